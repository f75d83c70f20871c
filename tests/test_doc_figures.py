"""Every figure the documentation quotes says what its committed results file
says, and the documentation lists every page.

The markup and the checker are in ``benchmarks/support/figures.py`` (``python -m
benchmarks.support.figures`` runs the same check; ``--write`` rewrites the figures
that differ). No GPU: it reads ``benchmarks/results/*.json``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.subproc import ROOT

if not (ROOT / "benchmarks" / "results").is_dir():  # an sdist ships tests/ without benchmarks/
    pytest.skip("benchmarks/ and its results are in a source checkout only", allow_module_level=True)

from benchmarks.support import figures

#: Pages whose every table is checked (each number of each table cell, but
#: the first column, comes from a marker, or the table says it holds no
#: figures); a page of figures should be listed here.
CHECKED_PAGES = ["README.md", "docs/performance.md", "docs/serving.md"]


def test_every_quoted_figure_matches_its_results_file() -> None:
    scans, problems = figures.check(figures.documented_files())
    assert not problems, (
        "figures in the docs differ from the results files they name (python -m benchmarks.support.figures "
        "--write rewrites them from the JSON; then read the sentences around them again):\n"
        + "\n".join(problems)
    )
    assert sum(len(s.figures) for s in scans) > 0


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_every_table_figure_of_a_page_is_checked(page: str) -> None:
    scan = figures.scan(ROOT / page)
    assert scan.figures, f"{page} quotes no checked figure"
    assert not scan.unchecked, (
        f"{page}: numbers in tables with no marker (benchmarks/support/figures.py says how to mark them, or "
        f"<!-- table: skip --> for a table without figures): {scan.unchecked}"
    )


def _doc_pages() -> list[str]:
    return sorted(path.name for path in (ROOT / "docs").glob("*.md"))


def test_readme_lists_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Documentation", 1)[1]
    linked = set(
        re.findall(r"\]\(https://github\.com/cudafut/cudafut/blob/main/docs/([\w-]+\.md)\)", section)
    )
    missing = [page for page in _doc_pages() if page not in linked]
    assert not missing, f"README.md, 'Documentation', should link docs/{missing}"
    assert "mkdocs serve" in section, "README.md, 'Documentation', should say how to view the site"


def test_the_site_menu_has_every_page() -> None:
    # mkdocs build --strict fails on a page missing from nav too; this says so without mkdocs.
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    missing = [page for page in _doc_pages() if page not in nav]
    assert not missing, f"mkdocs.yml's nav should list {missing}"


# The checker itself, on results files of its own.


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "run.json").write_text(
        json.dumps(
            {
                "wake": {
                    "2.0": {"cudafut await (balanced)": {"extra_p50_us": 83.1, "cpu": 0.2093}},
                    "20.0": {"cudafut await (balanced)": {"extra_p50_us": 116.6, "cpu": 0.0969}},
                },
                "many": {"n": 10000, "ratio": 4.004, "flag": True},
                "a key": {"step: one": 1.0, "steps: two": 2.0, "bimodal at random": 3.0, "random: x": 4.0},
            }
        )
    )
    monkeypatch.setattr(figures, "RESULTS", folder)
    figures.load.cache_clear()
    yield folder
    figures.load.cache_clear()


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def _problems(page: Path) -> list[str]:
    return figures.check([page])[1]


def test_a_marked_figure_is_checked_with_the_decimals_it_shows(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "It wakes +117 µs<!-- fig: run.json wake > 20.0 > await > extra_p50_us --> late,\n"
        "at CPU 0.10<!-- fig: run.json wake > 20.0 > await > cpu -->,\n"
        "4.0x<!-- fig: run.json many > ratio -->\n"
        "and 10,000 of them<!-- fig: run.json many > n -->.\n",
    )
    assert _problems(page) == []
    assert len(figures.scan(page).figures) == 4


def test_a_figure_that_drifted_fails_and_write_fixes_it(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "Stable 20 ms work wakes +18 µs<!-- fig: run.json wake > 20.0 > await > extra_p50_us --> late.\n",
    )
    problems = _problems(page)
    assert len(problems) == 1
    assert "says +18" in problems[0] and "shown as +117" in problems[0], problems
    assert figures.main(["--write", str(page)]) == 0
    assert "wakes +117 µs<!--" in page.read_text()
    assert _problems(page) == []


def test_several_figures_ranges_arithmetic_and_a_default_file(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- figures: run.json -->\n"
        "Repeating jobs: 83-117 µs<!-- fig: wake > 2.0 > await > extra_p50_us;\n"
        "  wake > 20.0 > await > extra_p50_us -->, 21 %<!-- fig: {wake > 2.0 > await > cpu} * 100 -->\n"
        "CPU; at most 0.117 ms<!-- fig: max({wake > * > await > extra_p50_us}) / 1000 -->;\n"
        "ratio 1.4<!-- fig: {wake > 20.0 > await > extra_p50_us} / {wake > 2.0 > await > extra_p50_us} -->;\n"
        "both: 83.1 and 0.21<!-- fig: wake > 2.0 > await > extra_p50_us; cpu -->.\n",
    )
    assert _problems(page) == []
    assert [f.number.text for f in figures.scan(page).figures] == [
        "83",
        "117",
        "21",
        "0.117",
        "1.4",
        "83.1",
        "0.21",
    ]


def test_a_table_is_checked_cell_by_cell(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- table: run.json wake > {row} > {col} > extra_p50_us; cpu -->\n"
        "\n"
        "| work | cudafut `await` (balanced) | ratio<!-- run.json many > ratio --> | other<!-- skip --> |\n"
        "|---|---|---|---|\n"
        "| 2 ms<!-- 2.0 --> | **+83 µs, CPU 0.21** | 4.00 | 7 |\n"
        "| 20 ms<!-- 20.0 --> | +117 µs, CPU 0.09 | n/a | 8 |\n",
    )
    problems = _problems(page)
    assert len(problems) == 1 and "says 0.09" in problems[0], problems
    scan = figures.scan(page)
    assert len(scan.figures) == 5
    # The skipped column is not checked, and says so.
    assert [text for _, text in scan.unchecked] == ["7", "8"]


def test_a_cell_with_too_few_numbers_is_reported(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- table: run.json wake > {row} > {col} > extra_p50_us; cpu -->\n"
        "| work | cudafut await (balanced) |\n|---|---|\n| 2.0 | +83 µs |\n",
    )
    (problem,) = _problems(page)
    assert "shows 1 number(s), its template has 2" in problem


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("run.json wake > 5.0 > x", "no key '5.0'"),
        ("run.json a key > step", "part of several keys"),
        ("run.json many > flag", "not a number"),
        ("run.json wake > * > await > cpu", "2 values"),
        ("missing.json many > n", "no results file"),
        ("many > n", "no results file: name one"),
        ("run.json {many > n} ** 2", "only numbers"),
    ],
)
def test_a_marker_that_cannot_be_read_says_why(
    results: Path, tmp_path: Path, marker: str, message: str
) -> None:
    page = _page(tmp_path, f"A figure: 5<!-- fig: {marker} -->.\n")
    problems = _problems(page)
    assert len(problems) == 1 and message in problems[0], problems


def test_keys_match_whole_then_by_prefix_then_by_part(results: Path) -> None:
    assert figures.evaluate("run.json", "a key > random") == 4.0  # prefix beats "bimodal at random"
    assert figures.evaluate("run.json", "a key > step:") == 1.0
    assert figures.evaluate("run.json", "a key > two") == 2.0


def test_code_is_neither_a_marker_nor_a_figure(results: Path, tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "```\n5 <!-- fig: run.json many > n -->\n```\n"
        "and `7 <!-- fig: run.json many > n -->` and `WaitPolicy(cpu_budget=0.02)`,\n"
        "and code across lines, `<!-- fig: run.json\nmany > n -->`\n",
    )
    assert figures.check([page]) == ([figures.Scan(page, [], [], [])], [])
