"""The waiter (host side): the watchlist, the drivers' polls, the watcher
thread and the timer, with scripted events."""

from __future__ import annotations

import gc
import select
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import cudafut
from cudafut import _compiled, _lifetimes, _policy, _timer, _waiter
from tests.children import until
from tests.fakes import FakeRecord, gone, stream_records


@pytest.fixture(autouse=True)
def _default_policy() -> Iterator[None]:
    old = cudafut.set_wait_policy("balanced")
    yield
    cudafut.set_wait_policy(old)
    _policy.predictor.clear()


class _InlineDriver(_waiter.Driver):
    """A driver whose thread is the test's own."""

    def ensure_polling(self) -> None:
        pass

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        fn()


# -- the watchlist fires in slices ------------------------------------------------


def test_thousands_of_completions_fire_in_slices() -> None:
    driver = _InlineDriver()
    recs = stream_records(600)
    fired: list[int] = []
    for rec in recs:
        driver.watch_one(rec, lambda r: fired.append(r.seq))
    for rec in recs:
        rec.complete()
    when = driver.poll(False)
    assert when is not None and when <= time.perf_counter()  # more to fire: poll again at once
    assert len(fired) == _waiter.FIRE_PER_POLL
    assert driver.watchlist.pending == 600 - _waiter.FIRE_PER_POLL
    polls = 1
    while when is not None:
        when = driver.poll(False)
        polls += 1
    assert fired == list(range(1, 601))  # in stream order
    assert polls == -(-600 // _waiter.FIRE_PER_POLL)  # full slices, then the rest


def _appends(out: list[Any], item: Any) -> Callable[[Any], None]:
    return lambda _record: out.append(item)


def test_completions_on_several_streams_fire_in_the_order_the_waits_came() -> None:
    # Waits i on stream i % 3, all complete at once: they fire 0, 1, 2, ...
    # (as plain futures released in order wake their tasks), not stream by
    # stream; a slice of the limit ends mid-stream and the next poll goes on.
    wl = _waiter.Watchlist()
    streams = [stream_records(10) for _ in range(3)]
    fired: list[int] = []
    for i in range(30):
        rec = streams[i % 3][i // 3]
        wl.add(rec, _appends(fired, i))
    for recs in streams:
        for rec in recs[:7]:  # waits 0..20 complete, 21.. pending
            rec.complete()
    polls = 0
    while True:
        got = wl.poll(time.perf_counter(), 4)
        for callback, record in got:
            callback(record)
        polls += 1
        if len(got) < 4:
            break
    assert fired == list(range(21))
    assert polls == 6 and wl.pending == 9
    assert [rec.queries > 0 for rec in streams[0][7:]] == [True, False, False]  # the oldest pending only
    # A poll's first completion fired on each stream teaches the predictor
    # (the first poll's: wait 0, 1 and 2, in the order they fired).
    firsts = [streams[0][0], streams[1][0], streams[2][0], streams[1][1]]
    assert [rec for rec, _now in wl.learnt[:4]] == firsts


def test_a_stream_completed_out_of_order_fires_in_queue_order_merged_by_arrival() -> None:
    # A stream's queue is sorted by its number: a wait added late for an
    # older record fires before the newer ones of its stream, wherever its
    # arrival puts it among the other streams'.
    wl = _waiter.Watchlist()
    a, b = stream_records(3), stream_records(2)
    order = [(a[1], "a2"), (b[0], "b1"), (a[2], "a3"), (a[0], "a1"), (b[1], "b2")]
    fired: list[str] = []
    for rec, name in order:
        wl.add(rec, _appends(fired, name))
    for rec in a + b:
        rec.complete()
    for callback, record in wl.poll(time.perf_counter()):
        callback(record)
    # Stream a's queue is a1 (arrival 3), a2 (0), a3 (2); b's b1 (1), b2 (4).
    assert fired == ["b1", "a1", "a2", "a3", "b2"]


def test_a_poll_queries_only_the_oldest_pending_record_of_each_stream() -> None:
    driver = _InlineDriver()
    recs = stream_records(50)
    for rec in recs:
        driver.watch_one(rec, lambda r: None)
    driver.poll(False)
    assert recs[0].queries == 1
    assert all(rec.queries == 0 for rec in recs[1:])


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
    assert gone(ref)


class _RecordingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def _watcher_sleeps(n: int) -> list[float]:
    """The first ``n`` sleeps (at least) of a fresh watcher thread that holds
    a value on a record which stays pending meanwhile."""
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    rec = FakeRecord()
    waiter.hold([rec], _Value())
    deadline = time.monotonic() + 5
    while len(cond.timeouts) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.complete()
    polls = [t for t in cond.timeouts if t is not None]
    assert len(polls) >= n
    return polls


def test_the_watcher_thread_sleeps_between_polls_even_when_told_to_spin() -> None:
    # A spinning thread would hold the GIL and shut the application's
    # threads out for the 5 ms switch interval at a time.
    cudafut.set_wait_policy("low_latency")
    assert min(_watcher_sleeps(20)) >= _waiter.THREAD_MIN_SLEEP_S > 0


def test_a_watcher_thread_that_only_keeps_values_alive_polls_every_max_sleep_s() -> None:
    # Polls 50 µs apart, each taking the GIL, stalled the application's
    # launching thread; a keep-alive needs no prompt wake-up.
    cudafut.set_wait_policy("low_latency")  # its plans would poll every 50 µs
    assert min(_watcher_sleeps(5)) >= cudafut.get_wait_policy().max_sleep_s


def test_keep_alives_after_a_callback_still_poll_every_max_sleep_s() -> None:
    # A callback's watch is a new wait: under low_latency its spin never
    # ends (spin_s is infinite), and keep-alives that follow must not poll
    # on that spin's plan.
    cudafut.set_wait_policy("low_latency")
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    watched, kept = FakeRecord(), FakeRecord()
    fired: list[object] = []

    def watch() -> None:
        waiter.watch_one(watched, fired.append)

    waiter.call_soon_threadsafe(watch)
    watched.complete()
    until(lambda: bool(fired), "the callback fired", 5.0)
    start = len(cond.timeouts)
    waiter.hold([kept], _Value())
    until(lambda: len(cond.timeouts) >= start + 5, "5 more watcher sleeps", 5.0)
    kept.complete()
    polls = [t for t in cond.timeouts[start:] if t is not None]
    assert min(polls) >= cudafut.get_wait_policy().max_sleep_s


def test_a_keep_alive_taken_while_idle_is_first_polled_max_sleep_s_later() -> None:
    # Dropped futures on a stream of short kernels each woke the idle
    # watcher, whose poll then found the work done: a wake-up (and the GIL
    # taken from the application) per few drops.
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    rec = FakeRecord()
    rec.complete()
    value = _Value()
    ref = weakref.ref(value)
    waiter.hold([rec], value)
    del value
    assert gone(ref)
    first = next(t for t in cond.timeouts if t is not None)
    assert cudafut.get_wait_policy().max_sleep_s <= first < _lifetimes.RETIRED_STALE_S


def test_a_watcher_thread_with_a_callback_to_run_polls_as_its_plans_say() -> None:
    # Beside a keep-alive of two records, one of them complete: the
    # callback's watch is not taken for a keep-alive (the keep-alive counts
    # its records one by one, as the watchlist does). No spin: its plan is
    # sleeps of 50 µs, doubling up to 2 ms.
    cudafut.set_wait_policy(cudafut.WaitPolicy(spin_s=0.0, first_sleep_s=50e-6, max_sleep_s=2e-3))
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    first, second, watched = FakeRecord(), FakeRecord(), FakeRecord()
    waiter.hold([first, second], _Value())
    first.complete()
    until(lambda: waiter.watchlist.pending == 1, "one record left watched", 5.0)
    start = len(cond.timeouts)
    fired: list[object] = []

    def watch() -> None:
        waiter.watch_one(watched, fired.append)

    waiter.call_soon_threadsafe(watch)
    until(lambda: len(cond.timeouts) >= start + 20, "20 more watcher sleeps", 5.0)
    watched.complete()
    second.complete()
    polls = [t for t in cond.timeouts[start:] if t is not None]
    assert min(polls) < cudafut.get_wait_policy().max_sleep_s


def test_a_backlog_of_completed_keep_alives_drains_without_the_keep_alive_sleeps() -> None:
    # A poll fires at most FIRE_PER_POLL watches and asks to poll again at
    # once: with the keep-alives' floor there, a backlog would drain one
    # slice per max_sleep_s.
    waiter = _waiter.ThreadWaiter()
    cond = waiter._cond = _RecordingCondition()
    records = [FakeRecord() for _ in range(3 * _waiter.FIRE_PER_POLL)]
    for rec in records:
        rec.complete()
    values = [_Value() for _ in records]
    refs = [weakref.ref(v) for v in values]
    for rec, value in zip(records, values, strict=True):
        waiter.hold([rec], value)
    del value, values
    assert all(gone(ref) for ref in refs)
    assert cond.timeouts.count(_waiter.THREAD_MIN_SLEEP_S) >= 2


def test_the_watcher_thread_sleeps_at_most_max_sleep_s() -> None:
    # Done-callbacks outside a loop get the same bound as await.
    cudafut.set_wait_policy(cudafut.WaitPolicy(max_sleep_s=2e-3, first_sleep_s=1e-3))
    assert max(_watcher_sleeps(10)) <= 2e-3


# -- the timer ----------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux only")
def test_the_timer_fires_at_the_time_asked_and_can_be_disarmed() -> None:
    timer = _timer.make_timer()
    assert timer is not None
    try:
        timer.arm(2e-3)
        assert select.select([timer.fd], [], [], 0)[0] == []
        assert not timer.drain()  # not expired yet
        assert select.select([timer.fd], [], [], 1.0)[0] == [timer.fd]
        assert timer.drain()
        assert select.select([timer.fd], [], [], 0)[0] == []
        assert not timer.drain()  # read already
        timer.arm(5e-3)
        timer.disarm()
        assert select.select([timer.fd], [], [], 0.02)[0] == []
    finally:
        timer.close()
    timer.close()  # idempotent


def test_the_timer_settime_call_reports_a_failure_and_a_closed_timer_disarms_quietly() -> None:
    # Whichever call arms it (os on 3.13, the native core's C, or ctypes).
    timer = _timer.make_timer()
    assert timer is not None
    timer.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        timer._settime(timer.fd, 1_000)  # the chosen call itself (a closed timer's fd is -1)
    timer.disarm()  # nothing to stop: no error
    with pytest.raises(OSError, match="Bad file descriptor"):
        timer.drain()  # as os.read: only "not expired" reads False


def test_the_timer_drains_from_c_on_the_native_core() -> None:
    # os.read releases the GIL; the native core's read keeps it.
    timer = _timer.make_timer()
    assert timer is not None
    try:
        native = _compiled.native()
        assert timer._drain is (_timer._os_drain if native is None else native.timer_drain)
    finally:
        timer.close()


class _ReentrantRecord(FakeRecord):
    """A pending record whose query calls ``hook`` (a finalizer, a backend
    reentering the list)."""

    __slots__ = ("hook",)

    def __init__(self, stream: int, seq: int) -> None:
        super().__init__(stream, seq)
        self.hook: Callable[[], object] | None = None

    def query(self) -> int | None:
        if self.hook is not None:
            self.hook()
        return super().query()


def test_a_queue_compacted_under_a_poll_raises_instead_of_corrupting_the_list() -> None:
    # A query that reenters the list (oldest() advances and compacts a queue
    # with more than 32 gone watches) shortens the queue the poll is walking.
    # The native list indexes without bounds checks: it must raise as the
    # pure one does, not write past the list's end.
    wl = _waiter.Watchlist()
    stream = 9_000_001
    records = [_ReentrantRecord(stream, seq) for seq in range(1, 41)]
    watches = [wl.add(r, lambda _r: None) for r in records]
    for w in watches[:38]:
        wl.remove(w)
    records[38].hook = wl.oldest
    with pytest.raises(IndexError, match="cannot advance"):
        wl.poll(time.perf_counter())
    assert wl.pending == 2
