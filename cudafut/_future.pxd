# Augments _future.py when Cython compiles it (setup.py): a future's fields
# become C struct members of its base class, so making a future and reading
# or writing its state cost no descriptor lookups. The .py file stays the
# one source of its behaviour; the pure-Python core ignores this.

cdef class _FutureState:
    cdef object __weakref__
    cdef public object _callbacks
    cdef public object _devices
    cdef public object _exception
    cdef public object _keep
    cdef public object _listeners
    cdef public object _lock
    cdef public object _records
    cdef public object _retrieved
    cdef public object _set_event
    cdef public object _state
    cdef public object _stream_given
    cdef public object _traceback
    cdef public object _value
