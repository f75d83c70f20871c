"""Coroutine functions are refused where nothing would await their coroutine
(issue 48): ``then()``, ``submit()``, ``launch()`` and ``warm_launchers()``
raise ``TypeError`` at the call, before anything is enqueued, instead of
resolving to a coroutine that Python later warns was never awaited. One
check (``cudafut._checks.not_async``) serves all four; this runs each kind of
async callable through each call on the fake GPU."""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _checks, _launch, testing


async def double(x: Any) -> Any:
    return x * 2


class AsyncModel:
    """An object whose ``__call__`` is a coroutine function."""

    async def __call__(self, x: Any) -> Any:
        return x

    async def method(self, x: Any) -> Any:
        return x


class Model:
    """A plain callable object."""

    def __call__(self, x: Any) -> Any:
        return x

    def plain(self, x: Any) -> Any:
        return x


#: Every shape of async callable the check must see through.
ASYNC_CALLABLES: dict[str, Callable[[], Callable[..., Any]]] = {
    "async def": lambda: double,
    "functools.partial of one": lambda: functools.partial(double),
    "a partial of a partial": lambda: functools.partial(functools.partial(double)),
    "an object with an async __call__": AsyncModel,
    "a partial of that object": lambda: functools.partial(AsyncModel()),
    "a bound async method": lambda: AsyncModel().method,
}


def _marked() -> Callable[..., Any]:
    """A plain function marked as a coroutine function (Python 3.12's
    ``inspect.markcoroutinefunction``, for one that returns an awaitable)."""

    def fn(x: Any) -> Any:
        return double(x)

    return inspect.markcoroutinefunction(fn)  # type: ignore[attr-defined,no-any-return,unused-ignore]


if hasattr(inspect, "markcoroutinefunction"):
    ASYNC_CALLABLES["a function marked a coroutine function"] = _marked


class Wrapper(AsyncModel):
    """A class whose instances are async callables: calling the class itself
    makes an instance, not a coroutine."""

    def __init__(self, x: Any) -> None:
        self.x = x


#: Plain callables that must still be taken, with what each makes of -3.
PLAIN_CALLABLES: dict[str, tuple[Callable[..., Any], Callable[[Any], bool]]] = {
    "def": (lambda x: x, lambda out: out == -3),
    "a bound method": (Model().plain, lambda out: out == -3),
    "a partial": (functools.partial(np.multiply, 1), lambda out: out == -3),
    "a plain callable object": (Model(), lambda out: out == -3),
    "a builtin": (abs, lambda out: out == 3),
    "a class with async instances": (Wrapper, lambda out: isinstance(out, Wrapper) and out.x == -3),
}


@pytest.mark.parametrize("kind", sorted(ASYNC_CALLABLES))
def test_the_shared_check_sees_every_async_callable(kind: str) -> None:
    assert _checks.is_async_callable(ASYNC_CALLABLES[kind]())


@pytest.mark.parametrize("kind", sorted(PLAIN_CALLABLES))
def test_the_shared_check_takes_plain_callables(kind: str) -> None:
    assert not _checks.is_async_callable(PLAIN_CALLABLES[kind][0])


@pytest.mark.parametrize("kind", sorted(ASYNC_CALLABLES))
def test_then_refuses_an_async_callable_on_a_pending_future(fake_cuda: testing.FakeCuda, kind: str) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with pytest.raises(TypeError, match=r"then\(\) runs fn .*coroutine function \(async def\).*await fut"):
        fut.then(ASYNC_CALLABLES[kind]())
    # Nothing was chained: setting the future records its own event and no child's.
    fut.set_result(np.arange(3))
    assert fake_cuda.pending == 1
    fake_cuda.complete_all()
    assert fut.result(timeout=10).tolist() == [0, 1, 2]


@pytest.mark.parametrize("kind", sorted(ASYNC_CALLABLES))
def test_then_refuses_an_async_callable_on_a_set_future_without_calling_it(
    fake_cuda: testing.FakeCuda, kind: str
) -> None:
    fut = cudafut.CudaFuture[Any]()
    fut.set_result(np.arange(3))
    before = fake_cuda.pending
    with warnings.catch_warnings():
        # A coroutine made and dropped warns "never awaited" when collected;
        # as an error, that would surface here or in a later test.
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(TypeError, match=r"then\(\) runs fn .*coroutine function"):
            fut.then(ASYNC_CALLABLES[kind]())
    assert fake_cuda.pending == before  # no pool stream waited, no child event


@pytest.mark.parametrize("kind", sorted(ASYNC_CALLABLES))
def test_submit_refuses_an_async_callable_before_anything_is_enqueued(
    fake_cuda: testing.FakeCuda, kind: str
) -> None:
    with pytest.raises(TypeError, match=r"submit\(\) runs fn at once.*coroutine function.*plain function"):
        cudafut.submit(ASYNC_CALLABLES[kind](), np.arange(3))
    assert fake_cuda.pending == 0  # not even the caller's stream was waited on


@pytest.mark.parametrize("kind", sorted(ASYNC_CALLABLES))
def test_launch_and_warm_launchers_refuse_every_async_callable(
    fake_cuda: testing.FakeCuda, kind: str
) -> None:
    with pytest.raises(TypeError, match=r"launch\(\) runs fn on a launcher thread.*coroutine function"):
        cudafut.launch(ASYNC_CALLABLES[kind](), 1)
    with pytest.raises(TypeError, match=r"warm_launchers\(\) runs fn.*coroutine function"):
        cudafut.warm_launchers(ASYNC_CALLABLES[kind](), 1)
    assert fake_cuda.pending == 0
    assert not _launch._launchers  # no launcher thread started


@pytest.mark.parametrize("kind", sorted(PLAIN_CALLABLES))
def test_then_and_submit_still_take_plain_callables(fake_cuda: testing.FakeCuda, kind: str) -> None:
    fake_cuda.auto_complete = True
    fn, expected = PLAIN_CALLABLES[kind]
    assert expected(cudafut.submit(fn, -3).result(timeout=10))
    fut = cudafut.CudaFuture[Any]()
    fut.set_result(-3)
    assert expected(fut.then(fn).result(timeout=10))


# -- a plain function that returns a coroutine -------------------------------------
#
# `lambda v: double(v)` passes the check at the call (it is a plain
# function); the coroutine it returns fails the future instead of becoming
# its value, and is closed (no "never awaited" warning).

_RETURNED = r"fn returned a coroutine \(double\), which nothing would await.*await afn\(await fut\)"


@pytest.mark.parametrize("parent_set", [True, False], ids=["set parent", "pending parent"])
def test_then_fails_its_child_when_fn_returns_a_coroutine(
    fake_cuda: testing.FakeCuda, parent_set: bool
) -> None:
    fake_cuda.auto_complete = True
    fut = cudafut.CudaFuture[Any]()
    if parent_set:  # the native core's then() of a set future takes its own path
        fut.set_result(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        child = fut.then(lambda v: double(v))
        if not parent_set:
            fut.set_result(3)
        with pytest.raises(TypeError, match=_RETURNED):
            _ = child.result(timeout=10)
        gc.collect()  # a coroutine left unclosed would warn (as an error) here


def test_submit_fails_its_future_when_fn_returns_a_coroutine(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fut = cudafut.submit(lambda x: double(x), 3)
        with pytest.raises(TypeError, match=_RETURNED):
            _ = fut.result(timeout=10)
        gc.collect()
