"""Serve a torchvision model from several processes and GPUs (docs/processes.md).

``--fronts`` front processes each run their own event loop and aiohttp
server on one port (``SO_REUSEPORT``: the kernel spreads connections), and
one GPU process per device (``--devices``; ``--gpu-procs`` for more) replays
captured CUDA graphs. Each front and GPU process pair shares a pipe, and
what crosses it is batches, not requests: the GPU process's loop does work
per message and per batch, none per request.

- A front gathers its requests for each GPU process (the one with the
  fewest of this front's rows outstanding) into a *front batch*: what
  arrived in one loop iteration (``--front-delay-ms 0``, the default) or
  within that many milliseconds, at most ``--max-batch``. It sends the
  batch as one message of raw bytes (its id, when its first request came,
  then the image indices as int32): nothing pickled per request.
- The GPU process joins the front batches of every front, in arrival order,
  into GPU batches of at most ``--max-batch`` rows (a front batch may be
  split between two), waiting at most ``--max-delay-ms`` (from a front
  batch's first request) for a full one,
  with at most ``--max-in-flight`` running, as :class:`cudafut.Batcher`
  does. It launches each once (:func:`cudafut.launch`: the graph replay on a
  launcher thread) and, once the batch is enqueued
  (:func:`cudafut.enqueued`), not done, sends each front with rows in it
  the batch's :class:`cudafut.CudaFuture` and where its rows are. The future
  crosses the pipe as CUDA IPC memory and an interprocess event: the answer
  stays on the GPU.
- The front awaits the GPU work itself, copies the batch's answer to the
  host once per message, and answers each of its requests from it.

The inputs here are indices into a bank of images already on the GPU (see
models.py). With real uploads, a front would decode each image into a slot
of a shared-memory ring (:mod:`multiprocessing.shared_memory`) and the
message would name the slots, so that the GPU process copies a whole batch
to the GPU at once (docs/processes.md).

``--per-request`` sends a message per request (a Batcher in the GPU process), to compare
(compare.py's ``fronts_per_request``): each request an ``(id, k)`` pickled
into the pipe, a :class:`cudafut.Batcher` in the GPU process
(``submit_future`` per request), one :func:`cudafut.gather`\\ ed future per
batch and front. Both kinds of process read the pipes on their event loop
as messages come, and write each pipe at most once per loop iteration,
never waiting for room.

The same HTTP interface as server.py (``POST /predict`` with ``{"i": k}``,
``GET /health``, ``GET /stats``)::

    python examples/service/multiproc.py --model resnet50 --fronts 4 --devices 0,1 --port 8080

It prints ``READY <port>`` once every GPU process has captured its graphs
and every front listens; until then ``/health`` answers 503. ``--nogpu
REFERENCE.npy`` runs the fronts alone, answering from the reference table
(the HTTP ceiling of that many fronts); ``--model toy`` runs everything
without a GPU (a NumPy model on cudafut's fake GPU, whose futures cross
processes once their work is done). A front's ``GET /stats`` gives, beside
its requests, its front batches and their rows (``front_batches``,
``front_items``), and the GPU batches its rows were in and their rows
(``gpu_batches``, ``gpu_items``).

Every process waits with timed polls (``--wait-policy polls``, the
default here: ``cudafut.WaitPolicy(notify=False)``). The library's
default (``--wait-policy balanced``) serves as well now: it arms a CUDA
notice for an await of work it has not learnt, but never for a future
received from another process, as each front's batches are; when it
did, the notices cost the service CPU and GPU time (docs/processes.md,
"Received futures poll on timers").

If a GPU process ends, each front at once answers that process's waiting
requests with 502, and the service stops a second later, saying which
process ended. A front that ends loses only its own requests: the GPU
processes drop its rows and answers, and the other fronts go on serving
(the service stops once no front is left). A front answers 504 if the GPU
process has not answered a request within 30 s.

Each process freezes what its imports and warm-up left (``gc.collect()``
then ``gc.freeze()``, as server.py does; ``--no-gc-freeze`` to compare)
before it says it is ready, and with ``CUDAFUT_GC_PAUSES=FILE`` appends its
collections of 5 ms or more to ``FILE`` (pauses.py); with
``CUDAFUT_STALL_TRACE=DIR`` each process's loop stalls go to ``DIR``
(stalltrace.py).
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
import socket
import struct
import sys
import time
import traceback
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import BAD_REQUEST, BUCKETS, MODELS, WAIT_POLICIES, image_index, missing, top_of, use_wait_policy
from pauses import freeze_warm_objects, frozen_count, record_from_env
from stalltrace import start_from_env as trace_stalls_from_env

import cudafut

#: ``--model toy``: ray_serve.py's NumPy model under cudafut's fake GPU.
TOY = "toy"
#: How long a front waits for a GPU process to answer a request (and for its GPU work).
ANSWER_TIMEOUT_S = 30.0
#: How often a front looks for requests waiting longer than that.
_SWEEP_S = 1.0
#: How long the service lets its fronts answer with errors after a GPU process ended.
_GRACE_S = 1.0
#: How a message is framed in a pipe (Connection.send_bytes()'s header).
_FRAME = struct.Struct("!i")
#: A front batch's message: its id and when its first request came
#: (``time.monotonic()``, one clock for every process of the machine), then
#: the image indices as int32 (native order: one machine).
_HEAD = struct.Struct("<Qd")
#: An answer's table: per part, the front batch's id, the part's offset in
#: it, its offset in the GPU batch, its rows (int64 each).
_PART = 4
# What a batch former waits for.
_IDLE, _WANT_ITEM, _WANT_FULL, _WANT_SLOT = range(4)


class GpuProcessGoneError(RuntimeError):
    """The GPU process that had a request ended before answering it (502)."""


class NoAnswerError(TimeoutError):
    """No answer within :data:`ANSWER_TIMEOUT_S` (504)."""


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
    device: int,
    model: str,
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool = True,
    *,
    per_request: bool = False,
    max_in_flight: int = 2,
    wait_policy: str = "polls",
) -> None:
    """A GPU process: front batches from each front's pipe, answers back
    down the same pipe (:class:`_GpuBatches`; with ``per_request``, the
    hand-off of :func:`_gpu_loop`). It ends once every front has gone. With
    ``freeze``, what warm-up left is frozen before ``ready`` is set."""
    record_from_env()
    use_wait_policy(wait_policy)
    if model == TOY:  # no GPU: the fake GPU, whose futures cross once done
        from ray_serve import Toy

        from cudafut.testing import fake_cuda

        with fake_cuda(auto_complete=True):
            _run_gpu_loop(
                Toy().answer, conns, max_batch, max_delay_s, ready, freeze, per_request, max_in_flight
            )
        return
    import torch
    from models import Served

    torch.cuda.set_device(device)
    served = Served(model, graphs=True)
    served.answer_on_gpu([0])
    # Each launcher thread's first model call is slow and holds the GIL in
    # part (docs/serving.md, "Cold launcher threads"): pay it before ready.
    cudafut.warm_launchers(served.answer_on_gpu, [0], device=device).result()
    _run_gpu_loop(
        served.answer_on_gpu, conns, max_batch, max_delay_s, ready, freeze, per_request, max_in_flight
    )


def _run_gpu_loop(
    run_batch: Callable[[Any], Any],
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool,
    per_request: bool,
    max_in_flight: int,
) -> None:
    if per_request:
        asyncio.run(_gpu_loop(run_batch, conns, max_batch, max_delay_s, ready, freeze, max_in_flight))
    else:
        asyncio.run(_gpu_batches(run_batch, conns, max_batch, max_delay_s, ready, freeze, max_in_flight))


class _Inbox:
    """The loop reads the pipes: ``take(i, message)`` for each message from
    ``conns[i]`` (its bytes with ``raw``, else unpickled), ``gone(i)`` once
    it has closed. A message that cannot be read (unpickling it imports its
    futures, which can fail) ends the process, saying why: its requests
    could not be answered.

    On the loop, not on reader threads: a thread woken by the pipe must
    first win the GIL from the loop and the launcher threads (up to 5 ms a
    hand-over when they are busy), and requests would wait for it. Each
    read is one ``recv`` without waiting that takes what the pipe holds,
    and the loop takes each whole message in it (the framing of
    :meth:`multiprocessing.connection.Connection.send_bytes`, as
    :class:`_Outbox` writes it); a part waits for the rest. A peer that dies
    in the middle of a message closes the pipe: the part is dropped.

    It reads as the pipes become readable (the loop watches them) until
    :meth:`pause`, and then only when asked (:meth:`drain`: one ``recv`` a
    pipe), until :meth:`resume`.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        conns: list[Any],
        take: Callable[[int, Any], None],
        gone: Callable[[int], None],
        raw: bool = False,
    ) -> None:
        self.loop = loop
        self.take = take
        self.gone = gone
        self.raw = raw
        # Duplicates of the pipes' sockets: their reads never wait (MSG_DONTWAIT).
        self.socks: dict[int, socket.socket] = {
            i: socket.socket(fileno=os.dup(conn.fileno())) for i, conn in enumerate(conns)
        }
        self.bufs = [bytearray() for _ in conns]
        self.watching = False
        self.resume()

    def resume(self) -> None:
        """Read each pipe as soon as it is readable."""
        if not self.watching:
            self.watching = True
            for i, sock in self.socks.items():
                self.loop.add_reader(sock.fileno(), self.read, i)

    def pause(self) -> None:
        """Read only when :meth:`drain` is called."""
        if self.watching:
            self.watching = False
            for sock in self.socks.values():
                self.loop.remove_reader(sock.fileno())

    def close(self) -> None:
        """Stop reading; close the duplicates."""
        self.pause()
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()

    def drain(self) -> None:
        """Take what each pipe holds now."""
        for i in list(self.socks):
            self.read(i)

    def read(self, i: int) -> None:
        sock = self.socks[i]
        try:
            try:
                data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # closed: the peer has gone
                if self.watching:
                    self.loop.remove_reader(sock.fileno())
                del self.socks[i]
                sock.close()
                self.gone(i)
                return
            buf = self.bufs[i]
            buf += data
            start, end = 0, len(buf)
            while end - start >= 4:
                (size,) = _FRAME.unpack_from(buf, start)
                if end - start - 4 < size:
                    break
                message = bytes(buf[start + 4 : start + 4 + size])
                start += 4 + size
                self.take(i, message if self.raw else ForkingPickler.loads(message))
            del buf[:start]
        except Exception:
            with _or_exit("a message between the processes could not be read"):
                raise


class _Outbox:
    """Messages for each pipe, written once per loop iteration (one write
    for all that the iteration produced, not one per request), and never
    waiting: what the pipe has no room for waits in a buffer until the
    loop sees the pipe writable. A blocking write could deadlock two
    processes whose pipes are both full, each waiting for the other to read.
    :meth:`put`'s items go as one pickled list per write (pickling a
    message, exporting its futures, happens here, on the loop);
    :meth:`put_raw`'s bytes each as a message of their own.

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
        self.raw: list[list[bytes]] = [[] for _ in conns]
        self.unsent = [bytearray() for _ in conns]
        self.watched = [False] * len(conns)
        self.scheduled = False

    def put(self, i: int, item: Any) -> None:
        self.boxes[i].append(item)
        self.wake()

    def put_raw(self, i: int, data: bytes) -> None:
        self.raw[i].append(data)
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
            raw = self.raw[i]
            if not box and not raw:
                continue
            out = self.unsent[i]
            for data in raw:  # what Connection.send_bytes() writes
                out += _FRAME.pack(len(data))
                out += data
            raw.clear()
            if box:
                with _or_exit(self.what):
                    pickled = ForkingPickler.dumps(box)  # what Connection.send() writes, framed below
                box.clear()
                out += _FRAME.pack(len(pickled))
                out += pickled
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
        except OSError:  # the peer has gone: what was for it is dropped
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


# -- the GPU process, a batch per message ----------------------------------------


class _GpuBatches:
    """The GPU process's loop: front batches in (:meth:`take`), one launch
    per GPU batch, one answer per GPU batch and front (see the module).

    A GPU batch starts with the oldest front batch waiting and takes the
    rows that arrived, in order, until it holds ``max_batch`` or
    ``max_delay_s`` have passed since its first request came to its front; up to
    ``max_in_flight`` batches run at once (launched, their GPU work not
    done), and while that many run the next takes what waits: the rule of
    :class:`cudafut.Batcher`, counted in rows. A batch of ``n`` rows is
    padded to the smallest of ``buckets`` that holds it, with its last
    index. The answer to a front is ``(future, n, table)``: the batch's
    future (its value has a row per index, padding included) and, as
    int64 bytes, per part of one of its front batches ``(front batch id,
    offset in it, offset in the GPU batch, rows)``.

    Its costs are per message (a header unpacked, an array view of the
    indices, a queue append) and per batch (the indices joined, a launch,
    an ``await`` of the launch, one pickled future per front): none per
    request.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        run_batch: Callable[[Any], Any],
        outbox: _Outbox,
        max_batch: int,
        max_delay_s: float,
        max_in_flight: int,
        buckets: tuple[int, ...] | None = BUCKETS,
    ) -> None:
        self.loop = loop
        self.run_batch = run_batch
        self.outbox = outbox
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.max_in_flight = max_in_flight
        self.buckets = buckets
        # Per front batch waiting: [front, id, indices, rows taken, arrived].
        self.queue: deque[list[Any]] = deque()
        self.queued = 0
        self.in_flight = 0
        self.want = _IDLE
        self.sleeper: asyncio.Future[None] | None = None
        self.gone: set[int] = set()
        self.batches = self.items = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.inbox: _Inbox | None = None  # set before form() runs

    def take(self, front: int, data: bytes) -> None:
        """A front batch's message from ``front``."""
        bid, came = _HEAD.unpack_from(data)
        indices = np.frombuffer(data, np.int32, offset=_HEAD.size)
        if not len(indices) or front in self.gone:
            return
        # On the loop's clock, when its first request came to the front: a
        # message read late (the pipes were not watched) waits no longer.
        now = self.loop.time()
        arrived = now - max(0.0, time.monotonic() - came)
        self.queue.append([front, bid, indices, 0, arrived])
        self.queued += len(indices)
        want = self.want
        if want == _WANT_ITEM or (want == _WANT_FULL and self.queued >= self.max_batch):
            self._wake()

    def drop(self, front: int) -> None:
        """``front`` has gone: its rows not yet launched are dropped, and
        nothing more is sent to it."""
        self.gone.add(front)
        kept = [entry for entry in self.queue if entry[0] != front]
        if len(kept) != len(self.queue):
            self.queue = deque(kept)
            self.queued = sum(len(entry[2]) - entry[3] for entry in kept)

    async def form(self) -> None:
        """Form and launch batches, for ever (the one task that does).

        While ``max_in_flight`` batches run, the pipes are not watched: what
        the fronts send meanwhile waits in them, and is read at once (one
        ``recv`` a pipe) when a batch ends. Under load, when batches are
        ready back to back, the loop so wakes once a batch, not once a
        message; it watches the pipes only while it waits for requests.
        """
        loop = self.loop
        inbox = self.inbox
        assert inbox is not None
        try:
            while True:
                if self.in_flight >= self.max_in_flight:
                    inbox.pause()
                    while self.in_flight >= self.max_in_flight:
                        await self._sleep(_WANT_SLOT)
                    inbox.drain()
                if not self.queue:
                    inbox.resume()
                    while not self.queue:
                        await self._sleep(_WANT_ITEM)
                deadline = self.queue[0][4] + self.max_delay_s
                if self.queued < self.max_batch and loop.time() < deadline:
                    inbox.resume()
                    while self.queue and self.queued < self.max_batch and loop.time() < deadline:
                        await self._sleep(_WANT_FULL, deadline)
                if self.queue:
                    self._launch()
        except Exception:
            with _or_exit("a GPU process could not form batches"):
                raise

    def _launch(self) -> None:
        chunks: list[np.ndarray[Any, Any]] = []
        parts: list[tuple[int, int, int, int, int]] = []
        n = 0
        queue = self.queue
        while queue and n < self.max_batch:
            entry = queue[0]
            front, bid, indices, start = entry[0], entry[1], entry[2], entry[3]
            count = min(len(indices) - start, self.max_batch - n)
            chunks.append(indices[start : start + count])
            parts.append((front, bid, start, n, count))
            n += count
            if start + count == len(indices):
                queue.popleft()
            else:  # the rest goes with the next batch
                entry[3] = start + count
        self.queued -= n
        size = n
        if self.buckets is not None:
            size = next((b for b in self.buckets if b >= n), n)
        batch = np.empty(size, np.int32)
        np.concatenate(chunks, out=batch[:n])
        batch[n:] = batch[n - 1]
        try:
            fut: cudafut.CudaFuture[Any] = cudafut.launch(self.run_batch, batch)
        except Exception as exc:  # noqa: BLE001 - the fronts get it, as a failed future
            fut = cudafut.CudaFuture()
            fut.set_exception(exc)
        self.in_flight += 1
        self.batches += 1
        self.items += n
        task = self.loop.create_task(self._answer(fut, n, parts))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(
        self, fut: cudafut.CudaFuture[Any], n: int, parts: list[tuple[int, int, int, int, int]]
    ) -> None:
        try:
            await cudafut.enqueued(fut)  # set once enqueued, not done
            tables: dict[int, array[int]] = {}
            for front, bid, start, offset, count in parts:
                tables.setdefault(front, array("q")).extend((bid, start, offset, count))
            for front, table in tables.items():
                if front not in self.gone:  # pickled, its future exported, by the outbox's write
                    self.outbox.put(front, (fut, n, table.tobytes()))
            with contextlib.suppress(Exception):  # a failure is the fronts' to report
                await fut  # done: its slot frees
        finally:
            self.in_flight -= 1
            if self.want == _WANT_SLOT:
                self._wake()

    async def _sleep(self, want: int, deadline: float | None = None) -> None:
        self.want = want
        self.sleeper = self.loop.create_future()
        timer = None if deadline is None else self.loop.call_at(deadline, self._wake)
        try:
            await self.sleeper
        finally:
            self.want = _IDLE
            self.sleeper = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self.sleeper is not None and not self.sleeper.done():
            self.sleeper.set_result(None)


async def _gpu_batches(
    run_batch: Callable[[Any], Any],
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool = True,
    max_in_flight: int = 2,
) -> None:
    """The GPU process's loop (:class:`_GpuBatches`) until every front has gone."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    outbox = _Outbox(loop, conns, "a GPU process could not send answers")
    batches = _GpuBatches(loop, run_batch, outbox, max_batch, max_delay_s, max_in_flight)

    def gone(i: int) -> None:
        batches.drop(i)
        if len(batches.gone) == len(conns):
            stopped.set()

    batches.inbox = _Inbox(loop, conns, batches.take, gone, raw=True)
    former = loop.create_task(batches.form())
    if freeze:  # the model, its graphs and the launchers live as long as this process
        freeze_warm_objects()
    stop_trace = trace_stalls_from_env(loop)  # CUDAFUT_STALL_TRACE=DIR: stalltrace.py
    ready.set()
    await stopped.wait()
    stop_trace()
    former.cancel()


# -- the GPU process, a request per message (--per-request) ------------------------


async def _gpu_loop(
    run_batch: Callable[[list[int]], Any],
    conns: list[Any],
    max_batch: int,
    max_delay_s: float,
    ready: Any,
    freeze: bool = True,
    max_in_flight: int = 2,
) -> None:
    """``--per-request``: requests ``(id, k)`` in lists from each front's
    pipe, each submitted to a :class:`cudafut.Batcher`; answers back down
    the same pipe, in lists of ``(ids, future)``: one future per batch and
    front (:func:`cudafut.gather` of the batch's futures for that front).
    Ends once every front has gone."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    answers: list[list[tuple[int, Any]]] = [[] for _ in conns]
    gone: set[int] = set()

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
            if i in gone:
                done.clear()
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

    def front_gone(i: int) -> None:
        gone.add(i)
        if len(gone) == len(conns):
            stopped.set()

    batcher: cudafut.Batcher[int, Any] = cudafut.Batcher(
        run_batch,
        max_batch=max_batch,
        max_delay_s=max_delay_s,
        buckets=BUCKETS,
        max_in_flight=max_in_flight,
        min_in_flight=0,  # the rule its figures were measured with: fill until max_delay_s
    )
    async with batcher:
        _Inbox(loop, conns, take, front_gone)
        if freeze:  # the model, its graphs, the batcher and the launchers live as long as this process
            freeze_warm_objects()
        stop_trace = trace_stalls_from_env(loop)  # CUDAFUT_STALL_TRACE=DIR: stalltrace.py
        ready.set()
        await stopped.wait()
        stop_trace()


def _failed(fut: cudafut.CudaFuture[Any]) -> bool:
    """Whether a future failed or was cancelled (non-blocking: ``done()``
    queries its events, and ``exception()`` then has nothing to wait for)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


# -- a front's side of the hand-off ------------------------------------------------


def _host_rows(value: Any) -> np.ndarray[Any, Any]:
    """A batch's answer on the host: one copy (PyTorch, CuPy), or as it is
    (NumPy, under the fake GPU)."""
    if hasattr(value, "cpu"):  # a PyTorch tensor (its GPU work is done)
        value = value.cpu().numpy()
    elif hasattr(value, "get") and not isinstance(value, np.ndarray):  # CuPy
        value = value.get()
    return np.asarray(value)


class _Open:
    """A front batch being gathered for one GPU process."""

    __slots__ = ("bid", "came", "indices", "timer", "waiters")

    def __init__(self, bid: int) -> None:
        self.bid = bid
        self.came = time.monotonic()
        self.waiters: list[asyncio.Future[list[float]]] = []
        self.indices = array("i")
        self.timer: asyncio.TimerHandle | None = None


class _Sent:
    """A front batch sent, not yet answered in full."""

    __slots__ = ("gpu", "left", "sent", "unanswered", "waiters")

    def __init__(self, gpu: int, waiters: list[asyncio.Future[list[float]]], sent: float) -> None:
        self.gpu = gpu
        self.waiters = waiters
        self.left = self.unanswered = len(waiters)  # rows not delivered; not in an answer yet
        self.sent = sent


class _Link:
    """A front's hand-off to the GPU processes, a front batch per message
    (see the module): :meth:`ask` gives a request's answer (its row: the
    top logits, then their classes), or raises :class:`GpuProcessGoneError` (its
    GPU process ended: at once) or :class:`NoAnswerError` (none within
    :data:`ANSWER_TIMEOUT_S`). ``delay_s`` 0: a front batch holds what
    arrived in one loop iteration."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, conns: list[Any], max_batch: int, delay_s: float
    ) -> None:
        n = len(conns)
        self.loop = loop
        self.max_batch = max_batch
        self.delay_s = delay_s
        self.alive = [True] * n
        self.outstanding = [0] * n  # rows per GPU process, not yet in an answer
        self.open: list[_Open | None] = [None] * n
        self.sent: dict[int, _Sent] = {}
        self.ids = itertools.count()
        self.counts = {"front_batches": 0, "front_items": 0, "gpu_batches": 0, "gpu_items": 0}
        self.tasks: set[asyncio.Task[None]] = set()
        pack = self._close_all if delay_s <= 0 else None  # at the write: what this iteration gathered
        self.outbox = _Outbox(loop, conns, "a front process could not send requests", pack=pack)
        self.sweeper = loop.call_later(_SWEEP_S, self._sweep)
        self.inbox = _Inbox(loop, conns, self._answered, self._gone)

    def ask(self, k: int) -> Awaitable[list[float]]:
        alive = [g for g, up in enumerate(self.alive) if up]
        if not alive:
            raise GpuProcessGoneError("every GPU process of the service has ended")
        g = min(alive, key=self.outstanding.__getitem__)
        b = self.open[g]
        if b is None:
            b = self.open[g] = _Open(next(self.ids))
            if self.delay_s > 0:
                b.timer = self.loop.call_later(self.delay_s, self._close, g)
            else:
                self.outbox.wake()  # its pack hook closes the batch
        waiter: asyncio.Future[list[float]] = self.loop.create_future()
        b.waiters.append(waiter)
        b.indices.append(k)
        self.outstanding[g] += 1
        if len(b.waiters) >= self.max_batch:
            self._close(g)
        return waiter

    def _close(self, g: int) -> None:
        b = self.open[g]
        if b is None:
            return
        self.open[g] = None
        if b.timer is not None:
            b.timer.cancel()
        self.sent[b.bid] = _Sent(g, b.waiters, self.loop.time())
        self.counts["front_batches"] += 1
        self.counts["front_items"] += len(b.waiters)
        self.outbox.put_raw(g, _HEAD.pack(b.bid, b.came) + b.indices.tobytes())

    def _close_all(self) -> None:
        for g, b in enumerate(self.open):
            if b is not None:
                self._close(g)

    def _answered(self, g: int, items: list[tuple[Any, int, bytes]]) -> None:
        # Unpickling the message (importing its futures: one per GPU batch)
        # ran just before, on this loop.
        for fut, n, table in items:
            parts = array("q")
            parts.frombytes(table)
            for j in range(0, len(parts), _PART):
                s = self.sent.get(parts[j])
                if s is not None:
                    s.unanswered -= parts[j + 3]
                    self.outstanding[g] -= parts[j + 3]
            task = self.loop.create_task(self._deliver(fut, n, parts))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _deliver(self, fut: Any, n: int, parts: array[int]) -> None:
        error: BaseException | None = None
        try:  # the GPU work (a producer that dies fails it: cudafut.SharingError)
            rows = _host_rows(await asyncio.wait_for(fut, ANSWER_TIMEOUT_S))
        except TimeoutError:
            error = NoAnswerError(f"the GPU work did not complete in {ANSWER_TIMEOUT_S} s")
        except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
            error = exc
        self.counts["gpu_batches"] += 1
        self.counts["gpu_items"] += n
        for j in range(0, len(parts), _PART):
            bid, start, offset, count = parts[j : j + _PART]
            s = self.sent.get(bid)
            if s is None:  # failed meanwhile (timed out)
                continue
            waiters = s.waiters[start : start + count]
            if error is None:
                for waiter, row in zip(waiters, rows[offset : offset + count].tolist(), strict=True):
                    if not waiter.done():  # its handler may have gone
                        waiter.set_result(row)
            else:
                _fail(waiters, error)
            s.left -= count
            if s.left <= 0:
                del self.sent[bid]

    def _gone(self, g: int) -> None:
        """GPU process ``g`` has ended: its requests fail at once."""
        self.alive[g] = False
        error = GpuProcessGoneError(f"GPU process {g} of the service ended before it answered")
        b = self.open[g]
        if b is not None:
            self.open[g] = None
            if b.timer is not None:
                b.timer.cancel()
            _fail(b.waiters, error)
        for bid, s in list(self.sent.items()):
            if s.gpu == g:
                _fail(s.waiters, error)
                del self.sent[bid]
        self.outstanding[g] = 0

    def _sweep(self) -> None:
        """Fail what waited too long for an answer (a GPU process that lives but does not answer)."""
        too_old = self.loop.time() - ANSWER_TIMEOUT_S
        for bid, s in list(self.sent.items()):
            if s.sent < too_old and s.unanswered:
                _fail(s.waiters, NoAnswerError(f"no answer from the GPU process in {ANSWER_TIMEOUT_S} s"))
                self.outstanding[s.gpu] -= s.unanswered
                del self.sent[bid]
        self.sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    def close(self) -> None:
        self.sweeper.cancel()
        self.inbox.close()
        self.outbox.close()


def _fail(waiters: list[asyncio.Future[Any]], error: BaseException) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(error)


class _PerRequestLink:
    """``--per-request``: a front's hand-off, a pickled ``(id, k)`` per
    request, an answer ``(ids, future)`` per batch; :meth:`ask` as
    :class:`_Link`'s."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conns: list[Any]) -> None:
        self.loop = loop
        self.alive = [True] * len(conns)
        self.outstanding = [0] * len(conns)
        self.waiting: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self.ids = itertools.count()
        self.counts: dict[str, int] = {}
        self.outbox = _Outbox(loop, conns, "a front process could not send requests")
        self.inbox = _Inbox(loop, conns, self._deliver, self._gone)

    def _deliver(self, g: int, items: list[tuple[list[int], Any]]) -> None:
        # Unpickling the message (importing its futures: one a batch) ran
        # just before, on this loop.
        for rids, fut in items:
            self.outstanding[g] -= len(rids)
            for j, rid in enumerate(rids):
                entry = self.waiting.pop(rid, None)
                if entry is not None and not entry[1].done():  # its handler may have timed out
                    entry[1].set_result((fut, j))

    def _gone(self, g: int) -> None:
        self.alive[g] = False
        error = GpuProcessGoneError(f"GPU process {g} of the service ended before it answered")
        for rid, (h, waiter) in list(self.waiting.items()):
            if h == g:
                _fail([waiter], error)
                del self.waiting[rid]

    async def ask(self, k: int) -> list[float]:
        alive = [g for g, up in enumerate(self.alive) if up]
        if not alive:
            raise GpuProcessGoneError("every GPU process of the service has ended")
        g = min(alive, key=self.outstanding.__getitem__)
        self.outstanding[g] += 1
        rid = next(self.ids)
        waiter: asyncio.Future[Any] = self.loop.create_future()
        self.waiting[rid] = (g, waiter)
        self.outbox.put(g, (rid, k))
        try:  # a GPU process that fails must not leave the client waiting for ever
            shared, j = await asyncio.wait_for(waiter, ANSWER_TIMEOUT_S)  # the batch is enqueued
        except TimeoutError:
            raise NoAnswerError(f"no answer from the GPU process in {ANSWER_TIMEOUT_S} s") from None
        finally:
            self.waiting.pop(rid, None)
        # The GPU work (of this front's part of the batch): a producer that
        # dies fails this wait (cudafut.SharingError); work that never ends
        # while it lives (a hung kernel) answers 504, not never.
        try:
            rows = await asyncio.wait_for(shared, ANSWER_TIMEOUT_S)
        except TimeoutError:
            raise NoAnswerError(f"the GPU work did not complete in {ANSWER_TIMEOUT_S} s") from None
        row: list[float] = rows[j].tolist()
        return row

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


def front_main(
    port: int,
    conns: list[Any],
    reference: str | None,
    warm: list[int],
    ready: Any,
    serving: Any,
    freeze: bool = True,
    *,
    per_request: bool = False,
    max_batch: int = 64,
    delay_s: float = 0.0,
    wait_policy: str = "polls",
) -> None:
    """A front process: HTTP on ``port`` (shared), requests to the GPU
    processes (:class:`_Link`, or :class:`_PerRequestLink` with
    ``per_request``). ``/health`` answers 503 until ``serving`` is set
    (every process of the service ready): a front listens before the GPU
    processes have captured their graphs, and a load balancer must not send
    it requests meanwhile. With ``freeze``, what its imports and warm-up
    left (PyTorch's, where it receives GPU futures) is frozen before
    ``ready``."""
    record_from_env()
    use_wait_policy(wait_policy)
    try:
        from aiohttp import web
    except ImportError as exc:  # one line that says what to install, not a traceback
        sys.exit(missing("multiproc.py", "aiohttp", exc))

    app = web.Application()
    links: list[_Link | _PerRequestLink] = []
    counts = {"requests": 0}
    answers = None if reference is None else [top_of(row) for row in np.load(reference)]

    async def predict(request: web.Request) -> web.Response:
        k = image_index(await request.json())
        if k is None:
            raise web.HTTPBadRequest(text=BAD_REQUEST)
        counts["requests"] += 1
        if answers is not None:
            return web.json_response({"top": answers[k]})
        try:
            row = await links[0].ask(k)
        except GpuProcessGoneError as exc:
            raise web.HTTPBadGateway(text=str(exc)) from None
        except NoAnswerError as exc:
            raise web.HTTPGatewayTimeout(text=str(exc)) from None
        return web.json_response({"top": row})

    up = [False]

    async def health(request: web.Request) -> web.Response:
        if not up[0]:
            up[0] = serving.is_set()  # a lock of multiprocessing's: asked until set
            if not up[0]:
                return web.Response(status=503, text="starting")
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        link = links[0].counts if links else {}
        return web.json_response({**counts, **link, "pid": os.getpid(), "gc_frozen": frozen_count()})

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
        # A GPU process that has gone fails its requests; main() stops the service.
        if per_request:
            links.append(_PerRequestLink(loop, conns))
        else:
            links.append(_Link(loop, conns, max_batch, delay_s))

    app.on_startup.append(started)
    app.add_routes([web.post("/predict", predict), web.get("/health", health), web.get("/stats", stats)])

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True)
        await site.start()
        if freeze:
            freeze_warm_objects()
        trace_stalls_from_env(asyncio.get_running_loop())  # after the freeze's walk: stalltrace.py
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
        help="GPU processes per device (each its own GIL, batches and graphs; the GPU time-slices them)",
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-batch", type=int, default=64, help="rows in a GPU batch (and a front batch)")
    parser.add_argument(
        "--max-delay-ms", type=float, default=2.0, help="the longest a GPU process waits for a full batch"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=2, help="GPU batches running at once, per GPU process"
    )
    parser.add_argument(
        "--front-delay-ms",
        type=float,
        default=0.0,
        help="the longest a front gathers a front batch (0: what one loop iteration got)",
    )
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="a message per request, a Batcher in the GPU process (to compare with front batches)",
    )
    parser.add_argument(
        "--wait-policy",
        choices=WAIT_POLICIES,
        default="polls",
        help="how every process's waiter polls (cudafut.set_wait_policy; polls, the default: "
        "WaitPolicy(notify=False); balanced: the library's default, within 1 %% of polls here, "
        "docs/processes.md)",
    )
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
    if args.max_batch < 1 or args.max_batch > BUCKETS[-1]:
        parser.error(f"--max-batch must be from 1 to {BUCKETS[-1]}")
    if args.max_in_flight < 1:
        parser.error("--max-in-flight must be at least 1")
    if not (args.max_delay_ms >= 0 and args.front_delay_ms >= 0):
        parser.error("--max-delay-ms and --front-delay-ms must be at least 0")
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
                args=(device, args.model, conns, args.max_batch, args.max_delay_ms / 1e3, ready),
                kwargs={
                    "freeze": not args.no_gc_freeze,
                    "per_request": args.per_request,
                    "max_in_flight": args.max_in_flight,
                    "wait_policy": args.wait_policy,
                },
                name=f"gpu{g}-device{device}",
            )
        )
        readies.append(ready)
    gpus = list(children)
    warm = [] if args.nogpu is not None or args.model == TOY else sorted(set(devices))
    for f in range(args.fronts):
        ready = ctx.Event()
        conns = [pipes[f][g][0] for g in range(len(devices))]
        children.append(
            ctx.Process(
                target=front_main,
                args=(args.port, conns, args.nogpu, warm, ready, serving),
                kwargs={
                    "freeze": not args.no_gc_freeze,
                    "per_request": args.per_request,
                    "max_batch": args.max_batch,
                    "delay_s": args.front_delay_ms / 1e3,
                    "wait_policy": args.wait_policy,
                },
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
    why = _supervise(gpus, [c for c in children if c not in gpus])
    for child in children:
        child.terminate()
    sys.exit(why)


def _supervise(gpus: list[Any], fronts: list[Any]) -> str:
    """Wait until the service must stop, and say why: a GPU process ended
    (its fronts first answer its waiting requests with errors, for
    :data:`_GRACE_S`), or every front did. A front that ends alone is
    reported; the others go on serving."""
    watched = gpus + fronts
    while True:
        mp.connection.wait([child.sentinel for child in watched])
        for child in [c for c in watched if not c.is_alive()]:
            watched.remove(child)
            if child in gpus:
                time.sleep(_GRACE_S)
                return f"multiproc.py: {child.name} exited with {child.exitcode}; stopped the service"
            print(
                f"multiproc.py: {child.name} exited with {child.exitcode}; the other fronts go on serving",
                file=sys.stderr,
                flush=True,
            )
        if not any(c in watched for c in fronts):
            return "multiproc.py: every front exited; stopped the service"


if __name__ == "__main__":
    main()
