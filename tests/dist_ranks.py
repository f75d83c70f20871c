"""What the ranks of tests/test_gpu_distributed.py run, one process per GPU
(started by tests/dist_launch.py; nothing here touches CUDA at import).

Every collective's input is made by a slow producer on the caller's current
stream: zeros at once, the real values only after SLOW_MS of spinning on the
GPU, and no synchronisation before the call. A collective that does not wait
for the caller's stream reads zeros (and an in-place one is overwritten
later by the producer): wrong data, never a flaky timing. Outputs passed as
``out=`` (and recv buffers) get -1 from a slow producer the same way: a
collective that does not wait writes them before the -1 lands. After each
call, a ``then()`` consumer copies the value (slowly, or at once): it reads
pre-collective data if it does not wait for the collective.

A battery runs twice: a warm round (no spinning) first, which compiles every
kernel and makes NCCL connect to every peer (NCCL connects lazily, on the
host, at the first call of each kind: time during which a slow producer would
finish and hide a missing wait), then the slow round.

Each check is recorded as "ok" or what went wrong, and returned to the test
(which asserts on them all at once: one run shows every failure). Argument
errors are raised identically on every rank before anything is enqueued, so
a section that raises is recorded and the ranks go on in step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import cudafut
import cudafut.distributed as dist
from cudafut import _backend
from tests.kernels import spin_copy, spin_fill

SLOW_MS = 50.0
#: Per collective: a desynchronised battery fails in CollectiveError long
#: before tests/dist_launch.py kills the ranks.
CALL_TIMEOUT_S = 30.0
#: Elements of the 1-D inputs; rows per rank's block of the 2-D ones.
N = 1 << 14
K = 512


def cupy() -> Any:
    return _backend.current.cupy()


# -- what each rank contributes (NumPy, so every rank knows every input) -------


def ramp(shape: tuple[int, ...], rank: int, salt: int, dtype: Any = np.float32) -> np.ndarray:
    """Rank ``rank``'s input: ``arange * (rank + 1) + rank + salt`` (exact in float32)."""
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.int64) * (rank + 1) + rank + salt).reshape(shape).astype(dtype)


def wave(shape: tuple[int, ...], rank: int, salt: int, dtype: Any) -> np.ndarray:
    """Values in [-50, 50] whose max and min over the ranks come from different ranks."""
    return (ramp(shape, rank, salt, np.int64) % 101 - 50).astype(dtype)


def big(shape: tuple[int, ...], rank: int, salt: int) -> np.ndarray:
    """int64 values beyond 32 bits (a 32-bit or float path would lose them)."""
    return ramp(shape, rank, salt, np.int64) + (rank + 1) * 2**40


def small(shape: tuple[int, ...], rank: int, salt: int) -> np.ndarray:
    """Values in {1, 2, 3}: a product over 8 ranks stays exact in float32."""
    return (ramp(shape, rank, salt, np.int64) % 3 + 1).astype(np.float32)


def summed(parts: Any) -> np.ndarray:
    """The elementwise sum of same-shaped arrays (in their dtype: pass int64 for exact sums)."""
    total: np.ndarray = np.sum(np.stack(list(parts)), axis=0)
    return total


def block(a: np.ndarray, i: int) -> np.ndarray:
    """Block ``i`` of K rows."""
    return a[i * K : (i + 1) * K]


# -- GPU helpers -------------------------------------------------------------------


def host(arr: Any, stream: Any) -> np.ndarray:
    """Copy to the host on ``stream`` only (no implicit wait on other streams)."""
    out = arr.get(stream=stream)
    stream.synchronize()
    return np.asarray(out)


def produce(stream: Any, values: np.ndarray, ms: float) -> Any:
    """A new array that holds zeros at once and ``values`` once ``ms`` of
    spinning on ``stream`` is over; the host does not wait for the spin."""
    cp = cupy()
    with stream:
        src = cp.asarray(values)
        x = cp.zeros_like(src)
        gate = cp.zeros(1, dtype=cp.float32)
        stream.synchronize()  # only the spin below is left pending
        spin_fill(gate, 1.0, ms)
        cp.multiply(src, gate.astype(src.dtype), out=x)
    return x


def slow_copy(v: Any, ms: float) -> Any:
    """A then() body: on the current (pool) stream, wait ``ms``, then copy
    ``v`` into a new array."""
    cp = cupy()
    y = cp.empty_like(v)
    if v.dtype == cp.float32:
        spin_copy(v, y, ms)
    else:
        gate = cp.zeros(1, dtype=cp.float32)
        spin_fill(gate, 0.0, ms)
        y[...] = v
    return y


def verdict(got: np.ndarray, want: np.ndarray, approx: bool = False) -> str:
    """Either "ok" or how ``got`` differs from ``want``."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got shape {got.shape} dtype {got.dtype}, want shape {want.shape} dtype {want.dtype}"
    same = np.isclose(got, want, rtol=1e-5, atol=0) if approx else got == want
    if same.all():
        return "ok"
    bad = np.flatnonzero(~same)
    i = int(bad[0])
    hint = ""
    if not got.any():
        hint = " (all zeros: read before its producer wrote it?)"
    elif (got == -1).all():
        hint = " (all -1: the output's slow producer wrote it after the collective?)"
    return (
        f"{bad.size} of {want.size} elements wrong; first at {i}: got {got.flat[i]!r}, "
        f"want {want.flat[i]!r}{hint}"
    )


def error_info(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "collective_error": isinstance(exc, dist.CollectiveError),
        "cuda_error": isinstance(exc, cudafut.CudaError),
        "op": getattr(exc, "op", None),
        "rank": getattr(exc, "rank", None),
        "size": getattr(exc, "size", None),
        "reason": str(getattr(exc, "reason", "")),
        "message": str(exc),
    }


def _trace() -> str:
    return "raised: " + traceback.format_exc()[-3000:]


# -- the battery ---------------------------------------------------------------------


class Read:
    """A future to read, and what its value must be."""

    def __init__(
        self, name: str, fut: cudafut.CudaFuture[Any], want: np.ndarray | None, same: Any, approx: bool
    ) -> None:
        self.name = name
        self.fut = fut
        self.want = want
        self.same = same
        self.approx = approx


class Battery:
    """One round: every collective enqueued back to back (no host waits),
    then every future read."""

    def __init__(self, rank: int, world: Any, sub: Any, tail: Any, ms: float, name: str) -> None:
        cp = cupy()
        self.rank = rank
        self.size = int(world.size)
        self.world = world
        self.sub = sub
        self.tail = tail
        self.ms = ms
        self.name = name
        self.stream = cp.cuda.Stream(non_blocking=True)  # the caller's stream: producers and calls
        self.other = cp.cuda.Stream(non_blocking=True)  # for wait(): ordered only by wait()
        self.reader = cp.cuda.Stream(non_blocking=True)  # host copies, ordered by nothing
        self.reads: list[Read] = []
        self.checks: dict[str, str] = {}
        self.keep: list[Any] = []
        self.cancel: Read | None = None

    # -- issuing --

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.checks[f"{self.name}/{name}"] = _trace()

    def produce(self, values: np.ndarray) -> Any:
        return produce(self.stream, values, self.ms)

    def call(self, fn: Callable[..., cudafut.CudaFuture[Any]], *args: Any, **kwargs: Any) -> Any:
        """``fn`` with the slow producers' stream current, as a user's code calls it."""
        with self.stream:
            return fn(*args, timeout=CALL_TIMEOUT_S, **kwargs)

    def garbage(self, shape: tuple[int, ...]) -> None:
        """Allocate and fill arrays like a dropped input on the producers'
        stream: the pool hands out the input's memory if the collective did
        not keep it alive."""
        cp = cupy()
        with self.stream:
            self.keep += [cp.full(shape, -7, dtype=cp.float32) for _ in range(8)]

    def expect(
        self,
        name: str,
        fut: cudafut.CudaFuture[Any],
        want: np.ndarray | None,
        *,
        same: Any = None,
        approx: bool = False,
        fast_then: bool = False,
    ) -> None:
        """Read ``fut``; and, with ``want``, a slow then() consumer (and a fast one)."""
        full = f"{self.name}/{name}"
        self.reads.append(Read(full, fut, want, same, approx))
        if want is None:
            return
        ms = self.ms
        child = fut.then(lambda v: slow_copy(v, ms))
        self.reads.append(Read(f"{full} then(slow copy)", child, want, None, approx))
        if fast_then:
            self.reads.append(Read(f"{full} then(copy)", fut.then(lambda v: v.copy()), want, None, approx))

    def issue(self) -> None:
        r, size = self.rank, self.size
        every = range(size)

        def vector(i: int, salt: int) -> np.ndarray:
            return ramp((N,), i, salt)

        maximum, minimum = np.maximum.reduce, np.minimum.reduce
        cases: list[tuple[str, Callable[[int, int], np.ndarray], Callable[[Any], Any] | None]] = [
            ("sum", vector, summed),
            ("max", lambda i, s: wave((N,), i, s, np.float32), maximum),
            ("sum", lambda i, s: big((N,), i, s), summed),
            ("max", lambda i, s: wave((N,), i, s, np.int64), maximum),
            ("min", lambda i, s: wave((N,), i, s, np.int64), minimum),
            ("prod", lambda i, s: small((N,), i, s), np.multiply.reduce),
            ("avg", vector, None),  # the sum over the size, rounded: not exact for 3 ranks
        ]
        for salt, (op, make, combine) in enumerate(cases, start=10):
            mine = make(r, salt)
            what = f"all_reduce {op} {mine.dtype.name}"
            with self.section(what):
                x = self.produce(mine)
                fut = self.call(dist.all_reduce, x, op)
                parts = [make(i, salt).astype(np.int64) for i in every]
                if combine is None:
                    want = (summed(parts) / size).astype(mine.dtype)
                else:
                    want = np.asarray(combine(parts)).astype(mine.dtype)
                self.expect(what, fut, want, same=x, approx=combine is None, fast_then=op == "sum")
                if op == "sum" and mine.dtype == np.float32:
                    with self.other:  # ordered after the all_reduce by wait() alone
                        y = fut.wait().copy()
                    self.expect(f"{what} wait()", cudafut.record(y, stream=self.other), want)

        with self.section("all_gather (input dropped)"):
            fut = self.call(dist.all_gather, self.produce(ramp((K, 3), r, 20)))  # nothing else holds it
            self.garbage((K, 3))
            self.expect("all_gather", fut, np.stack([ramp((K, 3), i, 20) for i in every]), fast_then=True)

        with self.section("all_gather out="):
            out = self.produce(np.full((size, K, 3), -1, np.float32))
            x = self.produce(ramp((K, 3), r, 21))
            fut = self.call(dist.all_gather, x, out=out)
            self.expect("all_gather out=", fut, np.stack([ramp((K, 3), i, 21) for i in every]), same=out)

        with self.section("reduce_scatter sum"):
            fut = self.call(dist.reduce_scatter, self.produce(ramp((size * K, 3), r, 22)))
            self.garbage((size * K, 3))
            want = block(summed(ramp((size * K, 3), i, 22, np.int64) for i in every), r).astype(np.float32)
            self.expect("reduce_scatter sum", fut, want, fast_then=True)

        with self.section("reduce_scatter max out="):
            out = self.produce(np.full((K, 3), -1, np.int64))
            x = self.produce(wave((size * K, 3), r, 23, np.int64))
            fut = self.call(dist.reduce_scatter, x, "max", out=out)
            want = block(np.maximum.reduce([wave((size * K, 3), i, 23, np.int64) for i in every]), r)
            self.expect("reduce_scatter max out=", fut, want, same=out)

        with self.section("broadcast"):
            src = size - 1
            x = self.produce(ramp((N,), r, 24))
            fut = self.call(dist.broadcast, x, src)
            self.expect(f"broadcast from {src}", fut, ramp((N,), src, 24), same=x, fast_then=True)

        with self.section("reduce"):
            x = self.produce(ramp((N,), r, 25))
            fut = self.call(dist.reduce, x, 0)
            want = summed(ramp((N,), i, 25, np.int64) for i in every).astype(np.float32)
            self.expect("reduce to 0", fut, want if r == 0 else None, same=x)

        with self.section("all_to_all"):
            fut = self.call(dist.all_to_all, self.produce(ramp((size * K, 2), r, 26)))
            self.garbage((size * K, 2))
            want = np.concatenate([block(ramp((size * K, 2), i, 26), r) for i in every])
            self.expect("all_to_all", fut, want, fast_then=True)

        with self.section("send/recv ring"):
            # Rank 0 sends first, every other rank receives first: a chain,
            # not a cycle (every rank sending first would deadlock).
            nxt, prv = (r + 1) % size, (r - 1) % size
            if r == 0:
                self._send(nxt)
                self._recv(prv)
            else:
                self._recv(prv)
                self._send(nxt)

        with self.section("new_group [0, 1]"):
            if self.sub is not None:
                x = self.produce(ramp((N,), r, 28))
                fut = self.call(dist.all_reduce, x, group=self.sub)
                want = (ramp((N,), 0, 28, np.int64) + ramp((N,), 1, 28, np.int64)).astype(np.float32)
                self.expect("group [0, 1] all_reduce", fut, want, same=x)

        with self.section("new_group [1, ..., size - 1]"):
            if self.tail is not None:  # group rank 0 is world rank 1
                x = self.produce(ramp((N,), r, 29))
                fut = self.call(dist.broadcast, x, 0, group=self.tail)
                self.expect("group [1..] broadcast from its rank 0", fut, ramp((N,), 1, 29), same=x)

        with self.section("cancelled await"):
            x = self.produce(ramp((N,), r, 30))
            fut = self.call(dist.all_reduce, x)
            want = summed(ramp((N,), i, 30, np.int64) for i in every).astype(np.float32)
            self.cancel = Read(f"{self.name}/cancelled await", fut, want, x, False)

    def _send(self, dst: int) -> None:
        fut = self.call(dist.send, self.produce(ramp((N,), self.rank, 27)), dst)  # input dropped
        self.garbage((N,))
        self.expect(f"send to {dst}", fut, None)

    def _recv(self, src: int) -> None:
        y = self.produce(np.full((N,), -1, np.float32))  # -1 lands late: recv must wait for it
        fut = self.call(dist.recv, y, src)
        self.expect(f"recv from {src}", fut, ramp((N,), src, 27), same=y)

    def control(self) -> None:
        """The harness itself: a copy that nothing orders after the slow
        producer reads zeros. Else the slow producers prove nothing."""
        cp = cupy()
        x = self.produce(ramp((N,), self.rank, 31))
        with self.other:
            y = cp.empty_like(x)
            y[...] = x
        got = host(y, self.other)
        self.keep.append(x)
        if self.ms:  # the warm round only compiles the copy
            self.checks[f"{self.name}/control"] = (
                "ok"
                if not got.any()
                else "an unordered copy saw the slow producer's data: the spin does not hold the "
                "producer's stream, so the ordering checks prove nothing"
            )

    # -- reading --

    def judge(self, read: Read, value: Any) -> None:
        if read.same is not None and value is not read.same:
            self.checks[f"{read.name} value is the array"] = f"got {type(value).__name__} {value!r:.200}"
        if read.want is not None:
            self.checks[read.name] = verdict(host(value, self.reader), read.want, read.approx)
        else:
            self.checks.setdefault(read.name, "ok")

    def read_result(self, read: Read) -> None:
        try:
            self.judge(read, read.fut.result(timeout=2 * CALL_TIMEOUT_S))
        except Exception:
            self.checks[read.name] = _trace()

    async def read_await(self, read: Read) -> None:
        try:
            self.judge(read, await read.fut)
        except Exception:
            self.checks[read.name] = _trace()

    async def cancelled_await(self) -> None:
        """Cancel an ``await`` of a pending collective: the collective goes on."""
        import anyio

        read = self.cancel
        if read is None:
            return
        try:
            with anyio.move_on_after(0.002) as scope:
                await read.fut
        except Exception:
            self.checks[f"{read.name}: cancelled"] = _trace()
        else:
            if self.ms and not scope.cancelled_caught:
                self.checks[f"{read.name}: was pending"] = "the await finished within 2 ms: cancelled nothing"
        if read.fut.cancelled():
            self.checks[f"{read.name}: future"] = "cancelling the await cancelled the future"
        await self.read_await(read)

    def finish(self) -> None:
        for g, what in ((self.world, "world"), (self.sub, "group [0, 1]"), (self.tail, "group [1..]")):
            if g is not None and g.aborted is not None:
                self.checks[f"{self.name}/{what} aborted"] = str(g.aborted)


def setup(rank: int, world: Any) -> tuple[Any, Any, dict[str, str]]:
    """Check the world, make the groups: (group [0, 1], group [1..size-1], checks)."""
    cp = cupy()
    size = int(world.size)
    checks: dict[str, str] = {}

    def check(name: str, ok: bool, detail: object) -> None:
        checks[f"setup/{name}"] = "ok" if ok else str(detail)

    nccl_priority = cp.cuda.runtime.streamGetPriority(world.stream.ptr)
    check("world rank", world.rank == rank == dist.get_rank(), (world.rank, dist.get_rank()))
    check("world size", world.size == size == dist.get_world_size() == int(os.environ["WORLD_SIZE"]), size)
    check("world ranks", list(world.ranks) == list(range(size)), world.ranks)
    local = int(os.environ["LOCAL_RANK"])
    check(
        "device", world.device == local % _backend.current.device_count() == cp.cuda.Device().id, world.device
    )
    check("stream priority high", nccl_priority < 0, nccl_priority)
    check("initialised", dist.is_initialized(), False)
    sub = tail = None
    try:
        sub = dist.new_group([0, 1], timeout=CALL_TIMEOUT_S)
        member = rank in (0, 1)
        check("group [0, 1] membership", (sub is not None) == member, sub)
        if sub is not None:
            check("group [0, 1] rank", sub.rank == rank == dist.get_rank(sub), sub.rank)
            check("group [0, 1] size", sub.size == 2 == dist.get_world_size(sub), sub.size)
            check("group [0, 1] ranks", list(sub.ranks) == [0, 1], sub.ranks)
            check("group [0, 1] own stream", sub.stream.ptr != world.stream.ptr, sub.stream)
        tail = dist.new_group(range(1, size), timeout=CALL_TIMEOUT_S)
        check("group [1..] membership", (tail is not None) == (rank >= 1), tail)
        if tail is not None:
            check("group [1..] rank", tail.rank == rank - 1, tail.rank)
            check("group [1..] ranks", list(tail.ranks) == list(range(1, size)), tail.ranks)
    except Exception:
        checks["setup/new_group"] = _trace()
    return sub, tail, checks


def _report(rank: int, checks: dict[str, str]) -> dict[str, Any]:
    return {"rank": rank, "checks": checks}


def battery_sync(rank: int, world: Any) -> dict[str, Any]:
    """Every collective, read with ``result()`` (no event loop)."""
    sub, tail, checks = setup(rank, world)
    for name, ms in (("warm", 0.0), ("slow", SLOW_MS)):
        b = Battery(rank, world, sub, tail, ms, name)
        b.control()
        b.issue()
        for read in [*b.reads, *([b.cancel] if b.cancel else [])]:
            b.read_result(read)
        b.finish()
        checks.update(b.checks)
    return _report(rank, checks)


async def battery_async(rank: int, world: Any) -> dict[str, Any]:
    """Every collective, read with ``await`` on the loop BACKEND names."""
    sub, tail, checks = setup(rank, world)
    for name, ms in (("warm", 0.0), ("slow", SLOW_MS)):
        b = Battery(rank, world, sub, tail, ms, name)
        b.control()
        b.issue()
        await b.cancelled_await()  # first, while everything is pending
        for read in b.reads:
            await b.read_await(read)
        b.finish()
        checks.update(b.checks)
    return _report(rank, checks)


# -- a dead peer -------------------------------------------------------------------


async def dead_peer(rank: int, world: Any) -> dict[str, Any]:
    """Rank 1 leaves after one all_reduce; the others' next ones must fail
    with CollectiveError within their timeout (5 s), and later calls at once."""
    cp = cupy()
    reader = cp.cuda.Stream(non_blocking=True)
    x = cp.ones(N, dtype=cp.float32)
    first = await dist.all_reduce(x, timeout=CALL_TIMEOUT_S)
    out: dict[str, Any] = {"rank": rank, "first": float(host(first, reader)[0])}
    if rank == 1:
        sys.stdout.flush()
        os._exit(3)
    a, b = cp.ones(N, dtype=cp.float32), cp.ones(N, dtype=cp.float32)
    t0 = time.monotonic()
    pending = []
    try:
        pending = [dist.all_reduce(a, timeout=5.0), dist.all_reduce(b, timeout=5.0)]
        out["enqueue"] = "ok"
    except Exception as exc:  # NCCL may see the peer gone at the call
        out["enqueue"] = error_info(exc)
    if pending:
        try:
            await pending[0]
            out["await"] = "no error"
        except Exception as exc:
            out["await"] = error_info(exc)
        out["await_s"] = time.monotonic() - t0
        try:
            pending[1].result(timeout=30)
            out["second"] = "no error"
        except Exception as exc:
            out["second"] = error_info(exc)
    t1 = time.monotonic()
    try:
        dist.all_reduce(cp.ones(4, dtype=cp.float32), timeout=5.0)
        out["later"] = "the call returned"
    except Exception as exc:
        out["later"] = error_info(exc)
    out["later_s"] = time.monotonic() - t1
    out["aborted"] = world.aborted
    return out
