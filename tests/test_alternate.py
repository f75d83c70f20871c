"""benchmarks/support/alternate.py: its arguments and its order of runs,
with a stand-in for ``python -m cudafut bench`` (no GPU needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support import alternate

ROOT = Path(__file__).resolve().parent.parent


def test_trees_run_in_turn_each_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake_run(cmd: list[str], cwd: Path, env: dict[str, str], **kwargs: Any) -> Any:
        calls.append((str(cwd), cmd[cmd.index("--name") + 1]))
        assert env["PYTHONPATH"].split(":")[0] == str(cwd)
        assert cmd[-2:] == ["--only", "wake"]
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    rc = alternate.main(
        [
            "--tree",
            f"a={ROOT}",
            "--tree",
            f"b={ROOT}",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
            "--",
            "--only",
            "wake",
        ]
    )
    assert rc == 0
    assert [name for _cwd, name in calls] == ["a-1", "b-1", "a-2", "b-2"]


def test_a_failed_run_is_counted_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = iter([1, 0])
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, next(results)))
    assert (
        alternate.main(
            ["--tree", f"a={ROOT}", "--tree", f"b={ROOT}", "--rounds", "1", "--out", str(tmp_path)]
        )
        == 1
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--tree", "nopath"],
        ["--tree", "a=/nonexistent"],
        ["--tree", f"a={ROOT}", "--tree", f"a={ROOT}"],
        ["--tree", f"a={ROOT}", "--rounds", "0"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        alternate.main(argv)


@pytest.mark.parametrize("args", [["--", "--only", "serve"], ["--", "--only", "collectives"], []])
def test_a_tree_without_examples_is_refused_for_the_sections_that_load_them(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cudafut").mkdir()
    (tmp_path / "benchmarks").mkdir()
    with pytest.raises(SystemExit):
        alternate.main(["--tree", f"base={tmp_path}", "--tree", f"new={ROOT}", *args])
    assert "has no examples/" in capsys.readouterr().err


def test_a_tree_without_examples_runs_the_sections_that_need_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cudafut").mkdir()
    (tmp_path / "benchmarks").mkdir()
    ran: list[list[str]] = []

    def run(trees: Any, rounds: int, out: Path, bench_args: list[str], *rest: Any) -> int:
        ran.append(bench_args)
        return 0

    monkeypatch.setattr(alternate, "run", run)
    assert alternate.main(["--tree", f"base={tmp_path}", "--", "--only", "host"]) == 0
    assert ran == [["--only", "host"]]
