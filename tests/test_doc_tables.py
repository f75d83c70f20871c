"""The documentation's figures are generated from the committed results
(benchmarks/support/tables.py): each generated file must be what the
generator writes now, and the pages must include them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "benchmarks" / "results").is_dir():  # an sdist ships tests/ without benchmarks/
    pytest.skip("benchmarks/ and its results are in a source checkout only", allow_module_level=True)

from benchmarks.support import tables  # noqa: E402


def test_every_generated_file_is_current() -> None:
    pytest.importorskip("aiohttp")  # the serve section renders its tables through examples/service/compare.py
    old = tables.stale()
    assert not old, (
        f"not what the results in benchmarks/results/ give now: {[str(p.relative_to(ROOT)) for p in old]}; "
        f"run {tables.COMMAND} and commit what it writes"
    )


def test_every_snippet_is_included_by_a_page_and_exists() -> None:
    pages = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    included = {
        m for text in pages.values() for m in re.findall(r'--8<-- "docs/generated/([\w-]+)\.md"', text)
    }
    assert included <= set(tables.SNIPPETS), (
        f"pages include snippets the generator does not write: {included}"
    )
    assert set(tables.SNIPPETS) <= included, f"snippets no page includes: {set(tables.SNIPPETS) - included}"


def test_each_table_names_its_machine_and_date() -> None:
    for name, render in tables.SNIPPETS.items():
        if name.startswith("serve") or name == "processes":  # rendered by the serve section
            pytest.importorskip("aiohttp")
        text = "\n".join(render(tables.runs()))
        assert re.search(r"\d{4}-\d\d-\d\d", text), f"{name}: no date"
        assert "H100" in text or "H200" in text, f"{name}: no machine"


def _write(folder: Path, name: str, meta: dict[str, object], **sections: object) -> None:
    (folder / name).write_text(json.dumps({"meta": meta, **sections}))


def test_the_newest_run_of_each_part_and_machine_is_kept(tmp_path: Path) -> None:
    h200 = {"gpu": "NVIDIA H200", "cpu_count": 16}
    _write(tmp_path, "old.json", {**h200, "date": "2026-01-01 10:00:00 UTC"}, wake={"x": 1}, host={"y": 1})
    _write(tmp_path, "new.json", {**h200, "date": "2026-02-01 10:00:00 UTC"}, wake={"x": 2})
    _write(
        tmp_path, "h100.json", {"gpu": "NVIDIA H100", "cpu_count": 16, "date": "2025-01-01"}, wake={"x": 0}
    )
    runs = tables.runs(tmp_path)
    best = tables.newest_by_part(runs)
    assert best[("wake", ("NVIDIA H200", 16))].name == "new.json"
    assert best[("host", ("NVIDIA H200", 16))].name == "old.json"  # still the newest of host
    assert best[("wake", ("NVIDIA H100", 16))].name == "h100.json"  # another machine
    assert tables.newest(runs, "wake") is not None and tables.newest(runs, "wake").name == "new.json"  # type: ignore[union-attr]


def test_a_caption_says_what_ran_beside_the_run(tmp_path: Path) -> None:
    meta = {"gpu": "NVIDIA H200", "cpu_count": 32, "date": "2026-02-01 10:00:00 UTC"}
    _write(tmp_path, "quiet.json", meta, wake={"x": 1})
    _write(tmp_path, "shared.json", {**meta, "beside": "the serve benchmark on the other GPU"}, host={"y": 1})
    by_name = {run.name: run for run in tables.runs(tmp_path)}
    assert "with the serve benchmark on the other GPU;" in tables._caption(by_name["shared.json"], "cmd")
    assert tables._caption(by_name["quiet.json"], "cmd") == (
        "*Measured on H200, host of 32 CPUs, 2026-02-01; run it again with `cmd`.*"
    )


def test_a_results_file_without_meta_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"wake": {}}))
    with pytest.raises(tables.TablesError, match="LEGACY"):
        tables.runs(tmp_path)


def test_a_stale_file_is_reported_and_write_fixes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "snippet.md"
    target.write_text("old\n")
    assert tables.stale({target: "new\n"}) == [target]
    target.write_text("new\n")
    assert tables.stale({target: "new\n"}) == []


def test_the_readme_table_goes_between_its_markers() -> None:
    text = f"a\n{tables.README_BEGIN}\nold\n{tables.README_END}\nb\n"
    assert (
        tables._with_readme_table(text, ["| x |"])
        == f"a\n{tables.README_BEGIN}\n| x |\n{tables.README_END}\nb\n"
    )
    with pytest.raises(tables.TablesError, match="lacks"):
        tables._with_readme_table("no markers", [])
