"""How far one ``then()`` figure moves within a process, on a GPU.

``python scripts/then-spread.py wake vary many`` (from the repository root,
on a machine with a GPU) measures the ``host`` section's ``then()`` chains
(``benchmarks.host.measure``: cudafut and ``torch.futures``, ``fn`` returning
or launching a kernel, each the best of 3 chains) in a fresh process, then
again after each named section has run in the same process (``--quick``),
and prints each measurement with the process's Python and OS threads.
Section progress goes to stderr. ``benchmarks/results/then-spread-h200.txt``
is one run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import host
from benchmarks.support.common import Progress, section


def rows(tag: str) -> None:
    r = host.measure(Progress(1000))
    names = {"cudafut then() per link": "cf", "peer: torch then() per link": "torch"}
    short = {}
    for k, v in r.items():
        if "then" in k:
            for long, name in names.items():
                k = k.replace(long, name)
            short[k] = round(v, 2)
    print(tag, short, flush=True)
    threads = [t.name for t in threading.enumerate()]
    print(tag, "py threads", threads, "os threads", len(os.listdir("/proc/self/task")), flush=True)


def main(names: list[str]) -> None:
    rows("fresh")
    for name in names:
        t = time.perf_counter()
        section(name).run(Progress(1000), True)
        print(name, f"ran {time.perf_counter() - t:.1f} s", flush=True)
        rows("after " + name)


if __name__ == "__main__":
    main(sys.argv[1:])
