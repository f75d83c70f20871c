"""cudafut's benchmark suite: every figure next to a baseline from the same run.

Run it with ``python -m cudafut bench`` (``--help`` lists the options), from a
source checkout on a machine with a GPU. It writes ``bench-<gpu>.json``, a
Markdown table and PNG plots into ``--out`` (default ``benchmarks/results``).

Sections (numbers as in the performance issue and docs/performance.md):

1-3. ``wake``: launch a kernel that runs for an exact time (0 µs to 20 ms,
     ``%globaltimer`` spin), learn that it finished; p50/p99 and CPU/wall for
     each waiting strategy, against ``stream.synchronize()`` (the floor).
     ``sweep``: the same ``await`` on repeating 2 and 20 ms work, for a range
     of ``WaitPolicy(cpu_budget=...)``. ``vary``: see its module.
4.   ``many``: 10,000 concurrent awaits over 8 streams; host time per future
     and the longest stall of a heartbeat task, next to plain asyncio futures.
5.   ``host``: create + set, ``record()``, ``then()`` chains, next to a bare
     kernel launch and to ``torch.futures``.
     ``copies``: ``to_device`` / ``to_host`` against raw ``cudaMemcpyAsync``
     on pinned memory and CuPy's pageable copies, 4 KB to 1 GB: bandwidth,
     calling-thread time, 64 tasks copying, 100,000 copies for leaks, the
     allocator wrapper's cost (issue 10).
6.   ``pipeline``: copy in / compute / copy out over N chunks: cudafut
     (``to_device().then().to_host()``), serial and hand-written
     multi-stream CuPy with events; pinned and pageable host chunks.
     ``tracking``: one ``cudafut.Tracked`` ``read()`` / ``write()`` block
     (host µs: nothing to wait for, one wait, tracking off) against raw CuPy
     events; tasks on their own streams sharing arrays (Tracked +
     ``@own_stream``, hand-written events, a CUDA.jl-style host wait, one
     stream; checked against a NumPy replay); ``@own_stream`` per task step
     (issue 11).
7.   peers appear inside the sections: asyncio ``sleep(0)`` polling,
     ``run_in_executor(event.synchronize)``, a native host function closing a
     pipe, numba-cuda ``async_done()``, ``torch.futures``.
8.   ``collectives``: NCCL collectives as futures against NCCL called
     directly, one worker process per GPU (docs/distributed.md).

Each section is one module of benchmarks/, named as in ``--only`` (``wake.py``
...), with the interface of ``common.Section``: ``NAME``, ``steps(quick)``,
``run(progress, quick)``, ``markdown(result)``, ``plots(result, out, stem)``;
``common.SECTIONS`` lists them in the order they run and are reported.
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

from .common import SECTIONS, Progress, section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudafut bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON, Markdown and plots")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--name", default=None, help="result file stem (default: bench-<gpu>)")
    args = parser.parse_args(argv)
    # Without a usable GPU: python -m cudafut's message and status 1, not
    # CuPy's traceback from the first measurement.
    from cudafut._cli.selfcheck import require_gpu

    require_gpu()
    # Every section module is imported before anything runs (a missing one
    # fails now, not after minutes of measuring); none needs CuPy to import.
    sections = [section(name) for name in SECTIONS if name in (args.only or SECTIONS)]
    # Imported only now: --help works without CuPy or a GPU.
    from . import gpu
    from .report import write_report

    env = gpu.environment()
    progress = Progress(sum(s.steps(args.quick) for s in sections))
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or "bench-" + env["gpu"].lower().replace("nvidia ", "").split()[0]
    for s in sections:
        results[s.NAME] = s.run(progress, args.quick)
        # After every section: a crash later keeps what was measured.
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    written = write_report(results, out, stem)
    for path in [out / f"{stem}.json", *written]:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
