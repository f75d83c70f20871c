"""Reliability on a GPU: memory safety when references are dropped, mass
cancellation, loops and threads, fork, Ctrl-C, sticky errors, bad input."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from benchmarks.support.interrupt import ctrl_c_during_result
from cudafut import _backend, _loops, _waiter
from cudafut._future import _State
from tests.kernels import Gate, gated_fill, spin_copy, spin_fill
from tests.runners import BACKENDS, run_on
from tests.subproc import run_python

pytestmark = pytest.mark.gpu

N = 1 << 18


def _slow_source(cp: Any, stream: Any, value: float, ms: float) -> Any:
    with stream:
        x = cp.zeros(N, dtype=cp.float32)
        spin_fill(x, value, ms)
    return x


def _pool_pressure(cp: Any, stream: Any) -> None:
    """Once the producer is done and the holds of dropped futures ended,
    allocate and scribble on ``stream``: memory freed there would be handed
    out and overwritten while a consumer (still spinning) has yet to read it."""
    end = time.monotonic() + 0.1
    while _waiter.thread_waiter().holding and time.monotonic() < end:
        time.sleep(0.002)
    gc.collect()
    with stream:
        junk = [cp.full(N, -1.0, dtype=cp.float32) for _ in range(16)]
    del junk


def _slow_plus_one(cp: Any, v: Any, ms: float = 150) -> Any:
    tmp = cp.empty_like(v)
    spin_copy(v, tmp, ms)  # reads v only after ms
    return tmp + 1


# -- memory safety: drop every reference right after enqueueing ------------------


def test_then_with_every_reference_dropped(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        x = _slow_source(cp, producer, 7.0, 5)
        out = cudafut.record(x, stream=producer).then(lambda v: _slow_plus_one(cp, v))
        del x
        _pool_pressure(cp, producer)
        assert (out.result().get() == 8).all()


def test_a_dropped_then_chain_keeps_every_link_alive(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    x = _slow_source(cp, producer, 1.0, 5)
    fut = cudafut.record(x, stream=producer)
    del x
    for _ in range(4):
        fut = fut.then(lambda v: _slow_plus_one(cp, v))  # the previous link is dropped
        _pool_pressure(cp, producer)
    assert (fut.result().get() == 5).all()


def test_a_dropped_pending_future_holds_its_value_for_other_streams(cp: Any) -> None:
    # Nothing but the dropped future keeps x: its hold must last until the
    # reader (another stream) has read it, or the pool hands x's block to
    # the scribbling on the producer's stream first.
    producer = cp.cuda.Stream(non_blocking=True)
    reader = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        x = _slow_source(cp, producer, 6.0, 5)
        y = cp.zeros(N, dtype=cp.float32)
        cp.cuda.Device().synchronize()  # y is ready; x is still being filled
        reader.wait_event(producer.record())
        with reader:
            spin_copy(x, y, 150)  # reads x 150 ms later
        fut = cudafut.record(x, stream=reader)  # pending until the read is done
        del x, fut
        _pool_pressure(cp, producer)
        reader.synchronize()
        assert (y.get() == 6).all()


def test_submit_with_its_arguments_dropped(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        x = _slow_source(cp, producer, 3.0, 5)
        with producer:  # submit's pool stream waits on the caller's current stream
            out = cudafut.submit(_slow_plus_one, cp, x)
        del x
        _pool_pressure(cp, producer)
        assert (out.result().get() == 4).all()


def test_wait_with_the_value_kept_by_the_result_future(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    consumer = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        x = _slow_source(cp, producer, 2.0, 5)
        fut = cudafut.record(x, stream=producer)
        del x
        with consumer:
            v = fut.wait()
            out = cudafut.record(_slow_plus_one(cp, v), keep=v)
        del v, fut
        _pool_pressure(cp, producer)
        assert (out.result().get() == 3).all()


def test_record_keep_holds_an_input_no_future_gave(cp: Any) -> None:
    # x comes from no future: nothing but keep= keeps it (an array from
    # wait() or await has the consumer's stream recorded on its memory,
    # which protects it without keep=, as the test above shows).
    producer = cp.cuda.Stream(non_blocking=True)
    consumer = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        x = _slow_source(cp, producer, 2.0, 5)
        consumer.wait_event(producer.record())
        with consumer:
            out = cudafut.record(_slow_plus_one(cp, x), keep=x)
        del x
        _pool_pressure(cp, producer)
        assert (out.result().get() == 3).all()


def test_submit_keeps_a_dropped_torch_argument(cp: Any) -> None:
    # cudafut's allocator wrapper does not see torch's memory: the future
    # keeping its arguments (and recording them on its stream) is all that
    # stops torch's allocator handing the block to the scribbling below.
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    producer = torch.cuda.Stream()

    def slow_plus_one(t: Any) -> Any:
        return _slow_plus_one(cp, cp.asarray(t))

    for _ in range(2):
        with torch.cuda.stream(producer):  # submit's stream waits for torch's current one
            x = torch.full((N,), 3.0, device="cuda")
            out = cudafut.submit(slow_plus_one, x)
        del x
        with torch.cuda.stream(producer):
            junk = [torch.full((N,), -1.0, device="cuda") for _ in range(16)]
        del junk
        assert (out.result().get() == 4).all()


# -- many cancellations -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.no_asyncio_debug(
    reason="debug mode records a stack for each task: starting 10,000 of them takes seconds, "
    "longer than the producers run, and they must still be running when the tasks are cancelled"
)
async def test_ten_thousand_cancelled_awaits_leave_nothing_behind(cp: Any) -> None:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    # The producers wait for the gate, not a fixed time: starting 10,000
    # tasks beside a slow garbage collection of the suite's heap outlasted
    # a 2 s spin, and the futures must still be pending when cancelled.
    # Twice in full GPU runs the host thread stalled with the gate closed
    # until it gave up (5 s, then 60 s); the gate dumps the stacks of such a
    # stall. The arrays are allocated before it closes (an allocation that
    # misses CuPy's pool calls cudaMalloc, which may wait for the device).
    xs = []
    for s in streams:
        with s:
            xs.append(cp.zeros(N, dtype=cp.float32))
    gc.collect()  # earlier garbage freed (cudaFree waits for the device) before the gate
    with Gate() as gate:
        for i, (x, s) in enumerate(zip(xs, streams, strict=True)):
            with s:
                gated_fill(x, float(i + 1), gate)  # 0: the zeros' value
        futs = [cudafut.record(x, stream=s) for x, s in zip(xs, streams, strict=True)]
        started = 0

        async def one(i: int) -> None:
            nonlocal started
            started += 1
            await futs[i % 8]

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                for i in range(10_000):
                    tg.start_soon(one, i)
                while started < 10_000:
                    await anyio.sleep(0.001)
                await anyio.sleep(0.01)
                assert not any(f.done() for f in futs), (
                    f"done before the gate opened (gave up: {gate.timed_out})"
                )
                scope.cancel()
        driver = _loops.current_driver()
        assert driver is not None and driver.watchlist.pending == 0
    with anyio.fail_after(1):
        await anyio.sleep(0.001)  # the loop still answers
    values = [float((await f)[0]) for f in futs]  # and the futures still work
    assert values == [float(i + 1) for i in range(8)]
    assert not gate.timed_out


# -- loops, threads ---------------------------------------------------------------------


def test_one_future_awaited_from_three_loops_in_three_threads(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    x = _slow_source(cp, producer, 4.0, 50)
    fut = cudafut.record(x, stream=producer)
    results: dict[str, float] = {}

    async def get() -> float:
        return float((await fut)[0])

    def run(backend: str) -> None:
        results[backend] = run_on(backend, get)

    threads = [threading.Thread(target=run, args=(backend,)) for backend in BACKENDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {"asyncio": 4.0, "uvloop": 4.0, "trio": 4.0}


def test_set_in_one_thread_while_a_loop_in_another_awaits(cp: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    producer = cp.cuda.Stream(non_blocking=True)

    def produce() -> None:
        time.sleep(0.05)
        x = _slow_source(cp, producer, 6.0, 20)
        with producer:
            fut.set_result(x)

    async def main() -> float:
        threading.Thread(target=produce).start()
        return float((await fut)[0])

    assert asyncio.run(main()) == 6.0


@pytest.fixture(params=[False, True], ids=["timed polls", "notices"])
def notify(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Timed polls only, then with CUDA notices on (the default)."""
    old = cudafut.set_wait_policy(cudafut.WaitPolicy(notify=request.param))
    yield bool(request.param)
    cudafut.set_wait_policy(old)


def test_a_loop_closed_while_awaits_are_pending(
    cp: Any, caplog: pytest.LogCaptureFixture, notify: bool
) -> None:
    """The loop goes with its tasks pending: nothing of cudafut fails or leaks
    (a timerfd per loop, a notice's pipe with ``notify=True``), and the
    future stays usable."""
    producer = cp.cuda.Stream(non_blocking=True)
    fds_before = len(os.listdir("/proc/self/fd"))
    futs = []
    # The producer waits for the gate, not a fixed time: a garbage
    # collection of the suite's heap can outlast any spin, and the task
    # must still be pending after the loop ran.
    with producer:  # the fill kernel loaded now: a first launch may wait for the device
        cp.empty(N, dtype=cp.float32).fill(5.0)
        xs = [cp.zeros(N, dtype=cp.float32) for _ in range(20)]  # no cudaMalloc with the gate closed
    gc.collect()  # earlier garbage freed (cudaFree waits for the device) before the gate
    with Gate() as gate:  # opened on the way out, failure or not (a stall dumps the stacks)
        for i, x in enumerate(xs):
            with producer:
                if i == 0:
                    gated_fill(x, 5.0, gate)
                else:
                    x.fill(5.0)  # behind the gated fill, on the same stream: one gate to give up
            fut = cudafut.record(x, stream=producer)
            futs.append(fut)
            loop = asyncio.new_event_loop()
            try:  # closed whatever happens: a loop left open fails the next test
                task = loop.create_task(_await(fut))
                loop.run_until_complete(asyncio.sleep(0.005))  # the task now waits (and sleeps)
                assert not task.done(), f"await {i} finished with the gate closed"
                task.cancel()
                loop.run_until_complete(asyncio.sleep(0))
            finally:
                loop.close()
            del loop, task
    with caplog.at_level(logging.ERROR, logger="cudafut"):
        gc.collect()
        assert all(float(f.result()[0]) == 5.0 for f in futs)
    assert not gate.timed_out
    gc.collect()
    assert not [r for r in caplog.records if r.name == "cudafut"]
    cp.cuda.Device().synchronize()  # and the notices' host functions (they close pipes)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


async def _await(fut: cudafut.CudaFuture[Any]) -> Any:
    return await fut


# -- processes and signals --------------------------------------------------------------

FORK = """
import os, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process: the point here
import cudafut
from cudafut import _backend, _cuda
cp = _backend.current.cupy()
x = cp.ones(4, dtype=cp.float32)
fut = cudafut.record(x)
fut.result()
pid = os.fork()
if pid == 0:
    for what, call in (("result", lambda: fut.result()), ("record", lambda: cudafut.record(x)),
                       ("submit", lambda: cudafut.submit(lambda: 1)),
                       ("then", lambda: fut.then(lambda v: v))):
        try:
            call()
            print(what, "no error")
        except cudafut.CudaUnavailableError as exc:
            print(what, "CudaUnavailableError", "fork" in str(exc))
    sys.stdout.flush()
    os._exit(0)
os.waitpid(pid, 0)
print("parent", float(cudafut.record(x + 1).result()[0]))
"""


def test_fork_child_gets_a_clear_error_and_the_parent_goes_on() -> None:
    proc = run_python(FORK, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "result CudaUnavailableError True",
        "record CudaUnavailableError True",
        "submit CudaUnavailableError True",
        "then CudaUnavailableError True",
        "parent 2.0",
    ], proc.stdout + proc.stderr


def test_ctrl_c_interrupts_result_while_the_gpu_works() -> None:
    # Timing goes in docs/reliability.md (scripts/reliability-run); this
    # checks the behaviour: KeyboardInterrupt out of result(), work pending.
    _latency, out = ctrl_c_during_result()
    assert out.split()[2] == "False"


STICKY = """
import asyncio, sys
import cudafut
from cudafut import _backend, _cuda
from tests.kernels import spin_fault, spin_fill
cp = _backend.current.cupy()
two = _backend.current.device_count() > 1
s = cp.cuda.Stream(non_blocking=True)
xs = [cp.zeros(4, dtype=cp.float32) for _ in range(3)]
xs[0] + 1
cp.cuda.Device().synchronize()
if two:
    with cp.cuda.Device(1):
        s1 = cp.cuda.Stream(non_blocking=True)
        y = cp.zeros(4, dtype=cp.float32)
        y + 1
        spin_fill(y, 0.0, 0)  # compile and load on device 1 before the fault
        cp.cuda.Device(1).synchronize()
with s:
    futs = [cudafut.record(x) for x in xs[:1]]
    spin_fault(200)
    futs += [cudafut.record(x) for x in xs[1:]]

async def main():
    ticks = 0
    async def heartbeat():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1
    beat = asyncio.create_task(heartbeat())
    async def one(f):
        try:
            await f
            return "ok"
        except cudafut.CudaError as exc:
            return exc.name
    print("awaits", await asyncio.gather(*(one(f) for f in futs)))
    before = ticks
    await asyncio.sleep(0.05)
    print("loop serves", ticks > before)
    if two:
        # Whether CUDA lets this process go on using another device after
        # a sticky error is CUDA's and CuPy's business: report what happens.
        try:
            with cp.cuda.Device(1), s1:
                spin_fill(y, 3.0, 20)
                f1 = cudafut.record(y)
            print("device 1", float((await f1)[0]))
        except Exception as exc:
            print("device 1 unusable:", type(exc).__name__)
    beat.cancel()

asyncio.run(main())
"""


def test_a_sticky_error_fails_pending_futures_and_the_loop_serves_on() -> None:
    proc = run_python(STICKY, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # The first record precedes the fault; it may complete or see the error.
    assert lines[0] in (
        "awaits ['ok', 'cudaErrorIllegalAddress', 'cudaErrorIllegalAddress']",
        "awaits ['cudaErrorIllegalAddress', 'cudaErrorIllegalAddress', 'cudaErrorIllegalAddress']",
    ), proc.stdout + proc.stderr
    assert lines[1] == "loop serves True"
    if _backend.current.device_count() > 1:
        assert lines[2].startswith("device 1"), proc.stdout


# -- bad input: a clear error, and nothing enqueued is lost ------------------------------


def test_bad_input_is_refused_and_enqueued_work_survives(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    x = _slow_source(cp, producer, 7.0, 30)
    fut = cudafut.record(x, stream=producer)
    child = fut.then(lambda v: v + 1)
    n = _backend.current.device_count()
    bad: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: fut.then(42), TypeError, "needs a callable"),  # type: ignore[call-overload]
        (lambda: fut.then(lambda v: v, priority="hihg"), ValueError, "'normal' or 'high'"),  # type: ignore[call-overload]
        (lambda: fut.add_done_callback("f"), TypeError, "needs a callable"),  # type: ignore[arg-type]
        (lambda: fut.result(timeout=-1), ValueError, "non-negative"),
        (lambda: fut.result(timeout=math.nan), ValueError, "non-negative"),
        (lambda: fut.wait(timeout="1"), TypeError, "number of seconds"),  # type: ignore[arg-type]
        (lambda: cudafut.submit(lambda: 1, device=n), ValueError, "out of range"),
        (lambda: cudafut.CudaFuture(devices=n + 3), ValueError, "out of range"),
        (lambda: cudafut.CudaFuture(devices=-1), ValueError, "out of range"),
        (lambda: cudafut.CudaFuture[Any]().set_result(np.zeros(3)), ValueError, "on no GPU"),
        (lambda: cudafut.record([1, 2]), ValueError, "on no GPU"),
        (lambda: cudafut.record(x, stream="s"), TypeError, "cupy.cuda.Stream"),
        (lambda: fut._complete(_State.SET, None, None, ()), cudafut.InvalidStateError, "already set"),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
    unset: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with pytest.raises(ValueError, match="on no GPU"):
        unset.set_result(np.zeros(3))
    with producer:
        unset.set_result(x)  # the refusal left it pending and usable
    with pytest.raises(cudafut.InvalidStateError, match="already set"):
        unset.set_result(x)
    assert (fut.result().get() == 7).all()
    assert (child.result().get() == 8).all()
    assert (unset.result().get() == 7).all()
    assert _waiter.thread_waiter().holding == 0 or _wait_for_no_holds()


def _wait_for_no_holds() -> bool:
    end = time.monotonic() + 5
    while _waiter.thread_waiter().holding and time.monotonic() < end:
        time.sleep(0.01)
    return _waiter.thread_waiter().holding == 0
