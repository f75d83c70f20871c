"""Section ``batcher``: the loop's CPU per request of :class:`cudafut.Batcher`,
with a ``run_batch`` that does no GPU work, beside the same hand-off written
by hand: requests in a deque, one task forming batches, a plain asyncio
future per request (the native core's target: at most 10 µs per
request). And, as the floor, each request awaiting a plain future that is
set at once.

Every scenario submits ``n`` requests from ``n`` concurrent tasks (made
with ``asyncio.gather``, as a server's request tasks are) and measures the
process CPU from the first submit to the last answer, divided by ``n``.
Interleaved rounds; the median is reported.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from pathlib import Path
from typing import Any

import cudafut

from .support.common import Progress

NAME = "batcher"

BATCHER = "cudafut Batcher (async run_batch, no GPU work)"
DEQUE = "peer: a deque and a batch-forming task, asyncio futures"
FLOOR = "floor: a task per request awaiting a future set at once"
RATIO = "ratio Batcher / deque hand-off"
OVER = "Batcher us per request over the deque hand-off"
ROUNDS = 5
MAX_BATCH = 64


def steps(quick: bool) -> int:
    return 3


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    return measure(progress, n=20_000 if quick else 100_000)


async def _echo(items: list[Any]) -> list[Any]:
    return items


async def _with_batcher(n: int) -> float:
    async with cudafut.Batcher(_echo, max_batch=MAX_BATCH, max_delay_s=0.0) as batcher:
        t = time.process_time()
        out = await asyncio.gather(*(batcher.submit(i) for i in range(n)))
        cpu = time.process_time() - t
    assert out == list(range(n))  # every answer checked
    return cpu


async def _with_deque(n: int) -> float:
    loop = asyncio.get_running_loop()
    queue: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()
    wake: list[asyncio.Future[None] | None] = [None]

    async def submit(x: int) -> int:
        fut: asyncio.Future[int] = loop.create_future()
        queue.append((x, fut))
        w = wake[0]
        if w is not None and not w.done():
            w.set_result(None)
        return await fut

    async def former() -> None:
        while True:
            while not queue:
                w = wake[0] = loop.create_future()
                await w
            batch = [queue.popleft() for _ in range(min(MAX_BATCH, len(queue)))]
            results = await _echo([x for x, _ in batch])
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    task = loop.create_task(former())
    t = time.process_time()
    out = await asyncio.gather(*(submit(i) for i in range(n)))
    cpu = time.process_time() - t
    task.cancel()
    assert out == list(range(n))
    return cpu


async def _floor(n: int) -> float:
    loop = asyncio.get_running_loop()

    async def request(x: int) -> int:
        fut: asyncio.Future[int] = loop.create_future()
        fut.set_result(x)
        return await fut

    t = time.process_time()
    out = await asyncio.gather(*(request(i) for i in range(n)))
    cpu = time.process_time() - t
    assert out == list(range(n))
    return cpu


def measure(progress: Progress, n: int = 100_000) -> dict[str, Any]:
    scenarios = {BATCHER: _with_batcher, DEQUE: _with_deque, FLOOR: _floor}
    samples: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(ROUNDS):
        for name, scenario in scenarios.items():
            samples[name].append(asyncio.run(scenario(n)) / n * 1e6)
    res: dict[str, Any] = {"n": n, "rounds": ROUNDS, "max_batch": MAX_BATCH}
    for name in scenarios:
        res[name] = {"loop_cpu_us_per_request": statistics.median(samples[name]), "samples_us": samples[name]}
        progress.step(f"batcher: {name}: {res[name]['loop_cpu_us_per_request']:.2f} us per request")
    mine = res[BATCHER]["loop_cpu_us_per_request"]
    peer = res[DEQUE]["loop_cpu_us_per_request"]
    res[RATIO] = mine / peer
    res[OVER] = mine - peer
    return res


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## Batcher: the loop's CPU per request ({result['n']:,} requests, batches of up to "
        f"{result['max_batch']}, median of {result['rounds']})",
        "",
        "| | loop CPU µs / request |",
        "|---|---|",
    ]
    for name in (BATCHER, DEQUE, FLOOR):
        lines.append(f"| {name} | {result[name]['loop_cpu_us_per_request']:.2f} |")
    mine = result[BATCHER]["loop_cpu_us_per_request"]
    verdict = "met" if mine <= 10 else "missed"
    lines += [
        "",
        f"Batcher / deque hand-off: {result[RATIO]:.2f}x. The Batcher's own target, at most 10 µs of loop "
        f"CPU per request: {verdict} ({mine:.2f} µs).",
        "",
    ]
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    return []
