"""Every figure the documentation quotes says what its committed results file
says, and the documentation lists every page. The docstrings of cudafut/
too: each figure they quote from a run is listed in ``DOCSTRING_FIGURES``
with its source, as a marker would name it on a page.

The markup and the checker are in ``benchmarks/support/figures.py`` (``python -m
benchmarks.support.figures`` runs the same check; ``--write`` rewrites the figures
that differ). No GPU: it reads ``benchmarks/results/*.json``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.subproc import ROOT

if not (ROOT / "benchmarks" / "results").is_dir():  # an sdist ships tests/ without benchmarks/
    pytest.skip("benchmarks/ and its results are in a source checkout only", allow_module_level=True)

from benchmarks.support import figures


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


# Docstrings: help() shows them as written, so their figures carry no
# marker; the marker of each is here, keyed by file and the figure as the
# docstring shows it ("150 µs", or a range "6.8-9.5 µs", one source per number).

#: A figure of a docstring: a number or a range with a unit of time or
#: throughput, or a ratio ("0.70x").
DOCSTRING_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*(?:-|to)\s*\d[\d,]*(?:\.\d+)?)?\s*"
    r"(?:µs|us|ms|GB/s|MB/s|req/s|images/s|x)(?![\w/])"
)
DOCSTRING_CODE = re.compile(r"``.*?``|`[^`]*`", re.S)

#: Every figure that a docstring of cudafut/ quotes from a run, and where it
#: comes from (a marker's text: ``FILE.json PATH``, ``;`` between the numbers
#: of a range). The docstring names the results file too, for its reader.
DOCSTRING_FIGURES: dict[tuple[str, str], str] = {
    ("cudafut/_trace/api.py", "4.6 µs"): (
        "bench-h200-tracing.json tracing > create + set + await > extra_us"
    ),
}

#: Figures of docstrings that are not a run's: settings and defaults, the
#: benchmark's own workloads, and rounded costs of single CUDA calls that no
#: committed results file measures. A new figure belongs in DOCSTRING_FIGURES,
#: quoted from a results file, unless it is one of these kinds.
NOT_FROM_A_RUN: dict[str, set[tuple[str, str]]] = {
    "a default or a setting": {
        ("cudafut/__init__.py", "100 µs"),
        ("cudafut/__init__.py", "1 ms"),
        ("cudafut/_combinators.py", "100 µs"),
        ("cudafut/_combinators.py", "1 ms"),
        ("cudafut/_future.py", "100 µs"),
        ("cudafut/_future.py", "1 ms"),
        ("cudafut/_policy.py", "1 ms"),
        ("cudafut/_policy.py", "2 ms"),
        ("cudafut/testing.py", "1 ms"),
        ("cudafut/distributed/_nccl.py", "10 ms"),
    },
    "a benchmark's workload": {
        ("cudafut/_cli/headline.py", "50 µs"),
        ("cudafut/_cli/headline.py", "20 ms"),
        ("cudafut/_cli/headline.py", "0.1 to 5 ms"),
    },
    "a rounded cost of one CUDA or host call, in no results file": {
        ("cudafut/__init__.py", "2 µs"),
        ("cudafut/_combinators.py", "0.4 µs"),
        ("cudafut/_combinators.py", "2 µs"),
        ("cudafut/_copies.py", "20 µs"),
        ("cudafut/_copies.py", "1 ms"),
        ("cudafut/_cuda.py", "1 µs"),
        ("cudafut/_cuda.py", "1.7 µs"),
        ("cudafut/_cuda.py", "0.4 µs"),
        ("cudafut/_event_calls.py", "1 µs"),
        ("cudafut/_notices.py", "50 µs"),
        ("cudafut/_events.py", "2 µs"),
        ("cudafut/_future.py", "1 µs"),
        ("cudafut/_future.py", "1.7 µs"),
        ("cudafut/_future.py", "0.4 µs"),
        ("cudafut/_future.py", "2 µs"),
        ("cudafut/_lifetimes.py", "2 µs"),
        ("cudafut/_memory.py", "3 µs"),
        ("cudafut/_memory.py", "1 µs"),
        ("cudafut/_pinned.py", "1 ms"),
        ("cudafut/_policy.py", "100-500 µs"),
        ("cudafut/_policy.py", "5 µs"),
        ("cudafut/_pools.py", "10 µs"),
        ("cudafut/_runtime.py", "1 µs"),
        ("cudafut/_producers.py", "1 µs"),
        ("cudafut/_tasks.py", "10 µs"),
        ("cudafut/_torch.py", "1 µs"),
        ("cudafut/_tracked.py", "2 µs"),
        ("cudafut/_tracked.py", "25 µs"),
        ("cudafut/_tracked.py", "1 µs"),
    },
}


def _docstrings() -> Iterator[tuple[str, str, str]]:
    """(file, where, docstring with inline code blanked) of every module,
    class and function of cudafut/."""
    for path in sorted((ROOT / "cudafut").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    blanked = DOCSTRING_CODE.sub(lambda m: " " * len(m.group()), doc)
                    yield rel, getattr(node, "name", "the module"), blanked


def _docstring_figures() -> list[tuple[str, str, str, str]]:
    """(file, where, figure, docstring) of every figure of the docstrings."""
    return [
        (rel, where, " ".join(m.group().split()), doc)
        for rel, where, doc in _docstrings()
        for m in DOCSTRING_FIGURE.finditer(doc)
    ]


def test_every_docstring_figure_comes_from_a_results_file() -> None:
    allowed = set().union(*NOT_FROM_A_RUN.values())
    problems = []
    seen = set()
    for rel, where, text, doc in _docstring_figures():
        key = (rel, text)
        seen.add(key)
        if key in allowed:
            continue
        source = DOCSTRING_FIGURES.get(key)
        if source is None:
            problems.append(
                f"{rel}, {where}: {text!r} is in no results file: quote one "
                "(and list it in DOCSTRING_FIGURES) or drop it"
            )
            continue
        items = figures._items(source, None)
        shown = figures.numbers(text)
        if len(shown) != len(items):
            problems.append(
                f"{rel}, {where}: {text!r} shows {len(shown)} number(s), its source has {len(items)}"
            )
            continue
        for number, (name, item) in zip(shown, items, strict=True):
            try:
                value = figures.evaluate(name, item)
            except figures.FigureError as exc:
                problems.append(f"{rel}, {where}: {text!r}: {exc} ({name}: {item})")
                continue
            if not number.matches(value):
                problems.append(
                    f"{rel}, {where}: says {number.text}, {name}: {item} gives {value:.6g} "
                    f"(shown as {number.formatted(value)})"
                )
            if name.removesuffix(".json") not in doc:
                problems.append(f"{rel}, {where}: {text!r} comes from {name}: the docstring should name it")
    stale = sorted(set(DOCSTRING_FIGURES) - seen) + sorted(allowed - seen)
    problems += [
        f"{rel}: no docstring shows {text!r} any more: remove it from the lists here" for rel, text in stale
    ]
    assert not problems, "figures in cudafut/'s docstrings:\n" + "\n".join(problems)


def test_a_docstring_figure_is_found_with_its_range_and_unit() -> None:
    found = [
        " ".join(m.group().split())
        for m in DOCSTRING_FIGURE.finditer(
            "p99 150 µs, 6.8-9.5 µs, 0.1 to 5 ms, 7,363 req/s, 0.70x, 2 GB/s; not h100x, 3 times, 4 mss"
        )
    ]
    assert found == ["150 µs", "6.8-9.5 µs", "0.1 to 5 ms", "7,363 req/s", "0.70x", "2 GB/s"]


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
