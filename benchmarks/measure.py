"""The measurements of the benchmark suite (see suite.py); needs CuPy and a GPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import cupy as cp
import cupyx

import cudafut
from cudafut import WaitPolicy, set_wait_policy

from . import gpu
from .gpu import CpuMeter, quantiles, stream, token, work

Samples = list[float]


class Progress:
    """One status line per step on stderr, with the time spent so far."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        print(f"[{self.done:3d}/{self.total}] {elapsed:6.1f}s  {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def policy(p: WaitPolicy | str) -> Iterator[None]:
    old = set_wait_policy(p)  # type: ignore[arg-type]
    try:
        yield
    finally:
        set_wait_policy(old)


# -- 1-3: wake-up latency and CPU ---------------------------------------------

WORK_MS = [0.0, 0.05, 0.2, 0.5, 2.0, 20.0]
REPS = {0.0: 2000, 0.05: 1000, 0.2: 600, 0.5: 300, 2.0: 150, 20.0: 40}
WARMUP = 30


def run_sync(once: Callable[[], object], n: int) -> tuple[Samples, float]:
    """Time ``n`` calls of ``once`` in this thread, after a warm-up."""
    for _ in range(WARMUP):
        once()
    with CpuMeter() as m:
        samples = gpu.timed(once, n)
    return samples, m.ratio


def floor(ns: int, n: int) -> tuple[Samples, float]:
    return run_sync(lambda: (work(ns), stream.synchronize()), n)


def blocking_event_sync(ns: int, n: int) -> tuple[Samples, float]:
    ev = cp.cuda.Event(block=True, disable_timing=True)
    return run_sync(lambda: (work(ns), ev.record(stream), ev.synchronize()), n)


def cudafut_result(ns: int, n: int) -> tuple[Samples, float]:
    return run_sync(lambda: (work(ns), cudafut.record(token, stream=stream).result()), n)


Once = Callable[[int], Awaitable[float]]


def run_async(make: Callable[[], Once], ns: int, n: int) -> tuple[Samples, float]:
    """Time ``n`` awaited round trips in a fresh asyncio loop, after a warm-up."""

    async def go() -> tuple[Samples, float]:
        once = make()
        for _ in range(WARMUP):
            await once(ns)
        samples = []
        with CpuMeter() as m:
            for _ in range(n):
                samples.append(await once(ns))
        return samples, m.ratio

    return asyncio.run(go())


def s_cudafut_await() -> Once:
    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        await cudafut.record(token, stream=stream)
        return time.perf_counter() - t

    return once


def s_sleep0_poll() -> Once:
    ev = cp.cuda.Event(block=False, disable_timing=True)

    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        ev.record(stream)
        while not ev.done:
            await asyncio.sleep(0)
        return time.perf_counter() - t

    return once


_pool = concurrent.futures.ThreadPoolExecutor(2)


def s_executor_sync() -> Once:
    ev = cp.cuda.Event(block=True, disable_timing=True)

    async def once(ns: int) -> float:
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        work(ns)
        ev.record(stream)
        await loop.run_in_executor(_pool, ev.synchronize)
        return time.perf_counter() - t

    return once


_hostfunc: gpu.HostFunc | None = None


def s_hostfunc_close() -> Once:
    global _hostfunc
    if _hostfunc is None:
        _hostfunc = gpu.HostFunc()
    hf = _hostfunc
    ev = cp.cuda.Event(block=False, disable_timing=True)

    async def once(ns: int) -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        r, w = os.pipe()

        def on_read() -> None:
            loop.remove_reader(r)
            os.close(r)
            done.set_result(None)

        loop.add_reader(r, on_read)
        t = time.perf_counter()
        work(ns)
        ev.record(stream)
        hf.close_after(ev, w)
        await done
        return time.perf_counter() - t

    return once


def s_numba() -> Once:
    from numba import cuda  # type: ignore[import-untyped]

    nstream = cuda.external_stream(stream.ptr)

    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        await nstream.async_done()
        return time.perf_counter() - t

    return once


ASYNC_STRATEGIES: dict[str, tuple[Callable[[], Once], WaitPolicy | str]] = {
    "cudafut await (balanced)": (s_cudafut_await, "balanced"),
    "cudafut await (balanced, no prediction)": (s_cudafut_await, WaitPolicy(predict=False)),
    "cudafut await (low_cpu)": (s_cudafut_await, "low_cpu"),
    "cudafut await (low_latency)": (s_cudafut_await, "low_latency"),
    "peer: asyncio sleep(0) polling": (s_sleep0_poll, "balanced"),
    "peer: run_in_executor(event.synchronize)": (s_executor_sync, "balanced"),
    "peer: host func close() + add_reader": (s_hostfunc_close, "balanced"),
    "peer: numba-cuda async_done()": (s_numba, "balanced"),
}
SYNC_STRATEGIES: dict[str, Callable[[int, int], tuple[Samples, float]]] = {
    "cudafut result() (balanced)": cudafut_result,
    "peer: blocking-sync event, synchronize()": blocking_event_sync,
}


ROUNDS = 4


def bench_wake(progress: Progress, quick: bool) -> dict[str, Any]:
    """For each work duration, every strategy in turn, ``ROUNDS`` times
    over (interleaved, so that clock and thermal drift hit all alike)."""
    out: dict[str, Any] = {}
    for ms in WORK_MS:
        ns = int(ms * 1e6)
        n = max(20, REPS[ms] // (5 if quick else 1)) // ROUNDS
        runs: dict[str, Callable[[], tuple[Samples, float]]] = {
            "floor: launch + stream.synchronize()": lambda ns=ns, n=n: floor(ns, n)
        }
        for name, (make, pol) in ASYNC_STRATEGIES.items():
            runs[name] = lambda make=make, pol=pol, ns=ns, n=n: _with_policy(pol, run_async, make, ns, n)
        for name, fn in SYNC_STRATEGIES.items():
            runs[name] = lambda fn=fn, ns=ns, n=n: fn(ns, n)
        samples: dict[str, Samples] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        errors: dict[str, str] = {}
        for _ in range(ROUNDS):
            for name, run in runs.items():
                if name in errors:
                    continue
                try:
                    got, ratio = run()
                except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                samples[name] += got
                cpu[name].append(ratio)
        base = quantiles(samples["floor: launch + stream.synchronize()"])
        row: dict[str, Any] = {}
        for name in runs:
            if name in errors:
                row[name] = {"error": errors[name]}
                progress.step(f"wake {ms} ms: {name}: unavailable ({errors[name][:60]})")
                continue
            q = quantiles(samples[name])
            q["ratio_p50"] = q["p50_us"] / base["p50_us"]
            q["extra_p50_us"] = q["p50_us"] - base["p50_us"]
            q["extra_p99_us"] = q["p99_us"] - base["p99_us"]
            q["cpu_per_wall"] = statistics.fmean(cpu[name])
            row[name] = q
            progress.step(
                f"wake {ms} ms: {name}: p50 {q['p50_us']:.1f} us ({q['ratio_p50']:.2f}x), "
                f"cpu {q['cpu_per_wall']:.3f}"
            )
        out[f"{ms}"] = row
    return out


SWEEP_MS = [2.0, 20.0]
SWEEP_BUDGETS = [0.0, 0.01, 0.02, 0.05, 0.1, 0.2]


def bench_sweep(progress: Progress, quick: bool) -> dict[str, Any]:
    """Await on repeating work of 2 and 20 ms for a range of ``cpu_budget``:
    the latency / CPU trade-off the policy offers."""
    out: dict[str, Any] = {}
    for ms in SWEEP_MS:
        ns = int(ms * 1e6)
        n = max(20, REPS[ms] // (5 if quick else 1))
        base = quantiles(floor(ns, n)[0])
        row: dict[str, Any] = {"floor_p50_us": base["p50_us"]}
        for budget in SWEEP_BUDGETS:
            pol = WaitPolicy(cpu_budget=budget)
            samples, cpu = _with_policy(pol, run_async, s_cudafut_await, ns, n)
            q = quantiles(samples)
            row[f"{budget}"] = {
                "extra_p50_us": q["p50_us"] - base["p50_us"],
                "extra_p99_us": q["p99_us"] - base["p99_us"],
                "cpu_per_wall": cpu,
            }
            extra = row[f"{budget}"]["extra_p50_us"]
            progress.step(f"sweep {ms} ms, cpu_budget {budget}: +{extra:.1f} us, cpu {cpu:.3f}")
        out[f"{ms}"] = row
    return out


def _with_policy(pol: WaitPolicy | str, fn: Callable[..., Any], *args: Any) -> Any:
    with policy(pol):
        return fn(*args)


# -- 4: many concurrent awaits ------------------------------------------------


def bench_many(
    progress: Progress, n: int = 10_000, nstreams: int = 8, batch: int = 10, busy_ms: float = 500
) -> dict[str, Any]:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(nstreams)]

    async def scenario(gpu_work: bool) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        stall = 0.0
        stop = False

        async def heartbeat() -> None:
            # Ticks every 0.5 ms (asyncio rounds that up to 1 ms): the stall
            # is the longest gap between two ticks. It must not spin, or the
            # CPU figures would count it.
            nonlocal stall
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.5e-3)
                now = time.perf_counter()
                stall, last = max(stall, now - last), now

        async def one_gpu(i: int) -> None:
            # One event record on a busy stream, awaited: pending until the
            # stream's long kernel ends, so all n waits are concurrent.
            await cudafut.record(token, stream=streams[i % nstreams])

        plain: list[asyncio.Future[None]] = []

        async def one_plain(i: int) -> None:
            # A plain asyncio future, resolved with the others in bulk after
            # the same busy time: what 10k concurrent awaits cost asyncio.
            fut = loop.create_future()
            plain.append(fut)
            await fut

        async def release_plain() -> None:
            await asyncio.sleep(busy_ms / 1e3)
            while len(plain) < n:
                await asyncio.sleep(1e-3)
            for start in range(0, n, 256):  # in slices, as cudafut's waiter fires
                for fut in plain[start : start + 256]:
                    fut.set_result(None)
                await asyncio.sleep(0)

        one = one_gpu if gpu_work else one_plain
        left = n
        all_done = asyncio.Event()

        async def counted(i: int) -> None:
            nonlocal left
            await one(i)
            left -= 1
            if not left:
                all_done.set()

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0)
        tasks = set()
        with CpuMeter() as m:
            # Busy streams: every await is still pending when the last one
            # starts, and they complete in bulk (the hard case for stalls).
            if gpu_work:
                for s in streams:
                    work(int(busy_ms * 1e6), on=s)
            else:
                releaser = asyncio.create_task(release_plain())
            for start in range(0, n, batch):  # clients arrive in small batches, not one burst
                for i in range(start, min(n, start + batch)):
                    task = asyncio.create_task(counted(i))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)
            await all_done.wait()
            if not gpu_work:
                await releaser
        stop = True
        await beat
        return {
            "host_cpu_us_per_future": m.cpu / n * 1e6,
            "wall_us_per_future": m.wall / n * 1e6,
            "max_heartbeat_stall_ms": stall * 1e3,
        }

    res: dict[str, Any] = {}
    for name, gpu_work in (("plain asyncio futures (baseline)", False), ("cudafut await", True)):
        asyncio.run(scenario(gpu_work))  # warm-up
        res[name] = asyncio.run(scenario(gpu_work))
        # The cyclic garbage collector's pauses are the loop's, not the
        # waiter's: show the stall without them too (as services tune it).
        gc.collect()
        gc.disable()
        try:
            no_gc = asyncio.run(scenario(gpu_work))
        finally:
            gc.enable()
        res[name]["max_heartbeat_stall_ms_gc_off"] = no_gc["max_heartbeat_stall_ms"]
        res[name]["host_cpu_us_per_future_gc_off"] = no_gc["host_cpu_us_per_future"]
        progress.step(f"10k awaits: {name}: {res[name]}")
    base = res["plain asyncio futures (baseline)"]["host_cpu_us_per_future"]
    mine = res["cudafut await"]["host_cpu_us_per_future"]
    res["cudafut host us per future over plain asyncio"] = mine - base
    return {"n": n, "streams": nstreams, "batch": batch, "busy_ms": busy_ms, **res}


# -- 5: host costs ----------------------------------------------------------


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def bench_host(progress: Progress, links: int = 1000) -> dict[str, Any]:
    res: dict[str, Any] = {}
    kernel = gpu._gsleep
    zero = cp.int64(0)

    def launch() -> None:
        kernel((1,), (1,), (zero,))

    def create_set() -> None:
        cudafut.CudaFuture(devices=0).set_result(token)

    def record() -> None:
        cudafut.record(token)

    with stream:
        for name, fn in (
            ("bare kernel launch", launch),
            ("cudafut create + set_result", create_set),
            ("cudafut record()", record),
        ):
            per_call_us(fn, 2000)
            res[name + " us"] = min(per_call_us(fn, 20_000) for _ in range(3))
            stream.synchronize()
            progress.step(f"host: {name}: {res[name + ' us']:.2f} us")

    def chain_cudafut(with_kernel: bool) -> float:
        fut = cudafut.record(token, stream=stream)

        def link(v: Any) -> Any:
            if with_kernel:
                launch()
            return v

        t = time.perf_counter()
        for _ in range(links):
            fut = fut.then(link)
        per = (time.perf_counter() - t) / links * 1e6
        fut.result()
        return per

    for with_kernel in (False, True):
        chain_cudafut(with_kernel)
        key = "cudafut then() per link us" + (" (fn launches a kernel)" if with_kernel else " (fn returns)")
        res[key] = min(chain_cudafut(with_kernel) for _ in range(3))
        progress.step(f"host: {key}: {res[key]:.2f}")
    with stream:
        res["bare kernel launch x1000, per launch us"] = min(per_call_us(launch, links) for _ in range(3))
    stream.synchronize()
    res.update(_torch_host(progress, links))
    launch_us = res["bare kernel launch us"]
    res["ratio create+set / bare launch"] = res["cudafut create + set_result us"] / launch_us
    return res


def _torch_host(progress: Progress, links: int) -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return {"torch": f"unavailable: {exc}"}
    res: dict[str, Any] = {}
    t = torch.zeros(1, device="cuda")
    tkernel = gpu._gsleep
    zero = cp.int64(0)

    def create_set() -> None:
        torch.futures.Future(devices=["cuda:0"]).set_result(t)

    per_call_us(create_set, 2000)
    key = "peer: torch Future(devices) create + set_result us"
    res[key] = min(per_call_us(create_set, 20_000) for _ in range(3))

    def chain(with_kernel: bool) -> float:
        fut = torch.futures.Future(devices=["cuda:0"])
        fut.set_result(t)

        def link(f: Any) -> Any:
            if with_kernel:
                tkernel((1,), (1,), (zero,))
            return f.value()

        t0 = time.perf_counter()
        for _ in range(links):
            fut = fut.then(link)
        per = (time.perf_counter() - t0) / links * 1e6
        fut.wait()
        torch.cuda.synchronize()
        return per

    for with_kernel in (False, True):
        chain(with_kernel)
        key = "peer: torch then() per link us" + (
            " (fn launches a kernel)" if with_kernel else " (fn returns)"
        )
        res[key] = min(chain(with_kernel) for _ in range(3))
        progress.step(f"host: {key}: {res[key]:.2f}")
    return res


# -- 6: pipeline ----------------------------------------------------------------


class Pipeline:
    """N chunks: pinned host -> device, ``rounds`` of a*x+b, device -> pinned host."""

    def __init__(self, chunks: int, size: int, rounds: int) -> None:
        self.chunks, self.size, self.rounds = chunks, size, rounds
        self.h_in = [cupyx.empty_pinned(size, dtype="float32") for _ in range(chunks)]
        self.h_out = [cupyx.empty_pinned(size, dtype="float32") for _ in range(chunks)]
        for i, h in enumerate(self.h_in):
            h[:] = i
        self.d_in = [cp.empty(size, dtype=cp.float32) for _ in range(chunks)]
        self.d_out = [cp.empty(size, dtype=cp.float32) for _ in range(chunks)]
        self.timeline: list[tuple[str, int, int, Any, Any]] | None = None

    def _mark(self, stage: str, i: int) -> Callable[[], None]:
        if self.timeline is None:
            return lambda: None
        s = cp.cuda.get_current_stream()
        start = cp.cuda.Event()
        start.record(s)

        def end() -> None:
            stop = cp.cuda.Event()
            stop.record(s)
            assert self.timeline is not None
            self.timeline.append((stage, i, s.ptr, start, stop))

        return end

    def copy_in(self, i: int) -> Any:
        end = self._mark("copy in", i)
        self.d_in[i].set(self.h_in[i])
        end()
        return self.d_in[i]

    def compute(self, i: int, x: Any) -> Any:
        end = self._mark("compute", i)
        gpu.axpb(x, self.d_out[i], 1.0001, 0.5, self.rounds)
        end()
        return self.d_out[i]

    def copy_out(self, i: int, y: Any) -> Any:
        end = self._mark("copy out", i)
        y.get(out=self.h_out[i], blocking=False)
        end()
        return self.h_out[i]

    def serial(self) -> None:
        t = time.perf_counter()
        with stream:
            for i in range(self.chunks):
                self.copy_out(i, self.compute(i, self.copy_in(i)))
        self.enqueue_s = time.perf_counter() - t
        stream.synchronize()

    def hand_written(self) -> None:
        """The classic: one stream per stage, events between stages."""
        s_in, s_comp, s_out = self._hand_streams
        t = time.perf_counter()
        for i in range(self.chunks):
            with s_in:
                x = self.copy_in(i)
                e1 = s_in.record()
            s_comp.wait_event(e1)
            with s_comp:
                y = self.compute(i, x)
                e2 = s_comp.record()
            s_out.wait_event(e2)
            with s_out:
                self.copy_out(i, y)
        self.enqueue_s = time.perf_counter() - t
        s_out.synchronize()

    def per_chunk_streams(self) -> None:
        """Hand-written, the way cudafut schedules it: each chunk's three
        stages on one stream, chunks round robin over 32 streams."""
        streams = self._chunk_streams
        t = time.perf_counter()
        for i in range(self.chunks):
            with streams[i % len(streams)]:
                self.copy_out(i, self.compute(i, self.copy_in(i)))
        self.enqueue_s = time.perf_counter() - t
        gpu.sync_all()

    async def with_cudafut(self) -> None:
        t = time.perf_counter()
        futs = []
        for i in range(self.chunks):
            fut = cudafut.submit(self.copy_in, i)
            fut = fut.then(lambda x, i=i: self.compute(i, x))
            futs.append(fut.then(lambda y, i=i: self.copy_out(i, y)))
        self.enqueue_s = time.perf_counter() - t
        await cudafut.gather(*futs)

    def check(self) -> None:
        for i in (0, self.chunks - 1):
            expect = cp.empty(self.size, dtype=cp.float32)
            gpu.axpb(cp.asarray(self.h_in[i]), expect, 1.0001, 0.5, self.rounds)
            if not (cp.asnumpy(expect) == self.h_out[i]).all():
                raise AssertionError(f"pipeline chunk {i}: wrong output")

    def prepare(self) -> None:
        self._hand_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
        self._chunk_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(32)]


PIPELINES = [(32, 16 << 20), (64, 4 << 20)]  # (chunks, float32 elements per chunk)


def bench_pipeline(progress: Progress) -> dict[str, Any]:
    return {
        f"{chunks} x {size * 4 >> 20} MB": _pipeline(progress, chunks, size) for chunks, size in PIPELINES
    }


def _pipeline(progress: Progress, chunks: int, size: int) -> dict[str, Any]:
    # Calibrate compute to take about as long as one copy: the overlap case.
    p = Pipeline(chunks, size, rounds=1)
    p.prepare()
    x, y = p.d_in[0], p.d_out[0]
    copy_t = _gpu_time(lambda: x.set(p.h_in[0]))
    per_round = _gpu_time(lambda: gpu.axpb(x, y, 1.0001, 0.5, 256)) / 256
    rounds = max(1, round(copy_t / per_round))
    p.rounds = rounds
    res: dict[str, Any] = {
        "chunks": chunks,
        "chunk_mb": size * 4 / 2**20,
        "rounds": rounds,
        "copy_in_ms": copy_t * 1e3,
    }
    loop = asyncio.new_event_loop()  # one loop for all runs, as a service has
    variants: dict[str, Callable[[], None]] = {
        "serial (one stream)": p.serial,
        "hand-written CuPy (3 streams + events)": p.hand_written,
        "hand-written CuPy (a stream per chunk, 32)": p.per_chunk_streams,
        "cudafut submit().then().then() + gather": lambda: loop.run_until_complete(p.with_cudafut()),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    enqueue: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
        gpu.sync_all()
    for _ in range(7):  # interleaved, so that drift hits all variants alike
        for name, fn in variants.items():
            times[name].append(_wall(fn))
            enqueue[name].append(p.enqueue_s)
            p.check()
    for name in variants:
        med = statistics.median(times[name])
        res[name] = {
            "seconds_median": med,
            "seconds_all": times[name],
            "chunks_per_s": chunks / med,
            "host_enqueue_us_per_chunk": statistics.median(enqueue[name]) / chunks * 1e6,
        }
        progress.step(f"pipeline {chunks} x {size * 4 >> 20} MB: {name}: {chunks / med:.0f} chunks/s")
    hand = res["hand-written CuPy (3 streams + events)"]["chunks_per_s"]
    ser = res["serial (one stream)"]["chunks_per_s"]
    mine = res["cudafut submit().then().then() + gather"]["chunks_per_s"]
    res["cudafut / hand-written"] = mine / hand
    res["cudafut / serial"] = mine / ser
    res["hand-written / serial"] = hand / ser
    res["cudafut / hand-written per chunk"] = (
        mine / res["hand-written CuPy (a stream per chunk, 32)"]["chunks_per_s"]
    )
    # Timelines, in a separate instrumented run.
    timelines = {}
    for name in ("hand-written CuPy (3 streams + events)", "cudafut submit().then().then() + gather"):
        p.timeline = []
        variants[name]()
        gpu.sync_all()
        ref = p.timeline[0][3]
        spans = [
            (stage, i, ptr, cp.cuda.get_elapsed_time(ref, a), cp.cuda.get_elapsed_time(ref, b))
            for stage, i, ptr, a, b in p.timeline
        ]
        t0 = min(span[3] for span in spans)
        timelines[name] = [(st, i, ptr, a - t0, b - t0) for st, i, ptr, a, b in spans]
        p.timeline = None
    loop.close()
    res["timelines_ms"] = timelines
    return res


def _gpu_time(fn: Callable[[], object]) -> float:
    a, b = cp.cuda.Event(), cp.cuda.Event()
    fn()
    a.record()
    for _ in range(5):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 5 / 1e3


def _wall(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    gpu.sync_all()
    return time.perf_counter() - t
