"""Turn a benchmark JSON into a Markdown table and PNG plots.

From the repository root, without a GPU (nor CuPy)::

    python -m benchmarks.support.report benchmarks/results/bench-h200.json [--out DIR]

writes ``bench-h200.md`` and the PNGs next to the JSON (or into ``DIR``).
Each section's module renders its own part (``markdown()``, ``plots()``);
this puts them together in the order of ``common.SECTIONS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import SECTIONS, Result, Section, section, stored

TARGETS = {
    "await p50 / floor (work <= 200 us)": "<= 1.25",
    "CPU/wall awaiting 2 ms and 20 ms": "<= 0.05",
    "10k awaits: host us per future": "<= 5",
    "10k awaits: longest loop stall ms": "<= 2",
    "create + set us": "<= 2",
    "then() us per link": "<= 10",
    "pipeline: cudafut / hand-written": ">= 0.95",
    "pipeline: cudafut / serial": ">= 2.5",
}


def _sections(res: dict[str, Any]) -> list[tuple[Section, Result]]:
    """The sections this JSON has a (non-empty) result for, in report order,
    each with its result; only their modules are imported."""
    found = []
    for name in SECTIONS:
        data = stored(res, name)
        if data:
            found.append((section(name), Result(data, res["meta"])))
    return found


def markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"# cudafut benchmark: {meta['gpu']}",
        "",
        f"cudafut {meta['cudafut']}, CuPy {meta['cupy']}, NVIDIA driver {meta.get('nvidia_driver')}, "
        f"Python {meta['python']}, {meta['cpu_count']} CPUs, {meta['date']}. Policy: `{meta['policy']}`.",
        "",
    ]
    for sec, result in _sections(res):
        lines += sec.markdown(result)
    return "\n".join(lines)


def plots(res: dict[str, Any], out: Path, stem: str) -> list[Path]:
    written: list[Path] = []
    for sec, result in _sections(res):
        written += sec.plots(result, out, stem)
    return written


def write_report(res: dict[str, Any], out: Path, stem: str) -> list[Path]:
    md = out / f"{stem}.md"
    md.write_text(markdown(res))
    return [md, *plots(res, out, stem)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.support.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("json", type=Path, help="a bench-<gpu>.json the suite wrote")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for Markdown and plots (default: the JSON's)"
    )
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    out = args.out or args.json.parent
    out.mkdir(parents=True, exist_ok=True)
    for p in write_report(data, out, args.json.stem):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
