"""Which core runs: the native one (C extensions) or its pure-Python twin.

The native core is ``cudafut/_core.pyx`` (event records, their streams'
state, the event pool, CUDA's event calls made from C), built by Cython when
the package is installed with a C compiler (``setup.py`` reads
:data:`MODULES` from this file), and ``cudafut/_waker.c``. Its twins in
Python are ``_events.py`` and ``_pools.EventPool``: the reference, and the
fallback where no extension was built. Everything else is Python in both
cores: compiling modules from their ``.py`` source made them no faster.

``CUDAFUT_PURE=1`` in the environment, read once at ``import cudafut``,
selects the pure-Python twins even where the extensions exist (tests run
the whole suite both ways). A ``.pyx`` edited after its extension was built
(an editable install) is not imported: the twin in Python runs instead,
with a warning that says how to rebuild, so the code that runs is never
older than the tree. This module is imported by
the modules that have a native twin and must import nothing of cudafut's.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ["MODULES", "PURE", "REBUILD", "compiled_modules", "core", "native"]

#: The native modules built from ``.pyx`` sources, by their import names.
#: ``setup.py`` reads this tuple (as a literal: keep it one).
MODULES: Final = ("cudafut._core",)

#: What rebuilds the extensions of an editable install.
REBUILD: Final = 'pip install -e ".[cuda12,test]" (or: python setup.py build_ext --inplace)'

_PACKAGE_DIR: Final = Path(__file__).resolve().parent

#: Whether ``CUDAFUT_PURE=1`` was set when cudafut was imported.
PURE: Final = os.environ.get("CUDAFUT_PURE", "") not in ("", "0")

# The native core once imported, or why not: "" until asked.
_native: ModuleType | None = None
_why_pure = ""


def _stale(name: str) -> bool:
    """Whether the ``.pyx`` of ``name`` is newer than its built extension
    (two ``stat`` calls, once)."""
    source = _PACKAGE_DIR.joinpath(*name.split(".")[1:]).with_suffix(".pyx")
    try:
        mtime = source.stat().st_mtime
    except OSError:  # an installed wheel ships no .pyx
        return False
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        try:
            if source.with_suffix(suffix).stat().st_mtime < mtime:
                return True
        except OSError:
            continue
    return False


def native() -> ModuleType | None:
    """The native core (``cudafut._core``), or None where the pure-Python
    twin runs: under ``CUDAFUT_PURE=1``, where it was not built, or where
    its ``.pyx`` is newer than the extension (with a warning)."""
    global _native, _why_pure
    if _native is not None or _why_pure:
        return _native
    if PURE:
        _why_pure = "CUDAFUT_PURE=1"
        return None
    if _stale("cudafut._core"):
        _why_pure = "cudafut/_core.pyx is newer than its extension"
        warnings.warn(
            f"cudafut: {_why_pure}; running the pure-Python core instead (rebuild: {REBUILD})",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    try:
        _native = importlib.import_module("cudafut._core")
    except ImportError:
        _why_pure = "no compiled extension was built"
    return _native


def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`MODULES` that run in this process (call after
    ``import cudafut``)."""
    return tuple(name for name in MODULES if name in sys.modules and _native is not None)


def core() -> str:
    """``"native"`` where the native core runs, else ``"pure"`` with the
    reason."""
    if native() is not None:
        return "native"
    return f"pure ({_why_pure})"
