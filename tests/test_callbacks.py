"""Callbacks that raise anything, futures that would wait on themselves, and
chains and values deeper than Python's recursion limit (issue 22), with
scripted events (tests/fakes.py) instead of a GPU."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _waiter, testing
from cudafut._interface import complete_with
from cudafut._values import find_devices, gpu_arrays, placements
from tests.fakes import FakeRecord, inject_watcher_bug, set_future

#: Deeper than Python's default recursion limit (1000) allows any recursive
#: walk or completion to go.
DEEP = 5000


def host_set(fut: cudafut.CudaFuture[Any], value: object) -> None:
    """``fut.set_result(value)`` without CUDA: set with no events, running
    what waits on it before returning, as ``set_result`` does."""
    complete_with(fut, value)


def raiser(exc: BaseException) -> Callable[[object], Any]:
    def fn(_value: object) -> NoReturn:
        raise exc

    return fn


class Custom(BaseException):
    """A BaseException that is neither an interrupt nor an Exception."""


def wait_until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` for up to 5 s (a hang guard, not a timing)."""
    for _ in range(500):
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# -- then() callbacks that raise a BaseException -------------------------------------


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_a_then_callback_fails_its_child_runs_the_others_then_reaches_the_setter(
    kind: type[BaseException],
) -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    exc = kind()
    before = parent.then(lambda v: v + 1)
    raising = parent.then(raiser(exc))
    after = parent.then(lambda v: v + 2)
    grandchild = raising.then(lambda v: v)
    both = cudafut.gather(before, after)
    woken: list[BaseException | None] = []
    blocked = threading.Thread(target=lambda: woken.append(raising.exception(timeout=5)))
    blocked.start()
    with pytest.raises(kind) as info:
        host_set(parent, 1)
    blocked.join()
    assert info.value is exc  # raised once everything else ran
    assert before.result(timeout=0) == 2 and after.result(timeout=0) == 3 and both.result(timeout=0) == [2, 3]
    assert raising.exception(timeout=0) is exc and type(raising.exception(timeout=0)) is kind  # type kept
    assert grandchild.exception(timeout=0) is exc
    assert woken == [exc]  # a thread blocked on the failing child woke


def test_an_interrupt_deep_in_a_chain_is_raised_after_every_other_branch() -> None:
    root: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    order: list[str] = []

    def step(name: str) -> Callable[[int], int]:
        def fn(v: int) -> int:
            order.append(name)
            return v + 1

        return fn

    a = root.then(step("a"))
    a_raises = a.then(raiser(KeyboardInterrupt()))
    a_after = a_raises.then(step("never"))
    b = root.then(step("b")).then(step("b1")).then(step("b2"))
    with pytest.raises(KeyboardInterrupt):
        host_set(root, 0)
    assert order == ["a", "b", "b1", "b2"]
    assert b.result(timeout=0) == 3
    assert isinstance(a_after.exception(timeout=0), KeyboardInterrupt)


def test_the_first_of_two_interrupts_is_raised_and_the_second_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    first, second = KeyboardInterrupt("first"), SystemExit("second")
    one, two = parent.then(raiser(first)), parent.then(raiser(second))
    last = parent.then(lambda v: v)
    with caplog.at_level(logging.ERROR, logger="cudafut"), pytest.raises(KeyboardInterrupt) as info:
        host_set(parent, 1)
    assert info.value is first
    assert (
        one.exception(timeout=0) is first
        and two.exception(timeout=0) is second
        and last.result(timeout=0) == 1
    )
    records = logged(caplog, "exception while completing")
    assert records and records[0].exc_info is not None and records[0].exc_info[1] is second


@pytest.mark.parametrize("kind", [Custom, GeneratorExit])
def test_other_base_exceptions_of_a_then_callback_are_stored_not_raised(kind: type[BaseException]) -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    exc = kind()
    raising = parent.then(raiser(exc))
    sibling = parent.then(lambda v: v * 10)
    host_set(parent, 4)  # does not raise
    assert raising.exception(timeout=0) is exc
    assert sibling.result(timeout=0) == 40


def test_then_on_a_set_future_raises_the_interrupt_to_its_caller() -> None:
    parent = set_future(1, [])
    with pytest.raises(SystemExit):
        parent.then(raiser(SystemExit(3)))
    assert parent.then(lambda v: v + 1).result(timeout=0) == 2  # nothing is left broken


def test_an_interrupt_in_a_submitted_function_fails_the_future_and_reaches_the_caller() -> None:
    # submit() runs fn through the same path as then() (cudafut._future.settle).
    from cudafut._future import settle

    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    waiting = fut.then(lambda v: v)
    exc = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        settle(fut, raiser(exc), (None,), {}, {}, None)
    assert fut.exception(timeout=0) is exc and waiting.exception(timeout=0) is exc


@pytest.mark.anyio
async def test_awaiting_a_child_whose_callback_raised_a_base_exception_raises_it(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    exc = Custom("from fn")
    raising, sibling = parent.then(raiser(exc)), parent.then(lambda v: v + 1)
    host_set(parent, 1)
    with anyio.fail_after(5):
        assert await sibling == 2
        with pytest.raises(Custom) as info:
            await raising
    assert info.value is exc


@pytest.mark.anyio
async def test_a_done_callback_runs_at_a_failure_not_after_other_devices_work(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    # done() is true at the first record known to have failed: so the done
    # callback runs then, not once the work on the other device ends.
    with testing.fake_cuda(devices=2, hint_after_s=None) as fake:
        first = cudafut.record(np.ones(2), stream=fake.stream(0))
        second = cudafut.record(np.ones(2), stream=fake.stream(1))
        both = cudafut.gather(first, second)
        fake.fail(first, 700)
        assert both.done()
        ran = anyio.Event()
        both.add_done_callback(lambda _f: ran.set())
        with anyio.fail_after(30):
            await ran.wait()
        assert not second.done()
        fake.complete_all()


@pytest.mark.anyio
async def test_done_callbacks_run_in_the_order_added_when_a_later_one_finds_the_work_done(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    # The first callback waits for its watch's next poll; the second, added
    # once the work is known complete, would run at once: it runs after it.
    with testing.fake_cuda(hint_after_s=None) as fake:
        fut = cudafut.record(np.ones(2), stream=fake.stream())
        ran: list[int] = []
        fut.add_done_callback(lambda _f: ran.append(0))
        await anyio.sleep(0.001)  # the first callback's watch is on the waiter
        fake.complete(fut)
        assert fut.done()  # the completion is known from here on
        both = anyio.Event()

        def second(_f: object) -> None:
            ran.append(1)
            both.set()

        fut.add_done_callback(second)
        with anyio.fail_after(30):
            await both.wait()
        assert ran == [0, 1]


# -- done callbacks that raise ---------------------------------------------------------


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt])
def test_an_interrupt_in_a_done_callback_on_the_watcher_is_logged_and_later_callbacks_run(
    kind: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    raised = threading.Event()

    def bad(_fut: object) -> None:
        raised.set()
        raise kind()

    rec = FakeRecord()
    fut = set_future("v", [rec])
    fut.add_done_callback(bad)
    also = threading.Event()
    fut.add_done_callback(lambda _f: also.set())  # the same wake-up as bad
    rec.complete()
    assert raised.wait(5) and also.wait(5)
    later = threading.Event()
    set_future("w", []).add_done_callback(lambda _f: later.set())
    assert later.wait(5)  # the watcher thread lives on
    assert wait_until(lambda: bool(logged(caplog, f"{kind.__name__} in a done callback")))
    record = logged(caplog, f"{kind.__name__} in a done callback")[0]
    assert record.exc_info is not None and type(record.exc_info[1]) is kind


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [SystemExit, Custom])
async def test_an_interrupt_in_a_done_callback_on_a_loop_is_reported_and_the_loop_goes_on(
    kind: type[BaseException],
    anyio_backend: tuple[str, dict[str, object]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    def bad(_fut: object) -> None:
        ran.append("bad")
        raise kind()

    rec = FakeRecord()
    fut = set_future("v", [rec])
    fut.add_done_callback(lambda _f: ran.append("first"))
    fut.add_done_callback(bad)
    fut.add_done_callback(lambda _f: ran.append("last"))
    set_future("now", []).add_done_callback(bad)  # runs at once from the loop
    rec.complete()
    with anyio.fail_after(5):
        assert await fut == "v"
        while len(ran) < 4:
            await anyio.sleep(0.001)
    assert sorted(ran) == ["bad", "bad", "first", "last"]
    assert logged(caplog, f"{kind.__name__} in a done callback")  # asyncio's handler, or cudafut's logger


# -- the watcher thread is supervised ---------------------------------------------------


def test_a_dead_watcher_thread_is_logged_once_and_replaced_at_the_next_use(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Watcher threads of earlier tests' fakes may still be ending: only the
    # threads started here count.
    before = set(threading.enumerate())
    waiter = _waiter.thread_waiter()
    started = threading.Event()
    set_future(1, []).add_done_callback(lambda _f: started.set())
    assert started.wait(5)
    old = waiter._thread
    assert old is not None and old.is_alive()
    deaths = waiter.deaths
    inject_watcher_bug(monkeypatch, waiter)
    ran = threading.Event()
    waiter.call_soon_threadsafe(ran.set)
    assert ran.wait(5)
    assert wait_until(lambda: waiter.deaths == deaths + 1)
    old.join(5)
    assert not old.is_alive()
    rec = FakeRecord()
    fut = set_future("v", [rec])
    later = threading.Event()
    fut.add_done_callback(lambda _f: later.set())  # the next use: a new thread
    rec.complete()
    assert later.wait(5)
    started_here = [t for t in threading.enumerate() if t not in before and t is not old]
    assert [t.name for t in started_here].count("cudafut-watcher") == 1
    records = logged(caplog, "watcher thread (cudafut-watcher) died")
    assert len(records) == 1 and records[0].exc_info is not None
    assert "an injected bug" in str(records[0].exc_info[1])


def test_work_handed_to_a_dying_watcher_is_run_by_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    waiter = _waiter.thread_waiter()
    second = threading.Event()

    def first() -> None:  # queues more work, then the thread dies before running it
        waiter.call_soon_threadsafe(second.set)

    inject_watcher_bug(monkeypatch, waiter, SystemExit("an injected bug"))
    waiter.call_soon_threadsafe(first)
    assert second.wait(5)


def test_a_watcher_that_dies_before_serving_waits_for_the_next_use(monkeypatch: pytest.MonkeyPatch) -> None:
    waiter = _waiter.thread_waiter()
    started = threading.Event()
    set_future(1, []).add_done_callback(lambda _f: started.set())
    assert started.wait(5)
    deaths = waiter.deaths
    old = waiter._thread
    bugs = [RuntimeError("stop the running thread")]

    def buggy() -> None:
        if bugs:
            raise bugs.pop()

    monkeypatch.setattr(waiter, "_take_holds", buggy)
    waiter.call_soon_threadsafe(lambda: None)
    assert wait_until(lambda: waiter.deaths == deaths + 1)
    assert old is not None
    old.join(5)

    def dies_at_once() -> None:
        raise RuntimeError("a bug that kills every new thread")

    monkeypatch.setattr(waiter, "_serve", dies_at_once)
    first = threading.Event()
    waiter.call_soon_threadsafe(first.set)  # starts a thread that dies serving nothing
    assert wait_until(lambda: waiter.deaths == deaths + 2)
    assert wait_until(lambda: "cudafut-watcher" not in [t.name for t in threading.enumerate()])
    assert not first.is_set()  # no churn: the call waits for the next use
    monkeypatch.undo()
    second = threading.Event()
    waiter.call_soon_threadsafe(second.set)
    assert first.wait(5) and second.wait(5)


# -- a future that would wait on itself --------------------------------------------------


def test_a_then_child_returned_by_its_own_fn_fails_instead_of_waiting_for_ever() -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    child: cudafut.CudaFuture[Any] = parent.then(lambda v: child)
    host_set(parent, 1)
    assert child.done()
    with pytest.raises(cudafut.InvalidStateError, match="would wait on itself"):
        child.result(timeout=0)


def test_returning_a_then_child_of_the_child_fails_the_child() -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    child: cudafut.CudaFuture[Any] = parent.then(lambda v: child.then(lambda w: w))
    host_set(parent, 1)
    assert isinstance(child.exception(timeout=0), cudafut.InvalidStateError)


def test_two_children_following_each_other_both_fail() -> None:
    p: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    q: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    a: cudafut.CudaFuture[Any] = p.then(lambda v: b)
    b: cudafut.CudaFuture[Any] = q.then(lambda v: a)
    host_set(p, 1)
    assert not a.done()  # follows b, which may still complete
    host_set(q, 2)
    error = b.exception(timeout=0)
    assert isinstance(error, cudafut.InvalidStateError)
    assert a.exception(timeout=0) is error  # a followed b


def test_a_cycle_through_a_gather_fails() -> None:
    p: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    g: cudafut.CudaFuture[list[Any]]
    a: cudafut.CudaFuture[Any] = p.then(lambda v: g)
    g = cudafut.gather(a)
    host_set(p, 1)
    assert isinstance(a.exception(timeout=0), cudafut.InvalidStateError)
    assert isinstance(g.exception(timeout=0), cudafut.InvalidStateError)


def test_following_a_pending_future_that_does_not_wait_on_the_child_still_works() -> None:
    parent: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    other: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    sibling = parent.then(lambda v: v + 1)
    shared = cudafut.gather(parent, other)  # waits on parent too, not on the child
    child = parent.then(lambda v: shared)
    via_sibling = parent.then(lambda v: sibling)
    host_set(parent, 1)
    assert not child.done() and via_sibling.result(timeout=0) == 2
    host_set(other, 5)
    assert child.result(timeout=0) == [1, 5]


# -- chains and values past the recursion limit ---------------------------------------------


def chain(root: cudafut.CudaFuture[int], links: int) -> cudafut.CudaFuture[int]:
    leaf = root
    for _ in range(links):
        leaf = leaf.then(lambda v: v + 1)
    return leaf


def test_a_long_then_chain_completes() -> None:
    root: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    leaf = chain(root, DEEP)
    host_set(root, 0)
    assert leaf.result(timeout=0) == DEEP


def test_a_long_chain_fails_and_cancels_through() -> None:
    failing: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    leaf = chain(failing, DEEP)
    exc = LookupError("root")
    failing.set_exception(exc)
    assert leaf.exception(timeout=0) is exc
    cancelling: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    leaf = chain(cancelling, DEEP)
    cancelling.cancel()
    assert leaf.cancelled()


def test_long_chains_of_followers_and_gathers_complete() -> None:
    root: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    leaf = root
    for _ in range(DEEP):
        leaf = leaf.then(lambda v: set_future(v + 1, []))  # each child follows a future
    host_set(root, 0)
    assert leaf.result(timeout=0) == DEEP
    root = cudafut.CudaFuture()
    gathered: cudafut.CudaFuture[Any] = root
    for _ in range(DEEP):
        gathered = cudafut.gather(gathered)
    host_set(root, 0)
    value = gathered.result(timeout=0)
    depth = 0
    while isinstance(value, list):
        (value,) = value
        depth += 1
    assert (depth, value) == (DEEP, 0)


def test_a_chain_completes_depth_first_as_nested_calls_would() -> None:
    root: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    order: list[str] = []

    def step(name: str) -> Callable[[int], int]:
        def fn(v: int) -> int:
            order.append(name)
            return v

        return fn

    a = root.then(step("a"))
    a.then(step("a1")).then(step("a11"))
    a.then(step("a2"))
    root.then(step("b"))
    host_set(root, 0)
    assert order == ["a", "a1", "a11", "a2", "b"]


def test_a_then_callback_setting_another_future_runs_its_callbacks_before_set_returns() -> None:
    # Inside a callback, set_result() still runs what waits before it returns.
    root: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    other: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    other_child = other.then(lambda v: v * 2)
    seen: list[int] = []

    def fn(v: int) -> int:
        host_set(other, v)
        seen.append(other_child.result(timeout=5))
        return v

    root.then(fn)
    host_set(root, 21)
    assert seen == [42]


class _GpuArray:
    """Looks like a GPU array: a CUDA array interface dict and a device."""

    def __init__(self, index: int) -> None:
        self.device = type("Device", (), {"index": index})()
        self.__cuda_array_interface__ = {"data": (0x1000, False), "shape": (1,), "version": 3}


@dataclasses.dataclass
class _Box:
    inner: object


def nested(leaf: object, depth: int) -> object:
    value = leaf
    for i in range(depth):
        value = (
            [value] if i % 4 == 0 else (value,) if i % 4 == 1 else {"k": value} if i % 4 == 2 else _Box(value)
        )
    return value


def test_values_nested_thousands_deep_are_walked() -> None:
    array = _GpuArray(1)
    deep = [nested(array, DEEP), _GpuArray(0)]
    assert sys.getrecursionlimit() < DEEP
    assert find_devices(deep) == (1, 0)
    assert gpu_arrays(deep)[0] is array and len(gpu_arrays(deep)) == 2
    assert placements(deep, None) == {1: 1, 0: 1}
    assert find_devices(nested(1, DEEP)) == ()


def test_a_deep_value_holding_itself_is_walked_once() -> None:
    array = _GpuArray(0)
    top: list[object] = []
    inner = nested([array, top], DEEP)
    top.append(inner)
    assert gpu_arrays(top) == [array]


def test_a_future_of_a_deep_value_has_a_repr() -> None:
    value: object = 1
    for _ in range(DEEP):
        value = [value]  # repr() of it recurses past the limit
    assert "value=<list nested too deep to show>" in repr(set_future(value, []))
