"""cudafut.Batcher's rules with fakes (no GPU): batching, padding to buckets,
the in-flight limit, cancellation, failures and closing, on asyncio, uvloop
and trio."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _loops, testing
from tests.fakes import FakeRecord, set_future

pytestmark = pytest.mark.anyio


async def _submit_all(batcher: cudafut.Batcher[Any, Any], items: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(items)

    async def one(i: int) -> None:
        results[i] = await batcher.submit(items[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    return results


async def test_requests_arriving_together_share_batches_up_to_max_batch() -> None:
    seen: list[list[int]] = []

    async def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        return [x * 10 for x in items]

    async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=0.05) as batcher:
        results = await _submit_all(batcher, list(range(20)))
    assert results == [x * 10 for x in range(20)]
    assert sorted(x for batch in seen for x in batch) == list(range(20))
    assert all(len(batch) <= 8 for batch in seen)
    assert len(seen) < 20  # they were batched
    stats = batcher.statistics()
    assert (stats.batches, stats.items, stats.padded, stats.in_flight, stats.queued) == (
        len(seen),
        20,
        0,
        0,
        0,
    )
    assert sum(size * count for size, count in stats.sizes.items()) == 20
    assert stats.mean_batch == 20 / len(seen)


async def test_a_lone_request_runs_after_max_delay() -> None:
    async def run_batch(items: list[str]) -> list[str]:
        return [s.upper() for s in items]

    async with cudafut.Batcher(run_batch, max_batch=64, max_delay_s=0.001) as batcher:
        assert await batcher.submit("a") == "A"
        assert await batcher.submit("b") == "B"
    assert batcher.statistics().sizes == {1: 2}


async def test_batches_are_padded_to_buckets_and_padding_results_dropped() -> None:
    sizes: list[int] = []

    async def run_batch(items: list[int]) -> np.ndarray[Any, Any]:
        sizes.append(len(items))
        return np.asarray(items) + 1  # an array: one row per item

    async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=0.05, buckets=[8, 1, 4, 2]) as batcher:
        results = await _submit_all(batcher, list(range(13)))
    assert [int(r) for r in results] == [x + 1 for x in range(13)]
    assert set(sizes) <= {1, 2, 4, 8}
    stats = batcher.statistics()
    assert stats.items == 13
    assert stats.padded == sum(sizes) - 13
    assert batcher.buckets == (1, 2, 4, 8)


async def test_at_most_max_in_flight_batches_run_and_the_next_takes_all_waiting() -> None:
    running = 0
    most = 0
    release = anyio.Event()
    sizes: list[int] = []

    async def run_batch(items: list[int]) -> list[int]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        sizes.append(len(items))
        await release.wait()
        running -= 1
        return items

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0, max_in_flight=2) as batcher:
        async with anyio.create_task_group() as tg:
            for i in range(11):
                tg.start_soon(batcher.submit, i)
                await anyio.sleep(0)
            for _ in range(20):  # let whatever can start, start
                await anyio.sleep(0)
            assert batcher.statistics().in_flight == 2
            assert batcher.statistics().queued > 0
            release.set()
    assert most == 2
    assert sum(sizes) == 11


async def test_a_full_batch_runs_without_waiting_for_max_delay() -> None:
    seen: list[list[int]] = []

    async def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        return items

    with anyio.fail_after(60):  # a hang guard: waiting for max_delay_s would take an hour
        # min_in_flight=0: with nothing running too, a batch waits to fill.
        async with cudafut.Batcher(
            run_batch, max_batch=4, max_delay_s=3600, max_in_flight=1, min_in_flight=0
        ) as batcher:
            assert sorted(await _submit_all(batcher, list(range(8)))) == list(range(8))
    assert [len(batch) for batch in seen] == [4, 4]


async def test_requests_waiting_for_a_slot_form_one_batch_when_it_frees() -> None:
    seen: list[list[int]] = []
    gate = anyio.Event()

    async def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        await gate.wait()
        return [x * 2 for x in items]

    results: dict[int, int] = {}

    async def one(b: cudafut.Batcher[int, int], i: int) -> None:
        results[i] = await b.submit(i)

    async with cudafut.Batcher(run_batch, max_batch=64, max_delay_s=0, max_in_flight=1) as batcher:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, batcher, 0)
            for _ in range(10):  # batch [0] runs, held: the only slot is taken
                await anyio.sleep(0)
            for i in range(1, 6):
                tg.start_soon(one, batcher, i)
            for _ in range(10):
                await anyio.sleep(0)
            assert batcher.statistics().queued == 5
            gate.set()
    # one batch, in arrival order (trio starts the tasks in an order of its choosing)
    assert len(seen) == 2 and seen[0] == [0] and sorted(seen[1]) == [1, 2, 3, 4, 5]
    assert results == {i: 2 * i for i in range(6)}


async def test_while_fewer_than_min_in_flight_batches_run_a_batch_goes_at_once() -> None:
    seen: list[list[int]] = []
    gates: list[anyio.Event] = []

    async def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        gate = anyio.Event()
        gates.append(gate)
        await gate.wait()
        return items

    async def settle() -> None:
        for _ in range(20):
            await anyio.sleep(0)

    # max_delay_s of an hour: a batch that waited for its deadline would hang the test.
    with anyio.fail_after(60):
        async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=3600) as batcher:
            assert batcher.min_in_flight == 2  # the default
            async with anyio.create_task_group() as tg:
                tg.start_soon(batcher.submit, 0)
                await settle()
                assert seen == [[0]]  # nothing ran: it went alone, at once
                tg.start_soon(batcher.submit, 1)
                await settle()
                assert seen == [[0], [1]]  # one ran: the second went at once too
                for i in range(2, 5):
                    tg.start_soon(batcher.submit, i)
                await settle()
                assert len(seen) == 2 and batcher.statistics().queued == 3  # two run: they fill
                gates[0].set()  # one ends: the pipeline runs low, the waiting ones go
                await settle()
                assert len(seen) == 3 and sorted(seen[2]) == [2, 3, 4]
                for gate in gates[1:]:
                    gate.set()


async def test_min_in_flight_zero_waits_to_fill_even_with_nothing_running() -> None:
    seen: list[list[int]] = []

    async def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        return items

    with anyio.fail_after(60):
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=3600, min_in_flight=0) as batcher:
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(batcher.submit, i)
                for _ in range(20):
                    await anyio.sleep(0)
                assert seen == [] and batcher.statistics().queued == 2  # waiting for its deadline
                for i in range(2, 4):
                    tg.start_soon(batcher.submit, i)  # full: it goes
    assert [sorted(b) for b in seen] == [[0, 1, 2, 3]]


async def test_a_deadline_timer_that_fires_before_the_loop_clock_reaches_it_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # uvloop rounds a timer's delay down to whole milliseconds: the timer of
    # a deadline fires while the loop's time is still below it. A fake clock
    # that never reaches any deadline: the batch must go when its timer
    # fires, after one sleep (asking the clock again slept again: a busy loop).
    sleeps = 0
    for tasks in (_loops.AsyncioTasks, _loops.TrioTasks):
        real_sleep = tasks.sleep

        async def counted(self: Any, deadline: float | None, real: Any = real_sleep) -> bool:
            nonlocal sleeps
            sleeps += deadline is not None
            result: bool = await real(self, deadline)
            return result

        monkeypatch.setattr(tasks, "sleep", counted)
        monkeypatch.setattr(tasks, "now", lambda self: 0.0)  # deadlines: 0.001

    async def run_batch(items: list[str]) -> list[str]:
        return [s.upper() for s in items]

    with anyio.fail_after(60):
        async with cudafut.Batcher(run_batch, max_delay_s=0.001, min_in_flight=0) as batcher:
            assert await batcher.submit("a") == "A"
    assert sleeps == 1


@pytest.mark.parametrize(("max_in_flight", "expected"), [(4, 2), (2, 2), (1, 1)])
def test_min_in_flight_defaults_to_two_or_max_in_flight(max_in_flight: int, expected: int) -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    assert cudafut.Batcher(run_batch, max_in_flight=max_in_flight).min_in_flight == expected


async def test_a_request_cancelled_before_its_batch_runs_is_dropped() -> None:
    seen: list[int] = []
    gate = anyio.Event()

    async def run_batch(items: list[int]) -> list[int]:
        seen.extend(items)
        await gate.wait()
        return items

    async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0, max_in_flight=1) as batcher:
        async with anyio.create_task_group() as tg:
            tg.start_soon(batcher.submit, 0)  # runs, holds the only slot
            for _ in range(10):
                await anyio.sleep(0)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await batcher.submit(1)  # queued, then cancelled
            tg.start_soon(batcher.submit, 2)
            for _ in range(10):
                await anyio.sleep(0)
            gate.set()
    assert seen == [0, 2]
    assert batcher.statistics().cancelled == 1


async def test_a_failing_batch_fails_only_its_requests() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        if 3 in items:
            raise KeyError("three")
        return items

    async with cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0) as batcher:
        assert await batcher.submit(1) == 1
        with pytest.raises(KeyError, match="three"):
            await batcher.submit(3)
        assert await batcher.submit(4) == 4
    assert batcher.statistics().failed_batches == 1


async def test_each_request_of_a_failing_batch_gets_its_exception() -> None:
    boom = ValueError("the model failed")

    async def run_batch(items: list[int]) -> list[int]:
        raise boom

    outcomes: list[BaseException] = []

    async def one(b: cudafut.Batcher[int, int], i: int) -> None:
        try:
            await b.submit(i)
        except ValueError as exc:
            outcomes.append(exc)

    async with cudafut.Batcher(run_batch, max_batch=3, max_delay_s=3600, min_in_flight=0) as batcher:
        async with anyio.create_task_group() as tg:
            for i in range(3):  # one full batch
                tg.start_soon(one, batcher, i)
    assert outcomes == [boom, boom, boom]
    assert batcher.statistics().failed_batches == 1


@pytest.mark.parametrize(
    ("out", "error", "match"),
    [([1, 2, 3], ValueError, "3 results for a batch of 1"), (42, TypeError, "one result per item")],
)
async def test_results_that_cannot_be_split_fail_the_batch(out: object, error: type, match: str) -> None:
    async def run_batch(items: list[int]) -> object:
        return out

    async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0) as batcher:
        with pytest.raises(error, match=match):
            await batcher.submit(0)


async def test_an_async_run_batch_may_return_a_cuda_future() -> None:
    async def run_batch(items: list[int]) -> cudafut.CudaFuture[list[int]]:
        rec = FakeRecord()
        rec.complete()
        return set_future([x + 1 for x in items], [rec])

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.01) as batcher:
        assert await _submit_all(batcher, [1, 2, 3]) == [2, 3, 4]


async def test_a_plain_run_batch_runs_through_launch_off_the_loop(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    loop_thread = threading.get_ident()
    threads: list[str] = []

    def run_batch(items: list[int]) -> list[int]:
        threads.append(threading.current_thread().name)
        return [x * 2 for x in items]

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.01, device=0) as batcher:
        assert await _submit_all(batcher, [1, 2, 3, 4, 5]) == [2, 4, 6, 8, 10]
    assert threads and all(name.startswith("cudafut-launcher-0-") for name in threads)
    assert threading.get_ident() == loop_thread


async def test_a_launched_batch_whose_waiter_is_cancelled_never_runs(fake_cuda: testing.FakeCuda) -> None:
    """Leaving the block with an exception cancels the running batches'
    launches: a batch still queued behind them never runs."""
    started = threading.Event()
    release = threading.Event()
    ran: list[list[int]] = []

    def run_batch(items: list[int]) -> list[int]:
        ran.append(items)
        started.set()
        release.wait(10)
        return items

    raised: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0, max_in_flight=8) as batcher:
                for i in range(40):  # more than the launcher threads: some wait in their queue
                    tg.start_soon(_swallow, batcher.submit(i))
                for _ in range(20):
                    await anyio.sleep(0)
                await anyio.to_thread.run_sync(started.wait, 10)
                raise ZeroDivisionError
    except BaseException as exc:  # the task group wraps it in an exception group
        raised = exc
    assert "ZeroDivisionError" in repr(raised)
    release.set()
    for _ in range(50):
        await anyio.sleep(0.01)
    assert 0 < len(ran) < 8  # the queued launches were cancelled before they started


async def _swallow(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw


async def test_leaving_the_block_runs_what_is_queued() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        await anyio.sleep(0.001)
        return items

    results: list[int] = []

    async def one(b: cudafut.Batcher[int, int], i: int) -> None:
        results.append(await b.submit(i))

    async with anyio.create_task_group() as tg:
        # A batch waits 60 s for more requests (min_in_flight=0: even with
        # nothing running): only leaving the block runs them.
        async with cudafut.Batcher(run_batch, max_batch=64, max_delay_s=60, min_in_flight=0) as batcher:
            for i in range(7):
                tg.start_soon(one, batcher, i)
            for _ in range(20):  # every task submitted
                await anyio.sleep(0)
            assert batcher.statistics().queued == 7
    assert sorted(results) == list(range(7))


async def test_submit_outside_the_block_is_refused() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    batcher = cudafut.Batcher(run_batch)
    with pytest.raises(cudafut.InvalidStateError, match="async with"):
        await batcher.submit(1)
    async with batcher:
        assert await batcher.submit(1) == 1
    with pytest.raises(cudafut.InvalidStateError):
        await batcher.submit(1)
    with pytest.raises(cudafut.InvalidStateError, match="runs once"):
        async with batcher:
            pass


@pytest.mark.parametrize("yields", range(5))
async def test_leaving_with_an_exception_fails_a_batch_whose_task_never_started(yields: int) -> None:
    # asyncio drops a task cancelled before its first step without running
    # its body: a batch spawned just before the block raised must still
    # answer its requests (with 2 yields, its task was made and not yet run).
    async def run_batch(items: list[int]) -> list[int]:
        await anyio.sleep(3600)
        return items

    batcher = cudafut.Batcher(run_batch, max_delay_s=0)
    outcome: list[BaseException | int] = []

    async def one() -> None:
        try:
            outcome.append(await batcher.submit(1))
        except cudafut.InvalidStateError as exc:
            outcome.append(exc)

    raised: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            async with batcher:
                tg.start_soon(one)
                for _ in range(yields):
                    await anyio.sleep(0)
                1 / 0  # noqa: B018
    except BaseException as exc:  # the task group wraps it in an exception group
        raised = exc
    assert "ZeroDivisionError" in repr(raised)
    assert len(outcome) == 1 and isinstance(outcome[0], cudafut.InvalidStateError)
    assert batcher.statistics().in_flight == 0


async def test_leaving_with_an_exception_fails_the_queued_requests() -> None:
    gate = anyio.Event()

    async def run_batch(items: list[int]) -> list[int]:
        await gate.wait()
        return items

    outcomes: list[BaseException | int] = []

    async def one(b: cudafut.Batcher[int, int], i: int) -> None:
        try:
            outcomes.append(await b.submit(i))
        except cudafut.InvalidStateError as exc:
            outcomes.append(exc)

    raised: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0, max_in_flight=1) as batcher:
                for i in range(3):
                    tg.start_soon(one, batcher, i)
                for _ in range(10):
                    await anyio.sleep(0)
                1 / 0  # noqa: B018
    except BaseException as exc:  # the task group wraps it in an exception group
        raised = exc
    assert "ZeroDivisionError" in repr(raised) or isinstance(raised, ZeroDivisionError)
    assert len(outcomes) == 3
    assert all(isinstance(o, cudafut.InvalidStateError) for o in outcomes)


async def test_a_cancellation_storm_loses_no_reply_and_leaks_nothing() -> None:
    rng = random.Random(7)

    async def run_batch(items: list[int]) -> list[int]:
        await anyio.sleep(rng.random() * 0.002)
        return [x * 3 for x in items]

    answered: dict[int, int] = {}
    cancelled: set[int] = set()

    async def one(b: cudafut.Batcher[int, int], i: int, delay: float | None) -> None:
        with anyio.CancelScope() as scope:
            if delay is not None:
                scope.deadline = anyio.current_time() + delay
            answered[i] = await b.submit(i)
        if scope.cancelled_caught:
            cancelled.add(i)

    async with cudafut.Batcher(run_batch, max_batch=16, max_delay_s=0.001, buckets=[4, 16]) as batcher:
        async with anyio.create_task_group() as tg:
            for i in range(600):
                tg.start_soon(one, batcher, i, rng.random() * 0.004 if rng.random() < 0.5 else None)
                if i % 50 == 0:
                    await anyio.sleep(0.001)
    assert set(answered) | cancelled == set(range(600))
    assert all(v == 3 * k for k, v in answered.items())
    stats = batcher.statistics()
    assert (stats.queued, stats.in_flight, stats.failed_batches) == (0, 0, 0)
    assert stats.items + stats.cancelled >= len(answered)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_batch": 0}, ValueError, "max_batch must be at least 1"),
        ({"max_batch": 2.0}, TypeError, "max_batch must be an int"),
        ({"max_batch": True}, TypeError, "max_batch must be an int, not bool"),
        ({"max_in_flight": 0}, ValueError, "max_in_flight"),
        ({"min_in_flight": 5}, ValueError, "min_in_flight must be between 0 and max_in_flight"),
        ({"min_in_flight": -1}, ValueError, "min_in_flight"),
        ({"min_in_flight": 1.0}, TypeError, "min_in_flight must be an int"),
        ({"min_in_flight": True}, TypeError, "min_in_flight must be an int"),
        ({"max_delay_s": -1}, ValueError, "max_delay_s"),
        ({"max_delay_s": float("nan")}, ValueError, "max_delay_s"),
        ({"max_delay_s": float("inf")}, ValueError, "max_delay_s"),
        ({"max_delay_s": "1"}, TypeError, "max_delay_s"),
        ({"buckets": []}, ValueError, "at least one size"),
        ({"buckets": [0]}, ValueError, "at least 1"),
        ({"buckets": "8"}, TypeError, "sequence of ints"),
        ({"buckets": [8], "max_batch": 16}, ValueError, "above the largest bucket"),
        ({"device": "0"}, TypeError, "device"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    with pytest.raises(error, match=match):
        cudafut.Batcher(run_batch, **kwargs)


def test_numpy_integers_and_a_zero_delay_are_accepted() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    batcher = cudafut.Batcher(
        run_batch, max_batch=np.int64(8), max_delay_s=0, max_in_flight=np.int32(1), buckets=[np.int16(8)]
    )
    assert (batcher.max_batch, batcher.max_in_flight, batcher.max_delay_s) == (8, 1, 0.0)
    assert batcher.buckets == (8,)
    assert type(batcher.max_batch) is int and type(batcher.buckets[0]) is int


def test_the_default_pipeline_is_the_largest_bucket_by_four_in_flight() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    batcher = cudafut.Batcher(run_batch, buckets=(1, 8, 32))
    assert (batcher.max_batch, batcher.max_in_flight) == (32, 4)
    assert cudafut.Batcher(run_batch).max_batch == 64


def test_run_batch_must_be_callable() -> None:
    with pytest.raises(TypeError, match="run_batch must be a function"):
        cudafut.Batcher(42)  # type: ignore[call-overload]


async def test_an_exception_leaves_the_block_unwrapped() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    with pytest.raises(ZeroDivisionError):
        async with cudafut.Batcher(run_batch):
            1 / 0  # noqa: B018


async def test_max_batch_defaults_to_the_largest_bucket() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    assert cudafut.Batcher(run_batch, buckets=(1, 2, 4, 8, 16, 32)).max_batch == 32
    assert cudafut.Batcher(run_batch).max_batch == 64


class _StopError(BaseException):
    pass


async def test_a_base_exception_from_an_async_run_batch_reaches_its_requests() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        raise _StopError("stop")

    outcomes: list[BaseException] = []

    async def one(b: cudafut.Batcher[int, int]) -> None:
        try:
            await b.submit(1)
        except _StopError as exc:
            outcomes.append(exc)

    with contextlib.suppress(BaseException):
        async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0) as batcher:
            await one(batcher)
    assert len(outcomes) == 1 and isinstance(outcomes[0], _StopError)


def test_a_batch_former_that_dies_fails_the_queue_and_later_submits() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    async def main() -> None:
        async with cudafut.Batcher(run_batch, max_batch=64, max_delay_s=60, min_in_flight=0) as batcher:
            waiting = asyncio.ensure_future(batcher.submit(1))
            for _ in range(5):
                await asyncio.sleep(0)
            for task in list(batcher._rt.tasks):  # the former, the only task so far
                task.cancel()
            with pytest.raises(cudafut.InvalidStateError):
                await waiting
            with pytest.raises(cudafut.InvalidStateError, match="batch-forming task was cancelled"):
                await batcher.submit(2)

    asyncio.run(main())


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Yield to the loop (asyncio's or trio's) until ``condition()`` holds:
    a bounded spin, which fails with ``what``."""
    for _ in range(10_000):
        if condition():
            return
        await anyio.sleep(0)
    pytest.fail(what)


def test_a_former_that_fails_after_a_cancelled_item_says_it_ended_not_cancelled() -> None:
    gate = asyncio.Event()

    async def run_batch(items: list[int]) -> list[int]:
        await gate.wait()
        return items

    async def main() -> None:
        async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0, max_in_flight=1) as batcher:
            first = asyncio.ensure_future(batcher.submit(1))
            await _until(lambda: batcher.statistics().batches > 0, "the first batch never started")
            gone = asyncio.ensure_future(batcher.submit(2))  # queued behind the batch in flight
            await asyncio.sleep(0)
            gone.cancel()  # its caller went away: the former will count it, cancelled
            gate.set()
            assert await first == 1
            await _until(lambda: batcher.statistics().cancelled > 0, "the cancelled item was never counted")

            async def broken(deadline: float | None) -> None:
                raise RuntimeError("the former broke")

            batcher._rt.sleep = broken  # its next wait fails
            assert await batcher.submit(3) == 3
            for _ in range(5):
                await asyncio.sleep(0)
            with pytest.raises(cudafut.InvalidStateError, match="batch-forming task ended;"):
                await batcher.submit(4)

    asyncio.run(main())


def test_statistics_count_cancelled_items_only_after_the_former_was_cancelled() -> None:
    async def main() -> None:
        async with cudafut.Batcher(_double, max_batch=64, max_delay_s=60) as batcher:
            for task in list(batcher._rt.tasks):
                task.cancel()
            for _ in range(5):
                await asyncio.sleep(0)
            assert batcher.statistics().cancelled == 0  # no item was cancelled
            with pytest.raises(cudafut.InvalidStateError, match="batch-forming task was cancelled"):
                await batcher.submit(1)

    asyncio.run(main())


def test_submit_outside_any_loop_is_an_invalid_state_error() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    async def main() -> cudafut.Batcher[int, int]:
        async with cudafut.Batcher(run_batch, max_delay_s=60) as batcher:
            coro = batcher.submit(1)
            result: list[BaseException] = []

            def other_thread() -> None:
                loop = asyncio.new_event_loop()
                try:
                    loop.run_until_complete(coro)
                except BaseException as exc:
                    result.append(exc)
                finally:
                    loop.close()

            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            assert isinstance(result[0], cudafut.InvalidStateError)
        return batcher

    asyncio.run(main())


async def test_submit_future_is_set_when_the_batch_is_enqueued_not_done(fake_cuda: testing.FakeCuda) -> None:
    """The future a process hands on: set (its events recorded) before the
    GPU work is done, then done with the item's row once it is."""

    def run_batch(items: list[int]) -> np.ndarray[Any, Any]:
        return np.array(items) * 10  # the fake's "GPU" arrays are NumPy's

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.01) as batcher:
        futures = [batcher.submit_future(i) for i in range(3)]
        for fut in futures:
            await cudafut.enqueued(fut)
        assert not any(fut.done() for fut in futures)  # the fake holds the GPU work
        fake_cuda.complete_all()
        assert [int(await fut) for fut in futures] == [0, 10, 20]
    assert batcher.statistics().batches == 1


async def test_submit_future_fails_with_its_batch(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True

    def run_batch(items: list[int]) -> list[int]:
        raise ValueError("bad batch")

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.01) as batcher:
        fut = batcher.submit_future(1)
        with pytest.raises(ValueError, match="bad batch"):
            await fut


async def test_submit_future_cancelled_before_its_batch_drops_the_item(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    seen: list[list[int]] = []

    def run_batch(items: list[int]) -> list[int]:
        seen.append(list(items))
        return items

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.05) as batcher:
        dropped = batcher.submit_future(1)
        kept = batcher.submit_future(2)
        assert dropped.cancel()
        assert await kept == 2
    assert seen == [[2]]


async def test_submit_future_with_an_async_run_batch(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True

    async def run_batch(items: list[int]) -> list[int]:
        return [x + 1 for x in items]

    async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.01) as batcher:
        assert await batcher.submit_future(5) == 6


async def test_submit_future_outside_the_batcher_is_refused() -> None:
    async def run_batch(items: list[int]) -> list[int]:
        return items

    batcher = cudafut.Batcher(run_batch, max_batch=4)
    with pytest.raises(cudafut.InvalidStateError, match="not running"):
        batcher.submit_future(1)


# -- start() / aclose(): a framework's start-up and shutdown hooks ---------------------------


async def _double(items: list[int]) -> list[int]:
    await anyio.sleep(0)
    return [x * 2 for x in items]


async def _until_queued(batcher: cudafut.Batcher[Any, Any], n: int) -> None:
    await _until(lambda: batcher.statistics().queued >= n, f"{n} items were never queued")


async def test_start_and_aclose_from_different_tasks_as_a_frameworks_hooks_do() -> None:
    batcher = cudafut.Batcher(_double, max_batch=8, max_delay_s=60, min_in_flight=0)
    async with anyio.create_task_group() as hook:  # the start-up hook: a task that ends
        hook.start_soon(batcher.start)
    results: list[int] = []

    async def request(i: int) -> None:
        results.append(await batcher.submit(i))

    async with anyio.create_task_group() as requests:
        for i in range(5):
            requests.start_soon(request, i)
        # A batch waits 60 s for more requests: only the close runs them.
        await _until_queued(batcher, 5)
        async with anyio.create_task_group() as hook:  # the shutdown hook, another task
            hook.start_soon(batcher.aclose)
    assert sorted(results) == [0, 2, 4, 6, 8]
    assert batcher.statistics().batches == 1
    with pytest.raises(cudafut.InvalidStateError, match="not running"):
        await batcher.submit(1)


def test_an_asyncio_close_ends_with_a_task_whose_done_callback_has_not_run() -> None:
    # A batch task leaves the Batcher's task set from its done callback, which
    # the loop runs later; on Python 3.12 gather() of tasks all done returns
    # without yielding to the loop, and a close that waited for the set to
    # empty spun for ever. A task that ended with no such callback stands for
    # one whose callback is still queued: the close must end all the same.
    async def main() -> None:
        batcher = cudafut.Batcher(_double, max_batch=8, max_delay_s=0)
        await batcher.start()
        assert isinstance(batcher._rt, _loops.AsyncioTasks)
        ended = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        await ended
        batcher._rt.tasks.add(ended)  # done, and no callback will discard it
        await asyncio.wait_for(batcher.aclose(), 10)

    asyncio.run(main())


async def test_start_and_aclose_are_idempotent() -> None:
    batcher = cudafut.Batcher(_double, max_batch=8, max_delay_s=0)
    async with anyio.create_task_group() as tg:  # concurrent starts: one former
        for _ in range(3):
            tg.start_soon(batcher.start)
    assert await batcher.start() is batcher
    assert await batcher.submit(3) == 6
    if isinstance(batcher._rt, _loops.AsyncioTasks):  # one batch former, started once
        assert [getattr(t.get_coro(), "__name__", None) for t in batcher._rt.tasks].count("_form") == 1
    async with anyio.create_task_group() as tg:  # concurrent closes: one close
        for _ in range(3):
            tg.start_soon(batcher.aclose)
    await batcher.aclose()
    with pytest.raises(cudafut.InvalidStateError, match="runs once"):
        await batcher.start()
    with pytest.raises(cudafut.InvalidStateError, match="runs once"):
        async with batcher:
            pass


async def test_aclose_of_a_batcher_never_started_closes_it() -> None:
    batcher = cudafut.Batcher(_double)
    await batcher.aclose()
    await batcher.aclose()
    with pytest.raises(cudafut.InvalidStateError, match="runs once"):
        await batcher.start()


async def test_start_and_a_with_block_do_not_mix() -> None:
    started = await cudafut.Batcher(_double).start()
    with pytest.raises(cudafut.InvalidStateError, match=r"started with start\(\).*aclose"):
        async with started:
            pass
    await started.aclose()
    async with cudafut.Batcher(_double) as in_block:
        with pytest.raises(cudafut.InvalidStateError, match="async with"):
            await in_block.start()
        with pytest.raises(cudafut.InvalidStateError, match="leaving the block closes it"):
            await in_block.aclose()
        assert await in_block.submit(2) == 4


def test_a_started_batcher_whose_loop_ends_says_so_and_closes_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve() -> cudafut.Batcher[int, int]:
        batcher = await cudafut.Batcher(_double).start()
        assert await batcher.submit(1) == 2
        return batcher  # no aclose(): the loop ends with the batcher started

    with caplog.at_level("ERROR", logger="cudafut"):
        batcher = asyncio.run(serve())
    assert any("did its loop end before `await batcher.aclose()`" in r.getMessage() for r in caplog.records)

    async def later() -> None:
        with pytest.raises(cudafut.InvalidStateError, match=r"cancelled \(its loop ended before aclose"):
            await batcher.submit(2)
        await batcher.aclose()  # nothing left to close: no error, from this loop too
        await batcher.aclose()

    asyncio.run(later())


def test_a_started_batcher_whose_trio_run_ends_says_so_and_closes_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trio = pytest.importorskip("trio")

    async def serve() -> cudafut.Batcher[int, int]:
        batcher = await cudafut.Batcher(_double).start()
        assert await batcher.submit(1) == 2
        return batcher

    with caplog.at_level("ERROR", logger="cudafut"):
        batcher = trio.run(serve)
    assert any("did its loop end before `await batcher.aclose()`" in r.getMessage() for r in caplog.records)

    async def later() -> None:
        with pytest.raises(cudafut.InvalidStateError, match=r"cancelled \(its loop ended before aclose"):
            await batcher.submit(2)
        await batcher.aclose()

    trio.run(later)


def test_aclose_after_the_former_was_cancelled_still_waits_for_the_running_batch() -> None:
    finished = []

    async def slow(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)
        finished.append(items)
        return items

    async def main() -> None:
        batcher = await cudafut.Batcher(slow, max_batch=1, max_delay_s=0).start()
        running = asyncio.ensure_future(batcher.submit(1))
        await _until(lambda: batcher.statistics().batches > 0, "the batch never started")
        for task in list(batcher._rt.tasks):
            if task.get_coro().__name__ == "_form":
                task.cancel()
        while batcher._broken is None:  # the former's end is seen
            await asyncio.sleep(0)
        await batcher.aclose()  # the loop still runs: the batch it started ends first
        assert finished == [[1]] and await running == 1

    asyncio.run(main())


def test_start_outside_a_running_loop_says_what_it_needs() -> None:
    coro = cudafut.Batcher(_double).start()
    with pytest.raises(RuntimeError, match=r"start\(\) needs a running asyncio, uvloop or trio loop"):
        coro.send(None)
    coro.close()


@pytest.mark.parametrize("call", ["start", "aclose"])
def test_start_and_aclose_on_another_loops_thread_are_refused(call: str) -> None:
    async def main() -> None:
        batcher = await cudafut.Batcher(_double, max_delay_s=0).start()
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                asyncio.run(getattr(batcher, call)())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert len(errors) == 1 and isinstance(errors[0], cudafut.InvalidStateError), errors
        assert "event loop that started the Batcher" in str(errors[0])
        assert await batcher.submit(5) == 10  # still running, on its own loop
        await batcher.aclose()

    asyncio.run(main())


def test_on_trio_a_started_batcher_never_closed_does_not_keep_the_run_alive() -> None:
    import trio

    async def main() -> cudafut.Batcher[int, int]:
        batcher = await cudafut.Batcher(_double, max_delay_s=0).start()
        assert await batcher.submit(4) == 8
        return batcher  # no aclose(): trio cancels the system task with the run

    batcher = trio.run(main)
    with pytest.raises(cudafut.InvalidStateError):  # and it counts as closed
        trio.run(batcher.submit, 1)


def test_on_trio_aclose_from_another_run_is_refused() -> None:
    import trio

    async def main() -> None:
        batcher = await cudafut.Batcher(_double, max_delay_s=0).start()
        errors: list[BaseException] = []

        def other_run() -> None:
            try:
                trio.run(batcher.aclose)
            except BaseException as exc:
                errors.append(exc)

        await trio.to_thread.run_sync(other_run)
        assert len(errors) == 1 and isinstance(errors[0], cudafut.InvalidStateError), errors
        await batcher.aclose()

    trio.run(main)


async def test_a_plain_run_batch_that_returns_a_coroutine_fails_its_requests(
    fake_cuda: testing.FakeCuda,
) -> None:
    """A plain run_batch runs on a launcher thread, which cannot await what
    it returns: its requests fail with TypeError naming the fix, and the
    coroutine is closed (Python does not warn that it was never awaited);
    on the batch former's launch (asyncio's plain submit) and on the task
    path (trio, and submit_future everywhere)."""
    fake_cuda.auto_complete = True
    made: list[Coroutine[Any, Any, list[int]]] = []

    async def rows(items: list[int]) -> list[int]:
        return items

    def run_batch(items: list[int]) -> Any:
        coro = rows(items)
        made.append(coro)
        return coro

    async with cudafut.Batcher(run_batch, max_batch=1, max_delay_s=0) as batcher:
        with pytest.raises(TypeError, match="plain function"):
            await batcher.submit(1)
        with pytest.raises(TypeError, match="plain function"):
            await batcher.submit_future(2)
    assert len(made) == 2 and all(inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED for coro in made)
