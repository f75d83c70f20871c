"""How a future takes another's outcome (then() children, followers of a
returned future, gather()), and the argument and timeout errors a new user
meets first, with scripted events (tests/fakes.py) instead of a GPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import gc
import logging
import math
import threading
import traceback
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _backend, _pools, testing
from cudafut._future import _State
from tests.children import until
from tests.fakes import FakeRecord, set_future


def failed(exc: BaseException) -> cudafut.CudaFuture[Any]:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    fut.set_exception(exc)
    return fut


def raised(exc: BaseException) -> BaseException:
    """``exc``, raised and caught once, so that it has a traceback of its own."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def cancelled() -> cudafut.CudaFuture[Any]:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    fut.cancel()
    return fut


def frames(tb: Any) -> list[str]:
    # A compiled core's frames carry qualified names ("cudafut._future.CudaFuture.result").
    return [frame.name.rsplit(".", 1)[-1] for frame in traceback.extract_tb(tb)]


# -- the state -----------------------------------------------------------------


def state(fut: cudafut.CudaFuture[Any]) -> _State:
    return fut._state


def test_the_state_is_a_private_enum() -> None:
    assert issubclass(_State, enum.Enum)
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    assert state(fut) is _State.PENDING
    fut.cancel()
    assert state(fut) is _State.CANCELLED
    assert state(failed(KeyError())) is _State.FAILED
    assert state(set_future(1, [FakeRecord()])) is _State.SET
    assert repr(cancelled()) == "<CudaFuture cancelled>"


# -- a cancelled parent or input: the one rule ------------------------------------


def test_then_child_of_a_cancelled_parent_is_cancelled() -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    calls: list[object] = []
    child = parent.then(calls.append)
    parent.cancel()
    assert child.cancelled() and cancelled().then(calls.append).cancelled()
    assert calls == []


def test_a_child_following_a_cancelled_returned_future_is_cancelled() -> None:
    inner: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    follower: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    follower._follow(inner)
    inner.cancel()
    assert follower.cancelled()


def test_gather_of_a_cancelled_input_is_cancelled_like_a_then_child() -> None:
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    later: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    out = cudafut.gather(pending, later)
    later.cancel()
    assert out.cancelled()
    with pytest.raises(cudafut.CancelledError):
        out.result(timeout=5)
    # Then the other input completes: the gathered future stays cancelled.
    pending.set_exception(KeyError("too late"))
    assert out.cancelled()
    pending.exception()
    assert cudafut.gather(set_future(1, [FakeRecord()]), cancelled()).cancelled()


def test_the_first_input_to_fail_or_be_cancelled_decides() -> None:
    a: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    b: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    out = cudafut.gather(a, b)
    exc = ValueError("b first")
    b.set_exception(exc)
    a.cancel()
    assert not out.cancelled() and out.exception(timeout=5) is exc


@pytest.mark.anyio
async def test_awaiting_a_gather_of_a_cancelled_input_raises_the_loops_cancelled_error(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    out = cudafut.gather(set_future(1, [FakeRecord()]), cancelled())
    expected = asyncio.CancelledError if anyio_backend[0] == "asyncio" else concurrent.futures.CancelledError
    with pytest.raises(expected):
        await out


# -- a failed parent or input --------------------------------------------------------


def test_children_and_gathers_fail_with_the_same_object_and_the_original_traceback() -> None:
    exc = raised(KeyError("original"))
    original = frames(exc.__traceback__)
    parent = failed(exc)
    child = parent.then(lambda v: v)
    out = cudafut.gather(set_future(1, [FakeRecord()]), parent)
    for fut in (parent, child, out, parent, child, out):
        with pytest.raises(KeyError) as info:
            fut.result(timeout=5)
        assert info.value is exc
        # Each raise starts from the stored traceback: earlier raises of the
        # same object (by the parent, the other children) leave no frames.
        seen = frames(info.value.__traceback__)
        assert seen[-len(original) :] == original and seen.count("result") == 1


def test_raising_the_same_failure_again_does_not_grow_its_traceback() -> None:
    fut = failed(KeyError("k"))
    lengths = []
    for _ in range(3):
        with pytest.raises(KeyError) as info:
            fut.result()
        lengths.append(len(frames(info.value.__traceback__)))
    assert lengths[0] == lengths[1] == lengths[2]


def test_a_known_gpu_error_of_an_input_fails_the_gather_and_the_then_child() -> None:
    rec = FakeRecord()
    rec.fail(700)
    rec.query()
    bad = set_future("v", [rec])
    calls: list[object] = []
    for fut in (cudafut.gather(bad, set_future(2, [FakeRecord()])), bad.then(calls.append)):
        error = fut.exception(timeout=5)
        assert isinstance(error, cudafut.CudaError) and error.code == 700
    assert calls == []


def test_gather_is_set_with_every_record_once_and_keeps_its_inputs() -> None:
    shared, other = FakeRecord(), FakeRecord()
    a = set_future("a", [shared])
    b = set_future("b", [shared, other])
    out = cudafut.gather(a, b, a)
    assert out._state is _State.SET and out._records == (shared, other)
    assert out._keep == (None, (a, b, a))
    shared.complete()
    other.complete()
    assert out.result(timeout=5) == ["a", "b", "a"]
    assert out._keep is None  # released once its events completed


def test_gather_of_one_future_and_of_none() -> None:
    rec = FakeRecord()
    rec.complete()
    assert cudafut.gather(set_future(3, [rec])).result(timeout=5) == [3]
    assert cudafut.gather().result(timeout=5) == []


# -- the unretrieved-exception log ---------------------------------------------------


def earlier_unrelated_call(fut: cudafut.CudaFuture[Any]) -> None:
    with pytest.raises(LookupError):
        fut.result()


def test_dropped_gather_logs_the_exceptions_own_traceback(caplog: pytest.LogCaptureFixture) -> None:
    exc = raised(LookupError("nobody asked the gather"))
    original = frames(exc.__traceback__)
    parent = failed(exc)
    out = cudafut.gather(parent)
    earlier_unrelated_call(parent)  # grows exc.__traceback__ with these frames
    assert "earlier_unrelated_call" in frames(exc.__traceback__)
    with caplog.at_level(logging.ERROR, logger="cudafut"):
        del out
        gc.collect()
    logged = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(logged) == 1  # the gather's; the input's counts as retrieved
    exc_info = logged[0].exc_info
    assert exc_info is not None and exc_info[1] is exc
    assert frames(exc_info[2]) == original


def test_a_failed_parent_is_logged_once_through_its_child(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="cudafut"):
        failed(raised(OSError("lost"))).then(lambda v: v)
        gc.collect()
    assert len([r for r in caplog.records if "never retrieved" in r.getMessage()]) == 1


# -- timeouts ----------------------------------------------------------------------------


def _outcome_of(call: Any, fut: cudafut.CudaFuture[Any]) -> list[object]:
    """Run ``call(fut)`` in a thread while ``fut`` is pending; set it with an
    exception once the thread blocks on it; return what the call gave."""
    got: list[object] = []

    def waiter() -> None:
        try:
            got.append(call(fut))
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    while fut._set_event is None and thread.is_alive():  # it is about to block
        thread.join(0.001)
    thread.join(0.01)  # let it reach the wait itself
    fut.set_exception(KeyError("set while waited on"))
    thread.join()
    return got


@pytest.mark.parametrize("timeout", [math.inf, 1e300, threading.TIMEOUT_MAX])
@pytest.mark.parametrize("call", ["result", "exception", "wait", "wait_all"])
def test_an_infinite_timeout_waits_without_limit(call: str, timeout: float) -> None:
    calls = {
        "result": lambda f: f.result(timeout=timeout),
        "exception": lambda f: f.exception(timeout=timeout),
        "wait": lambda f: f.wait(timeout=timeout),
        "wait_all": lambda f: cudafut.wait_all([f], timeout=timeout),
    }
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    (got,) = _outcome_of(calls[call], fut)
    assert isinstance(got, KeyError), got
    assert got is fut.exception()


def test_an_infinite_timeout_on_gpu_work_still_running() -> None:
    rec = FakeRecord()
    fut = set_future("v", [rec])
    threading.Timer(0.005, rec.complete).start()
    assert fut.result(timeout=math.inf) == "v"


def test_wait_all_reports_the_timeout_it_was_given() -> None:
    rec = FakeRecord()
    rec.complete()
    rec.query()  # known complete: wait() enqueues no stream wait
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with pytest.raises(cudafut.TimeoutError, match=r"index 1 \(of 2\) was not set within 0\.02 s:"):
        cudafut.wait_all([set_future("v", [rec]), pending], timeout=0.02)
    assert not pending.done()


# -- devices: checked before CUDA is touched -----------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything asks CUDA for its devices."""

    def touched() -> int:
        raise AssertionError("the argument should be refused before CUDA is touched")

    monkeypatch.setattr(_backend.current, "device_count", touched)
    monkeypatch.setattr(_backend.current, "current_device", touched)


@pytest.mark.parametrize("devices", [1.5, "0", b"0", True, 2j, object()])
def test_devices_that_are_not_devices_say_what_a_device_is(devices: Any, no_cuda: None) -> None:
    with pytest.raises(TypeError, match=r"an int device ordinal \(0, 1, \.\.\.\) or an iterable of them"):
        cudafut.CudaFuture(devices=devices)


def test_a_non_int_device_in_an_iterable_is_a_type_error(no_cuda: None) -> None:
    with pytest.raises(TypeError, match=r"a device is an int index \(a CUDA device ordinal"):
        cudafut.CudaFuture(devices=[1.5])  # type: ignore[list-item]


@pytest.mark.parametrize("devices", [-1, [-1], (2, -3)])
def test_a_negative_device_is_a_value_error_without_cuda(devices: Any, no_cuda: None) -> None:
    with pytest.raises(ValueError, match="out of range: CUDA devices are numbered from 0"):
        cudafut.CudaFuture(devices=devices)


def test_submit_to_a_negative_device_is_a_value_error_without_cuda(no_cuda: None) -> None:
    with pytest.raises(ValueError, match="out of range"):
        cudafut.submit(lambda: None, device=-1)


# -- gather(*futs) against wait_all(futs) and as_completed(futs) ---------------------------


def test_gather_of_a_list_says_to_unpack_it() -> None:
    fut = cancelled()
    for bad in ([fut], (fut,), iter([fut])):
        with pytest.raises(
            TypeError, match=r"separate arguments.*gather\(\*futs\), not gather\(\[\.\.\.\]\)"
        ):
            cudafut.gather(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes CudaFutures, not int"):
        cudafut.gather(fut, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["wait_all", "as_completed"])
def test_wait_all_and_as_completed_of_a_future_say_to_pass_an_iterable(name: str) -> None:
    call = getattr(cudafut, name)
    fut = cancelled()
    with pytest.raises(TypeError, match=rf"takes an iterable of CudaFutures: {name}\(\[fut1, fut2\]\)"):
        call(fut)
    with pytest.raises(TypeError, match="takes an iterable of CudaFutures, such as a list, not int"):
        call(3)
    with pytest.raises(TypeError, match="takes CudaFutures, not str"):
        call([fut, "x"])


# -- as_completed needs a running loop ----------------------------------------------------


def test_as_completed_without_a_running_loop_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="as_completed\\(\\) needs a running asyncio"):
        cudafut.as_completed([cancelled()])


@pytest.mark.anyio
async def test_as_completed_in_a_running_loop(anyio_backend: tuple[str, dict[str, object]]) -> None:
    a, b = failed(KeyError("a")), cancelled()
    with anyio.fail_after(10):
        seen = [fut async for fut in cudafut.as_completed([a, b])]
    assert sorted(map(id, seen)) == sorted([id(a), id(b)])
    a.exception()


# -- pool statistics ------------------------------------------------------------------------


def test_pool_counts_events_and_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pools of the test's own, so that records of other tests that happen
    # to be collected meanwhile (into the process pools) change nothing;
    # their events and streams are the fake GPU's.
    monkeypatch.setattr(_pools, "_MAX_FREE_EVENTS", 2)
    with testing.fake_cuda(devices=2):
        _check_pool_counts(_pools.EventPool(), _pools.StreamPool(size=3))


def test_the_pools_statistics_under_the_fake(fake_cuda: testing.FakeCuda) -> None:
    before = _pools.pool_statistics()  # the fake's own pools: nothing yet
    assert (before.events_created, before.streams) == (0, {})
    fut = cudafut.record(1).then(lambda v: v)
    stats = _pools.pool_statistics()
    assert stats.events_created == 2
    assert stats.events_in_use == {0: 2}
    assert stats.streams == {(0, "normal"): 1}
    fake_cuda.complete(fut)
    del fut
    gc.collect()
    # Handles back in the pool; the parent's (dropped at once, its status
    # unknown) once the watcher thread sweeps its stream's list of drops.
    until(lambda: _pools.pool_statistics().events_free == {0: 2}, "the dropped futures' events back")


def test_pool_statistics_counts_an_event_taken_and_returned(fake_cuda: testing.FakeCuda) -> None:
    # The public face of the pools' counts; under the fake, its own pools.
    assert cudafut.pool_statistics() == cudafut.PoolStatistics(0, {}, {}, {}, {}, {})
    fut = cudafut.record(1)
    taken = cudafut.pool_statistics()
    assert (taken.events_created, taken.events_in_use, taken.events_free) == (1, {0: 1}, {})
    fake_cuda.complete(fut)
    assert fut.done()  # its status known: its event goes back at the drop (else at a reclaim)
    del fut
    gc.collect()
    returned = cudafut.pool_statistics()
    assert (returned.events_created, returned.events_in_use, returned.events_free) == (1, {0: 0}, {0: 1})
    again = cudafut.record(2)  # the returned handle, reused
    assert cudafut.pool_statistics().events_created == 1
    fake_cuda.complete(again)
    copy = cudafut.to_device(np.zeros(3))
    fake_cuda.complete(copy)
    copied = cudafut.pool_statistics()
    assert (copied.copy_streams, copied.task_streams) == ({0: 1}, {})
    with pytest.raises(AttributeError):
        copied.events_created = 0  # type: ignore[misc]


def _check_pool_counts(events: _pools.EventPool, streams: _pools.StreamPool) -> None:
    assert (events.counts(), streams.counts()) == (({}, {}), {})

    taken = [events.acquire(0) for _ in range(4)] + [events.acquire(1)]
    for _ in range(5):
        streams.get(0, _pools.PRIORITIES["normal"])
    streams.get(1, _pools.PRIORITIES["high"])
    assert events.created == 5
    assert events.counts() == ({}, {0: 4, 1: 1})
    assert streams.counts() == {(0, "normal"): 3, (1, "high"): 1}

    for handle in taken[:4]:
        events.release(0, handle)  # two kept free, two destroyed
    assert events.counts() == ({0: 2}, {0: 0, 1: 1})
    assert events.acquire(0) in taken  # reused, not created
    assert events.created == 5


def test_pool_statistics_is_a_frozen_snapshot_of_the_process_pools() -> None:
    stats = _pools.pool_statistics()
    assert isinstance(stats, _pools.PoolStatistics)
    assert stats.events_created == _pools.events.created
    assert sum(stats.events_in_use.values()) + sum(stats.events_free.values()) <= stats.events_created
    with pytest.raises(AttributeError):
        stats.events_created = 0  # type: ignore[misc]


# -- the public names -----------------------------------------------------------------------


def test_every_public_name_is_named_cudafut_but_the_standard_librarys() -> None:
    for name in cudafut.__all__:
        obj = getattr(cudafut, name)
        expected = "concurrent.futures._base" if name == "CancelledError" else "cudafut"
        if name != "__version__":
            assert obj.__module__ == expected, name
    assert concurrent.futures.CancelledError.__module__ == "concurrent.futures._base"
