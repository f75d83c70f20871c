"""Interop on a GPU: PyTorch's streams and futures, DLPack-only values,
``__cuda_stream__`` streams, and the bridges to asyncio and concurrent.futures.

As in tests/test_gpu.py, every producer spins on %globaltimer for SLOW_MS
before it writes, so a consumer that is not ordered after it reads zeros.
Each ordering test names the wait it proves; without that wait the consumer
is unordered and the values it checks are wrong. ``test_control_*`` shows the
harness sees exactly that with PyTorch's streams too.

The PyTorch tests need torch built with CUDA (``pytest.importorskip``); the
others need CuPy only. tests/test_interop.py checks the same logic without a
GPU, with a fake torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import warnings
import weakref
from typing import Any

import pytest

import cudafut
from cudafut import _backend, _compiled, _cuda, _future, _torch
from cudafut._values import find_devices
from tests.children import until
from tests.kernels import spin_fill
from tests.runners import BACKENDS, run_on

pytestmark = [
    pytest.mark.gpu,
    # CuPy 14 deprecates ExternalStream; these tests wrap torch's streams with it.
    pytest.mark.filterwarnings("ignore:ExternalStream is deprecated:DeprecationWarning"),
]

N = 1 << 20
SLOW_MS = 50.0


def host(arr: Any, stream: Any) -> Any:
    """Copy a CuPy array to the host on ``stream`` only (no implicit wait on others)."""
    out = arr.get(stream=stream)
    stream.synchronize()
    return out


@pytest.fixture
def torch(cp: Any) -> Any:
    """PyTorch with CUDA, and what the tests run warm: a first use (CUDA
    lazy initialisation, kernel loads) takes longer than the producers spin,
    and would order an unordered consumer by accident."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build cannot use CUDA")
    t = torch.zeros(4, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        warm = [t + 1, t * 2, (t + 1) * 2, t + t]
        future = torch.futures.Future(devices=[0])
        future.set_result(t)
        warm += [future.wait() + 1, future.then(lambda f: f.value() * 2).wait()]
        view = cp.asarray(t)
        with cp.cuda.ExternalStream(stream.cuda_stream, 0):
            spin_fill(view, 1, 0)
        warm += [x.cpu() for x in warm]
    torch.cuda.synchronize()
    return torch


def torch_zeros(torch: Any, cp: Any) -> tuple[Any, Any]:
    """N float32 zeros made by torch on device 0, and a CuPy view of the same
    memory for the slow kernel; the device is idle after."""
    t = torch.zeros(N, dtype=torch.float32, device="cuda")
    view = cp.asarray(t)  # no copy: the CUDA array interface
    torch.cuda.synchronize()
    return t, view


def on(cp: Any, torch_stream: Any) -> Any:
    """A CuPy view of a torch stream, to launch the slow kernel there."""
    return cp.cuda.ExternalStream(torch_stream.cuda_stream, torch_stream.device_index)


def slow_cupy(cp: Any) -> tuple[Any, Any, cudafut.CudaFuture[Any]]:
    """A CuPy array that a non-blocking producer stream fills with 7 after
    SLOW_MS, its producer, and its future (recorded on the producer)."""
    x = cp.zeros(N, dtype=cp.float32)
    producer = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with producer:
        spin_fill(x, 7, SLOW_MS)
    return x, producer, cudafut.record(x, stream=producer)


# -- PyTorch's streams -----------------------------------------------------------------------------


def test_control_a_torch_op_on_another_stream_reads_stale_data(cp: Any, torch: Any) -> None:
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        y = t + 1  # deliberately unordered
    other.synchronize()
    assert not (y.cpu() == 8).all()
    producer.synchronize()


def test_torch_ops_in_then_run_on_the_pool_stream_after_a_slow_producer(cp: Any, torch: Any) -> None:
    """Fails without the pool stream being PyTorch's current stream in fn:
    ``v + 1`` then runs on torch's default stream, unordered."""
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    fut = cudafut.record(t, stream=producer)
    before = torch.cuda.current_stream()
    inside: list[tuple[int, int]] = []

    def fn(v: Any) -> Any:
        inside.append((torch.cuda.current_stream().cuda_stream, cp.cuda.get_current_stream().ptr))
        return v + 1  # a torch op

    child = fut.then(fn)
    ((torch_stream, cupy_stream),) = inside
    assert torch_stream == cupy_stream != before.cuda_stream
    assert torch.cuda.current_stream() == before  # restored
    assert (child.result(timeout=10).cpu() == 8).all()


@pytest.mark.parametrize("shape", ["tensor", "tuple"])
def test_then_with_torch_imported_runs_on_the_native_core(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """Fails where the native core's then() hands every link to the Python
    twin once torch is imported (a link then cost about four times one
    without torch); where a lone torch tensor does not take the switch from
    C (then it costs twice torch.futures' link); or where a value it must
    walk (a tuple) calls more than the torch half of the stream switch.
    The ordering is the test above's."""
    if _compiled.native() is None:
        pytest.skip(f"the native core does not run here ({_compiled.core()})")
    twin: list[object] = []
    settle_later = _future._settle_later

    def counted(*args: Any) -> Any:
        twin.append(args[0])
        return settle_later(*args)

    monkeypatch.setattr(_future, "_settle_later", counted)
    # Only the torch half: the native core has made the pool stream CuPy's
    # current one itself, so the whole of _torch.call_on_streams (which
    # switches CuPy's stream again) is never called.
    halves: list[list[int]] = []  # the pool streams handed to the torch half
    torch_half = _torch.call_on_torch_streams

    def counted_half(*args: Any) -> Any:
        halves.append([int(s.ptr) for s in args[1].values()])
        return torch_half(*args)

    def whole(*args: Any) -> Any:
        raise AssertionError("then() called _torch.call_on_streams, not its torch half")

    monkeypatch.setattr(_torch, "call_on_torch_streams", counted_half)
    monkeypatch.setattr(_torch, "call_on_streams", whole)
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    torch_before = torch.cuda.current_stream().cuda_stream
    cupy_before = cp.cuda.get_current_stream().ptr
    seen: list[tuple[int, int]] = []

    def fn(v: Any) -> Any:
        seen.append((torch.cuda.current_stream().cuda_stream, cp.cuda.get_current_stream().ptr))
        return (v if shape == "tensor" else v[0]) + 1

    child = cudafut.record(t if shape == "tensor" else (t,), stream=producer).then(fn)
    assert (child.result(timeout=10).cpu() == 8).all()
    assert twin == []
    [(torch_in_fn, cupy_in_fn)] = seen
    assert halves == ([] if shape == "tensor" else [[cupy_in_fn]])
    assert torch_in_fn == cupy_in_fn  # fn ran on the pool stream, torch's current too
    assert torch_in_fn != torch_before
    assert torch.cuda.current_stream().cuda_stream == torch_before  # restored
    assert cp.cuda.get_current_stream().ptr == cupy_before


def test_then_of_a_torch_tensor_records_it_on_the_pool_stream_for_torchs_allocator(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each link's pool stream is recorded on the tensor (Tensor.record_stream,
    as call_on_torch_streams does), at every link: the tensor's storage may
    have been freed and reallocated at the same address in between."""
    calls: list[tuple[int, int]] = []
    original = torch.Tensor.record_stream

    def counted(self: Any, stream: Any) -> Any:
        calls.append((self.data_ptr(), int(stream.cuda_stream)))
        return original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", counted)
    t = torch.ones(4, device="cuda")
    seen: list[int] = []

    def fn(v: Any) -> Any:
        seen.append(int(torch.cuda.current_stream().cuda_stream))
        return v

    fut = cudafut.record(t)
    for _ in range(3):
        fut = fut.then(fn)
    links = list(calls)  # result() records the caller's torch stream as a consumer too
    assert fut.result(timeout=10) is t
    assert {ptr for ptr, _ in links} == {t.data_ptr()}
    assert [stream for _, stream in links] == seen


def slow_cupy_for_torch(cp: Any, torch: Any) -> tuple[Any, Any, cudafut.CudaFuture[Any], Any, Any]:
    """:func:`slow_cupy`, with a torch view ``t`` of its array and a torch
    tensor ``out`` of N zeros for fn to write into, both made while the
    device is idle (before the producer starts): ``x, producer, fut, t, out``."""
    x = cp.zeros(N, dtype=cp.float32)
    t = torch.as_tensor(x, device="cuda")
    out = torch.zeros(N, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    cp.cuda.Device().synchronize()
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(x, 7, SLOW_MS)
    return x, producer, cudafut.record(x, stream=producer), t, out


def test_torch_ops_in_then_of_a_cupy_value_run_on_the_pool_stream(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails without the pool stream being PyTorch's current stream in fn
    where the value is a CuPy array (the native core's switch from C, which
    takes no call_on_torch_streams): ``t + 1`` then runs on torch's default
    stream, unordered after the slow producer, and ``out`` holds 1s."""
    x, producer, fut, t, out = slow_cupy_for_torch(cp, torch)
    if _compiled.native() is not None:

        def whole(*args: Any) -> Any:
            raise AssertionError("then() of a CuPy value took call_on_torch_streams, not the switch")

        monkeypatch.setattr(_torch, "call_on_torch_streams", whole)
    before = torch.cuda.current_stream().cuda_stream
    cupy_before = cp.cuda.get_current_stream().ptr
    inside: list[tuple[int, int]] = []

    def fn(v: Any) -> Any:
        inside.append((torch.cuda.current_stream().cuda_stream, cp.cuda.get_current_stream().ptr))
        out.copy_(t + 1)  # torch ops on torch's current stream
        return v

    child = fut.then(fn)
    ((torch_in_fn, cupy_in_fn),) = inside
    assert torch_in_fn == cupy_in_fn != before
    assert torch.cuda.current_stream().cuda_stream == before  # restored
    assert cp.cuda.get_current_stream().ptr == cupy_before
    assert child.result(timeout=10) is x
    torch.cuda.synchronize()
    assert (out.cpu() == 8).all()
    producer.synchronize()


def test_control_then_of_a_cupy_value_without_the_torch_switch_reads_stale_data(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The test above's harness sees a missing switch: with the switch made
    to torch's own current stream (as if then() left torch's stream alone),
    ``t + 1`` runs unordered and ``out`` is not all 8s."""
    if _compiled.native() is None:
        pytest.skip(f"the native core's switch does not run here ({_compiled.core()})")
    raw_switch = _torch.raw_switch

    def left_alone(torch_: Any, handle: int, device: int) -> Any:
        switch = raw_switch(torch_, handle, device)
        assert switch is not None
        get, put, _, stream = switch
        return get, put, get(device), stream  # "switch" to the current stream: none

    native = _compiled.native()
    assert native is not None
    monkeypatch.setattr(_torch, "raw_switch", left_alone)
    native.forget_switches()  # kept from earlier links: ask left_alone
    request.addfinalizer(native.forget_switches)
    _x, producer, fut, t, out = slow_cupy_for_torch(cp, torch)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # a non-default stream: nothing orders it after the producer

        def fn(v: Any) -> Any:
            out.copy_(t + 1)
            return v

        child = fut.then(fn)
    child.result(timeout=10)
    torch.cuda.synchronize()
    assert not (out.cpu() == 8).all()
    producer.synchronize()


@pytest.mark.parametrize("error", [KeyError, KeyboardInterrupt])
@pytest.mark.parametrize("shape", ["cupy", "tensor"])
def test_then_restores_torchs_stream_when_fn_raises(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch, error: type[BaseException], shape: str
) -> None:
    """Through the native core's switch from C (no call_on_torch_streams),
    and through the twin's: torch's stream comes back, the child fails, and
    an interrupt reaches then()'s caller too (as the twin does)."""
    if _compiled.native() is not None:

        def whole(*args: Any) -> Any:
            raise AssertionError("then() took call_on_torch_streams, not the switch")

        monkeypatch.setattr(_torch, "call_on_torch_streams", whole)
    x, producer, fut = slow_cupy(cp)
    if shape == "tensor":
        fut = cudafut.record(torch.as_tensor(x, device="cuda"), stream=producer)
    before = torch.cuda.current_stream().cuda_stream
    children: list[Any] = []

    def fn(v: Any) -> Any:
        raise error("from fn")

    if error is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            fut.then(fn)
    else:
        children.append(fut.then(fn))
    assert torch.cuda.current_stream().cuda_stream == before
    for child in children:
        with pytest.raises(KeyError, match="from fn"):
            child.result(timeout=10)
    producer.synchronize()


def test_record_of_a_cupy_array_with_torch_imported_records_cupys_current_stream(
    cp: Any, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails where record(x) with torch imported records another stream than
    CuPy's current one (the result is then read before the producer wrote),
    or, on the native core, hands a CuPy array to the twin's torch path."""
    if _compiled.native() is not None:

        def twin(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("record() of a CuPy array took the twin's torch path")

        monkeypatch.setattr(_torch, "record_value", twin)
    x = cp.zeros(N, dtype=cp.float32)
    producer = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut = cudafut.record(x)
    assert fut.result(timeout=10) is x
    assert (host(x, cp.cuda.Stream(non_blocking=True)) == 7).all()


def test_submit_waits_for_what_the_caller_enqueued_on_torchs_stream(cp: Any, torch: Any) -> None:
    """Fails without submit()'s pool stream waiting for PyTorch's current
    stream (CuPy's current stream, the default one, has nothing of it)."""
    t, view = torch_zeros(torch, cp)
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        with on(cp, mine):
            spin_fill(view, 7, SLOW_MS)  # the caller's producer, on torch's current stream
        fut = cudafut.submit(lambda a: a + 1, t)
    assert (fut.result(timeout=10).cpu() == 8).all()


@pytest.mark.parametrize("how", ["record", "set_result"])
def test_a_torch_tensor_is_recorded_on_torchs_current_stream(cp: Any, torch: Any, how: str) -> None:
    """Fails if the event goes on CuPy's current stream (the default one),
    which is not ordered after torch's non-blocking stream."""
    t, view = torch_zeros(torch, cp)
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        with on(cp, mine):
            spin_fill(view, 7, SLOW_MS)
        if how == "record":
            fut = cudafut.record(t)
        else:
            fut = cudafut.CudaFuture()
            fut.set_result(t)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = view + 1
    assert (host(y, consumer) == 8).all()
    child = fut.then(lambda v: v * 2)  # a pool stream ordered after torch's stream
    assert (child.result(timeout=10).cpu() == 14).all()


def test_wait_makes_torchs_current_stream_wait(cp: Any, torch: Any) -> None:
    """Fails without wait() making PyTorch's current stream wait (it differs
    from CuPy's current stream here)."""
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    fut = cudafut.record(t, stream=producer)
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        y = fut.wait() + 1  # a torch op on torch's current stream
    mine.synchronize()
    assert (y.cpu() == 8).all()


def test_a_cupy_stream_dropped_after_wait_of_a_torch_tensor_lives_until_torch_recorded_on_it(
    cp: Any, torch: Any
) -> None:
    """PyTorch records an event on the consumer stream when the tensor's
    memory is freed, and keeps no stream alive (PyTorch issue 66936): the
    CuPy stream wait() recorded the tensor on must outlive that record.
    Fails without keep_owner (the stream goes with its last reference, and
    compute-sanitizer reports PyTorch's cudaEventRecord on a destroyed
    handle); then it goes once the thread moved on and the GPU passed it."""
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    fut = cudafut.record(t, stream=producer)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = view + 1
    assert (host(y, consumer) == 8).all()
    gone = weakref.ref(consumer)
    del consumer, y
    gc.collect()
    assert gone() is not None  # the tensor lives: PyTorch will record on it
    del t, view, fut
    gc.collect()
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        cudafut.record(torch.zeros(4, device="cuda")).wait()  # moving on releases it
    until(lambda: gone() is None, "the stream released once the GPU passed its event")
    torch.cuda.synchronize()


def test_dropped_pending_futures_of_torch_tensors_freed_by_the_watcher_leave_no_stale_stream(
    cp: Any, torch: Any
) -> None:
    """The crash this guards: a pending future's tensor, waited on under a
    short-lived CuPy stream, is freed by the watcher thread (the producer
    stream's drop list) while the main thread makes and destroys streams, so
    PyTorch's free-time record would name a destroyed (or reused) handle.
    Under compute-sanitizer that is an API error; without it, at worst, a
    crash. Every stream goes once its tensor has."""
    refs = []
    for _ in range(200):
        t = torch.zeros(1 << 16, device="cuda")
        view = cp.asarray(t)
        producer = cp.cuda.Stream(non_blocking=True)
        with producer:
            spin_fill(view, 7, 0.2)
        fut = cudafut.record(t, stream=producer)
        consumer = cp.cuda.Stream(non_blocking=True)
        with consumer:
            fut.wait()
        refs.append(weakref.ref(consumer))
        del view, t, consumer, fut, producer
        cp.cuda.Stream(non_blocking=True)  # churn: a destroyed handle's number may come back
    torch.cuda.synchronize()
    cudafut.record(torch.zeros(4, device="cuda")).wait()  # this thread moves on
    until(lambda: all(r() is None for r in refs), "every consumer stream released")
    torch.cuda.synchronize()


# -- torch.futures: to_torch and from_torch ---------------------------------------------------------


@pytest.mark.parametrize("when", ["set before", "set after"])
def test_to_torch_orders_torchs_consumers(cp: Any, torch: Any, when: str) -> None:
    """Fails without PyTorch's current stream waiting on our events before
    torch's set_result() records its own there."""
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    if when == "set before":
        with producer:
            spin_fill(view, 7, SLOW_MS)
        tf = cudafut.record(t, stream=producer).to_torch()
    else:
        fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
        tf = fut.to_torch()
        assert not tf.done()
        with producer:
            spin_fill(view, 7, SLOW_MS)
            fut.set_result(t)  # completes tf here, in this thread
    assert tf.done()  # at once: torch's events carry the order
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        y = tf.wait() + 1
        z = tf.then(lambda f: f.value() * 2).wait()
    mine.synchronize()
    assert (y.cpu() == 8).all()
    assert (z.cpu() == 14).all()


def test_to_torch_of_cupy_arrays_completes_once_the_work_is_done(cp: Any, torch: Any) -> None:
    """torch cannot order a CuPy array: the torch future completes only once
    the GPU work is done. Fails if it were set at once (the read below would
    race the producer)."""
    x, _producer, fut = slow_cupy(cp)
    tf = fut.to_torch()
    value = tf.wait()  # blocks this thread until the watcher completes it
    assert value is x
    reader = cp.cuda.Stream(non_blocking=True)
    assert (host(value, reader) == 7).all()


@pytest.mark.parametrize("when", ["pending", "completed"])
def test_from_torch_orders_after_the_torch_futures_value(cp: Any, torch: Any, when: str) -> None:
    """Fails if the CudaFuture's events went on CuPy's current stream instead
    of the streams torch gives its callback (which wait for its value)."""
    t, view = torch_zeros(torch, cp)
    tf = torch.futures.Future(devices=[0])
    fut = cudafut.from_torch(tf) if when == "pending" else None
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        with on(cp, mine):
            spin_fill(view, 7, SLOW_MS)
        tf.set_result(t)  # torch records its event on `mine`
    if fut is None:
        fut = cudafut.from_torch(tf)
    assert fut.devices == (0,)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = view + 1
    assert (host(y, consumer) == 8).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_awaiting_a_torch_future_through_from_torch(cp: Any, torch: Any, backend: str) -> None:
    """Done means the torch future's value is ready on the GPU: fails if the
    events completed before the producer (then the read sees zeros)."""
    if backend == "uvloop":
        pytest.importorskip("uvloop")
    t, view = torch_zeros(torch, cp)
    mine = torch.cuda.Stream()

    async def main() -> Any:
        tf = torch.futures.Future(devices=[0])
        with torch.cuda.stream(mine):
            with on(cp, mine):
                spin_fill(view, 7, SLOW_MS)
            tf.set_result(t)
        return await cudafut.from_torch(tf)

    value = run_on(backend, main)
    assert value is t
    reader = cp.cuda.Stream(non_blocking=True)
    assert (host(view, reader) == 7).all()


def test_from_torch_and_to_torch_round_trip(cp: Any, torch: Any) -> None:
    t, view = torch_zeros(torch, cp)
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(view, 7, SLOW_MS)
    back = cudafut.from_torch(cudafut.record(t, stream=producer).to_torch())
    child = back.then(lambda v: v + 1)
    assert (child.result(timeout=10).cpu() == 8).all()


def test_from_torch_passes_the_error_on(cp: Any, torch: Any) -> None:
    tf = torch.futures.Future(devices=[0])
    fut = cudafut.from_torch(tf)
    tf.set_exception(ValueError("rank 3 is gone"))
    exc = fut.exception(timeout=10)
    assert exc is not None and "rank 3 is gone" in str(exc)


def test_from_torch_of_a_torch_distributed_future(cp: Any, torch: Any) -> None:
    """``work.get_future()`` of an asynchronous NCCL all-reduce, on a world of
    one: the CudaFuture is ordered after the collective (which is ordered
    after the slow producer on torch's current stream)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group exists already")
    import datetime

    try:
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
        )
    except Exception as exc:
        pytest.skip(f"no NCCL process group of one here: {exc}")
    try:
        t, view = torch_zeros(torch, cp)
        with on(cp, torch.cuda.current_stream()):
            spin_fill(view, 7, SLOW_MS)
        work = dist.all_reduce(t, async_op=True)
        fut = cudafut.from_torch(work.get_future())
        consumer = cp.cuda.Stream(non_blocking=True)
        with consumer:
            fut.wait()
            y = view + 1
        assert (host(y, consumer) == 8).all()
    finally:
        dist.destroy_process_group()


# -- values from other libraries --------------------------------------------------------------------


class DLPackOnly:
    """A value exposing only DLPack, wrapping a CuPy array."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()  # type: ignore[no-any-return]


@dataclasses.dataclass
class Batch:
    data: Any
    name: str = "batch"


def test_a_dlpack_only_value_is_found_and_ordered(cp: Any) -> None:
    """Fails without DLPack devices: set_result() would refuse a value on no GPU."""
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    producer = cp.cuda.Stream(non_blocking=True)
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with producer:
        spin_fill(x, 7, SLOW_MS)
        fut.set_result(Batch(DLPackOnly(x)))  # its event on the producer (CuPy's current)
    assert fut.devices == (0,)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = x + 1
    assert (host(y, consumer) == 8).all()
    child = fut.then(lambda batch: cp.from_dlpack(batch.data) * 2)
    assert (child.result(timeout=10).get() == 14).all()


def test_a_numba_device_array_is_found(cp: Any) -> None:
    x, _producer, fut = slow_cupy(cp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba's own warnings (versions, drivers) are not ours
        numba_cuda = pytest.importorskip("numba.cuda")
        try:
            array = numba_cuda.as_cuda_array(x)
        except Exception as exc:
            pytest.skip(f"numba cannot use this GPU: {exc}")
        assert find_devices([array]) == (0,)
    fut.result(timeout=10)


# -- streams from other libraries: __cuda_stream__ --------------------------------------------------


class StreamOnly:
    """A stream exposing only the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def test_a_cuda_stream_protocol_stream_is_accepted_and_its_device_found(cp: Any) -> None:
    """Fails without the protocol: record() would refuse the stream."""
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        spin_fill(x, 7, SLOW_MS)
    stream = StreamOnly(producer.ptr)
    assert _cuda.stream_handle(stream) == (producer.ptr, 0)  # the device from the stream's context
    fut = cudafut.record(x, stream=stream)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = x + 1
    assert (host(y, consumer) == 8).all()


def test_a_protocol_stream_on_another_device_is_found_there(cp: Any) -> None:
    if _backend.current.device_count() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        other = cp.cuda.Stream(non_blocking=True)
    assert cp.cuda.runtime.getDevice() == 0
    assert _cuda.stream_handle(StreamOnly(other.ptr)) == (other.ptr, 1)
    assert cp.cuda.runtime.getDevice() == 0


def test_a_torch_stream_behind_the_protocol(cp: Any, torch: Any) -> None:
    mine = torch.cuda.Stream()
    assert _cuda.stream_handle(StreamOnly(mine.cuda_stream)) == (mine.cuda_stream, 0)


def test_a_cuda_core_stream(cp: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cuda.core's deprecations of its experimental names
        core = pytest.importorskip("cuda.core")
        device_type = getattr(core, "Device", None) or pytest.importorskip("cuda.core.experimental").Device
        device = device_type(0)
        device.set_current()
        stream = device.create_stream()
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with cp.cuda.ExternalStream(int(stream.handle), 0):
        spin_fill(x, 7, SLOW_MS)
    fut = cudafut.record(x, stream=stream)  # __cuda_stream__, its device from stream.device
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        fut.wait()
        y = x + 1
    assert (host(y, consumer) == 8).all()


# -- bridges -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_to_asyncio_on_each_loop(cp: Any, backend: str) -> None:
    if backend == "uvloop":
        pytest.importorskip("uvloop")
    x, _producer, fut = slow_cupy(cp)

    async def main() -> Any:
        if backend == "trio":
            with pytest.raises(RuntimeError, match="on trio, await the CudaFuture itself"):
                fut.to_asyncio()
            return await fut
        first = await fut.to_asyncio()
        second = await asyncio.wait_for(cudafut.wrap_future(fut), 30)
        assert first is second
        return first

    value = run_on(backend, main)
    assert value is x
    reader = cp.cuda.Stream(non_blocking=True)
    assert (host(x, reader) == 7).all()  # done means the producer wrote


def test_to_concurrent_and_as_completed_sync_in_threads(cp: Any) -> None:
    made = [slow_cupy(cp) for _ in range(3)]
    futs = [fut for _x, _producer, fut in made]
    concurrent_futures = [fut.to_concurrent() for fut in futs]

    def consume() -> list[Any]:
        seen = []
        for fut in cudafut.as_completed_sync(futs, timeout=60):
            assert fut.done()
            seen.append(fut)
        return seen

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        seen = pool.submit(consume).result(timeout=60)
    assert sorted(map(id, seen)) == sorted(map(id, futs))
    done, _ = concurrent.futures.wait(concurrent_futures, timeout=60)
    assert done == set(concurrent_futures)
    reader = cp.cuda.Stream(non_blocking=True)
    for (x, _producer, _fut), cf in zip(made, concurrent_futures, strict=True):
        assert cf.result() is x
        assert (host(x, reader) == 7).all()
