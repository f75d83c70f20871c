"""CuPy's own objects: whether CuPy is imported, its allocator (read,
set, wrapped so that cudafut owns each block) and CUDA graphs captured and
replayed with CuPy.

A part of the CUDA seam (:mod:`cudafut._cuda` re-exports every function);
none of these calls reaches the GPU except the graphs'.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from . import _backend


def imported_cupy() -> Any:
    """The ``cupy`` module if something imported it already, else None;
    never imports it (a dict lookup), so costs nothing where CuPy is not
    used."""
    return sys.modules.get("cupy")


def cupy_allocator() -> Any:
    """CuPy's allocator in force now (``cupy.cuda.get_allocator()``), or
    None if CuPy is not imported; no GPU call, never imports CuPy."""
    cp = sys.modules.get("cupy")
    return None if cp is None else cp.cuda.get_allocator()


def set_cupy_allocator(allocate: Callable[[int], Any]) -> None:
    """Make ``allocate`` CuPy's allocator (``cupy.cuda.set_allocator``); no
    GPU call. Raises what CuPy raises (inside ``using_allocator()``)."""
    cupy_module().cuda.set_allocator(allocate)


def cupy_module() -> Any:
    """The ``cupy`` module, imported if need be, without checking that CUDA
    is usable (for what needs no GPU: the allocator hooks)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        cp = importlib.import_module("cupy")  # as in _initialise
    return cp


def wrap_cupy_allocator(allocator: Callable[[int], Any], owner: Callable[[Any, int, int], object]) -> Any:
    """An allocator for CuPy that takes each block from ``allocator`` and
    hands it out owned by ``owner(memory, device, stream)``: ``stream`` is
    the handle of CuPy's current stream at the allocation. The owner lives
    as long as the array's memory; when it dies, so does its reference to
    the block (back to ``allocator``'s pool).

    Costs ``allocator`` plus about a µs per allocation (CuPy's stream
    lookup, two small objects); no GPU call."""
    cp = cupy_module()
    memory_pointer = cp.cuda.MemoryPointer
    unowned = cp.cuda.UnownedMemory
    get_stream = cp.cuda.get_current_stream

    def allocate(size: int) -> Any:
        memory = allocator(size)
        device = memory.device_id
        return memory_pointer(unowned(memory.ptr, size, owner(memory, device, get_stream().ptr), device), 0)

    return allocate


def owner_of(array: Any) -> object:
    """The ``owner`` that :func:`wrap_cupy_allocator` gave the memory under
    ``array`` (a CuPy array), or None: for another array, or memory of
    another allocator. Reads CuPy's ``UnownedMemory`` (its private
    ``_owner``), which only this module knows; attribute reads, no call."""
    data = getattr(array, "data", None)
    memory = getattr(data, "mem", None)
    return getattr(memory, "_owner", None)


def capture_cupy_graph(fn: Callable[..., Any], inputs: tuple[Any, ...], warmup: int) -> tuple[Any, Any, Any]:
    """Run ``fn(*inputs)`` ``warmup`` times, then capture one call into a
    CUDA graph, on a new stream of the current device; ``(graph, outputs,
    keep)``, where ``keep`` (the stream and a private memory pool) must live
    as long as the graph. Blocks the calling thread until the warm-up
    calls have run on the GPU."""
    cp = _backend.current.cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    # A private pool for everything the capture allocates: blocks the graph
    # uses (intermediates freed during capture included) must never be
    # handed to other arrays, since every replay writes them again.
    pool = cp.cuda.MemoryPool()
    # The inputs were made on the caller's stream: the warm-up comes after.
    stream.wait_event(cp.cuda.get_current_stream().record())
    with cp.cuda.using_allocator(pool.malloc), stream:
        for _ in range(warmup):
            fn(*inputs)
        stream.synchronize()
        stream.begin_capture()
        try:
            outputs = fn(*inputs)
        finally:
            graph = stream.end_capture()
    return graph, outputs, (pool, stream)


def replay_cupy_graph(
    graph: Any, statics: tuple[Any, ...], outputs: Any, inputs: tuple[Any, ...], n: int, last: Any
) -> tuple[tuple[Any, ...], Any]:
    """Launch a graph of :func:`capture_cupy_graph` on CuPy's current
    stream: after ``last`` (the event of the previous replay, or None), the
    first ``n`` rows of ``inputs`` are copied into the captured inputs
    ``statics`` (device arrays: a device copy; host arrays: a host-to-device
    copy), the graph runs, and the first ``n`` rows of each of ``outputs``
    are copied out. ``(those copies, the replay's event)``. Enqueues only;
    tens of µs on the host."""
    cp = _backend.current.cupy()
    stream = cp.cuda.get_current_stream()
    if last is not None:
        stream.wait_event(last)
    for static, x in zip(statics, inputs, strict=True):
        if isinstance(x, cp.ndarray):
            static[:n] = x  # a device copy on the current stream
        else:  # host data (NumPy): the first rows of a C-contiguous array are contiguous
            static[:n].set(x, stream=stream)
    graph.launch(stream)
    copies = tuple(out[:n].copy() for out in outputs)
    return copies, stream.record()
