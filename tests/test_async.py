"""await, as_completed and loop callbacks on asyncio, uvloop and trio, with
scripted events (no GPU): the waiter's logic, not CUDA's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading

import anyio
import pytest

import cudafut
from cudafut import _loops
from tests.fakes import FakeRecord, set_future, stream_records

pytestmark = pytest.mark.anyio


async def complete_later(rec: FakeRecord, delay: float = 0.003) -> None:
    await anyio.sleep(delay)
    rec.complete()


async def test_await_resolves_once_every_event_completed() -> None:
    a, b = FakeRecord(), FakeRecord()
    fut = set_future("value", [a, b])
    async with anyio.create_task_group() as tg:
        tg.start_soon(complete_later, a)
        tg.start_soon(complete_later, b, 0.01)
        assert await fut == "value"
        assert a.status == 0 and b.status == 0


async def test_await_on_an_already_done_future_returns_at_once() -> None:
    rec = FakeRecord()
    rec.complete()
    assert await set_future(7, [rec]) == 7


async def test_await_an_unset_future_set_from_another_thread() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    rec = FakeRecord()
    rec.complete()

    def produce() -> None:
        from cudafut._future import _SET

        fut._complete(_SET, "late", None, (rec,))

    threading.Timer(0.01, produce).start()
    assert await fut == "late"


async def test_await_a_failed_future_raises_the_same_exception() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    exc = KeyError("k")
    fut.set_exception(exc)
    with pytest.raises(KeyError) as info:
        await fut
    assert info.value is exc


async def test_await_raises_cuda_error_instead_of_hanging() -> None:
    rec = FakeRecord()
    fut = set_future("v", [rec, FakeRecord()])  # the other never completes
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep, 0.003)
        rec.fail(700)
        with pytest.raises(cudafut.CudaError) as info:
            await fut
    assert info.value.code == 700


async def test_await_a_cancelled_future(anyio_backend: tuple[str, dict[str, object]]) -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.cancel()
    expected = asyncio.CancelledError if anyio_backend[0] == "asyncio" else concurrent.futures.CancelledError
    with pytest.raises(expected):
        await fut


async def test_cancelling_awaiting_tasks_leaves_nothing_pending() -> None:
    unset: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    running = set_future("v", [FakeRecord()])
    for fut in (unset, running) * 50:
        with anyio.move_on_after(0.001):
            await fut
    driver = _loops.current_driver()
    assert driver is not None
    assert driver.watchlist.pending == 0 and driver.watchlist.streams == 0
    assert not unset._listeners
    unset.cancel()


async def test_thousand_concurrent_awaits_query_only_the_oldest_per_stream() -> None:
    streams = [stream_records(125) for _ in range(8)]
    futs = [set_future(i, [streams[i % 8][i // 8]]) for i in range(1000)]
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await futs[i]

    async with anyio.create_task_group() as tg:
        for i in range(1000):
            tg.start_soon(one, i)
        await anyio.sleep(0.002)  # everybody waits (each checked its own event once)
        before = [[r.queries for r in records] for records in streams]
        # The waiter polls: only the head of each stream.
        with anyio.fail_after(10):
            while any(recs[0].queries == counts[0] for recs, counts in zip(streams, before, strict=True)):
                await anyio.sleep(0.005)
        for records, counts in zip(streams, before, strict=True):
            assert [r.queries for r in records[1:]] == counts[1:]
        # Complete in stream order, as a GPU does, at random across streams.
        cursor = [0] * 8
        while any(c < 125 for c in cursor):
            s = random.choice([k for k in range(8) if cursor[k] < 125])
            streams[s][cursor[s]].complete()
            cursor[s] += 1
            if random.random() < 0.05:
                await anyio.sleep(0)
    assert results == {i: i for i in range(1000)}
    driver = _loops.current_driver()
    assert driver is not None and driver.watchlist.pending == 0


async def test_as_completed_yields_in_completion_order() -> None:
    recs = [FakeRecord() for _ in range(3)]
    futs = [set_future(i, [recs[i]]) for i in range(3)]
    it = cudafut.as_completed(futs).__aiter__()
    with anyio.fail_after(10):
        for i in (2, 0, 1):
            recs[i].complete()
            assert await it.__anext__() is futs[i]
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()


async def test_done_callback_runs_in_the_loop_thread_after_completion() -> None:
    rec = FakeRecord()
    fut = set_future("v", [rec])
    called = anyio.Event()
    threads: list[int] = []

    def callback(f: object) -> None:
        threads.append(threading.get_ident())
        called.set()

    fut.add_done_callback(callback)
    await anyio.sleep(0.005)
    assert not called.is_set()
    rec.complete()
    with anyio.fail_after(5):
        await called.wait()
    assert threads == [threading.get_ident()]


async def test_await_outside_a_supported_loop_is_explained() -> None:
    fut = set_future("v", [FakeRecord()])
    gen = fut.__await__()  # driven by hand from a thread: outside any loop
    with pytest.raises(RuntimeError, match="running asyncio"):
        await anyio.to_thread.run_sync(lambda: gen.send(None))
    gen.close()


@pytest.mark.asyncio
async def test_done_callback_error_goes_to_the_loop_exception_handler() -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.set_exception(KeyError())
    fut.exception()

    def bad(f: object) -> None:
        raise ZeroDivisionError

    fut.add_done_callback(bad)
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.001)
    assert isinstance(seen[0]["exception"], ZeroDivisionError)
    assert seen[0]["future"] is fut
