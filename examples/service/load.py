"""A load generator for the service: closed or open loop, with a /health probe and every answer checked.

- **closed loop** (``--clients N``): N clients, each sending its next
  request as soon as the last is answered: the most the server can do.
- **open loop** (``--rate R``): requests arrive at R per second, at Poisson
  times, whether or not earlier ones were answered: latency at a load the
  server can carry.

The clients run in ``--procs`` processes (one Python process cannot send
more than a few thousand requests a second); a separate process sends
``GET /health`` every ``--health-ms`` milliseconds, which shows how long the
server's event loop is blocked. Every answer is compared with the reference
logits (models.check). Prints one JSON line::

    python examples/service/load.py --port 8080 --reference ref.npy --clients 64 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import IMAGES, check, missing, tolerance

try:  # here, not only in the load processes: they would fail one by one, and slowly
    import aiohttp
except ImportError as exc:  # one line that says what to install, not a traceback
    sys.exit(missing(Path(sys.argv[0]).name or "load.py", "aiohttp", exc))  # compare.py imports this


def quantiles_ms(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    arr = np.asarray(samples) * 1e3
    return {
        "p50_ms": round(float(np.percentile(arr, 50)), 3),
        "p99_ms": round(float(np.percentile(arr, 99)), 3),
        "max_ms": round(float(arr.max()), 3),
    }


async def _clients(
    url: str,
    reference: str | None,
    clients: int,
    rate: float,
    start: float,
    warmup: float,
    seconds: float,
    seed: int,
) -> dict[str, Any]:
    """One process's share: ``clients`` closed-loop clients, or arrivals at
    ``rate`` per second (``clients == 0``), from ``start`` (``time.time()``)
    for ``warmup + seconds``; latencies of the requests sent and answered in
    the last ``seconds``."""
    ref = np.load(reference) if reference else None
    tol = tolerance(ref) if ref is not None else 0.0
    rng = random.Random(seed)
    latencies: list[float] = []
    wrong = errors = 0
    window = end = 0.0  # perf_counter times, set once the load starts
    # Closed loop: a connection per client. Open loop: at most 64 per
    # process (a pool, as a proxy in front of the server would hold);
    # unbounded, a burst opens new connections, which costs the server more
    # than the requests themselves.
    connector = aiohttp.TCPConnector(limit=clients or 64)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal wrong, errors
            i = rng.randrange(IMAGES)
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/predict", json={"i": i}) as resp:
                    body = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
                return
            t1 = time.perf_counter()
            if body is None:
                errors += 1
                return
            if t0 >= window and t1 <= end:
                latencies.append(t1 - t0)
            if ref is not None and not check(body["top"], ref[i], tol):
                wrong += 1

        await asyncio.sleep(max(0.0, start - time.time()))
        now = time.perf_counter()
        window, end = now + warmup, now + warmup + seconds
        if clients:

            async def client() -> None:
                while time.perf_counter() < end:
                    await one()

            await asyncio.gather(*(client() for _ in range(clients)))
        else:
            tasks: set[asyncio.Task[None]] = set()
            t = time.perf_counter()
            while t < end:
                t += rng.expovariate(rate)
                delay = t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=30)
    return {"latencies": latencies, "wrong": wrong, "errors": errors}


async def _health(url: str, period: float, start: float, seconds: float) -> list[float]:
    samples: list[float] = []
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(max(0.0, start - time.time()))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                async with session.get(url + "/health") as resp:
                    await resp.read()
                samples.append(time.perf_counter() - t0)
            except aiohttp.ClientError:
                samples.append(float("inf"))
            await asyncio.sleep(max(0.0, period - (time.perf_counter() - t0)))
    return samples


def _run_clients(args: tuple[Any, ...], out: Any) -> None:
    try:
        import uvloop

        out.put(uvloop.run(_clients(*args)))
    except ImportError:
        out.put(asyncio.run(_clients(*args)))


def _run_health(args: tuple[Any, ...], out: Any) -> None:
    out.put(asyncio.run(_health(*args)))


def _collect(out: Any, n: int, procs: list[Any], limit: float) -> list[Any]:
    """``n`` results from the queue ``out``; exits with a line as soon as one
    of ``procs`` has died (its traceback is above), not after ``limit`` s."""
    got: list[Any] = []
    deadline = time.monotonic() + limit
    while len(got) < n:
        try:
            got.append(out.get(timeout=0.2))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                sys.exit(f"load.py: {len(dead)} load process(es) failed (exit status {dead[0]})")
            if time.monotonic() > deadline:
                sys.exit(f"load.py: no result from the load processes in {limit:.0f} s")
    return got


def run_load(
    port: int,
    *,
    reference: str | None,
    clients: int = 64,
    rate: float = 0.0,
    seconds: float = 5.0,
    warmup: float = 1.0,
    procs: int = 4,
    health_ms: float = 10.0,
    seed: int = 0,
    start: float | None = None,
) -> dict[str, Any]:
    """Load the server on ``port`` (closed loop with ``clients``, or open
    loop at ``rate`` per second when ``rate`` > 0) from ``start`` (a
    ``time.time()``, default in 1.5 s: the processes start meanwhile); the
    figures of the ``seconds`` after ``warmup``."""
    url = f"http://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if start is None:
        start = time.time() + 1.5
    window_start = start + warmup
    jobs = []
    for p in range(procs):
        share = clients // procs + (1 if p < clients % procs else 0)
        if clients and not share:
            continue
        job_rate = rate / procs if not clients else 0.0
        job_args = (url, reference, share, job_rate, start, warmup, seconds, seed + p)
        jobs.append(ctx.Process(target=_run_clients, args=(job_args, out)))
    health_out = ctx.Queue()
    health = ctx.Process(target=_run_health, args=((url, health_ms / 1e3, window_start, seconds), health_out))
    everyone = [*jobs, health]
    for job in everyone:
        job.start()
    try:
        limit = max(0.0, start - time.time()) + warmup + seconds + 120
        results = _collect(out, len(jobs), everyone, limit)
        probes = _collect(health_out, 1, everyone, limit)[0]
    finally:
        for job in everyone:
            job.join(timeout=30)
            if job.is_alive():
                job.terminate()
    latencies = [lat for r in results for lat in r["latencies"]]
    return {
        "mode": "closed" if clients else "open",
        "clients": clients,
        "rate": rate,
        "seconds": seconds,
        "requests": len(latencies),
        "rps": round(len(latencies) / seconds, 1),
        **quantiles_ms(latencies),
        "wrong": sum(r["wrong"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "health": quantiles_ms([p for p in probes if p != float("inf")]),
        "health_failed": sum(1 for p in probes if p == float("inf")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--reference", help="reference logits (.npy) to check every answer against")
    parser.add_argument("--clients", type=int, default=64, help="closed loop: concurrent clients")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="open loop: requests per second (then no clients)"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--health-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    clients = 0 if args.rate > 0 else args.clients
    print(
        json.dumps(
            run_load(
                args.port,
                reference=args.reference,
                clients=clients,
                rate=args.rate,
                seconds=args.seconds,
                warmup=args.warmup,
                procs=args.procs,
                health_ms=args.health_ms,
            )
        )
    )


if __name__ == "__main__":
    main()
