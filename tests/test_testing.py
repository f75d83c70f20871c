"""cudafut.testing: the public API on a fake GPU, as a service author's CI
runs it (no CUDA, no CuPy needed), on every async backend."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import threading
import time
import warnings
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _backend, _pools, testing
from cudafut._interface import records_of
from tests.subproc import ROOT, run_python

pytestmark = [pytest.mark.anyio, pytest.mark.anywhere]


# -- plain calls ---------------------------------------------------------------------


def test_host_values_live_on_the_fake_device(fake_cuda: testing.FakeCuda) -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    fut.set_result(42)  # refused without the fake: a value on no GPU
    assert fut.devices == (0,)
    assert not fut.done()
    fake_cuda.complete(fut)
    assert fut.done()
    assert fut.result(timeout=0) == 42
    rec = cudafut.record(np.arange(3))
    fake_cuda.complete(rec)
    np.testing.assert_array_equal(rec.result(), [0, 1, 2])


def test_devices_are_checked_against_the_fake() -> None:
    with testing.fake_cuda(devices=2, auto_complete=True):
        fut: cudafut.CudaFuture[str] = cudafut.CudaFuture(devices=1)
        fut.set_result("v")
        assert fut.devices == (1,)
        with pytest.raises(ValueError, match="out of range"):
            cudafut.CudaFuture(devices=2)


def test_result_times_out_until_completed(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.ones(2))
    with pytest.raises(cudafut.TimeoutError):
        fut.result(timeout=0.01)
    assert fake_cuda.pending == 1
    fake_cuda.complete_all()
    assert fake_cuda.pending == 0
    np.testing.assert_array_equal(fut.result(timeout=0), [1, 1])


def test_result_wakes_when_another_thread_completes(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.ones(1))
    timer = threading.Timer(0.005, fake_cuda.complete, (fut,))
    timer.start()
    assert fut.result(timeout=30)[0] == 1
    timer.join()


def test_auto_complete(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    fut = cudafut.record(7).then(lambda v: v + 1)
    assert fut.done()
    assert fut.result(timeout=0) == 8
    assert fake_cuda.pending == 0


def test_then_child_completes_its_parent_not_the_reverse(fake_cuda: testing.FakeCuda) -> None:
    parent = cudafut.record(np.arange(4))
    child = parent.then(lambda v: v * 2)
    other = parent.then(lambda v: v + 1)  # a second child: another pool stream
    fake_cuda.complete(parent)
    assert parent.done()
    assert not child.done()  # its own work is still "running"
    fake_cuda.complete(child)
    np.testing.assert_array_equal(child.result(timeout=0), [0, 2, 4, 6])
    assert not other.done()
    grandchild = other.then(lambda v: v.sum())
    fake_cuda.complete(grandchild)  # completes what it follows: other, then parent
    assert other.done()
    assert grandchild.result(timeout=0) == 10


def test_wait_orders_the_current_stream(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.ones(3))
    value = fut.wait()  # returns once set; the fake's current stream waits
    np.testing.assert_array_equal(value, [1, 1, 1])
    after = cudafut.record(value + 1)  # on the current stream, after the wait
    fake_cuda.complete(after)
    assert fut.done()  # a GPU would have finished what the stream waited for


def test_fail_gives_a_cuda_error(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.ones(1))
    child = fut.then(lambda v: v)
    fake_cuda.fail(fut, 719)
    with pytest.raises(cudafut.CudaError) as info:
        fut.result(timeout=1)
    assert info.value.code == 719
    assert info.value.name == "cudaErrorLaunchFailure"
    fake_cuda.complete(child)
    with pytest.raises(cudafut.CudaError):
        child.result(timeout=1)


@pytest.mark.parametrize(("code", "error"), [(0, ValueError), (600, ValueError), ("700", TypeError)])
def test_fail_refuses_codes_that_are_no_error(fake_cuda: testing.FakeCuda, code: Any, error: type) -> None:
    fut = cudafut.record(1)
    with pytest.raises(error):
        fake_cuda.fail(fut, code)
    with pytest.raises(TypeError, match="CudaFuture"):
        fake_cuda.complete(fut, "not a future")  # type: ignore[arg-type]
    assert not fut.done()  # nothing done when an argument is wrong


def test_a_pending_future_completes_once_set(fake_cuda: testing.FakeCuda) -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    fake_cuda.complete(fut)
    fut.set_result(5)
    assert fut.done()


def test_submit_and_done_callbacks(fake_cuda: testing.FakeCuda) -> None:
    called = threading.Event()
    fut = cudafut.submit(np.add, np.ones(2), 1)
    fut.add_done_callback(lambda _f: called.set())  # on the watcher thread
    fake_cuda.complete(fut)
    assert called.wait(30)
    np.testing.assert_array_equal(fut.result(), [2, 2])


def test_copies_take_and_give_numpy(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    on_device = cudafut.to_device(host.T)  # any layout in, C order out
    device_array = on_device.result()
    assert isinstance(device_array, np.ndarray)
    assert device_array.flags.c_contiguous
    out = np.empty((3, 2), np.float32)
    back = cudafut.to_host(on_device, out=out).result()
    assert back is out
    np.testing.assert_array_equal(back, host.T)
    np.testing.assert_array_equal(cudafut.to_host(device_array).result(), host.T)
    with pytest.raises(ValueError, match="shape"):
        cudafut.to_host(device_array, out=np.empty(2))
    with pytest.raises(TypeError, match="NumPy array"):
        cudafut.to_host([1, 2])


def test_streams_of_the_fake(fake_cuda: testing.FakeCuda) -> None:
    stream = fake_cuda.stream()
    fut = cudafut.record(np.zeros(1), stream=stream)
    with stream:
        on_it = cudafut.record(np.ones(1))  # the current stream now
    fake_cuda.complete(on_it)
    assert fut.done()  # earlier on the same stream


def test_launch_runs_on_a_launcher_thread(fake_cuda: testing.FakeCuda) -> None:
    threads = []

    def fn(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        threads.append(threading.current_thread().name)
        return x * 3

    fut = cudafut.launch(fn, np.ones(2))
    fake_cuda.complete(fut)  # now, or as soon as the launcher sets it
    np.testing.assert_array_equal(fut.result(timeout=30), [3, 3])
    assert threads[0].startswith("cudafut-launcher-0")

    def boom() -> None:
        raise KeyError("from fn")

    with pytest.raises(KeyError, match="from fn"):
        cudafut.launch(boom).result(timeout=30)


def test_calls_that_need_cupy_say_so(fake_cuda: testing.FakeCuda) -> None:
    with pytest.raises(cudafut.CudaUnavailableError, match=r"cudafut\.testing"):
        cudafut.empty_pinned((4,), np.float32)


def test_what_the_fake_does_with_task_streams_tracked_and_record_stream(fake_cuda: testing.FakeCuda) -> None:
    # As docs/testing.md and cudafut.testing's docstring say.
    fake_cuda.auto_complete = True

    async def task() -> tuple[Any, Any]:
        stream = cudafut.task_stream()
        assert cudafut.task_stream() is stream  # the task's own, for its life
        return stream, await cudafut.record(np.ones(2), stream=stream)

    stream, value = asyncio.run(task())
    assert isinstance(stream, testing.FakeStream) and value.tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match=r"GPU array.*fake GPU.*Tracked is not faked.*on a GPU"):
        cudafut.Tracked(np.ones(2))
    with pytest.raises(TypeError, match=r"GPU array.*fake GPU.*record_stream\(\) is not faked.*on a GPU"):
        cudafut.record_stream(np.ones(2), fake_cuda.stream())
    with pytest.raises(cudafut.CudaUnavailableError, match=r"@own_stream") as info:
        cudafut.empty_pinned((2,), np.float32)
    assert "Tracked" not in str(info.value)  # a TypeError, said above


def test_own_stream_says_it_is_not_faked_and_leaves_no_coroutine_unawaited(
    fake_cuda: testing.FakeCuda,
) -> None:
    async def inner() -> int:
        return 1

    decorated = cudafut.own_stream(inner)
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            asyncio.run(decorated())
        except cudafut.CudaUnavailableError as exc:
            error = str(exc)
        gc.collect()  # what is left of the run: a coroutine never closed would warn now
    assert "cudafut.testing" in error
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_cupy_in_a_callback_says_the_fake_hands_it_numpy(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True

    def like_cupy(v: np.ndarray[Any, Any]) -> Any:  # CuPy's own words
        raise TypeError(
            "Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, got numpy.ndarray)"
        )

    for fut in (
        cudafut.record(np.ones(2)).then(like_cupy),
        cudafut.submit(like_cupy, np.ones(2)),
        cudafut.launch(like_cupy, np.ones(2)),
    ):
        with pytest.raises(
            TypeError, match=r"fake GPU, values are NumPy arrays.*CuPy's functions cannot"
        ) as info:
            fut.result(timeout=10)
        assert "expected cupy._core.core._ndarray_base" in str(info.value.__cause__)

    def other(v: np.ndarray[Any, Any]) -> Any:
        raise TypeError("not about CuPy")

    with pytest.raises(TypeError, match=r"^not about CuPy$"):  # other TypeErrors pass as they are
        cudafut.record(np.ones(2)).then(other).result(timeout=10)


class CUDARuntimeError(RuntimeError):
    """As CuPy's ``cupy_backends.cuda.api.runtime.CUDARuntimeError``: what
    most of CuPy's functions raise on a machine without a driver, before they
    look at their arguments."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


CUDARuntimeError.__module__ = "cupy_backends.cuda.api.runtime"


@pytest.mark.parametrize(
    ("status", "translated"),
    [(35, True), (100, True), (3, True), (700, False), (2, False)],
)
def test_cupy_without_a_driver_in_a_callback_is_the_same_type_error(
    fake_cuda: testing.FakeCuda, status: int, translated: bool
) -> None:
    fake_cuda.auto_complete = True
    error = CUDARuntimeError(status)

    def no_driver(v: np.ndarray[Any, Any]) -> Any:
        raise error

    for fut in (
        cudafut.record(np.ones(2)).then(no_driver),
        cudafut.submit(no_driver, np.ones(2)),
        cudafut.launch(no_driver, np.ones(2)),
    ):
        if translated:  # no usable CUDA: the TypeError a machine with a GPU gives, and why
            with pytest.raises(TypeError, match=r"CUDA cannot be used on this machine.*NumPy arrays"):
                fut.result(timeout=10)
        else:  # any other CuPy error is the callback's own, as it is
            with pytest.raises(CUDARuntimeError) as info:
                fut.result(timeout=10)
            assert info.value is error
            continue
        assert isinstance(fut.exception(), TypeError)
        assert fut.exception().__cause__ is error  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["sqrt", "tanh", "stack"])
def test_real_cupy_on_a_numpy_array_in_a_callback_fails_with_the_documented_type_error(
    fake_cuda: testing.FakeCuda, name: str
) -> None:
    # What docs/testing.md promises, on any machine: with a GPU CuPy refuses
    # the NumPy array itself; without a driver it fails before looking.
    cp = pytest.importorskip("cupy")
    fake_cuda.auto_complete = True
    fn = getattr(cp, name)

    def call(v: np.ndarray[Any, Any]) -> Any:
        return fn([v, v]) if name == "stack" else fn(v)

    for fut in (
        cudafut.record(np.ones(2)).then(call),
        cudafut.submit(call, np.ones(2)),
        cudafut.launch(call, np.ones(2)),
    ):
        with pytest.raises(TypeError, match=r"values are NumPy arrays.*array module"):
            fut.result(timeout=10)


def test_the_fake_is_removed_on_exit() -> None:
    real = (_backend.current.current_device, _pools.events, _pools.streams)
    with testing.fake_cuda() as fake:
        assert _backend.current.current_device is not real[0]
        with pytest.raises(RuntimeError, match="installed already"), testing.fake_cuda():
            pass
        left = cudafut.record(np.ones(1))
        launched = cudafut.launch(np.zeros, 2)
        fake.complete(launched)
        launched.result(timeout=30)
        fake_launchers = [t for t in threading.enumerate() if t.name.startswith("cudafut-launcher")]
        assert fake_launchers
    assert (_backend.current.current_device, _pools.events, _pools.streams) == real
    assert left.done()  # what was queued completes as the fake leaves
    assert not any(t.is_alive() for t in fake_launchers)  # the fake's launchers ended


def test_a_wait_on_work_left_pending_hints_at_auto_complete(caplog: pytest.LogCaptureFixture) -> None:
    # A log, never a failure: the test waits until it shows, however slow the machine.
    def hints() -> list[str]:
        return [r.getMessage() for r in caplog.records if "auto_complete = True" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="cudafut"), testing.fake_cuda(hint_after_s=0) as fake:
        fut = cudafut.record(np.ones(2))
        for _ in range(10_000):
            with pytest.raises(cudafut.TimeoutError):
                fut.result(timeout=0.001)
            if hints():
                break
        assert "fake.complete_all()" in hints()[0]

        async def waits() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cudafut.record(np.ones(2)), 0.01)

        asyncio.run(waits())
        assert len(hints()) == 1  # once per fake
    with caplog.at_level(logging.WARNING, logger="cudafut"), testing.fake_cuda(hint_after_s=0) as fake:

        async def await_until_hinted() -> None:
            fut = cudafut.record(np.ones(2))
            while len(hints()) < 2:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(fut.to_asyncio()), 0.001)

        asyncio.run(await_until_hinted())
        fake.hint_after_s = None
        assert fake.hint_after_s is None
    with testing.fake_cuda() as fake:
        assert fake.hint_after_s == 5.0  # the fixture's too
    with pytest.raises(ValueError, match="hint_after_s"), testing.fake_cuda(hint_after_s=-1):
        pass


def test_a_synchronize_on_work_left_pending_blocks_hints_and_returns_once_completed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fake's event_synchronize (a Batcher's completion thread's wait)
    blocks until the test completes the event, and logs the hint meanwhile."""
    with caplog.at_level(logging.WARNING, logger="cudafut"), testing.fake_cuda(hint_after_s=0) as fake:
        fut = cudafut.record(np.ones(2))
        (rec,) = records_of(fut)
        returned = threading.Event()

        def synchronize() -> None:
            rec.calls.event_synchronize(rec.handle)
            returned.set()

        thread = threading.Thread(target=synchronize)
        thread.start()
        for _ in range(10_000):  # a log, never a failure: wait until it shows
            if any("auto_complete = True" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.001)
        assert not returned.is_set()
        fake.complete(fut)
        thread.join(30)
        assert returned.is_set() and rec.query() == 0
        assert any("auto_complete = True" in r.getMessage() for r in caplog.records)


def test_a_future_of_an_ended_fake_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with testing.fake_cuda(auto_complete=True):
        left = cudafut.record(np.ones(2))

    # As on a machine without a GPU, whether or not this one has one.
    def no_cuda(*args: object) -> Any:
        raise cudafut.CudaUnavailableError("the NVIDIA driver is missing")

    monkeypatch.setattr(_pools.streams, "get", no_cuda)
    monkeypatch.setattr(_backend.current, "current_stream", no_cuda)
    with pytest.raises(cudafut.InvalidStateError, match=r"fake GPU, which has ended .*fake_cuda\(\)") as info:
        left.then(lambda v: v).result(timeout=10)
    assert isinstance(info.value.__cause__, cudafut.CudaUnavailableError)
    with pytest.raises(cudafut.InvalidStateError, match=r"fake GPU, which has ended"):
        left.wait(timeout=10)
    assert left.result(timeout=10).tolist() == [1.0, 1.0]  # its value is still there


def test_a_fake_that_ended_refuses_its_calls() -> None:
    with testing.fake_cuda() as fake:
        fut = cudafut.record(np.ones(2))
    for call in (fake.complete_all, lambda: fake.complete(fut), lambda: fake.fail(fut), fake.stream):
        with pytest.raises(
            RuntimeError, match=r"this fake GPU has ended \(its `with cudafut\.testing\.fake_cuda"
        ):
            call()


@pytest.mark.parametrize("devices", [0, 65, True, 1.0])
def test_fake_cuda_checks_its_arguments(devices: Any) -> None:
    with pytest.raises((TypeError, ValueError)), testing.fake_cuda(devices=devices):
        pass


def test_cudafut_testing_without_its_import_says_to_import_it() -> None:
    # A subprocess: in pytest, cudafut's plugin has imported cudafut.testing.
    proc = run_python(
        """
        import cudafut
        for name in ("testing", "distributed", "no_such_name"):
            try:
                getattr(cudafut, name)
            except AttributeError as exc:
                print(exc)
        import cudafut.testing
        print(cudafut.testing.fake_cuda.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "add `import cudafut.testing` beside `import cudafut`" in lines[0]
    assert "add `import cudafut.distributed` beside `import cudafut`" in lines[1]
    assert lines[2:] == ["module 'cudafut' has no attribute 'no_such_name'", "fake_cuda"]


def test_the_documented_pytest_configuration_silences_pytest_asyncios_warning(
    pytester: pytest.Pytester,
) -> None:
    # docs/testing.md's pyproject.toml snippet, in a user's project that
    # installed cudafut[test] (pytest-asyncio with it): no deprecation warning
    # about the unset loop scope, where the same project without it has one.
    pytest.importorskip("pytest_asyncio")
    docs = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    [snippet] = re.findall(r"^```toml\n(.*?)^```", docs, re.S | re.M)
    assert "asyncio_default_fixture_loop_scope" in snippet
    pytester.makepyfile(
        """
        import numpy as np
        import pytest

        import cudafut
        import cudafut.testing


        @pytest.mark.asyncio
        async def test_handler(fake_cuda: cudafut.testing.FakeCuda) -> None:
            fake_cuda.auto_complete = True
            assert (await cudafut.record(np.arange(3))).tolist() == [0, 1, 2]
        """
    )
    warning = "*PytestDeprecationWarning*asyncio_default_fixture_loop_scope*is unset*"
    unset = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # a warning at configure time
    unset.assert_outcomes(passed=1)
    unset.stderr.fnmatch_lines([warning])
    pytester.makepyprojecttoml(snippet)
    configured = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error")
    configured.assert_outcomes(passed=1)
    configured.stderr.no_fnmatch_line(warning)
    configured.stdout.no_fnmatch_line(warning)


def test_import_needs_no_cupy() -> None:
    done = run_python(
        """
        import sys
        sys.modules["cupy"] = None  # any import of CuPy fails
        import numpy as np
        import cudafut, cudafut.testing
        with cudafut.testing.fake_cuda(auto_complete=True):
            print(cudafut.record(np.arange(3)).then(lambda v: v.sum()).result())
        print(sys.modules["cupy"] is None)
        """
    )
    assert done.stdout.split() == ["3", "True"], done.stderr


def test_the_plugin_is_registered_for_pytest() -> None:
    tomllib = pytest.importorskip("tomllib")
    with (ROOT / "pyproject.toml").open("rb") as f:
        entry_points = tomllib.load(f)["project"]["entry-points"]["pytest11"]
    assert entry_points == {"cudafut": "cudafut._pytest_plugin"}


def test_the_pytest_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import numpy as np
        import cudafut

        def test_uses_the_fixture(fake_cuda):
            fut = cudafut.record(np.ones(2))
            fake_cuda.complete(fut)
            assert fut.result(timeout=0).sum() == 2
        """
    )
    # The module by name, whether or not the entry point is installed here.
    result = pytester.runpytest_subprocess("-p", "no:cudafut", "-p", "cudafut._pytest_plugin")
    result.assert_outcomes(passed=1)


# -- awaits on asyncio, uvloop and trio -------------------------------------------------


async def test_await_wakes_when_completed(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.arange(3))
    async with anyio.create_task_group() as tg:

        async def complete_later() -> None:
            await anyio.sleep(0.005)
            fake_cuda.complete(fut)

        tg.start_soon(complete_later)
        np.testing.assert_array_equal(await fut, [0, 1, 2])


async def test_await_raises_the_failure(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.arange(3))
    fake_cuda.fail(fut, 700)
    with pytest.raises(cudafut.CudaError, match="cudaErrorIllegalAddress"):
        await fut


async def test_fail_completes_the_work_it_follows_first(fake_cuda: testing.FakeCuda) -> None:
    # As on a GPU, where a stream runs in order: a waiter that learns a
    # stream's completions oldest first must see the failure, and the older
    # work done, not wait on the older record forever.
    stream = fake_cuda.stream()
    older = cudafut.record(np.zeros(2), stream=stream)
    failing = cudafut.record(np.ones(2), stream=stream)
    async with anyio.create_task_group() as tg:

        async def fail_later() -> None:
            await anyio.sleep(0.01)
            fake_cuda.fail(failing, 719)

        tg.start_soon(fail_later)
        with anyio.fail_after(30), pytest.raises(cudafut.CudaError, match="cudaErrorLaunchFailure"):
            await failing
    assert older.done()
    np.testing.assert_array_equal(older.result(timeout=0), [0, 0])


def test_fail_of_several_records_fails_the_work_between_them(fake_cuda: testing.FakeCuda) -> None:
    # Work after a failed record on its stream fails too (CUDA's errors are
    # sticky), even where a later failing record also follows it.
    stream = fake_cuda.stream()
    first = cudafut.record(np.zeros(1), stream=stream)
    between = cudafut.record(np.ones(1), stream=stream)
    last = cudafut.record(np.ones(1), stream=stream)
    fake_cuda.fail(cudafut.gather(first, last), 700)
    for fut in (first, between, last):
        with pytest.raises(cudafut.CudaError, match="cudaErrorIllegalAddress"):
            fut.result(timeout=0)


def test_done_at_a_known_failure_behind_pending_work(fake_cuda: testing.FakeCuda) -> None:
    # A failure known of any record makes the future done, as it makes its
    # await and its callbacks end, even while an earlier record is pending.
    pending = cudafut.record(np.zeros(1), stream=fake_cuda.stream())
    failing = cudafut.record(np.ones(1), stream=fake_cuda.stream())
    both = cudafut.gather(pending, failing)
    fake_cuda.fail(failing, 700)
    assert failing.done()  # the failure is known from here on
    assert both.done()
    assert not pending.done()
    with pytest.raises(cudafut.CudaError, match="cudaErrorIllegalAddress"):
        both.result(timeout=0)


async def test_gather_and_as_completed(fake_cuda: testing.FakeCuda) -> None:
    # One stream each: on one stream, completing the last completes all.
    futs = [cudafut.record(np.full(1, i), stream=fake_cuda.stream()) for i in range(3)]
    gathered = cudafut.gather(*futs)
    seen = []
    async with anyio.create_task_group() as tg:

        async def complete_in_reverse() -> None:
            for fut in reversed(futs):
                await anyio.sleep(0.002)
                fake_cuda.complete(fut)

        tg.start_soon(complete_in_reverse)
        async for done in cudafut.as_completed(futs):
            seen.append(int((await done)[0]))
    assert seen == [2, 1, 0]
    assert [int(v[0]) for v in await gathered] == [0, 1, 2]


async def test_launch_awaited(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    assert (await cudafut.launch(np.arange, 4)).sum() == 6


async def test_batcher(fake_cuda: testing.FakeCuda) -> None:
    fake_cuda.auto_complete = True
    sizes = []

    def run_batch(items: list[int]) -> np.ndarray[Any, Any]:
        sizes.append(len(items))
        return np.asarray(items) * 10

    results: dict[int, int] = {}
    async with cudafut.Batcher(run_batch, max_batch=8, max_delay_s=0.05) as batcher:

        async def one(i: int) -> None:
            results[i] = int(await batcher.submit(i))

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
    assert results == {i: i * 10 for i in range(5)}
    assert sum(sizes) == 5


# -- on a GPU: the fake and real CUDA in one process ----------------------------------------


@pytest.mark.gpu
def test_real_cuda_is_untouched_by_a_fake_in_between(cp: Any) -> None:
    """The project's suite runs fake and real tests in one process: nothing of
    the fake (streams, event handles, launcher threads, records that outlive
    it) may reach CUDA afterwards, and CUDA's pools and launchers come back."""
    assert cp.asnumpy(cudafut.record(cp.arange(4)).then(lambda v: v + 1).result(timeout=30)).tolist() == [
        1,
        2,
        3,
        4,
    ]
    assert cp.asnumpy(cudafut.launch(cp.ones, 2).result(timeout=30)).tolist() == [1, 1]
    real_events = _pools.events
    with testing.fake_cuda() as fake:
        assert _pools.events is not real_events
        child = cudafut.record(np.ones(2)).then(lambda v: v * 2)
        launched = cudafut.launch(np.zeros, 2)
        fake.complete(child, launched)
        np.testing.assert_array_equal(child.result(timeout=30), [2, 2])
        launched.result(timeout=30)
        outlives = [cudafut.record(np.ones(1)) for _ in range(8)]  # pending at exit
        dropped = cudafut.record(np.ones(1))  # handed to the watcher thread, pending
        del dropped
    assert _pools.events is real_events
    assert all(fut.done() for fut in outlives)
    del outlives, child, launched
    gc.collect()  # the fake's records die now: never into CUDA's event pool
    for i in range(64):  # would record on a fake handle if one had come back
        out = cudafut.record(cp.full(3, i)).then(lambda v: v * 3)
        assert cp.asnumpy(out.result(timeout=30)).tolist() == [3 * i] * 3
    assert cp.asnumpy(cudafut.launch(cp.arange, 3).result(timeout=30)).tolist() == [0, 1, 2]
