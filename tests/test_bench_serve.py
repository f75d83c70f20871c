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
