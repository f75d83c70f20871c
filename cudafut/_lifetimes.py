"""Lifetimes: what cudafut keeps alive for the GPU, and what a fork resets.

Four things live here, below the waiter and the memory modules, so that
those need not import one another:

- **Keep-alives.** :func:`hold` keeps an object alive until some event
  records complete (or fail): a dropped future's value while other streams
  still read it, a pinned block while a copy still writes it, a CuPy block
  whose free waits for the streams that used it. The watcher thread
  (``_waiter.ThreadWaiter``) does the watching: it registers itself here as
  the *keeper* when ``_waiter`` is imported. :func:`keep_until` is the
  deferred free the finalizers share: query, and hold only what is pending.
- **Releases after the thread moves on.** :func:`retire` defers a release
  until the thread that asked for it has left what it was doing then (a
  weak-reference callback inside an object's deallocation, which goes on
  freeing after the callback returns): that thread runs it at its next
  :func:`release_retired` (``wait()``, ``record_stream()``, the watcher
  thread's loop), and any thread does once it is
  :data:`RETIRED_STALE_S` old. ``_torch`` keeps a tensor's streams so.
- **Leaks on purpose.** :func:`keep_forever`: memory whose guard could not
  be checked (CUDA failed at that moment) is never reused.
- **Fork handling.** One ``os.register_at_fork`` handler for the package:
  modules register a reset with :func:`at_fork_in_child`, and a forked child
  runs them in the order of registration (that is, of import: ``_cuda``'s
  first, so the child refuses CUDA before any other reset runs).

This module imports nothing of cudafut but the logger; records are anything
with ``query()`` (``_events.EventRecord``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from ._log import logger

__all__ = [
    "Keeper",
    "Record",
    "at_fork_in_child",
    "count_also",
    "hold",
    "holding",
    "keep_forever",
    "keep_until",
    "release_retired",
    "retire",
    "set_keeper",
]


class Record(Protocol):
    """What a keep-alive waits for: an event record (``_events.EventRecord``)."""

    def query(self) -> int | None:
        """The status (0 done, an error code), or None while pending."""
        ...

    def known(self) -> int | None:
        """The status if known without asking CUDA, else None."""
        ...


class Keeper(Protocol):
    """What watches the records of :func:`hold` (the watcher thread)."""

    def keep(self, records: Sequence[Record], obj: object) -> None:
        """Keep ``obj`` alive until ``records`` complete; callable from any
        thread and from finalizers, and cheap."""
        ...

    @property
    def holding(self) -> int:
        """Objects kept alive now (queued or watched)."""
        ...


_keeper: Keeper | None = None
# Holds asked for before a keeper registered (nothing imports a memory module
# without the waiter, but a hold must never be dropped): handed over then.
_early: list[tuple[Sequence[Record], object]] = []
_forever: Final[list[object]] = []


def set_keeper(keeper: Keeper) -> None:
    """Make ``keeper`` watch the holds (``_waiter`` calls it once, at import)."""
    global _keeper
    _keeper = keeper
    while _early:
        keeper.keep(*_early.pop(0))


def hold(records: Sequence[Record], obj: object) -> None:
    """Keep ``obj`` alive until ``records`` complete (or fail).

    Cheap and callable from any thread, a ``__del__`` included: an append to
    the watcher thread's queue, and a notify only when that thread is idle.
    """
    keeper = _keeper
    if keeper is None:
        _early.append((records, obj))
    else:
        keeper.keep(records, obj)


def keep_until(records: Sequence[Record], obj: object) -> bool:
    """Hold ``obj`` until those of ``records`` still pending complete; return
    whether any was (False: nothing to wait for, ``obj`` may go now).

    The deferred free of the finalizers: a query per record (under 2 µs
    each), then :func:`hold`. Raises what a query raises (``CudaError``, or
    ``CudaUnavailableError`` in a forked child): the caller decides.
    """
    pending = [r for r in records if r.known() is None and r.query() is None]
    if pending:
        hold(pending, obj)
        return True
    return False


#: Seconds after which any thread runs a release another thread retired
#: (:func:`retire`): that thread never called :func:`release_retired` since,
#: or ended. Far beyond the microseconds between a weak-reference callback
#: and the end of the deallocation that ran it, and beyond most waits for a
#: lock inside it (PyTorch's allocator frees behind its mutex).
RETIRED_STALE_S: Final = 10.0

#: Releases :func:`retire` deferred, by the thread that retired them:
#: ``{thread ident: deque of (time.monotonic() then, release, argument)}``,
#: oldest first. Only a thread appends to its own queue (an append is
#: atomic), and only it removes that queue from the map, once empty; any
#: thread pops the stale heads of the others'. Read through this module's
#: attribute (tests swap it).
retired: dict[int, deque[tuple[float, Callable[[Any], object], Any]]] = {}


def retire(release: Callable[[Any], object], arg: object) -> None:
    """Call ``release(arg)`` once the calling thread has moved on.

    For a weak-reference callback (or a finalizer) whose object's
    deallocation goes on after it returns: ``release`` must come after the
    rest of that deallocation, which may release the GIL (PyTorch frees a
    tensor's memory without it), so no other thread may run it meanwhile
    and no event of the GPU can say when it ended. The calling thread runs
    it at its next :func:`release_retired`, which it can only reach once
    that deallocation returned; any thread does after
    :data:`RETIRED_STALE_S`. Cheap (an append, a dictionary lookup) and
    callable from any thread, a finalizer included."""
    me = threading.get_ident()
    queue = retired.get(me)
    if queue is None:
        queue = retired.setdefault(me, deque())
    queue.append((time.monotonic(), release, arg))


def release_retired() -> None:
    """Run the releases this thread retired, and those any thread retired
    more than :data:`RETIRED_STALE_S` ago. Call it only where the thread is
    not inside a finalizer or a deallocation (a public call's entry, the
    watcher thread's loop): one retired there may not be done yet. Costs a
    test of an empty dictionary when no thread retired anything, else a
    look at the oldest entry of each thread's queue, plus the releases."""
    if not retired:
        return
    me = threading.get_ident()
    # Taken out first: what a finalizer run by a release retires goes to a
    # new queue, for this thread's next call.
    mine = retired.pop(me, None)
    if mine is not None:
        _drain(mine, float("inf"))
    stale = time.monotonic() - RETIRED_STALE_S
    for queue in list(retired.values()):
        _drain(queue, stale)


def _drain(queue: deque[tuple[float, Callable[[Any], object], Any]], before: float) -> None:
    """Run the releases at the head of ``queue`` retired before ``before``
    (another thread may be taking them too: each goes to one)."""
    while queue and queue[0][0] < before:
        try:
            item = queue.popleft()
        except IndexError:
            return
        _run_release(item)


def _run_release(item: tuple[float, Callable[[Any], object], Any]) -> None:
    try:
        item[1](item[2])
    except Exception:  # noqa: BLE001 - one failed release must not skip the others
        logger.exception("cudafut: a deferred release failed (%r)", item[1])


def _forget_retired() -> None:
    # A forked child: the parent's releases would call CUDA, which the
    # child has not; what they hold is kept (never destroyed here).
    for queue in retired.values():
        _forever.extend(queue)
    retired.clear()


def holding() -> int:
    """Objects kept alive now for pending GPU work (queued or watched by the
    watcher thread, including its done callbacks, and those counted by
    :func:`count_also`); no CUDA call."""
    keeper = _keeper
    held = len(_early) + (keeper.holding if keeper is not None else 0)
    for count in _counts:
        held += count()
    return max(held, 0)


_counts: Final[list[Callable[[], int]]] = []


def count_also(count: Callable[[], int]) -> None:
    """Count ``count()`` in :func:`holding`: objects kept alive for pending
    GPU work elsewhere than in the keeper (the native core keeps dropped
    futures per stream, and sweeps them through the keeper)."""
    _counts.append(count)


def keep_forever(obj: object) -> None:
    """Never free ``obj``: memory a copy may still write, whose guard could
    not be checked (CUDA failed at that moment)."""
    _forever.append(obj)


_fork_resets: Final[list[Callable[[], None]]] = []


def at_fork_in_child(reset: Callable[[], None]) -> None:
    """Run ``reset`` in a child forked from this process, after the resets
    registered before it (a module registers at import).

    A reset forgets what did not survive the fork (threads, CUDA state) and
    must not call CUDA."""
    _fork_resets.append(reset)


def _after_fork_in_child() -> None:
    for reset in _fork_resets:
        try:
            reset()
        except Exception:  # noqa: BLE001 - one failed reset must not skip the others
            logger.exception("cudafut: a reset after fork failed (%r)", reset)
    _forget_retired()  # this module's own, after the resets (the first refuses CUDA)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
