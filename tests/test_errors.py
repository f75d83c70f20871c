"""The documented errors, and nothing else (issue 22): device indexes, stream
handles, overlapping ``out=``, timeouts and policies of any real type,
impossible pinned arrays, a trace that cannot be written, a distributed
start-up that must end, and the front door without a GPU or a checkout.

CPU where the check comes before CUDA (or CUDA is faked); ``gpu`` where only
a device can show it."""

from __future__ import annotations

import fractions
import itertools
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import cudafut
import cudafut.distributed as dist
from cudafut import _backend, _copies, _cuda, _pinned
from cudafut.distributed import _group, _nccl
from tests.fakes import FakeRecord, set_future
from tests.subproc import ROOT, run_python

# -- device indexes ------------------------------------------------------------------


def test_task_stream_of_a_device_out_of_range_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # One device visible (faked): 99 is out of range before any stream is made.
    monkeypatch.setattr(_backend.current, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 99 is out of range.*1 CUDA device"):
        cudafut.task_stream(99)
    with pytest.raises(ValueError, match="numbered from 0"):
        cudafut.task_stream(-1)
    with pytest.raises(TypeError, match="int index"):
        cudafut.task_stream("0")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_task_stream_of_a_device_out_of_range_on_a_gpu() -> None:
    n = _backend.current.device_count()
    with pytest.raises(ValueError, match="out of range"):
        cudafut.task_stream(99)
    with pytest.raises(ValueError, match="out of range"):
        cudafut.task_stream(n)
    assert cudafut.task_stream(0) is cudafut.task_stream(0)


# -- stream handles ----------------------------------------------------------------


class ProtocolStream:
    """A ``__cuda_stream__`` object with the handle it is given."""

    def __init__(self, handle: int, device: int | None = 0) -> None:
        self.handle = handle
        if device is not None:
            self.device_id = device

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class TorchLikeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.device_index = 0


UNMAPPED = [0x1234, 0xDEADBEEF, 1 << 47, (1 << 64) - 1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the address check uses Linux's mincore")
@pytest.mark.parametrize("handle", UNMAPPED, ids=hex)
def test_a_stream_handle_at_no_address_is_a_value_error(handle: int) -> None:
    for stream in (ProtocolStream(handle), ProtocolStream(handle, device=None), TorchLikeStream(handle)):
        with pytest.raises(ValueError, match="not a CUDA stream of this process"):
            _cuda.stream_handle(stream)
    # Through the public API, before CUDA is touched (on a GPU: before it crashes).
    with pytest.raises(ValueError, match="not a CUDA stream"), cudafut.use_stream(ProtocolStream(handle)):
        pass


def test_stream_handles_that_may_be_streams_pass() -> None:
    mapped = np.zeros(8)
    handle = mapped.ctypes.data  # mapped memory: cannot be told from a stream without CUDA
    assert _cuda.stream_handle(ProtocolStream(handle)) == (handle, 0)
    assert _cuda.stream_handle(TorchLikeStream(handle)) == (handle, 0)
    for special in (0, 1, 2):  # the default streams
        assert _cuda.stream_handle(ProtocolStream(special)) == (special, 0)
    with pytest.raises(ValueError, match="negative"):
        _cuda.stream_handle(ProtocolStream(-8))


@pytest.mark.gpu
def test_an_unknown_stream_handle_is_a_value_error_not_a_crash() -> None:
    # In a child: before the fix, CUDA read the handle and the process died.
    proc = run_python(
        """
        import cupy as cp
        import cudafut

        class Bad:
            def __cuda_stream__(self):
                return (0, 0x1234)

        x = cp.zeros(4)
        for call in (
            lambda: cudafut.record(x, stream=Bad()),
            lambda: cudafut.to_host(x, stream=Bad()),
            lambda: cudafut.record_stream(x, Bad()),
            lambda: cudafut.use_stream(Bad()).__enter__(),
            lambda: cudafut.record(x, stream=cp.cuda.ExternalStream(0x1234)),
        ):
            try:
                call()
            except ValueError as exc:
                assert "not a CUDA stream" in str(exc), exc
            else:
                raise AssertionError("accepted")
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# -- to_host(out=) with overlapping elements ---------------------------------------


def overlapping_outs() -> list[np.ndarray[Any, Any]]:
    base = np.zeros(64)
    return [
        as_strided(base, (10,), (4,)),  # half an element apart
        as_strided(base, (5, 5), (8, 8)),  # rows shifted by one element
        as_strided(base, (4, 3), (16, 8)),  # rows of 3 elements, 2 apart
        as_strided(base, (3, 4), (-8, 16))[::-1],
    ]


@pytest.mark.parametrize("out", overlapping_outs(), ids=lambda a: f"{a.shape}/{a.strides}")
def test_an_out_whose_elements_overlap_is_refused(out: np.ndarray[Any, Any]) -> None:
    with pytest.raises(ValueError, match="overlap"):
        _copies._check_out(out, out.shape, out.dtype)


def test_outs_that_do_not_overlap_pass() -> None:
    base = np.zeros(256)
    for out in (
        base.reshape(16, 16).T,
        base[::3],
        base.reshape(4, 8, 8)[:, ::2, 1:].transpose(2, 0, 1),
        as_strided(base, (2, 3), (24, 16)),  # interleaved, yet distinct
        as_strided(base[100:], (3, 3), (8, -24)),
        base[::-1],
    ):
        assert _copies._check_out(out, out.shape, out.dtype) is out


def _brute_force_overlap(a: np.ndarray[Any, Any]) -> bool:
    starts = [sum(i * s for i, s in zip(idx, a.strides, strict=True)) for idx in np.ndindex(*a.shape)]
    starts.sort()
    return any(b - s < a.itemsize for s, b in itertools.pairwise(starts))


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    strides=st.lists(st.integers(-5, 5), min_size=3, max_size=3),
    itemsize=st.sampled_from([1, 2, 4, 8]),
)
def test_the_overlap_check_agrees_with_brute_force(
    shape: list[int], strides: list[int], itemsize: int
) -> None:
    dtype = {1: np.uint8, 2: np.int16, 4: np.float32, 8: np.float64}[itemsize]
    byte_strides = tuple(s * itemsize // 2 if itemsize > 1 else s for s in strides[: len(shape)])
    base = np.zeros(4096, dtype=np.uint8)
    a = as_strided(base[2048:].view(dtype), tuple(shape), byte_strides)
    assert _copies._overlaps(a) == _brute_force_overlap(a)


@pytest.mark.gpu
def test_to_host_refuses_an_overlapping_out_before_copying(cp: Any) -> None:
    x = cp.arange(10, dtype=cp.float64)
    out = as_strided(np.zeros(16), (10,), (4,))
    with pytest.raises(ValueError, match="overlap"):
        cudafut.to_host(x, out=out)
    fine = np.empty(20)[::2]
    np.testing.assert_array_equal(cudafut.to_host(x, out=fine).result(), np.arange(10))


# -- timeouts of any real type -------------------------------------------------------


REAL_TIMEOUTS = [
    np.float64(0.01),
    np.float32(0.01),
    np.int64(0),
    np.uint8(0),
    fractions.Fraction(1, 100),
]


@pytest.mark.parametrize("timeout", REAL_TIMEOUTS, ids=lambda t: f"{type(t).__name__}")
def test_timeouts_of_any_real_type_are_accepted(timeout: Any) -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    with pytest.raises(cudafut.TimeoutError):
        fut.result(timeout=timeout)
    with pytest.raises(cudafut.TimeoutError):
        fut.exception(timeout=timeout)
    with pytest.raises(cudafut.TimeoutError):
        cudafut.wait_all([fut], timeout=timeout)
    with pytest.raises(cudafut.TimeoutError):
        list(cudafut.as_completed_sync([fut], timeout=timeout))
    assert cudafut.trace(None, timeout=timeout).timeout == float(timeout)
    if timeout > 0:
        assert _group.check_timeout(timeout) == float(timeout)


@pytest.mark.parametrize("huge", [10**400, fractions.Fraction(10**400, 3), math.inf, 1e300, 2**63])
def test_a_huge_timeout_means_no_limit(huge: Any) -> None:
    rec = FakeRecord()
    rec.complete()
    fut = set_future(7, [rec])
    assert fut.result(timeout=huge) == 7
    assert fut.exception(timeout=huge) is None
    assert cudafut.wait_all([fut], timeout=huge) == [7]
    assert list(cudafut.as_completed_sync([fut], timeout=huge)) == [fut]
    assert cudafut.trace(None, timeout=huge).timeout == threading.TIMEOUT_MAX
    assert _group.check_timeout(huge) == threading.TIMEOUT_MAX


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (True, TypeError),
        (np.bool_(True), TypeError),
        ("1", TypeError),
        (1j, TypeError),
        (-1, ValueError),
        (np.float64(-0.5), ValueError),
        (fractions.Fraction(-1, 3), ValueError),
        (np.float32("nan"), ValueError),
        (-(10**400), ValueError),
    ],
    ids=repr,
)
def test_timeouts_that_are_not_non_negative_reals_are_refused(bad: Any, error: type[Exception]) -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    for call in (
        lambda: fut.result(timeout=bad),
        lambda: cudafut.wait_all([fut], timeout=bad),
        lambda: cudafut.trace(None, timeout=bad),
        lambda: _group.check_timeout(bad),
    ):
        with pytest.raises(error, match="timeout"):
            call()


# -- WaitPolicy --------------------------------------------------------------------------


def test_policy_fields_of_any_real_type_are_plain_floats() -> None:
    policy = cudafut.WaitPolicy(
        spin_s=np.float32(1e-4),
        first_sleep_s=fractions.Fraction(1, 20000),  # type: ignore[arg-type]
        max_sleep_s=np.int64(1),
    )
    assert type(policy.spin_s) is float and type(policy.first_sleep_s) is float
    assert policy.max_sleep_s == 1.0 and type(policy.max_sleep_s) is float
    assert cudafut.WaitPolicy(spin_s=1) == cudafut.WaitPolicy(spin_s=1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spin_s": 10**400}, "spin_s is too large to be a float"),
        ({"cpu_budget": -(10**400)}, "cpu_budget is too large"),
        ({"max_sleep_s": 10**400}, "max_sleep_s is too large"),
        ({"max_sleep_s": 1e12}, "longer than a thread can sleep"),
        ({"max_sleep_s": threading.TIMEOUT_MAX * 2}, "longer than a thread can sleep"),
    ],
)
def test_policy_numbers_too_large_are_value_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cudafut.WaitPolicy(**kwargs)


def test_the_longest_sleep_a_thread_can_take_is_a_valid_policy() -> None:
    policy = cudafut.WaitPolicy(max_sleep_s=threading.TIMEOUT_MAX)
    threading.Event().wait(min(policy.max_sleep_s, 0.0))  # threading takes it (0 s: no wait here)
    threading.Lock().acquire(timeout=policy.max_sleep_s)


# -- empty_pinned ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [2**70, (2**40, 2**40), (2**62, 4), (1,) * 65, (np.int64(2**62), np.int64(4))],
    ids=["2**70", "2**40 squared", "2**64 bytes", "65 dims", "numpy 2**62"],
)
def test_impossible_pinned_shapes_are_value_errors(shape: Any) -> None:
    with pytest.raises(ValueError, match=r"dimensions|than any array can hold"):
        cudafut.empty_pinned(shape, dtype=np.float64)


def test_a_pinned_array_over_the_limit_is_a_memory_error_before_cuda() -> None:
    with pytest.raises(MemoryError, match="limit"):
        cudafut.empty_pinned(2**50, dtype=np.float64)  # 8 PB: possible, but over any limit


class _Refusing:
    """A CUDA runtime whose ``cudaHostAlloc`` fails with ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status

    def hostAlloc(self, size: int, flags: int) -> int:  # noqa: N802 - CuPy's name
        raise _StatusError(self.status)


class _StatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


def test_pinning_that_cuda_refuses_is_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend.current, "runtime", lambda: _Refusing(2))  # cudaErrorMemoryAllocation
    with pytest.raises(MemoryError, match="could not pin"):
        cudafut.empty_pinned(1 << 20)
    assert _pinned.pool.take(1 << 20) is None  # to_host falls back to pageable memory
    monkeypatch.setattr(_backend.current, "runtime", lambda: _Refusing(999))
    with pytest.raises(cudafut.CudaError) as info:
        cudafut.empty_pinned(1 << 20)
    assert info.value.code == 999


# -- the trace file ------------------------------------------------------------------------


def test_a_trace_that_cannot_be_written_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "a-directory"
    target.mkdir()
    with pytest.raises(IsADirectoryError), cudafut.trace(target):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory"]
    assert list(target.iterdir()) == []


# -- distributed start-up ------------------------------------------------------------------


class _Store:
    """A store whose ``get`` never answers until the test ends."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        pass

    def get(self, key: str) -> bytes:
        self.released.wait()
        return b"never"


@pytest.fixture
def fake_cuda_for_dist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Just enough of CUDA and NCCL for init_process_group to reach the store."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    monkeypatch.setattr(_backend.current, "device_count", lambda: 1)
    monkeypatch.setattr(_cuda, "check_device", lambda device: device)
    monkeypatch.setattr(_backend.current, "use_device", lambda device: None)
    monkeypatch.setattr(_nccl, "check_available", lambda: None)
    monkeypatch.setattr(_nccl, "unique_id", lambda: b"\x01\x02\x03")


@pytest.fixture
def silent_store() -> Iterator[_Store]:
    store = _Store()
    yield store
    store.released.set()  # the daemon thread left on it ends


@pytest.mark.usefixtures("fake_cuda_for_dist")
def test_a_store_that_never_answers_fails_the_start_up_in_time(silent_store: _Store) -> None:
    with pytest.raises(dist.CollectiveError, match=r"store given \(store=\) did not answer within 0.2 s"):
        dist.init_process_group(rank=1, world_size=2, store=silent_store, timeout=0.2)
    assert not dist.is_initialized()


@pytest.mark.usefixtures("fake_cuda_for_dist")
def test_a_store_that_fails_is_a_collective_error() -> None:
    class Broken(_Store):
        def get(self, key: str) -> bytes:
            raise ConnectionResetError("peer went away")

    with pytest.raises(dist.CollectiveError, match="store failed: ConnectionResetError: peer went away"):
        dist.init_process_group(rank=1, world_size=2, store=Broken(), timeout=5)


@pytest.mark.parametrize("store", [object(), 42, type("OnlySet", (), {"set": lambda self, k, v: None})()])
def test_a_store_without_set_and_get_is_a_type_error_at_the_call(store: object) -> None:
    # Checked before CUDA: the same error with or without a GPU.
    with pytest.raises(TypeError, match=r"store must have set\(key, value\) and get\(key\)"):
        dist.init_process_group(rank=1, world_size=2, store=store, timeout=5)  # type: ignore[arg-type]
    assert not dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nobody_at_the_stores_address_fails_the_start_up_in_time() -> None:
    # In a child: the store's client keeps retrying in a daemon thread after
    # the call gave up, and it is torch's TCPStore where torch is installed.
    proc = run_python(
        """
        import sys, time, warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                import torch.distributed  # noqa: F401
            except ImportError:
                try:
                    from cupyx.distributed import _store  # noqa: F401
                except Exception as exc:
                    print("SKIP", type(exc).__name__, exc)
                    sys.exit(0)
        from cudafut import _backend, _cuda
        from cudafut.distributed import _nccl
        import cudafut.distributed as dist

        _backend.current.device_count = lambda: 1
        _cuda.check_device = lambda device: device
        _backend.current.use_device = lambda device: None
        _nccl.check_available = lambda: None
        _nccl.unique_id = lambda: b"\x01\x02\x03"
        t = time.monotonic()
        try:
            dist.init_process_group(rank=1, world_size=2, timeout=1.0)
        except dist.CollectiveError as exc:
            print("CollectiveError", round(time.monotonic() - t), exc)
        except BaseException as exc:
            print("OTHER", type(exc).__name__, exc)
        """,
        timeout=60,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    out = proc.stdout.strip()
    if out.startswith("SKIP"):
        pytest.skip(f"no store client here: {out}")
    assert out.startswith("CollectiveError"), (out, proc.stderr[-2000:])
    assert "did not answer" in out or "store failed" in out, out


# The bad-input cases of init_process_group that leave a store's call behind
# (nobody at the store's address, rank 0 waiting for a worker that never
# comes, a torch store whose key never comes), then an exit with the script's
# own status right away: what once aborted at exit (issue 34).
_BAD_STARTS = """
import os, socket, sys, threading, time, warnings
timeout, status = float(sys.argv[1]), int(sys.argv[2])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import torch.distributed as td
    except ImportError:
        td = None
        try:
            from cupyx.distributed import _store  # noqa: F401
        except Exception as exc:
            print("SKIP", type(exc).__name__, exc)
            sys.exit(status)
from cudafut import _backend, _cuda
from cudafut.distributed import _nccl
import cudafut.distributed as dist

_backend.current.device_count = lambda: 1
_cuda.check_device = lambda device: device
_backend.current.use_device = lambda device: None
_nccl.check_available = lambda: None
_nccl.unique_id = lambda: b"\x01\x02\x03"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


cases = [{"rank": 1, "world_size": 2}]
if td is not None:
    cases += [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2, "store": td.HashStore()}]
for case in cases:
    os.environ["MASTER_PORT"] = str(free_port())
    t = time.monotonic()
    try:
        dist.init_process_group(timeout=timeout, **case)
    except dist.CollectiveError as exc:
        print("CollectiveError", round(time.monotonic() - t, 2), exc, flush=True)
    else:
        print("JOINED", case, flush=True)
left = [t.name for t in threading.enumerate() if t.name == "cudafut-store"]
print("left in a store:", left, flush=True)
sys.exit(status)
"""


@pytest.mark.parametrize(("timeout", "runs"), [(0.2, 10), (2.0, 4), (5.0, 2)])
def test_a_start_up_that_gave_up_never_kills_the_process_at_exit(timeout: float, runs: int) -> None:
    # torch's TCPStore where torch is installed (the GPU machine), else cupyx's store.
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1"}
    statuses = [0, 3] * (runs // 2)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BAD_STARTS, str(timeout), str(status)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for status in statuses
    ]
    outs = [
        (status, *p.communicate(timeout=120 + 10 * timeout), p.returncode)
        for status, p in zip(statuses, procs, strict=True)
    ]
    if all(out.startswith("SKIP") for _, out, _, _ in outs):
        pytest.skip(f"no store client here: {outs[0][1]}")
    for status, out, err, rc in outs:
        assert rc == status, (rc, out, err[-3000:])  # never 134 (SIGABRT) or -6
        assert "terminate called" not in err, err[-3000:]
        lines = out.splitlines()
        assert lines[-1] == "left in a store: []", out
        failed = [line for line in lines if line.startswith("CollectiveError")]
        assert failed and len(failed) == len(lines) - 1, out
        for line in failed:  # in time: the timeout, and at most the grace to leave the store
            took = float(line.split()[1])
            assert took < timeout + _group.STORE_GRACE_S + 1.0, out


def _slow_store(inside: threading.Event, seconds: float) -> Any:
    """A ``_make_store`` whose store, like torch's TCPStore connecting,
    returns (fails) by itself a little after the start-up's deadline."""

    def make(rank: int, size: int, timeout: float, deadline: float) -> Any:
        inside.set()
        try:
            time.sleep(seconds)
            raise TimeoutError("the store's own timeout")
        finally:
            inside.clear()

    return make


@pytest.mark.usefixtures("fake_cuda_for_dist")
def test_a_start_up_that_gave_up_waits_for_its_store_to_return_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # Raising while the store's thread is still inside torch's C++ code let
    # that thread come back into Python as the interpreter ended: SIGABRT.
    inside = threading.Event()
    monkeypatch.setattr(_group, "_make_store", _slow_store(inside, 0.5))
    t = time.monotonic()
    with pytest.raises(dist.CollectiveError, match=r"did not answer within 0.2 s"):
        dist.init_process_group(rank=1, world_size=2, timeout=0.2)
    assert not inside.is_set()  # out of the store before the call raised
    assert 0.45 < time.monotonic() - t < 0.2 + _group.STORE_GRACE_S
    assert not [th for th in threading.enumerate() if th.name == "cudafut-store" and th.is_alive()]


@pytest.mark.usefixtures("fake_cuda_for_dist")
def test_a_store_past_the_grace_is_waited_for_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    inside = threading.Event()
    monkeypatch.setattr(_group, "_make_store", _slow_store(inside, 0.6))
    monkeypatch.setattr(_group, "STORE_GRACE_S", 0.05)
    t = time.monotonic()
    with pytest.raises(dist.CollectiveError, match=r"did not answer within 0.1 s"):
        dist.init_process_group(rank=1, world_size=2, timeout=0.1)
    assert time.monotonic() - t < 0.4
    assert inside.is_set()
    [(thread, until)] = [(th, u) for th, u in _group._left if th.is_alive()]
    assert until >= t + 0.1 + _group.EXIT_GRACE_S
    _group._join_left()  # what atexit runs, before the interpreter finalizes
    assert not thread.is_alive() and not inside.is_set()
    assert _group._left == []


def test_cupyxs_store_ends_its_calls_in_time_when_nobody_listens() -> None:
    pytest.importorskip("cupyx.distributed._store")
    # cupyx's own client retries for 25 s: the thread would outlive the start-up.
    store = _nccl.CupyxStore(1, 2, "127.0.0.1", _free_port(), 0.3)
    for call in (lambda: store.get("k"), lambda: store.set("k", b"v")):
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="nobody took connections"):
            call()
        assert 0.25 < time.monotonic() - t < 1.5
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        store.wait(["k"], timedelta(seconds=0.1))
    assert time.monotonic() - t < 1.0


def test_cupyxs_store_server_never_holds_up_the_exit() -> None:
    pytest.importorskip("cupyx.distributed._store")
    # Rank 0's server process, of a world never destroyed, ran until killed.
    proc = run_python(
        """
        import sys, warnings
        warnings.simplefilter("ignore")
        from cudafut.distributed import _nccl
        store = _nccl.CupyxStore(0, 2, "127.0.0.1", int(sys.argv[1]), 5.0)
        store.set("k", b"v")
        print(store.get("k"))
        sys.exit(3)
        """,
        str(_free_port()),
        timeout=60,
    )
    assert (proc.returncode, proc.stdout.strip()) == (3, "b'v'"), proc.stderr[-2000:]


# -- the front door: no checkout, no GPU ------------------------------------------------------------


def test_bench_without_a_source_checkout_says_how_to_get_one(tmp_path: Path) -> None:
    # An installed cudafut: the package alone, no benchmarks/ beside it.
    site = tmp_path / "site"
    shutil.copytree(ROOT / "cudafut", site / "cudafut", ignore=shutil.ignore_patterns("__pycache__"))
    for argv in (["bench", "--help"], ["bench"], ["bench", "--quick"]):
        proc = subprocess.run(
            [sys.executable, "-m", "cudafut", *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(site)},
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        assert "run from a source checkout" in proc.stderr and "git clone https://" in proc.stderr
        assert "not installed\nwith the package" in proc.stderr
        assert f"installed at {site / 'cudafut'}," in proc.stderr
        assert "python -m cudafut bench --help" in proc.stderr


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # no device, on any machine


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "cudafut", "bench", "--quick"],
        ["examples/pipeline.py", "--quick"],
        ["examples/traced_pipeline.py", "--out", "unused.json"],
        ["examples/trio_app.py", "--quick"],
        ["examples/bucket_overlap.py"],
    ],
    ids=lambda argv: argv[0] if argv[0] != "-m" else "bench",
)
def test_scripts_without_a_gpu_say_what_python_m_cudafut_says(argv: list[str], tmp_path: Path) -> None:
    if argv[0].startswith("examples/trio_app"):
        pytest.importorskip("trio")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, *(str(ROOT / a) if a.startswith("examples/") else a for a in argv)],
        capture_output=True,
        text=True,
        cwd=ROOT if argv[0] == "-m" else tmp_path,
        env={**os.environ, "PYTHONPATH": path, **NO_GPU},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    assert "cudafut cannot use a GPU here:" in proc.stderr, proc.stderr[-3000:]
    assert "To fix it:" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
