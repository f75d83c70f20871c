"""The ``many`` section's scenario on a machine without a GPU: host CPU per
future of 10,000 concurrent awaits, by phase, over a libcuda that does
nothing.

``python scripts/model-many.py`` (from the repository root) runs CUDA's
backend over the null libcuda of ``scripts/nullcuda.c`` and a stand-in for
CuPy's runtime (``scripts/profile-collective.py``'s, reused): build it to
``/tmp/nullcuda/libcuda.so.1`` (``gcc -shared -fPIC -O2 -o
/tmp/nullcuda/libcuda.so.1 scripts/nullcuda.c``) and run with
``LD_LIBRARY_PATH=/tmp/nullcuda``. 10,000 tasks await ``cudafut.record()``
futures over 8 streams, in batches of 10 per loop iteration, while every
event query says "not ready"; after ``--busy`` seconds the queries say
"complete". Beside it, the same tasks on plain asyncio futures, set in
slices of 256. Host CPU per future is printed for the three phases
(starting the tasks, waiting, finishing them), gc off, the median of
``--rounds`` alternated rounds.

What it models: the Python and C that cudafut runs per await, with driver
calls that cost nothing. What it leaves out: the driver's own cost (an
event record or query is 0.2-1.4 µs on an H200) and how late a sleeping
loop wakes on a GPU host. Use it to compare two trees' host paths on one
machine (alternate them), not for figures of a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import importlib.util
import os
import resource
import statistics
import sys
import warnings

sys.path.insert(0, os.getcwd())

_spec = importlib.util.spec_from_file_location("profile_collective", "scripts/profile-collective.py")
assert _spec is not None
assert _spec.loader is not None
_pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pc)

import cupy as cp  # noqa: E402 - after the helpers, which set CuPy's interface version

import cudafut  # noqa: E402
from cudafut import _compiled, _cuda  # noqa: E402

NSTREAMS = 8
CUDAFUT, PLAIN = "cudafut", "plain"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Model:
    """Streams and a token array on memory of this process (the null
    libcuda never reads them; cudafut checks that a handle is mapped)."""

    def __init__(self) -> None:
        self._memory = [ctypes.create_string_buffer(64) for _ in range(NSTREAMS + 1)]
        with warnings.catch_warnings():  # CuPy 14 deprecates it; the native path takes it as a Stream
            warnings.simplefilter("ignore", DeprecationWarning)
            self.streams = [cp.cuda.ExternalStream(ctypes.addressof(b), 0) for b in self._memory[:NSTREAMS]]
        native = _compiled.native()
        if native is not None:
            # Numbered and watermarked as the benchmark's CuPy streams are
            # (an ExternalStream may outlive its handle: the core would
            # otherwise give every record a stream state of its own).
            for stream in self.streams:
                native.keep_stream(stream, 0)
        token = self._memory[NSTREAMS]
        memory = cp.cuda.UnownedMemory(ctypes.addressof(token), 4, token, device_id=0)
        self.token = cp.ndarray((1,), cp.float32, memptr=cp.cuda.MemoryPointer(memory, 0))

    async def scenario(self, kind: str, n: int, busy: float) -> list[float]:
        loop = asyncio.get_running_loop()
        _pc.set_query_status(_cuda.NOT_READY)
        plain: list[asyncio.Future[None]] = []
        left = n
        done = asyncio.Event()

        async def one(i: int) -> None:
            nonlocal left
            if kind == CUDAFUT:
                await cudafut.record(self.token, stream=self.streams[i % NSTREAMS])
            else:
                fut = loop.create_future()
                plain.append(fut)
                await fut
            left -= 1
            if not left:
                done.set()

        tasks: set[asyncio.Task[None]] = set()
        c0 = cpu()
        for start in range(0, n, 10):
            for i in range(start, min(n, start + 10)):
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)
        c1 = cpu()
        await asyncio.sleep(busy)
        c2 = cpu()
        if kind == CUDAFUT:
            _pc.set_query_status(0)
        else:
            for start in range(0, n, 256):
                for fut in plain[start : start + 256]:
                    fut.set_result(None)
                await asyncio.sleep(0)
        await done.wait()
        c3 = cpu()
        return [(c1 - c0) / n * 1e6, (c2 - c1) / n * 1e6, (c3 - c2) / n * 1e6]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--busy", type=float, default=0.2, help="seconds the streams stay busy")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not _pc.libcuda():
        sys.exit(
            "build scripts/nullcuda.c to /tmp/nullcuda/libcuda.so.1 "
            "(gcc -shared -fPIC -O2 -o /tmp/nullcuda/libcuda.so.1 scripts/nullcuda.c) "
            "and run with LD_LIBRARY_PATH=/tmp/nullcuda"
        )
    _pc.install_nullcuda()
    model = Model()
    kinds = (PLAIN, CUDAFUT)
    for kind in kinds:  # warm-up
        asyncio.run(model.scenario(kind, args.n, args.busy))
    runs: dict[str, list[list[float]]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):  # alternated: drift hits both alike
        for kind in kinds:
            gc.collect()
            gc.disable()
            try:
                runs[kind].append(asyncio.run(model.scenario(kind, args.n, args.busy)))
            finally:
                gc.enable()
    print(f"{cudafut.__name__} core: {_compiled.core()}; {args.n} awaits over {NSTREAMS} streams, gc off")
    for kind, rows in runs.items():
        phases = [statistics.median(r[j] for r in rows) for j in range(3)]
        print(
            f"  {kind:8s} start {phases[0]:6.2f}  wait {phases[1]:6.2f}  finish {phases[2]:6.2f}  "
            f"total {sum(phases):6.2f} µs per future"
        )


if __name__ == "__main__":
    main()
