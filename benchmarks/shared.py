"""Section ``shared``: what a future costs when it crosses processes.

A producer launches a kernel of exactly ``D`` (``%globaltimer``) on an idle
GPU, records its future, and either awaits it itself (``same process``) or
sends it through a ``multiprocessing`` pipe to this process, which awaits it
(``other process``). Each wake is measured against the end of the work,
``t_launch + D`` on the machine's monotonic clock (both processes read the
same one): the *extra* wake. The shared future's extra cost is the
difference of the two medians (the target: at most 50 µs at p50). Work of
0.2, 2 and 20 ms, interleaved rounds.

Also: the host cost of pickling (the producer) and unpickling (the
receiver, once its caches are warm) a future of one CuPy array, and what
crossing costs at a rate: ``burst`` futures of 0-work sent back to back,
received and awaited one by one, against awaiting them in one process.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

from .support.common import Progress, quantiles

NAME = "shared"
WORK_MS = (0.2, 2.0, 20.0)


def steps(quick: bool) -> int:
    return len(WORK_MS) + 2


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    return measure(progress, rounds=40 if quick else 200, burst=2_000 if quick else 10_000)


def _kernel() -> Any:
    from cudafut import _backend
    from cudafut._kernels import GSLEEP

    cp = _backend.current.cupy()
    return cp.RawModule(code=GSLEEP).get_function("gsleep")


def _producer(conn: Any, burst: int) -> None:
    """The other process: per request (D ms, or "burst"), launch and send."""
    import cupy as cp

    import cudafut

    gsleep = _kernel()
    stream = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(256, dtype=cp.float32)
    gsleep((1,), (1,), (cp.int64(0),), stream=stream)
    stream.synchronize()
    while True:
        ask = conn.recv()
        if ask is None:
            return
        if ask == "burst":
            t = time.perf_counter()
            for _ in range(burst):
                conn.send(cudafut.record(x, stream=stream))
            conn.send(time.perf_counter() - t)
            continue
        ms = float(ask)
        t = time.perf_counter()
        gsleep((1,), (1,), (cp.int64(int(ms * 1e6)),), stream=stream)
        fut = cudafut.record(x, stream=stream)
        t_pickle = time.perf_counter()
        data = pickle.dumps(fut)
        pickled = time.perf_counter() - t_pickle
        conn.send_bytes(data)
        conn.send((t, pickled))
        conn.recv()  # the receiver is done: the GPU is idle again


async def _await_local(ms: float, gsleep: Any, stream: Any, x: Any) -> float:
    import cupy as cp

    import cudafut

    t = time.perf_counter()
    gsleep((1,), (1,), (cp.int64(int(ms * 1e6)),), stream=stream)
    await cudafut.record(x, stream=stream)
    return time.perf_counter() - t - ms / 1e3


async def _await_shared(conn: Any, ms: float) -> tuple[float, float, float]:
    conn.send(ms)
    data = conn.recv_bytes()
    t_unpickle = time.perf_counter()
    fut = pickle.loads(data)
    unpickled = time.perf_counter() - t_unpickle
    t, pickled = conn.recv()
    await fut
    extra = time.perf_counter() - t - ms / 1e3
    del fut
    conn.send("done")
    return extra, pickled, unpickled


async def _burst_local(burst: int, stream: Any, x: Any) -> float:
    import cudafut

    t = time.perf_counter()
    futs = [cudafut.record(x, stream=stream) for _ in range(burst)]
    for fut in futs:
        await fut
    return time.perf_counter() - t


async def _burst_shared(conn: Any, burst: int) -> float:
    t = time.perf_counter()
    conn.send("burst")
    for _ in range(burst):
        fut = conn.recv()
        await fut
    conn.recv()  # the producer's own time
    return time.perf_counter() - t


def measure(progress: Progress, rounds: int = 200, burst: int = 10_000) -> dict[str, Any]:
    import cupy as cp

    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    child = ctx.Process(target=_producer, args=(theirs, burst), daemon=True)
    child.start()
    gsleep = _kernel()
    stream = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(256, dtype=cp.float32)
    res: dict[str, Any] = {"rounds": rounds, "burst": burst, "work_ms": {}}
    try:
        for ms in (0.0, *WORK_MS):  # 0: warms both sides' caches (not reported)
            local: list[float] = []
            shared: list[float] = []
            pickled: list[float] = []
            unpickled: list[float] = []
            for _ in range(rounds if ms else 20):
                local.append(asyncio.run(_await_local(ms, gsleep, stream, x)))
                extra, p, u = asyncio.run(_await_shared(conn, ms))
                shared.append(extra)
                pickled.append(p)
                unpickled.append(u)
            if not ms:
                continue
            row: dict[str, Any] = {
                "same process extra wake": quantiles(local),
                "other process extra wake": quantiles(shared),
                "pickle us": quantiles(pickled),
                "unpickle us": quantiles(unpickled),
            }
            row["shared extra p50 us"] = (
                row["other process extra wake"]["p50_us"] - row["same process extra wake"]["p50_us"]
            )
            res["work_ms"][str(ms)] = row
            one, across = row["same process extra wake"]["p50_us"], row["other process extra wake"]["p50_us"]
            progress.step(
                f"shared: {ms} ms work: extra wake p50 {one:.0f} us in one process, {across:.0f} us across "
                f"(+{row['shared extra p50 us']:.0f}); pickle {row['pickle us']['p50_us']:.1f} us, unpickle "
                f"{row['unpickle us']['p50_us']:.1f} us"
            )
        local_s = [asyncio.run(_burst_local(burst, stream, x)) for _ in range(3)]
        shared_s = [asyncio.run(_burst_shared(conn, burst)) for _ in range(3)]
        res["burst_cost"] = {
            "same process us per future": statistics.median(local_s) / burst * 1e6,
            "other process us per future": statistics.median(shared_s) / burst * 1e6,
        }
        cost = res["burst_cost"]
        progress.step(
            f"shared: a burst of {burst:,} futures: {cost['same process us per future']:.1f} us each in one "
            f"process, {cost['other process us per future']:.1f} us each across"
        )
    finally:
        conn.send(None)
        child.join(30)
    return res


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## Futures across processes (median of {result['rounds']} per row)",
        "",
        "| work | extra wake, one process p50 / p99 µs | across processes p50 / p99 µs | shared extra p50 µs "
        "| pickle µs | unpickle µs |",
        "|---|---|---|---|---|---|",
    ]
    for ms, row in result["work_ms"].items():
        a, b = row["same process extra wake"], row["other process extra wake"]
        lines.append(
            f"| {ms} ms | {a['p50_us']:.0f} / {a['p99_us']:.0f} | {b['p50_us']:.0f} / {b['p99_us']:.0f} "
            f"| {row['shared extra p50 us']:.0f} | {row['pickle us']['p50_us']:.1f} "
            f"| {row['unpickle us']['p50_us']:.1f} |"
        )
    b = result["burst_cost"]
    lines += [
        "",
        f"A burst of {result['burst']:,} futures of done work: "
        f"{b['same process us per future']:.1f} µs each awaited in one process, "
        f"{b['other process us per future']:.1f} µs each sent, received and awaited across.",
        "",
    ]
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    return []
