"""When to poll: the wait policy, per-stream duration prediction, pacing.

Two measured facts shape every waiter here (DESIGN.md, docs/performance.md):
a thread that slept for milliseconds takes 200-500 µs to wake up, whoever
wakes it, and only spinning notices completion within microseconds. So a
waiter spins only while completion is likely near:

* right after a new wait, for ``spin_s`` (short work is seen at once);
* for work whose duration it has learnt (work on a stream tends to repeat),
  from shortly before the expected end: it sleeps until then, and the
  "shortly" is the wake-up lateness it measured, capped so that spinning
  costs at most ``cpu_budget`` of the wait;
* otherwise it sleeps in steps growing from ``first_sleep_s`` to
  ``max_sleep_s`` (every step is a poll, so errors are seen too).

The :class:`Predictor` learns durations from every completion a waiter sees,
one estimate per stream. A :class:`Pacer` is one sleeper's state (an event
loop's driver, the watcher thread, a thread blocked in ``result()``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from ._events import EventRecord

#: A completion seen within this long after the last poll that saw the work
#: pending counts as an exact observation of its duration.
_EXACT_S: Final = 50e-6
#: Weight of a new observation in the running estimates.
_ALPHA: Final = 0.25
#: How far an uninformative (late) observation pulls the estimate down.
_SHRINK: Final = 0.96
#: Lateness assumed before a sleeper has measured its own.
_DEFAULT_LATENESS_S: Final = 300e-6
#: Extra spin before a predicted end: a thread that just woke from a long
#: sleep runs slowly for tens of µs (cold caches, a waking vCPU); the spin
#: should be warm when the work completes.
_WARM_S: Final = 200e-6
#: Streams whose estimates are kept; beyond this the table starts afresh.
_MAX_STREAMS: Final = 4096


@dataclass(frozen=True)
class WaitPolicy:
    """How cudafut's waiters trade CPU time for wake-up latency.

    Every ``await``, :meth:`~cudafut.CudaFuture.result` and done-callback
    learns that GPU work completed by polling its CUDA event. Set the policy
    with :func:`set_wait_policy`; the presets are ``"balanced"`` (the
    default), ``"low_latency"`` and ``"low_cpu"``.

    Attributes:
        spin_s: after a new wait, poll continuously (yielding to the event
            loop between polls) for this many seconds. ``math.inf`` spins
            for the whole wait: the lowest latency, one busy core.
        first_sleep_s: the first sleep once spinning stopped, for work of
            unknown duration; each further sleep doubles, up to
            ``max_sleep_s``.
        max_sleep_s: the longest sleep between two polls.
        predict: learn how long work on each stream takes, and for work
            that repeats sleep until shortly before its expected end.
        cpu_budget: for predicted work, the largest share of the wait that
            may be spent spinning before the expected end (0 to 1).
    """

    spin_s: float = 100e-6
    first_sleep_s: float = 50e-6
    max_sleep_s: float = 1e-3
    predict: bool = True
    cpu_budget: float = 0.05

    def __post_init__(self) -> None:
        for name in ("spin_s", "first_sleep_s", "max_sleep_s", "cpu_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"WaitPolicy.{name} must be a number, not {value!r}")
            if value < 0:
                raise ValueError(f"WaitPolicy.{name} must not be negative, not {value!r}")
        if not 0 < self.first_sleep_s <= self.max_sleep_s < math.inf:
            raise ValueError(
                "WaitPolicy needs 0 < first_sleep_s <= max_sleep_s < inf, got "
                f"first_sleep_s={self.first_sleep_s!r}, max_sleep_s={self.max_sleep_s!r}"
            )
        if self.cpu_budget > 1:
            raise ValueError(f"WaitPolicy.cpu_budget is a share of the wait, 0 to 1, not {self.cpu_budget!r}")


PolicyName = Literal["balanced", "low_latency", "low_cpu"]

PRESETS: Final[dict[str, WaitPolicy]] = {
    "balanced": WaitPolicy(),
    "low_latency": WaitPolicy(spin_s=math.inf, predict=False),
    "low_cpu": WaitPolicy(spin_s=20e-6, first_sleep_s=200e-6, max_sleep_s=2e-3, cpu_budget=0.01),
}

_policy = PRESETS["balanced"]


def set_wait_policy(policy: WaitPolicy | PolicyName) -> WaitPolicy:
    """Set how every waiter in the process polls; return the previous policy.

    ``policy`` is a :class:`WaitPolicy` or a preset's name: ``"balanced"``
    (default: CPU at most about 5 % while waiting on long work, and
    repeating work noticed within tens of µs), ``"low_latency"`` (spin for the
    whole wait: one busy core per waiting thread or loop) or ``"low_cpu"``
    (short spins, longer sleeps). Takes effect at each waiter's next poll.
    """
    global _policy
    if isinstance(policy, str):
        try:
            new = PRESETS[policy]
        except KeyError:
            raise ValueError(
                f"unknown wait policy {policy!r}; use one of {sorted(PRESETS)} or a WaitPolicy"
            ) from None
    elif isinstance(policy, WaitPolicy):
        new = policy
    else:
        raise TypeError(f"set_wait_policy() needs a WaitPolicy or a preset name, not {policy!r}")
    old, _policy = _policy, new
    return old


def get_wait_policy() -> WaitPolicy:
    """The policy in force (see :func:`set_wait_policy`)."""
    return _policy


class _StreamStats:
    __slots__ = ("dev", "done_at", "est")

    def __init__(self, est: float, done_at: float) -> None:
        self.est = est
        self.dev = 0.0
        self.done_at = done_at


class Predictor:
    """How long the work behind a record on each stream is expected to take.

    A record's work starts when it was recorded or when the previous
    completion seen on its stream happened, whichever is later. Observations
    are intervals ``(last seen pending, first seen complete]``; the estimate
    moves towards the nearest point of each interval, so late observations
    (after a long sleep) never inflate it. Shared by all threads: a race
    only blurs an estimate.
    """

    def __init__(self) -> None:
        self._stats: dict[tuple[int, ...], _StreamStats] = {}

    def clear(self) -> None:
        self._stats.clear()

    def _start(self, rec: EventRecord, stats: _StreamStats | None) -> float:
        if stats is None or stats.done_at < rec.t:
            return rec.t
        return stats.done_at

    def expected(self, rec: EventRecord) -> tuple[float, float, float] | None:
        """``(expected end, estimated duration, deviation)``, or None."""
        stats = self._stats.get(rec.stream_key)
        if stats is None:
            return None
        return self._start(rec, stats) + stats.est, stats.est, stats.dev

    def observe(self, rec: EventRecord, now: float) -> None:
        """``rec`` was seen complete at ``now`` (and pending at ``rec.seen``)."""
        table = self._stats
        stats = table.get(rec.stream_key)
        start = self._start(rec, stats)
        high = now - start
        low = max(0.0, rec.seen - start) if rec.seen else 0.0
        if stats is None:
            if len(table) >= _MAX_STREAMS:
                table.clear()
            # First sight: the lower bound, so that next time the waiter
            # wakes early rather than late.
            table[rec.stream_key] = _StreamStats(high if high - low <= _EXACT_S else low, now)
            return
        est = stats.est
        seen = min(max(est, low), high)  # the interval's point nearest the estimate
        if seen == est and high - low > _EXACT_S:
            # A wide interval that holds the estimate (a wake-up after the
            # end) cannot tell an estimate that is too long: shrink it a
            # little, so that a biased one comes back to where spinning
            # observes the end exactly again.
            seen = est * _SHRINK
        stats.dev += _ALPHA * (abs(seen - est) - stats.dev)
        stats.est = est + _ALPHA * (seen - est)
        stats.done_at = now


predictor: Final = Predictor()


class Pacer:
    """One sleeper's pacing: when it polls next, and how late it wakes.

    Not thread-safe: each sleeper owns one (the blocking waits of
    ``result()`` share one lateness history, where a race only blurs it).
    """

    __slots__ = ("_asked", "_backoff", "_late_mean", "_late_q", "_lateness", "spin_ends", "spin_until")

    def __init__(self, lateness: deque[float] | None = None) -> None:
        #: End of the spin that follows a new wait (see :meth:`kick`).
        self.spin_until = 0.0
        #: While the last plan was "spin", until when it holds: polls before
        #: then need no new plan unless something fired.
        self.spin_ends = 0.0
        self._backoff = _policy.first_sleep_s
        self._asked = 0.0
        # Blocking waits share one history: each call is too short to learn.
        self._lateness = deque(maxlen=32) if lateness is None else lateness
        self._late_mean = self._late_q = _DEFAULT_LATENESS_S
        if self._lateness:
            self._summarise()

    def kick(self, now: float) -> None:
        """A new wait began: spin for a while, then start the sleeps afresh."""
        policy = _policy
        self.spin_until = now + policy.spin_s
        self._backoff = policy.first_sleep_s

    def sleeping_until(self, when: float) -> None:
        self._asked = when

    def woke(self, now: float) -> None:
        """The sleep asked for with :meth:`sleeping_until` ended (by its timer)."""
        if self._asked:
            self._lateness.append(max(0.0, now - self._asked))
            self._asked = 0.0
            self._summarise()

    def interrupted(self) -> None:
        """The sleep ended early (a new wait): it says nothing of lateness."""
        self._asked = 0.0

    def _summarise(self) -> None:
        late = sorted(self._lateness)
        self._late_mean = late[len(late) // 2]  # the median: robust to a rare long stall
        self._late_q = late[(len(late) * 4) // 5]  # the 80th percentile

    def margin(self, est: float, policy: WaitPolicy) -> float:
        """How long before a predicted end to ask to be woken: long enough
        for most wake-ups to land before it, unless that would spin for more
        than ``cpu_budget`` of the wait on average."""
        return min(self._late_q + _WARM_S, self._late_mean + policy.cpu_budget * est)

    def next_poll(self, records: Iterable[EventRecord], now: float) -> float:
        """When to poll next for ``records`` (the oldest pending record of
        each stream); a time not after ``now`` means "poll again at once",
        and :attr:`spin_ends` then says for how long that holds."""
        policy = _policy
        best = math.inf
        unknown = False
        for rec in records:
            expected = predictor.expected(rec) if policy.predict else None
            if expected is not None:
                end, est, dev = expected
                # Jitter widens the spin, but never beyond a tenth of the
                # work: erratic durations must not turn into long spins.
                jitter = min(2 * dev, 0.1 * est)
                overrun = end + policy.spin_s + 2 * jitter
                if now <= overrun:  # else it runs long this time: stop trusting it
                    when = end - jitter - self.margin(est, policy)
                    if when <= now:
                        self.spin_ends = min(overrun, now + policy.max_sleep_s)
                        return now
                    best = min(best, when)
                    continue
            if now < self.spin_until:
                self.spin_ends = min(self.spin_until, now + policy.max_sleep_s)
                return now
            unknown = True
        self.spin_ends = 0.0
        if unknown and now + self._backoff < best:
            best = now + self._backoff
            self._backoff = min(self._backoff * 2, policy.max_sleep_s)
        return best


def sleep_until(deadline: float, pacer: Pacer) -> None:
    """Block the thread until ``deadline`` (a ``perf_counter`` time), GIL released."""
    pacer.sleeping_until(deadline)
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    pacer.woke(time.perf_counter())
