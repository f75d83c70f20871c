"""An aiohttp inference service, written four ways (``--mode``).

``POST /infer`` with ``{"x": [DIM floats]}`` answers ``{"y": [OUT floats]}``,
the model's output (model.py); ``GET /health`` answers at once, if the event
loop is free to answer; ``GET /stats`` says how many requests and batches ran.

- ``batched``: the handler hands its input to a :class:`batcher.Batcher`; the
  batcher forms batches (up to ``--max-batch`` requests, or whatever arrived
  ``--max-delay-ms`` after the first) and runs each with **one**
  ``cudafut.submit(model.forward, batch)``, copied back with
  ``cudafut.to_host`` and awaited; each request gets its row.
- ``unbatched``: each handler does ``await cudafut.to_host(cudafut.submit(...))``
  for its own input: the loop is never blocked, but the GPU runs one small
  launch per request.
- ``sync``: the way it is usually written first: launch, then
  ``stream.synchronize()`` in the handler. Correct, but the event loop is
  blocked while the GPU works: every other request, ``/health`` included,
  waits.
- ``executor``: the same synchronising call in ``loop.run_in_executor``: the
  loop is free, at the cost of a thread per request in flight.

Run it (from the repository root, on a machine with a GPU)::

    python examples/service/server.py --mode batched --port 8080

and load it with ``load.py``, or compare all four with ``compare.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))  # batcher, model: next to this file

from batcher import Batcher, describe
from model import DIM, Model

import cudafut

MODES = ("batched", "unbatched", "sync", "executor")
Handler = Callable[[np.ndarray[Any, Any]], Awaitable[list[float]]]


async def read_input(request: web.Request) -> np.ndarray[Any, Any]:
    body = await request.json()
    x = np.asarray(body["x"], dtype=np.float32)
    if x.shape != (DIM,):
        raise web.HTTPBadRequest(text=f"x must hold {DIM} numbers")
    return x


def make_app(mode: str, model: Model, *, max_batch: int, max_delay_s: float, threads: int) -> web.Application:
    app = web.Application()
    counts = {"requests": 0}
    batcher_stats: list[Any] = []

    if mode == "batched":

        async def run_batch(xs: list[np.ndarray[Any, Any]]) -> list[list[float]]:
            # One launch for the whole batch; the loop serves others while the GPU runs it.
            fut = cudafut.submit(model.forward, np.stack(xs))
            out = await cudafut.to_host(fut)
            rows: list[list[float]] = out.tolist()
            return rows

        batcher: Batcher[np.ndarray[Any, Any], list[float]] = Batcher(
            run_batch, max_batch=max_batch, max_delay_s=max_delay_s
        )
        batcher_stats.append(batcher.stats)

        async def batcher_running(app: web.Application) -> AsyncIterator[None]:
            async with batcher:
                yield

        app.cleanup_ctx.append(batcher_running)
        compute: Handler = batcher.submit

    elif mode == "unbatched":

        async def compute(x: np.ndarray[Any, Any]) -> list[float]:
            out = await cudafut.to_host(cudafut.submit(model.forward, x[None]))
            row: list[float] = out[0].tolist()
            return row

    elif mode == "sync":
        stream = model.cp.cuda.Stream(non_blocking=True)

        async def compute(x: np.ndarray[Any, Any]) -> list[float]:
            with stream:
                y = model.forward(x[None])
            stream.synchronize()  # blocks the event loop until the GPU is done
            row: list[float] = y.get(stream=stream)[0].tolist()
            return row

    elif mode == "executor":
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="infer")
        local = threading.local()

        def forward_blocking(x: np.ndarray[Any, Any]) -> list[float]:
            if not hasattr(local, "stream"):  # one stream per worker thread
                local.stream = model.cp.cuda.Stream(non_blocking=True)
            with local.stream:
                y = model.forward(x[None])
            local.stream.synchronize()  # blocks this worker thread only
            row: list[float] = y.get(stream=local.stream)[0].tolist()
            return row

        async def compute(x: np.ndarray[Any, Any]) -> list[float]:
            return await asyncio.get_running_loop().run_in_executor(pool, forward_blocking, x)

        async def pool_running(app: web.Application) -> AsyncIterator[None]:
            yield
            pool.shutdown(wait=True)

        app.cleanup_ctx.append(pool_running)
    else:
        raise ValueError(f"unknown mode {mode!r}: choose one of {MODES}")

    async def infer(request: web.Request) -> web.Response:
        y = await compute(await read_input(request))
        counts["requests"] += 1
        return web.json_response({"y": y})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats(request: web.Request) -> web.Response:
        if batcher_stats:
            batches = describe(batcher_stats[0])
        else:  # one launch per request
            batches = {"batches": counts["requests"], "items": counts["requests"], "mean_batch": 1.0}
        return web.json_response({"mode": mode, "requests": counts["requests"], **batches})

    app.router.add_post("/infer", infer)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="batched")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--fixed-us", type=float, default=2000.0, help="GPU time of a launch, µs")
    parser.add_argument("--per-item-us", type=float, default=10.0, help="GPU time per request, µs")
    parser.add_argument("--max-batch", type=int, default=64, help="batched: the largest batch")
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="batched: the longest wait for more")
    parser.add_argument("--threads", type=int, default=8, help="executor: worker threads")
    args = parser.parse_args()

    model = Model(args.fixed_us, args.per_item_us)
    model.warm_up(args.max_batch)
    cudafut.to_host(cudafut.submit(model.forward, np.zeros((1, DIM), np.float32))).result(timeout=60)
    app = make_app(
        args.mode, model, max_batch=args.max_batch, max_delay_s=args.max_delay_ms / 1e3, threads=args.threads
    )
    print(f"serving {args.mode} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
