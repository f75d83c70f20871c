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


def _compare_run(p99: dict[str, float | None], rps: float) -> dict[str, object]:
    """compare.py's results for ResNet-50, 256 clients: a closed loop, open
    loop at half the no-GPU rate, and at fixed rates (``p99``: the
    batch_graph p99 at each, by rate label)."""
    row = {"clients": 256, "rps": rps, "p99_ms": 50.0, "mean_batch": 32.0, "gpu_busy": None}
    row.update(wrong=0, errors=0)
    groups: dict[str, object] = {"nogpu/2": {"rate": 300.0, "batch_graph": {**row, "p99_ms": 999.0}}}
    for label, value in p99.items():
        groups[label] = {"rate": float(label.removesuffix("/s")), "batch_graph": {**row, "p99_ms": value}}
    return {"resnet50": {"closed": {"batch_graph": row, "nogpu": row}, "open": groups}}


def test_the_depth_table_compares_one_machines_runs_at_fixed_rates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    tables.load.cache_clear()
    here = {"gpu": "NVIDIA H200", "cpu_count": 32, "date": "2026-02-01 10:00"}
    command = "python examples/service/compare.py --models resnet50"
    _write(
        tmp_path,
        "serve-depth-h200-default.json",
        {**here, "producer": command, "note": "measured with an option since removed"},
        **_compare_run({"300/s": 9.2, "2000/s": None}, 5000.0),
    )
    shallow = f"{command} --server-args='--max-batch 32 --max-in-flight 2'"
    _write(
        tmp_path,
        "serve-depth-h200-32x2.json",
        {**here, "producer": shallow},
        **_compare_run({"300/s": 16.6}, 7000.0),
    )
    elsewhere = {"gpu": "NVIDIA H200", "cpu_count": 16, "date": "2026-03-01 10:00", "producer": command}
    _write(tmp_path, "serve-depth-h200-32x2c64.json", elsewhere, **_compare_run({"300/s": 1.0}, 9000.0))
    try:
        text = "\n".join(tables._pipeline_depth(tables.runs(tmp_path)))
    finally:
        tables.load.cache_clear()
    # Fixed rates only: half the no-GPU rate has a column of its own.
    assert "open loop p99 ms at 300 / 2,000 req/s" in text
    # A window without answers, a rate this run did not measure: "-".
    assert "| 256 | 5,000 | 50.0 | 32.0 | - | 9.2 / - | 300: 5,000 served, p99 999.0 |" in text
    assert "| 256 | 7,000 | 50.0 | 32.0 | - | 16.6 / - | 300: 7,000 served, p99 999.0 |" in text
    assert "9,000" not in text  # another machine's run is not compared
    assert f"run it again with `{command}`, and again with `{shallow}`" in text
    assert "clients*: measured with an option since removed." in text  # a run's note, under the table


def test_a_shared_hosts_rows_are_marked_and_the_mark_explained(tmp_path: Path) -> None:
    meta = {"gpu": "NVIDIA H200", "cpu_count": 32, "date": "2026-02-01 10:00:00 UTC"}
    _write(tmp_path, "a.json", {**meta, "beside": "x on the other GPU"}, wake={"x": 1})
    _write(tmp_path, "b.json", meta, host={"y": 1})
    by_name = {run.name: run for run in tables.runs(tmp_path)}
    shared, alone = tables._machine_day(by_name["a.json"]), tables._machine_day(by_name["b.json"])
    assert shared == "H200, host of 32 CPUs, 2026-02-01, *host shared*"
    assert alone == "H200, host of 32 CPUs, 2026-02-01"
    assert tables._shared_note([f"| r | {alone} |"]) == []
    assert tables._shared_note([f"| r | {shared} |"]) == ["", tables.SHARED_NOTE]


def test_a_gpu_busy_not_recorded_is_a_dash_not_zero() -> None:
    assert tables._busy({"gpu_busy": None}) == "-"
    assert tables._busy({"gpu_busy": 0.0}) == "0 %"
    assert tables._busy({"gpu_busy": 0.437}) == "44 %"
