"""Notices: CUDA closes a file descriptor when work ends, so that an
event loop learns of the work's end by selecting on the descriptor
instead of querying (docs/design.md, "Notices").

Two ways, chosen per notice: a native notice thread of ``cudafut._waker``
blocked on a notice stream's blocking-sync event, or a CUDA host function
that is libc's ``close``. The notice streams are made once per device, off
the caller's thread (hazard 11). A part of the CUDA seam
(:mod:`cudafut._cuda` re-exports the public functions, and callers call
them there); the seam's other functions are called through ``_cuda``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Final

from . import _backend, _compiled, _lifetimes, _log, _runtime
from ._errors import CudaError, CudaUnavailableError

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
# Set, per device, when its helper has finished (streams made or not).
_notice_made: dict[int, threading.Event] = {}
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
                    "cuInit",
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
    init, device_get, retain, push, pop, create = _stream_calls
    dev, context, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    # The driver refuses every call before cuInit (CUDA_ERROR_NOT_INITIALIZED),
    # and nothing else need have called it yet: prepare_notices may run before
    # the process's first CUDA call. Once it has run, it returns at once.
    rc = init(0) or device_get(ctypes.byref(dev), device)
    if rc:
        raise _runtime.cuda_error(rc, device, driver=True)
    # One reference to the primary context per stream, never released:
    # the runtime holds it for the life of the process anyway.
    rc = retain(ctypes.byref(context), dev)
    if rc:
        raise _runtime.cuda_error(rc, device, driver=True)
    rc = push(context)
    if rc:
        raise _runtime.cuda_error(rc, device, driver=True)
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
        raise _runtime.cuda_error(rc, device, driver=True)
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
                _notice_broken[device] = _runtime.cuda_error(getattr(failure, "status", 999), device)
        _notice_making.discard(device)
        done = _notice_made.get(device)
    if done is not None:
        done.set()


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
    _runtime.check_usable()
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
            _start_helper(device)
            return None
        turn = _notice_turn.get(device, 0)
        _notice_turn[device] = turn + _NOTICE_TRIES
        candidates = [pool[(turn + i) % len(pool)] for i in range(min(len(pool), _NOTICE_TRIES))]
    rt = _backend.current.runtime()
    for stream in candidates:
        if rt.streamQuery(stream) == 0:  # idle: no notice queued there
            return stream
    return None


def _start_helper(device: int) -> threading.Event:
    # Under _notice_lock: the helper that makes ``device``'s notice streams,
    # started unless it runs; the event set when it has finished.
    done = _notice_made.get(device)
    if done is None:
        done = _notice_made[device] = threading.Event()
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
    return done


def prepare_notices(device: int, timeout: float) -> bool:
    """Make ``device``'s notice streams now, if no notice has yet, and wait
    up to ``timeout`` seconds for them; return whether they exist.

    For work that may never end unless a CUDA call ends it, such as an
    NCCL collective whose peer died (its abort records an event): the
    first notice on a device makes its streams, and a creation behind such
    work may wait for ever, holding up that very call (docs/design.md,
    hazard 11). :class:`cudafut.distributed.ProcessGroup` calls this before
    its first collective, and :func:`cudafut.warm_launchers` on each
    launcher thread. Blocks the calling thread while the streams are made
    (32 stream creations on a helper thread, well under a millisecond on an
    idle GPU; up to ``timeout`` where a creation waits for running work,
    logged as a warning then); once they exist, costs a dictionary lookup.
    Never raises: where no stream can be made (no libcuda, a forked child,
    no thread to make them on), notices are off and this returns False.
    """
    if _runtime.forked:
        return False
    with _notice_lock:
        if device in _notice_pool:
            return True
        if device in _notice_broken:
            return False
        try:
            done = _start_helper(device)
        except Exception as exc:  # noqa: BLE001 - no helper thread (none can start): the first notice tries again
            refused: Exception | None = exc
        else:
            refused = None
    if refused is not None:  # logged outside the lock
        _log.logger.warning(
            "cudafut: could not start the notice-stream helper of device %d", device, exc_info=refused
        )
        return False
    # Event.wait overflows past TIMEOUT_MAX (math.inf included).
    if not done.wait(min(timeout, threading.TIMEOUT_MAX)):
        # The hazard this guards against may still come: say so.
        _log.logger.warning(
            "cudafut: device %d's notice streams were not made within %g s (a stream creation waits "
            "for the GPU's running work); the first notice uses them once made",
            device,
            timeout,
        )
    with _notice_lock:
        return device in _notice_pool


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
            _backend.current.stream_wait(int(stream), record.handle, device)
            _backend.current.runtime().eventRecord(native, int(stream))
            if _waker.notice(_primary_contexts[device], native, fd):
                return
        except BaseException as exc:
            os.close(fd)  # nothing queued that closes it
            if isinstance(exc, (CudaError, CudaUnavailableError)) or not isinstance(exc, Exception):
                raise
            raise _runtime.cuda_error(getattr(exc, "status", 999), record.device) from exc
        # Every notice thread busy: the host function, after the wait queued.
    try:
        loaded = _host_close if _host_close is not None else _load_host_close()
        if loaded is False:
            raise CudaUnavailableError("cuLaunchHostFunc is not available (no libcuda.so.1)")
        launch, close = loaded
        device = record.device
        ptr = int(stream)
        _backend.current.stream_wait(ptr, record.handle, device)
        rt = _backend.current.runtime()
        previous = rt.getDevice()
        if previous != device:
            rt.setDevice(device)
    except BaseException as exc:
        os.close(fd)  # not launched: still ours
        if isinstance(exc, (CudaError, CudaUnavailableError)) or not isinstance(exc, Exception):
            raise
        raise _runtime.cuda_error(getattr(exc, "status", 999), record.device) from exc
    try:
        rc = launch(ptr, close, fd)
    finally:
        if previous != device:
            try:
                rt.setDevice(previous)
            except Exception:  # noqa: BLE001 - the notice is queued: never raise past it
                _log.logger.warning(
                    "cudafut: could not make device %d current again after a notice", previous, exc_info=True
                )
    if rc:
        if rc in _REFUSED_BEFORE_QUEUEING:
            os.close(fd)
        raise _runtime.cuda_error(rc, device)


def _after_fork_in_child() -> None:
    # The parent's notice streams (handles: nothing to destroy) and helpers
    # (not copied by fork) are not the child's; _cuda's own reset, which
    # refuses CUDA in the child, runs before this one.
    global _notice_lock
    _notice_lock = threading.Lock()  # another thread may have held it at the fork
    for table in (_notice_pool, _notice_turn, _notice_broken, _notice_made):
        table.clear()
    _notice_making.clear()
    _primary_contexts.clear()  # the child has no CUDA context (forked)
    _notice_events.clear()


_lifetimes.at_fork_in_child(_after_fork_in_child)
