"""The serve benchmark's several-process part, on the CPU: which GPU counts
it runs, and the targets it reports, from committed results."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks import serve
from benchmarks.support import tables
from benchmarks.support.common import service_module
from cudafut import testing

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


#: How the report marks a goal: met, or missed (in bold).
VERDICT = r"(met|\*\*missed\*\*)\)"


def test_the_gpu_counts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDAFUT_BENCH_SERVE_DEVICES", raising=False)
    assert serve._devices() == ()
    monkeypatch.setenv("CUDAFUT_BENCH_SERVE_DEVICES", "1 2 4")
    assert serve._devices() == (1, 2, 4)
    for bad in ("two", "0", "1 -2"):
        monkeypatch.setenv("CUDAFUT_BENCH_SERVE_DEVICES", bad)
        with pytest.raises(ValueError, match="GPU counts"):
            serve._devices()


def test_the_targets_of_several_processes_are_reported() -> None:
    """From the newest committed runs of several processes on 1, 2 and 4
    GPUs, put together as the part would: each GPU count gets its line."""
    pytest.importorskip("aiohttp")  # markdown() renders through compare.py
    runs = tables.runs()

    def holders(gpus: str) -> list[tables.Run]:
        return [r for r in runs if any(p.startswith(f"fronts: {gpus} GPU(s)") for p in r.parts)]

    # Runs of one machine only (the host that ran the most GPUs): a ratio
    # between GPU counts means nothing across machines.
    widest = next((holders(g) for g in ("4", "2") if holders(g)), [])
    if not widest:
        pytest.skip("no committed runs of several processes on more than one GPU")
    machine = max(widest, key=lambda r: (r.date, r.name)).machine
    processes = {}
    for gpus in ("1", "2", "4"):
        mine = [r for r in holders(gpus) if r.machine == machine]
        if mine:
            newest = max(mine, key=lambda r: (r.date, r.name))
            processes[gpus] = json.loads((RESULTS / newest.name).read_text())
    if "1" not in processes:
        pytest.skip("no committed run of several processes on one GPU of that machine")
    text = "\n".join(serve.markdown({"processes": processes}))
    limit = r"- 1 GPU\(s\): fronts at \d\.\d\dx the GPUs' own limit \(target >= 0\.9: " + VERDICT
    assert re.search(limit, text), text
    if "litserve_fronts" in json.dumps(processes["1"]):  # a run may leave LitServe out
        litserve = r"- 1 GPU\(s\): \d+\.\dx LitServe with the same processes \(target >= 5: " + VERDICT
        assert re.search(litserve, text), text
    for gpus, target in (("2", "1.9"), ("4", "3.7")):
        if gpus in processes:
            scaling = rf"- {gpus} GPUs: \d+\.\d\dx one GPU \(target >= {re.escape(target)}: " + VERDICT
            assert re.search(scaling, text), text
            assert f"Several processes, {gpus} GPU(s)" in text


def _closed(rps: float) -> dict[str, object]:
    return {
        "rps": rps,
        "p50_ms": 5.0,
        "p99_ms": 9.0,
        "health": {"p50_ms": 0.5, "p99_ms": 1.0, "max_ms": 2.0},
        "server_cpu": 1.0,
        "gpu_busy": 0.5,
        "mean_batch": 32.0,
        "wrong": 0,
        "errors": 0,
    }


def test_the_no_gpu_ceiling_is_the_higher_of_its_two_runs() -> None:
    """It runs first and again after the other handlers (it has been seen
    to rise within a run): the ratio is to the higher, both are shown."""
    pytest.importorskip("aiohttp")  # markdown() renders through compare.py
    model = {
        "closed": {"nogpu": _closed(10_000), "batch_graph": _closed(5_000)},
        "again": {"nogpu": _closed(16_000)},
        "open": {},
        "threads": {},
    }
    text = "\n".join(serve.markdown({"models": {"resnet50": model}}))
    assert (
        "- resnet50: launch + Batcher + graphs at 0.31x the no-GPU ceiling, the higher of its two runs "
        "(10,000 req/s first, 16,000 after the others; target >= 0.75: **missed**)"
    ) in text
    assert "| nogpu (again, after the others) | 16,000 |" in text
    del model["again"]  # a run from before: the one ceiling it has
    text = "\n".join(serve.markdown({"models": {"resnet50": model}}))
    ceiling = "- resnet50: launch + Batcher + graphs at 0.50x the no-GPU ceiling (target >= 0.75: **missed**)"
    assert ceiling in text


def test_a_goal_says_met_missed_or_not_measured() -> None:
    assert serve._goal(5.2, 5, at_least=True) == "target >= 5: met"
    assert serve._goal(4.9, 5, at_least=True) == "target >= 5: **missed**"
    assert serve._goal(2.5, 2, at_least=False, unit=" ms") == "target <= 2 ms: **missed**"
    assert serve._goal(None, 2, at_least=False, unit=" ms") == "target <= 2 ms: not measured"
    # A goal met only because the baseline was slower says so.
    assert serve._signed(serve._delta(1.0, 3.5)) == "-2.5 ms, the no-GPU server the slower"
    assert serve._signed(serve._delta(None, 3.5)) == "not measured"


def test_the_stall_ways_alternate_round_by_round() -> None:
    assert [serve._round_order(["launch", "executor"], r) for r in range(3)] == [
        ["launch", "executor"],
        ["executor", "launch"],
        ["launch", "executor"],
    ]


def test_the_later_stall_rounds_run_with_the_cold_rounds_objects_frozen(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serving recipe's gc.freeze(): a full collection in a warm round
    # does not walk what start-up left; the freeze ends with the rounds.
    fake_cuda.auto_complete = True
    frozen: list[tuple[int, int]] = []

    def call(r: int, i: int) -> int:
        if i == 0:
            frozen.append((r, gc.get_freeze_count()))
        return i

    pauses = service_module("pauses")
    freeze = pauses.freeze_warm_objects

    def slow_freeze() -> int:
        # As long as a freeze over PyTorch's objects holds the loop: its
        # ticker's late tick is not a round's stall.
        time.sleep(0.5)
        return int(freeze())

    monkeypatch.setattr(pauses, "freeze_warm_objects", slow_freeze)
    assert serve.STALL_FREEZE
    ways: dict[str, ThreadPoolExecutor | None] = {"launch": None}
    out = asyncio.run(serve._stall(4, 2, lambda r, i: (call, r, i), ways))
    assert [r for r, _ in frozen] == [0, 1, 2]
    assert all(count > frozen[0][1] for _, count in frozen[1:]), frozen
    assert gc.get_freeze_count() == 0
    assert max(out["launch"]["round_max_stall_ms"]) < 250, out["launch"]["round_max_stall_ms"]


def test_a_stall_way_can_await_the_executors_gpu_work_too(fake_cuda: testing.FakeCuda) -> None:
    # run_in_executor returns when the call's host part does; the AndWait
    # way then awaits its GPU work, as launch() does: one more way, in turn.
    fake_cuda.auto_complete = True
    seen: list[tuple[str, int]] = []

    def call(r: int, i: int) -> int:
        if i == 0:
            seen.append((threading.current_thread().name.split("_")[0], r))
        return i

    with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        ways: dict[str, ThreadPoolExecutor | serve.AndWait | None] = {
            "run_in_executor": pool,
            serve.THEN_AWAIT: serve.AndWait(pool, fake_cuda.stream()),
        }
        out = asyncio.run(serve._stall(4, 1, lambda r, i: (call, r, i), ways))
    assert sorted(out) == ["run_in_executor", serve.THEN_AWAIT]
    assert [r for _, r in seen] == [0, 0, 1, 1], seen
    assert all(out[w]["warm_rounds"] == 1 for w in out)


def test_the_stall_rounds_record_their_collections(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_stall on the fake GPU, launch() and run_in_executor alternated: one
    cold round and the warm ones of each way, and a full collection that each
    way's calls run in their first warm round, recorded with its round; the
    report then judges max and p99 over the warm rounds, with the median
    round's max and the collections beside them. Nothing frozen here: a
    frozen heap makes the full collection too short to record."""
    monkeypatch.setattr(serve, "STALL_FREEZE", False)
    fake_cuda.auto_complete = True
    held = [[i] for i in range(300_000)]  # a full collection walks them: well over 1 ms
    gc.collect()  # in the oldest generation now: no full collection of the collector's own is due
    rounds: dict[str, list[int]] = {"launcher": [], "executor": []}

    def call(r: int, i: int) -> int:
        if i == 0:  # each way's round starts with its first call
            where = "executor" if threading.current_thread().name.startswith("ThreadPool") else "launcher"
            rounds[where].append(r)
            if r <= 1:  # the cold round too: its collection is said beside its max
                gc.collect()
        return i

    with ThreadPoolExecutor(2) as pool:
        ways: dict[str, ThreadPoolExecutor | None] = {"launch": None, "run_in_executor": pool}
        out = asyncio.run(serve._stall(20, 3, lambda r, i: (call, r, i), ways))
    assert rounds == {"launcher": [0, 1, 2, 3], "executor": [0, 1, 2, 3]}
    for way in ways:
        s = out[way]
        assert s["warm_rounds"] == 3 and len(s["round_max_stall_ms"]) == 4, s
        assert s["warm_median_round_max_ms"] <= s["warm_max_stall_ms"] <= s["max_stall_ms"]
        full = [g for g in s["gc"] if g["generation"] == 2 and g["round"] == 1]
        assert full and full[0]["ms"] >= serve.STALL_GC_MS, s["gc"]
        assert all(0 <= g["round"] <= 3 and g["ms"] >= serve.STALL_GC_MS for g in s["gc"]), s["gc"]
        assert s["warm_gc"]["count"] >= 1 and s["warm_gc"]["by_generation"][2] >= 1, s["warm_gc"]
        assert s["warm_gc"]["longest_ms"] >= full[0]["ms"]
        cold = serve._cold_gc(s)
        assert cold is not None and cold >= serve.STALL_GC_MS
        assert "prepare_s" not in s
    del held
    caller = {k: {"p50_us": 1.0, "p99_us": 2.0} for k in serve._CALLS}
    launch = {
        "caller": caller,
        "stall_settings": {
            "switch_interval_s": 0.005,
            "launcher_threads": 2,
            "warm_rounds": {"trivial": 3},
            "alternated": True,
            "gc_over_ms": 1.0,
        },
        "stalls": {way: {"trivial": out[way]} for way in ways},
    }
    text = "\n".join(serve.markdown({"launch": launch}))
    assert "switch interval 5 ms (`sys.getswitchinterval()`)" in text
    assert "| later rounds' median max ms | later GCs of 1 ms or more: count, longest ms |" in text
    first = next(x for x in text.splitlines() if "launches in flight: first round max" in x)
    assert re.search(r"first round max [\d.]+ ms \(a [\d.]+ ms garbage collection in it\), ", first), first
    line = next(x for x in text.splitlines() if "later rounds against run_in_executor" in x)
    target = r"\(target: at most 1x each: (met|\*\*missed\*\*)\); median round's max [\d.]+ / [\d.]+ ms "
    own = r"\((?:[\d.]+x|-)\); median round's p99 [\d.]+ / [\d.]+ ms \((?:[\d.]+x|-); "
    own += r"a round's own p99 [\d.]+-[\d.]+ ms and [\d.]+-[\d.]+ ms\), 3 and 3 later rounds alternated"
    assert re.search(target + own, line), line
    assert re.search(r"in them: launch [1-9]\d* \(longest [\d.]+ ms; ", line), line
    assert re.search(r"run_in_executor [1-9]\d* \(longest [\d.]+ ms; ", line), line


def test_a_stall_result_from_before_the_rounds_alternated_reads_as_before() -> None:
    """The committed runs before: no median, no collections, the same columns."""
    runs = [r for r in tables.runs() if "serve: launch" in r.parts]
    if not runs:
        pytest.skip("no committed run of the serve section's launch part")
    data = json.loads((RESULTS / max(runs, key=lambda r: (r.date, r.name)).name).read_text())
    launch = data["serve"]["launch"]
    if "stall_settings" in launch:
        pytest.skip("the newest committed run alternates its rounds")
    text = "\n".join(serve.markdown({"launch": launch}))
    assert "median" not in text and "GCs" not in text
    assert "later rounds against run_in_executor: max " in text
