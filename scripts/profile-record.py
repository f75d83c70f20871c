"""Where the host time of ``record()`` and of ``await`` on done work goes, on a GPU.

``CUDAFUT_PURE=1 python scripts/profile-record.py`` (from the repository
root, on a machine with a GPU; pure Python, so that cProfile sees every
function) times 20,000 ``cudafut.record(x, stream=s)`` calls and 20,000
awaits of a done future, then profiles each with ``cProfile`` and prints
the 25 costliest functions by own time (``$OUT/prof-record.txt`` too;
``$OUT`` defaults to /tmp). Beside them, the CuPy primitives beneath:
``Event()`` + ``record``, a reused event's ``record``, ``eventQuery``,
``get_current_stream()``.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.getcwd())

import cupy as cp

import cudafut

N = 20_000


def per_call_us(fn: Callable[[], object], n: int = N) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    x = cp.zeros(4)
    s = cp.cuda.Stream(non_blocking=True)
    ev = cp.cuda.Event(disable_timing=True)
    rt = cp.cuda.runtime
    lines = [f"core: {cudafut._compiled.core()}"]
    for name, fn in (
        ("cupy Event() + record", lambda: cp.cuda.Event(disable_timing=True).record(s)),
        ("cupy record of a reused event", lambda: ev.record(s)),
        ("cupy eventQuery", lambda: rt.eventQuery(ev.ptr)),
        ("cupy get_current_stream()", cp.cuda.get_current_stream),
        ("cudafut.record(x, stream=s)", lambda: cudafut.record(x, stream=s)),
    ):
        per_call_us(fn, 2000)
        lines.append(f"{name}: {per_call_us(fn):.2f} us")
    done = cudafut.record(x, stream=s)
    s.synchronize()
    done.result()

    async def awaits(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            await done
        return (time.perf_counter() - t) / n * 1e6

    lines.append(f"await of a done future: {asyncio.run(awaits(N)):.2f} us")
    text = "\n".join(lines)
    for what, stmt in (
        ("record", lambda: [cudafut.record(x, stream=s) for _ in range(N)]),
        ("await", lambda: asyncio.run(awaits(N))),
    ):
        prof = cProfile.Profile()
        prof.runcall(stmt)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text += f"\n\n=== {what}, {N} calls, by own time ===\n" + buf.getvalue()
    print(text)
    with open(os.path.join(out, "prof-record.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
