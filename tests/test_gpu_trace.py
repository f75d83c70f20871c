"""Traces of real work on a GPU: the GPU times are there, bracket the work,
and come in the order the streams impose (a slow producer, then its
children on the same stream and on another one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import cudafut
from tests.kernels import spin_fill
from tests.runners import BACKENDS, run_on

pytestmark = pytest.mark.gpu

N = 1 << 16
SLOW_MS = 20.0
#: Timestamps are written rounded to the ns; comparisons allow for that.
ROUNDING_US = 0.01


def _trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc["otherData"], doc["traceEvents"]


def _gpu_slices(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["args"]["future"]: e for e in events if e["ph"] == "X" and e["cat"] == "gpu"}


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


def _holding(events: list[dict[str, Any]], point: dict[str, Any]) -> dict[str, Any]:
    """The innermost X slice on ``point``'s track holding its time."""
    holding = [
        e
        for e in events
        if e["ph"] == "X"
        and (e["pid"], e["tid"]) == (point["pid"], point["tid"])
        and e["ts"] <= point["ts"] <= _end(e)
    ]
    assert holding, point
    return min(holding, key=lambda e: e["dur"])


def _flows(events: list[dict[str, Any]], cat: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    starts = {e["id"]: e for e in events if e["ph"] == "s" and e["cat"] == cat}
    ends = {e["id"]: e for e in events if e["ph"] == "f" and e["cat"] == cat}
    assert set(starts) == set(ends)
    return [(_holding(events, starts[i]), _holding(events, ends[i])) for i in starts]


@pytest.mark.parametrize("backend", BACKENDS)
def test_submit_then_await_gives_ordered_gpu_times(cp: Any, tmp_path: Path, backend: str) -> None:
    path = tmp_path / "trace.json"

    def produce(out: Any) -> Any:
        spin_fill(out, 7.0, SLOW_MS)  # on the pool stream submit() made current
        return out

    async def pipeline() -> tuple[Any, Any]:
        fut = cudafut.submit(produce, cp.zeros(N, dtype=cp.float32))
        same = fut.then(lambda v: v + 1)  # continues on fut's stream
        other = fut.then(lambda v: v * 2)  # another pool stream, waiting on fut's event
        a, b = await cudafut.gather(same, other)
        return a, b

    x = cp.zeros(N, dtype=cp.float32)  # warm the allocator outside the trace
    del x
    with cudafut.trace(path, nvtx=False):
        a, b = run_on(backend, pipeline)
    assert (a.get() == 8).all() and (b.get() == 14).all()  # the ordering itself

    other_data, events = _trace(path)
    assert other_data["gpu_timing"] is True and other_data["gpu_incomplete"] == 0
    gpu = _gpu_slices(events)
    (producer,) = [e for e in gpu.values() if e["args"]["label"] == "submit(produce)"]
    children = [e for e in gpu.values() if e["args"].get("parent") == producer["args"]["future"]]
    assert len(children) == 2
    # The timing events bracket the slow kernel: it spins SLOW_MS on the
    # GPU's own clock, so the producer's span holds at least that (a lower
    # bound: a correctness property of the timing, not a speed).
    assert producer["dur"] >= 0.9 * SLOW_MS * 1e3
    for child in children:
        assert child["dur"] >= 0
        # Ordered after the producer on the GPU, on its stream or through
        # the wait another stream made on its event.
        assert child["ts"] >= _end(producer) - ROUNDING_US, (producer, child)
    tracks = {(c["pid"], c["tid"]) for c in children}
    assert (producer["pid"], producer["tid"]) in tracks and len(tracks) == 2  # one on each kind of stream

    # then(): an arrow from the producer's GPU work to each child's
    then = _flows(events, "then")
    assert sorted((s["args"]["future"], f["args"]["future"]) for s, f in then) == sorted(
        (producer["args"]["future"], c["args"]["future"]) for c in children
    )
    # wake-up: from GPU work to the waiter that saw it done. The slice is the
    # poll that saw it: it starts before the query (the work may complete
    # in between) and ends after, never before the work ended (GPU times are
    # placed no later than they happened: docs/tracing.md, "The clocks").
    wakes = _flows(events, "wake-up")
    assert wakes
    for work, wake in wakes:
        assert wake["name"] == "wake-up" and work["cat"] == "gpu"
        assert _end(wake) >= _end(work) - ROUNDING_US, (work, wake)
    awaited = [e for e in events if e["ph"] == "b" and e["name"] == "await"]
    assert [e["args"]["label"] for e in awaited] == ["gather"]


def test_record_and_result_on_a_stream_of_ones_own(cp: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    stream = cp.cuda.Stream(non_blocking=True)
    with cudafut.trace(path, nvtx=False):
        with stream:
            x = cp.zeros(N, dtype=cp.float32)
            first = cudafut.record(x)  # the first point on this stream: no start
            spin_fill(x, 3.0, SLOW_MS)
            second = cudafut.record(x)  # the work from `first` to here
        assert (second.result(timeout=30).get() == 3).all()
        first.result(timeout=30)
    _other, events = _trace(path)
    gpu = _gpu_slices(events)
    (work,) = gpu.values()
    assert work["args"]["label"] == "record" and work["dur"] >= 0.9 * SLOW_MS * 1e3
    assert work["args"]["observed_by"] == "result() (MainThread)"
    done = [e for e in events if e["ph"] == "i" and e["cat"] == "gpu"]
    assert len(done) == 1 and "unknown" in done[0]["args"]["start"]  # `first`
    assert done[0]["ts"] <= work["ts"] + ROUNDING_US  # its end is where `second`'s work starts


def test_work_still_running_when_the_trace_ends_is_marked(cp: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"

    def produce(out: Any) -> Any:
        spin_fill(out, 1.0, 300.0)
        return out

    with cudafut.trace(path, timeout=0, nvtx=False):  # write at once, without waiting
        fut = cudafut.submit(produce, cp.zeros(N, dtype=cp.float32))
    other_data, events = _trace(path)
    assert other_data["gpu_incomplete"] == 1
    (mark,) = [e for e in events if e["name"].endswith("(not complete)")]
    assert mark["args"]["future"] == 1 and mark["args"]["incomplete"]
    assert (fut.result(timeout=30).get() == 1).all()
