"""``python -m benchmarks``: the benchmark suite (:mod:`benchmarks.support.suite`),
from the root of a source checkout; ``python -m cudafut bench`` runs it."""

import sys

from benchmarks.support.suite import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
