"""Serve a torchvision model from several processes and GPUs (docs/processes.md).

``--fronts`` front processes each run their own event loop and aiohttp
server on one port (``SO_REUSEPORT``: the kernel spreads connections), and
one GPU process per device (``--devices``; ``--gpu-procs`` for more) runs a
:class:`cudafut.Batcher` over captured CUDA graphs (``submit_future``: each
request's future is set once its batch is enqueued). Each front and GPU
process pair shares a pipe: requests go to the GPU process with the fewest
outstanding (as this front counts them), and the answers come back as
:class:`cudafut.CudaFuture`\\ s that crossed the pipe: once a batch is
enqueued (:func:`cudafut.enqueued`), not once it is done, the GPU process
sends each front one future for its requests in it (:func:`cudafut.gather`),
and the front awaits the GPU work itself, through an interprocess event; the
answer's memory stays on the GPU until the front has read it. Both kinds of
process read the pipes on their event loop as messages come, and write
each pipe at most once per loop iteration, never waiting for room.

The same HTTP interface as server.py (``POST /predict`` with ``{"i": k}``,
``GET /health``, ``GET /stats``)::

    python examples/service/multiproc.py --model resnet50 --fronts 4 --devices 0,1 --port 8080

It prints ``READY <port>`` once every GPU process has captured its graphs
and every front listens; until then ``/health`` answers 503. ``--nogpu
REFERENCE.npy`` runs the fronts alone, answering from the reference table
(the HTTP ceiling of that many fronts); ``--model toy`` runs everything
without a GPU (a NumPy model on cudafut's fake GPU, whose futures cross
processes once their work is done). If any process ends, the service stops,
saying which.

Each process freezes what its imports and warm-up left (``gc.collect()``
then ``gc.freeze()``, as server.py does; ``--no-gc-freeze`` to compare)
before it says it is ready, and with ``CUDAFUT_GC_PAUSES=FILE`` appends its
collections of 5 ms or more to ``FILE`` (pauses.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import BAD_REQUEST, BUCKETS, MODELS, image_index, missing, top_of
from pauses import record_from_env

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


def _freeze_warm_objects() -> None:
    """Move what imports and warm-up left to the collector's permanent
    generation, where full collections no longer walk it (docs/serving.md,
    "Garbage-collection pauses"). Collected first: garbage frozen would
    never be freed. Once, before serving: not per request."""
    gc.collect()
    gc.freeze()


def gpu_main(
    device: int,
    model: str,
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool = True,
) -> None:
    """A GPU process: requests ``(id, k)`` in lists from each front's pipe,
    answers ``(ids, future)`` in lists back down the same pipe (see
    :func:`_gpu_loop`). With ``freeze``, what warm-up left is frozen before
    ``ready`` is set."""
    record_from_env()
    if model == TOY:  # no GPU: the fake GPU, whose futures cross once done
        from ray_serve import Toy

        from cudafut.testing import fake_cuda

        with fake_cuda(auto_complete=True):
            asyncio.run(_gpu_loop(Toy().answer, conns, max_batch, max_delay_s, ready, freeze))
        return
    import torch
    from models import Served

    torch.cuda.set_device(device)
    served = Served(model, graphs=True)
    served.answer_on_gpu([0])
    # Each launcher thread's first model call is slow and holds the GIL in
    # part (docs/serving.md, "Cold launcher threads"): pay it before ready.
    cudafut.warm_launchers(served.answer_on_gpu, [0], device=device).result()
    asyncio.run(_gpu_loop(served.answer_on_gpu, conns, max_batch, max_delay_s, ready, freeze))


def _read_on_loop(
    loop: asyncio.AbstractEventLoop,
    conns: list[Any],
    take: Callable[[int, Any], None],
    gone: Callable[[], None],
) -> None:
    """Have the loop read the pipes: ``take(i, message)`` for each message
    from ``conns[i]``, ``gone()`` once one of them has closed. A message
    that cannot be read (unpickling it imports its futures, which can fail)
    ends the process, saying why: its requests could not be answered.

    On the loop, not on reader threads: a thread woken by the pipe must
    first win the GIL from the loop and the launcher threads (up to 5 ms a
    hand-over when they are busy), and requests would wait for it. A
    message is written in one piece where the pipe has room (see
    :class:`_Outbox`), so a readable pipe holds all of it, or nearly:
    ``recv()`` does not wait for long.
    """

    def readable(i: int, conn: Any) -> None:
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    loop.remove_reader(conn.fileno())
                    gone()
                    return
                take(i, message)
                if not conn.poll():
                    return
        except Exception:
            with _or_exit("a message between the processes could not be read"):
                raise

    for i, conn in enumerate(conns):
        loop.add_reader(conn.fileno(), readable, i, conn)


class _Outbox:
    """Messages for each pipe, written once per loop iteration (one write
    for all that the iteration produced, not one per request), and never
    waiting: what the pipe has no room for waits in a buffer until the
    loop sees the pipe writable. A blocking write could deadlock two
    processes whose pipes are both full, each waiting for the other to read.
    Pickling a message (exporting its futures) happens here, on the loop.

    ``pack``, if given, is called at the start of each write, to :meth:`put`
    what the owner gathered since the last (see :meth:`wake`): the owner's
    grouping and the write then take one loop iteration, not two."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        conns: list[Any],
        what: str,
        pack: Callable[[], None] | None = None,
    ) -> None:
        self.loop = loop
        self.what = what
        self.pack = pack
        # Writes go through a duplicate of each pipe's socket, sent without
        # waiting (MSG_DONTWAIT): reads on the pipe itself stay blocking.
        self.socks = [socket.socket(fileno=os.dup(conn.fileno())) for conn in conns]
        self.boxes: list[list[Any]] = [[] for _ in conns]
        self.unsent = [bytearray() for _ in conns]
        self.watched = [False] * len(conns)
        self.scheduled = False

    def put(self, i: int, item: Any) -> None:
        self.boxes[i].append(item)
        self.wake()

    def wake(self) -> None:
        """Write at the next loop iteration (calling ``pack`` first)."""
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self.pack is not None:
            with _or_exit(self.what):  # answers that cannot be grouped cannot be sent
                self.pack()  # its put()s find a write scheduled: this one
        self.scheduled = False
        for i, box in enumerate(self.boxes):
            if box:
                with _or_exit(self.what):
                    data = ForkingPickler.dumps(box)  # what Connection.send() writes, framed below
                box.clear()
                self.unsent[i] += struct.pack("!i", len(data)) + data
                self._write(i)

    def close(self) -> None:
        """Stop writing: drop what is unsent, close the duplicates."""
        for i, sock in enumerate(self.socks):
            if self.watched[i]:
                self.loop.remove_writer(sock.fileno())
            sock.close()

    def _write(self, i: int) -> None:
        buf = self.unsent[i]
        try:
            sent = self.socks[i].send(buf, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:  # the peer has gone: main() stops the service
            buf.clear()
            sent = 0
        del buf[:sent]
        fd = self.socks[i].fileno()
        if buf and not self.watched[i]:
            self.watched[i] = True
            self.loop.add_writer(fd, self._write, i)
        elif not buf and self.watched[i]:
            self.watched[i] = False
            self.loop.remove_writer(fd)


async def _gpu_loop(
    run_batch: Callable[[list[int]], Any],
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool = True,
) -> None:
    """Requests ``(id, k)`` in lists from each front's pipe; answers back
    down the same pipe, in lists of ``(ids, future)``: one future per batch
    and front (:func:`cudafut.gather` of the batch's futures for that
    front), so a batch crosses to each front once, not once per request."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    answers: list[list[tuple[int, Any]]] = [[] for _ in conns]

    def group() -> None:
        # The outbox's pack hook: once per loop iteration, after the
        # iteration's futures were set, just before the write: those of one
        # front are sent as one gathered future, exported when the outbox
        # pickles it (its value's rows, one event per batch). Nearly always
        # one batch; where two batches were set in the same iteration, their
        # requests wait for both, and GPU work failing after it was enqueued
        # (a broken context, which fails every batch anyway) fails both. A
        # batch that failed before it was enqueued (run_batch raised) is
        # sent apart.
        for i, done in enumerate(answers):
            if not done:
                continue
            ok = []
            for rid, fut in done:
                if _failed(fut):  # sent alone: the others must not fail with it
                    outbox.put(i, ([rid], fut))
                else:
                    ok.append((rid, fut))
            if ok:
                outbox.put(i, ([rid for rid, _ in ok], cudafut.gather(*(fut for _, fut in ok))))
            done.clear()

    outbox = _Outbox(loop, conns, "a GPU process could not send answers", pack=group)

    async def answer(i: int, msgs: list[tuple[int, int]]) -> None:
        futs = []
        for rid, k in msgs:
            try:
                fut = batcher.submit_future(k)
            except Exception as exc:  # noqa: BLE001 - the front gets it, as a failed future
                fut = cudafut.CudaFuture()
                fut.set_exception(exc)
            futs.append((rid, fut))
        for rid, fut in futs:
            await cudafut.enqueued(fut)  # set once its batch is enqueued, not done
            answers[i].append((rid, fut))
            outbox.wake()  # group() runs just before the write

    tasks: set[asyncio.Task[None]] = set()

    def take(i: int, msgs: list[tuple[int, int]]) -> None:
        task = loop.create_task(answer(i, msgs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    batcher: cudafut.Batcher[int, Any] = cudafut.Batcher(
        run_batch, max_batch=max_batch, max_delay_s=max_delay_s, buckets=BUCKETS
    )
    async with batcher:
        _read_on_loop(loop, conns, take, stopped.set)  # a front that has gone stops this process
        if freeze:  # the model, its graphs, the batcher and the launchers live as long as this process
            _freeze_warm_objects()
        ready.set()
        await stopped.wait()


def _failed(fut: cudafut.CudaFuture[Any]) -> bool:
    """Whether a future failed or was cancelled (non-blocking: ``done()``
    queries its events, and ``exception()`` then has nothing to wait for)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


def front_main(
    port: int,
    conns: list[Any],
    reference: str | None,
    warm: list[int],
    ready: Any,
    serving: Any,
    freeze: bool = True,
) -> None:
    """A front process: HTTP on ``port`` (shared), requests to the GPU
    processes. ``/health`` answers 503 until ``serving`` is set (every
    process of the service ready): a front listens before the GPU processes
    have captured their graphs, and a load balancer must not send it
    requests meanwhile. With ``freeze``, what its imports and warm-up left
    (PyTorch's, where it receives GPU futures) is frozen before ``ready``."""
    record_from_env()
    try:
        from aiohttp import web
    except ImportError as exc:  # one line that says what to install, not a traceback
        sys.exit(missing("multiproc.py", "aiohttp", exc))
    import numpy as np

    app = web.Application()
    loop_ref: list[asyncio.AbstractEventLoop] = []
    outbox: list[_Outbox] = []
    outstanding = [0] * len(conns)
    waiting: dict[int, asyncio.Future[Any]] = {}
    ids = itertools.count()
    counts = {"requests": 0}
    answers = None if reference is None else [top_of(row) for row in np.load(reference)]

    def deliver(g: int, items: list[tuple[list[int], Any]]) -> None:
        # Unpickling the message (importing its futures: one a batch) ran
        # just before, on this loop.
        for rids, fut in items:
            outstanding[g] -= len(rids)
            for j, rid in enumerate(rids):
                waiter = waiting.pop(rid, None)
                if waiter is not None and not waiter.done():  # its handler may have timed out
                    waiter.set_result((fut, j))

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
        outbox[0].put(g, (rid, k))
        try:  # a GPU process that fails must not leave the client waiting for ever
            shared, j = await asyncio.wait_for(waiter, ANSWER_TIMEOUT_S)  # the batch is enqueued
        except TimeoutError:
            raise web.HTTPGatewayTimeout(
                text=f"no answer from the GPU process in {ANSWER_TIMEOUT_S} s"
            ) from None
        finally:
            waiting.pop(rid, None)
        # The GPU work (of this front's part of the batch): a producer that
        # dies fails this wait (cudafut.SharingError); work that never ends
        # while it lives (a hung kernel) answers 504, not never.
        try:
            rows = await asyncio.wait_for(shared, ANSWER_TIMEOUT_S)
        except TimeoutError:
            raise web.HTTPGatewayTimeout(
                text=f"the GPU work did not complete in {ANSWER_TIMEOUT_S} s"
            ) from None
        return web.json_response({"top": rows[j].tolist()})

    up = [False]

    async def health(request: web.Request) -> web.Response:
        if not up[0]:
            up[0] = serving.is_set()  # a lock of multiprocessing's: asked until set
            if not up[0]:
                return web.Response(status=503, text="starting")
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**counts, "pid": os.getpid(), "gc_frozen": gc.get_freeze_count()})

    if answers is None and warm:
        # The first future received from each device would otherwise import
        # PyTorch and make this process's CUDA context on that device on the
        # loop (a second or more each, and the driver makes the contexts of
        # many processes one after another): make them all before serving.
        import cupy  # received futures use CuPy's runtime: imported once, here
        import torch

        for device in warm:
            torch.zeros(1, device=f"cuda:{device}")
        del cupy

    async def started(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        loop_ref.append(loop)
        outbox.append(_Outbox(loop, conns, "a front process could not send requests"))
        # A GPU process that has gone: main() stops the whole service.
        _read_on_loop(loop, conns, deliver, lambda: None)

    app.on_startup.append(started)
    app.add_routes([web.post("/predict", predict), web.get("/health", health), web.get("/stats", stats)])

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True)
        await site.start()
        if freeze:
            _freeze_warm_objects()
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
    parser.add_argument("--devices", default="0", help="GPUs, e.g. 0,1")
    parser.add_argument(
        "--gpu-procs",
        type=int,
        default=1,
        help="GPU processes per device (each its own GIL, Batcher and graphs; the GPU time-slices them)",
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--nogpu", metavar="REFERENCE", help="answer from this reference table, no GPU")
    parser.add_argument("--reference", help="ignored (compare.py passes it to every server)")
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="do not freeze what each process's imports and warm-up left (gc.freeze()): to compare",
    )
    args = parser.parse_args(argv)
    if args.fronts < 1:
        parser.error("--fronts must be at least 1")
    if args.gpu_procs < 1:
        parser.error("--gpu-procs must be at least 1")
    devices = [] if args.nogpu else [int(d) for d in args.devices.split(",")] * args.gpu_procs
    ctx = mp.get_context("spawn")  # CUDA does not survive fork()
    serving = ctx.Event()
    pipes = [[ctx.Pipe() for _ in devices] for _ in range(args.fronts)]
    children: list[Any] = []
    readies = []
    for g, device in enumerate(devices):
        ready = ctx.Event()
        conns = [pipes[f][g][1] for f in range(args.fronts)]
        children.append(
            ctx.Process(
                target=gpu_main,
                args=(
                    device,
                    args.model,
                    conns,
                    args.max_batch,
                    args.max_delay_ms / 1e3,
                    ready,
                    not args.no_gc_freeze,
                ),
                name=f"gpu{g}-device{device}",
            )
        )
        readies.append(ready)
    warm = [] if args.nogpu is not None or args.model == TOY else sorted(set(devices))
    for f in range(args.fronts):
        ready = ctx.Event()
        conns = [pipes[f][g][0] for g in range(len(devices))]
        children.append(
            ctx.Process(
                target=front_main,
                args=(args.port, conns, args.nogpu, warm, ready, serving, not args.no_gc_freeze),
                name=f"front-{f}",
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
    serving.set()
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
