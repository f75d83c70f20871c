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
    assert f" | {vary._ratio_cell(r['thread'])} | {vary._ratio_cell(r['floor'])} |" in row, row
    told = 1 if result.get("told_floor") else 0  # the CPU floor's column, where the run has it
    assert len(row.split(" | ")) == 1 + len(vary._target_names(result)) + 2 + told


class _PolledEvent(_Event):
    """A non-blocking event's stand-in: ``done`` once its work's end passed."""

    @property
    def done(self) -> bool:
        return time.perf_counter() >= self.ends


def test_a_told_waiter_sleeps_until_its_margin_then_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    events: dict[int, _PolledEvent] = {}

    def event_of(made: dict[int, Any], stream: _Stream, block: bool) -> _PolledEvent:
        assert not block  # polled, as the sleep(0) peer's
        return events.setdefault(stream.ptr, _PolledEvent())

    monkeypatch.setattr(vary, "_event_of", event_of)
    fds_before = len(list(Path("/proc/self/fd").iterdir()))
    jobs = [[0.004, 0.0005, 0.002], [0.001] * 4]
    for margin in vary.TOLD:
        lats, cpu = vary._run_told(_Gpu(), margin, jobs, [_Stream(1), _Stream(2)])
        assert [len(x) for x in lats] == [3, 4]
        for durations, got in zip(jobs, lats, strict=True):
            assert all(t >= d for d, t in zip(durations, got, strict=True)), (margin, durations, got)
        assert cpu >= 0.0
    assert len(list(Path("/proc/self/fd").iterdir())) == fds_before  # every timerfd closed


def _rows(
    thread: tuple[float, float, float], told: list[tuple[float, float, float]], mine: float
) -> dict[str, Any]:
    def row(p50: float, p90: float, cpu: float) -> dict[str, float]:
        return {"extra_p50_us": p50, "extra_p90_us": p90, "cpu_per_wall": cpu}

    rows = {vary.THREAD: row(*thread), vary.BALANCED: row(0.0, 0.0, mine)}
    for name, figures in zip(vary.TOLD.values(), told, strict=True):
        rows[name] = row(*figures)
    return rows


def test_the_cpu_floor_is_the_cheapest_told_waiter_no_later_than_the_thread() -> None:
    # The sleeper to the end is too late at p90; of the two in time, the
    # one with less CPU sets the floor.
    rows = _rows((100, 300, 0.02), [(80, 400, 0.021), (60, 250, 0.04), (20, 40, 0.08)], mine=0.12)
    floor = vary._told_floor(rows)
    assert floor == {"margin_ms": 0.2, "cpu_over_thread": 2.0, "default_cpu_over_it": 3.0}
    assert vary._told_cell(floor).startswith("2.00x (sleeping until 0.2 ms before the end)")
    # None in time: no floor is claimed.
    late = _rows((10, 20, 0.02), [(80, 400, 0.02), (60, 250, 0.04), (20, 40, 0.08)], mine=0.12)
    assert vary._told_floor(late) is None
    assert vary._told_cell(None) == "none of them"
    # A run from before the told waiters has no floor either.
    assert vary._told_floor({k: v for k, v in rows.items() if k not in vary.TOLD.values()}) is None


def test_the_targets_table_gives_the_cpu_floor_where_the_run_has_it() -> None:
    result = copy.deepcopy(_newest())
    for layouts in result["patterns"].values():
        for rows in layouts.values():
            thread = rows[vary.THREAD]
            for margin, name in vary.TOLD.items():
                rows[name] = {**thread, "cpu_per_wall": thread["cpu_per_wall"] * (2 + margin * 1e3)}
    result["told_floor"] = vary._all_told_floors(result)
    text = "\n".join(vary.markdown(result))
    assert vary._TOLD_COLUMN in text
    key = next(iter(result["targets"]))
    row = next(line for line in text.splitlines() if line.startswith(f"| {key} |"))
    assert row.endswith(f" | {vary._told_cell(result['told_floor'][key])} |"), row
    assert "2.00x (sleeping until 0 ms before the end)" in row


def test_the_collections_during_the_rows_are_reported_beside_them() -> None:
    """A run's ``gc`` part: what was frozen before the rows and every long
    collection with its row; a run without one (before it was recorded)
    has no such line."""
    result = copy.deepcopy(_newest())
    result.pop("gc", None)
    assert "Collections of" not in "\n".join(vary.markdown(result))
    result["gc"] = {
        "threshold_ms": 5.0,
        "tracked_before": 412_000,
        "frozen": 409_876,
        "collect_and_freeze_ms": 51.2,
        "pauses": [],
    }
    text = "\n".join(vary.markdown(result))
    assert "(409,876 objects; `gc.collect()`, `gc.freeze()` and a count of what it froze took 51 ms)" in text
    assert "Collections of 5 ms or more during the rows: none." in text  # a run that recorded the rows only
    result["gc"]["between_rows"] = True
    result["gc"]["pauses"] = [
        {
            "row": "stable 2 ms [1 stream] peer: asyncio sleep(0) polling",
            "round": 0,
            "ms": 5.5,
            "generation": 1,
        },
        {"row": "between rows", "round": -1, "ms": 6.0, "generation": 1},
        {"row": "bimodal [8 streams] cudafut await (balanced)", "round": 1, "ms": 7.25, "generation": 2},
    ]
    text = "\n".join(vary.markdown(result))
    assert (
        "during the section: 3: "
        "7.2 ms (generation 2, bimodal [8 streams] cudafut await (balanced), round 2); "
        "6.0 ms (generation 1, between rows); "
        "5.5 ms (generation 1, stable 2 ms [1 stream] peer: asyncio sleep(0) polling, round 1)." in text
    )


def test_a_run_records_each_collection_with_its_row_and_unfreezes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run()``'s bookkeeping with CuPy and the GPU stood in for: a
    collection inside a row is named with it, one between rows as such;
    afterwards nothing stays frozen and the recorder is gone."""
    import gc
    import sys
    import types

    import benchmarks.support

    fake_gpu = types.SimpleNamespace(sync_all=lambda: None)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=lambda non_blocking: object()))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "benchmarks.support.gpu", fake_gpu)
    monkeypatch.setattr(benchmarks.support, "gpu", fake_gpu, raising=False)
    monkeypatch.setattr(vary, "GC_PAUSE_MS", 0.0)  # every collection is recorded
    monkeypatch.setattr(vary, "_floor", lambda gpu, seconds, n: seconds)
    collect_in = (next(iter(vary._patterns(True))), "8 streams", vary.BALANCED)

    def strategy(name: str, gpu: Any, pool: Any) -> Any:
        def run(jobs: list[list[float]], streams: list[Any]) -> tuple[list[list[float]], float]:
            if len(streams) == 8 and name == vary.BALANCED and not seen:
                seen.append(name)
                gc.collect()
            return [[d + 1e-5 * (i + 1) for i, d in enumerate(durations)] for durations in jobs], 0.1

        return run

    seen: list[str] = []
    monkeypatch.setattr(vary, "_strategy", strategy)

    class Steps:
        def step(self, what: str) -> None:
            if "stable 20 ms [8 streams]" in what and vary.THREAD in what:
                gc.collect()  # after that row's bookkeeping: between rows

    callbacks = list(gc.callbacks)
    result = vary.run(Steps(), quick=True)  # type: ignore[arg-type]
    assert gc.get_freeze_count() == 0
    assert gc.callbacks == callbacks
    g = result["gc"]
    assert g["between_rows"] and g["frozen"] > 0
    rows = [(p["row"], p["round"]) for p in g["pauses"] if p["generation"] == 2]
    assert (f"{collect_in[0]} [{collect_in[1]}] {collect_in[2]}", 0) in rows
    assert ("between rows", -1) in rows
    assert "Collections of 0 ms or more during the section: " in "\n".join(vary.markdown(result))
