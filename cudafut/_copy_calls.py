"""CUDA's copy and pinned-memory calls: the raw calls of :mod:`cudafut._copies`
and :mod:`cudafut._pinned`, one function each.

A part of the CUDA seam (:mod:`cudafut._cuda` re-exports every function):
the callers look them up as ``_cuda.name`` at each call (once per share on
the copy threads), so a fake (cudafut.testing) or a test can replace them
there.
"""

from __future__ import annotations

from typing import Final

from . import _backend, _runtime

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
    _backend.current.runtime().memcpyAsync(dst, src, nbytes, _H2D, stream)


def memcpy_to_host(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes`` from device address ``src`` to host
    address ``dst`` on ``stream`` (of the current device).

    Into pinned memory it enqueues and returns (a few µs): ``dst`` is
    written later, once the stream reaches the copy. Into pageable memory
    the driver stages it and blocks the calling thread until the copy is
    done."""
    _backend.current.runtime().memcpyAsync(dst, src, nbytes, _D2H, stream)


def pointer_is_pinned(ptr: int) -> bool:
    """Whether host address ``ptr`` lies in page-locked memory that CUDA
    knows (``cudaPointerGetAttributes``, about a µs; no GPU work). An
    address CUDA does not know is pageable: False."""
    try:
        return int(_backend.current.runtime().pointerGetAttributes(ptr).type) == _HOST_PINNED
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
        return int(_backend.current.runtime().hostAlloc(nbytes, _HOST_ALLOC_PORTABLE))
    except Exception as exc:
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            raise _runtime.cuda_error(status) from exc
        raise


def free_host(ptr: int) -> None:
    """``cudaFreeHost`` of a block from :func:`host_alloc`. Blocks the
    calling thread, and may wait until the whole device is idle."""
    _backend.current.runtime().freeHost(ptr)
