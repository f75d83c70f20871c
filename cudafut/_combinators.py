"""Combining futures: gather, wait_all, as_completed, as_completed_sync."""

from __future__ import annotations

import collections
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from ._errors import TimeoutError
from ._future import CudaFuture, Pending, check_timeout, remaining
from ._interface import adopt, discard_done_callback, new_future, succeeded, wait_for, when_done, when_set
from ._loops import current_driver, require_driver
from ._waiter import Driver, thread_waiter

__all__ = ["as_completed", "as_completed_sync", "gather", "wait_all"]


def _futures(futs: Iterable[object], what: str) -> list[CudaFuture[Any]]:
    """The futures of an iterable argument, with errors that say the convention."""
    if isinstance(futs, CudaFuture):
        raise TypeError(
            f"{what}() takes an iterable of CudaFutures: {what}([fut1, fut2]) "
            f"or {what}(futs), not {what}(fut)"
        )
    try:
        iterator = iter(futs)
    except TypeError:
        raise TypeError(
            f"{what}() takes an iterable of CudaFutures, such as a list, not {type(futs).__name__}"
        ) from None
    items: list[CudaFuture[Any]] = []
    for item in iterator:
        if not isinstance(item, CudaFuture):
            raise TypeError(f"{what}() takes CudaFutures, not {type(item).__name__}")
        items.append(item)
    return items


def gather(*futs: CudaFuture[Any]) -> CudaFuture[list[Any]]:
    """One future for many: its value is the list of their values.

    Takes the futures as separate arguments, as :func:`asyncio.gather` does:
    ``gather(f1, f2)`` or ``gather(*futs)``. It is set once every input is
    set, with the events of all of them, so ``await``,
    :meth:`~CudaFuture.result`, :meth:`~CudaFuture.wait` and
    :meth:`~CudaFuture.then` on it wait for all the GPU work.

    The first input to fail or be cancelled decides: if it failed, the
    gathered future fails with the same exception object; if it was
    cancelled, the gathered future is cancelled (docs/semantics.md, "Errors
    through chains"). Cancelling the gathered future leaves the inputs as
    they are.

    Blocks nothing: the host cost is a few µs per input, paid when each
    input completes, in the thread that completes it.

    Args:
        *futs: the futures to gather.

    Returns:
        A future of the list of the inputs' values, in argument order
        (already set, to ``[]``, when there are no inputs).

    Raises:
        TypeError: an argument is not a CudaFuture (a list of futures
            included: unpack it with ``gather(*futs)``).
    """
    for item in futs:
        if not isinstance(item, CudaFuture):
            if isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
                raise TypeError(
                    "gather() takes CudaFutures as separate arguments, as "
                    f"asyncio.gather() does: gather(*futs), not gather([...]) (got a {type(item).__name__})"
                )
            raise TypeError(f"gather() takes CudaFutures, not {type(item).__name__}")
    items = list(futs)
    out: CudaFuture[list[Any]] = new_future("gather")
    if not items:
        adopt(out, (), gather=True)  # nothing waits on it yet: nothing to run
        return out
    wait_for(out, items)  # a then() fn returning it may not close a cycle
    lock = threading.Lock()
    left = [len(items)]

    # A listener: it hands what it completes back to the loop that runs it
    # (no recursion through long chains of gathers).
    def one_completed(fut: CudaFuture[Any]) -> Pending | None:
        if not succeeded(fut):
            return adopt(out, (fut,))  # the first failure or cancellation decides
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            return adopt(out, items, gather=True)
        return None

    for fut in items:
        when_set(fut, lambda fut=fut: one_completed(fut))  # type: ignore[misc]
    return out


def wait_all(futs: Iterable[CudaFuture[Any]], timeout: float | None = None) -> list[Any]:
    """:meth:`CudaFuture.wait` for many: order the caller's streams after all.

    Takes one iterable of futures, as :func:`asyncio.wait` does:
    ``wait_all([f1, f2])`` or ``wait_all(futs)``. Blocks the calling thread
    only until every future is set (at most ``timeout`` seconds in all),
    then makes the calling thread's current streams wait on all their events
    (``cudaStreamWaitEvent``, about 0.4 µs each) and returns. Never blocks
    the GPU; do not call it on an event loop before the futures are set.

    Args:
        futs: the futures.
        timeout: seconds to wait at most, for all of them together; ``None``
            or ``math.inf``: no limit.

    Returns:
        Their values, in order.

    Raises:
        TypeError: ``futs`` is not an iterable of CudaFutures (a single
            future included: pass ``[fut]``).
        TimeoutError: not all set within ``timeout`` seconds.
        Exception: the first failure met, in order (as :meth:`CudaFuture.wait`).
    """
    items = _futures(futs, "wait_all")
    deadline = check_timeout(timeout)
    values: list[Any] = []
    for i, fut in enumerate(items):
        try:
            values.append(fut.wait(remaining(deadline)))
        except TimeoutError:
            raise TimeoutError(
                f"wait_all(): the future at index {i} (of {len(items)}) was not set within "
                f"{timeout} s: its producer has not called set_result() or set_exception() yet"
            ) from None
    return values


def as_completed(futs: Iterable[CudaFuture[Any]]) -> AsyncIterator[CudaFuture[Any]]:
    """Yield the futures as they become done (GPU work complete, or failed).

    ``async for fut in cudafut.as_completed(futs): value = await fut``.
    Takes one iterable of futures, as :func:`asyncio.as_completed` does.
    Call it with an asyncio, uvloop or trio loop running in this thread,
    and iterate it there.

    Never blocks the loop. One loop-wide waiter watches them all, as for
    ``await``: while the wait policy says spin (for ``spin_s``, 100 µs by
    default, after a new wait, and around the predicted end of work whose
    duration the waiter has learnt), the loop runs one poll (one
    ``cudaEventQuery``, about 2 µs) per loop iteration, taking that CPU but
    never blocking other tasks; otherwise it polls once per sleep, sleeps
    being at most ``max_sleep_s`` (1 ms by default). See
    docs/performance.md for the CPU measured.

    Args:
        futs: the futures.

    Returns:
        An async iterator of the same futures, in the order they complete.

    Raises:
        TypeError: ``futs`` is not an iterable of CudaFutures (a single
            future included: pass ``[fut]``).
        RuntimeError: no asyncio, uvloop or trio loop runs in this thread.
    """
    items = _futures(futs, "as_completed")
    if current_driver() is None:
        raise RuntimeError(
            "as_completed() needs a running asyncio (or uvloop) or trio event loop "
            "in this thread: call and iterate it inside a coroutine; outside a "
            "loop use fut.result() on each future"
        )
    return _as_completed(items)


class _Arrivals:
    """The futures of an as_completed() in the order they become done.

    One done callback per future, run by ``driver`` (the loop's waiter, or
    the watcher thread for :func:`as_completed_sync`), appends the future to
    ``ready`` and then calls ``wake`` if set, in the driver's thread.
    :meth:`close` removes the callbacks of those that have not arrived;
    :meth:`abandon` leaves them on the futures, to do nothing when they run.
    """

    def __init__(
        self, items: list[CudaFuture[Any]], driver: Driver, wake: Callable[[], None] | None = None
    ) -> None:
        self.items = items
        self.ready: collections.deque[CudaFuture[Any]] = collections.deque()
        self.wake = wake
        self.closed = False
        # One bound method, added to each future: abandon() finds it by identity.
        self._callback = self._arrived
        for fut in items:
            when_done(fut, self._callback, driver)

    def _arrived(self, fut: CudaFuture[Any]) -> None:
        if self.closed:
            return
        self.ready.append(fut)
        wake = self.wake
        if wake is not None:
            wake()

    def close(self) -> None:
        self.closed = True
        for fut in self.items:
            fut.remove_done_callback(self._callback)

    def abandon(self) -> None:
        """:meth:`close` without waiting for any future's lock, for where the
        garbage collector may close a generator, on a thread that may hold
        one: a callback whose future's lock is busy stays, runs once when
        its future is done, and does nothing (and keeps no future alive)."""
        self.closed = True
        for fut in self.items:
            discard_done_callback(fut, self._callback)
        self.items, self.wake = [], None
        self.ready.clear()


async def _as_completed(items: list[CudaFuture[Any]]) -> AsyncIterator[CudaFuture[Any]]:
    driver = require_driver()
    arrivals = _Arrivals(items, driver)

    def register(wake: Callable[[], None]) -> Callable[[], None]:
        arrivals.wake = wake

        def cancel() -> None:
            arrivals.wake = None

        return cancel

    try:
        for _ in items:
            if not arrivals.ready:
                await driver.until(register)
            yield arrivals.ready.popleft()
    finally:
        arrivals.close()


def as_completed_sync(
    futs: Iterable[CudaFuture[Any]], timeout: float | None = None
) -> Iterator[CudaFuture[Any]]:
    """Yield the futures as they become done, blocking the calling thread between them.

    The synchronous :func:`as_completed`, for threads and scripts, as
    :func:`concurrent.futures.as_completed` is for executors:
    ``for fut in cudafut.as_completed_sync(futs): value = fut.result()``
    (``result()`` of a yielded future returns at once). Takes one iterable
    of futures. Never call it on an event loop: use :func:`as_completed`
    there.

    cudafut's watcher thread watches all the futures' GPU work (one poll per
    busy stream, never spinning: a completion is noticed within its sleeps
    of at most ``max_sleep_s``, 1 ms by default, plus the operating system's
    wake-up delay) and wakes the iterating thread, which sleeps on a
    condition variable meanwhile (GIL released, Ctrl-C works). Blocks
    neither the GPU nor other threads. Leaving the loop early removes the
    remaining watches' callbacks (but for a future whose lock another
    thread holds at that instant: its callback stays until the future is
    done, and then does nothing; a closing generator never waits for a
    lock, since the garbage collector may close it on a thread that holds
    one).

    Args:
        futs: the futures.
        timeout: seconds to wait at most, for all of them together, counted
            from this call; ``None`` or ``math.inf``: no limit.

    Returns:
        An iterator of the same futures, in the order they become done
        (failed and cancelled ones included).

    Raises:
        TypeError: ``futs`` is not an iterable of CudaFutures (a single
            future included: pass ``[fut]``), or ``timeout`` is not a number.
        ValueError: ``timeout`` is negative or NaN.
        TimeoutError: (while iterating) the next future was not done in time;
            their GPU work goes on.
    """
    items = _futures(futs, "as_completed_sync")
    deadline = check_timeout(timeout)
    return _as_completed_sync(items, deadline, timeout)


def _as_completed_sync(
    items: list[CudaFuture[Any]], deadline: float | None, timeout: float | None
) -> Iterator[CudaFuture[Any]]:
    cond = threading.Condition()

    def wake() -> None:  # in the watcher thread, after the append
        with cond:
            cond.notify()

    arrivals = _Arrivals(items, thread_waiter(), wake)
    try:
        for i in range(len(items)):
            with cond:
                while not arrivals.ready:
                    if not cond.wait(remaining(deadline)) and not arrivals.ready:
                        raise TimeoutError(
                            f"as_completed_sync(): {len(items) - i} of {len(items)} futures were not "
                            f"done within {timeout} s; their GPU work goes on: iterate again, or "
                            "wait on them with result()"
                        )
            yield arrivals.ready.popleft()
    except GeneratorExit:
        # close() by its owner, or the garbage collector finalizing the
        # generator on whatever thread it runs, possibly inside a method of
        # one of these futures, under its lock (removing a callback there
        # deadlocked): nothing here may wait for a future's lock.
        arrivals.abandon()
        raise
    finally:
        if not arrivals.closed:
            arrivals.close()
