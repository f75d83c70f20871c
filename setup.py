"""Builds cudafut's native core: ``cudafut/_core.pyx`` (Cython) and
``cudafut/_waker.c`` (the list is ``MODULES`` in cudafut/_compiled.py).

The extensions are optional: with ``CUDAFUT_NO_EXTENSIONS=1``, without
Cython, or where the C compiler fails, the package installs the pure-Python
core (a warning says so) and works the same, only slower. Everything else
about the package is in pyproject.toml.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent

#: Cython's settings (each .pyx may set more in its first line).
DIRECTIVES = {"language_level": 3}


def modules() -> tuple[str, ...]:
    tree = ast.parse((HERE / "cudafut" / "_compiled.py").read_text())
    for node in tree.body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "MODULES":
            value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            return tuple(value)
    raise RuntimeError("cudafut/_compiled.py defines no MODULES")


def warn(message: str) -> None:
    print(f"cudafut: {message}; installing the pure-Python core (same behaviour, slower)", file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get("CUDAFUT_NO_EXTENSIONS", "") not in ("", "0"):
        warn("CUDAFUT_NO_EXTENSIONS is set")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        warn("Cython is not installed")
        return []
    exts = [
        Extension(name, [name.replace(".", "/") + ".pyx"], libraries=["dl", "pthread"]) for name in modules()
    ]
    compiled: list[Extension] = cythonize(exts, compiler_directives=DIRECTIVES, quiet=True)
    # The native notice threads (plain C).
    compiled.append(Extension("cudafut._waker", ["cudafut/_waker.c"], libraries=["dl", "pthread"]))
    return compiled


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python where the C compiler fails."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:  # one compiler per core
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: pure Python
            warn(f"the C extensions could not be built ({exc})")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            warn(f"{ext.name} could not be compiled ({exc})")


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
