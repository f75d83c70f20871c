"""An aiohttp inference service for a torchvision model, written the ways people write it (``--mode``).

``POST /predict`` with ``{"i": k}`` answers ``{"top": [5 logits, then their
5 classes]}`` for bank image ``k`` (models.py); ``GET /health`` answers at
once, if the event loop is free to answer; ``GET /stats`` says what the
batcher did. The modes, from the first thing people write to cudafut's
answer:

- ``nogpu``: answers from the reference table without the GPU: the harness's
  own ceiling (HTTP, JSON, the load generator).
- ``sync``: ``answer()`` then ``stream.synchronize()`` in the handler: the
  loop is blocked for the model's launch *and* its GPU time.
- ``executor``: the same in ``loop.run_in_executor`` (8 threads, a stream each).
- ``await``: ``answer()`` on a leased stream, then ``await cudafut.record()``:
  waiting is free, but the launch (4-8 ms of PyTorch dispatch for a
  ResNet-50) still runs on the loop.
- ``launch``: ``await cudafut.launch(answer, [k])``: the launch runs on a
  launcher thread, the loop only waits.
- ``launch_graph``: the same, replaying a captured CUDA graph (batch 1).
- ``batch``: ``await batcher.submit(k)``, a :class:`cudafut.Batcher` whose
  ``run_batch`` is ``answer`` (so it runs through ``launch``).
- ``batch_graph``: the same with buckets, one captured graph per bucket.
- ``batch_floor``: the floor beside ``batch_graph``: the same batching
  rule (``Batcher``'s defaults) and graph replays written by hand, with no
  cudafut on the loop: a deque, one batch-forming task, two worker threads
  that replay, ``synchronize()`` and wake the loop with
  ``call_soon_threadsafe``. What ``batch_graph`` would cost without
  cudafut's futures, launchers and waiter.

Run it (from the repository root, on a machine with a GPU and torchvision;
``pip install -e '.[service]'`` installs aiohttp and the rest)::

    python examples/service/server.py --model resnet50 --mode batch_graph --port 8080

``--wait-policy`` picks how the loop's waiter polls (a preset of
:func:`cudafut.set_wait_policy`, or ``polls`` for timed polls without CUDA
notices), to see
what the waiter's spins cost a loop that also serves HTTP (the modes that
await a launch; a ``Batcher``'s batches are waited for by its completion
thread, which the policy does not steer).
``--max-batch`` and ``--max-in-flight`` size the batch modes' pipeline
(default: the ``Batcher``'s, the largest bucket and 4; docs/serving.md,
``Batcher``).

It prints ``READY <port>`` once the model is warm (and, in the modes that
launch, each launcher thread has run it once: :func:`cudafut.warm_launchers`);
load it with load.py, or
compare the modes (and LitServe) with compare.py.

Before ``READY`` it also moves every object left by imports, model load and
warm-up to the collector's permanent generation (``gc.collect()`` then
``gc.freeze()``): a full collection then no longer walks them, which took
over 100 ms a time with PyTorch loaded (docs/serving.md, "Garbage-collection
pauses"). ``--no-gc-freeze`` leaves them, for comparison. ``GET
/stats?objects=10`` adds the tracked objects and their 10 commonest types
(it walks them all: for measuring, not for a health check); with
``CUDAFUT_GC_PAUSES=FILE`` every collection of 5 ms or more is appended to
``FILE`` (pauses.py); with ``CUDAFUT_STALL_TRACE=DIR``, every beat of
the loop 5 ms late and every thread's stack when it is 12 ms late are
written to ``DIR`` (stalltrace.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import (
    BAD_REQUEST,
    BUCKETS,
    MODELS,
    WAIT_POLICIES,
    Served,
    image_index,
    missing,
    require_model_packages,
    top_of,
    use_wait_policy,
)
from pauses import freeze_warm_objects, frozen_count, record_from_env
from stalltrace import start_from_env as trace_stalls_from_env

import cudafut

try:
    from aiohttp import web
except ImportError as exc:  # one line that says what to install, not a traceback
    sys.exit(missing("server.py", "aiohttp", exc))

MODES = (
    "nogpu",
    "sync",
    "executor",
    "await",
    "launch",
    "launch_graph",
    "batch",
    "batch_graph",
    "batch_floor",
)
Compute = Callable[[int], Awaitable[list[float]]]


def make_compute(
    mode: str,
    served: Served | None,
    ref: np.ndarray[Any, Any] | None,
    *,
    max_batch: int | None = None,
    max_delay_s: float = 0.002,
    max_in_flight: int | None = None,
) -> tuple[Compute, Any]:
    """The handler's computation for ``mode``, and the batcher (or None);
    the batch modes' options left None take the ``Batcher``'s defaults."""
    if mode == "nogpu":
        assert ref is not None
        answers = [top_of(row) for row in ref]

        async def nogpu(i: int) -> list[float]:
            return answers[i]

        return nogpu, None
    assert served is not None
    torch = served.torch
    if mode == "sync":
        stream = torch.cuda.Stream()

        async def sync(i: int) -> list[float]:
            with torch.cuda.stream(stream):
                out = served.answer([i])
            stream.synchronize()  # blocks the event loop until the GPU is done
            row: list[float] = out[0].tolist()
            return row

        return sync, None
    if mode == "executor":
        pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="infer")
        local = threading.local()

        def blocking(i: int) -> list[float]:
            if not hasattr(local, "stream"):  # one stream per worker thread
                local.stream = torch.cuda.Stream()
            with torch.cuda.stream(local.stream):
                out = served.answer([i])
            local.stream.synchronize()  # blocks this worker thread only
            row: list[float] = out[0].tolist()
            return row

        async def executor(i: int) -> list[float]:
            return await asyncio.get_running_loop().run_in_executor(pool, blocking, i)

        return executor, None
    if mode == "await":
        streams = [torch.cuda.Stream() for _ in range(8)]
        turn = [0]

        async def awaited(i: int) -> list[float]:
            stream = streams[turn[0] % len(streams)]
            turn[0] += 1
            with torch.cuda.stream(stream):
                out = served.answer([i])  # the launch runs here, on the loop
            await cudafut.record(out, stream=stream)  # the wait does not
            row: list[float] = out[0].tolist()
            return row

        return awaited, None
    if mode in ("launch", "launch_graph"):
        answer = served.answer if mode == "launch" else served.answer_graphed

        async def launched(i: int) -> list[float]:
            out = await cudafut.launch(answer, [i])
            row: list[float] = out[0].tolist()
            return row

        return launched, None
    if mode == "batch_floor":
        floor = FloorBatcher(
            served, max_batch or BUCKETS[-1], max_delay_s, max_in_flight or 4, min(2, max_in_flight or 4)
        )

        async def floored(i: int) -> list[float]:
            row: list[float] = (await floor.submit(i)).tolist()
            return row

        return floored, floor
    if mode in ("batch", "batch_graph"):
        graphs = mode == "batch_graph"
        depth = {"max_batch": max_batch, "max_in_flight": max_in_flight}
        answer = served.answer_graphed if graphs else served.answer

        def run_batch(indices: list[int]) -> Any:
            # A NumPy view of the pinned answer (filled by its copy once the
            # batch's GPU work is done, which the future awaits): NumPy's rows
            # and tolist() cost the loop less than a tensor's unbind and tolist.
            return answer(indices).numpy()

        batcher: cudafut.Batcher[int, Any] = cudafut.Batcher(
            run_batch,
            max_delay_s=max_delay_s,
            buckets=BUCKETS if graphs else None,
            **{k: v for k, v in depth.items() if v is not None},
        )

        async def batched(i: int) -> list[float]:
            row: list[float] = (await batcher.submit(i)).tolist()
            return row

        return batched, batcher
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


class FloorBatcher:
    """``--mode batch_floor``: the Batcher's batching rule written by hand,
    with no cudafut on the loop (see the module). A batch goes at once while
    fewer than ``min_in_flight`` run, else when it holds ``max_batch``, its
    oldest request waited ``max_delay_s``, or a running batch ends; at most
    ``max_in_flight`` run. Each runs on one of two worker threads (a stream
    each): the graph replay of its bucket, then ``synchronize()`` on that
    thread, then ``call_soon_threadsafe`` wakes the loop."""

    def __init__(
        self, served: Served, max_batch: int, max_delay_s: float, max_in_flight: int, min_in_flight: int
    ) -> None:
        self.served, self.max_batch, self.max_delay_s = served, max_batch, max_delay_s
        self.max_in_flight, self.min_in_flight = max_in_flight, min_in_flight
        self.queue: collections.deque[tuple[int, asyncio.Future[Any], float]] = collections.deque()
        self.in_flight = self.batches = self.items = 0
        self.wake: asyncio.Future[bool] | None = None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="floor")
        self.local = threading.local()
        self.former: asyncio.Task[None] | None = None
        # Warm both worker threads before serving (PyTorch's per-thread state,
        # as warm_launchers does for the launchers): each waits for the other.
        both = threading.Barrier(2)
        for f in [self.pool.submit(self._warm, both) for _ in range(2)]:
            f.result()

    def _warm(self, both: threading.Barrier) -> None:
        both.wait()
        torch = self.served.torch
        self.local.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.local.stream):
            self.served.answer_graphed([0])
        self.local.stream.synchronize()

    async def __aenter__(self) -> FloorBatcher:
        self.former = asyncio.get_running_loop().create_task(self._form())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.former is not None:
            self.former.cancel()
        self.pool.shutdown(wait=True)

    def statistics(self) -> Any:
        mean = self.items / self.batches if self.batches else 0.0
        return argparse.Namespace(batches=self.batches, items=self.items, mean_batch=mean, padded=0)

    def _wake(self, deadline: bool = False) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(deadline)

    async def submit(self, i: int) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self.queue
        queue.append((i, fut, loop.time()))
        if len(queue) == 1 or len(queue) >= self.max_batch:
            self._wake()
        return await fut

    async def _form(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self.queue
        while True:
            while not queue or self.in_flight >= self.max_in_flight:
                self.wake = loop.create_future()
                await self.wake
            deadline = queue[0][2] + self.max_delay_s
            while (
                len(queue) < self.max_batch
                and self.in_flight >= self.min_in_flight
                and loop.time() < deadline
            ):
                self.wake = loop.create_future()
                timer = loop.call_at(deadline, self._wake, True)
                at_deadline = await self.wake
                timer.cancel()
                if at_deadline:
                    break
            batch = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
            self.in_flight += 1
            self.batches += 1
            self.items += len(batch)
            self.pool.submit(self._work, loop, batch)

    def _work(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> None:
        torch = self.served.torch
        try:
            n = len(batch)
            size = next(b for b in BUCKETS if b >= n)
            indices = [e[0] for e in batch] + [batch[-1][0]] * (size - n)
            with torch.cuda.stream(self.local.stream):
                out = self.served.answer_graphed(indices)
            self.local.stream.synchronize()  # this worker thread only
            result: Any = out.numpy()
        except Exception as exc:  # noqa: BLE001 - each request gets it
            result = exc
        loop.call_soon_threadsafe(self._done, batch, result)

    def _done(self, batch: list[Any], result: Any) -> None:
        self.in_flight -= 1
        for k, (_, fut, _) in enumerate(batch):
            if not fut.done():
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result[k])
        self._wake()


def make_app(compute: Compute, batcher: cudafut.Batcher[int, Any] | FloorBatcher | None) -> web.Application:
    app = web.Application()
    counts = {"requests": 0}

    async def predict(request: web.Request) -> web.Response:
        i = image_index(await request.json())
        if i is None:
            raise web.HTTPBadRequest(text=BAD_REQUEST)
        counts["requests"] += 1
        return web.json_response({"top": await compute(i)})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        out: dict[str, Any] = dict(counts)
        if batcher is not None:
            s = batcher.statistics()
            out.update(batches=s.batches, items=s.items, mean_batch=round(s.mean_batch, 2), padded=s.padded)
        top = request.query.get("objects", "0")
        if not top.isdigit():
            raise web.HTTPBadRequest(text="objects= takes how many of the commonest types to list, e.g. 10")
        out.update(gc_stats(int(top)))
        return web.json_response(out)

    if batcher is not None:

        async def batcher_running(app: web.Application) -> AsyncIterator[None]:
            async with batcher:
                yield

        app.cleanup_ctx.append(batcher_running)
    app.add_routes([web.post("/predict", predict), web.get("/health", health), web.get("/stats", stats)])
    return app


def gc_stats(top: int = 0) -> dict[str, Any]:
    """The collector's state for ``/stats``: the objects frozen
    (``gc_frozen``) and each generation's collections so far; with ``top``,
    also the tracked objects not frozen (``gc_tracked``) and the ``top``
    commonest of their types (``gc_types``), which walks every one of them
    (tens of ms for 300,000, with the loop's thread held)."""
    out: dict[str, Any] = {
        "gc_frozen": frozen_count(),  # not gc.get_freeze_count(): that walks them all
        "gc_collections": [g["collections"] for g in gc.get_stats()],
    }
    if top > 0:
        objects = gc.get_objects()
        out["gc_tracked"] = len(objects)
        out["gc_types"] = collections.Counter(type(o).__name__ for o in objects).most_common(top)
        del objects
    return out


def main(argv: list[str] | None = None) -> None:
    record_from_env()  # CUDAFUT_GC_PAUSES=FILE: the benchmark reads the long collections there
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--mode", choices=MODES, default="batch_graph")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--reference", help="nogpu: the reference logits (.npy, from compare.py)")
    parser.add_argument(
        "--max-batch",
        type=int,
        help="batch modes: the largest batch (default: the Batcher's, the largest bucket)",
    )
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="batch modes: the longest wait")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        help="batch modes: the most batches running at once (default: the Batcher's, 4)",
    )
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the event loop")
    parser.add_argument("--switch-interval-ms", type=float, help="sys.setswitchinterval (default: 5 ms)")
    parser.add_argument(
        "--wait-policy",
        choices=WAIT_POLICIES,
        default="balanced",
        help="how the loop's waiter polls (cudafut.set_wait_policy; polls: WaitPolicy(notify=False))",
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="do not freeze the objects left by model load and warm-up (gc.freeze()): to compare",
    )
    args = parser.parse_args(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    use_wait_policy(args.wait_policy)
    from cudafut._cli.selfcheck import require_gpu

    ref = np.load(args.reference) if args.reference else None
    served = None
    if args.mode != "nogpu":
        require_gpu()
        require_model_packages("server.py --mode " + args.mode)
        served = Served(args.model, graphs=args.mode in ("launch_graph", "batch_graph", "batch_floor"))
        served.answer([0])
        if args.mode in ("launch", "launch_graph", "batch", "batch_graph"):
            # The first model call on each launcher thread sets up PyTorch's
            # per-thread and per-stream state, holding the GIL for part of
            # it (105 ms of stalled loop on an H200): pay it here, before READY.
            graphs = args.mode.endswith("graph")
            cudafut.warm_launchers(served.answer_graphed if graphs else served.answer, [0]).result()
    elif ref is None:
        parser.error("--mode nogpu needs --reference")
    compute, batcher = make_compute(
        args.mode,
        served,
        ref,
        max_batch=args.max_batch,
        max_delay_s=args.max_delay_ms / 1e3,
        max_in_flight=args.max_in_flight,
    )
    app = make_app(compute, batcher)

    async def trace_stalls(app: web.Application) -> AsyncIterator[None]:
        stop = trace_stalls_from_env(asyncio.get_running_loop())  # CUDAFUT_STALL_TRACE=DIR: stalltrace.py
        yield
        stop()

    app.cleanup_ctx.insert(0, trace_stalls)  # stopped last: the batcher's close is traced too
    loop = None
    if args.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    if not args.no_gc_freeze:
        # What imports, model load and warm-up left lives as long as the
        # process: frozen, full collections stop walking it (pauses.py).
        freeze_warm_objects()
    print(f"READY {args.port}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
