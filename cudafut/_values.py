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

:func:`order_foreign` orders the work other libraries queued for a value's
arrays (JAX's and Numba's streams) before the stream cudafut records on
(docs/design.md, hazard 9).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from . import _backend, _cuda, _events

__all__ = [
    "current_consumer",
    "find_devices",
    "gpu_arrays",
    "normalize_devices",
    "order_foreign",
    "placements",
]

#: DLPack device types of memory on a CUDA device: kDLCUDA, kDLCUDAManaged.
DLPACK_CUDA: Final = (2, 13)

#: Where a leaf's device is: its ``__cuda_array_interface__``, or the device
#: itself once known (a torch tensor, a DLPack device).
Where = dict[str, object] | int
Visit = Callable[[object, Where], object]
#: The stream that will use a device's arrays: ``consumer(device)`` gives
#: ``(cudaStream_t, the device of that stream)``.
Consumer = Callable[[int], tuple[int, int]]

#: The legacy default stream in the DLPack and CUDA array interface
#: protocols, which do not allow 0 (CuPy's null stream is 0).
_LEGACY: Final = 1


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
    ndarray = getattr(_cuda.imported_cupy(), "ndarray", None)
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
    ndarray = _ndarray if _ndarray is not _Never else _cupy_ndarray()
    if type(value) is ndarray:  # the common case: one CuPy array, nothing to walk
        return [value]
    found: list[object] = []
    _walk(value, lambda array, _where: found.append(array), set(), _tensor_type())
    return found


def _walk(value: object, visit: Visit, seen: set[int], tensor: type | None) -> None:
    """Call ``visit(array, where)`` for every GPU array in ``value``, in order
    of appearance, each container once (``seen``: their ids).

    A loop over a stack of iterators, not a recursion: containers nested any
    depth deep (thousands of lists in lists) cost memory, not the Python
    stack. CuPy arrays and scalars are handled inline: this runs at every
    ``await``.
    """
    if type(value) is _ndarray:  # the common case: one CuPy array
        visit(value, value.data.device_id)  # type: ignore[attr-defined]
        return
    if isinstance(value, SCALARS) or value is None:
        return
    items = _items(value, visit, seen, tensor)
    if items is None:
        return
    stack = [iter(items)]
    while stack:
        for item in stack[-1]:
            if type(item) is _ndarray:
                visit(item, item.data.device_id)  # type: ignore[attr-defined]
                continue
            items = _items(item, visit, seen, tensor)
            if items is not None:  # a container: its items first, then the rest
                stack.append(iter(items))
                break
        else:
            stack.pop()


#: Leaves that are never GPU arrays, skipped at once (also by the native
#: core's await and result(), which test ``type(v) in SCALARS`` first: the
#: commonest first).
SCALARS: Final = (int, float, str, bytes, complex)


def _items(value: object, visit: Visit, seen: set[int], tensor: type | None) -> Iterable[object] | None:
    """Visit ``value`` if it is a GPU array; return its items if it is a
    container not seen yet (list, tuple, dict, dataclass instance)."""
    if isinstance(value, (list, tuple, dict)):  # named tuples included
        if id(value) in seen:  # a container that holds itself
            return None
        seen.add(id(value))
        return value.values() if isinstance(value, dict) else value
    if isinstance(value, SCALARS) or value is None:
        return None
    if type(value) is _ndarray:  # a CuPy array: no __cuda_array_interface__ dict
        visit(value, value.data.device_id)  # type: ignore[attr-defined]
        return None
    if tensor is not None and isinstance(value, tensor):
        # Before __cuda_array_interface__, which raises for a tensor that
        # requires grad (and costs a dict).
        if value.is_cuda:  # type: ignore[attr-defined]
            visit(value, value.get_device())  # type: ignore[attr-defined]
        return None
    try:
        interface = value.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError:
        pass
    else:
        if not isinstance(interface, dict):
            raise TypeError(
                f"{type(value).__name__}.__cuda_array_interface__ must be a dict (the CUDA array "
                f"interface), not {type(interface).__name__}"
            )
        visit(value, interface)
        return None
    if hasattr(type(value), "__dataclass_fields__"):  # a dataclass instance
        if id(value) in seen:
            return None
        seen.add(id(value))
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)]  # type: ignore[arg-type]
    dlpack_device = getattr(value, "__dlpack_device__", None)
    if dlpack_device is not None:
        kind, index = dlpack_device()
        if kind in DLPACK_CUDA:
            visit(value, int(index))
    return None


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
        return _backend.current.current_device()
    return _backend.current.pointer_device(ptr)


def current_consumer(device: int) -> tuple[int, int]:
    """CuPy's current stream of ``device`` in the calling thread, as a
    :data:`Consumer`: where ``set_result()`` and ``record()`` record."""
    return int(_backend.current.current_stream(device).ptr), device


def consumer_on(streams: Mapping[int, Any]) -> Consumer:
    """A :data:`Consumer` for work run with ``streams`` (``{device: CuPy
    stream}``) current: an array on one of their devices is ordered before
    that stream, one on another device before its current stream (where the
    child's record of that device goes)."""

    def consumer(device: int) -> tuple[int, int]:
        stream = streams.get(device)
        return current_consumer(device) if stream is None else (int(stream.ptr), device)

    return consumer


def order_foreign(value: object, consumer: Consumer = current_consumer) -> None:
    """Order other libraries' work on the GPU arrays of ``value`` before the
    stream ``consumer(device)`` of each array's device, so that an event
    recorded there next, or a copy enqueued there, comes after that work
    (docs/design.md, hazard 9).

    CuPy arrays and torch tensors are skipped: cudafut records them on the
    current streams their work was queued on (a type check; no walk for a
    lone one). Every other GPU array is ordered by what it exports:

    - a ``__cuda_array_interface__`` that names a ``stream`` (version 3:
      Numba device arrays): an event recorded on that stream, which the
      consumer stream waits on (``cudaStreamWaitEvent``; a few µs, nothing
      if it is the consumer stream);
    - else ``__dlpack__``: ``__dlpack__(stream=consumer stream)``, with which
      the producer makes the consumer stream wait for its work, as the
      DLPack protocol asks (JAX: a ``cudaStreamWaitEvent`` on the buffer's
      definition events, no host wait); the capsule is dropped unused;
    - else a ``__cuda_array_interface__`` without a stream: by that
      protocol, its data may be used on any stream: nothing to do.

    Blocks neither the GPU nor, for JAX, the host (a producer may wait for
    its own work to be enqueued).

    Raises:
        ValueError: an array that cannot be ordered: its ``__dlpack__``
            refused the stream (a producer without stream support, a JAX
            array sharded over several devices, a deleted one), or it has
            ``__dlpack_device__`` without ``__dlpack__``.
    """
    ndarray = _ndarray if _ndarray is not _Never else _cupy_ndarray()
    if type(value) is ndarray:  # the common case: nothing to walk
        return
    tensor = _tensor_type()
    if tensor is not None and isinstance(value, tensor):
        return

    def visit(array: object, where: Where) -> None:
        if isinstance(array, ndarray) or (tensor is not None and isinstance(array, tensor)):
            return
        _order_one(array, where, consumer)

    _walk(value, visit, set(), tensor)


def _same_stream(a: int, b: int) -> bool:
    return a == b or (a in (0, _LEGACY) and b in (0, _LEGACY))


def _order_one(array: object, where: Where, consumer: Consumer) -> None:
    device = _device_of(array, where)
    stream, stream_device = consumer(device)
    producer = where.get("stream") if isinstance(where, dict) else None
    if isinstance(producer, int):
        if not _same_stream(producer, stream):
            _events.record(producer or _LEGACY, device).wait_on(stream, stream_device)
        return
    export = getattr(array, "__dlpack__", None)
    if export is None:
        if isinstance(where, dict):
            return  # no stream named: ready for any stream, by the array interface's rules
        raise ValueError(
            f"cannot order the GPU work that produced a {type(array).__name__}: it has "
            "__dlpack_device__() but no __dlpack__(stream=...) to order it by; wait for it "
            "on the host first and pass a CuPy view of it (cupy.asarray or cupy.from_dlpack)"
        )
    try:
        export(stream=stream or _LEGACY)
    except Exception as exc:  # any refusal: cannot order, so never a value that may be stale
        raise ValueError(
            f"cannot order the GPU work that produced a {type(array).__name__} before "
            f"stream {stream:#x} of device {stream_device}: its __dlpack__(stream=...) "
            f"failed ({type(exc).__name__}: {exc}); wait for it on the host first (JAX: "
            "x.block_until_ready()) and pass cupy.asarray(x) instead"
        ) from exc


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
