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


# -- the source tree: tests -> benchmarks -> cudafut, never back ------------------------


def _reaches(path: Path) -> set[str]:
    """The top-level names ``path`` imports, wherever (``import_module("x.y")``
    and Python code in strings run by child processes included), and
    ``"sys.path"`` if it changes the import path."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            for line in node.value.splitlines():
                words = line.split()
                if len(words) >= 2 and words[0] in ("import", "from"):
                    found.add(words[1].split(".")[0])
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.add("sys.path")
    return found


def test_the_package_never_reaches_into_the_checkout() -> None:
    # `python -m cudafut bench` runs benchmarks/ in a child process instead.
    for path in sorted(PACKAGE.rglob("*.py")):
        bad = _reaches(path) & {"benchmarks", "tests", "examples", "sys.path"}
        assert not bad, f"{path.relative_to(ROOT)} reaches {sorted(bad)} (cudafut is below them)"


def test_the_benchmarks_never_import_the_tests() -> None:
    # The tests may use benchmarks/support (the figures check, the Ctrl-C
    # child); what both need lives there.
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        assert "tests" not in _reaches(path), f"{path.relative_to(ROOT)} imports from tests/"
