"""cudafut's benchmark suite: every figure next to a baseline from the same run.

Run it with ``python -m cudafut bench`` (``--help`` lists the options), from a
source checkout on a machine with a GPU. It writes ``bench-<gpu>.json``, a
Markdown table and PNG plots into ``--out`` (default ``benchmarks/results``).

Sections (numbers as in the performance issue and docs/performance.md):

1-3. ``wake``: launch a kernel that runs for an exact time (0 µs to 20 ms,
     ``%globaltimer`` spin), learn that it finished; p50/p99 and CPU/wall for
     each waiting strategy, against ``stream.synchronize()`` (the floor).
4.   ``many``: 10,000 concurrent awaits over 8 streams; host time per future
     and the longest stall of a heartbeat task, next to plain asyncio futures.
5.   ``host``: create + set, ``record()``, ``then()`` chains, next to a bare
     kernel launch and to ``torch.futures``.
6.   ``pipeline``: copy in / compute / copy out over N chunks: cudafut, serial
     and hand-written multi-stream CuPy with events.
7.   peers appear inside the sections: asyncio ``sleep(0)`` polling,
     ``run_in_executor(event.synchronize)``, a native host function closing a
     pipe, numba-cuda ``async_done()``, ``torch.futures``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import cudafut

SECTIONS = ("wake", "sweep", "many", "host", "pipeline")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudafut bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON, Markdown and plots")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--name", default=None, help="result file stem (default: bench-<gpu>)")
    args = parser.parse_args(argv)
    sections = args.only or list(SECTIONS)
    # Imported only now: --help works without CuPy or a GPU.
    from . import gpu
    from .measure import (
        ASYNC_STRATEGIES,
        PIPELINES,
        SWEEP_BUDGETS,
        SWEEP_MS,
        SYNC_STRATEGIES,
        WORK_MS,
        Progress,
        bench_host,
        bench_many,
        bench_pipeline,
        bench_sweep,
        bench_wake,
    )
    from .report import write_report

    env = gpu.environment()
    total = (
        ("wake" in sections) * len(WORK_MS) * (1 + len(ASYNC_STRATEGIES) + len(SYNC_STRATEGIES))
        + ("sweep" in sections) * len(SWEEP_MS) * len(SWEEP_BUDGETS)
        + ("many" in sections) * 2
        + ("host" in sections) * 7
        + ("pipeline" in sections) * 4 * len(PIPELINES)
    )
    progress = Progress(total)
    print(f"cudafut {cudafut.__version__} bench on {env['gpu']}, CuPy {env['cupy']}", file=sys.stderr)
    gpu.work(0)
    gpu.stream.synchronize()
    results: dict[str, Any] = {
        "meta": {
            **env,
            "cudafut": cudafut.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "policy": repr(cudafut.get_wait_policy()),
            "quick": args.quick,
        }
    }
    if "wake" in sections:
        results["wake"] = bench_wake(progress, args.quick)
    if "sweep" in sections:
        results["sweep"] = bench_sweep(progress, args.quick)
    if "many" in sections:
        results["many_awaits"] = bench_many(progress)
    if "host" in sections:
        results["host"] = bench_host(progress)
    if "pipeline" in sections:
        results["pipeline"] = bench_pipeline(progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or "bench-" + env["gpu"].lower().replace("nvidia ", "").split()[0]
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    written = write_report(results, out, stem)
    for path in [out / f"{stem}.json", *written]:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
