"""The examples run as a user runs them, with ``--quick``, and check their own
results: the aiohttp service in its four modes (examples/service/compare.py),
the copy/compute pipeline (examples/pipeline.py, traced too) and the trio
batcher (examples/trio_app.py). No timing is asserted: only that each exits
0 having printed its ``results checked`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subproc import ROOT

pytestmark = pytest.mark.gpu


def run_example(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        timeout=timeout,
        check=False,
    )


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(300)
def test_service_compare_quick() -> None:
    pytest.importorskip("aiohttp")
    proc = run_example("service/compare.py", "--quick", timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all" in proc.stdout, _explain(proc)
    for mode in ("batched", "unbatched", "sync", "executor"):
        assert f"| {mode} |" in proc.stdout, _explain(proc)


@pytest.mark.timeout(300)
def test_pipeline_quick_traced(tmp_path: Path) -> None:
    trace = tmp_path / "pipeline.json"
    proc = run_example("pipeline.py", "--quick", "--trace", str(trace), timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all" in proc.stdout, _explain(proc)
    assert "chunks/s" in proc.stdout and "docs/render_trace.py" in proc.stdout, _explain(proc)
    events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    assert any(e["ph"] == "X" and e["cat"] == "gpu" for e in events)


@pytest.mark.timeout(300)
def test_trio_app_quick() -> None:
    pytest.importorskip("trio")
    proc = run_example("trio_app.py", "--quick", timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all" in proc.stdout, _explain(proc)
    assert "| batched |" in proc.stdout and "| unbatched |" in proc.stdout, _explain(proc)
