"""CudaFuture: a value whose GPU work is enqueued, and the calls that make one.

A future moves through two steps. It is *set* when the producer hands over
its value: :meth:`CudaFuture.set_result` records one CUDA event per device on
that device's current stream, so the value is *orderable*: later GPU work can
be made to wait for it. It is *done* when those events have completed on the
GPU (or when it failed or was cancelled). ``docs/semantics.md`` says what each
call waits for and what it blocks.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any, Generic, Literal, TypeVar, overload

from . import _cuda, _events, _loops, _pools, _waiter
from ._errors import CancelledError, CudaUnavailableError, InvalidStateError, TimeoutError
from ._events import EventRecord, first_error
from ._log import logger
from ._values import find_devices, normalize_devices

__all__ = ["CudaFuture", "record", "submit"]

T = TypeVar("T")
U = TypeVar("U")

_PENDING = "pending"
_CANCELLED = "cancelled"
_SET = "set"
_FAILED = "failed"

Listener = Callable[[], None]
#: Which stream pool ``then()`` and ``submit()`` take their streams from.
Priority = Literal["normal", "high"]


def check_timeout(timeout: float | None) -> float | None:
    """Validate a timeout and turn it into a ``perf_counter`` deadline."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a non-negative number of seconds or None, not {timeout!r}")
    return time.perf_counter() + timeout


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


def _check_callable(fn: object, what: str) -> None:
    if not callable(fn):
        raise TypeError(f"{what} needs a callable, not {fn!r}")


class CudaFuture(Generic[T]):
    """The value of GPU work that has been enqueued and may not have run yet.

    Args:
        devices: the devices whose streams :meth:`set_result` records on, as
            one index or an iterable of them. ``None`` (the default) means the
            devices of the value itself, found from its arrays.

    A future is created unset; the producer completes it once, with
    :meth:`set_result` or :meth:`set_exception`. Consumers then choose what
    they are willing to block: nothing (``await``, :meth:`then`,
    :meth:`wait`) or the calling thread (:meth:`result`).

    All methods may be called from any thread.
    """

    __slots__ = (
        "__weakref__",
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
        "_value",
    )

    def __init__(self, devices: int | Iterable[int] | None = None) -> None:
        self._lock = threading.Lock()
        self._state = _PENDING
        self._devices = None if devices is None else normalize_devices(devices)
        self._value: Any = None
        self._exception: BaseException | None = None
        self._records: tuple[EventRecord, ...] = ()
        # Objects other streams may still read; kept until our events complete.
        self._keep: object = None
        self._listeners: list[Listener] | None = None
        self._set_event: threading.Event | None = None
        self._retrieved = False
        # Whether a then() child already continues on this future's stream.
        self._stream_given = False

    # -- producer side ---------------------------------------------------

    def set_result(self, value: T) -> None:
        """Complete the future with ``value``, whose GPU work is enqueued.

        Records one event per device of ``value`` (or of the ``devices`` given
        to the constructor) on that device's current stream of the calling
        thread. Costs about 1 µs per device on the host; blocks neither the
        thread nor the GPU.

        Raises:
            InvalidStateError: the future was already set or cancelled.
            ValueError: ``value`` holds no GPU array and no ``devices`` were
                given, so there would be nothing to order against.
        """
        if self._state is not _PENDING:
            self._check_pending()
        _cuda.check_usable()
        devices = self._devices or find_devices(value)
        if len(devices) == 1:
            records: tuple[EventRecord, ...] = (_events.record_current(devices[0]),)
        elif devices:
            records = tuple(_events.record_current(d) for d in devices)
        else:
            raise ValueError(
                f"set_result() got a value on no GPU ({type(value).__name__}); "
                "pass devices=... to CudaFuture() to say which device's "
                "current stream produces it"
            )
        self._complete(_SET, value, None, records)

    def set_exception(self, exception: BaseException | type[BaseException]) -> None:
        """Complete the future with an error; consumers get this exception.

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
        self._complete(_FAILED, None, exception, ())

    def cancel(self) -> bool:
        """Cancel the future if it is not set yet; return whether it is cancelled.

        A set future cannot be cancelled: its GPU work is already enqueued.
        """
        with self._lock:
            if self._state == _CANCELLED:
                return True
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
            listeners, self._listeners = self._listeners, None
            event = self._set_event
        self._notify(event, listeners)
        return True

    # -- queries -----------------------------------------------------------

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices the future's events live on (before set: the ones given)."""
        if self._state == _SET:
            return tuple(dict.fromkeys(r.device for r in self._records))
        return self._devices or ()

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` cancelled the future."""
        return self._state == _CANCELLED

    def done(self) -> bool:
        """Whether the future is set and its GPU work complete, or it failed.

        Non-blocking: queries pending events (about 1.7 µs each).
        """
        state = self._state
        if state == _SET:
            return self._events_done()
        return state != _PENDING

    def _events_done(self) -> bool:
        for rec in self._records:
            status = rec.query()
            if status is None:
                return False
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

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            CudaError: the GPU work failed.
            CancelledError: the future was cancelled.
            Exception: whatever the producer set with :meth:`set_exception`.
        """
        self._block_until_done(timeout)
        return self._outcome(CancelledError)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Like :meth:`result`, but return the error (or ``None``) instead of
        raising it. Blocks the thread the same way."""
        self._block_until_done(timeout)
        state = self._state
        if state == _SET:
            return first_error(self._records)
        if state == _CANCELLED:
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

        Keep the returned value referenced until the work you enqueue on it
        is done, or hand it to that work's future with
        ``cudafut.record(result, keep=value)``: CuPy's memory pool may reuse
        a dropped array's memory on the producer's stream while your stream
        still reads it. :meth:`then` and :func:`submit` do this for you.

        Raises:
            TimeoutError: not set within ``timeout`` seconds.
            CudaError: the GPU work is already known to have failed.
            CancelledError: the future was cancelled.
        """
        _cuda.check_usable()
        deadline = check_timeout(timeout)
        self._block_until_set(deadline, timeout)
        if self._state == _SET:
            for rec in self._records:
                if rec.status is None:
                    rec.wait_on(int(_cuda.current_stream(rec.device).ptr), rec.device)
        return self._outcome(CancelledError)

    def __await__(self) -> Generator[Any, None, T]:
        """``await fut``: resolve when the GPU work is done; never blocks the loop.

        One waiter per event loop polls the events of every awaited future,
        as the wait policy says (:func:`set_wait_policy`): spinning on loop
        iterations while completion is near, sleeping otherwise; the loop
        keeps running other tasks throughout. Works on asyncio, uvloop and
        trio. Cancelling the awaiting task
        removes its wait; the future itself is unaffected.
        """
        _cuda.check_usable()
        if self._state == _SET and self._events_done():
            return self._outcome(CancelledError)
        # A plain generator, not a coroutine: each pending await keeps only a
        # few objects alive, which matters to the cyclic GC at 10k awaits.
        driver = _loops.require_driver()
        if self._state == _PENDING:
            yield from driver.until(
                lambda wake: self._on_set_removable(lambda: driver.call_soon_threadsafe(wake))
            ).__await__()
        if self._state == _SET and first_error(self._records) is None:
            pending = [r for r in self._records if r.status is None]
            if len(pending) == 1 and (yield from driver.spin_alone(pending[0]).__await__()):
                pending = []
            if pending:
                yield from driver.wait_records(pending)
        return self._outcome(driver.cancelled_error)

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
        on those streams after ``fn`` returns. Costs a few µs
        on the host; blocks neither the thread nor the GPU.

        If this future failed, ``fn`` is not called and the child fails with
        the same exception object; if ``fn`` raises, the child fails with that
        exception; if ``fn`` returns a CudaFuture, the child follows it. The
        child keeps this future's value alive until its own events complete.

        Args:
            fn: called with the value; returns the child's value or a future.
            priority: ``"normal"`` or ``"high"``: which pool streams to use.
        """
        _check_callable(fn, "then()")
        prio = _pools.check_priority(priority)
        _cuda.check_usable()
        child: CudaFuture[Any] = CudaFuture()
        self._on_set(lambda: _run_then(self, fn, prio, child))
        return child

    def add_done_callback(self, fn: Callable[[CudaFuture[T]], object]) -> None:
        """Call ``fn(future)`` once the future is done (GPU work complete).

        ``fn`` runs on the event loop that is running in the calling thread,
        or, without one, on cudafut's watcher thread. An exception raised by
        ``fn`` goes to the loop's exception handler or to the ``cudafut``
        logger; it is never lost. Costs nothing on the loop while waiting.
        """
        _check_callable(fn, "add_done_callback()")
        driver: _waiter.Driver = _loops.current_driver() or _waiter.thread_waiter()

        def when_done() -> None:  # runs in the driver's thread
            pending = [r for r in self._records if r.status is None] if self._state == _SET else []
            if pending:
                driver.watch_all(pending, lambda _error: driver.run_callback(fn, self))
            else:
                driver.run_callback(fn, self)

        self._on_set(lambda: driver.call_soon_threadsafe(when_done))

    # -- internals -----------------------------------------------------------

    def _check_pending(self) -> None:
        if self._state != _PENDING:
            raise InvalidStateError(
                f"this CudaFuture is already {self._state}; a future is "
                "completed once: create a new one for new work"
            )

    def _complete(
        self,
        state: str,
        value: object,
        exception: BaseException | None,
        records: tuple[EventRecord, ...],
        keep: object = None,
    ) -> None:
        with self._lock:
            self._check_pending()
            self._value = value
            self._exception = exception
            self._records = records
            self._keep = keep
            self._state = state  # last: readers that see it see the rest
            listeners, self._listeners = self._listeners, None
            event = self._set_event
        self._notify(event, listeners)

    def _try_complete(
        self,
        state: str,
        value: object,
        exception: BaseException | None,
        records: tuple[EventRecord, ...] = (),
        keep: object = None,
    ) -> None:
        """Complete unless already completed (a consumer may cancel a child)."""
        try:  # noqa: SIM105 - contextlib.suppress costs a µs on this hot path
            self._complete(state, value, exception, records, keep)
        except InvalidStateError:
            pass

    def _follow(
        self, other: CudaFuture[Any], records: tuple[EventRecord, ...] = (), keep: object = None
    ) -> None:
        """Complete this future like ``other`` once it is set, plus ``records``."""

        def copy() -> None:
            if other._state == _CANCELLED:
                self.cancel()
            elif other._state == _FAILED:
                other._retrieved = True
                self._try_complete(_FAILED, None, other._exception)
            else:
                self._try_complete(_SET, other._value, None, other._records + records, (keep, other))

        other._on_set(copy)

    def _notify(self, event: threading.Event | None, listeners: list[Listener] | None) -> None:
        if event is not None:
            event.set()
        for listener in listeners or ():
            _call_listener(listener, self)

    def _on_set(self, listener: Listener) -> None:
        """Run ``listener`` once set (or failed/cancelled): now, or in the
        thread that completes the future."""
        with self._lock:
            if self._state == _PENDING:
                if self._listeners is None:
                    self._listeners = []
                self._listeners.append(listener)
                return
        _call_listener(listener, self)

    def _on_set_removable(self, listener: Listener) -> Callable[[], None]:
        self._on_set(listener)

        def remove() -> None:
            with self._lock:
                if self._listeners is not None and listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def _block_until_set(self, deadline: float | None, timeout: float | None) -> None:
        if self._state != _PENDING:
            return
        with self._lock:
            if self._state != _PENDING:
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
        _cuda.check_usable()
        deadline = check_timeout(timeout)
        self._block_until_set(deadline, timeout)
        if self._state == _SET and not _waiter.block_until_complete(self._records, deadline):
            raise TimeoutError(
                f"the GPU work behind this future did not finish within {timeout} s; "
                "it is still running: call again to keep waiting"
            )

    def _outcome(self, cancelled_error: type[BaseException]) -> T:
        """The value, or the error to raise; the future must be set, failed,
        or cancelled, and its events complete (or failed)."""
        state = self._state
        if state == _CANCELLED:
            raise cancelled_error("the CudaFuture was cancelled before it was set")
        if state == _FAILED:
            self._retrieved = True
            assert self._exception is not None
            raise self._exception
        error = first_error(self._records)
        if error is not None:
            raise error
        self._keep = None
        return self._value  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        state = self._state
        if state == _SET:
            known = [r.status for r in self._records]
            state = "failed on the GPU" if any(known) else "running" if None in known else "done"
            state += f" devices={self.devices} value={_short(self._value)}"
        elif state == _FAILED:
            state = f"failed {self._exception!r}"
        return f"<CudaFuture {state}>"

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        state = self._state
        if state == _FAILED and not self._retrieved:
            logger.error(
                "cudafut: CudaFuture exception was never retrieved: %r",
                self._exception,
                exc_info=self._exception,
            )
        elif state == _SET:
            # A query (under 2 µs) spares the watcher thread work already done.
            try:
                pending = [r for r in self._records if r.query() is None]
            except CudaUnavailableError:  # in a forked child: nothing to protect
                return
            if pending:
                # Other streams may still read these buffers; freeing them now
                # would let the memory pool hand them out again (hazard 5).
                _waiter.thread_waiter().hold(pending, (self._value, self._keep))


def _short(value: object) -> str:
    if hasattr(value, "__cuda_array_interface__"):
        shape, dtype = getattr(value, "shape", "?"), getattr(value, "dtype", "?")
        text = f"{type(value).__name__}(shape={shape}, dtype={dtype})"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _call_listener(listener: Listener, future: CudaFuture[Any]) -> None:
    try:
        listener()
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        logger.error("cudafut: exception while completing %r", future, exc_info=exc)


def _run_then(
    parent: CudaFuture[Any], fn: Callable[[Any], Any], priority: int, child: CudaFuture[Any]
) -> None:
    """Run a then() callback; called once ``parent`` is set, in any thread."""
    state = parent._state
    if state == _CANCELLED:
        child.cancel()
        return
    error = parent._exception if state == _FAILED else first_error(parent._records)
    if error is not None:
        parent._retrieved = True
        child._try_complete(_FAILED, None, error)
        return
    try:
        streams = _then_streams(parent, priority)
        _settle(child, fn, (parent._value,), {}, streams, parent._value)
    except Exception as exc:  # noqa: BLE001 - stored in the child, not lost
        child._try_complete(_FAILED, None, exc)


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


def _settle(
    fut: CudaFuture[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    streams: Mapping[int, Any],
    keep: object,
) -> None:
    """Run ``fn`` with ``streams`` current (the first one's device current
    too), then complete ``fut`` from what it returned."""
    try:
        if streams:
            out = _cuda.call_on_streams(streams, next(iter(streams)), fn, args, kwargs)
        else:  # a parent on no device: nothing to order against
            out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the future carries it
        fut._try_complete(_FAILED, None, exc)
        return
    records = tuple(_events.record(int(s.ptr), d) for d, s in streams.items())
    if isinstance(out, CudaFuture):
        fut._follow(out, records, keep)
        return
    # Arrays fn placed on other devices were made on those devices' streams.
    records += tuple(_events.record_current(d) for d in find_devices(out) if d not in streams)
    fut._try_complete(_SET, out, None, records, keep)


def record(value: T, *, stream: Any = None, keep: object = None) -> CudaFuture[T]:
    """A future, already set, for GPU work already enqueued.

    Records one event on ``stream`` (a CuPy or PyTorch stream) or, by
    default, on the current stream of each device of ``value``. Costs about
    1 µs per event on the host; blocks neither the thread nor the GPU.

    ``keep``: objects the recorded work reads, kept alive until the events
    complete (so that the memory pool cannot hand their memory to other work
    meanwhile), even if every other reference is dropped. Pass the inputs
    of the work, e.g. the value ``fut.wait()`` returned::

        v = fut.wait()
        out = cudafut.record(v + 1, keep=v)  # v may be dropped now

    Raises:
        ValueError: no ``stream`` and ``value`` holds no GPU array.
    """
    _cuda.check_usable()
    if stream is None:
        devices = find_devices(value)
        if not devices:
            raise ValueError(
                f"record() got a value on no GPU ({type(value).__name__}); pass "
                "stream=... to say which stream produces it"
            )
        records = tuple(_events.record_current(d) for d in devices)
    else:
        ptr, device = _cuda.stream_handle(stream)
        records = (_events.record(ptr, device),)
    fut: CudaFuture[T] = CudaFuture()
    fut._complete(_SET, value, None, records, keep)
    return fut


@overload
def submit(
    fn: Callable[..., CudaFuture[U]],
    /,
    *args: Any,
    device: int | None = ...,
    priority: Priority = ...,
    **kwargs: Any,
) -> CudaFuture[U]: ...
@overload
def submit(
    fn: Callable[..., U], /, *args: Any, device: int | None = ..., priority: Priority = ..., **kwargs: Any
) -> CudaFuture[U]: ...
def submit(
    fn: Callable[..., Any],
    /,
    *args: Any,
    device: int | None = None,
    priority: Priority = "normal",
    **kwargs: Any,
) -> CudaFuture[Any]:
    """Run ``fn(*args, **kwargs)`` now, on a pool stream; return its future.

    ``fn`` runs synchronously in the calling thread with a pool stream of
    ``device`` (default: the current device) made current. That stream first
    waits for the work already enqueued on the caller's current stream, so
    ``fn`` sees inputs the caller produced. The future's events are recorded
    on the pool stream after ``fn`` returns; an exception from ``fn`` is
    stored in the future. The future keeps ``args`` and ``kwargs`` alive until
    its events complete. Host cost: ``fn`` plus a few µs; the GPU is not
    synchronised.
    """
    _check_callable(fn, "submit()")
    prio = _pools.check_priority(priority)
    _cuda.check_usable()
    dev = _cuda.current_device() if device is None else _cuda.check_device(device)
    stream = _pools.streams.get(dev, prio)
    _events.record_current(dev).wait_on(int(stream.ptr), dev)
    fut: CudaFuture[Any] = CudaFuture()
    _settle(fut, fn, args, kwargs, {dev: stream}, (args, kwargs))
    return fut


# Named so in tracebacks and reprs: users import it from cudafut.
for _obj in (CudaFuture, record, submit):
    _obj.__module__ = "cudafut"
del _obj
