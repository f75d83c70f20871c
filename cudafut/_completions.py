"""Completion threads: a future's GPU work waited for off the event loop.

An event loop that awaits a launched future learns of its GPU work's end
by its waiter: polls, a notice pipe, timers, spins predicted around the end
(``_waiter``, ``_loops``). For a :class:`cudafut.Batcher`, whose batches
end one after another at the GPU's pace, that costs the loop more CPU per
batch than a hand-written batcher's worker thread, which blocks until the
GPU is done and then wakes the loop once. :func:`after_gpu` does what that
worker does, for any thread's caller: once a future is set (by a launcher
thread, most often), a completion thread of the device blocks until its
events are no longer pending (``cudaEventSynchronize``, the GIL released)
and then calls a function, which wakes the loop once
(``call_soon_threadsafe``).

- One completion thread per device, a daemon started on the device's first
  use and kept for the life of the process (a forked child starts afresh);
  it never launches anything, so a launcher thread is never held up by a
  batch's GPU work.
- It takes the futures in the order they were set (a ``SimpleQueue``) and
  waits for one at a time: a future whose work ends before an older one's
  is answered after it. On one stream work ends in order anyway; across
  the device's launcher streams, or several ``Batcher``s on one device, a
  batch done early waits for the older ones (one thread per stream would
  spin a core per stream).
- ``cudaEventSynchronize`` returns once the event's work ends, or fails: no
  thread waits longer than the GPU work it waits for. On CUDA it spins or
  yields a CPU core meanwhile, as the device's scheduling flags say (the
  default spins while the process has fewer CUDA contexts than cores),
  without the GIL; under :mod:`cudafut.testing`'s fake it sleeps until the
  fake settles the event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from . import _lifetimes
from ._events import EventRecord
from ._future import CudaFuture
from ._interface import set_value, when_set
from ._log import logger

__all__ = ["after_gpu"]

#: One wait: the future, and what to call once its work is no longer pending.
_Job = tuple[CudaFuture[Any], Callable[[], None]]

_lock = threading.Lock()
# Per device, the queue its completion thread takes jobs from (None: no thread yet).
_queues: dict[int, queue.SimpleQueue[_Job]] = {}


def after_gpu(fut: CudaFuture[Any], device: int, then: Callable[[], None]) -> None:
    """Call ``then()`` on ``device``'s completion thread once ``fut`` is
    set and its events are complete or failed, or once it failed or was
    cancelled.

    ``then`` runs on the completion thread and must be quick (it delays the
    next future's wake-up); what it raises is logged. It is called even
    where the wait itself failed (a CUDA error other than the event's, a
    backend without ``event_synchronize``): the future's records may then
    still read pending, and the caller must look (``_interface.await_done``).

    Cost on the calling thread: a listener added to ``fut``; the thread that
    sets ``fut`` then puts one queue entry (well under a µs, never blocks).
    The device's first call starts its completion thread (tens of µs).
    Blocks neither the calling thread nor the GPU.
    """
    jobs = _queues.get(device)
    if jobs is None:
        jobs = _start(device)
    job = (fut, then)
    when_set(fut, lambda: jobs.put(job))


def _start(device: int) -> queue.SimpleQueue[_Job]:
    with _lock:
        jobs = _queues.get(device)
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(
                target=_serve, args=(jobs,), name=f"cudafut-completion-{device}", daemon=True
            ).start()
            _queues[device] = jobs
        return jobs


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    """A completion thread: wait for each future's GPU work in turn, then
    call its function. Never ends (a daemon); nothing a job does kills it."""
    while True:
        fut, then = jobs.get()
        _wait(fut)
        try:
            then()
        except BaseException:  # noqa: BLE001 - the thread serves every later job too
            logger.exception("cudafut: a completion thread's callback failed")
        del fut, then  # not kept alive while waiting for the next job


def _wait(fut: CudaFuture[Any]) -> None:
    """Block until the events of ``fut`` (set) are no longer pending, the
    first failed one ending the wait; nothing to wait for if it failed or
    was cancelled. A pending record that the host may fail while its event
    stays pending (a collective's, whose ``confirm`` is set; another
    process's work, imported) is not waited for: the caller finds it
    pending and waits on its loop, where such a failure is seen."""
    found = set_value(fut)
    if found is None:
        return
    for rec in found[1]:
        try:
            if rec.query() is None:
                if type(rec) is not EventRecord or rec.confirm is not None:
                    return
                rec.calls.event_synchronize(rec.handle)
                rec.query()  # its status, read by the caller without a CUDA call
        except Exception:  # noqa: BLE001 - the caller finds the record pending and waits itself
            logger.debug("cudafut: a completion thread could not wait for %r", rec, exc_info=True)
            return
        if rec.status:  # failed: the future's outcome is known
            return


def _after_fork_in_child() -> None:
    # The completion threads did not survive the fork: the child starts new
    # ones on first use.
    global _lock
    _lock = threading.Lock()
    _queues.clear()


_lifetimes.at_fork_in_child(_after_fork_in_child)
