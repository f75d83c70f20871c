"""Streams per task on a GPU: task_stream, own_stream, use_task_streams,
use_stream.

The ordering tests use slow producers (a kernel that spins on %globaltimer
before it writes): a consumer the join does not order reads zeros. Each has
a mutation in tests/_mutations.py (``task_join``, ``task_switch``) that
makes it fail.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _pools
from tests.kernels import spin_fill
from tests.subproc import run_python

pytestmark = pytest.mark.gpu

N = 1 << 16
SLOW_MS = 60.0


def read_on_current(cp: Any, x: Any) -> np.ndarray[Any, Any]:
    """A kernel reading ``x`` on the current stream, then its result on the
    host: what ``x`` held when the current stream got to it."""
    y = x + 0
    out: np.ndarray[Any, Any] = cp.asnumpy(y)
    return out


def slow_ones(cp: Any) -> Any:
    """A new array that a slow kernel on the current stream fills with ones."""
    x = cp.zeros(N, dtype=cp.float32)
    spin_fill(x, 1.0, SLOW_MS)
    return x


# -- the join at the end of an own_stream coroutine ----------------------------------


@pytest.mark.anyio
async def test_an_own_stream_coroutine_awaited_inline_returns_a_ready_array(cp: Any) -> None:
    @cudafut.own_stream
    async def produce() -> Any:
        x = slow_ones(cp)
        await anyio.sleep(0)
        return x

    x = await produce()
    assert np.all(read_on_current(cp, x) == 1.0)


@pytest.mark.anyio
async def test_an_own_stream_task_is_joined_to_a_plain_parent(cp: Any) -> None:
    results: list[Any] = []

    @cudafut.own_stream
    async def produce() -> None:
        await anyio.sleep(0)
        results.append(slow_ones(cp))

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
    assert np.all(read_on_current(cp, results[0]) == 1.0)


@pytest.mark.anyio
async def test_children_are_joined_to_a_parent_on_its_own_stream(cp: Any) -> None:
    @cudafut.own_stream
    async def produce(results: list[Any], value: float) -> None:
        await anyio.sleep(0)
        x = cp.zeros(N, dtype=cp.float32)
        spin_fill(x, value, SLOW_MS)
        results.append(x)

    @cudafut.own_stream
    async def parent() -> np.ndarray[Any, Any]:
        results: list[Any] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, results, 1.0)
            tg.start_soon(produce, results, 2.0)
        # This step runs on the parent's stream, which waited for both.
        assert cp.cuda.get_current_stream().ptr == cudafut.task_stream().ptr
        return read_on_current(cp, results[0] + results[1])

    assert np.all(await parent() == 3.0)


async def _use_task_streams_join(cp: Any) -> np.ndarray[Any, Any]:
    cudafut.use_task_streams()

    async def produce() -> Any:  # not decorated: the task factory does it
        await asyncio.sleep(0)
        return slow_ones(cp)

    async def driver() -> np.ndarray[Any, Any]:
        a, b = await asyncio.gather(produce(), produce())
        return read_on_current(cp, a + b)

    return await asyncio.create_task(driver())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_use_task_streams_joins_gathered_tasks(cp: Any, loop: str) -> None:
    from tests.runners import run_on

    assert np.all(run_on(loop, _use_task_streams_join, cp) == 2.0)


# -- the task's stream is current in its steps, and only there ------------------------


@pytest.mark.anyio
async def test_record_in_an_own_stream_task_follows_the_task_stream(cp: Any) -> None:
    @cudafut.own_stream
    async def produce() -> np.ndarray[Any, Any]:
        x = slow_ones(cp)  # on the task's stream
        await cudafut.record(x)  # must wait for the task's stream, not the thread's
        # The legacy stream does not wait for a non-blocking stream: only the
        # record's wait orders this read.
        out: np.ndarray[Any, Any] = cp.asnumpy(x, stream=cp.cuda.Stream.null)
        return out

    assert np.all(await produce() == 1.0)


@pytest.mark.anyio
async def test_use_stream_blocks_held_across_awaits_stay_in_their_task(cp: Any) -> None:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    seen: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    thread_stream = cp.cuda.get_current_stream().ptr
    one = cp.zeros(1, dtype=cp.float32)

    @cudafut.own_stream
    async def hold(i: int) -> None:
        mine = cudafut.task_stream().ptr
        with cudafut.use_stream(streams[i]) as s:
            assert s is streams[i]
            for _ in range(40):
                seen[i].add(cp.cuda.get_current_stream().ptr)
                fut = cudafut.record(one)
                seen[i].add(fut._records[0].stream)
                await anyio.sleep(0)
        assert cp.cuda.get_current_stream().ptr == mine  # back on the task's own stream

    async def plain() -> None:
        for _ in range(40):
            seen[2].add(cp.cuda.get_current_stream().ptr)
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(hold, i)
        tg.start_soon(plain)
    assert seen[0] == {streams[0].ptr}
    assert seen[1] == {streams[1].ptr}
    assert seen[2] == {thread_stream}
    assert cp.cuda.get_current_stream().ptr == thread_stream


@pytest.mark.anyio
async def test_control_a_with_stream_block_across_an_await_leaks_into_other_tasks(cp: Any) -> None:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    seen: dict[int, set[int]] = {0: set(), 1: set()}

    async def hold(i: int) -> None:
        with streams[i]:
            for _ in range(10):
                seen[i].add(cp.cuda.get_current_stream().ptr)
                await anyio.sleep(0)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(hold, i)
    finally:
        cp.cuda.Stream.null.use()
    assert len(seen[0] | seen[1]) > 1 and (seen[0] != {streams[0].ptr} or seen[1] != {streams[1].ptr})


@pytest.mark.anyio
async def test_task_streams_are_per_task_and_go_back_to_the_pool(cp: Any) -> None:
    gc.collect()
    before = _pools.pool_statistics().task_streams.get(0, (0, 0))[1]
    got: dict[int, set[int]] = {0: set(), 1: set()}

    async def use(i: int) -> None:
        for _ in range(5):
            got[i].add(cudafut.task_stream().ptr)
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(use, 0)
        tg.start_soon(use, 1)
    assert len(got[0]) == 1 and len(got[1]) == 1 and got[0] != got[1]
    in_thread: list[int] = []
    t = threading.Thread(target=lambda: in_thread.extend([cudafut.task_stream().ptr] * 2))
    t.start()
    t.join()
    assert in_thread[0] not in got[0] | got[1]
    del t
    for _ in range(3):
        gc.collect()
        await anyio.sleep(0)
    assert _pools.pool_statistics().task_streams[0][1] <= before + 1  # this test's own task may hold one


def test_use_stream_in_a_plain_task_is_refused(cp: Any) -> None:
    async def plain_task() -> None:
        with cudafut.use_stream(cudafut.task_stream()):
            pass

    with pytest.raises(RuntimeError, match="own_stream"):
        asyncio.run(plain_task())


def test_use_stream_outside_a_loop_is_the_threads(cp: Any) -> None:
    s = cp.cuda.Stream(non_blocking=True)
    with cudafut.use_stream(s):
        assert cp.cuda.get_current_stream() is s
    assert cp.cuda.get_current_stream() is not s


_TORCH = """
import asyncio, torch, cudafut

@cudafut.own_stream
async def step():
    ours = cudafut.task_stream().ptr
    first = torch.cuda.current_stream().cuda_stream
    await asyncio.sleep(0)
    return ours, first, torch.cuda.current_stream().cuda_stream

async def main():
    before = torch.cuda.current_stream().cuda_stream
    ours, first, second = await step()
    assert first == ours and second == ours, (ours, first, second)
    assert torch.cuda.current_stream().cuda_stream == before
    print("ok")

asyncio.run(main())
"""


def test_own_stream_sets_pytorchs_current_stream_too() -> None:
    pytest.importorskip("torch")
    done = run_python(_TORCH)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-3000:]
