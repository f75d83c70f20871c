"""The switch between the native core and its pure-Python twin
(cudafut/_compiled.py): CUDAFUT_PURE=1 runs the twin, a .pyx edited after
its build is passed over with a warning that names the rebuild, an edited
.py is simply what runs, and the report says which core ran."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudafut import _compiled, _events, _pools
from tests.subproc import ROOT, run_python

PACKAGE = Path(_compiled.__file__).resolve().parent
BUILT = _compiled.native() is not None


def test_pure_mode_runs_the_python_twins() -> None:
    proc = run_python(
        "import cudafut, sys\n"
        "from cudafut import _compiled, _events, _pools\n"
        "print(_compiled.core())\n"
        "print(type(_pools.events).__module__, _events.EventRecord.__module__,\n"
        "      'cudafut._core' in sys.modules)",
        CUDAFUT_PURE="1",
    )
    assert proc.stdout.split("\n")[:2] == [
        "pure (CUDAFUT_PURE=1)",
        "cudafut._pools cudafut._events False",
    ], proc.stdout + proc.stderr


def test_a_pyx_newer_than_its_extension_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "_PACKAGE_DIR", tmp_path)
    source = tmp_path / "_mod.pyx"
    source.write_text("x = 1\n")
    assert not _compiled._stale("cudafut._mod")  # no extension at all
    ext = tmp_path / ("_mod" + importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    os.utime(ext, (1_000_000, 1_000_000))
    os.utime(source, (2_000_000, 2_000_000))
    assert _compiled._stale("cudafut._mod")
    os.utime(ext, (3_000_000, 3_000_000))
    assert not _compiled._stale("cudafut._mod")


def test_the_report_names_what_runs() -> None:
    core = _compiled.core()
    if _compiled.PURE:
        assert core == "pure (CUDAFUT_PURE=1)" and not _compiled.compiled_modules()
    elif not BUILT:
        assert core == "pure (no compiled extension was built)"
    else:
        assert core == "native" and _compiled.compiled_modules() == ("cudafut._core",)
        assert _events.EventRecord.__module__ == "cudafut._core"
        assert type(_pools.events).__module__ == "cudafut._core"


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "cudafut"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    return copy


def _import_in(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": "always", "CUDAFUT_PURE": ""},
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not BUILT or _compiled.PURE, reason="no native core built here")
def test_an_edited_pyx_runs_the_python_twin_with_a_warning_that_names_the_rebuild(tmp_path: Path) -> None:
    copy = _copy_package(tmp_path)
    built = max(p.stat().st_mtime for p in copy.glob("_core.*") if p.suffix != ".pyx")
    later = built + 100  # an edit after the build
    os.utime(copy / "_core.pyx", (later, later))
    proc = _import_in(tmp_path, "import cudafut, cudafut._compiled as c\nprint(c.core())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "pure (cudafut/_core.pyx is newer than its extension)", proc.stdout
    assert "RuntimeWarning" in proc.stderr and "pip install -e" in proc.stderr, proc.stderr


@pytest.mark.skipif(not BUILT or _compiled.PURE, reason="no native core built here")
def test_an_edited_py_is_what_runs_and_the_native_core_stays(tmp_path: Path) -> None:
    copy = _copy_package(tmp_path)
    later = max(p.stat().st_mtime for p in copy.glob("_core.*")) + 100
    events = copy / "_events.py"
    events.write_text(events.read_text() + "\nEDITED = True\n")
    os.utime(events, (later, later))
    proc = _import_in(
        tmp_path, "import cudafut, cudafut._compiled as c, cudafut._events as e\nprint(c.core(), e.EDITED)"
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "native True"), proc.stderr


def test_an_edited_pyx_warns_under_pytest_without_a_plugin_error() -> None:
    # The project's own pytest settings turn warnings into errors; the stale
    # warning is exempt (pyproject.toml), so an edit never stops pytest from
    # loading the cudafut plugin.
    text = (ROOT / "pyproject.toml").read_text()
    assert "default:cudafut.*is newer than its extension:RuntimeWarning" in text
