"""Copy in, compute, copy out, over many chunks: cudafut against the serial loop.

The serial version is what one writes first: one stream, and for each chunk
copy it in, compute, copy it out, ``stream.synchronize()``. The GPU's copy
engines and its SMs take turns, and the host waits for every chunk.

The cudafut version enqueues every chunk at once and awaits them together::

    fut = cudafut.to_device(h_in[i]).then(compute)   # copy stream, then a pool stream
    outs.append(cudafut.to_host(fut, out=h_out[i]))  # back on the compute stream
    ...
    await cudafut.gather(*outs)

Copies in run on cudafut's copy streams; each chunk's compute, and its copy
out after it, on a pool stream (the pool hands them out in turn), each
waiting only for what it needs, so chunk i + 1 is copied in while chunk i
is computed and chunk i - 1 copied out. The host chunks are pinned
(``cudafut.empty_pinned``), so every copy is one ``cudaMemcpyAsync``.

It prints chunks/s of both and the speed-up, and checks that both computed
the same thing, and the right thing (``results checked: ...``). From the
repository root, on a machine with a GPU::

    python examples/pipeline.py                      # 64 chunks of 4 MB
    python examples/pipeline.py --quick              # a few seconds
    python examples/pipeline.py --trace pipe.json    # and record one run
    python docs/render_trace.py pipe.json            # draw it (pipe.png)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

import cudafut
from cudafut._cli.selfcheck import require_gpu

A, B = 1.0001, 0.5

#: y = x * A + B, ``rounds`` times: arithmetic whose time ``--rounds`` sets.
_ITERATE = cp.ElementwiseKernel(
    "float32 x, float32 a, float32 b, int32 rounds",
    "float32 y",
    "float v = x; for (int r = 0; r < rounds; ++r) v = v * a + b; y = v;",
    "iterate_axpb",
)


class Pipeline:
    def __init__(self, chunks: int, size: int, rounds: int) -> None:
        self.chunks, self.size, self.rounds = chunks, size, rounds
        base = (np.arange(size) % 1000 / 1000).astype(np.float32)
        self.h_in = [cudafut.empty_pinned(size, np.float32) for _ in range(chunks)]
        for i, chunk in enumerate(self.h_in):
            chunk[:] = base + i
        self.h_serial = [cudafut.empty_pinned(size, np.float32) for _ in range(chunks)]
        self.h_cudafut = [cudafut.empty_pinned(size, np.float32) for _ in range(chunks)]
        self.stream = cp.cuda.Stream(non_blocking=True)

    def compute(self, x: Any) -> Any:
        """On the current stream (a pool stream when called by ``then``)."""
        return _ITERATE(x, np.float32(A), np.float32(B), np.int32(self.rounds))

    def serial(self) -> None:
        """One stream; copy in, compute, copy out, synchronize, chunk by chunk."""
        with self.stream:
            d_in = cp.empty(self.size, dtype=cp.float32)
            for i in range(self.chunks):
                d_in.set(self.h_in[i], stream=self.stream)
                y = self.compute(d_in)
                y.get(out=self.h_serial[i], stream=self.stream, blocking=False)
                self.stream.synchronize()

    async def with_cudafut(self) -> None:
        """Every chunk enqueued at once; one await for all of them."""
        outs = []
        for i in range(self.chunks):
            fut = cudafut.to_device(self.h_in[i]).then(self.compute)
            outs.append(cudafut.to_host(fut, out=self.h_cudafut[i]))
        await cudafut.gather(*outs)

    def clear(self) -> None:
        for chunk in (*self.h_serial, *self.h_cudafut):
            chunk.fill(np.nan)

    def check(self) -> None:
        """Both versions agree bit for bit on every chunk, and match the closed
        form ``a^r x + b (a^r - 1) / (a - 1)`` on the first and last."""
        for i in range(self.chunks):
            if not np.array_equal(self.h_serial[i], self.h_cudafut[i]):
                raise AssertionError(f"chunk {i}: the cudafut pipeline and the serial loop differ")
        ar = A**self.rounds
        for i in (0, self.chunks - 1):
            expect = ar * self.h_in[i].astype(np.float64) + B * (ar - 1) / (A - 1)
            if not np.allclose(self.h_serial[i], expect, rtol=1e-3):
                raise AssertionError(f"chunk {i}: wrong values")


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def main(args: argparse.Namespace) -> None:
    p = Pipeline(args.chunks, args.chunk_mb << 18, args.rounds)  # 4-byte floats
    loop = asyncio.get_running_loop()
    serial_s: list[float] = []
    cudafut_s: list[float] = []
    for repeat in range(args.repeats + 1):  # the first round warms up (compiles, allocates)
        p.clear()
        s = timed(p.serial)
        t = loop.time()
        await p.with_cudafut()
        c = loop.time() - t
        p.check()
        if repeat:
            serial_s.append(s)
            cudafut_s.append(c)
    serial, fast = statistics.median(serial_s), statistics.median(cudafut_s)
    what = f"{p.chunks} chunks of {args.chunk_mb} MB, {p.rounds} rounds of a*x+b"
    print(f"{what}, median of {args.repeats} runs:")
    print(f"  serial (one stream, synchronize per chunk): {p.chunks / serial:8.1f} chunks/s")
    print(f"  cudafut to_device().then().to_host():       {p.chunks / fast:8.1f} chunks/s")
    print(f"  speed-up: {serial / fast:.2f}x")
    print(f"results checked: all {p.chunks} chunks of both versions agree and match the closed form")
    if args.trace is not None:
        p.clear()
        async with cudafut.trace(args.trace) as tr:
            await p.with_cudafut()
        p.serial()
        p.check()
        assert tr.events is not None
        print(
            f"wrote {args.trace} ({len(tr.events)} events); draw it: python docs/render_trace.py {args.trace}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4000, help="compute per element (the kernel's time)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16 chunks, 2 repeats: a few seconds")
    parser.add_argument("--trace", type=Path, default=None, help="record one cudafut run here (JSON)")
    args = parser.parse_args()
    require_gpu()  # without one: what `python -m cudafut` says, and status 1
    if args.quick:
        args.chunks, args.repeats = min(args.chunks, 16), min(args.repeats, 2)
    asyncio.run(main(args))
