"""A CPU model of examples/service/server.py's ``batch_graph`` handler: where a
request's time and the loop's CPU go, on a machine without a GPU.

``python scripts/model-serve.py`` (from the repository root) runs, in one
process on uvloop, the handler path of ``--mode batch_graph``: each request
spins ``--http-in-us`` of CPU on the loop (aiohttp parsing it), awaits
``batcher.submit(i)``, takes its row with ``.tolist()`` and spins
``--http-out-us`` (aiohttp answering). The Batcher is cudafut's, with a
plain ``run_batch`` that runs through ``launch()`` on a launcher thread as in
the server, over the fake GPU of :mod:`cudafut.testing`: ``run_batch``
sleeps ``--launch-us`` (the replay's host work, the GIL released), and its
batch's event completes when a "GPU" that runs one batch at a time would
finish it: ``--gpu-base-us + --gpu-per-item-us * bucket`` after it started
(the defaults fit ResNet-50 fp16 graphs on an H200: 4.4 ms for 64, 3.0 ms
for 32). The waiter polls those events on the loop as it polls CUDA's.

Load: ``--clients N`` closed-loop clients (each sends its next request
``--client-ms`` after its answer: the client's and the kernel's share of a
round trip, rounded up to the loop's millisecond timers), or ``--rate R``
Poisson arrivals a second. ``--floor`` swaps the Batcher for a hand-written
batcher (a deque, one forming task, one worker thread per batch that
"replays" and wakes the loop with ``call_soon_threadsafe``) with the same
dispatch rule; ``--profile`` prints the loop's top functions (cProfile)
per request. Prints one line per run: req/s, latency p50/p99, mean batch,
the "GPU"'s busy share, the loop thread's CPU share and its CPU per request.

What it models: cudafut's Python and C on the loop and launcher threads,
the batch-forming policy, the GPU's serialisation of batches. What it
leaves out: aiohttp's real cost and its variance (replaced by fixed spins
calibrated on the committed no-GPU row: 1 / 13,161 req/s = 76 µs), the
kernel's sockets, PyTorch's GIL holding on the launcher thread. Use it to
compare policies and trees on one machine, not for a GPU's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import cProfile
import heapq
import io
import os
import pstats
import random
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())

import cudafut
from cudafut.testing import fake_cuda


class FakeGpu:
    """Completes each batch's event when a one-batch-at-a-time GPU would."""

    def __init__(self, fake: Any, base_s: float, per_item_s: float) -> None:
        self.backend = fake._backend
        self.base_s, self.per_item_s = base_s, per_item_s
        self.free_at = 0.0
        self.busy_s = 0.0
        self.local = threading.local()
        self.heap: list[tuple[float, int, Any]] = []
        self.cond = threading.Condition()
        self.count = 0
        self.stopped = False
        record = self.backend.event_record

        def event_record(event: int, stream: int, device: int) -> None:
            record(event, stream, device)
            end = getattr(self.local, "end", None)
            if end is not None:  # the launch's event, after run_batch returned
                self.local.end = None
                ev = self.backend._recorded[event]
                with self.cond:
                    self.count += 1
                    heapq.heappush(self.heap, (end, self.count, ev))
                    self.cond.notify()

        self.backend.event_record = event_record
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def run(self, size: int) -> None:
        """On the launcher thread: this batch of ``size`` runs after the
        ones before it."""
        now = time.perf_counter()
        start = max(now, self.free_at)
        took = self.base_s + self.per_item_s * size
        self.free_at = start + took
        self.busy_s += took
        self.local.end = self.free_at

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.heap and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                end, _, ev = self.heap[0]
                delay = end - time.perf_counter()
                if delay > 0:
                    self.cond.wait(delay)
                    continue
                heapq.heappop(self.heap)
            self.backend.complete([ev])

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class FloorBatcher:
    """The same batching written by hand: no cudafut on the loop."""

    def __init__(self, run_batch: Any, max_batch: int, max_delay_s: float, buckets: tuple[int, ...]) -> None:
        self.run_batch, self.max_batch, self.max_delay_s, self.buckets = (
            run_batch,
            max_batch,
            max_delay_s,
            buckets,
        )
        self.queue: collections.deque[tuple[int, asyncio.Future[Any], float]] = collections.deque()
        self.in_flight = 0
        self.min_in_flight, self.max_in_flight = 2, 4
        self.wake: asyncio.Future[None] | None = None
        self.batches = self.items = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(4)

    async def submit(self, item: int) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self.queue
        queue.append((item, fut, loop.time()))
        if (
            (len(queue) == 1 or len(queue) >= self.max_batch)
            and self.wake is not None
            and not self.wake.done()
        ):
            self.wake.set_result(None)
        return await fut

    async def form(self, gpu: FakeGpu) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue or self.in_flight >= self.max_in_flight:
                self.wake = loop.create_future()
                await self.wake
            deadline = self.queue[0][2] + self.max_delay_s
            while (
                len(self.queue) < self.max_batch
                and self.in_flight >= self.min_in_flight
                and loop.time() < deadline
            ):
                self.wake = loop.create_future()
                handle = loop.call_at(deadline, lambda w=self.wake: w.done() or w.set_result(True))
                timed_out = await self.wake
                handle.cancel()
                if timed_out:
                    break
            batch = [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]
            self.in_flight += 1
            self.batches += 1
            self.items += len(batch)
            self.pool.submit(self._work, loop, batch, gpu)

    def _work(self, loop: asyncio.AbstractEventLoop, batch: list[Any], gpu: FakeGpu) -> None:
        n = len(batch)
        size = next(b for b in self.buckets if b >= n)
        out = self.run_batch([e[0] for e in batch] + [batch[-1][0]] * (size - n))
        gpu.local.end = None
        time.sleep(max(0.0, gpu.free_at - time.perf_counter()))
        loop.call_soon_threadsafe(self._done, batch, out)

    def _done(self, batch: list[Any], out: Any) -> None:
        self.in_flight -= 1
        for (_, fut, _), row in zip(batch, out, strict=False):
            if not fut.done():
                fut.set_result(row)
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


async def serve(args: argparse.Namespace, gpu: FakeGpu) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    buckets = (1, 2, 4, 8, 16, 32, 64)

    def run_batch(items: list[int]) -> np.ndarray[Any, Any]:
        time.sleep(args.launch_us * 1e-6)
        gpu.run(len(items))
        return np.tile(np.asarray(items, dtype=np.float32)[:, None], (1, 10))

    lat: list[float] = []
    window = [0.0, 0.0]
    http_in, http_out = args.http_in_us * 1e-6, args.http_out_us * 1e-6

    async def handle(i: int) -> None:
        t0 = time.perf_counter()
        spin(http_in)
        row = (await batcher.submit(i)).tolist()
        assert row[0] == i
        spin(http_out)
        t1 = time.perf_counter()
        if window[0] <= t0 and t1 <= window[1]:
            lat.append(t1 - t0)

    kw: dict[str, Any] = {"max_delay_s": args.max_delay_ms / 1e3, "buckets": buckets}
    if args.max_in_flight:
        kw["max_in_flight"] = args.max_in_flight
    if args.min_in_flight is not None:
        kw["min_in_flight"] = args.min_in_flight
    former = None
    if args.floor:
        batcher: Any = FloorBatcher(run_batch, 64, args.max_delay_ms / 1e3, buckets)
        batcher.min_in_flight = 2 if args.min_in_flight is None else args.min_in_flight
        batcher.max_in_flight = args.max_in_flight or 4
        former = asyncio.ensure_future(batcher.form(gpu))
        ctx: Any = None
    else:
        batcher = cudafut.Batcher(run_batch, **kw)
        ctx = batcher
        await batcher.start()
    await cudafut.launch(run_batch, [0])  # launcher threads started
    start = time.perf_counter()
    window[:] = [start + args.warmup, start + args.warmup + args.seconds]
    rng = random.Random(1)
    stop = window[1]
    stats0: Any = None
    cpu0 = gpu0 = 0.0

    async def mark() -> None:
        nonlocal stats0, cpu0, gpu0
        await asyncio.sleep(args.warmup)
        stats0 = _stats(batcher)
        cpu0, gpu0 = time.thread_time(), gpu.busy_s

    marker = asyncio.ensure_future(mark())
    prof = cProfile.Profile() if args.profile else None
    if args.clients:

        async def client(k: int) -> None:
            r = random.Random(k)
            while time.perf_counter() < stop:
                await handle(r.randrange(256))
                if args.client_ms:
                    await asyncio.sleep(args.client_ms / 1e3)

        if prof:
            prof.enable()
        await asyncio.gather(*(client(k) for k in range(args.clients)))
    else:
        tasks = set()
        t = time.perf_counter()
        if prof:
            prof.enable()
        while t < stop:
            t += rng.expovariate(args.rate)
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(handle(rng.randrange(256)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
    if prof:
        prof.disable()
    await marker
    end = time.perf_counter()
    cpu1, gpu1 = time.thread_time(), gpu.busy_s
    stats1 = _stats(batcher)
    span = end - window[0]
    if ctx is not None:
        await batcher.aclose()
    if former is not None:
        former.cancel()
    arr = np.asarray(lat) * 1e3
    n = len(lat)
    out = {
        "rps": n / args.seconds,
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_batch": (stats1[1] - stats0[1]) / max(1, stats1[0] - stats0[0]),
        "gpu_busy": (gpu1 - gpu0) / span,
        "loop_cpu": (cpu1 - cpu0) / span,
        "loop_us_per_request": (cpu1 - cpu0) / max(1, stats1[1] - stats0[1]) * 1e6,
    }
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
        out["requests_profiled"] = stats1[1]
    del loop
    return out


def _stats(batcher: Any) -> tuple[int, int]:
    if isinstance(batcher, FloorBatcher):
        return batcher.batches, batcher.items
    s = batcher.statistics()
    return s.batches, s.items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--http-in-us", type=float, default=40.0)
    parser.add_argument("--http-out-us", type=float, default=36.0)
    parser.add_argument("--client-ms", type=float, default=1.0)
    parser.add_argument("--launch-us", type=float, default=300.0)
    parser.add_argument("--gpu-base-us", type=float, default=600.0)
    parser.add_argument("--gpu-per-item-us", type=float, default=59.0)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--max-in-flight", type=int, default=0)
    parser.add_argument("--min-in-flight", type=int)
    parser.add_argument("--spin-us", type=float, help="the wait policy's spin_s (default: the policy's)")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    if not args.clients and not args.rate:
        parser.error("--clients N or --rate R")
    if args.spin_us is not None:
        cudafut.set_wait_policy(cudafut.WaitPolicy(spin_s=args.spin_us * 1e-6))
    with fake_cuda(hint_after_s=None) as fake:
        gpu = FakeGpu(fake, args.gpu_base_us * 1e-6, args.gpu_per_item_us * 1e-6)
        try:
            if args.loop == "uvloop":
                import uvloop

                out = uvloop.run(serve(args, gpu))
            else:
                out = asyncio.run(serve(args, gpu))
        finally:
            gpu.stop()
    profile = out.pop("profile", None)
    load = f"{args.clients} clients" if args.clients else f"{args.rate:g}/s"
    print(
        f"{'floor' if args.floor else 'Batcher'} {load}: {out['rps']:,.0f} req/s, p50 {out['p50_ms']:.2f} "
        f"p99 {out['p99_ms']:.2f} ms, batch {out['mean_batch']:.1f}, gpu {out['gpu_busy']:.0%}, "
        f"loop cpu {out['loop_cpu']:.0%} ({out['loop_us_per_request']:.1f} us/request)"
    )
    if profile:
        print(f"profile of {out['requests_profiled']} requests:")
        print(profile)


if __name__ == "__main__":
    main()
