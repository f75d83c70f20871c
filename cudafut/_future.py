"""CudaFuture: a value whose GPU work is enqueued (the class, its then()
link and its constructor); the producers are in cudafut/_producers.py,
the internal interface other modules use in cudafut/_interface.py.

A future moves through two steps. It is *set* when the producer hands over
its value: :meth:`CudaFuture.set_result` records one CUDA event per device on
that device's current stream, so the value is *orderable*: later GPU work can
be made to wait for it. It is *done* when those events have completed on the
GPU (or when it failed or was cancelled). ``docs/semantics.md`` says what each
call waits for and what it blocks.
"""

from __future__ import annotations

import asyncio
import asyncio.base_futures as _asyncio_base_futures
import asyncio.futures as _asyncio_futures
import concurrent.futures
import enum
import inspect
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from types import CoroutineType as _CoroutineType
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar, overload

from . import (
    _backend,
    _checks,
    _compiled,
    _cuda,
    _events,
    _lifetimes,
    _loops,
    _memory,
    _pools,
    _runtime,
    _torch,
    _waiter,
)
from ._engine import (
    INTERRUPTS,
    call_listener,
    pending_records,
    record_consumers,
    record_current_consumers,
    run_listeners,
)
from ._engine import Listener as Listener  # re-exported: the internal interface's types (_interface)
from ._engine import Pending as Pending
from ._errors import CancelledError, CudaUnavailableError, InvalidStateError, TimeoutError
from ._events import EventRecord, first_error
from ._log import logger
from ._trace import hooks as _trace
from ._values import SCALARS, consumer_on, current_consumer, find_devices, normalize_devices, order_foreign

__all__ = ["CudaFuture"]

T = TypeVar("T")
U = TypeVar("U")


class _State(enum.Enum):
    """Where a future is; it leaves ``PENDING`` once, for one of the others."""

    PENDING = "pending"
    SET = "set"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Module constants for the hot paths (a global is cheaper than an enum
# attribute), compared with ``is``.
_PENDING: Final = _State.PENDING
_SET: Final = _State.SET
_FAILED: Final = _State.FAILED
_CANCELLED: Final = _State.CANCELLED
# The states by public names, for the internal interface (cudafut/_interface.py).
PENDING: Final = _PENDING
SET: Final = _SET
FAILED: Final = _FAILED
CANCELLED: Final = _CANCELLED


class _KeptByProducer:
    """The type of :data:`KEPT_BY_PRODUCER`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KEPT_BY_PRODUCER"


#: A set future's ``_keep`` when its producer itself keeps the value and the
#: work's inputs alive until the records complete or fail (a collective's
#: process group, until its watchdog sees it end): the finalizer of such a
#: future dropped while its work is pending has nothing to hold.
KEPT_BY_PRODUCER: Final = _KeptByProducer()

# Timeouts at or beyond this many seconds (about 292 years on Linux) mean "no
# limit": threading refuses them (OverflowError).
_NO_LIMIT: Final = threading.TIMEOUT_MAX

#: Which stream pool ``then()`` and ``submit()`` take their streams from.
Priority = Literal["normal", "high"]


def check_timeout(timeout: float | None) -> float | None:
    """Validate a timeout and turn it into a ``perf_counter`` deadline.

    Any real number (NumPy scalars and ``Fraction`` included, bools not);
    ``None``, ``math.inf`` and any timeout of ``threading.TIMEOUT_MAX``
    seconds or more (``10**400`` too) give ``None``: no limit.

    Raises:
        TypeError: ``timeout`` is not a number.
        ValueError: ``timeout`` is negative or NaN.
    """
    if timeout is None:
        return None
    seconds = _checks.timeout_seconds(timeout)
    if seconds >= _NO_LIMIT:
        return None
    return time.perf_counter() + seconds


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


#: What then() says to do instead of a coroutine function.
_THEN_INSTEAD: Final = (
    "Pass a plain function (def) that enqueues the GPU work, or await the future and then the "
    "coroutine on your loop: `value = await fut; result = await fn(value)`"
)


# The native core (cudafut/_core.pyx), where it runs, keeps a future's state
# in C members: its FutureCore is the class's base, holding what __slots__
# names here in the pure core.
_native = _compiled.native()


class _PureCore:
    """The pure core's base of CudaFuture (its state is in CudaFuture's slots)."""

    __slots__ = ()


if TYPE_CHECKING:
    _Base = _PureCore
else:
    _Base = _PureCore if _native is None else _native.FutureCore


class CudaFuture(_Base, Generic[T]):
    """The value of GPU work that has been enqueued and may not have run yet.

    Args:
        devices: the devices whose streams :meth:`set_result` records on: one
            CUDA device ordinal (an ``int``: ``0``, ``1``, ...) or an iterable
            of them. ``None`` (the default) means the devices of the value
            itself, found from its arrays.

    Raises:
        TypeError: ``devices`` is neither an int nor an iterable of ints.
        ValueError: ``devices`` is empty, or names a device this process
            does not see (negative, or not below the device count).
        CudaUnavailableError: ``devices`` was given (and is not negative)
            but CUDA cannot be used here.

    A future is created unset; the producer completes it once, with
    :meth:`set_result` or :meth:`set_exception`. Consumers then choose what
    they are willing to block: nothing (``await``, :meth:`then`,
    :meth:`wait`) or the calling thread (:meth:`result`).

    All methods may be called from any thread. Creating a future with
    ``devices=None`` costs about half a µs on the host and blocks nothing.
    """

    __slots__ = (
        (
            "__weakref__",
            "_callbacks",
            "_devices",
            "_exception",
            "_keep",
            "_listeners",
            "_lock",
            "_records",
            "_retrieved",
            "_set_event",
            "_state",
            "_stream_given",
            "_traceback",
            "_value",
        )
        if _native is None
        else ()  # FutureCore's members
    )

    def __init__(self, devices: int | Iterable[int] | None = None) -> None:
        self._lock = threading.Lock()
        self._state: _State = _PENDING
        self._devices = None if devices is None else normalize_devices(devices)
        self._value: Any = None
        self._exception: BaseException | None = None
        # The exception's traceback when it was stored: re-raising grows
        # ``__traceback__``, so raises and the unretrieved-error log use this.
        self._traceback: TracebackType | None = None
        self._records: tuple[EventRecord, ...] = ()
        # Objects other streams may still read; kept until our events complete.
        # While pending: what this future waits for (a then() parent, a
        # followed future, gather() inputs), to refuse a wait on itself.
        self._keep: object = None
        self._listeners: list[Listener] | None = None
        self._set_event: threading.Event | None = None
        self._retrieved = False
        # Whether a then() child already continues on this future's stream.
        self._stream_given = False
        # Done callbacks not started yet, for remove_done_callback().
        self._callbacks: list[_DoneCallback] | None = None
        if _trace.active is not None:
            _trace.created(self)

    # -- producer side ---------------------------------------------------

    def set_result(self, value: T) -> None:
        """Complete the future with ``value``, whose GPU work is enqueued.

        Records one event per device of ``value`` (or of the ``devices`` given
        to the constructor) on that device's current stream of the calling
        thread: about 1 µs per device on the host. Never blocks the GPU.

        Then, before it returns and in the calling thread, it runs what waits
        on this future: every pending :meth:`then` callback ``fn`` (with its
        stream set-up), and, transitively, the ``then()`` callbacks of
        children that this completes. ``set_result()`` therefore blocks the
        calling thread for as long as those callbacks take. Awaiting tasks and
        :meth:`add_done_callback` callbacks are only handed to their loop or
        thread (a ``call_soon_threadsafe`` each); they run there. Chains of
        any length complete in a loop, without recursion. If a ``then()``
        callback raises ``KeyboardInterrupt`` or ``SystemExit``, its child
        fails with it and ``set_result()`` raises it once everything else
        waiting has run (docs/semantics.md, "Exceptions in callbacks").

        With PyTorch imported, the events of the torch CUDA tensors in
        ``value`` are recorded on PyTorch's current stream of their device
        instead (a few µs more; docs/interop.md). Arrays of other libraries
        are ordered before those streams first (JAX's by DLPack, Numba's by
        their stream: docs/interop.md, "Work queued by other libraries").

        Raises:
            InvalidStateError: the future was already set or cancelled.
            ValueError: ``value`` holds no GPU array and no ``devices`` were
                given, so there would be nothing to order against; or it
                holds an array whose producer cannot be ordered.
        """
        if self._state is not _PENDING:
            self._check_pending()
        if _runtime.forked:  # a flag test, without a call
            _runtime.check_usable()
        # Other libraries' work (JAX's streams) before the streams recorded on
        # (docs/design.md, hazard 9); nothing for CuPy arrays and torch tensors.
        order_foreign(value, current_consumer if self._devices is None else _onto(self._devices))
        torch = _torch.loaded()
        if torch is not None:  # torch tensors are recorded on PyTorch's current streams
            records: tuple[EventRecord, ...] = _torch.record_value(torch, value, self._devices)
        else:
            devices = self._devices or find_devices(value)
            if len(devices) == 1:
                records = (_events.record_current(devices[0]),)
            else:
                records = tuple(_events.record_current(d) for d in devices)
        if not records:  # under cudafut.testing's fake: its current device
            records = tuple(_events.record_current(d) for d in _backend.current.devices_of_host_value())
        if not records:
            raise ValueError(
                f"set_result() got a value on no GPU ({type(value).__name__}); "
                "pass devices=... to CudaFuture() to say which device's "
                "current stream produces it"
            )
        self._complete(_SET, value, None, records)

    def set_exception(self, exception: BaseException | type[BaseException]) -> None:
        """Complete the future with an error; consumers get this exception.

        Consumers get this very object, raised with the traceback it has now.
        In the calling thread, before returning, it fails the pending
        :meth:`then` children (without calling their ``fn``) and hands
        awaiting tasks and done callbacks to their loops: a few µs each.
        Blocks neither the thread otherwise nor the GPU.

        Raises:
            InvalidStateError: the future was already set or cancelled.
            TypeError: ``exception`` is not an exception.
        """
        if isinstance(exception, type) and issubclass(exception, BaseException):
            exception = exception()
        if not isinstance(exception, BaseException):
            raise TypeError(f"set_exception() needs an exception, not {exception!r}")
        if isinstance(exception, StopIteration):
            raise TypeError("StopIteration cannot be raised through a future")
        self._complete(_FAILED, None, exception, (), None, exception.__traceback__)

    def cancel(self) -> bool:
        """Cancel the future if it is not set yet; return whether it is cancelled.

        A set future cannot be cancelled: its GPU work is already enqueued.
        Cancelling cancels the pending :meth:`then` children and
        :func:`gather` results that depend on this future, in the calling
        thread (see docs/semantics.md, "Errors through chains"); blocks
        neither the thread otherwise nor the GPU.
        """
        with self._lock:
            if self._state is _CANCELLED:
                return True
            if self._state is not _PENDING:
                return False
            self._keep = None  # what it waited for (see __init__)
            self._state = _CANCELLED
            listeners, self._listeners = self._listeners, None
            event = self._set_event
        if _trace.active is not None:
            self._notify_traced(event, listeners)
        else:
            self._notify(event, listeners)
        return True

    def _cancel_later(self) -> Pending | None:
        """:meth:`cancel` for a pending future, leaving its listeners to the
        caller (see ``_engine.run_listeners``)."""
        with self._lock:
            if self._state is not _PENDING:
                return None
            self._keep = None
            self._state = _CANCELLED
            listeners, self._listeners = self._listeners, None
            event = self._set_event
        return self._announce(event, listeners)

    # -- queries -----------------------------------------------------------

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices the future's events live on (before set: the ones given)."""
        if self._state is _SET:
            return tuple(dict.fromkeys(r.device for r in self._records))
        return self._devices or ()

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` cancelled the future."""
        return self._state is _CANCELLED

    def done(self) -> bool:
        """Whether the future is set and its GPU work complete, or it failed.

        Non-blocking: queries its events in order up to the first one pending
        (about 1.7 µs each; an event known complete costs no query). A
        failure already known of a later event makes it done too.
        """
        state = self._state
        if state is _SET:
            return self._events_done()
        return state is not _PENDING

    def _events_done(self) -> bool:
        records = self._records
        for rec in records:
            status = rec.query()
            if status is None:
                # Done all the same if another record is known to have failed,
                # as an await, a callback and result() then are.
                return first_error(records) is not None
            if status:
                return True
        self._keep = None
        return True

    # -- consumer side -------------------------------------------------------

    def result(self, timeout: float | None = None) -> T:
        """Block the calling thread until the GPU work is done; return the value.

        Waits until the future is set, then until its events complete,
        sleeping with the GIL released (other threads and the GPU run on).
        Never call it from an event loop: ``await`` the future instead.

        Args:
            timeout: seconds to wait at most; ``None`` or ``math.inf``: no
                limit.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            CudaError: the GPU work failed.
            CancelledError: the future was cancelled.
            ValueError: ``timeout`` is negative or NaN.
            TypeError: ``timeout`` is not a number.
            Exception: whatever the producer set with :meth:`set_exception`.
        """
        self._block_until_done(timeout)
        value = self._outcome(CancelledError)
        if self._records:
            record_current_consumers(value, self._records, untracked=False)
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Like :meth:`result`, but return the error instead of raising it.

        Blocks the calling thread the same way as :meth:`result`, until the
        future is done; never call it from an event loop.

        Args:
            timeout: seconds to wait at most; ``None`` or ``math.inf``: no
                limit.

        Returns:
            The exception the producer set, the :class:`CudaError` the GPU
            work reported, or ``None`` if the work succeeded.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            CancelledError: the future was cancelled.
            ValueError: ``timeout`` is negative or NaN.
            TypeError: ``timeout`` is not a number.
        """
        self._block_until_done(timeout)
        state = self._state
        if state is _SET:
            return first_error(self._records)
        if state is _CANCELLED:
            raise CancelledError("the CudaFuture was cancelled before it was set")
        self._retrieved = True
        return self._exception

    def wait(self, timeout: float | None = None) -> T:
        """Order the caller's streams after the GPU work; return the value.

        Waits (blocking the thread) only until the future is *set*; then makes
        the calling thread's current stream of each of the future's devices
        wait on its events (``cudaStreamWaitEvent``, about 0.4 µs each) and
        returns at once. Work you enqueue next on those streams runs after
        the producer's. Blocks neither the GPU nor, once set, the thread.

        The value's CuPy arrays are marked used by those streams
        (:func:`cudafut.record_stream`): when you drop them, their memory goes
        back to CuPy's pool only after the work you enqueued on your streams
        by then is done, so no ``keep=`` is needed. A value that is not a
        CuPy array (memory cudafut's allocator wrapper did not make) is kept
        alive until the work queued on your streams at this call is done. A
        PyTorch tensor is recorded on them with ``Tensor.record_stream``, and
        a stream of yours that may be destroyed (a CuPy ``Stream``) is kept
        alive until PyTorch has recorded on it at the tensor's free (about
        1 µs the first time; :func:`cudafut.record_stream` says when it goes).

        Args:
            timeout: seconds to wait at most for the future to be set;
                ``None`` or ``math.inf``: no limit.

        Raises:
            TimeoutError: not set within ``timeout`` seconds.
            CudaError: the GPU work is already known to have failed.
            CancelledError: the future was cancelled.
            ValueError: ``timeout`` is negative or NaN.
            TypeError: ``timeout`` is not a number.
        """
        if _runtime.forked:  # a flag test, without a call
            _runtime.check_usable()
        deadline = check_timeout(timeout)
        self._block_until_set(deadline, timeout)
        if self._state is _SET:
            try:
                for rec in self._records:
                    if rec.status is None:
                        rec.wait_on(int(_backend.current.current_stream(rec.device).ptr), rec.device)
                torch = _torch.loaded()
                if torch is not None:  # PyTorch's current streams wait too
                    _torch.wait_current(torch, self._records, self._value)
                value = self._outcome(CancelledError)
                record_current_consumers(value, self._records, untracked=True)
            except CudaUnavailableError as exc:
                error = _explained(self, exc)
                if error is exc:
                    raise
                raise error from exc
            return value
        return self._outcome(CancelledError)

    def __await__(self) -> Generator[Any, None, T]:
        """``await fut``: resolve when the GPU work is done; never blocks the loop.

        One waiter per event loop polls the events of every awaited future,
        as the wait policy says (:func:`set_wait_policy`). While the policy
        says spin (for ``spin_s``, 100 µs by default, after a new wait, and
        around the predicted end of work whose duration the waiter has
        learnt), the loop runs one poll (one ``cudaEventQuery``, about 2 µs)
        per loop iteration, taking that CPU but never blocking other tasks;
        otherwise it polls once per sleep, sleeps being at most
        ``max_sleep_s`` (1 ms by default). See docs/performance.md for the CPU
        measured. Works on asyncio, uvloop and trio. Cancelling the awaiting
        task removes its wait; the future itself is unaffected. In an asyncio
        task, while other waits share the loop, a pending wait is one object
        (the waiter's watch and the future the task waits on at once); with
        a trace recording (:func:`cudafut.trace`) every await takes the
        general path, where the tracer times it.

        Raises:
            RuntimeError: the future is not done yet and no asyncio, uvloop
                or trio loop runs in this thread.
            CudaError: the GPU work failed.
            asyncio.CancelledError: the future was cancelled (on trio:
                :class:`CancelledError`).
            Exception: whatever the producer set with :meth:`set_exception`.
        """
        if self._state is _SET and not _runtime.forked and _trace.active is None:
            records = self._records
            if len(records) == 1:
                record = records[0]
                if record.status is None and record.query() is None:
                    # Pending: in an asyncio task among other waits, one
                    # object does the whole wait (_loops._AsyncioAwait).
                    driver = _loops.current_driver()
                    if driver is not None:
                        wait = driver.await_one(self, record, CudaFuture._awaited)
                        if wait is not None:
                            return wait  # type: ignore[return-value]
                    return self._await(True)
                return self._ready()
        return self._await(False)

    def _ready(self) -> Generator[Any, None, T]:
        """:meth:`__await__` of a future set with one record, complete or
        failed (a generator that returns at once, for ``await``'s sake)."""
        value = self._awaited(CancelledError)
        yield from ()  # makes this a generator: await takes an iterator
        return value

    def _await(self, seen_pending: bool) -> Generator[Any, None, T]:
        """:meth:`__await__`'s general path. ``seen_pending``: the future is
        set, and its one record was seen pending just now."""
        if not seen_pending:
            if _runtime.forked:  # a flag test, without a call
                _runtime.check_usable()
            if self._state is _SET and self._events_done():
                if _trace.active is not None:
                    _trace.waited_at_once(self, "await")
                return self._awaited(CancelledError)
        driver = _loops.require_driver()
        # A plain generator, not a coroutine: each pending await keeps only a
        # few objects alive, which matters to the cyclic GC at 10k awaits.
        token = _trace.wait_start(self, "await") if _trace.active is not None else None
        if self._state is _PENDING:
            yield from self._until_set(driver).__await__()
        if self._state is _SET:
            records = self._records
            if len(records) == 1:  # the common case, inline
                pending: Sequence[EventRecord] = records if records[0].status is None else ()
            else:
                pending = pending_records(records)
            if pending:
                yield from driver.wait(pending)
        if token is not None:
            _trace.waited("await", token)
        return self._awaited(driver.cancelled_error)

    def _awaited(self, cancelled_error: type[BaseException]) -> T:
        """An await's value, once the future is set and its records
        complete (or failed): the outcome, with the value's GPU memory
        recorded as used on the awaiting thread's current streams."""
        value = self._outcome(cancelled_error)
        if self._records:
            record_current_consumers(value, self._records, untracked=False)
        return value

    def _until_set(self, driver: _loops.LoopDriver) -> Coroutine[Any, Any, None]:
        """Wait in ``driver``'s loop until this future is set, failed or
        cancelled. A method, not a closure in ``__await__``: a closure there
        would give every await two cells for the collector, pending or not."""
        return driver.until(lambda wake: self._on_set_removable(lambda: driver.call_soon_threadsafe(wake)))

    @overload
    def then(self, fn: Callable[[T], CudaFuture[U]], *, priority: Priority = ...) -> CudaFuture[U]: ...
    @overload
    def then(self, fn: Callable[[T], U], *, priority: Priority = ...) -> CudaFuture[U]: ...
    def then(self, fn: Callable[[T], Any], *, priority: Priority = "normal") -> CudaFuture[Any]:
        """Chain GPU work: ``fn(value)`` on pool streams that wait for this future.

        Once this future is set, ``fn`` runs (in the thread that set it, or
        at once in the calling thread if it is set already) with, for each of
        this future's devices, a pool stream made current that first waits on
        this future's event (the first device is made the current device).
        The first child of a future produced on a pool stream continues on
        that stream when nothing was recorded there since (no wait needed: a
        ``submit().then().then()`` chain stays on one stream). The returned
        child future is set with ``fn``'s return value, its events recorded
        on those streams after ``fn`` returns.

        Cost: if this future is already set, ``fn`` runs at once, in the
        calling thread, before ``then()`` returns: the call costs ``fn``'s
        run time plus a few µs, and blocks the calling thread that long.
        Otherwise ``then()`` costs a few µs, and ``fn`` runs later inside
        :meth:`set_result`, blocking the setter's thread. Never blocks the GPU:
        the pool streams wait on the events, the host does not.

        If this future failed, ``fn`` is not called and the child fails with
        the same exception object; if it was cancelled, the child is
        cancelled; if ``fn`` raises, the child fails with that exception
        (any ``BaseException``, its type kept; the other callbacks waiting on
        this future still run, and ``KeyboardInterrupt`` or ``SystemExit``
        is then raised again in the thread that ran ``fn``: docs/semantics.md,
        "Exceptions in callbacks"); if ``fn`` returns a CudaFuture, the child
        follows it, or fails with :class:`InvalidStateError` if that future
        is the child or waits on it (it would wait on itself). The child
        keeps this future's value alive until its own events complete.
        Chains of any length work: completing one runs a loop, not a
        recursion.

        Args:
            fn: called with the value; returns the child's value or a future.
            priority: ``"normal"`` or ``"high"``: which pool streams to use.

        Returns:
            The child future.

        ``fn`` must be a plain function: it runs in a thread's own call,
        where no event loop awaits what it returns. A coroutine function
        (``async def``, a :func:`functools.partial` of one, or an object whose
        ``__call__`` is one) is refused at the call, before anything is
        chained; a plain ``fn`` that returns a coroutine (``lambda v:
        afn(v)``) fails the child with :class:`TypeError`, the coroutine
        closed.

        Raises:
            TypeError: ``fn`` is not callable, or is a coroutine function.
            ValueError: ``priority`` is neither ``"normal"`` nor ``"high"``.
            KeyboardInterrupt: (or ``SystemExit``) this future is set and
                ``fn``, run at once, raised it; the child failed with it.
        """
        _checks.check_callable(fn, "then()")
        _checks.not_async(
            fn, "then()", "in the thread that sets this future (at once if it is set)", _THEN_INSTEAD
        )
        prio = _pools.check_priority(priority)
        if _runtime.forked:  # a flag test, without a call
            _runtime.check_usable()
        child: CudaFuture[Any] = new_future("then")
        child._keep = self  # what it waits for (see __init__)
        if _trace.active is not None:
            _trace.chained(self, child, fn)
        self._on_set(lambda: _run_then(self, fn, prio, child))
        return child

    def add_done_callback(self, fn: Callable[[CudaFuture[T]], object]) -> None:
        """Call ``fn(future)`` once the future is done (GPU work complete).

        ``fn`` runs on the event loop that is running in the calling thread,
        or, without one, on cudafut's watcher thread; if that loop ends
        before the future is done, ``fn`` never runs. An exception raised by
        ``fn`` goes to the loop's exception handler or to the ``cudafut``
        logger; it is never lost. ``KeyboardInterrupt`` and ``SystemExit``
        too: they are reported, not raised, so that they stop neither the
        loop's waiter nor the watcher thread, and every other callback still
        runs (docs/semantics.md, "Exceptions in callbacks").

        Never blocks the loop; while waiting, the loop's waiter polls as for
        ``await`` (one ``cudaEventQuery``, about 2 µs, per loop iteration
        while the wait policy says spin, otherwise one per sleep of at most
        ``max_sleep_s``).

        :meth:`remove_done_callback` removes it until it starts.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        _checks.check_callable(fn, "add_done_callback()")
        self._when_done(fn, _loops.current_driver() or _waiter.thread_waiter())

    def remove_done_callback(self, fn: Callable[[CudaFuture[T]], object]) -> int:
        """Remove every :meth:`add_done_callback` ``fn`` that has not started; return how many.

        As :meth:`asyncio.Future.remove_done_callback`: callbacks are compared
        with ``==`` (a bound method equals another of the same object and
        function), and ``0`` means none was waiting. A callback already
        running or run is not counted. Callable from any thread; costs a
        comparison per callback added (``==`` runs outside the future's
        lock) and blocks nothing.
        """
        with self._lock:
            waiting = list(self._callbacks or ())
        matches = [entry for entry in waiting if entry.fn == fn]
        if not matches:
            return 0
        with self._lock:
            return self._drop_callbacks(matches)

    def _drop_callbacks(self, entries: list[_DoneCallback]) -> int:
        # Under the lock: those of ``entries`` not started never will be.
        removed = 0
        for entry in entries:
            if entry.state == _WAITING:
                entry.state = _REMOVED
                removed += 1
        if self._callbacks is not None:
            self._callbacks = [e for e in self._callbacks if e.state == _WAITING] or None
        return removed

    def to_asyncio(self, *, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[T]:
        """An :class:`asyncio.Future` done when this one is done (GPU work complete).

        Use it where asyncio wants a real future: callbacks that take an
        ``asyncio.Future`` (``add_done_callback`` with a context), libraries
        that check ``asyncio.isfuture``, code that hands the future to
        another thread's loop (``loop=``). A plain ``await fut`` needs none
        of this. (``asyncio.wrap_future`` takes only
        ``concurrent.futures.Future`` objects, and says so for a CudaFuture;
        :func:`cudafut.wrap_future` is an older name of this method.)

        The returned future gets this future's value, its exception (the
        same object, a :class:`CudaError` for failed GPU work) or, if this
        one was cancelled, is cancelled. **Cancelling the returned future
        cancels neither this future nor its GPU work**: the work is enqueued
        and cannot be taken back, and this future may have other consumers;
        the pending watch is dropped.

        Costs a few µs and blocks nothing. ``loop`` running in the calling
        thread (the default: the running loop): its waiter watches the GPU
        work as for ``await`` (a poll per loop iteration while the wait
        policy says spin, otherwise one per sleep of at most
        ``max_sleep_s``) and completes the future on the loop. Another
        thread's ``loop``: cudafut's watcher thread watches the work and
        hands the result over with ``loop.call_soon_threadsafe``. Callable
        from any thread.

        Raises:
            TypeError: ``loop`` is not an asyncio event loop.
            RuntimeError: no ``loop`` given and no asyncio (or uvloop) loop
                runs in this thread (on trio, ``await`` the CudaFuture itself).
        """
        out: asyncio.Future[T] = _bridged().to_asyncio(self, loop)
        return out

    def to_concurrent(self) -> concurrent.futures.Future[T]:
        """A :class:`concurrent.futures.Future` done when this one is done.

        For thread-pool code: its ``result()`` blocks as
        ``concurrent.futures`` does (a condition variable), and it works with
        ``concurrent.futures.wait()`` and ``as_completed()``. cudafut's
        watcher thread watches the GPU work (never spinning: it notices a
        completion within its sleeps of at most ``max_sleep_s``, 1 ms by
        default, plus the operating system's wake-up delay) and completes the
        returned future there, running its callbacks in that thread.
        Cancelling it cancels neither this future nor its GPU work. Costs a
        few µs; blocks nothing.
        """
        out: concurrent.futures.Future[T] = _bridged().to_concurrent(self)
        return out

    def to_torch(self) -> Any:
        """A ``torch.futures.Future`` with this future's value, ordered like it.

        Needs PyTorch imported (cudafut never imports it). When this future
        is set (in the setter's thread) and its value holds torch CUDA
        tensors on every device it has events on, PyTorch's current stream of
        each of those devices waits on the events and the torch future is set
        at once: torch's ``wait()``, ``value()`` and callbacks are then
        ordered on torch's streams, as for any torch future with devices.
        Otherwise (a value torch cannot see on the GPU: CuPy arrays, or a
        future whose devices were not known when ``to_torch()`` was called)
        the torch future is completed once the GPU work is *done*, from
        cudafut's watcher thread (latency as :meth:`to_concurrent`). torch
        runs its callbacks in the thread that completes it. Failures and
        cancellation become the torch future's exception. Costs a few µs;
        blocks nothing.

        Raises:
            RuntimeError: PyTorch is not imported.
        """
        return _bridged().to_torch(self)

    @property
    def _asyncio_future_blocking(self) -> None:
        """asyncio's mark of its own futures: a CudaFuture is not one.

        ``asyncio.isfuture(fut)`` is therefore False, so ``ensure_future``,
        ``gather`` and ``wait_for`` wrap it in a task like any awaitable. The
        property exists for one caller: :func:`asyncio.wrap_future`, which
        would fail with a bare ``AssertionError`` (it takes
        ``concurrent.futures.Future`` objects only), is told what to use.
        """
        isfuture = sys._getframe(0)
        if isfuture.f_code.co_name == "_asyncio_future_blocking":  # no frame where compiled
            isfuture = isfuture.f_back  # type: ignore[assignment]
        caller = isfuture.f_back
        if isfuture.f_code is _ISFUTURE_CODE and caller is not None and caller.f_code is _WRAP_FUTURE_CODE:
            raise TypeError(
                "asyncio.wrap_future() takes a concurrent.futures.Future; for a CudaFuture use "
                "fut.to_asyncio() (or cudafut.wrap_future(fut)), or simply await it"
            )
        return None

    # -- internals -----------------------------------------------------------

    def _when_done(self, fn: Callable[[CudaFuture[T]], object], driver: _waiter.Driver) -> None:
        """Call ``fn(self)`` in ``driver``'s thread once done, unless
        :meth:`remove_done_callback` removes it first (add_done_callback and
        the bridges)."""
        entry = _DoneCallback(fn, driver)
        with self._lock:
            if self._callbacks is None:
                self._callbacks = [entry]
            else:
                self._callbacks.append(entry)

        def run() -> None:
            # The callbacks added before this one in the same driver's thread
            # first: one still waiting for its watch's poll is as done.
            for started in self._claim_through(entry):
                driver.run_callback(started.fn, self)

        def when_done() -> None:  # runs in the driver's thread
            records = self._records
            # A record known to have failed makes the future done (done() says
            # so): the others, maybe on another device, are not waited for.
            over = self._state is not _SET or first_error(records) is not None
            pending = [] if over else [r for r in records if r.status is None]
            if pending:
                driver.watch_all(pending, lambda _error: run())
            else:
                run()

        self._on_set(lambda: driver.call_soon_threadsafe(when_done))

    def _claim_through(self, entry: _DoneCallback) -> list[_DoneCallback]:
        """Start ``entry`` and the callbacks of its driver added before it
        that still wait, in the order added (those removed never start);
        return them. Once started, a callback can be removed no more."""
        started: list[_DoneCallback] = []
        with self._lock:
            callbacks = self._callbacks
            driver = entry.driver()
            if callbacks is None or entry not in callbacks or driver is None:
                return started  # started already (by a later one), or removed
            for other in callbacks[: callbacks.index(entry) + 1]:
                if other.driver() is driver and other.state == _WAITING:
                    other.state = _STARTED
                    started.append(other)
            self._callbacks = [e for e in callbacks if e.state == _WAITING] or None
        return started

    def _check_pending(self) -> None:
        if self._state is not _PENDING:
            raise InvalidStateError(
                f"this CudaFuture is already {self._state.value}; a future is "
                "completed once: create a new one for new work"
            )

    def _complete(
        self,
        state: _State,
        value: object,
        exception: BaseException | None,
        records: tuple[EventRecord, ...],
        keep: object = None,
        traceback: TracebackType | None = None,
        later: bool = False,
    ) -> Pending | None:
        """Leave the pending state for ``state``; ``traceback`` goes with
        ``exception`` (its traceback when it was first stored).

        Runs the listeners before returning; with ``later``, returns them
        instead (with this future), for the caller's loop to run: internal
        completions, made by a listener, use it (see ``_engine.run_listeners``).
        """
        with self._lock:
            if self._state is not _PENDING:
                self._check_pending()
            self._value = value
            self._exception = exception
            self._traceback = traceback
            self._records = records
            self._keep = keep
            self._state = state  # last: readers that see it see the rest
            listeners, self._listeners = self._listeners, None
            event = self._set_event
        if later:
            return self._announce(event, listeners)
        if _trace.active is not None:
            self._notify_traced(event, listeners)
        elif event is not None or listeners is not None:  # most futures: nobody waits yet
            self._notify(event, listeners)
        return None

    def _announce(self, event: threading.Event | None, listeners: list[Listener] | None) -> Pending | None:
        """Wake the threads blocked on this just-completed future; return its
        listeners to run (see ``_engine.run_listeners``)."""
        if _trace.active is not None:
            self._notify_traced(event, None)
        elif event is not None:
            event.set()
        return None if listeners is None else (self, listeners)

    def _try_complete(
        self,
        state: _State,
        value: object,
        exception: BaseException | None,
        records: tuple[EventRecord, ...] = (),
        keep: object = None,
        traceback: TracebackType | None = None,
        later: bool = False,
    ) -> Pending | None:
        """Complete unless already completed (a consumer may cancel a child)."""
        try:
            return self._complete(state, value, exception, records, keep, traceback, later)
        except InvalidStateError:
            return None

    def _try_fail(self, exception: BaseException) -> None:
        """Fail with an exception just caught (its traceback is its own)."""
        self._try_complete(_FAILED, None, exception, (), None, exception.__traceback__)

    def _fail_later(self, exception: BaseException) -> Pending | None:
        """:meth:`_try_fail`, leaving the listeners to the caller."""
        return self._try_complete(_FAILED, None, exception, (), None, exception.__traceback__, True)

    def _succeeded(self) -> bool:
        """Set, and none of its events has reported an error so far."""
        return self._state is _SET and first_error(self._records) is None

    def _take_outcome(
        self,
        parents: Sequence[CudaFuture[Any]],
        records: tuple[EventRecord, ...] = (),
        keep: object = None,
        *,
        gather: bool = False,
    ) -> Pending | None:
        """Complete this future with what its completed ``parents`` came to.

        The one way a future takes another's outcome (a ``then()`` child, a
        follower of a returned future, a ``gather()``). The first parent,
        in order, that did not succeed decides:

        - cancelled: this future is cancelled (docs/semantics.md, "Errors
          through chains");
        - failed (:meth:`set_exception`, or an event error already seen):
          this future fails with the same exception object and its original
          traceback. The parent's error counts as retrieved: this future
          carries it now, and logs it if nobody retrieves it from here.

        If every parent succeeded, this future is set with the value of the
        only parent (with ``gather``: the list of the parents' values, in
        order) and the parents' records, each once, followed by ``records``;
        it keeps ``keep`` and the parents (so what they keep) alive until its
        events complete. A future already completed (a consumer cancelled it)
        stays as it is.

        Returns this future's listeners, for the caller to run (see
        ``_engine.run_listeners``): it is called by listeners.
        """
        for parent in parents:
            state = parent._state
            assert state is not _PENDING, "a parent must be completed first"
            if state is _CANCELLED:
                return self._cancel_later()
            if state is _FAILED:
                parent._retrieved = True
                return self._try_complete(_FAILED, None, parent._exception, (), None, parent._traceback, True)
            error = first_error(parent._records)
            if error is not None:
                return self._try_complete(_FAILED, None, error, (), None, None, True)
        if not gather:
            (parent,) = parents
            return self._try_complete(
                _SET, parent._value, None, parent._records + records, (keep, parent), None, True
            )
        # The same record may be shared (a future gathered twice, followers).
        shared = tuple({id(r): r for p in parents for r in p._records}.values())
        value = [p._value for p in parents]
        return self._try_complete(_SET, value, None, shared + records, (keep, tuple(parents)), None, True)

    def _follow(
        self, other: CudaFuture[Any], records: tuple[EventRecord, ...] = (), keep: object = None
    ) -> Pending | None:
        """Complete this future like ``other`` once it is set, plus ``records``.

        Fails it with :class:`InvalidStateError` instead if ``other`` is this
        future or waits on it: it would wait on itself for ever. Returns what
        is left to run if ``other`` is completed already (see
        ``_engine.run_listeners``).
        """
        with _follow_lock:  # two follows closing one cycle cannot both miss it
            if _waits_on(other, self):
                error = InvalidStateError(
                    "fn returned a CudaFuture that is, or waits on (through then() parents, "
                    "followed futures or gather() inputs), the very future fn's result "
                    "completes (its then() child): that future would wait on itself for ever; "
                    "return a value, or a future that does not depend on it"
                )
                return self._fail_later(error)
            with self._lock:
                if self._state is _PENDING:
                    self._keep = other  # what it waits for (see __init__)

        def take() -> Pending | None:
            return self._take_outcome((other,), records, keep)

        if other._listen(take):
            return None
        return take()  # completed already: the caller's loop runs what follows

    def _wait_for(self, upstream: Sequence[CudaFuture[Any]]) -> None:
        """Note, for a pending future made here, what it waits for (a
        ``gather()``'s inputs; see ``_follow``)."""
        self._keep = tuple(upstream)

    def _notify(self, event: threading.Event | None, listeners: list[Listener] | None) -> None:
        if event is not None:
            event.set()
        if listeners is not None:
            run_listeners(self, listeners)

    def _notify_traced(self, event: threading.Event | None, listeners: list[Listener] | None) -> None:
        """:meth:`_notify` while tracing is on, between the tracer's hooks
        (the traced set slice): the tracer observes, the future notifies."""
        token = _trace.completing(self, self._records)
        try:
            self._notify(event, listeners)
        finally:
            if token is not None:
                _trace.completed(token, self._state)

    def _listen(self, listener: Listener) -> bool:
        """Add ``listener`` if this future is pending; False if it is completed."""
        with self._lock:
            if self._state is _PENDING:
                if self._listeners is None:
                    self._listeners = [listener]
                else:
                    self._listeners.append(listener)
                return True
        return False

    def _on_set(self, listener: Listener) -> None:
        """Run ``listener`` once set (or failed/cancelled): now, or in the
        thread that completes the future."""
        # _listen() inlined: every then() and await comes here.
        with self._lock:
            if self._state is _PENDING:
                if self._listeners is None:
                    self._listeners = [listener]
                else:
                    self._listeners.append(listener)
                return
        call_listener(listener, self)

    def _on_set_removable(self, listener: Listener) -> Callable[[], None]:
        self._on_set(listener)

        def remove() -> None:
            with self._lock:
                if self._listeners is not None and listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def _block_until_set(self, deadline: float | None, timeout: float | None) -> None:
        if self._state is not _PENDING:
            return
        with self._lock:
            if self._state is not _PENDING:
                return
            if self._set_event is None:
                self._set_event = threading.Event()
            event = self._set_event
        if not event.wait(remaining(deadline)):
            raise TimeoutError(
                f"this CudaFuture was not set within {timeout} s: its producer "
                "has not called set_result() or set_exception() yet"
            )

    def _block_until_done(self, timeout: float | None) -> None:
        """Block until set, then until the events complete (or one fails)."""
        if _runtime.forked:  # a flag test, without a call
            _runtime.check_usable()
        token = _trace.wait_start(self, "result()") if _trace.active is not None else None
        deadline = check_timeout(timeout)
        self._block_until_set(deadline, timeout)
        if self._state is _SET and not _waiter.block_until_complete(self._records, deadline):
            raise TimeoutError(
                f"the GPU work behind this future did not finish within {timeout} s; "
                "it is still running: call again to keep waiting"
            )
        if token is not None:
            _trace.waited("result()", token)

    def _outcome(self, cancelled_error: type[BaseException]) -> T:
        """The value, or the error to raise; the future must be set, failed,
        or cancelled, and its events complete (or failed)."""
        state = self._state
        if state is _CANCELLED:
            raise cancelled_error("the CudaFuture was cancelled before it was set")
        if state is _FAILED:
            self._retrieved = True
            assert self._exception is not None
            # As asyncio does: each raise starts from the stored traceback,
            # instead of growing it with every earlier result() or await.
            raise self._exception.with_traceback(self._traceback)
        for rec in self._records:  # first_error(), inline: every await comes here
            if rec.status:
                error = rec.error()
                assert error is not None  # a failed record has an error
                raise error
        self._keep = None
        return self._value  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickling (a ``multiprocessing`` queue or pipe) sends this future
        to another process of this machine, which gets a :class:`CudaFuture`
        of the same work: see :func:`cudafut.enqueued` and docs/processes.md.
        Costs this thread a tenth of a millisecond or more
        (docs/processes.md, "What it costs", has the figures) and blocks
        nothing else; the GPU value stays in this process's memory (CUDA
        IPC) until the receiver lets go of it.

        Raises:
            InvalidStateError: the future is pending: its work is not
                enqueued yet (``await cudafut.enqueued(fut)`` first); or
                its value holds a host array its pending work may write.
            TypeError: its value holds a GPU array CUDA IPC cannot share.
        """
        if _exporter is None:  # pragma: no cover - cudafut/__init__ imports _shared
            raise TypeError("a CudaFuture pickles once cudafut is imported (import cudafut)")
        return _exporter(self)

    def __repr__(self) -> str:
        state = self._state
        if state is _SET:
            known = [r.status for r in self._records]
            text = "failed on the GPU" if any(known) else "running" if None in known else "done"
            text += f" devices={self.devices} value={_short(self._value)}"
        elif state is _FAILED:
            text = f"failed {self._exception!r}"
        else:
            text = state.value
        return f"<CudaFuture {text}>"

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        try:
            state = self._state
        except AttributeError:  # __init__ never ran: CudaFuture(...) refused its arguments
            return
        if state is _FAILED and not self._retrieved:
            exc = self._exception
            assert exc is not None
            logger.error(
                "cudafut: CudaFuture exception was never retrieved: %r",
                exc,
                # Its traceback when stored: __traceback__ has grown since if
                # the same object was raised elsewhere (by a gathered input).
                exc_info=(type(exc), exc, self._traceback),
            )
        elif state is _SET and self._keep is not KEPT_BY_PRODUCER:
            # Other streams may still read these buffers; freeing them now
            # would let the memory pool hand them out again (docs/design.md,
            # hazard 5). Records known complete (an awaited future's, or
            # answered by their stream's watermark) need no CUDA call; for
            # the others a query (under 2 µs) spares the watcher thread work
            # already done (handing every dropped future to it, unasked,
            # kept it busy enough to slow the caller's thread twofold).
            for rec in self._records:
                if rec.known() is None:
                    break
            else:
                return
            try:  # noqa: SIM105 - cheaper than contextlib.suppress in a finalizer
                _lifetimes.keep_until(self._records, (self._value, self._keep))
            except CudaUnavailableError:  # in a forked child: nothing to protect
                pass


_WAITING: Final = 0
_STARTED: Final = 1
_REMOVED: Final = 2


class _DoneCallback:
    """One ``add_done_callback`` (or bridge) callback: waiting, started or removed."""

    __slots__ = ("driver", "fn", "state")

    def __init__(self, fn: Callable[[Any], object], driver: object) -> None:
        self.fn = fn
        # The thread or loop it runs in (order holds within one), weakly: a
        # callback whose loop ended never runs, and must not keep that loop's
        # waiter (its timer's descriptor) alive while the future lives.
        self.driver = weakref.ref(driver)
        self.state = _WAITING


def _asyncio_code(module: Any, name: str) -> object:
    return getattr(getattr(module, name, None), "__code__", None)


# What CudaFuture._asyncio_future_blocking recognises: asyncio.wrap_future()
# asking asyncio.isfuture() about a CudaFuture.
_WRAP_FUTURE_CODE: Final = _asyncio_code(_asyncio_futures, "wrap_future")
_ISFUTURE_CODE: Final = _asyncio_code(_asyncio_base_futures, "isfuture")


def _short(value: object) -> str:
    if hasattr(value, "__cuda_array_interface__"):
        shape, dtype = getattr(value, "shape", "?"), getattr(value, "dtype", "?")
        text = f"{type(value).__name__}(shape={shape}, dtype={dtype})"
    else:
        try:
            text = repr(value)
        except RecursionError:  # a value nested thousands deep: repr() recurses
            text = f"<{type(value).__name__} nested too deep to show>"
    return text if len(text) <= 60 else text[:57] + "..."


# -- then()'s link, and settling a future from a function -----------------------------------
# The producers (record, submit, settle_launched): cudafut/_producers.py. Running listeners
# and marking consumers: cudafut/_engine.py, below this module.


#: Held while a follow is checked and noted, so that two follows closing one
#: cycle in two threads cannot both miss it. Re-entrant: a finalizer run by
#: the GC meanwhile may follow too.
_follow_lock: Final = threading.RLock()


def _waits_on(start: CudaFuture[Any], target: CudaFuture[Any]) -> bool:
    """Whether ``start`` is ``target`` or waits on it: through the pending
    futures' ``then()`` parents, followed futures and ``gather()`` inputs
    (see ``CudaFuture.__init__``). Costs a lock per pending future passed:
    nothing but one lock when ``start`` is completed already."""
    todo = [start]
    seen: set[int] = set()
    while todo:
        fut = todo.pop()
        if fut is target:
            return True
        if id(fut) in seen:
            continue
        seen.add(id(fut))
        with fut._lock:
            if fut._state is not _PENDING:
                continue
            upstream = fut._keep
        if isinstance(upstream, CudaFuture):
            todo.append(upstream)
        elif isinstance(upstream, tuple):
            todo.extend(up for up in upstream if isinstance(up, CudaFuture))
    return False


def _run_then(
    parent: CudaFuture[Any], fn: Callable[[Any], Any], priority: int, child: CudaFuture[Any]
) -> Pending | None:
    """Run a then() callback; called once ``parent`` is completed, in any
    thread. Returns the child's listeners, for the caller's loop."""
    if not parent._succeeded():
        return child._take_outcome((parent,))  # cancelled or failed: fn is not called
    try:
        streams = _then_streams(parent, priority)
        # The child keeps the value until its own events complete; fn may also
        # queue work on these streams that outlives them.
        record_consumers(parent._value, streams, untracked=False)
        return _settle_later(child, fn, (parent._value,), {}, streams, parent._value)
    except Exception as exc:  # noqa: BLE001 - stored in the child, not lost
        return child._fail_later(_explained(parent, exc))


def _then_failed(parent: CudaFuture[Any], exc: BaseException, explain: bool) -> CudaFuture[Any]:
    """The child of the native then() (cudafut/_core.pyx), failed with
    ``exc``: raised by a step around ``fn`` (``explain``: as
    :func:`_run_then` explains it) or by ``fn`` itself (then the child's
    interrupt counts as retrieved: the native then() raises it again)."""
    child: CudaFuture[Any] = new_future("then")
    child._keep = parent
    if not explain and isinstance(exc, INTERRUPTS):
        child._try_fail(exc)
        child._retrieved = True
        return child
    more = child._fail_later(_explained(parent, exc) if explain and isinstance(exc, Exception) else exc)
    if more is not None:
        run_listeners(*more)
    return child


def _then_follows(
    parent: CudaFuture[Any], out: CudaFuture[Any], records: tuple[EventRecord, ...]
) -> CudaFuture[Any]:
    """The child of the native then() whose ``fn`` returned the future
    ``out``: it follows ``out``, plus ``records`` (made after ``fn``)."""
    child: CudaFuture[Any] = new_future("then")
    child._keep = parent
    more = child._follow(out, records, parent._value)
    if more is not None:
        run_listeners(*more)
    return child


def _explained(fut: CudaFuture[Any], exc: Exception) -> Exception:
    """``exc``, or, where it is CUDA's absence and ``fut`` belongs to
    cudafut.testing's fake GPU that has ended, an :class:`InvalidStateError`
    that says so (caused by ``exc``). On failure paths only."""
    if isinstance(exc, CudaUnavailableError):
        for rec in fut._records:
            reason = rec.ended()
            if reason is not None:
                error = InvalidStateError(reason)
                error.__cause__ = exc
                return error
    return exc


def _then_streams(parent: CudaFuture[Any], priority: int) -> dict[int, Any]:
    """A pool stream per device of ``parent``, each waiting for its events.

    The first child continues on the parent's own stream where that is a
    pool stream of the same priority with nothing enqueued after the parent
    (by cudafut): the order is then free, and a chain of then() calls stays
    on one stream, as hand-written pipelines do. Later children of the same
    parent take the next pool streams, so they run concurrently.
    """
    streams: dict[int, Any] = {}
    reuse = not parent._stream_given
    parent._stream_given = True
    for rec in parent._records:
        stream = streams.get(rec.device)
        if stream is None:
            if reuse and _events.is_newest(rec):
                stream = _pools.streams.lookup(rec.stream, priority)
                if stream is not None:
                    streams[rec.device] = stream
                    continue  # same stream: already ordered after rec
            stream = streams[rec.device] = _pools.streams.get(rec.device, priority)
        rec.wait_on(int(stream.ptr), rec.device)
    return streams


def settle(
    fut: CudaFuture[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    streams: Mapping[int, Any],
    keep: object,
) -> None:
    """Run ``fn`` with ``streams`` current (the first one's device current
    too), then complete ``fut`` from what it returned, and run what waits on
    ``fut`` (the producers' step: cudafut/_producers.py calls it as
    ``_future.settle``, looked up at each call). ``KeyboardInterrupt`` and ``SystemExit`` from ``fn`` fail
    ``fut`` and are raised again."""
    more = _settle_later(fut, fn, args, kwargs, streams, keep)
    if more is not None:
        run_listeners(*more)


def _settle_later(
    fut: CudaFuture[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    streams: Mapping[int, Any],
    keep: object,
) -> Pending | None:
    """:func:`settle`, returning ``fut``'s listeners for the caller's loop."""
    user_fn = fn
    if _trace.active is not None:
        fn = _trace.timed_fn(fut, fn, streams)
    torch = _torch.loaded()
    try:
        if not streams:  # a parent on no device: nothing to order against
            out = fn(*args, **kwargs)
        elif torch is None:
            out = _backend.current.call_on_streams(streams, next(iter(streams)), fn, args, kwargs)
        else:  # the pool streams are PyTorch's current streams too
            out = _torch.call_on_streams(torch, streams, fn, args, kwargs, keep)
    except INTERRUPTS as exc:
        # The child's consumers must not wait for ever: fail it (and run what
        # waits on it) now; the interrupt then goes on up to the thread's
        # caller, after the other listeners (_engine.run_listeners), as asyncio's
        # tasks do. Raised to the user: not logged again as unretrieved.
        fut._try_fail(exc)
        fut._retrieved = True
        raise
    except BaseException as exc:  # noqa: BLE001 - the future carries it, type kept
        return fut._fail_later(exc)
    if type(out) is _CoroutineType:  # fn called an async def: nothing would await it
        return fut._fail_later(_checks.returned_coroutine(user_fn, out))
    if not isinstance(out, CudaFuture):
        try:  # arrays fn made with other libraries (JAX): docs/design.md, hazard 9
            order_foreign(out, consumer_on(streams))
        except ValueError as exc:
            return fut._fail_later(exc)
    # Loops, not comprehensions: each comprehension is a call (Python 3.11).
    records: tuple[EventRecord, ...] = ()
    for d, s in streams.items():
        records += (_events.record(int(s.ptr), d),)
    if isinstance(out, CudaFuture):
        return fut._follow(out, records, keep)
    # Arrays fn placed on other devices were made on those devices' streams.
    if torch is None:
        for d in find_devices(out):
            if d not in streams:
                records += (_events.record_current(d),)
    else:
        records += _torch.record_value(torch, out, None, skip=streams)
    return fut._try_complete(_SET, out, None, records, keep, None, True)


def _onto(devices: tuple[int, ...]) -> Callable[[int], tuple[int, int]]:
    """For ``set_result()`` with ``devices`` given: an array is ordered
    before the current stream of its device if that is one of them, else
    of the first (the only streams recorded on)."""

    def consumer(device: int) -> tuple[int, int]:
        return current_consumer(device if device in devices else devices[0])

    return consumer


def new_future(maker: str) -> CudaFuture[Any]:
    """A pending future made by cudafut's public function ``maker``.

    The one place that chooses between the untraced construction (a plain
    ``CudaFuture()``, after one test of a module global) and the traced one,
    which labels the future with ``maker`` (a compiled maker has no frame
    for the tracer to find its name in)."""
    if _trace.active is None:
        return new_pending()
    return _trace.make(CudaFuture, maker)


#: ``CudaFuture()``, pending and untraced (its caller tests ``_trace.active``
#: first, as :func:`new_future` does): the class itself in the pure core,
#: the native core's ``new_pending`` (no Python ``__init__``) where it runs.
new_pending: Callable[[], CudaFuture[Any]] = CudaFuture


# cudafut._bridges, whose to_asyncio/to_concurrent/to_torch are the bodies of
# the methods of those names: it sits above this module (it uses the class's
# internal interface only, cudafut/_interface.py), so it registers itself
# here at import.
_bridges: Any = None


def set_bridges(module: Any) -> None:
    """Make ``module`` (``_bridges``, at import) what the bridge methods call."""
    global _bridges
    _bridges = module


def _bridged() -> Any:
    if _bridges is None:  # pragma: no cover - cudafut/__init__ imports _bridges
        raise RuntimeError("CudaFuture's bridges work once cudafut is imported (import cudafut)")
    return _bridges


# cudafut._shared's export(), which CudaFuture.__reduce__ calls: _shared sits
# above this module (it builds futures), so it registers itself here.
_exporter: Callable[[CudaFuture[Any]], tuple[Any, tuple[Any, ...]]] | None = None


def set_exporter(export: Callable[[CudaFuture[Any]], tuple[Any, tuple[Any, ...]]]) -> None:
    """Make ``export`` what pickling a future calls (``_shared``, at import)."""
    global _exporter
    _exporter = export


# The native core (cudafut/_core.pyx) takes over the paths every future takes,
# where it was built: record(value, stream=s) (cudafut/_producers.py binds it), an await (of a done future, or
# of a pending one in an asyncio task among other waits), result() of done
# work, then() of a set future and the finalizer.
# CudaFuture's methods above stay the reference (CUDAFUT_PURE=1), and the
# native paths fall back on them for every case they do not handle.
if _native is not None:
    _native.bind_future(
        CudaFuture,
        (_PENDING, _SET, _FAILED, _CANCELLED),
        _trace,
        CudaFuture._await,
        CudaFuture.result,
        CudaFuture.__del__,
        record_current_consumers,
        order_foreign,
        _loops.current_driver,
        _cuda.mapped_pages(),
        _cuda.PAGE_SIZE,
        _memory.block_type(),
        SCALARS,
        KEPT_BY_PRODUCER,
        _memory.readers_by_block(),
    )
    _native.bind_then(
        CudaFuture.then, _then_failed, _then_follows, record_consumers, find_devices, _pools.PRIORITIES
    )
    for _name, _function in (
        ("then", _native.future_then),
        ("result", _native.future_result),
    ):
        _twin = getattr(CudaFuture, _name)
        _function.__doc__ = _twin.__doc__  # help() reads the twin's
        _function.__signature__ = inspect.signature(_twin)
        setattr(CudaFuture, _name, _function)
    # FutureCore's own __await__ and __del__ are the type's slots: without
    # the twins in the class, await and the finalizer call them from C.
    for _name in ("__await__", "__del__"):
        delattr(CudaFuture, _name)
    _native.install_await(CudaFuture)
    new_pending = _native.new_pending
    del _name, _function, _twin
