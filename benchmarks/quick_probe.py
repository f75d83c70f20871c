"""A quick probe of the core's host costs, next to the stream.synchronize() floor.

Not the benchmark suite (that comes with the performance issue): one run, p50s
and per-future averages, to see where the core stands. Run from the repository
root on a GPU machine:

    PYTHONPATH=. python3 benchmarks/quick_probe.py

It prints a table and writes quick.json to $OUT (or the current folder).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

import cupy as cp

import cudafut
from tests.kernels import spin_fill

NOOP = cp.RawKernel(r"""extern "C" __global__ void noop() {}""", "noop")
stream = cp.cuda.Stream(non_blocking=True)
x = cp.zeros(4)


def launch() -> None:
    with stream:
        NOOP((1,), (1,), ())


def p50_us(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e6


def round_trip(fn: Callable[[], object], n: int = 3000) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return p50_us(samples)


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def create_and_set() -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    with stream:
        fut.set_result(x)


def then_chain(links: int = 1000) -> float:
    fut = cudafut.record(x, stream=stream)
    t = time.perf_counter()
    for _ in range(links):
        fut = fut.then(lambda v: v)
    per_link = (time.perf_counter() - t) / links * 1e6
    fut.result()
    return per_link


async def await_round_trip(n: int = 3000) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        launch()
        await cudafut.record(x, stream=stream)
        samples.append(time.perf_counter() - t)
    return p50_us(samples)


async def many_awaits(n: int = 10_000) -> tuple[float, float, float]:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    stall = 0.0

    async def heartbeat() -> None:
        nonlocal stall
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now

    async def one(fut: cudafut.CudaFuture[Any]) -> None:
        await fut

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    c0, t0 = time.process_time(), time.perf_counter()
    futs = []
    for i in range(n):  # enqueued in one loop step: counts in the stall
        with streams[i % 8]:
            NOOP((1,), (1,), ())
            futs.append(cudafut.record(x))
    await asyncio.gather(*(one(f) for f in futs))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    beat.cancel()
    return wall / n * 1e6, cpu / n * 1e6, stall * 1e3


async def cpu_while_awaiting(ms: float, repeats: int = 5) -> float:
    y = cp.zeros(1, dtype=cp.float32)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        with stream:
            spin_fill(y, 1, ms)
        await cudafut.record(y, stream=stream)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def main() -> None:
    launch()
    stream.synchronize()
    res: dict[str, float] = {}
    res["launch+stream.synchronize p50 us (floor)"] = round_trip(lambda: (launch(), stream.synchronize()))
    res["launch+record+result p50 us"] = round_trip(
        lambda: (launch(), cudafut.record(x, stream=stream).result())
    )
    res["create+set us"] = per_call_us(create_and_set, 20_000)
    res["record us"] = per_call_us(lambda: cudafut.record(x, stream=stream), 20_000)
    stream.synchronize()
    res["then per link us (1000 links, trivial fn)"] = then_chain()
    res["launch+await p50 us (asyncio)"] = asyncio.run(await_round_trip())
    wall, cpu, stall = asyncio.run(many_awaits())
    res["10k awaits: wall us/future"] = wall
    res["10k awaits: cpu us/future"] = cpu
    res["10k awaits: max loop stall ms"] = stall
    res["cpu/wall awaiting 20 ms"] = asyncio.run(cpu_while_awaiting(20))
    for key, value in res.items():
        print(f"{key:45s} {value:9.2f}")
    with open(os.path.join(os.environ.get("OUT", "."), "quick.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
