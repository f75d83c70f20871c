"""Every Python example in README.md and docs/ runs, as a newcomer would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples() -> list[object]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, match in enumerate(FENCE.finditer(path.read_text())):
            found.append(pytest.param(match.group(1), id=f"{path.name}-{i}"))
    return found


def test_the_readme_has_examples() -> None:
    assert len(examples()) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("code", examples())
def test_example_runs(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "an example should print its result"
