"""Python work per cudafut operation, counted on a fake GPU (no GPU needed).

``python -m benchmarks.calls`` runs each operation under
:func:`cudafut.testing.fake_cuda` and counts, per operation:

- ``cudafut calls``: Python function calls whose code is in the cudafut
  package (the fake's own, in ``cudafut/testing.py``, apart: they stand
  for CUDA's calls);
- ``all calls``: every Python function call, asyncio's included, and
  ``c calls``: calls of C functions (builtins, methods of C types);
- ``gc objects``: for concurrent awaits, the objects the cyclic garbage
  collector tracks, alive per pending await (what a collection walks; the
  fake's events, which stand for the driver's, left out);

next to the same operation done with plain asyncio futures. The counts are
deterministic: the same code on the same Python gives the same numbers, so
they show what a change to the hot path saves without a GPU, where timings
need one (``python -m cudafut bench --only host --only many``).

What the fake changes: its values are NumPy arrays, which cudafut walks as
it walks containers (a real CuPy array is one type check), and its CUDA
calls are Python functions (counted apart). So the counts model the
library's own Python, not CUDA's cost. Options: ``--json PATH`` writes the
counts; ``-n`` sets how many concurrent awaits (default 1,000).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

import cudafut
from cudafut import testing

PACKAGE = str(Path(cudafut.__file__).resolve().parent)
FAKE = str(Path(testing.__file__).resolve())


class Counter:
    """Counts the calls made while it is installed (``sys.setprofile``, the
    calling thread only)."""

    def __init__(self) -> None:
        self.cudafut = 0
        self.fake = 0
        self.python = 0
        self.c = 0

    def __call__(self, frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            self.python += 1
            filename = frame.f_code.co_filename
            if filename == FAKE:
                self.fake += 1
            elif filename.startswith(PACKAGE):
                self.cudafut += 1
        elif event == "c_call":
            self.c += 1

    def per(self, n: int) -> dict[str, float]:
        return {
            "cudafut calls": round(self.cudafut / n, 2),
            "fake CUDA calls": round(self.fake / n, 2),
            "all calls": round(self.python / n, 2),
            "c calls": round(self.c / n, 2),
        }


@contextmanager
def counting() -> Iterator[Counter]:
    counter = Counter()
    sys.setprofile(counter)
    try:
        yield counter
    finally:
        sys.setprofile(None)


def _per_call(op: Callable[[], object], n: int) -> dict[str, float]:
    op()  # warm: pools, first-use imports
    with counting() as c:
        for _ in range(n):
            op()
    return c.per(n)


def _per_await(make: Callable[[], Coroutine[Any, Any, object]], n: int) -> dict[str, float]:
    async def main() -> dict[str, float]:
        await make()
        with counting() as c:
            for _ in range(n):
                await make()
        return c.per(n)

    return asyncio.run(main())


def _concurrent(
    fake: testing.FakeCuda, n: int, gpu: bool, make_value: Callable[[], Any], stream: Any
) -> dict[str, float]:
    """``n`` tasks, each awaiting a future pending until all are started,
    then completed at once: calls per future (start to finish), and GC
    objects alive per pending await."""

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        plain: list[asyncio.Future[None]] = []
        value = make_value()

        async def one_gpu() -> None:
            await cudafut.record(value, stream=stream)

        async def one_plain() -> None:
            fut = loop.create_future()
            plain.append(fut)
            await fut

        one = one_gpu if gpu else one_plain
        warm = asyncio.ensure_future(one())
        await asyncio.sleep(0)
        fake.complete_all()
        for fut in plain:
            fut.set_result(None)
        await warm
        plain.clear()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            with counting() as c:
                tasks = [asyncio.ensure_future(one()) for _ in range(n)]
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                pending = len(gc.get_objects()) - before - _fake_driver_objects()
                fake.complete_all()
                for fut in plain:
                    fut.set_result(None)
                await asyncio.gather(*tasks)
        finally:
            gc.enable()
        out = c.per(n)
        # The tasks themselves, their coroutines and frames are asyncio's and
        # the same on both sides; what differs is what each await adds.
        out["gc objects per pending await"] = round(pending / n, 2)
        return out

    return asyncio.run(main())


def _fake_driver_objects() -> int:
    """The fake GPU's events and their dependency tuples alive: what CUDA
    keeps in the driver, not in Python objects, so left out of the count."""
    count = 0
    for obj in gc.get_objects():
        if type(obj) is testing._Event:
            count += 1 + bool(obj.deps)
    return count


def measure(n: int = 1000) -> dict[str, Any]:
    """Every count (see the module's docstring), for ``n`` repetitions."""
    out: dict[str, Any] = {
        "meta": {"python": platform.python_version(), "cudafut": cudafut.__version__, "n": n},
    }
    with testing.fake_cuda() as fake:
        fake.auto_complete = True
        stream = fake.stream()  # as a cupy.cuda.Stream would be
        x = np.zeros(4, dtype=np.float32)
        done = cudafut.record(x, stream=stream)
        done.result()
        loop_free: dict[str, Any] = {
            "record(x, stream=s)": _per_call(lambda: cudafut.record(x, stream=stream), n),
            "result() of done work": _per_call(done.result, n),
            "then() per link, on done work": _per_call(lambda: done.then(_same), n),
        }

        async def await_done() -> object:
            return await done

        async def await_plain() -> object:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return await fut

        loop_free["await of done work"] = _per_await(await_done, n)
        loop_free["peer: asyncio future create + set + await"] = _per_await(await_plain, n)
        out["single"] = loop_free
        fake.auto_complete = False
        out["concurrent"] = {
            "cudafut await (record on a stream, completed in bulk)": _concurrent(
                fake, n, True, lambda: x, stream
            ),
            "peer: plain asyncio futures, set in bulk": _concurrent(fake, n, False, lambda: x, stream),
        }
    return out


def _same(value: object) -> object:
    return value


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        "# Python work per operation, on a fake GPU",
        "",
        f"Python {result['meta']['python']}, cudafut {result['meta']['cudafut']}, "
        f"{result['meta']['n']:,} repetitions (`python -m benchmarks.calls`).",
        "",
    ]
    for title, key in (("One operation at a time", "single"), ("Concurrent awaits", "concurrent")):
        rows = result[key]
        cols = list(next(iter(rows.values())))
        header = "| operation | " + " | ".join(cols) + " |"
        lines += [f"## {title}", "", header, "|---" * (len(cols) + 1) + "|"]
        for name, counts in rows.items():
            lines.append(f"| {name} | " + " | ".join(f"{counts[c]:g}" for c in cols) + " |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="repetitions (default 1,000)")
    parser.add_argument("--json", type=Path, help="write the counts to this file")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("-n must be at least 1")
    result = measure(args.n)
    print("\n".join(markdown(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
