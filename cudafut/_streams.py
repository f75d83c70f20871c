"""Stream handles: CuPy's current streams, the handle and device of any
stream object cudafut takes (CuPy's, PyTorch's, the ``__cuda_stream__``
protocol's), new streams, and calls made with streams current.

A part of the CUDA seam (:mod:`cudafut._cuda` re-exports every function,
and callers call them there: ``_cuda.stream_handle(s)``). The seam's other
functions are called here through ``_cuda`` too, looked up at each call,
so that :mod:`cudafut.testing`'s fake and a test's replacement reach these
calls as they reach every other caller's.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

from . import _backend

# cudaStreamLegacy and cudaStreamPerThread: handles that stand for "the
# default stream of the current device (and, for per-thread, thread)".
# cudaStreamLegacy and cudaStreamPerThread: handles that stand for "the
# default stream of the current device (and, for per-thread, thread)".
SPECIAL_STREAMS: Final = (0, 1, 2)


def current_stream(device: int) -> Any:
    """CuPy's current stream of ``device`` for the calling thread."""
    return _backend.current.cupy().cuda.get_current_stream(device)


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
        return handle, device_id if device_id >= 0 else _backend.current.stream_device(handle)
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
    if handle in SPECIAL_STREAMS:
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
    return _backend.current.stream_device(handle)


def stream_device(stream: int) -> int:
    """The device a stream belongs to: that of its CUDA context
    (``cuStreamGetCtx``); the default streams (0, 1, 2) are the current
    device's. About a µs on the host; the GPU is not involved.

    Raises:
        ValueError: CUDA does not know the handle.
    """
    if stream in SPECIAL_STREAMS:
        return _backend.current.current_device()
    driver = _backend.current.cupy().cuda.driver
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
    with _backend.current.on_device(device):
        return _backend.current.cupy().cuda.Stream(non_blocking=True, priority=priority)


def cupy_stream(stream: object, ptr: int, device: int) -> Any:
    """A CuPy stream object for ``stream`` (whose handle is ``ptr``, on
    ``device``), to make it CuPy's current stream: ``stream`` itself if it
    is one, else a non-owning CuPy wrapper (the caller keeps ``stream``
    alive)."""
    cp = _backend.current.cupy()
    if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
        return stream
    # CuPy 14 deprecates ExternalStream(ptr) for the stream protocol;
    # from_external takes the current device.
    with _backend.current.on_device(device):
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
    rt = _backend.current.runtime()
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


def stream_synchronize(stream: int) -> None:
    """``cudaStreamSynchronize``: block the calling thread until the work
    enqueued on ``stream`` so far has completed."""
    _backend.current.runtime().streamSynchronize(stream)


def current_stream_getter() -> Callable[[int], Any]:
    """CuPy's ``get_current_stream(device)``, for callers that bind it once
    (a stream switch per task step): calling it costs what CuPy's does."""
    get: Callable[[int], Any] = _backend.current.cupy().cuda.get_current_stream
    return get
