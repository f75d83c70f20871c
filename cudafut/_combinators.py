"""Combining futures: gather, wait_all, as_completed."""

from __future__ import annotations

import collections
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ._errors import CancelledError
from ._future import _CANCELLED, _FAILED, _SET, CudaFuture, check_timeout, remaining
from ._loops import require_driver

__all__ = ["as_completed", "gather", "wait_all"]


def _futures(futs: Iterable[object], what: str) -> list[CudaFuture[Any]]:
    items: list[CudaFuture[Any]] = []
    for item in futs:
        if not isinstance(item, CudaFuture):
            raise TypeError(f"{what} takes CudaFutures, not {type(item).__name__}")
        items.append(item)
    return items


def gather(*futs: CudaFuture[Any]) -> CudaFuture[list[Any]]:
    """One future for many: its value is the list of their values.

    It is set once every input is set, with the events of all of them, so
    ``await``, :meth:`~CudaFuture.result`, :meth:`~CudaFuture.wait` and
    :meth:`~CudaFuture.then` on it wait for all the GPU work. If an input
    fails or is cancelled, the gathered future fails with the first such
    exception (a cancelled input gives :class:`CancelledError`). Blocks
    nothing; the host cost is a few µs per input.
    """
    items = _futures(futs, "gather()")
    out: CudaFuture[list[Any]] = CudaFuture()
    if not items:
        out._complete(_SET, [], None, ())
        return out
    lock = threading.Lock()
    remaining = [len(items)]

    def one_set(fut: CudaFuture[Any]) -> None:
        if fut._state == _FAILED:
            fut._retrieved = True
            out._try_complete(_FAILED, None, fut._exception)
        elif fut._state == _CANCELLED:
            out._try_complete(_FAILED, None, CancelledError("a gathered CudaFuture was cancelled"))
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last and all(f._state == _SET for f in items):
            records = tuple({id(r): r for f in items for r in f._records}.values())
            out._try_complete(_SET, [f._value for f in items], None, records)

    for fut in items:
        fut._on_set(lambda fut=fut: one_set(fut))  # type: ignore[misc]
    return out


def wait_all(futs: Iterable[CudaFuture[Any]], timeout: float | None = None) -> list[Any]:
    """:meth:`CudaFuture.wait` for many: order the caller's streams after all.

    Blocks the thread only until every future is set (at most ``timeout``
    seconds in all), then makes the current streams wait on all their events
    and returns the values in order. Raises the first failure it meets.
    """
    items = _futures(futs, "wait_all()")
    deadline = check_timeout(timeout)
    return [fut.wait(remaining(deadline)) for fut in items]


async def as_completed(futs: Iterable[CudaFuture[Any]]) -> AsyncIterator[CudaFuture[Any]]:
    """Yield the futures as they become done (GPU work complete, or failed).

    ``async for fut in cudafut.as_completed(futs): value = await fut``.
    Waiting costs nothing on the loop; one loop-wide waiter watches them all.
    """
    items = _futures(futs, "as_completed()")
    driver = require_driver()
    ready: collections.deque[CudaFuture[Any]] = collections.deque()
    wake: list[Any] = [None]

    def arrived(fut: object) -> None:
        ready.append(fut)  # type: ignore[arg-type]
        if wake[0] is not None:
            wake[0]()

    def register(w: Any) -> Any:
        wake[0] = w

        def cancel() -> None:
            wake[0] = None

        return cancel

    for fut in items:
        fut.add_done_callback(arrived)
    for _ in items:
        if not ready:
            await driver.until(register)
        yield ready.popleft()
