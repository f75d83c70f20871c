"""Interop without a GPU: values and streams of other libraries, PyTorch's
streams and futures, and the bridges to asyncio and concurrent.futures.

CUDA is scripted: events are tests/fakes.py records, and the ``fake_cuda``
fixture stands in for CuPy's runtime, its current streams and the pool
streams. PyTorch is a fake module put in ``sys.modules`` (cudafut never
imports torch, it looks there), which records what cudafut asks of it.
tests/test_gpu_interop.py proves the same on a GPU with the real libraries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import gc
import itertools
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import anyio
import pytest

import cudafut
from cudafut import (
    _backend,
    _cuda,
    _events,
    _interface,
    _lifetimes,
    _memory,
    _pools,
    _runtime,
    _streams,
    _torch,
    _values,
)
from tests.children import until
from tests.fakes import FakeRecord, set_future

_made: list[FakeRecord] = []


class Rec(FakeRecord):
    """A scripted record that the test's teardown completes if the test did
    not: a pending one would be held by the watcher thread for ever (a
    dropped future's value is kept until its events complete)."""

    __slots__ = ()

    def __init__(self, stream: int | None = None, seq: int = 1, device: int = 0) -> None:
        super().__init__(stream, seq, device)
        _made.append(self)


@pytest.fixture(autouse=True)
def _complete_every_record() -> Iterator[None]:
    yield
    for rec in _made:
        if rec.script is None:
            rec.complete()
    _made.clear()


# -- values: DLPack, dataclasses, named tuples, Numba-like arrays ------------------------------


class DLPackOnly:
    """Exposes only the DLPack protocol, as a JAX array would. cudafut
    exports it only to order its producer, always with a stream; the
    streams are kept in ``exported``."""

    def __init__(self, device_type: int, device_id: int) -> None:
        self.where = (device_type, device_id)
        self.exported: list[object] = []

    def __dlpack__(self, stream: object = None) -> object:
        if stream is None:
            raise AssertionError("an export without a stream orders nothing")
        self.exported.append(stream)
        return object()  # the capsule, dropped unused

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.where


class DLDeviceType(enum.IntEnum):  # NumPy and CuPy return an IntEnum
    CPU = 1
    CUDA = 2
    CUDA_MANAGED = 13


def test_dlpack_objects_on_cuda_devices_are_found() -> None:
    assert _values.find_devices(DLPackOnly(2, 1)) == (1,)
    assert _values.find_devices(DLPackOnly(13, 0)) == (0,)  # managed memory
    assert _values.find_devices(DLPackOnly(DLDeviceType.CUDA, 3)) == (3,)
    assert _values.find_devices([DLPackOnly(1, 0), DLPackOnly(3, 0)]) == ()  # CPU, pinned host
    assert _values.gpu_arrays([DLPackOnly(1, 0), a := DLPackOnly(2, 0)]) == [a]
    assert a.exported == []  # finding devices never exports


@dataclasses.dataclass
class Batch:
    x: object
    y: object
    label: str = "batch"
    ignored: dataclasses.InitVar[int] = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    inner: object


class Pair(NamedTuple):
    first: object
    second: object


def test_dataclasses_and_named_tuples_are_walked_as_containers() -> None:
    value = Batch(DLPackOnly(2, 1), [Pair(DLPackOnly(2, 0), Frozen(DLPackOnly(2, 2)))])
    assert _values.find_devices(value) == (1, 0, 2)
    assert len(_values.gpu_arrays(value)) == 3
    assert _values.find_devices(Batch(1, "two")) == ()


def test_a_dataclass_that_holds_itself_is_walked_once() -> None:
    value = Batch(DLPackOnly(2, 1), None)
    value.y = [value, value]
    assert _values.find_devices(value) == (1,)


def test_a_dataclass_type_is_not_a_value() -> None:
    assert _values.find_devices(Batch) == ()


class NumbaLike:
    """A ``__cuda_array_interface__`` object without a device attribute."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "typestr": "<f4", "version": 3}


def test_a_numba_like_array_asks_cuda_for_its_pointers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def pointer_device(ptr: int) -> int:
        asked.append(ptr)
        return 1

    monkeypatch.setattr(_backend.current, "pointer_device", pointer_device)
    assert _values.find_devices(Batch(NumbaLike(0xABC), None)) == (1,)
    assert asked == [0xABC]


def test_a_cupy_array_is_read_without_its_array_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    class ndarray:  # noqa: N801 - stands for cupy.ndarray
        data = types.SimpleNamespace(device_id=1)

        @property
        def __cuda_array_interface__(self) -> dict[str, object]:
            raise AssertionError("a CuPy array's device is read from its memory pointer")

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=ndarray))
    monkeypatch.setattr(_values, "_ndarray", _values._Never)
    assert _values.find_devices(ndarray()) == (1,)
    assert _values.find_devices([ndarray(), DLPackOnly(2, 0)]) == (1, 0)


# -- a fake CUDA: runtime, current streams, pool streams, recorded events ----------------------


class FakeCupyStream:
    """A CuPy stream: ``ptr``, and entering makes it current for its device."""

    def __init__(self, env: FakeCuda, ptr: int, device: int) -> None:
        self.env, self.ptr, self.device = env, ptr, device

    def __enter__(self) -> FakeCupyStream:
        self.env.entered.setdefault(self.device, []).append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.env.entered[self.device].pop()


class FakeRuntime:
    class CUDARuntimeError(Exception):
        def __str__(self) -> str:
            return "cudaErrorIllegalAddress: an illegal memory access was encountered"

    def __init__(self) -> None:
        self.device = 0

    def getDevice(self) -> int:  # noqa: N802 - CuPy's name
        return self.device

    def setDevice(self, device: int) -> None:  # noqa: N802
        self.device = device


class FakeCuda:
    """What cudafut asked: ``log`` of ("record"/"wait", stream, device) and
    torch calls, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.records: list[FakeRecord] = []
        self.entered: dict[int, list[FakeCupyStream]] = {}
        self.cupy_current = {0: 0x100, 1: 0x101}  # CuPy's current streams outside any `with`
        self.handles = itertools.count(0x1000)

    def current_stream(self, device: int) -> Any:
        stack = self.entered.get(device)
        return stack[-1] if stack else types.SimpleNamespace(ptr=self.cupy_current[device])

    def record(self, stream: int, device: int, confirm: object = None, owner: object = None) -> Rec:
        rec = Rec(stream, 1, device)
        self.records.append(rec)
        self.log.append(("record", stream, device))
        return rec

    def stream_wait(self, stream: int, event: int, device: int) -> None:
        self.log.append(("wait", stream, device))

    def recorded(self) -> list[tuple[int, int]]:
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "record"]

    def waits(self) -> list[tuple[int, int]]:
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "wait"]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    env = FakeCuda()
    monkeypatch.setattr(_runtime, "_rt", FakeRuntime())
    monkeypatch.setattr(_runtime, "_count", 2)
    monkeypatch.setattr(_backend.current, "current_stream", env.current_stream)
    monkeypatch.setattr(
        _backend.current, "new_stream", lambda device, prio: FakeCupyStream(env, next(env.handles), device)
    )
    monkeypatch.setattr(_backend.current, "stream_wait", env.stream_wait)
    monkeypatch.setattr(_events, "record", env.record)
    monkeypatch.setattr(_pools, "streams", _pools.StreamPool())
    # Its stream handles are made up: no memory behind them to check.
    monkeypatch.setattr(_streams, "check_stream_address", lambda handle, stream: handle)
    return env


def test_without_torch_set_result_records_on_cupys_current_stream(fake_cuda: FakeCuda) -> None:
    assert "torch" not in sys.modules
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    fut.set_result([DLPackOnly(2, 0), DLPackOnly(2, 1)])
    assert fake_cuda.recorded() == [(0x100, 0), (0x101, 1)]


# -- other libraries' work ordered before cudafut's streams (docs/design.md, hazard 9) ----------


class JaxLike:
    """A JAX array: a ``__cuda_array_interface__`` with no stream (version
    2), and DLPack; exporting it with a stream logs ("export", stream,
    device) where CUDA calls are logged (the producer's wait)."""

    def __init__(self, log: list[tuple[Any, ...]], device: int = 0, fail: Exception | None = None) -> None:
        self.log, self.fail = log, fail
        self.device = types.SimpleNamespace(id=device)
        self.__cuda_array_interface__ = {"data": (0xA000, 1), "shape": (4,), "typestr": "<f4", "version": 2}

    def __dlpack__(self, *, stream: object = None) -> object:
        if self.fail is not None:
            raise self.fail
        self.log.append(("export", stream, self.device.id))
        return object()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device.id)


def test_set_result_and_record_export_a_jax_array_to_the_stream_before_recording_there(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails without hazard 9's fix: only ("record", ...) is logged, and the
    event is recorded on a stream that JAX's work is not ordered before."""
    x = JaxLike(fake_cuda.log, device=1)
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    fut.set_result({"x": x, "n": 3})
    assert fake_cuda.log == [("export", 0x101, 1), ("record", 0x101, 1)]
    fake_cuda.log.clear()
    cudafut.record(x)
    assert fake_cuda.log == [("export", 0x101, 1), ("record", 0x101, 1)]
    fake_cuda.log.clear()
    monkeypatch.setattr(_cuda, "stream_handle", lambda stream: (0x4321, 1))
    cudafut.record([x], stream="a stream of device 1")
    assert fake_cuda.log == [("export", 0x4321, 1), ("record", 0x4321, 1)]


def test_the_null_stream_is_passed_as_the_legacy_default_stream(fake_cuda: FakeCuda) -> None:
    fake_cuda.cupy_current[0] = 0  # CuPy's null stream: DLPack does not allow 0
    cudafut.record(JaxLike(fake_cuda.log))
    assert fake_cuda.log == [("export", 1, 0), ("record", 0, 0)]


def test_given_devices_order_an_array_before_the_streams_recorded_on(fake_cuda: FakeCuda) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=[0])
    fut.set_result(JaxLike(fake_cuda.log, device=1))  # not a device given: before device 0's stream
    assert fake_cuda.log == [("export", 0x100, 1), ("record", 0x100, 0)]


def test_then_orders_a_jax_array_fn_returns_before_the_childs_event(fake_cuda: FakeCuda) -> None:
    value = DLPackOnly(2, 0)
    parent = set_future(value, [Rec(device=0)])
    seen: list[int] = []

    def fn(value: Any) -> Any:
        seen.append(int(_backend.current.current_stream(0).ptr))
        return JaxLike(fake_cuda.log, device=0)

    parent.then(fn)
    (pool,) = seen
    assert value.exported == []  # the parent's value was ordered when it was set
    assert fake_cuda.log[-2:] == [("export", pool, 0), ("record", pool, 0)]


def test_submit_orders_jax_arguments_before_the_pool_stream(fake_cuda: FakeCuda) -> None:
    x = JaxLike(fake_cuda.log, device=0)
    seen: list[int] = []

    def fn(value: Any) -> Any:
        seen.append(int(_backend.current.current_stream(0).ptr))
        return DLPackOnly(2, 0)

    cudafut.submit(fn, x, device=0)
    (pool,) = seen
    assert ("export", pool, 0) in fake_cuda.log


def test_a_numba_array_with_a_stream_makes_the_consumer_wait_on_that_stream(fake_cuda: FakeCuda) -> None:
    """The array interface's ``stream`` (version 3) is the producer's stream:
    an event there, waited on by the stream recorded on; none when it is
    that stream already (1 and CuPy's null stream 0 are the same)."""

    class NumbaArray:
        def __init__(self, stream: int | None) -> None:
            self.device = types.SimpleNamespace(id=1)
            self.__cuda_array_interface__ = {
                "data": (0xB000, False),
                "shape": (4,),
                "typestr": "<f4",
                "version": 3,
                "stream": stream,
            }

    cudafut.record(NumbaArray(0x55))
    assert fake_cuda.log == [("record", 0x55, 1), ("wait", 0x101, 1), ("record", 0x101, 1)]
    fake_cuda.log.clear()
    cudafut.record([NumbaArray(0x101), NumbaArray(None)])  # its own stream; none: ready for any
    assert fake_cuda.log == [("record", 0x101, 1)]
    fake_cuda.log.clear()
    fake_cuda.cupy_current[1] = 0
    cudafut.record(NumbaArray(1))
    assert fake_cuda.log == [("record", 0, 1)]


def test_an_array_that_cannot_be_ordered_is_refused_before_anything_is_recorded(
    fake_cuda: FakeCuda,
) -> None:
    sharded = JaxLike(fake_cuda.log, fail=BufferError("only unsharded arrays can be exported"))
    with pytest.raises(ValueError, match=r"cannot order .*JaxLike.*BufferError: only unsharded.*ready\(\)"):
        cudafut.record(sharded)
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with pytest.raises(ValueError, match="cannot order"):
        fut.set_result([sharded])
    assert not fut.done() and fake_cuda.log == []
    child = set_future(DLPackOnly(2, 0), [Rec(device=0)]).then(lambda _v: sharded)
    with pytest.raises(ValueError, match="cannot order"):
        child.result(timeout=10)

    class DeviceOnly:  # __dlpack_device__ without __dlpack__: no way to order it
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    with pytest.raises(ValueError, match="no __dlpack__"):
        cudafut.record(DeviceOnly())


def test_cupy_arrays_and_torch_tensors_are_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their work is on the current streams cudafut records on: nothing to order."""

    def walk(*args: object) -> None:
        raise AssertionError("a lone CuPy array or tensor must not be walked")

    class ndarray:  # noqa: N801 - stands for cupy.ndarray
        data = types.SimpleNamespace(device_id=0)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=ndarray))
    monkeypatch.setattr(_values, "_ndarray", _values._Never)
    monkeypatch.setattr(_values, "_walk", walk)
    _values.order_foreign(ndarray(), lambda d: (0x100, d))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=FakeTensor))
    _values.order_foreign(FakeTensor(0), lambda d: (0x100, d))


# -- a fake PyTorch ------------------------------------------------------------------------------


class FakeTensor:
    """A torch tensor: its device from attributes; its array interface raises,
    as a real one that requires grad does."""

    def __init__(self, device: int = 0) -> None:
        self.index = device
        self.recorded: list[Any] = []

    @property
    def is_cuda(self) -> bool:
        return self.index >= 0

    def get_device(self) -> int:
        return self.index

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")


class FakeTorchStream:
    def __init__(self, handle: int, device: int) -> None:
        self.cuda_stream, self.device_index = handle, device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeTorchStream) and (other.cuda_stream, other.device_index) == (
            self.cuda_stream,
            self.device_index,
        )

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))

    def __repr__(self) -> str:
        return f"<torch stream {self.cuda_stream:#x} on {self.device_index}>"


def default_torch_stream(device: int) -> FakeTorchStream:
    return FakeTorchStream(0x70 + device, device)


class FakeTorchCuda:
    Stream = FakeTorchStream  # torch.cuda.Stream: ExternalStream is a subclass

    def __init__(self, env: FakeCuda) -> None:
        self.env = env
        self.current: dict[int, FakeTorchStream] = {}
        self.device = 0

    def is_available(self) -> bool:
        return True

    def current_stream(self, device: int | None = None) -> FakeTorchStream:
        d = self.device if device is None else device
        return self.current.get(d) or default_torch_stream(d)

    def set_stream(self, stream: FakeTorchStream) -> None:
        self.env.log.append(("torch.set_stream", stream.cuda_stream, stream.device_index))
        self.current[stream.device_index] = stream
        self.set_device(stream.device_index)  # as torch does

    def set_device(self, device: int) -> None:
        self.device = device
        _runtime._rt.setDevice(device)  # one CUDA runtime for both libraries

    def ExternalStream(self, handle: int, device: Any = None) -> FakeTorchStream:  # noqa: N802
        return FakeTorchStream(handle, device)


def make_torch(env: FakeCuda) -> types.ModuleType:
    torch = types.ModuleType("torch")
    cuda = FakeTorchCuda(env)

    class Future:
        """torch.futures.Future: callbacks run with streams of their own
        current, as torch's ``wrapCallback`` does for a future with devices."""

        def __init__(self, *, devices: list[int] | None = None) -> None:
            self.devices = list(devices or [])
            self.finished = False
            self.result: Any = None
            self.error: BaseException | None = None
            self.callbacks: list[Any] = []
            self.completed = threading.Event()

        def done(self) -> bool:
            return self.finished

        def value(self) -> Any:
            if self.error is not None:
                raise self.error
            return self.result

        wait = value

        def set_result(self, result: Any) -> None:
            env.log.append(("torch.set_result", tuple(self.devices)))
            self.result = result
            self._finish()

        def set_exception(self, error: BaseException) -> None:
            env.log.append(("torch.set_exception", error))
            self.error = error
            self._finish()

        def _finish(self) -> None:
            assert not self.finished, "torch: a Future can only be marked completed once"
            self.finished = True
            self.completed.set()
            for callback in self.callbacks:
                self._invoke(callback)

        def add_done_callback(self, callback: Any) -> None:
            if self.finished:
                self._invoke(callback)
            else:
                self.callbacks.append(callback)

        def _invoke(self, callback: Any) -> None:
            saved = dict(cuda.current)
            for device in self.devices:
                cuda.current[device] = FakeTorchStream(0xCB0 + device, device)
            try:
                callback(self)
            finally:
                cuda.current = saved

    torch.Tensor = FakeTensor  # type: ignore[attr-defined]
    torch.cuda = cuda  # type: ignore[attr-defined]
    torch.futures = types.SimpleNamespace(Future=Future)  # type: ignore[attr-defined]
    torch._C = types.SimpleNamespace(Future=Future)  # type: ignore[attr-defined]
    torch.device = lambda kind, index=None: index  # type: ignore[attr-defined]
    return torch


@pytest.fixture
def torch(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = make_torch(fake_cuda)
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(_torch, "_pool_streams", {})
    # The streams kept for this test's tensors go with it (a weak reference
    # dropped calls nothing back), and nothing it retired reaches another.
    monkeypatch.setattr(_torch, "_owners", {})
    monkeypatch.setattr(_lifetimes, "retired", {})
    return module


def test_torch_is_never_imported() -> None:
    assert "torch" not in sys.modules
    assert _torch.loaded() is None and _torch.module() is None
    with pytest.raises(RuntimeError, match="import torch first"):
        cudafut.from_torch(object())
    with pytest.raises(RuntimeError, match="import torch first"):
        set_future(1, [Rec()]).to_torch()
    assert "torch" not in sys.modules


def test_torch_without_cuda_changes_nothing(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    module = make_torch(fake_cuda)
    module.cuda.is_available = lambda: False
    monkeypatch.setitem(sys.modules, "torch", module)
    assert _torch.loaded() is None and _torch.module() is module


# -- PyTorch: recording, waiting, then() and submit() ----------------------------------------------


def test_a_torch_tensor_is_recorded_on_torchs_current_stream(fake_cuda: FakeCuda, torch: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    fut.set_result(FakeTensor(1))
    assert fake_cuda.recorded() == [(0x71, 1)]
    assert fut.devices == (1,)


def test_torch_tensors_and_other_arrays_record_each_on_their_librarys_stream(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    cudafut.record({"t": FakeTensor(0), "a": DLPackOnly(2, 0), "b": [DLPackOnly(2, 1)]})
    assert fake_cuda.recorded() == [(0x100, 0), (0x70, 0), (0x101, 1)]


def test_one_stream_current_in_both_libraries_is_recorded_once(fake_cuda: FakeCuda, torch: Any) -> None:
    torch.cuda.current[0] = FakeTorchStream(0x100, 0)  # the stream CuPy has current
    cudafut.record([FakeTensor(0), DLPackOnly(2, 0)])
    assert fake_cuda.recorded() == [(0x100, 0)]


def test_given_devices_record_on_cupys_stream_and_on_torchs_for_tensors(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=[0, 1])
    fut.set_result(FakeTensor(0))
    assert fake_cuda.recorded() == [(0x100, 0), (0x70, 0), (0x101, 1)]


def test_a_value_on_no_gpu_is_refused_with_torch_too(fake_cuda: FakeCuda, torch: Any) -> None:
    with pytest.raises(ValueError, match="on no GPU"):
        cudafut.CudaFuture[Any]().set_result(FakeTensor(-1))  # a CPU tensor
    with pytest.raises(ValueError, match="on no GPU"):
        cudafut.record([1, "x"])
    assert fake_cuda.recorded() == []


def test_wait_makes_torchs_current_stream_wait_and_records_the_tensors_on_it(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    tensor = FakeTensor(0)
    fut = set_future(tensor, [Rec(device=0)])
    assert fut.wait() is tensor
    assert fake_cuda.waits() == [(0x100, 0), (0x70, 0)]  # CuPy's current stream, then torch's
    assert default_torch_stream(0) in tensor.recorded


def test_wait_waits_once_when_both_libraries_share_the_stream(fake_cuda: FakeCuda, torch: Any) -> None:
    torch.cuda.current[0] = FakeTorchStream(0x100, 0)
    set_future(FakeTensor(0), [Rec(device=0)]).wait()
    assert fake_cuda.waits() == [(0x100, 0)]


def done_rec() -> Rec:
    """A record that is complete once asked."""
    rec = Rec(device=0)
    rec.complete()
    return rec


def complete_on(env: FakeCuda, handle: int) -> None:
    for rec in env.records:
        if rec.stream == handle:
            rec.complete()


def test_wait_keeps_a_users_stream_until_torch_recorded_on_it_at_the_free(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    tensor = FakeTensor(0)
    fut = set_future(tensor, [done_rec()])
    stream = FakeCupyStream(fake_cuda, 0x555, 0)  # a user's stream, that may be destroyed
    with stream:
        assert fut.wait() is tensor
    assert FakeTorchStream(0x555, 0) in tensor.recorded  # torch records an event on it at the free
    kept = weakref.ref(stream)
    del stream, fut
    gc.collect()
    assert kept() is not None  # while the tensor lives
    del tensor
    gc.collect()
    # Its deallocation may go on after the callback (torch frees without the
    # GIL): the stream stays until this thread has moved on.
    assert kept() is not None and (0x555, 0) not in fake_cuda.recorded()
    set_future(FakeTensor(0), [done_rec()]).wait()  # this thread moved on
    assert (0x555, 0) in fake_cuda.recorded()  # an event after torch's
    gc.collect()
    assert kept() is not None  # until the GPU is past it
    complete_on(fake_cuda, 0x555)
    until(lambda: gc.collect() >= 0 and kept() is None, "the stream released")


def test_a_tensor_the_watcher_thread_lets_go_releases_its_stream_in_that_threads_next_round(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    tensor = FakeTensor(0)
    producer = Rec(device=0)
    fut = set_future(tensor, [producer])
    stream = FakeCupyStream(fake_cuda, 0x556, 0)
    with stream:
        fut.wait()
    kept, alive = weakref.ref(stream), weakref.ref(tensor)
    del stream, fut, tensor  # a dropped future: cudafut keeps its value until its work is done
    gc.collect()
    assert alive() is not None and kept() is not None
    producer.complete()  # the watcher thread lets the value go, then releases the stream
    until(lambda: (0x556, 0) in fake_cuda.recorded(), "the watcher thread's release")
    assert alive() is None and kept() is not None
    complete_on(fake_cuda, 0x556)
    until(lambda: gc.collect() >= 0 and kept() is None, "the stream released")


def test_a_collection_inside_keep_owners_lock_may_record_another_tensor(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    """A finalizer run by a collection at any call inside the locked block
    (a Tracked value's, recording its tensor) takes the lock again in the
    same thread: a plain lock would hang here for good."""
    first, second = FakeTensor(0), FakeTensor(0)
    stream = FakeCupyStream(fake_cuda, 0x557, 0)
    with _torch._owners_lock:  # as if a finalizer ran while keep_owner held it
        assert _torch.keep_owner(first, 0x557, 0, stream)
        assert _torch.keep_owner(second, 0x557, 0, stream)
    assert len(_torch._owners) == 2


def test_the_idle_watcher_thread_releases_what_a_thread_that_never_came_back_retired(
    fake_cuda: FakeCuda, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lifetimes, "RETIRED_STALE_S", 0.05)
    rec, held = Rec(device=0), FakeTensor(0)
    assert _lifetimes.keep_until([rec], held)  # the watcher thread runs...
    gone = weakref.ref(held)
    del held
    rec.complete()
    until(lambda: gone() is None, "the watcher thread let it go")  # ...and, alone, goes idle
    released: list[str] = []
    other = threading.Thread(target=_lifetimes.retire, args=(released.append, "theirs"))
    other.start()
    other.join()  # it will never call wait() again
    until(lambda: released == ["theirs"], "the stale release, by the idle watcher thread")


def test_special_pool_and_torch_streams_are_not_kept_a_users_stream_is(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    tensor = FakeTensor(0)
    fut = set_future(tensor, [done_rec()])
    pool = _pools.streams.get(0, 0)  # cudafut's, for the process's life
    for stream in (pool, FakeCupyStream(fake_cuda, 0, 0), FakeCupyStream(fake_cuda, 2, 0)):
        with stream:
            fut.wait()
    _memory._record(tensor, 0x600, 0, FakeTorchStream(0x600, 0))  # PyTorch's own
    assert [s.cuda_stream for s in tensor.recorded if s.cuda_stream != 0x70] == [int(pool.ptr), 0, 2, 0x600]
    assert _torch._owners == {}
    user = FakeCupyStream(fake_cuda, 0x557, 0)
    with user:
        fut.wait()
    (kept,) = _torch._owners.values()
    owners = kept.owners
    assert [owner for owner, _, _ in owners.values()] == [user]
    with user:
        fut.wait()  # once per tensor and stream
    assert len(owners) == 1


class SlottedTensor:
    """A torch tensor that takes no weak reference."""

    __slots__ = ("recorded",)
    is_cuda = True

    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


def test_a_tensor_without_weak_references_is_recorded_without_keeping_the_stream(
    fake_cuda: FakeCuda, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "Tensor", (FakeTensor, SlottedTensor))
    solid, tensor = SlottedTensor(), FakeTensor(0)
    first, second = FakeCupyStream(fake_cuda, 0x558, 0), FakeCupyStream(fake_cuda, 0x559, 0)
    _memory._record(solid, 0x558, 0, first)
    _memory._record(tensor, 0x559, 0, second)
    assert solid.recorded == [FakeTorchStream(0x558, 0)] and tensor.recorded == [FakeTorchStream(0x559, 0)]
    dropped, kept = weakref.ref(first), weakref.ref(second)
    del first, second
    gc.collect()
    assert dropped() is None  # as before: torch is told, the stream is not kept
    assert kept() is not None


def test_then_makes_the_pool_stream_torchs_current_stream_while_fn_runs(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    parent_value = FakeTensor(0)
    parent = set_future(parent_value, [Rec(device=0)])
    seen: list[tuple[int, int]] = []

    def fn(value: Any) -> Any:
        seen.append((torch.cuda.current_stream(0).cuda_stream, _backend.current.current_stream(0).ptr))
        return FakeTensor(0)

    child = parent.then(fn)
    ((torch_stream, cupy_stream),) = seen
    assert torch_stream == cupy_stream >= 0x1000  # one pool stream, current in both libraries
    assert torch.cuda.current_stream(0) == default_torch_stream(0)  # restored
    assert fake_cuda.waits() == [(cupy_stream, 0)]  # the pool stream waits for the parent
    assert fake_cuda.recorded() == [(cupy_stream, 0)]  # the child's event, on the pool stream
    assert FakeTorchStream(cupy_stream, 0) in parent_value.recorded  # torch's allocator is told
    assert child.devices == (0,)


@pytest.mark.parametrize("raises", [False, True])
def test_then_sets_torchs_stream_through_its_c_entry_points_where_it_has_them(
    fake_cuda: FakeCuda, torch: Any, monkeypatch: pytest.MonkeyPatch, raises: bool
) -> None:
    # torch._C._cuda_getCurrentStream/_cuda_setStream take and give
    # (stream_id, device_index, device_type); torch.cuda's Stream objects
    # are left out of then()'s path once torch has initialised CUDA. (This
    # module's fake records are not the native core's: its then() with
    # torch is tested on the GPU, tests/test_gpu_interop.py.)
    cuda = torch.cuda
    calls: list[tuple[int, int, int]] = []

    def get(device: int) -> tuple[int, int, int]:
        stream = cuda.current_stream(device)
        return (stream.cuda_stream, stream.device_index, 1)

    def put(stream_id: int, device_index: int, device_type: int) -> None:
        calls.append((stream_id, device_index, device_type))
        cuda.current[device_index] = FakeTorchStream(stream_id, device_index)
        cuda.set_device(device_index)

    def external(handle: int, device: Any = None) -> FakeTorchStream:
        stream = FakeTorchStream(handle, device)
        stream.stream_id, stream.device_type = handle, 1  # type: ignore[attr-defined]
        return stream

    monkeypatch.setattr(torch, "_C", types.SimpleNamespace(_cuda_getCurrentStream=get, _cuda_setStream=put))
    monkeypatch.setattr(cuda, "is_initialized", lambda: True, raising=False)
    monkeypatch.setattr(cuda, "current_device", lambda: cuda.device, raising=False)
    monkeypatch.setattr(cuda, "ExternalStream", external)
    monkeypatch.setattr(cuda, "set_stream", None)  # the public call is not used
    monkeypatch.setattr(_torch, "_raw_calls", {})
    parent = set_future(FakeTensor(0), [Rec(device=0)])
    seen: list[int] = []

    def fn(value: Any) -> Any:
        seen.append(cuda.current_stream(0).cuda_stream)
        if raises:
            raise ValueError("fn")
        return FakeTensor(0)

    child = parent.then(fn)
    (pool,) = seen
    assert pool >= 0x1000  # a pool stream
    assert calls[-2:] == [(pool, 0, 1), (0x70, 0, 1)]
    assert cuda.current_stream(0) == default_torch_stream(0)  # restored
    if raises:
        assert isinstance(child.exception(timeout=0), ValueError)
    else:
        assert fake_cuda.recorded() == [(pool, 0)]  # the child's event, on the pool stream


@pytest.mark.parametrize("initialized", [False, True])
def test_raw_switch_gives_the_pool_streams_triple_once_torch_initialised_cuda(
    fake_cuda: FakeCuda, torch: Any, monkeypatch: pytest.MonkeyPatch, initialized: bool
) -> None:
    # What the native then() keeps per pool stream (tests/test_gpu_interop.py
    # runs it): torch's raw get/put, the pool stream's triple, its stream.
    cuda = torch.cuda

    def get(device: int) -> tuple[int, int, int]:
        return (cuda.current_stream(device).cuda_stream, device, 1)

    def put(stream_id: int, device_index: int, device_type: int) -> None:
        cuda.current[device_index] = FakeTorchStream(stream_id, device_index)

    def external(handle: int, device: Any = None) -> FakeTorchStream:
        stream = FakeTorchStream(handle, device)
        stream.stream_id, stream.device_index, stream.device_type = handle, device, 1  # type: ignore[attr-defined]
        return stream

    monkeypatch.setattr(torch, "_C", types.SimpleNamespace(_cuda_getCurrentStream=get, _cuda_setStream=put))
    monkeypatch.setattr(cuda, "is_initialized", lambda: initialized, raising=False)
    monkeypatch.setattr(cuda, "current_device", lambda: 0, raising=False)
    monkeypatch.setattr(cuda, "ExternalStream", external)
    monkeypatch.setattr(_torch, "_raw_calls", {})
    monkeypatch.setattr(_torch, "_pool_streams", {})
    switch = _torch.raw_switch(torch, 0x1234, 0)
    if not initialized:
        assert switch is None  # then() takes call_on_torch_streams, which initialises it
        return
    assert switch is not None
    got, set_, triple, stream = switch
    assert (got, set_) == (get, put)
    assert triple == (0x1234, 0, 1)
    assert stream is _torch.pool_stream(torch, 0x1234, 0)  # the one kept for the pool stream


def test_then_restores_torchs_streams_when_fn_raises(fake_cuda: FakeCuda, torch: Any) -> None:
    mine = FakeTorchStream(0x333, 0)
    torch.cuda.current[0] = mine

    def fn(value: Any) -> Any:
        assert torch.cuda.current_stream(0) != mine
        raise KeyError("in fn")

    child = set_future(FakeTensor(0), [Rec(device=0)]).then(fn)
    assert isinstance(child.exception(timeout=0), KeyError)
    assert torch.cuda.current_stream(0) == mine


def test_then_on_two_devices_sets_both_and_restores_the_callers_device(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    parent = set_future([FakeTensor(0), FakeTensor(1)], [Rec(device=0), Rec(device=1)])
    _runtime._rt.setDevice(1)  # the caller's device
    devices: list[int] = []

    def fn(value: Any) -> Any:
        devices.append(_runtime._rt.getDevice())
        return value

    child = parent.then(fn)
    assert devices == [0]  # the parent's first device is current in fn
    sets = [entry[2] for entry in fake_cuda.log if entry[0] == "torch.set_stream"]
    assert sets == [0, 1, 1, 0]  # both set, then both restored
    assert _runtime._rt.getDevice() == 1
    assert child.devices == (0, 1)


def test_fn_placing_a_tensor_on_another_device_records_there_on_torchs_stream(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    parent = set_future(FakeTensor(0), [Rec(device=0)])
    child = parent.then(lambda v: [v, FakeTensor(1)])
    pool = fake_cuda.recorded()[0][0]
    assert fake_cuda.recorded() == [(pool, 0), (0x71, 1)]
    assert child.devices == (0, 1)


def test_submit_waits_for_torchs_current_stream_too(fake_cuda: FakeCuda, torch: Any) -> None:
    tensor = FakeTensor(0)
    fut = cudafut.submit(lambda t: t, tensor, device=0)
    pool = fake_cuda.log[-1][1]  # the result's record, on the pool stream
    # The caller's CuPy and torch streams are recorded, and the pool stream waits for both.
    assert fake_cuda.recorded()[:2] == [(0x100, 0), (0x70, 0)]
    assert fake_cuda.waits() == [(pool, 0), (pool, 0)]
    assert FakeTorchStream(pool, 0) in tensor.recorded
    for rec in fake_cuda.records:
        rec.complete()
    assert fut.result(timeout=10) is tensor


# -- from_torch and to_torch -------------------------------------------------------------------------


def test_from_torch_records_on_the_streams_torch_gives_its_callback(fake_cuda: FakeCuda, torch: Any) -> None:
    tf = torch.futures.Future(devices=[0])
    fut = cudafut.from_torch(tf)
    assert not fut.done()
    tensor = FakeTensor(0)
    tf.set_result([tensor, DLPackOnly(2, 0)])  # the callback runs here, in the setter's thread
    assert fake_cuda.recorded() == [(0xCB0, 0)]  # torch's callback stream, once per device
    for rec in fake_cuda.records:
        rec.complete()
    assert fut.result(timeout=5)[0] is tensor


def test_from_torch_of_a_completed_future_is_set_at_once(fake_cuda: FakeCuda, torch: Any) -> None:
    tf = torch.futures.Future(devices=[1])
    tf.set_result(FakeTensor(1))
    fut = cudafut.from_torch(tf, devices=[1])
    assert fut.devices == (1,) and fake_cuda.recorded() == [(0xCB1, 1)]


def test_from_torch_of_a_cpu_value_is_done_when_the_torch_future_is(fake_cuda: FakeCuda, torch: Any) -> None:
    tf = torch.futures.Future()
    fut = cudafut.from_torch(tf)
    tf.set_result({"loss": 0.5})
    assert fut.done() and fut.result() == {"loss": 0.5}
    assert fake_cuda.recorded() == []


def test_from_torch_fails_with_the_torch_futures_error(fake_cuda: FakeCuda, torch: Any) -> None:
    tf = torch.futures.Future(devices=[0])
    fut = cudafut.from_torch(tf)
    error = ValueError("rank 1 died")
    tf.set_exception(error)
    assert fut.exception(timeout=5) is error


def test_from_torch_refuses_what_is_not_a_torch_future(fake_cuda: FakeCuda, torch: Any) -> None:
    with pytest.raises(TypeError, match=r"takes a torch\.futures\.Future, not CudaFuture"):
        cudafut.from_torch(cudafut.CudaFuture())
    with pytest.raises(TypeError, match="device"):
        cudafut.from_torch(torch.futures.Future(), devices="0")  # type: ignore[arg-type]


def test_to_torch_makes_torchs_stream_wait_before_setting_it(fake_cuda: FakeCuda, torch: Any) -> None:
    tensor = FakeTensor(0)
    fut = set_future(tensor, [Rec(device=0)])
    tf = fut.to_torch()
    assert tf.devices == [0] and tf.done()
    assert fake_cuda.log == [("wait", 0x70, 0), ("torch.set_result", (0,))]
    assert tf.value() is tensor


def test_to_torch_of_a_pending_future_with_devices_completes_in_the_setters_thread(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    tf = fut.to_torch()
    assert tf.devices == [0] and not tf.done()
    tensor = FakeTensor(0)
    fut.set_result(tensor)
    assert tf.done() and tf.value() is tensor
    assert fake_cuda.log.index(("wait", 0x70, 0)) < fake_cuda.log.index(("torch.set_result", (0,)))


def test_to_torch_of_what_torch_cannot_order_completes_once_the_work_is_done(
    fake_cuda: FakeCuda, torch: Any
) -> None:
    rec = Rec(device=0)
    fut = set_future(DLPackOnly(2, 0), [rec])  # not a torch tensor: torch records nothing for it
    tf = fut.to_torch()
    assert not tf.done()
    rec.complete()
    assert tf.completed.wait(10)
    assert tf.value() is fut.result()
    assert ("wait", 0x70, 0) not in fake_cuda.log


def test_to_torch_of_a_future_of_unknown_devices_is_a_cpu_future(fake_cuda: FakeCuda, torch: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    tf = fut.to_torch()
    assert tf.devices == []
    rec = Rec(device=0)
    _interface.complete_with(fut, FakeTensor(0), (rec,))
    assert not tf.done()
    rec.complete()
    assert tf.completed.wait(10)


@pytest.mark.parametrize("how", ["failed", "cancelled", "gpu error"])
def test_to_torch_passes_failures_on(fake_cuda: FakeCuda, torch: Any, how: str) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    tf = fut.to_torch()
    if how == "failed":
        error = KeyError("k")
        fut.set_exception(error)
        assert tf.error is error
    elif how == "cancelled":
        fut.cancel()
        assert isinstance(tf.error, cudafut.CancelledError)
    else:
        rec = Rec(device=0)
        rec.fail(700)
        rec.query()
        _interface.complete_with(fut, FakeTensor(0), (rec,))
        assert isinstance(tf.error, cudafut.CudaError) and tf.error.code == 700


def test_a_torch_future_completed_by_its_owner_is_left_alone(fake_cuda: FakeCuda, torch: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    tf = fut.to_torch()
    tf.set_result("mine")
    fut.set_result(FakeTensor(0))  # no second completion, no error logged
    assert tf.value() == "mine"


# -- streams: the __cuda_stream__ protocol ----------------------------------------------------------


class StreamOnly:
    """Exposes only ``__cuda_stream__``, as a cuda.core or Numba stream does."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def __cuda_stream__(self) -> object:
        return self.answer


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched(*args: object) -> int:
        raise AssertionError("the argument should be judged without CUDA")

    monkeypatch.setattr(_backend.current, "device_count", touched)
    monkeypatch.setattr(_backend.current, "current_device", touched)
    monkeypatch.setattr(_backend.current, "stream_device", touched)
    # The handles here are made up: no memory behind them to check.
    monkeypatch.setattr(_streams, "check_stream_address", lambda handle, stream: handle)


def test_a_cuda_stream_protocol_object_with_its_device(no_cuda: None) -> None:
    with_id = StreamOnly((0, 0x1234))
    with_id.device_id = 1  # type: ignore[attr-defined]
    assert _cuda.stream_handle(with_id) == (0x1234, 1)
    core_like = StreamOnly((0, 0x99))
    core_like.device = types.SimpleNamespace(device_id=2)  # type: ignore[attr-defined]  # cuda.core's Device
    assert _cuda.stream_handle(core_like) == (0x99, 2)
    int_device = StreamOnly((0, 0x98))
    int_device.device = 3  # type: ignore[attr-defined]
    assert _cuda.stream_handle(int_device) == (0x98, 3)


def test_the_protocol_may_be_an_attribute_and_the_handle_an_int_like(no_cuda: None) -> None:
    class Attribute:
        __cuda_stream__ = (0, 0x42)
        device_index = 0

    class Handle(enum.IntEnum):  # Numba gives CU_STREAM_DEFAULT, an IntEnum
        DEFAULT = 0x77

    assert _cuda.stream_handle(Attribute()) == (0x42, 0)
    tagged = StreamOnly((0, Handle.DEFAULT))
    tagged.device_id = 0  # type: ignore[attr-defined]
    assert _cuda.stream_handle(tagged) == (0x77, 0)


def test_a_protocol_stream_without_a_device_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def stream_device(handle: int) -> int:
        asked.append(handle)
        return 1

    monkeypatch.setattr(_backend.current, "stream_device", stream_device)
    monkeypatch.setattr(_streams, "check_stream_address", lambda handle, stream: handle)  # a made-up handle
    assert _cuda.stream_handle(StreamOnly((0, 0x1234))) == (0x1234, 1)
    assert asked == [0x1234]


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        ((1, 0x1234), ValueError, "protocol version 1: cudafut reads version 0"),
        ((0, -5), ValueError, "negative handle"),
        ((0, 1.5), TypeError, "int handle"),
        ((0, "0x10"), TypeError, "int handle"),
        ((0, object()), TypeError, "int handle"),
        (0x1234, TypeError, r"a \(version, handle\) tuple"),
        ((0, 1, 2), TypeError, r"a \(version, handle\) tuple"),
    ],
)
def test_a_bad_protocol_answer_is_explained(no_cuda: None, answer: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _cuda.stream_handle(StreamOnly(answer))


def test_what_is_not_a_stream_is_a_type_error_before_cuda_is_touched(no_cuda: None) -> None:
    with pytest.raises(TypeError, match=r"__cuda_stream__ \(the CUDA stream protocol.*not int"):
        _cuda.stream_handle(3)
    with pytest.raises(TypeError, match="not str"):
        cudafut.record(DLPackOnly(2, 0), stream="stream")


def test_record_on_a_protocol_stream(fake_cuda: FakeCuda) -> None:
    stream = StreamOnly((0, 0x4321))
    stream.device_id = 1  # type: ignore[attr-defined]
    fut = cudafut.record(DLPackOnly(2, 1), stream=stream)
    assert fake_cuda.recorded() == [(0x4321, 1)] and fut.devices == (1,)


def test_stream_device_asks_the_streams_context_and_restores_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, int]] = []

    class DriverError(Exception):
        pass

    class Driver:
        CUDADriverError = DriverError
        current = 0xAAA

        def streamGetCtx(self, stream: int) -> int:  # noqa: N802 - CuPy's names
            if stream == 0xBAD:
                raise DriverError("CUDA_ERROR_INVALID_HANDLE")
            return 0xC1 if stream == 0x1234 else 0xAAA

        def ctxGetCurrent(self) -> int:  # noqa: N802
            return self.current

        def ctxSetCurrent(self, ctx: int) -> None:  # noqa: N802
            calls.append(("set", ctx))
            self.current = ctx

        def ctxGetDevice(self) -> int:  # noqa: N802
            return {0xC1: 1, 0xAAA: 0}[self.current]

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(driver=Driver()))
    monkeypatch.setattr(_runtime, "_rt", FakeRuntime())
    monkeypatch.setattr(_runtime, "_cupy", fake_cupy)
    assert _backend.current.stream_device(0x1234) == 1
    assert calls == [("set", 0xC1), ("set", 0xAAA)]
    assert (
        _backend.current.stream_device(0x5678) == 0 and len(calls) == 2
    )  # its context is current: no switch
    assert _backend.current.stream_device(1) == 0  # a default stream: the current device
    with pytest.raises(ValueError, match="0xbad is not a CUDA stream of this process"):
        _backend.current.stream_device(0xBAD)


# -- remove_done_callback --------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[object] = []

    def method(self, fut: object) -> None:
        self.calls.append(fut)


def test_remove_done_callback_counts_what_it_removed() -> None:
    rec = Rec()
    fut = set_future(1, [rec])
    calls: list[str] = []
    done = threading.Event()

    def removed(_fut: object) -> None:
        calls.append("removed")

    def kept(_fut: object) -> None:
        calls.append("kept")
        done.set()

    fut.add_done_callback(removed)
    fut.add_done_callback(removed)
    fut.add_done_callback(kept)
    assert fut.remove_done_callback(removed) == 2
    assert fut.remove_done_callback(removed) == 0
    rec.complete()
    assert done.wait(10)
    assert calls == ["kept"]
    assert fut.remove_done_callback(kept) == 0  # it ran already


def test_remove_done_callback_compares_bound_methods_with_eq() -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    recorder = Recorder()
    fut.add_done_callback(recorder.method)
    assert fut.remove_done_callback(Recorder().method) == 0
    assert fut.remove_done_callback(recorder.method) == 1
    fut.set_exception(KeyError("k"))
    fut.exception()
    assert recorder.calls == []


def test_remove_done_callback_runs_no_user_code_under_the_lock() -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()

    class Nosy:
        def __call__(self, _fut: object) -> None:
            pass

        def __eq__(self, other: object) -> bool:
            assert not fut._lock.locked(), "__eq__ ran under the future's lock"
            return other is self

        __hash__ = object.__hash__

    nosy = Nosy()
    fut.add_done_callback(nosy)
    assert fut.remove_done_callback(nosy) == 1
    fut.cancel()


@pytest.mark.anyio
async def test_a_removed_callback_does_not_run_on_the_loop() -> None:
    rec = Rec()
    fut = set_future(1, [rec])
    calls: list[str] = []
    marker = anyio.Event()
    fut.add_done_callback(lambda _f: calls.append("removed"))
    fut.add_done_callback(lambda _f: marker.set())
    callbacks = fut._callbacks or []
    assert fut.remove_done_callback(callbacks[0].fn) == 1
    rec.complete()
    with anyio.fail_after(10):
        await marker.wait()
    assert calls == []


# -- asyncio: wrap_future and to_asyncio -----------------------------------------------------------


@pytest.mark.anyio
async def test_to_asyncio_is_done_when_the_gpu_work_is(anyio_backend: tuple[str, dict[str, object]]) -> None:
    rec = Rec()
    fut = set_future("value", [rec])
    if anyio_backend[0] == "trio":
        with pytest.raises(RuntimeError, match="on trio, await the CudaFuture itself"):
            fut.to_asyncio()
        return
    out = fut.to_asyncio()
    assert isinstance(out, asyncio.Future) and out.get_loop() is asyncio.get_running_loop()
    assert not out.done()
    rec.complete()
    with anyio.fail_after(10):
        assert await out == "value"
    wrapped = cudafut.wrap_future(fut)
    with anyio.fail_after(10):
        assert await wrapped == "value"


@pytest.mark.anyio
async def test_wrap_future_passes_on_errors_and_cancellation(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    if anyio_backend[0] == "trio":
        pytest.skip("asyncio futures need an asyncio loop")
    error = KeyError("k")
    failed: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    failed.set_exception(error)
    cancelled: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    cancelled.cancel()
    gpu = Rec()
    gpu.fail(700)
    with anyio.fail_after(10):
        with pytest.raises(KeyError) as info:
            await cudafut.wrap_future(failed)
        assert info.value is error
        with pytest.raises(asyncio.CancelledError):
            await cudafut.wrap_future(cancelled)
        with pytest.raises(cudafut.CudaError):
            await cudafut.wrap_future(set_future(1, [gpu]))


@pytest.mark.anyio
async def test_cancelling_the_asyncio_future_leaves_the_cuda_future_and_its_work(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    if anyio_backend[0] == "trio":
        pytest.skip("asyncio futures need an asyncio loop")
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    rec = Rec()
    running = set_future("running", [rec])
    for fut in (pending, running):
        out = fut.to_asyncio()
        out.cancel()
        await asyncio.sleep(0)  # its done callbacks run
        assert not fut.cancelled()
        assert fut._callbacks is None  # the watch's callback is dropped
    pending.set_exception(KeyError("still settable"))
    pending.exception()
    rec.complete()
    with anyio.fail_after(10):
        assert await running == "running"


@pytest.mark.parametrize("bridge", ["wrap_future", "to_asyncio"])
def test_wrap_future_for_a_loop_in_another_thread(bridge: str) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        rec = Rec()
        fut = set_future(42, [rec])
        out = cudafut.wrap_future(fut, loop=loop) if bridge == "wrap_future" else fut.to_asyncio(loop=loop)
        assert out.get_loop() is loop

        async def get() -> object:
            return await out

        result = asyncio.run_coroutine_threadsafe(get(), loop)
        rec.complete()
        assert result.result(timeout=10) == 42
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_wrap_future_argument_errors() -> None:
    with pytest.raises(RuntimeError, match="running asyncio"):
        cudafut.wrap_future(set_future(1, [Rec()]))
    with pytest.raises(TypeError, match="takes a CudaFuture, not Future"):
        cudafut.wrap_future(concurrent.futures.Future())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loop must be an asyncio event loop"):
        cudafut.wrap_future(set_future(1, [Rec()]), loop=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loop must be an asyncio event loop"):
        set_future(1, [Rec()]).to_asyncio(loop=object())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_asyncio_wrap_future_points_to_cudafuts(anyio_backend: tuple[str, dict[str, object]]) -> None:
    """asyncio.wrap_future() used to fail with a bare AssertionError (it takes
    concurrent.futures.Future objects only); asyncio's other entry points
    keep treating a CudaFuture as an awaitable."""
    if anyio_backend[0] == "trio":
        pytest.skip("asyncio's functions need an asyncio loop")
    rec = Rec()
    fut = set_future(5, [rec])
    with pytest.raises(TypeError, match=r"use fut\.to_asyncio\(\) \(or cudafut\.wrap_future\(fut\)\)"):
        asyncio.wrap_future(fut)  # type: ignore[arg-type]
    assert not asyncio.isfuture(fut)
    task = asyncio.ensure_future(fut)
    rec.complete()
    with anyio.fail_after(10):
        assert list(await asyncio.gather(fut, task)) == [5, 5]
        assert await asyncio.wait_for(fut, 10) == 5


# -- concurrent.futures ----------------------------------------------------------------------------


def test_to_concurrent_is_done_when_the_gpu_work_is() -> None:
    rec = Rec()
    out = set_future("value", [rec]).to_concurrent()
    assert isinstance(out, concurrent.futures.Future) and not out.done()
    rec.complete()
    done, _ = concurrent.futures.wait([out], timeout=10)
    assert done == {out} and out.result() == "value"


def test_to_concurrent_passes_on_errors_and_cancellation() -> None:
    error = KeyError("k")
    failed: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    failed.set_exception(error)
    assert failed.to_concurrent().exception(timeout=10) is error
    cancelled: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    cancelled.cancel()
    out = cancelled.to_concurrent()
    done, _ = concurrent.futures.wait([out], timeout=10)  # waiters learn of it too
    assert done == {out} and out.cancelled()
    gpu = Rec()
    gpu.fail(700)
    assert isinstance(set_future(1, [gpu]).to_concurrent().exception(timeout=10), cudafut.CudaError)


def test_cancelling_the_concurrent_future_leaves_the_cuda_future() -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    out = fut.to_concurrent()
    assert out.cancel()
    rec = Rec()
    _interface.complete_with(fut, 1, (rec,))  # its copy finds it cancelled: no error
    rec.complete()
    assert fut.result(timeout=10) == 1 and out.cancelled()


# -- as_completed_sync -------------------------------------------------------------------------------


def test_as_completed_sync_yields_in_completion_order() -> None:
    a, b = Rec(), Rec()
    fa, fb = set_future("a", [a]), set_future("b", [b])
    it = cudafut.as_completed_sync([fa, fb], timeout=30)
    b.complete()
    assert next(it) is fb
    a.complete()
    assert next(it) is fa
    assert list(it) == []


def test_as_completed_sync_yields_failed_and_cancelled_futures() -> None:
    failed: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    failed.set_exception(KeyError("k"))
    cancelled: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    cancelled.cancel()
    seen = list(cudafut.as_completed_sync([failed, cancelled], timeout=30))
    assert sorted(map(id, seen)) == sorted([id(failed), id(cancelled)])
    failed.exception()


def test_as_completed_sync_times_out_and_says_what_is_left() -> None:
    done = Rec()
    done.complete()
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    it = cudafut.as_completed_sync([set_future(1, [done]), pending], timeout=0.05)
    next(it)
    with pytest.raises(cudafut.TimeoutError, match=r"1 of 2 futures were not done within 0\.05 s"):
        next(it)
    assert pending._callbacks is None  # the generator closed: nothing left watching


def test_leaving_as_completed_sync_early_removes_its_callbacks() -> None:
    done = Rec()
    done.complete()
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    for _fut in cudafut.as_completed_sync([set_future(1, [done]), pending]):
        break
    gc.collect()  # closes the abandoned generator
    assert pending._callbacks is None
    pending.cancel()


def test_as_completed_sync_argument_errors_come_at_the_call() -> None:
    fut = set_future(1, [Rec()])
    with pytest.raises(TypeError, match=r"as_completed_sync\(\[fut1, fut2\]\)"):
        cudafut.as_completed_sync(fut)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        cudafut.as_completed_sync([fut], timeout=-1)
    with pytest.raises(TypeError, match="number of seconds"):
        cudafut.as_completed_sync([fut], timeout="1")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_leaving_as_completed_early_removes_its_callbacks() -> None:
    done = Rec()
    done.complete()
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    iterator = cudafut.as_completed([set_future(1, [done]), pending])
    with anyio.fail_after(10):
        async for _fut in iterator:
            break
        await iterator.aclose()  # type: ignore[attr-defined]
    assert pending._callbacks is None
    pending.cancel()


def test_the_new_names_are_exported() -> None:
    for name in ("wrap_future", "from_torch", "as_completed_sync"):
        assert name in cudafut.__all__ and getattr(cudafut, name).__module__ == "cudafut"
    for method in ("to_asyncio", "to_concurrent", "to_torch", "remove_done_callback"):
        assert getattr(cudafut.CudaFuture, method).__doc__
