"""Host-side behaviour: the state machine, chaining, errors and blocking
waits, with scripted events (tests/fakes.py) instead of a GPU."""

from __future__ import annotations

import gc
import logging
import math
import threading
import time

import pytest

import cudafut
from cudafut import testing
from cudafut._future import _State
from tests.fakes import FakeRecord, set_future


def failed(exc: BaseException) -> cudafut.CudaFuture[object]:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.set_exception(exc)
    return fut


# -- producer side -----------------------------------------------------------


def test_a_new_future_is_pending() -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    assert not fut.done() and not fut.cancelled()
    assert fut.devices == ()
    assert repr(fut) == "<CudaFuture pending>"


def test_set_exception_is_raised_as_the_same_object() -> None:
    exc = KeyError("missing")
    fut = failed(exc)
    assert fut.done()
    with pytest.raises(KeyError) as info:
        fut.result()
    assert info.value is exc
    assert fut.exception() is exc
    assert "failed KeyError" in repr(fut)


def test_set_exception_accepts_a_class_and_rejects_non_exceptions() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    fut.set_exception(ValueError)
    assert isinstance(fut.exception(), ValueError)
    with pytest.raises(TypeError, match="needs an exception"):
        cudafut.CudaFuture().set_exception("boom")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StopIteration"):
        cudafut.CudaFuture().set_exception(StopIteration())


def test_completing_twice_is_an_invalid_state() -> None:
    fut = failed(ValueError())
    with pytest.raises(cudafut.InvalidStateError, match="already failed"):
        fut.set_exception(KeyError())
    with pytest.raises(cudafut.InvalidStateError):
        fut.set_result(1)
    fut.exception()


def test_cancel_only_before_set() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    assert fut.cancel() and fut.cancel() and fut.cancelled() and fut.done()
    with pytest.raises(cudafut.CancelledError):
        fut.result()
    with pytest.raises(cudafut.CancelledError):
        fut.exception()
    with pytest.raises(cudafut.InvalidStateError, match="cancelled"):
        fut.set_exception(KeyError())
    done = set_future("v", [FakeRecord()])
    assert not done.cancel() and not done.cancelled()


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan])
def test_bad_timeouts_are_rejected(bad: float) -> None:
    fut = failed(KeyError())
    with pytest.raises(ValueError, match="non-negative"):
        fut.result(bad)
    with pytest.raises(ValueError, match="non-negative"):
        fut.wait(bad)
    fut.exception()


def test_non_number_timeout_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="number of seconds"):
        cudafut.CudaFuture().result("1")  # type: ignore[arg-type]


def test_result_times_out_on_an_unset_future() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    with pytest.raises(cudafut.TimeoutError, match="not set within"):
        fut.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        fut.wait(timeout=0)
    assert not fut.done()


def test_result_times_out_while_gpu_work_runs_then_succeeds(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record("value")
    with pytest.raises(cudafut.TimeoutError, match="still running"):
        fut.result(timeout=0.01)
    fake_cuda.complete(fut)
    assert fut.result(timeout=1) == "value"


def test_result_blocks_until_set_from_another_thread() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    exc = RuntimeError("from thread")
    threading.Timer(0.02, fut.set_exception, (exc,)).start()
    assert fut.exception(timeout=5) is exc


def test_result_from_many_threads(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record("v")
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(fut.result(5))) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.01)
    fake_cuda.complete(fut)
    for t in threads:
        t.join()
    assert results == ["v"] * 16


def test_cuda_error_from_an_event_fails_the_future() -> None:
    rec = FakeRecord()
    rec.fail(700)
    fut = set_future("v", [rec, FakeRecord(stream=0x200)])
    with pytest.raises(cudafut.CudaError) as info:
        fut.result(timeout=5)
    assert info.value.code == 700
    assert fut.done()
    assert isinstance(fut.exception(), cudafut.CudaError)
    assert "failed on the GPU" in repr(fut)


def test_done_queries_and_releases_kept_objects() -> None:
    rec = FakeRecord()
    fut = set_future("v", [rec])
    fut._keep = keep = object()
    assert not fut.done()
    assert fut._keep is keep
    assert "running" in repr(fut)
    rec.complete()
    assert fut.done()
    assert fut._keep is None
    assert "done" in repr(fut)


def test_set_result_on_a_host_value_without_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="no GPU"):
        cudafut.CudaFuture[int]().set_result(3)


def test_devices_argument_must_name_a_device() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        cudafut.CudaFuture(devices=[])
    with pytest.raises(TypeError, match="int index"):
        cudafut.CudaFuture(devices=["0"])  # type: ignore[list-item]


# -- then ----------------------------------------------------------------------


def test_then_on_a_failed_future_skips_fn_and_keeps_the_exception() -> None:
    exc = KeyError("original")
    calls: list[object] = []
    leaf = failed(exc).then(calls.append).then(calls.append).then(calls.append)
    assert leaf.exception() is exc
    assert calls == []


def test_then_on_a_future_failed_later_in_another_thread() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    child = fut.then(lambda v: v)
    exc = OSError("late")
    threading.Thread(target=fut.set_exception, args=(exc,)).start()
    assert child.exception(timeout=5) is exc


def test_then_on_a_cancelled_future_cancels_the_child() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    child = fut.then(lambda v: v)
    fut.cancel()
    assert child.cancelled()


def test_then_validates_its_arguments() -> None:
    fut: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    with pytest.raises(TypeError, match="callable"):
        fut.then(42)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="'normal' or 'high'"):
        fut.then(lambda v: v, priority="hihg")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="callable"):
        fut.add_done_callback(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        cudafut.submit("not callable")  # type: ignore[call-overload]


# -- combinators ---------------------------------------------------------------


def test_gather_of_nothing_is_an_empty_list() -> None:
    assert cudafut.gather().result() == []


def test_gather_collects_values_and_every_record() -> None:
    a, b = FakeRecord(0x1), FakeRecord(0x2)
    out = cudafut.gather(set_future(1, [a]), set_future(2, [b]))
    assert out._state is _State.SET and set(out._records) == {a, b}
    assert not out.done()
    a.complete()
    b.complete()
    assert out.result(timeout=5) == [1, 2]


def test_gather_fails_with_the_first_failure() -> None:
    exc = ValueError("first")
    pending: cudafut.CudaFuture[object] = cudafut.CudaFuture()
    out = cudafut.gather(pending, failed(exc))
    assert out.exception(timeout=5) is exc
    pending.cancel()


def test_gather_and_wait_all_reject_non_futures() -> None:
    with pytest.raises(TypeError, match="CudaFutures"):
        cudafut.gather(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CudaFutures"):
        cudafut.wait_all([1])  # type: ignore[list-item]


def test_wait_all_raises_the_first_failure_and_times_out() -> None:
    exc = KeyError("x")
    with pytest.raises(KeyError):
        cudafut.wait_all([failed(exc)])
    with pytest.raises(cudafut.TimeoutError):
        cudafut.wait_all([cudafut.CudaFuture()], timeout=0.01)


# -- callbacks, logging ----------------------------------------------------------


def test_done_callback_without_a_loop_runs_on_the_watcher_thread() -> None:
    rec = FakeRecord()
    fut = set_future("v", [rec])
    seen = threading.Event()
    where: list[str] = []

    def callback(fut: object) -> None:
        where.append(threading.current_thread().name)
        seen.set()

    fut.add_done_callback(callback)
    time.sleep(0.01)
    assert not seen.is_set()  # set, but the GPU work is not done
    rec.complete()
    assert seen.wait(5)
    assert where == ["cudafut-watcher"]


def test_exception_in_done_callback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    seen = threading.Event()

    def bad(fut: object) -> None:
        seen.set()
        raise ZeroDivisionError("in callback")

    failed(KeyError()).add_done_callback(bad)
    assert seen.wait(5)
    for _ in range(100):
        if any("done callback" in r.getMessage() for r in caplog.records):
            break
        time.sleep(0.01)
    records = [r for r in caplog.records if "done callback" in r.getMessage()]
    assert records and records[0].exc_info and records[0].exc_info[0] is ZeroDivisionError


def test_unretrieved_exception_is_logged_on_gc(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="cudafut"):
        failed(LookupError("nobody looked"))
        gc.collect()
    assert any("never retrieved" in r.getMessage() for r in caplog.records)


def test_dropped_pending_future_keeps_its_value_until_done() -> None:
    rec = FakeRecord()
    held = threading.Event()

    class Value:
        def __del__(self) -> None:
            held.set()

    fut = set_future(Value(), [rec])
    del fut
    gc.collect()
    time.sleep(0.01)
    assert not held.is_set()  # the watcher holds it while the GPU may read it
    rec.complete()
    assert held.wait(5)


# -- finding devices -------------------------------------------------------------


class _Device:
    def __init__(self, **attrs: int) -> None:
        self.__dict__.update(attrs)


class _GpuArray:
    """Looks like a GPU array: a CAI dict and a device with an index."""

    def __init__(self, device: _Device) -> None:
        self.device = device
        self.__cuda_array_interface__ = {"data": (0x1000, False), "shape": (1,), "version": 3}


def test_find_devices_walks_containers_in_order() -> None:
    from cudafut._values import find_devices

    a, b = _GpuArray(_Device(index=1)), _GpuArray(_Device(id=0))  # torch-like, CuPy-like
    nested: list[object] = [1, "s", None, 2.5, {"k": (a, [b, a])}]
    nested.append(nested)  # a container that holds itself
    assert find_devices(nested) == (1, 0)
    assert find_devices([1, "x", b"y", {"z": None}, (3j,)]) == ()


def test_find_devices_ignores_cpu_objects() -> None:
    np = pytest.importorskip("numpy")
    from cudafut._values import find_devices

    assert find_devices({"host": np.zeros(3), "list": [np.ones(2)]}) == ()
