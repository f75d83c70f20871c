"""Section ``copies``: host <-> device copies, ``cudafut.to_device`` /
``cudafut.to_host`` against raw ``cudaMemcpyAsync`` on pinned memory and
against CuPy's pageable copies, all in one run (issue 10).

- **Bandwidth**, 4 KB to 1 GB (``--quick``: 4 KB, 1 MB, 16 MB, 256 MB), both
  directions: bytes / median wall time of one copy, each ended by
  ``stream.synchronize()`` or ``result()``; the paths of a group interleaved
  in rounds, at least ``MIN_REPS`` rounds (more for small sizes). Raw:
  ``cupy.cuda.runtime.memcpyAsync`` between a pinned array and a device array
  on a non-blocking stream. cudafut pinned: ``to_device(pinned)``,
  ``to_host(dev, out=pinned)``, ``to_host(dev)`` (a result from the pinned
  pool). CuPy pageable: ``cupy.asarray(pageable)``, ``dev.get(out=pageable)``.
  cudafut pageable: ``to_device(pageable)``, ``to_host(dev, out=pageable)``.
  Every path's data is checked once per size (sampled, after the timed
  rounds, with a pattern the timed rounds never wrote).
- **Calling thread**: how long each call takes to return (the copy not
  awaited), p50 and max over the rounds, and the first call of each path at
  a size, separately: every pool (cudafut's pinned pool, CuPy's pinned and
  device pools) is emptied before it, so that it pays for its pinned blocks
  (``cudaHostAlloc``) and device memory (``cudaMalloc``).
- **64 tasks** copying at once (16 MB, in and out) while a ticker task
  sleeps 1 ms in a loop: how late it wakes, next to the same ticker alone;
  the first round with every pool empty, then a few rounds warm (pageable:
  the target), then the same on pinned arrays.
- **Churn**: 100,000 copies of random sizes (4 KB - 1 MB, both directions,
  pinned and pageable) in gathered batches of 64 (``--quick``: 5,000):
  pinned memory in use, held values, CUDA events in use, threads and file
  descriptors before and after.
- **Allocator**: ``cupy.empty(1024)`` allocate + free through cudafut's
  allocator wrapper against CuPy's pool alone; ``record_stream()`` + free.

Memory: per size at most one pinned and one pageable array of that size, one
device array plus one copy result, alive at once (CuPy's and cudafut's pools
cache blocks of the size; both are emptied between sizes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import cudafut
from cudafut import _memory, _pinned, _pools

from .support.common import Progress, error_line, meta_of, pyplot, save_figure

NAME = "copies"

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
SIZES = (4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB, GB)
QUICK_SIZES = (4 * KB, MB, 16 * MB, 256 * MB)
MIN_REPS = 3

H2D, D2H = "h2d", "d2h"
DIRECTIONS = {H2D: "host to device", D2H: "device to host"}

# The paths (keys in the JSON and rows of the tables).
RAW = "raw cudaMemcpyAsync (pinned)"
TO_DEVICE_PINNED = "cudafut to_device(pinned)"
CUPY_ASARRAY = "cupy.asarray(pageable)"
TO_DEVICE_PAGEABLE = "cudafut to_device(pageable)"
TO_HOST_PINNED = "cudafut to_host(out=pinned)"
TO_HOST_POOL = "cudafut to_host() (pool result)"
CUPY_GET = "get(out=pageable)"
TO_HOST_PAGEABLE = "cudafut to_host(out=pageable)"
PATHS = {
    H2D: (RAW, TO_DEVICE_PINNED, CUPY_ASARRAY, TO_DEVICE_PAGEABLE),
    D2H: (RAW, TO_HOST_PINNED, TO_HOST_POOL, CUPY_GET, TO_HOST_PAGEABLE),
}

# The ratios of bandwidth: (direction, name, path, baseline, target, from bytes).
RATIOS = (
    (H2D, "to_device(pinned) / raw", TO_DEVICE_PINNED, RAW, 0.95, 4 * MB),
    (D2H, "to_host(out=pinned) / raw", TO_HOST_PINNED, RAW, 0.95, 4 * MB),
    (D2H, "to_host() pool / raw", TO_HOST_POOL, RAW, 0.95, 4 * MB),
    (H2D, "to_device(pageable) / cupy.asarray", TO_DEVICE_PAGEABLE, CUPY_ASARRAY, 3.0, 16 * MB),
    (D2H, "to_host(out=pageable) / get(out=)", TO_HOST_PAGEABLE, CUPY_GET, 3.0, 16 * MB),
)
#: Streamed: copies issued back to back, this many bytes in flight (2 to 16
#: copies), then all waited for: the throughput, without one wake-up per copy.
STREAMED_BYTES = 256 * MB

#: Target: a cudafut call returns within this, at any size (warm).
CALL_TARGET_US = 50.0

# The concurrent tasks.
TASKS = 64
TASK_BYTES = 16 * MB
TICK_S = 1e-3
STALL_TARGET_MS = 2.0

# The churn.
CHURN = 100_000
QUICK_CHURN = 5_000
BATCH = 64
CHURN_MIN, CHURN_MAX = 4 * KB, MB
SETTLE_S = 2.0
#: Longest a gathered batch (churn) or the 64 tasks may take: a hang becomes
#: an error in the result instead of a suite that never ends.
HANG_S = 120.0
COUNTERS = ("pinned_in_use", "pinned_blocks_in_use", "held", "events_in_use", "threads", "fds")

# CuPy, cupyx and the GPU helpers, bound by _load() when run() starts, so that
# importing this module (report.py does) needs no CuPy.
cp: Any = None
gpu: Any = None


def _load() -> None:
    global cp, gpu
    cp = importlib.import_module("cupy")
    gpu = importlib.import_module(".support.gpu", __package__)


def steps(quick: bool) -> int:
    return len(QUICK_SIZES if quick else SIZES) + 3


def reps_for(nbytes: int, quick: bool) -> int:
    """Rounds at a size: about 4 GB (quick: 1 GB) per path, 3 to 300 (100)."""
    budget, most = (GB, 100) if quick else (4 * GB, 300)
    return max(MIN_REPS, min(most, budget // nbytes))


def _size_name(nbytes: int) -> str:
    for unit, name in ((GB, "GB"), (MB, "MB"), (KB, "KB")):
        if nbytes >= unit:
            return f"{nbytes / unit:g} {name}"
    return f"{nbytes} B"


# -- run (CuPy, a GPU) -----------------------------------------------------------------


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    _load()
    sizes = QUICK_SIZES if quick else SIZES
    res: dict[str, Any] = {
        "sizes": list(sizes),
        "reps": [reps_for(n, quick) for n in sizes],
        "bandwidth": {d: {p: [] for p in PATHS[d]} for d in PATHS},
        "errors": [],
        "pinned_limit": cudafut.memory_statistics().pinned_limit,
        "copy_streams": _pools.COPY_STREAMS_PER_POOL,
    }
    with gpu.stream:
        _warm_up()
        for nbytes in sizes:
            try:
                rows = _one_size(nbytes, reps_for(nbytes, quick), res["errors"])
            except Exception as exc:  # noqa: BLE001 - keep the other sizes
                res["errors"].append(f"{_size_name(nbytes)}: {error_line(exc)}")
                rows = {}
            for (direction, path), row in rows.items():
                res["bandwidth"][direction][path].append(row)
            _empty_pools()
            progress.step(f"copies {_size_name(nbytes)}: " + _size_line(rows))
        for key, part, what in (
            ("concurrent", lambda: _concurrent(quick), "64 tasks copying"),
            ("churn", lambda: _churn(QUICK_CHURN if quick else CHURN), "churn"),
            ("allocator", lambda: _allocator(quick), "allocator"),
        ):
            try:
                res[key] = part()
            except Exception as exc:  # noqa: BLE001 - keep the other parts
                res[key] = {"error": error_line(exc)}
            _empty_pools()
            progress.step(f"copies: {what}: {_part_line(key, res[key])}")
    res["ratios"] = _ratios(res)
    res["targets"] = _targets(res)
    return res


def _size_line(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    def gbs(d: str, p: str) -> str:
        row = rows.get((d, p))
        return f"{row['gbs']:.1f}" if row else "-"

    return (
        f"H2D raw {gbs(H2D, RAW)}, pinned {gbs(H2D, TO_DEVICE_PINNED)}, pageable "
        f"{gbs(H2D, TO_DEVICE_PAGEABLE)} (cupy {gbs(H2D, CUPY_ASARRAY)}); D2H raw {gbs(D2H, RAW)}, pinned "
        f"{gbs(D2H, TO_HOST_PINNED)}, pageable {gbs(D2H, TO_HOST_PAGEABLE)} (get {gbs(D2H, CUPY_GET)}) GB/s"
    )


def _part_line(key: str, part: dict[str, Any]) -> str:
    if "error" in part:
        return "failed: " + str(part["error"])[:200]
    if key == "concurrent":
        return (
            f"ticker late max {part['copying']['late_max_ms']:.2f} ms (alone "
            f"{part['baseline']['late_max_ms']:.2f}), {part['aggregate_gbs']:.1f} GB/s"
        )
    if key == "churn":
        return f"{part['copies']} copies, back to start: {all(part['returned'].values())}"
    if "skipped" in part:
        return "skipped: " + str(part["skipped"])
    return f"wrapper {part['wrapper_us']:.2f} us, CuPy pool {part['cupy_pool_us']:.2f} us per allocation"


def _empty_pools() -> None:
    """Everything cached freed: CuPy's device and pinned pools, cudafut's
    pinned pool (after the device is idle and the dropped copies' blocks
    came back)."""
    gc.collect()
    gpu.sync_all()
    _settle(0.5)  # short: called before every first call
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    _pinned.pool.free_cached()


def _settle(limit: float = SETTLE_S) -> float:
    """Wait (at most ``limit`` seconds) until the watcher thread holds
    nothing; the seconds it took."""
    t0 = time.perf_counter()
    while cudafut.memory_statistics().held and time.perf_counter() - t0 < limit:
        time.sleep(0.01)
    return time.perf_counter() - t0


def _warm_up() -> None:
    """Each cudafut path once, small and staged: the copy streams, the copy
    threads and the waiter exist before the first size is measured."""
    for n in (1024, MB // 4):
        host = np.ones(n, np.uint32)
        pinned = cudafut.empty_pinned(n, np.uint32)
        dev = cudafut.to_device(host).result()
        cudafut.to_device(pinned).result()
        cudafut.to_host(dev).result()
        cudafut.to_host(dev, out=host).result()
        cudafut.to_host(dev, out=pinned).result()
        del dev, pinned
    _empty_pools()


def _fill(a: Any, add: int = 0) -> None:
    """``a`` (uint32, host) = arange + add, written in slices (no big temporary)."""
    flat = a.reshape(-1)
    step = 1 << 24
    for o in range(0, flat.size, step):
        m = min(step, flat.size - o)
        flat[o : o + m] = np.arange(o + add, o + add + m, dtype=np.uint32)


@dataclasses.dataclass
class _Path:
    direction: str
    name: str
    call: Callable[[], Any]  # enqueues the copy; what it returns goes to finish
    finish: Callable[[Any], Any]  # waits for it; returns the array copied into
    warm: int = 1  # calls before the timed rounds (the first one is timed as "first")
    dest: Any = None  # the host array a device-to-host copy writes into, if ours


def _result(fut: Any) -> Any:
    return fut.result()


def _once(p: _Path) -> tuple[float, float]:
    """(seconds the call took to return, seconds until the copy was done)."""
    t0 = time.perf_counter()
    handle = p.call()
    t1 = time.perf_counter()
    p.finish(handle)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0


def _one_size(nbytes: int, reps: int, errors: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    n = nbytes // 4
    stream = gpu.stream
    sync = stream.synchronize
    memcpy = cp.cuda.runtime.memcpyAsync
    h2d, d2h = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
    to_device, to_host = cudafut.to_device, cudafut.to_host
    # A copy stream per call, round robin, and CuPy's pool caches per stream:
    # this many to_device() calls before the rounds, so that every copy
    # stream's arena has a block of this size (as after a while in a service).
    arenas = _pools.COPY_STREAMS_PER_POOL
    idx = np.linspace(0, n - 1, min(n, 4097)).astype(np.int64)
    idx_dev = cp.asarray(idx)
    marked = (idx + 7).astype(np.uint32)  # the checks' pattern: arange + 7

    def synced(array: Any) -> Callable[[Any], Any]:
        def finish(_handle: Any) -> Any:
            sync()
            return array

        return finish

    def sync_returned(handle: Any) -> Any:
        sync()
        return handle

    def check(p: _Path) -> None:
        if p.dest is not None:
            p.dest.fill(0)  # a copy that writes nothing cannot pass
        data = p.finish(p.call())
        got = cp.asnumpy(data[idx_dev]) if isinstance(data, cp.ndarray) else data.reshape(-1)[idx]
        if not np.array_equal(got, marked):
            errors.append(f"{_size_name(nbytes)} {DIRECTIONS[p.direction]}, {p.name}: wrong data")

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    dev = cp.arange(n, dtype=cp.uint32)

    # Group A: pageable memory and the pool result (no pinned array of ours).
    pageable = np.empty(n, np.uint32)
    _fill(pageable)
    sync()
    group_a = [
        _Path(D2H, TO_HOST_POOL, lambda: to_host(dev), _result),
        _Path(H2D, CUPY_ASARRAY, lambda: cp.asarray(pageable), sync_returned),
        _Path(H2D, TO_DEVICE_PAGEABLE, lambda: to_device(pageable), _result, warm=arenas),
        _Path(D2H, CUPY_GET, lambda: dev.get(out=pageable), sync_returned, dest=pageable),
        _Path(D2H, TO_HOST_PAGEABLE, lambda: to_host(dev, out=pageable), _result, dest=pageable),
    ]
    rows.update(_measure(group_a, nbytes, reps))
    dev += 7
    for p in group_a:
        if p.direction == D2H:
            check(p)
    dev -= 7
    _fill(pageable, 7)
    for p in group_a:
        if p.direction == H2D:
            check(p)
    gc.collect()
    cp.get_default_pinned_memory_pool().free_all_blocks()  # cupy.asarray's staging

    # Group B: one pinned array of ours (from cudafut's pool: the block the
    # pool results left there).
    pinned = cudafut.empty_pinned(n, np.uint32)
    _fill(pinned)
    pin_ptr, dev_ptr, s_ptr = pinned.ctypes.data, dev.data.ptr, stream.ptr
    group_b = [
        _Path(H2D, RAW, lambda: memcpy(dev_ptr, pin_ptr, nbytes, h2d, s_ptr), synced(dev)),
        _Path(H2D, TO_DEVICE_PINNED, lambda: to_device(pinned), _result, warm=arenas),
        _Path(D2H, RAW, lambda: memcpy(pin_ptr, dev_ptr, nbytes, d2h, s_ptr), synced(pinned), dest=pinned),
        _Path(D2H, TO_HOST_PINNED, lambda: to_host(dev, out=pinned), _result, dest=pinned),
    ]
    rows.update(_measure(group_b, nbytes, reps))
    dev += 7
    for p in group_b:
        if p.direction == D2H:
            check(p)
    dev -= 7
    _fill(pinned, 7)
    for p in group_b[::-1]:  # the raw copy last: it overwrites dev
        if p.direction == H2D:
            check(p)
    sync()
    return rows


def _measure(paths: list[_Path], nbytes: int, reps: int) -> dict[tuple[str, str], dict[str, Any]]:
    """The first call of each path (every pool emptied before it: cold),
    their warm-up calls, then ``reps`` rounds of all of them, interleaved."""
    first: dict[str, tuple[float, float]] = {}
    for p in paths:
        _empty_pools()
        first[p.name] = _once(p)
    for p in paths:
        for _ in range(p.warm - 1):
            _once(p)
    calls: dict[str, list[float]] = {p.name: [] for p in paths}
    totals: dict[str, list[float]] = {p.name: [] for p in paths}
    for _ in range(reps):
        for p in paths:
            call, total = _once(p)
            calls[p.name].append(call)
            totals[p.name].append(total)
    streamed: dict[str, float] = {}
    k = max(2, min(16, STREAMED_BYTES // nbytes))
    for p in paths:
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            handles = [p.call() for _ in range(k)]
            for handle in handles:
                p.finish(handle)
            best = min(best, time.perf_counter() - t0)
            del handles
        streamed[p.name] = k * nbytes / best / 1e9
    rows = {}
    for p in paths:
        med = statistics.median(totals[p.name])
        cs = sorted(calls[p.name])
        rows[(p.direction, p.name)] = {
            "bytes": nbytes,
            "gbs": nbytes / med / 1e9,
            "seconds_median": med,
            "seconds_min": min(totals[p.name]),
            "reps": reps,
            "call_p50_us": cs[len(cs) // 2] * 1e6,
            "call_max_us": cs[-1] * 1e6,
            "first_call_us": first[p.name][0] * 1e6,
            "first_total_ms": first[p.name][1] * 1e3,
            "streamed_gbs": streamed[p.name],
            "streamed_copies": k,
        }
    return rows


def _lateness(late: list[float], seconds: float) -> dict[str, Any]:
    s = sorted(late) or [0.0]
    return {
        "ticks": len(late),
        "seconds": seconds,
        "late_p50_ms": s[len(s) // 2] * 1e3,
        "late_p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
        "late_max_ms": s[-1] * 1e3,
    }


def _concurrent(quick: bool) -> dict[str, Any]:
    """64 tasks, each: ``to_device(its 16 MB array)``, +1 on the GPU,
    ``to_host(.., out=the same array)``, awaited; a ticker task sleeping 1 ms
    meanwhile, and the same ticker alone before. Three phases: the first
    round on pageable arrays with every pool empty (a service starting:
    ``cudaHostAlloc`` and ``cudaMalloc`` of its blocks), then a few rounds
    warm (the target), then the same on pinned arrays (no copy threads)."""
    rounds = 2 if quick else 5
    alone_s = 0.5 if quick else 1.0
    n = TASK_BYTES // 4
    bufs = [np.full(n, k, np.uint32) for k in range(TASKS)]
    pins = [cudafut.empty_pinned(n, np.uint32) for _ in range(TASKS)]
    for k, pin in enumerate(pins):
        pin.fill(k)
    calls: list[float] = []

    async def ticker(late: list[float], stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late.append(time.perf_counter() - t - TICK_S)

    async def task(buf: Any, rounds: int) -> None:
        for _ in range(rounds):
            t = time.perf_counter()
            fut = cudafut.to_device(buf)
            calls.append(time.perf_counter() - t)
            d = await fut
            d += 1
            t = time.perf_counter()
            back = cudafut.to_host(d, out=buf)
            calls.append(time.perf_counter() - t)
            await back
            del d, fut, back

    async def phase(arrays: list[Any], rounds: int) -> dict[str, Any]:
        late: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(late, stop))
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        gc.callbacks.append(gc_timer)
        try:
            await asyncio.wait_for(asyncio.gather(*(task(b, rounds) for b in arrays)), HANG_S)
        finally:
            gc.callbacks.remove(gc_timer)
        wall = time.perf_counter() - t0
        stop.set()
        await tick
        return {**_lateness(late, wall), "wall_s": wall}

    async def go() -> dict[str, Any]:
        alone: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(alone, stop))
        await asyncio.sleep(alone_s)
        stop.set()
        await tick
        first = await phase(bufs, 1)
        calls.clear()
        copying = await phase(bufs, rounds)
        cs = sorted(calls)
        pinned = await phase(pins, rounds)
        return {
            "baseline": _lateness(alone, alone_s),
            "first_round": first,
            "copying": copying,
            "pinned": pinned,
            "wall_s": copying["wall_s"],
            "call_p50_us": cs[len(cs) // 2] * 1e6,
            "call_max_us": cs[-1] * 1e6,
        }

    # The garbage collector's pauses while the tasks copy: a long one stalls
    # the loop whatever the copies do.
    gc_pauses: list[float] = []
    gc_start = [0.0]

    def gc_timer(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_start[0])

    _empty_pools()
    out = asyncio.run(go())
    moved = TASKS * rounds * 2 * TASK_BYTES
    out.update(
        tasks=TASKS,
        rounds=rounds,
        bytes_per_copy=TASK_BYTES,
        aggregate_gbs=moved / out["wall_s"] / 1e9,
        pinned_aggregate_gbs=moved / out["pinned"]["wall_s"] / 1e9,
        correct=all(bool((b == k + 1 + rounds).all()) for k, b in enumerate(bufs))
        and all(bool((b == k + rounds).all()) for k, b in enumerate(pins)),
        gc_collections=len(gc_pauses),
        gc_max_pause_ms=max(gc_pauses, default=0.0) * 1e3,
    )
    return out


async def _awaited(fut: Any) -> Any:
    return await fut


def _snapshot() -> dict[str, int]:
    m = cudafut.memory_statistics()
    p = _pools.pool_statistics()
    return {
        "pinned_in_use": m.pinned_in_use,
        "pinned_blocks_in_use": m.pinned_blocks_in_use,
        "held": m.held,
        "events_in_use": sum(p.events_in_use.values()),
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        # Not compared, for the record:
        "pinned_cached": m.pinned_cached,
        "pinned_host_allocs": m.pinned_host_allocs,
        "pinned_refused": m.pinned_refused,
        "events_created": p.events_created,
        "frees_delayed": m.frees_delayed,
    }


def _churn(copies: int) -> dict[str, Any]:
    """``copies`` copies of random sizes, both directions, pinned and
    pageable, in gathered batches of 64 under asyncio; the counters before
    (after one warm-up batch) and after (gc, settled)."""
    row = MB // 4
    pinned = cudafut.empty_pinned((BATCH, row), np.uint32)
    pageable = np.zeros((BATCH, row), np.uint32)
    dev = cp.zeros((BATCH, row), cp.uint32)
    gpu.sync_all()
    rng = random.Random(10)
    lo, hi = math.log(CHURN_MIN // 4), math.log(CHURN_MAX // 4)
    kinds = [0, 0, 0, 0, 0]

    def one(slot: int) -> Any:
        elems = min(row, int(math.exp(rng.uniform(lo, hi))))
        kind = rng.randrange(5)
        kinds[kind] += 1
        if kind == 0:
            return cudafut.to_device(pinned[slot, :elems])
        if kind == 1:
            return cudafut.to_device(pageable[slot, :elems])
        if kind == 2:
            return cudafut.to_host(dev[slot, :elems], out=pinned[slot, :elems])
        if kind == 3:
            return cudafut.to_host(dev[slot, :elems], out=pageable[slot, :elems])
        return cudafut.to_host(dev[slot, :elems])

    async def batch(n: int) -> None:
        await asyncio.wait_for(_awaited(cudafut.gather(*(one(slot) for slot in range(n)))), HANG_S)

    async def settled() -> float:
        gc.collect()
        gpu.sync_all()
        t0 = time.perf_counter()
        while cudafut.memory_statistics().held and time.perf_counter() - t0 < SETTLE_S:
            await asyncio.sleep(0.01)
        gc.collect()
        return time.perf_counter() - t0

    async def go() -> dict[str, Any]:
        await batch(BATCH)  # warm-up
        await settled()
        start = _snapshot()
        t0 = time.perf_counter()
        for done in range(0, copies, BATCH):
            await batch(min(BATCH, copies - done))
        seconds = time.perf_counter() - t0
        settle_s = await settled()
        end = _snapshot()
        return {"start": start, "end": end, "seconds": seconds, "settle_s": settle_s}

    out = asyncio.run(go())
    out.update(
        copies=copies,
        batch=BATCH,
        copies_per_s=copies / out["seconds"],
        kinds=dict(
            zip(
                (
                    "to_device pinned",
                    "to_device pageable",
                    "to_host out=pinned",
                    "to_host out=pageable",
                    "to_host pool",
                ),
                kinds,
                strict=True,
            )
        ),
        returned={k: out["end"][k] <= out["start"][k] for k in COUNTERS},
    )
    return out


def _allocator(quick: bool) -> dict[str, Any]:
    """``cupy.empty(1024, uint8)`` allocate + free: through cudafut's wrapper
    (the allocator in force) and through the allocator it wraps (set for the
    measurement, then restored), interleaved; ``record_stream()`` + free."""
    wrapper = cp.cuda.get_allocator()
    inner = _memory._installed_over
    res: dict[str, Any] = {"wrapper_installed": hasattr(wrapper, "cudafut_wraps")}
    if not res["wrapper_installed"] or inner is None:
        res["skipped"] = "cudafut's allocator wrapper is not installed (CUDAFUT_WRAP_ALLOCATOR=0?)"
        return res
    n, rounds = (5_000, 3) if quick else (20_000, 5)
    empty, u8, record_stream = cp.empty, cp.uint8, cudafut.record_stream
    other = cp.cuda.Stream(non_blocking=True)

    def alloc_free() -> float:
        t = time.perf_counter()
        for _ in range(n):
            empty(1024, dtype=u8)
        return (time.perf_counter() - t) / n

    def record_free(count: int) -> float:
        t = time.perf_counter()
        for _ in range(count):
            a = empty(1024, dtype=u8)
            record_stream(a, other)
            del a
        return (time.perf_counter() - t) / count

    pool: list[float] = []
    wrapped: list[float] = []
    recorded: list[float] = []
    try:
        for _ in range(rounds + 1):  # the first round warms up
            cp.cuda.set_allocator(inner)
            pool.append(alloc_free())
            cp.cuda.set_allocator(wrapper)
            wrapped.append(alloc_free())
            recorded.append(record_free(n))
    finally:
        cp.cuda.set_allocator(wrapper)
    # The free while ``other`` is still busy: the block waits for it.
    busy_n = 2000
    before = cudafut.memory_statistics()
    gpu.work(int(0.2e9), on=other)
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(other)
    busy = record_free(busy_n)
    still_busy = not ev.done
    held = cudafut.memory_statistics().held
    other.synchronize()
    settle_s = _settle()
    after = cudafut.memory_statistics()
    med = statistics.median
    res.update(
        allocations=n,
        rounds=rounds,
        cupy_pool_us=med(pool[1:]) * 1e6,
        wrapper_us=med(wrapped[1:]) * 1e6,
        record_stream_idle_us=med(recorded[1:]) * 1e6,
        record_stream_busy_us=busy * 1e6,
        busy_calls=busy_n,
        busy_stream_still_running=still_busy,
        busy_held_after_loop=held - before.held,
        busy_frees_delayed=after.frees_delayed - before.frees_delayed,
        held_after_settle=after.held,
        settle_s=settle_s,
    )
    res["wrapper_extra_us"] = res["wrapper_us"] - res["cupy_pool_us"]
    res["record_stream_idle_extra_us"] = res["record_stream_idle_us"] - res["wrapper_us"]
    res["record_stream_busy_extra_us"] = res["record_stream_busy_us"] - res["wrapper_us"]
    return res


# -- figures, targets, Markdown and plots (no CuPy) ------------------------------------


def _rows(result: dict[str, Any], direction: str, path: str) -> dict[int, dict[str, Any]]:
    return {row["bytes"]: row for row in result["bandwidth"][direction].get(path, [])}


def _ratios(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per ratio: {size in bytes (as a string, JSON keys): path / baseline}."""
    out: dict[str, dict[str, Any]] = {}
    for direction, name, path, base, _target, _from in RATIOS:
        mine, ref = _rows(result, direction, path), _rows(result, direction, base)
        out[name] = {str(b): mine[b]["gbs"] / ref[b]["gbs"] for b in sorted(mine) if b in ref}
        out[name + ", streamed"] = {
            str(b): mine[b]["streamed_gbs"] / ref[b]["streamed_gbs"]
            for b in sorted(mine)
            if b in ref and "streamed_gbs" in mine[b]
        }
    return out


def _targets(result: dict[str, Any]) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    ratios = result.get("ratios") or _ratios(result)
    for _direction, name, _path, _base, target, start in RATIOS:
        for label in (name, name + ", streamed"):
            big = [v for b, v in ratios.get(label, {}).items() if int(b) >= start]
            if big:
                checks[f"{label} >= {target:g} from {_size_name(start)}"] = min(big) >= target
    cudafut_paths = [(d, p) for d in PATHS for p in PATHS[d] if p.startswith("cudafut")]
    calls = [row for d, p in cudafut_paths for row in result["bandwidth"][d].get(p, [])]
    if calls:
        checks[f"cudafut calls return within {CALL_TARGET_US:g} µs, p50, every size"] = all(
            r["call_p50_us"] <= CALL_TARGET_US for r in calls
        )
        checks[f"cudafut calls return within {CALL_TARGET_US:g} µs, max (warm), every size"] = all(
            r["call_max_us"] <= CALL_TARGET_US for r in calls
        )
    conc = result.get("concurrent", {})
    if "copying" in conc:
        checks[f"64 tasks copying (warm): the loop never late by more than {STALL_TARGET_MS:g} ms"] = (
            conc["copying"]["late_max_ms"] <= STALL_TARGET_MS
        )
    churn = result.get("churn", {})
    if "returned" in churn:
        checks[f"{churn['copies']:,} copies: pinned memory, held values, events, threads, fds back"] = all(
            churn["returned"].values()
        )
    return checks


def _f(row: dict[str, Any] | None, key: str, fmt: str = "{:.1f}") -> str:
    return "-" if row is None else fmt.format(row[key])


def markdown(result: dict[str, Any]) -> list[str]:
    sizes = result["sizes"]
    ratios = result.get("ratios") or _ratios(result)
    lines = [
        "## copies: host <-> device, `to_device` / `to_host`",
        "",
        "Bandwidth in GB/s: bytes / median wall time of one copy, ended by `stream.synchronize()` or "
        "`result()`; the paths interleaved in rounds (rounds per size: "
        + ", ".join(f"{_size_name(b)} {r}" for b, r in zip(sizes, result["reps"], strict=True))
        + "). Raw: `cudaMemcpyAsync` between pinned memory and a device array on a non-blocking "
        "stream. Pinned memory from `cudafut.empty_pinned`; pageable: `numpy.empty`. Ratio: the "
        "cudafut path / its baseline.",
        "",
    ]
    for direction, title in DIRECTIONS.items():
        names = [r for r in RATIOS if r[0] == direction]
        paths = PATHS[direction]
        lines += _streamed_markdown(result, direction, title, ratios)
        lines += [
            f"### {title}",
            "",
            "| size | " + " | ".join(paths) + " | " + " | ".join(r[1] for r in names) + " |",
            "|---|" + "---|" * (len(paths) + len(names)),
        ]
        by_path = {p: _rows(result, direction, p) for p in paths}
        for b in sizes:
            cells = [_f(by_path[p].get(b), "gbs") for p in paths]
            cells += [f"{ratios[r[1]][str(b)]:.2f}" if str(b) in ratios.get(r[1], {}) else "-" for r in names]
            lines.append(f"| {_size_name(b)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "### The calling thread",
        "",
        "How long each call takes to return, µs: p50 / max over the rounds (warm); in brackets the "
        "first call of the path at the size, cold: cudafut's pinned pool and CuPy's pinned and "
        "device pools emptied just before, so it pays for the pinned blocks (`cudaHostAlloc`) and "
        "device memory (`cudaMalloc`) it needs; copy streams and copy threads exist already. "
        "CuPy's pageable copies block for the whole copy; raw `cudaMemcpyAsync` is the floor.",
        "",
    ]
    all_paths = [(d, p) for d in PATHS for p in PATHS[d]]
    header = [f"{p} ({d.upper()})" if p == RAW else p for d, p in all_paths]
    lines += ["| size | " + " | ".join(header) + " |", "|---|" + "---|" * len(all_paths)]
    cols = {(d, p): _rows(result, d, p) for d, p in all_paths}
    for b in sizes:
        cells = []
        for key in all_paths:
            row = cols[key].get(b)
            cells.append(
                "-"
                if row is None
                else f"{row['call_p50_us']:.0f} / {row['call_max_us']:.0f} ({row['first_call_us']:.0f})"
            )
        lines.append(f"| {_size_name(b)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += _concurrent_markdown(result.get("concurrent"))
    lines += _churn_markdown(result.get("churn"))
    lines += _allocator_markdown(result.get("allocator"))
    targets = result.get("targets") or _targets(result)
    if targets:
        lines += ["### Targets (issue 10)", ""]
        lines += [f"- {name}: {'met' if ok else '**missed**'}" for name, ok in targets.items()]
        lines.append("")
    if result.get("errors"):
        lines += ["### Errors", ""] + [f"- **{e}**" for e in result["errors"]] + [""]
    return lines


def _streamed_markdown(
    result: dict[str, Any], direction: str, title: str, ratios: dict[str, dict[str, Any]]
) -> list[str]:
    paths = PATHS[direction]
    names = [r[1] + ", streamed" for r in RATIOS if r[0] == direction]
    by_path = {p: _rows(result, direction, p) for p in paths}
    if not any("streamed_gbs" in row for rows in by_path.values() for row in rows.values()):
        return []
    lines = [
        f"### {title}, streamed",
        "",
        f"GB/s with copies issued back to back ({STREAMED_BYTES >> 20} MB in flight, 2 to 16 "
        "copies), then all waited for (best of 3): throughput, without one wake-up per copy.",
        "",
        "| size | " + " | ".join(paths) + " | " + " | ".join(names) + " |",
        "|---|" + "---|" * (len(paths) + len(names)),
    ]
    for b in result["sizes"]:
        cells = [
            _f(by_path[p].get(b), "streamed_gbs") if "streamed_gbs" in by_path[p].get(b, {}) else "-"
            for p in paths
        ]
        cells += [f"{ratios[n][str(b)]:.2f}" if str(b) in ratios.get(n, {}) else "-" for n in names]
        lines.append(f"| {_size_name(b)} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _concurrent_markdown(conc: dict[str, Any] | None) -> list[str]:
    if not conc:
        return []
    if "error" in conc:
        return ["### 64 tasks copying at once", "", f"**Failed**: {conc['error']}", ""]
    lines = [
        "### 64 tasks copying at once",
        "",
        f"{conc['tasks']} asyncio tasks, each {conc['rounds']} rounds of `to_device` of its "
        f"{_size_name(conc['bytes_per_copy'])} array, +1 on the GPU, `to_host(out=` the same "
        "array `)`, awaited; meanwhile a task sleeps 1 ms in a loop: how late it wakes, ms, next to "
        "the same ticker alone (before). First round: pageable arrays, every pool emptied before "
        "(a service's first requests pay for `cudaHostAlloc` and `cudaMalloc`); then the rounds on "
        "pageable arrays, warm (staged by the copy threads); then the same on pinned arrays "
        "(`cudafut.empty_pinned`: one `cudaMemcpyAsync` each, no copy thread). "
        f"Data right: {conc['correct']}; pageable {conc['aggregate_gbs']:.1f} GB/s in total over "
        f"{conc['wall_s']:.2f} s"
        + (f", pinned {conc['pinned_aggregate_gbs']:.1f} GB/s" if "pinned_aggregate_gbs" in conc else "")
        + f"; pageable calls return in {conc['call_p50_us']:.0f} µs (p50), "
        f"{conc['call_max_us']:.0f} µs (max)"
        + (
            f"; {conc['gc_collections']} garbage collections meanwhile, the longest "
            f"{conc['gc_max_pause_ms']:.2f} ms."
            if "gc_collections" in conc
            else "."
        ),
        "",
        "| ticker | ticks | late p50 | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for name, key in (
        ("alone", "baseline"),
        ("first round, pools empty (pageable)", "first_round"),
        ("with 64 tasks copying pageable, warm", "copying"),
        ("with 64 tasks copying pinned", "pinned"),
    ):
        q = conc.get(key)
        if q is None:
            continue
        lines.append(
            f"| {name} | {q['ticks']} | {q['late_p50_ms']:.3f} | {q['late_p99_ms']:.3f} | "
            f"{q['late_max_ms']:.3f} |"
        )
    return [*lines, ""]


def _churn_markdown(churn: dict[str, Any] | None) -> list[str]:
    if not churn:
        return []
    if "error" in churn:
        return ["### Churn", "", f"**Failed**: {churn['error']}", ""]
    lines = [
        f"### {churn['copies']:,} copies of random sizes",
        "",
        f"{_size_name(CHURN_MIN)} - {_size_name(CHURN_MAX)} (log-uniform), in gathered batches of "
        f"{churn['batch']} under asyncio: "
        + ", ".join(f"{k} {v}" for k, v in churn["kinds"].items())
        + f"; {churn['copies_per_s']:,.0f} copies/s. Start: after one warm-up batch; end: after "
        f"`gc.collect()` and {churn['settle_s']:.2f} s for the watcher thread to drop what it held.",
        "",
        "| counter | start | end | back |",
        "|---|---|---|---|",
    ]
    for k in churn["start"]:
        back = churn["returned"].get(k)
        mark = "" if back is None else ("yes" if back else "**no**")
        lines.append(f"| {k} | {churn['start'][k]:,} | {churn['end'][k]:,} | {mark} |")
    return [*lines, ""]


def _allocator_markdown(alloc: dict[str, Any] | None) -> list[str]:
    if not alloc:
        return []
    head = ["### Allocator and `record_stream`", ""]
    if "error" in alloc:
        return [*head, f"**Failed**: {alloc['error']}", ""]
    if "skipped" in alloc:
        return [*head, f"Skipped: {alloc['skipped']}.", ""]
    return [
        *head,
        f"`cupy.empty(1024, dtype=cupy.uint8)`, allocated and freed {alloc['allocations']:,} times, "
        f"median of {alloc['rounds']} interleaved rounds, µs per allocation:",
        "",
        "| | µs | over cudafut's wrapper |",
        "|---|---|---|",
        f"| CuPy's pool alone | {alloc['cupy_pool_us']:.2f} | |",
        f"| cudafut's wrapper (in force) | {alloc['wrapper_us']:.2f} | "
        f"{alloc['wrapper_extra_us']:+.2f} over CuPy's pool |",
        f"| + `record_stream(a, other)` before the free, other stream idle | "
        f"{alloc['record_stream_idle_us']:.2f} | {alloc['record_stream_idle_extra_us']:+.2f} |",
        f"| the same, other stream busy (the free waits; {alloc['busy_calls']} calls) | "
        f"{alloc['record_stream_busy_us']:.2f} | {alloc['record_stream_busy_extra_us']:+.2f} |",
        "",
        f"Busy stream: still running at the end of the loop: {alloc['busy_stream_still_running']}; "
        f"frees delayed {alloc['busy_frees_delayed']}, held right after the loop "
        f"{alloc['busy_held_after_loop']}, held {alloc['settle_s']:.2f} s after the stream finished: "
        f"{alloc['held_after_settle']}.",
        "",
    ]


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """Bandwidth against size, one panel per direction, one line per path."""
    if not any(rows for d in result.get("bandwidth", {}).values() for rows in d.values()):
        return []
    plt = pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    ticks = result["sizes"]
    for ax, (direction, title) in zip(axes, DIRECTIONS.items(), strict=True):
        for path in PATHS[direction]:
            rows = result["bandwidth"][direction].get(path) or []
            if not rows:
                continue
            style = "-o" if path.startswith("cudafut") else "--s"
            ax.plot([r["bytes"] for r in rows], [r["gbs"] for r in rows], style, label=path, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [_size_name(b) for b in ticks], fontsize=7)
        ax.set_xlabel("bytes copied")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s (bytes / median time to completion)")
    gpu_name = meta_of(result).get("gpu")
    fig.suptitle("to_device / to_host bandwidth" + (f" ({gpu_name})" if gpu_name else ""))
    return [save_figure(plt, fig, out / f"{stem}-copies.png")]
