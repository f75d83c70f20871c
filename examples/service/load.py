"""A load generator for server.py: N concurrent clients on loopback, every answer checked.

Each client sends its own random input, checks the answer against the
model's NumPy reference (model.py), and records the latency; a separate task
asks ``/health`` every ``--health-every-ms`` meanwhile, to see whether the
server's event loop stays free. It stops after ``--requests`` requests or
``--duration`` seconds, whichever comes first, and prints requests/s, the
p50/p99 latencies and the server's batching (``/stats``), as a table or, with
``--json``, as one JSON object. It exits with 1 if any answer was wrong.

    python examples/service/load.py --url http://127.0.0.1:8080 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import DIM, matches

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


async def run_load(
    url: str, *, clients: int, requests: int, duration: float, health_every_s: float
) -> dict[str, Any]:
    if urlsplit(url).hostname not in LOOPBACK:
        raise SystemExit(f"refusing to load {url}: this generator only talks to loopback")
    latencies: list[float] = []
    health: list[float] = []
    counts = {"sent": 0, "wrong": 0, "errors": 0}
    stop = asyncio.Event()
    deadline = time.perf_counter() + duration

    async def client(session: aiohttp.ClientSession, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set() and time.perf_counter() < deadline and counts["sent"] < requests:
            counts["sent"] += 1
            x = rng.standard_normal(DIM).astype(np.float32)
            t = time.perf_counter()
            try:
                async with session.post(f"{url}/infer", json={"x": x.tolist()}) as resp:
                    resp.raise_for_status()
                    body = await resp.json()
            except aiohttp.ClientError as exc:
                counts["errors"] += 1
                print(f"request failed: {exc!r}", file=sys.stderr)
                continue
            latencies.append(time.perf_counter() - t)
            if not matches(body["y"], x):
                counts["wrong"] += 1
        stop.set()

    async def pinger(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            async with session.get(f"{url}/health") as resp:
                resp.raise_for_status()
            health.append(time.perf_counter() - t)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), health_every_s)

    connector = aiohttp.TCPConnector(limit=clients + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        ping = asyncio.create_task(pinger(session))
        await asyncio.gather(*(client(session, seed) for seed in range(clients)))
        elapsed = time.perf_counter() - start
        stop.set()
        await ping
        async with session.get(f"{url}/stats") as resp:
            stats = await resp.json()

    ms = 1e3
    return {
        "mode": stats["mode"],
        "clients": clients,
        "requests": len(latencies),
        "wrong": counts["wrong"],
        "errors": counts["errors"],
        "seconds": round(elapsed, 3),
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 50) * ms, 3),
        "p99_ms": round(percentile(latencies, 99) * ms, 3),
        "health_p50_ms": round(percentile(health, 50) * ms, 3),
        "health_p99_ms": round(percentile(health, 99) * ms, 3),
        "health_max_ms": round(max(health, default=math.nan) * ms, 3),
        "batches": stats["batches"],
        "mean_batch": stats["mean_batch"],
    }


COLUMNS = [
    ("mode", "mode", "{}"),
    ("requests", "requests", "{}"),
    ("req/s", "rps", "{:.0f}"),
    ("p50 ms", "p50_ms", "{:.2f}"),
    ("p99 ms", "p99_ms", "{:.2f}"),
    ("/health p50 ms", "health_p50_ms", "{:.2f}"),
    ("/health p99 ms", "health_p99_ms", "{:.2f}"),
    ("mean batch", "mean_batch", "{:.1f}"),
    ("wrong", "wrong", "{}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=20_000, help="stop after this many requests")
    parser.add_argument("--duration", type=float, default=10.0, help="stop after this many seconds")
    parser.add_argument("--health-every-ms", type=float, default=20.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    result = asyncio.run(
        run_load(
            args.url.rstrip("/"),
            clients=args.clients,
            requests=args.requests,
            duration=args.duration,
            health_every_s=args.health_every_ms / 1e3,
        )
    )
    print(json.dumps(result) if args.json else table([result]))
    if result["wrong"] or result["errors"] or not result["requests"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
