"""The vary benchmark on the CPU: the floor strategy's mechanics (a fake
stream and event in place of CUDA's), and its report, old runs and new."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vary
from benchmarks.support import tables
from cudafut import WaitPolicy

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


class _Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.ends = 0.0  # when the work queued on it ends (perf_counter)


class _Event:
    """A blocking-sync event's stand-in: ``synchronize()`` sleeps until the
    work its stream had when recorded ends."""

    def __init__(self) -> None:
        self.ends = 0.0
        self.waiters: set[str] = set()

    def record(self, stream: _Stream) -> None:
        self.ends = stream.ends

    def synchronize(self) -> None:
        self.waiters.add(threading.current_thread().name)
        time.sleep(max(0.0, self.ends - time.perf_counter()))


class _Gpu:
    def work(self, ns: int, on: _Stream) -> None:
        on.ends = max(on.ends, time.perf_counter()) + ns * 1e-9


def test_the_floor_wakes_each_task_from_its_streams_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    events: dict[int, _Event] = {}

    def event_of(made: dict[int, Any], stream: _Stream, block: bool) -> _Event:
        assert block  # a blocking-sync event, as the thread peer's
        return events.setdefault(stream.ptr, _Event())

    monkeypatch.setattr(vary, "_event_of", event_of)
    before = set(threading.enumerate())
    jobs = [[0.002, 0.0005, 0.001], [0.001] * 4]
    lats, cpu = vary._run_floor(_Gpu(), jobs, [_Stream(1), _Stream(2)])
    assert [len(x) for x in lats] == [3, 4]
    for durations, got in zip(jobs, lats, strict=True):
        assert all(t >= d for d, t in zip(durations, got, strict=True)), (durations, got)
    assert cpu >= 0.0
    # One thread per stream waited, not the loop's; all of them ended with the run.
    assert all(len(ev.waiters) == 1 for ev in events.values())
    assert threading.main_thread().name not in set().union(*(ev.waiters for ev in events.values()))
    assert set(threading.enumerate()) <= before


def test_the_new_strategies() -> None:
    assert vary.FLOOR in vary.STRATEGIES and vary.BALANCED_POLLS in vary.STRATEGIES
    polls = vary._PRESETS[vary.BALANCED_POLLS]
    assert isinstance(polls, WaitPolicy) and not polls.notify
    # The default (BALANCED) has notices beside 1 ms polls; the notice rows
    # keep the 20 ms polls they were measured with before.
    for name in (vary.BALANCED_NOTICES, vary.BALANCED_HOSTFN, vary.NOTICES_ONLY, vary.NOTICES_NO_SPIN):
        policy = vary._PRESETS[name]
        assert isinstance(policy, WaitPolicy) and policy.notify and policy.notice_sleep_s == 20e-3
    bare = vary._PRESETS[vary.NOTICES_NO_SPIN]
    assert isinstance(bare, WaitPolicy) and bare.spin_s == 0 and not bare.predict
    assert vary.steps(quick=True) == 8 * 2 * len(vary.STRATEGIES) + 1


def _newest() -> dict[str, Any]:
    runs = [r for r in tables.runs() if "vary" in r.parts]
    if not runs:
        pytest.skip("no committed run of the vary section")
    data: dict[str, Any] = json.loads((RESULTS / max(runs, key=lambda r: (r.date, r.name)).name).read_text())
    result: dict[str, Any] = data["vary"]
    return result


def test_a_run_from_before_the_floor_reads_as_before() -> None:
    result = _newest()
    if vary.FLOOR in vary._names(result):
        pytest.skip("the newest committed run has the floor")
    text = "\n".join(vary.markdown(result))
    assert vary.FLOOR not in text and "floor strategy" not in text
    assert "| pattern | p50 <= thread | p90 <= thread |" in text


def test_each_target_row_is_given_against_the_thread_and_the_floor() -> None:
    """A run with the floor (the committed run, its rows given a floor at
    twice the thread's p50 and p90 and the same CPU, and a 1 ms-poll row)."""
    result = copy.deepcopy(_newest())
    for layouts in result["patterns"].values():
        for rows in layouts.values():
            thread = rows[vary.THREAD]
            floor = {**thread, "extra_p50_us": 2 * thread["extra_p50_us"]}
            floor["extra_p90_us"] = 2 * thread["extra_p90_us"]
            rows[vary.FLOOR] = floor
            rows[vary.BALANCED_POLLS] = rows[vary.BALANCED]
    text = "\n".join(vary.markdown(result))
    assert "| p50 / p90 / CPU over the blocked thread | p50 / p90 / CPU over the floor strategy |" in text
    assert text.count(vary.FLOOR) == 2  # a column of each layout's table
    ratios = vary._all_ratios(result)
    key = next(iter(result["targets"]))
    r = ratios[key]
    assert r["floor"]["p50"] == pytest.approx(r["thread"]["p50"] / 2, abs=0.011)
    assert r["floor"]["cpu"] == r["thread"]["cpu"]
    row = next(line for line in text.splitlines() if line.startswith(f"| {key} |"))
    assert row.endswith(f" | {vary._ratio_cell(r['thread'])} | {vary._ratio_cell(r['floor'])} |"), row
    assert len(row.split(" | ")) == 1 + len(vary._target_names(result)) + 2
