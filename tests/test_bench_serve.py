"""The serve benchmark's several-process part, on the CPU: which GPU counts
it runs, and the targets it reports, from committed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import serve

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


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
    """From the committed 4-GPU runs: one GPU (call 1) and two and four
    (call 2) as the part would have put them together."""
    pytest.importorskip("aiohttp")  # markdown() renders through compare.py
    processes = {
        "1": json.loads((RESULTS / "serve-fronts-h200x4-call1-1gpu.json").read_text()),
        "2": json.loads((RESULTS / "serve-fronts-h200x4-d6bb114-2gpu.json").read_text()),
        "4": json.loads((RESULTS / "serve-fronts-h200x4-d6bb114-4gpu.json").read_text()),
    }
    text = "\n".join(serve.markdown({"processes": processes}))
    assert "- 1 GPU(s): fronts at 0.61x the GPUs' own limit (target 0.9 on one GPU)" in text
    assert "- 1 GPU(s): 9.7x LitServe with the same processes (target 5)" in text
    assert "- 2 GPUs: 2.24x one GPU (target 1.9)" in text
    assert "- 4 GPUs: 3.45x one GPU (target 3.7)" in text
    assert "Several processes, 4 GPU(s)" in text


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
        "(10,000 req/s first, 16,000 after the others; target 0.75)"
    ) in text
    assert "| nogpu (again, after the others) | 16,000 |" in text
    del model["again"]  # a run from before: the one ceiling it has
    text = "\n".join(serve.markdown({"models": {"resnet50": model}}))
    assert "- resnet50: launch + Batcher + graphs at 0.50x the no-GPU ceiling (target 0.75)" in text
