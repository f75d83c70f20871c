"""The wait policy, the duration predictor, the pacer and the timer (host side)."""

from __future__ import annotations

import gc
import math
import select
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

import cudafut
from cudafut import _policy, _timer, _waiter
from cudafut._policy import Pacer, Predictor, WaitPolicy
from tests.fakes import FakeRecord, stream_records


@pytest.fixture(autouse=True)
def _default_policy() -> Iterator[None]:
    old = cudafut.set_wait_policy("balanced")
    _policy.predictor.clear()
    yield
    cudafut.set_wait_policy(old)
    _policy.predictor.clear()


# -- WaitPolicy and set_wait_policy --------------------------------------------


def test_presets_and_return_of_the_previous_policy() -> None:
    assert cudafut.get_wait_policy() == WaitPolicy()
    old = cudafut.set_wait_policy("low_latency")
    assert old == WaitPolicy()
    assert cudafut.get_wait_policy().spin_s == math.inf
    custom = WaitPolicy(spin_s=0, cpu_budget=0.2)
    assert cudafut.set_wait_policy(custom).spin_s == math.inf
    assert cudafut.get_wait_policy() is custom


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"spin_s": -1}, ValueError, "spin_s must not be negative"),
        ({"spin_s": math.nan}, TypeError, "spin_s must be a number"),
        ({"cpu_budget": "0.1"}, TypeError, "cpu_budget must be a number"),
        ({"cpu_budget": True}, TypeError, "cpu_budget must be a number"),
        ({"cpu_budget": 1.5}, ValueError, "share of the wait"),
        ({"first_sleep_s": 0}, ValueError, "0 < first_sleep_s <= max_sleep_s"),
        ({"first_sleep_s": 2e-3, "max_sleep_s": 1e-3}, ValueError, "first_sleep_s <= max_sleep_s"),
        ({"max_sleep_s": math.inf}, ValueError, "max_sleep_s < inf"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        WaitPolicy(**kwargs)  # type: ignore[arg-type]


def test_set_wait_policy_refuses_unknown_names_and_types() -> None:
    with pytest.raises(ValueError, match=r"unknown wait policy 'fast'.*balanced"):
        cudafut.set_wait_policy("fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a WaitPolicy or a preset name"):
        cudafut.set_wait_policy(0.1)  # type: ignore[arg-type]
    assert cudafut.get_wait_policy() == WaitPolicy()  # unchanged


# -- Predictor -----------------------------------------------------------------


def _observe(pred: Predictor, rec: FakeRecord, duration: float, seen_before: float | None = None) -> None:
    rec.seen = 0.0 if seen_before is None else rec.t + seen_before
    pred.observe(rec, rec.t + duration)


def test_exact_observations_teach_the_duration() -> None:
    pred = Predictor()
    recs = stream_records(20)
    start = 100.0
    for i, rec in enumerate(recs):
        rec.t = start + i  # recorded well after the previous completion
        _observe(pred, rec, 2e-3, seen_before=2e-3 - 10e-6)
    later = FakeRecord(recs[0].stream, 21)
    later.t = 200.0
    expected = pred.expected(later)
    assert expected is not None
    end, est, dev = expected
    assert est == pytest.approx(2e-3)
    assert end == pytest.approx(200.0 + 2e-3)
    assert dev == pytest.approx(0, abs=1e-9)


def test_a_late_observation_does_not_inflate_the_estimate() -> None:
    pred = Predictor()
    first, second = stream_records(2)
    first.t = 10.0
    _observe(pred, first, 1e-3, seen_before=1e-3 - 5e-6)  # exact: 1 ms
    second.t = 20.0
    # Seen pending at 0.5 ms, complete only at 5 ms (a long sleep): the
    # interval (0.5, 5] holds the estimate, which must not grow (it shrinks
    # a little: such an observation cannot tell an estimate that is long).
    _observe(pred, second, 5e-3, seen_before=0.5e-3)
    expected = pred.expected(second)
    assert expected is not None
    assert 0.98e-3 < expected[1] <= 1e-3


def test_an_estimate_that_is_too_long_comes_back() -> None:
    pred = Predictor()
    recs = stream_records(200)
    recs[0].t = 0.0
    _observe(pred, recs[0], 3e-3, seen_before=3e-3 - 5e-6)  # a one-off slow run
    for i, rec in enumerate(recs[1:], 1):
        rec.t = float(i)
        est = pred.expected(rec)[1]  # type: ignore[index]
        if est > 2e-3 + 50e-6:  # the waiter wakes after the real end (2 ms): late, uninformative
            _observe(pred, rec, est + 100e-6, seen_before=10e-6)
        else:  # it wakes before the end and spins through it: exact
            _observe(pred, rec, 2e-3, seen_before=2e-3 - 5e-6)
    assert pred.expected(recs[-1])[1] == pytest.approx(2e-3, rel=0.05)  # type: ignore[index]


def test_interval_observations_pull_the_estimate_into_them() -> None:
    pred = Predictor()
    recs = stream_records(3)
    recs[0].t = 1.0
    _observe(pred, recs[0], 1e-3, seen_before=1e-3 - 5e-6)
    recs[1].t = 2.0
    _observe(pred, recs[1], 4e-3, seen_before=3e-3)  # longer than thought: (3, 4] ms
    est = pred.expected(recs[1])[1]  # type: ignore[index]
    assert 1e-3 < est < 3e-3  # moved a quarter of the way towards 3 ms
    recs[2].t = 3.0
    _observe(pred, recs[2], 0.2e-3)  # done at the first poll: at most 0.2 ms
    assert pred.expected(recs[2])[1] < est  # type: ignore[index]


def test_first_sight_takes_the_lower_bound() -> None:
    pred = Predictor()
    rec = FakeRecord()
    rec.t = 5.0
    _observe(pred, rec, 3e-3, seen_before=1e-3)
    assert pred.expected(rec)[1] == pytest.approx(1e-3)  # type: ignore[index]


def test_work_queued_behind_a_completion_starts_there() -> None:
    pred = Predictor()
    first, second = stream_records(2)
    first.t = second.t = 1.0  # both recorded at once, second queued behind
    _observe(pred, first, 2e-3, seen_before=2e-3 - 1e-6)
    end, _est, _dev = pred.expected(second)  # type: ignore[misc]
    assert end == pytest.approx(1.0 + 2e-3 + 2e-3)


def test_the_table_is_bounded() -> None:
    pred = Predictor()
    for _ in range(_policy._MAX_STREAMS + 10):
        _observe(pred, FakeRecord(), 1e-3)
    assert len(pred._stats) <= _policy._MAX_STREAMS


# -- Pacer ----------------------------------------------------------------------


def test_unknown_work_spins_then_sleeps_longer_and_longer() -> None:
    pacer = Pacer()
    rec = FakeRecord()
    now = 10.0
    pacer.kick(now)
    assert pacer.next_poll([rec], now) == now  # within spin_s: spin
    assert pacer.spin_ends == pytest.approx(now + WaitPolicy().spin_s)
    later = now + 1.0
    delays = [pacer.next_poll([rec], later) - later for _ in range(8)]
    assert delays[0] == pytest.approx(WaitPolicy().first_sleep_s)
    assert delays == sorted(delays)
    assert delays[-1] == pytest.approx(WaitPolicy().max_sleep_s)


def test_predicted_work_sleeps_until_just_before_its_end() -> None:
    rec = FakeRecord()
    rec.t = 50.0
    _policy.predictor._stats[rec.stream_key] = _policy._StreamStats(est=20e-3, done_at=0.0)
    pacer = Pacer()
    for _ in range(10):  # measured lateness: 100 µs
        pacer.sleeping_until(1.0)
        pacer.woke(1.0 + 100e-6)
    pacer.kick(50.0)
    when = pacer.next_poll([rec], 50.0)
    # asks to be woken the lateness plus a warm-up before the end
    assert when == pytest.approx(50.0 + 20e-3 - 100e-6 - _policy._WARM_S)
    assert pacer.next_poll([rec], when) == when  # then spins
    # once well past the expected end, it stops trusting the estimate
    assert pacer.next_poll([rec], 50.0 + 25e-3) > 50.0 + 25e-3


def test_the_cpu_budget_caps_the_spin_before_a_short_predicted_end() -> None:
    rec = FakeRecord()
    rec.t = 0.0
    _policy.predictor._stats[rec.stream_key] = _policy._StreamStats(est=2e-3, done_at=-1.0)
    pacer = Pacer()
    for _ in range(10):
        pacer.sleeping_until(1.0)
        pacer.woke(1.0 + 400e-6)  # slow wake-ups
    margin = pacer.margin(2e-3, WaitPolicy(cpu_budget=0.05))
    assert margin == pytest.approx(400e-6 + 0.05 * 2e-3)  # not 400 µs + warm-up


def test_without_prediction_the_policy_ignores_history() -> None:
    cudafut.set_wait_policy(WaitPolicy(predict=False))
    rec = FakeRecord()
    rec.t = 0.0
    _policy.predictor._stats[rec.stream_key] = _policy._StreamStats(est=1.0, done_at=-1.0)
    pacer = Pacer()
    pacer.kick(0.0)
    assert pacer.next_poll([rec], 0.0) == 0.0  # spins: the 1 s estimate is ignored


def test_interrupted_sleeps_teach_no_lateness() -> None:
    pacer = Pacer()
    pacer.sleeping_until(1.0)
    pacer.interrupted()
    pacer.woke(5.0)
    assert not pacer._lateness


# -- the watchlist fires in slices ------------------------------------------------


def test_thousands_of_completions_fire_in_slices() -> None:
    watchlist = _waiter.Watchlist()
    recs = stream_records(600)
    fired: list[int] = []
    for rec in recs:
        watchlist.add(rec, lambda r: fired.append(r.seq))
    for rec in recs:
        rec.complete()
    first = watchlist.poll(time.perf_counter(), limit=256)
    assert len(first) == 256
    assert watchlist.pending == 344
    while watchlist.pending:
        for callback, rec in watchlist.poll(time.perf_counter(), limit=256):
            callback(rec)
    assert len(fired) == 344


# -- the watcher thread keeps values alive and never spins -------------------------


class _Value:
    pass


def test_held_values_live_until_their_records_complete() -> None:
    rec = FakeRecord()
    value = _Value()
    ref = weakref.ref(value)
    waiter = _waiter.thread_waiter()
    waiter.hold([rec], value)
    del value
    time.sleep(0.05)
    gc.collect()
    assert ref() is not None  # pending: kept
    rec.complete()
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
        gc.collect()
    assert ref() is None


class _RecordingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_the_watcher_thread_sleeps_between_polls_even_when_told_to_spin() -> None:
    # A spinning thread would hold the GIL and shut the application's
    # threads out for the 5 ms switch interval at a time.
    cudafut.set_wait_policy("low_latency")
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    rec = FakeRecord()
    waiter.hold([rec], _Value())
    deadline = time.monotonic() + 5
    while len(cond.timeouts) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.complete()
    polls = [t for t in cond.timeouts if t is not None]
    assert len(polls) >= 20
    assert min(polls) >= _waiter.THREAD_MIN_SLEEP_S > 0


# -- the timer ----------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux only")
def test_the_timer_fires_at_the_time_asked_and_can_be_disarmed() -> None:
    timer = _timer.make_timer()
    assert timer is not None
    try:
        timer.arm(2e-3)
        assert select.select([timer.fd], [], [], 0)[0] == []
        assert select.select([timer.fd], [], [], 1.0)[0] == [timer.fd]
        timer.drain()
        assert select.select([timer.fd], [], [], 0)[0] == []
        timer.arm(5e-3)
        timer.disarm()
        assert select.select([timer.fd], [], [], 0.02)[0] == []
    finally:
        timer.close()
    timer.close()  # idempotent
