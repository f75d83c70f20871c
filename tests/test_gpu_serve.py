"""Serving on a GPU: launch(), Batcher and graphed() with real CUDA work.

Ordering is proved as in tests/test_gpu.py: the caller's producer spins on
%globaltimer before it writes, so a launch that did not wait for it reads
zeros (``test_control_*`` shows the harness sees that; the mutation
``launch_stream_wait`` in tests/_mutations.py shows the ordering test
notices a missing wait).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _launch
from tests.kernels import spin_fill
from tests.launches import check_a_queued_launch_cancelled_never_runs
from tests.runners import BACKENDS, run_on

pytestmark = pytest.mark.gpu

N = 1 << 16
SLOW_MS = 50.0


@pytest.fixture
def torch(cp: Any) -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    torch.cuda.synchronize()
    return torch


def _slow_on_current(cp: Any, value: float = 7.0) -> Any:
    """Zeros that the caller's current stream overwrites with ``value`` after SLOW_MS."""
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.get_current_stream().synchronize()
    spin_fill(x, value, SLOW_MS)
    return x


def test_control_work_on_another_stream_reads_stale_data(cp: Any) -> None:
    """The harness sees a missing wait: a stream that does not wait reads zeros."""
    producer = cp.cuda.Stream(non_blocking=True)
    other = cp.cuda.Stream(non_blocking=True)
    with producer:
        x = _slow_on_current(cp)
    with other:
        y = x + 1
        seen = float(y[0].get(stream=other))
    producer.synchronize()
    assert seen == 1.0


def test_launch_orders_after_the_callers_current_stream(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        x = _slow_on_current(cp)
        fut = cudafut.launch(lambda a: a + 1, x)
    y = fut.result(timeout=30)
    assert float(y.min()) == float(y.max()) == 8.0


def test_launch_orders_after_torchs_current_stream(cp: Any, torch: Any) -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.zeros(N, device="cuda")
        torch.cuda._sleep(int(100e6))  # about 50 ms of GPU clock cycles
        t.fill_(7.0)
        fut = cudafut.launch(lambda a: a + 1, t)
    y = fut.result(timeout=30)
    assert float(y.min()) == float(y.max()) == 8.0


def test_fn_runs_on_a_launcher_thread_with_its_stream_current_for_cupy_and_torch(cp: Any, torch: Any) -> None:
    caller = threading.get_ident()

    def where() -> tuple[int, int, int, str]:
        return (
            threading.get_ident(),
            int(cp.cuda.get_current_stream().ptr),
            int(torch.cuda.current_stream().cuda_stream),
            threading.current_thread().name,
        )

    thread, cupy_stream, torch_stream, name = cudafut.launch(where).result(timeout=30)
    assert thread != caller
    assert name.startswith("cudafut-launcher-0-")
    assert cupy_stream == torch_stream != 0
    assert torch_stream != int(torch.cuda.current_stream().cuda_stream)

    # torch ops inside fn are ordered on that stream: the future covers them
    def slow_torch() -> Any:
        t = torch.zeros(N, device="cuda")
        torch.cuda._sleep(int(100e6))
        t.fill_(3.0)
        return t

    t = cudafut.launch(slow_torch).result(timeout=30)
    assert float(t.min()) == 3.0


class _OddError(Exception):
    pass


def test_launch_fails_with_fns_exception_type_kept(cp: Any) -> None:
    error = _OddError("seven")

    def boom() -> None:
        raise error

    fut = cudafut.launch(boom)
    with pytest.raises(_OddError) as info:
        fut.result(timeout=30)
    assert info.value is error
    # KeyboardInterrupt/SystemExit from fn fail the future; the launcher survives.
    fut = cudafut.launch(lambda: (_ for _ in ()).throw(SystemExit(3)))
    with pytest.raises(SystemExit):
        fut.result(timeout=30)
    assert float(cudafut.launch(lambda: cp.ones(4).sum()).result(timeout=30)) == 4.0


def test_a_launch_cancelled_before_it_starts_never_runs(cp: Any) -> None:
    check_a_queued_launch_cancelled_never_runs(timeout=30)


def test_launch_checks_its_arguments_before_enqueuing(cp: Any) -> None:
    with pytest.raises(TypeError, match="callable"):
        cudafut.launch(42)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="out of range"):
        cudafut.launch(lambda: 0, device=99)
    with pytest.raises(TypeError):
        cudafut.launch(lambda: 0, device="0")  # type: ignore[call-overload]


async def _many_launches(n: int) -> list[float]:
    cp = cudafut._backend.current.cupy()

    def work(i: int) -> Any:
        return (cp.full(64, i, dtype=cp.float32) * 2).sum()

    futs = [cudafut.launch(work, i) for i in range(n)]
    out: list[float] = [0.0] * n

    async def one(i: int) -> None:
        out[i] = float(await futs[i])

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_thousands_of_concurrent_launches_give_right_answers(cp: Any, backend: str) -> None:
    n = 3000
    out = run_on(backend, _many_launches, n)
    assert out == [i * 2 * 64.0 for i in range(n)]


def test_then_on_a_launched_future_chains_gpu_work(cp: Any) -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        x = _slow_on_current(cp)
        fut = cudafut.launch(lambda a: a * 2, x).then(lambda b: b + 1)
    y = fut.result(timeout=30)
    assert float(y.min()) == float(y.max()) == 15.0


# -- graphs ---------------------------------------------------------------------


def _torch_model(torch: Any) -> Any:
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda().eval()
    )


def test_a_torch_graph_replayed_through_launch_gives_the_eager_answers(cp: Any, torch: Any) -> None:
    model = _torch_model(torch)

    def forward(x: Any) -> Any:
        with torch.inference_mode():
            return model(x)

    g = cudafut.graphed(forward, buckets=(1, 4, 16), example=lambda n: torch.zeros(n, 32, device="cuda"))
    cudafut.launch(g.capture).result(timeout=120)
    for n in (1, 3, 4, 9, 16):
        x = torch.randn(n, 32, device="cuda")
        want = forward(x)
        got = cudafut.launch(g, x).result(timeout=30)
        assert got.shape == (n, 8)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit"):
        g(torch.zeros(17, 32, device="cuda"))


def test_graph_replays_from_many_launches_at_once_never_mix_inputs(cp: Any, torch: Any) -> None:
    """Replays of one graph from several launcher threads: each answer is its own."""
    model = _torch_model(torch)

    def forward(x: Any) -> Any:
        with torch.inference_mode():
            return model(x)

    g = cudafut.graphed(forward, buckets=(8,), example=lambda n: torch.zeros(n, 32, device="cuda"))
    xs = [torch.randn(8, 32, device="cuda") for _ in range(64)]
    wants = [forward(x) for x in xs]
    futs = [cudafut.launch(g, x) for x in xs]
    for fut, want in zip(futs, wants, strict=True):
        torch.testing.assert_close(fut.result(timeout=60), want, rtol=1e-4, atol=1e-4)


def test_a_cupy_graph_replayed_through_launch_gives_the_eager_answers(cp: Any) -> None:
    # Elementwise work: CuPy refuses cuBLAS calls (a matmul) during stream capture.
    w = cp.random.default_rng(1).standard_normal(16, dtype=cp.float32)

    def forward(x: Any) -> Any:
        return cp.tanh(x * w) * 2 + x

    g = cudafut.graphed(forward, buckets=(2, 8), example=lambda n: cp.zeros((n, 16), cp.float32))
    assert g.framework == "cupy"
    for n in (1, 2, 5, 8):
        x = cp.random.default_rng(n).standard_normal((n, 16), dtype=cp.float32)
        got = cudafut.launch(g, x).result(timeout=60)
        cp.testing.assert_allclose(got, forward(x), rtol=1e-5, atol=1e-5)


def test_warm_launchers_runs_once_on_each_launcher_stream_for_cupy_and_torch(cp: Any, torch: Any) -> None:
    """Each launcher thread runs the warm-up once, with its own stream current
    for CuPy and PyTorch, after the caller's stream; the future covers the
    GPU work of every thread."""
    device = cp.cuda.Device().id
    x = _slow_on_current(cp)  # 7.0 after SLOW_MS, on the caller's stream
    seen: list[tuple[int, int, int]] = []
    outs: list[Any] = []
    lock = threading.Lock()

    def warm(a: Any) -> None:
        t = torch.zeros(N, device="cuda")
        torch.cuda._sleep(int(100e6))  # about 50 ms: the future must cover it
        t.fill_(3.0)
        with lock:
            seen.append(
                (
                    threading.get_ident(),
                    int(cp.cuda.get_current_stream().ptr),
                    int(torch.cuda.current_stream().cuda_stream),
                )
            )
            outs.append((a + 1, t))  # a: read after the caller's stream

    assert cudafut.warm_launchers(warm, x).result(timeout=60) is None
    launchers = _launch._launchers_of(device)
    want = sorted(int(s.ptr) for s in launchers.streams)
    assert len(seen) == len(launchers.threads) == len(want)
    assert len({thread for thread, _, _ in seen}) == len(want)
    assert sorted(ptr for _, ptr, _ in seen) == want
    assert all(cupy_ptr == torch_ptr for _, cupy_ptr, torch_ptr in seen)
    for y, t in outs:  # done without a synchronize: the future waited for both
        assert float(y.min()) == float(y.max()) == 8.0
        assert float(t.min()) == 3.0


def forward_eager(model: Any, x: Any) -> Any:
    import torch

    with torch.inference_mode():
        return model(x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own imports, on first compile
@pytest.mark.filterwarnings("ignore::UserWarning")  # inductor's advice (TF32), raised as errors otherwise
def test_torch_compile_reduce_overhead_through_launch(cp: Any, torch: Any) -> None:
    pytest.importorskip("triton")
    model = _torch_model(torch)
    compiled = torch.compile(model, mode="reduce-overhead")

    def forward(x: Any) -> Any:
        with torch.inference_mode():
            return compiled(x).clone()  # cudagraph trees reuse their outputs

    x = torch.randn(4, 32, device="cuda")
    with torch.inference_mode():
        want = model(x)
    # The graph trees are shared by all threads: the call that records may
    # come on a launcher thread that has no cuBLAS handle yet, and CUDA
    # refuses to create one inside a capture (CUBLAS_STATUS_NOT_INITIALIZED).
    # docs/serving.md's recipe: run the eager model once on every thread.
    cudafut.warm_launchers(forward_eager, model, x).result(timeout=300)
    for _ in range(4):  # warm-up, record, replay: on launcher threads
        got = cudafut.launch(forward, x).result(timeout=300)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


# -- Batcher --------------------------------------------------------------------


async def _serve_with_batcher(n: int, cancel_some: bool) -> tuple[dict[int, float], set[int], Any]:
    cp = cudafut._backend.current.cupy()
    rng = random.Random(3)

    def run_batch(items: list[int]) -> Any:
        x = cp.asarray(items, dtype=cp.float32)
        return x * 2 + 1  # one row per item

    answered: dict[int, float] = {}
    cancelled: set[int] = set()

    async def one(b: cudafut.Batcher[int, Any], i: int, delay: float | None) -> None:
        with anyio.CancelScope() as scope:
            if delay is not None:
                scope.deadline = anyio.current_time() + delay
            answered[i] = float(await b.submit(i))
        if scope.cancelled_caught:
            cancelled.add(i)

    async with cudafut.Batcher(run_batch, max_batch=32, max_delay_s=0.001, buckets=(8, 32)) as batcher:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                delay = rng.random() * 0.003 if cancel_some and rng.random() < 0.5 else None
                tg.start_soon(one, batcher, i, delay)
                if i % 64 == 0:
                    await anyio.sleep(0.0005)
    return answered, cancelled, batcher.statistics()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batcher_with_launch_under_a_cancellation_storm_loses_no_reply(cp: Any, backend: str) -> None:
    threads_before = threading.active_count()
    answered, cancelled, stats = run_on(backend, _serve_with_batcher, 2000, True)
    assert set(answered) | cancelled == set(range(2000))
    assert all(v == 2 * k + 1 for k, v in answered.items())
    assert (stats.queued, stats.in_flight, stats.failed_batches) == (0, 0, 0)
    assert set(stats.sizes) <= set(range(1, 33))
    assert threading.active_count() <= threads_before + len(_launch._launchers[0].threads)  # type: ignore[union-attr]


def test_a_graph_replayed_through_the_batcher_gives_the_eager_answers(cp: Any, torch: Any) -> None:
    model = _torch_model(torch)

    def forward(x: Any) -> Any:
        with torch.inference_mode():
            return model(x)

    buckets = (1, 2, 4, 8)
    g = cudafut.graphed(forward, buckets=buckets, example=lambda n: torch.zeros(n, 32, device="cuda"))
    g.capture()
    inputs = [torch.randn(32, device="cuda") for _ in range(100)]
    wants = [forward(x[None])[0] for x in inputs]

    def run_batch(items: list[Any]) -> Any:
        return g(torch.stack(items))

    async def main() -> list[Any]:
        out: list[Any] = [None] * len(inputs)
        async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=0.002, buckets=buckets) as batcher:

            async def one(i: int) -> None:
                out[i] = await batcher.submit(inputs[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(inputs)):
                    tg.start_soon(one, i)
        assert set(batcher.statistics().sizes) <= set(range(1, 9))
        return out

    for backend in BACKENDS:
        got = run_on(backend, main)
        for g_row, w_row in zip(got, wants, strict=True):
            torch.testing.assert_close(g_row, w_row, rtol=1e-4, atol=1e-4)


def test_a_batch_waits_for_each_submitters_own_stream(cp: Any) -> None:
    """Items made by tasks on streams of their own (a slow producer each):
    the batch's launch waits for every submitter's stream."""
    import asyncio

    def run_batch(items: list[Any]) -> Any:
        return cp.stack(items).sum(axis=1)

    async def main() -> list[float]:
        async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=0.005) as batcher:

            @cudafut.own_stream
            async def one(value: float) -> float:
                x = cp.zeros(N, dtype=cp.float32)
                spin_fill(x, value, SLOW_MS)  # on this task's stream
                return float(await batcher.submit(x))

            return list(await asyncio.gather(*(one(float(i + 1)) for i in range(4))))

    assert run_on("asyncio", main) == [float((i + 1) * N) for i in range(4)]


def _reuse_race(torch: Any, consume: Any) -> tuple[float, float]:
    """A tensor made on a side stream, read later by the caller's (busy)
    torch stream, dropped, and its stream's next allocation filled at once:
    what the caller's read sees. ``consume(fut)`` takes the value."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = torch.full((N,), 3.0, device="cuda")
        fut = cudafut.record(y, stream=side)
    del y
    y = consume(fut)
    out = torch.empty(N, device="cuda")
    torch.cuda._sleep(int(100e6))  # the caller's stream is busy for about 50 ms
    out.copy_(y)  # ... so this read runs after what follows
    del y, fut
    with torch.cuda.stream(side):  # the side stream reuses its freed blocks at once
        z = torch.full((N,), 9.0, device="cuda")
    torch.cuda.synchronize()
    del z
    return float(out.min()), float(out.max())


def test_control_a_tensor_freed_to_its_stream_is_reused_under_a_pending_read(cp: Any, torch: Any) -> None:
    def consume(fut: Any) -> Any:
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())  # no record_stream
        value = fut._value
        torch.cuda.synchronize()
        # Its status learnt, the dropped future lets go of the tensor at once
        # (one whose status nobody asked waits on its stream's list for a
        # later query, which would hide the reuse this control shows).
        assert fut.done()
        return value

    assert _reuse_race(torch, consume)[1] == 9.0


@pytest.mark.parametrize("backend", ["asyncio", "result"])
def test_await_and_result_record_a_torch_value_on_the_callers_stream(
    cp: Any, torch: Any, backend: str
) -> None:
    def consume(fut: Any) -> Any:
        if backend == "result":
            return fut.result(timeout=30)

        async def main() -> Any:
            return await fut

        return run_on("asyncio", main)

    assert _reuse_race(torch, consume) == (3.0, 3.0)
