"""Stream-safe release of CuPy memory: :func:`record_stream`.

CuPy's memory pool hands a freed block back to the stream it was allocated
on, at once: work queued on *another* stream that still reads the block
races with the next allocation on the first (docs/design.md, hazard 5).
PyTorch's caching allocator has ``Tensor.record_stream`` for this; CuPy has
no free hook, so cudafut wraps CuPy's allocator: every allocation returns
memory owned by a small :class:`_Block` that knows the stream current at
allocation (the stream whose pool arena the block returns to) and the other
streams recorded for it. When the last array using the block is freed, the
block records one event on each of those streams and goes back to CuPy's
pool only once they completed (the watcher thread keeps it until then).

The wrapper is installed on first use of CUDA by cudafut, and at ``import
cudafut`` if CuPy is already imported; it wraps whatever allocator was in
force (CuPy's default pool, or one the user set). Arrays allocated before,
or under another allocator set later, are *untracked*: :func:`record_stream`
then keeps the array alive until the work queued on the stream so far is
done (see its docstring). ``CUDAFUT_WRAP_ALLOCATOR=0`` in the environment
leaves CuPy's allocator alone.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from typing import Any, Final

from . import _cuda, _events, _lifetimes, _pinned, _torch
from ._log import logger

__all__ = ["MemoryStatistics", "install", "memory_statistics", "record_stream", "record_streams_of"]

_lock: Final = threading.Lock()
_installed_over: Any = None  # the allocator we wrap, once installed
_state = {"frees_delayed": 0, "untracked_holds": 0}


# The reader streams of each live block that has any: ``{id(block): {stream
# handle: (device, stream object)}}``. Kept here, reachable from this module,
# and not on the block: a garbage collection that finds a block and its
# reader stream in one unreachable cycle (a traceback's frame holding both,
# say) runs the finalizers of the whole cycle in no set order, and CuPy's
# ``Stream.__del__`` could destroy the stream before the block's ``__del__``
# records an event on it: that crashed the process (the segfault seen during
# a collection in the GPU suite). An object reachable from a module is never
# part of such a cycle, so the stream outlives the block's finalizer.
_readers: dict[int, dict[int, tuple[int, object]]] = {}


class _Block:
    """Owns one allocation of the wrapped allocator (its ``MemoryPointer``)."""

    __slots__ = ("device", "memory", "stream")

    def __init__(self, memory: Any, device: int, stream: int) -> None:
        self.memory = memory
        self.device = device
        self.stream = stream

    def add_reader(self, stream: int, device: int, owner: object) -> None:
        """Record ``stream`` (of ``device``; ``owner`` its object, kept alive
        until the free) as a user of the block; a dictionary update."""
        if stream == self.stream:
            return  # the allocating stream: CuPy's pool orders it already
        readers = _readers.get(id(self))
        if readers is None:  # setdefault: two threads may add the first reader at once
            readers = _readers.setdefault(id(self), {})
        readers[stream] = (device, owner)

    @property
    def readers(self) -> dict[int, tuple[int, object]] | None:
        """The streams recorded so far: ``{handle: (device, stream object)}``."""
        return _readers.get(id(self))

    def __del__(self) -> None:
        readers = _readers.pop(id(self), None)
        if not readers:
            return  # back to CuPy's pool now, as without cudafut
        try:
            records = [_events.record(stream, device) for stream, (device, _) in readers.items()]
            if _lifetimes.keep_until(records, (self.memory, readers)):
                _state["frees_delayed"] += 1
        except Exception:  # noqa: BLE001 - a finalizer must not raise (a dead device, shutdown)
            pass


def _wrap(allocator: Any) -> Any:
    allocate = _cuda.wrap_cupy_allocator(allocator, _Block)
    allocate.cudafut_wraps = allocator
    return allocate


def install(cp: Any) -> None:
    """Wrap the allocator of CuPy (the module ``cp``, imported) in force, once;
    no GPU call. ``cp`` is what :func:`_cuda.on_initialise` hands its hooks:
    the seam's functions reach the same module."""
    global _installed_over
    if _installed_over is not None or os.environ.get("CUDAFUT_WRAP_ALLOCATOR", "1") == "0":
        return
    with _lock:
        if _installed_over is not None:
            return
        current = _cuda.cupy_allocator()
        if hasattr(current, "cudafut_wraps"):
            _installed_over = current.cudafut_wraps
            return
        try:
            _cuda.set_cupy_allocator(_wrap(current))
        except Exception as exc:  # noqa: BLE001 - e.g. inside cupy's using_allocator(): stay untracked
            logger.warning(
                "cudafut: could not wrap CuPy's allocator (%s); record_stream() keeps arrays alive instead",
                exc,
            )
            return
        _installed_over = current


def block_type() -> type:
    """The type of the blocks the allocator wrapper makes (the ``owner`` of
    their memory): the native core records an await's reader on one."""
    return _Block


def readers_by_block() -> dict[int, dict[int, tuple[int, object]]]:
    """The readers of every block (``id(block)``: ``{stream handle: (device,
    owner)}``), the map itself, for the native core's check that a stream
    object reads a block already (a lookup without a call, never a write)."""
    return _readers


def installed() -> bool:
    """Whether CuPy's allocator in force now is cudafut's wrapper."""
    return hasattr(_cuda.cupy_allocator(), "cudafut_wraps")


def _block_of(array: Any) -> _Block | None:
    owner = _cuda.owner_of(array)
    return owner if type(owner) is _Block else None


def record_stream(array: Any, stream: Any) -> None:
    """Free ``array``'s memory only after the work queued on ``stream``.

    The CuPy counterpart of PyTorch's ``Tensor.record_stream``: call it when
    you enqueue work that reads or writes ``array`` on a stream other than
    the one it was allocated on. When the array's memory is later freed (its
    last reference dropped), it goes back to CuPy's pool only after the work
    queued on ``stream`` up to the moment of the free has completed, so the
    pool cannot hand it to a new allocation while ``stream`` still uses it.
    :meth:`CudaFuture.wait`, ``await``, :meth:`CudaFuture.result`,
    :meth:`CudaFuture.then` and :func:`submit` call it for the streams they
    order, so values taken from futures need no ``keep=``.

    Cost: a few hundred ns now (nothing on the GPU); at the free, one event
    record per recorded stream and a query (about 3 µs), and the block stays
    out of the pool until the stream passes that point (the watcher thread
    watches it). Recording the stream the array was allocated on does
    nothing. Memory from cudafut's wrapper around CuPy's allocator costs
    about a µs more per allocation than CuPy's pool alone (docs/memory.md).

    ``array``: a CuPy array, a PyTorch CUDA tensor (its own
    ``record_stream`` is called), or any ``__cuda_array_interface__`` object.
    Memory cudafut's allocator wrapper did not allocate (arrays made before
    cudafut first used CUDA, or under an allocator set since, or by another
    library) cannot be watched until it is freed: the array object itself is
    then kept alive until the work queued on ``stream`` so far is done, and
    work you queue after this call is not covered: call it after enqueuing.

    ``stream``: a CuPy or PyTorch stream, or any object with
    ``__cuda_stream__``; it is kept alive until the array's memory is freed
    (a stream destroyed before could not be recorded on). For a PyTorch
    tensor, PyTorch's allocator records an event on ``stream`` when the
    tensor's memory is freed and keeps nothing alive (PyTorch issue 66936):
    cudafut keeps the stream object alive while the tensor lives, then until
    the thread that freed it has moved on (its next ``wait()`` or
    ``record_stream()``, the watcher thread's next round, or 10-20 s later
    from any thread: PyTorch frees the memory after the tensor's weak-reference
    callbacks, with the GIL released) and the GPU is past an event recorded
    then. PyTorch's own streams, cudafut's and the special handles (0, 1,
    2) are never destroyed and take none of this; for the others it costs
    about 1 µs of host time the first time a tensor meets the stream
    (about half that after), and at the release an event record and a
    query; a long-lived tensor recorded on many short-lived streams keeps
    them all until it dies (PyTorch records on each at the free). Not
    covered: a tensor that takes no weak reference (recorded as before); a
    view, or any tensor sharing the memory, that outlives the tensor (the
    memory is freed later, when the stream may be gone: keep the stream
    alive, or record the view too); a ``torch.cuda.ExternalStream``, which
    does not own its stream (keep the stream it wraps alive); a tensor freed
    while a CUDA graph is captured (PyTorch records later, at a later
    allocation or free: keep the stream alive past the capture).

    Raises:
        TypeError: ``array`` has no ``__cuda_array_interface__``, or
            ``stream`` is not a stream.
    """
    if not hasattr(array, "__cuda_array_interface__"):
        raise TypeError(
            f"record_stream() needs a GPU array (CuPy, PyTorch, or any "
            f"__cuda_array_interface__ object), not {type(array).__name__}"
            + (_cuda.NOT_FAKED.format(call="record_stream()") if _cuda.faked() else "")
        )
    _lifetimes.release_retired()  # what this thread retired: its deallocations are done
    ptr, device = _cuda.stream_handle(stream)
    _record(array, ptr, device, stream)


def _record(array: Any, stream: int, device: int, owner: object) -> None:
    block = _block_of(array)
    if block is not None:
        block.add_reader(stream, device, owner)
        return
    if _torch.record_external(array, stream, device, owner):
        return
    # Untracked memory: keep the array until what is queued on stream now is done.
    if _lifetimes.keep_until([_events.record(stream, device)], array):
        _state["untracked_holds"] += 1


def record_streams_of(
    arrays: Iterable[Any], streams: Iterable[tuple[int, int, object]], *, untracked: bool
) -> None:
    """:func:`record_stream` of each of ``arrays`` for each ``(stream handle,
    device, stream object)`` on that array's device (no argument checks: for
    cudafut's own consumers, which know their streams; the object is kept
    alive with the block). ``untracked``: also keep alive arrays the wrapper
    did not allocate (see :func:`record_stream`); off where the consumer
    stream is a guess (``await``, ``result()``)."""
    triples = tuple(streams)
    for array in arrays:
        block = _block_of(array)
        if block is not None:
            for stream, device, owner in triples:
                if block.device == device:
                    block.add_reader(stream, device, owner)
        elif untracked:
            for stream, device, owner in triples:
                _record(array, stream, device, owner)


@dataclasses.dataclass(frozen=True)
class MemoryStatistics:
    """A snapshot of cudafut's memory bookkeeping (:func:`memory_statistics`).

    Attributes:
        pinned_limit: the cap of the pinned pool, in bytes
            (:func:`set_pinned_limit`).
        pinned_in_use: bytes of pinned blocks handed out (arrays of
            :func:`empty_pinned` and :func:`to_host`, staging blocks of
            copies in flight, blocks waiting for a copy to finish).
        pinned_cached: bytes of pinned blocks free in the pool, for reuse.
        pinned_blocks_in_use: how many blocks ``pinned_in_use`` counts.
        pinned_host_allocs: ``cudaHostAlloc`` calls since the start.
        pinned_refused: requests refused for the limit (``MemoryError`` in
            :func:`empty_pinned`; pageable fall-backs in the copies).
        allocator_wrapped: whether CuPy's allocator in force is cudafut's
            wrapper, so that :func:`record_stream` tracks new arrays.
        frees_delayed: freed CuPy blocks that waited for a recorded stream
            before returning to CuPy's pool.
        untracked_holds: arrays :func:`record_stream` kept alive because
            cudafut's wrapper did not allocate them.
        held: objects the watcher thread keeps alive now for pending GPU
            work (delayed frees, dropped futures' values, pinned blocks).
    """

    pinned_limit: int
    pinned_in_use: int
    pinned_cached: int
    pinned_blocks_in_use: int
    pinned_host_allocs: int
    pinned_refused: int
    allocator_wrapped: bool
    frees_delayed: int
    untracked_holds: int
    held: int


def memory_statistics() -> MemoryStatistics:
    """A snapshot of the pinned pool and of the stream-safe frees.

    Costs a few µs; no CUDA call; blocks nothing but the pinned pool's lock
    for the instant it takes to count. For leak checks: after the copies
    you made are done and dropped (and a moment for the watcher thread),
    ``pinned_in_use`` and ``held`` return to where they started.
    """
    limit, in_use, cached, blocks, allocs, refused = _pinned.pool.counts()
    return MemoryStatistics(
        pinned_limit=limit,
        pinned_in_use=in_use,
        pinned_cached=cached,
        pinned_blocks_in_use=blocks,
        pinned_host_allocs=allocs,
        pinned_refused=refused,
        allocator_wrapped=installed(),
        frees_delayed=_state["frees_delayed"],
        untracked_holds=_state["untracked_holds"],
        held=_lifetimes.holding(),
    )


_cuda.on_initialise(install)
