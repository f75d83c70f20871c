"""``python -m cudafut --quick --json`` on a GPU: the self-check sees the
device, every figure is measured, the plot is drawn. No thresholds on
speed: the benchmark reports, it does not judge."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cudafut._cli import headline as _headline
from tests.subproc import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_quick_json_run(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "cudafut", "--quick", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["error"] is None

    check = doc["selfcheck"]
    assert check["usable"] is True and check["problem"] is None
    assert check["devices"]
    for dev in check["devices"]:
        assert dev["name"] and dev["total_memory_bytes"] > 0 and dev["multiprocessors"] > 0
        assert re.fullmatch(r"\d+\.\d+", dev["compute_capability"])
    assert re.fullmatch(r"\d+\.\d+", check["driver"]["cuda"])
    assert re.fullmatch(r"\d+\.\d+", check["cupy"]["cuda_runtime"])
    assert check["cupy"]["present"] is True and check["cupy"]["version"]
    for name in ("torch", "trio", "uvloop", "nvtx", "nccl"):
        assert isinstance(check["packages"][name]["present"], bool)
    assert isinstance(check["timerfd"], bool)
    assert check["policy"]["name"] == "balanced"

    results = doc["results"]
    assert results["quick"] is True
    assert results["device"]["name"] == check["devices"][0]["name"]
    assert set(results["wait"]) == {w.name for w in _headline.WORKS}
    figures = _headline.measurements(results)
    assert figures
    for name, value in figures.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    for row in results["wait"].values():  # differences of two medians: any sign
        assert math.isfinite(row["await_extra_us"]) and math.isfinite(row["thread_extra_us"])
        assert row["n"] > 0
    assert results["copies"]["data_ok"] is True
    assert results["copies"]["reps"] >= _headline.COPY_MIN_REPS

    if importlib.util.find_spec("matplotlib") is None:
        assert doc["plot"] is None
        assert any("cudafut[cli]" in note for note in doc["notes"])
    else:
        plot = Path(doc["plot"])
        assert plot.parent == out.resolve()
        assert plot.is_file() and plot.read_bytes()[:4] == b"\x89PNG"
