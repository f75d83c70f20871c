"""The collectives: argument checks, then one NCCL call through the group.

Each function checks its arguments (before anything is enqueued), then hands
the group the name of the :class:`~cudafut.distributed._nccl.Communicator`
method to call and its arguments but the stream (all_to_all, several
calls, a ``launch(comm, stream)``: no closure per call otherwise). The values
below are NCCL's enums (``ncclRedOp_t``, ``ncclDataType_t``), so that the
checks need neither CuPy nor NCCL.
"""

from __future__ import annotations

from typing import Any, Final

from .. import _backend
from .._future import CudaFuture
from . import _nccl
from ._group import ProcessGroup, resolve

OPS: Final = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
DTYPES: Final = {
    "i1": 0,
    "u1": 1,
    "i4": 2,
    "u4": 3,
    "i8": 4,
    "u8": 5,
    "f2": 6,
    "f4": 7,
    "f8": 8,
}


def check_op(op: object) -> int:
    """The NCCL reduction of ``op``, one of ``"sum"``, ``"prod"``, ``"max"``,
    ``"min"``, ``"avg"``."""
    try:
        return OPS[op]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, not {op!r}") from None


class _Buffer:
    """What NCCL needs of an array: pointer, element count, dtype, shape."""

    __slots__ = ("array", "count", "dtype", "itemsize", "ptr", "shape", "typestr")

    def __init__(self, array: object, what: str, group: ProcessGroup) -> None:
        if type(array) is _ndarray or (_ndarray is None and type(array) is _find_cupy(array)):
            self._of_cupy(array, what, group)
            return
        iface = getattr(array, "__cuda_array_interface__", None)
        if not isinstance(iface, dict):
            raise TypeError(
                f"{what} must be a GPU array (CuPy, or anything with __cuda_array_interface__ "
                f"such as a torch tensor), not {type(array).__name__}"
            )
        typestr = str(iface["typestr"])
        code = typestr[1:]
        if code not in DTYPES:
            raise TypeError(_bad_dtype(what, typestr))
        shape = tuple(int(d) for d in iface["shape"])
        itemsize = int(code[1:])
        count = 1
        for d in shape:
            count *= d
        strides = iface.get("strides")
        if strides is not None and count > 1:
            expected, step = [], itemsize
            for d in reversed(shape):
                expected.append(step)
                step *= d
            if tuple(strides) != tuple(reversed(expected)):
                raise ValueError(_NOT_CONTIGUOUS.format(what=what))
        ptr = int(iface["data"][0])
        if count:
            device = _device_of(array, ptr)
            if device != group.device:
                raise ValueError(_other_device(what, device, group))
        self.array = array
        self.ptr = ptr
        self.count = count
        self.dtype = DTYPES[code]
        self.itemsize = itemsize
        self.shape = shape
        self.typestr = typestr

    def _of_cupy(self, array: Any, what: str, group: ProcessGroup) -> None:
        self.ptr, self.count, self.dtype, self.itemsize, self.typestr = _read_cupy(array, what, group)
        self.array = array
        self.shape = array.shape


def _read_cupy(array: Any, what: str, group: ProcessGroup) -> tuple[int, int, int, int, str]:
    """``(ptr, count, NCCL dtype, itemsize, typestr)`` of a ``cupy.ndarray``,
    checked: one Python call, no allocation but the tuple."""
    # Read without its __cuda_array_interface__ (a dict built at each read,
    # with the dtype's descr and the current stream): the same checks, in
    # the same order, from its attributes. CuPy exports strides only when
    # the array is not C-contiguous by its own test, which is _Buffer's
    # (dimensions of one element aside, whose strides neither reads).
    dtype = array.dtype
    known = _dtypes.get(dtype)
    if known is None:
        known = _dtype_of(dtype)
    typestr, nccl_dtype, itemsize = known
    if nccl_dtype < 0:
        raise TypeError(_bad_dtype(what, typestr))
    count = array.size
    if count > 1 and not array._c_contiguous:  # noqa: SLF001 - CuPy's flag, read as .flags does
        raise ValueError(_NOT_CONTIGUOUS.format(what=what))
    ptr = 0
    if count:
        data = array.data
        ptr = data.ptr
        device = data.device_id
        if device != group.device:
            raise ValueError(_other_device(what, device, group))
    return ptr, count, nccl_dtype, itemsize, typestr


def _operand(array: Any, group: ProcessGroup) -> tuple[int, int, int]:
    """``(ptr, count, NCCL dtype)`` of an in-place collective's ``array``,
    checked as :class:`_Buffer` checks it (a CuPy array without one)."""
    if type(array) is _ndarray:
        ptr, count, dtype, _, _ = _read_cupy(array, "array", group)
        return ptr, count, dtype
    buf = _Buffer(array, "array", group)
    return buf.ptr, buf.count, buf.dtype


_NOT_CONTIGUOUS: Final = "{what} must be C-contiguous (copy it with .copy() first)"


def _bad_dtype(what: str, typestr: str) -> str:
    return (
        f"{what} has dtype {typestr!r}, which NCCL cannot reduce or move; use one of "
        "int8, uint8, int32, uint32, int64, uint64, float16, float32, float64"
    )


def _other_device(what: str, device: int, group: ProcessGroup) -> str:
    return f"{what} is on device {device}, but this rank's group runs on device {group.device}"


#: ``cupy.ndarray`` once found (None until CuPy is imported), whose arrays
#: _Buffer reads from their attributes; a class nothing is an instance of
#: where CuPy's arrays cannot be read so (HIP, an unknown CuPy).
_ndarray: type | None = None
#: A CuPy dtype's typestr, NCCL dtype (-1: not one NCCL takes) and itemsize.
_dtypes: dict[Any, tuple[str, int, int]] = {}


class _NoArray:
    """What _ndarray is where CuPy's arrays are read through the interface."""


def _find_cupy(array: object) -> type | None:
    """``cupy.ndarray``, if CuPy is imported (it is, if ``array`` is one)."""
    global _ndarray
    found = _nccl.cupy_array_type()
    if found is None:
        return None  # not imported (yet): looked for again at the next call
    cls, readable = found
    _ndarray = cls if readable else _NoArray
    return _ndarray


def _dtype_of(dtype: Any) -> tuple[str, int, int]:
    typestr = str(dtype.str)
    code = typestr[1:]
    known = (typestr, DTYPES[code], int(code[1:])) if code in DTYPES else (typestr, -1, 0)
    if len(_dtypes) < 64:
        _dtypes[dtype] = known
    return known


def _device_of(array: object, ptr: int) -> int:
    # CuPy arrays and torch tensors say it without a CUDA call (a few µs).
    device = getattr(array, "device", None)
    index = getattr(device, "id", None)
    if index is None:
        index = getattr(device, "index", None)
    return int(index) if isinstance(index, int) else _backend.current.pointer_device(ptr)


def _empty(group: ProcessGroup, shape: tuple[int, ...], like: _Buffer) -> Any:
    cp = _backend.current.cupy()
    with _backend.current.on_device(group.device):
        # On the caller's current stream, where the inputs are made.
        return cp.empty(shape, dtype=like.typestr)


def _out(out: object, group: ProcessGroup, shape: tuple[int, ...], like: _Buffer) -> _Buffer:
    if out is None:
        out = _empty(group, shape, like)
    buf = _Buffer(out, "out", group)
    if buf.shape != shape or buf.dtype != like.dtype:
        raise ValueError(
            f"out must have shape {shape} and the input's dtype, not shape {buf.shape} "
            f"(dtype {buf.typestr} against {like.typestr})"
        )
    return buf


def _peer(value: object, group: ProcessGroup, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a rank (an int), not {value!r}")
    if not 0 <= value < group.size:
        raise ValueError(f"{what} must be a rank of the group, in [0, {group.size}), not {value}")
    return value


def _blocks(buf: _Buffer, group: ProcessGroup, what: str) -> tuple[int, ...]:
    if not buf.shape or buf.shape[0] % group.size:
        raise ValueError(
            f"{what}'s first dimension must be a multiple of the group's size ({group.size}); "
            f"its shape is {buf.shape}"
        )
    return (buf.shape[0] // group.size, *buf.shape[1:])


def all_reduce(
    array: Any, op: str = "sum", *, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Reduce ``array`` over the group's ranks, in place.

    Returns a future of ``array``, set at once: its event follows the
    all-reduce on the group's communication stream, which first waits on the
    caller's current stream (where ``array`` is produced). ``await`` it,
    ``.result()``, ``.wait()`` or ``.then()`` it as any :class:`CudaFuture`.
    Every rank of the group must call it, in the same order as its other
    collectives. Costs a few µs on the host beside NCCL's own call (less
    with the native core, which makes the stream wait from C); blocks
    neither the thread (unless another thread's call of the group is inside
    NCCL) nor the GPU (only the communication stream waits).

    Args:
        array: a C-contiguous CuPy array (or torch tensor) on the group's device.
        op: ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` or ``"avg"``.
        group: the group (default: the world).
        timeout: seconds after which the collective fails the group with
            :class:`CollectiveError` (default: the group's).

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = group if type(group) is ProcessGroup else resolve(group)
    nop = OPS.get(op) if type(op) is str else None
    if nop is None:
        nop = check_op(op)
    if type(array) is _ndarray:  # _operand(), inline: one call less on the hottest path
        ptr, count, dtype, _, _ = _read_cupy(array, "array", g)
    else:
        ptr, count, dtype = _operand(array, g)
    return g.enqueue("all_reduce", (ptr, ptr, count, dtype, nop), array, array, timeout)


def all_gather(
    array: Any, *, out: Any = None, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Gather every rank's ``array`` into ``out`` (shape ``(size, *array.shape)``,
    a new CuPy array by default, made on the caller's current stream).

    Returns a future of ``out``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments (``out`` of the wrong shape or
            dtype); nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    buf = _Buffer(array, "array", g)
    dst = _out(out, g, (g.size, *buf.shape), buf)
    args = (buf.ptr, dst.ptr, buf.count, buf.dtype)
    return g.enqueue("all_gather", args, dst.array, (array, dst.array), timeout)


def reduce_scatter(
    array: Any,
    op: str = "sum",
    *,
    out: Any = None,
    group: ProcessGroup | None = None,
    timeout: float | None = None,
) -> CudaFuture[Any]:
    """Reduce ``array`` (shape ``(size * n, ...)``) over the ranks and give
    rank ``r`` block ``r`` of the result in ``out`` (shape ``(n, ...)``).

    Returns a future of ``out``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    nop = check_op(op)
    buf = _Buffer(array, "array", g)
    dst = _out(out, g, _blocks(buf, g, "array"), buf)
    args = (buf.ptr, dst.ptr, dst.count, buf.dtype, nop)
    return g.enqueue("reduce_scatter", args, dst.array, (array, dst.array), timeout)


def broadcast(
    array: Any, src: int, *, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Copy rank ``src``'s ``array`` into every rank's ``array``, in place.

    Returns a future of ``array``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    root = _peer(src, g, "src")
    ptr, count, dtype = _operand(array, g)
    return g.enqueue("broadcast", (ptr, ptr, count, dtype, root), array, array, timeout)


def reduce(
    array: Any,
    dst: int,
    op: str = "sum",
    *,
    group: ProcessGroup | None = None,
    timeout: float | None = None,
) -> CudaFuture[Any]:
    """Reduce ``array`` over the ranks into rank ``dst``'s ``array``, in place
    (other ranks' arrays are unchanged).

    Returns a future of ``array``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    root = _peer(dst, g, "dst")
    nop = check_op(op)
    ptr, count, dtype = _operand(array, g)
    return g.enqueue("reduce", (ptr, ptr, count, dtype, nop, root), array, array, timeout)


def all_to_all(
    array: Any, *, out: Any = None, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Send block ``j`` of ``array`` (shape ``(size * n, ...)``) to rank ``j``;
    block ``i`` of ``out`` (same shape) comes from rank ``i``.

    Returns a future of ``out``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    buf = _Buffer(array, "array", g)
    _blocks(buf, g, "array")
    dst = _out(out, g, buf.shape, buf)
    block = buf.count // g.size
    step = block * buf.itemsize

    def launch(comm: _nccl.Communicator, stream: int) -> None:
        _nccl.group_start()
        try:
            for peer in range(g.size):
                comm.send(buf.ptr + peer * step, block, buf.dtype, peer, stream)
                comm.recv(dst.ptr + peer * step, block, buf.dtype, peer, stream)
        finally:
            _nccl.group_end()

    return g.enqueue("all_to_all", (), dst.array, (array, dst.array), timeout, launch)


def send(
    array: Any, dst: int, *, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Send ``array`` to rank ``dst``, which calls :func:`recv`.

    Returns a future of ``array``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    peer = _peer(dst, g, "dst")
    ptr, count, dtype = _operand(array, g)
    return g.enqueue("send", (ptr, count, dtype, peer), array, array, timeout)


def recv(
    array: Any, src: int, *, group: ProcessGroup | None = None, timeout: float | None = None
) -> CudaFuture[Any]:
    """Receive into ``array`` what rank ``src`` sends with :func:`send`.

    Returns a future of ``array``, set at once, as :func:`all_reduce` does.

    Raises:
        TypeError, ValueError: bad arguments; nothing was enqueued.
        CollectiveError: the group was aborted earlier, or NCCL refused the call.
    """
    g = resolve(group)
    peer = _peer(src, g, "src")
    ptr, count, dtype = _operand(array, g)
    return g.enqueue("recv", (ptr, count, dtype, peer), array, array, timeout)
