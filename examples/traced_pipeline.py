"""A small pipeline recorded with ``cudafut.trace``: the timeline docs/tracing.md shows.

Run it on a machine with a GPU, from the repository root::

    python examples/traced_pipeline.py                      # writes docs/trace-pipeline.json
    python docs/render_trace.py docs/trace-pipeline.json    # draws docs/trace-pipeline.png

then open the JSON in https://ui.perfetto.dev (or chrome://tracing). It
records three things a user of cudafut meets:

1. a pipeline: ``CHUNKS`` chunks, each ``submit(load).then(compute).then(store)``
   (three GPU stages of known durations), awaited together with ``gather``.
   Each chunk runs on its own pool stream, the chunks overlap;
2. how the waiter watches repeated work: ``JOBS`` jobs of ``JOB_MS`` on one
   stream, each awaited as soon as it is launched. The first ones are of a
   duration the waiter has not seen: it spins 100 µs, then sleeps in growing
   steps and notices the end up to a sleep late. From the third on it may
   sleep until just before the learnt end and spin there (docs/tracing.md
   says what the committed trace shows: one such spin, a near miss). The
   waiter's track shows each sleep and spin;
3. a ``result()`` in a worker thread and a done callback on the loop.

Every stage's result is checked, so the trace is of work that did what it
says. The GPU stages are kernels that spin on the GPU's clock
(``%globaltimer``) for an exact time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import cupy as cp

import cudafut
from cudafut._cli.selfcheck import require_gpu

CHUNKS = 4
LOAD_MS, COMPUTE_MS, STORE_MS = 1.0, 2.0, 0.5
JOBS, JOB_MS = 4, 3.0
N = 1 << 16

_SPIN = cp.RawKernel(
    r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
""",
    "spin",
)


def busy(ms: float) -> None:
    """Keep the current stream busy for ``ms`` milliseconds of GPU time."""
    _SPIN((1,), (1,), (cp.int64(int(ms * 1e6)),))


def load(i: int) -> Any:
    busy(LOAD_MS)
    return cp.full(N, i, dtype=cp.float32)


def compute(x: Any) -> Any:
    busy(COMPUTE_MS)
    return x * 2 + 1


def store(x: Any) -> Any:
    busy(STORE_MS)
    return x.sum()


async def pipeline() -> None:
    outs = [cudafut.submit(load, i).then(compute).then(store) for i in range(CHUNKS)]
    sums = await cudafut.gather(*outs)
    for i, total in enumerate(sums):
        assert float(total) == N * (2 * i + 1), (i, float(total))


async def repeated_jobs(stream: Any, token: Any) -> None:
    for _ in range(JOBS):
        fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
        with stream:
            busy(JOB_MS)
            fut.set_result(token)  # an event on `stream`, after the job
        await fut


async def result_and_callback() -> None:
    fut = cudafut.submit(load, 9).then(compute)
    called = asyncio.Event()
    fut.add_done_callback(lambda _fut: called.set())
    value = await asyncio.to_thread(fut.result, 10)
    await called.wait()
    assert float(value[0]) == 19.0


async def main(out: Path) -> None:
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        token = cp.zeros(1, dtype=cp.float32)
    # Compile and load everything outside the trace: it would show as slow work.
    await pipeline()
    await result_and_callback()
    stream.synchronize()
    async with cudafut.trace(out) as trace:
        await pipeline()
        await repeated_jobs(stream, token)
        await result_and_callback()
    assert trace.events is not None
    print(f"wrote {out}: {len(trace.events)} trace events", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/trace-pipeline.json"), help="the trace file")
    args = parser.parse_args()
    require_gpu()  # without one: what `python -m cudafut` says, and status 1
    asyncio.run(main(args.out))
    print(f"render it: python docs/render_trace.py {args.out}", file=sys.stderr)
