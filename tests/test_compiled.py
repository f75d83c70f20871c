"""The switch between the compiled core and its pure-Python source
(cudafut/_compiled.py): CUDAFUT_PURE=1 imports every .py, a stale extension
is passed over for its newer source, and the report says which ran."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudafut import _compiled
from tests.subproc import run_python


def test_pure_mode_imports_every_module_from_its_source() -> None:
    proc = run_python(
        "import cudafut, cudafut.distributed._ops, sys\n"
        "from cudafut import _compiled\n"
        "print(_compiled.core())\n"
        "print(all(sys.modules[m].__file__.endswith('.py') for m in _compiled.MODULES))",
        CUDAFUT_PURE="1",
    )
    assert proc.stdout.split("\n")[:2] == ["pure (CUDAFUT_PURE=1)", "True"], proc.stdout + proc.stderr


def test_a_source_newer_than_its_extension_is_stale(tmp_path: Path) -> None:
    source = tmp_path / "_mod.py"
    source.write_text("x = 1\n")
    assert not _compiled._stale(source)  # no extension at all
    ext = tmp_path / ("_mod" + importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    os.utime(ext, (1_000_000, 1_000_000))
    os.utime(source, (2_000_000, 2_000_000))
    assert _compiled._stale(source)
    os.utime(ext, (3_000_000, 3_000_000))
    assert not _compiled._stale(source)
    typing = tmp_path / "_mod.pxd"  # the .pxd that types it, edited since the build
    typing.write_text("cdef class C:\n    pass\n")
    os.utime(typing, (4_000_000, 4_000_000))
    assert _compiled._stale(source)


def test_the_report_names_what_runs() -> None:
    core = _compiled.core()
    if _compiled.PURE:
        assert core == "pure (CUDAFUT_PURE=1)" and not _compiled.compiled_modules()
    elif not _compiled.compiled_modules():
        assert core == "pure (no compiled extension was built)"
    else:
        assert core in ("compiled", "mixed")
    assert all(name in sys.modules for name in _compiled.compiled_modules())


@pytest.mark.skipif(not _compiled.compiled_modules(), reason="no compiled extension here")
def test_an_edited_source_runs_instead_of_its_stale_extension(tmp_path: Path) -> None:
    """A copy of the package whose _events.py is newer than its extension:
    the .py is imported, with a warning that says how to rebuild."""
    import shutil

    root = Path(_compiled.__file__).parent
    copy = tmp_path / "cudafut"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    built = max(p.stat().st_mtime for p in copy.glob("_events.*") if p.suffix != ".py")
    later = built + 100  # an edit after the build
    os.utime(copy / "_events.py", (later, later))
    proc = subprocess.run(
        [sys.executable, "-c", "import cudafut, cudafut._events as e\nprint(e.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": "always"},
        timeout=120,
        check=False,
    )
    assert proc.stdout.strip().endswith("_events.py"), proc.stdout + proc.stderr
    assert "_events.py is newer than its compiled extension" in proc.stderr
    assert "pip install -e ." in proc.stderr


PACKAGE = Path(_compiled.__file__).resolve().parent


def _pxd_classes(pxd: Path) -> dict[str, set[str]]:
    """The fields each ``cdef class`` of a ``.pxd`` declares, by class name."""
    classes: dict[str, set[str]] = {}
    fields: set[str] | None = None
    for line in pxd.read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:2] == ["cdef", "class"]:
            fields = classes.setdefault(words[2].rstrip(":").split("(")[0], set())
        elif fields is not None and line.startswith("    cdef") and words:
            fields.add(words[-1])
    return classes


@pytest.mark.parametrize("pxd", sorted(PACKAGE.rglob("*.pxd")), ids=lambda p: p.name)
def test_a_pxd_declares_exactly_the_slots_of_its_classes(pxd: Path) -> None:
    # Compiled, a slot the .pxd lacks would be an AttributeError at its first
    # assignment, and only there: the pure core would never show it.
    classes = _pxd_classes(pxd)
    assert classes, f"{pxd.name} declares no class"
    module = __import__("cudafut." + ".".join(pxd.relative_to(PACKAGE).with_suffix("").parts), fromlist=["_"])
    for name, fields in classes.items():
        slots = set(getattr(module, name).__slots__)
        assert fields == slots, (
            f"{pxd.name}: {name} declares {sorted(fields)}, its __slots__ are {sorted(slots)}"
        )
