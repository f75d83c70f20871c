"""The core's paths in one short script, for compute-sanitizer (needs a GPU).

    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/sanitizer-paths.py
    compute-sanitizer --tool synccheck --error-exitcode 9 python scripts/sanitizer-paths.py

(``CUDAFUT_PURE=1`` for the pure-Python core.) The GPU suite under the
sanitizer takes too long and its timing bounds fail there (docs/reliability.md);
this walks what every future does instead: records on a busy stream, 200
concurrent awaits (the waiter's polls and the pacer), ``then()`` of a done
future and a chain of 50 links, ``result()``, ``wait()`` ordering another stream,
``launch()``, and futures dropped before their work ends. Each answer is
checked against NumPy; the script exits 1 on a wrong one. The sanitizer's
``ERROR SUMMARY`` line is the verdict on memory and synchronisation.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cudafut
from cudafut import _compiled
from tests.kernels import spin_fill


def main() -> int:
    wrong = 0
    n = 1 << 16
    stream = cp.cuda.Stream(non_blocking=True)

    # Records on a busy stream, read with result().
    with stream:
        x = cp.zeros(n, cp.float32)
        spin_fill(x, 3.0, 2.0)
        fut = cudafut.record(x, stream=stream)
    wrong += int(not np.all(fut.result().get() == 3.0))

    # then() of a done future, and a chain of 50 links.
    fut = fut.then(lambda a: a + 1)
    for _ in range(49):
        fut = fut.then(lambda a: a + 1)
    wrong += int(not np.all(fut.result().get() == 53.0))

    # wait() orders another stream after a slow producer.
    other = cp.cuda.Stream(non_blocking=True)
    with stream:
        y = cp.zeros(n, cp.float32)
        spin_fill(y, 7.0, 2.0)
        fut = cudafut.record(y, stream=stream)
    with other:
        fut.wait()
        z = y * 2
    other.synchronize()
    wrong += int(not np.all(z.get() == 14.0))

    # 200 concurrent awaits of work that ends at different times.
    async def many() -> int:
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]

        async def one(i: int) -> bool:
            s = streams[i % len(streams)]
            with s:
                a = cp.zeros(1024, cp.float32)
                spin_fill(a, float(i), 0.05 * (i % 7))
                got = await cudafut.record(a, stream=s)
            return bool(np.all(got.get() == float(i)))

        answers = await asyncio.gather(*(one(i) for i in range(200)))
        return answers.count(False)

    wrong += asyncio.run(many())

    # launch(): the work on the launcher's thread, the answer awaited.
    async def launched() -> bool:
        got = await cudafut.launch(lambda: cp.arange(n, dtype=cp.float32) * 2)
        return bool(np.all(got.get() == np.arange(n, dtype=np.float32) * 2))

    wrong += int(not asyncio.run(launched()))

    # Futures dropped while their work still runs: nothing freed early.
    for i in range(50):
        with stream:
            a = cp.zeros(n, cp.float32)
            spin_fill(a, float(i), 0.1)
            cudafut.record(a, stream=stream)
        del a
    gc.collect()
    stream.synchronize()

    print(f"core {_compiled.core()}: {wrong} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
