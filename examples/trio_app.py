"""Dynamic batching under trio: N client tasks, one batcher, one cudafut.submit per batch.

The same service idea as examples/service/, in one trio program: ``--clients``
tasks each send ``--requests`` inputs through a memory channel to a batcher
task, which forms batches (up to ``--max-batch`` requests, or whatever has
arrived ``--max-delay-ms`` after the first), runs each with one
``cudafut.submit(model.forward, batch)`` copied back with ``cudafut.to_host``,
and ``await``\\ s it: ``await`` on a CudaFuture works in trio as in asyncio,
without blocking the run. Each client checks its answers against the model's
NumPy reference (examples/service/model.py).

For comparison it runs the same clients unbatched (each ``await``\\ s its own
``submit``), and a ticker that sleeps 1 ms at a time shows how late trio's
run gets under the load. From the repository root, on a machine with a GPU::

    python examples/trio_app.py            # 64 clients x 100 requests
    python examples/trio_app.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent / "service"))

from batcher import check_options
from model import DIM, Model, matches

import cudafut

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class _Request(Generic[In, Out]):
    value: In
    arrived: float
    done: trio.Event = field(default_factory=trio.Event)
    result: Out | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the client was cancelled: do not compute it


class TrioBatcher(Generic[In, Out]):
    """Collect concurrent ``submit(value)`` calls into batches for ``run_batch``.

    Start ``serve`` in a nursery (``await nursery.start(batcher.serve)``);
    ``await batcher.close()`` ends it once the running batches are done.
    The options are the asyncio ``Batcher``'s (service/batcher.py), checked
    the same way: ``TypeError`` or ``ValueError`` for a bad one.
    """

    def __init__(
        self,
        run_batch: Callable[[list[In]], Awaitable[Sequence[Out]]],
        *,
        max_batch: int = 64,
        max_delay_s: float = 0.002,
        max_in_flight: int = 2,
    ) -> None:
        check_options(run_batch, max_batch, max_delay_s, max_in_flight)
        self.run_batch = run_batch
        self.max_batch, self.max_delay_s = max_batch, max_delay_s
        self.batch_sizes: list[int] = []
        self._slots = trio.Semaphore(max_in_flight)
        self._send: trio.MemorySendChannel[_Request[In, Out]]
        self._recv: trio.MemoryReceiveChannel[_Request[In, Out]]
        self._send, self._recv = trio.open_memory_channel(math.inf)

    async def submit(self, value: In) -> Out:
        request: _Request[In, Out] = _Request(value, trio.current_time())
        try:
            self._send.send_nowait(request)
        except trio.ClosedResourceError:
            raise RuntimeError("the batcher is closed") from None
        try:
            await request.done.wait()
        finally:
            request.abandoned = not request.done.is_set()
        if request.error is not None:
            raise request.error
        return request.result  # type: ignore[return-value]

    async def close(self) -> None:
        await self._send.aclose()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as running:
            task_status.started()
            while True:
                await self._slots.acquire()  # at most max_in_flight batches at once
                try:
                    first = await self._recv.receive()
                except trio.EndOfChannel:
                    self._slots.release()
                    return  # closed; the nursery waits for the running batches
                batch = [first]
                deadline = first.arrived + self.max_delay_s
                while len(batch) < self.max_batch:
                    try:
                        batch.append(self._recv.receive_nowait())
                        continue
                    except trio.WouldBlock:
                        pass
                    except trio.EndOfChannel:
                        break
                    try:
                        with trio.move_on_at(deadline):  # a cancelled receive loses nothing
                            batch.append(await self._recv.receive())
                            continue
                    except trio.EndOfChannel:
                        pass
                    break
                running.start_soon(self._run, batch)

    async def _run(self, batch: list[_Request[In, Out]]) -> None:
        try:
            batch = [r for r in batch if not r.abandoned]
            if not batch:
                return
            self.batch_sizes.append(len(batch))
            try:
                results = await self.run_batch([r.value for r in batch])
                if len(results) != len(batch):
                    raise ValueError(f"run_batch returned {len(results)} results for {len(batch)} items")
            except Exception as exc:  # noqa: BLE001 (each caller gets it)
                for r in batch:
                    r.error = exc
                    r.done.set()
                return
            for r, result in zip(batch, results, strict=True):
                r.result = result
                r.done.set()
        finally:
            self._slots.release()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


async def run_clients(
    infer: Callable[[np.ndarray[Any, Any]], Awaitable[list[float]]],
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


async def main(args: argparse.Namespace) -> None:
    model = Model(args.fixed_us, args.per_item_us)
    model.warm_up(args.max_batch)
    await cudafut.to_host(cudafut.submit(model.forward, np.zeros((1, DIM), np.float32)))

    async def run_batch(xs: list[np.ndarray[Any, Any]]) -> list[list[float]]:
        out = await cudafut.to_host(cudafut.submit(model.forward, np.stack(xs)))  # one launch per batch
        rows: list[list[float]] = out.tolist()
        return rows

    async def unbatched(x: np.ndarray[Any, Any]) -> list[float]:
        out = await cudafut.to_host(cudafut.submit(model.forward, x[None]))  # one launch per request
        row: list[float] = out[0].tolist()
        return row

    rows = []
    batcher: TrioBatcher[np.ndarray[Any, Any], list[float]] = TrioBatcher(
        run_batch, max_batch=args.max_batch, max_delay_s=args.max_delay_ms / 1e3
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.serve)
        row = await run_clients(batcher.submit, args.clients, args.requests, args.duration)
        await batcher.close()
    sizes = batcher.batch_sizes
    rows.append({"mode": "batched", **row, "mean_batch": sum(sizes) / max(1, len(sizes))})
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
    if args.quick:
        args.clients, args.requests, args.duration = 32, 40, 5.0
    trio.run(main, args)
