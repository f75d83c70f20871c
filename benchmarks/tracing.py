"""Section ``tracing``: what ``cudafut.trace()`` costs per future, off and on.

Tracing off must cost nothing measurable: every hook in the library is one
test of a module global (``if _trace.active is not None:``) on a path that
exists anyway. Code without the hooks cannot run in the same process, so
this measures what can be: the same host paths with no trace recording
(off) and inside ``async with cudafut.trace(...)`` (on), interleaved in
rounds, and the cost of one hook's test itself (``timeit``), which, times
the tests on a path, is all that "off" adds to it. Target: on - off at
most 5 µs per future.

The operations, each over ``N`` futures on one stream:

- create + set + await: ``CudaFuture(devices=0)``, ``set_result(token)``,
  then every future awaited (their events complete at once: this is host
  time, not waiting);
- ``then()`` per link: a chain of ``N`` links whose ``fn`` returns its value;
- ``record()`` + ``result()``.

Also, per future, what leaving the trace costs (waiting for the GPU, which
is done here, and building and writing the file, in a worker thread for
``async with``), and the file's size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import cudafut

from .support.common import Progress

NAME = "tracing"

N = 2000
ROUNDS = 5

CREATE_SET_AWAIT = "create + set + await"
THEN = "then() per link"
RECORD_RESULT = "record() + result()"
OPERATIONS = (CREATE_SET_AWAIT, THEN, RECORD_RESULT)
#: Tests of the hook flag on each path when tracing is off: a future whose
#: work is done by the time it is awaited (no poll); a result() that spins
#: once (one test to plan the spin, one when it sees the work done).
HOOK_TESTS = {CREATE_SET_AWAIT: 3, THEN: 4, RECORD_RESULT: 5}
HOOK_NS = "one hook test (off), ns"
EXIT_US = "trace exit per future us"
BYTES = "trace file bytes per future"


def steps(quick: bool) -> int:
    return (2 if quick else ROUNDS) * len(OPERATIONS) + 1


async def _create_set_await(n: int, token: Any) -> float:
    t = time.perf_counter()
    futs = []
    for _ in range(n):
        fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
        fut.set_result(token)
        futs.append(fut)
    for fut in futs:
        await fut
    return time.perf_counter() - t


async def _then_chain(n: int, token: Any) -> float:
    fut = cudafut.record(token)
    t = time.perf_counter()
    for _ in range(n):
        fut = fut.then(_same)
    elapsed = time.perf_counter() - t
    await fut
    return elapsed


def _same(value: Any) -> Any:
    return value


async def _record_result(n: int, token: Any) -> float:
    t = time.perf_counter()
    for _ in range(n):
        cudafut.record(token).result()
    return time.perf_counter() - t


MEASURE: dict[str, Callable[[int, Any], Coroutine[Any, Any, float]]] = {
    CREATE_SET_AWAIT: _create_set_await,
    THEN: _then_chain,
    RECORD_RESULT: _record_result,
}


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    from cudafut._trace import hooks as _trace

    from .support.gpu import stream, sync_all, token

    rounds = 2 if quick else ROUNDS
    off: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    on: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    exits: list[float] = []
    sizes: list[float] = []
    folder = Path(tempfile.mkdtemp(prefix="cudafut-trace-bench-"))

    async def once(op: str, traced: bool) -> float:
        measure = MEASURE[op]
        with stream:
            await measure(200, token)  # warm
            if not traced:
                return await measure(N, token) / N
            path = folder / "trace.json"
            async with cudafut.trace(path, nvtx=False):
                per = await measure(N, token) / N
                t = time.perf_counter()
            exits.append((time.perf_counter() - t) / N)
            sizes.append(os.path.getsize(path) / N)
            return per

    for r in range(rounds):
        for op in OPERATIONS:
            # Alternate which goes first, so that drift hits both alike.
            for traced in (r % 2 == 1, r % 2 == 0):
                (on if traced else off)[op].append(asyncio.run(once(op, traced)))
                sync_all()
            progress.step(
                f"tracing {op}: off {statistics.median(off[op]) * 1e6:.2f} us, "
                f"on {statistics.median(on[op]) * 1e6:.2f} us per future"
            )
    flag = timeit.timeit("if _trace.active is not None: pass", globals={"_trace": _trace}, number=1_000_000)
    empty = timeit.timeit("pass", number=1_000_000)
    progress.step(f"tracing: one hook test {max(0.0, flag - empty) * 1e3:.1f} ns")
    out: dict[str, Any] = {"n": N, "rounds": rounds}
    for op in OPERATIONS:
        off_us = statistics.median(off[op]) * 1e6
        on_us = statistics.median(on[op]) * 1e6
        out[op] = {
            "off_us": off_us,
            "on_us": on_us,
            "extra_us": on_us - off_us,
            "ratio": on_us / off_us,
            "off_all_us": [x * 1e6 for x in off[op]],
            "on_all_us": [x * 1e6 for x in on[op]],
            "hook_tests_off": HOOK_TESTS[op],
        }
    out[HOOK_NS] = max(0.0, flag - empty) * 1e3  # s per 1e6 tests -> ns per test
    out[EXIT_US] = statistics.median(exits) * 1e6
    out[BYTES] = statistics.median(sizes)
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        "## Tracing: `cudafut.trace()` per future, off and on",
        "",
        f"Host µs per future, median of {result['rounds']} interleaved rounds of {result['n']} futures; "
        "off: no trace recording; on: inside `async with cudafut.trace(...)` (NVTX off). "
        "Target: on - off at most 5 µs.",
        "",
        "| operation | off | on | on - off | on / off | hook tests when off |",
        "|---|---|---|---|---|---|",
    ]
    for op in OPERATIONS:
        row = result.get(op)
        if row is None:
            continue
        lines.append(
            f"| {op} | {row['off_us']:.2f} | {row['on_us']:.2f} | {row['extra_us']:+.2f} | "
            f"{row['ratio']:.2f}x | {row['hook_tests_off']} |"
        )
    lines += [
        "",
        f"One hook's test when off: {result[HOOK_NS]:.1f} ns (`timeit`, over `pass`), so "
        f"{HOOK_TESTS[CREATE_SET_AWAIT]} tests add about "
        f"{result[HOOK_NS] * HOOK_TESTS[CREATE_SET_AWAIT]:.0f} ns to a create + set + await. "
        f"Leaving the trace: {result[EXIT_US]:.2f} µs per future (waiting for the GPU, building and "
        f"writing the file in a worker thread); the file: {result[BYTES]:.0f} bytes per future.",
        "",
    ]
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    return []
