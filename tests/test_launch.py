"""launch()'s host logic on the fake CUDA (cudafut.testing): launcher
threads, their streams, cancellation and failures. GPU ordering is proved in
tests/test_gpu_serve.py."""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _backend, _events, _future, _interface, _launch, _lifetimes, _torch, testing
from tests.launches import check_a_queued_launch_cancelled_never_runs
from tests.runners import BACKENDS, run_on


def test_a_stream_cuda_refuses_fails_the_launch_and_kills_no_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    real = _backend.current.new_stream

    def refuse(device: int, priority: int) -> Any:
        raise cudafut.CudaError(2, "cudaErrorMemoryAllocation", "out of memory")

    monkeypatch.setattr(_backend.current, "new_stream", refuse)
    with pytest.raises(cudafut.CudaError, match="cudaErrorMemoryAllocation"):
        cudafut.launch(np.arange, 3)
    monkeypatch.setattr(_backend.current, "new_stream", real)
    assert cudafut.launch(np.arange, 3).result(timeout=10).tolist() == [0, 1, 2]


def test_fn_runs_on_a_launcher_thread_and_keeps_its_exception_type(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    names = cudafut.launch(lambda: threading.current_thread().name).result(timeout=10)
    assert names.startswith("cudafut-launcher-0-")

    class OddError(Exception):
        pass

    error = OddError("odd")

    def boom() -> None:
        raise error

    with pytest.raises(OddError) as info:
        cudafut.launch(boom).result(timeout=10)
    assert info.value is error


def test_a_launch_cancelled_before_it_starts_never_runs(
    fake_cuda: testing.FakeCuda,
) -> None:
    fake_cuda.auto_complete = True
    check_a_queued_launch_cancelled_never_runs(timeout=10)


def test_a_launch_cancelled_while_fn_runs_keeps_its_arguments_until_its_stream_passes(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[object] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: held.append(obj))
    inside = threading.Event()
    release = threading.Event()

    def slow(arg: object) -> int:
        inside.set()
        release.wait(10)
        return 1

    arg = object()
    fut = cudafut.launch(slow, arg)
    assert inside.wait(10)
    assert fut.cancel()
    release.set()
    for _ in range(200):
        if held:
            break
        threading.Event().wait(0.01)
    assert held and held[0] == ((arg,), {})


def test_a_coroutine_function_is_refused_before_anything_is_enqueued(fake_cuda: testing.FakeCuda) -> None:
    async def model(x: int) -> int:
        return x

    for fn in (model, functools.partial(model, 1)):
        with pytest.raises(TypeError, match=r"coroutine function \(async def\).*plain function"):
            cudafut.launch(fn, 1)
    assert fake_cuda.pending == 0  # not even the caller's event was recorded


def test_an_awaitable_returned_fails_the_future_and_the_coroutine_is_closed(
    fake_cuda: testing.FakeCuda,
) -> None:
    fake_cuda.auto_complete = True

    async def model() -> int:
        return 1

    made: list[Any] = []

    def returns_a_coroutine() -> Any:
        made.append(model())
        return made[-1]

    with pytest.raises(TypeError, match=r"returned an awaitable \(coroutine\).*plain function"):
        cudafut.launch(returns_a_coroutine).result(timeout=10)
    # Closed unrun: Python will not warn that it was never awaited.
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED
    assert cudafut.launch(np.arange, 2).result(timeout=10).tolist() == [0, 1]  # the launcher lives on


# -- warm_launchers ----------------------------------------------------------------------


def _where() -> tuple[str, int]:
    """The launcher thread this runs on, and the current stream there."""
    return threading.current_thread().name, int(_backend.current.current_stream(0).ptr)


def test_warm_launchers_runs_fn_once_on_each_launcher_thread_with_its_stream_current(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "3")  # read as the fake's launchers start, here
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def warm(tag: str, *, scale: int) -> int:
        assert (tag, scale) == ("x", 2)
        with lock:
            seen.append(_where())
        return scale

    fut = cudafut.warm_launchers(warm, "x", scale=2)
    assert fut.result(timeout=10) is None
    launchers = _launch._launchers[0]
    assert launchers is not None
    want = {(t.name, int(s.ptr)) for t, s in zip(launchers.threads, launchers.streams, strict=True)}
    assert len(want) == 3
    for _ in range(6):  # launches after it: no thread runs warm again
        cudafut.launch(lambda: 0).result(timeout=10)
    assert sorted(seen) == sorted(want)


def test_warm_launchers_makes_the_devices_notice_streams_before_fn_on_a_launcher_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "2")
    order: list[tuple[str, str]] = []
    lock = threading.Lock()

    def prepare(device: int, timeout: float) -> bool:
        assert (device, timeout) == (0, _backend.PREPARE_NOTICES_S)
        with lock:
            order.append(("prepare", threading.current_thread().name))
        return True

    def warm() -> None:
        with lock:
            order.append(("fn", threading.current_thread().name))

    monkeypatch.setattr(_backend.current, "prepare_notices", prepare)
    cudafut.warm_launchers(warm).result(timeout=10)
    threads = {name for _, name in order}
    assert len(threads) == 2 and threading.current_thread().name not in threads
    for name in threads:  # on each thread, the streams before fn
        assert [what for what, n in order if n == name] == ["prepare", "fn"]


def test_warm_launchers_runs_fn_where_preparing_the_notices_fails(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A launcher thread never dies of it: the future would never be set.
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "2")
    ran: list[str] = []

    def prepare(device: int, timeout: float) -> bool:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_backend.current, "prepare_notices", prepare)
    cudafut.warm_launchers(lambda: ran.append(threading.current_thread().name)).result(timeout=10)
    assert len(set(ran)) == 2
    assert cudafut.launch(lambda: 7).result(timeout=10) == 7  # the threads still serve


def test_warm_launchers_starts_the_launchers_and_waits_for_each_threads_gpu_work(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "2")
    assert not _launch._launchers  # the fake starts with none
    fut = cudafut.warm_launchers(lambda: None)
    for _ in range(200):
        if fut._state is not _future_pending():  # set once both threads ran fn
            break
        threading.Event().wait(0.01)
    assert not fut.done()  # set, but the events of the threads' work are pending
    assert len(_interface.records_of(fut)) >= 2  # one per thread's stream at least
    fake_cuda.complete_all()
    assert fut.result(timeout=10) is None


def _future_pending() -> object:
    return _future._PENDING


def test_a_busy_launcher_thread_delays_only_its_own_warm_up(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "3")
    cudafut.launch(lambda: 0).result(timeout=10)  # the launchers exist
    inside = threading.Event()
    release = threading.Event()

    def hold() -> str:
        inside.set()
        release.wait(10)
        return threading.current_thread().name

    busy = cudafut.launch(hold)
    assert inside.wait(10)
    ran: list[str] = []
    fut = cudafut.warm_launchers(lambda: ran.append(threading.current_thread().name))
    for _ in range(500):  # the two idle threads run it now
        if len(ran) == 2:
            break
        threading.Event().wait(0.01)
    assert len(ran) == 2 and not fut.done()
    # Launches still run meanwhile, on the idle threads.
    for _ in range(10):
        assert cudafut.launch(lambda: 7).result(timeout=10) == 7
    release.set()
    name = busy.result(timeout=10)
    assert fut.result(timeout=10) is None
    assert sorted(ran) == sorted(t.name for t in _launch._launchers[0].threads)  # type: ignore[union-attr]
    assert name not in ran[:2]


def test_warm_launchers_reaches_every_thread_however_the_copies_fall(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All threads asleep on the queue, one of them fast to take both
    copies: each warm-up still reaches every thread (many times, to meet
    the races)."""
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "4")
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count() -> None:
        with lock:
            name = threading.current_thread().name
            counts[name] = counts.get(name, 0) + 1

    rounds = 200
    for i in range(rounds):
        futs: list[cudafut.CudaFuture[Any]] = [cudafut.warm_launchers(count) for _ in range(1 + i % 3)]
        if i % 5 == 0:
            futs.append(cudafut.launch(lambda: 0))
        for fut in futs:
            fut.result(timeout=10)
    runs = sum(1 + i % 3 for i in range(rounds))
    assert len(counts) == 4
    assert set(counts.values()) == {runs}


def test_warm_launchers_fails_with_fns_first_exception_and_every_thread_lives_on(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    monkeypatch.setenv("CUDAFUT_LAUNCH_THREADS", "2")

    class WarmError(Exception):
        pass

    errors = [WarmError("a"), WarmError("b")]
    lock = threading.Lock()

    def boom() -> None:
        with lock:
            error = errors.pop()
        raise error

    with pytest.raises(WarmError, match=r"^[ab]$"):
        cudafut.warm_launchers(boom).result(timeout=10)
    assert errors == []  # failed once both threads ran it
    ran: list[str] = []
    cudafut.warm_launchers(lambda: ran.append(threading.current_thread().name)).result(timeout=10)
    assert len(set(ran)) == 2


def test_warm_launchers_refuses_bad_arguments_before_anything_is_enqueued(
    fake_cuda: testing.FakeCuda,
) -> None:
    async def model(x: int) -> int:
        return x

    with pytest.raises(TypeError, match=r"warm_launchers\(\) needs a callable"):
        cudafut.warm_launchers(42)  # type: ignore[arg-type]
    for fn in (model, functools.partial(model, 1)):
        with pytest.raises(TypeError, match=r"warm_launchers\(\) runs fn.*coroutine function \(async def\)"):
            cudafut.warm_launchers(fn, 1)
    with pytest.raises(ValueError, match="99"):
        cudafut.warm_launchers(lambda: 0, device=99)
    with pytest.raises(TypeError, match="device"):
        cudafut.warm_launchers(lambda: 0, device="0")  # type: ignore[arg-type]
    assert fake_cuda.pending == 0  # not even the caller's event was recorded
    assert not _launch._launchers  # nor a launcher started


async def _warm_from_a_loop(release: threading.Event) -> tuple[float, int]:
    """warm_launchers() while its fn blocks: the call returns at once and the
    loop's other tasks go on; the future is awaited without blocking."""
    ticks = [0]
    stop = [False]

    async def ticker() -> None:
        while not stop[0]:
            ticks[0] += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        t0 = time.perf_counter()
        fut = cudafut.warm_launchers(release.wait, 10)
        took = time.perf_counter() - t0
        before = ticks[0]
        await anyio.sleep(0.05)
        assert ticks[0] > before  # the loop ran while fn blocked its threads
        release.set()
        await fut
        stop[0] = True
    return took, ticks[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_warm_launchers_from_a_loop_blocks_nothing(fake_cuda: testing.FakeCuda, backend: str) -> None:
    fake_cuda.auto_complete = True
    cudafut.launch(lambda: 0).result(timeout=10)  # the launchers exist: the call is only puts
    took, ticks = run_on(backend, _warm_from_a_loop, threading.Event())
    assert took < 0.05
    assert ticks > 1


# -- the caller's events, recorded by the launcher thread ------------------------------------


def _spy_records(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Each ``_events.record`` call from here on: (stream handle, thread name)."""
    seen: list[tuple[int, str]] = []
    real = _events.record

    def spy(stream: int, device: int, confirm: Any = None, owner: object = None) -> Any:
        seen.append((stream, threading.current_thread().name))
        return real(stream, device, confirm, owner)

    monkeypatch.setattr(_events, "record", spy)
    return seen


def test_launch_records_the_callers_stream_on_a_launcher_thread_and_follows_it(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch() itself records nothing (a record on the calling thread
    releases the GIL there: benchmarks/stalls.py); the launcher thread
    records the caller's stream, and the launched work follows what the
    caller enqueued there before launch()."""
    seen = _spy_records(monkeypatch)
    caller = fake_cuda.stream()
    with caller:
        before = cudafut.record(np.zeros(3), stream=caller)  # the caller's work, pending
        seen.clear()
        fut = cudafut.launch(np.arange, 3)
        assert seen == []
    fake_cuda.complete(fut)  # its events and every event they follow
    assert fut.result(timeout=10).tolist() == [0, 1, 2]
    assert before.done()  # followed by the launched work, so completed with it
    on_caller = [name for stream, name in seen if stream == caller.ptr]
    assert len(on_caller) == 1 and on_caller[0].startswith("cudafut-launcher-0-")


def test_launch_from_a_per_thread_default_stream_records_it_on_the_calling_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cudaStreamPerThread names the calling thread's own stream: a launcher
    thread recording on that handle would record on its own, so the caller
    records it, as before."""
    fake_cuda.auto_complete = True
    cudafut.launch(np.arange, 1).result(timeout=10)  # the launchers started
    seen = _spy_records(monkeypatch)
    here = threading.get_ident()
    real = _backend.current.current_stream
    per_thread = testing.FakeStream.__new__(testing.FakeStream)
    per_thread.ptr, per_thread.device_id = 2, 0
    monkeypatch.setattr(
        _backend.current,
        "current_stream",
        lambda device: per_thread if threading.get_ident() == here else real(device),
    )
    fut = cudafut.launch(np.arange, 3)
    assert seen == [(2, threading.current_thread().name)]
    assert fut.result(timeout=10).tolist() == [0, 1, 2]
    assert all(stream != 2 for stream, _ in seen[1:])


# -- the caller's path ------------------------------------------------------------------


@pytest.mark.parametrize("callers", [2, 8])
def test_many_threads_launching_at_once_lose_no_launch(fake_cuda: testing.FakeCuda, callers: int) -> None:
    """The hand-off under contention: threads released together each launch
    a run of calls; every launch runs once, with its own arguments, and its
    future gets its own value."""
    fake_cuda.auto_complete = True
    each = 300
    start = threading.Barrier(callers)
    ran: list[tuple[int, int]] = []
    futures: list[list[cudafut.CudaFuture[tuple[int, int]]]] = [[] for _ in range(callers)]

    def fn(who: int, i: int, *, scale: int) -> tuple[int, int]:
        ran.append((who, i))
        return who, i * scale

    def caller(who: int) -> None:
        start.wait()
        for i in range(each):
            futures[who].append(cudafut.launch(fn, who, i, scale=2))

    threads = [threading.Thread(target=caller, args=(who,)) for who in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for who, mine in enumerate(futures):
        assert [fut.result(timeout=30) for fut in mine] == [(who, 2 * i) for i in range(each)]
    assert sorted(ran) == [(who, i) for who in range(callers) for i in range(each)]


def test_stop_runs_every_launch_queued_before_it(fake_cuda: testing.FakeCuda) -> None:
    """Launches queued from several threads while every launcher thread is
    busy: stop() ends the threads only once each queued launch has run."""
    fake_cuda.auto_complete = True
    cudafut.launch(lambda: 0).result(timeout=10)  # the launchers exist
    threads = len(_launch._launchers[0].threads)  # type: ignore[union-attr]
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> int:
        started.release()
        release.wait(10)
        return 0

    holders = [cudafut.launch(hold) for _ in range(threads)]
    for _ in range(threads):
        assert started.acquire(timeout=10)  # every launcher is busy: the rest waits in the queue
    queued: list[cudafut.CudaFuture[int]] = []
    lock = threading.Lock()

    def caller(who: int) -> None:
        mine = [cudafut.launch(int, who * 100 + i) for i in range(100)]
        with lock:
            queued.extend(mine)

    callers = [threading.Thread(target=caller, args=(who,)) for who in range(4)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    release.set()
    assert _launch.stop(0, timeout=30)
    assert all(fut.done() for fut in holders + queued)
    assert sorted(fut.result(timeout=0) for fut in queued) == list(range(400))


def test_new_pending_makes_the_future_the_constructor_makes(fake_cuda: testing.FakeCuda) -> None:
    """launch()'s future comes from _future.new_pending (the native core's
    factory, which skips __init__, or the class itself in the pure core):
    the same state, field by field, as CudaFuture() gives."""
    made, plain = _future.new_pending(), cudafut.CudaFuture[Any]()
    assert type(made) is cudafut.CudaFuture and not made.done()
    fields = [name for name in _future.CudaFuture.__init__.__code__.co_names if name.startswith("_")]
    assert {"_lock", "_state", "_records", "_devices", "_callbacks", "_stream_given"} <= set(fields)
    for name in fields:
        if hasattr(plain, name):
            if name == "_lock":
                assert type(made._lock) is type(plain._lock) and made._lock is not plain._lock
                assert not made._lock.locked()
            else:
                assert getattr(made, name) == getattr(plain, name), name
    made.set_result(np.arange(2))
    fake_cuda.complete(made)
    assert made.result(timeout=10).tolist() == [0, 1]


class _TorchStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def test_the_callers_streams_match_the_twins(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_launch._caller_streams (the native core's where it runs) gives what
    the pure twin gives: the default stream, a stream made current, and
    PyTorch's current stream where torch is loaded (and another)."""

    def both() -> tuple[Any, Any]:
        return _launch._caller_streams(0), _launch._caller_streams_py(0)

    native, twin = both()
    assert native == twin and len(native) == 1
    stream = fake_cuda.stream()
    with stream:
        native, twin = both()
        assert native == twin == ((stream.ptr, stream, stream),)
        torch_stream = _TorchStream(0x7000)
        torch = type("torch", (), {"cuda": type("cuda", (), {"current_stream": lambda device: torch_stream})})
        monkeypatch.setattr(_torch, "loaded", lambda: torch)
        monkeypatch.setitem(sys.modules, "torch", torch)
        native, twin = both()
        assert native == twin == ((stream.ptr, stream, stream), (0x7000, None, torch_stream))
        torch_stream.cuda_stream = stream.ptr  # the same stream: once
        native, twin = both()
        assert native == twin == ((stream.ptr, stream, stream),)
