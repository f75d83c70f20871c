"""Interprocess events and memory, and the PCI bus ids that name devices
in every process: what :mod:`cudafut._shared` needs for a future crossing
processes.

A part of the CUDA seam (:mod:`cudafut._cuda` re-exports every function,
and callers call them there).
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

from . import _backend
from ._errors import CudaError

# libcuda's cuMemGetAddressRange_v2, loaded on first use (CuPy has no wrapper).
_address_range: Any = None
_EVENT_INTERPROCESS: Final = 0x4  # cudaEventInterprocess
_IPC_LAZY_PEER_ACCESS: Final = 0x1  # cudaIpcMemLazyEnablePeerAccess


def ipc_event_create(device: int) -> tuple[int, bytes]:
    """A new interprocess event on ``device`` (timing disabled, as CUDA
    requires) and its handle for other processes (a few µs)."""
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
        event = int(rt.eventCreateWithFlags(rt.eventDisableTiming | _EVENT_INTERPROCESS))
    try:
        return event, bytes(rt.ipcGetEventHandle(event))
    except BaseException:
        rt.eventDestroy(event)
        raise


def ipc_open_event(handle: bytes, device: int) -> int:
    """Open another process's interprocess event (slow the first time in a
    process: callers keep what they open)."""
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
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
    rt = _backend.current.runtime()
    if _address_range is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _address_range = fn
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with _backend.current.on_device(device):
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
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
        return int(rt.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))


def ipc_close_memory(ptr: int) -> None:
    """Unmap an allocation :func:`ipc_open_memory` mapped."""
    _backend.current.runtime().ipcCloseMemHandle(ptr)


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
    cp = _backend.current.cupy()
    memory = cp.cuda.UnownedMemory(base, size, owner, device_id=device)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, offset), strides)


def device_bus_id(device: int) -> str:
    """``device``'s PCI bus id, which names it in every process (device
    ordinals depend on each process's ``CUDA_VISIBLE_DEVICES``)."""
    return str(_backend.current.runtime().deviceGetPCIBusId(device))


def device_of_bus_id(bus_id: str) -> int:
    """This process's ordinal of the device with PCI bus id ``bus_id``.

    Raises:
        CudaError: no visible device has that bus id.
    """
    return int(_backend.current.runtime().deviceGetByPCIBusId(bus_id))
