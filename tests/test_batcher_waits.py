"""A plain ``run_batch``'s batches on asyncio: launched by the batch former,
their GPU work waited for off the loop by the device's completion thread,
each batch answered in one loop callback. On the fake GPU, whose events
complete when the test says; no timed assertions (the waits below are
bounded spins or safety limits)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import testing

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition()`` holds (a bounded wait that fails with ``what``)."""
    for _ in range(20_000):
        if condition():
            return
        await asyncio.sleep(0.0005)
    pytest.fail(what)


#: A safety limit on each test's loop, so that a hang fails (pytest's
#: timeout may not interrupt uvloop); never reached when all goes well.
_HANG_S = 60.0


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    """``asyncio.run``, on asyncio in debug mode (which refuses a loop call
    from another thread) or on uvloop."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return lambda coro: uvloop.run(asyncio.wait_for(coro, _HANG_S))
    return lambda coro: asyncio.run(asyncio.wait_for(coro, _HANG_S), debug=True)


def _finish(fake: testing.FakeCuda) -> None:
    """Complete the GPU work recorded so far, and from now on all of it as it
    is recorded: a launch records its future's event after its function
    returns, so a test that saw every batch's function run may still be
    ahead of the last events."""
    fake.auto_complete = True
    fake.complete_all()


def _completion_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cudafut-completion-")]


class _Batches:
    """A plain run_batch whose GPU work the test completes or fails: each
    batch returns a future of its rows (``cudafut.record``, on the launcher's
    stream), kept by its first item."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[list[int]] = []
        self.futures: dict[int, cudafut.CudaFuture[Any]] = {}
        self.raise_for: int | None = None

    def __call__(self, items: list[int]) -> cudafut.CudaFuture[Any]:
        if self.raise_for in items:
            raise ValueError(f"bad batch {items}")
        fut = cudafut.record(np.asarray(items) * 10)
        with self.lock:
            self.seen.append(list(items))
            self.futures[items[0]] = fut
        return fut

    def launched(self) -> int:
        with self.lock:
            return sum(len(batch) for batch in self.seen)

    def batch_of(self, item: int) -> list[int]:
        with self.lock:
            return next(batch for batch in self.seen if item in batch)


def test_batches_are_answered_in_order_by_the_completion_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch, run: Callable[[Any], Any]
) -> None:
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "1")  # one launcher: the futures are set in launch order
    run_batch = _Batches()
    answered: list[int] = []
    stop = threading.Event()

    def gpu() -> None:  # completes the work as it comes, while the completion thread waits on it
        while not stop.wait(0.0002):
            fake_cuda.complete_all()

    async def main() -> list[int]:
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0, max_in_flight=3) as batcher:

            async def one(i: int) -> int:
                out = int(await batcher.submit(i))
                answered.append(i)
                return out

            tasks = [asyncio.ensure_future(one(i)) for i in range(40)]
            for _ in range(3):
                await asyncio.sleep(0)
            assert batcher.statistics().in_flight > 0
            thread = threading.Thread(target=gpu)
            thread.start()
            try:
                results = await asyncio.gather(*tasks)
            finally:
                stop.set()
                thread.join()
        assert batcher.statistics().in_flight == 0
        return results

    assert run(main()) == [i * 10 for i in range(40)]
    assert answered == list(range(40))  # batch after batch, each in its order
    assert [t.name for t in _completion_threads()] == ["cudafut-completion-0"]


@pytest.mark.parametrize("how", ["fault", "raise"])
def test_a_failed_batch_fails_exactly_its_requests(
    fake_cuda: testing.FakeCuda, how: str, run: Callable[[Any], Any]
) -> None:
    run_batch = _Batches()
    if how == "raise":
        run_batch.raise_for = 9
        fake_cuda.auto_complete = True

    async def main() -> tuple[list[Any], cudafut.BatcherStatistics]:
        async with cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0, max_in_flight=8) as batcher:
            tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(10)]
            if how == "fault":
                await _until(lambda: run_batch.launched() == 10, "the batches were never launched")
                # The last batch: nothing later on its stream follows it
                # (a fault fails the work after it there: CUDA's errors are sticky).
                bad = run_batch.batch_of(9)
                fake_cuda.fail(run_batch.futures[bad[0]])  # as a kernel that faulted
                _finish(fake_cuda)
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes, batcher.statistics()

    outcomes, stats = run(main())
    failed = [i for i, out in enumerate(outcomes) if isinstance(out, BaseException)]
    assert 9 in failed and failed in ([8, 9], [9])
    for i, out in enumerate(outcomes):
        if i in failed:
            if how == "fault":
                assert isinstance(out, cudafut.CudaError) and out.code == 700, out
            else:
                assert isinstance(out, ValueError), out
        else:
            assert int(out) == i * 10
    assert (stats.failed_batches, stats.in_flight, stats.items) == (1, 0, 10)


def test_leaving_the_block_waits_for_the_batches_in_flight(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any]
) -> None:
    run_batch = _Batches()

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        async with cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0, max_in_flight=8) as batcher:
            tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(7)]
            await _until(lambda: run_batch.launched() == 7, "the batches were never launched")
            assert batcher.statistics().in_flight == 4
            # The GPU finishes only once the close waits: from another thread.
            loop.call_soon(threading.Thread(target=_finish, args=(fake_cuda,)).start)
        assert batcher.statistics().in_flight == 0  # every batch answered before the close returned
        return [await task for task in tasks]

    assert [int(x) for x in run(main())] == [i * 10 for i in range(7)]


def test_aclose_waits_for_the_batches_in_flight(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any]
) -> None:
    run_batch = _Batches()

    async def main() -> list[Any]:
        batcher = await cudafut.Batcher(run_batch, max_batch=3, max_delay_s=0).start()
        tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(5)]
        await _until(lambda: run_batch.launched() == 5, "the batches were never launched")
        closing = asyncio.ensure_future(batcher.aclose())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not closing.done()  # the GPU work is still pending
        _finish(fake_cuda)
        await closing
        assert batcher.statistics().in_flight == 0  # every batch answered before the close returned
        return [await task for task in tasks]

    assert [int(x) for x in run(main())] == [i * 10 for i in range(5)]


def test_leaving_with_an_exception_answers_the_batches_in_flight_and_frees_the_thread(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any]
) -> None:
    run_batch = _Batches()

    async def main() -> list[Any]:
        batcher = cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0, max_in_flight=8)
        tasks: list[asyncio.Future[Any]] = []
        raised: BaseException | None = None
        try:
            async with batcher:
                tasks += [asyncio.ensure_future(batcher.submit(i)) for i in range(6)]
                await _until(lambda: run_batch.launched() == 6, "the batches were never launched")
                raise ZeroDivisionError
        except ZeroDivisionError as exc:
            raised = exc
        assert raised is not None
        assert batcher.statistics().in_flight == 0
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        # The GPU work ends later: the completion thread's wake-ups find the
        # batches answered, and it serves the next batcher.
        _finish(fake_cuda)
        async with cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0) as again:
            task = asyncio.ensure_future(again.submit(7))
            assert int(await task) == 70
        return outcomes

    outcomes = run(main())
    assert all(isinstance(out, cudafut.InvalidStateError) for out in outcomes), outcomes
    assert len(_completion_threads()) == 1


def test_no_thread_is_left_behind_by_batchers_on_two_devices() -> None:
    before = set(threading.enumerate())

    def run_batch(items: list[int]) -> list[int]:
        return [x + 1 for x in items]

    async def serve(device: int) -> list[int]:
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0, device=device) as batcher:
            return list(await asyncio.gather(*(batcher.submit(i) for i in range(9))))

    with testing.fake_cuda(devices=2, auto_complete=True):
        for _ in range(3):
            for device in (0, 1):
                assert asyncio.run(serve(device)) == [i + 1 for i in range(9)]
    started = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not [t.name for t in started if not t.name.startswith("cudafut-")]
    completion = sorted(t.name for t in _completion_threads())
    assert completion in (["cudafut-completion-0", "cudafut-completion-1"],)
    assert all(t.daemon for t in _completion_threads())


def test_a_loop_closed_with_a_batch_in_flight_leaves_the_completion_thread_serving(
    fake_cuda: testing.FakeCuda,
) -> None:
    run_batch = _Batches()
    left: list[asyncio.Future[Any]] = []

    async def leave_running() -> cudafut.Batcher[int, Any]:
        batcher = await cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0).start()
        left.append(asyncio.ensure_future(batcher.submit(1)))
        await _until(lambda: run_batch.launched() == 1, "the batch was never launched")
        return batcher  # the loop ends with the batch in flight

    asyncio.run(leave_running())
    _finish(fake_cuda)  # its wake-up finds the loop closed

    async def again() -> int:
        async with cudafut.Batcher(run_batch, max_batch=2, max_delay_s=0) as batcher:
            task = asyncio.ensure_future(batcher.submit(2))
            return int(await task)

    assert asyncio.run(again()) == 20


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_its_own_completion_thread(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True

    def run_batch(items: list[int]) -> list[int]:
        return [x * 3 for x in items]

    async def serve() -> list[int]:
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0) as batcher:
            results = asyncio.gather(*(batcher.submit(i) for i in range(6)))
            return list(await asyncio.wait_for(results, 30))  # a safety limit: a hang fails

    assert asyncio.run(serve()) == [i * 3 for i in range(6)]
    assert _completion_threads()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            code = 0 if asyncio.run(serve()) == [i * 3 for i in range(6)] else 3
        except BaseException as exc:  # reported by the exit code
            sys.stderr.write(f"child: {exc!r}\n")
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("raised", [asyncio.CancelledError, SystemExit])
def test_a_base_exception_from_run_batch_answers_the_batch(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any], raised: type[BaseException]
) -> None:
    # Raised on the launcher thread, it fails the launch's future; the loop
    # callback that answers the batch answers it too (a cancellation as
    # InvalidStateError; an interrupt, then on to the loop), or the request
    # and the close would wait for ever.
    fake_cuda.auto_complete = True

    def run_batch(items: list[int]) -> list[int]:
        raise raised("from run_batch")

    batcher = cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0)
    requests: list[asyncio.Future[Any]] = []

    async def main() -> None:
        await batcher.start()
        requests.append(asyncio.ensure_future(batcher.submit(1)))
        with pytest.raises(cudafut.InvalidStateError):
            await requests[0]
        await batcher.aclose()

    if raised is SystemExit:  # it leaves the loop once the batch is answered
        with pytest.raises(SystemExit):
            run(main())
    else:
        run(main())
    assert batcher.statistics().in_flight == 0


def test_two_concurrent_closes_both_return(fake_cuda: testing.FakeCuda, run: Callable[[Any], Any]) -> None:
    batches = _Batches()

    async def main() -> None:
        batcher = cudafut.Batcher(batches, max_batch=4, max_delay_s=0)
        await batcher.start()
        request = asyncio.ensure_future(batcher.submit(1))
        await _until(lambda: batches.launched() == 1, "the batch never launched")
        first = asyncio.ensure_future(batcher.aclose())
        await asyncio.sleep(0.005)
        second = asyncio.ensure_future(batcher.aclose())
        await asyncio.sleep(0.005)
        _finish(fake_cuda)
        await asyncio.gather(first, second)
        assert await request == 10

    run(main())


def test_a_batch_whose_record_the_host_may_fail_is_waited_for_on_the_loop(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any]
) -> None:
    # A record with a confirm (a collective's) may be failed from the host
    # while its event stays pending: the completion thread leaves it to the
    # loop's waiter, which sees the failure, instead of blocking on the event.
    private = fake_cuda.stream()
    held: list[cudafut.CudaFuture[Any]] = []

    def run_batch(items: list[int]) -> cudafut.CudaFuture[Any]:
        with private:
            fut = cudafut.record(np.asarray(items) * 10)
        for rec in cudafut._interface.records_of(fut):
            rec.confirm = lambda: None
        held.append(fut)
        return fut

    async def main() -> None:
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0) as batcher:
            request = asyncio.ensure_future(batcher.submit(1))
            await _until(lambda: bool(held), "the batch never launched")
            for rec in cudafut._interface.records_of(held[0]):
                rec.fail_with(RuntimeError("collective timed out"))
            with pytest.raises(RuntimeError, match="collective timed out"):
                await request
            _finish(fake_cuda)

    run(main())


def test_a_batch_is_answered_where_no_completion_thread_can_start(
    fake_cuda: testing.FakeCuda, run: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudafut import _completions

    def cannot(device: int) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_completions, "_queues", {})
    monkeypatch.setattr(_completions, "_start", cannot)
    fake_cuda.auto_complete = True

    async def main() -> None:
        async with cudafut.Batcher(lambda items: [i * 10 for i in items], max_batch=4, max_delay_s=0) as b:
            assert await b.submit(1) == 10

    run(main())
