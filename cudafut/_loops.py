"""Event-loop drivers: one waiter per running loop, for asyncio and trio.

Each running loop gets one :class:`~cudafut._waiter.Driver`, created on the
first ``await`` in it. The driver polls only while somebody waits, when the
wait policy says (``_policy.py``): on every loop iteration while completion
is likely near, else after a sleep. With nothing to wait for it schedules
nothing at all.

Sleeps use a timerfd watched by the loop (``_timer.py``), because the loops'
own timers round up to whole milliseconds; without timerfd, the loop's
timers. asyncio (and uvloop) drive the poll with loop callbacks, no task;
trio with one system task per run. trio is imported only when a trio loop is
found running.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from types import ModuleType
from typing import Any, Final

from . import _backend, _compiled, _lifetimes
from ._events import IMPORTED, EventRecord, is_newest
from ._log import logger
from ._policy import get_wait_policy, predictor
from ._timer import make_timer
from ._trace import hooks as _trace
from ._waiter import Driver, Watch, learn

Register = Callable[[Callable[[], None]], Callable[[], None]]
#: ``finish(future, cancelled_error)``: an await's value, once its record completed or failed.
Finish = Callable[[Any, type[BaseException]], Any]


#: An asyncio driver's mode: nothing queued, a poll queued (spinning), its
#: timer armed for its own poll, or for a lone await sleeping in its task.
_IDLE, _SPIN, _SLEEP, _ALONE = 0, 1, 2, 3


def _resolve(waiter: asyncio.Future[None], _done: object) -> None:
    # The task may have been cancelled (its future too) before the wake-up.
    if not waiter.done():
        waiter.set_result(None)


def _at_deadline(waiter: asyncio.Future[Any]) -> None:
    """A :meth:`AsyncioTasks.sleep` timer: the sleep ends at its deadline."""
    if not waiter.done():
        waiter.set_result(True)


#: A planned sleep shorter than this is spun instead: waking costs more.
MIN_SLEEP_S: Final = 20e-6


class LoopDriver(Driver):
    """The waiter of one running event loop (asyncio/uvloop or trio).

    What the loops share lives here: the sleep planning of :meth:`step`, and
    the fast path of :meth:`spin_alone`. Subclasses say how to yield to the
    loop, how to sleep, and how a task waits.
    """

    #: What an await in this loop raises for a cancelled future.
    cancelled_error: type[BaseException]
    # Whether a task is polling its own record in spin_alone (one at most).
    _alone = False

    @abc.abstractmethod
    async def _checkpoint(self) -> None:
        """Yield to the loop once (one loop iteration)."""

    @abc.abstractmethod
    def wait_records(self, records: Sequence[EventRecord], fresh: bool = True) -> Generator[Any, None, None]:
        """``yield from`` it in an awaiting task: returns once ``records``
        completed or one failed. ``fresh=False``: the wait spun already (a
        lone await's, handed over): the driver starts no second spin."""

    @abc.abstractmethod
    async def until(self, register: Register) -> None:
        """Wait until ``register``'s wake function is called in this loop.

        ``register(wake)`` arranges the call and returns a cancel function,
        which runs however the wait ends (cancellation included).
        """

    def wait(self, records: Sequence[EventRecord]) -> Generator[Any, None, None]:
        """``yield from`` what it returns in an awaiting task: returns once
        ``records`` completed or one failed. A lone wait (nothing else
        pending in this loop) polls from the task itself while the policy
        says spin (:meth:`spin_alone`); every other goes through the driver.

        A plain method returning the generator to run, not a generator: with
        many awaits pending, each keeps one generator fewer alive (the cyclic
        GC walks them all) and each resumption passes one frame fewer."""
        if len(records) == 1 and not self.watchlist.pending and not self._alone:
            return self._wait_alone(records)
        return self.wait_records(records)

    def await_one(self, future: Any, record: EventRecord, finish: Finish) -> Iterator[Any] | None:
        """What ``await future`` returns when ``future``'s one record is
        pending and other waits share this loop's waiter: one object that
        is the watch, the iterator and what the task waits on, or None
        where this loop has none (trio; or a lone wait, which spins from
        the task: :meth:`wait`). ``finish(future, cancelled_error)`` gives
        the await's value once the record completed or failed."""
        return None

    def _wait_alone(self, records: Sequence[EventRecord]) -> Generator[Any, None, None]:
        if (yield from self.spin_alone(records[0]).__await__()):
            return
        # The wait spun in the task already: a second spin after a new wait
        # would only cost CPU (about spin_s per wait of unlearnt work).
        yield from self.wait_records(records, fresh=False)

    def step(self, timer_fired: bool) -> float | None:
        """Poll once and plan what follows: None when nothing is left to
        watch, 0.0 to poll again at the next loop iteration (spinning), or
        how many seconds to sleep (at most the policy's ``max_sleep_s``;
        the pacer is told, to measure how late the wake-up comes)."""
        when = self.poll(timer_fired)
        if when is None:
            delay: float | None = None
        else:
            delay = when - time.perf_counter()
            if delay < MIN_SLEEP_S:
                delay = 0.0
            else:
                self.pacer.sleeping_until(when)
        if _trace.active is not None:
            _trace.planned(self, delay)
        return delay

    async def spin_alone(self, record: EventRecord) -> bool:
        """Poll ``record`` from the awaiting task itself while it is the
        loop's only wait; True if it completed, False to hand the wait to
        the driver.

        One loop iteration per poll while the policy says spin, as a
        ``sleep(0)`` loop; it saves the hop through the driver (a loop
        iteration and a future) that a wake-up otherwise costs, for the
        common case of one await at a time. When a plan's spin runs out (a
        plan lasts ``max_sleep_s`` at most) with the work pending, it plans
        again, as the driver's poll would: while the plan says spin, it
        spins on here (``low_latency`` spins the whole wait); where it says
        sleep, the task sleeps on the driver's timer (:meth:`_sleep_alone`)
        and polls again, if the work's duration is learnt (or the policy
        asks for no notices), so that the poll which sees the end is the
        task's own: after a long sleep the hop's code runs cold and costs
        tens of µs. Where the spin before the predicted end is more than
        six ``max_sleep_s`` away, the plan arms a notice for the stream and
        the task sleeps until that spin (at most ``predicted_sleep_s``); the
        notice ends the sleep if the work ends early. Work of unknown
        duration goes to the driver, which asks CUDA for a notice. Any other
        wait in the loop sends it to the driver too.
        """
        if self.watchlist.pending or self._alone:
            return False
        pacer = self.pacer
        now = time.perf_counter()
        pacer.new_wait(now)
        when = pacer.next_poll((record,), now, self.arm)
        if when > now and not _sleeps_alone(record):
            pacer.retract()  # the driver plans that sleep again
            return False  # the plan says sleep, with a notice: the driver's
        ends = pacer.spin_ends if when <= now else 0.0
        self._alone = True
        spinning = False  # what the tracer was told last
        try:
            while True:
                if when > now:
                    spinning = False
                    if _trace.active is not None:
                        _trace.planned(self, when - now, "sleep (lone await)")
                    if not await self._sleep_alone(when):
                        pacer.retract()  # not slept: the driver plans that sleep again
                        return False
                else:
                    if not spinning and _trace.active is not None:
                        _trace.planned(self, 0.0, "spin (lone await)")
                    spinning = True
                    await self._checkpoint()
                if self.watchlist.pending:
                    return False  # others wait too: one poller for all is cheaper
                if record.query() is not None:
                    now = time.perf_counter()
                    self.learn_later([(record, now)])
                    if _trace.active is not None:
                        _trace.seen_alone(self, record, now)
                    return True
                now = record.seen = time.perf_counter()
                if now < ends:
                    when = now  # the plan's spin goes on: poll at the next loop iteration
                    continue
                when = pacer.next_poll((record,), now, self.arm)
                if when <= now:
                    ends = pacer.spin_ends
                elif not _sleeps_alone(record):
                    pacer.retract()  # the driver plans that sleep again
                    return False  # the plan says sleep, with a notice: the driver's
        finally:
            self._alone = False
            if _trace.active is not None:
                _trace.planned(self, None)

    async def _sleep_alone(self, when: float) -> bool:
        """Sleep the lone awaiting task until ``when`` (a ``perf_counter``
        time) or until another wait arrives; False where this loop cannot
        (then the driver takes the wait). Here: never."""
        return False


def _sleeps_alone(record: EventRecord) -> bool:
    """Whether a lone await of ``record`` may sleep in its task: its
    stream's duration is learnt (no notice is asked for predicted work),
    the policy asks for no notices, or ``record`` is another process's (a
    received future: never noticed, see :meth:`AsyncioDriver._arm`)."""
    policy = get_wait_policy()
    if not policy.notify or record.stream_key[0] == IMPORTED:
        return True
    if not policy.predict:
        return False
    modes, surprised = predictor.modes(record)
    return bool(modes) and not surprised


class AsyncioDriver(LoopDriver):
    """Polls from asyncio loop callbacks: ``call_soon`` while spinning, a
    timerfd reader (or ``call_later``) while sleeping."""

    cancelled_error = asyncio.CancelledError
    name = "asyncio waiter"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if type(loop).__module__.startswith("uvloop"):
            self.name = "uvloop waiter"
        super().__init__()
        self._loop = weakref.ref(loop)  # the registry is keyed weakly by the loop
        self._thread = threading.get_ident()
        self._mode = _IDLE
        self._later: asyncio.TimerHandle | None = None
        self._timer = make_timer()
        self._reading = False
        # What a lone await sleeping in its task waits on (_ALONE mode).
        self._alone_wake: asyncio.Future[bool] | None = None
        # Armed notices, per stream key. CUDA closes their write ends.
        self._notices: dict[tuple[int, ...], _Notice] = {}
        self.arm = self._arm
        # The native core's side of this waiter: awaits among other pending
        # waits are made there, from C (None on the pure core).
        self._entry = None if _native is None else _native.AsyncioEntry(loop, self.watchlist, self)
        # The read ends still watched when the driver goes (its loop closed).
        weakref.finalize(self, _close_all, self._notices)
        _with_notices.add(self)

    def ensure_polling(self) -> None:
        if self._mode == _SPIN:
            return  # a poll is already queued
        loop = self._loop()
        if loop is None:
            return
        if self._mode == _SLEEP:
            self._cancel_sleep()
        elif self._mode == _ALONE:
            self._end_alone(False)  # the lone await wakes, and hands its wait over
        self._mode = _SPIN
        loop.call_soon(self._tick)

    async def _sleep_alone(self, when: float) -> bool:
        """The lone await's sleep, in its task, on this driver's timerfd
        (microseconds; the loop's own timers round up to milliseconds):
        until ``when``, or until a new wait calls :meth:`ensure_polling`.
        False without a timerfd, or while the driver has something queued.
        Costs a loop future and one timer system call; the wake-up is one
        loop callback and the task's step."""
        timer = self._timer
        loop = self._loop()
        if timer is None or loop is None or self._mode != _IDLE:
            return False
        wake: asyncio.Future[bool] = loop.create_future()
        if not self._reading:
            loop.add_reader(timer.fd, self._on_timer)
            self._reading = True
        self._alone_wake = wake
        self._mode = _ALONE
        pacer = self.pacer
        pacer.sleeping_until(when)
        timer.arm(when - time.perf_counter())
        try:
            timed_out = await wake
        finally:
            if self._alone_wake is wake:  # cancelled: stop the timer
                self._end_alone(False)
        if timed_out:
            pacer.woke(time.perf_counter())
        else:
            pacer.interrupted()
        return True

    def _end_alone(self, timed_out: bool) -> None:
        """End the lone await's sleep: by its timer, or early."""
        wake = self._alone_wake
        self._alone_wake = None
        self._mode = _IDLE
        if not timed_out and self._timer is not None:
            self._timer.disarm()
        if wake is not None and not wake.done():
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits on it
                wake.set_result(timed_out)

    async def _checkpoint(self) -> None:
        await asyncio.sleep(0)

    def learn_later(self, learnt: list[tuple[EventRecord, float]]) -> None:
        """Teach the predictor in a loop callback of its own, queued behind
        the wake-ups just scheduled (or the step of the task that saw its
        lone await complete): the awaiting code resumes first. A new wait
        that task makes meanwhile is planned without these observations,
        with the modes already found, and its start is its own record's:
        so at once where work was recorded behind one of them (it started
        when they completed, and the next wait's plan needs that)."""
        loop = self._loop()
        if loop is None or loop.is_closed() or not all(is_newest(record) for record, _when in learnt):
            learn(learnt)
            return
        loop.call_soon(learn, learnt)

    def _cancel_sleep(self) -> None:
        if self._later is not None:
            self._later.cancel()
            self._later = None
        elif self._timer is not None:
            self._timer.disarm()

    def _on_timer(self) -> None:
        timer = self._timer
        # A notice handled in the same loop iteration may have re-planned
        # (and re-armed the timer): only an expiry read ends this sleep.
        if timer is not None and not timer.drain():
            return
        if self._mode == _SLEEP:
            self._tick(True)
        elif self._mode == _ALONE:
            self._end_alone(True)

    def _tick(self, timer_fired: bool = False) -> None:
        self._mode = _IDLE
        self._later = None
        delay = self.step(timer_fired)
        if delay is None or self._mode != _IDLE:
            return  # nothing to watch, or a callback's new wait queued a poll
        loop = self._loop()
        if loop is None:
            return
        if not delay:
            self._mode = _SPIN
            loop.call_soon(self._tick)
            return
        self._mode = _SLEEP
        timer = self._timer
        if timer is None:
            self._later = loop.call_later(delay, self._tick, True)
            return
        if not self._reading:
            loop.add_reader(timer.fd, self._on_timer)
            self._reading = True
        timer.arm(delay)

    def _arm(self, record: EventRecord) -> bool:
        """Have CUDA wake this loop when ``record``'s work ends (see
        ``_cuda.close_after``): a pipe whose write end CUDA closes, its read
        end watched by the loop. One notice per stream at a time: one armed
        for this record or an older one of its stream serves, until it
        arrives (the stream completes in order, so a notice that never
        comes means later work never completes either: the waiter then
        polls every ``notice_sleep_s``; a stream handle reused by a new
        stream is covered by the old stream's notice until it fires). One
        armed for a newer record only does not serve (it would fire late).
        False where no notice serves, no notice stream is idle or they are
        still being made (on a helper thread: making one can wait for the
        GPU, docs/design.md hazard 11), or notices cannot be had: the waiter
        then polls on timers for this record, as ``notify=False`` does. The
        first failure to arm one stops notices for this waiter. Never raises
        an ``Exception``: it runs inside the waiter's poll.

        Never for a record of another process (a received future): each has
        a key of its own, so every await would ask for a notice, GPU work
        in this process's own CUDA context, which the GPU time-slices with
        the producer's; timed polls served several such processes better
        (docs/processes.md, "Received futures poll on timers")."""
        key = record.stream_key
        if key[0] == IMPORTED:
            return False
        armed = self._notices.get(key)
        if armed is not None:
            return armed.seq <= record.seq
        loop = self._loop()
        if loop is None:
            return False
        try:
            stream = _backend.current.notice_stream(record.device)
        except Exception:  # noqa: BLE001 - as a failed close_after below
            return self._stop_notices("no CUDA notices")
        if stream is None:  # none idle, or still being made (hazard 11): poll meanwhile
            return False
        try:
            r, w = os.pipe()
        except OSError:  # out of descriptors: poll instead
            return False
        notice = self._notices[key] = _Notice(record.seq, r, w)  # known to a fork from now on
        try:
            _backend.current.close_after(record, w, stream)  # takes w, whatever happens
        except BaseException as exc:
            del self._notices[key]
            os.close(r)
            if not isinstance(exc, Exception):
                raise
            return self._stop_notices("no CUDA notices")
        try:
            loop.add_reader(r, self._on_notice, key, notice)
        except Exception:  # noqa: BLE001 - CUDA owns w now: only r is ours to close
            del self._notices[key]
            os.close(r)
            return self._stop_notices("cannot watch a notice")
        return True

    def _stop_notices(self, reason: str) -> bool:
        """A notice is an optimisation: after the first failure to arm one
        this waiter polls on timers. Called inside ``except``: logs the
        failure with its traceback. Returns False, as ``_arm`` does."""
        self.arm = None
        logger.debug("cudafut: %s: %s; polling on timers", self.name, reason, exc_info=True)
        return False

    def _on_notice(self, key: tuple[int, ...], notice: _Notice) -> None:
        """CUDA closed a notice's pipe: the work it followed is done. Poll now."""
        if self._notices.get(key) is notice:
            del self._notices[key]
        loop = self._loop()
        if loop is not None:
            loop.remove_reader(notice.r)
        os.close(notice.r)
        if self._mode == _SLEEP:
            self._cancel_sleep()
            self._tick(False)
        elif self._mode == _ALONE:
            self._end_alone(False)  # the lone await polls its record now
        # Spinning: a poll is queued already. Idle: nothing is watched.

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return  # nobody is left to wake
        if threading.get_ident() == self._thread:
            loop.call_soon(fn)
        else:
            loop.call_soon_threadsafe(fn)

    def report(self, message: str, exc: BaseException, future: object = None) -> None:
        loop = self._loop()
        if loop is None:
            super().report(message, exc, future)
            return
        context: dict[str, Any] = {"message": message, "exception": exc}
        if future is not None:
            context["future"] = future
        loop.call_exception_handler(context)

    def await_one(self, future: Any, record: EventRecord, finish: Finish) -> Iterator[Any] | None:
        if not self.watchlist.pending and not self._alone:
            return None  # a lone wait: wait() spins from the task
        if self._entry is not None:  # the native core: its entry makes the await
            return self._entry.await_one(future, record, finish)  # type: ignore[no-any-return]
        loop = self._loop()
        if loop is None:
            return None
        return _AsyncioAwait(self, loop, future, record, finish)

    def wait_records(self, records: Sequence[EventRecord], fresh: bool = True) -> Generator[Any, None, None]:
        """``yield from`` it in an awaiting task: returns once ``records``
        completed or one failed. Keeps one asyncio future and one watch per
        record alive while it waits."""
        loop = self._loop()
        assert loop is not None
        waiter = loop.create_future()
        if len(records) == 1:
            watch = self.watch_one(records[0], functools.partial(_resolve, waiter), fresh)
            try:
                yield from waiter
            finally:
                self.watchlist.remove(watch)
            return
        cancel = self.watch_all(records, functools.partial(_resolve, waiter), fresh)
        try:
            yield from waiter
        finally:
            cancel()

    async def until(self, register: Register) -> None:
        loop = self._loop()
        assert loop is not None
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        cancel = register(wake)
        try:
            await waiter
        finally:
            cancel()


# The states of an _AsyncioAwait.
_NEW, _WAITING, _FIRED, _CANCELLED, _FINISHED = 0, 1, 2, 3, 4


class _AsyncioAwait(Watch):
    """One ``await`` of a future whose one record is pending, in an asyncio
    task: the watch in the waiter's list, the iterator that ``__await__``
    returns, and the future the task waits on, all in one object.

    Every object alive per pending wait costs the cyclic GC (10,000 awaits
    pending walk them all), and each one made costs its allocation: the
    general path (:meth:`AsyncioDriver.wait_records`, run from the future's
    ``__await__`` generator) keeps two generators, an asyncio future and
    its iterator, a ``functools.partial`` and a watch per wait.

    As an iterator: the first ``next()`` adds the watch and yields this
    object to the task (the ``yield`` of ``asyncio.Future.__await__``); the
    next, once the waiter saw the record complete or fail, returns
    ``finish(future, asyncio.CancelledError)``, or raises what it raises.
    ``throw()`` and ``close()`` (the awaiting coroutine is cancelled or
    closed) remove the watch. As a future, it is what ``asyncio.Task``
    needs of one it waits on (``asyncio.Future``'s protocol, for its one
    task): ``_asyncio_future_blocking``, ``get_loop()``,
    ``add_done_callback()``, ``remove_done_callback()``, ``done()``,
    ``cancelled()``, ``result()``, ``exception()`` and ``cancel()``. Used in
    the loop's thread only, as a task's future is.
    """

    __slots__ = (
        "_asyncio_future_blocking",
        "_context",
        "_driver",
        "_finish",
        "_future",
        "_loop",
        "_message",
        "_state",
        "_wakeup",
    )

    def __init__(
        self,
        driver: AsyncioDriver,
        loop: asyncio.AbstractEventLoop,
        future: Any,
        record: EventRecord,
        finish: Finish,
    ) -> None:
        # Watch's fields, set here rather than by Watch.__init__: one call
        # fewer per wait. The callback is set when the wait starts (next()).
        self.record = record
        self.seq = record.seq
        self.callback = None
        self._driver = driver
        self._loop = loop
        self._future = future
        self._finish = finish
        self._state = _NEW
        self._wakeup: Callable[..., object] | None = None
        self._context: Any = None
        self._message: object = None
        self._asyncio_future_blocking = False

    def __repr__(self) -> str:  # asyncio's task repr shows it (wait_for=...)
        state = ("new", "waiting", "woken", "cancelled", "finished")[self._state]
        future = self._future  # dropped once finished
        return f"<cudafut await {state}>" if future is None else f"<cudafut await {state} of {future!r}>"

    # -- the iterator, driven by the awaiting coroutine ------------------------

    def __iter__(self) -> _AsyncioAwait:
        return self

    def __next__(self) -> _AsyncioAwait:
        state = self._state
        if state == _FIRED:
            future = self._future
            self._state = _FINISHED
            self._future = None
            self._context = None
            raise StopIteration(self._finish(future, asyncio.CancelledError))
        if state == _NEW:
            # Driven by hand from another thread or loop? The loop, not the
            # driver, is compared (one driver per loop, and no lookup), through
            # asyncio's own getter that returns None instead of raising.
            if asyncio._get_running_loop() is not self._loop:  # noqa: SLF001 - in asyncio.__all__
                raise RuntimeError("a CudaFuture's await must run in the task that started it")
            self._state = _WAITING
            self.callback = self  # the waiter calls self(record) when it fires
            self._driver.watch(self)
            self._asyncio_future_blocking = True
            return self
        if state == _CANCELLED:
            self._stop()
            raise self._cancelled_error()
        # Resumed while waiting (or after the end): not driven by a task.
        raise RuntimeError("await wasn't used with future")

    def send(self, value: object) -> _AsyncioAwait:
        """As ``next()``: a task sends nothing else (``asyncio.Future``'s
        iterator ignores what is sent too)."""
        return self.__next__()

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> _AsyncioAwait:
        """Stop waiting and raise the exception thrown in (a cancellation),
        as a generator would (the legacy ``throw(type, value)`` included)."""
        self._stop()
        if not isinstance(val, BaseException):  # throw(exc), or throw(type[, value])
            val = (typ() if val is None else typ(val)) if isinstance(typ, type) else typ
        if tb is not None:
            val = val.with_traceback(tb)
        raise val

    def close(self) -> None:
        """Stop waiting (the awaiting coroutine is closed)."""
        self._stop()

    def _stop(self) -> None:
        # In the task, on the loop's thread: a cancel() only marks the wait
        # (Task.cancel may be misused from another thread; the watchlist is
        # the loop's). A watch removed stays in its stream's queue until the
        # waiter passes it: it keeps only its record from here on.
        self._driver.watchlist.remove(self)  # a no-op once fired or removed
        self._wakeup = None
        self._context = None
        self._future = None
        self._state = _FINISHED

    def __call__(self, record: EventRecord) -> None:
        """The waiter saw the record complete or fail: wake the task."""
        if self._state == _WAITING:
            self._state = _FIRED
            self._schedule()

    def _schedule(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None  # breaks the cycle task -> self -> task
            self._loop.call_soon(wakeup, self, context=self._context)

    def _cancelled_error(self) -> BaseException:
        message = self._message
        return asyncio.CancelledError() if message is None else asyncio.CancelledError(message)

    # -- the future, as asyncio.Task uses it ----------------------------------

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def add_done_callback(self, fn: Callable[..., object], *, context: Any = None) -> None:
        if self._wakeup is not None:
            raise RuntimeError("a cudafut await is waited on by one task only")
        self._wakeup = fn
        self._context = context
        if self._state == _FIRED or self._state == _CANCELLED:
            self._schedule()

    def remove_done_callback(self, fn: Callable[..., object]) -> int:
        if self._wakeup is not None and self._wakeup == fn:
            self._wakeup = None
            return 1
        return 0

    def done(self) -> bool:
        return self._state != _WAITING and self._state != _NEW

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> None:
        """None once the record completed or failed (the await's value is
        ``next()``'s); raises CancelledError if cancelled."""
        self.exception()

    def exception(self) -> BaseException | None:
        state = self._state
        if state == _CANCELLED:
            raise self._cancelled_error()
        if state in (_WAITING, _NEW):
            raise asyncio.InvalidStateError("Result is not ready.")
        return None

    def cancel(self, msg: object = None) -> bool:
        """Wake the task with CancelledError (its ``throw()`` then removes
        the watch); False if the wait is over already (the task then
        cancels at its next step)."""
        if self._state != _WAITING:
            return False
        self._state = _CANCELLED
        self._message = msg
        self._schedule()
        return True


class _Notice:
    """One armed notice: the record's sequence number on its stream, and
    the pipe (CUDA or a native notice thread closes ``w``; the loop watches
    ``r``)."""

    __slots__ = ("r", "seq", "w")

    def __init__(self, seq: int, r: int, w: int) -> None:
        self.seq = seq
        self.r = r
        self.w = w


def _close_all(notices: dict[tuple[int, ...], _Notice]) -> None:
    """Close the read ends of notices left when a driver goes (the write
    ends are CUDA's to close)."""
    for notice in notices.values():
        try:  # noqa: SIM105 - a finalizer: no contextlib
            os.close(notice.r)
        except OSError:
            pass
    notices.clear()


#: The drivers that may hold notices, for a forked child (see below).
_with_notices: weakref.WeakSet[AsyncioDriver] = weakref.WeakSet()


def _notices_after_fork_in_child() -> None:
    """A forked child holds copies of the write ends of the parent's armed
    notices, and CUDA runs nothing in it: while it lives, the parent's
    pipes would never reach end-of-file. Close the child's copies (each
    still the pipe of its read end: the same inode), and forget them."""
    for driver in list(_with_notices):
        for notice in driver._notices.values():  # noqa: SLF001 - this module's own class
            try:
                w_stat, r_stat = os.fstat(notice.w), os.fstat(notice.r)
                same = (w_stat.st_dev, w_stat.st_ino) == (r_stat.st_dev, r_stat.st_ino)
            except OSError:
                same = False  # closed by CUDA before the fork: nothing to close
            for fd in (notice.w, notice.r) if same else (notice.r,):
                with contextlib.suppress(OSError):
                    os.close(fd)
        driver._notices.clear()  # noqa: SLF001 - this module's own class


_lifetimes.at_fork_in_child(_notices_after_fork_in_child)


class TrioDriver(LoopDriver):
    """Polls from one trio system task per run."""

    # trio cancels with scopes; a cancelled *future* is a plain error there.
    cancelled_error = concurrent.futures.CancelledError
    name = "trio waiter"

    def __init__(self, trio: Any) -> None:
        super().__init__()
        self._trio = trio
        # Weakly: the registry is keyed by the token, and a strong reference
        # from its value would keep every finished run alive.
        self._token = weakref.ref(trio.lowlevel.current_trio_token())
        self._wakeup = trio.Event()
        self._timer = make_timer()
        self._sleeping = False
        trio.lowlevel.spawn_system_task(self._run, name="cudafut-waiter")

    async def _checkpoint(self) -> None:
        await self._trio.lowlevel.checkpoint()

    def ensure_polling(self) -> None:
        self._wakeup.set()
        if self._sleeping and self._timer is not None:
            self._timer.arm(0)  # fires at once: ends the timer sleep

    async def _run(self) -> None:
        trio = self._trio
        timer = self._timer
        timer_fired = False
        try:
            while True:
                if not self.watchlist.pending:
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                delay = self.step(timer_fired)
                timer_fired = False
                if delay is None:
                    continue
                if not delay:
                    await trio.lowlevel.checkpoint()
                    continue
                if timer is None:
                    with trio.move_on_after(delay):
                        await self._wakeup.wait()
                        continue
                    timer_fired = True
                    continue
                timer.arm(delay)
                self._sleeping = True
                try:
                    await trio.lowlevel.wait_readable(timer.fd)
                finally:
                    self._sleeping = False
                timer.drain()
                timer_fired = not self._wakeup.is_set()
        finally:
            if timer is not None:
                self._timer = None
                timer.close()
            # Cancelled: the run is ending. What is still watched can never
            # fire on it; dropped, its callbacks let go of their futures and
            # records, and of the run's objects: a callback holding the token
            # would keep this driver in the registry (its key) for good.
            self.watchlist.clear()
            token = self._token()
            if token is not None and _trio_drivers.get(token) is self:
                del _trio_drivers[token]

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        token = self._token()
        if token is None:
            return
        with contextlib.suppress(self._trio.RunFinishedError):  # the run ended
            token.run_sync_soon(fn)

    def wait_records(self, records: Sequence[EventRecord], fresh: bool = True) -> Generator[Any, None, None]:
        """As :meth:`AsyncioDriver.wait_records`, with a trio event."""
        event = self._trio.Event()
        cancel = self.watch_all(records, lambda _error: event.set(), fresh)
        try:
            yield from event.wait().__await__()
        finally:
            cancel()

    async def until(self, register: Register) -> None:
        event = self._trio.Event()
        cancel = register(event.set)
        try:
            await event.wait()
        finally:
            cancel()


# -- which library runs: the one place that tells asyncio and trio apart ---------------------
# Each asks asyncio first: trio's guest mode runs inside a running asyncio loop.


def current_library() -> ModuleType | None:
    """The async library whose loop runs in this thread: the ``asyncio``
    module (asyncio and uvloop loops), the ``trio`` module, or None. Never
    imports trio; a dictionary lookup and a call or two."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return asyncio
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        return trio
    return None


def current_task() -> object:
    """The running asyncio or trio task, or this thread (outside any loop,
    or in a loop callback that runs in no task)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        task = asyncio.current_task()
        if task is not None:
            return task
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_task()
        except RuntimeError:
            pass
    return threading.current_thread()


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` cancels a task: asyncio's ``CancelledError`` or, with
    trio imported, trio's ``Cancelled``."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


async def run_in_thread(fn: Callable[[], None]) -> None:
    """Await ``fn()`` run in a worker thread of the running loop's library
    (the asyncio loop's default executor, or ``trio.to_thread``).

    Raises:
        RuntimeError: no asyncio, uvloop or trio loop runs in this thread.
    """
    library = current_library()
    if library is None:
        raise RuntimeError("no asyncio (or uvloop) or trio loop runs in this thread")
    if library is asyncio:
        await asyncio.get_running_loop().run_in_executor(None, fn)
    else:
        await library.to_thread.run_sync(fn)


# -- a task group on the running loop: what a Batcher needs of it ----------------------------
# cudafut.Batcher forms batches in a task of its own and runs each in another; these
# give it the loop's time, a wakeable sleep and its tasks on asyncio and on trio alike.


class TrioSlot:
    """Where a trio request to a :class:`cudafut.Batcher` waits for its
    result: the part of an asyncio future's interface the batcher uses (an
    asyncio request waits on a plain asyncio future). Setting it costs a
    ``trio.Event.set``; :meth:`wait` blocks the task, never the thread."""

    __slots__ = ("_cancelled", "_error", "_event", "_traceback", "_value")

    def __init__(self, trio: Any) -> None:
        self._event = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._traceback: Any = None
        self._cancelled = False

    def done(self) -> bool:
        return self._cancelled or self._event.is_set()

    def cancel(self) -> None:
        self._cancelled = True

    def set_result(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._traceback = error.__traceback__  # each waiter raises it from here, not from the last
        self._event.set()

    async def wait(self) -> Any:
        try:
            await self._event.wait()
        except BaseException:
            self._cancelled = True  # its batch, if not run yet, drops it
            raise
        if self._error is not None:
            raise self._error.with_traceback(self._traceback)
        return self._value


class AsyncioTasks:
    """A :class:`cudafut.Batcher`'s few needs on the running asyncio (or
    uvloop) loop: its time, a sleep that :meth:`wake` ends early, and tasks
    spawned and kept (``tasks``) until they end. Each call costs what the
    loop's own does; none blocks the thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tasks: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Future[bool] | None = None

    def now(self) -> float:
        return self.loop.time()

    def wake(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(False)

    async def sleep(self, deadline: float | None) -> bool:
        """Until :meth:`wake` or ``deadline`` (loop time; None: no limit);
        True when it ended at the deadline. asyncio rounds its timers up to
        whole milliseconds, uvloop to whole milliseconds either way: its
        timer may fire while ``now()`` is still below ``deadline``, so the
        caller takes True as the deadline reached (asking ``now()`` again
        would sleep again for less than a millisecond, a busy loop)."""
        wake = self._wake = self.loop.create_future()
        timer = None if deadline is None else self.loop.call_at(deadline, _at_deadline, wake)
        try:
            return bool(await wake)
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        task: asyncio.Task[None] = self.loop.create_task(fn(*args))  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class TrioTasks:
    """:class:`AsyncioTasks`' calls in a trio run, its tasks in ``nursery``."""

    def __init__(self, trio: Any, nursery: Any) -> None:
        self.trio = trio
        self.nursery = nursery
        self._wake: Any = None

    def now(self) -> float:
        return float(self.trio.current_time())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def sleep(self, deadline: float | None) -> bool:
        """As :meth:`AsyncioTasks.sleep`: True when it ended at the deadline."""
        wake = self._wake = self.trio.Event()
        try:
            with self.trio.move_on_at(math.inf if deadline is None else deadline) as scope:
                await wake.wait()
            return bool(scope.cancelled_caught)
        finally:
            self._wake = None

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.nursery.start_soon(fn, *args)


# -- the running loop's driver ---------------------------------------------------------------

# An asyncio loop's driver is an attribute of the loop: a callback that the
# driver still watches when the loop ends may hold the loop, and the loop, the
# driver and its watches are then one cycle, collected together. Held by a
# registry keyed weakly by the loop, the driver would hold its own key alive
# for good (the registry below is for loops that refuse attributes).
_DRIVER_ATTRIBUTE: Final = "_cudafut_driver"
_asyncio_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioDriver] = (
    weakref.WeakKeyDictionary()
)
_trio_drivers: weakref.WeakKeyDictionary[Any, TrioDriver] = weakref.WeakKeyDictionary()


def _no_driver() -> AsyncioDriver | None:
    return None


# The driver found last, tried first: most awaits run in the loop of the one
# before. A weak reference, so that a closed loop's driver (its timer's
# descriptor) still goes with the loop; WeakKeyDictionary.get, a Python
# call that makes a weak reference, costs several times this.
_last_driver: Callable[[], AsyncioDriver | None] = _no_driver


def current_driver() -> LoopDriver | None:
    """The driver of the loop running in this thread, or None."""
    global _last_driver
    loop = asyncio._get_running_loop()  # noqa: SLF001 - in asyncio.__all__; None, not an exception
    if loop is not None:
        driver = _last_driver()
        if driver is not None and driver._loop() is loop:  # noqa: SLF001 - this module's class
            return driver
        driver = getattr(loop, _DRIVER_ATTRIBUTE, None)
        if driver is None or driver._loop() is not loop:  # noqa: SLF001 - this module's class
            driver = _asyncio_drivers.get(loop)
        if driver is None:
            driver = AsyncioDriver(loop)
            try:
                setattr(loop, _DRIVER_ATTRIBUTE, driver)
            except AttributeError:  # __slots__: the registry
                _asyncio_drivers[loop] = driver
        _last_driver = weakref.ref(driver)
        return driver
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        trio_driver = _trio_drivers.get(token)
        if trio_driver is None:
            trio_driver = _trio_drivers[token] = TrioDriver(trio)
        return trio_driver
    return None


def require_driver() -> LoopDriver:
    """The driver of the loop running in this thread; RuntimeError if none."""
    driver = current_driver()
    if driver is None:
        raise RuntimeError(
            "awaiting a CudaFuture needs a running asyncio (or uvloop) or trio "
            "event loop in this thread; outside a loop use fut.result()"
        )
    return driver


# The native core's twin of _AsyncioAwait (cudafut/_core.pyx), where it was
# built: the same protocol, with C members and methods that a task calls
# without a Python frame.
_native = _compiled.native()
if _native is not None:
    _AsyncioAwait = _native.AsyncioAwait  # type: ignore[misc]
