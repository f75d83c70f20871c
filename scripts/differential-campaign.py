"""Run many random programs through both cores on the fake GPU, as
tests/test_differential.py does with a few hundred, and report the first
difference between their traces and every program slower than a bound.

The CPU suite's differential test draws 500 programs a run; rare races and
rare orders of events need tens of thousands. From the repository root,
with the native core built::

    python scripts/differential-campaign.py                 # 10,000 programs, seed 0
    python scripts/differential-campaign.py -n 50000 --seed 7 --slow-s 1.5

Prints each slow program (a settle window waited out its bound, or the
events took long to come back) and stops at the first difference, printing
it and the program; exit status 1 then, else 0. A program printed here
reruns with ``python -m tests.differential_worker`` (one JSON line on
stdin) under either core (``CUDAFUT_PURE=1`` for the pure one).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import test_differential


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10_000, help="programs to run (default 10,000)")
    parser.add_argument("--seed", type=int, default=0, help="the random programs' seed")
    parser.add_argument("--slow-s", type=float, default=1.5, help="report programs slower than this")
    args = parser.parse_args()
    workers = test_differential._Worker(pure=False), test_differential._Worker(pure=True)
    rng = random.Random(args.seed)
    started, slow = time.monotonic(), 0
    try:
        for i in range(args.n):
            program = test_differential._random_program(rng)
            began = time.monotonic()
            try:
                test_differential._assert_same(workers, program)
            except AssertionError as exc:
                print(f"program {i} (seed {args.seed}): {exc}", flush=True)
                return 1
            took = time.monotonic() - began
            if took > args.slow_s:
                slow += 1
                print(f"slow: {took:.1f} s: {json.dumps(program)}", flush=True)
    finally:
        for worker in workers:
            worker.close()
    print(f"{args.n} programs, no difference, {slow} slow, in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
