"""The pages a user reads stay user pages (issue 48): short enough to read,
their figures generated rather than typed, and no run history in them
(that belongs in CHANGELOG.md and in git)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The longest each page may be, in lines of its source (the generated
#: tables it includes are one line each).
LONGEST = {
    "README.md": 150,
    "serving.md": 310,
    "performance.md": 310,
    "reliability.md": 310,
    "processes.md": 310,
}

CODE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
#: A commit's short or full hash: 7 to 40 hex digits with a digit and a letter among them.
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
#: What a lab notebook says and a user page does not.
HISTORY = re.compile(r"\bstep (?:one|two|three|four|five|\d)\b|\b\d\d:\d\d(?::\d\d)? UTC\b", re.I)
#: A hand-typed figure's marker (the generated tables replaced them).
MARKER = re.compile(r"<!-- (?:fig|figures|table):")


def _prose(path: Path) -> str:
    return CODE.sub("", path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(LONGEST))
def test_the_page_is_short_enough_to_read(name: str) -> None:
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= LONGEST[name], f"{name} has {lines} lines (at most {LONGEST[name]}): tighten it"


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_no_commit_hashes_run_history_or_figure_markers(path: Path) -> None:
    text = _prose(path)
    hashes = HASH.findall(text)
    assert not hashes, f"{path.name}: commit hashes {hashes}: git has them, not the page"
    assert not HISTORY.findall(text), f"{path.name}: run history {HISTORY.findall(text)}: CHANGELOG.md has it"
    assert not MARKER.findall(text), (
        f"{path.name}: a hand-typed figure's marker: include a table of docs/generated/ "
        "(benchmarks/support/tables.py) instead"
    )


def test_the_checks_find_what_they_look_for() -> None:
    assert HASH.findall("see 9e0b1d4 and serve-h200x1-739b050.json") == ["9e0b1d4", "739b050"]
    assert HASH.findall("16777216 bytes, a deadbeef, 0x55d0c8e0") == []
    assert HISTORY.findall("The native core, step four; 09:07:58 UTC") == ["step four", "09:07:58 UTC"]
    assert MARKER.findall("10 µs<!-- fig: run.json a > b -->")
