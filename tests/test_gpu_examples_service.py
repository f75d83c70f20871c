"""examples/service/ run as a user runs it, with ``--quick``, on a GPU: a
torchvision model served by the no-GPU harness, ``launch()`` and ``launch()``
+ ``Batcher`` + graphs, every answer checked by the load generator."""

from __future__ import annotations

import pytest

from tests.test_gpu_examples import _explain, run_example

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(400)
def test_service_compare_quick() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("torchvision")
    modes = ("nogpu", "launch", "batch_graph")
    proc = run_example("service/compare.py", "--quick", "--modes", *modes, timeout=380)
    assert proc.returncode == 0, _explain(proc)
    for mode in modes:
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {mode} |")]
        assert rows, _explain(proc)
        assert rows[0].rstrip().endswith("| 0 / 0 |"), _explain(proc)  # no wrong answer, no error


@pytest.mark.timeout(400)
def test_service_from_several_processes_quick() -> None:
    """multiproc.py: two front processes and a GPU process, the answers
    crossing as shared futures; every answer checked."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("torchvision")
    modes = ("nogpu_fronts", "fronts")
    proc = run_example("service/compare.py", "--quick", "--modes", *modes, "--fronts", "2", timeout=380)
    assert proc.returncode == 0, _explain(proc)
    for mode in modes:
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {mode} |")]
        assert rows, _explain(proc)
        assert rows[0].rstrip().endswith("| 0 / 0 |"), _explain(proc)
