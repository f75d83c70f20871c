"""The wait policy, the duration predictor and the pacer (host side), and the
proof of the regret bound: a simulation of the real drivers on a fake clock."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudafut
from cudafut import _loops, _policy, _waiter
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


def test_notices_are_on_by_default_beside_polls_of_max_sleep_s() -> None:
    # Notices beside 1 ms polls beat the polls alone at p90 in the vary
    # benchmark (benchmarks/results/); low_cpu and low_latency poll only.
    assert WaitPolicy().notify is True
    assert WaitPolicy().notice_sleep_s == WaitPolicy().max_sleep_s
    assert cudafut.get_wait_policy().notify is True
    assert [name for name, preset in _policy.PRESETS.items() if preset.notify] == ["balanced"]
    assert WaitPolicy(notify=False).notify is False


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
        ({"spin_s": math.nan}, ValueError, "spin_s must be a number, not NaN"),
        ({"cpu_budget": "0.1"}, TypeError, "cpu_budget must be a number"),
        ({"cpu_budget": True}, TypeError, "cpu_budget must be a number"),
        ({"cpu_budget": 1.5}, ValueError, "share of the wait"),
        ({"first_sleep_s": 0}, ValueError, "0 < first_sleep_s <= max_sleep_s"),
        ({"first_sleep_s": 2e-3, "max_sleep_s": 1e-3}, ValueError, "first_sleep_s <= max_sleep_s"),
        ({"max_sleep_s": math.inf}, ValueError, "max_sleep_s < inf"),
        ({"predict": "yes"}, TypeError, "predict must be True or False"),
        ({"predict": 1}, TypeError, "predict must be True or False"),
        ({"notify": 1}, TypeError, "notify must be True or False"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        WaitPolicy(**kwargs)  # type: ignore[arg-type]


def test_nan_is_a_value_error_for_policies_as_for_timeouts() -> None:
    # One rule: a float of the right type with a wrong value is a ValueError.
    with pytest.raises(ValueError, match="NaN"):
        WaitPolicy(max_sleep_s=math.nan)
    with pytest.raises(ValueError, match="timeout"):
        cudafut.CudaFuture().result(timeout=math.nan)


def test_set_wait_policy_refuses_unknown_names_and_types() -> None:
    with pytest.raises(ValueError, match=r"unknown wait policy 'fast'.*balanced"):
        cudafut.set_wait_policy("fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a WaitPolicy or a preset name"):
        cudafut.set_wait_policy(0.1)  # type: ignore[arg-type]
    assert cudafut.get_wait_policy() == WaitPolicy()  # unchanged


# -- Predictor -----------------------------------------------------------------


def _observe(pred: Predictor, rec: FakeRecord, duration: float, seen_before: float | None = None) -> None:
    """``rec`` took ``duration``; it was seen pending ``seen_before`` after its
    start (None: never, i.e. the first poll saw it complete)."""
    rec.seen = 0.0 if seen_before is None else rec.t + seen_before
    pred.observe(rec, rec.t + duration)


def _exact(pred: Predictor, recs: list[FakeRecord], durations: list[float], t0: float = 100.0) -> None:
    for i, (rec, d) in enumerate(zip(recs, durations, strict=True)):
        rec.t = t0 + i  # recorded well after the previous completion
        _observe(pred, rec, d, seen_before=d - 5e-6)


def test_a_repeating_duration_becomes_one_mode() -> None:
    pred = Predictor()
    recs = stream_records(6)
    _exact(pred, recs, [2e-3] * 6)
    modes, surprised = pred.modes(recs[-1])
    assert len(modes) == 1 and not surprised
    assert modes[0].center == pytest.approx(2e-3)
    assert modes[0].high - modes[0].low == pytest.approx(0, abs=1e-9)


def test_one_observation_predicts_nothing_two_agreeing_newest_ones_do() -> None:
    pred = Predictor()
    recs = stream_records(4)
    _exact(pred, recs[:1], [5e-3])
    assert pred.modes(recs[0]) == ((), True)
    _exact(pred, recs[1:2], [5e-3], t0=200.0)
    assert [m.center for m in pred.modes(recs[1])[0]] == [pytest.approx(5e-3)]
    # Two agreeing observations that are no longer the newest predict nothing.
    _exact(pred, recs[2:], [1e-3, 9e-3], t0=300.0)
    assert pred.modes(recs[-1])[0] == ()


def test_one_long_job_does_not_move_a_learnt_duration() -> None:
    # The step that once cost 34 ms per wait: one 50 ms job among 2 ms jobs.
    pred = Predictor()
    recs = stream_records(10)
    _exact(pred, recs, [2e-3] * 5 + [50e-3] + [2e-3] * 4)
    modes, surprised = pred.modes(recs[-1])
    assert [m.center for m in modes] == [pytest.approx(2e-3)]
    assert not surprised


def test_an_observation_outside_every_mode_marks_the_stream_surprised() -> None:
    pred = Predictor()
    recs = stream_records(5)
    _exact(pred, recs, [20e-3] * 4 + [1e-3])
    modes, surprised = pred.modes(recs[-1])
    assert [m.center for m in modes] == [pytest.approx(20e-3)]
    assert surprised  # the next wait polls as for unknown work too


def test_two_sizes_of_work_become_two_modes() -> None:
    pred = Predictor()
    recs = stream_records(12)
    rnd = random.Random(4)
    _exact(pred, recs, [rnd.choice([0.1e-3, 10e-3]) for _ in range(9)] + [0.1e-3, 10e-3, 0.1e-3])
    modes, _ = pred.modes(recs[-1])
    assert [m.center for m in modes] == [pytest.approx(0.1e-3), pytest.approx(10e-3)]


def test_a_slow_drift_is_followed() -> None:
    pred = Predictor()
    recs = stream_records(16)
    durations = [2e-3 * 1.01**i for i in range(16)]
    _exact(pred, recs, durations)
    (mode,), surprised = pred.modes(recs[-1])
    assert not surprised
    # The window is set by the newest members (and those widened it since
    # the modes were last found afresh), not the oldest.
    assert mode.low >= durations[-(_policy._MODE_NEWEST + _policy._REFRESH)] - 1e-12
    assert mode.high == pytest.approx(durations[-1])


def test_a_wide_observation_counts_at_its_midpoint() -> None:
    pred = Predictor()
    recs = stream_records(3)
    for i, rec in enumerate(recs):
        rec.t = 10.0 + i
        _observe(pred, rec, 3e-3, seen_before=1e-3)  # (1, 3] ms: a late poll
    (mode,), _ = pred.modes(recs[-1])
    assert mode.center == pytest.approx(2e-3)


def test_work_queued_behind_a_completion_starts_there() -> None:
    pred = Predictor()
    first, second = stream_records(2)
    first.t = second.t = 1.0  # both recorded at once, second queued behind
    _observe(pred, first, 2e-3, seen_before=2e-3 - 1e-6)
    assert pred.start(second) == pytest.approx(1.0 + 2e-3)


def test_the_table_is_bounded() -> None:
    pred = Predictor()
    for _ in range(_policy._MAX_STREAMS + 10):
        _observe(pred, FakeRecord(), 1e-3)
    assert len(pred) <= _policy._MAX_STREAMS


# -- Pacer ----------------------------------------------------------------------


def test_unknown_work_spins_then_sleeps_longer_and_longer() -> None:
    pacer = Pacer()
    rec = FakeRecord()
    now = 10.0
    pacer.new_wait(now)
    assert pacer.next_poll([rec], now) == now  # within spin_s: spin
    assert pacer.spin_ends == pytest.approx(now + WaitPolicy().spin_s)
    later = now + 1.0
    delays = [pacer.next_poll([rec], later) - later for _ in range(8)]
    assert delays[0] == pytest.approx(WaitPolicy().first_sleep_s)
    assert delays == sorted(delays)
    assert delays[-1] == pytest.approx(WaitPolicy().max_sleep_s)


def _learn(rec: FakeRecord, duration: float, times: int = 4) -> None:
    recs = stream_records(times)
    for r in recs:
        r.stream_key = rec.stream_key
    _exact(_policy.predictor, recs, [duration] * times, t0=rec.t - 100)


def _slow_waker(late: float) -> Pacer:
    pacer = Pacer()
    for _ in range(10):
        pacer.sleeping_until(1.0)
        pacer.woke(1.0 + late)
    return pacer


def test_predicted_work_polls_within_the_bound_then_spins_before_its_end() -> None:
    rec = FakeRecord()
    rec.t = 500.0
    _learn(rec, 20e-3)
    pacer = _slow_waker(100e-6)
    pacer.new_wait(rec.t)
    # the lateness plus a warm-up before the end: for 20 ms work, its cpu_budget
    # up to the cap
    opens = rec.t + 20e-3 - 100e-6 - min(WaitPolicy().cpu_budget * 20e-3, _policy._WARM_S)
    now = rec.t
    polls = []
    while True:
        when = pacer.next_poll([rec], now)
        if when <= now:
            break
        assert when - now <= WaitPolicy().max_sleep_s + 1e-12  # never a longer sleep
        polls.append(when)
        now = when
    assert now == pytest.approx(opens)
    assert len(polls) == math.ceil((opens - rec.t) / WaitPolicy().max_sleep_s)
    # past the window it stops trusting the prediction: growing sleeps again
    late = rec.t + 25e-3
    assert pacer.next_poll([rec], late) == pytest.approx(late + WaitPolicy().first_sleep_s)


def test_a_surprised_stream_also_spins_and_backs_off_before_its_modes() -> None:
    rec = FakeRecord()
    rec.t = 500.0
    _learn(rec, 20e-3)
    _policy.predictor.histories[rec.stream_key].surprised = True
    pacer = Pacer()
    pacer.new_wait(rec.t)
    assert pacer.next_poll([rec], rec.t) == rec.t  # the spin after a new wait
    now = rec.t + 1e-3
    assert pacer.next_poll([rec], now) == pytest.approx(now + WaitPolicy().first_sleep_s)


def test_the_cpu_budget_caps_the_spin_before_a_short_predicted_end() -> None:
    pacer = _slow_waker(400e-6)
    margin = pacer.margin(2e-3, WaitPolicy(cpu_budget=0.05))
    assert margin == pytest.approx(400e-6 + 0.05 * 2e-3)  # not 400 µs + warm-up


def test_long_predicted_work_spends_its_cpu_budget_warming_up_before_the_end() -> None:
    # A thread that slept through most of a long wait runs slowly for a
    # while: long work spins cpu_budget of its duration first, up to
    # _WARM_S (0.4 ms: 1 ms before 20 ms work cost more CPU for the same
    # median wake-up, benchmarks/results/waiter-variants-h200.txt),
    # whatever the slow tail of its wake-ups.
    pacer = _slow_waker(100e-6)
    for _ in range(5):  # a slower tail of wake-ups: it does not cap the spin
        pacer.sleeping_until(1.0)
        pacer.woke(1.0 + 400e-6)
    assert pacer._late_median == pytest.approx(100e-6)
    balanced = WaitPolicy()
    assert pacer.margin(20e-3, balanced) == pytest.approx(100e-6 + _policy._WARM_S)  # the cap
    assert pacer.margin(6e-3, balanced) == pytest.approx(100e-6 + 0.05 * 6e-3)
    assert pacer.margin(100e-3, balanced) == pytest.approx(100e-6 + _policy._WARM_S)
    # short work spins as long as it did: its budget
    assert pacer.margin(2e-3, balanced) == pytest.approx(100e-6 + 0.05 * 2e-3)
    assert pacer.margin(0.5e-3, balanced) == pytest.approx(100e-6 + 0.05 * 0.5e-3)
    # a smaller budget, a shorter spin (low_cpu: 1 %, 200 µs at 20 ms)
    assert pacer.margin(20e-3, _policy.PRESETS["low_cpu"]) == pytest.approx(100e-6 + 200e-6)


def test_without_prediction_the_policy_ignores_history() -> None:
    cudafut.set_wait_policy(WaitPolicy(predict=False))
    rec = FakeRecord()
    rec.t = 1000.0
    _learn(rec, 1.0)
    pacer = Pacer()
    pacer.new_wait(rec.t)
    assert pacer.next_poll([rec], rec.t) == rec.t  # spins: the 1 s duration is ignored


def test_interrupted_sleeps_teach_no_lateness() -> None:
    pacer = Pacer()
    pacer.sleeping_until(1.0)
    pacer.interrupted()
    pacer.woke(5.0)
    assert not pacer._lateness


# -- the regret bound, proved on a fake clock ----------------------------------------
#
# The real drivers run against a fake clock and scripted events: each
# ``perf_counter()`` call advances it a little (the cost of a poll), a sleep
# advances it by the time asked plus the OS's wake-up lateness. Whatever
# sequence of durations the work takes, every completion must be noticed at
# most ``max_sleep_s`` plus that lateness after it happened.

_TICK_S = 1e-6  # what one perf_counter() call (a poll, a loop iteration) costs


class _Clock:
    def __init__(self, lateness: float) -> None:
        self.now = 1000.0
        self.lateness = lateness

    def perf_counter(self) -> float:
        self.now += _TICK_S
        return self.now

    def sleep(self, delay: float) -> None:
        self.now += max(0.0, delay) + self.lateness


class _TimedRecord(FakeRecord):
    """Complete once the fake clock passes ``end``."""

    __slots__ = ("clock", "end")
    clock: _Clock
    end: float

    def query(self) -> int | None:
        if self.status is None and self.clock.now >= self.end:
            self.status = 0
        return self.status


class _SimDriver(_loops.LoopDriver):
    cancelled_error = RuntimeError

    def ensure_polling(self) -> None:
        pass

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        fn()

    async def _checkpoint(self) -> None:
        pass

    def wait_records(self, records: Sequence[Any], fresh: bool = True) -> Any:
        raise NotImplementedError

    async def until(self, register: Any) -> None:
        raise NotImplementedError


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock(0.0)
    for module in (_waiter, _loops, _policy):
        monkeypatch.setattr(module, "time", fake)
    return fake


def _job(clock: _Clock, stream: int, seq: int, duration: float) -> _TimedRecord:
    rec = _TimedRecord(stream, seq)
    rec.clock = clock
    rec.t = clock.now
    rec.end = clock.now + duration
    return rec


def _start_streams(clock: _Clock, driver: Any, streams: list[list[float]]) -> list[float]:
    """Start each stream's durations on ``driver``, one after another (the
    next job launched when the previous was noticed, as a task awaiting in
    a loop); the list it returns fills with how late each completion was seen."""
    lates: list[float] = []
    queues = [list(durations) for durations in streams]
    seqs = [0] * len(streams)

    def launch(i: int) -> None:
        if not queues[i]:
            return
        seqs[i] += 1
        rec = _job(clock, 0x9000 + i, seqs[i], queues[i].pop(0))

        def noticed(r: Any, i: int = i, rec: _TimedRecord = rec) -> None:
            lates.append(clock.now - rec.end)
            launch(i)

        driver.watch_one(rec, noticed)

    for i in range(len(streams)):
        launch(i)
    return lates


def _run_driver(clock: _Clock, streams: list[list[float]]) -> list[float]:
    """Each stream runs its durations one after another, the next job
    launched when the previous was noticed (a task awaiting in a loop), all
    streams watched by one driver. Returns how late each completion was seen."""
    driver = _SimDriver()
    lates = _start_streams(clock, driver, streams)
    timer_fired = False
    while True:
        before = clock.now
        when = driver.poll(timer_fired)
        if when is None:
            return lates
        bound = cudafut.get_wait_policy().max_sleep_s
        assert when - clock.now <= bound + 1e-9, "a sleep longer than max_sleep_s was planned"
        delay = when - clock.perf_counter()
        timer_fired = delay >= _loops.MIN_SLEEP_S
        if timer_fired:
            driver.pacer.sleeping_until(when)
            clock.sleep(delay)
        assert clock.now > before


def _run_blocking(clock: _Clock, durations: list[float]) -> list[float]:
    """``result()``'s blocking wait, job after job on one stream."""
    lates = []
    for seq, duration in enumerate(durations, 1):
        rec = _job(clock, 0x8000, seq, duration)
        assert _waiter.block_until_complete([rec], None)
        lates.append(clock.now - rec.end)
    return lates


def _log_uniform(rnd: random.Random, lo: float, hi: float) -> float:
    return math.exp(rnd.uniform(math.log(lo), math.log(hi)))


# Durations in the patterns of the `vary` benchmark, seeded by hypothesis.
_PATTERNS: dict[str, Callable[[random.Random, int], list[float]]] = {
    "stable": lambda rnd, n: [_log_uniform(rnd, 10e-6, 30e-3)] * n,
    "step": lambda rnd, n: [_log_uniform(rnd, 5e-3, 60e-3)] + [_log_uniform(rnd, 50e-6, 3e-3)] * n,
    "steps": lambda rnd, n: [d for k in range(4) for d in [(2e-3, 20e-3)[k % 2]] * (n // 4 + 1)],
    "random": lambda rnd, n: [_log_uniform(rnd, 50e-6, 20e-3) for _ in range(n)],
    "bimodal": lambda rnd, n: [rnd.choice((0.1e-3, 10e-3)) for _ in range(n)],
    "drift": lambda rnd, n: [1e-3 * 1.01**i for i in range(n)],
    "mixture": lambda rnd, n: [
        rnd.choice([0.0, 30e-6, 2e-3, 2.1e-3, 9e-3, 40e-3]) * rnd.uniform(0.9, 1.1) for _ in range(n)
    ],
}

_policies = st.one_of(
    st.sampled_from(["balanced", "low_cpu"]),
    st.builds(
        WaitPolicy,
        spin_s=st.sampled_from([0.0, 20e-6, 100e-6, 1e-3]),
        first_sleep_s=st.just(20e-6),
        max_sleep_s=st.sampled_from([50e-6, 500e-6, 1e-3, 5e-3]),
        predict=st.booleans(),
        cpu_budget=st.sampled_from([0.0, 0.05, 1.0]),
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pattern=st.sampled_from(sorted(_PATTERNS)),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    nstreams=st.integers(1, 4),
    lateness=st.sampled_from([0.0, 50e-6, 400e-6]),
    policy=_policies,
)
def test_every_completion_is_noticed_within_the_bound(
    clock: _Clock, pattern: str, seed: int, n: int, nstreams: int, lateness: float, policy: Any
) -> None:
    cudafut.set_wait_policy(policy)
    _policy.predictor.clear()
    clock.lateness = lateness
    rnd = random.Random(seed)
    streams = [_PATTERNS[pattern](rnd, n) for _ in range(nstreams)]
    bound = cudafut.get_wait_policy().max_sleep_s + lateness + 20 * _TICK_S
    lates = _run_driver(clock, streams)
    assert len(lates) == sum(map(len, streams))
    assert max(lates) <= bound, f"a completion was noticed {max(lates) * 1e3:.3f} ms late"
    if nstreams == 1:
        lates = _run_blocking(clock, streams[0])
        assert max(lates) <= bound, f"result() noticed a completion {max(lates) * 1e3:.3f} ms late"


# -- notices (WaitPolicy.notify): the bound holds whatever they do ----------------------
#
# A notice is CUDA closing a pipe when a record's work ends (_backend.current.close_after).
# On the fake clock it arrives on time (a wake-up delay after the end), late,
# early (before the work ends: a spurious wake-up), twice, or never (CUDA runs
# no host function after a context error). Whatever it does, every completion
# is noticed within notice_sleep_s (or max_sleep_s where no notice was armed;
# predicted_sleep_s where one covers predicted work) plus the OS's lateness;
# on time, within its delay or the usual bound.
# Each test sets its own policy (notices are on by default, beside 1 ms polls).

_NOTICE_KINDS = ("on time", "late", "early", "twice", "never")


def _run_driver_with_notices(
    clock: _Clock, streams: list[list[float]], kind: str, delay: float, armable: bool = True
) -> tuple[list[float], int]:
    """As :func:`_run_driver`, the driver asking for notices that behave as
    ``kind`` says; returns how late each completion was seen and how many
    notices were armed."""
    driver = _SimDriver()
    # When a notice wakes the driver: (clock time, stream key, record seq).
    deliveries: list[tuple[float, tuple[int, ...], int]] = []
    armed: dict[tuple[int, ...], int] = {}
    made: list[tuple[int, ...]] = []  # each notice armed

    def arm(rec: Any) -> bool:
        # AsyncioDriver._arm's rule: a notice armed for this record or an
        # older one of its stream serves; one for a newer one does not; the
        # entry lasts until the notice arrives (for ever if it never does).
        if not armable:
            return False
        key = rec.stream_key
        seq = armed.get(key)
        if seq is not None:
            return bool(seq <= rec.seq)
        armed[key] = rec.seq
        made.append(key)
        end = rec.end
        times = {
            "on time": [end + delay],
            "late": [end + 5e-3],
            "early": [min(clock.now + delay, end)],
            "twice": [end + delay, end + 2 * delay],
            "never": [],
        }[kind]
        deliveries.extend((t, key, rec.seq) for t in times)
        return True

    def deliver(key: tuple[int, ...], seq: int) -> None:
        if armed.get(key) == seq:
            del armed[key]

    driver.arm = arm
    lates = _start_streams(clock, driver, streams)
    policy = cudafut.get_wait_policy()
    longest = max(policy.max_sleep_s, policy.notice_sleep_s, policy.predicted_sleep_s)
    timer_fired = False
    while True:
        before = clock.now
        when = driver.poll(timer_fired)
        if when is None:
            return lates, len(made)
        assert when - clock.now <= longest + 1e-9, "a sleep longer than the policy allows was planned"
        deliveries.sort()
        delay_s = when - clock.perf_counter()
        if deliveries and deliveries[0][0] < clock.now + max(delay_s, 0.0):
            at, key, seq = deliveries.pop(0)
            deliver(key, seq)
            clock.now = max(clock.now, at) + clock.lateness  # woken by the notice
            timer_fired = False
        else:
            timer_fired = delay_s >= _loops.MIN_SLEEP_S
            if timer_fired:
                driver.pacer.sleeping_until(when)
                clock.sleep(delay_s)
        while deliveries and deliveries[0][0] <= clock.now:  # arrived while awake: no extra wake-up
            _at, key, seq = deliveries.pop(0)
            deliver(key, seq)
        assert clock.now > before


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pattern=st.sampled_from(sorted(_PATTERNS)),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 30),
    nstreams=st.integers(1, 4),
    lateness=st.sampled_from([0.0, 50e-6, 400e-6]),
    kind=st.sampled_from(_NOTICE_KINDS),
    delay=st.sampled_from([0.0, 100e-6, 300e-6]),
    notice_sleep_s=st.sampled_from([1e-3, 5e-3, 20e-3]),
    predicted_sleep_s=st.sampled_from([0.0, 5e-3, 20e-3]),
)
def test_every_completion_is_noticed_within_the_bound_whatever_the_notices_do(
    clock: _Clock,
    pattern: str,
    seed: int,
    n: int,
    nstreams: int,
    lateness: float,
    kind: str,
    delay: float,
    notice_sleep_s: float,
    predicted_sleep_s: float,
) -> None:
    cudafut.set_wait_policy(
        WaitPolicy(notify=True, notice_sleep_s=notice_sleep_s, predicted_sleep_s=predicted_sleep_s)
    )
    _policy.predictor.clear()
    clock.lateness = lateness
    rnd = random.Random(seed)
    streams = [_PATTERNS[pattern](rnd, n) for _ in range(nstreams)]
    policy = cudafut.get_wait_policy()
    slack = lateness + 20 * _TICK_S
    lates, _armed = _run_driver_with_notices(clock, streams, kind, delay)
    assert len(lates) == sum(map(len, streams))
    assert max(lates) <= max(policy.notice_sleep_s, policy.max_sleep_s, policy.predicted_sleep_s) + slack
    if kind in ("on time", "twice"):
        assert max(lates) <= max(delay, policy.max_sleep_s) + slack, (
            f"a notice on time, yet a completion was noticed {max(lates) * 1e3:.3f} ms late"
        )


def _timer_polls(
    clock: _Clock,
    streams: list[list[float]],
    kind: str = "on time",
    delay: float = 100e-6,
    armable: bool = True,
) -> tuple[int, int, list[float]]:
    """Run ``streams`` under the policy in force, with notices as ``kind``
    says (nothing learnt before): the polls a timer ended, the notices
    armed, and how late each completion was seen."""
    _policy.predictor.clear()
    polls: list[bool] = []
    driver_poll = _waiter.Driver.poll

    def counted(self: Any, timer_fired: bool) -> Any:
        polls.append(timer_fired)
        return driver_poll(self, timer_fired)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_waiter.Driver, "poll", counted)
        lates, armed = _run_driver_with_notices(clock, streams, kind, delay, armable)
    return polls.count(True), armed, lates


def test_unknown_work_is_noticed_by_its_notice_not_by_timed_polls(clock: _Clock) -> None:
    # 5 ms of work of no learnt duration: without notices the waiter polls
    # every max_sleep_s (1 ms) at most; with one and polls 20 ms apart, it
    # sleeps until the notice.
    cudafut.set_wait_policy(WaitPolicy(notify=True, notice_sleep_s=20e-3))
    with_notice, armed, lates = _timer_polls(clock, [[5e-3]])
    assert armed == 1
    assert lates[0] <= 100e-6 + 20 * _TICK_S
    without, _armed, _lates = _timer_polls(clock, [[5e-3]], "never", 0.0, armable=False)
    assert with_notice < without, (with_notice, without)


def _timer_polls_with_notices(
    clock: _Clock, streams: list[list[float]], policy: WaitPolicy
) -> tuple[int, int, list[float]]:
    """:func:`_timer_polls` under ``policy``, notices on time."""
    cudafut.set_wait_policy(policy)
    return _timer_polls(clock, streams)


def test_long_predicted_work_sleeps_to_its_spin_under_a_notice(clock: _Clock) -> None:
    # Learnt 20 ms work: polled max_sleep_s (1 ms) apart until its spin,
    # about 19 timer wake-ups a job; with a notice to report an early end,
    # one sleep until the spin.
    jobs = [[20e-3] * 24]  # the first 4 to learn it: polled as unknown work
    old_polls, old_armed, _ = _timer_polls_with_notices(clock, jobs, WaitPolicy(predicted_sleep_s=0.0))
    polls, armed, lates = _timer_polls_with_notices(clock, jobs, WaitPolicy())
    assert armed > old_armed, "no notice covered the predicted work"
    assert polls * 4 < old_polls, (polls, old_polls)
    assert max(lates[-6:]) <= 20 * _TICK_S, "learnt work was not seen while spinning"


def test_short_predicted_work_asks_for_no_notice(clock: _Clock) -> None:
    # Learnt 2 ms work: its spin begins within a few polls, which cost less
    # than a notice.
    jobs = [[2e-3] * 20]
    _, old_armed, _ = _timer_polls_with_notices(clock, jobs, WaitPolicy(predicted_sleep_s=0.0))
    _, armed, _ = _timer_polls_with_notices(clock, jobs, WaitPolicy())
    assert armed == old_armed


def test_a_waiter_of_several_streams_asks_no_notice_for_predicted_work(clock: _Clock) -> None:
    # One poll serves every stream; a notice per stream costs more than the
    # polls it saves.
    jobs = [[20e-3] * 12, [20e-3] * 12]
    _, old_armed, _ = _timer_polls_with_notices(clock, jobs, WaitPolicy(predicted_sleep_s=0.0))
    _, armed, _ = _timer_polls_with_notices(clock, jobs, WaitPolicy())
    assert armed == old_armed


def test_predicted_work_ending_early_is_seen_by_its_notice(clock: _Clock) -> None:
    # Learnt 20 ms work, then a job of 5 ms: the notice, not the spin 15 ms
    # later, reports it.
    cudafut.set_wait_policy(WaitPolicy())
    _policy.predictor.clear()
    lates, _armed = _run_driver_with_notices(clock, [[20e-3] * 8 + [5e-3]], "on time", 100e-6)
    assert lates[-1] <= 100e-6 + 20 * _TICK_S


@pytest.mark.parametrize("policy", [WaitPolicy(notify=False), "low_cpu"], ids=["notify=False", "low_cpu"])
def test_no_notice_is_asked_for_when_the_policy_says_so(clock: _Clock, policy: Any) -> None:
    # notify=False, and the preset that polls on timers only.
    cudafut.set_wait_policy(policy)
    _policy.predictor.clear()
    lates, armed = _run_driver_with_notices(clock, [[5e-3, 3e-3]], "on time", 0.0)
    assert armed == 0 and len(lates) == 2
    assert max(lates) <= cudafut.get_wait_policy().max_sleep_s + 20 * _TICK_S


def test_the_step_that_broke_the_old_predictor(clock: _Clock) -> None:
    # One 50 ms job, then forty of 2 ms: each 2 ms wait used to sleep until
    # the 50 ms estimate's end (34 ms late at the median on an H200).
    lates = _run_driver(clock, [[50e-3] + [2e-3] * 40])
    assert max(lates) <= WaitPolicy().max_sleep_s + 20 * _TICK_S
    # ... and once learnt, the 2 ms work is noticed while spinning.
    assert max(lates[-30:]) <= 20 * _TICK_S


class _LoneSimDriver(_SimDriver):
    """A lone await's own sleeps and spins (``spin_alone``) on the fake
    clock: each sleep ends ``clock.lateness`` late, each spin poll costs
    ``_TICK_S``; ``woke`` is when the last sleep ended, ``spun`` the time
    spent spinning."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.woke = 0.0
        self.spun = 0.0

    async def _checkpoint(self) -> None:
        self.clock.now += _TICK_S
        self.spun += _TICK_S

    async def _sleep_alone(self, when: float) -> bool:
        self.pacer.sleeping_until(when)
        self.clock.sleep(when - self.clock.now)
        self.woke = self.clock.now
        self.pacer.woke(self.clock.now)
        return True


def _lone_awaits(clock: _Clock, duration: float, n: int = 12) -> list[tuple[float, float, float]]:
    """``n`` lone awaits of work of ``duration``, one after another: for each,
    how long before its end the last sleep ended, how late the end was seen,
    and the share of the wait spent spinning."""
    driver = _LoneSimDriver(clock)
    out = []
    for seq in range(1, n + 1):
        rec = _job(clock, 0x7000, seq, duration)
        driver.woke, driver.spun = rec.t, 0.0
        coro = driver.spin_alone(rec)
        with pytest.raises(StopIteration) as stop:
            coro.send(None)
        if not stop.value.value:  # unknown work: the driver's notice ends it, just after
            rec.seen = clock.now = max(clock.now, rec.end)
            assert rec.query() == 0
            driver.learn_later([(rec, clock.now)])
        out.append((rec.end - driver.woke, clock.now - rec.end, driver.spun / duration))
    return out


def test_a_lone_await_of_long_learnt_work_spins_its_budget_before_the_end(clock: _Clock) -> None:
    # Stable 20 ms work (bench wake's longest row): the last sleep ends
    # cpu_budget of the duration, up to the cap (0.4 ms), before the end; the
    # end is seen while spinning, at a spin of about that share of the wait.
    clock.lateness = 50e-6
    budget = WaitPolicy().cpu_budget
    warm = min(budget * 20e-3, _policy._WARM_S)
    for lead, late, spun in _lone_awaits(clock, 20e-3)[6:]:
        assert warm - 20e-6 <= lead <= warm + 60e-6
        assert late <= 20 * _TICK_S
        assert spun <= warm / 20e-3 + 0.005
    # 2 ms work keeps the lead it had: its budget (0.1 ms) is under the warm-up
    for lead, late, _spun in _lone_awaits(clock, 2e-3)[6:]:
        assert lead <= budget * 2e-3 + 60e-6
        assert late <= 20 * _TICK_S
