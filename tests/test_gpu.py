"""GPU behaviour on a real device: ordering is proved with slow producers.

Every producer here spins on %globaltimer for SLOW_MS before it writes, so a
consumer that is not properly ordered after it reads zeros instead of the
value. ``test_control_*`` shows the harness catches exactly that, and
scripts/mutation-check shows each test fails when cudafut's own waits are
disabled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _backend, _loops, _pools
from cudafut._values import find_devices
from tests.kernels import slow_zeros, spin_copy, spin_fill

pytestmark = pytest.mark.gpu

N = 1 << 20
SLOW_MS = 50.0


@pytest.fixture
def producer(cp: Any) -> Any:
    return cp.cuda.Stream(non_blocking=True)


@pytest.fixture
def consumer(cp: Any) -> Any:
    return cp.cuda.Stream(non_blocking=True)


def slow(
    cp: Any, producer: Any, value: float = 7.0, ms: float = SLOW_MS
) -> tuple[Any, cudafut.CudaFuture[Any]]:
    """Zeros that the producer stream overwrites with ``value`` after ``ms``."""
    x = slow_zeros(producer, N, value, ms)
    return x, cudafut.record(x, stream=producer)


def host(arr: Any, stream: Any) -> Any:
    """Copy to the host on ``stream`` only (no implicit wait on others)."""
    out = arr.get(stream=stream)
    stream.synchronize()
    return out


# -- the harness itself -----------------------------------------------------


def test_control_without_a_wait_the_consumer_reads_stale_data(cp: Any, producer: Any, consumer: Any) -> None:
    x, fut = slow(cp, producer)
    with consumer:
        y = x + 1  # deliberately unordered
    assert not (host(y, consumer) == 8).all()
    fut.result()


# -- wait --------------------------------------------------------------------


def test_wait_orders_the_callers_current_stream(cp: Any, producer: Any, consumer: Any) -> None:
    _x, fut = slow(cp, producer)
    with consumer:
        y = fut.wait() + 1
    assert (host(y, consumer) == 8).all()


def test_wait_all_orders_after_every_future(cp: Any, consumer: Any) -> None:
    p1, p2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    (_x1, f1), (_x2, f2) = slow(cp, p1, 3.0, 10), slow(cp, p2, 4.0, SLOW_MS)
    with consumer:
        a, b = cudafut.wait_all([f1, f2])
        y = a + b
    assert (host(y, consumer) == 7).all()


# -- then --------------------------------------------------------------------


def test_then_runs_on_a_pool_stream_that_waits(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)
    current: list[Any] = []

    def fn(v: Any) -> Any:
        current.append(cp.cuda.get_current_stream())
        return v + 1

    child = fut.then(fn)
    assert current[0].ptr not in (0, producer.ptr)
    assert child.devices == (0,)
    assert (child.result().get() == 8).all()


def test_then_chain(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)
    leaf = fut.then(lambda v: v + 1).then(lambda v: v * 2).then(lambda v: v - 1)
    assert (leaf.result().get() == 15).all()


def test_then_of_a_done_future_records_the_child_after_fns_work(
    cp: Any, producer: Any, consumer: Any
) -> None:
    """then() of a set, completed future (the native core's own path): the
    child's event follows what fn enqueued, however slow."""
    _x, fut = slow(cp, producer, ms=1)
    fut.result()  # done: then() runs fn at once

    def fn(v: Any) -> Any:
        out = cp.zeros_like(v)
        spin_fill(out, 9, SLOW_MS)  # on then()'s pool stream, long after fn returns
        return out

    child = fut.then(fn)
    assert (host(child.result(), consumer) == 9).all()


def test_then_follows_a_returned_future(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)
    child = fut.then(lambda v: cudafut.submit(lambda: v * 3))
    assert (child.result().get() == 21).all()


def test_then_registered_before_set_runs_when_set(cp: Any, producer: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    child = fut.then(lambda v: v + 1)
    assert not child.done()
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut.set_result(x)  # runs the then() callback, ordered after the fill
    assert (child.result().get() == 8).all()


def test_then_error_keeps_its_type_through_a_chain(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)
    exc = KeyError("in then")

    def bad(v: Any) -> Any:
        raise exc

    leaf = fut.then(bad).then(lambda v: v + 1).then(lambda v: v + 1)
    with pytest.raises(KeyError) as info:
        leaf.result()
    assert info.value is exc


def test_then_priorities_use_distinct_pools(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer, ms=1)
    seen: dict[str, int] = {}
    for priority in ("normal", "high"):
        fut.then(
            lambda v, p=priority: seen.setdefault(p, cp.cuda.get_current_stream().ptr),
            priority=priority,
        )
    prio = cp.cuda.runtime.streamGetPriority
    assert prio(seen["high"]) < prio(seen["normal"]) == 0


def test_then_child_keeps_the_parent_value_alive(cp: Any) -> None:
    p = cp.cuda.Stream(non_blocking=True)
    with p:
        x = cp.full(N, 7, dtype=cp.float32)
    fut = cudafut.record(x, stream=p)
    p.synchronize()  # the parent is done: only the child can keep x alive

    def fn(v: Any) -> Any:
        dst = cp.empty_like(v)
        spin_copy(v, dst, SLOW_MS)  # reads v late, on the pool stream
        return dst

    child = fut.then(fn)
    x_ptr = x.data.ptr
    del x, fut
    gc.collect()
    with p:  # p's memory pool would hand out x's block if x were freed
        ys = [cp.full(N, 9, dtype=cp.float32) for _ in range(16)]
    assert x_ptr not in {y.data.ptr for y in ys}
    assert (child.result().get() == 7).all()


# -- result, submit, gather, callbacks --------------------------------------


def test_result_from_16_threads(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)

    def reader(_: int) -> Any:
        v = fut.result(timeout=30)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            y = v + 1  # unordered on purpose: result() must have waited
        return host(y, s)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(reader, range(16)))
    assert all((o == 8).all() for o in outs)


def test_result_timeout_then_success(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer, ms=200)
    with pytest.raises(cudafut.TimeoutError):
        fut.result(timeout=0.01)
    assert not fut.done()
    assert (fut.result(timeout=30).get() == 7).all()
    assert fut.done()


def test_submit_orders_after_the_callers_stream(cp: Any, consumer: Any) -> None:
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    current: list[Any] = []

    def fn(a: Any) -> Any:
        current.append(cp.cuda.get_current_stream().ptr)
        return a + 1

    with consumer:
        spin_fill(x, 7, SLOW_MS)
        fut = cudafut.submit(fn, x)
    assert current[0] not in (0, consumer.ptr)
    assert (fut.result().get() == 8).all()


def test_submit_stores_the_exception_and_checks_arguments(cp: Any) -> None:
    exc = ValueError("in submit")

    def bad() -> None:
        raise exc

    assert cudafut.submit(bad).exception() is exc
    with pytest.raises(ValueError, match="out of range"):
        cudafut.submit(bad, device=_backend.current.device_count())
    with pytest.raises(ValueError, match="'normal' or 'high'"):
        cudafut.submit(bad, priority="urgent")  # type: ignore[call-overload]


def test_set_result_records_on_the_current_stream(cp: Any, producer: Any, consumer: Any) -> None:
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut.set_result(x)
    assert fut.devices == (0,)
    with consumer:
        y = fut.wait() + 1
    assert (host(y, consumer) == 8).all()


def test_set_result_with_explicit_devices_and_a_host_value(cp: Any, producer: Any) -> None:
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture(devices=0)
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut.set_result(42)
    assert fut.result() == 42
    assert (host(x, cp.cuda.Stream(non_blocking=True)) == 7).all()


def test_gather_waits_for_all(cp: Any, consumer: Any) -> None:
    p1, p2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    (_x1, f1), (_x2, f2) = slow(cp, p1, 3.0, 5), slow(cp, p2, 4.0, SLOW_MS)
    a, b = cudafut.gather(f1, f2).result()
    with consumer:
        y = a + b  # unordered: result() on the gather must have waited for both
    assert (host(y, consumer) == 7).all()


def test_done_callback_without_a_loop_runs_after_the_gpu_work(cp: Any, producer: Any) -> None:
    x, fut = slow(cp, producer)
    got: list[Any] = []
    done = threading.Event()

    def callback(f: cudafut.CudaFuture[Any]) -> None:
        s = cp.cuda.Stream(non_blocking=True)
        got.append((threading.current_thread().name, host(x, s)))
        done.set()

    fut.add_done_callback(callback)
    assert done.wait(30)
    name, data = got[0]
    assert name == "cudafut-watcher" and (data == 7).all()


def test_events_are_recycled(cp: Any, producer: Any) -> None:
    x = cp.zeros(4, dtype=cp.float32)

    def cycle() -> None:
        parent = cudafut.record(x, stream=producer)
        parent.then(lambda v: v).result()
        assert parent.done()

    for _ in range(100):
        cycle()
    gc.collect()
    created = _pools.events.created
    for _ in range(300):
        cycle()
    gc.collect()
    assert _pools.events.created == created


def test_find_devices_in_nested_values(cp: Any) -> None:
    x = cp.zeros(3)
    assert find_devices([1, "s", {"a": (x, None)}, [x]]) == (0,)
    assert find_devices(cp.zeros(0)) == (0,)


def test_torch_tensors_are_values(cp: Any) -> None:
    torch = pytest.importorskip("torch")
    t = torch.ones(4, device="cuda")
    fut = cudafut.record({"t": t})
    assert fut.devices == (t.device.index,)
    assert fut.result()["t"] is t


def test_stream_argument_validation(cp: Any) -> None:
    with pytest.raises(TypeError, match=r"cupy\.cuda\.Stream"):
        cudafut.record(cp.zeros(1), stream="s")
    with pytest.raises(ValueError, match="no GPU"):
        cudafut.record([1, 2])


def test_then_on_a_second_device(cp: Any) -> None:
    if _backend.current.device_count() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        p = cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(N, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        with p:
            spin_fill(x, 7, SLOW_MS)
        fut = cudafut.record(x, stream=p)
    child = fut.then(lambda v: (cp.cuda.Device().id, v + 1))
    device, y = child.result()
    assert device == 1 and child.devices == (1,)
    with cp.cuda.Device(1):
        assert (y.get() == 8).all()


def test_a_value_on_two_devices(cp: Any) -> None:
    if _backend.current.device_count() < 2:
        pytest.skip("needs two GPUs")
    streams, xs = [], []
    for device, value in ((0, 7.0), (1, 8.0)):
        with cp.cuda.Device(device):
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                x = cp.zeros(N, dtype=cp.float32)
                s.synchronize()
                spin_fill(x, value, SLOW_MS)
            streams.append(s)
            xs.append(x)
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with cp.cuda.Device(1), streams[1], cp.cuda.Device(0), streams[0]:
        fut.set_result(xs)  # one event on each device's current stream
    assert fut.devices == (0, 1)

    def fn(v: Any) -> Any:
        with cp.cuda.Device(1):
            b = v[1] + 1  # on device 1's pool stream, made current for device 1
        return [v[0] + 1, b]

    a, b = fut.then(fn).result()
    assert (a.get() == 8).all()
    with cp.cuda.Device(1):
        assert (b.get() == 9).all()


def test_default_stream_of_another_device(cp: Any) -> None:
    """The legacy default stream handle (0) means "of the current device":
    recording for device 1 while device 0 is current must land on device 1."""
    if _backend.current.device_count() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        x = cp.zeros(N, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        spin_fill(x, 7, SLOW_MS)  # on device 1's default stream
        reader = cp.cuda.Stream(non_blocking=True)
    assert cp.cuda.Device().id == 0
    fut = cudafut.record(x)  # device 1's current stream is its default stream
    assert fut.result() is x
    with cp.cuda.Device(1):
        assert (host(x, reader) == 7).all()


# -- await -------------------------------------------------------------------


@pytest.mark.anyio
async def test_await_resolves_after_the_gpu_work(cp: Any, producer: Any, consumer: Any) -> None:
    _x, fut = slow(cp, producer)
    v = await fut
    with consumer:
        y = v + 1  # unordered on purpose: the await must have waited
    assert (host(y, consumer) == 8).all()


@pytest.mark.anyio
async def test_await_a_then_chain_and_gather(cp: Any, producer: Any, consumer: Any) -> None:
    _x, fut = slow(cp, producer)
    a, b = await cudafut.gather(fut.then(lambda v: v + 1), fut.then(lambda v: v * 2))
    with consumer:
        y = a + b
    assert (host(y, consumer) == 22).all()


@pytest.mark.anyio
async def test_thousand_concurrent_awaits_on_eight_streams(cp: Any) -> None:
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    reader = cp.cuda.Stream(non_blocking=True)
    data = cp.zeros((1000, 256), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    seen = [0.0] * 1000

    async def one(i: int) -> None:
        with streams[i % 8]:
            spin_fill(data[i], float(i), 0.02)
            fut = cudafut.record(data[i])
        row = await fut
        seen[i] = float(host(row, reader).min())

    async with anyio.create_task_group() as tg:
        for i in range(1000):
            tg.start_soon(one, i)
    assert seen == [float(i) for i in range(1000)]
    driver = _loops.current_driver()
    assert driver is not None and driver.watchlist.pending == 0


@pytest.mark.anyio
async def test_cancelling_an_await_leaves_nothing_pending(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer, ms=200)
    with anyio.move_on_after(0.01) as scope:
        await fut
    assert scope.cancelled_caught
    driver = _loops.current_driver()
    assert driver is not None and driver.watchlist.pending == 0
    assert (await fut).shape == (N,)


@pytest.mark.anyio
async def test_cancelling_some_of_many_awaits_leaves_the_rest_ordered(cp: Any) -> None:
    """Many awaits at once (on asyncio, each one object: _loops._AsyncioAwait):
    the cancelled ones leave no wait behind, the others still read after the
    slow producers' writes."""
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    reader = cp.cuda.Stream(non_blocking=True)
    data = cp.zeros((64, 256), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    seen: dict[int, float] = {}

    async def one(i: int) -> None:
        with streams[i % 4]:
            spin_fill(data[i], float(i + 1), 2.0)
            fut = cudafut.record(data[i])
        if i % 2:
            with anyio.move_on_after(0.005):
                await fut
            return
        row = await fut
        seen[i] = float(host(row, reader).min())

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)
    assert seen == {i: float(i + 1) for i in range(0, 64, 2)}
    driver = _loops.current_driver()
    assert driver is not None and driver.watchlist.pending == 0


@pytest.mark.anyio
async def test_done_callback_on_the_loop_after_the_gpu_work(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)
    called = anyio.Event()
    fut.add_done_callback(lambda f: called.set())
    await anyio.sleep(0.002)
    assert not called.is_set()
    with anyio.fail_after(30):
        await called.wait()
    assert fut.done()


@pytest.mark.anyio
async def test_as_completed_on_the_gpu(cp: Any) -> None:
    p1, p2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    (_x1, slow_f), (_x2, fast_f) = slow(cp, p1, 1.0, 500), slow(cp, p2, 2.0, 1)
    order = [fut async for fut in cudafut.as_completed([slow_f, fast_f])]
    assert order == [fast_f, slow_f]


def test_await_in_a_plain_asyncio_run(cp: Any, producer: Any) -> None:
    _x, fut = slow(cp, producer)

    async def main() -> Any:
        return await fut.then(lambda v: v + 1)

    assert (asyncio.run(main()).get() == 8).all()


# -- the wait policy on repeating work -----------------------------------------

# Notices are on by default, beside 1 ms polls ("balanced"); the last three:
# timed polls only, and notices with polls 20 ms apart (the notice ends the wait).
POLICIES = [
    "balanced",
    "low_cpu",
    "low_latency",
    cudafut.WaitPolicy(predict=False, spin_s=0, notify=False),
    cudafut.WaitPolicy(notify=False),
    cudafut.WaitPolicy(predict=False, spin_s=0, notice_sleep_s=20e-3),
]


@pytest.fixture(
    params=POLICIES,
    ids=[
        "balanced",
        "low_cpu",
        "low_latency",
        "no-spin-no-prediction-polls",
        "polls",
        "no-spin-no-prediction-notices",
    ],
)
def policy(request: pytest.FixtureRequest) -> Any:
    old = cudafut.set_wait_policy(request.param)
    yield request.param
    cudafut.set_wait_policy(old)


def _repeating(cp: Any, producer: Any, i: int, ms: float) -> tuple[Any, cudafut.CudaFuture[Any]]:
    # The same duration every time, on the same stream: what the predictor
    # learns; the last rounds run shorter, so a learnt estimate is wrong.
    return slow(cp, producer, float(i + 1), ms if i < 8 else ms / 4)


@pytest.mark.anyio
async def test_await_repeating_work_under_each_policy(
    cp: Any, producer: Any, consumer: Any, policy: Any
) -> None:
    for i in range(12):
        _x, fut = _repeating(cp, producer, i, 5.0)
        v = await fut
        with consumer:
            y = v + 0  # unordered on purpose: the await must have waited
        assert (host(y, consumer) == i + 1).all()


def test_result_of_repeating_work_under_each_policy(
    cp: Any, producer: Any, consumer: Any, policy: Any
) -> None:
    for i in range(12):
        _x, fut = _repeating(cp, producer, i, 5.0)
        v = fut.result()
        with consumer:
            y = v + 0
        assert (host(y, consumer) == i + 1).all()
