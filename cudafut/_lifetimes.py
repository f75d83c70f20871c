"""Lifetimes: what cudafut keeps alive for the GPU, and what a fork resets.

Three things live here, below the waiter and the memory modules, so that
those need not import one another:

- **Keep-alives.** :func:`hold` keeps an object alive until some event
  records complete (or fail): a dropped future's value while other streams
  still read it, a pinned block while a copy still writes it, a CuPy block
  whose free waits for the streams that used it. The watcher thread
  (``_waiter.ThreadWaiter``) does the watching: it registers itself here as
  the *keeper* when ``_waiter`` is imported. :func:`keep_until` is the
  deferred free the finalizers share: query, and hold only what is pending.
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
from collections.abc import Callable, Sequence
from typing import Final, Protocol

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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
