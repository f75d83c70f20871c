# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=False, auto_pickle=False
"""cudafut's native core: event records, their streams' state, the event
pool and the future's state as C-level types, and CUDA's event calls made
from C.

The twin of ``_events.py`` (:class:`EventRecord`, :func:`record`,
:func:`is_newest`, :func:`first_error`) and of
``_pools.EventPool``: the same interface and behaviour, which one test suite
runs on both (``CUDAFUT_PURE=1`` selects the Python twin; so does a machine
where this extension was not built). What differs is the cost:

- A record's fields are C members (its status a C int), and a record is made
  from a free list, without ``__init__``.
- CUDA is called from C: ``cuEventRecord``, ``cuEventQuery`` and
  ``cuStreamWaitEvent`` are loaded from libcuda (``dlopen``, as
  ``_waker.c`` does), with the GIL held: they return in under a µs,
  and a release on an event loop's thread would hand the GIL to threads
  running Python (a model's launcher threads), for up to a switch interval
  (``cuEventRecord`` and ``cuStreamWaitEvent`` block only while a stream's
  queue is full, as CuPy's calls would). Any call the fast path cannot
  make, or that fails, is made again through the backend's functions
  (``_backend.current``: CuPy's runtime), which set up the device's context or raise the
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
- The future's state is :class:`FutureCore`'s C members, CudaFuture's base
  class here (the pure core keeps the same names in CudaFuture's
  ``__slots__``), and ``await``, ``result()`` of done work, ``then()`` of a
  set future and the finalizer read them as struct fields. ``await`` is
  the type's slot, and the iterators it returns end in C (see
  :func:`_install_iternext`).

Under :mod:`cudafut.testing`'s fake GPU the same types are used; their
records keep the fake's backend and ask it (``event_query``, ``stream_wait``,
``event_error``, ``ended``), the calls this module makes go to the backend
object it keeps (the fake, while :func:`cudafut._backend.swap` has it
installed), and the pool is the fake's.
"""

cimport cython
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit

from cudafut import _lifetimes


cdef extern from "Python.h":
    # The two slots this module sets by hand (_install_iternext, install_await).
    ctypedef struct PyAsyncMethods:
        void *am_await
    ctypedef struct _AsyncSlot "PyTypeObject":
        PyAsyncMethods *tp_as_async
    ctypedef PyObject* (*iternextfunc)(PyObject*) except NULL
    ctypedef struct _IterSlot "PyTypeObject":
        iternextfunc tp_iternext
    void PyType_Modified(_IterSlot* type)
    void Py_INCREF(object op)
    void PyObject_GC_Track(object op)
    void PyObject_GC_UnTrack(object op)
    int PyObject_GC_IsTracked(object op)
    Py_ssize_t PY_SSIZE_T_MAX
from cpython.ref cimport Py_XDECREF
from libc.errno cimport errno
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport strerror
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

import itertools
from collections import deque as _deque
import sys
import threading
import types
import weakref

from cudafut import _backend, _checks, _runtime


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
    int pthread_mutex_trylock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)


ctypedef int (*cu_event_record_t)(void *event, void *stream) noexcept nogil
ctypedef int (*cu_event_query_t)(void *event) noexcept nogil
ctypedef int (*cu_stream_wait_event_t)(void *stream, void *event, unsigned int flags) noexcept nogil
ctypedef int (*cu_ctx_get_device_t)(int *device) noexcept nogil
ctypedef int (*cu_ctx_get_current_t)(void **ctx) noexcept nogil
ctypedef int (*cu_event_create_t)(void **event, unsigned int flags) noexcept nogil
ctypedef int (*cu_event_destroy_t)(void *event) noexcept nogil

cdef cu_event_record_t cu_event_record = NULL
cdef cu_event_query_t cu_event_query = NULL
cdef cu_stream_wait_event_t cu_stream_wait_event = NULL
cdef cu_ctx_get_device_t cu_ctx_get_device = NULL
cdef cu_ctx_get_current_t cu_ctx_get_current = NULL
# Optional (NULL: the pool creates and destroys through the backend).
cdef cu_event_create_t cu_event_create = NULL
cdef cu_event_destroy_t cu_event_destroy = NULL
cdef extern from *:
    """
    /* Ask the CPU to load an object's cache line and the `lines` after it,
       and the GC header just before it, ahead of use. A hint: it reads
       nothing and never faults (a non-GC object's "header" is just the
       bytes before it; NULL or None is harmless). Where the compiler has no
       such builtin, nothing. */
    static inline void cudafut_prefetch(PyObject *op, int lines) {
    #if defined(__GNUC__) || defined(__clang__)
        const char *p = (const char *)op;
        int i;
        __builtin_prefetch(p - 16);
        for (i = 0; i <= lines; i++) __builtin_prefetch(p + 64 * i);
    #else
        (void)op; (void)lines;
    #endif
    }
    /* The object a task's wake-up callable is bound to (the C Task's is a
       builtin function, a Python task's a bound method), or NULL: borrowed. */
    static inline PyObject *cudafut_bound_self(PyObject *fn) {
        if (PyCFunction_Check(fn)) return PyCFunction_GET_SELF(fn);
        if (PyMethod_Check(fn)) return PyMethod_GET_SELF(fn);
        return NULL;
    }
    """
    void cudafut_prefetch(PyObject *op, int lines) noexcept nogil
    PyObject *cudafut_type "(PyObject *)Py_TYPE"(PyObject *op) noexcept nogil
    PyObject *cudafut_bound_self(PyObject *fn) noexcept


cdef extern from *:
    """
    /* What a weak reference refers to, a new reference (None once it is
       gone). PyWeakref_GetObject's borrowed reference is deprecated from
       3.13, where PyWeakref_GetRef replaces it. */
    static PyObject *cudafut_weak_get(PyObject *ref) {
    #if PY_VERSION_HEX >= 0x030D0000
        PyObject *obj;
        if (PyWeakref_GetRef(ref, &obj) < 0) return NULL;
        if (obj == NULL) Py_RETURN_NONE;
        return obj;
    #else
        PyObject *obj = PyWeakref_GetObject(ref);
        Py_XINCREF(obj);
        return obj;
    #endif
    }
    """
    object _weak_get "cudafut_weak_get"(object ref)


cdef extern from *:
    """
    /* Whether the interpreter is finalizing: a C call where sys (a module
       global, None once modules are torn down) may be gone. */
    static int cudafut_finalizing(void) {
    #if PY_VERSION_HEX >= 0x030D0000
        return Py_IsFinalizing();
    #else
        return _Py_IsFinalizing();
    #endif
    }
    """
    bint _finalizing "cudafut_finalizing"() noexcept


cdef extern from *:
    """
    /* tp_new of CudaFuture (a subtype of FutureCore, bound at import),
       without FutureCore.__new__'s lookup, bound call, argument tuple and
       tp_new_wrapper checks: a future per then() link and per record. */
    static PyObject *cudafut_tp_new(PyObject *type, PyObject *args) {
        PyTypeObject *t = (PyTypeObject *)type;
        return t->tp_new(t, args, NULL);
    }
    /* stream.__exit__(None, None, None) as a method vectorcall: no bound method. */
    static PyObject *cudafut_call_exit(PyObject *stream, PyObject *name) {
        PyObject *args[4] = {stream, Py_None, Py_None, Py_None};
        return PyObject_VectorcallMethod(name, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    static int cudafut_code_flags(PyObject *fn) {
        return ((PyCodeObject *)PyFunction_GET_CODE(fn))->co_flags;
    }
    static PyObject *cudafut_func_dict(PyObject *fn) {
        PyObject *d = ((PyFunctionObject *)fn)->func_dict;
        if (d == NULL) Py_RETURN_NONE;
        Py_INCREF(d);
        return d;
    }
    """
    object cudafut_tp_new(object type, object args)
    object cudafut_call_exit(object stream, object name)
    int cudafut_code_flags(object fn) noexcept
    object cudafut_func_dict(object fn)


# 0: not tried yet; 1: loaded; -1: libcuda or a symbol is missing (every call
# then goes through the backend's functions).
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
cdef bint _await_at_once = False
cdef bint _then_record_early = False
cdef bint _then_no_keep = False


def _mutate(str name):
    """Disable one synchronisation point of the native core, for
    scripts/mutation-check only: ``"query"``, ``"stream_wait"``,
    ``"await_one"`` (an await among others ends at once),
    ``"settle_record"`` (then()'s child is recorded before ``fn`` runs) or
    ``"keep"`` (then()'s child keeps nothing alive)."""
    global _every_query_complete, _no_stream_wait, _await_at_once, _then_record_early, _then_no_keep
    if name == "query":
        _every_query_complete = True
    elif name == "stream_wait":
        _no_stream_wait = True
    elif name == "await_one":
        _await_at_once = True
    elif name == "settle_record":
        _then_record_early = True
    elif name == "keep":
        _then_no_keep = True
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
    MAX_FREE = 16384
    MAX_DEVICES = 64

#: CU_EVENT_DISABLE_TIMING, as the runtime's cudaEventDisableTiming.
cdef enum:
    CU_EVENT_DISABLE_TIMING = 2


cdef int _load_driver() noexcept:
    global _driver, cu_event_record, cu_event_query, cu_stream_wait_event, cu_ctx_get_device, cu_ctx_get_current
    global cu_event_create, cu_event_destroy
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
    cu_ctx_get_current = <cu_ctx_get_current_t>dlsym(lib, b"cuCtxGetCurrent")
    cu_event_create = <cu_event_create_t>dlsym(lib, b"cuEventCreate")
    cu_event_destroy = <cu_event_destroy_t>dlsym(lib, b"cuEventDestroy_v2")  # cuda.h's cuEventDestroy
    if (cu_event_record == NULL or cu_event_query == NULL or cu_stream_wait_event == NULL
            or cu_ctx_get_device == NULL or cu_ctx_get_current == NULL):
        _driver = -1
    else:
        _driver = 1
    return _driver


cdef inline bint _driver_ready() noexcept:
    """Whether libcuda's entry points are loaded (loading them on first use)."""
    return _driver == 1 or (_driver == 0 and _load_driver() == 1)


cdef inline int _ctx_device(int *device) noexcept nogil:
    """The device of this thread's current context (0), or nonzero if the
    thread has none yet. cuCtxGetDevice alone would fail then with
    CUDA_ERROR_INVALID_CONTEXT, which the callers take as "use the runtime"
    but compute-sanitizer reports as an API error; cuCtxGetCurrent answers
    NULL without an error, for about 20 ns more."""
    cdef void *ctx = NULL
    if cu_ctx_get_current(&ctx) != 0 or ctx == NULL:
        return -1
    return cu_ctx_get_device(device)


cdef inline double _now() noexcept nogil:
    # time.perf_counter() is CLOCK_MONOTONIC on Linux: the waiter compares both.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# -- the backend ------------------------------------------------------------------

# CUDA's backend (_cuda.CudaBackend, installed already: the modules that
# import this one, _events and _pools, import _cuda first), for the C fast
# path; and the backend in force (_backend.current, kept here by
# _swap_streams, the on_swap hook below): CUDA's or cudafut.testing's fake.
# Records keep the one that made them (their ``calls``); the runtime's path
# of record(), the pool's misses and record(x) of one CuPy array call it.
cdef object _CoroutineType = types.CoroutineType
cdef object _CUDA_BE = _backend.cuda()
cdef object _be = _CUDA_BE
# Whether this is a child forked after CUDA was initialised (_runtime.forked,
# copied by _after_fork below, which runs after _runtime's own reset): a C
# flag the futures' paths test on every call.
cdef bint _forked = _runtime.forked
# The module whose ``events`` is the event pool in use, and the twin's
# is_newest() for records made outside record() (bind()).
cdef object _pools = None
# The futures' fast path (record_value): stream types whose ``ptr`` and ``device_id`` are their handle and device
# (CuPy's, found once CuPy is imported; the fake's, while it runs), and the
# array type a lone value of needs no ordering walk (cupy.ndarray).
cdef tuple _stream_types = None
cdef bint _cupy_found = False  # _stream_types has CuPy's: look again once CuPy is imported
cdef object _lone_array = None
cdef tuple _backend_streams = ()
cdef object _cupy_current_stream = None  # cupy.cuda.get_current_stream
cdef object _is_newest = None


def bind(pools, is_newest):
    """Read the event pool in use from ``pools.events`` (``_pools``, which
    swaps it for cudafut.testing's fake) at each :func:`record`; ask
    ``is_newest`` (the Python twin's) of records made by their constructor."""
    global _pools, _is_newest
    _pools = pools
    _is_newest = is_newest


# -- streams --------------------------------------------------------------------


# One dropped future kept by its stream (_defer): its record, its value and
# its keep, strong references the collector does not see (the stream's state
# is not tracked); seq is the record's number, which orders the list.
ctypedef struct _Held:
    PyObject *rec
    PyObject *value
    PyObject *keep
    long long seq

# A stream's dropped futures are reclaimed by a record on it once this many
# more wait (and by the watcher thread: see _defer).
cdef enum:
    RECLAIM_EVERY = 64
    PROBE_GAP_MAX = 64


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
    # Dropped futures whose records were pending, by number (see _defer):
    # the records and what they keep alive, reclaimed in batch.
    cdef _Held *held
    cdef Py_ssize_t nheld
    cdef Py_ssize_t capheld
    cdef Py_ssize_t reclaim_at  # a record on this stream reclaims once nheld reaches it
    cdef bint armed  # the watcher thread holds a _Sweeper of this stream
    cdef bint unsorted  # a drop came after a newer one's: sorted before the next read
    # The newest record made here, borrowed, while it is not tracked by the
    # collector (its __dealloc__ or _track clears it): an await of an older
    # one asks it first (EventRecord._probe), so that one query answers
    # every older record from the watermark. Holding it would keep its
    # event out of the pool and make a cycle the collector cannot see (this
    # class is not tracked).
    cdef PyObject *last
    # After a probe found the newest pending: no probe until the stream's
    # newest number reaches probe_at (the gap doubles, up to PROBE_GAP_MAX,
    # and a probe that answers resets it), so a stream whose newest work is
    # always pending (a pipeline) pays an extra query rarely.
    cdef long long probe_at
    cdef long long probe_gap
    # then()'s memo of StreamPool.lookup(handle, priority) for this stream:
    # a pool's streams live as long as the pool (keyed by its identity), so
    # the answer for this handle never changes.
    cdef object memo_pool
    cdef object memo_stream
    cdef object memo_prio

    def __cinit__(self, key, long long device):
        self.key = key
        self.device = device
        self.reclaim_at = RECLAIM_EVERY
        pthread_mutex_init(&self.lock, NULL)

    def __dealloc__(self):
        # Never with entries in practice: each holds a record that holds
        # this state. Defensive: what is held goes.
        _release_held(self.held, self.nheld)
        free(self.held)
        pthread_mutex_destroy(&self.lock)

    cdef inline bint owned(self):
        """Whether the stream object that owns the handle is alive (so the
        handle still names this stream)."""
        if not self.ordered:
            return False
        if self.weak:
            return _weak_get(self.owner) is not None
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
    global _by_handle, _by_key, _be, _local, _backend_streams, _stream_types
    saved = (_by_handle, _by_key, _be, _local, _backend_streams)
    _by_handle, _by_key, _be, _local = {}, {}, backend, threading.local()
    _backend_streams = tuple(getattr(backend, "stream_types", ()))
    _stream_types = None  # found again at the next record

    def restore():
        global _by_handle, _by_key, _be, _local, _backend_streams, _stream_types
        _by_handle, _by_key, _be, _local, _backend_streams = saved
        _stream_types = None

    return restore


_backend.on_swap(_swap_streams)


def _after_fork():
    # The child has no CUDA (every call goes through the backend, which says
    # so), and a parent's thread may have held a stream's mutex at the fork.
    global _driver, _by_handle, _by_key, _local, _forked
    _driver = -1
    _forked = _runtime.forked
    _by_handle, _by_key, _local = {}, {}, threading.local()


_lifetimes.at_fork_in_child(_after_fork)


# -- records ---------------------------------------------------------------------


@cython.freelist(1024)
cdef class EventRecord:
    """A CUDA event recorded on a stream, and what is known of its status.

    ``status`` is ``None`` while the work may be pending, ``0`` once it is
    complete, or the CUDA error code the event reported. ``calls`` is the
    backend that made it (:class:`cudafut._backend.Backend`: CUDA's, the
    default, or cudafut.testing's fake), which it
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
        self.calls = _CUDA_BE if calls is None else calls
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
        untracked while it holds nothing that could refer back to it). It is
        no longer its stream's ``last``: the collector's clear of a cycle
        drops ``state`` before ``__dealloc__`` runs, which then could not
        clear that borrowed pointer."""
        cdef _Stream state = self.state
        if state is not None and state.last == <PyObject *>self:
            state.last = NULL
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

    cdef inline bint _known_now(self) noexcept:
        """Whether the status is known without asking CUDA: kept, or answered
        by the stream's watermark (then kept as 0), never where a ``confirm``
        must run first (in the polling thread) or the host failed it."""
        if self._known:
            return True
        if self._answered() and self._failure is None and self._confirm is None:
            self._status = 0
            self._known = True
            return True
        return False

    cdef inline bint _fast(self) noexcept:
        return self.calls is _CUDA_BE and _driver_ready()

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
            return self._settle(raw)  # (from C: a poll settles every record it fires)
        if self._known:  # the status property, read without its lookup
            return self._status
        return None

    cdef object _probe(self):
        """:meth:`_query` for an await or ``result()`` of this record: where
        a newer record of its stream is alive, that one is asked first, and
        if it is complete the watermark answers for this one and every
        record between (a service awaiting futures recorded before a
        ``synchronize()`` makes one query, not one each). A newer record
        found pending costs this call a second query; the stream then asks
        no newer record again until 1, 2, 4, ... up to 64 more are made."""
        global _queried
        cdef _Stream state = self.state
        cdef EventRecord last
        cdef int raw
        if (
            self._known or state is None or not state.ordered or state.last == NULL
            or state.newest < state.probe_at or _every_query_complete
        ):
            return self._query()
        last = <EventRecord>state.last
        if (
            last is self or last.floor < self.seq or last._known or last._confirm is not None
            or last._failure is not None or self._answered()
        ):
            return self._query()
        _queried += 1
        if last._fast():
            raw = cu_event_query(<void *>last.handle)
            if raw != 0 and raw != NOT_READY:  # an error: this record's own query reports it
                raw = NOT_READY
        else:
            raw = last.calls.event_query(last.handle)
        if raw == 0:
            state.probe_gap = 0
            state.probe_at = 0
            last._settle(0)  # the watermark reaches last.floor >= self.seq: _query answers
        else:
            state.probe_gap = PROBE_GAP_MAX if state.probe_gap * 2 > PROBE_GAP_MAX else max(1, state.probe_gap * 2)
            state.probe_at = last.seq + state.probe_gap
        return self._query()

    def probe(self):
        """The status as an await asks it (:meth:`_probe`): a newer record
        of the stream may be queried first."""
        return self._probe()

    def known(self):
        """The status if it is known without asking CUDA (kept, or answered
        by the stream's watermark), else None: never a driver call."""
        if self._known_now():
            return self._status
        return None

    def settle(self, int raw):
        """Take ``raw``, the event's final status (0 or an error code), once
        the event is no longer pending; a ``confirm`` that finds an error
        fails the record instead. Returns the status kept."""
        return self._settle(raw)

    cdef object _settle(self, int raw):
        cdef _Stream state
        if self._known:  # failed from the host, or settled by another thread: final
            return self._status
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
        self._wait_on(stream, device)

    cdef int _wait_on(self, long long stream, long long device) except -1:
        cdef int rc
        cdef void *s = <void *>stream
        cdef void *e = <void *>self.handle
        if self._known or _no_stream_wait:
            return 0
        if stream > 2 and self._fast():
            rc = cu_stream_wait_event(s, e, 0)  # GIL held, as cuEventRecord (see record())
            if rc == 0:
                return 0
        self.calls.stream_wait(stream, self.handle, device)
        return 0

    def ended(self):
        """Why this record's backend can no longer be used, or None (asked
        only when a call on its future failed for want of CUDA)."""
        return self.calls.ended()

    def __repr__(self):
        status = self.status
        state = {None: "pending", 0: "complete", FAILED: "failed"}.get(status, f"error {status}")
        return f"<EventRecord device={self.device} stream={self.stream:#x} seq={self.seq} {state}>"

    def __dealloc__(self):
        cdef _Stream state = self.state
        if state is not None and state.last == <PyObject *>self:
            state.last = NULL
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
    µs with CUDA; blocks, with the GIL held, only while CUDA waits for room
    in the stream's queue or another thread records on the same stream).

    ``confirm``, if given, is called (in the polling thread) when the event
    is first seen complete; an error it returns fails the record instead.
    ``owner``, if given, is the stream object whose handle ``stream`` is (a
    CuPy stream): while it lives, the handle names that stream, so the
    stream's watermark may answer for this record.
    """
    return _record(stream, device, confirm, owner)


cdef EventRecord _record(long long stream, long long device, object confirm, object owner):
    """:func:`record`, called from C by the futures' paths."""
    return _record_on(_stream_of(stream, device, owner), stream, device, confirm)


cdef EventRecord _record_on(_Stream state, long long stream, long long device, object confirm):
    cdef object pool = _pools.events
    cdef long long handle
    cdef EventRecord rec
    cdef int rc = -1
    cdef int current = -1
    cdef long long seq
    cdef long long floor
    cdef long long before
    cdef object backend = _be
    cdef bint fast = backend is _CUDA_BE and _driver_ready()
    cdef void *e
    cdef void *s = <void *>stream
    if state.nheld >= state.reclaim_at:
        _reclaim(state)  # futures dropped on this stream: their events back to the pool first
    if type(pool) is EventPool:
        handle = (<EventPool>pool)._acquire(<int>device)
    else:
        handle = pool.acquire(device)
    e = <void *>handle
    if fast:
        # With the GIL held: a release on an event loop's thread hands the
        # GIL to threads running Python (a model's launcher threads), and
        # the loop then waits up to a switch interval to get it back.
        # cuEventRecord returns in well under a µs unless the stream's queue
        # is full (about a thousand operations pending), when it blocks
        # until room frees, as CUDA's own calls do. Only a contended mutex
        # (another thread recording on this stream) is waited for without it.
        if pthread_mutex_trylock(&state.lock) != 0:
            with nogil:
                pthread_mutex_lock(&state.lock)
        if stream <= 2:  # the default stream of the *current* device: only if it is ``device``
            if _ctx_device(&current) != 0 or current != device:
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
            backend.event_record(handle, stream, device)
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
    rec.calls = backend
    rec.pool = pool
    rec.state = state
    rec.floor = floor
    if confirm is not None:
        rec._confirm = confirm  # may refer back to the record: the collector sees it
    else:
        PyObject_GC_UnTrack(rec)
        if state.ordered:
            # Borrowed (see _Stream.last): only while untracked, so that no
            # collector's clear runs before its __dealloc__ (see _track).
            state.last = <PyObject *>rec
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
        cdef void *event = NULL
        cdef int current = -1
        cdef long long handle
        if 0 <= device < MAX_DEVICES and self._nfree[device] > 0:
            self._nfree[device] -= 1
            return self._free[device][self._nfree[device]]
        # A miss (a burst of pending records beyond the free list): from C
        # where ``device``'s context is current (the runtime's handles are
        # the driver's; the runtime would use that same context), without
        # the Python calls of the backend's path. With the GIL held, as in
        # _record: the call returns in about a µs. Else, or if it fails, the
        # backend (which raises CudaError with the runtime's name).
        if (_be is _CUDA_BE and _driver_ready() and cu_event_create != NULL
                and _ctx_device(&current) == 0 and current == device
                and cu_event_create(&event, CU_EVENT_DISABLE_TIMING) == 0):
            handle = <long long>event
        else:
            handle = int(_be.event_create(device))
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
        if not _ending():
            # From C as _acquire creates (no context needed; never in a
            # forked child, where _driver is -1). A failure goes to the
            # backend, whose call raises CudaError with the runtime's name.
            if not (_be is _CUDA_BE and _driver == 1 and cu_event_destroy != NULL
                    and cu_event_destroy(<void *>handle) == 0):
                _be.event_destroy(handle)
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


# -- futures: the hot paths of _future.CudaFuture -----------------------------------
#
# The future's state is C members of FutureCore, CudaFuture's base where this
# core runs (its methods and documentation stay Python, in _future.py); these
# are the native twins of the paths every future takes: record(value,
# stream=s), an await (done, or pending in an asyncio task among other
# waits), result() of done work, then() of a set future and the finalizer.
# _future.py installs them where this core runs; each falls back on the
# Python twin for what it does not handle itself.

cdef class FutureCore:
    """CudaFuture's state as C members: the base class of
    :class:`cudafut.CudaFuture` where the native core runs (the pure core's
    CudaFuture keeps the same names in ``__slots__``). Python code reads and
    sets them as attributes; the native paths below read them as C fields,
    without a lookup. ``__await__`` is the type's own slot, so ``await fut``
    calls it without a Python-level lookup, and ``__del__`` its finalizer.
    A member not set yet reads None (``_state`` None: ``__init__`` never
    ran); ``_lock`` is made on first use."""

    cdef object _lazy_lock  # _lock, made on first use
    cdef public object _state
    cdef public object _devices
    cdef public object _value
    cdef public object _exception
    cdef public object _traceback
    cdef public tuple _records
    cdef public object _keep
    cdef public object _listeners
    cdef public object _set_event
    cdef public object _callbacks
    cdef public bint _retrieved
    cdef public bint _stream_given
    cdef object __weakref__

    @property
    def _lock(self):
        """The future's lock, made on first use: a future that record()
        made and an await consumed never takes it (a lock fewer to make and
        free per await). Made under the GIL, checked again after the
        allocation, so racing threads get the same lock."""
        lock = self._lazy_lock
        if lock is None:
            lock = _allocate_lock()
            if self._lazy_lock is None:
                self._lazy_lock = lock
            else:
                lock = self._lazy_lock
        return lock

    @_lock.setter
    def _lock(self, value):
        self._lazy_lock = value

    def __await__(self):
        """``await fut``: resolve when the GPU work is done; never blocks the loop.

        The native core's ``__await__`` (a type slot: ``await`` calls it
        from C). Its whole documentation is :meth:`cudafut.CudaFuture.__await__`'s,
        in docs/api.md and cudafut/_future.py, the pure core's twin."""
        return _future_await(self)

    def __del__(self):
        """The finalizer: keeps the value of work still pending until it
        completes (as the pure core's ``CudaFuture.__del__``); a future whose
        records are known complete costs no CUDA call."""
        _future_del(self)


def install_await(type cls not None):
    """Give ``cls`` (CudaFuture: a subclass of FutureCore with no
    ``__await__`` of its own) FutureCore's ``am_await`` slot itself, so that
    ``await fut`` calls it from C. CPython gives a Python subclass its
    generic slot instead, which looks ``__await__`` up and calls it: Cython
    lists the method in the type's dict as a plain method, not as a slot's
    wrapper. A later subclass of ``cls`` gets the generic slot again (the
    same behaviour, a few ns slower)."""
    owner = None
    if issubclass(cls, FutureCore):
        for k in cls.__mro__:  # where cls's __await__ comes from
            if "__await__" in k.__dict__:
                owner = k
                break
    if owner is not FutureCore:
        raise TypeError(f"{cls!r} is not a subclass of FutureCore whose __await__ is FutureCore's")
    (<_AsyncSlot*>cls).tp_as_async.am_await = (<_AsyncSlot*>FutureCore).tp_as_async.am_await
    PyType_Modified(<_IterSlot*>cls)


cdef object _Future = None  # CudaFuture
cdef object _PENDING = None
cdef object _SET = None
cdef object _FAILED = None
cdef object _CANCELLED = None
cdef object _hooks = None  # _trace.hooks: tracing on while .active is not None
# hooks.active is not None, kept by hooks.set_active (_set_tracing): the hot
# paths test a C flag instead of looking up a module attribute.
cdef bint _tracing = False


def _set_tracing(bint on):
    global _tracing
    _tracing = on
cdef object _await_py = None  # CudaFuture._await (the general await)
cdef object _result_py = None  # the Python twin's CudaFuture.result
cdef object _finalize_py = None  # the Python twin's CudaFuture.__del__
cdef object _kept_by_producer = None  # _future.KEPT_BY_PRODUCER: a finalizer has nothing to keep
cdef object _consumers_py = None  # _engine.record_current_consumers
cdef tuple _scalars = ()  # _values.SCALARS: values that hold no GPU array
cdef object _order_foreign = None  # _values.order_foreign
cdef object _current_driver = None  # _loops.current_driver
cdef object _mapped_pages = None  # _streams' pages known mapped (check_stream_address)
cdef object _block_type = None  # _memory's block of the allocator wrapper
cdef long long _page_size = 4096
cdef object _allocate_lock = None
cdef object _get_running_loop = None
# then(): the Python twin (CudaFuture.then), its helpers for what the native
# path hands back (a step that raised, a returned future), _engine's
# record_consumers, _values.find_devices, _pools' priorities by name.
cdef object _then_py = None
cdef object _then_failed = None
cdef object _then_follows = None
cdef object _record_consumers = None
cdef object _find_devices = None
cdef dict _priorities = None
# CuPy's runtime getDevice/setDevice (found with its stream types).
cdef object _get_device = None
cdef object _set_device = None
# Code flags of functions whose call makes a coroutine or an async generator.
cdef int _ASYNC_FLAGS = 0x80 | 0x100 | 0x200
# The CancelledError of an await on asyncio, asyncio's InvalidStateError.
cdef object _AsyncioCancelled = None
cdef object _AsyncioInvalidState = None


def bind_future(future, states, hooks, await_py, result_py, finalize_py, consumers_py,
                order_foreign, current_driver, mapped_pages, long long page_size, block_type,
                tuple scalars, kept_by_producer, dict readers):
    """Give the futures' native paths what they use of the Python modules
    (called once, by ``_future`` at import)."""
    global _Future, _PENDING, _SET, _FAILED, _CANCELLED, _hooks, _await_py, _result_py, _finalize_py
    global _consumers_py, _order_foreign, _current_driver, _mapped_pages, _page_size
    global _allocate_lock, _get_running_loop, _AsyncioCancelled, _AsyncioInvalidState, _block_type
    global _scalars, _kept_by_producer, _readers_map
    _kept_by_producer = kept_by_producer
    _readers_map = readers
    _block_type = block_type
    _scalars = scalars
    import _thread
    import asyncio
    _Future = future
    _PENDING, _SET, _FAILED, _CANCELLED = states
    _hooks = hooks
    hooks.on_change(_set_tracing)
    _await_py = await_py
    _result_py = result_py
    _finalize_py = finalize_py
    _consumers_py = consumers_py
    _order_foreign = order_foreign
    _current_driver = current_driver
    _mapped_pages = mapped_pages
    _page_size = page_size
    _allocate_lock = _thread.allocate_lock
    _get_running_loop = asyncio._get_running_loop
    _AsyncioCancelled = asyncio.CancelledError
    _AsyncioInvalidState = asyncio.InvalidStateError



# sys.modules, read on every record() and then() (whether CuPy and PyTorch
# are imported) without looking up the attribute.
cdef dict _modules = sys.modules
# The sys module itself, held from C: the interpreter's last collection may
# find this module's globals cleared, and a finalizer that looked ``sys`` up
# there raised (printed at exit as "Error in sys.excepthook").
cdef object _sys = sys


cdef object _is_finalizing_builtin = sys.is_finalizing


cdef inline bint _ending() except -1:
    """Whether the interpreter ends: CPython's own flag, then
    ``sys.is_finalizing()`` (which tests replace to pretend it)."""
    if _finalizing():
        return True
    f = _sys.is_finalizing
    return f is not _is_finalizing_builtin and f()


cdef bint _find_types() except -1:
    global _stream_types, _lone_array, _cupy_current_stream, _get_device, _set_device
    global _cupy_found
    cupy = sys.modules.get("cupy")
    cuda = getattr(cupy, "cuda", None)
    found = list(_backend_streams)
    _cupy_found = cuda is not None
    if cuda is not None:
        for name in ("Stream", "ExternalStream"):
            t = getattr(cuda, name, None)
            if isinstance(t, type):
                found.append(t)
        ndarray = getattr(cupy, "ndarray", None)
        _lone_array = ndarray if isinstance(ndarray, type) else None
        _cupy_current_stream = getattr(cuda, "get_current_stream", None)
        runtime = getattr(cuda, "runtime", None)
        _get_device = getattr(runtime, "getDevice", None)
        _set_device = getattr(runtime, "setDevice", None)
    _stream_types = tuple(found)
    return True


cdef inline int _ensure_types() except -1:
    """_find_types() where not done yet, or done before CuPy was imported."""
    if _stream_types is None or (not _cupy_found and "cupy" in _modules):
        _find_types()
    return 0


cdef object _current_stream(long long device):
    """The calling thread's current stream of ``device``: CuPy's own getter
    under CUDA's backend (the backend's current_stream() would only add
    Python frames around it), else the backend's (the fake's)."""
    if _be is _CUDA_BE and _cupy_current_stream is not None:
        return _cupy_current_stream(device)
    return _be.current_stream(device)


def new_pending():
    """A pending :class:`cudafut.CudaFuture`, as ``CudaFuture()`` makes it,
    without its Python ``__init__``: FutureCore's members start as None
    (False for the flags), and only those ``__init__`` sets otherwise are
    set here (``_future.new_future``'s untraced case, and ``launch()``'s)."""
    if _Future is None:
        raise RuntimeError("the native futures are not bound yet (import cudafut)")
    cdef FutureCore fut = <FutureCore>cudafut_tp_new(_Future, ())
    fut._state = _PENDING
    fut._records = ()
    if _tracing:  # a trace began meanwhile: as __init__, it sees the future
        _hooks.created(fut)
    return fut


cdef object _torch_module = None  # cudafut._torch, found on first use (its loaded() is swapped under the fake)


cdef object _torch_loaded():
    """``_torch.loaded()`` (torch where it is imported and can use CUDA,
    else None); cudafut._torch is imported on first use."""
    global _torch_module
    if "torch" not in _modules:
        return None
    if _torch_module is None:
        from cudafut import _torch
        _torch_module = _torch
    return _torch_module.loaded()


def caller_streams(long long device):
    """``_launch._caller_streams_py``'s twin: the calling thread's current
    streams of ``device`` as ``((handle, owner, stream), ...)``: CuPy's (or
    the fake's), and PyTorch's where torch is loaded and its current stream
    is another. Holds the GIL throughout (no CUDA call)."""
    _ensure_types()
    stream = _current_stream(device)
    ptr = int(stream.ptr)
    torch = _torch_loaded()
    if torch is not None:
        other = torch.cuda.current_stream(device)
        handle = int(other.cuda_stream)
        if handle != ptr:
            return ((ptr, stream, stream), (handle, None, other))
    return ((ptr, stream, stream),)


# The handles and device ordinals record_value() reads into C integers.
cdef object _HANDLE_LIMIT = 1 << 63
cdef object _DEVICE_LIMIT = 1 << 31


@cython.final
@cython.no_gc
cdef class _Consumer:
    """``consumer(device)`` for order_foreign: the one stream recorded on.
    With ``others_current`` (then()'s), arrays on other devices go before
    those devices' current streams, as _values.current_consumer orders them."""
    cdef tuple handle
    cdef bint others_current

    def __call__(self, device):
        if self.others_current and device != self.handle[1]:
            return (int(_current_stream(device).ptr), device)
        return self.handle


cdef object _record_twin = None  # _producers.record: the Python twin


def bind_record(record_twin):
    """Give record()'s native entry the Python twin it falls back on (called
    once, by ``_producers`` at import)."""
    global _record_twin
    _record_twin = record_twin


def future_record(value, *, stream=None, keep=None):
    """cudafut.record, native (its documentation is the twin's)."""
    fut = _record_value(value, stream, keep)
    if fut is None:
        return _record_twin(value, stream=stream, keep=keep)
    return fut


def record_value(value, stream, keep):
    """``record(value, stream=stream, keep=keep)``: a set future for work
    already enqueued on ``stream``, or None where the Python twin must make
    it (no stream given, a stream type it does not know, a handle not seen
    mapped yet, tracing on, a forked child)."""
    return _record_value(value, stream, keep)


cdef object _record_value(object value, object stream, object keep):
    cdef long long ptr
    cdef long long device
    cdef long long page
    cdef _Consumer consumer
    if _forked or _tracing:
        return None
    _ensure_types()
    if stream is None:
        # One CuPy array, recorded on its device's current stream: with
        # PyTorch imported too (the twin records torch's current streams for
        # torch tensors only, and a CuPy array is none).
        if _lone_array is None or type(value) is not _lone_array:
            return None
        device = value.data.device_id
        stream = _current_stream(device)
        return _set_future(value, _record(stream.ptr, device, None, stream), keep)
    if type(stream) not in _stream_types:
        return None
    handle = stream.ptr
    index = stream.device_id
    # Anything but two ints in range: the twin checks and explains.
    if type(handle) is not int or type(index) is not int:
        return None
    if not (0 <= handle < _HANDLE_LIMIT and 0 <= index < _DEVICE_LIMIT):
        return None
    ptr = handle
    device = index
    if ptr > 2:
        page = ptr - ptr % _page_size
        if page not in _mapped_pages:  # the twin checks it (mincore) and remembers
            return None
    if type(value) is not _lone_array or _lone_array is None:
        consumer = _Consumer.__new__(_Consumer)
        consumer.handle = (ptr, device)
        _order_foreign(value, consumer)  # docs/design.md, hazard 9
    return _set_future(value, _record(ptr, device, None, stream), keep)


def bind_then(then_py, then_failed, then_follows, record_consumers, find_devices, priorities):
    """Give then()'s native path what it uses of the Python modules (called
    once, by ``_future`` at import)."""
    global _then_py, _then_failed, _then_follows, _record_consumers, _find_devices, _priorities
    _then_py = then_py
    _then_failed = then_failed
    _then_follows = then_follows
    _record_consumers = record_consumers
    _find_devices = find_devices
    _priorities = dict(priorities)


cdef inline bint _plain_function(object fn):
    """A Python function whose call makes neither a coroutine nor an async
    generator (what _checks.not_async passes, said without a call); other
    callables go through the twin's checks."""
    if type(fn) is not _FunctionType:
        return False
    if cudafut_code_flags(fn) & _ASYNC_FLAGS:
        return False
    # inspect.markcoroutinefunction() marks a plain function as async.
    d = cudafut_func_dict(fn)
    if d is None:
        return True
    return (<dict>d).get("_is_coroutine_marker") is None


cdef object _FunctionType = types.FunctionType


cdef EventRecord _record_current(long long device):
    """_events.record_current: a record on the calling thread's current stream."""
    stream = _current_stream(device)
    return _record(stream.ptr, device, None, stream)


def current_device():
    """The calling thread's current device (``_events.current_device``'s
    twin): ``cuCtxGetCurrent`` and ``cuCtxGetDevice`` from C under CUDA's
    backend, no Python call; the backend's ``current_device()`` where that
    cannot answer (no context current in this thread yet, the fake). Blocks
    nothing."""
    cdef int device = -1
    if _be is _CUDA_BE and _driver_ready() and _ctx_device(&device) == 0:
        return device
    return _be.current_device()


def follow_current(long long stream, long long device):
    """Make ``stream`` of ``device`` wait for the calling thread's current
    stream of ``device`` (``_events.follow_current``'s twin): a record on the
    current stream and a ``cuStreamWaitEvent``, from C under CUDA's backend
    (no Python call but CuPy's current-stream getter; blocks, with the GIL
    held, only as :func:`record` does).
    Nothing when the current stream is ``stream`` itself (in order already)."""
    cdef EventRecord rec
    _ensure_types()
    caller = _current_stream(device)
    cdef long long ptr = caller.ptr
    if ptr != stream:
        rec = _record(ptr, device, None, caller)
        rec._wait_on(stream, device)


cdef object _set_future_py = None  # the twin: _interface.set_future


def bind_set_future(set_future_py):
    """The Python twin of :func:`set_future`, for what it does not handle."""
    global _set_future_py
    _set_future_py = set_future_py


def set_future(value, tuple records, keep=None, maker=None):
    """``_interface.set_future``'s twin: a future set with ``value`` and
    ``records`` already recorded, made without ``CudaFuture.__init__`` (a
    lock allocated, no other call). The twin makes it where a trace is on
    or a maker is named (the tracer sees it made)."""
    cdef FutureCore fut
    if maker is not None or _hooks is None or _tracing:
        return _set_future_py(value, records, keep, maker)
    fut = <FutureCore>cudafut_tp_new(_Future, ())
    fut._value = value
    fut._records = records
    fut._keep = keep
    fut._state = _SET
    return fut


def future_then(FutureCore self not None, fn, *, priority="normal"):
    """CudaFuture.then, native for a set future of one record whose work has
    not failed and a plain function (its documentation is the twin's): the
    pool stream, ``fn`` run on it at once (with PyTorch loaded, through
    ``_torch.call_on_torch_streams``, which makes it torch's current stream too),
    the child recorded there and set. The twin does the rest, and builds
    the child where a step raised or ``fn`` returned a future."""
    cdef EventRecord rec
    cdef EventRecord done
    cdef _Stream state
    cdef long long device
    cdef long long ptr
    cdef long long prev
    cdef FutureCore fut = self
    cdef FutureCore child
    if (fut._state is not _SET or _forked or _tracing
            or type(priority) is not str or not _plain_function(fn)):
        return _then_py(fut, fn, priority=priority)
    cdef tuple records = fut._records
    prio = _priorities.get(priority)
    if prio is None or len(records) != 1 or type(records[0]) is not EventRecord:
        return _then_py(fut, fn, priority=priority)
    rec = <EventRecord>records[0]
    if rec._known and rec._status:
        return _then_py(fut, fn, priority=priority)  # failed work: the child takes the error
    _ensure_types()
    torch = _torch_loaded()
    value = fut._value
    device = rec.device
    tensor_value = torch is not None and type(value) is _torch_tensor_type(torch)
    try:
        # _future._then_streams for one record: the parent's own pool stream
        # where nothing was recorded there since (no wait), else the next one.
        pool = _pools.streams
        stream = None
        state = rec.state
        reuse = not fut._stream_given
        fut._stream_given = True  # before the lookup, as the twin: one child continues there
        if reuse and (_is_newest(rec) if state is None else state.newest == rec.seq):
            if state is not None and state.memo_pool is pool and state.memo_prio == prio:
                stream = state.memo_stream
            else:
                stream = pool.lookup(rec.stream, prio)
                if stream is not None and state is not None:
                    state.memo_pool = pool
                    state.memo_stream = stream
                    state.memo_prio = prio
        if stream is None:
            stream = pool.get(device, prio)
            rec.wait_on(stream.ptr, device)
        if _lone_array is not None and type(value) is _lone_array:
            _consume_one(value, device, stream)
        elif not tensor_value:
            # (A torch tensor is no CuPy array: cudafut's allocator owns
            # none of it, and _record_consumers would mark nothing.)
            _record_consumers(value, {device: stream}, untracked=False)
    except Exception as exc:
        return _then_failed(fut, exc, True)
    early = None
    if _then_record_early:  # the mutation: before fn's work
        early = _record(stream.ptr, device, None, None)
    switch = None
    call, args = fn, (value,)
    try:
        if torch is not None:
            # The pool stream is PyTorch's current stream too while fn runs:
            # switched from C (in the CUDA branch below) for a CuPy array or
            # one torch CUDA tensor on this device; other values take
            # call_on_torch_streams, which walks them. (In this try, as the
            # twin's in its settle: what fails here fails the child.)
            if _be is _CUDA_BE and _get_device is not None:
                if _lone_array is not None and type(value) is _lone_array:
                    switch = _torch_switch(torch, stream.ptr, device)
                elif tensor_value and value.is_cuda and value.get_device() == device:
                    switch = _torch_switch(torch, stream.ptr, device)
            if switch is None:
                tensor_value = False
                call, args = _torch_module.call_on_torch_streams, (torch, {device: stream}, fn, (value,), {}, value)
        if _be is not _CUDA_BE or _get_device is None:
            out = _be.call_on_streams({device: stream}, device, call, args, {})
        else:
            # As _streams.call_on_streams: the caller's device comes back
            # however fn (or entering the stream) ends, and whatever fn set.
            prev = _get_device()
            try:
                if prev != device:
                    _set_device(device)
                stream.__enter__()
                try:
                    if switch is not None:
                        out = _on_torch_stream(<_TorchSwitch>switch, device, fn, value, tensor_value)
                    else:
                        out = call(*args)
                finally:
                    cudafut_call_exit(stream, "__exit__")
            finally:
                if _get_device() != prev:
                    _set_device(prev)
    except BaseException as exc:  # the child carries it, type kept
        child = _then_failed(fut, exc, False)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise  # to then()'s caller, once the child failed (as the twin)
        return child
    if type(out) is _CoroutineType:  # fn called an async def: nothing would await it
        return _then_failed(fut, _checks.returned_coroutine(fn, out), False)
    try:
        ptr = stream.ptr
        lone = _lone_array is not None and type(out) is _lone_array
        # One torch tensor on this device: recorded below with the pool stream
        # (order_foreign skips torch tensors, record_value the pool's device).
        tensor_out = (torch is not None and type(out) is _torch_tensor_type(torch)
                      and out.is_cuda and out.get_device() == device)
        if not lone and not tensor_out and not isinstance(out, _Future):
            consumer = _Consumer.__new__(_Consumer)
            (<_Consumer>consumer).handle = (ptr, device)
            (<_Consumer>consumer).others_current = True
            try:
                _order_foreign(out, consumer)  # docs/design.md, hazard 9
            except ValueError as exc:
                return _then_failed(fut, exc, False)
        # The child's record, after fn's work (and the foreign work ordered
        # before it), as the twin's: _events.record without an owner.
        if early is not None:
            done = early
        elif state is not None and state.memo_stream is stream and _by_handle.get(ptr) is state:
            # The parent's pool stream, whose state _stream_of would return
            # (a pool's stream owns its handle for good): no second lookup.
            done = _record_on(state, ptr, device, None)
        else:
            done = _record(ptr, device, None, None)
        if not lone and not tensor_out and isinstance(out, _Future):
            return _then_follows(fut, out, (done,))
        # Arrays fn placed on other devices were made on those devices' streams
        # (torch's tensors on torch's current streams).
        extra = ()
        if lone:
            if out.data.device_id != device:
                extra = (_record_current(out.data.device_id),)
        elif tensor_out:
            pass
        elif torch is not None:
            extra = _torch_module.record_value(torch, out, None, skip=(device,))
        else:
            for d in _find_devices(out):
                if d != device:
                    extra += (_record_current(d),)
    except Exception as exc:
        return _then_failed(fut, exc, True)
    child = _set_future(out, done, None if _then_no_keep else value)
    if extra:
        child._records = (done,) + extra
    return child


# then()'s torch stream switch for a pool stream, by its handle (pool
# streams live as long as the process, so a handle keeps its switch), for the
# torch module in _switch_torch, whose Tensor type is _switch_tensor.
cdef object _switch_torch = None
cdef object _switch_tensor = None
cdef dict _switches = {}


@cython.final
@cython.no_gc
cdef class _TorchSwitch:
    """_torch.raw_switch's answer for one pool stream."""
    cdef object get
    cdef object put
    cdef tuple triple
    cdef object stream  # the torch ExternalStream over the pool stream


cdef inline object _torch_tensor_type(object torch):
    """``torch.Tensor``, kept with the switches for the same torch module."""
    global _switch_torch, _switch_tensor
    if torch is not _switch_torch:
        _switches.clear()
        _switch_torch = torch
        _switch_tensor = torch.Tensor
    return _switch_tensor


cdef _TorchSwitch _torch_switch(object torch, long long ptr, long long device):
    """``_torch.raw_switch(torch, ptr, device)``, kept per handle once it
    gives one (None until torch has initialised CUDA: then the caller takes
    ``call_on_torch_streams``, which initialises it)."""
    cdef _TorchSwitch switch
    _torch_tensor_type(torch)
    found = _switches.get(ptr)
    if found is not None:
        return <_TorchSwitch>found
    raw = _torch_module.raw_switch(torch, ptr, device)
    if raw is None:
        return None
    switch = _TorchSwitch.__new__(_TorchSwitch)
    switch.get, switch.put, switch.triple, switch.stream = raw
    _switches[ptr] = switch
    return switch


def forget_switches():
    """Drop then()'s kept torch switches (tests that replace
    ``_torch.raw_switch``; the next link of each pool stream asks again)."""
    _switches.clear()


cdef object _on_torch_stream(_TorchSwitch switch, long long device, object fn, object value, bint tensor):
    """``fn(value)`` with the pool stream of ``switch`` PyTorch's current
    stream of ``device``, torch's previous stream restored however ``fn``
    ends: call_on_torch_streams for a value holding no torch tensor, or
    (``tensor``) being one torch CUDA tensor on ``device``, recorded on the
    pool stream first for torch's allocator, at every link: a live tensor's
    storage may have been freed and reallocated at the same address since
    (``untyped_storage().resize_()``), and torch keeps no generation to tell."""
    if tensor:
        value.record_stream(switch.stream)
    saved = switch.get(device)
    switch.put(*switch.triple)
    try:
        return fn(value)
    finally:
        switch.put(*saved)


cdef FutureCore _set_future(object value, EventRecord rec, object keep):
    """A CudaFuture set with ``value`` and ``rec`` (as _future.set_future);
    the members not set here are None and False, as ``__init__`` leaves them."""
    cdef FutureCore fut = <FutureCore>cudafut_tp_new(_Future, ())
    fut._value = value
    fut._records = (rec,)
    fut._keep = keep
    fut._state = _SET
    return fut


cdef int _future_del(FutureCore fut) except -1:
    """CudaFuture.__del__: nothing to do for a future whose records are known
    complete (known, or answered by its stream's watermark; never a confirm);
    one record pending on a stream whose watermark holds: kept by that
    stream's list of drops (:func:`_defer`: no driver call, no Python call);
    else one query, and the Python twin, which keeps the value of pending
    work."""
    cdef EventRecord rec
    cdef _Stream st
    cdef tuple records
    if _ending():  # as the twin: no CUDA call while the interpreter ends
        return 0
    state = fut._state
    if state is None:  # __init__ never ran: CudaFuture(...) refused its arguments
        return 0
    if state is _SET:
        if fut._keep is _kept_by_producer:  # the twin keeps nothing of such a future
            return 0
        records = fut._records
        if records is not None and len(records) == 1 and type(records[0]) is EventRecord and not _forked:
            rec = <EventRecord>records[0]
            if rec._known_now():  # (one with a confirm runs it: the loop below)
                return 0
            st = rec.state
            if rec._confirm is None and st is not None and st.ordered:
                try:
                    _defer(st, rec, fut._value, fut._keep)
                except MemoryError:
                    pass  # no room for it: the twin holds it
                else:
                    return 0
        for r in fut._records:
            if type(r) is not EventRecord:
                _finalize_py(fut)
                return 0
            rec = <EventRecord>r
            if rec._known:
                continue
            if rec._confirm is not None or _query_quietly(rec) is None:
                _finalize_py(fut)  # pending: its value is kept until the work completes
                return 0
    elif state is _FAILED and not fut._retrieved:
        _finalize_py(fut)
    return 0


# -- dropped futures: kept by their stream, reclaimed in batch ---------------------
#
# A future dropped while its one record is pending (fire and forget:
# ``cudafut.record(x)`` unkept, or a future going out of scope while its work
# runs) must keep its value and keep alive until the work completes (docs/
# design.md, hazard 5). Its finalizer used to ask CUDA (a query, about 1.4 µs
# on an H200: more than the record itself) and hand what was pending to the
# watcher thread. Here it appends the record, value and keep to its
# stream's list (C, no driver call, no Python call), which is reclaimed in
# batch: work on one stream completes in order, so one record seen complete
# answers for every older one (the watermark). Two reclaimers:
#
# - a record on that stream (_record) once RECLAIM_EVERY more drops wait: at
#   most two queries (the newest held, then the middle one), and what they
#   prove complete goes, its events back to the pool before the record takes
#   one;
# - the watcher thread, so that nothing waits for a next record: the stream's
#   first drop hands it a _Sweeper (one _lifetimes.hold, on the oldest record
#   held), which sweeps the list once that record completes (a binary search
#   of queries for what is complete) and arms again on what is left.
#
# Only streams whose watermark holds (ordered) keep drops; on others, and for
# a record with a confirm or a future of several records, the finalizer
# queries as before. The lists are C arrays of strong references in the
# (untracked) stream state: a dropped future costs the collector nothing.
# Entries are detached from a list before their references go (a value's
# finalizer may drop another future onto the same list).

cdef Py_ssize_t _deferred = 0  # entries in every stream's list
cdef Py_ssize_t _sweepers = 0  # _Sweepers the watcher thread holds


def deferred():
    """Dropped futures whose values the streams' lists keep now, less the
    sweepers the watcher thread holds for them (which ``_lifetimes.holding``
    counts once each): added to ``holding()``. No CUDA call."""
    return _deferred - _sweepers


_lifetimes.count_also(deferred)


cdef void _release_held(_Held *held, Py_ssize_t n) noexcept:
    """Let go of ``n`` entries detached from their list: the values, and the
    records (whose events go back to the pool)."""
    cdef Py_ssize_t i
    for i in range(n):
        Py_XDECREF(held[i].value)
        Py_XDECREF(held[i].keep)
        Py_XDECREF(held[i].rec)


cdef int _defer(_Stream st, EventRecord rec, object value, object keep) except -1:
    """Keep ``rec``, ``value`` and ``keep`` (a dropped future's) in ``st``'s
    list until a reclaim finds ``rec`` complete. No driver call; a Python
    call (``_lifetimes.hold``) only where the list has no sweeper yet."""
    global _deferred
    cdef _Held *grown
    cdef Py_ssize_t cap
    cdef Py_ssize_t i
    if st.nheld == st.capheld:
        cap = 16 if st.capheld == 0 else 2 * st.capheld
        grown = <_Held *>realloc(st.held, cap * sizeof(_Held))
        if grown == NULL:
            raise MemoryError()
        st.held = grown
        st.capheld = cap
    # Appended: the readers want the list by number (a binary search), and
    # sort it first where a drop came out of order. Sorting at each drop
    # would cost a list freed newest first (CPython's list does) a move of
    # every entry per drop: quadratic in the futures dropped.
    i = st.nheld
    if i > 0 and st.held[i - 1].seq > rec.seq:
        st.unsorted = True
    Py_INCREF(rec)
    Py_INCREF(value)
    Py_INCREF(keep)
    st.held[i].rec = <PyObject *>rec
    st.held[i].value = <PyObject *>value
    st.held[i].keep = <PyObject *>keep
    st.held[i].seq = rec.seq
    st.nheld += 1
    _deferred += 1
    if not st.armed:
        _arm(st)
    return 0


cdef int _by_seq(const void *a, const void *b) noexcept nogil:
    cdef long long x = (<const _Held *>a).seq
    cdef long long y = (<const _Held *>b).seq
    return (x > y) - (x < y)


cdef void _sort_held(_Stream st) noexcept:
    """``st``'s list by number, if a drop came out of order (see _defer)."""
    if st.unsorted:
        qsort(st.held, st.nheld, sizeof(_Held), _by_seq)
        st.unsorted = False


cdef void _collect(_Stream st) noexcept:
    """Let go of the entries of ``st`` whose records are known complete or
    failed, or answered by the stream's watermark; the list left by number.
    No driver call."""
    global _deferred
    cdef Py_ssize_t n = st.nheld
    cdef Py_ssize_t i
    cdef Py_ssize_t kept = 0
    cdef Py_ssize_t gone = 0
    cdef _Held *going
    cdef EventRecord rec
    if n == 0:
        return
    going = <_Held *>malloc(n * sizeof(_Held))
    if going == NULL:
        _sort_held(st)
        return
    # Runs no Python (the list holds every record it reads): the list is
    # whole before the first reference goes.
    for i in range(n):
        rec = <EventRecord>st.held[i].rec
        if rec._known_now():
            going[gone] = st.held[i]
            gone += 1
        else:
            st.held[kept] = st.held[i]
            kept += 1
    st.nheld = kept
    _deferred -= gone
    _release_held(going, gone)
    free(going)
    # Last: a value let go above may have dropped an older record here.
    _sort_held(st)


cdef object _held_rec(_Stream st, Py_ssize_t i):
    return <object>st.held[i].rec


cdef void _reclaim(_Stream st) noexcept:
    """A record's reclaim of ``st``'s dropped futures (see above): the
    newest held queried, then, if pending, the one RECLAIM_EVERY / 2 older
    (at most two queries, about 3 µs on an H200, once per RECLAIM_EVERY
    drops: a GPU that trails the host by fewer records leaves at most that
    many held); whatever they prove complete goes. None proved (a GPU far
    behind): the next reclaim waits until the list has doubled."""
    cdef Py_ssize_t before
    cdef EventRecord newest
    cdef EventRecord older
    # No reclaim inside this one: a value let go may record on this stream
    # (an allocator's free), which would otherwise reclaim again.
    st.reclaim_at = PY_SSIZE_T_MAX
    _collect(st)
    before = st.nheld
    if before:
        # Both read before a query: one through the runtime (or the fake)
        # runs Python, which may change the list.
        newest = <EventRecord>_held_rec(st, before - 1)
        older = <EventRecord>_held_rec(st, max(before - 1 - RECLAIM_EVERY // 2, 0))
        if _query_quietly(newest) is None and older is not newest:
            _query_quietly(older)
        _collect(st)
    st.reclaim_at = (st.nheld if st.nheld < before else 2 * st.nheld) + RECLAIM_EVERY
    if st.nheld and not st.armed and not (_finalizing() or _forked):
        _arm(st)  # an earlier arm failed: what is left still needs a sweeper


cdef void _sweep(_Stream st) noexcept:
    """The watcher thread's sweep of ``st``: the newest record held
    queried; if pending, a binary search for the newest complete one (the
    oldest was, if the sweeper's record was); whatever they prove complete
    goes. A record failed (a sticky error: every query fails alike) makes it
    query each one left instead."""
    cdef list recs
    cdef Py_ssize_t lo
    cdef Py_ssize_t hi
    cdef Py_ssize_t mid
    cdef bint failed = False
    _collect(st)
    if st.nheld:
        # Copied: a query through the runtime (or the fake) runs Python,
        # which may change the list meanwhile.
        recs = [_held_rec(st, i) for i in range(st.nheld)]
        hi = len(recs) - 1
        status = _query_quietly(<EventRecord>recs[hi])
        if status is None and hi > 0:
            status = _query_quietly(<EventRecord>recs[0])
            if status is not None:  # recs[lo] is not pending, recs[hi] is
                lo = 0
                failed = status != 0
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    status = _query_quietly(<EventRecord>recs[mid])
                    if status is None:
                        hi = mid
                    else:
                        lo = mid
                        failed = failed or status != 0
        elif status is not None:
            failed = status != 0
        if failed:
            for r in recs:
                _query_quietly(<EventRecord>r)
        del recs
        _collect(st)
    st.reclaim_at = st.nheld + RECLAIM_EVERY


@cython.no_gc
@cython.final
cdef class _Sweeper:
    """What the watcher thread holds for a stream with dropped futures
    (``_lifetimes.hold``, with the oldest record held): let go once that
    record completes or fails, it sweeps the stream's list (:func:`_sweep`)
    and arms another for what is left. Not tracked by the collector."""

    cdef _Stream state
    cdef bint live

    def __del__(self):
        if self.live:
            self.live = False
            _swept(self.state)


cdef void _swept(_Stream st) noexcept:
    global _sweepers
    _sweepers -= 1
    # ``armed`` stays set while values are let go (Python runs: a drop on
    # this stream then must not arm a second sweeper beside this one).
    if _finalizing() or _forked:
        # As the twin: nothing is kept while the interpreter ends, nor in a
        # forked child (no CUDA there: nothing to protect).
        _let_go(st)
        st.armed = False
        return
    _sweep(st)
    st.armed = False
    if st.nheld:
        _arm(st)


cdef void _let_go(_Stream st) noexcept:
    """Let go of every entry of ``st``, complete or not."""
    global _deferred
    cdef _Held *going = st.held
    cdef Py_ssize_t n = st.nheld
    st.held = NULL
    st.nheld = st.capheld = 0
    st.unsorted = False
    _deferred -= n
    _release_held(going, n)
    free(going)


cdef void _arm(_Stream st) noexcept:
    """Hand the watcher thread a sweeper of ``st``, watching its oldest
    record held (one Python call: ``_lifetimes.hold``)."""
    global _sweepers
    cdef _Sweeper sweeper = _Sweeper.__new__(_Sweeper)
    sweeper.state = st
    sweeper.live = True
    st.armed = True
    _sweepers += 1
    _sort_held(st)  # the oldest first
    try:
        _lifetimes.hold((_held_rec(st, 0),), sweeper)
    except BaseException:  # no watcher (the interpreter ends, no thread): the next record tries again
        sweeper.live = False
        st.armed = False
        _sweepers -= 1
        st.reclaim_at = 0


cdef object _query_quietly(EventRecord rec):
    """The status of ``rec`` (answered by its stream's watermark, or asked of
    CUDA), None while pending or where a query fails (the Python twin then
    asks again and reports). Runs no ``confirm``: the caller checked."""
    if rec._known_now():
        return rec._status
    try:
        return rec._query()
    except Exception:
        return None


cdef object _outcome(FutureCore fut, object cancelled_error):
    """CudaFuture._awaited: the outcome, with the value's arrays recorded as
    used by the awaiting thread's current streams."""
    cdef EventRecord rec
    cdef tuple records
    state = fut._state
    if state is not _SET:
        return _awaited_py(fut, cancelled_error)  # raises (failed, cancelled)
    records = fut._records
    for r in records:
        if type(r) is not EventRecord:
            return _awaited_py(fut, cancelled_error)
        rec = <EventRecord>r
        if rec._known and rec._status:
            raise rec.error()
    fut._keep = None
    value = fut._value
    if len(records) == 1 and _lone_array is not None and type(value) is _lone_array:
        _consume_one(value, (<EventRecord>records[0]).device)
    elif records and value is not None and type(value) not in _scalars and not isinstance(value, _scalars):
        _consumers_py(value, records, untracked=False)
    return value


cdef object _consume_one(object array, long long device, object stream=None):
    """record_current_consumers() of one CuPy array for an await or
    result(): the awaiting thread's current stream of ``device`` reads it
    from now on (_memory's block, if cudafut's allocator wrapper made it;
    the owner is read as _cupy_objects.owner_of reads it). A torch tensor is never
    a CuPy array: torch's streams have nothing to record here. With
    ``stream`` (then()'s pool stream), record_consumers(): that stream reads it."""
    memory = getattr(array.data, "mem", None)
    block = getattr(memory, "_owner", None)
    if type(block) is not _block_type or block.device != device:
        return None  # another allocator's memory: untracked, nothing to do for an await
    if stream is None:
        stream = _current_stream(device)
    ptr = stream.ptr
    if ptr != block.stream:  # the allocating stream: CuPy's pool orders it already
        # Already a reader through the same stream object (a then() chain on
        # one pool stream): nothing to add, and no Python call.
        readers = _readers_map.get(id(block))
        if readers is not None:
            entry = (<dict>readers).get(ptr)
            if entry is not None and (<tuple>entry)[1] is stream:
                return None
        block.add_reader(ptr, device, stream)
    return None


cdef dict _readers_map = {}  # _memory's readers by block, bound by bind_future


cdef object _awaited_py(object fut, object cancelled_error):
    return type(fut)._awaited(fut, cancelled_error)


def awaited(FutureCore fut not None, cancelled_error):
    """CudaFuture._awaited, native."""
    return _outcome(fut, cancelled_error)


cdef int _raise_thrown(object typ, object val, object tb) except -1:
    """Raise what a generator's ``throw(typ, val, tb)`` is given (either form)."""
    if not isinstance(val, BaseException):
        val = (typ() if val is None else typ(val)) if isinstance(typ, type) else typ
    if tb is not None:
        val = val.with_traceback(tb)
    raise val


cdef extern from *:
    """
    /* End an iteration with value (what an await evaluates to): set
       StopIteration(value), return NULL. Cython's raise would add a
       traceback entry (a frame object) to every await, dropped at once. */
    static PyObject *cudafut_return(PyObject *value) {
        PyObject *args = PyTuple_Pack(1, value);  /* value is the one argument, a tuple too */
        if (args != NULL) {
            PyErr_SetObject(PyExc_StopIteration, args);
            Py_DECREF(args);
        }
        return NULL;
    }
    """
    PyObject* _return "cudafut_return"(object value)


cdef void _install_iternext(type cls, iternextfunc fn) noexcept:
    """Make ``fn`` the tp_iternext of ``cls`` (one of this module's final
    classes, at import): the loop's ``await`` calls it directly; ``__next__``
    stays the Python-level entry, with the same behaviour."""
    (<_IterSlot*>cls).tp_iternext = fn
    PyType_Modified(<_IterSlot*>cls)


@cython.final
@cython.freelist(8)
cdef class _Done:
    """What ``await`` of a done future iterates: nothing, then its outcome;
    a generator's ``send``, ``throw`` and ``close`` too. Tracked by the
    collector: the future's value may refer back to it."""
    cdef object fut

    def __iter__(self):
        return self

    def __next__(self):
        fut = self.fut
        if fut is None:
            raise StopIteration
        self.fut = None
        # Set (never cancelled or failed): the error type is not needed.
        raise StopIteration(_outcome(fut, None))

    def send(self, value):
        """As ``next()``, as a generator started by ``send(None)``."""
        return self.__next__()

    def throw(self, typ, val=None, tb=None):
        """Raise the exception thrown in; the outcome is never taken."""
        self.fut = None
        _raise_thrown(typ, val, tb)

    def close(self):
        """Never take the outcome."""
        self.fut = None


cdef PyObject* _done_next(PyObject* op) except NULL:
    """_Done's tp_iternext: as its ``__next__``."""
    cdef _Done self = <_Done>op
    fut = self.fut
    if fut is None:
        return NULL  # exhausted: NULL without an exception
    self.fut = None
    return _return(_outcome(fut, None))


_install_iternext(_Done, _done_next)


cdef object _future_await(FutureCore fut):
    """CudaFuture.__await__ (FutureCore's slot)."""
    cdef EventRecord rec
    cdef AsyncioEntry entry
    cdef _Done done
    cdef tuple records
    if fut._state is _SET and not _forked and not _tracing:
        records = fut._records
        if len(records) == 1:
            r = records[0]
            if type(r) is EventRecord:
                rec = <EventRecord>r
                if not rec._known:
                    entry = _entry_here()
                    # Behind an older watched record of its stream, the
                    # record cannot be seen complete before that one: it
                    # joins the queue without a query (Watchlist._behind).
                    if entry is not None and not rec._answered() and entry.watchlist._behind(rec):
                        return _entry_await(entry, fut, rec)
                    if rec._probe() is None:
                        if entry is not None:
                            return _entry_await(entry, fut, rec)
                        driver = _current_driver()
                        if driver is not None:
                            wait = driver.await_one(fut, rec, awaited)
                            if wait is not None:
                                return wait
                        return _await_py(fut, True)
                done = _Done.__new__(_Done)
                done.fut = fut
                return done
    return _await_py(fut, False)


def future_result(FutureCore self not None, timeout=None):
    """CudaFuture.result, native (its documentation is the twin's): the
    outcome at once where every record is complete; else the twin, which
    blocks."""
    cdef EventRecord rec
    cdef FutureCore fut = self
    if timeout is None and fut._state is _SET and not _forked and not _tracing:
        for r in fut._records:
            if type(r) is not EventRecord:
                return _result_py(fut, timeout)
            rec = <EventRecord>r
            if not rec._known and rec._probe() is None:
                return _result_py(fut, timeout)  # pending: the twin blocks until done
        return _outcome(fut, None)  # set: the error type is not needed
    return _result_py(fut, timeout)


# -- the waiters' pacing -------------------------------------------------------------

cdef dict _policy_ns = None  # cudafut._policy's globals: its policy in force, read per plan
cdef object _policy_mod = None
cdef dict _histories = None  # the predictor's table (Predictor.histories), read only
cdef object _predictor = None
cdef object _logger = None
cdef int _DEBUG_LEVEL = 10
cdef double _WARM_S = 0.0
cdef double _NOTICE_POLLS = 0.0
cdef double _DEFAULT_LATENESS_S = 0.0
cdef double _INF = float("inf")

# The policy last read, and its fields as C doubles (refreshed when
# set_wait_policy() installs another: policies are frozen).
cdef object _seen_policy = None
cdef double _spin_s = 0.0
cdef double _first_sleep_s = 0.0
cdef double _max_sleep_s = 0.0
cdef double _cpu_budget = 0.0
cdef double _notice_sleep_s = 0.0
cdef double _predicted_sleep_s = 0.0
cdef bint _predict = True
cdef bint _notify = False


def bind_policy(policy):
    """Give the pacer the policy module (called once, by ``_policy`` at
    import): its policy in force, predictor, logger and constants."""
    global _policy_ns, _policy_mod, _histories, _predictor, _logger, _DEBUG_LEVEL
    global _WARM_S, _DEFAULT_LATENESS_S, _NOTICE_POLLS
    _policy_mod = policy
    _policy_ns = policy.__dict__
    _predictor = policy.predictor
    _histories = _predictor.histories
    _logger = policy.logger
    _DEBUG_LEVEL = policy._DEBUG
    _WARM_S = policy._WARM_S
    _NOTICE_POLLS = policy._NOTICE_POLLS
    _DEFAULT_LATENESS_S = policy._DEFAULT_LATENESS_S


cdef object _current_policy():
    """The policy in force, its fields read into the C globals above."""
    global _seen_policy, _spin_s, _first_sleep_s, _max_sleep_s, _cpu_budget, _notice_sleep_s
    global _predicted_sleep_s, _predict, _notify
    policy = _policy_ns["_policy"]
    if policy is not _seen_policy:
        _spin_s = policy.spin_s
        _first_sleep_s = policy.first_sleep_s
        _max_sleep_s = policy.max_sleep_s
        _cpu_budget = policy.cpu_budget
        _notice_sleep_s = policy.notice_sleep_s
        _predicted_sleep_s = policy.predicted_sleep_s
        _predict = policy.predict
        _notify = policy.notify
        _seen_policy = policy
    return policy


@cython.final
cdef class Pacer:
    """The twin of ``_policy.Pacer`` (see there): one sleeper's pacing, its
    state in C fields; :meth:`next_poll` reads the predictor's histories
    and the policy without a Python call per stream (the twin makes four)."""

    cdef public object name
    cdef public double spin_until
    cdef public double spin_ends
    # Readable for the differential test (tests/test_pacer_differential.py).
    cdef readonly double _backoff
    cdef readonly double _retract
    cdef readonly double _asked
    cdef readonly object _lateness
    cdef readonly double _late_median

    def __init__(self, lateness=None, name="waiter"):
        _current_policy()
        self.name = name
        self.spin_until = 0.0
        self.spin_ends = 0.0
        self._backoff = _first_sleep_s
        self._retract = 0.0
        self._asked = 0.0
        self._lateness = _deque(maxlen=32) if lateness is None else lateness
        self._late_median = _DEFAULT_LATENESS_S
        if self._lateness:
            self._summarise()

    def new_wait(self, double now):
        """A new wait began: spin for a while, then start the sleeps afresh."""
        self._new_wait(now)

    cdef inline void _new_wait(self, double now):
        _current_policy()
        self.spin_until = now + _spin_s
        self._backoff = _first_sleep_s
        self._retract = 0.0

    def retract(self):
        """The last plan's sleep was not taken: the back-off steps back (the twin's)."""
        if self._retract:
            self._backoff = self._retract
            self._retract = 0.0

    def sleeping_until(self, double when):
        """The sleeper is about to sleep until ``when``."""
        self._asked = when

    def woke(self, double now):
        """The sleep asked for with :meth:`sleeping_until` ended (by its timer)."""
        cdef double late
        if self._asked:
            late = now - self._asked
            if not late > 0.0:  # max(0.0, late), as the twin's (NaN and -0.0 included)
                late = 0.0
            self._lateness.append(late)
            self._asked = 0.0
            self._summarise()
            if _logger.isEnabledFor(_DEBUG_LEVEL):
                _policy_mod.log_woke(self.name, late, self._late_median)

    def interrupted(self):
        """The sleep ended early (a new wait): it says nothing of lateness."""
        self._asked = 0.0

    @cython.boundscheck(True)  # an empty history raises IndexError, as the twin's
    def _summarise(self):
        cdef list late = sorted(self._lateness)
        cdef Py_ssize_t n = len(late)
        self._late_median = late[n // 2]  # robust to a rare long stall

    def margin(self, double duration, policy):
        """How long before a predicted end to ask to be woken (the twin's)."""
        return self._margin(duration, <double>policy.cpu_budget)

    cdef inline double _margin(self, double duration, double cpu_budget):
        cdef double warm = cpu_budget * duration
        if _WARM_S < warm:  # min(warm, _WARM_S), as Python's: the first of equals
            warm = _WARM_S
        return self._late_median + warm

    def next_poll(self, records, double now, arm=None):
        """When to poll next for ``records`` (the twin's, to the bit)."""
        cdef double spin_s, bound, best, start, low, high, opens, closes, spin_ends, t
        cdef double max_sleep_s, notice_sleep_s, predicted_sleep_s, cpu_budget, until
        cdef bint backoff = False, noticed = False, covered = False, bounded = False
        cdef bint ahead, surprised, predict, cover
        cdef tuple modes, mode
        # One policy for the whole plan, as the twin's local: arm() and a
        # finding of modes run Python, and another thread's pacer may
        # refresh the C globals meanwhile.
        policy = _current_policy()
        spin_s = _spin_s
        max_sleep_s = _max_sleep_s
        notice_sleep_s = _notice_sleep_s
        predicted_sleep_s = _predicted_sleep_s
        cpu_budget = _cpu_budget
        predict = _predict
        bound = now + max_sleep_s
        best = _INF
        self._retract = 0.0
        if not _notify:
            arm = None
        cover = arm is not None and len(records) == 1 and predicted_sleep_s > max_sleep_s
        spin_ends = 0.0
        for rec in records:
            hist = None
            if predict:
                # (An EventRecord's members read from C: a poll that plans
                # looks at the oldest record of every busy stream.)
                key = (<EventRecord>rec).stream_key if type(rec) is EventRecord else rec.stream_key
                hist = _histories.get(key)
                if hist is None:
                    modes, surprised = (), True
                else:
                    found = hist.modes
                    if found is None:  # found afresh (and logged): the twin's path
                        found, surprised = _predictor.modes(rec)
                        modes = found
                    else:
                        modes = found
                        surprised = hist.surprised
            else:
                modes, surprised = (), True
            ahead = False  # a mode's window is open now or still to come
            until = 0.0
            if modes:
                # As predictor.start(): modes come from a history (hist).
                t = (<EventRecord>rec).t if type(rec) is EventRecord else rec.t
                start = hist.done_at
                if start < t:
                    start = t
                for m in modes:
                    mode = <tuple>m
                    low = mode[0]
                    high = mode[1]
                    opens = start + low - self._margin(<double>mode[2], cpu_budget)
                    closes = start + high + spin_s + (high - low)
                    if now < opens:
                        if opens < best:
                            best = opens
                        until = opens - now
                        ahead = True
                        break
                    if now < closes:
                        if closes > spin_ends:
                            spin_ends = closes
                        ahead = True
                        break
            if ahead and not surprised:
                if cover and until > _NOTICE_POLLS * max_sleep_s and arm is not None and arm(rec):
                    covered = True
                else:
                    bounded = True
                continue
            if now < self.spin_until:
                if self.spin_until > spin_ends:
                    spin_ends = self.spin_until
            elif arm is not None and arm(rec):
                noticed = True
            else:
                backoff = True
        if spin_ends:
            self.spin_ends = bound if bound < spin_ends else spin_ends
            if _logger.isEnabledFor(_DEBUG_LEVEL):
                _policy_mod.explain(self, records, now, now, policy)
            return now
        self.spin_ends = 0.0
        if backoff and now + self._backoff < best:
            best = now + self._backoff
            self._retract = self._backoff
            self._backoff = self._backoff * 2
            if max_sleep_s < self._backoff:
                self._backoff = max_sleep_s
        elif not backoff and not bounded:  # every record has a notice
            if noticed:
                bound = now + (max_sleep_s if max_sleep_s > notice_sleep_s else notice_sleep_s)
                if covered and now + predicted_sleep_s < bound:
                    bound = now + predicted_sleep_s
            elif covered:
                bound = now + predicted_sleep_s
        when = bound if bound < best else best
        if _logger.isEnabledFor(_DEBUG_LEVEL):
            _policy_mod.explain(self, records, now, when, policy)
        return when


# -- the drivers' timer ---------------------------------------------------------------

cdef extern from "<sys/timerfd.h>" nogil:
    cdef struct itimerspec:
        timespec it_interval
        timespec it_value
    int timerfd_settime(int fd, int flags, const itimerspec *new_value, itimerspec *old_value)


def timer_settime(int fd, long long ns):
    """``timerfd_settime(fd, 0, {0, ns})`` from C, GIL held (one system call,
    under a µs; ``ns`` 0 disarms): what ``_timer.Timer`` arms its timerfd
    with on Python before 3.13 (where ctypes took a few µs a call, twice per
    loop iteration of a waiter that sleeps between new waits). Raises
    OSError where the call fails."""
    cdef itimerspec spec
    spec.it_interval.tv_sec = 0
    spec.it_interval.tv_nsec = 0
    spec.it_value.tv_sec = ns // 1000000000
    spec.it_value.tv_nsec = ns % 1000000000
    if timerfd_settime(fd, 0, &spec, NULL) < 0:
        err = errno
        raise OSError(err, strerror(err).decode())


cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void *buf, size_t count)

cdef extern from "<errno.h>" nogil:
    int EAGAIN
    int EWOULDBLOCK
    int EINTR


def timer_drain(int fd):
    """Read a timerfd's expiry count from C, GIL held (one system call):
    whether it had expired (False: not expired or re-armed, ``EAGAIN``; or
    interrupted). What ``_timer.Timer.drain`` reads with: ``os.read``
    releases the GIL, and the loop's thread then waits to take it back
    from whichever thread took it meanwhile (a launcher thread running a
    model's Python: tens of µs in the serving model). Raises OSError on
    other failures, as ``os.read``."""
    cdef unsigned long long count = 0
    if read(fd, &count, 8) >= 0:
        return True
    err = errno
    if err == EAGAIN or err == EWOULDBLOCK or err == EINTR:
        return False
    raise OSError(err, strerror(err).decode())


# -- the waiter's watch list ---------------------------------------------------------

# The asyncio driver's mode while a poll is queued (_loops._SPIN: read by
# AsyncioEntry._watch; a test holds them equal).
cdef enum:
    _LOOP_SPIN = 1


cdef class Watch:
    """The twin of ``_waiter.Watch`` (see there): one waiter's interest in
    one record, an entry of its stream's queue itself."""

    cdef public object record
    cdef public object callback
    cdef public long long seq
    cdef public long long arrival  # its number in the order the watchlist took its watches

    def __init__(self, record, callback):
        self.record = record
        self.callback = callback
        self.seq = record.seq


cdef Watch _gone():
    cdef Watch watch = Watch.__new__(Watch)
    watch.seq = -1
    return watch


# What replaces a queue entry once passed: it holds no record.
cdef Watch _GONE = _gone()


@cython.final
cdef class _Queue:
    """The twin of ``_waiter._Queue``: one stream's watches, sorted by the
    record's number on the stream (arrival order among equals); those
    before ``head`` are gone."""

    cdef public list watches
    cdef public Py_ssize_t head

    def __cinit__(self):
        self.watches = []
        self.head = 0

    def add(self, Watch watch not None):
        self._add(watch)

    cdef void _add(self, Watch watch) except *:
        cdef list watches = self.watches
        cdef Py_ssize_t lo = self.head
        cdef Py_ssize_t hi = len(watches)
        cdef Py_ssize_t mid
        if hi == 0 or (<Watch>watches[hi - 1]).seq <= watch.seq:
            watches.append(watch)
            return
        while lo < hi:  # bisect right, by seq
            mid = (lo + hi) // 2
            if watch.seq < (<Watch>watches[mid]).seq:
                hi = mid
            else:
                lo = mid + 1
        watches.insert(lo, watch)

    def advance(self, Py_ssize_t to):
        self._advance(to)

    cdef void _advance(self, Py_ssize_t to) except *:
        """Forget the watches before ``to``."""
        cdef list watches = self.watches
        cdef Py_ssize_t i
        # Checked: the module indexes without bounds checks, and a queue
        # compacted under a walk (a record's query or finalizer reentering
        # the list) would be written past its end.
        if not self.head <= to <= len(watches):
            raise IndexError(f"a queue of {len(watches)} watches cannot advance from {self.head} to {to}")
        for i in range(self.head, to):
            watches[i] = _GONE  # releases the record (and its event) now
        if to > 32 and to * 2 > len(watches):
            del watches[:to]
            to = 0
        self.head = to


cdef inline object _status_of(object record):
    if type(record) is EventRecord:
        return (<EventRecord>record)._query()
    return record.query()


# Streams a poll keeps its merge's state for on the stack (more: malloc).
cdef enum:
    _POLL_SMALL = 16


cdef inline void _heap_down(long long *key, Py_ssize_t *src, Py_ssize_t size, Py_ssize_t pos) noexcept nogil:
    """Sift the entry at ``pos`` down a binary min-heap of ``(key, src)``
    pairs (compared as tuples, as heapq compares the pure twin's)."""
    cdef long long k = key[pos]
    cdef Py_ssize_t s = src[pos]
    cdef Py_ssize_t child
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and (
            key[child + 1] < key[child] or (key[child + 1] == key[child] and src[child + 1] < src[child])
        ):
            child += 1
        if not (key[child] < k or (key[child] == k and src[child] < s)):
            break
        key[pos] = key[child]
        src[pos] = src[child]
        pos = child
    key[pos] = k
    src[pos] = s


cdef class Watchlist:
    """The twin of ``_waiter.Watchlist`` (see there): pending records in one
    queue per stream; not thread-safe by design."""

    cdef dict _queues
    cdef public Py_ssize_t pending
    cdef bint _learn
    cdef public list learnt
    cdef long long _arrived  # the next watch's arrival number

    def __init__(self, learn=True):
        self._queues = {}
        self.pending = 0
        self._learn = bool(learn)
        self.learnt = []
        self._arrived = 0

    @property
    def streams(self):
        """Number of streams with watched records (dead watches included)."""
        return len(self._queues)

    def add(self, record, callback):
        return self.add_watch(Watch(record, callback))

    def add_watch(self, Watch watch not None):
        """Add a watch made by the caller (its ``callback`` set)."""
        self._add_watch(watch)
        return watch

    cdef int _add_watch(self, Watch watch) except -1:
        cdef _Queue queue
        record = watch.record
        key = (<EventRecord>record).stream_key if type(record) is EventRecord else record.stream_key
        q = self._queues.get(key)
        if q is None:
            queue = _Queue.__new__(_Queue)
            self._queues[key] = queue
        else:
            queue = <_Queue>q
        watch.arrival = self._arrived
        self._arrived += 1
        queue._add(watch)
        self.pending += 1
        return 0

    def clear(self):
        """Forget every watch, as :meth:`remove` does each."""
        cdef _Queue queue
        cdef Watch watch
        for q in self._queues.values():
            queue = <_Queue>q
            for w in queue.watches:
                watch = <Watch>w
                watch.callback = None
        self._queues.clear()
        self.pending = 0

    def remove(self, Watch watch not None):
        """Forget a watch; a no-op if it fired or was removed already."""
        if watch.callback is not None:
            watch.callback = None
            self.pending -= 1
            if self.pending == 0:
                self._queues.clear()  # drop dead entries: an idle list holds nothing

    cdef bint _behind(self, EventRecord rec) except -1:
        """Whether the newest watch of ``rec``'s stream here is live and of
        the same record or an older one of the same ordered stream. The
        stream completes in order and a poll walks its queue oldest first,
        so ``rec`` cannot be seen complete before that watch's record: an
        await of it may join the queue without asking CUDA, and costs one
        poll's delay at most where both completed since the last poll. A
        record numbered out of order (two threads recording on one stream
        at once, see ``_events``) waits as long as the work between the two,
        as the queue already makes it. The pure core asks CUDA (no
        watermark there): the same outcome, one query more."""
        cdef _Queue queue
        cdef Watch last
        cdef _Stream state = rec.state
        if state is None or not state.ordered:
            return False
        q = self._queues.get(rec.stream_key)
        if q is None:
            return False
        queue = <_Queue>q
        n = len(queue.watches)
        if n <= queue.head:
            return False
        last = <Watch>queue.watches[n - 1]
        if last.callback is None or last.seq > rec.seq or type(last.record) is not EventRecord:
            return False
        return (<EventRecord>last.record).state is state

    @cython.boundscheck(True)  # a reentered list may shrink under the walk: IndexError, not a crash
    def poll(self, double now, long long limit=1 << 62):
        """Query the oldest live record of each stream; return what fired
        (``(callback, record)`` pairs), at most ``limit`` callbacks, in the
        order the watches were added across streams: each stream's
        completed prefix, walked lazily oldest first, merged by arrival."""
        cdef list fired = []
        cdef dict queues = self._queues
        cdef list keys
        cdef list qs
        cdef list wls
        cdef _Queue queue
        cdef list watches
        cdef Watch watch
        cdef Py_ssize_t i, n, s, k, size
        cdef bint joined
        # Per stream: where its walk is (at), its length when the poll began
        # (end), whether none of it fired yet (first); the merge's heap of
        # the streams whose next live watch completed: its arrival (key) and
        # the stream (src). On the stack for the usual few streams.
        cdef Py_ssize_t small_i[4 * _POLL_SMALL]
        cdef long long small_k[_POLL_SMALL]
        cdef Py_ssize_t *ibuf = small_i
        cdef long long *key = small_k
        cdef Py_ssize_t *at
        cdef Py_ssize_t *end
        cdef Py_ssize_t *src
        cdef Py_ssize_t *first
        if limit <= 0:
            return fired
        keys = list(queues)
        k = len(keys)
        if k > _POLL_SMALL:
            ibuf = <Py_ssize_t*>malloc(4 * k * sizeof(Py_ssize_t))
            key = <long long*>malloc(k * sizeof(long long))
            if ibuf == NULL or key == NULL:
                free(ibuf)
                free(key)
                raise MemoryError()
        at = ibuf
        end = ibuf + k
        src = ibuf + 2 * k
        first = ibuf + 3 * k
        qs = []
        wls = []
        try:
            size = 0
            for s in range(k):
                queue = <_Queue>queues[keys[s]]
                watches = queue.watches
                qs.append(queue)
                wls.append(watches)
                i = queue.head
                n = len(watches)
                while i < n:
                    watch = <Watch>watches[i]
                    if watch.callback is not None:
                        record = watch.record
                        if _status_of(record) is None:
                            if type(record) is EventRecord:
                                (<EventRecord>record).seen = now
                            else:
                                record.seen = now
                            break
                        if record.ordered and n - i > 2:
                            # Ask the newest: if it is complete, the stream's
                            # watermark answers every older one from memory.
                            _status_of((<Watch>watches[n - 1]).record)
                        key[size] = watch.arrival
                        src[size] = s
                        size += 1
                        break
                    i += 1
                at[s] = i
                end[s] = n
                first[s] = 1
            s = size // 2
            while s > 0:
                s -= 1
                _heap_down(key, src, size, s)
            while size:
                s = src[0]
                watches = <list>PyList_GET_ITEM(wls, s)
                i = at[s]
                n = end[s]
                watch = <Watch>watches[i]
                callback = watch.callback
                if callback is not None:  # (else removed meanwhile, by a query's reentrant code)
                    record = watch.record
                    if first[s]:
                        if self._learn:  # later ones completed unseen: they teach nothing
                            self.learnt.append((record, now))
                        first[s] = 0
                    watch.callback = None
                    self.pending -= 1
                    fired.append((callback, record))
                i += 1
                if len(fired) >= limit:
                    while i < n and (<Watch>watches[i]).callback is None:
                        i += 1
                    at[s] = i
                    break
                joined = False
                while i < n:  # this stream's next live watch: complete, it joins the merge
                    # (A hint, as in _Wakeups: the watches and records ahead of
                    # the walk, apart in memory, asked for before they are read.)
                    if i + _WATCH_AHEAD < PyList_GET_SIZE(watches):
                        cudafut_prefetch(PyList_GET_ITEM(watches, i + _WATCH_AHEAD), 2)
                        watch = <Watch><object>PyList_GET_ITEM(watches, i + _WATCH_AHEAD // 2)
                        cudafut_prefetch(<PyObject*>watch.record, 2)
                        if type(watch) is AsyncioAwait:  # what run_fired reads of it: the task's wake-up
                            cudafut_prefetch(<PyObject*>(<AsyncioAwait>watch)._wakeup, 0)
                            cudafut_prefetch(<PyObject*>(<AsyncioAwait>watch)._context, 0)
                    watch = <Watch>watches[i]
                    if watch.callback is not None:
                        record = watch.record
                        if _status_of(record) is None:
                            if type(record) is EventRecord:
                                (<EventRecord>record).seen = now
                            else:
                                record.seen = now
                        else:
                            key[0] = watch.arrival  # the top's stream stays, with its next watch
                            _heap_down(key, src, size, 0)
                            joined = True
                        break
                    i += 1
                if not joined:
                    size -= 1
                    if size:
                        key[0] = key[size]
                        src[0] = src[size]
                        _heap_down(key, src, size, 0)
                at[s] = i
            for s in range(k):
                if at[s] >= end[s]:
                    del queues[keys[s]]
                else:
                    (<_Queue>qs[s])._advance(at[s])
        finally:
            if ibuf != small_i:
                free(ibuf)
                free(key)
        return fired

    @cython.boundscheck(True)  # as poll()
    def oldest(self):
        """The oldest live record of each stream: what the next poll queries."""
        cdef list out = []
        cdef _Queue queue
        cdef list watches
        cdef Py_ssize_t i, n
        for key, q in list(self._queues.items()):
            queue = <_Queue>q
            watches = queue.watches
            i = queue.head
            n = len(watches)
            while i < n and (<Watch>watches[i]).callback is None:
                i += 1
            if i < n:
                queue._advance(i)
                out.append((<Watch>watches[queue.head]).record)
            else:
                del self._queues[key]
        return out


# -- one await in an asyncio task ---------------------------------------------------

cdef class AsyncioEntry  # below: the loop's side that makes them

# How many wake-ups ahead _Wakeups asks the CPU for the objects a wake-up
# touches (twice as far for those its list names), and how many watches
# ahead a poll's walk asks for a watch (half as far for its record).
cdef enum:
    _AHEAD = 2
    _WATCH_AHEAD = 8

# The states of an AsyncioAwait.
cdef enum:
    A_NEW = 0
    A_WAITING = 1
    A_FIRED = 2
    A_CANCELLED = 3
    A_FINISHED = 4


@cython.final
cdef class AsyncioAwait(Watch):
    """The twin of ``_loops._AsyncioAwait`` (see there): one ``await`` of a
    future whose one record is pending, in an asyncio task; the watch in the
    waiter's list, the iterator ``__await__`` returns and the future the
    task waits on, with C members and methods the task calls without a
    Python frame."""

    cdef public bint _asyncio_future_blocking
    cdef AsyncioEntry _entry  # the loop's driver's native side, which made it
    cdef object _loop
    cdef object _future
    cdef object _finish
    cdef int _state
    cdef object _wakeup
    cdef object _context
    cdef object _message
    # The thread whose running loop _entry_await found to be this await's
    # (0: none checked): the first next() in that thread skips asking
    # asyncio again (its getter makes a getpid() system call on 3.11).
    cdef unsigned long _checked_in

    def __init__(self, AsyncioEntry entry, loop, future, record, finish):
        # Made by AsyncioEntry._make on the native core; this constructor is
        # for tests (the twin's signature takes the driver in its place).
        _fill(self, entry, loop, future, record, finish)

    def __repr__(self):
        state = ("new", "waiting", "woken", "cancelled", "finished")[self._state]
        future = self._future
        return f"<cudafut await {state}>" if future is None else f"<cudafut await {state} of {future!r}>"

    def __iter__(self):
        return self

    def __next__(self):
        if self._state == A_FIRED or (self._state == A_NEW and _await_at_once):
            raise StopIteration(self._finished())
        return self._step()

    cdef object _finished(self):
        """The outcome, once fired (or, under the mutation, at once)."""
        future = self._future
        finish = self._finish
        self._state = A_FINISHED
        self._future = None
        self._context = None
        if finish is awaited:
            return _outcome(future, _AsyncioCancelled)
        return finish(future, _AsyncioCancelled)

    cdef object _step(self):
        """``__next__`` in any state but fired: start waiting, or raise."""
        cdef int state = self._state
        if state == A_NEW:
            # Checked by _entry_await in this thread a moment ago (the
            # coroutine's await iterates what __await__ returned at once):
            # one check, not two. Another thread, or no check: ask asyncio.
            if (self._checked_in == 0 or self._checked_in != PyThread_get_thread_ident()) \
                    and _get_running_loop() is not self._loop:
                raise RuntimeError("a CudaFuture's await must run in the task that started it")
            self._checked_in = 0
            if self._entry is None:
                raise RuntimeError("this await was made without its loop's AsyncioEntry")
            self._state = A_WAITING
            self.callback = self
            self._entry._watch(self)
            self._asyncio_future_blocking = True
            return self
        if state == A_CANCELLED:
            self._stop()
            raise self._cancelled_error()
        raise RuntimeError("await wasn't used with future")

    def send(self, value):
        """As ``next()``: a task sends nothing else."""
        return self.__next__()

    def throw(self, typ, val=None, tb=None):
        """Stop waiting and raise the exception thrown in (a cancellation)."""
        self._stop()
        _raise_thrown(typ, val, tb)

    def close(self):
        """Stop waiting (the awaiting coroutine is closed)."""
        self._stop()

    cdef _stop(self):
        if self._entry is not None:
            self._entry.watchlist.remove(self)  # a no-op once fired or removed
        self._wakeup = None
        self._context = None
        self._future = None
        self._state = A_FINISHED

    def __call__(self, record):
        """The waiter saw the record complete or fail: wake the task."""
        if self._state == A_WAITING:
            self._state = A_FIRED
            self._schedule()

    cdef inline object _fire_into(self, _Wakeups batch):
        """``__call__`` inside :func:`run_fired`: fired, its task's wake-up
        added to ``batch`` (scheduled by the caller) rather than scheduled
        on its own. Returns the batch to add the next wake-ups to: a new one
        (the caller schedules the old) where this await's loop is another."""
        if self._state != A_WAITING:
            return batch
        self._state = A_FIRED
        wakeup = self._wakeup
        if wakeup is None:
            return batch  # no task waits yet: add_done_callback schedules it
        self._wakeup = None  # breaks the cycle task -> self -> task, as _schedule
        context = self._context
        if context is None:  # as call_soon(context=None): the current context, copied now
            context = PyContext_CopyCurrent()
        if batch is None or batch.loop is not self._loop:
            batch = _new_wakeups(self._loop, [])
        batch.items.append(wakeup)
        batch.items.append(self)
        batch.items.append(context)
        return batch

    cdef _schedule(self):
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None  # breaks the cycle task -> self -> task
            self._loop.call_soon(wakeup, self, context=self._context)

    cdef _cancelled_error(self):
        message = self._message
        return _AsyncioCancelled() if message is None else _AsyncioCancelled(message)

    def get_loop(self):
        return self._loop

    def add_done_callback(self, fn, *, context=None):
        if self._wakeup is not None:
            raise RuntimeError("a cudafut await is waited on by one task only")
        self._wakeup = fn
        self._context = context
        if self._state == A_FIRED or self._state == A_CANCELLED:
            self._schedule()

    def remove_done_callback(self, fn):
        if self._wakeup is not None and self._wakeup == fn:
            self._wakeup = None
            return 1
        return 0

    def done(self):
        return self._state != A_WAITING and self._state != A_NEW

    def cancelled(self):
        return self._state == A_CANCELLED

    def result(self):
        """None once the record completed or failed; raises CancelledError
        if cancelled. (The task's wake-up calls it on every await: a C
        call, not a call of ``exception()``.)"""
        self._check_ready()
        return None

    def exception(self):
        self._check_ready()
        return None

    cdef inline int _check_ready(self) except -1:
        """Raise CancelledError if cancelled, InvalidStateError while not
        yet fired (as an asyncio future's ``result()``)."""
        cdef int state = self._state
        if state == A_CANCELLED:
            raise self._cancelled_error()
        if state == A_WAITING or state == A_NEW:
            raise _AsyncioInvalidState("Result is not ready.")
        return 0

    def cancel(self, msg=None):
        """Wake the task with CancelledError; False if the wait is over."""
        if self._state != A_WAITING:
            return False
        self._state = A_CANCELLED
        self._message = msg
        self._schedule()
        return True


cdef PyObject* _asyncio_await_next(PyObject* op) except NULL:
    """AsyncioAwait's tp_iternext: as its ``__next__``."""
    cdef AsyncioAwait self = <AsyncioAwait>op
    if self._state == A_FIRED or (self._state == A_NEW and _await_at_once):
        return _return(self._finished())
    out = self._step()
    Py_INCREF(out)
    return <PyObject*>out


_install_iternext(AsyncioAwait, _asyncio_await_next)


@cython.final
cdef class _Wakeups:
    """The wake-ups of tasks whose awaits one poll fired, in firing order,
    run by one loop callback: what ``loop.call_soon(wakeup, await,
    context=context)`` per await did, without a ``Handle`` (a Python-level
    ``call_soon`` and ``Handle._run`` each) per await. The ready queue's
    order is the same: the wake-ups were consecutive handles, and are now
    consecutive calls of one."""

    cdef object loop
    cdef list items  # wakeup, await, context; wakeup, await, context; ...

    def __call__(self):
        """Run every wake-up, each in its context (as ``Handle._run``: an
        ``Exception`` goes to the loop's exception handler and the rest run;
        ``KeyboardInterrupt`` or ``SystemExit`` propagates, the wake-ups not
        run yet scheduled again first, so no task is stranded)."""
        cdef list items = self.items
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t n = len(items)
        cdef PyObject* ahead
        cdef AsyncioAwait wait_ahead
        self.items = None  # run once
        while i < n:
            # The wake-ups run in firing order, a stream's records at a time:
            # their tasks, awaits and futures lie apart in memory, each a
            # cache miss the CPU would wait for. Ask for them a few wake-ups
            # ahead: first the objects this list names, then (named by those,
            # in cache by then) the task and the await's future and record.
            if i + 6 * _AHEAD < n:
                cudafut_prefetch(PyList_GET_ITEM(items, i + 6 * _AHEAD), 1)
                cudafut_prefetch(PyList_GET_ITEM(items, i + 6 * _AHEAD + 1), 2)
                cudafut_prefetch(PyList_GET_ITEM(items, i + 6 * _AHEAD + 2), 1)
            if i + 3 * _AHEAD < n:
                ahead = cudafut_bound_self(PyList_GET_ITEM(items, i + 3 * _AHEAD))
                if ahead != NULL:
                    cudafut_prefetch(ahead, 3)
                ahead = PyList_GET_ITEM(items, i + 3 * _AHEAD + 1)
                if cudafut_type(ahead) == <PyObject*>AsyncioAwait:
                    wait_ahead = <AsyncioAwait><object>ahead
                    cudafut_prefetch(<PyObject*>wait_ahead._future, 2)
                    cudafut_prefetch(<PyObject*>wait_ahead.record, 2)
            wakeup = items[i]
            wait = items[i + 1]
            context = items[i + 2]
            i += 3
            try:
                _run_in(context, wakeup, wait)
            except (SystemExit, KeyboardInterrupt):
                self._again(items, i)
                raise
            except BaseException as exc:
                try:
                    self._report(wakeup, wait, context, exc)
                except BaseException:  # the loop's handler raised SystemExit or KeyboardInterrupt
                    self._again(items, i)
                    raise

    cdef int _again(self, list items, Py_ssize_t i) except -1:
        """Schedule the wake-ups from ``items[i]`` on: an exception is
        leaving this callback, and no task may be stranded."""
        if i < len(items):
            self.loop.call_soon(_new_wakeups(self.loop, items[i:]))
        return 0

    cdef int _report(self, object wakeup, object wait, object context, object exc) except -1:
        """The loop's exception handler, given what ``Handle._run`` gives it
        (a handle made now, only for the report)."""
        import asyncio

        handle = asyncio.Handle(wakeup, (wait,), self.loop, context)
        self.loop.call_exception_handler(
            {"message": f"Exception in callback {wakeup!r}({wait!r})", "exception": exc, "handle": handle}
        )
        return 0

    cdef int schedule(self, object driver) except -1:
        """``loop.call_soon(self)``; a failure is the driver's to report,
        as each await's ``call_soon`` failing was (nothing propagates: the
        rest of the poll must run). A ``KeyboardInterrupt`` or
        ``SystemExit`` that landed inside ``call_soon`` (a signal) leaves the
        loop running: the batch is scheduled once more, or its tasks would
        never wake."""
        try:
            self.loop.call_soon(self)
        except BaseException as exc:
            driver.report("cudafut: exception in an internal wake-up callback", exc)
            if not isinstance(exc, Exception):
                try:
                    self.loop.call_soon(self)
                except BaseException as again:
                    driver.report("cudafut: exception in an internal wake-up callback", again)
        return 0


cdef _Wakeups _new_wakeups(object loop, list items):
    cdef _Wakeups batch = _Wakeups.__new__(_Wakeups)
    batch.loop = loop
    batch.items = items
    return batch


cdef inline object _run_in(object context, object fn, object arg):
    """``context.run(fn, arg)`` without the method call."""
    PyContext_Enter(context)  # raises where the context is entered already, as run() does
    try:
        return fn(arg)
    finally:
        PyContext_Exit(context)


def run_fired(driver, list fired):
    """``Driver.run_fired`` of the native core: run what a poll fired, in
    order (``callback(record)`` each, an exception reported by the driver).
    The wake-ups of asyncio tasks whose :class:`AsyncioAwait` fired are
    gathered, consecutive ones into one loop callback (:class:`_Wakeups`),
    scheduled before any other callback runs: the loop runs the tasks'
    steps in the order the old per-await ``call_soon`` did. Costs one C
    step per await and one ``call_soon`` per run of consecutive awaits
    (one per poll, in the common case), where a ``call_soon`` and a
    ``Handle`` per await went before; in the loop's debug mode each wake-up
    keeps its own handle (the slow-callback report names its task)."""
    cdef _Wakeups batch = None
    cdef _Wakeups fresh
    cdef AsyncioAwait wait
    cdef tuple pair
    cdef int debug = -1  # whether the loop runs in debug mode: asked at the first await
    for item in fired:
        pair = <tuple>item
        callback = pair[0]
        if type(callback) is AsyncioAwait:
            wait = <AsyncioAwait>callback
            if debug < 0:
                debug = 1 if wait._loop.get_debug() else 0
            if not debug:
                fresh = wait._fire_into(batch)
                if fresh is not batch:
                    if batch is not None:
                        batch.schedule(driver)
                    batch = fresh
                continue
        if batch is not None:
            batch.schedule(driver)
            batch = None
        try:
            callback(pair[1])
        except BaseException as exc:  # no callback may kill the poller or strand the rest
            driver.report("cudafut: exception in an internal wake-up callback", exc)
    if batch is not None:
        batch.schedule(driver)


cdef inline int _fill(AsyncioAwait wait, AsyncioEntry entry, object loop, object future, object record,
                      object finish) except -1:
    """A new AsyncioAwait's state: ``__init__``'s, and ``AsyncioEntry._make``'s
    (which skips ``__init__``)."""
    wait.record = record
    wait.seq = (<EventRecord>record).seq if type(record) is EventRecord else record.seq
    wait.callback = None
    wait._entry = entry
    wait._loop = loop
    wait._future = future
    wait._finish = finish
    wait._state = A_NEW
    wait._asyncio_future_blocking = False
    wait._checked_in = 0
    return 0


# The entry of the asyncio loop that awaited last, tried first: most awaits
# run in the loop of the one before. Weakly: a closed loop's driver and its
# watches go with the loop.
cdef object _last_entry = None


@cython.final
cdef class AsyncioEntry:
    """The native side of one asyncio loop's waiter (``_loops.AsyncioDriver``):
    what ``await`` of a pending future needs of it, as C members, so that
    an await among other pending waits makes no Python-level call of
    cudafut's own but the driver's ``ensure_polling()`` (the twin's path:
    ``current_driver()``, ``AsyncioDriver.await_one()``, ``Driver.watch()``).

    Every wait starts a spin and a poll, as ``Driver.watch`` does: the
    driver's pacer and ``ensure_polling()``, read from ``driver`` at each
    wait. A lone wait (nothing pending) is the
    driver's to decide (it may spin from the task): not handled here."""

    cdef object _loop  # a weak reference
    cdef readonly Watchlist watchlist
    cdef object _driver  # (it owns this entry: the cycle is the collector's, as a bound method's was)
    cdef object __weakref__

    def __init__(self, loop, Watchlist watchlist not None, driver):
        self._loop = weakref.ref(loop)
        self.watchlist = watchlist
        self._driver = driver

    def await_one(self, future, record, finish):
        """``AsyncioDriver.await_one`` once it found other waits pending:
        the one object that does the wait (an :class:`AsyncioAwait`); this
        entry is tried first by the next await (:func:`_entry_await`)."""
        global _last_entry
        loop = _weak_get(self._loop)
        if loop is None:
            return None
        if _last_entry is None or _weak_get(_last_entry) is not self:
            _last_entry = weakref.ref(self)
        return self._make(loop, future, record, finish)

    cdef AsyncioAwait _make(self, object loop, object future, object record, object finish):
        cdef AsyncioAwait wait = AsyncioAwait.__new__(AsyncioAwait)
        _fill(wait, self, loop, future, record, finish)
        return wait

    cdef int _watch(self, Watch watch) except -1:
        """``Driver.watch``: the driver's pacer starts a spin (from C where
        it is the native :class:`Pacer`), the driver a poll (its
        ``ensure_polling()``, the one Python call of an await among
        others, skipped while a poll is queued), and the watch is added."""
        # First, as Driver.watch: if they raise, no watch is left behind.
        driver = self._driver
        pacer = driver.pacer
        if type(pacer) is Pacer:
            (<Pacer>pacer)._new_wait(_now())
        else:
            pacer.new_wait(_now())
        # ensure_polling() returns at once where a poll is queued already
        # (spinning: the common case of many awaits): not called then, one
        # Python frame fewer per await.
        if driver._mode != _LOOP_SPIN:
            driver.ensure_polling()
        self.watchlist._add_watch(watch)
        return 0


cdef AsyncioEntry _entry_here():
    """The :class:`AsyncioEntry` of the running loop where it is the asyncio
    loop that awaited last and other waits are pending there, else None (the
    caller then asks the loop's driver: a lone wait is the driver's, which
    may spin from the task)."""
    cdef AsyncioEntry entry
    if _last_entry is None:
        return None
    e = _weak_get(_last_entry)
    if e is None:
        return None
    entry = <AsyncioEntry>e
    if entry.watchlist.pending == 0:
        return None
    loop = _weak_get(entry._loop)
    if loop is None or _get_running_loop() is not loop:
        return None
    return entry


cdef object _entry_await(AsyncioEntry entry, FutureCore fut, EventRecord rec):
    """``await fut`` of a pending record in the loop of ``entry`` (from
    :func:`_entry_here`): its :class:`AsyncioAwait`, made from C."""
    cdef AsyncioAwait wait
    loop = _weak_get(entry._loop)
    if loop is None:  # (a finalizer the query ran may have ended it)
        return _await_py(fut, True)
    wait = entry._make(loop, fut, rec, awaited)
    wait._checked_in = PyThread_get_thread_ident()  # its first next() needs no second look
    return wait
