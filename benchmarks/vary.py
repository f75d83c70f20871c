"""Section ``vary``: work whose duration changes, the case a predicting waiter
can get wrong.

Each pattern is a sequence of exact-duration kernels (``%globaltimer``
spins) run one after another on a stream, the next launched as soon as the
previous one was noticed, as a service's task does; once on one stream, and
once as 8 tasks on 8 streams at the same time. For every job, the *extra* is
the wall time from launch to "noticed" minus what the floor would take for
the same duration (launch + ``stream.synchronize()``, modelled as the
duration plus the floor of an empty kernel, both measured in this run; the
model's error at 0.2, 2 and 20 ms is reported beside it).

Beside cudafut's waiters, the peers: a bare thread blocked on a
blocking-sync event (no event loop: the targets' reference), the floor of
an asyncio task woken by such a thread (one per stream, handing the
completion to the loop with ``call_soon_threadsafe``: what a notice-driven
``await`` is judged against, beside the thread), ``run_in_executor`` of the
event's ``synchronize()``, and ``asyncio.sleep(0)`` polling.

Every strategy runs every pattern with the same durations (seeded), in
interleaved rounds, each on fresh streams (so nothing learnt carries over
from another strategy). CuPy is imported inside ``run()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import math
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import cudafut
from cudafut import WaitPolicy, _cuda

from .support.common import CpuMeter, Progress, meta_of, policy, pyplot, save_figure, service_module

NAME = "vary"

# The strategies (row names in the JSON and the tables).
#: The default policy: CUDA notices beside polls at most 1 ms apart
#: (WaitPolicy()). In runs before notices were on by default, this row was
#: timed polls alone, which :data:`BALANCED_POLLS` measures now.
BALANCED = "cudafut await (balanced)"
LOW_CPU = "cudafut await (low_cpu)"
LOW_LATENCY = "cudafut await (low_latency)"
THREAD = "peer: blocking-sync event in a thread"
EXECUTOR = "peer: run_in_executor(event.synchronize)"
SLEEP0 = "peer: asyncio sleep(0) polling"
#: The balanced policy with CUDA notices and polls only 20 ms apart while
#: they are armed (the default before notices were on by default), delivered
#: by the native notice threads (cudafut._waker).
BALANCED_NOTICES = "cudafut await (balanced, native notices)"
#: The same with CUDA host-function notices instead of the native notice
#: threads: the notices before them.
BALANCED_HOSTFN = "cudafut await (balanced, host-function notices)"
#: Notices alone: no spin around predicted ends (WaitPolicy.predict=False).
NOTICES_ONLY = "cudafut await (notices, no predicted spin)"
#: Notices and nothing else: no spin after a new wait or around predicted
#: ends, polls 20 ms apart while notices are armed: the least CPU a notice
#: can cost, against the floor strategy's.
NOTICES_NO_SPIN = "cudafut await (notices only, no spin)"
#: The balanced policy without notices: timed polls alone
#: (WaitPolicy(notify=False)), the default of runs before notices were.
BALANCED_POLLS = "cudafut await (balanced, timed polls only)"
#: The floor of an interrupt-driven completion delivered to an asyncio task:
#: the task launches and records a blocking-sync event, a thread of its
#: stream (made once per run) blocks on it and wakes the task with
#: ``loop.call_soon_threadsafe``. :data:`THREAD` is a bare thread with no
#: loop to wake: this is the least a notice-driven ``await`` can cost.
FLOOR = (
    "floor: a thread per stream blocked on a blocking-sync event, "
    "waking the awaiting task (call_soon_threadsafe)"
)
#: Waiters told each job's duration, so no prediction can beat them: the
#: task sleeps on a timerfd (microsecond timers; asyncio's round up to a
#: millisecond) until its margin before the job's end, then polls the event
#: once per loop iteration. The margins sweep the trade a sleeper makes
#: (wake-up lateness against spinning): the least CPU of the ones that are
#: no later than :data:`THREAD` at p50 and p90 is the CPU floor of that
#: target for any waiter that sleeps and spins (docs/performance.md).
TOLD = {
    0.0: "floor: told the duration, sleep (timerfd) until the end, then sleep(0) polling",
    0.2e-3: "floor: told the duration, sleep (timerfd) until 0.2 ms before the end, then sleep(0) polling",
    1e-3: "floor: told the duration, sleep (timerfd) until 1 ms before the end, then sleep(0) polling",
}
STRATEGIES = (
    BALANCED,
    BALANCED_POLLS,
    BALANCED_NOTICES,
    BALANCED_HOSTFN,
    NOTICES_ONLY,
    NOTICES_NO_SPIN,
    LOW_CPU,
    LOW_LATENCY,
    THREAD,
    FLOOR,
    *TOLD.values(),
    EXECUTOR,
    SLEEP0,
)
_PRESETS: dict[str, WaitPolicy | str] = {
    BALANCED: "balanced",
    BALANCED_POLLS: WaitPolicy(notify=False),
    BALANCED_NOTICES: WaitPolicy(notify=True, notice_sleep_s=20e-3),
    BALANCED_HOSTFN: WaitPolicy(notify=True, notice_sleep_s=20e-3),
    NOTICES_ONLY: WaitPolicy(predict=False, notify=True, notice_sleep_s=20e-3),
    NOTICES_NO_SPIN: WaitPolicy(spin_s=0, predict=False, notify=True, notice_sleep_s=20e-3),
    LOW_CPU: "low_cpu",
    LOW_LATENCY: "low_latency",
}

#: Layouts: one task on one stream, and 8 tasks on 8 streams at once.
LAYOUTS = {"1 stream": 1, "8 streams": 8}

MS = 1e-3


def _log_uniform(rnd: random.Random, lo: float, hi: float) -> float:
    return math.exp(rnd.uniform(math.log(lo), math.log(hi)))


def _patterns(quick: bool) -> dict[str, Callable[[random.Random], list[float]]]:
    """Each pattern: durations in seconds, drawn from the given generator."""
    k = 3 if quick else 1
    return {
        "step: one 50 ms job, then 40 of 2 ms": lambda rnd: [50 * MS] + [2 * MS] * 40,
        "steps: 6 of 20 ms, 6 of 2 ms, x3": lambda rnd: ([20 * MS] * 6 + [2 * MS] * 6) * 3,
        "random: log-uniform 50 us - 20 ms": lambda rnd: [
            _log_uniform(rnd, 0.05 * MS, 20 * MS) for _ in range(200 // k)
        ],
        "bimodal: 0.1 or 10 ms at random": lambda rnd: [
            rnd.choice((0.1 * MS, 10 * MS)) for _ in range(100 // k)
        ],
        "drift: 2 ms growing 1 % a job": lambda rnd: [2 * MS * 1.01**i for i in range(100 // k)],
        "stable 0.2 ms": lambda rnd: [0.2 * MS] * (200 // k),
        "stable 2 ms": lambda rnd: [2 * MS] * (60 // k),
        "stable 20 ms": lambda rnd: [20 * MS] * (20 // k),
    }


#: Patterns whose every job takes 2 ms or more: where CPU/wall is judged.
LONG_PATTERNS = (
    "steps: 6 of 20 ms, 6 of 2 ms, x3",
    "stable 2 ms",
    "stable 20 ms",
    "drift: 2 ms growing 1 % a job",
)


def _rounds(quick: bool) -> int:
    return 1 if quick else 2


def steps(quick: bool) -> int:
    return len(_patterns(quick)) * len(LAYOUTS) * len(STRATEGIES) + 1


# -- the strategies: each runs lists of durations, one list per stream ----------

Jobs = list[list[float]]
Latencies = list[list[float]]


def _await_cudafut(gpu: Any) -> Callable[[int, Any], Coroutine[Any, Any, float]]:
    async def once(ns: int, s: Any) -> float:
        t = time.perf_counter()
        gpu.work(ns, on=s)
        await cudafut.record(gpu.token, stream=s)
        return time.perf_counter() - t

    return once


def _event_of(events: dict[int, Any], stream: Any, block: bool) -> Any:
    """One reusable event per stream (made on first use)."""
    ev = events.get(stream.ptr)
    if ev is None:
        import cupy as cp

        ev = events[stream.ptr] = cp.cuda.Event(block=block, disable_timing=True)
    return ev


def _await_sleep0(gpu: Any) -> Callable[[int, Any], Coroutine[Any, Any, float]]:
    events: dict[int, Any] = {}

    async def once(ns: int, s: Any) -> float:
        ev = _event_of(events, s, block=False)
        t = time.perf_counter()
        gpu.work(ns, on=s)
        ev.record(s)
        while not ev.done:
            await asyncio.sleep(0)
        return time.perf_counter() - t

    return once


def _await_executor(gpu: Any, pool: concurrent.futures.ThreadPoolExecutor) -> Any:
    events: dict[int, Any] = {}

    async def once(ns: int, s: Any) -> float:
        ev = _event_of(events, s, block=True)
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        gpu.work(ns, on=s)
        ev.record(s)
        await loop.run_in_executor(pool, ev.synchronize)
        return time.perf_counter() - t

    return once


def _run_async(once: Callable[[int, Any], Coroutine[Any, Any, float]], jobs: Jobs, streams: list[Any]) -> Any:
    async def task(durations: list[float], s: Any) -> list[float]:
        return [await once(int(d * 1e9), s) for d in durations]

    async def main() -> tuple[Latencies, float]:
        with CpuMeter() as m:
            lats = await asyncio.gather(*(task(d, s) for d, s in zip(jobs, streams, strict=True)))
        return list(lats), m.ratio

    return asyncio.run(main())


def _run_threads(gpu: Any, jobs: Jobs, streams: list[Any]) -> tuple[Latencies, float]:
    import cupy as cp

    lats: Latencies = [[] for _ in jobs]

    def task(i: int) -> None:
        s = streams[i]
        ev = cp.cuda.Event(block=True, disable_timing=True)
        out = lats[i]
        for d in jobs[i]:
            t = time.perf_counter()
            gpu.work(int(d * 1e9), on=s)
            ev.record(s)
            ev.synchronize()
            out.append(time.perf_counter() - t)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(len(jobs))]
    with CpuMeter() as m:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return lats, m.ratio


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # cancelled meanwhile
        fut.set_result(None)


def _run_floor(gpu: Any, jobs: Jobs, streams: list[Any]) -> tuple[Latencies, float]:
    """:data:`FLOOR`: each task launches, records its stream's blocking-sync
    event and hands it to its stream's thread, which blocks on it and wakes
    the task's future through ``loop.call_soon_threadsafe``."""

    async def main() -> tuple[Latencies, float]:
        loop = asyncio.get_running_loop()
        events: dict[int, Any] = {}
        queues: list[queue.SimpleQueue[tuple[Any, asyncio.Future[None]] | None]] = [
            queue.SimpleQueue() for _ in streams
        ]

        def waiter(q: queue.SimpleQueue[tuple[Any, asyncio.Future[None]] | None]) -> None:
            while (item := q.get()) is not None:
                ev, fut = item
                ev.synchronize()
                loop.call_soon_threadsafe(_wake, fut)

        async def task(durations: list[float], s: Any, q: queue.SimpleQueue[Any]) -> list[float]:
            ev = _event_of(events, s, block=True)
            out = []
            for d in durations:
                ns = int(d * 1e9)
                fut = loop.create_future()
                t = time.perf_counter()
                gpu.work(ns, on=s)
                ev.record(s)
                q.put((ev, fut))
                await fut
                out.append(time.perf_counter() - t)
            return out

        threads = [threading.Thread(target=waiter, args=(q,), daemon=True) for q in queues]
        for th in threads:
            th.start()
        try:
            with CpuMeter() as m:
                lats = await asyncio.gather(
                    *(task(d, s, q) for d, s, q in zip(jobs, streams, queues, strict=True))
                )
        finally:
            for q in queues:
                q.put(None)
            for th in threads:
                th.join()
        return list(lats), m.ratio

    return asyncio.run(main())


class _TimerSleep:
    """A timerfd the running loop watches: :meth:`sleep` to the microsecond."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from cudafut._timer import make_timer

        timer = make_timer()
        if timer is None:
            raise RuntimeError("no timerfd on this machine: the told-the-duration floors need one")
        self._timer = timer
        self._loop = loop
        self._fut: asyncio.Future[None] | None = None
        loop.add_reader(timer.fd, self._fired)

    def _fired(self) -> None:
        self._timer.drain()
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        self._fut = self._loop.create_future()
        self._timer.arm(seconds)
        await self._fut

    def close(self) -> None:
        self._loop.remove_reader(self._timer.fd)
        self._timer.close()


def _run_told(gpu: Any, margin_s: float, jobs: Jobs, streams: list[Any]) -> tuple[Latencies, float]:
    """:data:`TOLD`: each task launches, records its stream's event, sleeps
    until ``margin_s`` before the job's known end, then polls the event."""

    async def main() -> tuple[Latencies, float]:
        loop = asyncio.get_running_loop()
        events: dict[int, Any] = {}
        sleepers = [_TimerSleep(loop) for _ in streams]

        async def task(durations: list[float], s: Any, sleeper: _TimerSleep) -> list[float]:
            ev = _event_of(events, s, block=False)
            out = []
            for d in durations:
                t = time.perf_counter()
                gpu.work(int(d * 1e9), on=s)
                ev.record(s)
                ahead = t + d - margin_s - time.perf_counter()
                if ahead > 0:
                    await sleeper.sleep(ahead)
                while not ev.done:
                    await asyncio.sleep(0)
                out.append(time.perf_counter() - t)
            return out

        try:
            with CpuMeter() as m:
                lats = await asyncio.gather(
                    *(task(d, s, w) for d, s, w in zip(jobs, streams, sleepers, strict=True))
                )
        finally:
            for w in sleepers:
                w.close()
        return list(lats), m.ratio

    return asyncio.run(main())


def _strategy(name: str, gpu: Any, pool: concurrent.futures.ThreadPoolExecutor) -> Callable[..., Any]:
    if name in _PRESETS:
        preset = _PRESETS[name]

        native = name != BALANCED_HOSTFN  # the policies without notify=True ask for none

        def run_cudafut(jobs: Jobs, streams: list[Any]) -> Any:
            previous = _cuda.set_native_notices(native)
            try:
                with policy(preset):
                    return _run_async(_await_cudafut(gpu), jobs, streams)
            finally:
                _cuda.set_native_notices(previous)

        return run_cudafut
    if name == THREAD:
        return lambda jobs, streams: _run_threads(gpu, jobs, streams)
    if name == FLOOR:
        return lambda jobs, streams: _run_floor(gpu, jobs, streams)
    for margin, told in TOLD.items():
        if name == told:
            return functools.partial(_run_told, gpu, margin)
    if name == EXECUTOR:
        return lambda jobs, streams: _run_async(_await_executor(gpu, pool), jobs, streams)
    return lambda jobs, streams: _run_async(_await_sleep0(gpu), jobs, streams)


# -- the floor --------------------------------------------------------------------


def _floor(gpu: Any, seconds: float, n: int) -> float:
    """p50 of launch + ``stream.synchronize()`` for a kernel of ``seconds``."""
    ns = int(seconds * 1e9)
    for _ in range(5):
        gpu.work(ns)
        gpu.stream.synchronize()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        gpu.work(ns)
        gpu.stream.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _summary(extras_us: list[float], cpu: float, durations: list[float]) -> dict[str, Any]:
    s = sorted(extras_us)
    n = len(s)
    return {
        "extra_p50_us": s[n // 2],
        "extra_p90_us": s[min(n - 1, (n * 9) // 10)],
        "extra_max_us": s[-1],
        "extra_mean_us": statistics.fmean(s),
        "cpu_per_wall": cpu,
        "jobs": n,
        "mean_work_ms": statistics.fmean(durations) * 1e3,
    }


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    import cupy as cp

    from .support import gpu

    floor0 = _floor(gpu, 0.0, 400)
    model = {}
    for ms in (0.2, 2.0, 20.0):
        model[f"{ms}"] = (_floor(gpu, ms * MS, 20 if ms > 10 else 100) - ms * MS - floor0) * 1e6
    progress.step(f"vary: floor of an empty kernel {floor0 * 1e6:.1f} us, model error (us) {model}")

    pauses = service_module("pauses")
    recorder = pauses.PauseRecorder(GC_PAUSE_MS, count_tracked=False)  # a count would stall the row
    pool = concurrent.futures.ThreadPoolExecutor(max(LAYOUTS.values()))
    keep_streams: list[Any] = []  # alive to the end: a freed stream's handle could be reused
    extras: dict[tuple[str, str, str], list[float]] = {}
    cpus: dict[tuple[str, str, str], list[float]] = {}
    works: dict[tuple[str, str, str], list[float]] = {}
    patterns = _patterns(quick)
    # A full collection walks every object tracked (CuPy's, and PyTorch's
    # where an earlier section imported it) and holds the loop meanwhile:
    # in a row, it lands on one strategy's wake-up. What the imports left is
    # frozen first, as the serving recipe does (docs/serving.md), and every
    # collection of GC_PAUSE_MS or more that remains is recorded with the row
    # it fell in, or as between rows.
    gc_out: dict[str, Any] = {
        "threshold_ms": GC_PAUSE_MS,
        "tracked_before": len(gc.get_objects()),
        "between_rows": True,  # runs without this key recorded the rows' collections only
    }
    rows_of: dict[int, tuple[str, int]] = {}  # index in recorder.pauses: (row, round)
    try:
        t0 = time.perf_counter()
        gc_out["frozen"] = pauses.freeze_warm_objects()
        gc_out["collect_and_freeze_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        recorder.install()
        for r in range(_rounds(quick)):
            for p_index, (pattern, make) in enumerate(patterns.items()):
                for layout, nstreams in LAYOUTS.items():
                    jobs = [make(random.Random(1000 * p_index + i)) for i in range(nstreams)]
                    for name in STRATEGIES:
                        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(nstreams)]
                        keep_streams += streams
                        seen = len(recorder.pauses)
                        lats, cpu = _strategy(name, gpu, pool)(jobs, streams)
                        key = (pattern, layout, name)
                        for i in range(seen, len(recorder.pauses)):
                            rows_of[i] = (f"{pattern} [{layout}] {name}", r)
                        ex = extras.setdefault(key, [])
                        for durations, got in zip(jobs, lats, strict=True):
                            ex += [(t - d - floor0) * 1e6 for d, t in zip(durations, got, strict=True)]
                        cpus.setdefault(key, []).append(cpu)
                        works.setdefault(key, []).extend(d for durations in jobs for d in durations)
                        if r == _rounds(quick) - 1:
                            q = _summary(ex, statistics.fmean(cpus[key]), works[key])
                            progress.step(
                                f"vary {pattern} [{layout}] {name}: extra p50 {q['extra_p50_us']:.0f} "
                                f"p90 {q['extra_p90_us']:.0f} max {q['extra_max_us']:.0f} us, "
                                f"cpu {q['cpu_per_wall']:.3f}"
                            )
    finally:
        recorder.remove()
        # Everything: a benchmark process freezes nothing else, so the next
        # section starts unfrozen, as this one did.
        gc.unfreeze()
        pool.shutdown()
        gpu.sync_all()
    gc_out["pauses"] = [
        {"row": row, "round": r, "ms": p["ms"], "generation": p["generation"]}
        for i, p in enumerate(recorder.pauses)
        for row, r in [rows_of.get(i, ("between rows", -1))]
    ]
    out: dict[str, Any] = {
        "gc": gc_out,
        "floor_empty_kernel_us": floor0 * 1e6,
        "floor_model_error_us": model,
        "rounds": _rounds(quick),
        "policy_balanced": repr(cudafut.WaitPolicy()),
        "patterns": {},
    }
    for pattern in patterns:
        out["patterns"][pattern] = {
            layout: {
                name: _summary(extras[key], statistics.fmean(cpus[key]), works[key])
                for name in STRATEGIES
                for key in [(pattern, layout, name)]
            }
            for layout in LAYOUTS
        }
    out["targets"] = _targets(out)
    out["ratios"] = _all_ratios(out)
    out["told_floor"] = _all_told_floors(out)
    return out


# -- targets, Markdown and plots (no CuPy) --------------------------------------------

MAX_EXTRA_US = 1500.0
#: Garbage collections at least this long are recorded with their row (ms).
GC_PAUSE_MS = 5.0
MAX_CPU_LONG = 0.10


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """Per pattern and layout, whether the default policy met the issue's
    targets against the blocking-sync thread of the same run."""
    out: dict[str, Any] = {}
    for pattern, layouts in result["patterns"].items():
        for layout, rows in layouts.items():
            mine, thread = rows[BALANCED], rows[THREAD]
            checks = {
                "p50 <= thread": mine["extra_p50_us"] <= thread["extra_p50_us"],
                "p90 <= thread": mine["extra_p90_us"] <= thread["extra_p90_us"],
                f"max <= {MAX_EXTRA_US:.0f} us": mine["extra_max_us"] <= MAX_EXTRA_US,
            }
            if pattern in LONG_PATTERNS:
                checks[f"cpu <= {MAX_CPU_LONG}"] = mine["cpu_per_wall"] <= MAX_CPU_LONG
            out[f"{pattern} [{layout}]"] = checks
    return out


#: The peers the default policy's figures are divided by (the ``ratios``
#: of the JSON, and the Targets table's last columns): the bare blocked
#: thread of the targets, and the floor of a task woken by such a thread.
PEERS = {"thread": THREAD, "floor": FLOOR}
#: Their Targets columns ("the floor" alone is the launch + synchronize model).
_PEER_COLUMNS = {
    "thread": "p50 / p90 / CPU over the blocked thread",
    "floor": "p50 / p90 / CPU over the floor strategy",
}


#: The Targets column of :func:`_told_floor` (runs that have the told waiters).
_TOLD_COLUMN = (
    "CPU floor: the least CPU / wall of a waiter told the duration that is no later than the "
    "blocked thread at p50 and p90, over the thread's; the default policy's over it"
)


def _over(value: float, base: float) -> float | None:
    return round(value / base, 2) if base > 0 else None


def _ratios(rows: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The default policy's extra p50, extra p90 and CPU / wall over each
    peer's of :data:`PEERS` that the rows have (older runs lack the floor)."""
    mine = rows[BALANCED]
    return {
        key: {
            "p50": _over(mine["extra_p50_us"], rows[peer]["extra_p50_us"]),
            "p90": _over(mine["extra_p90_us"], rows[peer]["extra_p90_us"]),
            "cpu": _over(mine["cpu_per_wall"], rows[peer]["cpu_per_wall"]),
        }
        for key, peer in PEERS.items()
        if peer in rows
    }


def _all_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """:func:`_ratios` of every pattern and layout, keyed as the targets are."""
    return {
        f"{pattern} [{layout}]": _ratios(rows)
        for pattern, layouts in result["patterns"].items()
        for layout, rows in layouts.items()
    }


def _told_floor(rows: dict[str, Any]) -> dict[str, Any] | None:
    """Of the :data:`TOLD` waiters no later than the blocked thread at p50
    and p90, the one with the least CPU: its margin, its CPU over the
    thread's, and the default policy's CPU over its. None where none is
    (or the run had none)."""
    thread = rows[THREAD]
    fits = [
        (rows[name]["cpu_per_wall"], margin)
        for margin, name in TOLD.items()
        if name in rows
        and rows[name]["extra_p50_us"] <= thread["extra_p50_us"]
        and rows[name]["extra_p90_us"] <= thread["extra_p90_us"]
    ]
    if not fits:
        return None
    cpu, margin = min(fits)
    return {
        "margin_ms": margin * 1e3,
        "cpu_over_thread": _over(cpu, thread["cpu_per_wall"]),
        "default_cpu_over_it": _over(rows[BALANCED]["cpu_per_wall"], cpu),
    }


def _all_told_floors(result: dict[str, Any]) -> dict[str, Any]:
    """:func:`_told_floor` of every pattern and layout, keyed as the targets are."""
    return {
        f"{pattern} [{layout}]": _told_floor(rows)
        for pattern, layouts in result["patterns"].items()
        for layout, rows in layouts.items()
    }


def _told_cell(floor: dict[str, Any] | None) -> str:
    if floor is None or None in (floor["cpu_over_thread"], floor["default_cpu_over_it"]):
        return "none of them" if floor is None else "-"
    return (
        f"{floor['cpu_over_thread']:.2f}x (sleeping until {floor['margin_ms']:g} ms before the end); "
        f"ours {floor['default_cpu_over_it']:.2f}x it"
    )


def _names(result: dict[str, Any]) -> list[str]:
    """The strategies of a result, in its order (a run from before a
    strategy was added lacks it)."""
    layouts = next(iter(result["patterns"].values()))
    return list(next(iter(layouts.values())))


def _ratio_cell(r: dict[str, float | None] | None) -> str:
    if r is None:
        return "-"
    return " / ".join("-" if r[k] is None else f"{r[k]:.2f}x" for k in ("p50", "p90", "cpu"))


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        "## vary: work whose duration changes",
        "",
        "Extra wall time from launch to *noticed* over the floor for the same duration "
        f"(empty-kernel floor {result['floor_empty_kernel_us']:.1f} us; the floor model's error at "
        + ", ".join(f"{k} ms: {v:+.1f} us" for k, v in result["floor_model_error_us"].items())
        + f"), in µs, p50 / p90 / max, and process CPU / wall; {result['rounds']} interleaved round(s).",
        "",
    ]
    if "gc" in result:
        lines += [_gc_text(result["gc"]), ""]
    names = _names(result)
    for layout in LAYOUTS:
        lines += [f"### {layout}", "", "| pattern | " + " | ".join(names) + " |"]
        lines.append("|---" * (len(names) + 1) + "|")
        for pattern, layouts in result["patterns"].items():
            cells = []
            for name in names:
                q = layouts[layout][name]
                cells.append(
                    f"{q['extra_p50_us']:.0f} / {q['extra_p90_us']:.0f} / {q['extra_max_us']:.0f}, "
                    f"{q['cpu_per_wall']:.2f}"
                )
            lines.append(f"| {pattern} | " + " | ".join(cells) + " |")
        lines.append("")
    # Beside the verdicts, the default policy over the thread and over the
    # floor: for runs that have the floor (the tables of older runs stay as they were).
    ratios = _all_ratios(result) if FLOOR in names else {}
    extra = [_PEER_COLUMNS[key] for key in PEERS] if ratios else []
    told = result.get("told_floor", {})
    if told:
        extra.append(_TOLD_COLUMN)
    heading = "### Targets (default policy against the blocking-sync thread, same run)"
    if ratios:
        heading = heading.removesuffix(")") + (
            "; beside them its extra p50, extra p90 and CPU / wall over the blocked thread's and over "
            "the floor strategy's, a thread blocked on the event that wakes the awaiting task)"
        )
    lines += [heading, ""]
    lines += ["| pattern | " + " | ".join(_target_names(result) + extra) + " |"]
    lines.append("|---" * (len(_target_names(result)) + len(extra) + 1) + "|")
    for key, checks in result["targets"].items():
        cells = [
            "" if n not in checks else "met" if checks[n] else "**missed**" for n in _target_names(result)
        ]
        if ratios:
            cells += [_ratio_cell(ratios.get(key, {}).get(peer)) for peer in PEERS]
        if told:
            cells.append(_told_cell(told.get(key)))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _gc_text(g: dict[str, Any]) -> str:
    """The garbage collector's part in a run: what was frozen before the
    rows, and every collection over the threshold, with its row."""
    text = (
        f"Before the rows this section froze what the process held, as the serving recipe does "
        f"({g['frozen']:,} objects; `gc.collect()`, `gc.freeze()` and a count of what it froze took "
        f"{g['collect_and_freeze_ms']:.0f} ms). Collections of {g['threshold_ms']:g} ms or more "
        f"during the {'section' if g.get('between_rows') else 'rows'}: "
    )
    found = sorted(g["pauses"], key=lambda p: -p["ms"])
    if not found:
        return text + "none."
    return (
        text
        + f"{len(found)}: "
        + "; ".join(
            f"{p['ms']:.1f} ms (generation {p['generation']}, "
            + ("between rows" if p["round"] < 0 else f"{p['row']}, round {p['round'] + 1}")
            + ")"
            for p in found
        )
        + "."
    )


def _target_names(result: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for checks in result["targets"].values():
        names += [n for n in checks if n not in names]
    return names


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    patterns = list(result["patterns"])
    short = [p.split(":")[0] for p in patterns]
    names = _names(result)
    fig, axes = plt.subplots(2, len(LAYOUTS), figsize=(15, 8), sharex=True)
    width = 0.8 / len(names)
    for col, layout in enumerate(LAYOUTS):
        top, bottom = axes[0][col], axes[1][col]
        for k, name in enumerate(names):
            xs = [i + (k - len(names) / 2 + 0.5) * width for i in range(len(patterns))]
            rows = [result["patterns"][p][layout][name] for p in patterns]
            p50 = [max(1.0, r["extra_p50_us"]) for r in rows]
            p90 = [max(1.0, r["extra_p90_us"]) for r in rows]
            bars = top.bar(xs, p50, width, label=name)
            top.scatter(xs, p90, marker="_", color=bars.patches[0].get_facecolor(), s=60)
            bottom.bar(xs, [r["cpu_per_wall"] for r in rows], width, label=name)
        top.set_yscale("log")
        top.set_title(f"{layout}: extra wake-up, p50 (bar) and p90 (tick)")
        top.set_ylabel("µs over the floor")
        top.axhline(MAX_EXTRA_US, color="grey", linestyle=":", linewidth=1)
        bottom.set_ylabel("CPU / wall")
        bottom.axhline(MAX_CPU_LONG, color="grey", linestyle=":", linewidth=1)
        bottom.set_xticks(range(len(patterns)), short, rotation=30)
    axes[0][0].legend(fontsize=7)
    meta = meta_of(result)
    fig.suptitle(f"cudafut waiters on work that varies ({meta.get('gpu', 'GPU')})")
    return [save_figure(plt, fig, out / f"{stem}-vary.png")]
