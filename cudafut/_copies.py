"""Awaitable copies between host and device: :func:`to_device`, :func:`to_host`.

Only pinned host memory is copied asynchronously by the GPU's copy engines;
a ``cudaMemcpyAsync`` from or to pageable memory is staged by the driver
and blocks the calling thread (docs/memory.md). So:

- pinned, C-contiguous host memory (:func:`cudafut.empty_pinned`, the
  results of :func:`to_host`, any ``cudaHostAlloc``'d or registered memory)
  is copied with one ``cudaMemcpyAsync``, from the calling thread;
- small pageable sources (up to ``INLINE_BYTES``) are copied into a pinned
  block on the calling thread, then by one ``cudaMemcpyAsync``;
- larger pageable memory is staged in chunks through pinned blocks by
  cudafut's copy threads (``WORKERS`` of them, GIL released while NumPy
  copies and while they wait for the GPU): each thread copies its share of
  the chunks, the host copy of one chunk overlapping the DMA of the other,
  through two staging blocks of its own. The future is pending until the
  last DMA is enqueued (``to_device``) or the last chunk is copied out
  (``to_host`` into pageable ``out``).

Copies that name no stream run on a copy stream of the device
(``_pools.copy_streams``), after the work already queued on the caller's
current stream (for ``to_host`` of an array) or after the future's events
(for ``to_host`` of a future, on the stream ``then()`` picks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from . import _backend, _cuda, _events, _lifetimes, _pinned, _pools, _torch
from ._errors import InvalidStateError
from ._events import EventRecord
from ._future import CudaFuture
from ._interface import complete_with, set_future
from ._values import find_devices, order_foreign

__all__ = ["to_device", "to_host", "to_host_after"]

#: Pageable copies up to this size are staged on the calling thread.
INLINE_BYTES: Final = 256 << 10
#: A staged copy is shared by one copy thread per ``JOB_BYTES`` (at most
#: ``WORKERS``): handing a share to a thread costs a wake-up and GIL
#: hand-offs (about 100 µs each, measured on an H100 host), so a 16 MB copy
#: is faster on 2 threads than on 8, and a 64 MB one on 8 than on 2.
JOB_BYTES: Final = 8 << 20
WORKERS: Final = max(1, min(8, (os.cpu_count() or 2) // 2))
#: Each share is cut into about 2 chunks, so that the host copy of one
#: overlaps the DMA of the other, each between these sizes (a chunk costs
#: about 25 µs of Python).
CHUNK_MIN: Final = 1 << 20
CHUNK_MAX: Final = 8 << 20

_SUPPORTED_KINDS: Final = "biufc"

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock: Final = threading.Lock()


# Under cudafut.testing's fake CUDA (_cuda.faked()), whose device arrays are
# NumPy arrays: copies are NumPy copies, made at the call, with an event on
# the stream the real copy would use. One call per copy, off the µs paths.


def _fake_to_device(array: np.ndarray[Any, Any], device: int, ptr: int) -> CudaFuture[Any]:
    return set_future(np.array(array, order="C"), (_events.record(ptr, device),), array)


def _fake_to_host(
    array: Any,
    out: Any,
    stream: Any,
    *,
    follow: bool,
    after: Callable[[int], None] | None,
    read: list[EventRecord] | None,
) -> CudaFuture[Any]:
    if not isinstance(array, np.ndarray):
        raise TypeError(
            "to_host() under cudafut.testing's fake CUDA needs a NumPy array (the fake's device "
            f"arrays) or a CudaFuture of one, not {type(array).__name__}"
        )
    device = _backend.current.current_device()
    if out is not None:
        out = _check_out(out, array.shape, array.dtype)
    current = int(_backend.current.current_stream(device).ptr)
    if stream is not None:
        ptr, _ = _stream_of(stream, device)
    elif follow:
        ptr = current
    else:
        ptr = int(_pools.copy_streams.get(device, 0).ptr)
    if after is not None:
        after(ptr)
    elif ptr != current:
        _events.record(current, device).wait_on(ptr, device)
    result = np.empty(array.shape, array.dtype) if out is None else out
    np.copyto(result, array)
    rec = _events.record(ptr, device)
    if read is not None:
        read.append(rec)
    return set_future(result, (rec,), array)


def _run_in_worker(fn: Callable[..., None], *args: Any) -> None:
    global _executor
    executor = _executor
    if executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="cudafut-copy")
            executor = _executor
    executor.submit(fn, *args)


def _reset_after_fork() -> None:
    global _executor
    _executor = None  # the parent's threads do not exist in the child


_lifetimes.at_fork_in_child(_reset_after_fork)


# -- arguments ------------------------------------------------------------------


def _host_array(host: object) -> np.ndarray[Any, Any]:
    if isinstance(host, np.ndarray):
        array = host
    elif hasattr(host, "__cuda_array_interface__"):
        raise TypeError(
            f"to_device() got a GPU array ({type(host).__name__}); copy between devices "
            "with cupy.asarray() or array.copy() under the target device instead"
        )
    elif hasattr(host, "__array_interface__"):
        array = np.asarray(host)
    else:
        try:
            view = memoryview(host)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "to_device() needs a NumPy array or an object with the buffer protocol or "
                f"__array_interface__, not {type(host).__name__}; convert it with numpy.asarray() first"
            ) from None
        array = np.asarray(view)
    if array.dtype.kind not in _SUPPORTED_KINDS:
        raise TypeError(
            f"CuPy arrays cannot hold dtype {array.dtype}: copy booleans, integers, floats or complex numbers"
        )
    return array


def _device_array_info(array: object) -> tuple[int, tuple[int, ...], np.dtype[Any]]:
    """(device, shape, dtype) of a GPU array; TypeError for anything else."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if not isinstance(interface, dict):
        raise TypeError(
            "to_host() needs a GPU array (a CuPy array, or any __cuda_array_interface__ object) "
            f"or a CudaFuture of one, not {type(array).__name__}"
        )
    try:
        shape = tuple(int(n) for n in interface["shape"])
        dtype = np.dtype(interface["typestr"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{type(array).__name__}.__cuda_array_interface__ is malformed ({exc!r}): it needs "
            "'shape' (a tuple of ints) and 'typestr' (a NumPy type string)"
        ) from None
    (device,) = find_devices(array) or (_backend.current.current_device(),)
    return device, shape, dtype


def _check_out(out: object, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, not {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}, but the array copied has shape "
            f"{shape} and dtype {dtype}: pass an array of the same shape and dtype "
            "(cudafut.empty_pinned(shape, dtype) copies fastest)"
        )
    if not out.flags.writeable:
        raise ValueError("out is read-only: pass a writeable array")
    if out.size > 1 and 0 in out.strides:
        raise ValueError(
            "out has a zero stride (a broadcast view), so its elements overlap: pass a real array"
        )
    if _overlaps(out):
        raise ValueError(
            f"out's elements overlap (strides {out.strides} for shape {out.shape} and "
            f"{out.itemsize}-byte items, as np.lib.stride_tricks.as_strided can make): two elements "
            "would receive one byte; pass an array whose elements are distinct"
        )
    return out


def _overlaps(array: np.ndarray[Any, Any]) -> bool:
    """Whether two elements of ``array`` share a byte.

    Costs a few µs for any array NumPy makes (contiguous, transposed,
    sliced: sorted by stride, each stride spans every smaller one); only a
    layout that fails that test has every element's offset computed (memory
    and time in proportion to its size)."""
    if array.size <= 1 or array.flags.c_contiguous or array.flags.f_contiguous:
        return False
    dims = sorted((abs(st), n) for st, n in zip(array.strides, array.shape, strict=True) if n > 1)
    span = array.itemsize
    for stride, n in dims:
        if stride < span:
            break
        span = stride * (n - 1) + span
    else:
        return False
    offsets = np.zeros(1, dtype=np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    offsets.sort()
    return bool(np.any(np.diff(offsets) < array.itemsize))


def _stream_of(stream: object, device: int | None) -> tuple[int, int]:
    ptr, stream_device = _cuda.stream_handle(stream)
    if device is not None and stream_device != device:
        raise ValueError(f"stream is on device {stream_device}, but the copy is for device {device}")
    return ptr, stream_device


def _pinned_address(array: np.ndarray[Any, Any]) -> int:
    """The address of a C-contiguous, non-empty array in pinned memory
    (one DMA can read or write it); 0 for any other array."""
    if not array.flags.c_contiguous or array.nbytes == 0:
        return 0
    ptr: int = array.__array_interface__["data"][0]
    return ptr if _backend.current.pointer_is_pinned(ptr) else 0


# -- chunks -----------------------------------------------------------------------

# A piece of a transfer: (host view, byte offset in the C-ordered device
# buffer, bytes). A C-contiguous host array is cut into byte ranges; another
# layout into blocks of rows (NumPy copies them into C order).
Piece = tuple[np.ndarray[Any, Any], int, int]


def _plan(nbytes: int) -> tuple[int, int]:
    """(copy threads, chunk bytes) for a staged copy of ``nbytes``."""
    jobs = max(1, min(WORKERS, nbytes // JOB_BYTES))
    chunk = max(CHUNK_MIN, min(CHUNK_MAX, -(-nbytes // (2 * jobs))))
    return jobs, -(-chunk // 4096) * 4096


def _pieces(host: np.ndarray[Any, Any], chunk: int) -> list[Piece]:
    if host.flags.c_contiguous:
        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        return [(flat[o : o + chunk], o, min(chunk, n - o)) for o in range(0, n, chunk)]
    row = host.itemsize * math.prod(host.shape[1:])
    rows = max(1, chunk // max(row, 1))
    n = host.shape[0]
    return [(host[r : r + rows], r * row, (min(r + rows, n) - r) * row) for r in range(0, n, rows)]


def _split(pieces: list[Piece], jobs: int) -> list[list[Piece]]:
    """The pieces in at most ``jobs`` consecutive runs, one per copy thread."""
    per = -(-len(pieces) // min(jobs, len(pieces)))
    return [pieces[i : i + per] for i in range(0, len(pieces), per)]


def _staging(nbytes: int) -> tuple[np.ndarray[Any, Any], _pinned.HostBuffer] | None:
    return _pinned.host_array((nbytes,), np.dtype(np.uint8))


def _view(stage: np.ndarray[Any, Any], piece: np.ndarray[Any, Any], nbytes: int) -> np.ndarray[Any, Any]:
    view: np.ndarray[Any, Any] = stage[:nbytes].view(piece.dtype).reshape(piece.shape)
    return view


class _Transfer:
    """The jobs of one staged copy; the last one to finish completes it."""

    def __init__(self, fut: CudaFuture[Any], jobs: int, finish: Callable[[], None]) -> None:
        self.fut = fut
        self.lock = threading.Lock()
        self.remaining = jobs
        self.error: BaseException | None = None
        self.finish = finish

    def job_done(self, error: BaseException | None = None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            if self.remaining:
                return
        if self.error is not None:
            self.fail(self.error)
            return
        try:
            self.finish()
        except Exception as exc:  # noqa: BLE001 - the future carries it
            self.fail(exc)

    def fail(self, error: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):  # its consumer cancelled it
            self.fut.set_exception(error)


# A copy thread's share of a staged copy: (its pieces, its two staging
# blocks (None past the pinned limit), stream, device, device pointer).
Stager = Callable[[Sequence[Piece], list[Any], int, int, int], None]


def _run_share(
    transfer: _Transfer, stager: Stager, pieces: Sequence[Piece], ptr: int, stream: int, device: int
) -> None:
    """Run one copy thread's share on ``device`` through two staging blocks
    of its own, and report to the transfer however it ends."""
    error: BaseException | None = None
    stages: list[Any] = []
    try:
        with _backend.current.on_device(device):
            biggest = max(n for _, _, n in pieces)
            stages += [_staging(biggest) for _ in range(min(2, len(pieces)))]
            stager(pieces, stages, stream, device, ptr)
    except BaseException as exc:  # noqa: BLE001 - handed to the future
        error = exc
    # The staging blocks go back (each after its guard) before the future can
    # complete: once a copy is done, memory_statistics() no longer counts them.
    stages.clear()
    transfer.job_done(error)


def _stage_in(pieces: Sequence[Piece], stages: list[Any], stream: int, device: int, dst: int) -> None:
    """Host to device: the host copy of one piece overlaps the DMA of the other."""
    memcpy, synchronize = _backend.current.memcpy_to_device, _backend.current.event_synchronize
    last: list[EventRecord | None] = [None] * len(stages)
    for i, (piece, offset, n) in enumerate(pieces):
        b = i % len(stages)
        stage = stages[b]
        if stage is None:  # past the pinned limit: the driver stages it, blocking this thread
            src = np.ascontiguousarray(piece)
            memcpy(dst + offset, src.ctypes.data, n, stream)
            continue
        previous = last[b]
        if previous is not None and previous.query() is None:
            synchronize(previous.handle)
        np.copyto(_view(stage[0], piece, n), piece)
        memcpy(dst + offset, stage[1].allocation.ptr, n, stream)
        last[b] = rec = _events.record(stream, device)
        stage[1].guard = (rec,)  # the block returns to the pool after this DMA


def _stage_out(pieces: Sequence[Piece], stages: list[Any], stream: int, device: int, src: int) -> None:
    """Device to pageable host: the DMA of one piece overlaps the host copy of the other."""
    memcpy = _backend.current.memcpy_to_host
    pending: tuple[EventRecord, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
    for i, (piece, offset, n) in enumerate(pieces):
        stage = stages[i % len(stages)]
        if stage is None:  # past the pinned limit: the driver stages it
            tmp = np.empty(piece.shape, piece.dtype)
            memcpy(tmp.ctypes.data, src + offset, n, stream)
            _backend.current.stream_synchronize(stream)
            np.copyto(piece, tmp)
            continue
        memcpy(stage[1].allocation.ptr, src + offset, n, stream)
        rec = _events.record(stream, device)
        view = _view(stage[0], piece, n)
        if pending is not None:
            _copy_out(*pending)
        pending = (rec, view, piece)
        stage[1].guard = (rec,)
    if pending is not None:
        _copy_out(*pending)


def _copy_out(rec: EventRecord, stage: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
    if rec.query() is None:
        _backend.current.event_synchronize(rec.handle)
    if rec.query():
        raise rec.error() or RuntimeError("the copy failed")
    np.copyto(out, stage)


# -- to_device ----------------------------------------------------------------------


def to_device(host: Any, /, *, device: int | None = None, stream: Any = None) -> CudaFuture[Any]:
    """Copy a host array to a GPU; return the future of the CuPy array.

    ``host``: a NumPy array, or anything with the buffer protocol or
    ``__array_interface__`` (of booleans, integers, floats or complex
    numbers), in any layout; the device array is C-contiguous, of the same
    shape and dtype. ``device``: the target device (default: the current
    one). ``stream``: the stream to copy on (a CuPy or PyTorch stream, or any
    ``__cuda_stream__`` object); by default a copy stream of cudafut's, so
    that copies overlap compute.

    Returns without waiting for the copy, whatever the size, but the
    destination array is allocated on the calling thread, from CuPy's
    memory pool of the device: when the pool has no free block of that
    size, that is a ``cudaMalloc``, which can take milliseconds for
    hundreds of MB (later calls of the same size reuse the pool's block).
    Besides, the calling thread does about 20 µs
    of work for pinned sources (one ``cudaMemcpyAsync``), plus a host copy
    of at most ``INLINE_BYTES`` (256 KB) for small pageable ones. Larger
    pageable sources are staged by cudafut's copy threads, in chunks through
    pinned memory; the future is then pending (not yet set: :meth:`~CudaFuture.wait`
    blocks until it is) until the last chunk's DMA is enqueued. Take the
    array through the future (``await``, :meth:`~CudaFuture.result`,
    :meth:`~CudaFuture.wait`, :meth:`~CudaFuture.then`): work queued on the
    copy's stream by hand is not ordered after a staged copy.

    The future keeps ``host`` alive until the copy is done; **do not change
    ``host`` until then** (until the future is done): the copy may read it
    at any moment before. Cancelling a task that awaits the future does not
    stop the copy.

    Raises:
        TypeError: ``host`` is not host memory of a supported dtype, or
            ``stream`` is not a stream, or ``device`` not an int.
        ValueError: ``device`` does not exist, or ``stream`` is on another
            device.
        CudaUnavailableError: CUDA cannot be used here.
    """
    array = _host_array(host)
    if device is not None:
        _cuda.check_device_argument(device)
    _cuda.check_usable()
    dev = _backend.current.current_device() if device is None else _cuda.check_device(device)
    if stream is None:
        copy_stream = _pools.copy_streams.get(dev, 0)
        ptr = int(copy_stream.ptr)
    else:
        ptr, dev = _stream_of(stream, dev if device is not None else None)
        copy_stream = _backend.current.cupy_stream(stream, ptr, dev)
    if _cuda.faked():
        return _fake_to_device(array, dev, ptr)
    nbytes = array.nbytes
    pinned = _pinned_address(array)
    if pinned or nbytes <= INLINE_BYTES:
        return _to_device_now(array, dev, copy_stream, ptr, pinned)
    # Allocated here (a few µs from CuPy's pool; the first allocation of a
    # size may take a cudaMalloc), so that the copy threads start at once.
    dst = _new_device_array(array.shape, array.dtype, dev, copy_stream)
    fut: CudaFuture[Any] = CudaFuture()
    threads, chunk = _plan(nbytes)
    jobs = _split(_pieces(array, chunk), threads)

    def finish() -> None:
        complete_with(fut, dst, (_events.record(ptr, dev),), array)

    transfer = _Transfer(fut, len(jobs), finish)
    for job in jobs:
        _run_in_worker(_run_share, transfer, _stage_in, job, int(dst.data.ptr), ptr, dev)
    return fut


def _new_device_array(shape: tuple[int, ...], dtype: np.dtype[Any], device: int, stream: Any) -> Any:
    cp = _backend.current.cupy()
    with _backend.current.on_device(device), stream:
        return cp.empty(shape, dtype)


def _to_device_now(
    array: np.ndarray[Any, Any], device: int, stream: Any, ptr: int, pinned: int
) -> CudaFuture[Any]:
    """The copy enqueued by the caller: from pinned memory at address
    ``pinned``, or (0) through a staging block it fills."""
    cp = _backend.current.cupy()
    nbytes = array.nbytes
    staged = None
    with _backend.current.on_device(device):
        with stream:  # allocated on the copy stream: freed in its order
            dst = cp.empty(array.shape, array.dtype)
        if pinned:
            _backend.current.memcpy_to_device(dst.data.ptr, pinned, nbytes, ptr)
        elif nbytes:
            staged = _staging(nbytes)
            if staged is None:  # past the pinned limit: the driver stages it
                src = np.ascontiguousarray(array)
                _backend.current.memcpy_to_device(dst.data.ptr, src.ctypes.data, nbytes, ptr)
            else:
                np.copyto(_view(staged[0], array, nbytes), array)
                _backend.current.memcpy_to_device(dst.data.ptr, staged[1].allocation.ptr, nbytes, ptr)
        rec = _events.record(ptr, device)
    if staged is not None:
        staged[1].guard = (rec,)  # back to the pool once the DMA has read it
    return set_future(dst, (rec,), array)


# -- to_host ---------------------------------------------------------------------------


def to_host(array_or_future: Any, /, *, out: Any = None, stream: Any = None) -> CudaFuture[Any]:
    """Copy a GPU array to host memory; return the future of the NumPy array.

    ``array_or_future``: a CuPy array (or any ``__cuda_array_interface__``
    object), copied after the work queued so far on the caller's current
    stream of its device (and, for another library's array, after the work
    that library queued on it: a torch tensor's current PyTorch stream,
    JAX's streams by DLPack, a Numba array's stream; docs/interop.md); or
    a :class:`CudaFuture` of one, copied once the future is set, after its
    events, on the device (the host never waits for the producer: the copy
    continues on the stream :meth:`~CudaFuture.then` picks).

    ``out``: where to copy, a NumPy array of the same shape and dtype, any
    layout. Without it, the result is a C-contiguous array in pinned memory
    from cudafut's pool (:func:`empty_pinned`), which returns to the pool
    when the array is garbage collected (past the pool's limit, pageable
    memory is used instead). Pinned ``out`` is one ``cudaMemcpyAsync``;
    pageable ``out`` is staged in chunks through pinned memory by cudafut's
    copy threads, and the future is set only once every chunk is copied out.
    ``stream``: the stream to copy on (as for :func:`to_device`).

    ``await``/:meth:`~CudaFuture.result` give the NumPy array once its data
    is complete; the array is yours to keep. Do not read it after
    :meth:`~CudaFuture.wait` alone: that orders GPU streams, not the host.

    Returns at once, whatever the size: about 20 µs of work on the calling
    thread for a pinned destination; staged copies run on the copy threads.
    Without ``out``, a result over ``INLINE_BYTES`` (256 KB) whose size has
    no free block in the pool is pinned by a copy thread (a
    ``cudaHostAlloc``, about 1 ms per 100 MB), which then enqueues the copy
    on cudafut's copy stream: the future is pending (not yet set) until
    then. With ``stream=`` or for a future's value, the caller pins it (the
    copy must be enqueued before the caller's next work on that stream).
    The future keeps the source array alive until the copy is done.

    Raises:
        TypeError: not a GPU array or future; ``out`` not a NumPy array;
            ``stream`` not a stream.
        ValueError: ``out`` of another shape or dtype, read-only or
            overlapping, ``stream`` on another device, or an array whose
            producer cannot be ordered (docs/interop.md). For a future not
            set yet these are found when it is set, and the returned future
            fails with them.
        CudaUnavailableError: CUDA cannot be used here.
    """
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, not {type(out).__name__}")
    if stream is not None:
        _cuda.stream_handle(stream)  # a TypeError now, not in the future
    _cuda.check_usable()
    if isinstance(array_or_future, CudaFuture):
        return array_or_future.then(lambda value: _to_host_on(value, out, stream, follow=True))
    return _to_host_on(array_or_future, out, stream, follow=False)


def to_host_after(
    array: Any, order: Callable[[int], None], *, out: Any = None
) -> tuple[CudaFuture[Any], EventRecord]:
    """:func:`to_host` of a GPU array on a copy stream that waits for what
    ``order`` says only, not for the caller's current stream (for
    :class:`cudafut.Tracked`: its last writer).

    ``order(stream handle)`` is called once the arguments are checked and
    before anything is enqueued, to make the copy stream wait. Also returns
    an event recorded on the copy stream once the copy has read ``array``:
    a pageable destination is staged later by the copy threads, so they copy
    a snapshot of ``array`` taken on the copy stream before that event."""
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, not {type(out).__name__}")
    _cuda.check_usable()
    read: list[EventRecord] = []
    fut = _to_host_on(array, out, None, follow=False, after=order, read=read)
    return fut, read[0]


def _to_host_on(
    array: Any,
    out: Any,
    stream: Any,
    *,
    follow: bool,
    after: Callable[[int], None] | None = None,
    read: list[EventRecord] | None = None,
) -> CudaFuture[Any]:
    """The copy, from the caller's current stream (``follow``: it already
    waits for the producer, as in a then() callback) or a copy stream.
    ``after``, ``read``: see :func:`to_host_after`."""
    if _cuda.faked():
        return _fake_to_host(array, out, stream, follow=follow, after=after, read=read)
    device, shape, dtype = _device_array_info(array)
    if out is not None:
        out = _check_out(out, shape, dtype)
    current = _backend.current.current_stream(device)
    if stream is not None:
        ptr, _ = _stream_of(stream, device)
        copy_stream = _backend.current.cupy_stream(stream, ptr, device)
    elif follow:
        copy_stream, ptr = current, int(current.ptr)
    else:
        copy_stream = _pools.copy_streams.get(device, 0)
        ptr = int(copy_stream.ptr)
    if after is not None:
        after(ptr)
    else:
        if ptr != int(current.ptr):
            _events.record(int(current.ptr), device).wait_on(ptr, device)
        if not follow:  # a future's value was ordered when it was set
            _order_producer(array, device, ptr)
    cp = _backend.current.cupy()
    if type(array) is cp.ndarray and array.flags.c_contiguous:
        src = array  # what the conversion below returns, for less
    else:
        with _backend.current.on_device(device), copy_stream:
            src = cp.ascontiguousarray(cp.asarray(array))
    keep = (array, src)
    nbytes = src.nbytes
    if out is None:
        # A large result with no cached block would cost the caller a
        # cudaHostAlloc (about 1 ms per 100 MB): a copy thread pins it, and
        # enqueues the copy later. Only on cudafut's own copy stream: on a
        # stream of the caller's (or a then() callback's), work queued
        # after this call must still come after the copy.
        later = nbytes > INLINE_BYTES and stream is None and not follow and read is None
        made = _pinned.host_array(shape, dtype, cached_only=later)
        if made is not None:
            result, buffer = made
            return _copy_to_pinned(src, result, buffer.allocation.ptr, buffer, device, ptr, keep, read)
        if later:
            fut: CudaFuture[Any] = CudaFuture()
            _run_in_worker(_pin_and_copy, fut, src, shape, dtype, device, ptr, keep)
            return fut
        out = np.empty(shape, dtype)
    address = _pinned_address(out)
    if address:
        return _copy_to_pinned(src, out, address, None, device, ptr, keep, read)
    if nbytes == 0:
        with _backend.current.on_device(device):
            rec = _events.record(ptr, device)
            if read is not None:
                read.append(rec)
            return set_future(out, (rec,), keep)
    if read is not None:
        # The copy threads read src later, after an event recorded now has
        # fired and a writer may have changed the array: they copy a snapshot.
        with _backend.current.on_device(device), copy_stream:
            if src.data.ptr == cp.asarray(array).data.ptr:
                src = src.copy()
            read.append(_events.record(ptr, device))
        keep = (array, src)
    staged: CudaFuture[Any] = CudaFuture()
    _start_staged_out(staged, src, out, device, ptr, keep)
    return staged


def _start_staged_out(
    fut: CudaFuture[Any], src: Any, out: np.ndarray[Any, Any], device: int, ptr: int, keep: object
) -> None:
    """Hand the copy of ``src`` into pageable ``out`` to the copy threads,
    in chunks staged through pinned memory; the last one completes ``fut``."""
    threads, chunk = _plan(src.nbytes)
    jobs = _split(_pieces(out, chunk), threads)

    def finish() -> None:
        # Every chunk is on the host now: a host value, with no GPU work left.
        complete_with(fut, out, (), keep)

    transfer = _Transfer(fut, len(jobs), finish)
    base = int(src.data.ptr)
    for job in jobs:
        _run_in_worker(_run_share, transfer, _stage_out, job, base, ptr, device)


def _pin_and_copy(
    fut: CudaFuture[Any],
    src: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: int,
    ptr: int,
    keep: object,
) -> None:
    """On a copy thread: a pinned result block (a ``cudaHostAlloc`` if need
    be), the copy into it on stream ``ptr`` (which already follows the
    producer), and ``fut`` set; past the pinned limit, a staged copy into
    pageable memory instead. Errors go to ``fut``."""
    try:
        with _backend.current.on_device(device):
            made = _pinned.host_array(shape, dtype)
            if made is None:
                _start_staged_out(fut, src, np.empty(shape, dtype), device, ptr, keep)
                return
            result, buffer = made
            _backend.current.memcpy_to_host(result.ctypes.data, int(src.data.ptr), src.nbytes, ptr)
            rec = _events.record(ptr, device)
        buffer.guard = (rec,)
        complete_with(fut, result, (rec,), keep)
    except BaseException as exc:  # noqa: BLE001 - a copy thread never dies of a copy
        with contextlib.suppress(InvalidStateError):  # its consumer cancelled it
            fut.set_exception(exc)


def _order_producer(array: Any, device: int, ptr: int) -> None:
    """The copy stream ``ptr`` waits for the work of the library that made
    ``array`` where that is not CuPy's current stream: a torch tensor's
    current torch stream; JAX's and Numba's streams (docs/design.md, hazard 9)."""
    torch = _torch.loaded()
    if torch is not None and _torch.is_tensor(torch, array):
        _torch.follow_current(torch, device, ptr)
    else:
        order_foreign(array, lambda _d: (ptr, device))


def _copy_to_pinned(
    src: Any,
    out: np.ndarray[Any, Any],
    address: int,
    buffer: _pinned.HostBuffer | None,
    device: int,
    ptr: int,
    keep: object,
    read: list[EventRecord] | None = None,
) -> CudaFuture[Any]:
    """One DMA from ``src`` into ``out``, pinned at ``address``, on stream
    ``ptr``; the future of ``out``."""
    nbytes = src.nbytes
    with _backend.current.on_device(device):
        if nbytes:
            _backend.current.memcpy_to_host(address, int(src.data.ptr), nbytes, ptr)
        rec = _events.record(ptr, device)
    if read is not None:
        read.append(rec)  # the DMA has read src once rec fires
    if buffer is not None:
        buffer.guard = (rec,)
    return set_future(out, (rec,), keep)
