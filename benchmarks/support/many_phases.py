"""Where the CPU of 10,000 concurrent awaits goes: the ``many`` section's
scenario cut in two phases, under several wait policies.

On a machine with a GPU, from a source checkout::

    python -m benchmarks.support.many_phases
    CUDAFUT_PURE=1 python -m benchmarks.support.many_phases --profile

The scenario is the ``many`` section's (10,000 tasks in batches of 10, one
``record()`` each on one of 8 streams busy for 500 ms, awaited), beside the
same tasks awaiting plain asyncio futures set in bulk after 500 ms. Per
policy, one line: the host CPU per future and the wall time of the
*arrival* (from the first task made to the last) and of the *wait* (from
there to the last answer), and the event queries and waiter polls of each
phase. A ``*`` ends the lines whose arrival outlasted the GPU's work: their
arrival figures include completions. Two rounds, so that a policy's first run is not alone. A
diagnostic, not a benchmark section: ``python -m cudafut bench --only many``
is what is compared.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import sys
import time
from typing import Any

import cupy as cp

import cudafut
from cudafut import _compiled, _cuda, _waiter
from cudafut._policy import PRESETS

from .gpu import token, work

N, STREAMS, BATCH, BUSY_S = 10_000, 8, 10, 0.5

counts = {"query": 0, "poll": 0}


def _count_calls() -> None:
    """Count event queries and waiter polls (the seam's function and the
    driver's method, wrapped where every caller looks them up)."""
    query = _cuda.event_query
    poll = _waiter.Driver.poll

    def counted_query(handle: int) -> int:
        counts["query"] += 1
        return query(handle)

    def counted_poll(self: _waiter.Driver, timer_fired: bool) -> float | None:
        counts["poll"] += 1
        return poll(self, timer_fired)

    _cuda.event_query = counted_query  # type: ignore[assignment]
    _waiter.Driver.poll = counted_poll  # type: ignore[method-assign]


async def scenario(streams: list[Any], plain: bool = False) -> tuple[float, ...]:
    """(arrival CPU µs/future, arrival ms, wait CPU µs/future, wait ms,
    queries and polls in arrival, in wait)."""
    loop = asyncio.get_running_loop()
    left = N
    done = asyncio.Event()
    futs: list[asyncio.Future[None]] = []

    async def one(i: int) -> None:
        nonlocal left
        if plain:
            fut = loop.create_future()
            futs.append(fut)
            await fut
        else:
            await cudafut.record(token, stream=streams[i % STREAMS])
        left -= 1
        if not left:
            done.set()

    async def release() -> None:
        await asyncio.sleep(BUSY_S)
        while len(futs) < N:
            await asyncio.sleep(1e-3)
        for start in range(0, N, 256):
            for fut in futs[start : start + 256]:
                fut.set_result(None)
            await asyncio.sleep(0)

    tasks: set[asyncio.Task[None]] = set()
    releaser = None
    c0, w0 = time.process_time(), time.perf_counter()
    if plain:
        releaser = asyncio.create_task(release())
    else:
        for s in streams:
            work(int(BUSY_S * 1e9), on=s)
    for start in range(0, N, BATCH):
        for i in range(start, min(N, start + BATCH)):
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(0)
    c1, w1 = time.process_time(), time.perf_counter()
    q1, p1 = counts["query"], counts["poll"]
    await done.wait()
    c2, w2 = time.process_time(), time.perf_counter()
    if releaser is not None:
        await releaser
    return (
        (c1 - c0) / N * 1e6,
        (w1 - w0) * 1e3,
        (c2 - c1) / N * 1e6,
        (w2 - w1) * 1e3,
        q1,
        counts["query"] - q1,
        p1,
        counts["poll"] - p1,
    )


POLICIES: dict[str, cudafut.WaitPolicy] = {
    "balanced": cudafut.WaitPolicy(),
    "predict off": cudafut.WaitPolicy(predict=False),
    "spin 0, predict off": cudafut.WaitPolicy(spin_s=0, predict=False),
    "low_cpu": PRESETS["low_cpu"],
    "notify": cudafut.WaitPolicy(notify=True),
}


def main(argv: list[str]) -> None:
    print("core:", _compiled.core())
    _count_calls()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(STREAMS)]
    head = ("arrive cpu/f", "arrive ms", "wait cpu/f", "wait ms", "q arr", "q wait", "p arr", "p wait")
    print(f"{'policy':22s} " + " ".join(f"{h:>12s}" for h in head))
    previous = cudafut.get_wait_policy()
    try:
        for _ in range(2):
            for name, policy in [("plain", None), *POLICIES.items()]:
                if policy is not None:
                    cudafut.set_wait_policy(policy)
                counts["query"] = counts["poll"] = 0
                row = asyncio.run(scenario(streams, plain=policy is None))
                # An arrival longer than the GPU's work saw completions too.
                late = " *" if policy is not None and row[1] > BUSY_S * 1e3 else ""
                print(f"{name:22s} " + " ".join(f"{v:12.1f}" for v in row) + late, flush=True)
        if "--profile" in argv:
            cudafut.set_wait_policy(previous)
            asyncio.run(scenario(streams))
            profiler = cProfile.Profile()
            profiler.enable()
            row = asyncio.run(scenario(streams))
            profiler.disable()
            print("profiled:", row)
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
            print(out.getvalue())
    finally:
        cudafut.set_wait_policy(previous)


if __name__ == "__main__":
    main(sys.argv[1:])
