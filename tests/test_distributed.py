"""cudafut.distributed without a GPU: the launcher's environment, argument
checks, the error type, and what importing it costs."""

from __future__ import annotations

import gc
import json
import math
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import cudafut
import cudafut.distributed as dist
from cudafut import _backend, _events, _interface, _lifetimes
from cudafut.distributed import _group, _nccl, _ops
from cudafut.distributed._env import launch_env
from cudafut.distributed._ops import check_op
from tests.dist_launch import LAUNCH_VARS
from tests.fakes import FakeRecord
from tests.subproc import run_python

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
MPIRUN = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean environment: no launcher variable set."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def setenv(env: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        env.setenv(name, value)


# -- the launcher's environment ---------------------------------------------------


def test_no_launcher_is_a_world_of_one(env: pytest.MonkeyPatch) -> None:
    assert launch_env() == (0, 1, None)


@pytest.mark.parametrize("names", [TORCHRUN, MPIRUN], ids=["torchrun", "mpirun"])
def test_the_launchers_variables(env: pytest.MonkeyPatch, names: tuple[str, str, str]) -> None:
    rank, size, local = names
    setenv(env, **{rank: "5", size: "8", local: "1"})
    assert launch_env() == (5, 8, 1)


@pytest.mark.parametrize("names", [TORCHRUN, MPIRUN], ids=["torchrun", "mpirun"])
def test_the_local_rank_is_optional(env: pytest.MonkeyPatch, names: tuple[str, str, str]) -> None:
    rank, size, _local = names
    setenv(env, **{rank: "1", size: "2"})
    assert launch_env() == (1, 2, None)


def test_torchrun_wins_over_mpirun(env: pytest.MonkeyPatch) -> None:
    setenv(env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    setenv(env, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0")
    assert launch_env() == (1, 2, 1)


def test_arguments_override_the_environment(env: pytest.MonkeyPatch) -> None:
    setenv(env, RANK="0", WORLD_SIZE="2")
    assert launch_env(rank=3, world_size=4)[:2] == (3, 4)
    setenv(env, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    assert launch_env(rank=1, world_size=2)[:2] == (1, 2)


def test_arguments_without_a_launcher(env: pytest.MonkeyPatch) -> None:
    assert launch_env(rank=2, world_size=3) == (2, 3, None)
    assert launch_env(rank=0, world_size=1) == (0, 1, None)


# (environment, words the message must contain, case-insensitively)
BAD_ENVIRONMENTS = [
    pytest.param({"RANK": "2", "WORLD_SIZE": "2"}, ["rank", "2"], id="rank-equals-size"),
    pytest.param({"RANK": "7", "WORLD_SIZE": "4"}, ["rank", "7", "4"], id="rank-above-size"),
    pytest.param({"RANK": "-1", "WORLD_SIZE": "2"}, ["rank", "-1"], id="negative-rank"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "0"}, ["world_size", "0"], id="empty-world"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "-2"}, ["world_size", "-2"], id="negative-size"),
    pytest.param({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK", "'one'"], id="word-rank"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2.0"}, ["WORLD_SIZE", "'2.0'"], id="float-size"),
    pytest.param({"RANK": "", "WORLD_SIZE": "2"}, ["RANK", "''"], id="empty-rank"),
    pytest.param({"RANK": "1"}, ["WORLD_SIZE"], id="rank-without-size"),
    pytest.param({"WORLD_SIZE": "2"}, ["RANK"], id="size-without-rank"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, ["local", "-1"], id="negative-local"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["local", "'x'"], id="word-local"),
    pytest.param(
        {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, ["rank", "4"], id="mpirun-rank-is-size"
    ),
    pytest.param(
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "two"},
        ["OMPI_COMM_WORLD_SIZE", "'two'"],
        id="mpirun-word-size",
    ),
]


def assert_says(exc: BaseException, words: list[str]) -> None:
    text = str(exc).lower()
    missing = [w for w in words if w.lower() not in text]
    assert not missing, f"the message {str(exc)!r} does not mention {missing}"


@pytest.mark.parametrize(("values", "words"), BAD_ENVIRONMENTS)
def test_inconsistent_environments_are_value_errors(
    env: pytest.MonkeyPatch, values: dict[str, str], words: list[str]
) -> None:
    setenv(env, **values)
    with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
        launch_env()
    assert_says(info.value, words)


@pytest.mark.parametrize(
    ("rank", "world_size", "words"),
    [
        (2, 2, ["rank", "2"]),
        (-1, 4, ["rank", "-1"]),
        (0, 0, ["world_size", "0"]),
        (1, None, ["world_size"]),  # one of the two, and no launcher to give the other
        (None, 2, ["rank"]),
    ],
)
def test_inconsistent_arguments_are_value_errors(
    env: pytest.MonkeyPatch, rank: int | None, world_size: int | None, words: list[str]
) -> None:
    with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
        launch_env(rank=rank, world_size=world_size)
    assert_says(info.value, words)


@pytest.mark.parametrize("bad", [1.5, "x", True])
def test_arguments_of_the_wrong_type_are_refused(env: pytest.MonkeyPatch, bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        launch_env(rank=bad, world_size=4)


def test_init_checks_the_environment_before_touching_cuda(env: pytest.MonkeyPatch) -> None:
    # These fail the same way with or without a GPU: nothing is initialised.
    setenv(env, RANK="3", WORLD_SIZE="2")
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group()
    env.delenv("RANK")
    env.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="nccl"):
        dist.init_process_group("gloo")
    with pytest.raises(ValueError, match="timeout"):
        dist.init_process_group(timeout=0)
    with pytest.raises(TypeError, match="timeout"):
        dist.init_process_group(timeout="5")  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_calls_before_init_say_what_to_do() -> None:
    assert not dist.is_initialized()
    for call in (dist.get_rank, dist.get_world_size, lambda: dist.new_group([0])):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()


# -- reduction ops ---------------------------------------------------------------------


def test_every_documented_op_is_accepted_and_distinct() -> None:
    ops = ("sum", "prod", "max", "min", "avg")
    codes = [check_op(op) for op in ops]
    assert len(set(codes)) == len(ops)
    # NCCL's ncclRedOp_t values: the checks need neither CuPy nor NCCL.
    assert dict(zip(ops, codes, strict=True)) == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


@pytest.mark.parametrize("bad", ["add", "mean", "", "sum ", None, 0, ("sum",)])
def test_unknown_ops_are_value_errors_that_list_the_valid_ones(bad: object) -> None:
    with pytest.raises(ValueError, match="op") as info:
        check_op(bad)
    assert all(op in str(info.value) for op in ("sum", "prod", "max", "min", "avg")), info.value


# -- the error -------------------------------------------------------------------------


def test_collective_error_is_a_cuda_error_that_says_who_what_and_why() -> None:
    assert issubclass(dist.CollectiveError, cudafut.CudaError)
    assert issubclass(dist.CollectiveError, RuntimeError)
    err = dist.CollectiveError(rank=3, op="all_reduce", size=8, reason="timed out after 5.0 s")
    assert (err.rank, err.op, err.size, err.reason) == (3, "all_reduce", 8, "timed out after 5.0 s")
    text = str(err)
    assert "all_reduce" in text and "rank 3" in text and "8" in text and "timed out after 5.0 s" in text
    assert not err.sticky  # a dead peer does not corrupt this process's CUDA context
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is dist.CollectiveError
    assert (again.rank, again.op, again.size, again.reason) == (3, "all_reduce", 8, err.reason)
    assert str(again) == text
    with pytest.raises(cudafut.CudaError) as info:  # code that handles failed GPU work handles it
        raise err
    assert info.value is err


def test_collective_errors_repr_and_str_do_not_call_it_a_cuda_error() -> None:
    # Issue 34: its repr said "CUDA error -1 (CollectiveError) ...".
    for err in (
        dist.CollectiveError(0, "all_reduce", 2, "a peer may have died", device=1),
        dist.CollectiveError(3, "broadcast", 8, "NCCL reported an error"),
    ):
        for again in (err, pickle.loads(pickle.dumps(err))):
            for text in (repr(again), str(again), "".join(traceback.format_exception_only(again))):
                assert "CUDA error" not in text and "-1" not in text, text
                assert again.op in text and f"rank {again.rank} of {again.size}" in text, text
                assert again.reason in text, text
            assert repr(again) == f"CollectiveError({str(again)!r})"


def test_public_names() -> None:
    names = {
        "init_process_group",
        "destroy_process_group",
        "is_initialized",
        "get_rank",
        "get_world_size",
        "new_group",
        "ProcessGroup",
        "CollectiveError",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "all_to_all",
        "send",
        "recv",
    }
    assert names <= set(dist.__all__), names - set(dist.__all__)
    assert set(dist.__all__) <= {name for name in dir(dist) if not name.startswith("_")}
    for name in dist.__all__:
        assert getattr(dist, name).__doc__, f"{name} has no docstring"


# -- what the import costs -------------------------------------------------------------


def test_import_needs_neither_torch_nor_cupy() -> None:
    # A finder first in line records every attempt, even one that would
    # fail on a machine without the package (try: import torch).
    proc = run_python(
        """
        import json, sys
        heavy = ("torch", "cupy", "cupyx", "cupy_backends")
        tried = []

        class Spy:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in heavy:
                    tried.append(name)
                return None

        sys.meta_path.insert(0, Spy())
        import cudafut.distributed as dist
        loaded = sorted(n for n in sys.modules if n.split(".")[0] in heavy)
        print(json.dumps({"tried": tried, "loaded": loaded, "initialised": dist.is_initialized()}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"tried": [], "loaded": [], "initialised": False}


# -- the group's bookkeeping and the watchdog, with scripted events --------------------


class _FakeComm:
    def __init__(self) -> None:
        self.error: str | None = None
        self.aborted = threading.Event()

    def check_async_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)

    def abort(self) -> None:
        self.aborted.set()


def _fake_group(timeout: float = 5.0) -> _group.ProcessGroup:
    return _group.ProcessGroup(_FakeComm(), 0, [0, 1], 0, timeout, "test", stream=object())


def _pending(group: _group.ProcessGroup, rec: FakeRecord, timeout: float = 5.0) -> _group._Pending:
    p = _group._Pending(group, "all_reduce", timeout)
    p.record = rec
    group._pending.append(p)
    return p


def test_a_deadline_passed_fails_every_pending_collective_and_aborts() -> None:
    g = _fake_group()
    recs = [FakeRecord(), FakeRecord()]
    for rec in recs:
        _pending(g, rec)
    assert g.check(time.monotonic())  # pending, nothing late
    assert not g.check(time.monotonic() + 10)  # past the 5 s deadline
    for rec in recs:
        err = rec.error()
        assert isinstance(err, dist.CollectiveError) and err.op == "all_reduce"
        assert "timeout of 5 s" in err.reason
    assert g.aborted and g._comm.aborted.wait(5)


def test_an_asynchronous_nccl_error_fails_the_group() -> None:
    g = _fake_group()
    rec = FakeRecord()
    _pending(g, rec)
    g._comm.error = "NCCL error 6: remote process exited"
    assert not g.check(time.monotonic())
    err = rec.error()
    assert isinstance(err, dist.CollectiveError) and "remote process exited" in err.reason


def test_completed_collectives_are_dropped_and_the_rest_kept() -> None:
    g = _fake_group()
    done, waiting = FakeRecord(), FakeRecord()
    done.complete()
    _pending(g, done)
    p = _pending(g, waiting)
    assert g.check(time.monotonic())
    assert list(g._pending) == [p]


class _HookedRecord(FakeRecord):
    """Runs ``hook`` at each query: another thread's look, made to happen here."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[], object]) -> None:
        super().__init__()
        self.hook = hook

    def query(self) -> int | None:
        self.hook()
        return super().query()


def test_a_check_never_drops_what_another_check_popped_first() -> None:
    # destroy() checks from the user's thread while the watchdog does: a
    # look must pop only what it saw complete, not a count of entries.
    g = _fake_group()
    inner: list[bool] = []

    def look_first() -> None:
        if not inner:
            inner.append(True)  # once: the inner look queries `first` too
            inner.append(g.check(time.monotonic()))

    first = _HookedRecord(look_first)
    first.complete()
    _pending(g, first)
    p2 = _pending(g, FakeRecord())
    assert g.check(time.monotonic())  # its query of `first` runs a whole look first
    assert inner == [True, True]
    assert list(g._pending) == [p2]  # the pending one is still watched


def test_the_watchdog_outlives_a_group_whose_check_raises() -> None:
    dog = _group._Watchdog()
    broken, healthy = _fake_group(), _fake_group(timeout=0.05)
    broken.check = lambda now: 1 / 0  # type: ignore[method-assign, assignment, return-value]
    rec = FakeRecord()
    _pending(healthy, rec, timeout=0.05)
    dog.watch(broken)
    dog.watch(healthy)
    deadline = time.monotonic() + 5
    while not (broken.aborted and healthy.aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broken.aborted is not None and "could not check" in broken.aborted
    assert healthy.aborted is not None and "timeout" in healthy.aborted  # still watched
    assert isinstance(rec.error(), dist.CollectiveError)


def test_a_completion_late_in_its_timeout_is_not_trusted() -> None:
    g = _fake_group()
    assert g.confirm("all_reduce", time.monotonic() + 10) is None
    assert not g.aborted
    err = g.confirm("all_gather", time.monotonic() - 1)
    assert isinstance(err, dist.CollectiveError) and err.op == "all_gather"
    assert "cannot be trusted" in err.reason and g.aborted


class _Confirmable(_events.EventRecord):
    __slots__ = ()

    def __del__(self) -> None:
        pass  # owns no CUDA event


class _SaysComplete:
    """A backend whose events are all complete (the rest is CUDA's): given
    to the records themselves, since the native core asks the driver
    directly, not a patched backend, once CUDA is loaded in the process."""

    def event_query(self, handle: int) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(_backend.cuda(), name)


def test_a_record_asks_its_producer_before_it_counts_as_complete() -> None:
    ok = _Confirmable(-1, 0, 0x77, (0, 0x77), 1, 0.0, _SaysComplete())
    ok.confirm = lambda: None
    assert ok.query() == 0 and ok.error() is None
    failed = _Confirmable(-2, 0, 0x77, (0, 0x77), 2, 0.0, _SaysComplete())
    error = dist.CollectiveError(0, "all_reduce", 2, "aborted")
    failed.confirm = lambda: error
    assert failed.query() == _events.FAILED
    assert failed.error() is error
    failed.fail_with(dist.CollectiveError(0, "x", 2, "later"))  # a failure is final
    assert failed.error() is error


# -- a collective's path on the host: the array's checks and the enqueue, on the fake GPU --


class _CaiArray:
    """A GPU array as the CUDA array interface describes it (a torch tensor's way)."""

    def __init__(self, shape: tuple[int, ...], typestr: str = "<f4", strides: object = None, device: int = 0):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "data": (0x7F0000001000, False),
            "version": 3,
        }
        self.device = type("device", (), {"index": device, "id": None})()


def _cupy_array(
    shape: tuple[int, ...], dtype: str = "float32", strides: object = None, device: int = 0
) -> Any:
    """A real cupy.ndarray over memory it does not own (made without a GPU; never read)."""
    cp = pytest.importorskip("cupy")
    from cupy.cuda import memory

    mem = memory.UnownedMemory(0x7F0000001000, 1 << 16, None, device_id=device)
    return cp.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0), strides=strides)


def _refusal(array: object) -> tuple[type[BaseException], str] | None:
    try:
        _ops._Buffer(array, "array", _fake_group())
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


def _operand_refusal(array: object) -> tuple[type[BaseException], str] | None:
    try:
        _ops._operand(array, _fake_group())
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


def _as_interface(x: Any) -> _CaiArray:
    """What CuPy's __cuda_array_interface__ says of ``x`` (strides only when not C-contiguous)."""
    strides = None if x.flags.c_contiguous else x.strides
    out = _CaiArray(x.shape, x.dtype.str, strides, x.data.device_id)
    out.__cuda_array_interface__["data"] = (x.data.ptr if x.size else 0, False)
    return out


@pytest.mark.parametrize(
    ("shape", "dtype", "strides"),
    [
        ((1024,), "float32", None),
        ((4, 8), "int64", None),
        ((4, 4), "float32", (4, 16)),  # transposed: not C-contiguous
        ((2, 1), "float32", (4, 999)),  # a dimension of one, whatever its stride: contiguous
        ((8,), "float32", (8,)),  # every other element
        ((1,), "float32", (8,)),  # one element: contiguous
        ((0, 4), "float16", None),  # empty: no pointer, no device
        ((16,), "bool", None),  # a dtype NCCL does not take
        ((16,), "complex64", None),
    ],
)
def test_a_cupy_array_is_read_as_its_interface_says(
    shape: tuple[int, ...], dtype: str, strides: tuple[int, ...] | None
) -> None:
    x = _cupy_array(shape, dtype, strides)
    via = _as_interface(x)
    assert _refusal(x) == _refusal(via)
    if _refusal(x) is None:
        fast, slow = _ops._Buffer(x, "array", _fake_group()), _ops._Buffer(via, "array", _fake_group())
        assert fast.array is x
        for name in ("count", "dtype", "itemsize", "ptr", "shape", "typestr"):
            assert getattr(fast, name) == getattr(slow, name), name
        # The in-place collectives' reading (no _Buffer): the same fields.
        assert _ops._operand(x, _fake_group()) == (slow.ptr, slow.count, slow.dtype)
        assert _ops._operand(via, _fake_group()) == (slow.ptr, slow.count, slow.dtype)
    else:
        assert _operand_refusal(x) == _refusal(x)


def test_a_cupy_array_on_another_device_is_refused_as_before() -> None:
    x = _cupy_array((16,), device=1)
    refusal = _refusal(x)
    assert refusal == _refusal(_as_interface(x))
    assert refusal == (ValueError, "array is on device 1, but this rank's group runs on device 0")


def test_non_contiguous_and_bad_dtypes_keep_their_messages() -> None:
    assert _refusal(_cupy_array((4, 4), strides=(4, 16))) == (
        ValueError,
        "array must be C-contiguous (copy it with .copy() first)",
    )
    kind, text = _refusal(_cupy_array((4,), "bool")) or (None, "")
    assert kind is TypeError and "dtype '|b1', which NCCL cannot reduce or move" in text


def test_other_arrays_go_through_the_interface() -> None:
    buf = _ops._Buffer(_CaiArray((3, 5), "<i4"), "array", _fake_group())
    assert (buf.count, buf.dtype, buf.itemsize, buf.shape, buf.typestr) == (15, 2, 4, (3, 5), "<i4")
    assert _refusal(_CaiArray((4, 4), strides=(4, 16))) == (
        ValueError,
        "array must be C-contiguous (copy it with .copy() first)",
    )
    assert _refusal(_CaiArray((4,), device=1)) == (
        ValueError,
        "array is on device 1, but this rank's group runs on device 0",
    )
    kind, text = _refusal(object()) or (None, "")
    assert kind is TypeError and "must be a GPU array" in text


class _StubNccl:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def allReduce(self, *args: Any) -> None:  # noqa: N802 - CuPy's name
        self.calls.append(args)

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def test_a_collective_on_the_fake_gpu(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _StubNccl()
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 5.0, "test")
    waits: list[tuple[int, int]] = []
    real_wait = _backend.current.stream_wait

    def stream_wait(stream: int, event: int, device: int) -> None:
        waits.append((stream, event))
        real_wait(stream, event, device)

    monkeypatch.setattr(_backend.current, "stream_wait", stream_wait)
    holds: list[object] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: holds.append(obj))
    x = _CaiArray((256,))
    fut = dist.all_reduce(x, "max", group=g)
    assert stub.calls == [(0x7F0000001000, 0x7F0000001000, 256, 7, 2, g.stream.ptr)]
    assert [s for s, _ in waits] == [g.stream.ptr]  # the communication stream waits on the caller's
    (entry,) = g._pending
    assert entry.keep == (x, x) and entry.record is _interface.records_of(fut)[0]
    del fut  # the group keeps the array until the collective ends: the future holds nothing
    assert holds == []
    with g.stream:  # called on the communication stream itself: no wait
        fut = dist.all_reduce(x, group=g)
    assert len(waits) == 1 and len(g._pending) == 2
    fake_cuda.complete(fut)
    assert fut.result(timeout=5) is x
    deadline = time.monotonic() + 5
    while g._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not g._pending  # the watchdog dropped both, and what they kept
    with pytest.raises(ValueError, match="C-contiguous"):
        dist.all_reduce(_CaiArray((4, 4), strides=(4, 16)), group=g)
    assert len(stub.calls) == 2  # nothing enqueued for the refused one


def test_destroy_hands_a_dropped_pending_collectives_arrays_to_the_lifetimes(fake_cuda: Any) -> None:
    """A collective still pending when destroy() gives up (its own timeout
    longer than the group's): nothing looks at the group's entry again, so
    its arrays live until its record ends, then go, as a dropped future's
    finalizer would have let them."""
    g = _group.ProcessGroup(_nccl.Communicator(_StubNccl()), 0, [0, 1], 0, 0.2, "test")
    x = _CaiArray((4,))
    alive = weakref.ref(x)
    fut = dist.all_reduce(x, group=g, timeout=math.inf)
    del fut, x
    g.destroy()  # waits out the group's 0.2 s, then destroys the communicator
    assert not g._pending
    gc.collect()
    assert alive() is not None  # the collective's record has not ended
    fake_cuda.complete_all()
    deadline = time.monotonic() + 30
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert alive() is None


# -- the group's entries, aborts and destroy, on the fake GPU ------------------------


def _wait_until(cond: Callable[[], object], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(cond())


def test_an_entry_is_its_records_confirm_and_lets_go_of_it_once_done(fake_cuda: Any) -> None:
    g = _group.ProcessGroup(_nccl.Communicator(_StubNccl()), 0, [0, 1], 0, 5.0, "test")
    x = _CaiArray((4,))
    fut = dist.all_reduce(x, group=g)
    (entry,) = g._pending
    rec = _interface.records_of(fut)[0]
    assert rec.confirm is entry and entry.record is rec  # no closure per call
    assert entry() is None  # a confirm: no NCCL error, in time
    fake_cuda.complete(fut)
    assert fut.result(timeout=5) is x

    # Dropped by the watchdog: the record no longer refers to the entry (the
    # cycle is broken: reference counting frees both), nor the entry to x.
    def dropped(r: _events.EventRecord = rec) -> bool:
        return not g._pending and r.confirm is None

    assert _wait_until(dropped)
    assert entry.keep is None
    alive = weakref.ref(x)
    gc.disable()
    try:
        del fut, rec, entry, x
        assert _wait_until(lambda: alive() is None)  # without the cyclic collector
    finally:
        gc.enable()


class _BlockingNccl(_StubNccl):
    """A communicator whose allReduce blocks until abort() (a first send to
    a peer that never comes), and that records which of destroy and abort ran."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()
        self.ended: list[str] = []

    def allReduce(self, *args: Any) -> None:  # noqa: N802 - CuPy's name
        self.inside.set()
        self.release.wait(10)
        super().allReduce(*args)

    def abort(self) -> None:
        self.ended.append("abort")
        self.release.set()

    def destroy(self) -> None:
        self.ended.append("destroy")


def test_destroy_never_frees_a_communicator_a_call_is_inside(fake_cuda: Any) -> None:
    stub = _BlockingNccl()
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 0.2, "test")
    x = _CaiArray((4,))
    got: list[object] = []

    def call() -> None:
        try:
            got.append(dist.all_reduce(x, group=g, timeout=math.inf))  # no timeout of its own
        except Exception as exc:
            got.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert stub.inside.wait(5)
    g.destroy()  # waits out the group's 0.2 s: the call is still inside NCCL
    assert g.aborted is not None and "still inside NCCL" in g.aborted
    assert _wait_until(lambda: stub.ended == ["abort"])  # never ncclCommDestroy under the call
    caller.join(5)
    (fut,) = got
    assert isinstance(fut, cudafut.CudaFuture)  # NCCL took it: its event says how it ended
    fake_cuda.complete_all()
    with pytest.raises(dist.CollectiveError, match="still inside NCCL"):
        fut.result(timeout=5)
    with pytest.raises(dist.CollectiveError, match="aborted earlier"):
        dist.all_reduce(x, group=g)


def test_destroy_waits_past_its_deadline_for_a_holder_not_inside_nccl(fake_cuda: Any) -> None:
    # At destroy()'s deadline the call lock is held by a thread that is not
    # inside NCCL (a call's bookkeeping, stretched here): destroy waits for
    # it and frees the communicator, instead of aborting the group.
    stub = _StubNccl()
    ended: list[str] = []
    stub.destroy = lambda: ended.append("destroy")  # type: ignore[method-assign]
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 0.05, "test")
    held = threading.Event()

    def hold() -> None:
        with g._call_lock:
            held.set()
            time.sleep(0.2)  # past the group's 0.05 s

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    g.destroy()
    holder.join(5)
    assert g.aborted == "the group was destroyed" and ended == ["destroy"]


def test_ctrl_c_in_a_call_leaves_the_group_usable_and_its_arrays_held_past_a_fence(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A KeyboardInterrupt raised in the binding (before or after NCCL took
    # the call: nothing says which) propagates as itself; the group is not
    # left "calling" (the watchdog would abort it as timed out), and the
    # arrays are held until a fence recorded after the call passes.
    stub = _StubNccl()
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 5.0, "test")
    holds: list[tuple[object, object]] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: holds.append((records, obj)))
    x = _CaiArray((4,))

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    stub.allReduce = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        dist.all_reduce(x, group=g)
    assert g._calling is None and g.aborted is None
    ((records, kept),) = holds
    assert len(records) == 1 and kept == [(x, x)]  # type: ignore[arg-type]  # (value, keep): all_reduce keeps x
    del stub.allReduce
    assert isinstance(dist.all_reduce(x, group=g), cudafut.CudaFuture)  # still usable


def test_destroy_holds_the_call_lock_while_it_frees_the_communicator(fake_cuda: Any) -> None:
    stub = _StubNccl()
    seen: list[bool] = []
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 5.0, "test")
    stub.destroy = lambda: seen.append(g._call_lock.locked())  # type: ignore[method-assign]
    g.destroy()
    assert seen == [True] and not g._call_lock.locked()
    assert g.aborted == "the group was destroyed"


def test_an_abort_keeps_the_failed_arrays_until_the_stream_passes_a_fence(fake_cuda: Any) -> None:
    g = _group.ProcessGroup(_nccl.Communicator(_StubNccl()), 0, [0, 1], 0, 5.0, "test")
    x = _CaiArray((4,))
    alive = weakref.ref(x)
    fut = dist.all_reduce(x, group=g)
    rec = _interface.records_of(fut)[0]
    del fut, x
    g.abort("a peer died")
    assert isinstance(rec.error(), dist.CollectiveError)  # failed from the host at once
    assert not g._pending and rec.confirm is None
    del rec
    gc.collect()
    time.sleep(0.05)
    gc.collect()
    assert alive() is not None  # NCCL's kernel may still use it: kept past the fence
    fake_cuda.complete_all()  # the stream passed the fence (the aborted kernel ended)
    assert _wait_until(lambda: gc.collect() >= 0 and alive() is None, 30)


def test_an_abort_keeps_the_arrays_for_ever_where_no_fence_can_be_recorded(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = _group.ProcessGroup(_nccl.Communicator(_StubNccl()), 0, [0, 1], 0, 5.0, "test")
    x = _CaiArray((4,))
    fut = dist.all_reduce(x, group=g)
    forever: list[object] = []
    monkeypatch.setattr(_lifetimes, "keep_forever", forever.append)
    monkeypatch.setattr(_events, "record", _refuse_record)
    g.abort("a peer died")
    assert forever == [[(x, x)]]
    assert isinstance(_interface.records_of(fut)[0].error(), dist.CollectiveError)


def _refuse_record(*args: Any, **kw: Any) -> Any:
    raise cudafut.CudaError(700, "cudaErrorIllegalAddress", "an illegal memory access")


def _refusing_the_collectives_record() -> Callable[..., Any]:
    """_events.record, refusing the record that follows an NCCL call (the
    one given a confirm; the pure core's wait on the caller's stream records
    through it too)."""
    real = _events.record

    def record(stream: int, device: int, confirm: Any = None, owner: object = None) -> Any:
        if confirm is not None:
            _refuse_record()
        return real(stream, device, confirm, owner)

    return record


def test_a_record_failure_after_nccl_took_the_call_aborts_and_keeps_the_arrays_for_ever(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = _StubNccl()
    ended: list[str] = []
    stub.abort = lambda: ended.append("abort")  # type: ignore[method-assign]
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 5.0, "test")
    x = _CaiArray((4,))
    forever: list[object] = []
    monkeypatch.setattr(_lifetimes, "keep_forever", forever.append)
    monkeypatch.setattr(_events, "record", _refusing_the_collectives_record())
    with pytest.raises(
        dist.CollectiveError, match="no event could be recorded after NCCL took all_reduce"
    ) as info:
        dist.all_reduce(x, group=g)
    assert isinstance(info.value.__cause__, cudafut.CudaError)
    assert len(stub.calls) == 1  # NCCL took it
    assert forever[0] == (x, x)  # its kernel may run: never freed
    assert g._calling is None and not g._pending and not g._call_lock.locked()
    assert g.aborted is not None and _wait_until(lambda: ended == ["abort"])
    with pytest.raises(dist.CollectiveError, match="aborted earlier"):
        dist.all_reduce(x, group=g)


def test_ctrl_c_in_the_record_after_nccl_took_the_call_stays_itself(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same failure as above, by a KeyboardInterrupt: it propagates as
    # itself (not a CollectiveError), and the group is aborted all the same.
    g = _group.ProcessGroup(_nccl.Communicator(_StubNccl()), 0, [0, 1], 0, 5.0, "test")
    x = _CaiArray((4,))
    forever: list[object] = []
    monkeypatch.setattr(_lifetimes, "keep_forever", forever.append)
    real = _events.record

    def record(stream: int, device: int, confirm: Any = None, owner: object = None) -> Any:
        if confirm is not None:
            raise KeyboardInterrupt
        return real(stream, device, confirm, owner)

    monkeypatch.setattr(_events, "record", record)
    with pytest.raises(KeyboardInterrupt):
        dist.all_reduce(x, group=g)
    assert forever == [(x, x)] and g._calling is None and g.aborted is not None


def test_a_collective_from_another_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudafut import testing

    with testing.fake_cuda(devices=2) as fake:
        stub = _StubNccl()
        g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 1, 5.0, "test")
        seen: list[int] = []
        real = _events.follow_current

        def follow(stream: int, device: int) -> None:
            seen.append(_backend.current.current_device())
            real(stream, device)

        monkeypatch.setattr(_events, "follow_current", follow)
        x = _CaiArray((4,), device=1)
        assert _events.current_device() == 0
        fut = dist.all_reduce(x, group=g)
        assert seen == [1] and _events.current_device() == 0  # on the group's device, then back
        fake.complete(fut)
        assert fut.result(timeout=5) is x
        g.destroy()


class _AbortedDuringTheCall(_StubNccl):
    """A communicator during whose allReduce another thread aborts the group
    (the watchdog past the call's deadline, destroy() under the call); NCCL
    then takes the call all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.group: _group.ProcessGroup | None = None

    def allReduce(self, *args: Any) -> None:  # noqa: N802 - CuPy's name
        assert self.group is not None
        self.group.abort("a peer died")
        super().allReduce(*args)


def test_a_call_nccl_took_while_the_group_was_aborted_fails_with_the_abort(fake_cuda: Any) -> None:
    stub = _AbortedDuringTheCall()
    g = _group.ProcessGroup(_nccl.Communicator(stub), 0, [0, 1], 0, 5.0, "test")
    stub.group = g
    x = _CaiArray((4,))
    alive = weakref.ref(x)
    fut = dist.all_reduce(x, group=g)
    assert len(stub.calls) == 1  # NCCL took it
    rec = _interface.records_of(fut)[0]
    err = rec.error()  # failed from the host at once, as the abort's other entries
    assert isinstance(err, dist.CollectiveError) and "a peer died" in err.reason
    assert not g._pending and not g.busy()  # not left behind for a look that never comes
    assert rec.confirm is None
    with pytest.raises(dist.CollectiveError, match="a peer died"):
        fut.result(timeout=5)
    del fut, rec, err, x
    gc.collect()
    assert alive() is not None  # its kernel may still run: kept past a fence after it
    fake_cuda.complete_all()
    assert _wait_until(lambda: gc.collect() >= 0 and alive() is None, 30)


class _RacedRecord(FakeRecord):
    """Runs ``on_query`` at its first query and ``on_fail`` after its first
    failure from the host: two threads' steps, made to interleave."""

    __slots__ = ("on_fail", "on_query")

    def __init__(self, on_query: Callable[[], object], on_fail: Callable[[], object]) -> None:
        super().__init__()
        self.on_query: Callable[[], object] | None = on_query
        self.on_fail: Callable[[], object] | None = on_fail

    def query(self) -> int | None:
        hook, self.on_query = self.on_query, None
        if hook is not None:
            hook()
        return super().query()

    def fail_with(self, error: Exception) -> None:
        super().fail_with(error)
        hook, self.on_fail = self.on_fail, None
        if hook is not None:
            hook()


def test_a_look_during_an_abort_never_lets_the_failed_arrays_go(monkeypatch: pytest.MonkeyPatch) -> None:
    # The watchdog's look took its list of entries, then another thread's
    # abort failed them from the host: the look sees them "done" (their
    # status is final), but their kernels may still run. The abort keeps
    # their arrays past its fence; the look must not let go of them first.
    g = _fake_group()
    looking, failed = threading.Event(), threading.Event()
    look = threading.Thread(target=lambda: g.check(time.monotonic()))

    def after_fail() -> None:
        failed.set()
        look.join(5)  # the look ends before the abort gathers the arrays

    def in_the_look() -> None:
        looking.set()
        failed.wait(5)  # the abort fails the entry meanwhile

    rec = _RacedRecord(in_the_look, after_fail)
    p = _pending(g, rec)
    arrays = object()
    p.keep = arrays
    kept: list[object] = []
    monkeypatch.setattr(_lifetimes, "keep_forever", kept.append)  # (this group's stream has no handle)
    look.start()
    assert looking.wait(5)
    g.abort("a peer died")
    assert not look.is_alive()
    assert isinstance(rec.error(), dist.CollectiveError)
    assert kept == [[arrays]]
