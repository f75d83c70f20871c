"""Finding the devices a value lives on.

A value is a CuPy array, any object with ``__cuda_array_interface__``
(PyTorch tensors, Numba arrays, ...), or a list, tuple or dict of them,
nested. Other leaves (numbers, strings, NumPy arrays, None) live on no device.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import _cuda

__all__ = ["find_devices", "normalize_devices"]


def find_devices(value: object) -> tuple[int, ...]:
    """The devices of every GPU array in ``value``, in order of appearance.

    Costs nothing on the GPU; a CuPy or PyTorch array is read from its
    attributes, another ``__cuda_array_interface__`` object costs one
    ``cudaPointerGetAttributes``.
    """
    found: dict[int, None] = {}
    _walk(value, found, set())
    return tuple(found)


def _walk(value: object, found: dict[int, None], seen: set[int]) -> None:
    if isinstance(value, (list, tuple, dict)):
        if id(value) in seen:  # a container that holds itself
            return
        seen.add(id(value))
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            _walk(item, found, seen)
        return
    if isinstance(value, (str, bytes, int, float, complex)) or value is None:
        return
    try:
        interface = value.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError:  # not a GPU array (a CPU torch tensor raises here too)
        return
    found[_device_of(value, interface)] = None


def _device_of(value: object, interface: dict[str, object]) -> int:
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
