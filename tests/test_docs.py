"""Every Python example in README.md and docs/ runs, as a newcomer would run it."""

from __future__ import annotations

import re

import pytest

from tests.subproc import ROOT, run_python

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
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "an example should print its result"
