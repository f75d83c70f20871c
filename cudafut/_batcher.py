"""Batcher: concurrent requests gathered into batches for one GPU call each.

A service answering one request at a time launches one small batch per
request; the GPU then runs a model at batch 1 over and over, far below what
it can do. :class:`Batcher` gathers the requests that arrive together into
one call of ``run_batch(items)``, on asyncio (and uvloop) or trio, and hands
each request its own result. docs/serving.md shows it serving a torchvision
model, with figures.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import dataclasses
import inspect
import math
import numbers
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Final, Generic, TypeVar, overload

from . import _backend, _checks, _completions, _cuda, _loops, _torch
from ._errors import InvalidStateError
from ._events import EventRecord
from ._future import CudaFuture
from ._interface import (
    await_done,
    complete_with,
    fail_future,
    new_future,
    set_future,
    share_state,
    until_set,
)
from ._launch import enqueue_as_caller
from ._log import logger
from ._producers import record
from ._values import find_devices

__all__ = ["Batcher", "BatcherStatistics"]

In = TypeVar("In")
Out = TypeVar("Out")

# What the batch former waits for; submit() and a finished batch wake it
# only when it waits for what they bring (a wake-up costs a loop iteration).
_IDLE: Final = 0  # running, not waiting
_WANT_ITEM: Final = 1  # the queue is empty
_WANT_FULL: Final = 2  # a batch is forming: wake when it is full
_WANT_SLOT: Final = 3  # max_in_flight batches run: wake when one ends

# How a Batcher was started: by an `async with` block, or by start() (closed
# by aclose(), for a framework's start-up and shutdown hooks).
_NOT_STARTED: Final = 0
_IN_BLOCK: Final = 1
_BY_START: Final = 2


#: What the log and a later submit() say when the batch-forming task was
#: cancelled while the batcher was started: most often its loop ended first.
_FORMER_CANCELLED: Final = (
    "a Batcher's batch-forming task was cancelled while the Batcher was started (did its loop end "
    "before `await batcher.aclose()`?): close a started Batcher in your framework's shutdown hook "
    "(aiohttp's on_cleanup, a lifespan's end), or use `async with cudafut.Batcher(...)`"
)


@dataclasses.dataclass(frozen=True)
class BatcherStatistics:
    """What a :class:`Batcher` did so far (:meth:`Batcher.statistics`).

    Attributes:
        batches: batches run (``run_batch`` called), failed ones included.
        items: requests run in those batches (padding not counted).
        padded: padding items added to reach a bucket size.
        cancelled: requests dropped before their batch ran, their caller
            having been cancelled.
        failed_batches: batches whose ``run_batch`` raised, or returned
            results that could not be split; each of their requests got the
            exception.
        in_flight: batches running now.
        queued: requests waiting for a batch now.
        sizes: how many batches ran with each number of requests (before
            padding).
    """

    batches: int
    items: int
    padded: int
    cancelled: int
    failed_batches: int
    in_flight: int
    queued: int
    sizes: dict[int, int]

    @property
    def mean_batch(self) -> float:
        """Requests per batch, on average (0.0 before the first batch)."""
        return self.items / self.batches if self.batches else 0.0


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return int(value)


_Entry = tuple[Any, Any, float, tuple[EventRecord, ...]]


class _Flight:
    """A plain ``run_batch``'s batch on asyncio, launched by the batch former
    itself (no task): its requests, their number before padding and after,
    and its launch's future. It is in ``Batcher._flights`` until answered
    (each batch is answered, and ends, once)."""

    __slots__ = ("batch", "fut", "n", "size")

    def __init__(self, batch: list[_Entry], n: int, size: int) -> None:
        self.batch = batch
        self.n = n
        self.size = size
        self.fut: CudaFuture[Any] | None = None


class Batcher(Generic[In, Out]):
    """Gather concurrent requests into batches, one ``run_batch`` call each.

    Use it on the event loop that serves the requests (asyncio, uvloop or
    trio)::

        async with cudafut.Batcher(run_batch, max_batch=64, max_delay_s=0.002) as batcher:
            y = await batcher.submit(x)  # from each request's task

    ``run_batch(items)`` gets the list of items of one batch and returns one
    result per item: a sequence of that length, or an array (CuPy, NumPy,
    PyTorch, ...) whose first axis is the batch. It may be

    - a plain function: it runs through :func:`cudafut.launch`, on a
      launcher thread of ``device``, so its host work (stacking the inputs,
      PyTorch's dispatch of a whole model, a graph replay) never runs on the
      loop; the batch is answered once its GPU work is done (on asyncio and
      uvloop, a completion thread of ``device``, which launches nothing,
      blocks until then, GIL released, and wakes the loop once for the
      whole batch; batches are answered in the order their launches
      returned);
    - an async function (``async def``): awaited on the loop; if it returns
      a :class:`CudaFuture`, that is awaited too. Its host work runs on the
      loop, so keep it short (or call :func:`cudafut.launch` inside).

    How batches form: a batch starts with the oldest waiting request. While
    fewer than ``min_in_flight`` batches run (the GPU idle, or about to
    be), it goes at once with what is waiting. Otherwise it takes what
    arrives until it holds ``max_batch`` requests, ``max_delay_s`` have
    passed since that request arrived (asyncio and uvloop round the delay
    to whole milliseconds), or a running batch ends leaving fewer than
    ``min_in_flight``, whichever comes first: batches stay small at low
    load and grow with it. Up to
    ``max_in_flight`` batches run at once, so the next batch forms while the
    GPU runs one; while that many run, requests wait, and when one ends the
    next batch goes by the same rule (at once if fewer than
    ``min_in_flight`` now run). Where ``min_in_flight`` equals
    ``max_in_flight`` (as ``max_in_flight=1`` makes it by default), no
    batch waits to fill and ``max_delay_s`` has no effect. With
    ``buckets`` (sizes such as ``(1, 2, 4, 8, 16, 32, 64)``), a batch of
    ``n`` requests is padded up to the smallest bucket of at least ``n`` by
    repeating its last item, so that ``run_batch`` only ever sees those
    sizes (one captured CUDA graph per size: :func:`cudafut.graphed`); the
    results of the padding are dropped.

    Each request gets its own result, or the exception of its batch (one
    failing batch fails only its requests). A request whose caller is
    cancelled before its batch runs is dropped from the batch; cancelled
    later, its result is dropped. Leaving the ``async with`` block runs what
    is queued and waits for the running batches; leaving it with an
    exception fails the queued requests with :class:`InvalidStateError`.
    Where a framework starts and stops the service in two hooks (aiohttp's
    ``on_startup`` and ``on_cleanup``), :meth:`start` and :meth:`aclose` do
    what entering and leaving the block do, from any tasks of the loop.

    Costs on the loop, per request: a future, a queue append and, when the
    batch former waits for requests, its wake-up; per batch: for a plain
    ``run_batch`` on asyncio (no :meth:`submit_future` in the batch), the
    launch's queue put and one callback, the completion thread's wake-up,
    that answers the batch; otherwise one task and the ``await`` of its
    future. Nothing blocks the loop (a plain ``run_batch`` runs on a
    launcher thread, its GPU work waited for on a completion thread; an
    async one runs its host work on the loop).

    Args:
        run_batch: the function that runs one batch (see above).
        max_batch: the most requests in one batch (default: the largest
            bucket, or 64 without buckets; at most the largest bucket).
        max_delay_s: the longest a request waits for others to join its
            batch, in seconds (default 0.002).
        buckets: the batch sizes ``run_batch`` accepts, or None (default:
            any size up to ``max_batch``).
        max_in_flight: the most batches running at once (default 4;
            docs/serving.md measures depths).
        min_in_flight: while fewer batches than this run, a batch goes
            as soon as it has a request, without waiting to fill (default
            2, or ``max_in_flight`` if lower; 0: always wait for
            ``max_batch`` or ``max_delay_s``).
        device: the device whose launcher threads run a plain
            ``run_batch`` (default: the current device when the batch runs).

    Raises:
        TypeError: ``run_batch`` is not callable, or an option has the wrong type.
        ValueError: an option is out of range (``max_batch``,
            ``max_in_flight`` or a bucket below 1, ``min_in_flight``
            outside 0 to ``max_in_flight``, a negative, infinite or
            NaN delay, ``max_batch`` above the largest bucket).
    """

    max_batch: int
    max_in_flight: int
    min_in_flight: int
    max_delay_s: float
    buckets: tuple[int, ...] | None
    device: int | None
    run_batch: Callable[[list[In]], Any]
    _async: bool
    _queue: collections.deque[tuple[Any, Any, float, tuple[EventRecord, ...]]]
    _broken: BaseException | None
    _former_cancelled: bool
    _rt: Any
    _nursery_cm: Any
    _mode: int
    _token: Any
    _started: Any
    _done: Any
    _want: int
    _closing: bool
    _closed: bool
    _in_flight: int
    _batches: int
    _items: int
    _padded: int
    _cancelled: int
    _failed: int
    _sizes: collections.Counter[int]

    @overload
    def __init__(
        self: Batcher[In, Out],
        run_batch: Callable[[list[In]], Awaitable[Sequence[Out]]] | Callable[[list[In]], Sequence[Out]],
        *,
        max_batch: int | None = ...,
        max_delay_s: float = ...,
        buckets: Sequence[int] | None = ...,
        max_in_flight: int = ...,
        min_in_flight: int | None = ...,
        device: int | None = ...,
    ) -> None: ...
    @overload
    def __init__(
        self: Batcher[In, Any],
        run_batch: Callable[[list[In]], Any],
        *,
        max_batch: int | None = ...,
        max_delay_s: float = ...,
        buckets: Sequence[int] | None = ...,
        max_in_flight: int = ...,
        min_in_flight: int | None = ...,
        device: int | None = ...,
    ) -> None: ...
    def __init__(
        self,
        run_batch: Callable[[list[In]], Any],
        *,
        max_batch: int | None = None,
        max_delay_s: float = 0.002,
        buckets: Sequence[int] | None = None,
        max_in_flight: int = 4,
        min_in_flight: int | None = None,
        device: int | None = None,
    ) -> None:
        if not callable(run_batch):
            raise TypeError(
                f"run_batch must be a function of a list of items, not {type(run_batch).__name__}"
            )
        if max_batch is None:  # the largest bucket, or 64
            largest = None
            if isinstance(buckets, Sequence) and not isinstance(buckets, (str, bytes)) and buckets:
                with contextlib.suppress(TypeError, ValueError):
                    largest = max(_check_count("a bucket", b) for b in buckets)
            max_batch = 64 if largest is None else largest
        self.max_batch = _check_count("max_batch", max_batch)
        self.max_in_flight = _check_count("max_in_flight", max_in_flight)
        if min_in_flight is None:  # two, or max_in_flight if lower
            min_in_flight = min(2, self.max_in_flight)
        if isinstance(min_in_flight, bool) or not isinstance(min_in_flight, numbers.Integral):
            raise TypeError(f"min_in_flight must be an int, not {type(min_in_flight).__name__}")
        if not 0 <= min_in_flight <= self.max_in_flight:
            raise ValueError(
                f"min_in_flight must be between 0 and max_in_flight ({self.max_in_flight}), "
                f"not {min_in_flight}"
            )
        self.min_in_flight = int(min_in_flight)
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, numbers.Real):
            raise TypeError(f"max_delay_s must be a number of seconds, not {type(max_delay_s).__name__}")
        if not 0 <= max_delay_s < math.inf:  # NaN fails too
            raise ValueError(f"max_delay_s must be a finite number of seconds >= 0, not {max_delay_s}")
        self.max_delay_s = float(max_delay_s)
        self.buckets = None
        if buckets is not None:
            if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
                raise TypeError(f"buckets must be a sequence of ints, not {type(buckets).__name__}")
            sizes = sorted({_check_count("a bucket", b) for b in buckets})
            if not sizes:
                raise ValueError("buckets must hold at least one size (or be None)")
            if self.max_batch > sizes[-1]:
                raise ValueError(
                    f"max_batch ({self.max_batch}) is above the largest bucket ({sizes[-1]}): "
                    "no bucket could hold a full batch; lower max_batch or add a bucket"
                )
            self.buckets = tuple(sizes)
        if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
            raise TypeError(f"device must be a CUDA device ordinal (an int) or None, not {device!r}")
        self.device = device
        self.run_batch = run_batch
        self._async = _checks.is_async_callable(run_batch)
        # Plain run_batch's batches on asyncio launched by the former, not
        # answered yet; the future set when the last is (a close waits for it).
        self._flights: set[_Flight] = set()
        self._drained: asyncio.Future[None] | None = None
        self._queue = collections.deque()
        self._rt = None
        self._nursery_cm = None
        self._mode = _NOT_STARTED
        self._token = None
        self._started = None
        self._done = None
        self._want = _IDLE
        self._closing = False
        self._closed = False
        self._broken = None
        self._former_cancelled = False  # while started (its loop ended?)
        self._in_flight = 0
        # Batches spawned whose task has not run a line yet: asyncio drops
        # a task cancelled before its first step without running its body.
        self._unstarted: dict[int, list[tuple[Any, Any, float, tuple[EventRecord, ...]]]] = {}
        self._batches = 0
        self._items = 0
        self._padded = 0
        self._cancelled = 0
        self._failed = 0
        self._sizes = collections.Counter()

    # -- the requests' side --------------------------------------------------

    async def submit(self, item: In) -> Out:
        """The result of ``item``, computed in a batch with other requests.

        Waits (without blocking the loop) for the batch to run and its GPU
        work to be done. Cancelling the caller before the batch runs drops
        the item from it.

        Raises:
            InvalidStateError: the batcher is not running (outside its
                ``async with`` block, or closing), or it closed with an
                exception before the item's batch ran.
            Exception: what the item's batch raised.
        """
        rt = self._running()
        # GPU arrays in the item: its batch's stream must first wait for what
        # this task enqueued (it may run on a stream of its own).
        after = _submitter_events(item)
        if isinstance(rt, _loops.AsyncioTasks):
            slot: Any = rt.loop.create_future()
            self._queue.append((item, slot, rt.loop.time(), after))
            self._wake_for_item()
            result: Out = await slot
            return result
        slot = _loops.TrioSlot(rt.trio)
        self._queue.append((item, slot, rt.now(), after))
        self._wake_for_item()
        value: Out = await slot.wait()
        return value

    def submit_future(self, item: In) -> CudaFuture[Out]:
        """``item``'s result as a :class:`CudaFuture`, set as soon as its
        batch is *enqueued*, before the GPU work is done: for a consumer that
        waits for the GPU itself, such as another process (pickle the
        future after ``await cudafut.enqueued(fut)``: docs/processes.md), or
        a chain of ``then()``. Costs what :meth:`submit` costs, less the
        wait; blocks nothing. Call it on the batcher's loop; cancelling the
        future before its batch runs drops the item, and an exception of the
        batch fails it.

        Raises:
            InvalidStateError: as :meth:`submit`.
        """
        rt = self._running()
        fut: CudaFuture[Out] = new_future("Batcher.submit_future")
        self._queue.append((item, fut, rt.now(), _submitter_events(item)))
        self._wake_for_item()
        return fut

    def _running(self) -> Any:
        """The runtime, checked as :meth:`submit` checks it."""
        rt = self._rt
        if rt is None or self._closing:
            if self._broken is not None:
                why = (
                    "was cancelled (its loop ended before aclose(), or the task was cancelled)"
                    if self._former_cancelled
                    else "ended"
                )
                raise InvalidStateError(
                    f"this Batcher's batch-forming task {why}; create a new Batcher on this loop"
                ) from self._broken
            raise InvalidStateError(
                "this Batcher is not running: submit() inside `async with cudafut.Batcher(...) as b:`, "
                "or between `await b.start()` and `await b.aclose()`"
            )
        if isinstance(rt, _loops.AsyncioTasks):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not rt.loop:
                raise InvalidStateError("Batcher.submit() must run on the event loop the Batcher runs on")
        return rt

    def _wake_for_item(self) -> None:
        want = self._want
        if want == _WANT_ITEM or (want == _WANT_FULL and len(self._queue) >= self.max_batch):
            self._rt.wake()

    def statistics(self) -> BatcherStatistics:
        """What the batcher did so far; costs a few µs, blocks nothing."""
        return BatcherStatistics(
            batches=self._batches,
            items=self._items,
            padded=self._padded,
            cancelled=self._cancelled,
            failed_batches=self._failed,
            in_flight=self._in_flight,
            queued=len(self._queue),
            sizes=dict(sorted(self._sizes.items())),
        )

    # -- lifetime -------------------------------------------------------------

    async def start(self) -> Batcher[In, Out]:
        """Start forming batches on the running loop; return the batcher.

        For a service whose start-up and shutdown are two hooks rather than
        one block: aiohttp's ``on_startup`` and ``on_cleanup``, Starlette's
        or FastAPI's ``on_startup``/``on_shutdown`` (a lifespan, being one
        block, can use ``async with`` as well)::

            async def on_startup(app):
                app["batcher"] = await cudafut.Batcher(run_batch).start()

            async def on_cleanup(app):
                await app["batcher"].aclose()

        :meth:`submit` works from then on, in any task of this loop, until
        :meth:`aclose`. Idempotent: a second call (from any task of the
        same loop) returns the batcher, started once. The batch former
        belongs to the loop, not to the calling task: on asyncio it is a task
        of the loop; on trio, a system task (trio ends it with the run, so a
        batcher never closed does not keep the run alive).

        Cost: on asyncio, one task created, and the call returns at once; on
        trio, one system task, and the call waits one scheduling round for
        it to start. Blocks neither the thread nor the loop; touches no
        GPU.

        Raises:
            InvalidStateError: the batcher was closed (by :meth:`aclose`
                or by leaving its ``async with`` block: a Batcher runs once),
                runs in an ``async with`` block, or was started on another
                loop or thread.
            RuntimeError: no asyncio, uvloop or trio loop runs in this
                thread.
        """
        if self._mode == _IN_BLOCK:
            raise InvalidStateError(
                "this Batcher runs in an `async with` block, which starts and closes it: do not "
                "also call start()"
            )
        if self._closing or self._closed:
            raise InvalidStateError(
                "this Batcher was closed (by aclose() or its `async with` block): a Batcher runs "
                "once; create a new one"
            )
        if self._mode == _BY_START:
            self._check_loop("start()")
            if self._started is not None:  # trio: another task's start() waits for the former
                await self._started.wait()
            return self
        library = _loops.current_library()
        if library is None:
            raise RuntimeError(
                "Batcher.start() needs a running asyncio, uvloop or trio loop in this thread: await it "
                "in a coroutine (a framework's start-up hook)"
            )
        self._mode = _BY_START
        if library is asyncio:
            self._start_asyncio()
            return self
        trio = library
        self._token = trio.lowlevel.current_trio_token()
        self._started = started = trio.Event()
        self._done = trio.Event()
        trio.lowlevel.spawn_system_task(self._serve_trio, trio, name="cudafut.Batcher")
        await started.wait()
        return self

    async def aclose(self) -> None:
        """Close a batcher that :meth:`start` started: run what is queued,
        wait for the batches running, and stop forming batches.

        Afterwards :meth:`submit` raises :class:`InvalidStateError`, as it
        does after an ``async with`` block. Idempotent: a second call (or
        a call from another task while one closes it) waits for the same
        close and returns; on a batcher never started, or whose loop (or
        trio run) has ended, it only marks it closed, from any loop.

        Cost: the wait for the queued and running batches (their GPU work
        included), without blocking the loop; then nothing. Call it on the
        loop that started the batcher.

        Raises:
            InvalidStateError: the batcher runs in an ``async with`` block
                (leaving the block closes it), or was started on another
                loop or thread.
        """
        if self._mode == _IN_BLOCK:
            raise InvalidStateError("this Batcher runs in an `async with` block: leaving the block closes it")
        if self._mode == _NOT_STARTED or self._loop_ended():
            # Nothing runs or waits any more, from whatever loop this is.
            self._closing = self._closed = True
            return
        self._check_loop("aclose()")
        if self._done is None:  # asyncio: what leaving a block without an exception does
            await self.__aexit__(None, None, None)
            return
        if self._started is not None:  # a start() still waits for the former to start
            await self._started.wait()
        self._closing = True
        rt = self._rt
        if rt is not None:
            rt.wake()
        await self._done.wait()

    def _loop_ended(self) -> bool:
        """Whether the loop or run that started the batcher is over (so is
        everything it ran)."""
        rt = self._rt
        if isinstance(rt, _loops.AsyncioTasks):
            return rt.loop.is_closed()
        return self._closed  # trio: the system task ends with its run, or closed it

    def _check_loop(self, call: str) -> None:
        """Raise unless the running loop is the one that started the batcher."""
        rt = self._rt
        library = _loops.current_library()
        if isinstance(rt, _loops.AsyncioTasks):
            ok = library is asyncio and asyncio.get_running_loop() is rt.loop
        else:  # trio: the run whose token start() kept
            ok = library not in (None, asyncio) and library.lowlevel.current_trio_token() is self._token
        if not ok:
            raise InvalidStateError(
                f"Batcher.{call} must run on the event loop that started the Batcher (its thread), "
                "not another loop or thread"
            )

    async def _serve_trio(self, trio: Any) -> None:
        """The trio system task of a batcher that :meth:`start` started: a
        nursery for the former and its batches, open until they end."""
        try:
            async with trio.open_nursery() as nursery:
                self._rt = _loops.TrioTasks(trio, nursery)
                nursery.start_soon(self._form)
                self._started.set()
                self._started = None
        except BaseException as exc:
            if _only_cancellations(exc):
                if not self._closing:  # the run ended with the batcher started
                    self._former_was_cancelled(RuntimeError(_FORMER_CANCELLED))
                raise  # the run ends: trio cancels its system tasks
            # Raised from a system task, it would crash the whole run.
            self._broken = exc
            logger.error("cudafut: a Batcher's batch-forming task ended", exc_info=exc)
        finally:
            self._closing = True
            self._closed = True
            self._fail_queued()
            self._done.set()
            if self._started is not None:  # it failed before it started
                self._started.set()
                self._started = None

    def _start_asyncio(self) -> None:
        rt = _loops.AsyncioTasks(asyncio.get_running_loop())
        self._rt = rt
        rt.spawn(self._form)
        for task in rt.tasks:  # the former: if it ends early, nothing may hang
            task.add_done_callback(self._former_ended)

    async def __aenter__(self) -> Batcher[In, Out]:
        if self._rt is not None or self._closing or self._closed:
            if self._mode == _BY_START and not self._closing:
                raise InvalidStateError(
                    "this Batcher was started with start(): close it with aclose(), not an `async with` block"
                )
            raise InvalidStateError("a Batcher runs once: create a new one")
        library = _loops.current_library()
        if library is asyncio:
            self._mode = _IN_BLOCK
            self._start_asyncio()
            return self
        if library is None:
            raise RuntimeError("cudafut.Batcher needs a running asyncio, uvloop or trio loop")
        self._mode = _IN_BLOCK
        trio = library
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        self._rt = _loops.TrioTasks(trio, nursery)
        nursery.start_soon(self._form)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        rt = self._rt
        self._closing = True
        if exc is not None:  # nothing more runs: fail what waits
            self._fail_queued()
        rt.wake()
        try:
            if isinstance(rt, _loops.AsyncioTasks):
                if exc is not None:
                    for task in rt.tasks:
                        task.cancel()
                    self._fail_flights()
                while rt.tasks or self._flights:
                    if not rt.tasks:  # only launched batches run: wait for the last to be answered
                        drained = self._drained
                        if drained is None or drained.done():  # a concurrent close waits on the same
                            drained = self._drained = rt.loop.create_future()
                        await asyncio.shield(drained)
                        continue
                    # Each round waits for the tasks it saw, then drops them
                    # itself: a task leaves rt.tasks only when its done
                    # callback runs on the loop, and since Python 3.12
                    # gather() of tasks all done returns without yielding
                    # to the loop, so waiting for the callback spun for ever.
                    tasks = list(rt.tasks)
                    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                    rt.tasks.difference_update(tasks)
                    for outcome in outcomes:
                        if isinstance(outcome, BaseException) and not _loops.is_cancellation(outcome):
                            logger.error("cudafut: a Batcher task failed", exc_info=outcome)
                return None
            if exc is not None:
                # The exception leaves the block as it came, not wrapped in
                # the nursery's exception group.
                self._rt.nursery.cancel_scope.cancel()
                await self._nursery_cm.__aexit__(None, None, None)
                return None
            result: bool | None = await self._nursery_cm.__aexit__(None, None, None)
            return result
        finally:
            self._closed = True
            self._fail_queued()
            self._fail_unstarted()

    def _fail_unstarted(self) -> None:
        """Fail the requests of batches whose task was cancelled before it
        ran (leaving the block with an exception): nobody may wait for ever."""
        unstarted, self._unstarted = self._unstarted, {}
        for batch in unstarted.values():
            self._in_flight -= 1
            error = InvalidStateError("the Batcher closed before this item's batch ran")
            for entry in batch:
                _fail_slot(entry[1], error)

    def _former_ended(self, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        if task.cancelled():  # most often its loop ended with the batcher still started
            self._former_was_cancelled(asyncio.CancelledError(_FORMER_CANCELLED))
        else:
            self._broken = task.exception() or RuntimeError("the batch-forming task returned")
            logger.error("cudafut: a Batcher's batch-forming task ended: %r", self._broken)
        self._closing = True
        self._fail_queued()

    def _former_was_cancelled(self, error: BaseException) -> None:
        """The batch former was cancelled while the batcher was started: a
        later submit() says so (from ``error``), and the log says what to do."""
        self._broken = error
        self._former_cancelled = True
        logger.error("cudafut: %s", _FORMER_CANCELLED)

    def _fail_queued(self) -> None:
        while self._queue:
            slot = self._queue.popleft()[1]
            if not slot.done():
                slot.set_exception(InvalidStateError("the Batcher closed before this item's batch ran"))

    # -- forming and running batches --------------------------------------------

    async def _form(self) -> None:
        """The one task that forms batches, until the batcher closes and its
        queue is empty."""
        rt = self._rt
        queue = self._queue
        try:
            while True:
                while self._in_flight >= self.max_in_flight:
                    self._want = _WANT_SLOT
                    await rt.sleep(None)
                while True:
                    while queue and queue[0][1].done():  # its caller went away
                        queue.popleft()
                        self._cancelled += 1
                    if queue:
                        break
                    if self._closing:
                        return
                    self._want = _WANT_ITEM
                    await rt.sleep(None)
                # Fewer than min_in_flight batches run: the GPU would idle
                # (or soon), so the batch goes now; else it fills until
                # max_batch, its deadline, or the pipeline runs low.
                deadline = queue[0][2] + self.max_delay_s
                while (
                    len(queue) < self.max_batch
                    and self._in_flight >= self.min_in_flight
                    and not self._closing
                    and rt.now() < deadline
                ):
                    self._want = _WANT_FULL
                    if await rt.sleep(deadline):  # its timer fired: the deadline passed
                        break
                self._want = _IDLE
                batch: list[tuple[Any, Any, float, tuple[EventRecord, ...]]] = []
                while queue and len(batch) < self.max_batch:
                    entry = queue.popleft()
                    if entry[1].done():
                        self._cancelled += 1
                    else:
                        batch.append(entry)
                if batch:
                    self._in_flight += 1
                    if (
                        not self._async
                        and type(rt) is _loops.AsyncioTasks
                        and not any(isinstance(entry[1], CudaFuture) for entry in batch)
                    ):
                        self._launch(batch)  # no task: answered by the completion thread's wake-up
                        continue
                    self._unstarted[id(batch)] = batch
                    rt.spawn(self._run, batch)
        finally:
            self._want = _IDLE

    def _launch(self, batch: list[_Entry]) -> None:
        """Launch a plain ``run_batch``'s batch from the former, on asyncio:
        the completion thread of its device waits for its GPU work (off the
        loop) and wakes the loop once, with :meth:`_landed`, which answers
        its requests. On the loop: the launch's queue put and a listener."""
        n = len(batch)
        flight = _Flight(batch, n, self._size_for(n))
        self._flights.add(flight)
        try:
            items, after = self._inputs(batch, flight.size)
            dev, fut = self._enqueue(items, after)
            flight.fut = fut
        except BaseException as exc:  # each request of the batch gets it
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: answered, then raised
                self._answer(flight, None, exc)
                raise
            self._fail(flight, exc)
            return
        wake = self._rt.loop.call_soon_threadsafe
        landed = self._landed

        def then() -> None:  # on the completion thread
            # Not contextlib.suppress: this runs once per batch.
            try:  # noqa: SIM105
                wake(landed, flight)
            except RuntimeError:  # the loop closed: nobody waits for the answers any more
                pass

        try:
            _completions.after_gpu(fut, dev, then)
        except Exception:  # noqa: BLE001 - no completion thread (none could start): the loop's waiter waits
            logger.debug("cudafut: no completion thread; the loop waits for the batch", exc_info=True)
            self._rt.spawn(self._land_later, flight)

    def _landed(self, flight: _Flight) -> None:
        """On the loop, once the completion thread saw the batch's GPU work
        end (or its launch fail): answer its requests."""
        if flight not in self._flights:  # answered already (the batcher closed with an exception)
            return
        fut = flight.fut
        assert fut is not None
        try:
            done, out = await_done(fut, InvalidStateError)
        except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
            self._fail(flight, exc)
            return
        except BaseException as exc:
            # run_batch raised a cancellation, KeyboardInterrupt or
            # SystemExit on its launcher thread: the batch's requests get it
            # (a cancellation as InvalidStateError, as the task path does);
            # an interrupt then goes on to the loop.
            error: BaseException = exc
            if _loops.is_cancellation(exc):
                error = InvalidStateError(f"run_batch raised {type(exc).__name__}")
            self._fail(flight, error)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        if not done:  # the completion thread could not wait: the loop's waiter does
            self._rt.spawn(self._land_later, flight)
            return
        self._split_and_answer(flight, out)

    async def _land_later(self, flight: _Flight) -> None:
        fut = flight.fut
        assert fut is not None
        try:
            out = await fut
        except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
            if flight in self._flights:
                self._fail(flight, exc)
            return
        except BaseException:
            # Cancelled (the batcher left with an exception: it answered the
            # batch), or KeyboardInterrupt/SystemExit: nobody may wait for ever.
            if flight in self._flights:
                self._answer(
                    flight, None, InvalidStateError("the Batcher closed while this item's batch ran")
                )
            raise
        if flight in self._flights:
            self._split_and_answer(flight, out)

    def _split_and_answer(self, flight: _Flight, out: Any) -> None:
        try:
            _refuse_awaitable(out)
            results = _split(out, flight.n, flight.size)
        except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
            self._fail(flight, exc)
            return
        self._answer(flight, results, None)

    def _fail(self, flight: _Flight, error: BaseException) -> None:
        """A failed batch: counted, and its requests answered with ``error``."""
        self._failed += 1
        self._answer(flight, None, error)

    def _answer(self, flight: _Flight, results: Sequence[Any] | None, error: BaseException | None) -> None:
        """Answer a flight's requests, with ``results`` or ``error``, and end it."""
        self._flights.discard(flight)
        try:
            if results is None:
                assert error is not None
                for entry in flight.batch:
                    _fail_slot(entry[1], error)
            else:
                for entry, result in zip(flight.batch, results):  # noqa: B905 - results may hold padding
                    slot = entry[1]
                    if not slot.done():
                        slot.set_result(result)
        finally:
            drained = self._drained
            if drained is not None and not self._flights and not drained.done():
                drained.set_result(None)
            self._batch_ended()

    def _fail_flights(self) -> None:
        """The batcher leaves with an exception: cancel the flights' launches
        (one not started never runs; one started has its result dropped) and
        fail their requests now; their completion threads' wake-ups find
        them answered."""
        for flight in list(self._flights):
            if flight.fut is not None:
                flight.fut.cancel()
            self._answer(flight, None, InvalidStateError("the Batcher closed while this item's batch ran"))

    def _batch_ended(self) -> None:
        self._in_flight -= 1
        want = self._want
        if want == _WANT_SLOT or (want == _WANT_FULL and self._in_flight < self.min_in_flight):
            self._rt.wake()

    def _enqueue(self, items: list[Any], after: tuple[EventRecord, ...]) -> tuple[int, CudaFuture[Any]]:
        """A plain ``run_batch``'s launch of ``items`` on a launcher thread of
        the batcher's device (the current one if none was given), after
        ``after``: the device and the launch's future."""
        _cuda.check_usable()
        dev = _backend.current.current_device() if self.device is None else _cuda.check_device(self.device)
        return dev, enqueue_as_caller(self.run_batch, (items,), {}, dev, after)

    def _inputs(self, batch: list[_Entry], size: int) -> tuple[list[Any], tuple[EventRecord, ...]]:
        """A batch's items, padded to ``size`` by repeating the last, and
        the newest record of each stream its requests were submitted after;
        counted in the statistics."""
        n = len(batch)
        items = [entry[0] for entry in batch]
        if size > n:
            items.extend([items[-1]] * (size - n))
        self._batches += 1
        self._items += n
        self._padded += size - n
        self._sizes[n] += 1
        return items, _newest_per_stream(entry[3] for entry in batch)

    def _size_for(self, n: int) -> int:
        buckets = self.buckets
        if buckets is None:
            return n
        for size in buckets:
            if size >= n:
                return size
        return n  # unreachable: max_batch <= the largest bucket

    async def _run(self, batch: list[tuple[Any, Any, float, tuple[EventRecord, ...]]]) -> None:
        del self._unstarted[id(batch)]
        n = len(batch)
        try:
            size = self._size_for(n)
            items, after = self._inputs(batch, size)
            try:
                handing = any(isinstance(entry[1], CudaFuture) for entry in batch)
                # The rows submit_future()'s futures got: the same the others get.
                handed: Sequence[Any] | None = None
                if self._async:
                    for rec in after:  # this task's stream waits for the submitters'
                        rec.wait_on(int(_backend.current.current_stream(rec.device).ptr), rec.device)
                    out = await self.run_batch(items)
                    if isinstance(out, CudaFuture):
                        if handing:
                            await until_set(out)
                            handed = _hand_over(batch, out, n, size)
                        out = await out
                    elif handing:
                        handed = _hand_over(batch, _recorded(out), n, size)
                else:
                    _dev, fut = self._enqueue(items, after)
                    try:
                        if handing:  # submit_future()'s futures: set once enqueued
                            await until_set(fut)
                            handed = _hand_over(batch, fut, n, size)
                        out = await fut
                    except BaseException:
                        fut.cancel()  # not started: never runs; started: its result is dropped
                        raise
                    _refuse_awaitable(out)
                results = _split(out, n, size) if handed is None else handed
            except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
                self._failed += 1
                for entry in batch:
                    _fail_slot(entry[1], exc)
                return
            for entry, result in zip(batch, results):  # noqa: B905 - results may hold padding
                slot = entry[1]
                if not isinstance(slot, CudaFuture) and not slot.done():
                    slot.set_result(result)
        except BaseException as exc:
            # Cancelled (the batcher left with an exception), or a
            # KeyboardInterrupt/SystemExit from run_batch: nobody may wait for ever.
            error: BaseException = exc
            if _loops.is_cancellation(exc):
                error = InvalidStateError("the Batcher closed while this item's batch ran")
            for entry in batch:
                _fail_slot(entry[1], error)
            raise
        finally:
            self._batch_ended()


def _refuse_awaitable(out: object) -> None:
    """Raise TypeError where a plain ``run_batch``'s outcome is an awaitable
    (closing a coroutine, so that it does not warn it was never awaited).
    The launcher thread refuses an awaitable ``run_batch`` returns itself
    (``_launch``); this sees the value of a :class:`CudaFuture` it returned."""
    if inspect.isawaitable(out):
        if inspect.iscoroutine(out):
            out.close()
        raise TypeError(
            "run_batch returned an awaitable from a launcher thread: declare it "
            "`async def` to run it on the loop"
        )


def _only_cancellations(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation, or a group (Python 3.11's, or the
    ``exceptiongroup`` backport's that trio uses on 3.10) of nothing else."""
    groups = tuple(
        group
        for group in (
            getattr(builtins, "BaseExceptionGroup", None),
            getattr(sys.modules.get("exceptiongroup"), "BaseExceptionGroup", None),
        )
        if group is not None
    )
    if groups and isinstance(exc, groups):
        return all(_only_cancellations(e) for e in exc.exceptions)
    return _loops.is_cancellation(exc)


def _fail_slot(slot: Any, exc: BaseException) -> None:
    """Fail a request still waiting (a submit_future() future already set
    keeps its value: its GPU work's own outcome decides)."""
    if isinstance(slot, CudaFuture):
        fail_future(slot, exc)
    elif not slot.done():
        slot.set_exception(exc)


def _hand_over(
    batch: list[tuple[Any, Any, float, tuple[EventRecord, ...]]], fut: CudaFuture[Any], n: int, size: int
) -> Sequence[Any] | None:
    """Set the batch's submit_future() futures from ``fut``, the batch's
    future, once it is set: each its row of the value, with the batch's
    events; return the rows (None: ``fut`` failed, which leaves the futures
    to the ``await`` that follows)."""
    state, value, _exc, records = share_state(fut)
    if state != "set":
        return None
    results = _split(value, n, size)
    for entry, result in zip(batch, results):  # noqa: B905 - results may hold padding
        if isinstance(entry[1], CudaFuture):
            complete_with(entry[1], result, records)
    return results


def _recorded(out: Any) -> CudaFuture[Any]:
    """An async ``run_batch``'s plain result as a set future: its GPU work
    recorded on the current streams (none for a host value)."""
    try:
        return record(out)
    except ValueError:  # on the host: nothing to wait for
        return set_future(out, ())


def _split(out: Any, n: int, size: int) -> Sequence[Any]:
    """The ``n`` requests' results in what ``run_batch`` returned for
    ``size`` items (padding included)."""
    if isinstance(out, Sequence) and not isinstance(out, (str, bytes)):
        if len(out) not in (size, n):
            raise ValueError(f"run_batch returned {len(out)} results for a batch of {size} items")
        return out
    shape = getattr(out, "shape", None)
    if isinstance(shape, tuple) and len(shape) >= 1:
        if shape[0] not in (size, n):
            raise ValueError(
                f"run_batch returned an array whose first axis has {shape[0]} rows for a batch of "
                f"{size} items"
            )
        head = out[:n] if shape[0] != n else out
        unbind = getattr(head, "unbind", None)
        if unbind is not None:  # torch: one call for all the views
            return unbind(0)  # type: ignore[no-any-return]
        return list(head)
    raise TypeError(
        "run_batch must return one result per item: a list or tuple, or an array whose first "
        f"axis is the batch, not {type(out).__name__}"
    )


#: Items that hold no GPU array: submit() skips looking into them (a
#: request's index or key, the commonest item, costs no search).
_HOST_SCALARS: Final = frozenset({int, float, str, bytes, bool, type(None)})


def _submitter_events(item: object) -> tuple[EventRecord, ...]:
    """Events after the calling task's work on the devices of ``item``'s
    GPU arrays; () for an item on the host (no CUDA touched)."""
    if type(item) in _HOST_SCALARS:
        return ()
    devices = find_devices(item)
    if not devices:
        return ()
    return tuple(rec for device in devices for rec in _torch.current_records(device))


def _newest_per_stream(groups: Iterable[tuple[EventRecord, ...]]) -> tuple[EventRecord, ...]:
    """One event per stream, the newest: events on a stream complete in order."""
    newest: dict[tuple[int, ...], EventRecord] = {}
    for group in groups:
        for rec in group:
            old = newest.get(rec.stream_key)
            if old is None or rec.seq > old.seq:
                newest[rec.stream_key] = rec
    return tuple(newest.values())
