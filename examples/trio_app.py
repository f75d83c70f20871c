"""Dynamic batching under trio: N client tasks, one cudafut.Batcher, one launch per batch.

The same service idea as examples/service/, in one trio program without
HTTP: ``--clients`` tasks each ``await batcher.submit(x)`` for ``--requests``
inputs; :class:`cudafut.Batcher` gathers the requests that arrive together
into batches (up to ``--max-batch`` requests, or whatever has arrived
``--max-delay-ms`` after the first) and runs each as one
``cudafut.launch(model.forward, batch)`` copied back with one
``cudafut.to_host``. The Batcher runs on trio as on asyncio, and ``await``
on a CudaFuture does not block trio's run. Each client checks its answers
against the toy model's NumPy reference (examples/toy_model.py).

For comparison it runs the same clients unbatched (each ``await``\\ s its own
``launch``), and a ticker that sleeps 1 ms at a time shows how late trio's
run gets under the load. From the repository root, on a machine with a GPU::

    python examples/trio_app.py            # 64 clients x 100 requests
    python examples/trio_app.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy_model import DIM, Model, matches

import cudafut
from cudafut._cli.selfcheck import require_gpu


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


async def run_clients(
    infer: Callable[[np.ndarray[Any, Any]], Awaitable[Any]],
    clients: int,
    requests: int,
    duration: float,
) -> dict[str, Any]:
    """``clients`` tasks, each sending up to ``requests`` inputs (for at most
    ``duration`` s) through ``infer`` and checking the answers; with a ticker."""
    latencies: list[float] = []
    lateness: list[float] = []
    wrong = 0
    deadline = time.perf_counter() + duration

    async def client(seed: int) -> None:
        nonlocal wrong
        rng = np.random.default_rng(seed)
        for _ in range(requests):
            if time.perf_counter() > deadline:
                return
            x = rng.standard_normal(DIM).astype(np.float32)
            t = time.perf_counter()
            y = await infer(x)
            latencies.append(time.perf_counter() - t)
            if not matches(y, x):
                wrong += 1

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await trio.sleep(0.001)
            lateness.append(time.perf_counter() - t - 0.001)

    start = time.perf_counter()
    async with trio.open_nursery() as outer:
        outer.start_soon(ticker)
        async with trio.open_nursery() as nursery:
            for seed in range(clients):
                nursery.start_soon(client, seed)
        outer.cancel_scope.cancel()
    elapsed = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "wrong": wrong,
        "rps": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "late_p99_ms": percentile(lateness, 99) * 1e3,
    }


def forward_batch(model: Model, xs: list[np.ndarray[Any, Any]]) -> Any:
    """One launch for the whole batch: the stacking and the enqueue run on
    a launcher thread of cudafut.launch, not on trio's thread."""
    return model.forward(np.stack(xs))


async def main(args: argparse.Namespace) -> None:
    model = Model(args.fixed_us, args.per_item_us)
    model.warm_up(args.max_batch)  # compiles the kernels (once per process)
    # Each launcher thread creates its own cuBLAS handle on its first call: do
    # that now, on every launcher thread, not during the first timed batches.
    await cudafut.warm_launchers(model.warm_up, args.max_batch)
    await cudafut.to_host(cudafut.launch(model.forward, np.zeros((1, DIM), np.float32)))

    async def run_batch(xs: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
        # One copy back per batch; the Batcher hands each client its row.
        out: np.ndarray[Any, Any] = await cudafut.to_host(cudafut.launch(forward_batch, model, xs))
        return out

    async def unbatched(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out = await cudafut.to_host(cudafut.launch(model.forward, x[None]))  # one launch per request
        row: np.ndarray[Any, Any] = out[0]
        return row

    rows = []
    async with cudafut.Batcher(
        run_batch, max_batch=args.max_batch, max_delay_s=args.max_delay_ms / 1e3
    ) as batcher:
        row = await run_clients(batcher.submit, args.clients, args.requests, args.duration)
    rows.append({"mode": "batched", **row, "mean_batch": batcher.statistics().mean_batch})
    row = await run_clients(unbatched, args.clients, args.requests, args.duration)
    rows.append({"mode": "unbatched", **row, "mean_batch": 1.0})

    print(f"{args.clients} trio client tasks, up to {args.requests} requests each:")
    print("| mode | requests | req/s | p50 ms | p99 ms | mean batch | 1 ms sleep late p99 ms | wrong |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['requests']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['mean_batch']:.1f} | {r['late_p99_ms']:.2f} | {r['wrong']} |"
        )
    total = sum(r["requests"] for r in rows)
    if any(r["wrong"] for r in rows) or not all(r["requests"] for r in rows):
        print("FAILED: wrong answers, or no answers", file=sys.stderr)
        sys.exit(1)
    print(f"results checked: all {total} answers matched the model's NumPy reference")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=100, help="per client")
    parser.add_argument("--duration", type=float, default=20.0, help="at most this many seconds per mode")
    parser.add_argument("--fixed-us", type=float, default=2000.0, help="GPU time of a launch, µs")
    parser.add_argument("--per-item-us", type=float, default=10.0, help="GPU time per request, µs")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="32 clients x 40 requests")
    args = parser.parse_args()
    require_gpu()  # without one: what `python -m cudafut` says, and status 1
    if args.quick:
        args.clients, args.requests, args.duration = 32, 40, 5.0
    trio.run(main, args)
