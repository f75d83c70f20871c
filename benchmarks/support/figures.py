"""Check the single figures some pages quote against the committed results.

From the repository root, without a GPU (nor CuPy)::

    python -m benchmarks.support.figures             # check README.md, docs/, examples/, benchmarks/*.md
    python -m benchmarks.support.figures --write     # rewrite every figure that differs from its JSON
    python -m benchmarks.support.figures docs/x.md   # some files only

``tests/test_doc_figures.py`` runs the check, so a figure that no longer says
what its results file says fails the CPU suite. The markup is HTML comments,
invisible on GitHub and on the site; a figure without one is not checked.
Whole benchmarks are shown as generated tables instead
(``python -m benchmarks.support.tables``), which need no markers.

**One figure.** Put ``<!-- fig: FILE.json PATH -->`` after it: the last
number before the comment is checked against the value at ``PATH`` in
``benchmarks/results/FILE.json``::

    on 20 ms jobs it wakes 136 µs<!-- fig: bench-h200-waker-07ea09f.json
    wake > 20.0 > await (balanced) > extra_p50_us --> after the floor

``PATH`` is the JSON's keys, separated by `` > ``; each may be the whole key
or its beginning, or any part of it, that no other key at that level
has (``await (balanced)`` for ``cudafut await (balanced)``). ``*`` stands
for every key at its level that has the rest of the path. Several
figures, separated by ``;``, check the last as many numbers before the
comment, in order (``207 against 154 µs<!-- fig: A; B
-->``). A figure may also be arithmetic on paths in braces, with ``min``,
``max``, ``abs``, ``sum`` and ``len``: ``{X > extra_max_us} / 1000`` for
milliseconds, ``{A} / {B}`` for a ratio, ``max({vary > patterns > * > ...})``.

**Default file.** ``<!-- figures: FILE.json -->`` makes FILE the file of the
markers after it that name none (until the next such line).

**A table.** Put ``<!-- table: FILE.json TEMPLATE -->`` before a Markdown
table: every number of every body cell is checked, TEMPLATE being the
figures of one cell (``;``-separated, as above) where ``{row}`` is the
row's label (its first cell) and ``{col}`` the column's header. A label
that is not a key (nor part of one) names its key in a comment,
``| 50 µs<!-- 0.05 --> |``; a comment holding a whole template (it has a
`` > `` or ``{``) replaces the table's for that column or row; ``<!--
skip -->`` leaves a column or row unchecked. A cell without numbers
(``n/a``) is not checked. ``<!-- table: skip -->`` before a table says
that its numbers are not figures (dates, sizes, settings).

``Scan.unchecked`` lists the numbers of table cells (but the first column)
that no marker covers, for a test to require that a page's tables are all
checked.

A number is shown with as many decimals as it needs: ``117`` matches
116.59, ``0.13`` 0.1309. ``--write`` replaces each number that differs
by the JSON's value with the same decimals (and sign, and thousands
separators), so after a new benchmark run a writer changes the file names
in the markers, runs ``--write``, and reads the prose around the changed
figures again: the claims in words ("beats", "missed") are not checked.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"

COMMENT = re.compile(r"<!--(.*?)-->", re.S)
MARKER = re.compile(r"\s*(fig|figures|table)\s*:(.*)", re.S)
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?![ \t]*\n))+`")  # within a paragraph
# A figure: not part of a word ("h200", "p50") nor of another number; "-" is a
# sign only where no digit precedes it ("1.58-2.08" is a range of two).
NUMBER = re.compile(r"(?:(?<![\w.\x01])([+-]))?(?<![\w.])(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
# What a comment becomes before numbers are read: "2.5<!-- -->-3.3" is a range.
HIDDEN = "\x01"
SEPARATOR = " > "
FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "sum": sum,
    "len": len,
}


class FigureError(ValueError):
    """A marker that cannot be read, or a path the results file lacks."""


@dataclass(frozen=True)
class Number:
    """A number as the Markdown shows it."""

    start: int
    end: int
    text: str
    value: float
    decimals: int
    sign: str  # "+", "-" or ""
    grouped: bool  # thousands separators

    def matches(self, value: float) -> bool:
        half = 0.5 * 10.0 ** (-self.decimals)
        return abs(self.value - value) <= half * (1 + 1e-9) + 1e-12

    def formatted(self, value: float) -> str:
        spec = f"{'+' if self.sign == '+' else ''}{',' if self.grouped else ''}.{self.decimals}f"
        return format(value, spec)


@dataclass(frozen=True)
class Figure:
    """A number of a Markdown file and where its value comes from."""

    doc: Path
    line: int
    number: Number
    source: str  # "FILE.json: PATH-or-expression"
    value: float | None  # None when ``error`` says why
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and self.number.matches(self.value)

    def problem(self) -> str:
        where = f"{_rel(self.doc)}:{self.line}"
        if self.value is None:
            return f"{where}: {self.number.text}: {self.error} ({self.source})"
        return (
            f"{where}: says {self.number.text}, {self.source} gives {self.value:.6g} "
            f"(shown as {self.number.formatted(self.value)})"
        )


@dataclass
class Scan:
    """What one Markdown file quotes, and what could not be read."""

    doc: Path
    figures: list[Figure]
    problems: list[str]
    unchecked: list[tuple[int, str]]  # numbers in table cells no marker covers


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


@cache
def load(name: str) -> Any:
    """The results file ``name`` (relative to benchmarks/results/)."""
    path = RESULTS / name
    if not path.is_file():
        raise FigureError(f"no results file {_rel(path)}")
    return json.loads(path.read_text())


def _step(node: Any, segment: str) -> list[Any]:
    if segment == "*":
        if isinstance(node, dict):
            return list(node.values())
        if isinstance(node, list):
            return list(node)
        raise FigureError(f"'*' on a {type(node).__name__}")
    if isinstance(node, list):
        try:
            return [node[int(segment)]]
        except (ValueError, IndexError):
            raise FigureError(f"no item {segment!r} in a list of {len(node)}") from None
    if not isinstance(node, dict):
        raise FigureError(f"{segment!r} under a {type(node).__name__}, not an object")
    if segment in node:
        return [node[segment]]
    holders = [key for key in node if key.startswith(segment)]
    if len(holders) != 1:
        holders = [key for key in node if segment in key]
    if len(holders) == 1:
        return [node[holders[0]]]
    keys = ", ".join(repr(key) for key in (holders or list(node)))
    if holders:
        raise FigureError(f"{segment!r} is part of several keys: {keys}")
    raise FigureError(f"no key {segment!r}; there are {keys}")


def resolve(name: str, path: str) -> list[Any]:
    """The values at ``path`` in results file ``name`` (several where it has ``*``)."""
    nodes = [load(name)]
    wild = False  # after a "*", entries that lack the rest of the path are left out
    for segment in (part.strip() for part in path.split(SEPARATOR)):
        found: list[Any] = []
        errors: list[FigureError] = []
        for node in nodes:
            try:
                found += _step(node, segment)
            except FigureError as exc:
                if not wild:
                    raise
                errors.append(exc)
        if not found and errors:
            raise errors[0]
        nodes = found
        wild = wild or segment == "*"
    return nodes


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FigureError(f"{what} is {value!r}, not a number")
    return float(value)


def evaluate(name: str, expression: str) -> float:
    """The figure ``expression`` gives from results file ``name``: a path, or
    arithmetic on paths in braces."""
    expression = " ".join(expression.split())
    if "{" not in expression:
        values = resolve(name, expression)
        if len(values) != 1:
            raise FigureError(f"{expression!r} is {len(values)} values; use min(), max(), ... on it")
        return _number(values[0], expression)
    paths: dict[str, list[Any]] = {}

    def name_path(match: re.Match[str]) -> str:
        var = f"_path{len(paths)}"
        paths[var] = resolve(name, match.group(1))
        return var

    try:
        tree = ast.parse(re.sub(r"\{([^{}]*)\}", name_path, expression), mode="eval")
    except SyntaxError as exc:
        raise FigureError(f"cannot read {expression!r}: {exc.msg}") from None
    return _number(_eval(tree.body, paths, expression), expression)


def _eval(node: ast.AST, paths: dict[str, list[Any]], expression: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in paths:
        values = paths[node.id]
        return values[0] if len(values) == 1 else values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _number(_eval(node.operand, paths, expression), expression)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left = _number(_eval(node.left, paths, expression), expression)
        right = _number(_eval(node.right, paths, expression), expression)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise FigureError(f"division by zero in {expression!r}")
        return left / right
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in FUNCTIONS
        and not node.keywords
    ):
        args = [_eval(arg, paths, expression) for arg in node.args]
        flat = [_number(v, expression) for a in args for v in (a if isinstance(a, list) else [a])]
        if not flat:
            raise FigureError(f"{node.func.id}() of nothing in {expression!r}")
        return FUNCTIONS[node.func.id](flat)
    raise FigureError(f"{expression!r}: only numbers, paths in braces, + - * / and {', '.join(FUNCTIONS)}")


def numbers(text: str, start: int = 0, end: int | None = None) -> list[Number]:
    """The numbers of ``text[start:end]`` (``text`` with code and comments blanked)."""
    found = []
    for match in NUMBER.finditer(text, start, len(text) if end is None else end):
        sign, whole, fraction = match.group(1) or "", match.group(2), match.group(3) or ""
        value = float(whole.replace(",", "") + fraction)
        found.append(
            Number(
                start=match.start(),
                end=match.end(),
                text=match.group(0),
                value=-value if sign == "-" else value,
                decimals=len(fraction) - 1 if fraction else 0,
                sign=sign,
                grouped="," in whole,
            )
        )
    return found


def _blank(text: str, spans: Iterable[tuple[int, int]], by: str = " ") -> str:
    chars = list(text)
    for start, end in spans:
        for i in range(start, end):
            if chars[i] != "\n":
                chars[i] = by
    return "".join(chars)


def _code_spans(text: str) -> list[tuple[int, int]]:
    """Fenced blocks and inline code: what is neither markup nor a figure."""
    spans = []
    fence_start = None
    offset = 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            if fence_start is None:
                fence_start = offset
            else:
                spans.append((fence_start, offset + len(line)))
                fence_start = None
        offset += len(line)
    if fence_start is not None:
        spans.append((fence_start, len(text)))
    blanked = _blank(text, spans)
    spans += [match.span() for match in INLINE_CODE.finditer(blanked)]
    return spans


def _split_source(body: str, default: str | None) -> tuple[str, str]:
    """(results file, the rest) of a figure: its own file if it names one
    first, else ``default``."""
    body = " ".join(body.split())
    first, _, rest = body.partition(" ")
    if first.endswith(".json"):
        return first, rest
    if default is None:
        raise FigureError("no results file: name one first in the marker, or before it in <!-- figures: -->")
    return default, body


def _items(template: str, default: str | None) -> list[tuple[str, str]]:
    """The (results file, figure) pairs of a marker, ``;``-separated. A figure
    without a file has the one before it in the marker, else ``default``; one
    that is a bare key continues the path before it (``A > B > p50; p90`` is
    ``A > B > p50`` and ``A > B > p90``)."""
    items: list[tuple[str, str]] = []
    for part in template.split(";"):
        if not part.strip():
            continue
        name, item = _split_source(part, items[-1][0] if items else default)
        if items and SEPARATOR not in item and "{" not in item:
            before = items[-1][1]
            if SEPARATOR in before and "{" not in before:
                item = before.rsplit(SEPARATOR, 1)[0] + SEPARATOR + item
        items.append((name, item))
    if not items:
        raise FigureError("a marker without a figure")
    return items


def _label(cell: str) -> str:
    return " ".join(COMMENT.sub("", cell).replace("`", "").replace("*", "").split())


def _is_template(note: str) -> bool:
    """Whether a header's comment is a template of its own, not a key (a key
    may be several: ``random > 1 stream``)."""
    first, _, rest = note.partition(" ")
    return "{" in note or ";" in note or (first.endswith(".json") and bool(rest))


def scan(doc: Path) -> Scan:
    """Every marked figure of ``doc`` with its value, and what cannot be read."""
    text = doc.read_text()
    masked = _blank(text, _code_spans(text))
    comments = list(COMMENT.finditer(masked))
    plain = _blank(masked, (c.span() for c in comments), HIDDEN)  # numbers only
    result = Scan(doc, [], [], [])
    line_of = _line_index(text)
    default: str | None = None
    covered: set[int] = set()
    previous_end = 0

    for comment in comments:
        marker = MARKER.match(comment.group(1))
        where = f"{_rel(doc)}:{line_of(comment.start())}"
        if marker is None:
            previous_end = comment.end()
            continue
        kind, body = marker.group(1), marker.group(2).strip()
        try:
            if kind == "figures":
                default = _split_source(body, None)[0] if body.endswith(".json") else None
                if default is None:
                    raise FigureError(f"<!-- figures: {body} --> should name one FILE.json")
                load(default)
            elif kind == "fig":
                items = _items(body, default)
                before = numbers(plain, previous_end, comment.start())
                if len(before) < len(items):
                    raise FigureError(
                        f"{len(items)} figure(s) marked, {len(before)} number(s) before the marker"
                    )
                for number, (name, item) in zip(before[-len(items) :], items, strict=True):
                    result.figures.append(_figure(doc, line_of(number.start), number, name, item))
                    covered.add(number.start)
            else:
                first = body.split(" ", 1)[0]
                table_default = first if first.endswith(".json") else default
                template = body[len(first) :].strip() if first.endswith(".json") else body
                if body == "skip":
                    for row in _rows(plain, comment.end()):
                        covered.update(n.start for n in numbers(plain, *row))
                else:
                    _table(doc, text, plain, comment.end(), table_default, template, result, line_of, covered)
        except FigureError as exc:
            result.problems.append(f"{where}: {exc}")
        previous_end = comment.end()

    for start, end in _table_cells(masked):
        for number in numbers(plain, start, end):
            if number.start not in covered:
                result.unchecked.append((line_of(number.start), number.text))
    return result


def _figure(doc: Path, line: int, number: Number, name: str, item: str) -> Figure:
    source = f"{name}: {item}"
    try:
        return Figure(doc, line, number, source, evaluate(name, item))
    except FigureError as exc:
        return Figure(doc, line, number, source, None, str(exc))


def _line_index(text: str) -> Callable[[int], int]:
    starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line_of(offset: int) -> int:
        lo, hi = 0, len(starts)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if starts[mid] <= offset:
                lo = mid
            else:
                hi = mid
        return lo + 1

    return line_of


def _rows(masked: str, start: int) -> list[tuple[int, int]]:
    """The (start, end) of each line of the table at or after ``start``
    (blank lines may come first); empty if a paragraph comes first."""
    rows = []
    offset = masked.index("\n", start) + 1 if "\n" in masked[start:] else len(masked)
    while offset < len(masked):
        end = masked.find("\n", offset)
        end = len(masked) if end < 0 else end
        line = masked[offset:end].replace(HIDDEN, "").strip()
        if line.startswith("|"):
            rows.append((offset, end))
        elif line or rows:
            break
        offset = end + 1
    return rows


def _cells(masked: str, start: int, end: int) -> list[tuple[int, int]]:
    """The (start, end) of each cell of the table row ``masked[start:end]``."""
    bars = [i for i in range(start, end) if masked[i] == "|"]
    if not masked[start:end].rstrip().endswith("|"):
        bars.append(end)
    return [(a + 1, b) for a, b in itertools.pairwise(bars)]


def _table_cells(masked: str) -> list[tuple[int, int]]:
    """Every body cell but the first of every table of a file."""
    cells = []
    lines = masked.splitlines(keepends=True)
    offset, in_table, row = 0, False, 0
    for line in lines:
        if line.strip().startswith("|"):
            row = row + 1 if in_table else 0
            in_table = True
            if row >= 2:
                cells += _cells(masked, offset, offset + len(line.rstrip("\n")))[1:]
        else:
            in_table = False
        offset += len(line)
    return cells


def _notes(text: str, start: int, end: int) -> list[str]:
    return [" ".join(m.group(1).split()) for m in COMMENT.finditer(text, start, end)]


def _table(
    doc: Path,
    text: str,
    plain: str,
    after: int,
    default: str | None,
    template: str,
    result: Scan,
    line_of: Callable[[int], int],
    covered: set[int],
) -> None:
    rows = _rows(plain, after)
    if len(rows) < 3:
        raise FigureError("a table marker should come right before a table")
    header = _cells(plain, *rows[0])

    def key_or_template(cell: tuple[int, int]) -> tuple[str, str | None, bool]:
        """(label, template override, skip) of a header cell."""
        notes = _notes(text, *cell)
        note = notes[-1] if notes else ""
        if note == "skip":
            return "", None, True
        if note and _is_template(note):
            return _label(text[cell[0] : cell[1]]), note, False
        return (note or _label(text[cell[0] : cell[1]])), None, False

    columns = [key_or_template(cell) for cell in header]
    for row_start, row_end in rows[2:]:
        cells = _cells(plain, row_start, row_end)
        row_key, row_template, row_skip = key_or_template(cells[0])
        if row_skip:
            continue
        for (col_key, col_template, col_skip), cell in zip(columns[1:], cells[1:], strict=False):
            shown = numbers(plain, *cell)
            if col_skip or not shown:
                continue
            own = (col_template or row_template or template).replace("{row}", row_key)
            cell_template = own.replace("{col}", col_key)
            try:
                items = _items(cell_template, default)
            except FigureError as exc:
                result.problems.append(f"{_rel(doc)}:{line_of(cell[0])}: {exc}")
                continue
            if len(items) != len(shown):
                result.problems.append(
                    f"{_rel(doc)}:{line_of(cell[0])}: the cell {' '.join(text[cell[0] : cell[1]].split())!r} "
                    f"shows {len(shown)} number(s), its template has {len(items)}: {cell_template!r}"
                )
                continue
            for number, (name, item) in zip(shown, items, strict=True):
                result.figures.append(_figure(doc, line_of(number.start), number, name, item))
                covered.add(number.start)


def documented_files() -> list[Path]:
    """The Markdown files the check reads by default."""
    found = [ROOT / "README.md"]
    for folder in ("docs", "examples", "benchmarks"):
        found += sorted((ROOT / folder).rglob("*.md"))
    return [path for path in found if path.is_file() and RESULTS not in path.parents]


def check(paths: Sequence[Path]) -> tuple[list[Scan], list[str]]:
    """The scans of ``paths`` and every problem: a figure that differs from
    its results file, or a marker that cannot be read."""
    scans = [scan(path) for path in paths]
    problems = [p for s in scans for p in s.problems]
    problems += [f.problem() for s in scans for f in s.figures if not f.ok]
    return scans, problems


def write(scans: Sequence[Scan]) -> int:
    """Rewrite every figure of ``scans`` that differs from its results file;
    the number of figures changed."""
    changed = 0
    for s in scans:
        wrong = [f for f in s.figures if f.value is not None and not f.ok]
        if not wrong:
            continue
        text = s.doc.read_text()
        for figure in sorted(wrong, key=lambda f: f.number.start, reverse=True):
            assert figure.value is not None
            n = figure.number
            text = text[: n.start] + n.formatted(figure.value) + text[n.end :]
        s.doc.write_text(text)
        changed += len(wrong)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.support.figures",
        description="Check the figures quoted in the docs against benchmarks/results/*.json.",
    )
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: all the docs)")
    parser.add_argument("--write", action="store_true", help="rewrite the figures that differ")
    parser.add_argument("--list", action="store_true", help="print every checked figure and its source")
    args = parser.parse_args(argv)
    paths = [path.resolve() for path in args.files] or documented_files()
    scans, problems = check(paths)
    if args.list:
        for s in scans:
            for f in s.figures:
                print(f"{_rel(f.doc)}:{f.line}: {f.number.text} <- {f.source}")
    if args.write:
        changed = write(scans)
        print(f"rewrote {changed} figure(s)")
        scans, problems = check(paths)
    for problem in problems:
        print(problem, file=sys.stderr)
    total = sum(len(s.figures) for s in scans)
    files = sum(1 for s in scans if s.figures)
    print(f"{total} figure(s) in {files} file(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
