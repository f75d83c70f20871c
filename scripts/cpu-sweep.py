"""How fast this host runs cudafut's host calls on each of its CPUs.

``python scripts/cpu-sweep.py`` (from the repository root, on a machine with
a GPU) pins its main thread to each CPU in turn and measures, best of 3:
a ``then()`` chain per link (``fn`` returning, and launching a kernel), a
``record()`` and a bare kernel launch; then imports torch and measures them
again beside ``torch.futures``' chain, with the ratio. One JSON line per
CPU. On a virtual machine whose CPUs share physical cores with other
guests, the same call costs up to twice as much on one CPU as on another,
and a CPU's speed changes within minutes: a lone figure of a host section
says as much about the host as about the code, and only ratios measured
back to back (as ``python -m cudafut bench --only host``'s alternated rounds)
compare. ``benchmarks/results/cpu-sweep-h200.txt`` is one run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp

import cudafut
from benchmarks.host import cudafut_chain, torch_chain
from benchmarks.support.gpu import gsleep, stream, token

ZERO = cp.int64(0)


def launch() -> None:
    gsleep((1,), (1,), (ZERO,))


def chain(with_kernel: bool) -> float:
    return cudafut_chain(stream, token, 1000, launch if with_kernel else None)


def per_call(fn: Any, n: int) -> float:
    with stream:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        per = (time.perf_counter() - t) / n * 1e6
    stream.synchronize()
    return per


def best(fn: Any, *args: Any) -> float:
    fn(*args)
    return round(min(fn(*args) for _ in range(3)), 2)


def main() -> None:
    theirs = None
    for phase in ("no torch", "torch"):
        if phase == "torch":
            import torch

            theirs = torch_chain(torch, torch.zeros(1, device="cuda"), 1000)
        for cpu in sorted(os.sched_getaffinity(0)):
            os.sched_setaffinity(0, {cpu})  # this thread only
            row: dict[str, Any] = {
                "cpu": cpu,
                "phase": phase,
                "then us": best(chain, False),
                "then, kernel in fn us": best(chain, True),
                "record us": best(per_call, lambda: cudafut.record(token), 10_000),
                "launch us": best(per_call, launch, 2000),
            }
            if theirs is not None:
                row["torch then us"] = best(theirs, False)
                row["ratio then / torch's"] = round(row["then us"] / row["torch then us"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
