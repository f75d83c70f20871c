"""Sections 1-3, ``wake``: launch a kernel that runs for an exact time (0 µs to
20 ms), learn that it finished; p50/p99 and CPU/wall for each waiting
strategy, against launch + ``stream.synchronize()`` (the floor).

Also the pieces ``sweep.py`` reuses: ``floor()``, ``run_async()`` and the
cudafut ``await`` strategy. CuPy is imported inside the functions that
measure, so that report.py can render without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cudafut
from cudafut import WaitPolicy

from .support.common import (
    CpuMeter,
    Progress,
    Samples,
    meta_of,
    pyplot,
    quantiles,
    save_figure,
    timed,
    with_policy,
)

if TYPE_CHECKING:
    from .support.gpu import HostFunc

NAME = "wake"

WORK_MS = [0.0, 0.05, 0.2, 0.5, 2.0, 20.0]
REPS = {0.0: 2000, 0.05: 1000, 0.2: 600, 0.5: 300, 2.0: 150, 20.0: 40}
WARMUP = 30
ROUNDS = 4

# The strategies (row names in the JSON and the tables).
FLOOR = "floor: launch + stream.synchronize()"
#: The default policy and the same without prediction: timed polls, no
#: CUDA notices (WaitPolicy.notify=False, the default).
AWAIT_BALANCED = "cudafut await (balanced)"
AWAIT_NO_PREDICTION = "cudafut await (balanced, no prediction)"
#: The same two with CUDA notices (WaitPolicy(notify=True)).
AWAIT_NOTICES = "cudafut await (balanced, notices)"
AWAIT_NOTICES_NO_PREDICTION = "cudafut await (notices, no prediction)"
AWAIT_LOW_CPU = "cudafut await (low_cpu)"
AWAIT_LOW_LATENCY = "cudafut await (low_latency)"
PEER_SLEEP0 = "peer: asyncio sleep(0) polling"
#: The floor of a waiter that sleeps: told the duration, it sleeps on the
#: loop's timer until 1-2 ms before the end (asyncio's timers round up to a
#: millisecond), then polls a CuPy event once per loop iteration.
FLOOR_SLEEPER = "floor: sleep until 1-2 ms before the known end, then sleep(0) polling"
PEER_EXECUTOR = "peer: run_in_executor(event.synchronize)"
PEER_HOSTFUNC = "peer: host func close() + add_reader"
PEER_NUMBA = "peer: numba-cuda async_done()"
RESULT_BALANCED = "cudafut result() (balanced)"
PEER_BLOCKING_EVENT = "peer: blocking-sync event, synchronize()"


def run_sync(once: Callable[[], object], n: int) -> tuple[Samples, float]:
    """Time ``n`` calls of ``once`` in this thread, after a warm-up."""
    for _ in range(WARMUP):
        once()
    with CpuMeter() as m:
        samples = timed(once, n)
    return samples, m.ratio


def floor(ns: int, n: int) -> tuple[Samples, float]:
    from .support.gpu import stream, work

    return run_sync(lambda: (work(ns), stream.synchronize()), n)  # type: ignore[func-returns-value]


def blocking_event_sync(ns: int, n: int) -> tuple[Samples, float]:
    import cupy as cp

    from .support.gpu import stream, work

    ev = cp.cuda.Event(block=True, disable_timing=True)
    return run_sync(lambda: (work(ns), ev.record(stream), ev.synchronize()), n)  # type: ignore[func-returns-value]


def cudafut_result(ns: int, n: int) -> tuple[Samples, float]:
    from .support.gpu import stream, token, work

    return run_sync(lambda: (work(ns), cudafut.record(token, stream=stream).result()), n)  # type: ignore[func-returns-value]


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
    from .support.gpu import stream, token, work

    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        await cudafut.record(token, stream=stream)
        return time.perf_counter() - t

    return once


def s_sleep0_poll(early_s: float | None = None) -> Once:
    """``sleep(0)`` polls of a CuPy event; with ``early_s``, after sleeping
    on the loop's timer until ``early_s`` before the known end."""
    import cupy as cp

    from .support.gpu import stream, work

    ev = cp.cuda.Event(block=False, disable_timing=True)

    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        ev.record(stream)
        if early_s is not None and ns / 1e9 > early_s:
            await asyncio.sleep(ns / 1e9 - early_s)
        while not ev.done:
            await asyncio.sleep(0)
        return time.perf_counter() - t

    return once


_pool = concurrent.futures.ThreadPoolExecutor(2)


def s_executor_sync() -> Once:
    import cupy as cp

    from .support.gpu import stream, work

    ev = cp.cuda.Event(block=True, disable_timing=True)

    async def once(ns: int) -> float:
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        work(ns)
        ev.record(stream)
        await loop.run_in_executor(_pool, ev.synchronize)
        return time.perf_counter() - t

    return once


_hostfunc: HostFunc | None = None


def s_hostfunc_close() -> Once:
    import cupy as cp

    from .support.gpu import HostFunc, stream, work

    global _hostfunc
    if _hostfunc is None:
        _hostfunc = HostFunc()
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
    from .support.gpu import stream, work

    cuda = importlib.import_module("numba.cuda")  # an optional peer: untyped, maybe absent
    nstream = cuda.external_stream(stream.ptr)

    async def once(ns: int) -> float:
        t = time.perf_counter()
        work(ns)
        await nstream.async_done()
        return time.perf_counter() - t

    return once


ASYNC_STRATEGIES: dict[str, tuple[Callable[[], Once], WaitPolicy | str]] = {
    AWAIT_BALANCED: (s_cudafut_await, "balanced"),
    AWAIT_NO_PREDICTION: (s_cudafut_await, WaitPolicy(predict=False)),
    AWAIT_NOTICES: (s_cudafut_await, WaitPolicy(notify=True)),
    AWAIT_NOTICES_NO_PREDICTION: (s_cudafut_await, WaitPolicy(predict=False, notify=True)),
    AWAIT_LOW_CPU: (s_cudafut_await, "low_cpu"),
    AWAIT_LOW_LATENCY: (s_cudafut_await, "low_latency"),
    PEER_SLEEP0: (s_sleep0_poll, "balanced"),
    FLOOR_SLEEPER: (functools.partial(s_sleep0_poll, 2e-3), "balanced"),
    PEER_EXECUTOR: (s_executor_sync, "balanced"),
    PEER_HOSTFUNC: (s_hostfunc_close, "balanced"),
    PEER_NUMBA: (s_numba, "balanced"),
}
SYNC_STRATEGIES: dict[str, Callable[[int, int], tuple[Samples, float]]] = {
    RESULT_BALANCED: cudafut_result,
    PEER_BLOCKING_EVENT: blocking_event_sync,
}


def steps(quick: bool) -> int:
    return len(WORK_MS) * (1 + len(ASYNC_STRATEGIES) + len(SYNC_STRATEGIES))


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    """For each work duration, every strategy in turn, ``ROUNDS`` times
    over (interleaved, so that clock and thermal drift hit all alike)."""
    out: dict[str, Any] = {}
    for ms in WORK_MS:
        ns = int(ms * 1e6)
        n = max(20, REPS[ms] // (5 if quick else 1)) // ROUNDS
        runs: dict[str, Callable[[], tuple[Samples, float]]] = {FLOOR: functools.partial(floor, ns, n)}
        for name, (make, pol) in ASYNC_STRATEGIES.items():
            runs[name] = functools.partial(with_policy, pol, run_async, make, ns, n)
        for name, fn in SYNC_STRATEGIES.items():
            runs[name] = functools.partial(fn, ns, n)
        samples: dict[str, Samples] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        errors: dict[str, str] = {}
        for _ in range(ROUNDS):
            for name, measure in runs.items():
                if name in errors:
                    continue
                try:
                    got, ratio = measure()
                except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                samples[name] += got
                cpu[name].append(ratio)
        base = quantiles(samples[FLOOR])
        row: dict[str, Any] = {}
        for name in runs:
            if name in errors:
                row[name] = {"error": errors[name]}
                progress.step(f"wake {ms} ms: {name}: unavailable ({errors[name][:60]})")
                continue
            q: dict[str, Any] = quantiles(samples[name])
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


def markdown(result: dict[str, Any]) -> list[str]:
    wake = result
    lines = [
        "## 1-3. Launch a kernel of exact duration, learn that it finished",
        "",
        "p50 (p99) extra wall time over the same run's floor, launch + `stream.synchronize()`, "
        "in µs; ratio of p50s; CPU/wall while waiting.",
        "",
    ]
    works = list(wake)
    header = "| strategy | " + " | ".join(f"{w} ms" for w in works) + " |"
    lines += [header, "|---" * (len(works) + 1) + "|"]
    names = list(wake[works[0]])
    for name in names:
        if all("error" in wake[w].get(name, {}) for w in works):
            continue  # never measured: said once under the table
        cells = []
        for w in works:
            q = wake[w].get(name, {})
            if "error" in q:
                cells.append("n/a")
            elif name == FLOOR:
                cells.append(f"{q['p50_us']:.1f} µs (p99 {q['p99_us']:.1f}), cpu {q['cpu_per_wall']:.2f}")
            else:
                cells.append(
                    f"{q['extra_p50_us']:+.1f} ({q['extra_p99_us']:+.0f}), "
                    f"{q['ratio_p50']:.2f}x, cpu {q['cpu_per_wall']:.2f}"
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = {n: q["error"] for w in works for n, q in wake[w].items() if "error" in q}
    for n, e in errors.items():
        lines.append(f"\n{n}: not measured on this machine ({e.split(':')[0]}).")
    lines.append("")
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    wake = result
    works = list(wake)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for name in wake[works[0]]:
        if name == FLOOR:
            continue
        xs, ys, cs = [], [], []
        for w in works:
            q = wake[w].get(name, {})
            if "extra_p50_us" in q:
                xs.append(max(float(w), 0.01))
                ys.append(max(q["extra_p50_us"], 0.5))
                cs.append(q["cpu_per_wall"])
        if xs:
            style = "-o" if name.startswith("cudafut") else "--s"
            ax.plot(xs, ys, style, label=name)
            bx.plot(xs, cs, style, label=name)
    for a in (ax, bx):
        a.set_xscale("log")
        a.set_xlabel("GPU work, ms (0 plotted at 0.01)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("extra wake-up latency over stream.synchronize(), p50, µs")
    bx.set_ylabel("CPU / wall while waiting")
    bx.axhline(0.05, color="grey", lw=0.8)
    ax.legend(fontsize=7)
    gpu_name = meta_of(result).get("gpu")
    fig.suptitle("Wake-up latency and CPU against work duration" + (f" ({gpu_name})" if gpu_name else ""))
    return [save_figure(plt, fig, out / f"{stem}-wake.png")]
