"""The engine under the futures: running listeners, and marking consumers.

Two jobs of :mod:`cudafut._future` that need no future of their own, below it
(docs/design.md, "Layers"):

- running the listeners of a just-completed future (``then()`` callbacks,
  waiting tasks), and, in a loop, those of every future they complete: a
  chain of any length completes without recursion (:func:`run_listeners`);
- marking the GPU arrays of a value used by the streams that consume it, so
  that their memory outlives the work queued there (:func:`record_consumers`,
  :func:`record_current_consumers`), and finding the records an ``await``
  must still wait for (:func:`pending_records`).

The future's state machine, ``then()``'s link and the producers stay in
:mod:`cudafut._future`, which knows the class they make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from . import _backend, _memory, _torch
from ._events import EventRecord
from ._log import logger
from ._values import gpu_arrays

__all__ = [
    "INTERRUPTS",
    "Listener",
    "Pending",
    "call_listener",
    "pending_records",
    "record_consumers",
    "record_current_consumers",
    "run_listeners",
]

#: What runs once a future leaves the pending state. A listener that
#: completes another future returns that future's listeners instead of
#: running them (see ``run_listeners``): a chain of any length completes in
#: a loop, not by recursion.
Listener = Callable[[], "Pending | None"]
#: A future just completed, and its listeners still to run.
Pending = tuple[Any, "list[Listener]"]


#: What a callback may raise that must reach the user, not a log.
INTERRUPTS: Final = (KeyboardInterrupt, SystemExit)


def run_listeners(future: object, listeners: list[Listener]) -> None:
    """Run the listeners of a just-completed ``future``, and, in a loop, the
    listeners of every future they complete, depth first: the order the
    calls would nest in, without the recursion (a chain of any length).

    No listener's exception stops the others. ``KeyboardInterrupt`` and
    ``SystemExit`` (the first one) are raised again once all have run, in
    this thread; any other exception is logged (a then() ``fn``'s own
    exceptions never come here: its child stores them).
    """
    interrupt: BaseException | None = None
    for listener in listeners:
        try:
            more = listener()
        except BaseException as exc:  # noqa: BLE001 - no listener may strand the others
            interrupt = _listener_raised(future, exc, interrupt)
            continue
        if more is not None:
            interrupt = _run_pending(more, interrupt)
    if interrupt is not None:
        raise interrupt


def _run_pending(pending: Pending, interrupt: BaseException | None) -> BaseException | None:
    """The loop of :func:`run_listeners`, for what a listener handed back."""
    stack = [(pending[0], iter(pending[1]))]
    while stack:
        future, listeners = stack[-1]
        for listener in listeners:
            try:
                more = listener()
            except BaseException as exc:  # noqa: BLE001 - see run_listeners
                interrupt = _listener_raised(future, exc, interrupt)
                continue
            if more is not None:
                stack.append((more[0], iter(more[1])))
                break
        else:
            stack.pop()
    return interrupt


def _listener_raised(
    future: object, exc: BaseException, interrupt: BaseException | None
) -> BaseException | None:
    """The interrupt to raise once every listener ran: the first one."""
    if interrupt is None and isinstance(exc, INTERRUPTS):
        return exc
    logger.error("cudafut: exception while completing %r", future, exc_info=exc)
    return interrupt


def call_listener(listener: Listener, future: object) -> None:
    """Run one listener of a completed future now (and what it hands back)."""
    try:
        more = listener()
    except INTERRUPTS:
        raise  # in the thread of the call that added it: the user's
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        logger.error("cudafut: exception while completing %r", future, exc_info=exc)
        return
    if more is not None:
        run_listeners(*more)


def record_consumers(value: object, streams: Mapping[int, Any], *, untracked: bool) -> None:
    """Mark the GPU arrays of ``value`` used by ``streams`` (``{device:
    CuPy stream}``), so that their memory outlives the work queued there
    (:func:`cudafut.record_stream`)."""
    arrays = gpu_arrays(value)
    if arrays:
        triples = [(int(s.ptr), d, s) for d, s in streams.items()]
        _memory.record_streams_of(arrays, triples, untracked=untracked)


def record_current_consumers(value: object, records: tuple[EventRecord, ...], *, untracked: bool) -> None:
    """For ``wait()``, ``await`` and ``result()``: the caller's current
    streams of the future's devices consume the value (for ``await`` and
    ``result()``, most likely: ``untracked`` is off there)."""
    arrays = gpu_arrays(value)
    if arrays:
        if len(records) == 1:  # the common case, without the generic comprehensions
            device = records[0].device
            devices: Iterable[int] = (device,)
            stream = _backend.current.current_stream(device)
            consumers = [(int(stream.ptr), device, stream)]
        else:
            devices = dict.fromkeys(r.device for r in records)
            currents = [(d, _backend.current.current_stream(d)) for d in devices]
            consumers = [(int(s.ptr), d, s) for d, s in currents]
        _memory.record_streams_of(arrays, consumers, untracked=untracked)
        if not untracked:  # await, result(): wait() records torch's stream itself (_torch.wait_current)
            torch = _torch.loaded()
            if torch is not None:
                # A tensor made on another stream (a launcher's): torch's
                # allocator must not hand its memory out before what the
                # caller's torch stream enqueues on it has run.
                tensors = [a for a in arrays if isinstance(a, torch.Tensor)]
                if tensors:
                    _torch.record_tensors(tensors, {d: torch.cuda.current_stream(d) for d in devices})


def pending_records(records: tuple[EventRecord, ...]) -> Sequence[EventRecord]:
    """The records an await must still wait for: those not known complete,
    ``records`` itself when that is all of them (no list); none if one
    failed (its error is raised at once)."""
    pending: list[EventRecord] | None = None
    for i, rec in enumerate(records):
        status = rec.status
        if status:
            return ()
        if status is not None and pending is None:  # complete: the first one not waited for
            pending = list(records[:i])
        elif status is None and pending is not None:
            pending.append(rec)
    return records if pending is None else pending
