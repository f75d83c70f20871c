"""Garbage-collection pauses in the service example, on the CPU: the
``gc.callbacks`` hook (examples/service/pauses.py), the pause report, and
the servers' ``gc.freeze()`` after warm-up (docs/serving.md)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import serve
from tests.subproc import ROOT
from tests.test_examples import load_example
from tests.test_examples_service import SERVICE, _free_port, _reference, _wait_until_up


def _cycles(n: int) -> None:
    """``n`` two-object reference cycles, unreachable: only the collector frees them."""
    for _ in range(n):
        a: dict[str, Any] = {}
        b: dict[str, Any] = {"a": a}
        a["b"] = b


def test_the_hook_records_a_collection_with_what_it_walked(tmp_path: Path) -> None:
    pauses = load_example(SERVICE / "pauses.py")
    path = tmp_path / "gc.jsonl"
    with pauses.PauseRecorder(threshold_ms=0.0, path=path) as recorder:  # every collection, however short
        gc.disable()  # the cycles wait for the full collection below, not a young one
        try:
            _cycles(5_000)
            gc.collect()
        finally:
            gc.enable()
    full = [p for p in recorder.pauses if p["generation"] == 2]
    assert full, recorder.pauses
    last = full[-1]
    assert last["collected"] >= 10_000  # the cycles' objects
    assert last["tracked"] >= last["collected"] and last["ms"] >= 0 and last["pid"] == os.getpid()
    assert pauses.read(path) == recorder.pauses  # the file holds the same, one line each
    # Removed, it records nothing more; a threshold no collection reaches records nothing.
    seen = len(recorder.pauses)
    gc.collect()
    assert len(recorder.pauses) == seen and recorder._callback not in gc.callbacks
    with pauses.PauseRecorder(threshold_ms=float("inf")) as never:
        _cycles(1_000)
        gc.collect()
    assert never.pauses == []


def test_the_hook_is_installed_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pauses = load_example(SERVICE / "pauses.py")
    monkeypatch.delenv(pauses.ENV, raising=False)
    assert pauses.record_from_env() is None
    monkeypatch.setenv(pauses.ENV, str(tmp_path / "gc.jsonl"))
    recorder = pauses.record_from_env()
    try:
        assert recorder is not None and recorder._callback in gc.callbacks
        assert recorder.path == tmp_path / "gc.jsonl" and recorder.threshold_ms == pauses.THRESHOLD_MS
    finally:
        assert recorder is not None
        recorder.remove()


def test_the_pauses_of_a_window_are_read_and_summed(tmp_path: Path) -> None:
    pauses = load_example(SERVICE / "pauses.py")
    path = tmp_path / "gc.jsonl"
    assert pauses.read(path) == []  # no file: the server recorded nothing
    rows = [
        {
            "t": 99.0,
            "ms": 500.0,
            "generation": 2,
            "collected": 1,
            "tracked": 9,
            "pid": 1,
        },  # before the window
        {"t": 100.0, "ms": 6.0, "generation": 0, "collected": 0, "tracked": 10, "pid": 1},
        {"t": 101.0, "ms": 151.5, "generation": 2, "collected": 7, "tracked": 310_000, "pid": 2},
        {"t": 102.0, "ms": 12.25, "generation": 1, "collected": 3, "tracked": 20, "pid": 1},
        {"t": 103.0, "ms": 90.0, "generation": 2, "collected": 1, "tracked": 9, "pid": 1},  # at its end: out
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"t": 101.5, "ms"'  # a line still being written
    path.write_text(text)
    window = pauses.read(path, 100.0, 103.0)
    assert window == rows[1:4]
    s = pauses.summary(window)
    assert s["count"] == 3 and s["longest_ms"] == 151.5 and s["longest"] == rows[2]
    assert s["count_over"] == 2 and s["over_ms"] == 10.0 and s["total_ms"] == 169.75
    assert pauses.summary(window, over_ms=100.0)["count_over"] == 1
    none = pauses.summary([])
    assert none["count"] == 0 and none["longest_ms"] is None and none["longest"] is None


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.parametrize("freeze", [True, False])
def test_the_server_freezes_what_warm_up_left_unless_told_not_to(tmp_path: Path, freeze: bool) -> None:
    pytest.importorskip("aiohttp")
    ref_path = tmp_path / "ref.npy"
    np.save(ref_path, _reference())
    port = _free_port()
    cmd = [sys.executable, str(SERVICE / "server.py"), "--mode", "nogpu", "--port", str(port)]
    cmd += ["--reference", str(ref_path), *([] if freeze else ["--no-gc-freeze"])]
    env = {**os.environ, "CUDAFUT_GC_PAUSES": str(tmp_path / "gc.jsonl")}
    if freeze:
        # Its loop's stall trace too, where /stats has few objects to walk:
        # unfrozen, the walk stalls the loop, and faulthandler's dump of a
        # running thread can crash the server (stalltrace.py's docstring).
        env["CUDAFUT_STALL_TRACE"] = str(tmp_path / "stalls")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(server, port, 60, "the server")
        try:
            stats = _get(port, "/stats?objects=5")
        except OSError as exc:  # the connection lost: say whether the server ended, and how
            try:
                code = server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                raise exc from None
            raise AssertionError(f"the server ended ({code}): {log.read_text()[-3000:]}") from exc
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert (tmp_path / "stalls" / "late.jsonl").exists() == freeze, sorted(tmp_path.rglob("*"))
    counts = {k: v for k, v in stats.items() if k != "gc_types"}
    assert len(stats["gc_collections"]) == 3 and len(stats["gc_types"]) == 5, stats
    if freeze:  # the imports' and warm-up's objects: thousands, and few left to walk
        assert stats["gc_frozen"] > 10_000 and stats["gc_tracked"] < stats["gc_frozen"] / 10, counts
    else:
        assert stats["gc_frozen"] == 0 and stats["gc_tracked"] > 10_000, counts


_GPU_PROCESS = """
import gc, multiprocessing as mp, sys, threading
print(gc.get_freeze_count())  # the interpreter's own (375 on Python 3.12.1, 0 on 3.11)
sys.path.insert(0, sys.argv[1])
import multiproc
ours, theirs = mp.Pipe()
ready = threading.Event()
# The front goes away once the GPU process is ready: its loop then ends.
threading.Thread(target=lambda: (ready.wait(60), ours.close())).start()
multiproc.gpu_main(0, "toy", [theirs], 8, 0.001, ready, freeze=sys.argv[2] == "1")
print(gc.get_freeze_count())
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_the_multi_process_gpu_process_freezes_before_it_is_ready(freeze: bool, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", _GPU_PROCESS, str(SERVICE), "1" if freeze else "0"]
    env = {k: v for k, v in os.environ.items() if k != "CUDAFUT_GC_PAUSES"}
    env["CUDAFUT_STALL_TRACE"] = str(tmp_path / "stalls")  # its loop's stall trace starts too
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    before, frozen = int(lines[0]), int(lines[-1])
    assert frozen > before + 10_000 if freeze else frozen == before
    assert (tmp_path / "stalls" / "late.jsonl").exists()


def test_the_comparison_table_reports_the_pauses_where_recorded() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("psutil")
    compare = load_example(SERVICE / "compare.py")
    r = {
        "rps": 4000.0, "p50_ms": 5.0, "p99_ms": 21.8, "server_cpu": 0.98, "gpu_busy": 0.5, "mean_batch": 12.0,
        "wrong": 0, "errors": 0, "health": {"p50_ms": 0.4, "p99_ms": 1.2, "max_ms": 6.3},
    }  # fmt: skip
    longest = {"t": 1.0, "ms": 151.2, "generation": 2, "collected": 9, "tracked": 312_000, "pid": 1}
    paused = {**r, "gc": {"count": 2, "longest_ms": 151.2, "total_ms": 160.0, "over_ms": 10.0,
                          "count_over": 1, "longest": longest}}  # fmt: skip
    results = {
        "resnet50": {
            "closed": {"nogpu": r},
            "open": {"4000/s": {"rate": 4000.0, "nogpu": r, "batch_graph": paused}},
            "threads": {},
        }
    }
    text = "\n".join(compare.table(results))
    assert "open loop at 4,000 req/s** (a fixed rate)" in text
    assert "| GC pauses >= 5 ms: count / longest ms |" in text
    assert (
        "| batch_graph | 4,000 | 5.00 | 21.8 | 0.40 / 1.20 / 6.30 | 98 % | 50 % | 12.0 | 2 / 151.2 | 0 / 0 |"
        in text
    )
    # The answers' check stays the last column (tests/test_gpu_examples_service.py reads it there).
    assert "| nogpu | 4,000 | 5.00 | 21.8 | 0.40 / 1.20 / 6.30 | 98 % | 50 % | 12.0 | - | 0 / 0 |" in text
    closed = text.split("open loop")[0]
    assert "GC pauses" not in closed  # no row of it recorded any: the table as before
    assert "gc pauses >= 5 ms: 2, longest 151.2 ms" in compare._line(paused)
    # The benchmark's targets for it (issue 47's).
    report = "\n".join(serve.markdown({"models": results}))
    assert (
        "- resnet50, open loop at 4,000/s: batch_graph request p99 21.8 ms (target <= 25 ms: met), "
        "/health max 6.3 ms (target <= 10 ms: met), garbage collections of 5 ms or more: 2, longest "
        "151.2 ms, generation 2, 312,000 objects tracked (target: none over 10 ms: **missed**)"
    ) in report


def test_the_fixed_open_loop_rates_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDAFUT_BENCH_SERVE_RATES", raising=False)
    assert serve._rates() == (4000.0,)
    monkeypatch.setenv("CUDAFUT_BENCH_SERVE_RATES", "4000 2000.5")
    assert serve._rates() == (4000.0, 2000.5)
    monkeypatch.setenv("CUDAFUT_BENCH_SERVE_RATES", "")
    assert serve._rates() == ()
    for bad in ("fast", "0", "4000 -1"):
        monkeypatch.setenv("CUDAFUT_BENCH_SERVE_RATES", bad)
        with pytest.raises(ValueError, match="request rates"):
            serve._rates()


def test_compare_runs_the_fixed_rates_and_reads_each_servers_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``open_rates``, nogpu and batch_graph (not the unbatched
    handlers) also run open loop at each rate, and every run is handed the
    file its server records pauses in."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("psutil")
    import contextlib
    import types
    from collections.abc import Iterator

    compare = load_example(SERVICE / "compare.py")
    runs: list[tuple[str, float, Any]] = []

    @contextlib.contextmanager
    def serving(model: str, mode: str, port: int, ref_path: str, log: Path, **kwargs: Any) -> Iterator[Any]:
        yield types.SimpleNamespace(pid=0, mode=mode, log=log)

    def measure(
        proc: Any, port: int, *, rate: float = 0.0, pauses: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        runs.append((proc.mode, rate, pauses))
        assert pauses == compare.pauses_file(proc.log)
        health = {"p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}
        return {
            "rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0, "health": health, "server_cpu": 1.0,
            "main_thread_cpu": 0.5, "gpu_busy": None, "mean_batch": None, "wrong": 0, "errors": 0,
        }  # fmt: skip

    monkeypatch.setattr(compare, "serving", serving)
    monkeypatch.setattr(compare, "measure", measure)
    monkeypatch.setattr(compare, "reference", lambda model: np.zeros((2, 3), np.float32))
    modes = ("nogpu", "executor", "batch_graph")
    out = compare.compare(
        ("resnet50",), modes, seconds=0.1, warmup=0.0, open_rates=(4000.0,), step=lambda t: None
    )
    assert {(mode, rate) for mode, rate, _ in runs if rate == 4000.0} == {
        ("nogpu", 4000.0),
        ("batch_graph", 4000.0),
    }
    assert set(out["resnet50"]["open"]["4000/s"]) == {"rate", "nogpu", "batch_graph"}
    assert all(pauses is not None for _, _, pauses in runs)


def test_the_frozen_count_is_remembered_not_walked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # gc.get_freeze_count() walks the whole permanent generation (about
    # 30 ms with PyTorch loaded): a /stats that asked it held the loop.
    pauses = load_example(SERVICE / "pauses.py")
    assert pauses.frozen_count() == 0
    keep = [[i] for i in range(1000)]
    try:
        frozen = pauses.freeze_warm_objects()
        # Not == gc.get_freeze_count() later: frozen objects that other
        # threads drop leave the permanent generation.
        assert frozen >= len(keep)

        def walk() -> int:
            raise AssertionError("frozen_count() walked the frozen objects again")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert pauses.frozen_count() == frozen
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_the_stall_trace_names_what_held_the_loop(tmp_path: Path) -> None:
    import asyncio
    import time

    stalltrace = load_example(SERVICE / "stalltrace.py")

    def hold_the_loop() -> None:
        time.sleep(0.1)  # what a walk of 300,000 objects does to the loop, three times over

    async def main() -> None:
        stop = stalltrace.start(asyncio.get_running_loop(), tmp_path, period_ms=2.0, dump_after_ms=20.0)
        try:
            await asyncio.sleep(0.05)
            hold_the_loop()
            await asyncio.sleep(0.05)
        finally:
            stop()

    asyncio.run(main())
    late = [json.loads(line) for line in (tmp_path / "late.jsonl").read_text().splitlines()]
    assert any(row["late_ms"] >= 50 and row["pid"] == os.getpid() for row in late), late
    stacks = (tmp_path / f"stacks-{os.getpid()}.txt").read_text()
    assert "in hold_the_loop" in stacks, stacks
