"""Running Python code in a fresh interpreter, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_env(**env: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, and ``env``."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **env}


def run_python(code: str, *argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the repository importable; return the finished process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=python_env(**env),
        timeout=timeout,
        check=False,
    )
