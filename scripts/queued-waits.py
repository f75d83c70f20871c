"""Awaits queued behind pending work of their own stream: how late each
wakes, and the loop's CPU, on a GPU.

``python scripts/queued-waits.py [--rounds N]`` (from the repository root,
on a machine with a GPU) queues jobs of known duration (a ``%globaltimer``
spin kernel each) on one or more streams, records a future after each,
and awaits every future from its own task, all at once. For each job it
takes the wake-up's lateness: the host time the task resumed, less the
launch time plus the durations queued up to that job (the same estimate
for any code, so compare trees in one call, alternated). Prints one JSON
line per scenario: p50, p90 and max lateness in µs, and the process CPU
per job in µs.

The patterns: many short jobs on one stream; one long job with short ones
queued behind it; 8 streams with a queue each.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.getcwd())

import cupy as cp

import cudafut
from benchmarks.support.gpu import token, work

PATTERNS = {
    "64 x 50 us, 1 stream": (1, [50e-6] * 64),
    "5 ms then 32 x 100 us, 1 stream": (1, [5e-3] + [100e-6] * 32),
    "8 streams x 16 x 200 us": (8, [200e-6] * 16),
}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _q(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))]


async def one_round(streams: list[cp.cuda.Stream], durations: list[float]) -> tuple[list[float], float]:
    cp.cuda.Device().synchronize()
    lateness: list[float] = []
    c0 = cpu()
    t0 = time.perf_counter()
    futs = []
    for s in streams:
        end = 0.0
        for d in durations:
            work(int(d * 1e9), on=s)
            end += d
            futs.append((cudafut.record(token, stream=s), end))

    async def one(fut: cudafut.CudaFuture[object], end: float) -> None:
        await fut
        lateness.append((time.perf_counter() - t0 - end) * 1e6)

    await asyncio.gather(*(one(f, e) for f, e in futs))
    return lateness, (cpu() - c0) / len(futs) * 1e6


async def main(rounds: int) -> None:
    for name, (nstreams, durations) in PATTERNS.items():
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(nstreams)]
        await one_round(streams, durations)  # warm-up
        late: list[float] = []
        cpus: list[float] = []
        for _ in range(rounds):
            lat, c = await one_round(streams, durations)
            late += lat
            cpus.append(c)
        late.sort()
        cpus.sort()
        print(
            json.dumps(
                {
                    "pattern": name,
                    "late_p50_us": round(_q(late, 0.5), 1),
                    "late_p90_us": round(_q(late, 0.9), 1),
                    "late_max_us": round(late[-1], 1),
                    "cpu_us_per_job_median": round(cpus[len(cpus) // 2], 2),
                    "jobs": len(late),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
    print(f"# core: {cudafut._compiled.core()}", flush=True)
    asyncio.run(main(rounds))
