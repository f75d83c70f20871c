"""A worker for tests/test_cores.py: runs sequences of operations on
cudafut's fake GPU and prints what a user would observe, one JSON line per
sequence. Started twice, with and without ``CUDAFUT_PURE=1``: the native
and the pure core must print the same lines.

Input, one JSON line per sequence: a list of ``[op, a, b]`` (see ``run``).
"""

# The lambdas below are called at once, inside their loop step (_outcome).
# ruff: noqa: B023

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

import cudafut
from cudafut import _compiled, testing


def _outcome(call: Any) -> str:
    try:
        value = call()
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return f"raised {type(exc).__name__}: {exc}"
    if isinstance(value, np.ndarray):
        return f"array {value.tolist()}"
    if isinstance(value, cudafut.CudaFuture):
        return "future"
    return f"value {value!r}"


def _state(fut: cudafut.CudaFuture[Any]) -> str:
    return f"done={fut.done()} cancelled={fut.cancelled()}"


def run(ops: list[list[Any]]) -> list[str]:
    seen: list[str] = []
    futs: list[cudafut.CudaFuture[Any]] = []
    # Done callbacks run on the watcher thread, at no fixed point of the
    # sequence: counted, and compared once all have run.
    called: list[int] = []
    registered: list[cudafut.CudaFuture[Any]] = []

    def pick(i: int) -> cudafut.CudaFuture[Any] | None:
        return futs[i % len(futs)] if futs else None

    def plus_one(x: Any) -> Any:
        return x + 1

    def boom(x: Any) -> Any:
        raise ValueError("from a callback")

    with testing.fake_cuda(hint_after_s=None) as fake:
        for op, a, b in ops:
            fut = pick(a)
            if op == "new":
                futs.append(cudafut.CudaFuture(devices=0))
                seen.append("new")
            elif op == "record":
                seen.append(_outcome(lambda: futs.append(cudafut.record(np.full(2, a)))))
            elif op == "set" and fut is not None:
                seen.append(_outcome(lambda: fut.set_result(np.full(2, b))))
            elif op == "fail" and fut is not None:
                seen.append(_outcome(lambda: fut.set_exception(KeyError(b))))
            elif op == "cancel" and fut is not None:
                seen.append(_outcome(fut.cancel))
            elif op == "then" and fut is not None:
                fn = plus_one if b % 3 else boom
                seen.append(_outcome(lambda: futs.append(fut.then(fn))))
            elif op == "gather" and fut is not None:
                other = pick(b) or fut  # futs is not empty here
                seen.append(_outcome(lambda: futs.append(cudafut.gather(fut, other))))
            elif op == "callback" and fut is not None:
                seen.append(_outcome(lambda: fut.add_done_callback(lambda f: called.append(1))))
                registered.append(fut)
            elif op == "complete":
                fake.complete_all()
                seen.append("completed")
            elif op == "result" and fut is not None:
                seen.append(_outcome(lambda: fut.result(timeout=0)))
                seen.append(_state(fut))
            elif op == "await" and fut is not None:

                async def wait(f: cudafut.CudaFuture[Any] = fut) -> Any:
                    return await asyncio.wait_for(f, 0.05)

                seen.append(_outcome(lambda: asyncio.run(wait())))
            elif op == "state" and fut is not None:
                seen.append(_state(fut))
        fake.complete_all()
        seen.extend(_state(f) for f in futs)
        due = sum(f.done() for f in registered)  # a never-set future runs none
        deadline = time.monotonic() + 10
        while len(called) < due and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(f"callbacks run: {len(called)}, due {due} of {len(registered)}")
    return seen


def main() -> None:
    print(json.dumps({"core": _compiled.core()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
