"""launch()'s host logic on the fake CUDA (cudafut.testing): launcher
threads, their streams, cancellation and failures. GPU ordering is proved in
tests/test_gpu_serve.py."""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _cuda, _lifetimes, testing
from tests.launches import check_a_queued_launch_cancelled_never_runs


def test_a_stream_cuda_refuses_fails_the_launch_and_kills_no_thread(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.auto_complete = True
    real = _cuda.new_stream

    def refuse(device: int, priority: int) -> Any:
        raise cudafut.CudaError(2, "cudaErrorMemoryAllocation", "out of memory")

    monkeypatch.setattr(_cuda, "new_stream", refuse)
    with pytest.raises(cudafut.CudaError, match="cudaErrorMemoryAllocation"):
        cudafut.launch(np.arange, 3)
    monkeypatch.setattr(_cuda, "new_stream", real)
    assert cudafut.launch(np.arange, 3).result(timeout=10).tolist() == [0, 1, 2]


def test_fn_runs_on_a_launcher_thread_and_keeps_its_exception_type(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    names = cudafut.launch(lambda: threading.current_thread().name).result(timeout=10)
    assert names.startswith("cudafut-launcher-0-")

    class OddError(Exception):
        pass

    error = OddError("odd")

    def boom() -> None:
        raise error

    with pytest.raises(OddError) as info:
        cudafut.launch(boom).result(timeout=10)
    assert info.value is error


def test_a_launch_cancelled_before_it_starts_never_runs(
    fake_cuda: testing.FakeCuda,
) -> None:
    fake_cuda.auto_complete = True
    check_a_queued_launch_cancelled_never_runs(timeout=10)


def test_a_launch_cancelled_while_fn_runs_keeps_its_arguments_until_its_stream_passes(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[object] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: held.append(obj))
    inside = threading.Event()
    release = threading.Event()

    def slow(arg: object) -> int:
        inside.set()
        release.wait(10)
        return 1

    arg = object()
    fut = cudafut.launch(slow, arg)
    assert inside.wait(10)
    assert fut.cancel()
    release.set()
    for _ in range(200):
        if held:
            break
        threading.Event().wait(0.01)
    assert held and held[0] == ((arg,), {})


def test_a_coroutine_function_is_refused_before_anything_is_enqueued(fake_cuda: testing.FakeCuda) -> None:
    async def model(x: int) -> int:
        return x

    for fn in (model, functools.partial(model, 1)):
        with pytest.raises(TypeError, match=r"coroutine function \(async def\).*plain function"):
            cudafut.launch(fn, 1)
    assert fake_cuda.pending == 0  # not even the caller's event was recorded


def test_an_awaitable_returned_fails_the_future_and_the_coroutine_is_closed(
    fake_cuda: testing.FakeCuda,
) -> None:
    fake_cuda.auto_complete = True

    async def model() -> int:
        return 1

    made: list[Any] = []

    def returns_a_coroutine() -> Any:
        made.append(model())
        return made[-1]

    with pytest.raises(TypeError, match=r"returned an awaitable \(coroutine\).*plain function"):
        cudafut.launch(returns_a_coroutine).result(timeout=10)
    # Closed unrun: Python will not warn that it was never awaited.
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED
    assert cudafut.launch(np.arange, 2).result(timeout=10).tolist() == [0, 1]  # the launcher lives on
