"""What waiting for a GPU costs the host on this machine, whoever waits: no cudafut involved.

``python scripts/poll-floor.py`` (from the repository root, on a machine
with a GPU; garbage collection off) prints, twice:

- ``loop tick``: the event loop thread's CPU per 1 ms ``asyncio.sleep``
  (what any waiter that polls on the loop's timers pays per poll, at
  least), with 8 CuPy event queries per tick, and with those 8 plus 10,000
  other events pending on the same 8 busy streams (does a query cost more
  when many events are pending?); and one query's own time;
- ``thread tick``: a thread's CPU per 1 ms ``time.sleep``, without and with
  the 8 queries (what a waker thread polling on its own would pay);
- ``thread blocked``: a thread's CPU, in all, while it waits in
  ``synchronize()`` on a blocking-sync event through 500 ms of GPU work;
- ``loop woken``: the loop thread's CPU per wake-up when another thread
  writes a pipe every millisecond (what waking the loop once per batch of
  completions costs it), beside the loop's own 1 ms tick of that round.

docs/performance.md ("10,000 concurrent awaits") says where cudafut's own
waiting costs come from; ``scripts/profile-many.py --policies`` splits them
by phase.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())

import cupy as cp

from benchmarks.support.gpu import work

streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
others = [cp.cuda.Event(disable_timing=True) for _ in range(10_000)]


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new thread; its result, or its exception raised here."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return out[0]


def check_pending(events: list[Any], what: str) -> None:
    """The queries timed must be of pending events (a completed one answers
    faster): say so if the work ended before the ticks did."""
    if any(e.done for e in events):
        print(f"warning: {what}: the work ended before the ticks did; its query figures are low")


def busy_events(ns: int) -> list[Any]:
    """An event recorded behind ``ns`` of work on each stream: pending."""
    events = []
    for s in streams:
        work(ns, on=s)
        e = cp.cuda.Event(disable_timing=True)
        e.record(s)
        events.append(e)
    return events


async def loop_tick(queries: bool, pending: int) -> tuple[float, float]:
    """The loop thread's CPU per 1 ms tick (µs), and one query's time (µs)."""
    events = busy_events(int(1.5e9)) if queries else []
    for i in range(pending):
        others[i].record(streams[i % 8])
    one = 0.0
    if events:
        t = time.perf_counter()
        for _ in range(125):
            for e in events:
                e.done  # noqa: B018 - the query is the point
        one = (time.perf_counter() - t) / 1000 * 1e6
    c0 = time.thread_time()
    for _ in range(1000):
        await asyncio.sleep(0.001)
        for e in events:
            e.done  # noqa: B018
    cpu = (time.thread_time() - c0) / 1000 * 1e6
    check_pending(events, "loop tick")
    for s in streams:
        s.synchronize()
    return cpu, one


def thread_tick(queries: bool) -> float:
    events = busy_events(int(1.3e9)) if queries else []

    def run() -> float:
        c0 = time.thread_time()
        for _ in range(1000):
            time.sleep(0.001)
            for e in events:
                e.done  # noqa: B018
        return (time.thread_time() - c0) / 1000 * 1e6

    cpu: float = in_thread(run)
    check_pending(events, "thread tick")
    for s in streams:
        s.synchronize()
    return cpu


def thread_blocked() -> float:
    e = cp.cuda.Event(block=True, disable_timing=True)
    work(int(5e8), on=streams[0])
    e.record(streams[0])

    def run() -> float:
        c0 = time.thread_time()
        e.synchronize()
        return (time.thread_time() - c0) * 1e6

    cpu: float = in_thread(run)
    return cpu


async def loop_woken() -> float:
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.set_blocking(r, False)
    n = 0
    done = asyncio.Event()

    def on_read() -> None:
        nonlocal n
        os.read(r, 64)
        n += 1
        if n == 1000:
            done.set()

    loop.add_reader(r, on_read)
    stop = False

    def writer() -> None:
        while not stop:
            time.sleep(0.001)
            os.write(w, b"x")

    t = threading.Thread(target=writer)
    t.start()
    c0 = time.thread_time()
    await done.wait()
    cpu = (time.thread_time() - c0) / 1000 * 1e6
    stop = True
    t.join()
    loop.remove_reader(r)
    os.close(r)
    os.close(w)
    return cpu


def main() -> None:
    gc.disable()
    for _ in range(2):
        bare, _ = asyncio.run(loop_tick(False, 0))
        queried, one = asyncio.run(loop_tick(True, 0))
        crowded, one_crowded = asyncio.run(loop_tick(True, len(others)))
        print(
            f"loop tick: {bare:6.1f} µs CPU; with 8 queries {queried:6.1f} (one {one:.2f} µs); "
            f"with 10,000 other events pending {crowded:6.1f} (one {one_crowded:.2f} µs)"
        )
        print(f"thread tick: {thread_tick(False):6.1f} µs CPU; with 8 queries {thread_tick(True):6.1f}")
        blocked = thread_blocked()
        print(f"thread blocked on a blocking-sync event through 500 ms: {blocked:8.1f} µs CPU in all")
        woken = asyncio.run(loop_woken())
        print(f"loop woken by a pipe each 1 ms: {woken:6.1f} µs CPU per wake; its own 1 ms tick: {bare:6.1f}")


if __name__ == "__main__":
    main()
