"""``python -m cudafut bench``: run the benchmark suite of a source checkout."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_USAGE = "usage: python -m cudafut bench [--help | options]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "bench":
        print(_USAGE, file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "suite.py").is_file():
        print(
            "python -m cudafut bench runs the suite in benchmarks/ of a source checkout "
            f"(not found next to {Path(__file__).parent}); clone the repository and "
            "`pip install -e .` it",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))
    suite = importlib.import_module("benchmarks.suite")  # not a part of the package
    return int(suite.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
