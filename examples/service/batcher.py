"""Dynamic batching for an asyncio service: no CUDA here, so it can be tested anywhere.

Requests call ``await batcher.submit(item)``; one task forms batches of up to
``max_batch`` items, waiting at most ``max_delay_s`` after the first item of
a batch arrived for more, and hands each batch to ``run_batch(items)``, an
async function that returns one result per item (in the service: one
``cudafut.submit()`` for the whole batch, awaited). Each request gets its own
slice back, or the batch's exception.

``max_in_flight`` batches may run at once: while the GPU runs one batch the
next one forms, so the GPU never waits for the host to collect requests.
Requests whose caller went away (a cancelled ``submit``) are dropped from the
batch before it runs.
"""

from __future__ import annotations

import asyncio
import collections
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


def check_options(run_batch: object, max_batch: object, max_delay_s: object, max_in_flight: object) -> None:
    """Refuse what no batcher can run with: a ``TypeError`` for the wrong kind
    of value, a ``ValueError`` for a value out of range. Shared by
    :class:`Batcher` and examples/trio_app.py's ``TrioBatcher``."""
    if not callable(run_batch):
        raise TypeError(f"run_batch must be an async function of a list, not {type(run_batch).__name__}")
    for name, value in (("max_batch", max_batch), ("max_in_flight", max_in_flight)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, numbers.Real):
        raise TypeError(f"max_delay_s must be a number of seconds, not {type(max_delay_s).__name__}")
    if not 0 <= max_delay_s < math.inf:  # NaN fails too
        raise ValueError(f"max_delay_s must be a finite number of seconds >= 0, not {max_delay_s}")


@dataclass
class _Item(Generic[In, Out]):
    value: In
    future: asyncio.Future[Out]
    arrived: float  # the loop's time when submit() was called


@dataclass
class BatchStats:
    """What the batcher did so far."""

    batches: int = 0
    items: int = 0
    sizes: collections.Counter[int] = field(default_factory=collections.Counter)

    @property
    def mean_batch(self) -> float:
        return self.items / self.batches if self.batches else 0.0


class Batcher(Generic[In, Out]):
    """Collect concurrent ``submit(item)`` calls into batches for ``run_batch``.

    Use it as ``async with Batcher(run_batch) as batcher:`` (or call
    ``start()`` and ``aclose()``) on the loop that serves the requests.
    """

    def __init__(
        self,
        run_batch: Callable[[list[In]], Awaitable[Sequence[Out]]],
        *,
        max_batch: int = 64,
        max_delay_s: float = 0.002,
        max_in_flight: int = 2,
    ) -> None:
        check_options(run_batch, max_batch, max_delay_s, max_in_flight)
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.stats = BatchStats()
        self._pending: collections.deque[_Item[In, Out]] = collections.deque()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> Batcher[In, Out]:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the batcher is already started")
        self._task = asyncio.get_running_loop().create_task(self._collect(), name="batcher")

    async def submit(self, value: In) -> Out:
        """The result of ``value``, computed in a batch with other requests."""
        if self._closed or self._task is None:
            raise RuntimeError("the batcher is not running")
        loop = asyncio.get_running_loop()
        item: _Item[In, Out] = _Item(value, loop.create_future(), loop.time())
        self._pending.append(item)
        self._arrived.set()
        return await item.future

    async def aclose(self) -> None:
        """Stop forming batches, let the running ones finish, fail the rest."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(RuntimeError("the batcher was closed"))

    async def _next_item(self) -> _Item[In, Out]:
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        return self._pending.popleft()

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()  # at most max_in_flight batches at once
            batch: list[_Item[In, Out]] = []
            try:
                first = await self._next_item()
                batch.append(first)
                deadline = first.arrived + self.max_delay_s
                while len(batch) < self.max_batch:
                    if self._pending:
                        batch.append(self._pending.popleft())
                        continue
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    self._arrived.clear()
                    try:
                        # Waiting on an Event, not on a queue: a timeout loses no item.
                        await asyncio.wait_for(self._arrived.wait(), remaining)
                    except asyncio.TimeoutError:
                        break
            except BaseException:  # cancelled by aclose(): fail what was taken
                self._slots.release()
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(RuntimeError("the batcher was closed"))
                raise
            task = loop.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[_Item[In, Out]]) -> None:
        try:
            batch = [item for item in batch if not item.future.done()]  # callers gone: skip
            if not batch:
                return
            self.stats.batches += 1
            self.stats.items += len(batch)
            self.stats.sizes[len(batch)] += 1
            try:
                results = await self.run_batch([item.value for item in batch])
                if len(results) != len(batch):
                    raise ValueError(f"run_batch returned {len(results)} results for {len(batch)} items")
            except Exception as exc:  # noqa: BLE001 (each caller gets it)
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                return
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result(result)
        finally:
            self._slots.release()


def describe(stats: BatchStats) -> dict[str, Any]:
    """The stats as JSON-ready numbers."""
    return {"batches": stats.batches, "items": stats.items, "mean_batch": round(stats.mean_batch, 2)}
