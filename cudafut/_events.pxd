# Augments _events.py when Cython compiles it (setup.py): EventRecord becomes
# an extension type, its fields C struct members, so making a record and
# reading its status cost no dictionary or descriptor lookups. The .py file
# stays the one source of its behaviour; the pure-Python core ignores this.

cdef class EventRecord:
    cdef public object confirm
    cdef public object device
    cdef public object failure
    cdef public object handle
    cdef public object seen
    cdef public object seq
    cdef public object status
    cdef public object stream
    cdef public object stream_key
    cdef public object t
