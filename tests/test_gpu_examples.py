"""The examples run as a user runs them, with ``--quick``, and check their own
results: the copy/compute pipeline (examples/pipeline.py, traced too),
cudafut.Batcher under trio (examples/trio_app.py), a Batcher started and
closed by aiohttp's hooks (examples/service_hooks.py), and the notebook
(examples/notebook.ipynb, executed by nbclient); examples/service/ in
tests/test_gpu_examples_service.py. No timing is asserted: only that each
exits 0 having printed its ``results checked`` line, or, for the notebook,
its values."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.notebooks import execute_notebook, printed
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
def test_pipeline_quick_traced(tmp_path: Path) -> None:
    trace = tmp_path / "pipeline.json"
    proc = run_example("pipeline.py", "--quick", "--trace", str(trace), timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all" in proc.stdout, _explain(proc)
    assert "chunks/s" in proc.stdout and "docs/render_trace.py" in proc.stdout, _explain(proc)
    events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    assert any(e["ph"] == "X" and e["cat"] == "gpu" for e in events)


@pytest.mark.timeout(300)
def test_service_hooks_on_a_gpu() -> None:
    pytest.importorskip("aiohttp")
    proc = run_example("service_hooks.py", timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all; the Batcher closed with the app" in proc.stdout, _explain(proc)


@pytest.mark.timeout(300)
def test_trio_app_quick() -> None:
    pytest.importorskip("trio")
    proc = run_example("trio_app.py", "--quick", timeout=280)
    assert proc.returncode == 0, _explain(proc)
    assert "results checked: all" in proc.stdout, _explain(proc)
    assert "| batched |" in proc.stdout and "| unbatched |" in proc.stdout, _explain(proc)


@pytest.mark.timeout(300)
def test_notebook_runs(tmp_path: Path) -> None:
    """Every cell of examples/notebook.ipynb, in order, in a fresh kernel
    (tests/notebooks.py says which); skipped without nbclient and ipykernel."""
    nb = execute_notebook(ROOT / "examples" / "notebook.ipynb", tmp_path, timeout=120)
    out = printed(nb)
    explain = f"the notebook printed:\n{out}"
    # sum(sqrt(x * x + 1) for x in range(2**20)) = 549755289607.9 (float32 rounds)
    total = re.search(r"^result\(\): ([0-9.e+]+)$", out, re.M)
    assert total is not None and math.isclose(float(total[1]), 549_755_289_608, rel_tol=1e-3), explain
    # ~50 ticks of 10 ms during 0.5 s of GPU work when awaited; none when blocked in result()
    ticked = re.search(r"^await: the loop ticked (\d+) times", out, re.M)
    assert ticked is not None and int(ticked[1]) >= 10, explain
    assert "result(): the loop ticked 0 times" in out, explain
    assert "as_completed: 16 jobs, total 136000" in out, explain
