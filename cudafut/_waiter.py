"""The waiter: learning, without blocking anybody, that recorded events completed.

A :class:`Watchlist` keeps the records someone waits on in one sorted queue
per stream, ordered by the record's sequence number on that stream. Work on a
stream completes in order, so each poll queries only the oldest pending record
of each stream: the cost of a poll is one ``cudaEventQuery`` per busy stream,
whatever the number of waiters.

A :class:`Driver` owns one watchlist and runs it in one thread: the asyncio
and trio drivers (``_loops.py``) in their event loop, :class:`ThreadWaiter`
in a daemon thread for callers that have no loop. Watchlists are touched only
from their driver's thread; other threads hand work over with
:meth:`Driver.call_soon_threadsafe`.

:func:`block_until_complete` is the blocking wait of ``result()``, run in the
caller's thread.

No Python code here ever runs on a CUDA driver thread (docs/design.md,
hazard 1), and every wait polls the raw event status, so a sticky CUDA error
surfaces as an error instead of a hang (hazards 2 and 3).
"""

from __future__ import annotations

import abc
import bisect
import functools
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, cast

from . import _compiled, _lifetimes, _policy
from ._events import EventRecord, first_error
from ._log import logger
from ._policy import Pacer, predictor, sleep_until
from ._trace import hooks as _trace

#: Wake-ups run per poll at most. Work on a stream completes in order, so
#: thousands of waits can complete at once; firing them in slices keeps each
#: event loop step short (each wake-up resumes a task: about 20 µs) and the
#: loop responsive.
FIRE_PER_POLL: Final = 64

RecordCallback = Callable[[EventRecord], None]
DoneCallback = Callable[[Exception | None], None]


class Watch:
    """One waiter's interest in one record: an entry of its stream's queue
    itself (no tuple per entry, as every object alive per wait costs the
    cyclic GC). ``arrival``: its number in the order the watchlist took
    its watches (set by :meth:`Watchlist.add_watch`): a poll fires what
    completed on all streams in that order."""

    __slots__ = ("arrival", "callback", "record", "seq")

    arrival: int

    def __init__(self, record: EventRecord, callback: RecordCallback) -> None:
        self.record = record
        self.callback: RecordCallback | None = callback
        self.seq = record.seq


def _seq(watch: Watch) -> int:
    return watch.seq


def _gone() -> Watch:
    watch = Watch.__new__(Watch)
    watch.callback = None
    watch.seq = -1
    return watch


#: What replaces a queue entry once passed: it holds no record.
_GONE: Final = _gone()


class _Queue:
    """One stream's watches, sorted by the record's sequence number on the
    stream (arrival order among equals); those before ``head`` are gone.

    Records are nearly always awaited in the order they were recorded, so
    adding is an append and taking the oldest an index step: no heap, no
    comparisons in Python (a heap of watches cost 10 comparisons per wait at
    10,000 waits).
    """

    __slots__ = ("head", "watches")

    def __init__(self) -> None:
        self.watches: list[Watch] = []
        self.head = 0

    def add(self, watch: Watch) -> None:
        watches = self.watches
        if not watches or watches[-1].seq <= watch.seq:
            watches.append(watch)
        else:
            bisect.insort_right(watches, watch, lo=self.head, key=_seq)

    def advance(self, to: int) -> None:
        """Forget the watches before ``to``."""
        watches = self.watches
        if not self.head <= to <= len(watches):  # as the native twin, which must check
            raise IndexError(f"a queue of {len(watches)} watches cannot advance from {self.head} to {to}")
        for i in range(self.head, to):
            watches[i] = _GONE  # releases the record (and its event) now
        if to > 32 and to * 2 > len(watches):
            del watches[:to]
            to = 0
        self.head = to


class Watchlist:
    """Pending records in one queue per stream; not thread-safe by design."""

    def __init__(self, learn: bool = True) -> None:
        self._queues: dict[tuple[int, ...], _Queue] = {}
        #: Number of watches that have not fired nor been removed (a plain
        #: attribute, not a property: every await reads it).
        self.pending = 0
        # Whether completions teach the duration predictor: not from the
        # watcher thread, whose polls are coarse and about keep-alives.
        self._learn = learn
        #: What the polls saw complete first on each stream, ``(record,
        #: now)``, for the duration predictor: the driver that polls takes
        #: them (``Driver.poll``), and may teach them after the wake-ups
        #: they caused, off the path from completion to the awaiting code.
        self.learnt: list[tuple[EventRecord, float]] = []
        # The next watch's arrival number (Watch.arrival).
        self._arrived = 0

    @property
    def streams(self) -> int:
        """Number of streams with watched records (dead watches included)."""
        return len(self._queues)

    def add(self, record: EventRecord, callback: RecordCallback) -> Watch:
        return self.add_watch(Watch(record, callback))

    def add_watch(self, watch: Watch) -> Watch:
        """Add a watch made by the caller (its ``callback`` set): a subclass
        of :class:`Watch` may carry the wait's other state itself."""
        key = watch.record.stream_key
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        watch.arrival = self._arrived
        self._arrived += 1
        watches = queue.watches
        if watches and watches[-1].seq > watch.seq:
            queue.add(watch)  # out of order: a sorted insert
        else:
            watches.append(watch)  # _Queue.add's common case, inline: every wait comes here
        self.pending += 1
        return watch

    def clear(self) -> None:
        """Forget every watch, as :meth:`remove` does each: for a loop that
        ended, where none can fire any more. Their callbacks are dropped, and
        with them what they hold (futures, records, the loop's objects)."""
        for queue in self._queues.values():
            for watch in queue.watches:
                watch.callback = None
        self._queues.clear()
        self.pending = 0

    def remove(self, watch: Watch) -> None:
        """Forget a watch; a no-op if it fired or was removed already."""
        if watch.callback is not None:
            watch.callback = None
            self.pending -= 1
            if self.pending == 0:
                self._queues.clear()  # drop dead entries: an idle list holds nothing

    def poll(self, now: float, limit: int = 1 << 62) -> list[tuple[RecordCallback, EventRecord]]:
        """Query the oldest live record of each stream; return what fired,
        at most ``limit`` callbacks (the rest fire at the next poll).

        What completed fires in the order the watches were added (their
        ``arrival``), across streams: the completed prefix of each stream's
        queue (oldest first, as a stream completes) is merged by arrival, as
        plain futures released in the order their awaits came wake their
        tasks (10,000 awaits over 8 streams then wake in task order, not
        task 0, 8, 16, ...). Each stream's prefix is walked lazily: its next
        watch is queried once the one before it fired.

        ``now`` is the ``perf_counter()`` time of the poll: the first
        completion fired on each stream goes on :attr:`learnt` (for the
        duration predictor), pending records remember when they were seen.
        The caller runs the returned callbacks (they may add or remove
        watches, which must not happen while the queues are walked).
        """
        fired: list[tuple[RecordCallback, EventRecord]] = []
        if limit <= 0:
            return fired
        queues = self._queues
        keys = list(queues)
        walks: list[list[Any]] = []  # per stream: [queue, watches, at, end, first]
        heap: list[tuple[int, int]] = []  # (arrival, stream) of each stream's completed next watch
        for s, key in enumerate(keys):
            queue = queues[key]
            watches = queue.watches
            i, n = queue.head, len(watches)
            while i < n:
                watch = watches[i]
                if watch.callback is not None:
                    record = watch.record
                    if record.query() is None:
                        record.seen = now
                        break
                    if record.ordered and n - i > 2:
                        # Ask the newest: if it is complete, the native
                        # core's watermark answers every older one from
                        # memory, without a driver query each.
                        watches[n - 1].record.query()
                    heap.append((watch.arrival, s))
                    break
                i += 1
            walks.append([queue, watches, i, n, True])
        heapq.heapify(heap)
        while heap:
            s = heap[0][1]
            walk = walks[s]
            watches, i, n = walk[1], walk[2], walk[3]
            watch = watches[i]
            callback = watch.callback
            if callback is not None:  # (else removed meanwhile, by a query's reentrant code)
                record = watch.record
                if walk[4]:
                    if self._learn:  # later ones completed unseen: they teach nothing
                        self.learnt.append((record, now))
                    walk[4] = False
                watch.callback = None
                self.pending -= 1
                fired.append((callback, record))
            i += 1
            if len(fired) >= limit:
                while i < n and watches[i].callback is None:
                    i += 1
                walk[2] = i
                break
            joined = False
            while i < n:  # this stream's next live watch: complete, it joins the merge
                watch = watches[i]
                if watch.callback is not None:
                    record = watch.record
                    if record.query() is None:
                        record.seen = now
                    else:
                        heapq.heapreplace(heap, (watch.arrival, s))
                        joined = True
                    break
                i += 1
            if not joined:
                heapq.heappop(heap)
            walk[2] = i
        for key, walk in zip(keys, walks, strict=True):
            if walk[2] >= walk[3]:
                del queues[key]
            else:
                walk[0].advance(walk[2])
        return fired

    def oldest(self) -> list[EventRecord]:
        """The oldest live record of each stream: what the next poll queries."""
        out = []
        for key, queue in list(self._queues.items()):
            watches = queue.watches
            i, n = queue.head, len(watches)
            while i < n and watches[i].callback is None:
                i += 1
            if i < n:
                queue.advance(i)
                out.append(watches[queue.head].record)
            else:
                del self._queues[key]
        return out


# The native core's twins (cudafut/_core.pyx) where it runs: the watch, the
# queues and the list, with C members and typed loops; the classes above
# stay the reference (CUDAFUT_PURE=1).
_native = _compiled.native()
if _native is not None:
    globals().update(Watch=_native.Watch, Watchlist=_native.Watchlist)


class _Group:
    """Calls ``on_done(None)`` once every record completed, or ``on_done(err)``
    at the first record that reports a CUDA error."""

    __slots__ = ("_on_done", "_remaining", "_watches", "_watchlist")

    def __init__(self, watchlist: Watchlist, records: Sequence[EventRecord], on_done: DoneCallback) -> None:
        self._watchlist = watchlist
        self._on_done = on_done
        self._remaining = len(records)
        self._watches = [watchlist.add(rec, self._fired) for rec in records]

    def _fired(self, record: EventRecord) -> None:
        if self._remaining <= 0:
            return
        error = record.error()
        if error is not None:
            self._remaining = 0
            self.cancel()
        else:
            self._remaining -= 1
            if self._remaining:
                return
        self._on_done(error)

    def cancel(self) -> None:
        for watch in self._watches:
            self._watchlist.remove(watch)


class Driver(abc.ABC):
    """Runs a watchlist in one thread; subclasses say how to spin and sleep.

    :meth:`poll` queries, runs what fired, and returns when to poll next,
    as the :class:`~cudafut._policy.Pacer` decides.
    """

    #: What the debug log and traces call this waiter.
    name = "waiter"
    #: ``arm(record)`` asks for a notice when ``record``'s work ends, so that
    #: no timed poll is needed for it (see ``Pacer.next_poll``); True once
    #: one is armed. None: this driver polls on timers only.
    arm: Callable[[EventRecord], bool] | None = None

    def __init__(self, *, learn: bool = True) -> None:
        self.watchlist = Watchlist(learn=learn)
        self.pacer = Pacer(name=self.name)
        self.slice_full = False

    def _new_wait(self) -> None:
        self.pacer.new_wait(time.perf_counter())
        self.ensure_polling()

    def watch_one(self, record: EventRecord, callback: RecordCallback, fresh: bool = True) -> Watch:
        """Call ``callback(record)`` in this driver's thread once ``record``
        completes or fails; the common case, with the fewest objects alive
        per wait. Must be called from the driver's thread; cancel with
        ``self.watchlist.remove(watch)``. ``fresh=False``: the wait is one
        that already spun (a lone await handing its wait over): no new spin."""
        return self.watch(Watch(record, callback), fresh)

    def watch(self, watch: Watch, fresh: bool = True) -> Watch:
        """:meth:`watch_one` for a watch the caller made (its ``callback``
        set): the waiter calls ``watch.callback(watch.record)``."""
        if fresh:
            self.pacer.new_wait(time.perf_counter())  # _new_wait(), inline: every wait comes here
        self.ensure_polling()
        return self.watchlist.add_watch(watch)

    def watch_all(
        self, records: Sequence[EventRecord], on_done: DoneCallback, fresh: bool = True
    ) -> Callable[[], None]:
        """Call ``on_done`` in this driver's thread when ``records`` complete.

        Must be called from the driver's thread. Returns a function that
        cancels the wait (idempotent). ``fresh`` as for :meth:`watch_one`.
        """
        if len(records) == 1:
            watch = self.watch_one(records[0], lambda rec: on_done(rec.error()), fresh)
            return functools.partial(self.watchlist.remove, watch)
        if fresh:
            self._new_wait()
        else:
            self.ensure_polling()
        return _Group(self.watchlist, records, on_done).cancel

    def poll(self, timer_fired: bool) -> float | None:
        """Poll once, run what fired; return when to poll next (a
        ``perf_counter`` time, at most the policy's ``max_sleep_s`` ahead),
        or None when nothing is left to watch. ``timer_fired``: this poll
        ends a sleep that ran its full length (it teaches the pacer how late
        this thread wakes)."""
        now = time.perf_counter()
        if timer_fired:
            self.pacer.woke(now)
        else:
            self.pacer.interrupted()
        watchlist = self.watchlist
        fired = watchlist.poll(now, FIRE_PER_POLL)
        # Whether this poll fired a full slice (it asks to poll again at once).
        self.slice_full = len(fired) == FIRE_PER_POLL
        if fired:
            _run_fired(self, fired)
        learnt = watchlist.learnt
        if learnt:
            watchlist.learnt = []
            if watchlist.pending:
                learn(learnt)  # the plan below reads what they teach
            else:
                self.learn_later(learnt)
        if _trace.active is not None:
            _trace.polled(self, now, timer_fired, fired)
        if not watchlist.pending:
            return None
        if self.slice_full:
            return now  # more may have completed: fire them at the next loop iteration
        if not fired and now < self.pacer.spin_ends:
            return now  # the plan still says spin: keep the spinning poll lean
        return self.pacer.next_poll(watchlist.oldest(), time.perf_counter(), self.arm)

    def learn_later(self, learnt: list[tuple[EventRecord, float]]) -> None:
        """Teach the duration predictor what a poll saw complete (``(record,
        when)`` pairs), when nothing else waits: ``Predictor.observe`` is
        Python that runs cold after a long wait. Here, at once; an event
        loop's driver defers it past the wake-ups, where no plan needs it
        first."""
        learn(learnt)

    def run_fired(self, fired: Iterable[tuple[RecordCallback, EventRecord]]) -> None:
        for callback, record in fired:
            try:
                callback(record)
            except BaseException as exc:  # noqa: BLE001 - no callback may kill the poller or strand the rest
                self.report("cudafut: exception in an internal wake-up callback", exc)

    @abc.abstractmethod
    def ensure_polling(self) -> None:
        """A wait was added: make sure a poll runs soon."""

    @abc.abstractmethod
    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in this driver's thread, soon; callable from any thread."""

    def report(self, message: str, exc: BaseException, future: object = None) -> None:
        """Report an exception raised by a user callback; never loses it."""
        extra = "" if future is None else f" (future: {future!r})"
        logger.error("%s%s", message, extra, exc_info=exc)

    def run_callback(self, fn: Callable[[Any], object], future: object) -> None:
        """Run a user's done callback; whatever it raises is reported.

        ``KeyboardInterrupt`` and ``SystemExit`` included: raised here they
        would stop this driver's loop or thread in the middle of its
        wake-ups, stranding every other waiter (docs/semantics.md,
        "Exceptions in callbacks").
        """
        if _trace.active is not None:
            fn = _trace.timed_callback(fn, future)
        try:
            fn(future)
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            self.report("cudafut: exception in a done callback", exc, future)
        except BaseException as exc:  # noqa: BLE001 - see above
            self.report(
                f"cudafut: {type(exc).__name__} in a done callback, reported here and not "
                f"raised: it would stop the {self.name} that runs every other callback",
                exc,
                future,
            )


def learn(learnt: list[tuple[EventRecord, float]]) -> None:
    """Teach the duration predictor ``(record, when)`` pairs: each record
    was seen complete at ``when`` (and pending at its ``seen``)."""
    for record, when in learnt:
        predictor.observe(record, when)


#: What ``Driver.poll`` runs what fired with: ``Driver.run_fired``, or the
#: native core's twin, which gathers the wake-ups of the asyncio tasks whose
#: awaits fired into one loop callback (the same order; no ``call_soon`` per
#: await). A driver's own ``run_fired`` is not consulted: none overrides it.
_run_fired: Callable[[Driver, list[tuple[RecordCallback, EventRecord]]], None] = (
    Driver.run_fired if _native is None else _native.run_fired
)


#: The watcher thread never spins: a spinning thread would hold the GIL and
#: stall the application's threads for up to the switch interval (5 ms).
#: Nothing it does needs microseconds.
THREAD_MIN_SLEEP_S: Final = 50e-6


class ThreadWaiter(Driver):
    """A daemon thread that polls for callers without an event loop.

    It runs ``add_done_callback`` callbacks added outside any loop and keeps
    alive the values of futures dropped while their GPU work is pending. It
    sleeps on a condition variable when it has nothing to watch (no CPU),
    and between polls otherwise (never spins, see ``THREAD_MIN_SLEEP_S``).
    While it only keeps values alive (futures dropped while their work
    runs, memory freed behind pending work), it polls every ``max_sleep_s``
    of the wait policy, the first time too: a keep-alive needs no prompt
    wake-up, and a wake-up per drop on a stream of short kernels, taking
    the GIL, stalled the application's launching thread at each launch (a
    ``then()`` chain that dropped its links cost several times one that
    kept them). A value is let go up to ``max_sleep_s`` later.

    Nothing a callback raises stops it (``KeyboardInterrupt`` and
    ``SystemExit`` are logged like the rest). Should it die anyway (a bug),
    the death is logged once and the next use (a call handed over, a value
    to hold) starts a new thread, which takes over the pending watches.
    """

    name = "watcher thread"

    def __init__(self) -> None:
        # Its polls are coarse and about keep-alives: they teach the
        # duration predictor nothing.
        super().__init__(learn=False)
        # Re-entrant: hold() runs from finalizers, which the GC may run while
        # this thread holds the lock.
        self._cond = threading.Condition(threading.RLock())
        self._calls: list[Callable[[], None]] = []
        # Values to keep alive: appended without a lock (atomic under the
        # GIL), picked up at the next poll; the thread is woken only if idle.
        self._holds: deque[tuple[Sequence[EventRecord], object]] = deque()
        # Records watched for holds (this thread's own count): while every
        # pending watch is one of them, polls are max_sleep_s apart.
        self._keeping = 0
        self._idle = True
        self._thread: threading.Thread | None = None
        self._started = False
        #: How many times the thread died (a bug) and was replaced.
        self.deaths = 0
        # Whether the running thread has run calls yet (see _died).
        self._served = False

    def ensure_polling(self) -> None:
        pass  # only called from the watcher thread, which polls next anyway

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._calls.append(fn)
            self._start_or_notify()

    def _start_or_notify(self) -> None:
        if not self._started:
            # Claimed before the thread is built: a finalizer run by the GC
            # meanwhile re-enters here (the lock is re-entrant) and must not
            # start a second watcher.
            self._started = True
            self._served = False
            self._thread = threading.Thread(target=self._run, name="cudafut-watcher", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug: logged, and the next use starts a new thread
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        """The thread is dying of ``exc``: the next use starts another one
        (at once if uses came meanwhile); the death is logged once."""
        with self._cond:
            self.deaths += 1
            self._started = False
            self._thread = None
            self._idle = True
            # Uses that came while it was dying: served at once, unless this
            # thread died before serving anything (then the next use retries:
            # a bug that kills every thread at once cannot make them churn).
            if self._served and (self._calls or self._holds):
                self._start_or_notify()
        logger.error(
            "cudafut: the watcher thread (cudafut-watcher) died of %r; cudafut starts a new "
            "one at its next use (please report this: it is a bug)",
            exc,
            exc_info=exc,
        )

    def _serve(self) -> None:
        next_poll: float | None = None
        while True:
            # What this thread retired in its last round (a dropped
            # future's tensor it let go): those deallocations are done.
            _lifetimes.release_retired()
            timer_fired = False
            with self._cond:
                if not self._calls:
                    if next_poll is None:
                        # Idle first, then look: hold() reads the flag after
                        # it appends, so one of the two sees the other.
                        self._idle = True
                        if _trace.active is not None:
                            _trace.planned(self, None)
                        if not self._holds:
                            # Bounded: releases retired by threads that may
                            # never come back go once stale (_lifetimes.retire).
                            self._cond.wait(_lifetimes.RETIRED_STALE_S)
                        self._idle = False
                    elif not self._holds:
                        least = THREAD_MIN_SLEEP_S
                        # Keep-alives only, unless the last poll fired a full slice:
                        # then no floor, or a backlog of completed holds would
                        # drain 64 per max_sleep_s (a spin plan does not count).
                        if not self.slice_full and self.watchlist.pending <= self._keeping:
                            least = max(least, _policy.get_wait_policy().max_sleep_s)
                        delay = max(next_poll - time.perf_counter(), least)
                        if _trace.active is not None:
                            _trace.planned(self, delay)
                        self.pacer.sleeping_until(time.perf_counter() + delay)
                        timer_fired = not self._cond.wait(delay)
                calls, self._calls = self._calls, []
            if calls:
                self._run_calls(calls)
                self._served = True
            idle = next_poll is None
            if self._take_holds() and idle and not calls and self.watchlist.pending <= self._keeping:
                # Keep-alives only, taken while idle: their first poll too
                # comes max_sleep_s later (see the class), by when more
                # drops have joined the same sweep.
                next_poll = time.perf_counter() + _policy.get_wait_policy().max_sleep_s
                continue
            next_poll = self.poll(timer_fired)

    def _run_calls(self, calls: list[Callable[[], None]]) -> None:
        # A function of its own, so that no local of the endless loop keeps
        # the last call (and what it holds) alive.
        for fn in calls:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - the watcher never dies of a callback
                self.report("cudafut: exception in the watcher thread", exc)
        calls.clear()

    def hold(self, records: Sequence[EventRecord], obj: object) -> None:
        """Keep ``obj`` alive until ``records`` complete (or fail).

        Cheap and callable from any thread (a ``__del__`` included): an
        append, and a notify only when the watcher thread is idle.
        """
        self._holds.append((records, obj))
        if self._idle:
            with self._cond:
                self._start_or_notify()

    def _take_holds(self) -> int:
        """Watch the holds queued so far; return how many there were."""
        holds = self._holds
        taken = 0
        while holds:
            records, obj = holds.popleft()
            self._hold(records, obj)
            taken += 1
        return taken

    def _hold(self, records: Sequence[EventRecord], obj: object) -> None:
        # The callback's default argument owns ``obj``: it goes when the
        # callback is dropped, once the records complete.
        # A watch per record, each callback owning ``obj`` (it goes with the
        # last of them), so that ``_keeping`` counts the records still
        # watched, as ``watchlist.pending`` does. Not fresh waits: a
        # keep-alive needs no spin (see the class).
        def done(_record: EventRecord, _held: object = obj) -> None:
            self._keeping -= 1

        for record in records:
            self._keeping += 1
            try:
                self.watch_one(record, done, fresh=False)
            except BaseException:
                self._keeping -= 1
                raise

    @property
    def holding(self) -> int:
        """Values kept alive now (queued or watched); for tests and leak checks."""
        return len(self._holds) + self.watchlist.pending

    def _reset_after_fork(self) -> None:
        # The child has no watcher thread; it starts afresh on first use.
        self.__init__()  # type: ignore[misc]


_thread_waiter = ThreadWaiter()
_lifetimes.at_fork_in_child(_thread_waiter._reset_after_fork)  # noqa: SLF001 - this module's own


class _Keeper:
    """The watcher thread as the keeper of ``_lifetimes.hold``."""

    def keep(self, records: Sequence[_lifetimes.Record], obj: object) -> None:
        # The only records cudafut holds on are EventRecords.
        _thread_waiter.hold(cast("Sequence[EventRecord]", records), obj)

    @property
    def holding(self) -> int:
        return _thread_waiter.holding


_lifetimes.set_keeper(_Keeper())


def thread_waiter() -> ThreadWaiter:
    return _thread_waiter


_YIELD_EVERY_S: Final = 50e-6
_blocking_lateness: Final[deque[float]] = deque(maxlen=32)


def block_until_complete(records: Sequence[EventRecord], deadline: float | None) -> bool:
    """Block the calling thread until ``records`` complete or one fails (or
    is known to have failed: records behind a pending one are not waited for).

    Returns ``False`` if ``deadline`` (a ``time.perf_counter()`` value) passed
    first. Polls as the wait policy says, sleeping with the GIL released, so
    other Python threads run and Ctrl-C interrupts the sleep at once.
    """
    pacer: Pacer | None = None
    for record in records:
        status = record.query()
        if status is None:
            if first_error(records) is not None:
                return True  # the future failed: the caller raises it, as done() says
            if pacer is None:
                pacer = Pacer(_blocking_lateness, name="result()")
                pacer.new_wait(time.perf_counter())
            while (status := record.query()) is None:
                now = record.seen = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return False
                when = pacer.next_poll((record,), now)
                if when > now:
                    if first_error(records) is not None:
                        return True  # learnt meanwhile, by another thread's query
                    if deadline is not None:
                        when = min(when, deadline)
                    if _trace.active is not None:
                        _trace.blocking_planned(when - now)
                    sleep_until(when, pacer)
                    continue
                if _trace.active is not None:
                    _trace.blocking_planned(0.0)
                # Spinning: query until the plan says otherwise. A sleep(0)
                # now and then lets other threads have the GIL (a query
                # holds it, and the switch interval is 5 ms).
                spin_ends = pacer.spin_ends
                if deadline is not None:
                    spin_ends = min(spin_ends, deadline)
                yield_at = now + _YIELD_EVERY_S
                while (status := record.query()) is None and now < spin_ends:
                    now = record.seen = time.perf_counter()
                    if now > yield_at:
                        time.sleep(0)
                        yield_at = now + _YIELD_EVERY_S
                if status is not None:
                    break
            now = time.perf_counter()
            predictor.observe(record, now)
            if _trace.active is not None:
                _trace.blocking_seen(record, now)
        if status:
            return True  # an error: the caller raises it
    return True
