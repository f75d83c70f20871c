"""``python -m cudafut`` without a GPU: the arguments, ``--help``, what it
says on a machine it cannot measure, the rendering of results, and that
``python -m cudafut bench`` still runs the suite.

The measuring itself is in tests/test_gpu_main.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cudafut
from cudafut import _cli as cli
from cudafut._cli import headline as _headline
from cudafut._cli import selfcheck as _selfcheck
from tests.subproc import ROOT, run_python

MAIN = "import sys; from cudafut._cli import main; sys.exit(main(sys.argv[1:]))"
NO_CUPY = "import sys; sys.modules['cupy'] = None; " + MAIN  # as if CuPy were not installed


@pytest.fixture(autouse=True)
def _keep_policy() -> Any:
    old = cudafut.get_wait_policy()
    yield
    cudafut.set_wait_policy(old)


# -- arguments ------------------------------------------------------------------------


def test_defaults() -> None:
    args = cli.parser().parse_args([])
    assert (args.quick, args.json, args.out, args.no_plot, args.policy, args.check_only) == (
        False,
        False,
        ".",
        False,
        None,
        False,
    )


def test_every_option() -> None:
    args = cli.parser().parse_args(
        ["--quick", "--json", "--out", "some/dir", "--no-plot", "--policy", "low_cpu", "--check-only"]
    )
    assert (args.quick, args.json, args.out, args.no_plot, args.policy, args.check_only) == (
        True,
        True,
        "some/dir",
        True,
        "low_cpu",
        True,
    )


@pytest.mark.parametrize("argv", [["--policy", "fastest"], ["--bogus"], ["measure"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: python -m cudafut" in capsys.readouterr().err


def test_help_describes_everything() -> None:
    proc = run_python(MAIN, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for word in (
        "--quick",
        "--json",
        "--out",
        "--policy",
        "--no-plot",
        "--check-only",
        "self-check",
        "50 us",
        "20 ms",
        "0.1-5 ms",
        "blocking-sync event",
        "to_device(pinned)",
        "64 MB",
        "cudafut[cli]",
        "python -m cudafut bench",
        "Exit status",
    ):
        assert word in out, word


# -- no usable GPU --------------------------------------------------------------------


def test_no_gpu_says_what_is_missing() -> None:
    # No device visible (on a GPU machine too); on a machine without a
    # driver or CuPy, that is what it reports.
    proc = run_python(MAIN, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "cudafut cannot use a GPU here:" in proc.stderr
    assert "To fix it:" in proc.stderr
    assert "CUDA_VISIBLE_DEVICES" in proc.stderr  # set to '': the fix says so
    assert "CuPy" in proc.stdout and "wait policy" in proc.stdout  # the self-check ran
    # What it needs, and what works without it.
    assert "python -m cudafut needs an NVIDIA GPU" in proc.stderr
    assert "pytest" in proc.stderr and "cudafut.testing" in proc.stderr and "docs/testing.md" in proc.stderr


def test_no_gpu_json_says_why() -> None:
    proc = run_python(MAIN, "--json", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout is one document
    assert doc["ok"] is False
    assert doc["error"]["reason"]
    assert doc["error"]["fix"]
    assert doc["results"] is None
    assert doc["selfcheck"]["usable"] is False
    assert doc["selfcheck"]["problem"] == doc["error"]["reason"]


def test_no_gpu_points_to_the_fake_gpu() -> None:
    # The last fix, whatever is missing (no device here; no CuPy), once.
    for proc in (run_python(MAIN, CUDA_VISIBLE_DEVICES=""), run_python(NO_CUPY)):
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "\n  - or test without a GPU: cudafut.testing (docs/testing.md)\n" in proc.stderr, proc.stderr
        assert proc.stderr.count("cudafut.testing") == 1, proc.stderr
    # And the error a call raises says it too.
    proc = run_python(
        "import cudafut\n"
        "try:\n"
        "    cudafut.CudaFuture(devices=0)\n"
        "except cudafut.CudaUnavailableError as exc:\n"
        "    print(exc)",
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.stdout.rstrip().endswith("; or test without a GPU: cudafut.testing (docs/testing.md)"), proc


def test_no_cupy_names_the_extra() -> None:
    proc = run_python(NO_CUPY)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "CuPy is not installed" in proc.stderr
    assert "cudafut[cuda12]" in proc.stderr
    assert "not installed" in proc.stdout


def test_no_cupy_json() -> None:
    proc = run_python(NO_CUPY, "--json", "--quick")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["selfcheck"]["cupy"]["present"] is False
    assert "CuPy is not installed" in doc["error"]["reason"]
    assert any("cudafut[cuda12]" in fix for fix in doc["error"]["fix"])


def test_selfcheck_never_raises() -> None:
    check = _selfcheck.gather()
    json.dumps(check)
    assert isinstance(check["usable"], bool)
    assert (check["problem"] is None) == check["usable"]
    assert set(check["packages"]) == {"torch", "trio", "uvloop", "nvtx", "nccl"}
    assert isinstance(check["timerfd"], bool)
    assert check["policy"]["name"] == "balanced"
    lines = _selfcheck.lines(check)
    assert lines[0].startswith(f"cudafut {cudafut.__version__}")
    assert any("wait policy" in line for line in lines)


def test_cuda_versions_read_as_cuda_writes_them() -> None:
    assert _selfcheck.cuda_version(12090) == "12.9"
    assert _selfcheck.cuda_version(13000) == "13.0"
    assert _selfcheck.cuda_version(0) is None


def test_import_loads_no_optional_package() -> None:
    proc = run_python(
        """
        import sys
        import cudafut
        assert "cudafut._cli" not in sys.modules  # the command line is not a part of the library
        import cudafut.__main__, cudafut._cli.bench, cudafut._cli.headline, cudafut._cli.selfcheck
        print(sorted(m for m in ("rich", "matplotlib", "cupy", "numba", "torch") if m in sys.modules))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- bench -----------------------------------------------------------------------------


def test_bench_runs_the_suite_in_a_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m cudafut bench ARGS`` runs ``python -m benchmarks ARGS`` of
    the checkout (first on PYTHONPATH, in the caller's folder) and exits
    with its status; the package never imports benchmarks/."""
    seen: list[tuple[list[str], dict[str, str]]] = []

    class Child:
        def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
            seen.append((cmd, env))

        def wait(self) -> int:
            return 7

    monkeypatch.setattr(subprocess, "Popen", Child)
    monkeypatch.delitem(sys.modules, "benchmarks", raising=False)
    assert cli.main(["bench", "--quick", "--only", "wake"]) == 7
    [(cmd, env)] = seen
    assert cmd == [sys.executable, "-m", "benchmarks", "--quick", "--only", "wake"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert "benchmarks" not in sys.modules


def test_python_dash_m_runs_the_command_line() -> None:
    # `python -m cudafut` goes through cudafut/__main__.py, the shim.
    proc = run_python("import runpy; runpy.run_module('cudafut', run_name='__main__')", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m cudafut")
    proc = run_python(
        "import runpy; runpy.run_module('cudafut', run_name='__main__')",
        "--check-only",
        "--json",
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["ok"] is False


def test_bench_help_is_the_suites() -> None:
    proc = run_python(MAIN, "bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "python -m cudafut bench" in proc.stdout
    assert "--only" in proc.stdout


@pytest.mark.parametrize("module", ["benchmarks.reliability", "benchmarks.stalls", "benchmarks.calls"])
def test_the_standalone_benchmarks_help_needs_no_gpu(module: str) -> None:
    # Compiling the benchmarks' kernel needs a GPU: not at import, not for --help.
    proc = run_python(
        "import runpy, sys; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)",
        module,
        "--help",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr


# -- what a run prints (measuring faked) ---------------------------------------------------


def fake_results() -> dict[str, Any]:
    wait = {}
    for i, work in enumerate(_headline.WORKS):
        waiters = {
            which: {
                "p50_us": 100.0 + 10 * j + i,
                "p90_us": 150.0 + 10 * j,
                "late_p50_us": 20.0 + 30 * j,
                "late_p90_us": 40.0 + 30 * j,
                "cpu": [1.0, 0.3, 0.05][j],
            }
            for j, which in enumerate(_headline.WAITERS)
        }
        wait[work.name] = {
            "label": work.label,
            "work_ms": [work.low_ms, work.high_ms],
            "n": 100,
            "waiters": waiters,
            "await_extra_us": 30.0,
            "thread_extra_us": 60.0,
            "await_vs_thread": 50.0 / 80.0,
        }
    copies = {
        "bytes": _headline.COPY_BYTES,
        "reps": 10,
        "data_ok": True,
        "h2d": {"raw_gbs": 50.0, "cudafut_gbs": 49.0, "ratio": 0.98},
        "d2h": {"raw_gbs": 52.0, "cudafut_gbs": 51.0, "ratio": 51 / 52},
    }
    return {
        "quick": True,
        "device": {"index": 0, "name": "NVIDIA H100 80GB HBM3"},
        "waiters": dict(_headline.WAITERS),
        "wait": wait,
        "copies": copies,
        "seconds": 5.0,
    }


def test_tables_and_measurements() -> None:
    results = fake_results()
    tables = _headline.tables(results)
    assert [title.split()[0] for title, _, _ in tables] == ["Waking", "Copies"]
    for title, headers, rows in tables:
        assert all(len(row) == len(headers) for row in rows)
        text = _headline.plain_table(title, headers, rows)
        assert len(text) == 3 + len(rows)
    assert tables[0][2][0][:5] == ["short (50 µs)", "20 µs", "+30 µs", "+60 µs", "0.62x"]
    figures = _headline.measurements(results)
    assert len(figures) == 3 * (3 * 5 + 1) + 2 * 3
    assert all(value > 0 and math.isfinite(value) for value in figures.values())
    assert _headline.plot_name(results) == "cudafut-h100.png"


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = _headline.plot(fake_results(), tmp_path / "p.png", "a title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A GPU that passes the self-check, and a run that returns fake results
    (calling ``step`` as the real one does); the ``quick`` flags it got."""
    real = _selfcheck.gather

    def usable() -> dict[str, Any]:
        check = real()
        check.update(usable=True, problem=None, fix=[], devices=[])
        return check

    calls: list[bool] = []

    def run(quick: bool, step: Any) -> dict[str, Any]:
        calls.append(quick)
        for i in range(_headline.steps()):
            step(f"part {i}")
        return fake_results()

    monkeypatch.setattr(_selfcheck, "gather", usable)
    monkeypatch.setattr(_headline, "run", run)
    return calls


def test_a_run_without_rich_or_matplotlib(
    measured: list[bool], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(cli, "_have", lambda module: False)
    assert cli.main(["--quick", "--out", str(tmp_path), "--policy", "low_cpu"]) == 0
    assert measured == [True]
    assert cudafut.get_wait_policy() == cudafut.WaitPolicy(
        spin_s=20e-6, first_sleep_s=200e-6, max_sleep_s=2e-3, cpu_budget=0.01, notify=False
    )
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: for a progress bar and a plot, pip install 'cudafut[cli]' (rich and matplotlib missing)"
    ]
    assert f"[{_headline.steps()}/{_headline.steps()}]" in err  # plain progress lines
    assert "wait policy     low_cpu" in out
    assert "Waking up on GPU 0" in out and "to_host(out=pinned)" in out
    assert "plot:" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_run_json_is_one_document(
    measured: list[bool], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["--json", "--out", str(tmp_path / "new")]) == 0
    out, _ = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is True and doc["error"] is None
    assert doc["results"] == fake_results()
    assert doc["selfcheck"]["usable"] is True
    if importlib.util.find_spec("matplotlib") is None:
        assert doc["plot"] is None
        assert any("cudafut[cli]" in note for note in doc["notes"])
    else:
        assert Path(doc["plot"]) == (tmp_path / "new" / "cudafut-h100.png").resolve()
        assert Path(doc["plot"]).is_file()


def test_a_run_with_rich(measured: list[bool], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("rich")
    assert cli.main(["--no-plot", "--out", str(tmp_path)]) == 0
    assert measured == [False]
    out, _ = capsys.readouterr()
    assert "Waking up on GPU 0" in out and "cudafut / raw" in out
    assert list(tmp_path.iterdir()) == []


def test_the_rich_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    with cli._progress(3, fancy=True) as step:
        for i in range(3):
            step(f"part {i}")
    assert capsys.readouterr().out == ""


def test_check_only(measured: list[bool], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--check-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"] is None and doc["selfcheck"]["usable"] is True
    assert measured == []


# -- README's set-up block --------------------------------------------------------------


def _set_up_commands() -> list[tuple[str, str]]:
    """README.md's first ``sh`` block under "Set up": (command, its comment)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Set up", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands: list[tuple[str, str]] = []
    for line in block.splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            commands.append((command.strip(), comment.strip()))
        elif comment.strip() and commands:  # a comment continued on the next line
            commands[-1] = (commands[-1][0], f"{commands[-1][1]} {comment.strip()}")
    return commands


def test_the_set_up_block_runs_under_set_e_without_a_gpu() -> None:
    """CI runs README's install and test commands as written (.ci/run, under
    ``set -e``); ``python -m cudafut`` exits 1 without a GPU, so it comes
    after them and its comment says what it needs and what it does without."""
    commands = _set_up_commands()
    names = [command for command, _ in commands]
    assert names[:2] == ['pip install -e ".[cuda12,test]"', "pytest"], names
    assert names[-1] == "python -m cudafut", names
    comment = commands[-1][1]
    assert "needs an NVIDIA GPU" in comment and "status 1" in comment, comment
