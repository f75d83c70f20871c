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

OUT = os.environ.get("OUT", "/tmp")
N, NSTREAMS, BUSY_MS = 10_000, 8, 500
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(NSTREAMS)]


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def scenario(prof: cProfile.Profile | None = None, plain: bool = False) -> dict[str, float]:
    left = N
    done = asyncio.Event()
    marks: dict[str, tuple[float, float]] = {}
    futs: list[asyncio.Future[None]] = []
    loop = asyncio.get_running_loop()

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
    return {
        "start_us": (c1 - c0) / N * 1e6,
        "wait_us": (cf - c1) / N * 1e6,
        "finish_us": (c2 - cf) / N * 1e6,
        "total_us": (c2 - c0) / N * 1e6,
        "wait_wall_ms": (tf - t1) * 1e3,
        "finish_wall_ms": (t2 - tf) * 1e3,
    }


def main() -> None:
    for plain in (True, False, True, False):
        r = asyncio.run(scenario(plain=plain))
        gc.collect()
        print("plain  " if plain else "cudafut", {k: round(v, 2) for k, v in r.items()})
    pr = cProfile.Profile()
    asyncio.run(scenario(pr))
    for order, name in (("tottime", "prof-many.txt"), ("cumulative", "prof-many-cum.txt")):
        b = io.StringIO()
        pstats.Stats(pr, stream=b).sort_stats(order).print_stats(40)
        with open(os.path.join(OUT, name), "w") as f:
            f.write(b.getvalue())


if __name__ == "__main__":
    main()
