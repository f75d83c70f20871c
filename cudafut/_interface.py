"""CudaFuture's internal interface: how cudafut's other modules (the
producers, combinators, bridges, copies, collectives, cudafut.testing)
make, complete, combine and read futures, never through CudaFuture's
attributes. This module is the class's one reader from outside
cudafut/_future.py (ruff's SLF rules hold everywhere else); the class's own
hot paths read its attributes directly.

Each function costs a lock at most (``share_state``, ``discard_done_callback``,
those that complete a future) and blocks nothing, unless it says so.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from . import _compiled, _loops, _waiter
from ._engine import Listener, Pending
from ._events import EventRecord, first_error
from ._future import CANCELLED, FAILED, PENDING, SET, CudaFuture
from ._future import KEPT_BY_PRODUCER as KEPT_BY_PRODUCER
from ._future import new_future as new_future  # re-exported: the class's one constructor
from ._trace import hooks as _trace

T = TypeVar("T")


def set_future(
    value: T, records: tuple[EventRecord, ...], keep: object = None, maker: str | None = None
) -> CudaFuture[T]:
    """A future set with ``value`` and ``records`` already recorded (for
    cudafut's own producers, such as the collectives); ``keep`` lives until
    the records complete (:data:`KEPT_BY_PRODUCER`: the caller keeps the
    value and what the work reads alive itself until then, so that a
    dropped future holds nothing). ``maker``: the public function that made it, as
    :func:`new_future` takes it; None: the tracer finds its maker among the
    callers' frames."""
    fut: CudaFuture[T] = CudaFuture() if maker is None else new_future(maker)
    if _trace.active is not None:
        fut._complete(SET, value, None, records, keep)  # the tracer sees it set
        return fut
    # No other thread has seen the future yet, and nobody listens: what
    # _complete does, without its lock and its listeners (half a µs).
    fut._value = value
    fut._records = records
    fut._keep = keep
    fut._state = SET
    return fut


def share_state(fut: CudaFuture[Any]) -> tuple[str, Any, BaseException | None, tuple[EventRecord, ...]]:
    """``(state, value, exception, records)`` of ``fut`` as it is now, state
    being ``"pending"``, ``"set"``, ``"failed"`` or ``"cancelled"``: for
    ``_shared``, which pickles it. An exception read here counts as
    retrieved (the receiving process carries it now)."""
    with fut._lock:
        state = fut._state
        if state is PENDING:
            return "pending", None, None, ()
        if state is CANCELLED:
            return "cancelled", None, None, ()
        if state is FAILED:
            fut._retrieved = True
            exc = fut._exception
            assert exc is not None
            return "failed", None, exc.with_traceback(fut._traceback), ()
        return "set", fut._value, None, fut._records


def until_set(fut: CudaFuture[Any]) -> Coroutine[Any, Any, None]:
    """Wait in the running loop (asyncio, uvloop or trio) until ``fut`` is
    set, failed or cancelled, not for its GPU work."""
    return fut._until_set(_loops.require_driver())


def records_of(fut: CudaFuture[Any]) -> tuple[EventRecord, ...]:
    """The event records of a set future (none while pending, failed or
    cancelled): for cudafut.testing, which completes them."""
    return fut._records


def fail_future(fut: CudaFuture[Any], exception: BaseException) -> None:
    """Fail a pending future with an exception just caught (a producer
    outside this module: a launcher thread); a completed one stays as is."""
    fut._try_fail(exception)


def settled(fut: CudaFuture[Any]) -> tuple[bool, Any, BaseException | None]:
    """``(cancelled, value, exception)`` of a completed future whose events
    completed (or failed). An exception handed over counts as retrieved here
    (the other future carries it now, and reports it if nobody asks), and
    starts from the traceback it had when it was stored."""
    state = fut._state
    if state is CANCELLED:
        return True, None, None
    if state is FAILED:
        fut._retrieved = True
        exc = fut._exception
        assert exc is not None
        return False, None, exc.with_traceback(fut._traceback)
    assert state is SET, "settled() needs a completed future"
    error = first_error(fut._records)
    if error is not None:
        return False, None, error
    return False, fut._value, None


def set_value(fut: CudaFuture[T]) -> tuple[T, tuple[EventRecord, ...]] | None:
    """``(value, records)`` of a set future, its events complete or not;
    None while pending, or once failed or cancelled (for the bridges)."""
    if fut._state is not SET:
        return None
    return fut._value, fut._records


def await_done(fut: CudaFuture[T], cancelled_error: type[BaseException]) -> tuple[bool, T | None]:
    """What ``await fut`` would give, without waiting: ``(True, value)`` for
    a future set whose events all completed, the value's GPU memory recorded
    as used on the calling thread's current streams as an ``await`` records
    it; its exception raised where it failed (or an event failed), or
    ``cancelled_error`` where it was cancelled; ``(False, None)`` while it
    is pending or an event is not known complete. Never waits nor queries
    an event (it reads the statuses known): for a caller told off the loop
    that the work ended (``_completions.after_gpu``)."""
    state = fut._state
    if state is PENDING:
        return False, None
    if state is SET:
        records = fut._records
        if first_error(records) is None and any(rec.status is None for rec in records):
            return False, None
    return True, fut._awaited(cancelled_error)


def given_devices(fut: CudaFuture[Any]) -> tuple[int, ...] | None:
    """The devices given to ``CudaFuture()`` (None: none given)."""
    return fut._devices


def succeeded(fut: CudaFuture[Any]) -> bool:
    """Whether ``fut`` is set and none of its events reported an error so far."""
    return fut._succeeded()


def when_done(fut: CudaFuture[T], fn: Callable[[CudaFuture[T]], object], driver: _waiter.Driver) -> None:
    """Call ``fn(fut)`` in ``driver``'s thread once ``fut`` is done (set and
    its events complete, or failed, or cancelled), unless
    :meth:`CudaFuture.remove_done_callback` removes it first."""
    fut._when_done(fn, driver)


def when_set(fut: CudaFuture[Any], listener: Listener) -> None:
    """Call ``listener()`` once ``fut`` is set, failed or cancelled: now, or
    in the thread that completes it (an exception from it is logged). A
    listener may return what it completed, for the caller's loop to run
    (see ``_engine.run_listeners``); one that returns None is a plain callback."""
    fut._on_set(listener)


def adopt(
    fut: CudaFuture[Any], parents: Sequence[CudaFuture[Any]], *, gather: bool = False
) -> Pending | None:
    """Complete ``fut`` with what its completed ``parents`` came to (their
    value, or with ``gather`` the list of their values; the first failure or
    cancellation decides); returns its listeners for the caller to run.
    See ``CudaFuture._take_outcome``."""
    return fut._take_outcome(parents, gather=gather)


def wait_for(fut: CudaFuture[Any], upstream: Sequence[CudaFuture[Any]]) -> None:
    """Note what a pending future made by the caller waits for (a
    ``gather()``'s inputs), so that a ``then()`` returning it cannot close a cycle."""
    fut._wait_for(upstream)


def discard_done_callback(fut: CudaFuture[Any], fn: Callable[..., object]) -> bool:
    """:meth:`CudaFuture.remove_done_callback` for code the garbage collector
    may run (a generator's ``finally``), on a thread that may hold this
    future's lock: where the lock is busy, nothing is removed and False is
    returned (the callback then runs once, when the future is done).
    Callbacks are compared by identity (``is``: pass the very object that
    was added), so no user ``__eq__`` runs under the lock."""
    lock = fut._lock
    if not lock.acquire(blocking=False):
        return False
    try:
        fut._drop_callbacks([entry for entry in fut._callbacks or () if entry.fn is fn])
    finally:
        lock.release()
    return True


def complete_with(
    fut: CudaFuture[T],
    value: T,
    records: tuple[EventRecord, ...] = (),
    keep: object = None,
) -> None:
    """Set a pending future made by one of cudafut's producers (a staged
    copy, a bridge) with ``records`` already recorded; ``keep`` lives until
    they complete. A future its consumer cancelled meanwhile stays cancelled."""
    fut._try_complete(SET, value, None, records, keep)


# The native core's set_future (no CudaFuture.__init__: about half a µs
# less per collective) where it was built; this module's stays the reference
# (CUDAFUT_PURE=1) and makes the futures it hands back (a trace on, a maker).
_native = _compiled.native()
if _native is not None:
    _native.bind_set_future(set_future)
    globals().update(set_future=_native.set_future)
