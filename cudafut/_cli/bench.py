"""``python -m cudafut bench``: the front door of the benchmark suite, which
lives in benchmarks/ of a source checkout, not in the package.

It runs ``python -m benchmarks`` of that checkout in a child process (same
interpreter, same working directory, the checkout first on ``PYTHONPATH``)
and exits with its status: the package never imports the suite, which
imports the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_REPOSITORY = "https://github.com/cudafut/cudafut"

_NO_CHECKOUT = f"""\
python -m cudafut bench runs the full benchmark suite, which is not installed
with the package: it lives in benchmarks/ of a source checkout (this cudafut
is installed at {{where}}, with no benchmarks/ beside it).
To run it, run from a source checkout:

  git clone {_REPOSITORY}
  cd cudafut && pip install -e '.[cli]'
  python -m cudafut bench --help

`python -m cudafut` (no `bench`) works from any install: a self-check and a
20-second benchmark of this GPU.
"""


def command(root: Path, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The suite's command line and environment, for the checkout at ``root``."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "benchmarks", *argv], {**os.environ, "PYTHONPATH": path}


def bench(argv: list[str]) -> int:
    """``python -m cudafut bench``: the suite of a source checkout, in a
    child process, and its exit status (a message and status 2 without a
    checkout; the self-check's message and status 1 without a usable GPU,
    ``--help`` aside)."""
    package = Path(__file__).resolve().parent.parent
    root = package.parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        print(_NO_CHECKOUT.format(where=package), file=sys.stderr, end="")
        return 2
    cmd, env = command(root, argv)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child got the Ctrl-C too: let it write what it measured
        return proc.wait()
