"""A cudafut.Batcher in a service class, started and closed by aiohttp's hooks.

A service whose framework starts it and shuts it down in two hooks (aiohttp's
``on_startup`` and ``on_cleanup``, Starlette's and FastAPI's ``on_startup``
and ``on_shutdown``) has no ``async with`` block to hold a Batcher open:
``await batcher.start()`` in the start-up hook and ``await batcher.aclose()``
in the shutdown hook do what entering and leaving the block would. Requests
``await batcher.submit(x)`` in between, from their own tasks; the batches'
``run_batch`` (a plain function) runs through ``cudafut.launch``, off the loop.

Run from the repository root; it serves on a free local port, sends
``--requests`` concurrent requests, checks every answer against NumPy, and
shuts the server down (``on_cleanup`` closes the Batcher)::

    python examples/service_hooks.py           # on a GPU, with CuPy
    python examples/service_hooks.py --fake    # without one: cudafut.testing's fake GPU, NumPy

``--serve PORT`` serves until interrupted instead (``POST /predict`` with
``{"x": 0.5}``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from types import ModuleType
from typing import Any

import numpy as np
from aiohttp import ClientSession, web

import cudafut

#: The length of each request's input vector.
DIM = 16


class Service:
    """The model behind the HTTP routes, with its Batcher.

    ``xp`` is the array module: ``cupy`` on a GPU, ``numpy`` under the fake
    GPU (whose values are NumPy arrays, and which does not fake CuPy)."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp
        self.weights = xp.linspace(-1, 1, DIM, dtype=xp.float32)
        # Made here, started by on_startup: the constructor needs no loop.
        self.batcher: cudafut.Batcher[Any, Any] = cudafut.Batcher(
            self.run_batch, max_batch=32, max_delay_s=0.002
        )

    def run_batch(self, items: list[Any]) -> Any:
        """One batch, on a launcher thread (a plain function: cudafut.launch)."""
        xp = self.xp
        return xp.tanh(xp.stack(items) * self.weights).sum(axis=1)  # one row per item

    async def on_startup(self, app: web.Application) -> None:
        await self.batcher.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.batcher.aclose()  # runs what is queued, waits for the batches running

    async def predict(self, request: web.Request) -> web.Response:
        x = float((await request.json())["x"])
        y = await self.batcher.submit(self.xp.full(DIM, x, dtype=self.xp.float32))
        return web.json_response({"y": float(y)})


def make_app(service: Service) -> web.Application:
    app = web.Application()
    app.router.add_post("/predict", service.predict)
    app.on_startup.append(service.on_startup)
    app.on_cleanup.append(service.on_cleanup)
    return app


def expected(x: float) -> float:
    """What /predict answers for ``x``, computed with NumPy."""
    w = np.linspace(-1, 1, DIM, dtype=np.float32)
    return float(np.tanh(np.full(DIM, x, dtype=np.float32) * w).sum())


async def check(service: Service, requests: int) -> None:
    """Serve on a free port, send ``requests`` at once, check each answer,
    then shut the server down (on_cleanup closes the Batcher)."""
    runner = web.AppRunner(make_app(service))
    await runner.setup()  # runs on_startup: the Batcher starts
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        xs = [i / requests for i in range(requests)]
        async with ClientSession() as session:

            async def ask(x: float) -> float:
                async with session.post(f"http://127.0.0.1:{port}/predict", json={"x": x}) as resp:
                    resp.raise_for_status()
                    return float((await resp.json())["y"])

            ys = await asyncio.gather(*(ask(x) for x in xs))
    finally:
        await runner.cleanup()  # runs on_cleanup: the Batcher closes
    wrong = [x for x, y in zip(xs, ys, strict=True) if not math.isclose(y, expected(x), abs_tol=1e-4)]
    stats = service.batcher.statistics()
    print(f"{requests} requests in {stats.batches} batches (mean {stats.mean_batch:.1f})")
    if wrong:
        raise SystemExit(f"wrong answers for x in {wrong[:5]}")
    try:
        await service.batcher.submit(service.xp.zeros(DIM, dtype=service.xp.float32))
    except cudafut.InvalidStateError:
        print("results checked: all; the Batcher closed with the app")
    else:
        raise SystemExit("the Batcher still ran after on_cleanup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="use cudafut.testing's fake GPU and NumPy")
    parser.add_argument(
        "--requests", type=int, default=200, help="concurrent requests to check (default 200)"
    )
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve on PORT until interrupted instead")
    args = parser.parse_args()
    if args.fake:
        import cudafut.testing

        with cudafut.testing.fake_cuda(auto_complete=True):
            run(Service(np), args)
        return
    from cudafut._cli.selfcheck import require_gpu

    require_gpu()
    import cupy

    run(Service(cupy), args)


def run(service: Service, args: argparse.Namespace) -> None:
    if args.serve is not None:
        web.run_app(make_app(service), host="127.0.0.1", port=args.serve)
    else:
        asyncio.run(check(service, args.requests))


if __name__ == "__main__":
    main()
