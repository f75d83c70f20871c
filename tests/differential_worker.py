"""The worker of tests/test_differential.py: runs random programs on
cudafut.testing's fake GPU and prints, per program, a trace of what happened,
one JSON line each. Started twice, with and without ``CUDAFUT_PURE=1``: the
native and the pure-Python core must print the same traces.

A program (one JSON line on stdin) is ``{"loop": "asyncio" | "uvloop" |
"trio", "ops": [[op, a, b, c], ...]}``: the ops of :data:`OPS` with small
int arguments, run in one task of that loop (through anyio) under a fresh
fake GPU with two devices, after two ops of its own (future 0: a record on
stream s1; future 1: a ``CudaFuture(devices=0)``, unset), so that every op
has a future to act on. Programs use cudafut's public API and the fake's
controls, nothing of ``_future``, ``_loops`` or ``_core``, so that they
survive the rewrite of the core; the few internals read are named where
used (the fake's backend class, whose calls are noted; the event pool's
counts; ``_runtime``'s flag of a parent that initialised CUDA, for fork).

The trace, in program order, holds:

- each op's outcome: a value, an exception's type and message (addresses
  blanked), a future's ``done()``/``cancelled()``;
- every ``then()`` callback as it runs (they run synchronously in the thread
  that sets the parent: their order is exact);
- the fake backend's calls that change the GPU: event creation and
  destruction, event records (handle, stream, device), stream waits
  (stream, handle), in the order made. Queries are left out: when the
  waiter polls is a matter of time, and the native core answers older
  records of a stream from its watermark without asking (by design);
- after each op, the loop is run until it is quiet (every done callback and
  every awaiting task of a future that is ``done()`` has run: the settle
  window), and what ran in it: done callbacks (per future in the order run,
  which is the order added) and finished awaits (sorted: trio wakes the tasks
  of one batch in random order, by design). The order across futures in a
  window is left out (it is the order the loop's waiter found them
  complete in, an implementation detail of each core's waiter);
- at the end, every pending event completed: the state and outcome of every
  future, and which awaiting tasks never finished (their future was never
  set).

The cyclic garbage collector is off while a program runs and collects at
``drop`` ops and between programs only, so that event handles return to the
pool at the same points in both cores (the native records are not tracked
by the collector, so automatic collections would run at other times).
"""

# The lambdas below are called at once, inside their loop step.

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import re
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final, Literal

import anyio
import numpy as np

import cudafut
from cudafut import _backend, _compiled, _pools, _runtime, testing

#: The operations, by name (a program's ops name them).
OPS = (
    "new",  # CudaFuture(devices=...)
    "record",  # record(x, stream=s)
    "record_raises",  # record(x) whose event record raises a CUDA error
    "set",  # set_result(x), on a stream made current
    "set_exception",
    "cancel",
    # then(fn): fn returns a value, raises, returns a future, records, returns
    # another library's array; on the high-priority pool streams
    "then",
    "gather",
    "callback",  # add_done_callback (one in four raises)
    "remove_callback",
    "await",  # a task that awaits the future
    "complete",  # fake.complete(fut): its events and what they follow
    "complete_all",
    "fail",  # fake.fail(fut, code): a CUDA error from its events
    "auto",  # toggle fake.auto_complete
    "drop",  # the program's reference goes; gc.collect()
    "result0",  # result(timeout=0)
    "wait0",  # wait(timeout=0)
    "exception0",  # exception(timeout=0)
    "state",  # done(), cancelled()
    "fork",  # os.fork(): what a child sees of a future
)

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_MAIN = threading.main_thread()

# -- the fake backend's calls --------------------------------------------------------------

#: The calls of the program running (None: not recording), the names of its
#: streams by handle, and the number of the record each event handle was
#: last recorded as (handles are pooled: which handle a record gets depends
#: on when earlier records went back to the pool, which the watcher thread
#: decides for records it kept alive: a matter of time, left out).
_calls: list[Any] | None = None
_stream_names: dict[int, str] = {}
_records: dict[int | None, int] = {}
#: A CUDA error the next event record raises (record_raises), or 0.
_fail_next_record = 0


class _Foreign:
    """An array of another library on device 1 (DLPack): the stream it is
    asked to order its work before goes into the trace."""

    def __init__(self, k: int, trace: list[Any]) -> None:
        self.k = k
        self.trace = trace

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 1)

    def __dlpack__(self, stream: Any = None) -> None:
        self.trace.append(
            ["ordered before", self.k, _stream_name(stream) if isinstance(stream, int) else stream]
        )

    def __repr__(self) -> str:
        return f"<foreign array of then {self.k}>"


def _stream_name(ptr: int) -> str:
    name = _stream_names.get(ptr)
    if name is None:  # a pool stream (then()), by first appearance
        name = _stream_names[ptr] = f"other{sum(n.startswith('other') for n in _stream_names.values())}"
    return name


def _note(*call: Any) -> None:
    calls = _calls
    if calls is None:
        return
    if threading.current_thread() is not _MAIN:
        # Never seen so far; if a core ever calls the backend from another
        # thread, its place in the order is a matter of time: marked.
        call = ("from another thread", *call)
    calls.append(list(call))


def _watch_backend() -> None:
    """Note the fake backend's event records and stream waits (its class's
    methods, wrapped once for this process: ``_backend.current`` is the
    fake, whose methods are looked up at each call). Event creation and
    destruction are not noted (the pool's reuse is a matter of time, see
    ``_records``); :func:`run` checks instead that every event is back in
    the pool at the end."""
    backend = testing._Backend
    record, stream_wait = backend.event_record, backend.stream_wait

    def event_record(self: Any, event: int, stream: int, device: int) -> None:
        global _fail_next_record
        if _fail_next_record:
            code, _fail_next_record = _fail_next_record, 0
            _records.pop(event, None)
            _note("record raises", _stream_name(stream), device, code)
            raise self.event_error(code, device)
        record(self, event, stream, device)
        n = _records[event] = _records.get(None, 0) + 1  # None: the count
        _records[None] = n
        _note("record", n, _stream_name(stream), device)

    def wait(self: Any, stream: int, event: int, device: int) -> None:
        # Noted only for an event still pending: a wait for one complete or
        # failed already orders nothing, and whether a core skips it depends
        # on whether its status was queried before, which the watcher
        # thread does (for the records it keeps alive) when it gets to it.
        ev = self.event_of(event)
        if ev is None or ev.status is None:
            _note("stream waits", _stream_name(stream), device, "for record", _records.get(event))
        stream_wait(self, stream, event, device)

    backend.event_record = event_record  # type: ignore[method-assign]
    backend.stream_wait = wait  # type: ignore[method-assign]


# -- outcomes ------------------------------------------------------------------------------


def _show(value: object) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, cudafut.CudaFuture):
        return "a future"
    if isinstance(value, list):
        return [_show(v) for v in value]
    if isinstance(value, (int, bool, str)) or value is None:
        return value
    return _ADDRESS.sub("0x?", repr(value))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_ADDRESS.sub('0x?', str(exc))}"


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        value = call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # CancelledError included
        return _error(exc)
    return _show(value)


def _state(fut: cudafut.CudaFuture[Any]) -> str:
    return f"done={fut.done()} cancelled={fut.cancelled()}"


def _final(fut: cudafut.CudaFuture[Any]) -> Any:
    if not fut.done():
        return "pending"
    if fut.cancelled():
        return "cancelled"
    value = _outcome(lambda: fut.result(timeout=0))
    error = _outcome(lambda: _show(fut.exception(timeout=0)))
    return value if error is None else [value, error]


# -- a program -----------------------------------------------------------------------------


class _Program:
    """One program's run: its futures, streams, callbacks, tasks and trace."""

    def __init__(self, fake: testing.FakeCuda, ops: list[list[Any]]) -> None:
        self.fake = fake
        self.ops = ops
        self.trace: list[Any] = []
        # Futures by number (None once dropped), and the weak references of
        # the dropped ones.
        self.futs: list[cudafut.CudaFuture[Any] | None] = []
        # Streams to record on or make current: None (the current stream),
        # two of device 0, one of device 1.
        self.streams: list[Any] = [None, fake.stream(0), fake.stream(0), fake.stream(1)]
        for i, s in enumerate(self.streams[1:], 1):
            _stream_names[int(s.ptr)] = f"s{i}"
        for device in (0, 1):  # the current (default) streams, if the seam says which
            with contextlib.suppress(Exception):
                _stream_names.setdefault(int(_backend.current.current_stream(device).ptr), f"default{device}")
        # Done callbacks: (number, future number, weak future); those run.
        self.callbacks: list[tuple[int, int, weakref.ref[Any]]] = []
        self.added: dict[int, list[tuple[int, Callable[[Any], None]]]] = {}
        self.ran: set[int] = set()
        self.removed: set[int] = set()
        # Awaiting tasks: (number, future number, weak future); those finished.
        self.tasks: list[tuple[int, int, weakref.ref[Any]]] = []
        self.finished: set[int] = set()
        self.window: list[Any] = []
        self.then_count = 0
        self.ending = False

    # -- helpers --

    def live(self) -> list[int]:
        return [i for i, f in enumerate(self.futs) if f is not None]

    def pick(self, a: int) -> tuple[int, cudafut.CudaFuture[Any]] | None:
        live = self.live()
        if not live:
            return None
        i = live[a % len(live)]
        fut = self.futs[i]
        assert fut is not None
        return i, fut

    def add(self, fut: cudafut.CudaFuture[Any]) -> int:
        self.futs.append(fut)
        return len(self.futs) - 1

    def made(self, call: Callable[[], cudafut.CudaFuture[Any]]) -> Any:
        """Run ``call``; keep the future it returns (its number in the trace)."""
        try:
            fut = call()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            return _error(exc)
        return f"future {self.add(fut)}"

    def then_fn(self, kind: int, c: int) -> Callable[[Any], Any]:
        k = self.then_count
        self.then_count += 1

        def fn(x: Any) -> Any:
            self.trace.append(["then runs", k, _show(x)])
            if kind == 0:
                return x + 1
            if kind == 1:
                raise ValueError(f"then {k}")
            if kind == 2:  # follow a future of the program (maybe the child itself)
                picked = self.pick(c)
                return x if picked is None else picked[1]
            if kind == 3:  # record on the then() stream, made current
                return cudafut.record(np.full(2, c))
            if kind == 5:  # another library's array on device 1 (a JAX array's DLPack)
                return _Foreign(k, self.trace)
            if kind == 6:  # on the high-priority pool streams
                return x + 2
            return 7

        return fn

    def callback(self, n: int, fid: int, raises: bool) -> Callable[[Any], None]:
        def cb(f: cudafut.CudaFuture[Any]) -> None:
            self.ran.add(n)
            self.window.append(["callback", fid, n, _final(f)])
            if raises:
                raise RuntimeError(f"callback {n}")

        return cb

    async def awaiter(self, n: int, fid: int, fut: cudafut.CudaFuture[Any]) -> None:
        try:
            value = await fut
        except BaseException as exc:
            if self.ending:  # cancelled at the end: it never finished
                raise
            seen = _error(exc)
        else:
            seen = _show(value)
        self.finished.add(n)
        self.window.append(["await", fid, n, seen])

    async def settle(self) -> None:
        """Run the loop until every callback and awaiting task of a done
        future has run; then put what ran into the trace."""
        deadline = time.monotonic() + 10
        while True:
            await anyio.sleep(0)
            missing = [
                ("callback", n)
                for n, _, ref in self.callbacks
                if n not in self.ran and n not in self.removed and (f := ref()) is not None and f.done()
            ]
            missing += [
                ("await", n)
                for n, _, ref in self.tasks
                if n not in self.finished and (f := ref()) is not None and f.done()
            ]
            if not missing:
                break
            if time.monotonic() > deadline:
                self.trace.append(["never ran", missing])
                break
            await anyio.sleep(0.0002)
        if self.window:
            self.trace.append(["ran", _window(self.window)])
            self.window = []

    # -- the run --

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            # Two futures to act on from the first op: a record on s1, unset.
            self.step(tg, "record", 0, 1, 0)
            self.step(tg, "new", 0, 0, 0)
            for op in self.ops:
                self.step(tg, *op)
                if op[0] in _SETTLING:
                    self.learn()
                await self.settle()
                if _calls:
                    self.trace.append(["calls", list(_calls)])
                    _calls.clear()
            self.fake.complete_all()
            await self.settle()
            self.trace.append(["futures", [None if f is None else [_state(f), _final(f)] for f in self.futs]])
            due = [n for n, _, _ in self.callbacks if n not in self.removed]
            self.trace.append(["callbacks never run", [n for n in due if n not in self.ran]])
            self.trace.append(["never finished", [n for n, _, _ in self.tasks if n not in self.finished]])
            self.ending = True
            tg.cancel_scope.cancel()

    def learn(self) -> None:
        """Ask every live future done(): each failure the fake just made is
        then known to both cores at once, so that the awaits and callbacks
        that end at it end in this settle window, not whenever a waiter's
        poll happens to find it."""
        for fut in self.futs:
            if fut is not None:
                fut.done()

    def step(self, tg: Any, name: str, a: int, b: int, c: int) -> None:
        global _fail_next_record
        fake, trace = self.fake, self.trace
        picked = self.pick(a)
        if name == "new":
            devices = (0, 1, (0, 1))[a % 3]
            trace.append([name, self.made(lambda: cudafut.CudaFuture(devices=devices))])
        elif name == "record":
            stream = self.streams[b % len(self.streams)]
            trace.append([name, self.made(lambda: cudafut.record(np.full(2, a), stream=stream))])
        elif name == "record_raises":
            _fail_next_record = (700, 719, 1, 999)[b % 4]
            trace.append([name, self.made(lambda: cudafut.record(np.full(2, a)))])
            _fail_next_record = 0
        elif name == "complete_all":
            fake.complete_all()
            trace.append([name])
        elif name == "auto":
            fake.auto_complete = not fake.auto_complete
            trace.append([name, fake.auto_complete])
        elif picked is None:
            trace.append([name, "no future"])
        else:
            self.on_future(tg, name, *picked, b, c)

    def on_future(self, tg: Any, name: str, i: int, fut: cudafut.CudaFuture[Any], b: int, c: int) -> None:
        fake, trace = self.fake, self.trace
        if name in _KNOWING:
            # What these do depends on whether a failure of the GPU work is
            # known yet, which depends on when a waiter last polled: done()
            # asks first, so that both cores know the same.
            fut.done()
        if name == "set":
            stream = self.streams[c % len(self.streams)]

            def set_result() -> None:
                if stream is None:
                    fut.set_result(np.full(2, b))
                else:
                    with stream:
                        fut.set_result(np.full(2, b))

            trace.append([name, i, _outcome(set_result)])
        elif name == "set_exception":
            trace.append([name, i, _outcome(lambda: fut.set_exception(KeyError(b)))])
        elif name == "cancel":
            trace.append([name, i, _outcome(fut.cancel)])
        elif name == "then":
            fn = self.then_fn(b % 7, c)
            priority: Literal["normal", "high"] = "high" if b % 7 == 6 else "normal"
            trace.append([name, i, self.made(lambda: fut.then(fn, priority=priority))])
        elif name == "gather":
            other = self.pick(b)
            assert other is not None
            other[1].done()  # as fut's (_KNOWING)
            trace.append([name, i, other[0], self.made(lambda: cudafut.gather(fut, other[1]))])
        elif name == "callback":
            n = len(self.callbacks)
            cb = self.callback(n, i, raises=b % 4 == 3)
            trace.append([name, i, n, _outcome(lambda: fut.add_done_callback(cb))])
            self.callbacks.append((n, i, weakref.ref(fut)))
            self.added.setdefault(i, []).append((n, cb))
        elif name == "remove_callback":
            added = self.added.get(i)
            if added:
                k = b % len(added)
                removed = fut.remove_done_callback(added[k][1])
                if removed:
                    self.removed.add(added[k][0])  # due no more
                trace.append([name, i, added[k][0], removed])
            else:
                trace.append([name, i, "none added"])
        elif name == "await":
            n = len(self.tasks)
            self.tasks.append((n, i, weakref.ref(fut)))
            tg.start_soon(self.awaiter, n, i, fut)
            trace.append([name, i, n])
        elif name == "complete":
            trace.append([name, i, _outcome(lambda: fake.complete(fut))])
        elif name == "fail":
            code = (700, 719, 1, 999)[b % 4]
            trace.append([name, i, code, _outcome(lambda: fake.fail(fut, code))])
        elif name == "drop":
            self.futs[i] = None
            ref = weakref.ref(fut)
            del fut
            gc.collect()
            trace.append([name, i, "alive" if ref() is not None else "collected"])
        elif name == "result0":
            trace.append([name, i, _outcome(lambda: fut.result(timeout=0)), _state(fut)])
        elif name == "wait0":
            trace.append([name, i, _outcome(lambda: fut.wait(timeout=0)), _state(fut)])
        elif name == "exception0":
            trace.append([name, i, _outcome(lambda: _show(fut.exception(timeout=0)))])
        elif name == "state":
            trace.append([name, i, _state(fut)])
        elif name == "fork":
            trace.append([name, i, _fork(fut, as_after_cuda=b % 2 == 1)])
        else:
            raise ValueError(f"no op {name!r}")


#: Ops after which the worker learns what the fake settled (``learn``).
_SETTLING: Final = frozenset({"fail", "complete", "complete_all", "auto"})

#: Ops on a future whose outcome depends on a failure being known:
#: ``then()`` runs ``fn`` or fails the child, ``gather()`` fails at once or
#: waits, ``wait()`` returns or raises.
_KNOWING: Final = frozenset({"then", "gather", "wait0"})


def _window(window: list[Any]) -> list[Any]:
    """What ran in one settle window: per future, its callbacks in the order
    they ran, then its awaits, sorted (see the module's docstring)."""
    callbacks: dict[int, list[Any]] = {}
    awaits: dict[int, list[Any]] = {}
    for kind, fid, n, seen in window:
        (callbacks if kind == "callback" else awaits).setdefault(fid, []).append([n, seen])
    return [
        [fid, callbacks.get(fid, []), sorted(awaits.get(fid, []))] for fid in sorted({*callbacks, *awaits})
    ]


def _fork(fut: cudafut.CudaFuture[Any], *, as_after_cuda: bool) -> Any:
    """Fork; the child reports what it sees of ``fut`` and of a new record.
    ``as_after_cuda``: the parent is taken to have initialised CUDA (the
    child must then refuse every call with the documented fork error);
    otherwise, under the fake, the child has its copy of the fake GPU."""
    if not hasattr(os, "fork"):
        return "no fork"
    saved = getattr(_runtime, "_rt", None)
    if as_after_cuda:
        if not hasattr(_runtime, "_rt"):
            return "cannot pretend CUDA was initialised"
        _runtime._rt = object()
    read, write = os.pipe()
    try:
        pid = os.fork()
    finally:
        if as_after_cuda:
            _runtime._rt = saved
    if pid == 0:  # the child
        code = 1
        try:
            os.close(read)
            seen = [
                _outcome(lambda: fut.result(timeout=0)),
                _outcome(fut.done),
                _outcome(lambda: fut.then(lambda x: 1).cancelled()),
                _outcome(lambda: _state(cudafut.record(np.ones(2)))),
            ]
            os.write(write, json.dumps(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 20)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "the child hung"
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
    finally:
        os.close(read)
    _, status = os.waitpid(pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status), "saw": json.loads(data) if data else None}


def run(program: dict[str, Any]) -> list[Any]:
    """Run one program; return its trace."""
    global _calls
    loop = program["loop"]
    backend, options = ("trio", {}) if loop == "trio" else ("asyncio", {"use_uvloop": loop == "uvloop"})
    _stream_names.clear()
    _records.clear()
    gc.collect()
    gc.disable()
    try:
        with testing.fake_cuda(devices=2, hint_after_s=None) as fake:
            _calls = []
            prog = _Program(fake, program["ops"])
            anyio.run(prog.run, backend=backend, backend_options=options)
            _calls = None
            trace = prog.trace
            del prog
            trace.append(["events in use once all is dropped", _events_in_use()])
    finally:
        _calls = None
        gc.enable()
    return trace


def _events_in_use() -> dict[str, int]:
    """Per device, the events of the fake's pool still in use once the
    program's objects are garbage: none, once the watcher thread has let go
    of those it kept alive (waited for, up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        # What the program leaves in cycles (a failed future's traceback),
        # also those a thread's last reference left behind meanwhile.
        gc.collect()
        _free, in_use = _pools.events.counts()
        if not any(in_use.values()):
            return {}
        if time.monotonic() > deadline:
            return {str(d): n for d, n in sorted(in_use.items()) if n}
        time.sleep(0.002)


def main() -> None:
    _watch_backend()
    # Timed polls only: a notice's stream wait and event record are made
    # when the waiter plans a sleep, a matter of time (as queries are).
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=False))
    # Import what the loops import on first use, then take every object
    # alive now out of the collector's sight: gc.collect() at drops and
    # between programs then costs about 0.1 ms, not 14.
    for loop in ("asyncio", "trio", *(("uvloop",) if importlib.util.find_spec("uvloop") else ())):
        run({"loop": loop, "ops": [["await", 0, 0, 0], ["complete_all", 0, 0, 0]]})
    gc.freeze()
    print(json.dumps({"core": _compiled.core(), "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
