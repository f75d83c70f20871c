"""Every public call of cudafut, fed wrong arguments (issue 22).

Hypothesis draws arguments for each public function, constructor and
``CudaFuture`` method from a pool of wrong values: wrong types, NaN and the
infinities, huge and negative numbers, NumPy scalars, ``Fraction``,
arrays of wrong shapes and dtypes, foreign objects and objects that fake
cudafut's protocols (``__cuda_stream__``, ``__cuda_array_interface__``).
Each call must either work, or raise one of the exceptions cudafut
documents, with a message; and leave the threads, the open file
descriptors and ``memory_statistics()`` as they were.

On this machine without a GPU, calls that need CUDA raise
``CudaUnavailableError``; the ``gpu`` variant runs the same draws where CUDA
is usable, with real CuPy arrays and streams among the values (and without
the fakes that would point CUDA at memory that is not there: those could
corrupt the context of the whole test session).
"""

from __future__ import annotations

import asyncio
import contextlib
import decimal
import fractions
import gc
import inspect
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import cudafut
from cudafut import (
    CancelledError,
    CudaError,
    CudaFuture,
    CudaUnavailableError,
    InvalidStateError,
    TimeoutError,
)
from tests.conftest import GPU_MISSING
from tests.fakes import FakeRecord, set_future


class DrawnError(Exception):
    """The exception of the failed futures among the drawn values: what
    ``result()`` and ``wait()`` of such a future rightly raise."""


#: What any call may raise for a wrong argument (docs/semantics.md, each
#: docstring's ``Raises:``); CudaUnavailableError where the call needs CUDA.
DOCUMENTED: tuple[type[BaseException], ...] = (
    TypeError,
    ValueError,
    CudaUnavailableError,
    InvalidStateError,
    TimeoutError,
    CancelledError,
)

#: More that some calls document.
ALSO_DOCUMENTED: dict[str, tuple[type[BaseException], ...]] = {
    # RuntimeError: "called where it cannot work" (no running loop, no torch,
    # a task that does not run on its own stream), each saying so.
    "use_task_streams": (RuntimeError,),
    "use_stream": (RuntimeError,),
    "wrap_future": (RuntimeError,),
    "enqueued": (RuntimeError,),
    "from_torch": (RuntimeError,),
    # Past the pinned pool's limit, or CUDA could not pin (docstring).
    "empty_pinned": (MemoryError, CudaError),
    # The drawn future failed: these raise its exception, as they should.
    "CudaFuture.result": (DrawnError,),
    "CudaFuture.wait": (DrawnError,),
}

#: Calls that change process-wide settings: restored after each call.
GLOBAL_SETTERS = {"set_wait_policy", "set_tracking", "set_pinned_limit"}

#: Calls with nothing to check here: no arguments, or ones that only build
#: a record of numbers (their fields are whatever the caller gives).
PLAIN_RECORDS = {
    "MemoryStatistics",
    "TrackingStatistics",
    "BatcherStatistics",
    "PoolStatistics",
    "SharedStatistics",
}


# -- the values ------------------------------------------------------------------------


class Foreign:
    """An object of no kind cudafut knows; callable (it takes anything)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __repr__(self) -> str:
        return "Foreign()"


class LyingStream:
    """Claims the CUDA stream protocol, and answers wrongly."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def __cuda_stream__(self) -> object:
        return self.answer

    def __repr__(self) -> str:
        return f"LyingStream({self.answer!r})"


class LyingArray:
    """Claims ``__cuda_array_interface__``, with a wrong description."""

    def __init__(self, interface: object) -> None:
        self.__cuda_array_interface__ = interface

    def __repr__(self) -> str:
        return f"LyingArray({self.__cuda_array_interface__!r})"


async def coroutine_function(*args: object, **kwargs: object) -> None:
    pass


def nothing(*args: object, **kwargs: object) -> None:
    pass


def _failed_future() -> CudaFuture[Any]:
    fut: CudaFuture[Any] = CudaFuture()
    fut.set_exception(DrawnError("a failed future, drawn"))
    fut.exception()  # retrieved: no "never retrieved" report when it is dropped
    return fut


def _done_future() -> CudaFuture[Any]:
    rec = FakeRecord()
    rec.complete()
    rec.query()  # known complete: nothing ever hands its fake handle to CUDA
    return set_future(5, [rec])


NUMBERS: list[Any] = [
    -1,
    0,
    1,
    2,
    99,
    2**31,
    2**63,
    2**64,
    10**400,
    -(10**400),
    -0.5,
    1e-300,
    1e300,
    math.inf,
    -math.inf,
    math.nan,
    np.float32("nan"),
    np.float64(-math.inf),
    np.int64(-1),
    np.uint64(2**64 - 1),
    np.int8(3),
    fractions.Fraction(1, 3),
    fractions.Fraction(10**400, 7),
    decimal.Decimal("1.5"),
    decimal.Decimal("NaN"),
    1j,
]

HOST_ARRAYS: list[Any] = [
    np.zeros(0),
    np.zeros(()),
    np.zeros((2, 3, 0)),
    np.zeros((1,) * 12),
    np.zeros((3, 4)).T,
    np.zeros(8)[::3],
    np.zeros(3, dtype=object),
    np.array(["text"]),
    np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
    np.broadcast_to(np.zeros(1), (4,)),
    as_strided(np.zeros(16), (6,), (4,)),  # elements overlap
    np.zeros(4, dtype=np.complex64),
    np.zeros(4, dtype=np.float16),
    np.zeros(3, dtype=bool),
]

FOREIGN: list[Any] = [
    None,
    True,
    False,
    "",
    "0",
    "balanced",
    b"\x00",
    [],
    [1, -1],
    [None],
    [[1]],
    (),
    (2, -3),
    {},
    {"spin_s": 1},
    set(),
    object(),
    Foreign(),
    Foreign,
    nothing,
    int,
    range(3),
    threading.Lock(),
    LyingStream("not a tuple"),
    LyingStream((1, 5)),
    LyingStream((0, "a")),
    LyingStream((0, -4)),
    LyingStream((0, 1.5)),
    LyingStream((0, 0x1234)),  # an address nothing is mapped at
    LyingArray("not a dict"),
    LyingArray({}),
    LyingArray({"shape": "x", "typestr": 3}),
]

#: Fakes that would point CUDA at memory that is not there: CPU only (on a
#: GPU they could copy from a wild address and corrupt the context).
WILD: list[Any] = [
    LyingArray({"shape": (4,), "typestr": "<f4", "data": (0x1234, False), "version": 3}),
    LyingArray({"shape": (2**40,), "typestr": "<f8", "data": (0x1000, False), "version": 3}),
]

#: Values made afresh for each call (futures, iterators: a call may use them up).
MADE: list[Callable[[], Any]] = [
    _failed_future,
    _done_future,
    lambda: [_failed_future(), 3],
    lambda: iter([1, 2]),
]


def gpu_made() -> list[Callable[[], Any]]:
    cp = cudafut._backend.current.cupy()
    return [
        lambda: cp.zeros(0),
        lambda: cp.zeros(()),
        lambda: cp.zeros((3, 4)).T,
        lambda: cp.zeros(9)[::3],
        lambda: cp.zeros(4, dtype=cp.complex64),
        lambda: cp.zeros((2, 0, 3)),
        lambda: cp.cuda.Stream(non_blocking=True),
        lambda: cp.cuda.Stream.null,
        lambda: cudafut.record(cp.zeros(2)),
    ]


def wrong_values(gpu: bool) -> list[Callable[[], Any]]:
    """Every wrong value, as a function that makes it."""
    fixed = NUMBERS + HOST_ARRAYS + FOREIGN + ([] if gpu else WILD)
    return [_constant(v) for v in fixed] + MADE + (gpu_made() if gpu else [])


def _constant(value: object) -> Callable[[], Any]:
    return lambda: value


def values(gpu: bool) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(wrong_values(gpu)).map(lambda make: make()),
        st.integers(),
        st.floats(),
        st.text(max_size=4),
    )


# -- the calls ---------------------------------------------------------------------------


def public_calls() -> list[str]:
    names = []
    for name in cudafut.__all__:
        obj = getattr(cudafut, name)
        if not callable(obj) or (isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        names.append(name)
    return names


FUTURE_METHODS = ["result", "exception", "wait", "then", "add_done_callback", "set_result", "cancel"]


def draw_call(data: st.DataObject, fn: Callable[..., Any], pool: st.SearchStrategy[Any]) -> tuple[list, dict]:
    """Positional and keyword arguments for ``fn``: each required parameter
    and about half of the optional ones get a drawn value; sometimes one
    argument too many."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            args.extend(data.draw(st.lists(pool, max_size=2), label=f"*{p.name}"))
        elif p.kind is p.VAR_KEYWORD:
            continue
        elif p.default is p.empty or data.draw(st.booleans(), label=f"give {p.name}"):
            value = data.draw(pool, label=p.name)
            if p.kind is p.KEYWORD_ONLY:
                kwargs[p.name] = value
            elif p.kind is p.POSITIONAL_ONLY:
                args.append(value)
            elif bool(kwargs) or data.draw(st.booleans(), label=f"{p.name} by name"):
                kwargs[p.name] = value  # after one by name, the rest go by name too
            else:
                args.append(value)
    if data.draw(st.integers(0, 9), label="one too many") == 0:
        args.append(data.draw(pool, label="extra"))
    return args, kwargs


def invoke(name: str, fn: Callable[..., Any], args: list, kwargs: dict) -> Any:
    """Call ``fn`` as its kind needs: enter a context manager, iterate an
    iterator, run what needs a loop on one."""
    if name == "use_stream":
        with fn(*args, **kwargs) as stream:
            return stream
    if name == "as_completed_sync":
        return list(fn(*args, **kwargs))
    if name in ("as_completed", "wrap_future", "use_task_streams"):

        async def on_a_loop() -> Any:
            result = fn(*args, **kwargs)
            if name == "as_completed":
                return [f async for f in result]
            if name == "wrap_future":  # its outcome is the future's, not an argument error
                await asyncio.wait([result], timeout=10)
                return result.exception() if result.done() and not result.cancelled() else None
            return result

        return asyncio.run(on_a_loop())
    return fn(*args, **kwargs)


# -- what must not change ----------------------------------------------------------------


def _fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _memory() -> tuple[int, ...]:
    s = cudafut.memory_statistics()
    return (s.pinned_in_use, s.pinned_blocks_in_use, s.held, s.untracked_holds)


class Snapshot:
    """Threads, open fds and cudafut's memory counts, to compare after a call.

    A call leaks if, after it, there are threads it started, more open fds,
    or higher memory counts: garbage of earlier calls collected meanwhile
    can only lower them. (A full ``gc.collect()`` takes 0.1 s here: it runs
    only when the young generations did not settle the counts.)"""

    def __init__(self) -> None:
        gc.collect(1)
        self.threads = set(threading.enumerate())
        self.fds = _fds()
        self.memory = _memory()

    def _leaks(self) -> tuple[list[threading.Thread], bool, bool]:
        fds = _fds()
        memory = _memory()
        more_fds = fds is not None and self.fds is not None and fds > self.fds
        more_memory = any(a > b for a, b in zip(memory, self.memory, strict=True))
        return self.new_threads(), more_fds, more_memory

    def new_threads(self) -> list[threading.Thread]:
        # cudafut's own long-lived threads (the watcher, the copy and launcher
        # threads) start once per process and are kept: not a leak.
        return [
            t
            for t in threading.enumerate()
            if t not in self.threads and t.is_alive() and not t.name.startswith("cudafut")
        ]

    def check(self, what: str) -> None:
        gc.collect(1)
        threads, more_fds, more_memory = self._leaks()
        deadline = time.monotonic() + 10
        tries = 0
        while threads or more_fds or more_memory:
            # The watcher thread gives held blocks back within a few ms of
            # their GPU work's end: wait for that with cheap young-generation
            # collections first; only cycles need a full collection (0.1 s
            # each here, which made the GPU variants take seconds a call).
            if time.monotonic() > deadline:
                break
            tries += 1
            if tries <= 50:
                gc.collect(1)
                time.sleep(0.002)
            else:
                gc.collect()
                time.sleep(0.01)
            threads, more_fds, more_memory = self._leaks()
        assert not threads, f"{what} left threads running: {threads}"
        assert not more_fds, f"{what} left file descriptors open: {self.fds} before, {_fds()} after"
        assert not more_memory, f"{what} raised memory_statistics(): {self.memory} -> {_memory()}"


def _settle(result: Any, gpu: bool) -> None:
    """Let GPU work a call enqueued finish, so that what it holds returns."""
    if not gpu:
        return
    futs = result if isinstance(result, list) else [result]
    for fut in futs:
        if isinstance(fut, CudaFuture) and not isinstance(result, type):
            with contextlib.suppress(TimeoutError, CancelledError):
                fut.exception(timeout=10)
    cudafut._backend.current.cupy().cuda.Device().synchronize()


def check_call(name: str, call: Callable[[], Any], gpu: bool) -> None:
    allowed = DOCUMENTED + ALSO_DOCUMENTED.get(name, ())
    before = Snapshot()
    saved = _save_settings()
    error: BaseException | None = None
    try:
        result = call()
    except allowed as exc:
        error, result = exc, None
    except BaseException as exc:
        raise AssertionError(
            f"{name} raised {type(exc).__name__}, which it does not document: {exc!r}"
        ) from exc
    finally:
        _restore_settings(saved)
    if error is not None:
        assert str(error).strip(), f"{name} raised {type(error).__name__} with no message"
    if name != "CudaFuture":  # a new future has no producer: nothing to settle
        _settle(result, gpu)
    del result
    before.check(name)


def _save_settings() -> tuple[Any, ...]:
    return (cudafut.get_wait_policy(), cudafut.memory_statistics().pinned_limit, _tracking())


def _tracking() -> bool:
    previous = cudafut.set_tracking(True)
    cudafut.set_tracking(previous)
    return previous


def _restore_settings(saved: tuple[Any, ...]) -> None:
    policy, limit, tracking = saved
    cudafut.set_wait_policy(policy)
    cudafut.set_pinned_limit(limit)
    cudafut.set_tracking(tracking)


# -- the tests ----------------------------------------------------------------------------

EXAMPLES = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)


def _run_function(name: str, data: st.DataObject, gpu: bool) -> None:
    fn = getattr(cudafut, name)
    if name in PLAIN_RECORDS:
        return
    pool = values(gpu)
    if name == "own_stream":
        # The one call that takes an async def. (Elsewhere one would be
        # called and its coroutine never awaited: Python warns, as it does
        # for asyncio's callbacks.)
        pool = st.one_of(pool, st.just(coroutine_function))
    args, kwargs = draw_call(data, fn, pool)
    check_call(name, lambda: invoke(name, fn, args, kwargs), gpu)


def _run_method(method: str, data: st.DataObject, gpu: bool) -> None:
    # A future that is done (failed): no value of timeout can make a call wait.
    fut = _failed_future() if method != "set_result" else CudaFuture()
    pool = values(gpu)
    if method in ("result", "exception", "wait"):
        args, kwargs = [], {"timeout": data.draw(pool, label="timeout")}
    else:
        args, kwargs = [data.draw(pool, label="argument")], {}
    check_call(f"CudaFuture.{method}", lambda: getattr(fut, method)(*args, **kwargs), gpu)


@pytest.mark.parametrize("name", public_calls())
@EXAMPLES
@given(data=st.data())
def test_a_public_call_with_wrong_arguments(name: str, data: st.DataObject) -> None:
    if GPU_MISSING is None:
        pytest.skip("the CPU variant: the gpu variant runs where CUDA is usable")
    _run_function(name, data, gpu=False)


@pytest.mark.parametrize("method", FUTURE_METHODS)
@EXAMPLES
@given(data=st.data())
def test_a_future_method_with_wrong_arguments(method: str, data: st.DataObject) -> None:
    if GPU_MISSING is None:
        pytest.skip("the CPU variant: the gpu variant runs where CUDA is usable")
    _run_method(method, data, gpu=False)


@pytest.fixture(scope="module")
def gpu_calls(warm_kernels: None) -> Iterator[None]:
    """For the gpu variants: cudafut's lazily made, process-long state made
    already (the watcher and copy threads, the loop drivers' timers, the
    pools), so that it is not taken for a leak; and a pinned limit of
    256 MB, so that a drawn shape cannot pin gigabytes (it is a
    MemoryError instead)."""
    cp = cudafut._backend.current.cupy()
    x = cp.arange(4, dtype=cp.float32)

    async def on_a_loop() -> None:
        await cudafut.record(x)
        await cudafut.to_host(x)
        await cudafut.gather(cudafut.submit(lambda: x + 1), cudafut.to_device(np.zeros(4)))

    asyncio.run(on_a_loop())
    cudafut.wait_all([cudafut.record(x)], timeout=60)
    list(cudafut.as_completed_sync([cudafut.record(x)], timeout=60))
    limit = cudafut.memory_statistics().pinned_limit
    cudafut.set_pinned_limit(256 << 20)
    yield
    cudafut.set_pinned_limit(limit)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_calls")
@pytest.mark.parametrize("name", public_calls())
@EXAMPLES
@given(data=st.data())
def test_a_public_call_with_wrong_arguments_on_a_gpu(name: str, data: st.DataObject) -> None:
    _run_function(name, data, gpu=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_calls")
@pytest.mark.parametrize("method", FUTURE_METHODS)
@EXAMPLES
@given(data=st.data())
def test_a_future_method_with_wrong_arguments_on_a_gpu(method: str, data: st.DataObject) -> None:
    _run_method(method, data, gpu=True)


#: Right values for required arguments, so that the sweep reaches the others.
NEUTRAL: dict[str, dict[str, Any]] = {
    "trace": {"path": None},
    "Trace": {"path": None},
    "wait_all": {"futs": []},
    "as_completed_sync": {"futs": []},
    "empty_pinned": {"shape": 1},
}


def _sweep(name: str, gpu: bool) -> None:
    """Each wrong value in each argument of ``name`` in turn (the other
    arguments left out, or, where required, given the same value): every
    value is tried, where the draws above try combinations. Threads, fds and
    memory are compared once, around the whole sweep."""
    fn = getattr(cudafut, name)
    if name in PLAIN_RECORDS:
        return
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    required = [p for p in params if p.default is p.empty]
    allowed = DOCUMENTED + ALSO_DOCUMENTED.get(name, ())
    before = Snapshot()
    slots: list[inspect.Parameter | None] = [*params] or [None]
    for slot in slots:
        chosen = required if slot is None or slot in required else [*required, slot]
        for make in wrong_values(gpu):
            args: list[Any] = []
            kwargs: dict[str, Any] = {}
            for p in chosen:
                neutral = NEUTRAL.get(name, {})
                given = neutral[p.name] if p is not slot and p.name in neutral else make()
                if p.kind is p.KEYWORD_ONLY:
                    kwargs[p.name] = given
                else:
                    args.append(given)
            saved = _save_settings()
            try:
                result = invoke(name, fn, args, kwargs)
            except allowed as exc:
                error: BaseException | None = exc
                result = None
            except BaseException as exc:
                raise AssertionError(
                    f"{name}(*{args!r}, **{kwargs!r}) raised {type(exc).__name__}, which it does not "
                    f"document: {exc!r}"
                ) from exc
            else:
                error = None
            finally:
                _restore_settings(saved)
            if error is not None:
                assert str(error).strip(), f"{name}(*{args!r}, **{kwargs!r}) raised an empty {error!r}"
            if name != "CudaFuture":
                _settle(result, gpu)
            del result, error
    before.check(f"{name} (all wrong values)")


@pytest.mark.parametrize("name", public_calls())
def test_every_wrong_value_in_every_argument(name: str) -> None:
    if GPU_MISSING is None:
        pytest.skip("the CPU variant: the gpu variant runs where CUDA is usable")
    _sweep(name, gpu=False)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_calls")
@pytest.mark.parametrize("name", public_calls())
def test_every_wrong_value_in_every_argument_on_a_gpu(name: str) -> None:
    _sweep(name, gpu=True)


def test_every_public_call_is_tried() -> None:
    # A new public name is fed wrong arguments too, from the day it exists.
    names = public_calls()
    assert "record" in names and "WaitPolicy" in names and "empty_pinned" in names
    functions = {n for n in ALSO_DOCUMENTED if "." not in n}
    assert functions <= set(names), functions - set(names)
    assert sys.modules["cudafut"] is cudafut


# -- misuse that names its cause (issue 34) ---------------------------------------------


def test_record_of_a_numpy_array_says_it_got_a_host_array() -> None:
    # Without the fake, GPU or not: a NumPy array is on no GPU.
    with pytest.raises(ValueError, match=r"got a host array \(numpy\.ndarray\).*cudafut\.to_device") as info:
        cudafut.record(np.ones(2))
    assert "cudafut.testing" in str(info.value)
    with pytest.raises(ValueError, match="on no GPU"):
        cudafut.record([1, 2])  # not an array: as before
