"""Section ``tracking``: ``cudafut.Tracked`` arrays and task streams
(``@own_stream``, ``use_task_streams()``), each figure next to the
hand-written CuPy that does the same (issue 11).

- **Per block**: host time of one ``with t.read():`` / ``with t.write():``
  block with nothing in it (no GPU work), timed one by one with
  ``perf_counter_ns`` in batches of ``BATCH``, the scenarios interleaved in
  rounds (the first round is a warm-up); p50 and p99. The cases: nothing to
  wait for (the last writer, and every reader, on this stream; the last
  writer on another stream and finished), one wait (the last writer on
  another stream still running; a write whose other stream's newest reader
  is still running: reads on a second stream and writes on the first
  alternate, only the writes timed), and tracking off (``enabled=False``
  and ``set_tracking(False)``). "Running": a third stream spins
  ``BUSY_NS`` first, which the waited-for work queues behind; a batch in
  which it had finished is counted. Baselines in the same rounds: a
  pre-created ``cupy.cuda.Event`` recorded (what a block without a wait
  leaves on the GPU), ``stream.wait_event()`` + a record (one wait), the
  same with a new ``cupy.cuda.Event()`` each time, a ``with`` of an empty
  Python context manager, and the timer alone (included in every figure,
  not subtracted). Targets: at most 3 µs with nothing to wait for, 5 µs
  with one wait, a few hundred ns (taken as 0.5 µs) with tracking off; p50.
  The tracker's ``statistics()`` over each batch is kept, to show that a
  case did what it says (waits inserted per block).

- **Workloads**: asyncio tasks, each on its own stream, reading and writing
  a shared set of arrays in a seeded random order with kernels of random
  length (a ``%globaltimer`` spin); every strategy runs the same program,
  the strategies interleaved in rounds (order rotated), median wall time
  from the first task's start to the device being idle. Each access is one
  kernel (one thread) on a one-element int64 array that reads the value,
  writes it to the access's slot of ``seen``, spins, and for a write stores
  the value plus a constant (a negative marker meanwhile, which a kernel
  running at the same time as the write counts as an error, as it counts a
  value that changed under a read or a write). Each task yields
  (``await asyncio.sleep(0)``) after every access. The strategies:

  (a) ``Tracked``: the tasks are ``@cudafut.own_stream`` coroutines, each
      access a ``with t.read() as a:`` / ``with t.write() as a:`` block
      around the launch;
  (b) by hand, the same rule with raw CuPy events and the fewest calls: a
      read waits for the last writer, a write for the last writer and the
      newest reader of every other stream since, a stream never waits for
      itself, no completion queries; one event recorded per access (a
      pre-created event per task, array and kind, re-recorded: a newer
      record on a stream implies the older); ``with stream:`` per access;
  (c) CUDA.jl's policy: when an array's last user was another task, wait on
      the host, without blocking the loop, for that task's stream
      (``await cudafut.record(None, stream=...)``, again if the array was
      used meanwhile), then launch; reads and writes alike;
  (d) serial: every task's kernels on one stream, no events (the
      reference floor).

  After every run the program is replayed in NumPy in the order the host
  issued each array's accesses: every value an access saw, every array's
  final value and the error count must match, or the strategy's result is
  reported as wrong, not as a figure. Workloads: the target's case (16
  tasks, 64 arrays, kernels 20-200 µs), then the inputs that hurt tracking:
  tiny kernels (~5 µs: host-bound, overhead is all), 64 tasks, and one array
  shared by all (every access crosses streams). Targets, on the first: (a)
  at least 95 % of (b)'s throughput, and at least 2x (c)'s.

- **Task steps**: a task doing ``N`` ``await asyncio.sleep(0)``, plain, as
  an ``@own_stream`` coroutine, and plain under ``use_task_streams()``;
  µs per step, interleaved rounds, median; added per step (target at most
  2 µs). Also an ``@own_stream`` coroutine that returns at once, awaited
  inline, against a plain one: the cost per call (a stream switch, an event
  record and a wait). With torch imported (``own_stream`` then sets
  PyTorch's current stream too), the same in a separate process (so that
  torch, loaded, changes no other figure), if torch is installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

import cudafut

from .support.common import Progress, error_line, meta_of, pyplot, save_figure

NAME = "tracking"

ROOT = Path(__file__).resolve().parent.parent

# -- per block -------------------------------------------------------------------------

#: Blocks per batch (one setup each); rounds of batches, the first a warm-up.
BATCH = 100
BLOCK_ROUNDS = 60
QUICK_BLOCK_ROUNDS = 10
#: What the waited-for stream runs first, so that it is still running at the
#: end of a batch (a batch takes about 1 ms).
BUSY_NS = 5_000_000

TIMER = "timer alone (two perf_counter_ns)"
WITH_FLOOR = "with an empty Python context manager"
OFF_READ = "read(), Tracked(enabled=False)"
OFF_WRITE = "write(), Tracked(enabled=False)"
OFF_GLOBAL_READ = "read(), set_tracking(False)"
OFF_GLOBAL_WRITE = "write(), set_tracking(False)"
READ_SAME = "read(), last writer on this stream"
WRITE_SAME = "write(), every access on this stream"
READ_DONE = "read(), last writer on another stream, finished"
READ_WAIT = "read(), one wait (last writer on another stream, running)"
WRITE_WAIT = "write(), one wait (a reader on another stream, running)"
RAW_RECORD = "raw: event.record() (pre-created event)"
RAW_WAIT = "raw: stream.wait_event() + event.record()"
RAW_NEW = "raw: stream.wait_event() + new cupy.cuda.Event().record()"
BLOCKS = (
    TIMER,
    WITH_FLOOR,
    OFF_READ,
    OFF_WRITE,
    OFF_GLOBAL_READ,
    OFF_GLOBAL_WRITE,
    READ_SAME,
    WRITE_SAME,
    READ_DONE,
    READ_WAIT,
    WRITE_WAIT,
    RAW_RECORD,
    RAW_WAIT,
    RAW_NEW,
)
#: Target (µs, p50) and baseline of the blocks that have one.
NOTHING_US, ONE_WAIT_US, OFF_US = 3.0, 5.0, 0.5
BLOCK_TARGETS: dict[str, tuple[float, str]] = {
    READ_SAME: (NOTHING_US, RAW_RECORD),
    WRITE_SAME: (NOTHING_US, RAW_RECORD),
    READ_DONE: (NOTHING_US, RAW_RECORD),
    READ_WAIT: (ONE_WAIT_US, RAW_WAIT),
    WRITE_WAIT: (ONE_WAIT_US, RAW_WAIT),
    OFF_READ: (OFF_US, WITH_FLOOR),
    OFF_WRITE: (OFF_US, WITH_FLOOR),
    OFF_GLOBAL_READ: (OFF_US, WITH_FLOOR),
    OFF_GLOBAL_WRITE: (OFF_US, WITH_FLOOR),
}
STAT_FIELDS = ("waits_inserted", "waits_skipped_same_stream", "waits_skipped_complete", "events_recorded")

# -- workloads ---------------------------------------------------------------------------

TRACKED = "(a) Tracked + @own_stream"
BY_HAND = "(b) by hand, fewest events"
CUDAJL = "(c) CUDA.jl-style host wait when crossing tasks"
SERIAL = "(d) serial, one stream"
STRATEGIES = (TRACKED, BY_HAND, CUDAJL, SERIAL)
SHORT = {TRACKED: "a", BY_HAND: "b", CUDAJL: "c", SERIAL: "d"}
WORKLOAD_ROUNDS = 7
QUICK_WORKLOAD_ROUNDS = 2
#: Targets on the first workload: (a) / (b) and (a) / (c), in throughput.
VS_HAND, VS_CUDAJL = 0.95, 2.0


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    label: str
    tasks: int
    arrays: int
    ops: int  # accesses per task
    quick_ops: int
    min_ns: int
    max_ns: int
    write_p: float
    seed: int

    def ops_for(self, quick: bool) -> int:
        return self.quick_ops if quick else self.ops


WORKLOADS = (
    Workload("mixed", "16 tasks, 64 arrays, kernels 20-200 µs", 16, 64, 200, 50, 20_000, 200_000, 0.3, 11),
    Workload(
        "tiny", "16 tasks, 64 arrays, kernels 4-6 µs (host-bound)", 16, 64, 200, 50, 4_000, 6_000, 0.3, 12
    ),
    Workload(
        "many_tasks", "64 tasks, 64 arrays, kernels 20-200 µs", 64, 64, 50, 12, 20_000, 200_000, 0.3, 13
    ),
    Workload(
        "one_array", "16 tasks, one shared array, kernels 20-200 µs", 16, 1, 200, 50, 20_000, 200_000, 0.3, 14
    ),
)
TARGET_WORKLOAD = WORKLOADS[0].name

_ACCESS = r"""
extern "C" __global__ void access(long long* a, long long* seen, long long slot, long long ns,
                                  long long add, int write, unsigned long long* errors) {
    volatile long long* p = a;
    long long v0 = *p;
    seen[slot] = v0;
    if (v0 < 0) atomicAdd(errors, 1ULL);  // a write was running
    if (write) {
        *p = -1 - v0;  // the marker while this write runs
        __threadfence();
    }
    spin(ns);
    long long v1 = *p;
    if (write) {
        if (v1 != -1 - v0) atomicAdd(errors, 1ULL);  // another write ran meanwhile
        *p = v0 + add;
        __threadfence();
    } else if (v1 != v0) {
        atomicAdd(errors, 1ULL);  // a write ran under this read
    }
}
"""

# -- task steps ----------------------------------------------------------------------------

PLAIN = "plain task"
OWN = "@own_stream coroutine as the task"
FACTORY = "plain coroutine under use_task_streams()"
STEP_KINDS = (PLAIN, OWN, FACTORY)
CALL_PLAIN = "plain coroutine awaited inline"
CALL_OWN = "@own_stream coroutine awaited inline"
STEP_TARGET_US = 2.0
STEP_ROUNDS = 7
QUICK_STEP_ROUNDS = 3
TORCH_TIMEOUT_S = 240

# CuPy and the GPU helpers, bound by _load() when run() starts, so that
# importing this module (report.py does) needs no CuPy.
cp: Any = None
gpu: Any = None
#: cudafut, typed loosely: Tracked, set_tracking, own_stream, use_task_streams
#: are looked up when run() runs (a missing one is that part's error).
cf: Any = cudafut


def _load() -> None:
    global cp, gpu
    cp = importlib.import_module("cupy")
    gpu = importlib.import_module(".support.gpu", __package__)


def steps(quick: bool) -> int:
    return 1 + len(WORKLOADS) + 2


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    _load()
    res: dict[str, Any] = {"quick": quick, "errors": []}
    try:
        res["blocks"] = _blocks(quick)
    except Exception as exc:  # noqa: BLE001 - keep the other parts
        res["blocks"] = {"error": error_line(exc)}
    gpu.sync_all()
    progress.step("tracking: per block: " + _blocks_line(res["blocks"]))
    res["workloads"] = {}
    for w in WORKLOADS:
        try:
            res["workloads"][w.name] = _workload(w, quick)
        except Exception as exc:  # noqa: BLE001 - keep the other workloads
            res["workloads"][w.name] = {"label": w.label, "error": error_line(exc)}
        gc.collect()
        gpu.sync_all()
        progress.step(f"tracking: {w.label}: " + _workload_line(res["workloads"][w.name]))
    try:
        res["steps"] = _task_steps(quick)
    except Exception as exc:  # noqa: BLE001
        res["steps"] = {"error": error_line(exc)}
    progress.step("tracking: task steps: " + _steps_line(res["steps"]))
    res["torch_steps"] = _torch_steps(quick)
    progress.step("tracking: task steps, torch imported: " + _steps_line(res["torch_steps"]))
    res["targets"] = _targets(res)
    return res


# -- per block (CuPy, a GPU) ----------------------------------------------------------------


class _Null:
    """The cheapest ``with`` Python has (a class with ``__enter__``/``__exit__``)."""

    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _BlockEnv:
    def __init__(self) -> None:
        self.a = cp.zeros(256, dtype=cp.float32)
        self.s_a = cp.cuda.Stream(non_blocking=True)  # the timed blocks' stream
        self.s_b = cp.cuda.Stream(non_blocking=True)  # the other reader or writer
        self.s_c = cp.cuda.Stream(non_blocking=True)  # the busy stream
        self.events = [cp.cuda.Event(disable_timing=True) for _ in range(BATCH)]
        self.null = _Null()


def _stats(t: Any) -> dict[str, int]:
    s = t.statistics()
    return {f: int(getattr(s, f)) for f in STAT_FIELDS if hasattr(s, f)}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def _busy(env: _BlockEnv) -> Any:
    """The busy stream spins ``BUSY_NS``; an event after it (not done while it spins)."""
    gpu.work(BUSY_NS, on=env.s_c)
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(env.s_c)
    return ev


# Each batch: (samples in ns, tracked blocks run, statistics delta, busy
# stream still running at the end or None). The loops are written out, one
# per case, so that each times only its block.
_Batch = tuple[list[int], int, dict[str, int], bool | None]


def _b_timer(env: _BlockEnv, n: int) -> _Batch:
    pc, out = time.perf_counter_ns, [0] * n
    for i in range(n):
        t0 = pc()
        out[i] = pc() - t0
    return out, 0, {}, None


def _b_with_floor(env: _BlockEnv, n: int) -> _Batch:
    pc, out, null = time.perf_counter_ns, [0] * n, env.null
    for i in range(n):
        t0 = pc()
        with null:
            pass
        out[i] = pc() - t0
    return out, 0, {}, None


def _time_blocks(block: Callable[[], Any], n: int) -> list[int]:
    """ns of each of ``n`` empty ``with block():`` (the timer included)."""
    pc, out = time.perf_counter_ns, [0] * n
    for i in range(n):
        t0 = pc()
        with block():
            pass
        out[i] = pc() - t0
    return out


def _b_off(env: _BlockEnv, n: int, write: bool, globally: bool) -> _Batch:
    t = cf.Tracked(env.a) if globally else cf.Tracked(env.a, enabled=False)
    before = _stats(t)
    previous = cf.set_tracking(False) if globally else None
    try:
        with env.s_a:
            out = _time_blocks(t.write if write else t.read, n)
    finally:
        if globally:
            cf.set_tracking(previous)
    return out, n, _delta(before, _stats(t)), None


def _b_same(env: _BlockEnv, n: int, write: bool) -> _Batch:
    t = cf.Tracked(env.a)
    with env.s_a:
        with t.write():
            pass
        before = _stats(t)
        out = _time_blocks(t.write if write else t.read, n)
    return out, n, _delta(before, _stats(t)), None


def _b_read_done(env: _BlockEnv, n: int) -> _Batch:
    t = cf.Tracked(env.a)
    with env.s_b, t.write():
        pass
    env.s_b.synchronize()
    before = _stats(t)
    with env.s_a:
        out = _time_blocks(t.read, n)
    return out, n, _delta(before, _stats(t)), None


def _b_read_wait(env: _BlockEnv, n: int) -> _Batch:
    t = cf.Tracked(env.a)
    busy = _busy(env)
    with env.s_c, t.write():  # the last writer: queued behind the spin
        pass
    before = _stats(t)
    with env.s_a:
        out = _time_blocks(t.read, n)
    running = not busy.done
    return out, n, _delta(before, _stats(t)), running


def _b_write_wait(env: _BlockEnv, n: int) -> _Batch:
    """Reads on stream B and writes on stream A alternate, everything queued
    behind the busy stream: each read waits for A's last write, each write
    for B's newest read (its last writer is on its own stream). Only the
    writes are timed."""
    pc, out = time.perf_counter_ns, [0] * n
    t = cf.Tracked(env.a)
    busy = _busy(env)
    s_a, s_b = env.s_a, env.s_b
    with env.s_c, t.write():
        pass
    with s_a, t.write():  # waits for the busy stream's write
        pass
    before = _stats(t)
    for i in range(n):
        with s_b, t.read():
            pass
        with s_a:
            t0 = pc()
            with t.write():
                pass
            out[i] = pc() - t0
    running = not busy.done
    return out, 2 * n, _delta(before, _stats(t)), running


def _b_raw_record(env: _BlockEnv, n: int) -> _Batch:
    pc, out, events, s = time.perf_counter_ns, [0] * n, env.events, env.s_a
    with s:
        for i in range(n):
            ev = events[i]
            t0 = pc()
            ev.record(s)
            out[i] = pc() - t0
    return out, 0, {}, None


def _b_raw_wait(env: _BlockEnv, n: int) -> _Batch:
    pc, out, events, s = time.perf_counter_ns, [0] * n, env.events, env.s_a
    busy = _busy(env)
    with s:
        for i in range(n):
            ev = events[i]
            t0 = pc()
            s.wait_event(busy)
            ev.record(s)
            out[i] = pc() - t0
    return out, 0, {}, not busy.done


def _b_raw_new(env: _BlockEnv, n: int) -> _Batch:
    pc, out, s, event = time.perf_counter_ns, [0] * n, env.s_a, cp.cuda.Event
    busy = _busy(env)
    ev = None
    with s:
        for i in range(n):
            t0 = pc()
            s.wait_event(busy)
            ev = event()  # the previous one is destroyed here, in the timed block
            ev.record(s)
            out[i] = pc() - t0
    del ev
    return out, 0, {}, not busy.done


_BLOCK_FUNCS: dict[str, Callable[[_BlockEnv, int], _Batch]] = {
    TIMER: _b_timer,
    WITH_FLOOR: _b_with_floor,
    OFF_READ: lambda env, n: _b_off(env, n, write=False, globally=False),
    OFF_WRITE: lambda env, n: _b_off(env, n, write=True, globally=False),
    OFF_GLOBAL_READ: lambda env, n: _b_off(env, n, write=False, globally=True),
    OFF_GLOBAL_WRITE: lambda env, n: _b_off(env, n, write=True, globally=True),
    READ_SAME: lambda env, n: _b_same(env, n, write=False),
    WRITE_SAME: lambda env, n: _b_same(env, n, write=True),
    READ_DONE: _b_read_done,
    READ_WAIT: _b_read_wait,
    WRITE_WAIT: _b_write_wait,
    RAW_RECORD: _b_raw_record,
    RAW_WAIT: _b_raw_wait,
    RAW_NEW: _b_raw_new,
}


def _blocks(quick: bool) -> dict[str, Any]:
    rounds = QUICK_BLOCK_ROUNDS if quick else BLOCK_ROUNDS
    env = _BlockEnv()
    samples: dict[str, list[int]] = {b: [] for b in BLOCKS}
    blocks: dict[str, int] = dict.fromkeys(BLOCKS, 0)
    stats: dict[str, dict[str, int]] = {b: {} for b in BLOCKS}
    idle: dict[str, int] = dict.fromkeys(BLOCKS, 0)  # batches whose busy stream had finished
    errors: dict[str, str] = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = BLOCKS[r % len(BLOCKS) :] + BLOCKS[: r % len(BLOCKS)]
        for b in order:
            if b in errors:
                continue
            try:
                out, count, delta, running = _BLOCK_FUNCS[b](env, BATCH)
            except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others go on
                errors[b] = error_line(exc)
                continue
            finally:
                gpu.sync_all()
            if r == 0:
                continue
            samples[b] += out
            blocks[b] += count
            for k, v in delta.items():
                stats[b][k] = stats[b].get(k, 0) + v
            if running is False:
                idle[b] += 1
    rows: dict[str, Any] = {}
    for b in BLOCKS:
        if not samples[b]:
            continue
        s = sorted(samples[b])
        rows[b] = {
            "p50_us": s[len(s) // 2] / 1e3,
            "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
            "mean_us": statistics.fmean(s) / 1e3,
            "max_us": s[-1] / 1e3,
            "n": len(s),
            "tracked_blocks": blocks[b],
            "stats": stats[b],
            "batches_busy_stream_done": idle[b],
        }
    return {"batch": BATCH, "rounds": rounds, "busy_ns": BUSY_NS, "rows": rows, "errors": errors}


# -- workloads (CuPy, a GPU) ------------------------------------------------------------


@dataclasses.dataclass
class _Op:
    array: int
    write: bool
    tail: tuple[Any, ...]  # the kernel's arguments after the array
    gid: int  # the access's slot in ``seen``
    ns: int
    add: int


@dataclasses.dataclass
class _Program:
    tasks: list[list[_Op]]
    arrays: int
    total: int
    gpu_ns: int  # sum of the kernels' durations


class _Env:
    """The arrays, outputs, kernel, streams and events of one workload."""

    def __init__(self, w: Workload) -> None:
        module = cp.RawModule(code=_kernel_source())
        self.kernel = module.get_function("access")
        self.arrays = [cp.zeros(1, dtype=cp.int64) for _ in range(w.arrays)]
        self.seen = cp.zeros(w.tasks * w.ops, dtype=cp.int64)
        self.errors = cp.zeros(1, dtype=cp.uint64)
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(w.tasks)]
        self.serial = cp.cuda.Stream(non_blocking=True)
        # (b)'s events: per task, per array, one for its writes, one for its reads.
        self.ev_w = [[cp.cuda.Event(disable_timing=True) for _ in range(w.arrays)] for _ in range(w.tasks)]
        self.ev_r = [[cp.cuda.Event(disable_timing=True) for _ in range(w.arrays)] for _ in range(w.tasks)]

    def reset(self) -> None:
        for a in self.arrays:
            a.fill(0)
        self.seen.fill(-(1 << 40))
        self.errors.fill(0)
        gpu.sync_all()


def _kernel_source() -> str:
    from cudafut._kernels import SPIN

    return SPIN + _ACCESS


def _program(w: Workload, env: _Env, ops: int, seed: int) -> _Program:
    """The same program for every strategy: per task, ``ops`` accesses
    (array, read or write, kernel length, constant added)."""
    rng = np.random.default_rng(seed)
    tasks: list[list[_Op]] = []
    gpu_ns = 0
    for k in range(w.tasks):
        js = rng.integers(0, w.arrays, ops)
        writes = rng.random(ops) < w.write_p
        nss = rng.integers(w.min_ns, w.max_ns + 1, ops)
        adds = rng.integers(1, 8, ops)
        mine = []
        for i in range(ops):
            gid = k * ops + i
            tail = (
                env.seen,
                np.int64(gid),
                np.int64(nss[i]),
                np.int64(adds[i]),
                np.int32(bool(writes[i])),
                env.errors,
            )
            mine.append(_Op(int(js[i]), bool(writes[i]), tail, gid, int(nss[i]), int(adds[i])))
            gpu_ns += int(nss[i])
        tasks.append(mine)
    return _Program(tasks, w.arrays, w.tasks * ops, gpu_ns)


_GRID, _BLOCK = (1,), (1,)


class _Strategy:
    """One way to run the program: ``setup()`` (untimed), then ``worker(k)``
    for every task, gathered (timed), then ``counts()``."""

    def __init__(self, prog: _Program, env: _Env, log: list[list[int]]) -> None:
        self.prog, self.env, self.log = prog, env, log

    def setup(self) -> None:
        pass

    def worker(self, k: int) -> Coroutine[Any, Any, None]:
        raise NotImplementedError

    def counts(self) -> dict[str, Any]:
        return {}


class _Tracked(_Strategy):
    def setup(self) -> None:
        self.tracked = [cf.Tracked(a) for a in self.env.arrays]
        self.streams_used: set[int] = set()
        kernel, log, ops, used = self.env.kernel, self.log, self.prog.tasks, self.streams_used
        tracked = self.tracked

        async def worker(k: int) -> None:
            used.add(int(cp.cuda.get_current_stream().ptr))
            for op in ops[k]:
                t = tracked[op.array]
                with t.write() if op.write else t.read() as a:
                    kernel(_GRID, _BLOCK, (a, *op.tail))
                    log[op.array].append(op.gid)
                await asyncio.sleep(0)

        self._worker: Callable[[int], Coroutine[Any, Any, None]] = cf.own_stream(worker)

    def worker(self, k: int) -> Coroutine[Any, Any, None]:
        coro: Coroutine[Any, Any, None] = self._worker(k)
        return coro

    def counts(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for t in self.tracked:
            for key, v in _stats(t).items():
                total[key] = total.get(key, 0) + v
        total["streams_used"] = len(self.streams_used)
        total["default_stream_used"] = 0 in self.streams_used
        return total


class _ByHand(_Strategy):
    def setup(self) -> None:
        n = self.prog.arrays
        self.writer: list[int] = [-1] * n  # the task of the last write, -1: none
        self.writer_ev: list[Any] = [None] * n
        self.readers: list[dict[int, Any]] = [{} for _ in range(n)]  # since the last write
        self.waits = [0]

    async def worker(self, k: int) -> None:
        env, log, waits = self.env, self.log, self.waits
        kernel, arrays, s = env.kernel, env.arrays, env.streams[k]
        ev_w, ev_r = env.ev_w[k], env.ev_r[k]
        writer, writer_ev, readers = self.writer, self.writer_ev, self.readers
        for op in self.prog.tasks[k]:
            j = op.array
            with s:
                wk = writer[j]
                if wk >= 0 and wk != k:
                    s.wait_event(writer_ev[j])
                    waits[0] += 1
                if op.write:
                    for rk, rev in readers[j].items():
                        if rk != k:
                            s.wait_event(rev)
                            waits[0] += 1
                    kernel(_GRID, _BLOCK, (arrays[j], *op.tail))
                    ev = ev_w[j]
                    ev.record(s)
                    writer[j], writer_ev[j] = k, ev
                    readers[j].clear()
                else:
                    kernel(_GRID, _BLOCK, (arrays[j], *op.tail))
                    ev = ev_r[j]
                    ev.record(s)
                    readers[j][k] = ev
                log[j].append(op.gid)
            await asyncio.sleep(0)

    def counts(self) -> dict[str, Any]:
        return {"waits_inserted": self.waits[0], "events_recorded": self.prog.total}


class _CudaJl(_Strategy):
    def setup(self) -> None:
        n = self.prog.arrays
        self.owner: list[int] = [-1] * n  # the task that used the array last
        self.version: list[int] = [0] * n  # accesses enqueued so far
        self.host_waits = [0]

    async def worker(self, k: int) -> None:
        env, log, host_waits = self.env, self.log, self.host_waits
        kernel, arrays, streams, s = env.kernel, env.arrays, env.streams, env.streams[k]
        owner, version, record = self.owner, self.version, cf.record
        for op in self.prog.tasks[k]:
            j = op.array
            while True:
                last = owner[j]
                if last < 0 or last == k:
                    break
                seen = version[j]
                host_waits[0] += 1
                await record(None, stream=streams[last])
                if version[j] == seen:  # nobody used it meanwhile: last's access is done
                    break
            with s:
                kernel(_GRID, _BLOCK, (arrays[j], *op.tail))
            owner[j] = k
            version[j] += 1
            log[j].append(op.gid)
            await asyncio.sleep(0)

    def counts(self) -> dict[str, Any]:
        return {"host_waits": self.host_waits[0]}


class _Serial(_Strategy):
    async def worker(self, k: int) -> None:
        env, log = self.env, self.log
        kernel, arrays, s = env.kernel, env.arrays, env.serial
        for op in self.prog.tasks[k]:
            j = op.array
            with s:
                kernel(_GRID, _BLOCK, (arrays[j], *op.tail))
            log[j].append(op.gid)
            await asyncio.sleep(0)


_STRATEGY_CLASSES: dict[str, type[_Strategy]] = {
    TRACKED: _Tracked,
    BY_HAND: _ByHand,
    CUDAJL: _CudaJl,
    SERIAL: _Serial,
}


def _run_once(strategy: str, prog: _Program, env: _Env, ntasks: int) -> dict[str, Any]:
    """One run of ``prog``: timed from the tasks' creation to the device
    idle; then checked against the replay."""
    gc.collect()  # finished tasks give their streams back to cudafut's pool
    env.reset()
    log: list[list[int]] = [[] for _ in range(prog.arrays)]
    strat = _STRATEGY_CLASSES[strategy](prog, env, log)
    strat.setup()

    async def main() -> tuple[float, float]:
        t0 = time.perf_counter()
        await asyncio.gather(*(strat.worker(k) for k in range(ntasks)))
        t1 = time.perf_counter()
        gpu.sync_all()
        return t1 - t0, time.perf_counter() - t0

    issue, wall = asyncio.run(main())
    problems = _check(prog, env, log)
    return {"wall_s": wall, "issue_s": issue, "problems": problems, "counts": strat.counts()}


def _check(prog: _Program, env: _Env, log: list[list[int]]) -> list[str]:
    """The program replayed in NumPy, each array's accesses in the order the
    host issued them: what each access saw and each array's end value."""
    problems: list[str] = []
    issued = sorted(g for entries in log for g in entries)
    if issued != list(range(prog.total)):
        problems.append(f"{len(issued)} accesses issued, {len(set(issued))} distinct, of {prog.total}")
    ops = {op.gid: op for mine in prog.tasks for op in mine}
    expected = np.full(prog.total, -(1 << 40), dtype=np.int64)
    final = np.zeros(prog.arrays, dtype=np.int64)
    for j, entries in enumerate(log):
        value = 0
        for g in entries:
            expected[g] = value
            if ops[g].write:
                value += ops[g].add
        final[j] = value
    seen = env.seen[: prog.total].get()
    got = cp.concatenate(env.arrays).get()
    errors = int(env.errors.get()[0])
    bad = np.flatnonzero(seen != expected)
    if bad.size:
        g = int(bad[0])
        problems.append(
            f"{bad.size} of {prog.total} accesses saw another value than the replay's (first: access {g}, "
            f"array {ops[g].array}, {'write' if ops[g].write else 'read'}, saw {seen[g]}, "
            f"expected {expected[g]})"
        )
    wrong = np.flatnonzero(got != final)
    if wrong.size:
        problems.append(f"{wrong.size} of {prog.arrays} arrays end on another value than the replay's")
    if errors:
        problems.append(f"{errors} kernels saw another access running at the same time")
    return problems


def _workload(w: Workload, quick: bool) -> dict[str, Any]:
    rounds = QUICK_WORKLOAD_ROUNDS if quick else WORKLOAD_ROUNDS
    ops = w.ops_for(quick)
    env = _Env(w)
    prog = _program(w, env, ops, w.seed)
    warm = _program(w, env, min(5, ops), w.seed + 1000)
    res: dict[str, Any] = {
        "label": w.label,
        "tasks": w.tasks,
        "arrays": w.arrays,
        "accesses": prog.total,
        "kernel_ns": [w.min_ns, w.max_ns],
        "write_p": w.write_p,
        "seed": w.seed,
        "gpu_ms": prog.gpu_ns / 1e6,
        "rounds": rounds,
        "strategies": {},
    }
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    errors: dict[str, str] = {}
    for s in STRATEGIES:  # warm-up: kernels, task streams, events
        try:
            _run_once(s, warm, env, w.tasks)
        except Exception as exc:  # noqa: BLE001 - this strategy's failure, the others go on
            errors[s] = error_line(exc)
    for r in range(rounds):
        order = STRATEGIES[r % len(STRATEGIES) :] + STRATEGIES[: r % len(STRATEGIES)]
        for s in order:
            if s in errors:
                continue
            try:
                runs[s].append(_run_once(s, prog, env, w.tasks))
            except Exception as exc:  # noqa: BLE001
                errors[s] = error_line(exc)
    for s in STRATEGIES:
        row: dict[str, Any] = {}
        if s in errors:
            row["error"] = errors[s]
        if runs[s]:
            walls = [x["wall_s"] for x in runs[s]]
            wall = statistics.median(walls)
            problems = [p for x in runs[s] for p in x["problems"]]
            row.update(
                wall_s=wall,
                walls_s=walls,
                issue_s=statistics.median(x["issue_s"] for x in runs[s]),
                accesses_per_s=prog.total / wall,
                correct=not problems,
                wrong_runs=sum(1 for x in runs[s] if x["problems"]),
                problems=problems[:5],
                counts=runs[s][-1]["counts"],
            )
        res["strategies"][s] = row
    res["ratios"] = _ratios(res)
    del env
    return res


def _ok(row: dict[str, Any] | None) -> bool:
    """Measured in every round, and right every time."""
    return row is not None and "wall_s" in row and bool(row.get("correct")) and "error" not in row


def _ratios(wres: dict[str, Any]) -> dict[str, float | None]:
    """(a)'s throughput over each other strategy's; None when either is
    missing or wrong."""
    rows = wres.get("strategies", {})
    mine = rows.get(TRACKED)
    out: dict[str, float | None] = {}
    for s in STRATEGIES[1:]:
        other = rows.get(s)
        ok = _ok(mine) and _ok(other)
        out[f"a/{SHORT[s]}"] = other["wall_s"] / mine["wall_s"] if ok else None
    return out


# -- task steps -----------------------------------------------------------------------------


async def _sleeper(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _nothing() -> None:
    return None


def _task_steps(quick: bool) -> dict[str, Any]:
    n = 5_000 if quick else 20_000
    calls = 2_000 if quick else 10_000
    rounds = QUICK_STEP_ROUNDS if quick else STEP_ROUNDS
    own_sleeper = cf.own_stream(_sleeper)
    own_nothing = cf.own_stream(_nothing)

    async def task_steps(kind: str) -> float:
        if kind == FACTORY:
            cf.use_task_streams()
        coro = own_sleeper(n) if kind == OWN else _sleeper(n)
        t0 = time.perf_counter()
        await asyncio.create_task(coro)
        return (time.perf_counter() - t0) / n

    async def inline_calls(kind: str) -> float:
        fn = own_nothing if kind == CALL_OWN else _nothing
        await fn()  # the task's stream leased before the clock starts
        t0 = time.perf_counter()
        for _ in range(calls):
            await fn()
        return (time.perf_counter() - t0) / calls

    kinds = (*STEP_KINDS, CALL_PLAIN, CALL_OWN)
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    errors: dict[str, str] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for kind in kinds if r % 2 else kinds[::-1]:
            if kind in errors:
                continue
            gc.collect()
            measure = inline_calls if kind in (CALL_PLAIN, CALL_OWN) else task_steps
            try:
                per = asyncio.run(measure(kind))
            except Exception as exc:  # noqa: BLE001 - this kind's failure, the others go on
                errors[kind] = error_line(exc)
                continue
            if r:
                samples[kind].append(per)
    gpu.sync_all()
    res: dict[str, Any] = {"steps": n, "calls": calls, "rounds": rounds, "errors": errors}
    for kind in kinds:
        if samples[kind]:
            res[kind] = {
                "us": statistics.median(samples[kind]) * 1e6,
                "all_us": [x * 1e6 for x in samples[kind]],
            }
    for kind, base in ((OWN, PLAIN), (FACTORY, PLAIN), (CALL_OWN, CALL_PLAIN)):
        if kind in res and base in res:
            res[kind]["added_us"] = res[kind]["us"] - res[base]["us"]
    return res


def _torch_steps(quick: bool) -> dict[str, Any]:
    """The task steps in a process that imports torch (CUDA initialised)."""
    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch is not installed"}
    cmd = [sys.executable, "-m", f"{__package__}.{NAME}", "--torch-steps", *(["--quick"] if quick else [])]
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TORCH_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the torch process did not end in {TORCH_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"the torch process exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _torch_main(quick: bool) -> int:
    """``python -m benchmarks.tracking --torch-steps``: the task steps with
    torch imported, one JSON line on stdout."""
    try:
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"skipped": "torch sees no CUDA device"}))
            return 0
        torch.cuda.current_stream()  # CUDA initialised in torch
        version = torch.__version__
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(json.dumps({"skipped": f"torch not importable: {exc!r}"}))
        return 0
    _load()
    try:
        res = _task_steps(quick)
    except Exception as exc:  # noqa: BLE001
        res = {"error": error_line(exc)}
    res["torch"] = version
    print(json.dumps(res))
    return 0


# -- targets, Markdown and plots (no CuPy) -------------------------------------------------


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: its name, the figure, met (True / False, None: not
    judged, with why)."""
    out: list[dict[str, Any]] = []
    rows = result.get("blocks", {}).get("rows", {})
    for b, (target, _base) in BLOCK_TARGETS.items():
        row = rows.get(b)
        name = f"{b}: p50 at most {target:g} µs"
        if row is None:
            out.append({"name": name, "value": "-", "met": None, "why": "not measured"})
        else:
            out.append({"name": name, "value": f"{row['p50_us']:.2f} µs", "met": row["p50_us"] <= target})
    wres = result.get("workloads", {}).get(TARGET_WORKLOAD, {})
    label = wres.get("label", TARGET_WORKLOAD)
    strat = wres.get("strategies", {})
    ratios = wres.get("ratios", {})
    for key, goal, other in (("a/b", VS_HAND, BY_HAND), ("a/c", VS_CUDAJL, CUDAJL)):
        name = f"{label}: (a) / {other} throughput at least {goal:g}"
        mine = strat.get(TRACKED)
        ratio = ratios.get(key)
        if mine is not None and "wall_s" in mine and not mine.get("correct"):
            out.append({"name": name, "value": "(a) wrong", "met": False})
        elif ratio is None:
            out.append({"name": name, "value": "-", "met": None, "why": _why(strat, other)})
        else:
            out.append({"name": name, "value": f"{ratio:.2f}", "met": ratio >= goal})
    # With torch imported the figures are reported, not judged (the target is
    # for CuPy alone; switching PyTorch's stream too costs more).
    steps_res = result.get("steps", {})
    for kind in (OWN, FACTORY):
        name = f"task step, {kind}: at most {STEP_TARGET_US:g} µs added"
        if "added_us" in steps_res.get(kind, {}):
            added = steps_res[kind]["added_us"]
            out.append({"name": name, "value": f"{added:+.2f} µs", "met": added <= STEP_TARGET_US})
        else:
            why = steps_res.get("errors", {}).get(kind) or steps_res.get("error") or "not measured"
            out.append({"name": name, "value": "-", "met": None, "why": str(why)[:200]})
    return out


def _why(strat: dict[str, Any], other: str) -> str:
    for s in (TRACKED, other):
        row = strat.get(s) or {}
        if "error" in row:
            return f"{s} failed"
        if "wall_s" in row and not row.get("correct"):
            return f"{s} gave wrong results"
    return "not measured"


def _blocks_line(blocks: dict[str, Any]) -> str:
    if "error" in blocks:
        return "failed: " + str(blocks["error"])[:200]
    rows = blocks.get("rows", {})
    shown = (("same", READ_SAME), ("wait", READ_WAIT), ("off", OFF_READ), ("raw wait", RAW_WAIT))
    parts = [f"{key} {rows[b]['p50_us']:.2f}" for key, b in shown if b in rows]
    return (
        ", ".join(parts)
        + " us p50"
        + (f"; {len(blocks['errors'])} cases failed" if blocks.get("errors") else "")
    )


def _workload_line(wres: dict[str, Any]) -> str:
    if "error" in wres:
        return "failed: " + str(wres["error"])[:200]
    parts = []
    for s in STRATEGIES:
        row = wres["strategies"].get(s, {})
        if "wall_s" not in row:
            parts.append(f"{SHORT[s]} failed")
        elif not row["correct"]:
            parts.append(f"{SHORT[s]} WRONG")
        else:
            parts.append(f"{SHORT[s]} {row['wall_s'] * 1e3:.1f} ms")
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in wres.get("ratios", {}).items() if v is not None)
    return "; ".join(parts) + (f" ({ratios})" if ratios else "")


def _steps_line(res: dict[str, Any]) -> str:
    for key in ("error", "skipped"):
        if key in res:
            return f"{key}: {str(res[key])[:200]}"
    parts = [
        f"{k} {res[k]['added_us']:+.2f} us" for k in (OWN, FACTORY, CALL_OWN) if "added_us" in res.get(k, {})
    ]
    parts += [f"{k} failed" for k in res.get("errors", {})]
    return ", ".join(parts)


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not judged"}[met]


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        "## tracking: `Tracked` arrays and task streams (issue 11)",
        "",
    ]
    lines += _blocks_markdown(result.get("blocks"))
    for name, wres in result.get("workloads", {}).items():
        lines += _workload_markdown(name, wres)
    lines += _steps_markdown(result.get("steps"), result.get("torch_steps"))
    targets = result.get("targets") or _targets(result)
    if targets:
        lines += ["### Targets (issue 11)", ""]
        for t in targets:
            why = f" ({t['why']})" if t.get("why") else ""
            lines.append(f"- {t['name']}: {t['value']}, {_mark(t['met'])}{why}")
        lines.append("")
    return lines


def _blocks_markdown(blocks: dict[str, Any] | None) -> list[str]:
    if not blocks:
        return []
    head = ["### Per `read()` / `write()` block, host time", ""]
    if "error" in blocks:
        return [*head, f"**Failed**: {blocks['error']}", ""]
    rows = blocks["rows"]
    lines = [
        *head,
        f"One empty block timed with `perf_counter_ns` (the timer's own cost, first row, is included "
        f"in every figure), {blocks['batch']} blocks per batch, {blocks['rounds']} interleaved rounds "
        f'after a warm-up; µs. "Running": the waited-for work queues behind a '
        f"{blocks['busy_ns'] / 1e6:g} ms spin on a third stream. Per block, from the tracker's "
        "`statistics()` over the batches: waits inserted, waits skipped (same stream / finished), "
        "events recorded (write, one wait: reads on the other stream alternate with the timed "
        "writes and count too). Target judged on p50.",
        "",
        "| block | p50 | p99 | max | baseline (p50) | target | per block: waits / skipped same / "
        "skipped done / events | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in BLOCKS:
        row = rows.get(b)
        if row is None:
            if b in blocks.get("errors", {}):
                lines.append(f"| {b} | **failed** | | | | | | |")
            continue
        target, base = BLOCK_TARGETS.get(b, (None, None))
        base_row = rows.get(base) if base else None
        base_cell = f"{base_row['p50_us']:.2f} ({base})" if base_row else ""
        per = ""
        if row["tracked_blocks"] and row["stats"]:
            per = " / ".join(
                f"{row['stats'].get(f, 0) / row['tracked_blocks']:.2f}" if f in row["stats"] else "-"
                for f in STAT_FIELDS
            )
            if row.get("batches_busy_stream_done"):
                per += f" ({row['batches_busy_stream_done']} batches: busy stream done early)"
        verdict = "" if target is None else _mark(row["p50_us"] <= target)
        lines.append(
            f"| {b} | {row['p50_us']:.2f} | {row['p99_us']:.2f} | {row['max_us']:.1f} | {base_cell} | "
            f"{'' if target is None else f'<= {target:g}'} | {per} | {verdict} |"
        )
    lines.append("")
    for b, err in blocks.get("errors", {}).items():
        lines.append(f"- **{b} failed**: {err}")
    return [*lines, ""] if blocks.get("errors") else lines


def _workload_markdown(name: str, wres: dict[str, Any]) -> list[str]:
    head = [f"### Workload `{name}`: {wres.get('label', name)}", ""]
    if "error" in wres:
        return [*head, f"**Failed**: {wres['error']}", ""]
    lines = [
        *head,
        f"{wres['accesses']:,} accesses ({wres['tasks']} tasks, {wres['arrays']} arrays, "
        f"{wres['write_p']:.0%} writes, kernels {wres['kernel_ns'][0] / 1e3:g}-"
        f"{wres['kernel_ns'][1] / 1e3:g} µs, {wres['gpu_ms']:.1f} ms of kernels in all, seed "
        f"{wres['seed']}), the same program for every strategy; wall: the first task's start to the "
        f"device idle, median of {wres['rounds']} interleaved rounds; issued: until the last "
        "access was enqueued (close to the wall: the host is the bottleneck). Every run checked "
        "against a NumPy replay; a wrong run makes the strategy's figure void.",
        "",
        "| strategy | accesses/s | wall ms | issued ms | (a) / this | GPU waits | host waits | "
        "task streams | right |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = wres.get("ratios", {})
    for s in STRATEGIES:
        row = wres["strategies"].get(s, {})
        if "wall_s" not in row:
            lines.append(f"| {s} | **failed** | | | | | | | |")
            continue
        counts = row.get("counts", {})
        ratio = ratios.get(f"a/{SHORT[s]}") if s != TRACKED else 1.0
        streams = counts.get("streams_used", "")
        if counts.get("default_stream_used"):
            streams = f"{streams} (**one is the default stream**)"
        if row["correct"]:
            thr = f"{row['accesses_per_s']:,.0f}"
            right = "yes"
        else:
            thr = "**wrong**"
            right = f"**no**, {row['wrong_runs']} of {len(row['walls_s'])} runs: " + "; ".join(
                row["problems"][:2]
            )
        lines.append(
            f"| {s} | {thr} | {row['wall_s'] * 1e3:.1f} | {row['issue_s'] * 1e3:.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | {counts.get('waits_inserted', '')} | "
            f"{counts.get('host_waits', '')} | {streams} | {right} |"
        )
    lines.append("")
    for s in STRATEGIES:
        err = wres["strategies"].get(s, {}).get("error")
        if err:
            lines.append(f"- **{s} failed**: {err}")
    if any("error" in wres["strategies"].get(s, {}) for s in STRATEGIES):
        lines.append("")
    mine = wres["strategies"].get(TRACKED, {}).get("counts", {})
    if "waits_skipped_complete" in mine:
        lines += [
            f"(a), last run: {mine.get('waits_inserted', 0):,} waits inserted, "
            f"{mine.get('waits_skipped_same_stream', 0):,} skipped (same stream), "
            f"{mine.get('waits_skipped_complete', 0):,} skipped (finished), "
            f"{mine.get('events_recorded', 0):,} events recorded; (b) waits whatever has finished.",
            "",
        ]
    return lines


def _steps_markdown(local: dict[str, Any] | None, torch: dict[str, Any] | None) -> list[str]:
    if not local and not torch:
        return []
    lines = ["### Task steps: `@own_stream`, `use_task_streams()`", ""]
    cols = [("this process", local or {}), ("torch imported (own process)", torch or {})]
    for title, res in cols:
        for key in ("error", "skipped"):
            if key in res:
                lines.append(f"- {title}: {'**failed**' if key == 'error' else 'skipped'}: {res[key]}")
        for kind, err in res.get("errors", {}).items():
            lines.append(f"- {title}, {kind}: **failed**: {err}")
    measured = [(t, r) for t, r in cols if PLAIN in r]
    if not measured:
        return [*lines, ""]
    first = measured[0][1]
    torch_note = f"; torch {measured[-1][1]['torch']}" if "torch" in measured[-1][1] else ""
    if lines[-1] != "":
        lines.append("")
    lines += [
        f"µs per step of a task doing {first['steps']:,} `await asyncio.sleep(0)`, and per call of a "
        f"coroutine that returns at once awaited inline {first['calls']:,} times; median of "
        f"{first['rounds']} interleaved rounds{torch_note}. Added: over the plain task (coroutine) "
        f"in the same process. Target: at most {STEP_TARGET_US:g} µs added per step, without torch "
        "(with torch imported, `own_stream` switches PyTorch's current stream too: reported, not judged).",
        "",
        "| | " + " | ".join(f"{t}: µs | added" for t, _ in measured) + " | target |",
        "|---|" + "---|---|" * len(measured) + "---|",
    ]
    for kind in (*STEP_KINDS, CALL_PLAIN, CALL_OWN):
        cells = []
        for _t, r in measured:
            row = r.get(kind)
            if row is None:
                cells += ["-", ""]
                continue
            added = row.get("added_us")
            cells += [f"{row['us']:.2f}", "" if added is None else f"{added:+.2f}"]
        target = ""
        if kind in (OWN, FACTORY) and local and "added_us" in local.get(kind, {}):
            target = (
                f"<= {STEP_TARGET_US:g} (this process): {_mark(local[kind]['added_us'] <= STEP_TARGET_US)}"
            )
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {target} |")
    return [*lines, ""]


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """Throughput per strategy per workload (bars; wrong results marked, not
    drawn), and per-block p50 / p99 against the targets."""
    workloads = {k: v for k, v in result.get("workloads", {}).items() if "strategies" in v}
    rows = result.get("blocks", {}).get("rows", {})
    if not workloads and not rows:
        return []
    plt = pyplot()
    if plt is None:
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(STRATEGIES)
    names = list(workloads)
    for i, s in enumerate(STRATEGIES):
        xs, ys = [], []
        for x, name in enumerate(names):
            row = workloads[name]["strategies"].get(s, {})
            pos = x + (i - (len(STRATEGIES) - 1) / 2) * width
            if "wall_s" not in row:
                left.text(pos, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
            elif not row["correct"]:
                left.text(pos, 0, "WRONG", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
            else:
                xs.append(pos)
                ys.append(row["accesses_per_s"])
        left.bar(xs, ys, width, label=s)
    left.set_xticks(
        range(len(names)), [workloads[n].get("label", n).replace(", ", "\n") for n in names], fontsize=7
    )
    left.set_ylabel("accesses / s (median wall)")
    left.set_title("Shared arrays, tasks on their own streams")
    left.legend(fontsize=7)
    left.grid(True, axis="y", alpha=0.3)
    shown = [b for b in BLOCKS if b in rows and b != TIMER]
    at = list(range(len(shown)))
    right.barh(at, [rows[b]["p50_us"] for b in shown], 0.6, label="p50")
    right.plot([rows[b]["p99_us"] for b in shown], at, "k|", ms=10, label="p99")
    for y, b in zip(at, shown, strict=True):
        if b in BLOCK_TARGETS:
            target = BLOCK_TARGETS[b][0]
            right.plot([target, target], [y - 0.4, y + 0.4], "r-", lw=1.5)
    right.set_yticks(at, shown, fontsize=6)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("µs per block (red: target)")
    right.set_title("One read() / write() block, host time")
    right.legend(fontsize=7)
    right.grid(True, axis="x", which="both", alpha=0.3)
    gpu_name = meta_of(result).get("gpu")
    fig.suptitle("Tracked arrays and task streams" + (f" ({gpu_name})" if gpu_name else ""))
    return [save_figure(plt, fig, out / f"{stem}-tracking.png")]


if __name__ == "__main__":
    if "--torch-steps" in sys.argv[1:]:
        sys.exit(_torch_main("--quick" in sys.argv[1:]))
    print("python -m benchmarks.tracking --torch-steps [--quick]: the task steps with torch imported")
