"""Finding the devices a value lives on.

A value is a GPU array, or a list, tuple (named tuples included), dict or
dataclass instance of them, nested. A GPU array is, in the order they are
tried: a PyTorch CUDA tensor (when torch is imported; read from its
attributes, ``requires_grad`` or not), any object with
``__cuda_array_interface__`` (CuPy, Numba device arrays, ...), or any object
whose ``__dlpack_device__()`` names CUDA memory (``kDLCUDA`` = 2 or
``kDLCUDAManaged`` = 13; JAX arrays, recent NumPy-likes), on the device it
names. Other leaves (numbers, strings, NumPy arrays, CPU tensors, None) live
on no device.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Final

from . import _cuda

__all__ = ["find_devices", "gpu_arrays", "normalize_devices", "placements"]

#: DLPack device types of memory on a CUDA device: kDLCUDA, kDLCUDAManaged.
DLPACK_CUDA: Final = (2, 13)

#: Where a leaf's device is: its ``__cuda_array_interface__``, or the device
#: itself once known (a torch tensor, a DLPack device).
Where = dict[str, object] | int
Visit = Callable[[object, Where], object]


def _tensor_type() -> type | None:
    """``torch.Tensor`` if the program imported torch (never imports it)."""
    torch = sys.modules.get("torch")
    return None if torch is None else getattr(torch, "Tensor", None)


class _Never:
    """Stands for ``cupy.ndarray`` until CuPy is imported: no value has it as type."""


_ndarray: type = _Never


def _cupy_ndarray() -> type:
    """``cupy.ndarray`` once CuPy is imported (remembered), else a type no value has."""
    global _ndarray
    cp = sys.modules.get("cupy")
    ndarray = getattr(cp, "ndarray", None)
    if isinstance(ndarray, type):
        _ndarray = ndarray
        return ndarray
    return _Never


def find_devices(value: object) -> tuple[int, ...]:
    """The devices of every GPU array in ``value``, in order of appearance.

    Costs nothing on the GPU; a CuPy array or torch tensor is read from its
    attributes, a DLPack object costs its ``__dlpack_device__()``, another
    ``__cuda_array_interface__`` object (a Numba array) one
    ``cudaPointerGetAttributes``.
    """
    ndarray = _ndarray if _ndarray is not _Never else _cupy_ndarray()
    if type(value) is ndarray:  # the common case: one CuPy array, no dict built
        return (value.data.device_id,)  # type: ignore[attr-defined]
    found: dict[int, None] = {}
    _walk(value, lambda array, where: found.setdefault(_device_of(array, where)), set(), _tensor_type())
    return tuple(found)


def placements(value: object, tensor: type | None) -> dict[int, int]:
    """Per device of ``value``, in order: 2 if it holds an instance of
    ``tensor`` (``torch.Tensor``) there, 1 if it holds another GPU array,
    3 for both."""
    found: dict[int, int] = {}

    def visit(array: object, where: Where) -> None:
        device = _device_of(array, where)
        kind = 2 if tensor is not None and isinstance(array, tensor) else 1
        found[device] = found.get(device, 0) | kind

    if _ndarray is _Never:
        _cupy_ndarray()
    _walk(value, visit, set(), tensor)
    return found


def gpu_arrays(value: object) -> list[object]:
    """Every GPU array in ``value``, in order of appearance (the host walks
    the containers; no CUDA call)."""
    found: list[object] = []
    if _ndarray is _Never:
        _cupy_ndarray()
    _walk(value, lambda array, _where: found.append(array), set(), _tensor_type())
    return found


def _walk(value: object, visit: Visit, seen: set[int], tensor: type | None) -> None:
    if isinstance(value, (list, tuple, dict)):  # named tuples included
        if id(value) in seen:  # a container that holds itself
            return
        seen.add(id(value))
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            _walk(item, visit, seen, tensor)
        return
    if isinstance(value, (str, bytes, int, float, complex)) or value is None:
        return
    if type(value) is _ndarray:  # a CuPy array: no __cuda_array_interface__ dict
        visit(value, value.data.device_id)  # type: ignore[attr-defined]
        return
    if tensor is not None and isinstance(value, tensor):
        # Before __cuda_array_interface__, which raises for a tensor that
        # requires grad (and costs a dict).
        if value.is_cuda:  # type: ignore[attr-defined]
            visit(value, value.get_device())  # type: ignore[attr-defined]
        return
    try:
        interface = value.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError:
        pass
    else:
        visit(value, interface)
        return
    if hasattr(type(value), "__dataclass_fields__"):  # a dataclass instance
        if id(value) in seen:
            return
        seen.add(id(value))
        for field in dataclasses.fields(value):  # type: ignore[arg-type]
            _walk(getattr(value, field.name, None), visit, seen, tensor)
        return
    dlpack_device = getattr(value, "__dlpack_device__", None)
    if dlpack_device is not None:
        kind, index = dlpack_device()
        if kind in DLPACK_CUDA:
            visit(value, int(index))


def _device_of(value: object, where: Where) -> int:
    if isinstance(where, int):
        return where
    interface = where
    device = getattr(value, "device", None)
    for attr in ("id", "index"):  # cupy.cuda.Device.id, torch.device.index
        index = getattr(device, attr, None)
        if isinstance(index, int):
            return index
    data = interface.get("data")
    ptr = data[0] if isinstance(data, tuple) and data else 0
    if not isinstance(ptr, int) or ptr == 0:  # an empty array owns no memory
        return _cuda.current_device()
    return _cuda.pointer_device(ptr)


def normalize_devices(devices: int | Iterable[int]) -> tuple[int, ...]:
    """Validate a ``devices`` argument: an index or an iterable of them.

    Returns:
        The devices, each once, in order.

    Raises:
        TypeError: ``devices`` is neither an int nor an iterable of ints.
        ValueError: no device, or one out of range.
        CudaUnavailableError: CUDA cannot be used here (a negative index is
            a ``ValueError`` first).
    """
    if type(devices) is int:
        return (_cuda.check_device(devices),)
    if isinstance(devices, int) and not isinstance(devices, bool):  # an int subclass
        items: tuple[object, ...] = (devices,)
    elif isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise TypeError(
            "devices must be an int device ordinal (0, 1, ...) or an iterable of "
            f"them, such as [0, 1], or None for the value's own devices; not {devices!r}"
        )
    else:
        items = tuple(devices)
    if not items:
        raise ValueError(
            "devices must name at least one device; a future on no device "
            "would order nothing (pass devices=None to use the value's own)"
        )
    for d in items:  # every argument error before the first CUDA call
        _cuda.check_device_argument(d)
    return tuple(dict.fromkeys(_cuda.check_device(d) for d in items))
