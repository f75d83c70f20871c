"""The waiter: learning, without blocking anybody, that recorded events completed.

A :class:`Watchlist` keeps the records someone waits on in one heap per
stream, ordered by the record's sequence number on that stream. Work on a
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

No Python code here ever runs on a CUDA driver thread (DESIGN.md hazard 1),
and every wait polls the raw event status, so a sticky CUDA error surfaces
as an error instead of a hang (hazards 2 and 3).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from ._errors import CudaError
from ._events import EventRecord

logger: Final = logging.getLogger("cudafut")

#: After a new wait, an event loop re-polls on every loop iteration for this
#: long before it falls back to sleeping: short GPU work is noticed within
#: microseconds.
SPIN_S: Final = 100e-6
#: Poll period once spinning stops. asyncio and uvloop round every sleep up to
#: a whole millisecond (DESIGN.md), so a shorter period would not be honoured.
SLEEP_S: Final = 1e-3
#: A blocking wait queries in a tight loop for this long, then sleeps with
#: the GIL released, from 20 µs doubling up to ``SLEEP_S``.
BLOCK_SPIN_S: Final = 20e-6
BLOCK_FIRST_SLEEP_S: Final = 20e-6

RecordCallback = Callable[[EventRecord], None]
DoneCallback = Callable[[CudaError | None], None]


class Watch:
    """One waiter's interest in one record."""

    __slots__ = ("callback", "record")

    def __init__(self, record: EventRecord, callback: RecordCallback) -> None:
        self.record = record
        self.callback: RecordCallback | None = callback


class Watchlist:
    """Pending records in one heap per stream; not thread-safe by design."""

    def __init__(self) -> None:
        self._heaps: dict[tuple[int, ...], list[tuple[int, int, Watch]]] = {}
        self._live = 0
        self._order = itertools.count()

    @property
    def pending(self) -> int:
        """Number of watches that have not fired nor been removed."""
        return self._live

    @property
    def streams(self) -> int:
        """Number of streams with watched records (dead watches included)."""
        return len(self._heaps)

    def add(self, record: EventRecord, callback: RecordCallback) -> Watch:
        watch = Watch(record, callback)
        heap = self._heaps.get(record.stream_key)
        if heap is None:
            heap = self._heaps[record.stream_key] = []
        heapq.heappush(heap, (record.seq, next(self._order), watch))
        self._live += 1
        return watch

    def remove(self, watch: Watch) -> None:
        """Forget a watch; a no-op if it fired or was removed already."""
        if watch.callback is not None:
            watch.callback = None
            self._live -= 1
            if self._live == 0:
                self._heaps.clear()  # drop dead entries: an idle list holds nothing

    def poll(self) -> list[tuple[RecordCallback, EventRecord]]:
        """Query the oldest live record of each stream; return what fired.

        The caller runs the returned callbacks (they may add or remove
        watches, which must not happen while the heaps are walked).
        """
        fired: list[tuple[RecordCallback, EventRecord]] = []
        heaps = self._heaps
        for key in list(heaps):
            heap = heaps[key]
            while heap:
                watch = heap[0][2]
                callback = watch.callback
                if callback is not None:
                    if watch.record.query() is None:
                        break
                    watch.callback = None
                    self._live -= 1
                    fired.append((callback, watch.record))
                heapq.heappop(heap)
            if not heap:
                del heaps[key]
        return fired


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


class Driver:
    """Runs a watchlist in one thread; subclasses say how and when to poll."""

    def __init__(self) -> None:
        self.watchlist = Watchlist()

    def watch_all(self, records: Sequence[EventRecord], on_done: DoneCallback) -> Callable[[], None]:
        """Call ``on_done`` in this driver's thread when ``records`` complete.

        Must be called from the driver's thread. Returns a function that
        cancels the wait (idempotent).
        """
        group = _Group(self.watchlist, records, on_done)
        self.kick()
        return group.cancel

    def run_fired(self, fired: Iterable[tuple[RecordCallback, EventRecord]]) -> None:
        for callback, record in fired:
            try:
                callback(record)
            except Exception as exc:  # noqa: BLE001 - internal callbacks must not kill the poller
                self.report("cudafut: exception in an internal wake-up callback", exc)

    def kick(self) -> None:
        """Something was added: make sure polling runs soon."""
        raise NotImplementedError

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in this driver's thread, soon; callable from any thread."""
        raise NotImplementedError

    def report(self, message: str, exc: BaseException, future: object = None) -> None:
        """Report an exception raised by a user callback; never loses it."""
        extra = "" if future is None else f" (future: {future!r})"
        logger.error("%s%s", message, extra, exc_info=exc)

    def run_callback(self, fn: Callable[[Any], object], future: object) -> None:
        try:
            fn(future)
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            self.report("cudafut: exception in a done callback", exc, future)


class ThreadWaiter(Driver):
    """A daemon thread that polls for callers without an event loop.

    It runs ``add_done_callback`` callbacks added outside any loop and keeps
    alive the values of futures dropped while their GPU work is pending. It
    sleeps on a condition variable when it has nothing to watch (no CPU).
    """

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.Lock())
        self._calls: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        pass  # only called from the watcher thread, which polls next anyway

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._calls.append(fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cudafut-watcher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        delay = BLOCK_FIRST_SLEEP_S
        while True:
            with self._cond:
                if not self._calls:
                    if self.watchlist.pending:
                        self._cond.wait(delay)
                        delay = min(delay * 2, SLEEP_S)
                    else:
                        self._cond.wait()
                calls, self._calls = self._calls, []
            if calls:
                delay = BLOCK_FIRST_SLEEP_S
                self._run_calls(calls)
            self.run_fired(self.watchlist.poll())

    def _run_calls(self, calls: list[Callable[[], None]]) -> None:
        # A function of its own, so that no local of the endless loop keeps
        # the last call (and what it holds) alive.
        for fn in calls:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                self.report("cudafut: exception in the watcher thread", exc)
        calls.clear()

    def hold(self, records: Sequence[EventRecord], obj: object) -> None:
        """Keep ``obj`` alive until ``records`` complete (or fail)."""
        self.call_soon_threadsafe(lambda: self._hold(records, obj))

    def _hold(self, records: Sequence[EventRecord], obj: object) -> None:
        # The callback's default argument owns ``obj``: it goes when the
        # callback is dropped, once the records complete.
        def done(_error: CudaError | None, _held: object = obj) -> None:
            pass

        self.watch_all(records, done)

    def _reset_after_fork(self) -> None:
        # The child has no watcher thread; it starts afresh on first use.
        self.__init__()  # type: ignore[misc]


_thread_waiter = ThreadWaiter()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_thread_waiter._reset_after_fork)


def thread_waiter() -> ThreadWaiter:
    return _thread_waiter


def block_until_complete(records: Sequence[EventRecord], deadline: float | None) -> bool:
    """Block the calling thread until ``records`` complete or one fails.

    Returns ``False`` if ``deadline`` (a ``time.perf_counter()`` value) passed
    first. Spins for ``BLOCK_SPIN_S``, then sleeps with the GIL released, so
    other Python threads run and Ctrl-C interrupts within a millisecond.
    """
    for record in records:
        status = record.query()
        if status is None:
            spin_until = time.perf_counter() + BLOCK_SPIN_S
            delay = BLOCK_FIRST_SLEEP_S
            while (status := record.query()) is None:
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_until:
                    continue
                time.sleep(delay if deadline is None else min(delay, deadline - now))
                delay = min(delay * 2, SLEEP_S)
        if status:
            return True  # an error: the caller raises it
    return True
