"""Stream-safe frees (record_stream, and the consumers that call it) on a GPU.

The hazard (docs/design.md, hazard 5): an array allocated on stream A, read
on stream B by a slow kernel, dropped at once; CuPy's pool hands its block
to the next allocation on A, which overwrites it while B has not read it
yet. Each test has a control that shows the corruption without the
protection, so that it can fail.

B's reader waits for a gate the host opens after A's reallocations, not for
a fixed time: on a host slowed by the rest of the suite (a full garbage
collection over its heap), a timed reader had read before the overwrite,
and the controls failed.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest

import cudafut
from cudafut import _backend, _memory
from tests.kernels import Gate, gated_copy

pytestmark = pytest.mark.gpu

N = 1 << 20
_streams: list[Any] = []


def stream() -> Any:
    s = _backend.current.cupy().cuda.Stream(non_blocking=True)
    _streams.append(s)
    return s


def overwrite_on(a: Any, ptr: int) -> list[Any]:
    """Allocate on ``a`` until CuPy's pool hands out the block at ``ptr``
    (or 64 tries: the arena of a reused stream handle may hold other free
    blocks of the size), each filled with twos at once.

    The twos are written by a synchronous ``cudaMemcpy``, not by a kernel on
    ``a``: once the suite has made many streams, ``a`` and the reader's
    stream may share one of the device's hardware queues
    (``CUDA_DEVICE_MAX_CONNECTIONS``), and a kernel on ``a`` would then wait
    behind the reader's spin: the overwrite the controls need would never
    come in time."""
    cp = _backend.current.cupy()
    twos = np.full(N, 2.0, dtype=np.float32)
    rt = cp.cuda.runtime
    taken = []
    with a:
        for _ in range(64):
            y = cp.empty(N, dtype=cp.float32)
            rt.memcpy(y.data.ptr, twos.ctypes.data, twos.nbytes, rt.memcpyHostToDevice)
            taken.append(y)
            if y.data.ptr == ptr:
                break
    return taken


@contextlib.contextmanager
def fresh_pool() -> Iterator[None]:
    """A new CuPy pool behind cudafut's wrapper, for this thread: its only
    free blocks are the test's, so the reuse the controls need is certain
    (the default pool, after the rest of the suite, holds other blocks)."""
    cp = _backend.current.cupy()
    # Earlier tests' garbage may hold memory whose free (cudaFree)
    # synchronises the device: not while a gated reader waits.
    gc.collect()
    pool = cp.cuda.MemoryPool()
    try:
        with cp.cuda.using_allocator(_memory._wrap(pool.malloc)):
            yield
    finally:
        pool.free_all_blocks()


def race(protect: Callable[[Any, Any], None]) -> Race:
    """What B read of an array of ones that A's next allocation overwrites
        with twos as soon as the array is dropped; ``protect(array, B)`` runs
        after B's read is enqueued. Also: whether A's allocations got the block
    back before B was done."""
    with fresh_pool():
        return _race(protect)


def _race(protect: Callable[[Any, Any], None]) -> Race:
    cp = _backend.current.cupy()
    a, b = stream(), stream()
    with a:
        x = cp.ones(N, dtype=cp.float32)
    a.synchronize()
    with Gate() as gate:
        with b:
            out = cp.zeros(N, dtype=cp.float32)  # a memset, not a kernel: none may load in the window
            gated_copy(x, out, gate)  # B reads x once the gate opens
        protect(x, b)
        ptr = x.data.ptr
        del x
        return _reallocate_and_read(a, b, gate, ptr, out)


class Race(NamedTuple):
    """What a race between B's slow read and A's reallocations came to."""

    #: What B read: ones, unless A's twos overwrote the block first.
    got: np.ndarray[Any, Any]
    #: Whether A's allocations got the block back (the controls need it).
    reused: bool
    #: Whether they got it back while B still read it (a protection must
    #: prevent that; B waits for the gate, so it has not read yet).
    reused_under_reader: bool


def _reallocate_and_read(a: Any, b: Any, gate: Gate, ptr: int, out: Any) -> Race:
    """After the last reference to the block at ``ptr`` is dropped, while B's
    reader waits for ``gate``: overwrite what the pool hands back on ``a``
    (the block itself, unless protected), open the gate, then B's result
    (see :class:`Race`)."""
    try:
        gc.collect()
        taken = overwrite_on(a, ptr)
        reused = taken[-1].data.ptr == ptr
        under_reader = reused and not b.done
    finally:
        gate.open()
    b.synchronize()
    assert not gate.timed_out, "the reader gave up waiting: something synchronised the device while it waited"
    a.synchronize()
    del taken
    got: np.ndarray[Any, Any] = _backend.current.cupy().asnumpy(out)
    return Race(got, reused, under_reader)


def test_the_allocator_is_wrapped() -> None:
    assert cudafut.memory_statistics().allocator_wrapped


def test_control_without_record_stream_the_block_is_reused_under_the_reader() -> None:
    got, reused, _ = race(lambda x, b: None)
    assert reused, "the pool did not hand the block back: the test below would prove nothing"
    assert (got == 2.0).any(), "the block came back, but B's read was not overwritten"


def test_record_stream_keeps_the_block_until_the_reader_is_done() -> None:
    before = cudafut.memory_statistics().frees_delayed
    got, _, reused_under_reader = race(cudafut.record_stream)
    assert not reused_under_reader
    assert np.all(got == 1.0)
    assert cudafut.memory_statistics().frees_delayed == before + 1


def test_record_stream_of_the_allocating_stream_does_nothing() -> None:
    cp = _backend.current.cupy()
    a = stream()
    with a:
        x = cp.ones(16, dtype=cp.float32)
    cudafut.record_stream(x, a)
    block = _memory._block_of(x)
    assert block is not None and block.readers is None


def test_control_wait_without_the_mark_is_corrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_memory, "record_streams_of", lambda *args, **kwargs: None)
    got, reused, _ = _wait_race()
    assert reused, "the pool did not hand the block back: the test below would prove nothing"
    assert (got == 2.0).any(), "the block came back, but B's read was not overwritten"


def _wait_race() -> Race:
    """What B read of a future's value, taken with wait() (no keep=) and
    dropped at once, while A reallocates its block."""
    with fresh_pool():
        return _wait_race_in_pool()


def _wait_race_in_pool() -> Race:
    cp = _backend.current.cupy()
    a, b = stream(), stream()
    with a:
        x = cp.ones(N, dtype=cp.float32)
        fut = cudafut.record(x)
    a.synchronize()
    del x
    with Gate() as gate:
        with b:
            v = fut.wait()
            out = cp.zeros(N, dtype=cp.float32)
            gated_copy(v, out, gate)
        ptr = v.data.ptr
        del v, fut
        return _reallocate_and_read(a, b, gate, ptr, out)


def test_wait_without_keep_protects_the_value_read_on_the_consumer_stream() -> None:
    got, _, reused_under_reader = _wait_race()
    assert not reused_under_reader
    assert np.all(got == 1.0)


def test_an_untracked_array_is_kept_alive_until_the_stream_passes() -> None:
    """Memory the wrapper did not allocate (another allocator): record_stream
    keeps the array object itself until the work queued so far is done."""
    cp = _backend.current.cupy()
    pool = cp.cuda.MemoryPool()
    a, b = stream(), stream()
    with cp.cuda.using_allocator(pool.malloc), a:
        x = cp.ones(N, dtype=cp.float32)
    assert _memory._block_of(x) is None
    a.synchronize()
    gc.collect()  # see fresh_pool
    with Gate() as gate:
        with b:
            out = cp.zeros(N, dtype=cp.float32)
            gated_copy(x, out, gate)
        before = cudafut.memory_statistics().untracked_holds
        cudafut.record_stream(x, b)
        assert cudafut.memory_statistics().untracked_holds == before + 1
        ptr = x.data.ptr
        del x
        with cp.cuda.using_allocator(pool.malloc):
            got, _, reused_under_reader = _reallocate_and_read(a, b, gate, ptr, out)
    assert not reused_under_reader
    assert np.all(got == 1.0)


def test_then_and_submit_mark_their_pool_streams() -> None:
    cp = _backend.current.cupy()
    a = stream()
    with a:
        x = cp.ones(N, dtype=cp.float32)
        fut = cudafut.record(x)
    child = fut.then(lambda v: v + 1)
    block = _memory._block_of(x)
    assert block is not None and block.readers, "then() did not mark its stream"
    with a:  # submit() orders after the caller's current stream; x was made on a
        sub = cudafut.submit(lambda v: v * 2, x)
    assert len(block.readers) >= 1
    assert float(child.result()[0]) == 2.0 and float(sub.result()[0]) == 2.0


def test_then_marks_each_pool_stream_that_reads_a_block() -> None:
    """Fails where then() leaves a block unmarked for a second pool stream
    because another stream reads it already (the native core skips a block
    only for the same stream object)."""
    cp = _backend.current.cupy()
    a = stream()
    with a:
        x = cp.ones(N, dtype=cp.float32)
        fut = cudafut.record(x)
    seen: list[int] = []

    def fn(v: Any) -> Any:
        seen.append(int(cp.cuda.get_current_stream().ptr))
        return v + 1

    children = []
    while len(set(seen)) < 2 and len(seen) < 64:  # siblings: the pool's next streams
        children.append(fut.then(fn))
    assert len(set(seen)) == 2
    block = _memory._block_of(x)
    assert block is not None
    assert set(seen) <= set(block.readers or {})
    for child in children:
        assert float(child.result()[0]) == 2.0


def test_record_stream_argument_errors() -> None:
    with pytest.raises(TypeError, match="GPU array"):
        cudafut.record_stream(np.zeros(3), stream())
    with pytest.raises(TypeError, match="stream"):
        cudafut.record_stream(_backend.current.cupy().zeros(3), "B")


# A block and its reader stream garbage in one cycle: the collector runs the
# finalizers of the whole cycle in an order of its own, so CuPy's
# Stream.__del__ may destroy the stream before the block's free records on
# it (a segfault in the suite, or an error the finalizer swallows, and the
# block back in the pool under a running reader). Both creation orders, in a
# fresh interpreter that the crash would kill.
_CYCLE = """
import gc, sys
import cupy as cp
import cudafut
from tests.kernels import spin_fill

cudafut.record(cp.zeros(1)).result()  # cudafut's first use of CUDA wraps the allocator
gc.disable()
for stream_first in (True, False):
    before = cudafut.memory_statistics().frees_delayed

    class Cycle:
        pass

    c = Cycle()
    c.me = c
    if stream_first:
        c.stream = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(1 << 20, dtype=cp.float32)
    if not stream_first:
        c.stream = cp.cuda.Stream(non_blocking=True)
    with c.stream:
        spin_fill(x, 1.0, 200.0)
    cudafut.record_stream(x, c.stream)
    c.x = x
    del x, c
    gc.collect()
    delayed = cudafut.memory_statistics().frees_delayed - before
    print(f"stream_first={stream_first} delayed={delayed}", flush=True)
    assert delayed == 1, "the free did not wait for the reader stream"
cp.cuda.Device().synchronize()
print("ok")
"""


def test_a_block_freed_in_a_garbage_cycle_with_its_reader_stream() -> None:
    from tests.subproc import run_python

    done = run_python(_CYCLE)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    )
