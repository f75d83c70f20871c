"""Run ``python -m cudafut bench`` on several source trees in turn, so that
a change and its baseline are measured in the same run (drift and the
machine hit both alike).

From a source checkout, on a machine with a GPU::

    git archive 3c2beb9 | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python -m benchmarks.support.alternate --tree base=/tmp/base --tree new=. \\
        --rounds 2 --out /tmp/results -- --only wake --only many

Each round runs every tree once, in the order given, each in its own
process with that tree first on ``PYTHONPATH`` (its ``cudafut`` and its
``benchmarks``), writing ``<name>-<round>.json`` (and the Markdown and
plots) to ``--out``. A run that fails is reported and the others go on; the
exit status says whether all succeeded. ``--timeout`` bounds each run.
The ``serve`` and ``collectives`` sections load code from the tree's
``examples/``: asked for (or every section, without ``--only``) on a tree
without it, the run is refused before anything starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

#: The ``cudafut bench`` sections that load code from the tree's examples/.
NEEDS_EXAMPLES: Final = frozenset({"serve", "collectives"})


def _tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree needs NAME=PATH, not {text!r}")
    root = Path(path).resolve()
    if not (root / "cudafut").is_dir() or not (root / "benchmarks").is_dir():
        raise argparse.ArgumentTypeError(f"{root} holds no cudafut/ and benchmarks/: not a source tree")
    return name, root


def run(
    trees: list[tuple[str, Path]],
    rounds: int,
    out: Path,
    bench_args: list[str],
    timeout: float,
    envs: dict[str, dict[str, str]] | None = None,
) -> int:
    """Run the benchmark ``rounds`` times over ``trees`` (``envs``: extra
    variables per tree name); the number of runs that failed."""
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for round_ in range(1, rounds + 1):
        for name, root in trees:
            stem = f"{name}-{round_}"
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                **(envs or {}).get(name, {}),
            }
            cmd = [
                sys.executable,
                "-m",
                "cudafut",
                "bench",
                "--out",
                str(out.resolve()),
                "--name",
                stem,
                *bench_args,
            ]
            t = time.perf_counter()
            print(f"[{stem}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            try:
                rc = subprocess.run(cmd, cwd=root, env=env, timeout=timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            print(f"[{stem}] rc={rc} in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
            failed += rc != 0
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.support.alternate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tree", type=_tree, action="append", required=True, help="NAME=PATH, repeatable")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE",
        help="an environment variable for tree NAME's runs (CUDAFUT_PURE=1: its pure core), repeatable",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: arguments of cudafut bench")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = [name for name, _root in args.tree]
    if len(set(names)) != len(names):  # one tree may run twice under two names
        parser.error(f"tree names must differ: {names}")
    envs: dict[str, dict[str, str]] = {}
    for item in args.env:
        name, sep, assignment = item.partition(":")
        var, eq, value = assignment.partition("=")
        if not (sep and eq and var) or name not in names:
            parser.error(f"--env needs NAME:VAR=VALUE with NAME one of {names}, not {item!r}")
        envs.setdefault(name, {})[var] = value
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    needy = sorted(NEEDS_EXAMPLES & set(bench_args))
    if needy or "--only" not in bench_args:  # without --only, every section runs
        for name, root in args.tree:
            if not (root / "examples").is_dir():
                parser.error(
                    f"tree {name} ({root}) has no examples/, which the sections "
                    f"{', '.join(needy or sorted(NEEDS_EXAMPLES))} load: archive it too "
                    "(git archive REV cudafut benchmarks examples)"
                )
    return 1 if run(args.tree, args.rounds, args.out, bench_args, args.timeout, envs) else 0


if __name__ == "__main__":
    sys.exit(main())
