"""Taking another future's outcome (then() children, followers, gather()),
infinite timeouts, device arguments and pool statistics, with real events.

The slow producers spin on %globaltimer before they write (tests/kernels.py),
so their events are still pending while the tests cancel, fail and check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import math
import threading
import time
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _pools, _waiter
from tests.kernels import slow_zeros

pytestmark = pytest.mark.gpu

N = 1 << 16
SLOW_MS = 50.0

# The producers' streams, kept for the session: a handle freed and reused
# while a record of it is alive would confuse nobody here, but is not worth
# the doubt.
_streams: list[Any] = []


def slow(cp: Any, value: float = 7.0, ms: float = SLOW_MS) -> tuple[Any, cudafut.CudaFuture[Any]]:
    """Zeros that a fresh stream overwrites with ``value`` after ``ms``."""
    stream = cp.cuda.Stream(non_blocking=True)
    _streams.append(stream)
    x = slow_zeros(stream, N, value, ms)
    return x, cudafut.record(x, stream=stream)


def cancelled() -> cudafut.CudaFuture[Any]:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    fut.cancel()
    return fut


# -- a cancelled or failed input, with real events pending ---------------------------


def test_gather_of_a_cancelled_input_is_cancelled_while_the_others_run(cp: Any) -> None:
    _x, fut = slow(cp)
    out = cudafut.gather(fut, cancelled())
    assert out.cancelled()  # at once: decided without waiting for the GPU work
    with pytest.raises(cudafut.CancelledError):
        out.result(timeout=60)
    assert (fut.result(timeout=60).get() == 7).all()


def test_gather_of_a_failed_input_fails_with_the_same_object(cp: Any) -> None:
    _x, fut = slow(cp)
    bad: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    out = cudafut.gather(fut, bad)
    exc = KeyError("input")
    bad.set_exception(exc)
    assert out.exception(timeout=60) is exc
    assert (fut.result(timeout=60).get() == 7).all()


def test_then_child_of_a_parent_cancelled_before_set_is_cancelled(cp: Any) -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    calls: list[object] = []
    child = parent.then(calls.append)
    grandchild = child.then(calls.append)
    parent.cancel()
    assert child.cancelled() and grandchild.cancelled() and calls == []


def test_then_child_following_a_returned_cancelled_future_is_cancelled(cp: Any) -> None:
    _x, fut = slow(cp)
    child = fut.then(lambda v: cancelled())  # fn ran on a pool stream, then returned it
    assert child.cancelled()
    with pytest.raises(cudafut.CancelledError):
        child.result(timeout=60)
    assert (fut.result(timeout=60).get() == 7).all()


def test_then_child_following_a_returned_slow_future_gets_its_value(cp: Any) -> None:
    _x, fut = slow(cp, 1.0)
    holder: list[Any] = []

    def fn(v: Any) -> cudafut.CudaFuture[Any]:
        y, inner = slow(cp, 5.0)
        holder.append(y)
        return inner

    child = fut.then(fn)
    assert (child.result(timeout=60).get() == 5).all()


@pytest.mark.anyio
async def test_awaiting_a_gather_of_a_cancelled_input(
    cp: Any, anyio_backend: tuple[str, dict[str, object]]
) -> None:
    _x, fut = slow(cp)
    out = cudafut.gather(fut, cancelled())
    expected = asyncio.CancelledError if anyio_backend[0] == "asyncio" else concurrent.futures.CancelledError
    with anyio.fail_after(60):
        with pytest.raises(expected):
            await out
        assert (cp.asnumpy(await fut) == 7).all()


# -- where then() runs fn ----------------------------------------------------------------


def test_then_on_a_set_future_runs_fn_now_in_the_calling_thread(cp: Any) -> None:
    _x, fut = slow(cp)
    ran_in: list[int] = []

    def fn(v: Any) -> Any:
        ran_in.append(threading.get_ident())
        return v + 1

    child = fut.then(fn)
    assert ran_in == [threading.get_ident()]  # before then() returned
    assert child.devices == (0,)  # and the child is set: its events are recorded
    assert (child.result(timeout=60).get() == 8).all()


def test_set_result_runs_pending_then_callbacks_in_the_setters_thread(cp: Any) -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    ran_in: list[int] = []

    def fn(v: Any) -> Any:
        ran_in.append(threading.get_ident())
        return v * 2

    child = parent.then(fn)
    setter_ident: list[int] = []
    ran_before_set_result_returned: list[int] = []

    def produce() -> None:
        x = cp.ones(N, dtype=cp.float32)
        setter_ident.append(threading.get_ident())
        parent.set_result(x)
        ran_before_set_result_returned.extend(ran_in)

    thread = threading.Thread(target=produce)
    thread.start()
    thread.join()
    assert ran_before_set_result_returned == setter_ident
    assert (child.result(timeout=60).get() == 2).all()


# -- infinite timeouts on real work ----------------------------------------------------


@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_infinite_timeouts_on_real_work(cp: Any, timeout: float) -> None:
    _x, fut = slow(cp)
    assert (fut.result(timeout=timeout).get() == 7).all()
    assert fut.exception(timeout=timeout) is None
    _y, fut2 = slow(cp, 3.0)
    (v,) = cudafut.wait_all([fut2], timeout=timeout)
    assert ((v + 0).get() == 3).all()  # the current stream waited
    assert (fut2.wait(timeout=timeout).get() == 3).all()


# -- device arguments on a machine with a GPU --------------------------------------------


def test_device_arguments_on_a_gpu(cp: Any) -> None:
    with pytest.raises(ValueError, match="numbered from 0"):
        cudafut.CudaFuture(devices=-1)
    with pytest.raises(ValueError, match="numbered from 0"):
        cudafut.submit(lambda: None, device=-1)
    with pytest.raises(TypeError, match="int device ordinal"):
        cudafut.CudaFuture(devices=1.5)  # type: ignore[arg-type]
    assert cudafut.CudaFuture(devices=(0, 0)).devices == (0,)


# -- pool statistics ------------------------------------------------------------------------


def _no_holds() -> None:
    end = time.monotonic() + 10
    while _waiter.thread_waiter().holding and time.monotonic() < end:
        time.sleep(0.005)
    gc.collect()


def test_pool_statistics_count_live_records(cp: Any) -> None:
    _no_holds()
    before = _pools.pool_statistics()
    x = cp.ones(N, dtype=cp.float32)
    futs = [cudafut.record(x) for _ in range(8)]
    during = _pools.pool_statistics()
    assert during.events_in_use.get(0, 0) - before.events_in_use.get(0, 0) == 8
    for fut in futs:
        fut.result(timeout=60)
    del futs, fut  # the loop variable holds the last future (and its record)
    gc.collect()
    after = _pools.pool_statistics()
    assert after.events_in_use.get(0, 0) == before.events_in_use.get(0, 0)
    assert after.events_free.get(0, 0) >= 8
    assert after.events_created == _pools.events.created
