"""``python -m cudafut bench``: the front door of the benchmark suite, which
lives in benchmarks/ of a source checkout, not in the package."""

from __future__ import annotations

import importlib
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


def bench(argv: list[str]) -> int:
    """``python -m cudafut bench``: the suite of a source checkout (a
    message and status 2 without one; the self-check's message and status
    1 without a usable GPU, ``--help`` aside)."""
    package = Path(__file__).resolve().parent.parent
    root = package.parent
    if not (root / "benchmarks" / "support" / "suite.py").is_file():
        print(_NO_CHECKOUT.format(where=package), file=sys.stderr, end="")
        return 2
    sys.path.insert(0, str(root))
    suite = importlib.import_module("benchmarks.support.suite")  # not a part of the package
    try:
        return int(suite.main(argv))
    except SystemExit as exc:  # argparse (--help, bad options) and require_gpu()
        return exc.code if isinstance(exc.code, int) else 1 if exc.code else 0
