"""Where the host time of 10,000 concurrent awaits goes, on a GPU.

``python scripts/profile-many.py`` (from the repository root, on a machine
with a GPU) runs the ``many`` section's scenario (10,000 tasks awaiting
``cudafut.record()`` futures over 8 streams busy for 500 ms) next to plain
asyncio futures, twice each, and prints the host CPU per future in three
phases: starting the tasks, waiting for the GPU, finishing them. Then it
profiles one cudafut round with ``cProfile`` and writes the 40 costliest
functions, by own time and by cumulative time, to ``$OUT/prof-many.txt``
and ``$OUT/prof-many-cum.txt`` (``$OUT`` defaults to /tmp). The first
cudafut round includes the warm-up (event and stream pools growing).

``--policies`` instead runs two rounds of the scenario under several wait
policies (after plain asyncio futures each round), and prints per phase
the host CPU per future and the event queries and waiter polls made. A
``*`` ends the rows where starting the tasks outlasted the GPU's work: their
phases overlap. No profile is written then.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import io
import os
import pstats
import resource
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())

import cupy as cp

import cudafut
from benchmarks.support.gpu import token, work
from cudafut import _backend, _waiter
from cudafut._policy import PRESETS

OUT = os.environ.get("OUT", "/tmp")
N, NSTREAMS, BUSY_MS = 10_000, 8, 500
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(NSTREAMS)]


#: Event queries and waiter polls so far (counted with --policies only).
counts = {"query": 0, "poll": 0}
POLICIES = {
    "balanced": cudafut.WaitPolicy(),
    "predict off": cudafut.WaitPolicy(predict=False),
    "spin 0, predict off": cudafut.WaitPolicy(spin_s=0, predict=False),
    "low_cpu": PRESETS["low_cpu"],
    "timed polls only": cudafut.WaitPolicy(notify=False),
}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def count_calls() -> None:
    """Count event queries and waiter polls: CUDA's backend's call (which
    CUDA's records ask) and the driver's method, wrapped where every caller
    looks them up."""
    cuda = _backend.cuda()
    query = cuda.event_query
    poll = _waiter.Driver.poll

    def counted_query(handle: int) -> int:
        counts["query"] += 1
        return query(handle)

    def counted_poll(self: _waiter.Driver, timer_fired: bool) -> float | None:
        counts["poll"] += 1
        return poll(self, timer_fired)

    cuda.event_query = counted_query  # type: ignore[method-assign]
    _waiter.Driver.poll = counted_poll  # type: ignore[method-assign]


async def scenario(prof: cProfile.Profile | None = None, plain: bool = False) -> dict[str, float]:
    left = N
    done = asyncio.Event()
    marks: dict[str, tuple[float, float]] = {}
    futs: list[asyncio.Future[None]] = []
    loop = asyncio.get_running_loop()
    at = {"start": (counts["query"], counts["poll"])}

    async def one(i: int) -> None:
        nonlocal left
        if plain:
            f = loop.create_future()
            futs.append(f)
            await f
        else:
            await cudafut.record(token, stream=streams[i % NSTREAMS])
        left -= 1
        if left == N - 1:
            marks["first"] = (time.perf_counter(), cpu())
            at["first"] = (counts["query"], counts["poll"])
        if not left:
            done.set()

    for s in streams:
        work(int(BUSY_MS * 1e6), on=s)
    if prof:
        prof.enable()
    c0, t0 = cpu(), time.perf_counter()
    tasks: list[Any] = []
    for start in range(0, N, 10):  # clients arrive in small batches, as in the section
        tasks.extend(asyncio.ensure_future(one(i)) for i in range(start, start + 10))
        await asyncio.sleep(0)
    c1, t1 = cpu(), time.perf_counter()
    at["started"] = (counts["query"], counts["poll"])
    if plain:  # released in slices after the same busy time, as the section does
        await asyncio.sleep(BUSY_MS / 1e3 - (t1 - t0))
        marks["first"] = (time.perf_counter(), cpu())
        for k in range(0, N, 256):
            for f in futs[k : k + 256]:
                f.set_result(None)
            await asyncio.sleep(0)
    await done.wait()
    c2, t2 = cpu(), time.perf_counter()
    if prof:
        prof.disable()
    tf, cf = marks["first"]
    # The counts at each cut (plain futures mark no first completion here; they count nothing).
    (q0, p0), (q1, p1), (qf, pf) = at["start"], at["started"], at.get("first", at["started"])
    return {
        "start_us": (c1 - c0) / N * 1e6,
        "wait_us": (cf - c1) / N * 1e6,
        "finish_us": (c2 - cf) / N * 1e6,
        "total_us": (c2 - c0) / N * 1e6,
        "wait_wall_ms": (tf - t1) * 1e3,
        "finish_wall_ms": (t2 - tf) * 1e3,
        "start_wall_ms": (t1 - t0) * 1e3,
        "start_queries": q1 - q0,
        "wait_queries": qf - q1,
        "finish_queries": counts["query"] - qf,
        "start_polls": p1 - p0,
        "wait_polls": pf - p1,
        "finish_polls": counts["poll"] - pf,
    }


def policies() -> None:
    count_calls()
    previous = cudafut.get_wait_policy()
    keys = [f"{phase}_{what}" for what in ("us", "queries", "polls") for phase in ("start", "wait", "finish")]
    print(f"{'policy':20s} " + " ".join(f"{k:>14s}" for k in keys))
    try:
        for _ in range(2):
            for name, policy in [("plain", None), *POLICIES.items()]:
                if policy is not None:
                    cudafut.set_wait_policy(policy)
                r = asyncio.run(scenario(plain=policy is None))
                late = " *" if r["start_wall_ms"] > BUSY_MS else ""
                print(f"{name:20s} " + " ".join(f"{r[k]:14.1f}" for k in keys) + late, flush=True)
    finally:
        cudafut.set_wait_policy(previous)


def main() -> None:
    if "--policies" in sys.argv[1:]:
        policies()
        return
    for plain in (True, False, True, False):
        r = asyncio.run(scenario(plain=plain))
        gc.collect()
        shown = {k: round(v, 2) for k, v in r.items() if not k.endswith(("_queries", "_polls"))}
        print("plain  " if plain else "cudafut", shown)  # calls are counted with --policies only
    pr = cProfile.Profile()
    asyncio.run(scenario(pr))
    for order, name in (("tottime", "prof-many.txt"), ("cumulative", "prof-many-cum.txt")):
        b = io.StringIO()
        pstats.Stats(pr, stream=b).sort_stats(order).print_stats(40)
        with open(os.path.join(OUT, name), "w") as f:
            f.write(b.getvalue())


if __name__ == "__main__":
    main()
