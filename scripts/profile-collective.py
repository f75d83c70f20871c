"""The host cost of one ``cudafut.distributed.all_reduce``, without a GPU.

``python scripts/profile-collective.py`` (from the repository root) runs
``dist.all_reduce(x)`` on a group over a stub communicator (its
``allReduce`` does nothing) under :mod:`cudafut.testing`'s fake GPU, next to
the stub's ``allReduce`` called directly, in interleaved rounds of back-to-
back calls (each future dropped at the next call, as
benchmarks/collectives.py does), and prints the µs per call of both and
their difference: the wrapper's own host cost (the fake's event calls
included, which cost more than CUDA's). ``x`` is a real ``cupy.ndarray``
over memory it does not own (no GPU needed to make one).

``--backend nullcuda`` runs CUDA's own backend instead of the fake, over
a libcuda whose calls do nothing (``scripts/nullcuda.c``, built to
``/tmp/nullcuda/libcuda.so.1``: run with ``LD_LIBRARY_PATH=/tmp/nullcuda``;
the native core's driver calls go there) and a stand-in for CuPy's runtime
(Python calls that do nothing): the path CUDA's backend takes, at the cost
of its Python. ``--count`` then counts the CUDA calls of a collective.

``--backend null`` replaces the fake's event calls by ones that do nothing
(events stay pending, as a GPU's do for a while): nearer CUDA's, whose
calls are C calls. ``--complete`` makes every event complete at once
instead. ``--profile`` writes a cProfile of one round, by own time and by
cumulative time, to ``$OUT/prof-collective.txt`` (``$OUT``: /tmp);
``--count`` prints the backend calls made per collective.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from typing import Any

# CuPy's CUDA array interface v3 asks CUDA for the current stream: v2 does not.
os.environ.setdefault("CUPY_CUDA_ARRAY_INTERFACE_EXPORT_VERSION", "2")
sys.path.insert(0, os.getcwd())

import cupy as cp
from cupy.cuda import memory

import cudafut.distributed as dist
from cudafut import _backend, _cuda, testing
from cudafut.distributed import _group, _nccl

OUT = os.environ.get("OUT", "/tmp")


class StubNccl:
    """What CuPy's NcclCommunicator offers, doing nothing."""

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        pass

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def array(n: int = 1024) -> Any:
    """A cupy.ndarray of ``n`` float32 over memory nobody owns (never read)."""
    mem = memory.UnownedMemory(0x7F0000000000, n * 4, None, device_id=0)
    return cp.ndarray((n,), dtype=cp.float32, memptr=memory.MemoryPointer(mem, 0))


def rounds(group: _group.ProcessGroup, stub: StubNccl, x: Any, calls: int, n: int) -> dict[str, list[float]]:
    p, size = x.data.ptr, x.size
    stream = group.stream.ptr
    all_reduce, allreduce = dist.all_reduce, stub.allReduce
    out: dict[str, list[float]] = {"cudafut": [], "direct": [], "cudafut_thread": []}

    def mine() -> float:
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fut = all_reduce(x, group=group)
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        del fut
        out["cudafut_thread"].append(dc / calls * 1e6)
        return dt

    def direct() -> float:
        t = time.perf_counter()
        for _ in range(calls):
            allreduce(p, p, size, 7, 0, stream)
        return time.perf_counter() - t

    mine(), direct()  # warm-up
    for r in range(n):
        for path in ("cudafut", "direct") if r % 2 == 0 else ("direct", "cudafut"):
            gc.collect()
            out[path].append((mine if path == "cudafut" else direct)() / calls * 1e6)
        settle(group)
    return out


fake: testing.FakeCuda | None = None


def settle(group: _group.ProcessGroup) -> None:
    """Let the pending collectives complete, and the watchdog drop them."""
    if fake is not None:
        fake.complete_all()
    deadline = time.monotonic() + 5
    while group._pending and time.monotonic() < deadline:
        time.sleep(0.01)


def nullify(backend: Any, complete: bool) -> None:
    """The fake's event calls, replaced by ones that do nothing."""
    status = 0 if complete else _cuda.NOT_READY

    def nothing(*args: object) -> None:
        pass

    backend.event_record = nothing
    backend.stream_wait = nothing
    backend.event_query = lambda event: status


class NullRuntime:
    """CuPy's runtime calls that cudafut's CUDA backend makes, doing nothing."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def getDevice(self) -> int:  # noqa: N802
        self.calls["cudaGetDevice"] += 1
        return 0

    def setDevice(self, device: int) -> None:  # noqa: N802
        self.calls["cudaSetDevice"] += 1

    def eventRecord(self, event: int, stream: int) -> None:  # noqa: N802
        self.calls["cudaEventRecord"] += 1

    def streamWaitEvent(self, stream: int, event: int) -> None:  # noqa: N802
        self.calls["cudaStreamWaitEvent"] += 1

    def eventQuery(self, event: int) -> int:  # noqa: N802
        self.calls["cudaEventQuery"] += 1
        return int(libcuda().null_query_status) if libcuda() else 0


class NullStream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.device_id = 0


_lib: Any = None


def libcuda() -> Any:
    global _lib
    if _lib is None:
        import ctypes

        try:
            _lib = ctypes.CDLL("libcuda.so.1")
            _lib.null_calls  # noqa: B018 - the null library, not a real one
        except (OSError, AttributeError):
            _lib = False
    return _lib


def null_counts() -> dict[str, int]:
    import ctypes

    names = (
        "cuEventRecord",
        "cuEventQuery",
        "cuStreamWaitEvent",
        "cuCtxGetDevice",
        "cuEventCreate",
        "cuEventDestroy",
    )
    arr = (ctypes.c_long * 6).in_dll(libcuda(), "null_calls")
    return dict(zip(names, arr, strict=True))


def set_query_status(status: int) -> None:
    import ctypes

    ctypes.c_int.in_dll(libcuda(), "null_query_status").value = status


def install_nullcuda() -> tuple[NullRuntime, NullStream]:
    """CUDA's backend over the null libcuda and a null CuPy runtime."""
    import types

    from cudafut import _runtime

    if not libcuda():
        sys.exit(
            "--backend nullcuda: build scripts/nullcuda.c to /tmp/nullcuda/libcuda.so.1 "
            "(gcc -shared -fPIC -O2 -o /tmp/nullcuda/libcuda.so.1 scripts/nullcuda.c) "
            "and run with LD_LIBRARY_PATH=/tmp/nullcuda"
        )
    rt = NullRuntime()
    caller = NullStream(0x5550000)
    current = lambda device=-1: caller  # noqa: E731
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=current))
    _runtime._rt, _runtime._cupy, _runtime._count = rt, fake_cupy, 1
    # The native core calls CuPy's own getter (found in sys.modules), whose
    # thread state needs a GPU: the same stand-in there.
    cp.cuda.get_current_stream = current
    return rt, caller


def count_calls(backend: Any) -> Counter[str]:
    seen: Counter[str] = Counter()
    for name in _backend.SEAM:
        fn = getattr(backend, name)

        def counted(*args: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            seen[_name] += 1
            return _fn(*args, **kw)

        setattr(backend, name, counted)
    return seen


def main() -> None:
    global fake
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("fake", "null", "nullcuda"), default="fake")
    ap.add_argument("--complete", action="store_true", help="events complete at once")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--count", action="store_true")
    args = ap.parse_args()
    if args.backend == "nullcuda":
        nullcuda(args)
        return
    with testing.fake_cuda(auto_complete=args.complete, hint_after_s=None) as f:
        fake = f
        backend = _backend.current
        if args.backend == "null":
            nullify(backend, args.complete)
        stub = StubNccl()
        group = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 600.0, "bench")
        x = array()
        if args.count:
            dist.all_reduce(x, group=group)
            settle(group)
            seen = count_calls(backend)
            k = 100
            futs = [dist.all_reduce(x, group=group) for _ in range(k)]
            del futs
            print("backend calls per collective:", {n: c / k for n, c in sorted(seen.items())})
            return
        measure(args, group, stub, x)
        group.destroy()


def measure(args: argparse.Namespace, group: _group.ProcessGroup, stub: StubNccl, x: Any) -> None:
    """The timed rounds and their report (and a profile, if asked), then
    every collective settled: the same on either backend."""
    out = rounds(group, stub, x, args.calls, args.rounds)
    report(args, out)
    if args.profile:
        profile(group, x, args.calls)
    settle(group)


def nullcuda(args: argparse.Namespace) -> None:
    rt, _caller = install_nullcuda()
    set_query_status(0 if args.complete else _cuda.NOT_READY)
    stub = StubNccl()
    group = _group.ProcessGroup(
        _nccl.Communicator(stub), 0, [0, 1], 0, 600.0, "bench", stream=NullStream(0x6660000)
    )
    x = array()

    def settle_null(group: _group.ProcessGroup) -> None:
        set_query_status(0)
        deadline = time.monotonic() + 5
        while group._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        set_query_status(0 if args.complete else _cuda.NOT_READY)

    global settle
    settle = settle_null
    if args.count:
        dist.all_reduce(x, group=group)
        settle(group)
        k = 100
        before, rt.calls = null_counts(), Counter()
        for _ in range(k):
            fut = dist.all_reduce(x, group=group)
        del fut
        after = null_counts()
        driver = {n: (after[n] - before[n]) / k for n in after if after[n] != before[n]}
        print("CUDA calls per collective on the calling thread (driver, from C):", driver)
        print("  through CuPy's runtime:", {n: c / k for n, c in sorted(rt.calls.items())})
        settle(group)
        return
    measure(args, group, stub, x)


def profile(group: _group.ProcessGroup, x: Any, calls: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fut = dist.all_reduce(x, group=group)
    prof.disable()
    del fut
    settle(group)
    for key, name in (("tottime", "prof-collective.txt"), ("cumulative", "prof-collective-cum.txt")):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(40)
        with open(os.path.join(OUT, name), "w") as fh:
            fh.write(s.getvalue())
    print(f"  profile: {OUT}/prof-collective.txt, {OUT}/prof-collective-cum.txt")


def report(args: argparse.Namespace, out: dict[str, list[float]]) -> None:
    mine, direct = (statistics.median(out[p]) for p in ("cudafut", "direct"))
    print(
        f"backend {args.backend}{' (complete)' if args.complete else ''}: "
        f"{args.rounds} rounds of {args.calls} calls"
    )
    if len(out["cudafut"]) <= 20:
        print("  per round, cudafut µs:", " ".join(f"{v:.2f}" for v in out["cudafut"]))
        print("  per round, direct  µs:", " ".join(f"{v:.3f}" for v in out["direct"]))
    print(
        f"  median CPU of the calling thread, cudafut: {statistics.median(out['cudafut_thread'][1:]):.2f} µs"
    )
    print(f"  median: cudafut {mine:.2f} µs, stub direct {direct:.3f} µs, overhead {mine - direct:.2f} µs")


if __name__ == "__main__":
    main()
