"""The waiter's regret bound on a GPU: work whose duration changes.

One stream runs one 50 ms job, then forty of 2 ms, each launched when the
previous one was noticed. A waiter that trusted what it learnt from the long
job slept until its predicted end (34 ms late per 2 ms job, once); the bound
says no completion is noticed later than ``max_sleep_s`` plus the operating
system's wake-up delay. These tests assert that bound, with a generous
allowance for the wake-up delay of a virtual machine (``_OS_WAKE_S``), far
below what the unbounded waiter cost: under the default policy (CUDA
notices beside timed polls) and with timed polls only (``notify=False``).

Each job is followed by the same job waited for by ``stream.synchronize()``,
and the bound is over what that blocked wait saw: when other processes
share the GPU, their kernels delay ours, and that delay is not the waiter's.
A sequence that misses the bound runs once more, on a fresh stream (no
durations learnt on it), and the test fails only if both miss, warning of
the first miss otherwise: other processes' threads on the host's CPUs
delay a sleeping thread's wake-up now and then (the blocked wait does not
sleep in the same way), while a waiter that oversleeps after each step
down would miss both runs.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import cudafut
from cudafut import _backend
from tests import kernels

pytestmark = pytest.mark.gpu

_OS_WAKE_S = 2e-3
_STEP_MS = [50.0] + [2.0] * 40


@pytest.fixture(
    autouse=True,
    params=["balanced", cudafut.WaitPolicy(notify=False)],
    ids=["balanced", "balanced-polls"],
)
def _balanced(request: pytest.FixtureRequest) -> Iterator[None]:
    old = cudafut.set_wait_policy(request.param)
    yield
    cudafut.set_wait_policy(old)


def _median_p90(extras: list[float]) -> tuple[float, float]:
    tail = sorted(extras[1:])  # the 2 ms jobs after the long one
    return tail[len(tail) // 2], tail[(len(tail) * 9) // 10]


def _miss(extras: list[float], blocked: list[float]) -> str | None:
    """What a sequence's lateness misses of the bound, or None."""
    bound = cudafut.get_wait_policy().max_sleep_s + _OS_WAKE_S
    for at, late, ref in zip(("the median", "p90"), _median_p90(extras), _median_p90(blocked), strict=True):
        if late > bound + ref:
            return (
                f"2 ms jobs noticed {late * 1e3:.2f} ms late at {at} (bound {bound * 1e3} ms"
                f" over a blocked wait's {ref * 1e3:.2f} ms)"
            )
    return None


def _blocked(stream: Any, out: Any, ms: float) -> float:
    """How late ``stream.synchronize()`` sees the same job end."""
    t = time.perf_counter()
    with stream:
        kernels.spin_fill(out, 1.0, ms)
    stream.synchronize()
    return time.perf_counter() - t - ms / 1e3


def _launch(stream: Any, out: Any, ms: float) -> cudafut.CudaFuture[Any]:
    with stream:
        kernels.spin_fill(out, 1.0, ms)
    return cudafut.record(out, stream=stream)


def _attempts() -> Iterator[tuple[Any, Any, list[float], list[float]]]:
    """Up to two runs of the sequence, each on a fresh stream (no durations
    learnt on it; what the waiter learnt of its own wake-ups stays): yields
    the stream, the kernel's output and the lists the run fills (lateness
    through the waiter, then through a blocked wait); ends once a run is
    within the bound, warning of a first miss; fails the test if both miss."""
    cp = _backend.current.cupy()
    out = cp.zeros(1, dtype=cp.float32)
    kernels.spin_fill(out, 0.0, 0.0)  # compile and load before timing
    cp.cuda.Device().synchronize()
    misses: list[str] = []
    for _ in range(2):
        extras: list[float] = []
        blocked: list[float] = []
        stream = cp.cuda.Stream(non_blocking=True)
        yield stream, out, extras, blocked
        miss = _miss(extras, blocked)
        if miss is None:
            if misses:
                warnings.warn(f"the first run missed the bound: {misses[0]}", stacklevel=1)
            return
        misses.append(miss)
    pytest.fail("; then ".join(misses))


@pytest.mark.anyio
@pytest.mark.no_asyncio_debug(reason="asserts a latency bound: debug mode adds work to every loop callback")
async def test_await_after_a_step_down_is_noticed_within_the_bound(anyio_backend: Any) -> None:
    for stream, out, extras, blocked in _attempts():
        for ms in _STEP_MS:
            t = time.perf_counter()
            await _launch(stream, out, ms)
            extras.append(time.perf_counter() - t - ms / 1e3)
            blocked.append(_blocked(stream, out, ms))


def test_result_after_a_step_down_is_noticed_within_the_bound() -> None:
    for stream, out, extras, blocked in _attempts():
        for ms in _STEP_MS:
            t = time.perf_counter()
            _launch(stream, out, ms).result()
            extras.append(time.perf_counter() - t - ms / 1e3)
            blocked.append(_blocked(stream, out, ms))
