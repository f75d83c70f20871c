"""await, as_completed and loop callbacks on asyncio, uvloop and trio, with
scripted events (no GPU): the waiter's logic, not CUDA's."""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import gc
import logging
import random
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _compiled, _loops, testing
from cudafut._interface import records_of
from tests.fakes import FakeRecord, set_future, stream_records

pytestmark = pytest.mark.anyio


async def test_each_backend_runs_on_the_loop_it_names(request: pytest.FixtureRequest) -> None:
    """The anyio_backend variants (tests/conftest.py) are what their ids say."""
    variant = request.node.callspec.id
    if variant == "trio":
        import trio

        trio.lowlevel.current_trio_token()  # raises outside a trio run
        return
    loop = asyncio.get_running_loop()
    assert loop.get_debug()
    assert (type(loop).__module__.split(".")[0] == "uvloop") == (variant == "uvloop")
    eager = getattr(asyncio, "eager_task_factory", None)
    assert (eager is not None and loop.get_task_factory() is eager) == (variant == "eager")


@pytest.mark.no_asyncio_debug(reason="checks the marker itself")
async def test_no_asyncio_debug_turns_debug_mode_off(anyio_backend: tuple[str, dict[str, object]]) -> None:
    if anyio_backend[0] == "asyncio":
        assert not asyncio.get_running_loop().get_debug()


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


async def test_await_on_an_already_done_future_returns_at_once(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(7)
    fake_cuda.complete(fut)
    assert await fut == 7


async def test_await_an_unset_future_set_from_another_thread(fake_cuda: testing.FakeCuda) -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fake_cuda.complete(fut)  # its events, once it is set
    threading.Timer(0.01, fut.set_result, ("late",)).start()
    assert await fut == "late"


async def test_await_a_failed_future_raises_the_same_exception() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    exc = KeyError("k")
    fut.set_exception(exc)
    with pytest.raises(KeyError) as info:
        await fut
    assert info.value is exc


async def test_await_raises_cuda_error_instead_of_hanging() -> None:
    """The record fails while the await is already waiting in the loop's
    waiter: the waiter's poll finds the error and ends the wait, although
    the future's other record never completes."""
    rec, never = FakeRecord(), FakeRecord()
    fut = set_future("v", [rec, never])
    errors: list[cudafut.CudaError] = []

    async def waiter() -> None:
        try:
            await fut
        except cudafut.CudaError as exc:
            errors.append(exc)

    driver = _loops.current_driver()
    assert driver is not None
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            while not driver.watchlist.pending:  # until the await is in the waiter
                await anyio.sleep(0)
            queries = rec.queries
            assert not errors and queries >= 1
            rec.fail(700)
    assert [exc.code for exc in errors] == [700]
    assert rec.queries > queries  # found by a poll after the failure, not before
    assert driver.watchlist.pending == 0 and never.status is None


async def test_await_a_cancelled_future(anyio_backend: tuple[str, dict[str, object]]) -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.cancel()
    expected = asyncio.CancelledError if anyio_backend[0] == "asyncio" else concurrent.futures.CancelledError
    with pytest.raises(expected):
        await fut


async def test_cancelling_awaiting_tasks_leaves_nothing_pending(fake_cuda: testing.FakeCuda) -> None:
    unset: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    running = cudafut.record("v")
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
        # Everybody waits, each having checked its own event once. Waiting for
        # the watchlist, not a fixed sleep: a slow machine may start the last
        # tasks late, and their own first check would then count as a poll.
        driver = _loops.current_driver()
        assert driver is not None
        with anyio.fail_after(10):
            while driver.watchlist.pending < 1000:
                await anyio.sleep(0.001)
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


async def test_done_callback_error_goes_to_the_loops_handler(
    anyio_backend: tuple[str, dict[str, object]], caplog: pytest.LogCaptureFixture
) -> None:
    """asyncio (uvloop included): the running loop's exception handler, with
    the future in the context; trio has no such handler: the cudafut logger."""
    on_asyncio = anyio_backend[0] == "asyncio"
    seen: list[dict[str, object]] = []
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.set_exception(KeyError())
    fut.exception()
    raised: list[ZeroDivisionError] = []

    def bad(f: object) -> None:
        raised.append(ZeroDivisionError())
        raise raised[-1]

    def ours() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "cudafut"]

    loop = asyncio.get_running_loop() if on_asyncio else None
    previous = loop.get_exception_handler() if loop is not None else None
    if loop is not None:
        loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        with caplog.at_level(logging.ERROR, logger="cudafut"):
            fut.add_done_callback(bad)
            with anyio.fail_after(5):
                while not (seen or ours()):
                    await anyio.sleep(0.001)
    finally:
        if loop is not None:
            loop.set_exception_handler(previous)
    assert len(raised) == 1
    if on_asyncio:
        assert len(seen) == 1 and not ours()
        assert seen[0]["exception"] is raised[0]
        assert seen[0]["future"] is fut
    else:
        [record] = ours()
        assert record.exc_info is not None and record.exc_info[1] is raised[0]
        assert "done callback" in record.getMessage() and repr(fut) in record.getMessage()


def test_a_test_marked_both_anyio_and_asyncio_is_refused(pytester: pytest.Pytester) -> None:
    """tests/conftest.py refuses the mix that ran a test's uvloop and trio
    variants on pytest-asyncio's loop."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.anyio

        @pytest.mark.asyncio
        async def test_mixed():
            pass

        async def test_anyio_only():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*both the anyio and the asyncio marker*", "*::test_mixed*"])
    assert "test_anyio_only" not in result.stderr.str()


# -- an await among others: one object per wait (asyncio) -----------------------


def _asyncio_only(anyio_backend: tuple[str, dict[str, object]]) -> None:
    if anyio_backend[0] != "asyncio":
        pytest.skip("the one-object await is asyncio's (trio waits through its driver)")


async def _until_pending(n: int) -> _loops.LoopDriver:
    driver = _loops.current_driver()
    assert driver is not None
    with anyio.fail_after(10):
        while driver.watchlist.pending < n:
            await anyio.sleep(0)
    return driver


async def test_awaits_among_others_wait_as_one_object_each(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    streams = [fake_cuda.stream() for _ in range(4)]
    futs = [cudafut.record(i, stream=streams[i % 4]) for i in range(40)]
    tasks = [asyncio.ensure_future(_await(f)) for f in futs]
    driver = await _until_pending(40)
    # The first await was alone (it spins from its task); the rest joined it.
    # (_loops._AsyncioAwait: the native core's twin where it runs.)
    waited_on = [type(t._fut_waiter) is _loops._AsyncioAwait for t in tasks]  # type: ignore[attr-defined]
    assert waited_on.count(True) >= 39
    fake_cuda.complete(*futs[:20])
    assert await asyncio.gather(*tasks[:20]) == list(range(20))
    assert not any(t.done() for t in tasks[20:])
    fake_cuda.complete_all()
    assert await asyncio.gather(*tasks[20:]) == list(range(20, 40))
    assert driver.watchlist.pending == 0


async def _await(fut: cudafut.CudaFuture[Any]) -> Any:
    return await fut


async def test_awaits_among_others_wait_in_their_own_loop_after_another_loop_awaited(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    """The native core tries the loop that awaited last first: an await in
    another loop (another thread's) meanwhile must not take this loop's
    next await into its waiter."""
    _asyncio_only(anyio_backend)
    async with _beside_another_wait(fake_cuda) as driver:
        first = asyncio.ensure_future(_await(cudafut.record("a")))
        await _until_pending(2)

        async def elsewhere() -> tuple[Any, ...]:
            other = asyncio.ensure_future(_await(cudafut.record("x")))
            there = await _until_pending(1)
            wait: Any = cudafut.record("y").__await__()
            next(wait)  # among others there: that loop's waiter holds it
            return there, wait, asyncio.get_running_loop(), other

        # Kept alive, its wait still watched: the other loop's waiter would take an await.
        there, wait, _loop, _other = await anyio.to_thread.run_sync(lambda: asyncio.run(elsewhere()))
        assert there is not driver and there.watchlist.pending >= 1
        assert driver.watchlist.pending == 2  # nothing of the other loop's here
        second = asyncio.ensure_future(_await(cudafut.record("b")))
        await _until_pending(3)  # this loop's own waiter
        fake_cuda.complete_all()
        assert list(await asyncio.gather(first, second)) == ["a", "b"]
        wait.close()


async def test_an_await_among_others_whose_poll_cannot_start_leaves_no_watch_behind(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter is told of a new wait before the watch is added (as
    ``Driver.watch`` does): if that raises, the await fails and nothing of
    it stays in the watch list."""
    _asyncio_only(anyio_backend)
    async with _beside_another_wait(fake_cuda) as driver:

        class Broken:
            """The driver's pacer, but its new_wait() raises (the native
            core's Pacer is a type whose methods cannot be patched)."""

            def __init__(self, pacer: object) -> None:
                self.pacer = pacer

            def new_wait(self, now: float) -> None:
                raise RuntimeError("the pacer broke")

            def __getattr__(self, name: str) -> object:
                return getattr(self.pacer, name)

        with monkeypatch.context() as patch:
            patch.setattr(driver, "pacer", Broken(driver.pacer))
            with pytest.raises(RuntimeError, match="the pacer broke"):
                await asyncio.ensure_future(_await(cudafut.record("v")))
        assert driver.watchlist.pending == 1  # the other wait's only


async def test_cancelling_one_of_many_awaits_keeps_the_message_and_the_rest(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    futs = [cudafut.record(i) for i in range(10)]
    tasks = [asyncio.ensure_future(_await(f)) for f in futs]
    driver = await _until_pending(10)
    tasks[5].cancel("no longer needed")
    with pytest.raises(asyncio.CancelledError) as caught:
        await tasks[5]
    assert "no longer needed" in str(caught.value) or caught.value.args == ("no longer needed",)
    assert driver.watchlist.pending == 9
    fake_cuda.complete_all()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [r for i, r in enumerate(results) if i != 5] == [i for i in range(10) if i != 5]
    assert driver.watchlist.pending == 0
    assert await futs[5] == 5  # the future itself is unaffected


async def test_a_task_cancelled_after_its_record_completed_is_cancelled(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    """As with an asyncio future set before the task woke: the wait cannot
    be cancelled any more, the task is, at its next step."""
    _asyncio_only(anyio_backend)
    futs = [cudafut.record(i, stream=fake_cuda.stream()) for i in range(3)]  # completed apart
    tasks = [asyncio.ensure_future(_await(f)) for f in futs]
    driver = await _until_pending(3)
    fake_cuda.complete(futs[2])
    driver.poll(False)  # the waiter sees it here: the task's wake-up is queued, not run
    waited = tasks[2]._fut_waiter  # type: ignore[attr-defined]
    assert waited.done() and not waited.cancelled() and not waited.cancel()
    assert tasks[2].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[2]
    assert driver.watchlist.pending == 2
    fake_cuda.complete_all()
    assert await asyncio.gather(*tasks[:2]) == [0, 1]


async def test_a_failed_record_among_many_fails_its_await_only(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    streams = [fake_cuda.stream() for _ in range(3)]
    futs = [cudafut.record(i, stream=streams[i]) for i in range(3)]
    tasks = [asyncio.ensure_future(_await(f)) for f in futs]
    await _until_pending(3)
    fake_cuda.fail(futs[1], 700)
    fake_cuda.complete(futs[0], futs[2])
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] == 0 and results[2] == 2
    assert isinstance(results[1], cudafut.CudaError) and results[1].code == 700


async def test_a_timeout_among_many_awaits_removes_its_wait(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    futs = [cudafut.record(i) for i in range(5)]
    tasks = [asyncio.ensure_future(_await(f)) for f in futs[:4]]
    driver = await _until_pending(4)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(futs[4], 0.01)
    assert driver.watchlist.pending == 4
    fake_cuda.complete_all()
    assert await asyncio.gather(*tasks) == [0, 1, 2, 3]


@contextlib.asynccontextmanager
async def _beside_another_wait(fake_cuda: testing.FakeCuda) -> AsyncIterator[_loops.LoopDriver]:
    """Another task waits (so that an await here is one among others);
    yields the loop's driver; at the end completes everything and checks
    that the other wait came through."""
    other = asyncio.ensure_future(_await(cudafut.record("other")))
    driver = await _until_pending(1)
    yield driver
    fake_cuda.complete_all()
    assert await other == "other"


async def test_the_one_object_await_as_a_future_and_an_iterator(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    """What asyncio.Task relies on, and misuse: explained, never a hang."""
    _asyncio_only(anyio_backend)
    async with _beside_another_wait(fake_cuda) as driver:
        fut = cudafut.record("v")
        wait: Any = fut.__await__()
        assert type(wait) is _loops._AsyncioAwait
        assert iter(wait) is wait and not wait.done()
        assert repr(wait).startswith("<cudafut await new of <CudaFuture")
        with pytest.raises(asyncio.InvalidStateError):
            wait.result()
        # Driven by hand from a thread without this loop: refused, nothing added.
        with pytest.raises(RuntimeError, match=r"running asyncio|task that started it"):
            await anyio.to_thread.run_sync(lambda: wait.send(None))
        assert driver.watchlist.pending == 1
        assert next(wait) is wait and driver.watchlist.pending == 2  # the yield a task sees
        wait.add_done_callback(lambda w: None)
        with pytest.raises(RuntimeError, match="one task"):
            wait.add_done_callback(lambda w: None)
        with pytest.raises(RuntimeError, match="wasn't used with future"):
            next(wait)  # resumed before the wake-up
        assert wait.get_loop() is asyncio.get_running_loop()
        assert wait.cancel() and wait.cancelled() and not wait.cancel()
        with pytest.raises(asyncio.CancelledError):
            wait.result()
        # The watch goes when the task is thrown into (or closes), on the loop's thread.
        assert driver.watchlist.pending == 2
        with pytest.raises(asyncio.CancelledError):
            next(wait)
        assert driver.watchlist.pending == 1
        wait.close()
    assert await fut == "v"


@pytest.mark.no_asyncio_debug(reason="in debug mode each wake-up keeps its own handle: the batch is not used")
async def test_tasks_woken_by_one_poll_run_in_firing_order_among_other_callbacks(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    """One poll fires one-object awaits and a plain callback of the waiter
    between them: the tasks' steps and what the callback schedules run in
    the order the records fired (the native core runs consecutive task
    wake-ups as one loop callback, flushed before any other callback)."""
    _asyncio_only(anyio_backend)
    loop = asyncio.get_running_loop()
    stream = fake_cuda.stream()
    log: list[str] = []

    async def wake(name: str, fut: cudafut.CudaFuture[Any]) -> None:
        await fut
        log.append(name)

    futs = [cudafut.record(i, stream=stream) for i in range(6)]
    tasks = [asyncio.ensure_future(wake(f"task {i}", f)) for i, f in enumerate(futs) if i != 3]
    driver = await _until_pending(5)

    # Record 3's watch is a plain callback, which schedules its entry as a
    # task's wake-up would.
    def callback(_record: object) -> None:
        loop.call_soon(log.append, "callback 3")

    driver.watch_one(records_of(futs[3])[0], callback)
    fake_cuda.complete_all()
    await asyncio.gather(*tasks)
    assert log == ["task 0", "task 1", "task 2", "callback 3", "task 4", "task 5"]


def test_a_keyboard_interrupt_in_a_woken_task_strands_no_other_task(fake_cuda: testing.FakeCuda) -> None:
    """A task that raises KeyboardInterrupt as it wakes stops the loop, as
    asyncio's own wake-ups do; the tasks woken by the same poll after it
    still run when the loop runs again (none is left waiting)."""
    stream = fake_cuda.stream()
    log: list[int] = []

    async def wake(i: int, fut: cudafut.CudaFuture[Any]) -> None:
        await fut
        if i == 2:
            raise KeyboardInterrupt
        log.append(i)

    async def start() -> list[asyncio.Task[None]]:
        futs = [cudafut.record(i, stream=stream) for i in range(6)]
        tasks = [asyncio.ensure_future(wake(i, f)) for i, f in enumerate(futs)]
        await _until_pending(5)  # the first spins alone in its task
        fake_cuda.complete_all()
        return tasks

    loop = asyncio.new_event_loop()
    try:
        tasks = loop.run_until_complete(start())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(asyncio.gather(*tasks[3:]))
        loop.run_until_complete(asyncio.gather(*tasks[3:]))
        assert sorted(log) == [0, 1, 3, 4, 5]
        assert isinstance(tasks[2].exception(), KeyboardInterrupt)
    finally:
        loop.close()


class _RaisingWakeTask(asyncio.tasks._PyTask):  # type: ignore[misc,name-defined]
    """A Python task whose next wake-up raises ``boom`` (once)."""

    boom: BaseException | None = None

    def _Task__wakeup(self, fut: Any) -> None:  # noqa: N802 - the name _PyTask calls
        boom, self.boom = self.boom, None
        if boom is not None:
            raise boom
        super()._Task__wakeup(fut)


def test_a_loop_handler_raising_for_a_woken_task_strands_no_other_task(fake_cuda: testing.FakeCuda) -> None:
    """A task's wake-up raises: the loop's exception handler gets it, with
    the ``handle`` ``Handle._run`` would give; the handler raises
    ``SystemExit``, which stops the loop, and the tasks the same poll woke
    after it still run when the loop runs again."""
    stream = fake_cuda.stream()
    log: list[int] = []
    contexts: list[dict[str, Any]] = []

    def handler(_loop: Any, context: dict[str, Any]) -> None:
        contexts.append(context)
        raise SystemExit

    async def wake(i: int, fut: cudafut.CudaFuture[Any]) -> None:
        await fut
        log.append(i)

    async def start() -> list[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(lambda lp, coro, **kw: _RaisingWakeTask(coro, loop=lp, **kw))
        futs = [cudafut.record(i, stream=stream) for i in range(6)]
        tasks = [asyncio.ensure_future(wake(i, f)) for i, f in enumerate(futs)]
        tasks[2].boom = ValueError("boom")  # type: ignore[attr-defined]
        await _until_pending(5)  # the first spins alone in its task
        fake_cuda.complete_all()
        return tasks

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(handler)
    try:
        tasks = loop.run_until_complete(start())
        with pytest.raises(SystemExit):
            loop.run_until_complete(asyncio.gather(*tasks[3:]))
        loop.run_until_complete(asyncio.gather(*tasks[3:]))
        assert sorted(log) == [0, 1, 3, 4, 5]
        assert isinstance(contexts[0]["exception"], ValueError)
        assert isinstance(contexts[0]["handle"], asyncio.Handle)
        # Task 2's wake-up raised: it waits for ever, as with a Handle; its
        # "destroyed but pending" report is not this test's.
        loop.set_exception_handler(lambda _loop, _context: None)
        del tasks
        gc.collect()
    finally:
        loop.close()


def test_an_interrupt_inside_call_soon_strands_no_woken_task(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``KeyboardInterrupt`` that lands inside the loop's ``call_soon``
    (a signal) as a poll schedules its wake-ups is reported, and every task
    the poll woke still runs (it was so with a ``call_soon`` per await)."""
    stream = fake_cuda.stream()
    log: list[int] = []

    async def wake(i: int, fut: cudafut.CudaFuture[Any]) -> None:
        await fut
        log.append(i)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        futs = [cudafut.record(i, stream=stream) for i in range(6)]
        tasks = [asyncio.ensure_future(wake(i, f)) for i, f in enumerate(futs)]
        await _until_pending(5)
        real = loop.call_soon
        interrupted: list[bool] = []

        def call_soon(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not interrupted and type(fn).__name__ == "_Wakeups":
                interrupted.append(True)
                raise KeyboardInterrupt
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(loop, "call_soon", call_soon)
        fake_cuda.complete_all()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert interrupted or not _compiled.native()  # the pure core schedules a handle per await

    asyncio.run(main())
    assert sorted(log) == [0, 1, 2, 3, 4, 5]


async def test_closing_a_coroutine_that_awaits_among_others_removes_its_wait(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    async with _beside_another_wait(fake_cuda) as driver:
        coro = _await(cudafut.record("v"))
        waited = coro.send(None)  # driven by hand: the yield a task would see
        assert type(waited) is _loops._AsyncioAwait and driver.watchlist.pending == 2
        coro.close()  # GeneratorExit through the await: close() on the object
        assert driver.watchlist.pending == 1


async def test_a_legacy_throw_of_a_type_and_value_raises_as_a_generator_would(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    _asyncio_only(anyio_backend)
    async with _beside_another_wait(fake_cuda) as driver:
        wait: Any = cudafut.record("v").__await__()
        next(wait)
        with pytest.raises(ValueError, match="thrown in"):
            wait.throw(ValueError, "thrown in")
        assert driver.watchlist.pending == 1


@pytest.mark.parametrize("task_type", ["c", "python"])
async def test_timeouts_and_task_groups_cancel_awaits_among_others(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda, task_type: str
) -> None:
    """asyncio.timeout() and a TaskGroup (Python 3.11+) count their
    cancellations right, on the C Task and on asyncio's pure-Python Task."""
    _asyncio_only(anyio_backend)
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout() and TaskGroup are Python 3.11's")
    make = asyncio.Task if task_type == "c" else asyncio.tasks._PyTask
    loop = asyncio.get_running_loop()
    futs = [cudafut.record(i) for i in range(4)]
    tasks = [make(_await(f), loop=loop) for f in futs[:3]]
    driver = await _until_pending(3)

    async def timed() -> object:
        async with asyncio.timeout(0.01):
            return await futs[3]

    timer = make(timed(), loop=loop)
    with pytest.raises(TimeoutError):
        await timer
    assert timer.cancelling() == 0 and driver.watchlist.pending == 3

    async def grouped() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(_await(cudafut.record("waits")))
            group.create_task(_raise_soon())

    with pytest.raises(getattr(builtins, "ExceptionGroup")):  # Python 3.11+  # noqa: B009
        await make(grouped(), loop=loop)
    assert driver.watchlist.pending == 3
    fake_cuda.complete_all()
    assert await asyncio.gather(*tasks) == [0, 1, 2]
    assert driver.watchlist.pending == 0


async def _raise_soon() -> None:
    await asyncio.sleep(0.005)
    raise ValueError("a sibling failed")


async def test_a_wait_cancelled_then_seen_complete_before_its_task_runs(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    """cancel() only marks the wait: the waiter may still fire its watch
    before the task runs; the task ends cancelled, the count stays right."""
    _asyncio_only(anyio_backend)
    futs = [cudafut.record(i, stream=fake_cuda.stream()) for i in range(3)]  # completed apart
    tasks = [asyncio.ensure_future(_await(f)) for f in futs]
    driver = await _until_pending(3)
    waited = tasks[2]._fut_waiter  # type: ignore[attr-defined]
    assert tasks[2].cancel() and waited.cancelled()
    assert driver.watchlist.pending == 3  # removed by the task, on the loop's thread
    fake_cuda.complete(futs[2])
    driver.poll(False)  # the waiter fires the cancelled watch: nothing to wake twice
    assert driver.watchlist.pending == 2
    with pytest.raises(asyncio.CancelledError):
        await tasks[2]
    assert driver.watchlist.pending == 2
    assert repr(waited).startswith("<cudafut await finished")
    fake_cuda.complete_all()
    assert await asyncio.gather(*tasks[:2]) == [0, 1]
    assert driver.watchlist.pending == 0


async def test_an_await_of_done_work_behind_an_unpolled_record_returns_at_once(
    fake_cuda: testing.FakeCuda,
) -> None:
    """The older record's work ended unseen by any poll (the waiter sleeps
    for long): an await of later work, done too, learns it from its own
    query, before the poll that wakes the older record's task."""
    stream = fake_cuda.stream()
    first = cudafut.record("a", stream=stream)
    second = cudafut.record("b", stream=stream)
    old = cudafut.set_wait_policy(cudafut.WaitPolicy(spin_s=0.0, first_sleep_s=60.0, max_sleep_s=60.0))
    done: list[str] = []

    async def one(fut: cudafut.CudaFuture[str]) -> None:
        done.append(await fut)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, first)
            await _until_pending(1)
            for _ in range(5):
                await anyio.sleep(0)  # the waiter polled once and sleeps
            fake_cuda.complete_all()
            with anyio.fail_after(10):  # the waiter's next poll: in 60 s
                assert await second == "b"
            assert done == []  # the first task still waits for the poll
            tg.cancel_scope.cancel()
    finally:
        cudafut.set_wait_policy(old)


async def test_a_done_callback_of_done_work_behind_an_unpolled_record_runs_soon(
    fake_cuda: testing.FakeCuda,
) -> None:
    """A done callback is added without a query: its wait starts a spin as
    any new wait does, even behind a watched record of its stream, whose
    end no poll has seen (the waiter sleeps for long): it runs at once,
    not at that sleep's end."""
    stream = fake_cuda.stream()
    first = cudafut.record("a", stream=stream)
    second = cudafut.record("b", stream=stream)
    old = cudafut.set_wait_policy(cudafut.WaitPolicy(spin_s=1.0, first_sleep_s=60.0, max_sleep_s=60.0))
    called = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_await, first)
            driver = await _until_pending(1)
            driver.pacer.spin_until = 0.0  # the first wait's spin is over
            for _ in range(5):
                await anyio.sleep(0)  # the waiter polled and sleeps
            fake_cuda.complete_all()
            second.add_done_callback(lambda f: called.set())
            with anyio.fail_after(10):  # the waiter's planned poll: in 60 s
                await called.wait()
            tg.cancel_scope.cancel()
    finally:
        cudafut.set_wait_policy(old)


def _tracked_per_await(fake: testing.FakeCuda, kind: str, n: int = 2000) -> float:
    """GC-tracked objects alive per task while ``n`` tasks await: a pending
    ``cudafut.record()`` future each, or a plain asyncio future each."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        plain: list[asyncio.Future[None]] = []

        async def one(i: int) -> None:
            if kind == "plain":
                fut = loop.create_future()
                plain.append(fut)
                await fut
            else:
                await cudafut.record(i)

        # A first wait of each kind makes what lives as long as the loop
        # (the driver and its native entry, the waiter's state).
        warm = [asyncio.ensure_future(one(-1)) for _ in range(2)]
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        before = len(gc.get_objects())
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        during = len(gc.get_objects())
        for fut in plain:
            fut.set_result(None)
        fake.complete_all()
        await asyncio.gather(*warm, *tasks)
        # The list of tasks is one object: not per task.
        return (during - before - 1) / n

    return asyncio.run(run())


def test_a_pending_await_holds_few_more_gc_tracked_objects_than_an_asyncio_one(
    fake_cuda: testing.FakeCuda,
) -> None:
    """Each pending await is walked by every full collection. A task
    awaiting a plain asyncio future holds 7 tracked objects here (the task,
    its coroutine, context, weak reference and wake-up method, the future
    and its iterator). Awaiting a recorded, pending future on the native
    core, it holds the same but the future's two, and the ``CudaFuture``,
    its lock, its tuple of records and the ``AsyncioAwait`` (the record and
    the watch are not tracked): two more. The fake GPU adds a tuple per
    record holding its event object (a CUDA event is an int; the fake's
    events are pooled, made in the first round only, which the minimum of
    two rounds leaves out), so the bound here is 3 more; the pure core's
    await keeps one object more."""
    from cudafut import _compiled

    gc.collect()
    plain = min(_tracked_per_await(fake_cuda, "plain") for _ in range(2))
    mine = min(_tracked_per_await(fake_cuda, "cudafut") for _ in range(2))
    assert plain == pytest.approx(round(plain), abs=0.05)  # whole objects per task
    limit = 3 if _compiled.native() is not None else 4
    assert mine - plain <= limit + 0.05, (mine, plain)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_lone_low_latency_await_spins_in_its_task_for_the_whole_wait() -> None:
    # low_latency spins for the whole wait. A plan's spin lasts max_sleep_s
    # at most; when it runs out, a lone await plans again and spins on in
    # its task, rather than hand its wait to the driver (a watch in its
    # list), whose wake-up hop, after a long spin, runs cold (about 25 us
    # later at 20 ms on an H200).
    old = cudafut.set_wait_policy("low_latency")
    rec = FakeRecord()
    driver = _loops.require_driver()
    watched: list[int] = []

    async def complete_after_a_few_plans() -> None:
        await asyncio.sleep(5 * cudafut.get_wait_policy().max_sleep_s)
        watched.append(driver.watchlist.pending)
        rec.complete()

    try:
        task = asyncio.create_task(complete_after_a_few_plans())
        assert await set_future("v", [rec]) == "v"
        await task
    finally:
        cudafut.set_wait_policy(old)
    assert watched == [0]


@pytest.mark.parametrize("path", ["lone await", "driver"])
async def test_the_predictor_learns_a_completion_after_the_awaiting_task_resumed(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda, path: str
) -> None:
    # Predictor.observe is Python that runs cold after a long wait: on an
    # event loop it runs in a callback queued behind the wake-up, so the
    # awaiting code resumes first. On trio the driver teaches it at once.
    from cudafut import _policy

    sleeps = cudafut.WaitPolicy(
        spin_s=1e-6, first_sleep_s=1e-3, max_sleep_s=1e-3, predict=False, notify=False
    )
    old = cudafut.set_wait_policy("low_latency" if path == "lone await" else sleeps)
    fut = cudafut.record("v", stream=fake_cuda.stream())
    (rec,) = records_of(fut)
    _policy.predictor.histories.pop(rec.stream_key, None)  # a fake stream's key may have been used before

    async def complete_soon() -> None:
        await anyio.sleep(0.005)
        fake_cuda.complete_all()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(complete_soon)
            assert await fut == "v"
            at_resume = rec.stream_key in _policy.predictor.histories
            await anyio.sleep(0)
            after_a_step = rec.stream_key in _policy.predictor.histories
    finally:
        cudafut.set_wait_policy(old)
        _policy.predictor.histories.pop(rec.stream_key, None)
    if anyio_backend[0] == "trio":
        assert at_resume
    else:
        assert (at_resume, after_a_step) == (False, True)


async def test_the_predictor_learns_at_once_when_work_is_queued_behind_the_completion(
    anyio_backend: tuple[str, dict[str, object]], fake_cuda: testing.FakeCuda
) -> None:
    # Work recorded behind the completed one started when it completed: the
    # next await's plan needs that start, so the predictor learns before the
    # awaiting code resumes (a deferred lesson would leave the next wait a
    # start too early, and it would spin from then).
    from cudafut import _policy

    stream = fake_cuda.stream()
    first = cudafut.record("a", stream=stream)
    second = cudafut.record("b", stream=stream)
    (rec,) = records_of(first)
    _policy.predictor.histories.pop(rec.stream_key, None)  # a fake stream's key may have been used before

    async def complete_the_first() -> None:
        await anyio.sleep(0.005)
        fake_cuda.complete(first)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(complete_the_first)
            assert await first == "a"
            learnt = rec.stream_key in _policy.predictor.histories
            fake_cuda.complete(second)
            assert await second == "b"
    finally:
        _policy.predictor.histories.pop(rec.stream_key, None)
    assert learnt


def _learnt(record: FakeRecord, duration: float) -> None:
    """Give ``record``'s stream a learnt duration: a mode the waiter spins
    for, around ``duration`` after the record was made."""
    from cudafut import _policy

    hist = _policy._History(record.t)
    for _ in range(4):
        hist.points.append((duration, True))
    hist.modes = _policy._find_modes(hist.points)
    hist.surprised = False
    _policy.predictor.histories[record.stream_key] = hist


@pytest.mark.parametrize("learnt", [True, False])
async def test_a_lone_await_of_learnt_work_sleeps_in_its_task_and_polls_the_end_itself(
    anyio_backend: tuple[str, dict[str, object]], learnt: bool
) -> None:
    # Work of a learnt duration: the lone await sleeps on the driver's timer
    # in its own task until the spin before the predicted end, and the poll
    # that sees the end is its own (after a long sleep the driver's wake-up
    # hop runs cold). Unknown work goes to the driver, which asks CUDA for a
    # notice; so does every wait on trio.
    from cudafut import _policy

    rec = FakeRecord()
    if learnt:
        _learnt(rec, 0.02)
    driver = _loops.require_driver()
    watched: list[int] = []
    modes: list[int] = []

    async def complete_near_the_end() -> None:
        await anyio.sleep(0.01)
        modes.append(getattr(driver, "_mode", -1))
        await anyio.sleep(0.0095)
        watched.append(driver.watchlist.pending)
        rec.complete()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(complete_near_the_end)
            assert await set_future("v", [rec]) == "v"
    finally:
        _policy.predictor.histories.pop(rec.stream_key, None)
    in_task = learnt and anyio_backend[0] != "trio"
    assert watched == [0 if in_task else 1]
    if in_task:
        assert modes == [_loops._ALONE]


async def test_a_new_wait_wakes_a_lone_await_sleeping_in_its_task(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    # A second wait while the lone await sleeps: the driver takes both, and
    # each completes.
    from cudafut import _policy

    first, second = FakeRecord(), FakeRecord()
    _learnt(first, 0.05)
    driver = _loops.require_driver()
    modes: list[int] = []

    async def second_wait() -> None:
        await anyio.sleep(0.01)
        modes.append(getattr(driver, "_mode", -1))
        fut = set_future("b", [second])
        second.complete()
        assert await fut == "b"
        first.complete()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(second_wait)
            assert await set_future("a", [first]) == "a"
    finally:
        _policy.predictor.histories.pop(first.stream_key, None)
    assert driver.watchlist.pending == 0
    if anyio_backend[0] != "trio":
        assert modes == [_loops._ALONE]


async def test_cancelling_a_lone_await_sleeping_in_its_task_stops_its_timer(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    from cudafut import _policy

    rec, later = FakeRecord(), FakeRecord()
    _learnt(rec, 0.05)
    driver = _loops.require_driver()
    try:
        with anyio.move_on_after(0.01):
            await set_future("v", [rec])
    finally:
        _policy.predictor.histories.pop(rec.stream_key, None)
    if isinstance(driver, _loops.AsyncioDriver):
        assert driver._mode == _loops._IDLE
        assert driver._alone_wake is None
    later.complete()
    assert await set_future("w", [later]) == "w"
    assert driver.watchlist.pending == 0
