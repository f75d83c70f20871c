"""The seam to CUDA: the only module that imports CuPy.

Everything here is a thin, typed wrapper over ``cupy.cuda.runtime``. CuPy is
imported on first use, so ``import cudafut`` works on a machine without a GPU;
the first call that needs CUDA raises :class:`CudaUnavailableError` with the
reason.

Costs (measured with CuPy 14.2, see docs/performance.md): an event record is
under 1 µs, a query about 1.7 µs and holds the GIL, a stream wait about
0.4 µs and releases the GIL.

The native core (cudafut/_core.pyx) makes the event calls of its records
from C where it can, and comes here for the rest; each record asks the
backend that made it through :class:`RecordCalls`, so that the fake's
records never reach CUDA.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, Protocol

from . import _compiled, _lifetimes, _log
from ._errors import CudaError, CudaUnavailableError

#: ``cudaErrorNotReady``: what a query returns while the work is pending.
NOT_READY = 600

# cudaStreamLegacy and cudaStreamPerThread: handles that stand for "the
# default stream of the current device (and, for per-thread, thread)".
_SPECIAL_STREAMS = (0, 1, 2)

# Re-entrant: a finalizer the garbage collector runs during the first
# initialisation (a cudafut-allocated block's, which records an event) calls
# runtime() on the same thread; the nested call initialises, and the hooks
# it runs twice (the allocator's install) do nothing the second time.
_init_lock = threading.RLock()
#: Called with the cupy module once CUDA is found usable (see on_initialise()).
_init_hooks: list[Callable[[Any], None]] = []
_cupy: Any = None
_rt: Any = None
_count = 0

_DRIVER_HINTS = {
    35: (
        "the NVIDIA driver is missing or older than the CUDA version CuPy was "
        "built for; install a newer driver, or the cudafut extra that matches "
        "it ('cudafut[cuda12]' or 'cudafut[cuda13]')"
    ),
    100: ("no CUDA-capable device is visible; check `nvidia-smi` and the CUDA_VISIBLE_DEVICES variable"),
    3: "the CUDA driver failed to initialise; check `nvidia-smi` and dmesg",
    999: "the CUDA driver reported an unknown error; check `nvidia-smi`",
}

#: Ends every message of a machine without a usable GPU: the fake GPU.
NO_GPU_TESTING: Final = "or test without a GPU: cudafut.testing (docs/testing.md)"

_FORK_MESSAGE = (
    "CUDA cannot be used in a process forked after CUDA was initialised in its "
    "parent (CUDA does not survive fork()); start worker processes with "
    "multiprocessing's 'spawn' or 'forkserver' method, or initialise CUDA only "
    "in the children"
)


class _Forked:
    """Stands in for CuPy in a forked child: every use raises, clearly."""

    def __getattr__(self, name: str) -> Any:
        raise CudaUnavailableError(_FORK_MESSAGE)


#: True in a child forked after CUDA was initialised: see check_usable().
forked = False


def _after_fork_in_child() -> None:
    global _cupy, _rt, forked, _notice_lock
    if _rt is not None:  # CUDA was initialised in the parent
        _cupy = _rt = _Forked()
        forked = True
    # The parent's notice streams (handles: nothing to destroy) and helpers
    # (not copied by fork) are not the child's.
    _notice_lock = threading.Lock()  # another thread may have held it at the fork
    for table in (_notice_pool, _notice_turn, _notice_broken):
        table.clear()
    _notice_making.clear()
    _primary_contexts.clear()  # the child has no CUDA context (forked)
    _notice_events.clear()


def check_usable() -> None:
    """Raise the fork error in a forked child (a flag test: costs nothing).

    Called at every entry point, because some calls would otherwise reach
    CuPy through an array (``__cuda_array_interface__``) or return a value
    the parent computed as if nothing had happened."""
    if forked:
        raise CudaUnavailableError(_FORK_MESSAGE)


_lifetimes.at_fork_in_child(_after_fork_in_child)


def runtime() -> Any:
    """``cupy.cuda.runtime``, after checking once that CUDA is usable."""
    rt = _rt
    if rt is None:
        rt = _initialise()
    return rt


def cupy() -> Any:
    """The ``cupy`` module, after checking once that CUDA is usable."""
    if _rt is None:  # set last, after the hooks (the allocator's wrapper) ran
        _initialise()
    return _cupy


def _initialise() -> Any:
    global _cupy, _rt, _count
    with _init_lock:
        if _rt is not None:
            return _rt
        try:
            # import_module, not an import statement: compiled, the statement
            # would take a None in sys.modules (a blocked CuPy) for the module.
            cp = importlib.import_module("cupy")
        except ImportError as exc:
            raise CudaUnavailableError(
                "CuPy is not installed. Install cudafut with the extra that "
                "matches your CUDA driver: pip install 'cudafut[cuda12]' or "
                f"'cudafut[cuda13]'; {NO_GPU_TESTING}"
            ) from exc
        rt = cp.cuda.runtime
        try:
            count = rt.getDeviceCount()
        except rt.CUDARuntimeError as exc:
            hint = _DRIVER_HINTS.get(exc.status, "CUDA could not be initialised")
            raise CudaUnavailableError(f"{hint} (CUDA said: {exc}); {NO_GPU_TESTING}") from exc
        if count == 0:
            raise CudaUnavailableError(f"{_DRIVER_HINTS[100]}; {NO_GPU_TESTING}")
        _cupy, _count = cp, count
        for hook in _init_hooks:
            hook(cp)
        _rt = rt
        return rt


def on_initialise(hook: Callable[[Any], None]) -> None:
    """Call ``hook(cupy)`` when cudafut first finds CUDA usable (at once if
    it has), and, if CuPy is imported already, now: hooks must not need the
    GPU (the allocator wrapper of ``_memory``)."""
    _init_hooks.append(hook)
    cp = _cupy if _cupy is not None else sys.modules.get("cupy")
    if cp is not None and hasattr(cp, "cuda"):
        hook(cp)


def device_count() -> int:
    """Number of visible CUDA devices; raises if CUDA is unusable."""
    runtime()
    return _count


def check_device(device: object) -> int:
    """Validate a device index and return it as an int.

    The argument is checked before CUDA is touched, so a wrong type or a
    negative index is a ``TypeError`` or ``ValueError`` even where CUDA
    cannot be used; only an index that may exist needs the device count.

    Raises:
        TypeError: ``device`` is not an int.
        ValueError: ``device`` is negative, or not below the device count.
        CudaUnavailableError: CUDA cannot be used here.
    """
    if type(device) is int and 0 <= device < _count:
        return device  # the common case, once CUDA is initialised
    device = check_device_argument(device)
    n = device_count()
    if not 0 <= device < n:
        raise ValueError(
            f"device {device} is out of range: this process sees {n} CUDA "
            f"device(s), numbered 0 to {n - 1} (see CUDA_VISIBLE_DEVICES)"
        )
    return device


def check_device_argument(device: object) -> int:
    """What can be checked of a device index without CUDA: an int, not negative.

    Raises:
        TypeError: ``device`` is not an int.
        ValueError: ``device`` is negative.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"a device is an int index (a CUDA device ordinal: 0, 1, ...), not {device!r}")
    if device < 0:
        raise ValueError(
            f"device {device} is out of range: CUDA devices are numbered from 0 (see CUDA_VISIBLE_DEVICES)"
        )
    return device


def current_device() -> int:
    return int(runtime().getDevice())


class on_device:  # noqa: N801 - used as a function: ``with on_device(d):``
    """Make ``device`` current for the block, restoring the previous one.

    Costs one ``cudaGetDevice``, plus two ``cudaSetDevice`` when the
    device is not current already. A class rather than a
    ``contextlib.contextmanager``: the copies and event calls enter one or
    more per operation, and a generator-based context costs about 1 µs
    more each. One instance serves one ``with`` at a time."""

    __slots__ = ("_device", "_prev", "_rt")

    def __init__(self, device: int) -> None:
        self._device = device

    def __enter__(self) -> None:
        rt = self._rt = runtime()
        prev = self._prev = rt.getDevice()
        if prev != self._device:
            rt.setDevice(self._device)

    def __exit__(self, *exc: object) -> None:
        if self._prev != self._device:
            self._rt.setDevice(self._prev)


def current_stream(device: int) -> Any:
    """CuPy's current stream of ``device`` for the calling thread."""
    if _rt is None:
        runtime()
    return _cupy.cuda.get_current_stream(device)


def stream_handle(stream: object) -> tuple[int, int]:
    """``(cudaStream_t, device)`` of a stream object, wherever cudafut takes one.

    Accepted, tried in this order:

    - a CuPy stream (``cupy.cuda.Stream``, ``cupy.cuda.ExternalStream``):
      its ``ptr`` and ``device_id``;
    - a PyTorch stream: its ``cuda_stream`` and ``device_index``;
    - any object implementing the CUDA stream protocol: ``__cuda_stream__``,
      a method (or attribute) giving ``(0, handle)`` (``cuda.core`` and
      Numba streams, CuPy 14 streams, ...).

    The device, where the object does not carry it: its ``device_id`` or
    ``device_index`` attribute (an int), else its ``device`` attribute (an
    int, or an object with an int ``device_id``, ``id`` or ``index``:
    ``cuda.core``'s ``Device``, CuPy's, ``torch.device``), else asked from
    CUDA: the device of the context the stream belongs to
    (``cuStreamGetCtx``, as ``cuda.core`` does, about a µs). The default
    streams (handles 0, 1 and 2) belong to the current device.

    The kind of object is checked before CUDA is touched.

    What can be checked of the handle is, before CUDA sees it: CUDA does not
    validate stream handles (a stream is a pointer to the driver's own
    structure, which it reads: an unknown one crashes the process), so a
    handle that is not even an address of this process's memory (``0x1234``,
    a number from elsewhere) is a ``ValueError`` (Linux: ``mincore``, about
    a µs). A handle that points into mapped memory but at no live stream (a
    stream already destroyed, a pointer to something else) cannot be told
    apart without the risk of the crash; CUDA may then crash the process,
    or fail a later call with a :class:`CudaError`.

    Raises:
        TypeError: ``stream`` is none of these, or its ``__cuda_stream__``
            does not give a ``(version, handle)`` pair of ints.
        ValueError: a protocol version other than 0, a negative handle, or
            a handle that is no address of this process (see above), or
            one CUDA says it does not know.
    """
    cuda = getattr(sys.modules.get("cupy"), "cuda", None)  # no import: not a CuPy stream then
    if cuda is not None and isinstance(stream, (cuda.Stream, cuda.ExternalStream)):
        handle, device_id = check_stream_address(int(stream.ptr), stream), int(stream.device_id)
        return handle, device_id if device_id >= 0 else stream_device(handle)
    ptr = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    device = getattr(stream, "device_index", None)
    if isinstance(ptr, int) and isinstance(device, int):
        return check_stream_address(ptr, stream), device
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is None:
        raise TypeError(
            "stream must be a CuPy stream (cupy.cuda.Stream, cupy.cuda.ExternalStream), a "
            "PyTorch stream (torch.cuda.Stream), or an object with __cuda_stream__ (the CUDA "
            f"stream protocol: cuda.core and Numba streams, ...), not {type(stream).__name__}"
        )
    handle = _protocol_handle(protocol() if callable(protocol) else protocol, stream)
    return handle, _protocol_device(stream, handle)


def _protocol_handle(info: object, stream: object) -> int:
    """The handle of a ``__cuda_stream__`` answer, ``(0, handle)``, checked."""
    name = type(stream).__name__
    if not isinstance(info, tuple) or len(info) != 2:
        raise TypeError(f"{name}.__cuda_stream__ must give a (version, handle) tuple, not {info!r}")
    version, handle = info
    if version != 0:
        raise ValueError(
            f"{name}.__cuda_stream__ gives protocol version {version!r}: cudafut reads "
            "version 0, (0, cudaStream_t address)"
        )
    if isinstance(handle, (bool, float, str, bytes)):
        raise TypeError(f"{name}.__cuda_stream__ must give an int handle, not {handle!r}")
    try:
        handle = int(handle)  # an int, an IntEnum, a cuda.bindings CUstream
    except TypeError:
        raise TypeError(f"{name}.__cuda_stream__ must give an int handle, not {handle!r}") from None
    if handle < 0:
        raise ValueError(f"{name}.__cuda_stream__ gives a negative handle ({handle})")
    return check_stream_address(handle, stream)


#: The size of a memory page, as :func:`check_stream_address` reads them.
PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_mincore: Any = None


#: Pages seen mapped (a stream's structure lives in the driver's heap, which
#: is seldom unmapped): a handle on one of them costs a set lookup.
_mapped_pages: set[int] = set()
_MAPPED_PAGES_KEPT: Final = 1024
# mincore's output, one byte per page (its value is not used).
_page_state = ctypes.c_ubyte()


def _load_mincore() -> Any:
    """libc's ``mincore``, or False where it cannot be had (not Linux)."""
    global _mincore
    fn: Any = False
    if sys.platform.startswith("linux"):
        try:
            fn = ctypes.CDLL(None, use_errno=True).mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = False
    _mincore = fn
    return fn


def mapped_pages() -> set[int]:
    """The pages :func:`check_stream_address` found mapped (the set itself,
    kept for the process's life): a handle on one of them needs no check."""
    return _mapped_pages


def check_stream_address(handle: int, stream: object) -> int:
    """``handle``, if it may be a stream of this process: one of the default
    streams (0, 1, 2), or an address in memory this process has mapped.

    A stream handle is the address of the driver's structure for it, and
    CUDA reads that structure without checking it first: an address nothing
    is mapped at crashes the process. ``mincore`` on its page says whether
    it is mapped, about a µs, without reading it (Linux; elsewhere nothing
    is checked).

    Raises:
        ValueError: ``handle`` is out of the address space, or nothing is
            mapped at it.
    """
    if handle in _SPECIAL_STREAMS:
        return handle
    name = type(stream).__name__
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"{name} gives the stream handle {handle}, which is not an address")
    page = handle - handle % PAGE_SIZE
    if page in _mapped_pages:
        return handle
    mincore = _mincore
    if mincore is None:
        mincore = _load_mincore()
    if mincore is False:
        return handle
    if mincore(page, PAGE_SIZE, ctypes.byref(_page_state)) == 0:
        if len(_mapped_pages) >= _MAPPED_PAGES_KEPT:
            _mapped_pages.clear()
        _mapped_pages.add(page)
    elif ctypes.get_errno() in (errno.ENOMEM, errno.EINVAL):
        raise ValueError(
            f"{name} gives the stream handle {handle:#x}, which is not a CUDA stream of this "
            "process (nothing is mapped at that address; CUDA would crash reading it): pass the "
            "stream object itself, or the handle of a live stream (cudaStream_t)"
        )
    return handle


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _protocol_device(stream: object, handle: int) -> int:
    """The device of a ``__cuda_stream__`` object (see :func:`stream_handle`)."""
    for attr in ("device_id", "device_index"):
        index = getattr(stream, attr, None)
        if _is_index(index):
            return index  # type: ignore[return-value]
    device = getattr(stream, "device", None)
    if _is_index(device):
        return device  # type: ignore[return-value]
    for attr in ("device_id", "id", "index"):  # cuda.core Device, cupy Device, torch.device
        index = getattr(device, attr, None)
        if _is_index(index):
            return index  # type: ignore[return-value]
    return stream_device(handle)


def stream_device(stream: int) -> int:
    """The device a stream belongs to: that of its CUDA context
    (``cuStreamGetCtx``); the default streams (0, 1, 2) are the current
    device's. About a µs on the host; the GPU is not involved.

    Raises:
        ValueError: CUDA does not know the handle.
    """
    if stream in _SPECIAL_STREAMS:
        return current_device()
    runtime()
    driver = _cupy.cuda.driver
    try:
        context = driver.streamGetCtx(stream)
    except driver.CUDADriverError as exc:
        raise ValueError(f"{stream:#x} is not a CUDA stream of this process ({exc})") from exc
    current = driver.ctxGetCurrent()
    if current == context:
        return int(driver.ctxGetDevice())
    driver.ctxSetCurrent(context)
    try:
        return int(driver.ctxGetDevice())
    finally:
        driver.ctxSetCurrent(current)


def new_stream(device: int, priority: int) -> Any:
    """A new non-blocking CuPy stream on ``device``.

    CUDA clamps ``priority`` into the device's range, so a large negative
    number asks for the highest priority the device has.
    """
    with on_device(device):
        return _cupy.cuda.Stream(non_blocking=True, priority=priority)


def cupy_stream(stream: object, ptr: int, device: int) -> Any:
    """A CuPy stream object for ``stream`` (whose handle is ``ptr``, on
    ``device``), to make it CuPy's current stream: ``stream`` itself if it
    is one, else a non-owning CuPy wrapper (the caller keeps ``stream``
    alive)."""
    cp = cupy()
    if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
        return stream
    # CuPy 14 deprecates ExternalStream(ptr) for the stream protocol;
    # from_external takes the current device.
    with on_device(device):
        return cp.cuda.Stream.from_external(_Handle(ptr))


class _Handle:
    """A bare stream handle, under the ``__cuda_stream__`` protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def call_on_streams(
    streams: Mapping[int, Any], primary: int, fn: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Call ``fn(*args, **kwargs)`` with each ``streams[device]`` current for
    its device and ``primary`` the current device, in the calling thread;
    restore the previous state however ``fn`` ends."""
    rt = _rt
    prev = rt.getDevice()
    entered: list[Any] = []
    try:
        for device, stream in streams.items():
            if rt.getDevice() != device:
                rt.setDevice(device)
            stream.__enter__()
            entered.append(stream)
        if rt.getDevice() != primary:
            rt.setDevice(primary)
        return fn(*args, **kwargs)
    finally:
        # CuPy pops in LIFO order and remembers each stream's device itself.
        for stream in reversed(entered):
            stream.__exit__(None, None, None)
        if rt.getDevice() != prev:
            rt.setDevice(prev)


def event_create(device: int) -> int:
    """A new event on ``device``, created with timing disabled (cheapest).
    Not blocking-sync: such events cost more to query and wait on, and
    10,000 awaits with them stalled a loop for the GPU's whole busy time
    (the notices' own events are blocking-sync: :func:`close_after`)."""
    rt = runtime()
    with on_device(device):
        return int(rt.eventCreateWithFlags(rt.eventDisableTiming))


def event_destroy(event: int) -> None:
    runtime().eventDestroy(event)


def timing_event_create(device: int) -> int:
    """A new event on ``device`` with timing enabled (for tracing only:
    recording one costs a little more than a timing-disabled event)."""
    rt = runtime()
    with on_device(device):
        return int(rt.eventCreateWithFlags(rt.eventDefault))


def event_elapsed_ms(start: int, end: int) -> float:
    """``cudaEventElapsedTime``: ms from ``start`` to ``end`` (both complete,
    both timing events of one device); negative if ``end`` ran first."""
    return float(_rt.eventElapsedTime(start, end))


def event_record(event: int, stream: int, device: int) -> None:
    """Record ``event`` on ``stream`` of ``device`` (under 1 µs, no wait)."""
    if stream in _SPECIAL_STREAMS:
        _on_device_of(device, _rt.eventRecord, event, stream)
    else:  # the common case, without the call: an explicit stream carries its device
        _rt.eventRecord(event, stream)


def event_query(event: int) -> int:
    """Raw ``cudaEventQuery`` status: 0 done, 600 pending, else an error.

    Non-blocking, holds the GIL (CuPy does not release it here).
    """
    return int(_rt.eventQuery(event))


def event_error(code: int, device: int) -> CudaError:
    """The :class:`CudaError` of an event that reported ``code`` (a runtime
    ``cudaError_t``) on ``device``."""
    return cuda_error(code, device)


def stream_wait(stream: int, event: int, device: int) -> None:
    """Make ``stream`` (on ``device``) wait for ``event``; the host does not wait."""
    if stream in _SPECIAL_STREAMS:
        _on_device_of(device, _rt.streamWaitEvent, stream, event)
    else:
        _rt.streamWaitEvent(stream, event)


# -- notices: CUDA closes a file descriptor when work ends ------------------------------

# libcuda's cuLaunchHostFunc and libc's close(), loaded on the first notice;
# False where they cannot be had.
_host_close: Any = None
# Per device, the streams notices wait on (handles, never destroyed), made
# all at once by a helper thread on the device's first notice; the next to
# try; whether the helper is still making them; why it could not. Creating
# a stream can wait for the GPU's running work to end, while holding a lock
# that other CUDA calls need, and CuPy holds the GIL through it
# (docs/design.md, hazard 11): so streams are made once, off the calling
# thread, through the driver with the GIL released, and never again.
_notice_pool: dict[int, list[int]] = {}
_notice_turn: dict[int, int] = {}
_notice_making: set[int] = set()
_notice_broken: dict[int, BaseException] = {}
_NOTICE_STREAMS_PER_DEVICE: Final = 32
# Idle notice streams looked for per request (a stream query each).
_NOTICE_TRIES: Final = 4
# The driver's calls that make a stream without the GIL (ctypes releases
# it), loaded with cuLaunchHostFunc.
_stream_calls: Any = None
_notice_lock = threading.Lock()
# cuEventCreate, loaded with cuLaunchHostFunc; the blocking-sync event of
# each notice stream (for the native notice threads), never destroyed.
_notice_event_create: Any = None
_notice_events: dict[int, int] = {}
_BLOCKING_SYNC_NO_TIMING: Final = 0x1 | 0x2  # CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING
# cuLaunchHostFunc's refusals that queue nothing: the descriptor is still ours.
# (Any other code may come from earlier work, with the function queued.)
_REFUSED_BEFORE_QUEUEING: Final = frozenset({1, 3, 4, 201, 400, 800, 801})


def _load_host_close() -> Any:
    global _host_close, _stream_calls, _notice_event_create
    with _notice_lock:
        if _host_close is None:
            try:
                libcuda = ctypes.CDLL("libcuda.so.1")
                launch = libcuda.cuLaunchHostFunc
                launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                launch.restype = ctypes.c_int
                close = ctypes.cast(ctypes.CDLL(None).close, ctypes.c_void_p).value
                calls = []
                for name in (
                    "cuDeviceGet",
                    "cuDevicePrimaryCtxRetain",
                    "cuCtxPushCurrent_v2",
                    "cuCtxPopCurrent_v2",
                    "cuStreamCreateWithPriority",
                ):
                    call = getattr(libcuda, name)
                    call.restype = ctypes.c_int
                    calls.append(call)
                _stream_calls = tuple(calls)
                _notice_event_create = libcuda.cuEventCreate
                _notice_event_create.restype = ctypes.c_int
                _host_close = (launch, close)
            except (OSError, AttributeError):
                _host_close = False
    return _host_close


def _new_stream_handle(device: int) -> int:
    """A new non-blocking stream on ``device``'s primary context (the
    runtime's), made through the driver with the GIL released: it may wait
    for the GPU (hazard 11). The caller owns the handle; cudafut never
    destroys these."""
    if _stream_calls is None and _load_host_close() is False:
        raise CudaUnavailableError("no libcuda.so.1 to make a notice stream with")
    device_get, retain, push, pop, create = _stream_calls
    dev, context, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    rc = device_get(ctypes.byref(dev), device)
    if rc:
        raise cuda_error(rc, device, driver=True)
    # One reference to the primary context per stream, never released:
    # the runtime holds it for the life of the process anyway.
    rc = retain(ctypes.byref(context), dev)
    if rc:
        raise cuda_error(rc, device, driver=True)
    rc = push(context)
    if rc:
        raise cuda_error(rc, device, driver=True)
    event = ctypes.c_void_p()
    try:
        rc = create(ctypes.byref(stream), 1, 0)  # CU_STREAM_NON_BLOCKING, default priority
        # The stream's own event for native notices, blocking-sync (a thread
        # waiting on it sleeps in the driver); none: host functions serve.
        if (
            not rc
            and _notice_event_create is not None
            and _notice_event_create(ctypes.byref(event), _BLOCKING_SYNC_NO_TIMING)
        ):
            event.value = None
    finally:
        pop(ctypes.byref(ctypes.c_void_p()))
    if rc:
        raise cuda_error(rc, device, driver=True)
    handle = int(stream.value or 0)
    if event.value:
        _notice_events[handle] = int(event.value)
        _primary_contexts.setdefault(device, int(context.value or 0))
    return handle


def _make_notice_streams(device: int) -> None:
    # The helper thread's work: the device's notice streams, shown to
    # callers only once all are made (until then, a stream query could
    # wait behind a creation that waits for the GPU).
    made: list[int] = []
    failure: BaseException | None = None
    try:
        for _ in range(_NOTICE_STREAMS_PER_DEVICE):
            made.append(_new_stream_handle(device))
    except BaseException as exc:  # noqa: BLE001 - kept for the next caller, or logged
        failure = exc
    # Logged before the streams are shown: whoever sees the helper done sees its log too.
    if not made and not isinstance(failure, (CudaError, CudaUnavailableError, type(None))):
        # Callers get a CudaError with CUDA's "unknown" code: the cause is here.
        _log.logger.warning(
            "cudafut: no notice stream made on device %d; notices are off there",
            device,
            exc_info=failure,
        )
    if made and failure is not None:
        _log.logger.warning(
            "cudafut: made %d of %d notice streams on device %d; notices use those",
            len(made),
            _NOTICE_STREAMS_PER_DEVICE,
            device,
            exc_info=failure,
        )
    with _notice_lock:
        if made:
            _notice_pool[device] = made
        elif failure is not None:  # none made: every caller is told why
            if isinstance(failure, (CudaError, CudaUnavailableError)):
                _notice_broken[device] = failure
            else:
                _notice_broken[device] = cuda_error(getattr(failure, "status", 999), device)
        _notice_making.discard(device)


# At most this many native notice threads, each blocked on one notice
# stream's event (one notice per stream per loop at a time).
_NATIVE_NOTICE_THREADS: Final = 64
# The compiled waker once started, False where it cannot be (not built,
# CUDAFUT_PURE=1, no libcuda), None before the first notice; whether to
# use it (set_native_notices: the benchmarks compare both kinds).
_waker: Any = None
_native_notices = True
# Each device's primary context, retained with its notice streams.
_primary_contexts: dict[int, int] = {}


def set_native_notices(enabled: bool) -> bool:
    """Deliver notices by native notice threads where they are built (the
    default) or by CUDA host functions; returns the previous setting. For
    the benchmarks and tests, which compare the two in one process."""
    global _native_notices
    previous, _native_notices = _native_notices, bool(enabled)
    return previous


def _load_waker() -> Any:
    global _waker
    waker: Any = False
    if not _compiled.PURE:
        try:
            from . import _waker as waker
        except ImportError:
            waker = False
        else:
            if not waker.start(_NATIVE_NOTICE_THREADS):
                waker = False
    _waker = waker
    return waker


def notice_stream(device: int) -> int | None:
    """An idle stream of ``device`` for one notice (:func:`close_after`), or
    None where none is idle or they are still being made: the caller then
    polls instead. Up to 4 stream queries (a few µs, holding the GIL),
    made outside the module's lock.

    A device's first call starts a helper thread (about 50 µs) that makes
    its 32 notice streams, kept for the life of the process: CUDA may wait
    for the GPU to make a stream (docs/design.md, hazard 11), so none is
    made on the caller's thread, nor ever again. While the helper waits
    so, other CUDA calls of the process, the caller's polls included, may
    wait behind it: once per device. An idle stream has no notice queued:
    the caller's notice then waits for no other (two threads asking at
    once may still be given the same one: a notice then comes late).

    Raises:
        CudaError: the helper could not make any stream (a new error each
            time, with the code CUDA gave).
        CudaUnavailableError: no ``libcuda`` (as ``close_after``), or a
            forked child.
    """
    check_usable()
    with _notice_lock:
        pool = _notice_pool.get(device)
        if pool is None:
            broken = _notice_broken.get(device)
            if broken is not None:
                # A new exception each time: raising the stored one again
                # would grow its traceback, and keep every caller's frames.
                if isinstance(broken, CudaError):
                    raise CudaError(broken.code, broken.name, broken.description, device=device)
                raise CudaUnavailableError(str(broken))
            if device not in _notice_making:
                _notice_making.add(device)
                try:
                    threading.Thread(
                        target=_make_notice_streams,
                        args=(device,),
                        name="cudafut-notice-streams",
                        daemon=True,
                    ).start()
                except BaseException:
                    _notice_making.discard(device)
                    raise
            return None
        turn = _notice_turn.get(device, 0)
        _notice_turn[device] = turn + _NOTICE_TRIES
        candidates = [pool[(turn + i) % len(pool)] for i in range(min(len(pool), _NOTICE_TRIES))]
    for stream in candidates:
        if _rt.streamQuery(stream) == 0:  # idle: no notice queued there
            return stream
    return None


def close_after(record: Any, fd: int, stream: int) -> None:
    """Have CUDA close ``fd`` once the work before ``record``'s event is
    done: ``stream`` (from :func:`notice_stream`) waits for the event,
    then runs a host function that is libc's ``close`` itself. No Python
    runs on CUDA's thread, and nothing takes the GIL there (docs/design.md,
    hazard 1). A few µs on the calling thread; blocks neither it nor the
    GPU. Notices on one stream run in the order they were asked for.

    Takes ``fd``, whatever happens: the caller never closes it. If the
    launch was not attempted, or CUDA refused it before queueing anything
    (an invalid value, handle or context, not supported or permitted), it
    is closed here before raising; after any other refusal it is left open
    (the code may report earlier work, with the function queued, and
    closing the number twice would close whatever file took it next).
    CUDA runs no host function after a context error (hazard 2), so ``fd``
    may never be closed: callers keep a poll to fall back on.

    Where the compiled waker is built (``cudafut._waker``, and not
    ``CUDAFUT_PURE=1``), a native notice thread closes ``fd`` instead of a
    host function: ``stream`` waits for the event and records its own
    blocking-sync event, and the thread blocks in ``cuEventSynchronize`` on
    that (sleeping in the driver, no GIL), then closes ``fd``. Unlike a host
    function it returns after a context error too (hazard 2). Queueing it
    costs a stream wait, an event record and a list append (a thread is
    started, tens of µs, when none is idle); with every thread busy, the
    host function serves.

    Raises:
        CudaUnavailableError: no ``libcuda`` to launch host functions with.
        CudaError: the notice could not be set up or launched.
    """
    native = _notice_events.get(int(stream)) if _native_notices else None
    if native is not None and (_waker if _waker is not None else _load_waker()):
        try:
            device = record.device
            stream_wait(int(stream), record.handle, device)
            runtime().eventRecord(native, int(stream))
            if _waker.notice(_primary_contexts[device], native, fd):
                return
        except BaseException as exc:
            os.close(fd)  # nothing queued that closes it
            if isinstance(exc, (CudaError, CudaUnavailableError)) or not isinstance(exc, Exception):
                raise
            raise cuda_error(getattr(exc, "status", 999), record.device) from exc
        # Every notice thread busy: the host function, after the wait queued.
    try:
        loaded = _host_close if _host_close is not None else _load_host_close()
        if loaded is False:
            raise CudaUnavailableError("cuLaunchHostFunc is not available (no libcuda.so.1)")
        launch, close = loaded
        device = record.device
        ptr = int(stream)
        stream_wait(ptr, record.handle, device)
        previous = _rt.getDevice()
        if previous != device:
            _rt.setDevice(device)
    except BaseException as exc:
        os.close(fd)  # not launched: still ours
        if isinstance(exc, (CudaError, CudaUnavailableError)) or not isinstance(exc, Exception):
            raise
        raise cuda_error(getattr(exc, "status", 999), record.device) from exc
    try:
        rc = launch(ptr, close, fd)
    finally:
        if previous != device:
            try:
                _rt.setDevice(previous)
            except Exception:  # noqa: BLE001 - the notice is queued: never raise past it
                _log.logger.warning(
                    "cudafut: could not make device %d current again after a notice", previous, exc_info=True
                )
    if rc:
        if rc in _REFUSED_BEFORE_QUEUEING:
            os.close(fd)
        raise cuda_error(rc, device)


def _on_device_of(device: int, call: Callable[[int, int], object], a: int, b: int) -> None:
    # For a special stream handle only (the callers test for it): it means
    # "the default stream of the *current* device", so switch to the device
    # it is meant for; an explicit stream carries its device itself.
    if _rt.getDevice() != device:
        with on_device(device):
            call(a, b)
    else:
        call(a, b)


def pointer_device(ptr: int) -> int:
    """The device that owns a device pointer."""
    return int(runtime().pointerGetAttributes(ptr).device)


# -- copies, pinned memory, synchronisation -------------------------------------------
# The raw calls of _copies and _pinned, one function each: the callers look
# them up as ``_cuda.name`` at each call (once per share on the copy
# threads), so a fake (cudafut.testing) or a test can replace them here.

_H2D: Final = 1  # cudaMemcpyHostToDevice
_D2H: Final = 2  # cudaMemcpyDeviceToHost
_HOST_PINNED: Final = 1  # cudaMemoryTypeHost
_HOST_ALLOC_PORTABLE: Final = 1  # cudaHostAllocPortable: pinned for every device


def memcpy_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes`` from host address ``src`` to device
    address ``dst`` on ``stream`` (of the current device).

    From pinned memory it enqueues and returns (a few µs): the copy engine
    reads ``src`` later, so keep it until an event recorded after it has
    completed. From pageable memory the driver stages it through its own
    pinned buffer and blocks the calling thread until ``src`` has been read
    (the copy threads of :mod:`cudafut._copies` run these in parallel)."""
    runtime().memcpyAsync(dst, src, nbytes, _H2D, stream)


def memcpy_to_host(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes`` from device address ``src`` to host
    address ``dst`` on ``stream`` (of the current device).

    Into pinned memory it enqueues and returns (a few µs): ``dst`` is
    written later, once the stream reaches the copy. Into pageable memory
    the driver stages it and blocks the calling thread until the copy is
    done."""
    runtime().memcpyAsync(dst, src, nbytes, _D2H, stream)


def pointer_is_pinned(ptr: int) -> bool:
    """Whether host address ``ptr`` lies in page-locked memory that CUDA
    knows (``cudaPointerGetAttributes``, about a µs; no GPU work). An
    address CUDA does not know is pageable: False."""
    try:
        return int(runtime().pointerGetAttributes(ptr).type) == _HOST_PINNED
    except Exception:  # noqa: BLE001 - unknown to CUDA: pageable
        return False


def host_alloc(nbytes: int) -> int:
    """``cudaHostAlloc`` (portable: pinned for every device) of ``nbytes``;
    its address. Blocks the calling thread while the driver pins the pages:
    tens of µs to milliseconds, growing with the size.

    Raises:
        CudaError: CUDA refused; code 2 (``cudaErrorMemoryAllocation``) when
            the machine cannot pin that much more.
    """
    try:
        return int(runtime().hostAlloc(nbytes, _HOST_ALLOC_PORTABLE))
    except Exception as exc:
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            raise cuda_error(status) from exc
        raise


def free_host(ptr: int) -> None:
    """``cudaFreeHost`` of a block from :func:`host_alloc`. Blocks the
    calling thread, and may wait until the whole device is idle."""
    runtime().freeHost(ptr)


def event_synchronize(event: int) -> None:
    """``cudaEventSynchronize``: block the calling thread until ``event``
    has completed."""
    runtime().eventSynchronize(event)


def stream_synchronize(stream: int) -> None:
    """``cudaStreamSynchronize``: block the calling thread until the work
    enqueued on ``stream`` so far has completed."""
    runtime().streamSynchronize(stream)


def use_device(device: int) -> None:
    """Make ``device`` the calling thread's current device, for CuPy too
    (``cupy.cuda.Device(device).use()``: a ``cudaSetDevice``, under a µs)."""
    cupy().cuda.Device(device).use()


def initialise() -> None:
    """Initialise CUDA in this process, once (later calls cost a global
    read).

    Raises:
        CudaUnavailableError: CUDA cannot be used here (and under
            cudafut.testing's fake CUDA, which has no runtime).
    """
    runtime()


# -- CuPy's own objects: streams, allocator, graphs -----------------------------------


def imported_cupy() -> Any:
    """The ``cupy`` module if something imported it already, else None;
    never imports it (a dict lookup), so costs nothing where CuPy is not
    used."""
    return sys.modules.get("cupy")


def current_stream_getter() -> Callable[[int], Any]:
    """CuPy's ``get_current_stream(device)``, for callers that bind it once
    (a stream switch per task step): calling it costs what CuPy's does."""
    get: Callable[[int], Any] = cupy().cuda.get_current_stream
    return get


def cupy_allocator() -> Any:
    """CuPy's allocator in force now (``cupy.cuda.get_allocator()``), or
    None if CuPy is not imported; no GPU call, never imports CuPy."""
    cp = sys.modules.get("cupy")
    return None if cp is None else cp.cuda.get_allocator()


def set_cupy_allocator(allocate: Callable[[int], Any]) -> None:
    """Make ``allocate`` CuPy's allocator (``cupy.cuda.set_allocator``); no
    GPU call. Raises what CuPy raises (inside ``using_allocator()``)."""
    cupy_module().cuda.set_allocator(allocate)


def cupy_module() -> Any:
    """The ``cupy`` module, imported if need be, without checking that CUDA
    is usable (for what needs no GPU: the allocator hooks)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        cp = importlib.import_module("cupy")  # as in _initialise
    return cp


def wrap_cupy_allocator(allocator: Callable[[int], Any], owner: Callable[[Any, int, int], object]) -> Any:
    """An allocator for CuPy that takes each block from ``allocator`` and
    hands it out owned by ``owner(memory, device, stream)``: ``stream`` is
    the handle of CuPy's current stream at the allocation. The owner lives
    as long as the array's memory; when it dies, so does its reference to
    the block (back to ``allocator``'s pool).

    Costs ``allocator`` plus about a µs per allocation (CuPy's stream
    lookup, two small objects); no GPU call."""
    cp = cupy_module()
    memory_pointer = cp.cuda.MemoryPointer
    unowned = cp.cuda.UnownedMemory
    get_stream = cp.cuda.get_current_stream

    def allocate(size: int) -> Any:
        memory = allocator(size)
        device = memory.device_id
        return memory_pointer(unowned(memory.ptr, size, owner(memory, device, get_stream().ptr), device), 0)

    return allocate


def owner_of(array: Any) -> object:
    """The ``owner`` that :func:`wrap_cupy_allocator` gave the memory under
    ``array`` (a CuPy array), or None: for another array, or memory of
    another allocator. Reads CuPy's ``UnownedMemory`` (its private
    ``_owner``), which only this module knows; attribute reads, no call."""
    data = getattr(array, "data", None)
    memory = getattr(data, "mem", None)
    return getattr(memory, "_owner", None)


def capture_cupy_graph(fn: Callable[..., Any], inputs: tuple[Any, ...], warmup: int) -> tuple[Any, Any, Any]:
    """Run ``fn(*inputs)`` ``warmup`` times, then capture one call into a
    CUDA graph, on a new stream of the current device; ``(graph, outputs,
    keep)``, where ``keep`` (the stream and a private memory pool) must live
    as long as the graph. Blocks the calling thread until the warm-up
    calls have run on the GPU."""
    cp = cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    # A private pool for everything the capture allocates: blocks the graph
    # uses (intermediates freed during capture included) must never be
    # handed to other arrays, since every replay writes them again.
    pool = cp.cuda.MemoryPool()
    # The inputs were made on the caller's stream: the warm-up comes after.
    stream.wait_event(cp.cuda.get_current_stream().record())
    with cp.cuda.using_allocator(pool.malloc), stream:
        for _ in range(warmup):
            fn(*inputs)
        stream.synchronize()
        stream.begin_capture()
        try:
            outputs = fn(*inputs)
        finally:
            graph = stream.end_capture()
    return graph, outputs, (pool, stream)


def replay_cupy_graph(
    graph: Any, statics: tuple[Any, ...], outputs: Any, inputs: tuple[Any, ...], n: int, last: Any
) -> tuple[tuple[Any, ...], Any]:
    """Launch a graph of :func:`capture_cupy_graph` on CuPy's current
    stream: after ``last`` (the event of the previous replay, or None), the
    first ``n`` rows of ``inputs`` are copied into the captured inputs
    ``statics`` (device arrays: a device copy; host arrays: a host-to-device
    copy), the graph runs, and the first ``n`` rows of each of ``outputs``
    are copied out. ``(those copies, the replay's event)``. Enqueues only;
    tens of µs on the host."""
    cp = cupy()
    stream = cp.cuda.get_current_stream()
    if last is not None:
        stream.wait_event(last)
    for static, x in zip(statics, inputs, strict=True):
        if isinstance(x, cp.ndarray):
            static[:n] = x  # a device copy on the current stream
        else:  # host data (NumPy): the first rows of a C-contiguous array are contiguous
            static[:n].set(x, stream=stream)
    graph.launch(stream)
    copies = tuple(out[:n].copy() for out in outputs)
    return copies, stream.record()


def cuda_error(code: int, device: int | None = None, *, driver: bool = False) -> CudaError:
    """A :class:`CudaError` for a raw status, with CUDA's name and text: a
    runtime ``cudaError_t``, or with ``driver=True`` a driver ``CUresult``."""
    name, description = (f"CUresult {code}", "") if driver else ("", "")
    if _cupy is not None and not forked:
        error = _cupy.cuda.driver.CUDADriverError if driver else _cupy.cuda.runtime.CUDARuntimeError
        # CuPy formats the message as "<name>: <description>".
        name, _, description = str(error(code)).partition(": ")
    return CudaError(code, name, description, device=device)


def initialised() -> bool:
    """Whether CUDA is initialised in this process (and usable: not in a
    forked child); never initialises it."""
    return _rt is not None and not forked


def devices_of_host_value() -> tuple[int, ...]:
    """The devices a value holding no GPU array is recorded on, where the
    caller named none: none with CUDA (``set_result()`` refuses it); the
    current device under :mod:`cudafut.testing`'s fake, whose device arrays
    are NumPy arrays. Called only on that refusal's path."""
    return ()


# -- interprocess events and memory (_shared: a future crossing processes) ----------------

# libcuda's cuMemGetAddressRange_v2, loaded on first use (CuPy has no wrapper).
_address_range: Any = None
_EVENT_INTERPROCESS: Final = 0x4  # cudaEventInterprocess
_IPC_LAZY_PEER_ACCESS: Final = 0x1  # cudaIpcMemLazyEnablePeerAccess


def ipc_event_create(device: int) -> tuple[int, bytes]:
    """A new interprocess event on ``device`` (timing disabled, as CUDA
    requires) and its handle for other processes (a few µs)."""
    rt = runtime()
    with on_device(device):
        event = int(rt.eventCreateWithFlags(rt.eventDisableTiming | _EVENT_INTERPROCESS))
    try:
        return event, bytes(rt.ipcGetEventHandle(event))
    except BaseException:
        rt.eventDestroy(event)
        raise


def ipc_open_event(handle: bytes, device: int) -> int:
    """Open another process's interprocess event (slow the first time in a
    process: callers keep what they open)."""
    rt = runtime()
    with on_device(device):
        return int(rt.ipcOpenEventHandle(handle))


def ipc_memory_handle(ptr: int, device: int) -> tuple[bytes, int, int]:
    """``(handle, offset, size)``: the interprocess handle of the allocation
    holding address ``ptr`` of ``device``, ``ptr``'s offset in it and the
    allocation's size (a few µs).

    Raises:
        CudaError: CUDA cannot share that memory (a stream-ordered pool's,
            ``cudaMallocAsync``, or a virtual-memory allocation).
    """
    global _address_range
    rt = runtime()
    if _address_range is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _address_range = fn
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with on_device(device):
        # The driver call needs a current context, which a new thread has
        # none of: on_device() sets nothing where ``device`` is already the
        # thread's device (0 on a new thread), and cudaSetDevice binds the
        # primary context (CUDA 12 on), so call it whatever the device is.
        rt.setDevice(device)
        code = _address_range(ctypes.byref(base), ctypes.byref(size), ptr)
    if code:
        raise CudaError(code, "CUresult", f"cuMemGetAddressRange failed for {ptr:#x}")
    return bytes(rt.ipcGetMemHandle(base.value)), ptr - base.value, size.value


def ipc_open_memory(handle: bytes, device: int) -> int:
    """Map another process's allocation into this one; its base address
    (a driver call of tens to hundreds of µs: callers keep what they map)."""
    rt = runtime()
    with on_device(device):
        return int(rt.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))


def ipc_close_memory(ptr: int) -> None:
    """Unmap an allocation :func:`ipc_open_memory` mapped."""
    runtime().ipcCloseMemHandle(ptr)


def array_over(
    base: int,
    size: int,
    owner: object,
    device: int,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
) -> Any:
    """A CuPy array over memory cudafut did not allocate (``size`` bytes at
    ``base`` on ``device``, e.g. another process's, mapped): ``shape``,
    ``strides`` and ``dtype`` from ``base + offset``; ``owner`` lives as long
    as the array (or any view of it). No copy, no CUDA call."""
    cp = cupy()
    memory = cp.cuda.UnownedMemory(base, size, owner, device_id=device)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, offset), strides)


def device_bus_id(device: int) -> str:
    """``device``'s PCI bus id, which names it in every process (device
    ordinals depend on each process's ``CUDA_VISIBLE_DEVICES``)."""
    return str(runtime().deviceGetPCIBusId(device))


def device_of_bus_id(bus_id: str) -> int:
    """This process's ordinal of the device with PCI bus id ``bus_id``.

    Raises:
        CudaError: no visible device has that bus id.
    """
    return int(runtime().deviceGetByPCIBusId(bus_id))


def device_synchronize(device: int) -> None:
    """``cudaDeviceSynchronize`` on ``device``: block the calling thread (CuPy
    releases the GIL) until all of this process's work there has ended."""
    rt = runtime()
    with on_device(device):
        rt.deviceSynchronize()


# -- the swap (cudafut.testing) ------------------------------------------------------
# cudafut.testing replaces the functions above by a fake GPU's. They are
# rebound here, in this module's namespace, and every caller looks them up
# as ``_cuda.name`` at each call: the real functions run as they are, with no
# flag tested and no indirection added.


class Backend(Protocol):
    """The CUDA calls cudafut's core makes, as one interface.

    Two implementations: this module's own functions (CUDA through CuPy,
    the native notices of ``_waker.c`` behind :func:`close_after`) and
    :mod:`cudafut.testing`'s fake GPU. mypy checks both against this class
    (this module at its end, the fake as :func:`swap`'s argument).
    :func:`swap` is the one place that chooses: it rebinds this module's
    functions to the backend's methods, so that the core's calls
    (``_cuda.name(...)``, looked up at each call) reach CUDA's functions
    with nothing in between. Each method's meaning is the docstring of the
    function of this module with the same name.
    """

    def call_on_streams(
        self, streams: Mapping[int, Any], primary: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any: ...
    def close_after(self, record: Any, fd: int, stream: int) -> None: ...
    def cupy(self) -> Any: ...
    def cupy_stream(self, stream: object, ptr: int, device: int) -> Any: ...
    def current_device(self) -> int: ...
    def current_stream(self, device: int) -> Any: ...
    def current_stream_getter(self) -> Callable[[int], Any]: ...
    def device_count(self) -> int: ...
    def device_bus_id(self, device: int) -> str: ...
    def device_of_bus_id(self, bus_id: str) -> int: ...
    def device_synchronize(self, device: int) -> None: ...
    def devices_of_host_value(self) -> tuple[int, ...]: ...
    def event_create(self, device: int) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def event_record(self, event: int, stream: int, device: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def free_host(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def initialise(self) -> None: ...
    def initialised(self) -> bool: ...
    def ipc_close_memory(self, ptr: int) -> None: ...
    def ipc_event_create(self, device: int) -> tuple[int, bytes]: ...
    def ipc_memory_handle(self, ptr: int, device: int) -> tuple[bytes, int, int]: ...
    def ipc_open_event(self, handle: bytes, device: int) -> int: ...
    def ipc_open_memory(self, handle: bytes, device: int) -> int: ...
    def memcpy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def memcpy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def new_stream(self, device: int, priority: int) -> Any: ...
    def notice_stream(self, device: int) -> int | None: ...
    def on_device(self, device: int) -> AbstractContextManager[None]: ...
    def pointer_device(self, ptr: int) -> int: ...
    def pointer_is_pinned(self, ptr: int) -> bool: ...
    def runtime(self) -> Any: ...
    def stream_device(self, stream: int) -> int: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def stream_wait(self, stream: int, event: int, device: int) -> None: ...
    def use_device(self, device: int) -> None: ...


#: The functions a backend replaces, by name: the methods of :class:`Backend`.
SEAM: Final = tuple(name for name in vars(Backend) if not name.startswith("_"))

#: Modules holding objects of the backend (pools of streams and events,
#: threads owning streams) and the record type: see on_swap().
_swap_hooks: list[Callable[[Any], Callable[[], None]]] = []
# The backend installed and the restore functions of its hooks; None: CUDA.
_swapped: tuple[Any, list[Callable[[], None]]] | None = None
_swap_lock = threading.RLock()  # a hook may import a module that registers one


def faked() -> bool:
    """Whether :mod:`cudafut.testing`'s fake GPU is installed (for error
    messages: a flag read, no call to CUDA)."""
    return _swapped is not None


#: The end of the refusal of a GPU-array-only call under the fake GPU.
NOT_FAKED: Final = (
    "; under cudafut.testing's fake GPU, NumPy arrays stand for GPU arrays, but {call} is not faked "
    "(it needs GPU memory): test this part on a GPU (docs/testing.md)"
)


def on_swap(hook: Callable[[Any], Callable[[], None]]) -> None:
    """Register ``hook(backend)``, called when :func:`swap` installs a
    backend: it sets aside what the module holds of the previous backend
    (streams, events, threads that own them) so that no object of one
    backend reaches the other, and returns the function that puts it back.
    A hook registered while a backend is installed is called at once."""
    with _swap_lock:
        _swap_hooks.append(hook)
        if _swapped is not None:
            _swapped[1].append(hook(_swapped[0]))


def swap(backend: Backend) -> Callable[[], None]:
    """Install ``backend`` in place of CUDA (this module's functions); return
    the function that removes it.

    Costs the real functions nothing: they are rebound, never wrapped. The
    hooks of :func:`on_swap` run after the functions are installed; on
    removal they run first, in reverse order, then the functions return.

    Raises:
        RuntimeError: a backend is installed already.
    """
    global _swapped, _count
    with _swap_lock:
        if _swapped is not None:
            raise RuntimeError(
                "a fake CUDA (cudafut.testing.fake_cuda) is installed already; leave it before "
                "installing another"
            )
        namespace = globals()
        saved = {name: namespace[name] for name in SEAM}
        saved_count = _count
        namespace.update({name: getattr(backend, name) for name in SEAM})
        _count = backend.device_count()
        restores: list[Callable[[], None]] = []
        _swapped = (backend, restores)
        try:
            for hook in _swap_hooks:
                restores.append(hook(backend))
        except BaseException:
            _unswap(restores, saved, saved_count)
            raise

    def restore() -> None:
        with _swap_lock:
            if _swapped is None or _swapped[0] is not backend:
                return  # removed already
            _unswap(restores, saved, saved_count)

    return restore


def _unswap(restores: list[Callable[[], None]], saved: dict[str, Any], count: int) -> None:
    global _swapped, _count
    try:
        for undo in reversed(restores):
            undo()
    finally:
        globals().update(saved)
        _count = count
        _swapped = None


class RecordCalls:
    """What an event record asks of the backend that made it: its status,
    a stream's wait on it, the error of a status, and whether the backend
    can still be used.

    A record keeps the object of its backend for as long as it lives, so
    that a record of :mod:`cudafut.testing`'s fake asks the fake, never
    CUDA, even after the fake is removed. :data:`CUDA` is CUDA's (this
    module's functions); the fake's backend is its own.
    """

    __slots__ = ()

    #: Stream types whose ``ptr`` and ``device_id`` attributes are their
    #: handle and device, beyond CuPy's (which the native core finds once
    #: CuPy is imported): a fast path of ``record(x, stream=s)`` reads them.
    stream_types: tuple[type, ...] = ()

    # This module's functions looked up at each call, as the core's calls do
    # (a test may replace one).
    def event_query(self, event: int) -> int:
        return event_query(event)

    def stream_wait(self, stream: int, event: int, device: int) -> None:
        stream_wait(stream, event, device)

    def event_error(self, code: int, device: int) -> CudaError:
        return event_error(code, device)

    def ended(self) -> str | None:
        """Why this backend can no longer be used, or None (CUDA: never)."""
        return None


#: The record calls of CUDA (see :class:`RecordCalls`).
CUDA: Final = RecordCalls()


def record_calls() -> Any:
    """The record calls of the backend installed now: :data:`CUDA`, or
    :mod:`cudafut.testing`'s fake."""
    return CUDA if _swapped is None else _swapped[0]


if TYPE_CHECKING:  # mypy: this module's functions implement the interface
    from . import _cuda as _this

    _implements: Backend = _this
