"""Running a Jupyter notebook as its user would, top to bottom, in a kernel.

nbclient drives an IPython kernel started as ``sys.executable -m
ipykernel_launcher``: this very Python, so the kernel imports what the tests
import. The kernelspec is written for the run into a temporary folder,
rather than looked up among the installed ones (a ``--target`` install of
ipykernel has none, and an installed ``python3`` may be another Python),
with the repository first on the kernel's ``PYTHONPATH`` and IPython's
profile in the temporary folder. Needs nbclient and ipykernel
(``pip install -e ".[notebook]"``): :func:`execute_notebook` skips the test
without them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.subproc import ROOT

KERNEL = "cudafut-test-python"
REASON = 'running a notebook needs nbclient and ipykernel: pip install -e ".[notebook]"'


def execute_notebook(notebook: Path | Any, tmp_path: Path, *, timeout: int = 120) -> Any:
    """Run every cell of ``notebook`` (a path, or a notebook node) with the
    repository root as the kernel's working directory; return the executed
    notebook. A cell that raises fails the run (``CellExecutionError``)."""
    nbclient = pytest.importorskip("nbclient", reason=REASON)
    pytest.importorskip("ipykernel", reason=REASON)
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    nb = nbformat.read(notebook, as_version=4) if isinstance(notebook, Path) else notebook
    kernels = tmp_path / "kernels"
    spec = kernels / KERNEL
    spec.mkdir(parents=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    kernel_json = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info.major}.{sys.version_info.minor} (the tests')",
        "language": "python",
        # Added to the environment the kernel inherits from this process.
        "env": {"PYTHONPATH": path, "IPYTHONDIR": str(tmp_path / "ipython")},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel_json), encoding="utf-8")
    km = AsyncKernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    client = nbclient.NotebookClient(
        nb, km=km, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute(cleanup_kc=True)  # shut the kernel down, though this function made the manager
    return nb


def printed(nb: Any) -> str:
    """Everything the notebook's cells wrote to stdout, in order."""
    return "".join(
        output.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream" and output.name == "stdout"
    )
