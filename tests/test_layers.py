"""The package's layering: cudafut's modules import one another one way only.

Read from the source with ``ast`` (nothing is imported): every import between
cudafut's modules counts, at the top of a module, inside a function (a lazy
import) or under ``if TYPE_CHECKING:``. A circle means some module imports one
above it; docs/design.md ("Layers") draws the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.subproc import ROOT

PACKAGE = ROOT / "cudafut"


def _module_names() -> dict[str, Path]:
    names = {}
    # .pyi: the stubs of modules compiled from C alone (cudafut/_waker.c).
    for path in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The cudafut modules that ``module`` imports, wherever it imports them."""
    found: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
            # ``from . import _x``: the submodules only, not the package itself.
            found |= subs if len(subs) == len(node.names) else subs | {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return (found & modules.keys()) - {module}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_cudafut_has_no_import_circle() -> None:
    modules = _module_names()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "cudafut._future" in graph and "cudafut._trace.hooks" in graph["cudafut._future"]
    circles = _circles(graph)
    assert not circles, (
        "these cudafut modules import one another in a circle (lazy and TYPE_CHECKING "
        f"imports count): {circles}; move what the lower module needs below it "
        "(docs/design.md, 'Layers')"
    )


def test_the_tracer_never_imports_the_future() -> None:
    # The tracer only observes: the future hands it what happened.
    modules = _module_names()
    for name, path in modules.items():
        if name.startswith("cudafut._trace"):
            assert "cudafut._future" not in _imports(name, path, modules), name
