"""One rank of the ``collectives`` section: ``benchmarks/collectives.py``
starts one per GPU, with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and a folder
(``CUDAFUT_BENCH_RENDEZVOUS``) where rank 0 leaves NCCL's unique id for the
direct communicator.

Rank 0 prints its progress and, at the end, its result (JSON) on stdout, each
on one line with a prefix (``collectives.PROGRESS``, ``collectives.RESULT``);
the other ranks only measure alongside. Every rank runs the same collectives
in the same order, with counts fixed in advance (nothing timed decides how
many calls a rank makes), so none waits for a call another never makes.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import importlib.util
import json
import os
import pickle
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .collectives import (
    COLLECTIVE_TIMEOUT_S,
    CUDAFUT,
    DIRECT,
    FLOOR,
    MB,
    OPS,
    OVERLAPPED,
    PROGRESS,
    RENDEZVOUS_ENV,
    REPEATS,
    RESULT,
    ROOT,
    SERIAL_GPU,
    SERIAL_HOST,
    bus_factor,
    calls_per_repeat,
    sizes,
)

HOST_BYTES = 4096
HOST_CALLS = 100  # per batch: well within a stream's queue


class Worker:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.cp: Any = importlib.import_module("cupy")
        self.nccl: Any = importlib.import_module("cupy.cuda.nccl")
        if not getattr(self.nccl, "available", False):
            raise RuntimeError("CuPy cannot load NCCL here (cupy.cuda.nccl.available is False)")
        # Imported by name: the worker runs against whatever cudafut provides.
        self.dist: Any = importlib.import_module("cudafut.distributed")
        cp = self.cp
        self.device = self.local % cp.cuda.runtime.getDeviceCount()
        cp.cuda.Device(self.device).use()

    def say(self, what: str) -> None:
        """A progress line (rank 0 only: the parent follows its stdout)."""
        if self.rank == 0:  # a newline first: NCCL may have left a line unfinished
            print("\n" + PROGRESS + what, flush=True)
        print(f"[rank {self.rank}] {what}", file=sys.stderr, flush=True)

    # -- setup ----------------------------------------------------------------------

    def start(self) -> None:
        cp, nccl = self.cp, self.nccl
        t = time.perf_counter()
        self.group = self.dist.init_process_group(timeout=COLLECTIVE_TIMEOUT_S)
        # NCCL called directly, on a communicator of the same size, on its own stream.
        uid = self._nccl_id(Path(os.environ[RENDEZVOUS_ENV]))
        self.comm = nccl.NcclCommunicator(self.world, uid, self.rank)
        self.direct_stream = cp.cuda.Stream(non_blocking=True)
        # The caller's stream of the cudafut path (its collectives wait on it).
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.flag = cp.zeros(1, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        self.barrier()
        self.init_s = time.perf_counter() - t
        version = int(nccl.get_version())
        self.nccl_version = f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
        props = cp.cuda.runtime.getDeviceProperties(self.device)
        self.gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.say(
            f"collectives: {self.world} ranks up in {self.init_s:.1f} s, {self.gpu}, NCCL {self.nccl_version}"
        )

    def _nccl_id(self, folder: Path) -> Any:
        """Rank 0 makes NCCL's unique id and leaves it in ``folder``; the
        others read it (CuPy 14 gives bytes, older CuPy a tuple: pickled)."""
        path = folder / "nccl-unique-id"
        if self.rank == 0:
            uid = self.nccl.get_unique_id()
            tmp = folder / "nccl-unique-id.tmp"
            tmp.write_bytes(pickle.dumps(uid))
            os.replace(tmp, path)  # whole or absent
            return uid
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 left no NCCL id in {path} within {COLLECTIVE_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        return pickle.loads(path.read_bytes())

    def barrier(self) -> None:
        """Every rank here, both streams idle (a direct one-element all-reduce)."""
        nccl = self.nccl
        self.stream.synchronize()
        self.comm.allReduce(
            self.flag.data.ptr,
            self.flag.data.ptr,
            1,
            nccl.NCCL_FLOAT32,
            nccl.NCCL_SUM,
            self.direct_stream.ptr,
        )
        self.direct_stream.synchronize()

    def finish(self) -> None:
        self.barrier()
        self.dist.destroy_process_group()
        self.comm.destroy()

    # -- the two paths ---------------------------------------------------------------

    def calls(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], None], int, list[Any]]:
        """(one cudafut call, one direct call, the bytes nccl-tests counts,
        the buffers) for ``op`` on a full buffer of about ``nbytes``."""
        cp, nccl, dist = self.cp, self.nccl, self.dist
        n = self.world
        block = nbytes // 4 // n  # elements each rank contributes / receives
        total = block * n
        f32, s = nccl.NCCL_FLOAT32, self.direct_stream
        if op == "all_reduce":
            x = cp.zeros(total, dtype=cp.float32)
            p = x.data.ptr
            return (
                lambda: dist.all_reduce(x),
                lambda: self.comm.allReduce(p, p, total, f32, nccl.NCCL_SUM, s.ptr),
                total * 4,
                self._ready(x),
            )
        if op == "all_gather":
            x = cp.zeros(block, dtype=cp.float32)
            y = cp.zeros((n, block), dtype=cp.float32)
            px, py = x.data.ptr, y.data.ptr
            return (
                lambda: dist.all_gather(x, out=y),
                lambda: self.comm.allGather(px, py, block, f32, s.ptr),
                total * 4,
                self._ready(x, y),
            )
        if op == "reduce_scatter":
            x = cp.zeros(total, dtype=cp.float32)
            y = cp.zeros(block, dtype=cp.float32)
            px, py = x.data.ptr, y.data.ptr
            return (
                lambda: dist.reduce_scatter(x, out=y),
                lambda: self.comm.reduceScatter(px, py, block, f32, nccl.NCCL_SUM, s.ptr),
                total * 4,
                self._ready(x, y),
            )
        raise ValueError(op)

    def _ready(self, *arrays: Any) -> list[Any]:
        """``arrays``, once the legacy stream that filled them is done (the
        streams timed here do not wait for it)."""
        self.cp.cuda.Device().synchronize()
        return list(arrays)

    def repeat_cudafut(self, call: Callable[[], Any], k: int) -> tuple[float, float]:
        """(enqueue, total) seconds of ``k`` back-to-back calls and one wait, as a user writes it."""
        self.barrier()
        with self.stream:
            t = time.perf_counter()
            for _ in range(k):
                fut = call()
            t_enq = time.perf_counter()
            fut.result(timeout=COLLECTIVE_TIMEOUT_S)
            return t_enq - t, time.perf_counter() - t

    def repeat_direct(self, call: Callable[[], None], k: int) -> tuple[float, float]:
        self.barrier()
        t = time.perf_counter()
        for _ in range(k):
            call()
        t_enq = time.perf_counter()
        self.direct_stream.synchronize()
        return t_enq - t, time.perf_counter() - t

    def interleaved(
        self, mine: Callable[[], Any], direct: Callable[[], None], k: int, rounds: int
    ) -> dict[str, list[tuple[float, float]]]:
        """``rounds`` repetitions of each path, alternating which goes first,
        after one warm-up each."""
        self.repeat_cudafut(mine, k)
        self.repeat_direct(direct, k)
        out: dict[str, list[tuple[float, float]]] = {CUDAFUT: [], DIRECT: []}
        for r in range(rounds):
            order = (CUDAFUT, DIRECT) if r % 2 == 0 else (DIRECT, CUDAFUT)
            for path in order:
                if path == CUDAFUT:
                    out[path].append(self.repeat_cudafut(mine, k))
                else:
                    out[path].append(self.repeat_direct(direct, k))
        return out

    # -- the measurements ----------------------------------------------------------------

    def bandwidth(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for op in OPS:
            rows: list[dict[str, Any]] = []
            out[op] = rows
            for nbytes in sizes(self.quick):
                k = calls_per_repeat(nbytes)
                mine, direct, counted, buffers = self.calls(op, nbytes)
                times = self.interleaved(mine, direct, k, REPEATS)
                del mine, direct, buffers
                self.cp.get_default_memory_pool().free_all_blocks()
                per_call = {path: [total / k for _, total in times[path]] for path in times}
                busbw = {
                    path: counted / statistics.median(ts) * bus_factor(op, self.world) / 1e9
                    for path, ts in per_call.items()
                }
                row = {
                    "bytes": counted,
                    "calls": k,
                    "cudafut_s": per_call[CUDAFUT],
                    "direct_s": per_call[DIRECT],
                    "cudafut_busbw_gbs": busbw[CUDAFUT],
                    "direct_busbw_gbs": busbw[DIRECT],
                    "ratio": busbw[CUDAFUT] / busbw[DIRECT],
                }
                rows.append(row)
                self.say(
                    f"collectives {op} {nbytes // MB} MB x {k}: busbw cudafut {busbw[CUDAFUT]:.1f}, "
                    f"direct {busbw[DIRECT]:.1f} GB/s ({row['ratio']:.3f})"
                )
        return out

    def host_cost(self) -> dict[str, Any]:
        cp = self.cp
        batches = 5 if self.quick else 20
        x = cp.zeros(HOST_BYTES // 4, dtype=cp.float32)
        self._ready(x)
        p, nccl, s = x.data.ptr, self.nccl, self.direct_stream

        def mine_4k() -> Any:
            return self.dist.all_reduce(x)

        def direct_4k() -> None:
            self.comm.allReduce(p, p, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)

        # The floor of a collective as a future: the CUDA work cudafut must
        # do around NCCL, written by hand with CuPy (an event on the
        # caller's stream that the NCCL stream waits on, one event after),
        # with events reused from a ring: no future, no checks, no watchdog.
        ring = [cp.cuda.Event(disable_timing=True) for _ in range(2 * HOST_CALLS)]
        turn = [0]

        def floor_4k() -> None:
            i = turn[0] = (turn[0] + 2) % len(ring)
            before, after = ring[i], ring[i + 1]
            before.record(self.stream)
            s.wait_event(before)
            self.comm.allReduce(p, p, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
            after.record(s)

        ways: dict[str, Callable[[], tuple[float, float]]] = {
            CUDAFUT: lambda: self.repeat_cudafut(mine_4k, HOST_CALLS),
            DIRECT: lambda: self.repeat_direct(direct_4k, HOST_CALLS),
            FLOOR: lambda: self.repeat_direct(floor_4k, HOST_CALLS),
        }
        for way in ways.values():  # warm-up
            way()
        times: dict[str, list[tuple[float, float]]] = {path: [] for path in ways}
        order = list(ways)
        for r in range(batches):  # each path first in turn: drift hits all alike
            for path in order[r % 3 :] + order[: r % 3]:
                times[path].append(ways[path]())
        res: dict[str, Any] = {"bytes": HOST_BYTES, "calls": HOST_CALLS, "batches": batches}
        for path, ts in times.items():
            res[f"{path}_enqueue_us"] = statistics.median(e for e, _ in ts) / HOST_CALLS * 1e6
            res[f"{path}_total_us"] = statistics.median(t for _, t in ts) / HOST_CALLS * 1e6
        self.say(
            f"collectives host cost per 4 KB all_reduce: cudafut {res['cudafut_enqueue_us']:.1f} us "
            f"enqueued ({res['cudafut_total_us']:.1f} total), direct {res['direct_enqueue_us']:.1f} us "
            f"({res['direct_total_us']:.1f}), floor {res['floor_enqueue_us']:.1f} us "
            f"({res['floor_total_us']:.1f})"
        )
        return res

    def overlap(self) -> dict[str, Any]:
        ex = _example()
        count, bucket_mb = (8, 32) if self.quick else (16, 64)
        with self.stream:
            buckets = ex.Buckets(count, bucket_mb * MB // 4, rank=self.rank)
            cal = ex.calibrate(buckets, timeout=COLLECTIVE_TIMEOUT_S)
            self.say(
                f"collectives overlap: per bucket all-reduce {cal['allreduce_s'] * 1e3:.2f} ms, "
                f"compute {cal['compute_s'] * 1e3:.2f} ms ({cal['rounds']} rounds)"
            )
            expected = ex.expected_values(buckets, self.world)
            variants = {name: ex.VARIANTS[name] for name in (OVERLAPPED, SERIAL_GPU, SERIAL_HOST)}
            for fn in variants.values():
                ex.check(fn(buckets, COLLECTIVE_TIMEOUT_S), expected)  # warm-up; right values
            times: dict[str, list[float]] = {name: [] for name in variants}
            names = list(variants)
            for r in range(REPEATS):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    self.barrier()
                    with self.stream:
                        t = time.perf_counter()
                        reduced = variants[name](buckets, COLLECTIVE_TIMEOUT_S)
                        times[name].append(time.perf_counter() - t)
                    ex.check(reduced, expected)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        c, m = cal["compute_s"], cal["allreduce_s"]
        res = {
            "buckets": count,
            "bucket_mb": bucket_mb,
            "rounds": cal["rounds"],
            "allreduce_ms": m * 1e3,
            "compute_ms": c * 1e3,
            "repeats": REPEATS,
            "variants": {name: {"seconds_median": med[name], "seconds_all": times[name]} for name in times},
            "speedup_vs_serial_gpu": med[SERIAL_GPU] / med[OVERLAPPED],
            "speedup_vs_serial": med[SERIAL_HOST] / med[OVERLAPPED],
            # Serial: count * (c + m); perfect overlap hides all but one of the shorter.
            "ideal_speedup": count * (c + m) / (c + m + (count - 1) * max(c, m)),
        }
        self.say(
            f"collectives overlap: {med[OVERLAPPED] * 1e3:.2f} ms overlapped, "
            f"{res['speedup_vs_serial_gpu']:.2f}x over serial on the GPU, "
            f"{res['speedup_vs_serial']:.2f}x over serial with result() (ideal {res['ideal_speedup']:.2f}x)"
        )
        return res

    def measure(self) -> dict[str, Any]:
        cp = self.cp
        result: dict[str, Any] = {
            "nproc": self.world,
            "gpu": self.gpu,
            "nccl": self.nccl_version,
            "cupy": cp.__version__,
            "quick": self.quick,
            "dtype": "float32",
            "repeats": REPEATS,
            "init_s": self.init_s,
        }
        result["busbw"] = self.bandwidth()
        result["host"] = self.host_cost()
        result["overlap"] = self.overlap()
        return result


def _example() -> Any:
    """examples/bucket_overlap.py, loaded from its file (examples/ is no package)."""
    path = ROOT / "examples" / "bucket_overlap.py"
    spec = importlib.util.spec_from_file_location("cudafut_example_bucket_overlap", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name if __spec__ else __name__}")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    # The parent sends SIGUSR1 before it kills a worker that hangs: every
    # thread's stack goes to stderr, which the parent shows.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 0
    try:
        worker = Worker(args.quick)
        worker.start()
        result = worker.measure()
        if worker.rank == 0:
            print("\n" + RESULT + json.dumps(result), flush=True)
        worker.finish()
    except BaseException:  # noqa: BLE001 - told on stderr, then a failing exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: NCCL and CUDA objects freed at exit can block
    # on a peer that is gone; everything was said.
    os._exit(code)


if __name__ == "__main__":
    main()
