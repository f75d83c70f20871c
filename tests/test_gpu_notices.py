"""Notices on a GPU (WaitPolicy.notify): for work of no learnt duration, an
asyncio or uvloop waiter has CUDA close a pipe when the work ends (a host
function that is libc's ``close()``, launched by address) and sleeps until
then, instead of polling every ``max_sleep_s``.

What is checked: the notice, not a timer, ends the wait (``_on_notice``
runs); one notice serves a wait, not one per poll (a notice fired before
the work ends would be asked for again and again: the ``notice_early``
mutation); every pipe is closed afterwards and no thread is left; the
function CUDA runs is libc's ``close`` itself, so no Python runs on CUDA's
threads. The bound when notices never come is proved on the CPU
(tests/test_policy.py); ``notice_drop`` is the mutation that stops them.

Notices are on by default (``WaitPolicy()``). Most tests use ``NOTICES``,
whose polls are 20 ms apart, so that a notice, not a poll, ends the wait;
two check that ``notify=False`` and ``"low_cpu"`` poll on timers instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import cudafut
from cudafut import _backend, _cuda, _loops, _notices, _policy
from tests import kernels
from tests.runners import run_on

pytestmark = pytest.mark.gpu

LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])
SPIN_MS = 50.0

#: Notices with polls 20 ms apart: the notice, not a timed poll, ends a wait
#: (the default polls every 1 ms beside them).
NOTICES = cudafut.WaitPolicy(notify=True, notice_sleep_s=20e-3)


#: Who delivers a notice: a native notice thread (cudafut._waker, where the
#: compiled core is built) or a CUDA host function.
KINDS = ["native", "host function"]


@pytest.fixture(autouse=True, params=KINDS)
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    native = request.param == "native"
    if native and not _native_built():
        pytest.skip("the native waker (cudafut._waker) is not built, or CUDAFUT_PURE=1")
    old = cudafut.set_wait_policy(NOTICES)
    previous = _cuda.set_native_notices(native)
    if not native:  # the notice streams are made on a helper thread: wait until they exist
        deadline = time.monotonic() + 30
        while _backend.current.notice_stream(0) is None and time.monotonic() < deadline:
            time.sleep(0.01)
    _policy.predictor.clear()  # a reused stream handle must not bring a learnt duration
    yield str(request.param)
    _cuda.set_native_notices(previous)
    cudafut.set_wait_policy(old)


def _native_built() -> bool:
    from cudafut import _compiled

    return not _compiled.PURE and importlib.util.find_spec("cudafut._waker") is not None


class _Seen:
    def __init__(self) -> None:
        self.armed = 0
        self.fired = 0


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> _Seen:
    """Counts the notices armed (``_cuda.close_after``) and received
    (``AsyncioDriver._on_notice``)."""
    counts = _Seen()
    close_after = _backend.current.close_after
    on_notice = _loops.AsyncioDriver._on_notice

    def counting_close_after(record: Any, fd: int, stream: int) -> None:
        counts.armed += 1
        close_after(record, fd, stream)

    def counting_on_notice(self: Any, key: Any, notice: Any) -> None:
        counts.fired += 1
        on_notice(self, key, notice)

    monkeypatch.setattr(_backend.current, "close_after", counting_close_after)
    monkeypatch.setattr(_loops.AsyncioDriver, "_on_notice", counting_on_notice)
    return counts


async def _slow_value(value: float) -> float:
    _policy.predictor.clear()  # a reused stream handle must not bring a learnt duration
    cp = _backend.current.cupy()
    out = cp.zeros(1, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        kernels.spin_fill(out, value, SPIN_MS)
        fut = cudafut.record(out)
    got = await fut
    return float(got[0])


@pytest.mark.parametrize("loop", LOOPS)
def test_a_notice_ends_the_wait_for_work_of_unknown_duration(seen: _Seen, loop: str) -> None:
    # Timed polls a second apart (the fixture restores the policy): only the
    # notice can end the 50 ms wait early, however loaded the host. With
    # the default 20 ms, a timed poll once saw the work done before a
    # notice thread delayed by a loaded host did.
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=1.0))
    assert run_on(loop, _slow_value, 7.0) == 7.0
    assert seen.fired >= 1, "no notice ended the wait: it was polled on timers"
    # One notice per wait: a notice that fired before the work ended would
    # be asked for again at every plan (hundreds in 50 ms).
    assert 1 <= seen.armed <= 3, seen.armed


def _descriptors() -> dict[str, str]:
    """This process's open descriptors and what each one is (a failure
    then names what was left open)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


@pytest.mark.parametrize("loop", LOOPS)
def test_notices_leave_no_pipe_and_no_thread(seen: _Seen, loop: str) -> None:
    run_on(loop, _slow_value, 1.0)  # the first loop of a kind may keep descriptors
    gc.collect()
    fds, threads = _descriptors(), threading.active_count()
    for i in range(5):
        assert run_on(loop, _slow_value, float(i)) == float(i)
    gc.collect()
    assert _descriptors() == fds
    assert threading.active_count() == threads
    assert seen.fired >= 5


@pytest.mark.parametrize(
    "policy", [cudafut.WaitPolicy(notify=False), "low_cpu"], ids=["notify=False", "low_cpu"]
)
def test_without_notify_the_wait_is_polled(seen: _Seen, policy: Any) -> None:
    cudafut.set_wait_policy(policy)
    assert run_on("asyncio", _slow_value, 3.0) == 3.0
    assert seen.armed == 0 and seen.fired == 0


def test_the_default_policy_asks_for_notices(seen: _Seen) -> None:
    cudafut.set_wait_policy("balanced")
    assert run_on("asyncio", _slow_value, 3.0) == 3.0
    assert seen.armed >= 1


_PREPARE_FIRST = """
import cudafut
from cudafut import _notices
# The process's first CUDA call: nothing has initialised the driver yet.
print("prepared", _notices.prepare_notices(0, 60.0))
print("pool", len(_notices._notice_pool.get(0, ())))
"""


def test_notice_streams_can_be_made_before_any_other_cuda_call() -> None:
    # A process group or a launcher thread may prepare the notice streams
    # before anything else in the process touched CUDA: the driver refuses
    # every call before cuInit, so the streams' maker initialises it.
    from tests.subproc import run_python

    proc = run_python(_PREPARE_FIRST, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "prepared True" in proc.stdout.splitlines(), out
    assert "pool 0" not in proc.stdout, out
    assert "cudafut:" not in proc.stderr, out  # no warning logged (the last-resort handler)


def test_the_host_function_is_libc_close_itself() -> None:
    # What CUDA calls on its own thread: libc's close, by address; nothing
    # that could take the GIL (docs/design.md, hazard 1).
    loaded = _notices._load_host_close()
    assert loaded, "libcuda's cuLaunchHostFunc could not be loaded"
    _launch, function = loaded
    assert function == ctypes.cast(ctypes.CDLL(None).close, ctypes.c_void_p).value


def test_native_notices_are_delivered_by_the_native_threads(seen: _Seen, kind: str) -> None:
    if kind != "native":
        pytest.skip("native notices only")
    from cudafut import _waker

    before = _waker.statistics()[4]
    for i in range(3):
        assert run_on("asyncio", _slow_value, float(i)) == float(i)
    threads, _idle, queued, cap, done = _waker.statistics()
    assert done - before >= 3, "the notices did not come from the native threads"
    assert 1 <= threads <= cap and queued == 0


def test_a_native_notice_comes_for_a_failed_context_too(kind: str) -> None:
    """cuEventSynchronize returns after a sticky error, where a host function
    never runs (hazard 2): the wait ends with the error, and the native
    thread's notice comes too. Which of the two ends the wait first, the
    notice or the fallback poll (every notice_sleep_s), is a race: the test
    asked for the notice first, and failed 3 runs in 6 on an H200. Runs in
    a subprocess: the error poisons the context. The notice streams are made
    before the faulting kernel starts: made while it runs, they may wait for
    it (hazard 11), and no notice would be asked for."""
    if kind != "native":
        pytest.skip("native notices only")
    from tests.subproc import run_python

    proc = run_python(
        """
import asyncio, time, cudafut
from cudafut import _backend, _cuda, _waker
from tests import kernels
cp = _backend.current.cupy()
cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=20e-3))
deadline = time.monotonic() + 30
while _backend.current.notice_stream(0) is None and time.monotonic() < deadline:
    time.sleep(0.01)
async def main():
    out = cp.zeros(1, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        kernels.spin_fault(50.0)
        fut = cudafut.record(out)
    try:
        await asyncio.wait_for(fut, 30)
    except cudafut.CudaError as exc:
        print("error", exc.name)
    # The fallback poll may find the error first: what matters is that the
    # native thread's wait returns too, where a host function never would.
    deadline = time.monotonic() + 10
    while _waker.statistics()[4] < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    print("native", _waker.statistics()[4] >= 1)
asyncio.run(main())
"""
    )
    out = proc.stdout + proc.stderr
    assert "native True" in out, out
    assert "error cudaErrorIllegalAddress" in out, out


# -- the end of a process, and fork, with notices in flight -------------------------------------

#: Arms a notice for 3 s of GPU work: the await's task asks for it, then
#: (EXIT) the process ends with the work still running and the notice in
#: flight (a native notice thread blocked in cuEventSynchronize, or CUDA's
#: host function queued), or (FORK) forks, and the child asks for CUDA.
_IN_FLIGHT = """
import asyncio, os, sys, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process: the point here
import cudafut
from cudafut import _backend, _cuda
from tests import kernels
cp = _backend.current.cupy()
native = sys.argv[1] == "native"
cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True, notice_sleep_s=20e-3))
_cuda.set_native_notices(native)
deadline = time.monotonic() + 30
while not native and _backend.current.notice_stream(0) is None and time.monotonic() < deadline:
    time.sleep(0.01)  # the host functions' notice streams are made on a helper thread
out = cp.zeros(1, dtype=cp.float32)
stream = cp.cuda.Stream(non_blocking=True)

async def wait(fut):
    return float((await fut)[0])

async def main():
    with stream:
        kernels.spin_fill(out, 2.0, 3000.0)
        fut = cudafut.record(out)
    task = asyncio.ensure_future(wait(fut))
    await asyncio.sleep(0.3)  # the wait has asked for its notice
    print("pending", not fut.done())
    if native:
        from cudafut import _waker
        threads, _idle, _queued, _cap, done = _waker.statistics()
        print("native notice in flight", threads >= 1 and done == 0)
    if sys.argv[2] == "fork":
        sys.stdout.flush()  # or the child prints the parent's buffered lines again
        pid = os.fork()
        if pid == 0:
            for what, call in (("result", lambda: fut.result()), ("record", lambda: cudafut.record(out))):
                try:
                    call()
                    print("child", what, "no error")
                except cudafut.CudaUnavailableError as exc:
                    print("child", what, "CudaUnavailableError", "fork" in str(exc))
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", await task)
    return fut

kept = asyncio.run(main())  # exit: the task is cancelled, the work and its notice go on
unawaited = cudafut.record(out)
print("exiting")
"""


def test_the_interpreter_exits_cleanly_with_a_notice_in_flight(kind: str) -> None:
    from tests.subproc import run_python

    proc = run_python(_IN_FLIGHT, "native" if kind == "native" else "host", "exit", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.splitlines()
    assert lines[0] == "pending True" and lines[-1] == "exiting", out
    if kind == "native":
        assert "native notice in flight True" in lines, out
    assert "Traceback" not in proc.stderr and "Fatal" not in proc.stderr, out


def test_a_child_forked_with_a_notice_in_flight_is_told_why(kind: str) -> None:
    from tests.subproc import run_python

    proc = run_python(_IN_FLIGHT, "native" if kind == "native" else "host", "fork", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.splitlines()
    assert "child result CudaUnavailableError True" in lines, out
    assert "child record CudaUnavailableError True" in lines, out
    assert "parent 2.0" in lines and lines[-1] == "exiting", out  # the parent's notice still came
