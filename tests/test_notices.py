"""Notices (WaitPolicy.notify) on the fake GPU: an asyncio or uvloop waiter
with work of no learnt duration asks CUDA to close a pipe when the work ends
(``_cuda.close_after``), one notice per stream, and sleeps until then; a
failed event, whose notice never comes, is still seen by the fallback poll.
Notices are on by default; ``NOTICES`` says so where a test relies on them,
and some tests turn them off. The bound itself is proved on a fake clock in
tests/test_policy.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import math
import os
import signal
import threading
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _backend, _cuda, _events, _interface, _loops, _notices, _policy, _runtime, testing
from tests.fakes import count_notices
from tests.runners import run_on

LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])

#: Notices on (as by default), said where a test relies on them.
NOTICES = cudafut.WaitPolicy(notify=True)


def _open_fds() -> set[tuple[str, str]]:
    """The process's descriptors and what each is (a pipe's inode too): an
    earlier test's descriptors closed meanwhile do not hide a new one."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


@pytest.fixture(autouse=True)
def _fresh_policy() -> Iterator[None]:
    old = cudafut.set_wait_policy(NOTICES)
    # These are the host function's notices (with a libcuda present, native
    # notice threads would serve instead: tests/test_gpu_notices.py, test_waker.py).
    native = _cuda.set_native_notices(False)
    _policy.predictor.clear()  # a reused stream key must not bring a learnt duration
    yield
    _cuda.set_native_notices(native)
    cudafut.set_wait_policy(old)
    _policy.predictor.clear()


@pytest.fixture
def notices() -> Iterator[tuple[testing.FakeCuda, list[int]]]:
    """The fake GPU, and the descriptors handed to its close_after()."""
    with testing.fake_cuda() as fake, pytest.MonkeyPatch.context() as mp:
        # Patched inside the fake and undone before it goes: the fake's
        # removal puts real CUDA's close_after back.
        yield fake, count_notices(mp)


async def _await_completed_later(fake: testing.FakeCuda, futs: list[Any], after_s: float) -> list[Any]:
    async def finish() -> None:
        await asyncio.sleep(after_s)
        fake.complete(*futs)

    finisher = asyncio.ensure_future(finish())
    values = [await f for f in futs]
    await finisher
    return values


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_an_await_of_unknown_work_asks_for_one_notice_per_stream(
    notices: tuple[testing.FakeCuda, list[int]], loop: str
) -> None:
    fake, handed = notices
    run_on(loop, asyncio.sleep, 0)  # uvloop's first loop opens a pipe it keeps
    before = _open_fds()
    streams = [fake.stream(), fake.stream()]
    futs = [cudafut.record(np.full(2, i), stream=streams[i % 2]) for i in range(6)]
    values = run_on(loop, _await_completed_later, fake, futs, 0.02)
    assert [v[0] for v in values] == [0, 1, 2, 3, 4, 5]
    # A notice for the oldest pending record of a stream serves its later
    # ones: one per stream, never one per await.
    assert 1 <= len(handed) <= 2
    del futs, values
    gc.collect()
    assert not _open_fds() - before, "a notice's pipe was left open"


@pytest.mark.parametrize("loop", LOOPS)
def test_an_await_of_another_processs_work_polls_and_asks_for_no_notice(
    notices: tuple[testing.FakeCuda, list[int]], loop: str
) -> None:
    # A received future's record is keyed as imported (cudafut._shared): the
    # same wait, keyed so, arms no notice and still ends, on timed polls.
    fake, handed = notices
    futs = [cudafut.record(np.full(2, i), stream=fake.stream()) for i in range(3)]
    for i, fut in enumerate(futs):
        for rec in _interface.records_of(fut):
            rec.stream_key = (_events.IMPORTED, 1000 + i)
    values = run_on(loop, _await_completed_later, fake, futs, 0.02)
    assert [v[0] for v in values] == [0, 1, 2]
    assert handed == [], "a record of another process was noticed"


def test_a_lone_await_of_another_processs_work_sleeps_in_its_task(
    notices: tuple[testing.FakeCuda, list[int]],
) -> None:
    # Its wait is never noticed (above), so it is not handed to the driver
    # for a notice: it sleeps in its task, as under notify=False.
    fake, _handed = notices
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    (rec,) = _interface.records_of(fut)
    assert not _loops._sleeps_alone(rec), "unlearnt work of this process is handed over for a notice"
    rec.stream_key = (_events.IMPORTED, 1000)
    assert _loops._sleeps_alone(rec)
    fake.complete(fut)


def _timer_flags(monkeypatch: pytest.MonkeyPatch, method: str) -> list[bool]:
    """From now on, each call of the asyncio driver's ``method`` (``_tick``
    or ``_end_alone``): whether its sleep's timer ended it (False: a notice
    or a new wait did)."""
    flags: list[bool] = []
    original = getattr(_loops.AsyncioDriver, method)

    def recorded(self: Any, timer_fired: bool = False) -> None:
        flags.append(timer_fired)
        original(self, timer_fired)

    monkeypatch.setattr(_loops.AsyncioDriver, method, recorded)
    return flags


def _polls_seen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The asyncio driver's polls from now on: for each, whether its sleep's
    timer ended it (a notice's poll says False)."""
    return _timer_flags(monkeypatch, "_tick")


@pytest.mark.parametrize("loop", LOOPS)
def test_the_notice_not_a_timer_ends_the_sleep(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a fallback poll a second away, a wait that ended on a timer would
    # show as a timer-fired poll: the notice must end it first.
    fake, handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=1.0))
    fired = _polls_seen(monkeypatch)
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    (value,) = run_on(loop, _await_completed_later, fake, [fut], 0.02)
    assert value.sum() == 2
    assert handed, "no notice was armed: the test would prove nothing"
    assert True not in fired, "the sleep ended on its timer, not on the notice"


def _teach(key: tuple[int, ...], duration: float) -> None:
    """Teach the predictor that work on stream ``key`` takes ``duration``:
    six exact observations, all ended before now."""
    base = time.perf_counter() - 10 * duration
    for k in range(6):
        t = base + k * duration
        rec: Any = types.SimpleNamespace(stream_key=key, t=t, seen=t + duration - 1e-6)
        _policy.predictor.observe(rec, t + duration)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_lone_await_of_long_learnt_work_sleeps_until_its_notice(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Work learnt to take 0.5 s on its stream ends after 20 ms: the lone
    # await sleeps in its task toward the spin before the predicted end,
    # under a notice armed for the stream, and the notice, not the timer,
    # ends that sleep (polls max_sleep_s apart would have seen it too,
    # after 20 wake-ups).
    fake, handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, predicted_sleep_s=10.0))
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    (rec,) = _interface.records_of(fut)
    _teach(rec.stream_key, 0.5)
    assert _loops._sleeps_alone(rec)
    ends = _timer_flags(monkeypatch, "_end_alone")
    (value,) = run_on(loop, _await_completed_later, fake, [fut], 0.02)
    assert value.sum() == 2
    assert handed, "no notice covered the predicted work"
    assert ends == [False], f"the lone await's sleeps ended so (True: by the timer): {ends}"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_lone_await_handed_to_the_driver_spins_once(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long spin after a new wait (50 ms): the lone await spins it in its
    # task, then hands the wait to the driver, which asks for a notice and
    # sleeps until it comes. A second spin there, as after a new wait,
    # would poll at every loop iteration for another 50 ms: thousands.
    fake, handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, spin_s=0.05, notice_sleep_s=1.0))
    fired = _polls_seen(monkeypatch)
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    (value,) = run_on(loop, _await_completed_later, fake, [fut], 0.2)
    assert value.sum() == 2
    assert handed, "no notice was armed: the wait was not handed to the driver"
    assert len(fired) < 10, f"the driver polled {len(fired)} times: it spun again"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hold_back_the_parents_notices(
    notices: tuple[testing.FakeCuda, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child inherits the write end of the parent's armed notice; CUDA
    # runs nothing in a child, so unless the child closes its copy, the
    # parent's pipe never reaches end-of-file while the child lives.
    fake, handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=5.0))
    fired = _polls_seen(monkeypatch)
    fut = cudafut.record(np.ones(2), stream=fake.stream())

    async def main() -> Any:
        async def wait() -> Any:
            return await fut

        waiter = asyncio.ensure_future(wait())
        while not handed:  # the notice is armed once the spin after the wait ends
            await asyncio.sleep(0.001)
        pid = os.fork()
        if pid == 0:  # the child: lives on, holding whatever it inherited
            time.sleep(30)
            os._exit(0)
        try:
            fake.complete(fut)
            return await waiter
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    assert asyncio.run(main()).sum() == 2
    assert True not in fired, "the parent's notice was held back by the child"


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "policy",
    [cudafut.WaitPolicy(notify=False), "low_cpu", "low_latency"],
    ids=["notify=False", "low_cpu", "low_latency"],
)
def test_without_notify_the_waiter_polls_on_timers(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, policy: Any
) -> None:
    # notify=False, and the presets that poll on timers only.
    fake, handed = notices
    cudafut.set_wait_policy(policy)
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    (value,) = run_on(loop, _await_completed_later, fake, [fut], 0.01)
    assert value.sum() == 2 and handed == []


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_event_whose_notice_never_comes_is_seen_by_the_fallback_poll(
    notices: tuple[testing.FakeCuda, list[int]], loop: str
) -> None:
    fake, handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=5e-3))
    fut = cudafut.record(np.ones(2), stream=fake.stream())

    async def main() -> None:
        async def fail() -> None:
            await asyncio.sleep(0.01)
            fake.fail(fut, 700)

        failer = asyncio.ensure_future(fail())
        with pytest.raises(cudafut.CudaError):
            await fut
        await failer

    run_on(loop, main)
    assert handed, "no notice was armed: the test would prove nothing"


async def _trio_await_completed_later(fake: testing.FakeCuda, fut: Any, after_s: float) -> Any:
    """``_await_completed_later`` of one future, on trio."""
    import trio

    async def finish() -> None:
        await trio.sleep(after_s)
        fake.complete(fut)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish)
        return await fut


def test_trio_polls_on_timers(notices: tuple[testing.FakeCuda, list[int]]) -> None:
    trio = pytest.importorskip("trio")
    fake, handed = notices
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    assert trio.run(_trio_await_completed_later, fake, fut, 0.01).sum() == 2 and handed == []


def _driver_steps(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """What each loop driver's ``step`` planned from now on (None: nothing
    left to watch; 0.0: poll again at once; else seconds of sleep)."""
    steps: list[float | None] = []
    step = _loops.LoopDriver.step

    def counted(self: Any, timer_fired: bool) -> float | None:
        planned = step(self, timer_fired)
        steps.append(planned)
        return planned

    monkeypatch.setattr(_loops.LoopDriver, "step", counted)
    return steps


def test_a_lone_await_handed_to_the_trio_driver_spins_once(
    notices: tuple[testing.FakeCuda, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on asyncio (above): the lone await spins spin_s (50 ms) in its
    # task and hands the wait to trio's driver, which sleeps on timers at
    # most 20 ms apart. A second spin there would poll at every checkpoint
    # for another 50 ms: thousands of steps.
    trio = pytest.importorskip("trio")
    fake, _handed = notices
    cudafut.set_wait_policy(cudafut.WaitPolicy(spin_s=0.05, max_sleep_s=0.02))
    steps = _driver_steps(monkeypatch)
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    assert trio.run(_trio_await_completed_later, fake, fut, 0.2).sum() == 2
    assert steps, "the wait was never handed to the driver: the test would prove nothing"
    assert len(steps) < 100, f"the driver stepped {len(steps)} times: it spun again"


@pytest.mark.parametrize(
    ("spin_s", "notify"),
    [
        (0.001, True),  # spun, then a sleep plan with a notice: the driver's
        (0.001, False),  # spun, then a sleep plan to take alone, which trio's task cannot
        (0.0, True),  # no spin: the first plan already says sleep, with a notice
    ],
)
def test_the_trio_drivers_first_sleep_after_a_hand_over_is_the_lone_awaits_plan(
    notices: tuple[testing.FakeCuda, list[int]], monkeypatch: pytest.MonkeyPatch, spin_s: float, notify: bool
) -> None:
    # The lone await's plan says sleep first_sleep_s (and steps the
    # back-off to twice that), but it hands the wait over instead of
    # sleeping: the driver must plan that first sleep again, not twice it.
    trio = pytest.importorskip("trio")
    fake, _handed = notices
    policy = cudafut.WaitPolicy(
        spin_s=spin_s, first_sleep_s=0.002, max_sleep_s=0.02, predict=False, notify=notify
    )
    cudafut.set_wait_policy(policy)
    steps = _driver_steps(monkeypatch)
    fut = cudafut.record(np.ones(2), stream=fake.stream())
    assert trio.run(_trio_await_completed_later, fake, fut, 0.05).sum() == 2
    assert steps, "the wait was never handed to the driver: the test would prove nothing"
    assert steps[0] is not None and 0.001 < steps[0] <= 0.002  # not 0.004


def test_real_cuda_without_libcuda_says_so_and_takes_the_descriptor() -> None:
    # No GPU here: the real close_after refuses, and the waiter then polls.
    # It takes the descriptor whatever happens: not launched, it closes it.
    if _notices._load_host_close() is not False:
        pytest.skip("libcuda is loadable here")
    r, w = os.pipe()
    try:
        with pytest.raises(cudafut.CudaUnavailableError, match="cuLaunchHostFunc"):
            _backend.current.close_after(object(), w, 0)
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(w)
    finally:
        os.close(r)


# -- close_after's descriptor, whatever CUDA does (stubs in place of CUDA) ----------------


class _Stub:
    """Stands for the runtime, a stream and a record in ``_cuda.close_after``."""

    device = 0
    handle = 0x1234
    stream_key = (0, 0x99)
    ptr = 0x5678

    class CUDARuntimeError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(f"cudaErrorStub{status}: a stubbed error")
            self.status = status

    def getDevice(self) -> int:  # noqa: N802 - CuPy's name
        return 0

    def setDevice(self, device: int) -> None:  # noqa: N802 - CuPy's name
        pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def stub_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``_cuda.close_after`` against stubs; the list holds what the stub
    launch returns (0 when empty)."""
    results: list[int] = []
    monkeypatch.setattr(_notices, "_host_close", (lambda ptr, fn, fd: results.pop(0) if results else 0, 1))
    monkeypatch.setattr(_runtime, "_rt", _Stub())
    monkeypatch.setattr(_backend.current, "stream_wait", lambda stream, event, device: None)
    for table in ("_notice_pool", "_notice_turn", "_notice_broken", "_notice_made"):
        monkeypatch.setattr(_notices, table, {})
    monkeypatch.setattr(_notices, "_notice_making", set())
    return results


@pytest.mark.parametrize(("code", "closed"), [(1, True), (400, True), (700, False), (999, False)])
def test_a_refused_launch_closes_the_descriptor_only_if_nothing_was_queued(
    stub_cuda: list[int], code: int, closed: bool
) -> None:
    r, w = os.pipe()
    stub_cuda.append(code)
    try:
        with pytest.raises(cudafut.CudaError):
            _backend.current.close_after(_Stub(), w, _Stub.ptr)
        assert _is_open(w) is not closed
    finally:
        os.close(r)
        if _is_open(w):
            os.close(w)


def test_a_launched_notice_leaves_the_descriptor_to_cuda(stub_cuda: list[int]) -> None:
    r, w = os.pipe()
    try:
        _backend.current.close_after(_Stub(), w, _Stub.ptr)
        assert _is_open(w)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("error", [RuntimeError("CUDARuntimeError"), KeyboardInterrupt()])
def test_a_failure_before_the_launch_closes_the_descriptor(
    stub_cuda: list[int], monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    def failing(stream: int, event: int, device: int) -> None:
        raise error

    monkeypatch.setattr(_backend.current, "stream_wait", failing)
    r, w = os.pipe()
    try:
        expected = cudafut.CudaError if isinstance(error, Exception) else type(error)
        with pytest.raises(expected):
            _backend.current.close_after(_Stub(), w, _Stub.ptr)
        assert not _is_open(w)
    finally:
        os.close(r)


# -- notice streams: made off the calling thread (hazard 11) ------------------------------


class _Maker:
    """Stands for ``_notices._new_stream_handle`` and the runtime's stream
    query: new handles, the threads that asked, a gate that holds them (as
    CUDA may, until the GPU is idle), and the handles with a notice queued."""

    CUDARuntimeError = _Stub.CUDARuntimeError

    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []  # (device, handle)
        self.threads: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.busy: set[int] = set()
        self.queried: list[int] = []
        self.free_passes = 0  # creations let through before the gate holds one

    def __call__(self, device: int) -> int:
        self.threads.add(threading.get_ident())
        if self.free_passes > 0:
            self.free_passes -= 1
        else:
            assert self.gate.wait(30), "the test never opened the maker's gate"
        handle = 0x1000 + len(self.made)
        self.made.append((device, handle))
        return handle

    def streamQuery(self, stream: int) -> int:  # noqa: N802 - CuPy's name
        self.queried.append(stream)
        return 600 if stream in self.busy else 0

    def settle(self) -> None:
        """Until no helper is making streams (they finish at once once the
        gate is open)."""
        for _ in range(3000):
            with _notices._notice_lock:
                if not _notices._notice_making:
                    return
            time.sleep(0.001)
        raise AssertionError("a notice-stream helper never finished")

    def first(self, device: int = 0) -> int:
        """The first notice stream of ``device``, its streams made."""
        assert _backend.current.notice_stream(device) is None, "streams were made on the caller's thread"
        self.settle()
        stream = _backend.current.notice_stream(device)
        assert stream is not None
        return stream


def _no_stream(device: int) -> int:
    """A stream creation that CUDA refuses (code 2, out of memory)."""
    raise _cuda.cuda_error(2, device)


@pytest.fixture
def maker(stub_cuda: list[int], monkeypatch: pytest.MonkeyPatch) -> Iterator[_Maker]:
    made = _Maker()
    monkeypatch.setattr(_notices, "_new_stream_handle", made)
    monkeypatch.setattr(_runtime, "_rt", made)
    yield made
    made.gate.set()
    made.settle()


def test_notice_streams_are_made_once_on_a_helper_thread_never_the_callers(maker: _Maker) -> None:
    maker.gate.clear()  # CUDA waits for the GPU to make a stream...
    maker.free_passes = 3  # ...after a few: none is used until all are made
    assert _backend.current.notice_stream(0) is None, "the caller waited for streams to be made"
    for _ in range(100):
        if len(maker.made) == 3:
            break
        time.sleep(0.01)
    assert len(maker.made) == 3
    assert _backend.current.notice_stream(0) is None, "a stream was used before all were made"
    assert not maker.queried, "a stream was queried while streams were being made"
    maker.gate.set()
    maker.settle()
    assert _backend.current.notice_stream(0) is not None
    assert len(maker.made) == _notices._NOTICE_STREAMS_PER_DEVICE
    assert threading.get_ident() not in maker.threads
    for _ in range(3 * _notices._NOTICE_STREAMS_PER_DEVICE):
        _backend.current.notice_stream(0)
    assert len(maker.made) == _notices._NOTICE_STREAMS_PER_DEVICE, "a notice stream was made again"
    maker.first(device=1)
    assert {d for d, _ in maker.made} == {0, 1}, "a device borrowed another's streams"


def test_a_notice_takes_an_idle_stream_never_one_with_a_notice_queued(maker: _Maker) -> None:
    maker.first()
    handles = [h for _, h in maker.made]
    rounds = len(handles) // _notices._NOTICE_TRIES  # calls that try every stream once
    maker.busy.update(handles)
    maker.busy.discard(handles[9])  # notices queued on all but one
    given = [_backend.current.notice_stream(0) for _ in range(rounds)]
    assert [g for g in given if g is not None] == [handles[9]], "a stream with a notice queued was given"
    maker.busy.update(handles)
    assert all(_backend.current.notice_stream(0) is None for _ in range(rounds))
    maker.busy.clear()
    assert _backend.current.notice_stream(0) is not None


def test_a_helper_that_cannot_make_streams_is_a_cuda_error_for_the_caller(
    maker: _Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_notices, "_new_stream_handle", _no_stream)
    assert _backend.current.notice_stream(0) is None
    maker.settle()
    raised = []
    for _ in range(3):
        with pytest.raises(cudafut.CudaError) as info:
            _backend.current.notice_stream(0)
        raised.append(info.value)
    assert {e.code for e in raised} == {2}
    # A new exception each time: one raised again keeps every caller's
    # frames alive through its growing traceback.
    assert len({id(e) for e in raised}) == 3
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in raised}) == 1


def test_a_helper_that_fails_otherwise_logs_the_cause(
    maker: _Maker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(device: int) -> int:
        raise OSError("no more handles")

    monkeypatch.setattr(_notices, "_new_stream_handle", failing)
    with caplog.at_level(logging.WARNING, logger="cudafut"):
        assert _backend.current.notice_stream(0) is None
        maker.settle()
    with pytest.raises(cudafut.CudaError):  # CUDA's "unknown" code: the cause is in the log
        _backend.current.notice_stream(0)
    (logged,) = [r for r in caplog.records if "no notice stream made" in r.getMessage()]
    assert logged.exc_info is not None and isinstance(logged.exc_info[1], OSError)


def test_a_helper_that_made_some_streams_uses_them_and_says_so(
    maker: _Maker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[int] = []

    def two_then_fail(device: int) -> int:
        if len(made) == 2:
            raise _cuda.cuda_error(2, device)
        made.append(0x2000 + len(made))
        return made[-1]

    monkeypatch.setattr(_notices, "_new_stream_handle", two_then_fail)
    with caplog.at_level(logging.WARNING, logger="cudafut"):
        assert _backend.current.notice_stream(0) is None
        maker.settle()
    assert _backend.current.notice_stream(0) in made
    assert any("made 2 of 32 notice streams" in r.getMessage() for r in caplog.records)


def test_prepared_notice_streams_are_made_before_any_notice_asks(maker: _Maker) -> None:
    assert _backend.current.prepare_notices(0, 30.0) is True
    assert len(maker.made) == _notices._NOTICE_STREAMS_PER_DEVICE
    assert threading.get_ident() not in maker.threads, "streams were made on the caller's thread"
    # The first notice takes a stream at once, and nothing is made again.
    assert _backend.current.notice_stream(0) is not None
    assert _backend.current.prepare_notices(0, 30.0) is True
    assert len(maker.made) == _notices._NOTICE_STREAMS_PER_DEVICE


def test_preparing_behind_a_creation_that_waits_gives_up_at_its_timeout(
    maker: _Maker, caplog: pytest.LogCaptureFixture
) -> None:
    maker.gate.clear()  # a creation waiting behind running work
    with caplog.at_level(logging.WARNING, logger="cudafut"):
        assert _backend.current.prepare_notices(0, 0.05) is False
    assert any("notice streams were not made within 0.05 s" in r.getMessage() for r in caplog.records)
    assert _backend.current.notice_stream(0) is None  # still being made: polls meanwhile
    maker.gate.set()
    maker.settle()
    assert _backend.current.prepare_notices(0, 0.0) is True
    assert len(maker.made) == _notices._NOTICE_STREAMS_PER_DEVICE, "a second helper made streams"


def test_preparing_where_no_stream_can_be_made_is_false_never_an_error(
    maker: _Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_notices, "_new_stream_handle", _no_stream)
    assert _backend.current.prepare_notices(0, 30.0) is False
    assert _backend.current.prepare_notices(0, 30.0) is False
    with pytest.raises(cudafut.CudaError):
        _backend.current.notice_stream(0)


def test_preparing_where_no_helper_thread_can_start_is_false_never_an_error(
    maker: _Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = threading.Thread.start

    def refused(thread: threading.Thread) -> None:
        if thread.name == "cudafut-notice-streams":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert _backend.current.prepare_notices(0, 30.0) is False
    assert not _notices._notice_making, "a helper that never started counts as running"
    monkeypatch.setattr(threading.Thread, "start", start)  # threads again: the next call makes them
    assert _backend.current.prepare_notices(0, 30.0) is True


def test_preparing_without_a_time_limit_waits_for_the_streams(maker: _Maker) -> None:
    assert _backend.current.prepare_notices(0, math.inf) is True


class _DriverCalls:
    """Stands for the driver entry points ``_new_stream_handle`` calls, in
    their order; ``failing`` names one that returns ``code``."""

    NAMES = ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
             "cuCtxPopCurrent_v2", "cuStreamCreateWithPriority")  # fmt: skip

    def __init__(self, failing: str = "", code: int = 0) -> None:
        self.called: list[str] = []
        self.failing, self.code = failing, code

    def entry(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.called.append(name)
            return self.code if name == self.failing else 0

        return call

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_notices, "_stream_calls", tuple(self.entry(n) for n in self.NAMES))
        monkeypatch.setattr(_notices, "_notice_event_create", None)


def test_a_notice_stream_is_made_with_the_driver_initialised_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # prepare_notices may be the process's first CUDA call, and the driver
    # refuses every call before cuInit.
    calls = _DriverCalls()
    calls.install(monkeypatch)
    _notices._new_stream_handle(0)
    assert calls.called[0] == "cuInit"
    assert calls.called[-2:] == ["cuStreamCreateWithPriority", "cuCtxPopCurrent_v2"]


def test_a_driver_that_cannot_start_is_a_cuda_error_before_any_other_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _DriverCalls("cuInit", 100)  # CUDA_ERROR_NO_DEVICE
    calls.install(monkeypatch)
    with pytest.raises(cudafut.CudaError) as info:
        _notices._new_stream_handle(0)
    assert info.value.code == 100
    assert calls.called == ["cuInit"]


def test_a_new_process_group_prepares_its_devices_notice_streams() -> None:
    from cudafut.distributed import _group

    asked: list[tuple[int, float]] = []

    def prepare(device: int, timeout: float) -> bool:
        asked.append((device, timeout))
        return True

    with testing.fake_cuda(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backend.current, "prepare_notices", prepare)
        _group.ProcessGroup(object(), 0, [0], 0, 5.0, "test")
        assert asked == [(0, _backend.PREPARE_NOTICES_S)]
        _group.ProcessGroup(object(), 0, [0], 0, 5.0, "test", stream=object())  # a test's own stream
        assert len(asked) == 1


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("failing", ["close_after", "notice_stream"])
def test_a_waiter_whose_notice_fails_polls_and_stops_asking(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, _handed = notices
    attempts: list[object] = []

    def refusing(record: Any, fd: int, stream: int) -> None:
        attempts.append(fd)
        os.close(fd)  # as close_after does when nothing was launched
        raise cudafut.CudaError(1, "cudaErrorInvalidValue", "refused", 0)

    def no_stream(device: int) -> int:
        attempts.append(device)
        raise cudafut.CudaError(2, "cudaErrorMemoryAllocation", "no stream", device)

    monkeypatch.setattr(_backend.current, failing, refusing if failing == "close_after" else no_stream)
    futs = [cudafut.record(np.full(2, i), stream=fake.stream()) for i in range(3)]
    values = run_on(loop, _await_completed_later, fake, futs, 0.02)
    assert [v[0] for v in values] == [0, 1, 2]
    assert len(attempts) == 1, "a waiter kept asking for notices that fail"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_waiter_polls_until_its_notice_stream_is_made_then_uses_notices(
    notices: tuple[testing.FakeCuda, list[int]], loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, handed = notices
    asked: list[int] = []
    real = _backend.current.notice_stream

    def not_yet(device: int) -> int | None:
        asked.append(device)
        return None if len(asked) <= 2 else real(device)

    monkeypatch.setattr(_backend.current, "notice_stream", not_yet)
    futs = [cudafut.record(np.full(2, i), stream=fake.stream()) for i in range(3)]
    values = run_on(loop, _await_completed_later, fake, futs, 0.05)
    assert [v[0] for v in values] == [0, 1, 2]
    assert len(asked) >= 3, "a waiter stopped asking while its notice stream was being made"
    assert handed, "no notice once the stream was made"


def test_a_stale_timer_callback_after_a_notice_does_not_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # The notice and the timer become ready in one loop iteration: the
    # notice re-plans (and re-arms the timer); the timer's callback, already
    # due, must find no expiry and not poll.
    async def main() -> list[bool]:
        driver = _loops.require_driver()
        assert isinstance(driver, _loops.AsyncioDriver)
        ticks: list[bool] = []
        monkeypatch.setattr(driver, "_tick", lambda timer_fired=False: ticks.append(timer_fired))
        timer = driver._timer
        if timer is None:
            pytest.skip("no timerfd here")
        driver._mode = _loops._SLEEP
        timer.arm(10.0)  # re-armed: nothing expired
        driver._on_timer()
        timer.arm(1e-9)
        await asyncio.sleep(0.01)
        driver._on_timer()
        timer.disarm()
        driver._mode = _loops._IDLE
        return ticks

    assert asyncio.run(main()) == [True]
