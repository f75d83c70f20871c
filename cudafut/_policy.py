"""When to poll: the wait policy, learnt durations, and pacing.

Two measured facts shape every waiter here (docs/performance.md): a thread
that slept for milliseconds takes 100-500 µs to wake up, whoever wakes it,
and only spinning notices completion within microseconds. So a waiter spins
only while completion is likely near:

* right after a new wait, for ``spin_s`` (short work is seen at once);
* around the durations it has learnt for the stream (work on a stream tends
  to repeat, or to come in a few sizes): from shortly before each learnt
  duration ends to shortly after;
* otherwise it sleeps, in steps growing from ``first_sleep_s`` to
  ``max_sleep_s``; every step is a poll, so errors are seen too.

**Bounded regret.** No sleep is ever planned longer than ``max_sleep_s``,
whatever the predictor believes: a completion is noticed at most
``max_sleep_s`` after it happens, plus the time the operating system takes
to wake the sleeper; or, where a CUDA notice is armed for every stream
waited on (``WaitPolicy.notify``), when the notice arrives, a poll at most
``notice_sleep_s`` or ``predicted_sleep_s`` apart catching what a notice
cannot report. A wrong prediction can waste CPU (a spin at the wrong
time), never more latency than that.

The :class:`Predictor` learns from every completion a waiter sees, one
history per stream. A :class:`Pacer` is one sleeper's state (an event loop's
driver, the watcher thread, the threads blocked in ``result()``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from . import _checks, _compiled
from ._log import logger

if TYPE_CHECKING:
    from ._events import EventRecord

# The debug log of the waiters' decisions (``logging.getLogger("cudafut")`` at
# DEBUG). It is asked for with ``logger.isEnabledFor(DEBUG)`` (logging caches
# the answer: about 70 ns, measured on Python 3.11) only where a waiter
# plans a sleep or a spin, learns modes or is surprised: never on the poll
# that merely goes on spinning. A plan costs 1-3 µs and is followed by a
# sleep of at least 20 µs or by wake-ups of about 10 µs each, so the check is
# lost in the noise, and it follows level changes at once (a flag of our own
# would need refreshing).
_DEBUG: Final = logging.DEBUG

#: Observations kept per stream: the window in which modes are found.
_HISTORY: Final = 16
#: A duration needs this many recent observations close to each other to be
#: trusted, or the two newest ones (work that just changed and repeats): one
#: long job must not move the waiter (it did, once: one 50 ms job made forty
#: 2 ms jobs wake 34 ms late). With 3, random durations formed chance
#: clusters often enough to spin for ends that did not come.
_MODE_MIN: Final = 4
#: ... and one of them among the newest observations: work that moved on is
#: forgotten quickly.
_RECENT: Final = 8
#: Observations within this relative distance of each other belong to one
#: mode; beyond this absolute spread a mode is too erratic to spin for.
_MODE_REL: Final = 0.15
_MODE_ABS_S: Final = 20e-6
#: A mode is spun for only if its spread (newest members) is at most this
#: share of its duration (or ``spin_s``): a wider one would cost more CPU than
#: it saves latency.
_MAX_SPREAD: Final = 0.2
#: Members of a mode that set its window: the newest ones, so that a slow
#: drift is followed.
_MODE_NEWEST: Final = 4
#: Observations that fall in a mode widen it; the modes are found afresh
#: after this many, or at once after one that falls in none.
_REFRESH: Final = 4
#: An observation narrower than this (or than 5 % of the duration) is exact.
_EXACT_S: Final = 50e-6
_EXACT_REL: Final = 0.05
#: Lateness assumed before a sleeper has measured its own.
_DEFAULT_LATENESS_S: Final = 300e-6
#: The longest spin before a predicted end, beyond the sleeper's median
#: lateness (``cpu_budget`` of the duration below it): a thread that slept
#: for most of a long wait runs slowly for a while after it wakes (cold
#: caches, a waking vCPU), and the spin should be warm when the work
#: completes. On an H200 host, alternated in one ``vary`` run (3 rounds,
#: benchmarks/results/waiter-variants-h200.txt), 0.4 ms in place of 2 ms
#: (1 ms before 20 ms work) cost 0.056 of a core instead of 0.083 on
#: stable 20 ms work, at the same median wake-up (+146 against +145 µs).
_WARM_S: Final = 0.4e-3
#: A waiter of one stream sleeps through predicted work under a notice
#: (``WaitPolicy.predicted_sleep_s``) where that saves more than this many
#: polls ``max_sleep_s`` apart: a notice (its pipe, its arming, the notice
#: thread's wake-up and the loop's) costs the host about as much CPU as 5
#: of them (the ``vary`` benchmark, one H200 host). A waiter of several
#: streams polls them all at once, and a notice per stream costs more than
#: the polls it saves: it polls.
_NOTICE_POLLS: Final = 6
#: Streams whose histories are kept; beyond this the table starts afresh.
_MAX_STREAMS: Final = 4096


#: The longest sleep a waiter can take: ``threading`` refuses longer waits
#: (``OverflowError``), and a timerfd takes nanoseconds in 64 bits.
MAX_SLEEP_LIMIT_S: Final = _checks.NO_LIMIT


@dataclass(frozen=True)
class WaitPolicy:
    """How cudafut's waiters trade CPU time for wake-up latency.

    Every ``await``, :meth:`~cudafut.CudaFuture.result` and done-callback
    learns that GPU work completed by polling its CUDA event. Set the policy
    with :func:`set_wait_policy`; the presets are ``"balanced"`` (the
    default), ``"low_latency"`` and ``"low_cpu"``.

    Whatever the policy and whatever was learnt, no sleep between two polls
    is longer than ``max_sleep_s``: a completion is noticed at most
    ``max_sleep_s`` after it happens, plus the operating system's wake-up
    delay (docs/performance.md, "Bounded regret"). The exceptions are
    sleeps with a notice armed for every stream they wait on, which the
    notice ends when the work completes (a notice lost to a context error
    is caught by the sleep's end): up to ``notice_sleep_s`` where that is
    set above ``max_sleep_s``, and up to ``predicted_sleep_s`` through
    predicted work on one stream.

    CUDA notices are on by default (``notify=True``), beside polls at most
    ``max_sleep_s`` apart (``notice_sleep_s`` = 1 ms): whichever comes first
    ends the wait. In the ``vary`` benchmark (docs/performance.md), work
    that no learnt duration covers (random durations, the jobs after a
    step) was noticed sooner at p90 than with the polls alone, at about
    the same CPU; ``WaitPolicy(notify=False)`` polls on timers only.
    An await of a future received from another process never arms a
    notice: it polls on timers (a notice would be GPU work in this
    process's own CUDA context, one per future; the multi-process serving
    recipe measured better without: docs/processes.md, "Received futures
    poll on timers").
    The first notice on a device makes its 32 notice streams on a helper
    thread; CUDA may hold that creation, and other CUDA calls of the
    process with it, until the GPU's running work ends (docs/design.md,
    hazard 11), once per device. Where running work can only end by a CUDA
    call of the same process (an NCCL collective whose peer died, ended by
    its abort), that wait would never end: a
    :class:`cudafut.distributed.ProcessGroup` makes the streams when it is
    made, before its first collective (waiting up to 10 s for them, with a
    warning past that); around such work of your own, use ``notify=False``
    until a first notice has been made.

    Attributes:
        spin_s: after a new wait, poll continuously (yielding to the event
            loop between polls) for this many seconds. ``math.inf`` spins
            for the whole wait: the lowest latency, one busy core.
        first_sleep_s: the first sleep once spinning stopped, for work of
            unknown duration; each further sleep doubles, up to
            ``max_sleep_s``.
        max_sleep_s: the longest sleep between two polls: the bound on how
            late any completion is noticed.
        predict: learn the durations of work on each stream, and spin around
            the expected ends of durations that repeat.
        cpu_budget: for predicted work, the largest share of the wait that
            may be spent spinning before the expected end (0 to 1).
        notify: on by default. Where no learnt duration says when work
            ends (unknown or unpredictable work), an asyncio or uvloop
            waiter asks CUDA for a notice, and polls on a timer only as
            often as ``notice_sleep_s`` says: a native notice thread (or a
            host function that is libc's ``close()``) closes a pipe the
            loop watches, after the oldest pending event of each stream (no
            Python runs on CUDA's threads: docs/design.md, hazard 1). One
            notice per stream at a time, not one per await, each costing a
            stream wait and an event record on the loop's thread. Trio and
            blocking waits (``result()``) poll on timers either way.
        notice_sleep_s: with ``notify=True``, the longest sleep while
            notices are armed for every stream waited on: a poll that also
            catches what a notice cannot report. CUDA runs no host function
            after a context error, so a sticky error is seen at most this
            late, as is a failure decided on the host (a collective past its
            timeout). Less than ``max_sleep_s`` counts as ``max_sleep_s``
            (the default, 1 ms: a poll at least every ``max_sleep_s``, as
            without notices; a longer one polls less and leaves the wait to
            the notice: later at p90 in ``vary``).
        predicted_sleep_s: with ``notify=True`` and ``predict=True``, an
            asyncio or uvloop waiter of one stream whose work is predicted
            to end more than six ``max_sleep_s`` from now arms a notice
            for the stream, which ends the sleep if the work ends early,
            and sleeps until the spin before the predicted end, at most
            this long, instead of polling ``max_sleep_s`` apart (each poll
            a wake-up of the loop; a notice costs about five). A sticky
            error, or a failure decided on the host, is seen at most this
            late during such work. A waiter of several streams polls them
            all at once and asks no notice for predicted work. At most
            ``max_sleep_s``: none either.

    Every number may be any real number (NumPy scalars and ``Fraction``
    included, bools not).

    Raises:
        TypeError: a field that is not a number (``predict``, ``notify``:
            not a bool).
        ValueError: a negative or NaN number, one too large for a float (an
            ``int`` beyond 1.8e308: use ``math.inf`` for ``spin_s``),
            ``first_sleep_s`` not in ``(0, max_sleep_s]``, a ``max_sleep_s``
            longer than a thread can sleep (``threading.TIMEOUT_MAX``, about
            292 years; infinite included), a ``cpu_budget`` over 1, or a
            ``notice_sleep_s`` longer than a thread can sleep.
    """

    spin_s: float = 100e-6
    first_sleep_s: float = 50e-6
    max_sleep_s: float = 1e-3
    predict: bool = True
    cpu_budget: float = 0.05
    notify: bool = True
    notice_sleep_s: float = 1e-3
    predicted_sleep_s: float = 20e-3

    def __post_init__(self) -> None:
        values = {}
        for name in (
            "spin_s",
            "first_sleep_s",
            "max_sleep_s",
            "cpu_budget",
            "notice_sleep_s",
            "predicted_sleep_s",
        ):
            value = values[name] = _checks.real_number(getattr(self, name), f"WaitPolicy.{name}")
            if value < 0:
                raise ValueError(f"WaitPolicy.{name} must not be negative, not {getattr(self, name)!r}")
            # Plain floats for the waiters' arithmetic (a Fraction or NumPy
            # scalar would slow every plan down, or change its types).
            object.__setattr__(self, name, value)
        for flag in ("predict", "notify"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"WaitPolicy.{flag} must be True or False, not {getattr(self, flag)!r}")
        first, most = values["first_sleep_s"], values["max_sleep_s"]
        if not 0 < first <= most < math.inf:
            raise ValueError(
                "WaitPolicy needs 0 < first_sleep_s <= max_sleep_s < inf, got "
                f"first_sleep_s={self.first_sleep_s!r}, max_sleep_s={self.max_sleep_s!r}"
            )
        if most > MAX_SLEEP_LIMIT_S:
            raise ValueError(
                f"WaitPolicy.max_sleep_s={self.max_sleep_s!r} is longer than a thread can sleep "
                f"({MAX_SLEEP_LIMIT_S:g} s, threading.TIMEOUT_MAX); it bounds how late a completion "
                "is noticed: a few ms is usual"
            )
        if values["notice_sleep_s"] > MAX_SLEEP_LIMIT_S:
            raise ValueError(
                f"WaitPolicy.notice_sleep_s={self.notice_sleep_s!r} is longer than a thread can sleep "
                f"({MAX_SLEEP_LIMIT_S:g} s): it bounds how late an error a notice cannot report is "
                "seen; tens of ms is usual"
            )
        if values["predicted_sleep_s"] > MAX_SLEEP_LIMIT_S:
            raise ValueError(
                f"WaitPolicy.predicted_sleep_s={self.predicted_sleep_s!r} is longer than a thread can "
                f"sleep ({MAX_SLEEP_LIMIT_S:g} s): it bounds how late an error a notice cannot report "
                "is seen during predicted work; tens of ms is usual"
            )
        if values["cpu_budget"] > 1:
            raise ValueError(f"WaitPolicy.cpu_budget is a share of the wait, 0 to 1, not {self.cpu_budget!r}")


PolicyName = Literal["balanced", "low_latency", "low_cpu"]

PRESETS: Final[dict[str, WaitPolicy]] = {
    "balanced": WaitPolicy(),
    # low_latency spins for the whole wait: a notice would only cost its arm.
    "low_latency": WaitPolicy(spin_s=math.inf, predict=False, notify=False),
    # low_cpu as measured in vary: timed polls only.
    "low_cpu": WaitPolicy(
        spin_s=20e-6, first_sleep_s=200e-6, max_sleep_s=2e-3, cpu_budget=0.01, notify=False
    ),
}

_policy = PRESETS["balanced"]


def set_wait_policy(policy: WaitPolicy | PolicyName) -> WaitPolicy:
    """Set how every waiter in the process polls; return the previous policy.

    ``policy`` is a :class:`WaitPolicy` or a preset's name: ``"balanced"``
    (default: spins around learnt durations, otherwise CUDA notices and
    sleeps of at most 1 ms), ``"low_latency"`` (spin for the whole wait: one
    busy core per waiting thread or loop) or ``"low_cpu"`` (short spins,
    sleeps of up to 2 ms, no notices). Takes effect at each waiter's next
    poll. Costs nothing.

    Raises:
        ValueError: an unknown preset name.
        TypeError: neither a :class:`WaitPolicy` nor a string.
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
    """The policy in force (see :func:`set_wait_policy`). Costs nothing."""
    return _policy


class Mode(NamedTuple):
    """A duration that recent work on a stream keeps taking.

    ``low`` and ``high`` bound the newest members; ``center`` is their
    median. Durations are in seconds, from the start of the work.
    """

    low: float
    high: float
    center: float

    def holds(self, duration: float) -> bool:
        """Whether ``duration`` falls in this mode, give or take its tolerance."""
        return (
            self.low * (1 - _MODE_REL) - _MODE_ABS_S <= duration <= self.high * (1 + _MODE_REL) + _MODE_ABS_S
        )


class _History:
    __slots__ = ("done_at", "modes", "points", "stale", "surprised")

    def __init__(self, done_at: float) -> None:
        #: Durations observed, newest last: ``(point, exact)``.
        self.points: deque[tuple[float, bool]] = deque(maxlen=_HISTORY)
        self.done_at = done_at
        #: Found from ``points`` when first asked for after an observation
        #: (None until then): off the path from completion to wake-up.
        self.modes: tuple[Mode, ...] | None = ()
        #: Observations since the modes were last found afresh.
        self.stale = 0
        #: Whether the newest observation fell outside every mode: the work
        #: may have changed, so the next wait also polls as for unknown work.
        self.surprised = True


def _find_modes(points: deque[tuple[float, bool]]) -> tuple[Mode, ...]:
    """Clusters of at least ``_MODE_MIN`` observations, one of them recent,
    or of the two newest ones, narrow enough to spin for; sorted by duration.
    About 5 µs for a full history."""
    # A snapshot first: other threads append to ``points`` meanwhile, and
    # iterating a deque that changes raises RuntimeError. ``list(deque)`` is
    # one C call that runs no Python code, so no other thread can append
    # during it.
    snapshot = list(points)
    n = len(snapshot)
    if n < 2:
        return ()
    # (duration, age rank, exact), sorted by duration. Single linkage: a slow
    # drift stays one cluster; the spread check keeps chains of unrelated
    # durations out.
    ranked = sorted([(p, i, exact) for i, (p, exact) in enumerate(snapshot)])
    spin_s = _policy.spin_s
    modes = []
    first = 0
    for end in range(1, n + 1):
        if end < n and ranked[end][0] <= ranked[end - 1][0] * (1 + _MODE_REL) + _MODE_ABS_S:
            continue
        members, first = ranked[first:end], end
        size = len(members)
        if size < 2:
            continue
        ages = [m[1] for m in members]
        if size < _MODE_MIN:
            if min(ages) != n - 2:  # not the two newest
                continue
        elif max(ages) < n - _RECENT:
            continue
        # The newest members set the window (exact ones when there are two).
        members.sort(key=_age, reverse=True)
        exact = [m for m in members if m[2]]
        values = sorted([m[0] for m in (exact if len(exact) >= 2 else members)[:_MODE_NEWEST]])
        low, high = values[0], values[-1]
        center = values[len(values) // 2]
        if high - low <= max(_MAX_SPREAD * center, spin_s):
            modes.append(Mode(low, high, center))
    return tuple(modes)


def _age(member: tuple[float, int, bool]) -> int:
    return member[1]


def _modes_of(hist: _History) -> tuple[Mode, ...]:
    modes = hist.modes
    if modes is None:
        modes = hist.modes = _find_modes(hist.points)
        hist.stale = 0
    return modes


class Predictor:
    """The durations that work recorded on each stream is expected to take.

    A record's work starts when it was recorded or when the previous
    completion seen on its stream happened, whichever is later. Each
    completion seen is an observation: the work took between ``low`` (last
    seen pending) and ``high`` (first seen complete). The newest
    ``_HISTORY`` observations of a stream are kept, and a *mode* is a
    cluster of at least ``_MODE_MIN`` of them close to each other, one among
    the newest ``_RECENT``, or of the two newest observations when they
    agree (work that just changed). Work of a stable duration has one mode, bimodal
    work two, random work usually none: only modes are spun for, so a
    one-off duration never moves the waiter, and work that turned shorter is
    noticed by the ordinary polls.

    Shared by all threads: a race only blurs a history.
    """

    def __init__(self) -> None:
        #: One history per stream key. The native core's :class:`Pacer`
        #: reads it (never changes it) to plan without a Python call per
        #: stream: it is cleared in place, never replaced.
        self.histories: dict[tuple[int, ...], _History] = {}

    def clear(self) -> None:
        self.histories.clear()

    def __len__(self) -> int:
        return len(self.histories)

    def start(self, rec: EventRecord) -> float:
        """When ``rec``'s work is taken to start (a ``perf_counter`` time)."""
        hist = self.histories.get(rec.stream_key)
        if hist is None or hist.done_at < rec.t:
            return rec.t
        return hist.done_at

    def modes(self, rec: EventRecord) -> tuple[tuple[Mode, ...], bool]:
        """The modes of ``rec``'s stream, shortest first (maybe none), and
        whether the stream's newest observation fell outside all of them."""
        hist = self.histories.get(rec.stream_key)
        if hist is None:
            return (), True
        if hist.modes is None and logger.isEnabledFor(_DEBUG):  # found afresh: say what
            found = _modes_of(hist)
            logger.debug(
                "cudafut: %s: modes %s, from %d observations (%s)",
                _stream(rec.stream_key),
                _modes_text(found) or "none",
                len(hist.points),
                ", ".join(_ms(p) for p, _exact in hist.points),
            )
        return _modes_of(hist), hist.surprised

    def observe(self, rec: EventRecord, now: float) -> None:
        """``rec`` was seen complete at ``now`` (and pending at ``rec.seen``)."""
        table = self.histories
        hist = table.get(rec.stream_key)
        start = rec.t if hist is None or hist.done_at < rec.t else hist.done_at
        high = max(0.0, now - start)
        low = max(0.0, rec.seen - start) if rec.seen else 0.0
        low = min(low, high)
        if hist is None:
            if len(table) >= _MAX_STREAMS:
                table.clear()
            hist = table[rec.stream_key] = _History(now)
        exact = high - low <= max(_EXACT_S, _EXACT_REL * high)
        # An interval's midpoint: unbiased whether the poll came early or late.
        point = high if exact else (low + high) / 2
        modes = _modes_of(hist)  # as the wait was planned with: found already
        hist.points.append((point, exact))
        hist.done_at = now
        for k, mode in enumerate(modes):
            if mode.holds(point):
                hist.surprised = False
                if hist.stale < _REFRESH:
                    # Cheap: widen the mode to the point; modes are found
                    # afresh (about 5-20 µs) only every few observations.
                    hist.stale += 1
                    if not mode.low <= point <= mode.high:
                        widened = Mode(min(mode.low, point), max(mode.high, point), mode.center)
                        hist.modes = (*modes[:k], widened, *modes[k + 1 :])
                    return
                break
        else:
            hist.surprised = True
            if modes and logger.isEnabledFor(_DEBUG):
                logger.debug(
                    "cudafut: %s: surprise: work took %s, in none of its modes %s; "
                    "polling it as work of unknown duration until the modes are found again",
                    _stream(rec.stream_key),
                    _ms(point),
                    _modes_text(modes),
                )
        hist.modes = None  # found again when next asked for, off this path


predictor: Final = Predictor()


class Pacer:
    """One sleeper's pacing: when it polls next, and how late it wakes.

    Not thread-safe: each sleeper owns one (the blocking waits of
    ``result()`` share one lateness history, where a race only blurs it).
    """

    __slots__ = (
        "_asked",
        "_backoff",
        "_late_median",
        "_lateness",
        "_retract",
        "name",
        "spin_ends",
        "spin_until",
    )

    def __init__(self, lateness: deque[float] | None = None, name: str = "waiter") -> None:
        #: Who sleeps (for the debug log): "asyncio waiter", "result()", ...
        self.name = name
        #: End of the spin that follows a new wait (see :meth:`new_wait`).
        self.spin_until = 0.0
        #: While the last plan was "spin", until when it holds: polls before
        #: then need no new plan unless something fired.
        self.spin_ends = 0.0
        self._backoff = _policy.first_sleep_s
        # The back-off before the last plan's step (0.0: that plan took
        # none): what retract() restores.
        self._retract = 0.0
        self._asked = 0.0
        # Blocking waits share one history: each call is too short to learn.
        self._lateness = deque(maxlen=32) if lateness is None else lateness
        self._late_median = _DEFAULT_LATENESS_S
        if self._lateness:
            self._summarise()

    def new_wait(self, now: float) -> None:
        """A new wait began: spin for a while, then start the sleeps afresh."""
        policy = _policy
        self.spin_until = now + policy.spin_s
        self._backoff = policy.first_sleep_s
        self._retract = 0.0

    def retract(self) -> None:
        """The last plan's sleep was not taken (a lone await handed its
        wait to the loop's waiter instead, which plans again): the back-off
        steps back to where that plan found it, so the waiter's first sleep
        is the one that plan chose, not twice it."""
        if self._retract:
            self._backoff = self._retract
            self._retract = 0.0

    def sleeping_until(self, when: float) -> None:
        """The sleeper is about to sleep until ``when``."""
        self._asked = when

    def woke(self, now: float) -> None:
        """The sleep asked for with :meth:`sleeping_until` ended (by its timer)."""
        if self._asked:
            late = max(0.0, now - self._asked)
            self._lateness.append(late)
            self._asked = 0.0
            self._summarise()
            if logger.isEnabledFor(_DEBUG):
                log_woke(self.name, late, self._late_median)

    def interrupted(self) -> None:
        """The sleep ended early (a new wait): it says nothing of lateness."""
        self._asked = 0.0

    def _summarise(self) -> None:
        late = sorted(self._lateness)
        self._late_median = late[len(late) // 2]  # robust to a rare long stall

    def margin(self, duration: float, policy: WaitPolicy) -> float:
        """How long before a predicted end to ask to be woken: the median
        lateness, plus a warm-up spin of ``cpu_budget`` of the duration (at
        most ``_WARM_S``): long work spends its budget warming up, short
        work spins no longer than it did."""
        return self._late_median + min(policy.cpu_budget * duration, _WARM_S)

    def next_poll(
        self, records: Sequence[EventRecord], now: float, arm: Callable[[EventRecord], bool] | None = None
    ) -> float:
        """When to poll next for ``records`` (the oldest pending record of
        each stream); a time not after ``now`` means "poll again at once",
        and :attr:`spin_ends` then says for how long that holds.

        ``arm(record)``, if given and the policy says ``notify``, is asked
        for a notice when ``record``'s work ends, for each record that no
        learnt duration covers (once the spin after a new wait is over);
        True means one is armed (now or earlier), so that no timed poll is
        needed for it.

        Never later than ``now + max_sleep_s``: the bound on regret; or
        ``now + notice_sleep_s`` when every record has a notice armed.
        """
        policy = _policy
        spin_s = policy.spin_s
        bound = now + policy.max_sleep_s
        best = math.inf
        self._retract = 0.0
        backoff = False
        noticed = False
        covered = False  # a predicted record whose notice reports an early end
        bounded = False
        if not policy.notify:
            arm = None
        # Predicted work is covered by notices for a waiter of one stream only.
        cover = arm is not None and len(records) == 1 and policy.predicted_sleep_s > policy.max_sleep_s
        spin_ends = 0.0
        for rec in records:
            modes, surprised = predictor.modes(rec) if policy.predict else ((), True)
            ahead = False  # a mode's window is open now or still to come
            until = 0.0  # how long until that window opens
            if modes:
                start = predictor.start(rec)
                for mode in modes:
                    opens = start + mode.low - self.margin(mode.center, policy)
                    closes = start + mode.high + spin_s + (mode.high - mode.low)
                    if now < opens:
                        best = min(best, opens)
                        until = opens - now
                        ahead = True
                        break
                    if now < closes:
                        spin_ends = max(spin_ends, closes)
                        ahead = True
                        break
            if ahead and not surprised:
                # Predicted: until its window opens, polled by the bound in
                # case it ends early; or, alone and far enough from it, by a
                # notice, which reports an early end (_NOTICE_POLLS).
                if cover and until > _NOTICE_POLLS * policy.max_sleep_s and arm is not None and arm(rec):
                    covered = True
                else:
                    bounded = True
                continue
            # Unknown work, work past every mode (it runs longer than learnt
            # this time), or a stream whose work just changed: spin after a
            # new wait, then sleep in growing steps.
            if now < self.spin_until:
                spin_ends = max(spin_ends, self.spin_until)
            elif arm is not None and arm(rec):
                noticed = True  # the notice wakes the waiter: no timed poll for it
            else:
                backoff = True
        if spin_ends:
            self.spin_ends = min(spin_ends, bound)
            if logger.isEnabledFor(_DEBUG):
                explain(self, records, now, now, policy)
            return now
        self.spin_ends = 0.0
        if backoff and now + self._backoff < best:
            best = now + self._backoff
            self._retract = self._backoff
            self._backoff = min(self._backoff * 2, policy.max_sleep_s)
        elif not backoff and not bounded:  # every record has a notice
            if noticed:
                bound = now + max(policy.notice_sleep_s, policy.max_sleep_s)
                if covered:
                    bound = min(bound, now + policy.predicted_sleep_s)
            elif covered:
                bound = now + policy.predicted_sleep_s
        when = min(best, bound)
        if logger.isEnabledFor(_DEBUG):
            explain(self, records, now, when, policy)
        return when


def explain(
    pacer: Pacer, records: Sequence[EventRecord], now: float, when: float, policy: WaitPolicy
) -> None:
    """Log the plan ``pacer.next_poll()`` just made, and why (debug only;
    both cores' pacers call it)."""
    if when <= now:
        plan = f"spin for {_us(pacer.spin_ends - now)}"
    else:
        plan = f"sleep {_us(when - now)}" + (
            " (the bound, max_sleep_s)" if when >= now + policy.max_sleep_s else ""
        )
    why = []
    for rec in records:
        modes, surprised = predictor.modes(rec) if policy.predict else ((), True)
        start = predictor.start(rec)
        if not modes:
            text = "no modes learnt"
        else:
            text = f"modes {_modes_text(modes)}" + (", newest fell in none" if surprised else "")
            for mode in modes:
                opens = start + mode.low - pacer.margin(mode.center, policy)
                if now < opens:
                    text += f", the {_ms(mode.center)} mode's spin starts in {_us(opens - now)}"
                    break
                if now < start + mode.high + policy.spin_s + (mode.high - mode.low):
                    text += f", in the {_ms(mode.center)} mode's spin"
                    break
            else:
                text += ", past every mode"
        if now < pacer.spin_until:
            text += ", a new wait"
        why.append(f"{_stream(rec.stream_key)}: work started {_ms(now - start)} ago, {text}")
    logger.debug("cudafut: %s: %s; %s", pacer.name, plan, "; ".join(why) or "nothing watched")


def log_woke(name: str, late: float, median: float) -> None:
    """Log how late a timed sleep ended (debug only; both cores' pacers call it)."""
    logger.debug(
        "cudafut: %s: woke %s after the time planned (median lateness %s)", name, _us(late), _us(median)
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _modes_text(modes: Sequence[Mode]) -> str:
    return (
        "[" + ", ".join(f"{_ms(m.center)} ({_ms(m.low)}-{_ms(m.high)})" for m in modes) + "]" if modes else ""
    )


def _stream(key: tuple[int, ...]) -> str:
    return f"device {key[0]} stream {key[1]:#x}" + (f" (thread {key[2]:#x})" if len(key) > 2 else "")


def sleep_until(deadline: float, pacer: Pacer) -> None:
    """Block the thread until ``deadline`` (a ``perf_counter`` time), GIL released."""
    pacer.sleeping_until(deadline)
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    pacer.woke(time.perf_counter())


# The native core's twin (cudafut/_core.pyx) where it runs: the same pacer
# with C fields, planning without a Python call per stream; the class above
# stays the reference (CUDAFUT_PURE=1).
_native = _compiled.native()
if _native is not None:
    _native.bind_policy(sys.modules[__name__])
    globals().update(Pacer=_native.Pacer)
