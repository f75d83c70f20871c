"""Reliability runs that take minutes: leaks over 1,000,000 futures, a
loopback server under 64 clients, Ctrl-C latency, mass cancellation, and a
soak of 64 tasks awaiting work that changes duration (steps and random:
the waiter's spins and timed polls in turn, under the default policy).

    python -m benchmarks.reliability [--futures 1000000] [--seconds 60]
        [--soak-seconds 60] [--only cancel|ctrl_c|leak|load|soak ...] [--out DIR]

Prints a summary and writes ``reliability-<gpu>.json``. docs/reliability.md
explains the results committed in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import cupy as cp

import cudafut
from cudafut import _loops, _pools, _waiter

from .support.common import quantiles
from .support.interrupt import ctrl_c_during_result


def work(ns: int, on: Any = None) -> None:
    """``support.gpu.work``, imported at the first use: compiling its kernel
    needs a GPU, and ``--help`` does not."""
    from .support.gpu import work as gpu_work

    gpu_work(ns, on)


def resources() -> dict[str, float]:
    """What a leak would grow: events, streams, threads, fds, memory."""
    free, total = cp.cuda.runtime.memGetInfo()
    pool = cp.get_default_memory_pool()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    pools = _pools.pool_statistics()
    events_free = sum(pools.events_free.values())
    return {
        "events_created": _pools.events.created,
        "events_free_in_pool": events_free,
        "events_live": _pools.events.created - events_free,
        "pool_streams": sum(pools.streams.values()),
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "device_used_mb": (total - free) / 2**20,
        "cupy_pool_used_mb": pool.used_bytes() / 2**20,
        "watcher_holding": _waiter.thread_waiter().holding,
    }


def _run_sampled(
    main: Callable[[], Coroutine[Any, Any, None]], samples: list[dict[str, float]]
) -> dict[str, Any]:
    """``asyncio.run(main())`` between two samples of the resources (each
    after a full collection): its seconds, and the resources at the start,
    at the end and at their peak (over ``samples``, which ``main`` fills,
    too)."""
    gc.collect()
    start = resources()
    t = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t
    gc.collect()
    time.sleep(0.1)
    end = resources()
    peak = {k: max(s[k] for s in [start, *samples, end]) for k in start}
    return {"seconds": wall, "start": start, "peak": peak, "end": end}


def leak_run(n_futures: int, workers: int = 8) -> dict[str, Any]:
    """``n_futures`` futures: record() then then(), awaited, by ``workers``
    concurrent tasks on their own streams; resources sampled along the way."""
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(workers)]
    per_worker = n_futures // (2 * workers)
    samples: list[dict[str, float]] = []

    async def worker(k: int) -> None:
        s = streams[k]
        with s:
            x = cp.arange(1024, dtype=cp.float32)
        for i in range(per_worker):
            with s:
                fut = cudafut.record(x * 0 + i)
            child = fut.then(lambda v: v + 1)
            y = await child
            if i % 5000 == 0:
                assert float(y[3].get()) == i + 1
                if k == 0:
                    samples.append(resources())

    async def main() -> None:
        await asyncio.gather(*(worker(k) for k in range(workers)))

    run = _run_sampled(main, samples)
    wall = run["seconds"]
    return {
        "futures": per_worker * workers * 2,
        "us_per_future": wall / (per_worker * workers * 2) * 1e6,
        **run,
        "samples": len(samples),
    }


LOG_50_US, LOG_20_MS = math.log(0.05), math.log(20.0)  # in ms


def soak_run(seconds: float, tasks: int = 64) -> dict[str, Any]:
    """``tasks`` tasks on their own streams for ``seconds``, each launching
    work and awaiting it: half in steps (blocks of 2 ms jobs, then of 20 ms),
    half of random duration (log-uniform, 50 µs to 20 ms), so that the
    waiter spins around what it learnt and polls in turn (the default
    policy: no CUDA notices; tests/test_gpu_notices.py checks that theirs
    leave no pipe). Every answer is checked; resources are sampled every
    5 s: a leak of threads, descriptors, events or memory grows them."""
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(tasks)]
    samples: list[dict[str, float]] = []
    counts = {"awaits": 0, "wrong": 0}
    deadline = 0.0

    async def task(k: int) -> None:
        rnd = random.Random(k)
        s = streams[k]
        with s:
            x = cp.zeros(16, dtype=cp.float32)
        i = 0
        while time.perf_counter() < deadline:
            random_work = k % 2
            ms = math.exp(rnd.uniform(LOG_50_US, LOG_20_MS)) if random_work else (2.0, 20.0)[(i // 8) % 2]
            work(int(ms * 1e6), on=s)
            with s:
                fut = cudafut.record(x + i)
            y = await fut
            if i % 16 == 0 and float(y[0].get()) != i:
                counts["wrong"] += 1
            counts["awaits"] += 1
            i += 1

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(5.0)
            samples.append(resources())

    async def main() -> None:
        nonlocal deadline
        deadline = time.perf_counter() + seconds
        await asyncio.gather(sampler(), *(task(k) for k in range(tasks)))

    run = _run_sampled(main, samples)
    return {
        "tasks": tasks,
        **counts,
        **run,
        "samples": samples,
    }


CLIENT = """
import asyncio, json, sys, time
port, seconds, clients = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
lat, errors = [], []
async def client(k):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        n = k * 1_000_000 + i
        t = time.perf_counter()
        w.write(f"{n}\\n".encode()); await w.drain()
        line = await r.readline()
        lat.append(time.perf_counter() - t)
        if float(line) != 2.0 * (n % 1000) + 1:
            errors.append((n, line.decode().strip()))
        i += 1
    w.close()
async def main():
    await asyncio.gather(*(client(k) for k in range(clients)))
asyncio.run(main())
print(json.dumps({"latencies": lat, "errors": errors[:20], "n_errors": len(errors)}))
"""


def load_run(seconds: float, clients: int = 64) -> dict[str, Any]:
    """An asyncio TCP server on loopback; each request is one submit() and
    one await; ``clients`` clients in another process, for ``seconds``."""
    s0 = cp.cuda.Stream(non_blocking=True)
    with s0:
        base = cp.arange(4096, dtype=cp.float32) * 0
    s0.synchronize()
    samples: list[dict[str, float]] = []
    server_errors: list[str] = []

    def compute(n: int) -> Any:
        work(50_000, on=cp.cuda.get_current_stream())  # 50 µs of GPU work
        return base + (2.0 * (n % 1000) + 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                y = await cudafut.submit(compute, int(line))
                writer.write(f"{float(y[7].get())}\n".encode())
                await writer.drain()
        except Exception as exc:  # noqa: BLE001 - counted and reported
            server_errors.append(repr(exc))
        finally:
            writer.close()

    async def sampler() -> None:
        while True:
            await asyncio.sleep(5)
            samples.append(resources())

    async def main() -> dict[str, Any]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        start = resources()
        task = asyncio.create_task(sampler())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(CLIENT),
            str(port),
            str(seconds),
            str(clients),
            stdout=subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        task.cancel()
        server.close()
        await server.wait_closed()
        gc.collect()
        end = resources()
        res = json.loads(out)
        lat = res.pop("latencies")
        return {
            "clients": clients,
            "seconds": seconds,
            "requests": len(lat),
            "requests_per_s": len(lat) / seconds,
            "latency": quantiles(lat),
            "client_errors": res["n_errors"],
            "client_error_examples": res["errors"],
            "server_errors": server_errors[:20],
            "n_server_errors": len(server_errors),
            "start": start,
            "end": end,
            "peak": {k: max(s[k] for s in [start, *samples, end]) for k in start},
        }

    return asyncio.run(main())


def ctrl_c_runs(trials: int = 5) -> dict[str, Any]:
    latencies = [ctrl_c_during_result()[0] for _ in range(trials)]
    return {"trials": trials, "latency_ms": [x * 1e3 for x in latencies], "max_ms": max(latencies) * 1e3}


def cancel_run(n: int = 10_000) -> dict[str, Any]:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    for s in streams:
        work(2_000_000_000 // 8, on=s)  # 250 ms
    futs = [cudafut.record(cp.zeros(1), stream=s) for s in streams]

    async def main() -> dict[str, Any]:
        tasks = [asyncio.create_task(_await(futs[i % 8])) for i in range(n)]
        await asyncio.sleep(0.05)
        t = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cancel_s = time.perf_counter() - t
        driver = _loops.current_driver()
        t = time.perf_counter()
        await asyncio.sleep(0)
        responsive_s = time.perf_counter() - t
        pending = driver.watchlist.pending if driver else -1
        values = [await f for f in futs]
        return {
            "tasks": n,
            "cancel_all_ms": cancel_s * 1e3,
            "next_loop_step_ms": responsive_s * 1e3,
            "pending_after": pending,
            "futures_still_complete": len(values) == len(futs),
        }

    return asyncio.run(main())


RUNS = ("cancel", "ctrl_c", "leak", "load", "soak")


async def _await(fut: cudafut.CudaFuture[Any]) -> Any:
    return await fut


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__)
    parser.add_argument("--futures", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--soak-seconds", type=float, default=60)
    parser.add_argument("--only", action="append", choices=RUNS, help="run only these (repeatable)")
    parser.add_argument("--name", help="results file stem (default: reliability-<gpu>)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    # Without a usable GPU: python -m cudafut's message and status 1.
    from cudafut._cli.selfcheck import require_gpu

    require_gpu()
    from .support.gpu import environment

    only = set(args.only or RUNS)
    env = environment()
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    producer = " ".join(["python -m benchmarks.reliability", *(argv if argv is not None else sys.argv[1:])])
    res: dict[str, Any] = {
        "meta": {**env, "cudafut": cudafut.__version__, "date": date, "producer": producer}
    }
    if "cancel" in only:
        print("cancellations ...", file=sys.stderr, flush=True)
        res["cancel"] = cancel_run()
        print(json.dumps(res["cancel"]), file=sys.stderr, flush=True)
    if "ctrl_c" in only:
        print("ctrl-c ...", file=sys.stderr, flush=True)
        res["ctrl_c"] = ctrl_c_runs()
        print(json.dumps(res["ctrl_c"]), file=sys.stderr, flush=True)
    if "leak" in only:
        print(f"leak run, {args.futures} futures ...", file=sys.stderr, flush=True)
        res["leak"] = leak_run(args.futures)
        keys = ("futures", "seconds", "start", "end")
        print(json.dumps({k: res["leak"][k] for k in keys}), file=sys.stderr)
    if "load" in only:
        print(f"load run, 64 clients, {args.seconds} s ...", file=sys.stderr, flush=True)
        res["load"] = load_run(args.seconds)
        summary = {k: v for k, v in res["load"].items() if k not in ("start", "end", "peak")}
        print(json.dumps(summary), file=sys.stderr)
    if "soak" in only:
        print(f"soak, 64 tasks, {args.soak_seconds} s ...", file=sys.stderr, flush=True)
        res["soak"] = soak_run(args.soak_seconds)
        keys = ("awaits", "wrong", "start", "end")
        print(json.dumps({k: res["soak"][k] for k in keys}), file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"reliability-{env['gpu'].lower().replace('nvidia ', '').split()[0]}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
