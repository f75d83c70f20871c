"""Serve a torchvision model from several processes and GPUs (docs/processes.md).

``--fronts`` front processes each run their own event loop and aiohttp
server on one port (``SO_REUSEPORT``: the kernel spreads connections), and
one GPU process per device (``--devices``) runs a :class:`cudafut.Batcher`
over captured CUDA graphs (``submit_future``: each request's future is set
once its batch is enqueued). Each front and GPU process pair shares a pipe:
requests go to the GPU process with the fewest outstanding (as this front
counts them), and the answers come back as :class:`cudafut.CudaFuture`\\ s
that crossed the pipe: the GPU process sends each future once its batch is
enqueued (:func:`cudafut.enqueued`), not once it is done, and the front
awaits the GPU work itself, through an interprocess event; the answer's
memory stays on the GPU until the front has read it.

The same HTTP interface as server.py (``POST /predict`` with ``{"i": k}``,
``GET /health``, ``GET /stats``)::

    python examples/service/multiproc.py --model resnet50 --fronts 4 --devices 0,1 --port 8080

It prints ``READY <port>`` once every GPU process has captured its graphs
and every front listens. ``--nogpu REFERENCE.npy`` runs the fronts alone,
answering from the reference table (the HTTP ceiling of that many fronts);
``--model toy`` runs everything without a GPU (a NumPy model on cudafut's
fake GPU, whose futures cross processes once their work is done). If any
process ends, the service stops, saying which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import BAD_REQUEST, BUCKETS, MODELS, image_index, missing, top_of

import cudafut

#: ``--model toy``: ray_serve.py's NumPy model under cudafut's fake GPU.
TOY = "toy"
#: How long a front waits for a GPU process to take a request and enqueue it.
ANSWER_TIMEOUT_S = 30.0


@contextlib.contextmanager
def _or_exit(what: str) -> Iterator[None]:
    """End this process, saying why, if the block fails: requests that can
    no longer be answered must not wait for ever (the parent sees the exit)."""
    try:
        yield
    except EOFError:
        raise
    except BaseException:  # noqa: BLE001 - whatever it was, this process cannot go on
        traceback.print_exc()
        print(f"multiproc.py: {what}; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def gpu_main(
    device: int, model: str, conns: list[Any], max_batch: int, max_delay_s: float, ready: Any
) -> None:
    """A GPU process: requests ``(id, k)`` in lists from each front's pipe,
    answers ``(id, future)`` in lists back down the same pipe."""
    if model == TOY:  # no GPU: the fake GPU, whose futures cross once done
        from ray_serve import Toy

        from cudafut.testing import fake_cuda

        with fake_cuda(auto_complete=True):
            asyncio.run(_gpu_loop(Toy().answer, conns, max_batch, max_delay_s, ready))
        return
    import torch
    from models import Served

    torch.cuda.set_device(device)
    served = Served(model, graphs=True)
    served.answer_on_gpu([0])
    # Each launcher thread's first model call is slow and holds the GIL in
    # part (docs/serving.md, "Cold launcher threads"): pay it before ready.
    cudafut.warm_launchers(served.answer_on_gpu, [0], device=device).result()
    asyncio.run(_gpu_loop(served.answer_on_gpu, conns, max_batch, max_delay_s, ready))


async def _gpu_loop(
    run_batch: Callable[[list[int]], Any], conns: list[Any], max_batch: int, max_delay_s: float, ready: Any
) -> None:
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    # One sender thread per front: pickling a future (exporting it) and the
    # pipe's write happen there, off the loop.
    outboxes: list[list[tuple[int, Any]]] = [[] for _ in conns]
    wakes = [threading.Event() for _ in conns]

    def sender(i: int) -> None:
        conn, box, wake = conns[i], outboxes[i], wakes[i]
        while True:
            wake.wait()
            wake.clear()
            batch = box[:]
            del box[: len(batch)]
            if batch:
                with _or_exit("a GPU process could not send answers"):
                    conn.send(batch)

    async def answer(i: int, rid: int, fut: Any) -> None:
        await cudafut.enqueued(fut)
        outboxes[i].append((rid, fut))
        wakes[i].set()

    def receiver(i: int) -> None:
        conn = conns[i]
        while True:
            try:
                msgs = conn.recv()
            except EOFError:
                msgs = None
            if msgs is None:
                loop.call_soon_threadsafe(stopped.set)
                return
            loop.call_soon_threadsafe(submit, i, msgs)

    tasks: set[asyncio.Task[None]] = set()

    def submit(i: int, msgs: list[tuple[int, int]]) -> None:
        for rid, k in msgs:
            try:
                fut = batcher.submit_future(k)
            except Exception as exc:  # noqa: BLE001 - the front gets it, as a failed future
                fut = cudafut.CudaFuture()
                fut.set_exception(exc)
            task = loop.create_task(answer(i, rid, fut))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    batcher: cudafut.Batcher[int, Any] = cudafut.Batcher(
        run_batch, max_batch=max_batch, max_delay_s=max_delay_s, buckets=BUCKETS
    )
    async with batcher:
        for i in range(len(conns)):
            threading.Thread(target=sender, args=(i,), daemon=True, name=f"sender-{i}").start()
            threading.Thread(target=receiver, args=(i,), daemon=True, name=f"receiver-{i}").start()
        ready.set()
        await stopped.wait()


def front_main(port: int, conns: list[Any], reference: str | None, warm_cuda: bool, ready: Any) -> None:
    """A front process: HTTP on ``port`` (shared), requests to the GPU processes."""
    try:
        from aiohttp import web
    except ImportError as exc:  # one line that says what to install, not a traceback
        sys.exit(missing("multiproc.py", "aiohttp", exc))
    import numpy as np

    app = web.Application()
    loop_ref: list[asyncio.AbstractEventLoop] = []
    outstanding = [0] * len(conns)
    waiting: dict[int, asyncio.Future[Any]] = {}
    ids = itertools.count()
    counts = {"requests": 0}
    answers = None if reference is None else [top_of(row) for row in np.load(reference)]

    def deliver(g: int, batch: list[tuple[int, Any]]) -> None:
        outstanding[g] -= len(batch)
        for rid, fut in batch:
            waiter = waiting.pop(rid, None)
            if waiter is not None and not waiter.done():  # its handler may have timed out
                waiter.set_result(fut)

    def receiver(g: int) -> None:
        # Unpickling (importing the futures) happens here, off the loop.
        while True:
            try:
                with _or_exit("a front process could not receive answers"):
                    batch = conns[g].recv()
            except EOFError:
                return
            loop_ref[0].call_soon_threadsafe(deliver, g, batch)

    async def predict(request: web.Request) -> web.Response:
        k = image_index(await request.json())
        if k is None:
            raise web.HTTPBadRequest(text=BAD_REQUEST)
        counts["requests"] += 1
        if answers is not None:
            return web.json_response({"top": answers[k]})
        g = min(range(len(conns)), key=outstanding.__getitem__)
        outstanding[g] += 1
        rid = next(ids)
        waiter: asyncio.Future[Any] = loop_ref[0].create_future()
        waiting[rid] = waiter
        conns[g].send([(rid, k)])
        try:  # a GPU process that fails must not leave the client waiting for ever
            shared = await asyncio.wait_for(waiter, ANSWER_TIMEOUT_S)  # the batch is enqueued
        except TimeoutError:
            raise web.HTTPGatewayTimeout(
                text=f"no answer from the GPU process in {ANSWER_TIMEOUT_S} s"
            ) from None
        finally:
            waiting.pop(rid, None)
        # The GPU work: a producer that dies fails this wait (cudafut.SharingError).
        row = await shared
        return web.json_response({"top": row.tolist()})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**counts, "pid": os.getpid()})

    if answers is None and warm_cuda:
        # The first received future would otherwise import PyTorch and make
        # this process's CUDA context on a receiver thread, with the GIL held
        # for seconds in part: do it before serving.
        import torch

        torch.zeros(1, device="cuda")

    async def started(app: web.Application) -> None:
        loop_ref.append(asyncio.get_running_loop())
        for g in range(len(conns)):
            threading.Thread(target=receiver, args=(g,), daemon=True).start()

    app.on_startup.append(started)
    app.add_routes([web.post("/predict", predict), web.get("/health", health), web.get("/stats", stats)])

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True)
        await site.start()
        ready.set()
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=(*MODELS, TOY),
        default="resnet50",
        help="toy: NumPy on the fake GPU, no GPU needed",
    )
    parser.add_argument("--fronts", type=int, default=4, help="front (HTTP) processes")
    parser.add_argument("--devices", default="0", help="GPUs, one GPU process each: e.g. 0,1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--nogpu", metavar="REFERENCE", help="answer from this reference table, no GPU")
    parser.add_argument("--reference", help="ignored (compare.py passes it to every server)")
    args = parser.parse_args(argv)
    if args.fronts < 1:
        parser.error("--fronts must be at least 1")
    devices = [] if args.nogpu else [int(d) for d in args.devices.split(",")]
    ctx = mp.get_context("spawn")  # CUDA does not survive fork()
    pipes = [[ctx.Pipe() for _ in devices] for _ in range(args.fronts)]
    children: list[Any] = []
    readies = []
    for g, device in enumerate(devices):
        ready = ctx.Event()
        conns = [pipes[f][g][1] for f in range(args.fronts)]
        children.append(
            ctx.Process(
                target=gpu_main,
                args=(device, args.model, conns, args.max_batch, args.max_delay_ms / 1e3, ready),
                name=f"gpu-{device}",
            )
        )
        readies.append(ready)
    for f in range(args.fronts):
        ready = ctx.Event()
        conns = [pipes[f][g][0] for g in range(len(devices))]
        warm = args.nogpu is None and args.model != TOY
        children.append(
            ctx.Process(
                target=front_main, args=(args.port, conns, args.nogpu, warm, ready), name=f"front-{f}"
            )
        )
        readies.append(ready)
    for child in children:
        child.start()
    # Only the children hold the pipes now: a process that ends closes its
    # ends, and its peers see it (EOF) instead of waiting for ever.
    for row in pipes:
        for ends in row:
            ends[0].close()
            ends[1].close()
    for ready, child in zip(readies, children, strict=True):
        while not ready.wait(1.0):
            if not child.is_alive():
                for other in children:
                    other.terminate()
                sys.exit(f"multiproc.py: {child.name} exited with {child.exitcode} before it was ready")
    print(f"READY {args.port}", flush=True)

    def stop(*_: object) -> None:
        for child in children:
            child.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The first child to end ends the service: requests must not wait for a
    # process that is gone.
    mp.connection.wait([child.sentinel for child in children])
    gone = [child for child in children if not child.is_alive()]
    for child in children:
        child.terminate()
    sys.exit(f"multiproc.py: {gone[0].name} exited with {gone[0].exitcode}; stopped the service")


if __name__ == "__main__":
    main()
