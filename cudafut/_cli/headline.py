"""The headline benchmark of ``python -m cudafut``: about 20 seconds (5 with
``--quick``) that show what cudafut costs on this GPU, each figure next to a
baseline measured in the same run.

- **Waking up**: GPU work of an exact duration (a kernel that spins on the
  GPU's ``%globaltimer``, ``_kernels.GSLEEP``), short (50 µs), long (20 ms)
  and varying (random, 0.1 to 5 ms, the same sequence for every waiter),
  learnt finished by three waiters in turn, interleaved over ``ROUNDS``
  rounds: the floor (launch + a spinning ``stream.synchronize()``),
  ``await`` of a cudafut future, and a thread blocked on a blocking-sync
  event (``cupy.cuda.Event(block=True)``, ``event.synchronize()`` through
  ``loop.run_in_executor``). Each sample's *lateness* is its wall time less
  the work's duration; the CPU fraction is the process's CPU time over the
  wall time of the timed loop (1.0: one core busy).
- **Copies**: 64 MB between pinned host memory (``cudafut.empty_pinned``)
  and a device array, ``cudafut.to_device(pinned)`` and
  ``cudafut.to_host(dev, out=pinned)`` (each ended by ``result()``) against
  ``cupy.cuda.runtime.memcpyAsync`` + ``stream.synchronize()``; GB/s of
  the median copy.

The full suite (``python -m cudafut bench``, benchmarks/ of a source
checkout) measures these and much more; this module is the minimal part of
it that ships in the wheel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .. import _backend, _pools
from .._copies import to_device, to_host
from .._errors import CudaUnavailableError
from .._kernels import GSLEEP
from .._pinned import empty_pinned
from .._producers import record

#: The waiters (keys in the results).
FLOOR: Final = "floor"
AWAIT: Final = "await"
THREAD: Final = "thread"
WAITERS: Final = {
    FLOOR: "floor: launch + stream.synchronize()",
    AWAIT: "await of a cudafut future",
    THREAD: "thread blocked on a blocking-sync event (run_in_executor)",
}


@dataclass(frozen=True)
class Work:
    """A kind of GPU work: durations drawn uniformly from [low_ms, high_ms]."""

    name: str
    label: str
    low_ms: float
    high_ms: float
    seconds: float  # its share of the full run

    @property
    def mean_s(self) -> float:
        return (self.low_ms + self.high_ms) / 2e3


WORKS: Final = (
    Work("short", "short (50 µs)", 0.05, 0.05, 2.0),
    Work("long", "long (20 ms)", 20.0, 20.0, 8.0),
    Work("varying", "varying (0.1-5 ms)", 0.1, 5.0, 5.5),
)
ROUNDS: Final = 4
#: ``--quick`` runs this share of every part.
QUICK_FACTOR: Final = 0.25
#: A rough host cost per sample on top of the work, to plan sample counts.
OVERHEAD_S: Final = 40e-6
SEED: Final = 13

COPY_BYTES: Final = 64 << 20
COPY_SECONDS: Final = 1.5
COPY_MIN_REPS: Final = 5
COPY_MAX_REPS: Final = 500
H2D: Final = "h2d"
D2H: Final = "d2h"
DIRECTIONS: Final = {H2D: "host to device", D2H: "device to host"}


def steps() -> int:
    """How many times :func:`run` calls its ``step``."""
    return len(WORKS) * ROUNDS * len(WAITERS) + 2


def planned_seconds(quick: bool) -> float:
    """About how long :func:`run` measures (setting up comes on top)."""
    return (sum(w.seconds for w in WORKS) + COPY_SECONDS) * (QUICK_FACTOR if quick else 1.0)


class _Gpu:
    """The spin kernel, a stream and the value the futures carry."""

    def __init__(self) -> None:
        cp = _backend.current.cupy()
        self.cp = cp
        self.device = int(cp.cuda.runtime.getDevice())
        name = cp.cuda.runtime.getDeviceProperties(self.device)["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.token = cp.zeros(1, dtype=cp.float32)
            self.kernel = cp.RawModule(code=GSLEEP).get_function("gsleep")
            self.work(0)
            self.stream.synchronize()
        except Exception as exc:  # the device is busy, or NVRTC is missing: say so
            said = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if "compile" in type(exc).__name__.lower() or "nvrtc" in said.lower():
                raise CudaUnavailableError(
                    f"CuPy could not compile a CUDA kernel ({said}); CuPy compiles kernels with NVRTC, "
                    "from the CUDA toolkit: install it, e.g. pip install 'cupy-cuda12x[ctk]' "
                    "(or 'cupy-cuda13x[ctk]')"
                ) from exc
            raise CudaUnavailableError(
                f"GPU {self.device} ({self.name}) could not run a kernel ({said}); check `nvidia-smi`: "
                "is the GPU in exclusive mode and busy, or failing?"
            ) from exc

    def work(self, ns: int) -> None:
        """Enqueue a kernel that runs for exactly ``ns`` ns on ``stream``."""
        with self.stream:
            self.kernel((1,), (1,), (self.cp.int64(ns),))


Samples = list[float]


def _floor(gpu: _Gpu, warm: list[int], timed: list[int]) -> tuple[Samples, float, float]:
    work, sync, clock = gpu.work, gpu.stream.synchronize, time.perf_counter

    def once(ns: int) -> float:
        t = clock()
        work(ns)
        sync()
        return clock() - t

    for ns in warm:
        once(ns)
    c0, t0 = time.process_time(), clock()
    samples = [once(ns) for ns in timed]
    return samples, time.process_time() - c0, clock() - t0


def _waiter(gpu: _Gpu, which: str, pool: concurrent.futures.Executor) -> Callable[[int], Awaitable[float]]:
    work, stream, token, clock = gpu.work, gpu.stream, gpu.token, time.perf_counter
    if which == AWAIT:

        async def await_once(ns: int) -> float:
            t = clock()
            work(ns)
            await record(token, stream=stream)
            return clock() - t

        return await_once

    event = gpu.cp.cuda.Event(block=True, disable_timing=True)

    async def thread_once(ns: int) -> float:
        loop = asyncio.get_running_loop()
        t = clock()
        work(ns)
        event.record(stream)
        await loop.run_in_executor(pool, event.synchronize)
        return clock() - t

    return thread_once


def _async(
    gpu: _Gpu, which: str, pool: concurrent.futures.Executor, warm: list[int], timed: list[int]
) -> tuple[Samples, float, float]:
    async def go() -> tuple[Samples, float, float]:
        once = _waiter(gpu, which, pool)
        for ns in warm:
            await once(ns)
        c0, t0 = time.process_time(), time.perf_counter()
        samples = [await once(ns) for ns in timed]
        return samples, time.process_time() - c0, time.perf_counter() - t0

    return asyncio.run(go())


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def _wait(
    gpu: _Gpu,
    work: Work,
    factor: float,
    rng: random.Random,
    pool: concurrent.futures.Executor,
    step: Callable[[str], None],
) -> dict[str, Any]:
    per = work.seconds * factor / ROUNDS / len(WAITERS)
    n = max(5, int(per / (work.mean_s + OVERHEAD_S)))
    warm_n = max(2, min(20, n // 10))
    late: dict[str, Samples] = {w: [] for w in WAITERS}
    wall: dict[str, Samples] = {w: [] for w in WAITERS}
    cpu = dict.fromkeys(WAITERS, 0.0)
    elapsed = dict.fromkeys(WAITERS, 0.0)
    for r in range(ROUNDS):
        durations = [int(rng.uniform(work.low_ms, work.high_ms) * 1e6) for _ in range(warm_n + n)]
        warm, timed = durations[:warm_n], durations[warm_n:]
        for which, title in WAITERS.items():
            step(f"{work.label}, round {r + 1}/{ROUNDS}: {title.split(':')[0]}")
            if which == FLOOR:
                samples, c, w = _floor(gpu, warm, timed)
            else:
                samples, c, w = _async(gpu, which, pool, warm, timed)
            wall[which] += samples
            late[which] += [s - ns / 1e9 for s, ns in zip(samples, timed, strict=True)]
            cpu[which] += c
            elapsed[which] += w
    gpu.stream.synchronize()
    rows: dict[str, dict[str, float]] = {}
    for which in WAITERS:
        ws, ls = sorted(wall[which]), sorted(late[which])
        rows[which] = {
            "p50_us": statistics.median(ws) * 1e6,
            "p90_us": _pct(ws, 0.9) * 1e6,
            "late_p50_us": statistics.median(ls) * 1e6,
            "late_p90_us": _pct(ls, 0.9) * 1e6,
            "cpu": cpu[which] / elapsed[which],
        }
    floor = rows[FLOOR]["late_p50_us"]
    return {
        "label": work.label,
        "work_ms": [work.low_ms, work.high_ms],
        "n": n * ROUNDS,
        "waiters": rows,
        "await_extra_us": rows[AWAIT]["late_p50_us"] - floor,
        "thread_extra_us": rows[THREAD]["late_p50_us"] - floor,
        # lateness of await over the blocked thread's: < 1, await wakes sooner
        "await_vs_thread": rows[AWAIT]["late_p50_us"] / rows[THREAD]["late_p50_us"],
    }


def _copies(gpu: _Gpu, seconds: float, step: Callable[[str], None]) -> dict[str, Any]:
    cp = gpu.cp
    import numpy as np  # CuPy's dependency, so there when CuPy is

    step(f"copies of {COPY_BYTES >> 20} MB: warm-up and data check")
    nbytes, n = COPY_BYTES, COPY_BYTES // 4
    rt = cp.cuda.runtime
    stream = gpu.stream
    pinned = empty_pinned(n, np.uint32)
    pinned[:] = np.arange(n, dtype=np.uint32)
    dev = cp.empty(n, dtype=cp.uint32)
    pin_ptr, dev_ptr, s_ptr = pinned.ctypes.data, dev.data.ptr, stream.ptr

    def raw_h2d() -> None:
        rt.memcpyAsync(dev_ptr, pin_ptr, nbytes, rt.memcpyHostToDevice, s_ptr)
        stream.synchronize()

    def raw_d2h() -> None:
        rt.memcpyAsync(pin_ptr, dev_ptr, nbytes, rt.memcpyDeviceToHost, s_ptr)
        stream.synchronize()

    def fut_h2d() -> None:
        to_device(pinned).result()

    def fut_d2h() -> None:
        to_host(dev, out=pinned).result()

    paths: dict[tuple[str, str], Callable[[], None]] = {
        (H2D, "raw"): raw_h2d,
        (H2D, "cudafut"): fut_h2d,
        (D2H, "raw"): raw_d2h,
        (D2H, "cudafut"): fut_d2h,
    }
    # One call per copy stream first: CuPy's pool caches per stream, and each
    # to_device() takes the next copy stream (as after a while in a service).
    for call in paths.values():
        for _ in range(_pools.COPY_STREAMS_PER_POOL + 1):
            call()
    idx = np.linspace(0, n - 1, min(n, 4097)).astype(np.int64)
    got = to_device(pinned).result()
    h2d_ok = bool(np.array_equal(cp.asnumpy(got[cp.asarray(idx)]), idx.astype(np.uint32)))
    del got
    with stream:
        dev[:] = cp.arange(n, dtype=cp.uint32) + 7
    stream.synchronize()
    to_host(dev, out=pinned).result()
    d2h_ok = bool(np.array_equal(pinned[idx], (idx + 7).astype(np.uint32)))

    step(f"copies of {COPY_BYTES >> 20} MB: interleaved rounds")
    times: dict[tuple[str, str], Samples] = {key: [] for key in paths}
    t0 = time.perf_counter()
    reps = 0
    while reps < COPY_MAX_REPS and (reps < COPY_MIN_REPS or time.perf_counter() - t0 < seconds):
        for key, call in paths.items():
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
        reps += 1
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "data_ok": h2d_ok and d2h_ok}
    for d in (H2D, D2H):
        raw = nbytes / statistics.median(times[(d, "raw")]) / 1e9
        fut = nbytes / statistics.median(times[(d, "cudafut")]) / 1e9
        out[d] = {"raw_gbs": raw, "cudafut_gbs": fut, "ratio": fut / raw}
    return out


def run(quick: bool, step: Callable[[str], None]) -> dict[str, Any]:
    """Measure (needs a usable GPU); the results, JSON-ready.

    ``step(what)`` is called as each of :func:`steps` parts starts.

    Raises:
        CudaUnavailableError: CUDA cannot be used, or CuPy cannot compile
            the spin kernel.
    """
    t0 = time.perf_counter()
    gpu = _Gpu()
    factor = QUICK_FACTOR if quick else 1.0
    rng = random.Random(SEED)
    results: dict[str, Any] = {
        "quick": quick,
        "device": {"index": gpu.device, "name": gpu.name},
        "waiters": dict(WAITERS),
        "wait": {},
    }
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cudafut-headline")
    try:
        for work in WORKS:
            results["wait"][work.name] = _wait(gpu, work, factor, rng, pool, step)
        results["copies"] = _copies(gpu, COPY_SECONDS * factor, step)
    finally:
        pool.shutdown()
    results["seconds"] = time.perf_counter() - t0
    return results


def measurements(results: dict[str, Any]) -> dict[str, float]:
    """Every measured figure of ``results`` by a dotted name (all positive)."""
    out: dict[str, float] = {}
    for kind, row in results["wait"].items():
        for which, fig in row["waiters"].items():
            for key, value in fig.items():
                out[f"wait.{kind}.{which}.{key}"] = value
        out[f"wait.{kind}.await_vs_thread"] = row["await_vs_thread"]
    for d in (H2D, D2H):
        for key, value in results["copies"][d].items():
            out[f"copies.{d}.{key}"] = value
    return out


# -- rendering (no CuPy) ------------------------------------------------------------


def _us(value: float, sign: bool = False) -> str:
    return f"{value:+.0f} µs" if sign else f"{value:.0f} µs"


def tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The results as (title, headers, rows) tables, for a terminal."""
    wait_rows = []
    for row in results["wait"].values():
        w = row["waiters"]
        wait_rows.append(
            [
                row["label"],
                _us(w[FLOOR]["late_p50_us"]),
                _us(row["await_extra_us"], sign=True),
                _us(row["thread_extra_us"], sign=True),
                f"{row['await_vs_thread']:.2f}x",
                f"{w[FLOOR]['cpu']:.0%}",
                f"{w[AWAIT]['cpu']:.0%}",
                f"{w[THREAD]['cpu']:.0%}",
            ]
        )
    dev = results["device"]
    wait = (
        f"Waking up on GPU {dev['index']} ({dev['name']}): median lateness after the work's duration",
        [
            "work",
            "floor",
            "await vs floor",
            "thread vs floor",
            "await / thread",
            "CPU floor",
            "CPU await",
            "CPU thread",
        ],
        wait_rows,
    )
    c = results["copies"]
    copy_rows = [
        [
            DIRECTIONS[d],
            "to_device(pinned)" if d == H2D else "to_host(out=pinned)",
            f"{c[d]['cudafut_gbs']:.1f}",
            f"{c[d]['raw_gbs']:.1f}",
            f"{c[d]['ratio']:.2f}x",
        ]
        for d in (H2D, D2H)
    ]
    copies = (
        f"Copies of {c['bytes'] >> 20} MB, pinned <-> device, {c['reps']} rounds"
        + ("" if c["data_ok"] else " (DATA CHECK FAILED)"),
        ["direction", "cudafut call", "cudafut GB/s", "raw memcpyAsync GB/s", "cudafut / raw"],
        copy_rows,
    )
    return [wait, copies]


def numeric_columns(headers: list[str], rows: list[list[str]]) -> list[bool]:
    """For each column, whether it holds figures (to align them right)."""
    return [bool(rows) and all(row[i][:1] in "0123456789+-." for row in rows) for i in range(len(headers))]


def plain_table(title: str, headers: list[str], rows: list[list[str]]) -> list[str]:
    """A table as aligned text lines (figures right-aligned, text left)."""
    cols = [headers, *rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    right = numeric_columns(headers, rows)

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if right[i] else cell.ljust(widths[i]) for i, cell in enumerate(cells)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [title, line(headers), rule, *(line(r) for r in rows)]


def plot_name(results: dict[str, Any]) -> str:
    """The plot's file name: ``cudafut-<gpu>.png`` (``cudafut-h100.png``)."""
    words = results["device"]["name"].lower().replace("nvidia", "").split()
    slug = "".join(ch for ch in (words[0] if words else "gpu") if ch.isalnum() or ch in "-_") or "gpu"
    return f"cudafut-{slug}.png"


def plot(results: dict[str, Any], path: Path, title: str) -> Path:
    """Draw the results into the PNG ``path``; return it.

    Raises:
        ImportError: matplotlib is not installed (the ``cli`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_late, ax_cpu, ax_copy) = plt.subplots(1, 3, figsize=(15, 4.6))
    kinds = list(results["wait"])
    labels = [results["wait"][k]["label"] for k in kinds]
    width = 0.26
    colours = {FLOOR: "#9e9e9e", AWAIT: "#1f77b4", THREAD: "#ff7f0e"}
    for i, which in enumerate(WAITERS):
        xs = [j + (i - 1) * width for j in range(len(kinds))]
        p50 = [results["wait"][k]["waiters"][which]["late_p50_us"] for k in kinds]
        p90 = [results["wait"][k]["waiters"][which]["late_p90_us"] for k in kinds]
        cpu = [results["wait"][k]["waiters"][which]["cpu"] * 100 for k in kinds]
        name = {FLOOR: "floor (sync)", AWAIT: "cudafut await", THREAD: "blocked thread"}[which]
        bars = ax_late.bar(xs, p50, width, color=colours[which], label=name)
        ax_late.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
        ax_late.errorbar(
            xs,
            p50,
            yerr=[[0.0] * len(p50), [b - a for a, b in zip(p50, p90, strict=True)]],
            fmt="none",
            ecolor="0.35",
            elinewidth=1,
        )
        bars = ax_cpu.bar(xs, cpu, width, color=colours[which], label=name)
        ax_cpu.bar_label(bars, fmt="%.0f%%", fontsize=8, padding=2)
    for ax in (ax_late, ax_cpu):
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(labels)
    ax_late.set_ylabel("µs after the work's duration (median, whisker: p90)")
    ax_late.set_title("How late each waiter wakes")
    ax_late.margins(y=0.25)
    ax_late.legend(loc="upper left")
    ax_cpu.set_ylabel("process CPU time / wall time (%)")
    ax_cpu.set_title("CPU used while waiting")
    ax_cpu.set_ylim(0, 115)
    c = results["copies"]
    dirs = [H2D, D2H]
    for i, (key, name, colour) in enumerate(
        (("raw_gbs", "raw memcpyAsync", "#9e9e9e"), ("cudafut_gbs", "cudafut", "#1f77b4"))
    ):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(dirs))]
        bars = ax_copy.bar(xs, [c[d][key] for d in dirs], 0.38, color=colour, label=name)
        ax_copy.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax_copy.set_xticks(range(len(dirs)))
    ax_copy.set_xticklabels([DIRECTIONS[d] for d in dirs])
    ax_copy.set_ylabel("GB/s (median copy)")
    ax_copy.set_title(f"Copies of {c['bytes'] >> 20} MB, pinned memory")
    ax_copy.legend(loc="lower center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
