# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=False
"""cudafut's native core: event records, their streams' state and the event
pool as C-level types, and CUDA's event calls made from C.

The twin of ``_events.py`` (:class:`EventRecord`, :func:`record`,
:func:`is_newest`, :func:`first_error`) and of
``_pools.EventPool``: the same interface and behaviour, which one test suite
runs on both (``CUDAFUT_PURE=1`` selects the Python twin; so does a machine
where this extension was not built). What differs is the cost:

- A record's fields are C members (its status a C int), and a record is made
  from a free list, without ``__init__``.
- CUDA is called from C: ``cuEventRecord``, ``cuEventQuery`` and
  ``cuStreamWaitEvent`` are loaded from libcuda (``dlopen``, as
  ``_waker.c`` does), the GIL released around ``cuEventRecord`` and
  ``cuStreamWaitEvent`` (they may wait for room in a full queue) and kept
  for ``cuEventQuery``, which never waits. Any call the fast path cannot
  make, or that fails, is made again through ``_cuda``'s functions (CuPy's
  runtime), which set up the device's context or raise the
  :class:`~cudafut.CudaError` with the runtime's code and name.
- Per stream, records are numbered under a C mutex held across
  ``cuEventRecord``, so the numbers follow the stream's order; a record
  made through the runtime instead (no context in this thread yet, another
  device's default stream, the fake) is enqueued outside the mutex, so it
  vouches only for the records numbered before its enqueue began (its
  ``floor``). The highest floor seen complete (the watermark) answers for
  every record of that stream numbered up to it with a memory load instead
  of a driver call. It is used only on streams whose handle cannot be
  reused while their records live: the special handles (0, 1, 2; the
  per-thread stream per thread, never per thread ident, which is reused),
  the streams cudafut's own pools made (:func:`keep_stream`), and a stream
  whose object (a CuPy or PyTorch ``Stream``, which owns its handle) the
  caller names while it lives; on any other stream every record is queried.
- Records are not tracked by the cyclic garbage collector while they hold
  nothing that could refer back to them; one given a ``confirm`` or a
  failure (an exception, whose traceback can hold the future that holds the
  record) is tracked from then on. Stream states are never tracked.

Under :mod:`cudafut.testing`'s fake GPU the same types are used; their
calls go through the fake's record calls (``_cuda.RecordCalls``), and the
pool is the fake's.
"""

cimport cython
from cpython.object cimport PyObject
from cpython.weakref cimport PyWeakref_GetObject

from cudafut import _lifetimes


cdef extern from "Python.h":
    void PyObject_GC_Track(object op)
    void PyObject_GC_UnTrack(object op)
    int PyObject_GC_IsTracked(object op)
from libc.stdlib cimport free, realloc
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

import itertools
import sys
import threading
import weakref

from cudafut import _cuda


cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *filename, int flags)
    void *dlsym(void *handle, const char *symbol)
    int RTLD_NOW
    int RTLD_NOLOAD


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *mutex, void *attr)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)


ctypedef int (*cu_event_record_t)(void *event, void *stream) noexcept nogil
ctypedef int (*cu_event_query_t)(void *event) noexcept nogil
ctypedef int (*cu_stream_wait_event_t)(void *stream, void *event, unsigned int flags) noexcept nogil
ctypedef int (*cu_ctx_get_device_t)(int *device) noexcept nogil

cdef cu_event_record_t cu_event_record = NULL
cdef cu_event_query_t cu_event_query = NULL
cdef cu_stream_wait_event_t cu_stream_wait_event = NULL
cdef cu_ctx_get_device_t cu_ctx_get_device = NULL
# 0: not tried yet; 1: loaded; -1: libcuda or a symbol is missing (every call
# then goes through _cuda's functions).
cdef int _driver = 0

# What the native calls did, for tests and benchmarks (counts()): driver
# queries made, and queries the watermark answered instead. Plain C
# counters, changed under the GIL.
cdef unsigned long long _queried = 0
cdef unsigned long long _answered = 0


def counts():
    """``(driver queries, queries answered by a watermark)`` made by this
    process's records so far (the fake's included)."""
    return _queried, _answered


# Mutations of scripts/mutation-check (tests/_mutations.py): every query
# reports complete; every stream wait is skipped. Never set otherwise.
cdef bint _every_query_complete = False
cdef bint _no_stream_wait = False


def _mutate(str name):
    """Disable one synchronisation point of the native core, for
    scripts/mutation-check only: ``"query"`` or ``"stream_wait"``."""
    global _every_query_complete, _no_stream_wait
    if name == "query":
        _every_query_complete = True
    elif name == "stream_wait":
        _no_stream_wait = True
    else:
        raise ValueError(f"no native mutation {name!r}")


#: cudaErrorNotReady and CUDA_ERROR_NOT_READY.
cdef enum:
    NOT_READY = 600

#: The status of a record failed from the host (EventRecord.fail_with).
FAILED = -1
cdef int C_FAILED = -1

# How many handles the pool keeps free per device (beyond: destroyed), and
# the devices it serves (the ordinals a process can see are far fewer).
cdef enum:
    MAX_FREE = 4096
    MAX_DEVICES = 64


cdef int _load_driver() noexcept:
    global _driver, cu_event_record, cu_event_query, cu_stream_wait_event, cu_ctx_get_device
    cdef void *lib = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)
    if lib == NULL:
        lib = dlopen(b"libcuda.so.1", RTLD_NOW)
    if lib == NULL:
        _driver = -1
        return _driver
    cu_event_record = <cu_event_record_t>dlsym(lib, b"cuEventRecord")
    cu_event_query = <cu_event_query_t>dlsym(lib, b"cuEventQuery")
    cu_stream_wait_event = <cu_stream_wait_event_t>dlsym(lib, b"cuStreamWaitEvent")
    cu_ctx_get_device = <cu_ctx_get_device_t>dlsym(lib, b"cuCtxGetDevice")
    if (cu_event_record == NULL or cu_event_query == NULL or cu_stream_wait_event == NULL
            or cu_ctx_get_device == NULL):
        _driver = -1
    else:
        _driver = 1
    return _driver


cdef inline bint _driver_ready() noexcept:
    """Whether libcuda's entry points are loaded (loading them on first use)."""
    return _driver == 1 or (_driver == 0 and _load_driver() == 1)


cdef inline double _now() noexcept nogil:
    # time.perf_counter() is CLOCK_MONOTONIC on Linux: the waiter compares both.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# -- the backend ------------------------------------------------------------------

# The record calls of the backend installed (_cuda.RecordCalls): CUDA's, or
# those of cudafut.testing's fake; and CUDA's own, for the C fast path.
cdef object _CUDA_CALLS = _cuda.CUDA
cdef object _calls = _CUDA_CALLS
# The module whose ``events`` is the event pool in use, and the twin's
# is_newest() for records made outside record() (bind()).
cdef object _pools = None
cdef object _is_newest = None


def bind(pools, is_newest):
    """Read the event pool in use from ``pools.events`` (``_pools``, which
    swaps it for cudafut.testing's fake) at each :func:`record`; ask
    ``is_newest`` (the Python twin's) of records made by their constructor."""
    global _pools, _is_newest
    _pools = pools
    _is_newest = is_newest


# -- streams --------------------------------------------------------------------


@cython.no_gc
@cython.final
cdef class _Stream:
    """One stream's numbering and watermark, for the life of one stream
    object (a stream destroyed and its handle given to a new stream gets a
    new state: the old one's records keep theirs)."""

    cdef readonly object key
    cdef readonly long long device
    cdef long long newest  # the number of the newest record
    cdef long long done  # every record numbered up to this one is complete
    cdef bint ordered  # whether ``done`` may answer for older records
    # What keeps the handle this stream's: the stream object itself (a
    # pool's, kept for ever), a weak reference to it, or None (a special
    # handle, or a handle whose owner nobody named: never ordered).
    cdef object owner
    cdef bint weak
    cdef pthread_mutex_t lock

    def __cinit__(self, key, long long device):
        self.key = key
        self.device = device
        pthread_mutex_init(&self.lock, NULL)

    def __dealloc__(self):
        pthread_mutex_destroy(&self.lock)

    cdef inline bint owned(self):
        """Whether the stream object that owns the handle is alive (so the
        handle still names this stream)."""
        if not self.ordered:
            return False
        if self.weak:
            return PyWeakref_GetObject(self.owner) != <PyObject *>None
        return True


# Explicit streams by handle (unique across devices), and special handles by
# (device, handle) or, for the per-thread stream, (device, 2, thread).
cdef dict _by_handle = {}
cdef dict _by_key = {}


# Per thread: its per-thread streams' states, by device (a thread ident is
# reused once its thread ends; this goes with the thread), and the numbers
# that name them in stream keys.
_local = threading.local()
_thread_numbers = itertools.count(1)


cdef inline bint _owns_handle(object owner):
    """Whether ``owner`` owns its stream handle for its whole life (CuPy's
    and PyTorch's ``Stream``, the fake's streams), unlike a wrapper of a
    handle made elsewhere (``ExternalStream``, a ``__cuda_stream__`` view),
    which may outlive the stream it names."""
    return type(owner).__name__ in ("Stream", "FakeStream")


cdef _Stream _stream_of(long long stream, long long device, object owner):
    cdef _Stream state
    cdef object key
    cdef object mine
    cdef dict states
    if stream > 2:
        state = <_Stream>_by_handle.get(stream)
        if state is not None and state.device == device:
            if owner is None:
                if state.owned() or not state.ordered:
                    return state
            elif state.owned():
                mine = state.owner() if state.weak else state.owner
                if mine is owner or not state.weak:  # a pool's stream: the handle is its
                    return state
        # New, another device's, owned by a stream object that is gone, or
        # named by another object: a state of its own, ordered if the caller
        # names an object that owns the handle.
        key = (device, stream)
        state = _Stream(key, device)
        if owner is not None and _owns_handle(owner):
            try:
                state.owner = weakref.ref(owner)
            except TypeError:  # no weak reference to it: never ordered
                pass
            else:
                state.weak = True
                state.ordered = True
        _by_handle[stream] = state
        return state
    if stream == 2:  # cudaStreamPerThread: one stream per thread and device
        try:
            states = _local.states
        except AttributeError:
            states = _local.states = {}
            _local.number = next(_thread_numbers)
        state = <_Stream>states.get(device)
        if state is None:
            state = _Stream((device, stream, _local.number), device)
            state.ordered = True
            states[device] = state
        return state
    key = (device, stream)
    state = <_Stream>_by_key.get(key)
    if state is None:
        state = _Stream(key, device)
        state.ordered = True  # the legacy default stream is one stream for ever
        state = <_Stream>_by_key.setdefault(key, state)
    return state


def keep_stream(stream, long long device):
    """Mark ``stream`` (a CuPy stream object that cudafut's pools keep for
    the process's life) as one whose handle is never reused: its
    watermark answers for its older records. The stream is kept alive."""
    cdef long long ptr = <long long>stream.ptr
    cdef _Stream state = _stream_of(ptr, device, None)
    if state.ordered and not state.weak and state.owner is stream:
        return
    state = _Stream((device, ptr), device)
    state.owner = stream
    state.ordered = True
    _by_handle[ptr] = state


def _swap_streams(backend):
    global _by_handle, _by_key, _calls, _local
    saved = (_by_handle, _by_key, _calls, _local)
    _by_handle, _by_key, _calls, _local = {}, {}, backend, threading.local()

    def restore():
        global _by_handle, _by_key, _calls, _local
        _by_handle, _by_key, _calls, _local = saved

    return restore


_cuda.on_swap(_swap_streams)


def _after_fork():
    # The child has no CUDA (every call goes through _cuda, which says so),
    # and a parent's thread may have held a stream's mutex at the fork.
    global _driver, _by_handle, _by_key, _local
    _driver = -1
    _by_handle, _by_key, _local = {}, {}, threading.local()


_lifetimes.at_fork_in_child(_after_fork)


# -- records ---------------------------------------------------------------------


@cython.freelist(1024)
cdef class EventRecord:
    """A CUDA event recorded on a stream, and what is known of its status.

    ``status`` is ``None`` while the work may be pending, ``0`` once it is
    complete, or the CUDA error code the event reported. ``calls`` is the
    backend that made it (:class:`cudafut._cuda.RecordCalls`), which it
    asks for as long as it lives; ``pool``, the event pool its handle
    returns to when it is garbage (``None``: it owns no pooled event).
    """

    cdef public long long handle
    cdef public long long device
    cdef public long long stream
    cdef public object stream_key
    cdef public long long seq
    cdef int _status
    cdef bint _known
    cdef public double t
    cdef public double seen
    cdef object _failure
    cdef object _confirm
    cdef public object calls
    cdef public object pool
    cdef _Stream state  # None: made by __init__, outside record()
    # The highest number of its stream that this record's completion proves
    # complete: its own on the fast path; on the runtime's path, the newest
    # number before its enqueue began (records numbered later may have been
    # enqueued before it).
    cdef long long floor

    def __init__(self, long long handle, long long device, long long stream, stream_key, long long seq,
                 double t, calls=None, pool=None):
        self.handle = handle
        self.device = device
        self.stream = stream
        self.stream_key = stream_key
        self.seq = seq
        self.t = t
        self.calls = _CUDA_CALLS if calls is None else calls
        self.pool = pool

    @property
    def failure(self):
        """An error decided on the host for the work behind this record
        (see :meth:`fail_with`), or None."""
        return self._failure

    @failure.setter
    def failure(self, value):
        if value is not None:  # its traceback may hold this record
            self._track()
        self._failure = value

    @property
    def confirm(self):
        """Asked once the event completes: an error means the work did not
        succeed after all (an NCCL kernel that an abort ended early)."""
        return self._confirm

    @confirm.setter
    def confirm(self, value):
        if value is not None:  # it may refer back to this record
            self._track()
        self._confirm = value

    cdef inline void _track(self):
        """Let the collector see this record from now on (record() leaves it
        untracked while it holds nothing that could refer back to it)."""
        if not PyObject_GC_IsTracked(self):
            PyObject_GC_Track(self)

    @property
    def ordered(self):
        """Whether a newer record of the stream seen complete answers for
        this one without a query (the stream's watermark)."""
        return self.state is not None and self.state.ordered

    @property
    def status(self):
        """None while pending, 0 once complete, else the error code."""
        if self._known:
            return self._status
        return None

    @status.setter
    def status(self, value):
        if value is None:
            self._known = False
        else:
            self._status = value
            self._known = True

    cdef inline bint _answered(self) noexcept:
        """Whether the stream's watermark says this record is complete."""
        cdef _Stream state = self.state
        return state is not None and state.ordered and self.seq <= state.done

    cdef inline bint _fast(self) noexcept:
        return self.calls is _CUDA_CALLS and _driver_ready()

    def query(self):
        """Non-blocking: the status, asking CUDA only while it is unknown."""
        return self._query()

    cdef object _query(self):
        global _queried, _answered
        cdef int raw
        if self._known:
            return self._status
        if _every_query_complete:
            raw = 0
        elif self._answered():
            raw = 0  # a newer record of the stream is complete: so is this one
            _answered += 1
        elif self._fast():
            _queried += 1
            raw = cu_event_query(<void *>self.handle)
            if raw != 0 and raw != NOT_READY:  # an error, or no context here: the runtime says which
                raw = self.calls.event_query(self.handle)
        else:
            _queried += 1
            raw = self.calls.event_query(self.handle)
        if raw != NOT_READY and self._failure is None:
            return self.settle(raw)
        return self.status

    def known(self):
        """The status if it is known without asking CUDA (kept, or answered
        by the stream's watermark), else None: never a driver call."""
        if not self._known:
            if self._answered() and self._failure is None and self._confirm is None:
                # (a confirm runs in the polling thread, never here)
                self._status = 0
                self._known = True
                return 0
            return None
        return self._status

    def settle(self, int raw):
        """Take ``raw``, the event's final status (0 or an error code), once
        the event is no longer pending; a ``confirm`` that finds an error
        fails the record instead. Returns the status kept."""
        cdef _Stream state
        confirm = self._confirm
        if raw == 0 and confirm is not None:
            error = confirm()
            if error is not None:
                self.fail_with(error)
                return self.status
            if self._known:  # failed from the host meanwhile: that is final
                return self._status
        self._status = raw
        self._known = True
        if raw == 0:
            state = self.state
            if state is not None and self.floor > state.done:
                state.done = self.floor
        return raw

    def error(self):
        """The :class:`CudaError` this record reported, if any (or the
        error :meth:`fail_with` gave it)."""
        if self._known and self._status:
            return self._failure or self.calls.event_error(self._status, self.device)
        return None

    def fail_with(self, error):
        """Fail the work behind this record from the host (callable from any
        thread): every waiter sees ``error`` at its next poll, whatever the
        event reports later. For work that can never complete (a collective
        whose peer died), so that nobody waits on it for ever."""
        if not self._known:  # complete already: the work did finish
            self.failure = error  # tracked by the collector from now on
            self._status = C_FAILED
            self._known = True

    def wait_on(self, long long stream, long long device):
        """Make ``stream`` wait for this record, unless it is known complete."""
        cdef int rc
        cdef void *s = <void *>stream
        cdef void *e = <void *>self.handle
        if self._known or _no_stream_wait:
            return
        if stream > 2 and self._fast():
            with nogil:
                rc = cu_stream_wait_event(s, e, 0)
            if rc == 0:
                return
        self.calls.stream_wait(stream, self.handle, device)

    def ended(self):
        """Why this record's backend can no longer be used, or None (asked
        only when a call on its future failed for want of CUDA)."""
        return self.calls.ended()

    def __repr__(self):
        status = self.status
        state = {None: "pending", 0: "complete", FAILED: "failed"}.get(status, f"error {status}")
        return f"<EventRecord device={self.device} stream={self.stream:#x} seq={self.seq} {state}>"

    def __dealloc__(self):
        pool = self.pool
        if pool is not None:
            try:
                if type(pool) is EventPool:
                    (<EventPool>pool)._release(<int>self.device, self.handle)
                else:
                    pool.release(self.device, self.handle)
            except BaseException:  # a destructor must not raise (e.g. at shutdown)
                pass


def record(long long stream, long long device, confirm=None, owner=None):
    """Record a pooled event on ``stream`` of ``device`` (host: about half a
    µs with CUDA; blocks only while CUDA waits for room in the stream's
    queue, with the GIL released).

    ``confirm``, if given, is called (in the polling thread) when the event
    is first seen complete; an error it returns fails the record instead.
    ``owner``, if given, is the stream object whose handle ``stream`` is (a
    CuPy stream): while it lives, the handle names that stream, so the
    stream's watermark may answer for this record.
    """
    cdef object pool = _pools.events
    cdef long long handle
    cdef _Stream state = _stream_of(stream, device, owner)
    cdef EventRecord rec
    cdef int rc = -1
    cdef int current = -1
    cdef long long seq
    cdef long long floor
    cdef long long before
    cdef bint fast = _calls is _CUDA_CALLS and _driver_ready()
    cdef void *e
    cdef void *s = <void *>stream
    if type(pool) is EventPool:
        handle = (<EventPool>pool)._acquire(<int>device)
    else:
        handle = pool.acquire(device)
    e = <void *>handle
    if fast:
        with nogil:
            pthread_mutex_lock(&state.lock)
            if stream <= 2:  # the default stream of the *current* device: only if it is ``device``
                if cu_ctx_get_device(&current) != 0 or current != device:
                    current = -1
            if stream > 2 or current >= 0:
                rc = cu_event_record(e, s)
            if rc == 0:
                state.newest += 1
                seq = floor = state.newest
            pthread_mutex_unlock(&state.lock)
    if rc != 0:
        # The runtime's path: another device's default stream, no context in
        # this thread yet, an error to raise with its name, or the fake. Not
        # under the mutex (the runtime's call releases the GIL, and a
        # finalizer may record on this stream meanwhile): this record then
        # vouches only for those numbered before its enqueue began.
        with nogil:
            pthread_mutex_lock(&state.lock)
            before = state.newest
            pthread_mutex_unlock(&state.lock)
        try:
            _cuda.event_record(handle, stream, device)
        except BaseException:
            pool.release(device, handle)
            raise
        with nogil:
            pthread_mutex_lock(&state.lock)
            state.newest += 1
            seq = state.newest
            pthread_mutex_unlock(&state.lock)
        floor = before
    rec = EventRecord.__new__(EventRecord)
    rec.handle = handle
    rec.device = device
    rec.stream = stream
    rec.stream_key = state.key
    rec.seq = seq
    rec.t = _now()
    rec.calls = _calls
    rec.pool = pool
    rec.state = state
    rec.floor = floor
    if confirm is not None:
        rec._confirm = confirm  # may refer back to the record: the collector sees it
    else:
        PyObject_GC_UnTrack(rec)
    return rec


def is_newest(EventRecord rec not None):
    """Whether nothing was recorded on ``rec``'s stream after it (by cudafut)."""
    cdef _Stream state = rec.state
    if state is None:  # made by its constructor (a test's): the twin's numbers
        return _is_newest(rec)
    return state.newest == rec.seq


def first_error(records):
    cdef EventRecord rec
    for r in records:
        rec = <EventRecord?>r
        if rec._known and rec._status:
            return rec.error()
    return None


# -- the event pool --------------------------------------------------------------


@cython.final
cdef class EventPool:
    """Free event handles per device, in C arrays.

    Taking and giving back hold the GIL and call nothing that could release
    it, so they take no lock.
    """

    cdef long long *_free[MAX_DEVICES]
    cdef int _nfree[MAX_DEVICES]
    cdef int _cap[MAX_DEVICES]
    cdef long long _made[MAX_DEVICES]
    cdef long long _destroyed[MAX_DEVICES]
    cdef readonly long long created
    cdef bint _closed
    cdef int _max_free

    def __cinit__(self):
        # The twin's limit, read once (tests lower it before making a pool).
        self._max_free = MAX_FREE if _pools is None else _pools._MAX_FREE_EVENTS

    def __dealloc__(self):
        cdef int d
        for d in range(MAX_DEVICES):
            free(self._free[d])

    cdef long long _acquire(self, int device) except? -1:
        if 0 <= device < MAX_DEVICES and self._nfree[device] > 0:
            self._nfree[device] -= 1
            return self._free[device][self._nfree[device]]
        handle = int(_cuda.event_create(device))
        self.created += 1
        if 0 <= device < MAX_DEVICES:
            self._made[device] += 1
        return handle

    cdef int _release(self, int device, long long handle) except -1:
        cdef long long *grown
        cdef int cap
        if self._closed:
            return 0
        if 0 <= device < MAX_DEVICES and self._nfree[device] < self._max_free:
            if self._nfree[device] == self._cap[device]:
                cap = 64 if self._cap[device] == 0 else 2 * self._cap[device]
                grown = <long long *>realloc(self._free[device], cap * sizeof(long long))
                if grown == NULL:
                    raise MemoryError()
                self._free[device] = grown
                self._cap[device] = cap
            self._free[device][self._nfree[device]] = handle
            self._nfree[device] += 1
            return 0
        if not sys.is_finalizing():
            _cuda.event_destroy(handle)
            if 0 <= device < MAX_DEVICES:
                self._destroyed[device] += 1
        return 0

    def acquire(self, int device):
        """A free event of ``device``, or a new one (timing disabled)."""
        return self._acquire(device)

    def release(self, int device, long long handle):
        """Give ``handle`` back (destroyed beyond the free limit)."""
        self._release(device, handle)

    def close(self):
        """Take no handle back from now on (the pool of a backend that has
        ended: cudafut.testing's fake, whose records may outlive it)."""
        self._closed = True

    def counts(self):
        """Per device: (free handles, handles in use)."""
        cdef int d
        free_ = {}
        in_use = {}
        for d in range(MAX_DEVICES):
            if self._cap[d]:  # a handle came back once
                free_[d] = self._nfree[d]
            if self._made[d]:
                in_use[d] = self._made[d] - self._destroyed[d] - self._nfree[d]
        return free_, in_use
