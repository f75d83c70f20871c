"""Edges of the native core's paths, on the fake GPU: a future's lazily made
lock under racing threads; an await in a loop run nested inside another, and
in a forked child's loop (each waits in its own loop); a plain Batcher
batch's order after what the loop enqueued on its current streams."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _loops, testing


async def _await(fut: cudafut.CudaFuture[Any]) -> Any:
    return await fut


async def _until_pending(n: int) -> Any:
    driver = _loops.current_driver()
    assert driver is not None
    for _ in range(100_000):
        if driver.watchlist.pending >= n:
            return driver
        await asyncio.sleep(0)
    raise AssertionError("never pending")


def _race_one_future(fake_cuda: testing.FakeCuda, nthreads: int) -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    calls: list[int] = []
    children: list[Any] = []
    locks: list[Any] = []
    barrier = threading.Barrier(nthreads + 1)

    def work(i: int) -> None:
        barrier.wait()
        locks.append(fut._lock)

        def done(_: object, i: int = i) -> None:
            calls.append(i)

        fut.add_done_callback(done)
        children.append(fut.then(lambda v: v + 1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    barrier.wait()
    fut.set_result(1)
    for t in threads:
        t.join()
    fake_cuda.complete_all()
    assert len({id(lock) for lock in locks}) == 1
    assert [c.result(timeout=10) for c in children] == [2] * nthreads
    fut.result(timeout=10)
    deadline = time.monotonic() + 10
    while len(calls) < nthreads and time.monotonic() < deadline:
        time.sleep(1e-3)
    time.sleep(1e-3)
    assert sorted(calls) == list(range(nthreads))


def test_racing_threads_share_one_lazy_lock_and_lose_no_callback(fake_cuda: testing.FakeCuda) -> None:
    """Many threads add callbacks, then() children and results to fresh
    futures at once: every callback runs once, every child resolves."""
    for _ in range(300):
        _race_one_future(fake_cuda, 8)


def test_an_await_in_a_loop_run_nested_in_another_waits_in_its_own_loop(fake_cuda: testing.FakeCuda) -> None:
    """A loop run inside another loop's task (as nest_asyncio, IPython and
    sync-over-async helpers do, the outer loop's running mark cleared
    meanwhile): the outer loop's _thread_id is still this thread's ident,
    but it is not the running loop. An await in the inner loop, while the
    outer loop has awaits pending, must wait in the inner loop."""

    async def inner() -> Any:
        # another wait in the inner loop first (so that this await is one among others there too)
        return await cudafut.record("inner")

    async def outer() -> Any:
        a = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(_await(cudafut.record(i))) for i in range(3)]
        await _until_pending(2)
        b = asyncio.new_event_loop()
        asyncio.events._set_running_loop(None)
        try:
            b.call_later(0.02, fake_cuda.complete_all)
            got = b.run_until_complete(inner())
        finally:
            asyncio.events._set_running_loop(a)
            b.close()
        fake_cuda.complete_all()
        return got, await asyncio.gather(*tasks)

    assert asyncio.run(outer()) == ("inner", [0, 1, 2])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_an_await_in_a_forked_child_waits_in_the_childs_loop(fake_cuda: testing.FakeCuda) -> None:
    """A child forked while a loop had awaits pending (the fake GPU: no
    CUDA in the parent, so the child is not marked forked) runs its own
    loop: the parent's loop object still reads the forking thread's ident,
    which the child's thread has too."""

    async def child_main() -> Any:
        return await cudafut.record("child")

    async def outer() -> int:
        tasks = [asyncio.ensure_future(_await(cudafut.record(i))) for i in range(3)]
        await _until_pending(2)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                asyncio.events._set_running_loop(None)  # (3.12+ does it at fork)

                async def main() -> Any:
                    asyncio.get_running_loop().call_later(0.02, fake_cuda.complete_all)
                    return await child_main()

                code = 0 if asyncio.run(main()) == "child" else 3
            except BaseException as exc:
                sys.stderr.write(f"child: {exc!r}\n")
                code = 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        fake_cuda.complete_all()
        await asyncio.gather(*tasks)
        return os.waitstatus_to_exitcode(status)

    assert asyncio.run(outer()) == 0


def test_a_plain_batch_follows_what_the_loop_enqueued_on_its_current_stream(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c6e2d48: a plain run_batch's launcher records the loop's current
    stream when it takes the job (as launch()), and the batch follows it."""
    from cudafut import _batcher, _events
    from cudafut._interface import until_set

    seen: list[tuple[int, str]] = []
    real_record = _events.record

    def spy(stream: int, device: int, confirm: Any = None, owner: object = None) -> Any:
        seen.append((stream, threading.current_thread().name))
        return real_record(stream, device, confirm, owner)

    launched: list[Any] = []
    real_enqueue = _batcher.enqueue_as_caller  # type: ignore[attr-defined]

    def capture(*args: Any) -> Any:
        fut = real_enqueue(*args)
        launched.append(fut)
        return fut

    monkeypatch.setattr(_batcher, "enqueue_as_caller", capture)
    caller = fake_cuda.stream()

    def run_batch(items: list[int]) -> Any:
        return np.asarray(items) + 1

    async def main() -> Any:
        with caller:
            before = cudafut.record(np.zeros(3), stream=caller)  # the loop's work, pending
            monkeypatch.setattr(_events, "record", spy)
            async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.001) as batcher:
                task = asyncio.ensure_future(batcher.submit(5))
                while not launched:
                    await asyncio.sleep(1e-3)
                await asyncio.wait_for(until_set(launched[0]), 10)  # set (its events pending)
                fake_cuda.complete(launched[0])  # its events and every event they follow
                got = await asyncio.wait_for(task, 10)
            return got, before.done()

    got, followed = asyncio.run(main())
    assert int(got) == 6
    assert followed
    on_caller = [name for stream, name in seen if stream == caller.ptr]
    assert len(on_caller) == 1 and on_caller[0].startswith("cudafut-launcher-0-")


def test_a_plain_batch_from_a_per_thread_default_stream_records_it_on_the_loops_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c6e2d48: as launch(), cudaStreamPerThread is recorded by the loop's
    thread (a launcher recording that handle would record its own stream)."""
    from cudafut import _backend, _events

    fake_cuda.auto_complete = True
    cudafut.launch(np.arange, 1).result(timeout=10)  # the launchers started
    seen: list[tuple[int, str]] = []
    real_record = _events.record

    def spy(stream: int, device: int, confirm: Any = None, owner: object = None) -> Any:
        seen.append((stream, threading.current_thread().name))
        return real_record(stream, device, confirm, owner)

    here = threading.get_ident()
    real = _backend.current.current_stream
    per_thread = testing.FakeStream.__new__(testing.FakeStream)
    per_thread.ptr, per_thread.device_id = 2, 0

    def run_batch(items: list[int]) -> Any:
        return np.asarray(items) + 1

    async def main() -> Any:
        async with cudafut.Batcher(run_batch, max_batch=4, max_delay_s=0.001, device=0) as batcher:
            monkeypatch.setattr(_events, "record", spy)
            monkeypatch.setattr(
                _backend.current,
                "current_stream",
                lambda device: per_thread if threading.get_ident() == here else real(device),
            )
            return await asyncio.wait_for(batcher.submit(5), 10)

    assert int(asyncio.run(main())) == 6
    on_per_thread = [name for stream, name in seen if stream == 2]
    assert on_per_thread == [threading.current_thread().name]
