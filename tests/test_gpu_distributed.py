"""cudafut.distributed on real GPUs: NCCL collectives as CudaFutures.

The multi-process tests start one process per GPU (tests/dist_launch.py; the
ranks run tests/dist_ranks.py), CUDAFUT_DIST_NPROC of them (default: every
GPU, at most 8), and skip on a machine with fewer than 2 GPUs. Their inputs
come from slow producers on the caller's stream with no synchronisation
before the call, so a missing stream wait shows up as wrong data; each
rank's checks are compared with NumPy references of what every rank
contributed, and every failing check of every rank is reported at once.

The world-of-one tests run in this process on one GPU (no store, no peers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import cudafut.distributed as dist
from cudafut import _backend
from tests.dist_launch import LAUNCH_VARS, NO_MULTICAST, describe, run_ranks
from tests.kernels import spin_copy, spin_fill
from tests.runners import BACKENDS
from tests.subproc import run_python

pytestmark = pytest.mark.gpu

N = 1 << 16
SLOW_MS = 50.0


@pytest.fixture
def nproc() -> int:
    """The world size of the multi-process tests: CUDAFUT_DIST_NPROC, else
    every GPU (at most 8); one GPU per rank (NCCL refuses two ranks on one)."""
    count = _backend.current.device_count()
    raw = os.environ.get("CUDAFUT_DIST_NPROC")
    n = int(raw) if raw else min(count, 8)
    if count < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {count}")
    if n < 2:
        pytest.skip(f"needs 2 processes; CUDAFUT_DIST_NPROC={raw}")
    if n > count:
        pytest.skip(f"CUDAFUT_DIST_NPROC={n} needs {n} GPUs (one per rank); this machine has {count}")
    return n


def failures(results: list[Any]) -> list[str]:
    """Every check a rank did not report "ok", as 'rank r: name: what'."""
    out = []
    for res in results:
        value = res.value
        if not isinstance(value, dict) or not value.get("checks"):
            out.append(f"rank {res.rank}: no checks reported (returncode {res.returncode})")
            continue
        out += [f"rank {res.rank}: {name}: {what}" for name, what in value["checks"].items() if what != "ok"]
    return out


# -- every collective, every way of reading it ------------------------------------

BATTERY_ASYNC = "from tests.dist_ranks import battery_async as main"
BATTERY_SYNC = "from tests.dist_ranks import battery_sync as main"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", [*BACKENDS, "result"])
def test_collectives_after_slow_producers_and_before_slow_consumers(nproc: int, backend: str) -> None:
    """all_reduce (sum, max, min, prod, avg; float32, int64), all_gather,
    reduce_scatter, broadcast (from size - 1), reduce (to 0), all_to_all,
    send/recv around a ring, groups [0, 1] and [1..size-1]: read with
    ``await`` on each loop, or with ``result()``; plus then(), wait(), a
    cancelled await, dropped inputs and slowly produced outputs."""
    body = BATTERY_SYNC if backend == "result" else BATTERY_ASYNC
    results = run_ranks(nproc, body, timeout=150, extra_env={"BACKEND": backend})
    bad = failures(results)
    assert [r.returncode for r in results] == [0] * nproc, describe(results) + "\n" + "\n".join(bad)
    assert not bad, "\n".join(bad)
    for res in results:
        checks = res.value["checks"]
        # Each rank really ran the slow round, and the harness caught an unordered read.
        assert checks.get("slow/control") == "ok", res.tail()
        assert sum(name.startswith("slow/") for name in checks) >= 30, sorted(checks)
        assert ("slow/reduce to 0 then(slow copy)" in checks) == (res.rank == 0)
        assert ("slow/group [0, 1] all_reduce" in checks) == (res.rank < 2)


# -- a dead peer ----------------------------------------------------------------------

DEAD_PEER = """
HARD_EXIT = True   # NCCL's teardown after an abort may hang: leave at once
from tests.dist_ranks import dead_peer as main
"""


@pytest.mark.timeout(240)
def test_a_dead_peer_fails_the_collective_within_its_timeout(nproc: int) -> None:
    results = run_ranks(nproc, DEAD_PEER, timeout=120, grace=90, extra_env={"BACKEND": "asyncio"})
    codes = [r.returncode for r in results]
    assert codes[1] == 3 and [c for i, c in enumerate(codes) if i != 1] == [0] * (nproc - 1), describe(
        results
    )
    for res in results:
        if res.rank == 1:
            continue
        out = res.value
        assert isinstance(out, dict), describe(results)
        assert out["first"] == nproc, out  # the all_reduce before the peer died
        where = "await" if out["enqueue"] == "ok" else "enqueue"  # NCCL may notice at the call
        err = out[where]
        assert isinstance(err, dict) and err["collective_error"] and err["cuda_error"], out
        assert (err["op"], err["rank"], err["size"]) == ("all_reduce", res.rank, nproc), out
        assert err["reason"], out
        if where == "await":
            assert out["await_s"] < 30, out  # timeout=5: the watchdog, not the GPU, ended it
            second = out["second"]  # every pending future of the group fails
            assert isinstance(second, dict) and second["collective_error"], out
            assert second["op"] == "all_reduce", out
        later = out["later"]  # the group is aborted: the next call raises at once
        assert isinstance(later, dict) and later["collective_error"] and later["op"] == "all_reduce", out
        assert out["later_s"] < 1.0, out
        assert out["aborted"], out


# -- a world of one process, in this process ----------------------------------------


@pytest.fixture
def world1(cp: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.ProcessGroup]:
    """init_process_group() with no launcher variables: a world of one."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in NO_MULTICAST.items():  # read by NCCL at its first init in this process
        monkeypatch.setenv(var, value)
    previous = cp.cuda.Device().id
    assert not dist.is_initialized()
    group = dist.init_process_group(timeout=30)
    try:
        yield group
    finally:
        dist.destroy_process_group()
        cp.cuda.Device(previous).use()
    assert not dist.is_initialized()


def host(arr: Any, stream: Any) -> Any:
    """Copy to the host on ``stream`` only (no implicit wait on others)."""
    out = arr.get(stream=stream)
    stream.synchronize()
    return out


def test_world_of_one_is_the_default_and_every_collective_is_trivial(
    cp: Any, world1: dist.ProcessGroup
) -> None:
    g = world1
    assert (g.rank, g.size, tuple(g.ranks), g.timeout, g.aborted) == (0, 1, (0,), 30, None)
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert cp.cuda.Device().id == g.device  # init made it current
    assert cp.cuda.runtime.streamGetPriority(g.stream.ptr) < 0  # high priority
    for dtype, ops in ((cp.float32, ("sum", "prod", "max", "min", "avg")), (cp.int64, ("sum", "max"))):
        x = (cp.arange(20, dtype=dtype).reshape(4, 5) + 1) * 3
        want = x.get()
        for op in ops:
            y = x.copy()
            assert dist.all_reduce(y, op).result() is y
            assert (y.get() == want).all(), op
        gathered = dist.all_gather(x).result()
        assert gathered.shape == (1, 4, 5) and (gathered.get()[0] == want).all()
        out = cp.empty((1, 4, 5), dtype=dtype)
        assert dist.all_gather(x, out=out).result() is out and (out.get()[0] == want).all()
        scattered = dist.reduce_scatter(x, "max").result()
        assert scattered.shape == (4, 5) and (scattered.get() == want).all()
        swapped = dist.all_to_all(x).result()
        assert swapped.shape == (4, 5) and (swapped.get() == want).all()
        for call in (lambda a: dist.broadcast(a, 0), lambda a: dist.reduce(a, 0, "min")):
            y = x.copy()
            assert call(y).result() is y and (y.get() == want).all()
    # a group of the one rank: its own communicator and stream
    solo = dist.new_group([0])
    assert solo is not None and (solo.rank, solo.size, tuple(solo.ranks)) == (0, 1, (0,))
    assert solo.stream.ptr != g.stream.ptr
    y = cp.full(8, 5, dtype=cp.float32)
    assert (dist.all_reduce(y, group=solo).result().get() == 5).all()


def test_world_of_one_refuses_bad_arguments_before_enqueueing(cp: Any, world1: dist.ProcessGroup) -> None:
    x = cp.ones((4, 6), dtype=cp.float32)
    with pytest.raises(ValueError, match="op"):
        dist.all_reduce(x, "bogus")
    with pytest.raises(ValueError, match="op"):
        dist.reduce_scatter(x, "add")
    with pytest.raises(TypeError):
        dist.all_reduce(x.get())  # host memory
    for bad in (cp.ones(4, dtype=cp.complex64), cp.ones(4, dtype=cp.bool_), cp.ones(4, dtype=cp.int16)):
        with pytest.raises((TypeError, ValueError)):
            dist.all_reduce(bad)
    with pytest.raises((TypeError, ValueError)):
        dist.all_reduce(x[:, ::2])  # not C-contiguous
    with pytest.raises((TypeError, ValueError)):
        dist.all_reduce(x.T)  # Fortran order
    with pytest.raises(ValueError, match="src"):
        dist.broadcast(x, 1)  # no rank 1 in a world of one
    with pytest.raises(ValueError, match="dst"):
        dist.reduce(x, -1)
    with pytest.raises(ValueError, match="dst"):
        dist.send(x, 1)
    with pytest.raises(ValueError, match="src"):
        dist.recv(x, 2)
    with pytest.raises(ValueError, match="out"):
        dist.all_gather(x, out=cp.empty((2, 4, 6), dtype=cp.float32))
    with pytest.raises((TypeError, ValueError)):
        dist.all_gather(x, out=cp.empty((1, 4, 6), dtype=cp.float64))
    with pytest.raises(ValueError, match="out"):
        dist.reduce_scatter(x, out=cp.empty((2, 6), dtype=cp.float32))
    with pytest.raises(ValueError, match="timeout"):
        dist.all_reduce(x, timeout=0)
    with pytest.raises(TypeError):
        dist.all_reduce(x, timeout="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dist.all_reduce(x, group="world")  # type: ignore[arg-type]
    if _backend.current.device_count() >= 2:
        other = 1 if world1.device != 1 else 0
        with cp.cuda.Device(other):
            elsewhere = cp.ones(4, dtype=cp.float32)
        with pytest.raises(ValueError, match="device"):
            dist.all_reduce(elsewhere)
    # nothing was enqueued, nothing was aborted: the group works on
    assert world1.aborted is None
    assert (dist.all_reduce(x).result().get() == 1).all()


def test_world_of_one_orders_after_a_slow_producer(cp: Any, world1: dist.ProcessGroup) -> None:
    """The one-rank collectives copy at most, so the data would not show a
    missing wait: the reads are on a stream that nothing orders, and the
    out-of-place all_gather and the then() children read what they got."""
    producer, reader = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        reduced = dist.all_reduce(x)  # no synchronize: the communication stream must wait
        gathered = dist.all_gather(x)
    child = reduced.then(lambda v: v + 1)

    def slow_copy(v: Any) -> Any:
        y = cp.empty_like(v)
        spin_copy(v, y, SLOW_MS)
        return y

    slow_child = gathered.then(slow_copy)
    assert (host(reduced.result(), reader) == 7).all()
    assert (host(gathered.result(), reader) == 7).all()
    assert (host(child.result(), reader) == 8).all()
    assert (host(slow_child.result(), reader) == 7).all()


@pytest.mark.anyio
async def test_world_of_one_await(cp: Any, world1: dist.ProcessGroup) -> None:
    producer, reader = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut = dist.all_gather(x)
    assert not fut.done()  # the communication stream waits for the producer
    out = await fut
    assert out.shape == (1, N) and (host(out, reader) == 7).all()


# -- a collective past its timeout, on one GPU -------------------------------------

TIMEOUT = """
import os, sys, time
for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK"):
    os.environ.pop(var, None)
import cudafut
import cudafut.distributed as dist
from cudafut import _backend, _cuda
from tests.kernels import spin_fill
from tests.runners import run_on

cp = _backend.current.cupy()
group = dist.init_process_group(timeout=30)
x = cp.zeros(1024, dtype=cp.float32)
spin_fill(x, 1, 0)                    # compile the kernel, connect, before timing anything
dist.all_reduce(x).result(timeout=30)
s = cp.cuda.Stream(non_blocking=True)
with s:
    spin_fill(x, 1, 3000)             # the collective's input comes after 3 s ...
    fut = dist.all_reduce(x, timeout=0.5)   # ... past its timeout
t0 = time.monotonic()

async def main():
    try:
        await fut
        return "no error"
    except dist.CollectiveError as exc:
        return (f"CollectiveError op={exc.op} rank={exc.rank} size={exc.size} "
                f"cuda_error={isinstance(exc, cudafut.CudaError)}")

print("await:", run_on(sys.argv[1], main), flush=True)
print("fast:", time.monotonic() - t0 < 2.5, flush=True)  # failed by the watchdog, not the GPU
try:
    fut.result(timeout=5)
except dist.CollectiveError as exc:
    print("result: CollectiveError", exc.op, flush=True)
t1 = time.monotonic()
try:
    dist.all_reduce(x)
    print("later: returned", flush=True)
except dist.CollectiveError as exc:
    print("later: CollectiveError", exc.op, time.monotonic() - t1 < 0.5, flush=True)
print("aborted:", bool(group.aborted), flush=True)
os._exit(0)                           # do not wait for the spinning kernel, nor NCCL's teardown
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_collective_past_its_timeout_fails_every_wait_and_aborts_the_group(backend: str) -> None:
    proc = run_python(TIMEOUT, backend, timeout=90, **NO_MULTICAST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keys = {"await", "fast", "result", "later", "aborted"}
    lines = [line for line in proc.stdout.splitlines() if line.split(":")[0] in keys]
    assert lines == [
        "await: CollectiveError op=all_reduce rank=0 size=1 cuda_error=True",
        "fast: True",
        "result: CollectiveError all_reduce",
        "later: CollectiveError all_reduce True",
        "aborted: True",
    ], proc.stdout + proc.stderr
