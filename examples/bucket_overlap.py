"""Gradient buckets with futures: all-reduce bucket k while bucket k+1 is computed.

Run it with two GPUs of one machine::

    torchrun --nproc-per-node 2 examples/bucket_overlap.py [--buckets 16] [--bucket-mb 64]

(without torchrun it runs as a world of one process, where an all-reduce has
no one to talk to). Rank 0 prints how long the overlapped loop takes against
the same work done serially; every rank checks that each reduced bucket holds
the sum over the ranks of what each contributed.

The overlap is nothing but the futures' ordering: ``dist.all_reduce(grad)``
enqueues the collective on the group's communication stream, which first
waits for the caller's stream (where ``grad`` was computed) and returns a
future that is already set. The caller goes on to compute the next bucket on
its own stream while the GPU all-reduces this one; one ``gather(...)`` at the
end waits for all of them.

``benchmarks/collectives.py`` imports ``Buckets``, ``calibrate``,
``overlapped``, ``serial``, ``serial_on_gpu``, ``expected_values`` and
``check`` from this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import cupy as cp

import cudafut
import cudafut.distributed as dist
from cudafut._cli.selfcheck import require_gpu

#: How long any wait here may take, in seconds (a dead peer fails, not hangs).
TIMEOUT_S = 120.0

# A stand-in for a layer's backward kernel: y = x, then `rounds` times
# y = y * a + b. Its duration grows with `rounds`; its result depends on x.
_backward = cp.ElementwiseKernel(
    "T x, T a, T b, int32 rounds",
    "T y",
    "T v = x; for (int r = 0; r < rounds; r++) v = v * a + b; y = v;",
    "cudafut_example_backward",
)
A, B = cp.float32(0.9999), cp.float32(1e-4)


class Buckets:
    """``count`` gradient buckets of ``elements`` float32 each, on the current
    device: this rank's inputs, the gradients computed from them, and the
    rounds of the backward kernel."""

    def __init__(self, count: int, elements: int, *, rank: int, rounds: int = 1) -> None:
        self.count, self.elements, self.rank, self.rounds = count, elements, rank, rounds
        self.inputs = [self.input_of(rank, k) for k in range(count)]
        self.grads = [cp.zeros(elements, dtype=cp.float32) for _ in range(count)]
        cp.cuda.Device().synchronize()  # ready whatever stream computes on them

    def input_of(self, rank: int, k: int) -> Any:
        """Rank ``rank``'s input to bucket ``k``: a ramp over [0, 1) plus
        ``rank + k / 8``."""
        ramp = (cp.arange(self.elements, dtype=cp.int64) % 997).astype(cp.float32) / cp.float32(997)
        return ramp + cp.float32(rank + 0.125 * k)

    def compute(self, k: int) -> Any:
        """Bucket ``k``'s gradient, computed on the caller's current stream."""
        _backward(self.inputs[k], A, B, cp.int32(self.rounds), self.grads[k])
        return self.grads[k]

    @property
    def nbytes(self) -> int:
        return self.elements * 4


def overlapped(buckets: Buckets, timeout: float = TIMEOUT_S) -> list[Any]:
    """Compute each bucket and start its all-reduce at once: bucket k is
    reduced (on the group's stream) while bucket k+1 is computed (on the
    caller's stream). The host waits once, at the end. Returns the reduced
    buckets."""
    futs = []
    for k in range(buckets.count):
        grad = buckets.compute(k)
        futs.append(dist.all_reduce(grad))  # set now; runs after `grad` is computed
    return cudafut.gather(*futs).result(timeout=timeout)


def serial(buckets: Buckets, timeout: float = TIMEOUT_S) -> list[Any]:
    """The same work without overlap, written the blocking way: the host waits
    for each all-reduce before it computes the next bucket."""
    return [dist.all_reduce(buckets.compute(k)).result(timeout=timeout) for k in range(buckets.count)]


def serial_on_gpu(buckets: Buckets, timeout: float = TIMEOUT_S) -> list[Any]:
    """The same work without overlap, and without the host waiting: the
    caller's stream waits, on the GPU, for each all-reduce (``fut.wait()``)
    before it computes the next bucket. What ``overlapped`` gains over this
    is the overlap alone."""
    futs = []
    for k in range(buckets.count):
        fut = dist.all_reduce(buckets.compute(k))
        fut.wait(timeout=timeout)  # set already: returns at once, the stream waits
        futs.append(fut)
    return cudafut.gather(*futs).result(timeout=timeout)


def barrier(timeout: float = TIMEOUT_S) -> None:
    """Every rank gets here before any goes on (a one-element all-reduce)."""
    dist.all_reduce(cp.zeros(1, dtype=cp.float32)).result(timeout=timeout)


def _gpu_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The shortest GPU time of ``fn()`` on the current stream."""
    stream = cp.cuda.get_current_stream()
    best = float("inf")
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    return best


def calibrate(buckets: Buckets, *, calls: int = 10, timeout: float = TIMEOUT_S) -> dict[str, float]:
    """Set ``buckets.rounds`` so that computing a bucket takes about as long
    as all-reducing one (where overlap pays most), the same on every rank.

    Returns the measurements, in seconds: ``allreduce_s`` (one bucket),
    ``compute_s`` (one bucket, at the rounds chosen), and ``rounds``.
    """
    grad = buckets.grads[0]

    def reduce_many() -> None:
        # Back to back, each ordered after the previous through the caller's
        # stream (wait()): the span on that stream is `calls` all-reduces.
        for _ in range(calls):
            dist.all_reduce(grad).wait(timeout=timeout)

    reduce_many()  # warm-up (connections, the kernel's compilation below)
    barrier(timeout)
    allreduce = _gpu_seconds(reduce_many, repeats=2) / calls

    def compute(rounds: int) -> float:
        buckets.rounds = rounds
        return _gpu_seconds(lambda: buckets.compute(0))

    compute(1)  # compiles the kernel
    lo, hi = 64, 64 + 2048
    t_lo, t_hi = compute(lo), compute(hi)
    per_round = max((t_hi - t_lo) / (hi - lo), 1e-12)
    fixed = max(t_lo - per_round * lo, 0.0)
    # The same figures on every rank, so that all choose the same rounds: the
    # shortest all-reduce (the rank that arrived last waited least: its span
    # is the collective's own; max of the negated), the slowest compute.
    agreed = cp.array([-allreduce, per_round, fixed], dtype=cp.float64)
    maxima = dist.all_reduce(agreed, op="max").result(timeout=timeout)
    allreduce, per_round, fixed = -float(maxima[0]), float(maxima[1]), float(maxima[2])
    buckets.rounds = max(1, round((allreduce - fixed) / per_round))
    return {
        "allreduce_s": allreduce,
        "compute_s": fixed + per_round * buckets.rounds,
        "round_s": per_round,
        "rounds": buckets.rounds,
    }


def expected_values(buckets: Buckets, world: int, ks: Sequence[int] | None = None) -> dict[int, Any]:
    """What buckets ``ks`` (default: the first and the last) hold after the
    all-reduce: the sum over the ranks of the gradient each computed, found
    here by computing every rank's gradient."""
    out = {}
    for k in (0, buckets.count - 1) if ks is None else ks:
        total = cp.zeros(buckets.elements, dtype=cp.float32)
        for r in range(world):
            total += _backward(buckets.input_of(r, k), A, B, cp.int32(buckets.rounds))
        out[k] = total
    return out


def check(reduced: Sequence[Any], expected: dict[int, Any]) -> None:
    """Raise AssertionError unless each expected bucket was reduced right
    (up to the rounding of a different summation order)."""
    for k, want in expected.items():
        got = reduced[k]
        if not bool(cp.allclose(got, want, rtol=1e-5, atol=1e-5)):
            worst = float(cp.abs(got - want).max())
            raise AssertionError(f"bucket {k}: not the sum over ranks (largest difference {worst:g})")


VARIANTS: dict[str, Callable[..., list[Any]]] = {
    "overlapped": overlapped,
    "serial on the GPU (wait() each)": serial_on_gpu,
    "serial (result() each)": serial,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, default=16, help="gradient buckets (default 16)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="MB per bucket (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each variant (default 5)")
    args = parser.parse_args(argv)
    require_gpu()  # without one: what `python -m cudafut` says, and status 1

    dist.init_process_group(timeout=TIMEOUT_S)  # torchrun's or mpirun's environment
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # The caller's stream: a non-blocking one, as a training loop has.
        with cp.cuda.Stream(non_blocking=True):
            buckets = Buckets(args.buckets, args.bucket_mb << 18, rank=rank)
            cal = calibrate(buckets)
            expected = expected_values(buckets, world)
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for fn in VARIANTS.values():
                check(fn(buckets), expected)  # warm-up, and every variant reduces right
            for _ in range(args.repeats):
                for name, fn in VARIANTS.items():
                    barrier()
                    t = time.perf_counter()
                    reduced = fn(buckets)
                    times[name].append(time.perf_counter() - t)
                    check(reduced, expected)
        if rank == 0:
            print(
                f"{world} rank(s), {buckets.count} buckets of {args.bucket_mb} MB; per bucket: "
                f"compute {cal['compute_s'] * 1e3:.2f} ms ({buckets.rounds} rounds), "
                f"all-reduce {cal['allreduce_s'] * 1e3:.2f} ms"
            )
            best = statistics.median(times["overlapped"])
            for name, ts in times.items():
                med = statistics.median(ts)
                gain = "" if name == "overlapped" else f"   overlapped is {med / best:.2f}x faster"
                print(f"{name:34s} {med * 1e3:8.2f} ms{gain}")
            print("check: every reduced bucket is the sum over ranks")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
