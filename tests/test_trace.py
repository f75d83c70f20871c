"""Tracing (``cudafut.trace``) and the waiters' debug log, on the host: a
pipeline of futures runs on scripted events and streams (no GPU), the trace
file is parsed back and checked event by event."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import cudafut
from cudafut import _backend, _cuda, _events, _policy, _pools
from cudafut._trace import hooks, pool, recorder
from tests.fakes import FakeRecord

#: The phases a cudafut trace uses (Chrome trace-event format).
PHASES = {"M", "X", "i", "b", "e", "s", "f"}


# -- a fake GPU: streams, events and a GPU clock, all on the host ------------------------


class _Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _StreamPool:
    """Stands in for ``_pools.streams``: a new stream for each ``get``."""

    def __init__(self) -> None:
        self._ptrs = itertools.count(0x1000)
        self.owned: dict[int, _Stream] = {}

    def get(self, device: int, priority: int) -> _Stream:
        stream = _Stream(next(self._ptrs))
        self.owned[stream.ptr] = stream
        return stream

    def lookup(self, handle: int, priority: int) -> _Stream | None:
        return self.owned.get(handle)


class _Timing:
    """Stands in for the CUDA timing events: an event 'runs' when recorded
    (its GPU time is the host time then), unless the test holds it back."""

    def __init__(self) -> None:
        self._handles = itertools.count(1)
        self.times: dict[int, float] = {}
        self.acquired: list[int] = []
        self.released: list[int] = []
        self.hold_back = False  # events recorded meanwhile stay pending
        self.pending: set[int] = set()

    def usable(self) -> bool:
        return True

    def acquire(self, device: int) -> int:
        handle = next(self._handles)
        self.acquired.append(handle)
        return handle

    def release(self, device: int, handle: int) -> None:
        self.released.append(handle)

    def record(self, handle: int, stream: int, device: int) -> None:
        self.times[handle] = time.perf_counter()
        if self.hold_back:
            self.pending.add(handle)

    def ref_stream(self, device: int) -> int:
        return 0xEEEE

    def done(self, handle: int) -> bool:
        return handle not in self.pending

    def elapsed_ms(self, ref: int, handle: int) -> float | None:
        if handle in self.pending:
            return None
        return (self.times[handle] - self.times[ref]) * 1e3


class FakeGpu:
    """What the ``fake_gpu`` fixture patches in, and the records it made."""

    def __init__(self) -> None:
        self.records: list[FakeRecord] = []
        self.sequence: dict[tuple[int, ...], int] = {}
        self.timing = _Timing()
        self.streams = _StreamPool()

    def record(self, stream: int, device: int, confirm: object = None, owner: object = None) -> FakeRecord:
        key = (device, stream)
        self.sequence[key] = seq = self.sequence.get(key, 0) + 1
        rec = FakeRecord(stream, seq, device)
        self.records.append(rec)
        return rec

    def complete_all(self) -> None:
        for rec in list(self.records):
            rec.complete()

    def complete_when(self, ready: Callable[[], bool]) -> threading.Thread:
        """Complete every record, from another thread, once ``ready()``
        (looked at every 0.5 ms, for 10 s at most): the waiters' paths are
        then the same however slowly this machine runs."""

        def run() -> None:
            deadline = time.monotonic() + 10
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.0005)
            self.complete_all()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def sleeping(waiter: str) -> Callable[[], bool]:
    """Whether a traced waiter whose name holds ``waiter`` has planned a sleep."""

    def ready() -> bool:
        tr = hooks.active
        return tr is not None and any(
            waiter in w.name
            and ((w.open is not None and w.open[0] == "sleep") or any(s[0] == "sleep" for s in w.slices))
            for w in list(tr.waiters)
        )

    return ready


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    gpu = FakeGpu()
    monkeypatch.setattr(_events, "record", gpu.record)
    monkeypatch.setattr(_events, "_sequence", gpu.sequence)
    monkeypatch.setattr(_pools, "streams", gpu.streams)
    monkeypatch.setattr(_backend.current, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "check_device", lambda device: device)
    monkeypatch.setattr(_backend.current, "current_stream", lambda device: _Stream(0x10))
    monkeypatch.setattr(_backend.current, "stream_wait", lambda stream, event, device: None)
    monkeypatch.setattr(
        _backend.current, "call_on_streams", lambda streams, primary, fn, args, kwargs: fn(*args, **kwargs)
    )
    monkeypatch.setattr(pool, "timing", gpu.timing)
    yield gpu
    gpu.complete_all()  # nothing left for the watcher thread to poll


@pytest.fixture(autouse=True)
def _no_trace_left() -> Iterator[None]:
    old = cudafut.set_wait_policy("balanced")
    yield
    cudafut.set_wait_policy(old)
    _policy.predictor.clear()
    leaked = hooks.active
    if leaked is not None:
        hooks.set_active(None)
        pytest.fail("a test left a trace recording")


# -- reading a trace back --------------------------------------------------------------------


class Parsed:
    """A trace file, parsed and checked against the trace-event format."""

    def __init__(self, doc: dict[str, Any]) -> None:
        assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
        self.doc = doc
        self.other: dict[str, Any] = doc["otherData"]
        self.events: list[dict[str, Any]] = doc["traceEvents"]
        for e in self.events:
            assert e["ph"] in PHASES, e
            assert isinstance(e["pid"], int), e
            if e["ph"] != "M":
                assert isinstance(e["ts"], (int, float)) and isinstance(e["tid"], int), e
                assert isinstance(e["name"], str) and isinstance(e["cat"], str), e
            if e["ph"] == "X":
                assert e["dur"] >= 0, e
        self.threads = {
            (e["pid"], e["tid"]): e["args"]["name"] for e in self.events if e["name"] == "thread_name"
        }
        self.processes = {e["pid"]: e["args"]["name"] for e in self.events if e["name"] == "process_name"}

    @classmethod
    def file(cls, path: Path) -> Parsed:
        return cls(json.loads(path.read_text(encoding="utf-8")))

    def named(self, name: str, ph: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("name") == name and (ph is None or e["ph"] == ph)]

    def one(self, name: str, ph: str | None = None) -> dict[str, Any]:
        found = self.named(name, ph)
        assert len(found) == 1, (name, found)
        return found[0]

    def gpu(self, fid: int) -> dict[str, Any]:
        (slice_,) = [
            e for e in self.events if e["ph"] == "X" and e["cat"] == "gpu" and e["args"]["future"] == fid
        ]
        return slice_

    def track(self, event: dict[str, Any]) -> str:
        return str(self.threads[(event["pid"], event["tid"])])

    def flows(self, cat: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(start, finish) of each flow of ``cat``; every start has one finish."""
        starts = {e["id"]: e for e in self.events if e["ph"] == "s" and e["cat"] == cat}
        ends = {e["id"]: e for e in self.events if e["ph"] == "f" and e["cat"] == cat}
        assert set(starts) == set(ends), (starts, ends)
        assert all(e["bp"] == "e" for e in ends.values())
        return [(starts[i], ends[i]) for i in sorted(starts)]

    def slice_at(self, point: dict[str, Any]) -> dict[str, Any]:
        """The innermost X slice of ``point``'s track that holds its time
        strictly: where a viewer binds a flow event."""
        holding = [
            e
            for e in self.events
            if e["ph"] == "X"
            and (e["pid"], e["tid"]) == (point["pid"], point["tid"])
            and e["ts"] < point["ts"] < e["ts"] + e["dur"]
        ]
        assert holding, point
        return min(holding, key=lambda e: e["dur"])

    def check_nesting(self) -> None:
        """X slices of one track never partly overlap (viewers need that)."""
        tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for e in self.events:
            if e["ph"] == "X":
                tracks.setdefault((e["pid"], e["tid"]), []).append(e)
        for slices in tracks.values():
            stack: list[float] = []
            for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
                while stack and stack[-1] <= e["ts"] + 1e-3:
                    stack.pop()
                end = e["ts"] + e["dur"]
                assert not stack or end <= stack[-1] + 1e-3, ("partial overlap", e)
                stack.append(end)


def load(x: Any) -> Any:
    return x + 1


def double(x: Any) -> Any:
    return x * 2


def triple(x: Any) -> Any:
    return x * 3


# -- a pipeline ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_pipeline_traced_on_a_loop(
    fake_gpu: FakeGpu, tmp_path: Path, anyio_backend: tuple[str, dict[str, object]]
) -> None:
    path = tmp_path / "trace.json"
    async with cudafut.trace(path) as tr:
        first = cudafut.submit(load, 1)
        second = first.then(double)
        third = second.then(triple)
        plain: cudafut.CudaFuture[int] = cudafut.CudaFuture(devices=0)
        plain.set_result(5)
        fake_gpu.complete_when(sleeping("waiter"))  # the waiter spins, then sleeps
        with anyio.fail_after(10):
            assert await third == 12
            assert await plain == 5
    t = Parsed.file(path)
    assert tr.events == t.events
    t.check_nesting()
    assert t.other["futures"] == 4 and t.other["gpu_timing"] is True and t.other["gpu_incomplete"] == 0
    assert t.processes[1].startswith("host (pid ") and t.processes[100] == "GPU 0"

    # created and set, on the thread that did it, with the streams
    assert t.track(t.one("create #1 submit(load)", "i")) == "MainThread"
    set1 = t.one("set #1 submit(load)", "X")
    assert set1["args"]["devices"] == [0] and set1["args"]["streams"] == ["stream 0x1000 (cudafut pool)"]
    assert t.one("create #2 then(double)")["args"]["parent"] == 1
    assert t.one("set #4 CudaFuture()")["args"]["streams"] == ["stream 0x10"]

    # the functions, with their host time, inside the future they make
    for name in ("submit #1 load", "then #2 double", "then #3 triple"):
        assert t.track(t.one(name, "X")) == "MainThread"

    # GPU work: then() continues on the parent's pool stream, in order
    gpu = [t.gpu(fid) for fid in (1, 2, 3)]
    assert {t.track(g) for g in gpu} == {"stream 0x1000 (cudafut pool)"}
    for parent, child in itertools.pairwise(gpu):
        assert child["ts"] >= parent["ts"] + parent["dur"] - 1e-3
    # the plain future is the first point cudafut recorded on its stream:
    # your own CudaFuture()'s work starts no earlier than it was made
    plain_gpu = t.gpu(4)
    assert t.track(plain_gpu) == "stream 0x10"
    assert plain_gpu["ts"] == t.one("create #4 CudaFuture()")["ts"]

    # then(): parent -> child arrows, bound inside the GPU slices
    then = t.flows("then")
    assert [(t.slice_at(s)["name"], t.slice_at(f)["name"]) for s, f in then] == [
        ("#1 submit(load)", "#2 then(double)"),
        ("#2 then(double)", "#3 then(triple)"),
    ]

    # who saw the work done: the loop's waiter, with an arrow from the GPU work
    waiter = "trio waiter" if anyio_backend[0] == "trio" else "waiter"
    wakes = t.flows("wake-up")
    assert wakes
    for s, f in wakes:
        gpu_slice, wake = t.slice_at(s), t.slice_at(f)
        assert gpu_slice["cat"] == "gpu" and wake["name"] == "wake-up"
        assert t.track(wake).startswith("waiter: ") and waiter in t.track(wake)
        assert gpu_slice["args"]["future"] in wake["args"]["futures"]
    assert waiter in t.gpu(3)["args"]["observed_by"]

    # the awaits: async slices (tasks overlap on a thread), begin and end
    begins = {e["args"]["future"]: e for e in t.named("await", "b")}
    assert sorted(begins) == [3, 4]
    assert waiter in begins[3]["args"]["observed_by"]
    # the plain future's work completed with the rest: done at the await
    assert begins[4]["args"]["observed_by"] == "a query: done when looked at"
    assert sorted(e["id"] for e in t.named("await", "e")) == sorted(e["id"] for e in begins.values())

    # the waiter's own track: what it did while the work ran
    kinds = {e["name"] for e in t.events if e["ph"] == "X" and e["cat"] == "waiter"}
    assert "wake-up" in kinds and kinds & {"spin", "spin (lone await)"} and "sleep" in kinds
    for e in t.named("sleep", "X"):
        assert e["args"]["planned_us"] > 0 and ("late_us" in e["args"] or e["args"]["woken_early"])
    assert fake_gpu.timing.released and sorted(fake_gpu.timing.released) == fake_gpu.timing.acquired


def test_result_then_and_a_done_callback_off_the_loop(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    done = threading.Event()
    with cudafut.trace(str(path)):  # a str path too
        parent: cudafut.CudaFuture[int] = cudafut.CudaFuture(devices=0)
        parent.set_result(1)
        fake_gpu.complete_when(sleeping("result()"))
        assert parent.result(timeout=10) == 1
        child = parent.then(double)

        def on_done(fut: cudafut.CudaFuture[Any]) -> None:
            done.set()

        fake_gpu.complete_when(sleeping("watcher thread"))
        child.add_done_callback(on_done)
        assert done.wait(10)
    t = Parsed.file(path)
    t.check_nesting()

    result = t.one("result() #1", "X")
    assert t.track(result) == "MainThread"
    assert result["args"]["observed_by"] == "result() (MainThread)"
    on_result_track = [
        e["name"] for e in t.events if e["ph"] == "X" and t.track(e) == "waiter: result() (MainThread)"
    ]
    assert "wake-up" in on_result_track
    callback = t.one("callback #2 on_done", "X")
    assert t.track(callback) == "cudafut-watcher"
    assert t.gpu(2)["args"]["observed_by"] == "watcher thread (cudafut-watcher)"
    ((s, f),) = t.flows("then")
    assert (t.slice_at(s)["name"], t.slice_at(f)["name"]) == ("#1 CudaFuture()", "#2 then(double)")
    assert t.track(t.slice_at(f)) != t.track(t.slice_at(s))  # a pool stream, waiting on the parent's


def test_failures_cancellations_and_futures_never_set(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"

    def boom(x: Any) -> Any:
        raise KeyError("boom")

    with cudafut.trace(path):
        failed: cudafut.CudaFuture[int] = cudafut.CudaFuture()
        failed.set_exception(ValueError("bad"))
        pending: cudafut.CudaFuture[int] = cudafut.CudaFuture()
        child = pending.then(double)
        pending.cancel()
        raising = cudafut.submit(load, 1).then(boom)
    assert child.cancelled() and isinstance(raising.exception(timeout=0), KeyError)
    assert isinstance(failed.exception(), ValueError)
    t = Parsed.file(path)
    assert t.one("fail #1 CudaFuture()")["args"]["state"] == "failed"
    assert t.one("cancel #2 CudaFuture()")["args"]["state"] == "cancelled"
    assert t.one("cancel #3 then(double)")["args"]["parent"] == 2
    assert "KeyError" in t.one("then #5 boom", "X")["args"]["error"]
    assert t.one("fail #5 then(boom)")["args"]["state"] == "failed"
    assert t.named("never set #1 CudaFuture()") == []
    with cudafut.trace(path):
        cudafut.CudaFuture()
    assert (
        Parsed.file(path).one("never set #1 CudaFuture()", "i")["args"]["state"]
        == "pending when the trace ended"
    )


def test_work_still_running_when_the_trace_ends_is_marked(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    fake_gpu.timing.hold_back = True
    with cudafut.trace(path, timeout=0):  # no waiting
        cudafut.submit(load, 1)
    t = Parsed.file(path)
    assert t.other["gpu_incomplete"] == 1
    mark = t.one("#1 submit(load) (not complete)", "i")
    assert t.track(mark) == "stream 0x1000 (cudafut pool)" and mark["args"]["incomplete"]


# -- one trace at a time; the exit; no state left ----------------------------------------------


def test_traces_cannot_nest_or_overlap() -> None:
    with cudafut.trace(None) as outer:
        with pytest.raises(RuntimeError, match="recording already"), cudafut.trace(None):
            pass  # pragma: no cover - never entered
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                cudafut.trace(None).start()
            except RuntimeError as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "cannot nest or overlap" in str(errors[0])
        assert hooks.active is not None and repr(outer).startswith("<cudafut.Trace recording")
    with pytest.raises(RuntimeError, match="recorded already"), outer:
        pass  # pragma: no cover
    with pytest.raises(RuntimeError, match="not recording"):
        cudafut.trace(None).stop()
    # after the outer one, a new one may start
    tr = cudafut.trace(None).start()
    tr.stop()
    assert tr.events is not None and repr(tr).startswith("<cudafut.Trace written")


def test_the_trace_is_written_when_the_block_raises(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"

    def block() -> None:
        with cudafut.trace(path):
            cudafut.submit(load, 1)
            raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        block()
    t = Parsed.file(path)
    assert "KeyError('inside')" in t.other["exception"]
    t.one("submit #1 load", "X")


def test_a_write_error_never_hides_the_blocks_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nowhere = tmp_path / "missing" / "trace.json"
    with pytest.raises(KeyError), cudafut.trace(nowhere):
        raise KeyError("the block's")
    assert "could not write the trace" in caplog.text
    with pytest.raises(FileNotFoundError), cudafut.trace(nowhere):
        pass
    assert hooks.active is None


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="file path"):
        cudafut.trace(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        cudafut.trace(None, timeout=-1)
    with pytest.raises(ValueError, match="non-negative"):
        cudafut.trace(None, timeout=float("nan"))
    with pytest.raises(TypeError, match="nvtx"):
        cudafut.trace(None, nvtx="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gpu_timing"):
        cudafut.trace(None, gpu_timing=1)  # type: ignore[arg-type]
    assert cudafut.trace(tmp_path / "t.json").path == tmp_path / "t.json"
    assert isinstance(cudafut.trace(None), cudafut.Trace)


def test_tracing_off_leaves_no_state(
    fake_gpu: FakeGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cudafut.trace(tmp_path / "trace.json") as tr:
        assert hooks.active is not None
        tracer = weakref.ref(hooks.active)
        made = cudafut.submit(load, 1).then(double)
    assert hooks.active is None and tr._tracer is None
    gc.collect()
    assert tracer() is None  # nothing kept it: not the futures, drivers nor pools
    assert sorted(fake_gpu.timing.released) == fake_gpu.timing.acquired

    # Off, no hook function runs at all: each site tests ``active`` only.
    def called(*args: object, **kwargs: object) -> None:
        raise AssertionError("a trace hook ran with no trace recording")

    names = [
        n
        for n, v in vars(hooks).items()
        if isinstance(v, types.FunctionType) and v.__module__ == hooks.__name__
    ]
    assert "completing" in names and "polled" in names
    for name in names:
        if not name.startswith("_"):
            monkeypatch.setattr(hooks, name, called)
    fake_gpu.complete_all()
    again = cudafut.submit(load, 2).then(double)
    again.add_done_callback(lambda fut: None)
    fake_gpu.complete_all()
    assert again.result(timeout=10) == 6 and made.result(timeout=10) == 4


def test_a_fault_of_the_tracer_never_breaks_the_work(
    fake_gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a tracer bug")

    # "completing"/"completed": the tracer only observes a completion; the
    # future notifies its waiters and listeners whatever the tracer does.
    for method in ("created", "polled", "planned", "wait_start", "timed", "completing", "completed"):
        monkeypatch.setattr(recorder.Tracer, method, broken)
    with cudafut.trace(None) as tr:
        fut = cudafut.submit(load, 1).then(double)
        fake_gpu.complete_when(lambda: True)
        assert fut.result(timeout=10) == 4
    assert tr.events is not None
    faults = [r for r in caplog.records if "could not be recorded" in r.getMessage()]
    assert len(faults) == 1  # once per trace


def test_gpu_timing_off_records_the_host_only(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    with cudafut.trace(path, gpu_timing=False):
        cudafut.submit(load, 1).then(double)
    t = Parsed.file(path)
    assert fake_gpu.timing.acquired == []
    assert not any(e["pid"] >= 100 for e in t.events) and t.other["gpu_timing"] is False
    (pair,) = t.flows("then")  # on the host
    assert t.slice_at(pair[0])["name"] == "set #1 submit(load)"


# -- NVTX ---------------------------------------------------------------------------------------


class _Nvtx(types.ModuleType):
    """A stand-in for the nvtx package that remembers every call."""

    def __init__(self) -> None:
        super().__init__("nvtx")
        self.started: dict[int, tuple[str, str | None, int | None]] = {}
        self.ended: list[int] = []
        self.marks: list[str] = []
        self._ids = itertools.count(1)

    def start_range(
        self, message: str, color: str | None = None, domain: str | None = None, payload: int | None = None
    ) -> tuple[int, int]:
        rng = next(self._ids)
        self.started[rng] = (message, domain, payload)
        return (rng, 0)

    def end_range(self, range_id: tuple[int, int]) -> None:
        self.ended.append(range_id[0])

    def mark(self, message: str, color: str | None = None, domain: str | None = None) -> None:
        self.marks.append(message)


def test_nvtx_ranges_start_and_end_while_tracing(fake_gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    nvtx = _Nvtx()
    monkeypatch.setitem(sys.modules, "nvtx", nvtx)
    with cudafut.trace(None):
        fut = cudafut.submit(load, 1).then(double)
        never: cudafut.CudaFuture[int] = cudafut.CudaFuture()
        fake_gpu.complete_when(sleeping("result()"))
        assert fut.result(timeout=10) == 4
    messages = {m for m, _domain, _payload in nvtx.started.values()}
    assert {"future submit", "future then", "submit load", "then double", "result()"} <= messages
    assert {domain for _m, domain, _p in nvtx.started.values()} == {"cudafut"}
    assert sorted(nvtx.ended) == sorted(nvtx.started)  # every range ended, the never-set one too
    assert "wake-up" in nvtx.marks
    del never
    count = len(nvtx.started)
    cudafut.submit(load, 1)  # no trace: no range
    with cudafut.trace(None, nvtx=False):
        cudafut.submit(load, 1)
    assert len(nvtx.started) == count


def test_nvtx_true_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install nvtx"):
        cudafut.trace(None, nvtx=True).start()
    assert hooks.active is None
    with cudafut.trace(None):  # None: used if installed, else not
        pass


# -- the debug log ------------------------------------------------------------------------------


def test_the_debug_log_says_what_the_waiters_decide(
    fake_gpu: FakeGpu, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cudafut")
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture(devices=0)
    fut.set_result(1)
    fake_gpu.complete_when(lambda: any("result(): woke" in r.getMessage() for r in list(caplog.records)))
    assert fut.result(timeout=10) == 1
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(line.startswith("cudafut: result(): spin for ") and "a new wait" in line for line in lines)
    assert any(line.startswith("cudafut: result(): sleep ") and "no modes learnt" in line for line in lines)
    assert any(line.startswith("cudafut: result(): woke ") for line in lines)

    # modes learnt, then a surprise
    stream = 0x777
    predictor = _policy.predictor
    for seq, duration in enumerate([2e-3] * 4 + [9e-3], start=1):
        rec = FakeRecord(stream, seq)
        rec.t = 100.0 * seq
        rec.seen = rec.t + duration - 1e-6  # seen pending just before: an exact observation
        predictor.observe(rec, rec.t + duration)
        predictor.modes(rec)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "device 0 stream 0x777: modes [2.000 ms (2.000 ms-2.000 ms)]" in text
    assert "surprise: work took 9.000 ms, in none of its modes [2.000 ms" in text


def test_the_debug_log_is_silent_by_default(fake_gpu: FakeGpu, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cudafut")
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture(devices=0)
    fut.set_result(1)
    fake_gpu.complete_when(lambda: True)
    assert fut.result(timeout=10) == 1
    assert not [r for r in caplog.records if r.name == "cudafut"]
