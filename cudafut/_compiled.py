"""Which of cudafut's modules run compiled, and the switch back to pure Python.

The modules of the hot path (the future, its events and pools, the waiter and
the loop drivers, the wait policy, launches, the batcher, the collectives'
per-call path) are compiled by Cython from their own ``.py`` source when the
package is built with a C compiler (``setup.py`` reads :data:`MODULES` from
this file). The ``.py`` files are the one source of truth: the compiled
module is the same code, run without the interpreter's bytecode loop. Where
no extension was built, Python imports the ``.py`` files, and everything
behaves the same, only slower.

``CUDAFUT_PURE=1`` in the environment, read once at ``import cudafut``,
makes the package import the ``.py`` files even where the extensions exist
(tests run the whole suite both ways). A ``.py`` file edited after its
extension was built (an editable install, ``pip install -e .``) is imported
instead of the stale extension, with a warning that says how to rebuild:
the code that runs is always the code in the tree. This module is imported
first by ``cudafut/__init__.py`` and must import nothing of cudafut's.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ["MODULES", "compiled_modules", "core"]

#: The modules built as C extensions, by their import names. ``setup.py``
#: reads this tuple (as a literal: keep it one).
MODULES: Final = (
    "cudafut._batcher",
    "cudafut._combinators",
    "cudafut._cuda",
    "cudafut._engine",
    "cudafut._events",
    "cudafut._future",
    "cudafut._launch",
    "cudafut._lifetimes",
    "cudafut._loops",
    "cudafut._memory",
    "cudafut._policy",
    "cudafut._pools",
    "cudafut._values",
    "cudafut._waiter",
    "cudafut.distributed._ops",
)

_PACKAGE_DIR: Final = Path(__file__).resolve().parent

#: Whether ``CUDAFUT_PURE=1`` was set when cudafut was imported.
PURE: Final = os.environ.get("CUDAFUT_PURE", "") not in ("", "0")


def _stale(source: Path) -> bool:
    """Whether ``source`` (or the ``.pxd`` that types it) has an extension
    built beside it that is older."""
    try:
        mtime = source.stat().st_mtime
    except OSError:
        return False
    with contextlib.suppress(OSError):  # most modules have no .pxd
        mtime = max(mtime, source.with_suffix(".pxd").stat().st_mtime)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        try:
            if source.with_suffix(suffix).stat().st_mtime < mtime:
                return True
        except OSError:
            continue
    return False


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` source of a compiled module ahead of its extension:
    for all of them under ``CUDAFUT_PURE=1``, else for a stale one (two
    ``stat`` calls per module, once, at import)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        source = _PACKAGE_DIR.joinpath(*fullname.split(".")[1:]).with_suffix(".py")
        if not PURE:
            if not _stale(source):
                return None
            warnings.warn(
                f"cudafut: {source.name} is newer than its compiled extension; importing the .py "
                "(rebuild with `pip install -e .` or `python setup.py build_ext --inplace`)",
                stacklevel=2,
            )
        return importlib.util.spec_from_file_location(fullname, source)


def install() -> None:
    """Put the source finder first: called once by ``cudafut/__init__``."""
    if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`MODULES` that run compiled in this process
    (imported ones only: call after ``import cudafut``)."""
    out = []
    for name in MODULES:
        module = sys.modules.get(name)
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or ""
        if origin.endswith((".so", ".pyd")):
            out.append(name)
    return tuple(out)


def core() -> str:
    """``"compiled"`` if every imported hot-path module runs compiled,
    ``"pure"`` if none does, ``"mixed"`` otherwise; with the reason for pure."""
    imported = [name for name in MODULES if name in sys.modules]
    done = compiled_modules()
    if imported and len(done) == len(imported):
        return "compiled"
    if done:
        return "mixed"
    return "pure (CUDAFUT_PURE=1)" if PURE else "pure (no compiled extension was built)"
