"""Callbacks that raise anything, a watcher thread that dies, futures that
would wait on themselves, and chains and values deeper than Python's
recursion limit (issue 22), with real events.

The slow producers spin on %globaltimer before they write (tests/kernels.py),
so their events are still pending when the callbacks are added.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _waiter
from tests.fakes import inject_watcher_bug
from tests.kernels import slow_zeros

pytestmark = pytest.mark.gpu

N = 1 << 10
SLOW_MS = 50.0
DEEP = 5000

_streams: list[Any] = []


def slow(cp: Any, value: float = 7.0, ms: float = SLOW_MS) -> tuple[Any, Any]:
    """A fresh stream, and zeros it overwrites with ``value`` after ``ms``."""
    stream = cp.cuda.Stream(non_blocking=True)
    _streams.append(stream)
    return stream, slow_zeros(stream, N, value, ms)


def slow_future(cp: Any, value: float = 7.0, ms: float = SLOW_MS) -> cudafut.CudaFuture[Any]:
    stream, x = slow(cp, value, ms)
    return cudafut.record(x, stream=stream)


def raiser(exc: BaseException) -> Callable[[object], Any]:
    def fn(_value: object) -> Any:
        raise exc

    return fn


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def all_equal(array: Any, value: float) -> bool:
    return bool((array.get() == value).all())


# -- then() callbacks --------------------------------------------------------------------


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_a_then_callback_fails_its_child_and_the_siblings_complete(
    cp: Any, kind: type[BaseException]
) -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    exc = kind()
    plus = parent.then(lambda v: v + 1)
    raising = parent.then(raiser(exc))
    times = parent.then(lambda v: v * 2)
    after = raising.then(lambda v: v)
    woken: list[BaseException | None] = []
    blocked = threading.Thread(target=lambda: woken.append(raising.exception(timeout=60)))
    blocked.start()
    stream, x = slow(cp)
    with stream, pytest.raises(kind) as info:
        parent.set_result(x)
    blocked.join()
    assert info.value is exc
    assert all_equal(plus.result(timeout=60), 8) and all_equal(times.result(timeout=60), 14)
    assert raising.exception(timeout=60) is exc and after.exception(timeout=60) is exc
    assert woken == [exc]


@pytest.mark.anyio
async def test_awaiting_the_siblings_of_a_raising_callback(cp: Any, anyio_backend: Any) -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    plus = parent.then(lambda v: v + 1)
    raising = parent.then(raiser(SystemExit(2)))
    stream, x = slow(cp)
    with stream, pytest.raises(SystemExit):
        parent.set_result(x)
    with anyio.fail_after(60):
        assert all_equal(await plus, 8)
    assert isinstance(raising.exception(timeout=60), SystemExit)


# -- done callbacks and the watcher thread ---------------------------------------------------


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt])
def test_an_interrupt_in_a_done_callback_on_the_watcher_leaves_it_running(
    cp: Any, kind: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    raised = threading.Event()

    def bad(_fut: object) -> None:
        raised.set()
        raise kind()

    first = slow_future(cp)
    first.add_done_callback(bad)
    assert raised.wait(60)
    later = slow_future(cp, 3.0)
    seen = threading.Event()
    later.add_done_callback(lambda _f: seen.set())
    assert seen.wait(60)
    assert all_equal(later.to_concurrent().result(timeout=60), 3)
    assert logged(caplog, f"{kind.__name__} in a done callback")


@pytest.mark.anyio
async def test_an_interrupt_in_a_done_callback_on_a_loop_leaves_the_loop_running(
    cp: Any, anyio_backend: Any
) -> None:
    ran: list[str] = []

    def bad(_fut: object) -> None:
        ran.append("bad")
        raise SystemExit(1)

    fut = slow_future(cp)
    fut.add_done_callback(bad)
    fut.add_done_callback(lambda _f: ran.append("after"))
    other = slow_future(cp, 5.0)
    with anyio.fail_after(60):
        assert all_equal(await fut, 7)
        while len(ran) < 2:
            await anyio.sleep(0.001)
        assert all_equal(await other, 5)  # the loop's waiter goes on
    assert sorted(ran) == ["after", "bad"]


def test_a_dead_watcher_thread_is_replaced_and_completes_real_work(
    cp: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    waiter = _waiter.thread_waiter()
    deaths = waiter.deaths
    watched = threading.Event()
    pending = slow_future(cp, 2.0, ms=500.0)
    pending.add_done_callback(lambda _f: watched.set())  # watched when the thread dies
    inject_watcher_bug(monkeypatch, waiter)
    for _ in range(6000):  # the watcher runs its loop at least every max_sleep_s
        if waiter.deaths > deaths:
            break
        threading.Event().wait(0.01)
    assert waiter.deaths == deaths + 1
    fut = slow_future(cp, 4.0)
    assert all_equal(fut.to_concurrent().result(timeout=60), 4)  # the next use: a new thread
    assert watched.wait(60)  # which took over the pending watch
    assert len(logged(caplog, "watcher thread (cudafut-watcher) died")) == 1


# -- a future that would wait on itself -------------------------------------------------------


def test_a_then_child_returned_by_its_own_fn_fails(cp: Any) -> None:
    parent: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    child: cudafut.CudaFuture[Any] = parent.then(lambda v: child)
    grandchild: cudafut.CudaFuture[Any] = parent.then(lambda v: grandchild.then(lambda w: w))
    stream, x = slow(cp)
    with stream:
        parent.set_result(x)
    assert isinstance(child.exception(timeout=60), cudafut.InvalidStateError)
    assert isinstance(grandchild.exception(timeout=60), cudafut.InvalidStateError)


# -- deep chains and values -------------------------------------------------------------------


def test_a_5000_link_chain_on_the_gpu(cp: Any) -> None:
    root: cudafut.CudaFuture[Any] = cudafut.CudaFuture(devices=0)
    leaf = root
    for _ in range(DEEP):
        leaf = leaf.then(lambda v: v + 1)
    stream, x = slow(cp, 0.0)
    with stream:
        root.set_result(x)
    assert all_equal(leaf.result(timeout=120), DEEP)


def nested(leaf: object, depth: int) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 3 == 0 else (value,) if i % 3 == 1 else {"k": value}
    return value


def innermost(value: object) -> Any:
    while isinstance(value, (list, tuple, dict)):
        (value,) = value.values() if isinstance(value, dict) else value
    return value


def test_a_value_nested_5000_deep_is_recorded_set_and_consumed(cp: Any) -> None:
    stream, x = slow(cp)
    deep = nested(x, DEEP)
    with stream:
        recorded = cudafut.record(deep)
        fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
        fut.set_result(deep)
    assert recorded.devices == (0,) and fut.devices == (0,)
    assert all_equal(innermost(recorded.result(timeout=60)), 7)
    assert all_equal(innermost(fut.then(lambda v: v).result(timeout=60)), 7)
    assert all_equal(innermost(fut.wait(timeout=60)), 7)
    assert repr(fut).startswith("<CudaFuture")
