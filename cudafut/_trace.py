"""Tracing: a timeline of every future, for Perfetto, chrome://tracing and Nsight Systems.

``with cudafut.trace("trace.json"):`` records, for every future made inside
the block, when it was created and set (on which streams of which devices),
when the GPU ran the work between its recording points (CUDA timing events,
made only while tracing), which waiter saw it done and when, and the host
time of the callbacks it ran; ``then()`` links become flow arrows. The file is
written when the block exits, in the Chrome trace-event JSON format that
https://ui.perfetto.dev and chrome://tracing open. docs/tracing.md explains
the tracks.

Cost when off: every hook in the library is one test of the module global
:data:`active` (``if _trace.active is not None:``), on paths that exist
anyway, allocating nothing. Everything else lives here and runs only while a
trace records.

Hooks re-read :data:`active` through the module functions below, so a trace
that ends in another thread between a hook's test and its call costs nothing
but a return. Nothing here takes a lock on the hot paths: appends and dict
stores are atomic under the GIL, and hooks run in whichever thread the
library runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Final

from . import _checks, _cuda, _events, _pools
from ._log import logger

if TYPE_CHECKING:
    from ._events import EventRecord
    from ._future import CudaFuture

__all__ = ["Trace", "trace"]

#: The trace that records now, or None. The one flag every hook tests.
active: Tracer | None = None

_start_lock: Final = threading.Lock()

#: pids of the trace file: the host, and GPU ``d`` as ``_GPU_PID + d``.
_HOST_PID: Final = 1
_GPU_PID: Final = 100

#: NVTX domain and colours (names the ``nvtx`` package knows without matplotlib).
_NVTX_DOMAIN: Final = "cudafut"
_NVTX_COLOURS: Final = {
    "future": "blue",
    "fn": "green",
    "wait": "yellow",
    "spin": "red",
    "sleep": "cyan",
    "wake-up": "orange",
}

#: Timing events kept for the next trace, per device; beyond this destroyed.
_MAX_FREE_TIMING: Final = 8192

#: Sleep between two looks at the GPU work of a trace that is ending.
_EXIT_POLL_S: Final = 1e-3


# -- the GPU clock --------------------------------------------------------------------


class _CudaTiming:
    """Timing events through ``_cuda`` (the seam): made only while tracing,
    pooled across traces. Tests replace the module's ``_timing`` with a fake
    of the same methods."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._ref_streams: dict[int, Any] = {}

    def usable(self) -> bool:
        """Whether CUDA is initialised in this process (records exist only then)."""
        return _cuda.initialised()

    def acquire(self, device: int) -> int:
        try:
            return self._free[device].pop()
        except (KeyError, IndexError):
            return _cuda.timing_event_create(device)

    def release(self, device: int, handle: int) -> None:
        free = self._free.setdefault(device, [])
        if len(free) < _MAX_FREE_TIMING:
            free.append(handle)
        else:
            _cuda.event_destroy(handle)

    def record(self, handle: int, stream: int, device: int) -> None:
        _cuda.event_record(handle, stream, device)

    def ref_stream(self, device: int) -> int:
        """An idle stream of the tracer's own: the reference event recorded
        there completes at once, whatever the application's streams run."""
        stream = self._ref_streams.get(device)
        if stream is None:
            stream = self._ref_streams[device] = _cuda.new_stream(device, 0)
        return int(stream.ptr)

    def elapsed_ms(self, ref: int, handle: int) -> float | None:
        """ms from ``ref`` to ``handle``, or None while ``handle`` is pending."""
        if _cuda.event_query(handle) != 0:
            return None
        return _cuda.event_elapsed_ms(ref, handle)

    def done(self, handle: int) -> bool:
        return bool(_cuda.event_query(handle) != _cuda.NOT_READY)


_timing: Any = _CudaTiming()


#: A timing event: (handle, device, stream key, host time it was recorded,
#: fid of the future whose GPU work it ends (0: none), the tick that work
#: started at (None: not known)). The ticks with a fid are the GPU spans.
Tick = tuple[int, int, tuple[int, ...], float, int, Any]
# What completing() hands to completed(): (tracer, fid, thread, t0, records).
Completing = tuple["Tracer", int, int, float, "tuple[EventRecord, ...]"]

# What the log holds: one tuple per hook call, the kind first. Folded into
# one _Future per future only when the file is written, so that recording
# costs a tuple and an append.
# Functions are logged as their code object (or their name, for callables
# without one), named when the file is written; never the function itself,
# which may hold arrays alive.
_CREATED: Final = 0  # (kind, fid, t, thread, code of the caller(s) of CudaFuture())
_CHAINED: Final = 1  # (kind, fid, parent fid or 0, fn)
_SET: Final = 2  # (kind, fid, thread, t0, t1, state, records)
_CALL: Final = 4  # (kind, fid, "then"|"submit"|"callback", fn, thread, t0, t1, error)
_WAIT: Final = 5  # (kind, fid, "await"|"result()", thread, t0, t1)


class _Span:
    """The GPU work of a future on one stream: from ``start`` (None: not
    known) to ``end``."""

    __slots__ = ("end", "key", "start")

    def __init__(self, key: tuple[int, ...], start: Tick | None, end: Tick) -> None:
        self.key = key
        self.start = start
        self.end = end


class _Future:
    """What a trace knows of one future (folded from the log when written)."""

    __slots__ = ("calls", "fid", "gpu", "label", "parent", "records", "set", "state", "t", "tid", "waits")

    def __init__(self, fid: int, label: str, t: float, tid: int) -> None:
        self.fid = fid
        self.label = label
        self.t = t
        self.tid = tid
        self.parent: _Future | None = None
        self.state = "pending"
        #: (thread, start, end) of set_result()/set_exception()/cancel(), with
        #: the listeners it ran (then() callbacks).
        self.set: tuple[int, float, float] | None = None
        self.records: tuple[EventRecord, ...] = ()
        self.gpu: list[_Span] = []
        #: (kind, name, thread, start, end, error): then()/submit() fn, done callbacks.
        self.calls: list[tuple[str, str, int, float, float, str | None]] = []
        #: (kind, thread, start, end): awaits and result() calls.
        self.waits: list[tuple[str, int, float, float]] = []


class _Waiter:
    """One waiter's track: its spins, sleeps and wake-ups, one after another."""

    __slots__ = ("name", "open", "slices", "tid")

    def __init__(self, name: str, tid: int) -> None:
        self.name = name
        self.tid = tid
        #: The range in progress: [kind, start, planned end (sleeps), nvtx range].
        self.open: list[Any] | None = None
        #: (kind, start, end, args, records seen).
        self.slices: list[tuple[str, float, float, dict[str, Any], tuple[EventRecord, ...]]] = []


_get_ident: Final = threading.get_ident
_now: Final = time.perf_counter


class Tracer:
    """The state of one recording trace; see :class:`Trace` for the public face.

    Hooks run in any thread; each appends to lists and stores into dicts
    (atomic under the GIL). Once :attr:`closed`, every hook returns at once.
    """

    def __init__(self, gpu_timing: bool | None, nvtx: Any) -> None:
        self.t0 = _now()
        self.wall0 = time.time()
        self.closed = False
        self.t_stop = 0.0
        self.log: list[tuple[Any, ...]] = []
        self._fids = itertools.count(1)
        #: id(future) -> fid. An id is reused only after its future died;
        #: a future made before the trace never shares one with a traced one.
        self._by_id: dict[int, int] = {}
        self._parents: dict[int, int] = {}  # then() child -> parent (0: not traced)
        self._fn_timed: set[int] = set()  # futures whose fn gave their GPU span
        self.threads: dict[int, str] = {}
        self._waiters: dict[Any, tuple[Callable[[], object], _Waiter]] = {}
        self.waiters: list[_Waiter] = []
        #: The traced future that made each record (for "seen by" and wake-up arrows).
        self.owner: dict[EventRecord, int] = {}
        #: The first sighting of each owned record: (time, waiter, slice index).
        self.seen: dict[EventRecord, tuple[float, _Waiter, int]] = {}
        self.ticks: list[Tick] = []
        self.last_tick: dict[tuple[int, ...], Tick] = {}
        self.refs: dict[int, Tick] = {}
        self.gpu_timing = gpu_timing
        self.gpu_error: str | None = None
        self.nvtx = nvtx
        self.faulted = False
        self._nv_futures: dict[int, Any] = {}
        self.open_nvtx: set[Any] = set()

    # -- tracks -------------------------------------------------------------------------

    def tid(self) -> int:
        ident = _get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        return ident

    def waiter(self, key: Any, owner: object, name: str) -> _Waiter:
        """The track of the waiter ``owner`` (a driver, kept weakly; None for
        the blocking waits of one thread)."""
        found = self._waiters.get(key)
        if found is not None and found[0]() is owner:
            return found[1]
        tid = self.tid()
        track = _Waiter(f"{name} ({self.threads[tid]})", tid)
        ref: Callable[[], object] = _no_owner if owner is None else weakref.ref(owner)
        self._waiters[key] = (ref, track)
        self.waiters.append(track)
        return track

    # -- NVTX ---------------------------------------------------------------------------

    def nv_start(self, message: str, kind: str, payload: int | None = None) -> Any:
        nv = self.nvtx
        if nv is None:
            return None
        rng = nv.start_range(message, color=_NVTX_COLOURS[kind], domain=_NVTX_DOMAIN, payload=payload)
        if rng is not None:
            self.open_nvtx.add(rng)
        return rng

    def nv_end(self, rng: Any) -> None:
        if rng is not None and self.nvtx is not None:
            self.open_nvtx.discard(rng)
            self.nvtx.end_range(rng)

    # -- GPU ticks ----------------------------------------------------------------------

    def tick(
        self, device: int, stream: int, key: tuple[int, ...], fid: int = 0, start: Tick | None = None
    ) -> Tick | None:
        """Record a timing event on ``stream`` now (ending the GPU work of
        future ``fid`` that began at ``start``); None without GPU timing."""
        if self.gpu_timing is False or self.closed:
            return None
        timing = _timing
        try:
            if self.gpu_timing is None:
                if not timing.usable():
                    return None
                self.gpu_timing = True
            if device not in self.refs:
                ref_handle = timing.acquire(device)
                ref_t = _now()
                timing.record(ref_handle, timing.ref_stream(device), device)
                self.refs[device] = (ref_handle, device, (device, -1), ref_t, 0, None)
            handle = timing.acquire(device)
            t = _now()
            timing.record(handle, stream, device)
        except Exception as exc:  # noqa: BLE001 - tracing must never break the traced work
            self.gpu_timing = False
            self.gpu_error = f"{type(exc).__name__}: {exc}"
            logger.warning("cudafut: trace: GPU timing turned off after an error: %s", self.gpu_error)
            return None
        tick = (handle, device, key, t, fid, start)
        self.ticks.append(tick)
        self.last_tick[key] = tick
        return tick

    # -- hooks (called through the module functions) -------------------------------------

    def created(self, fut: CudaFuture[Any], codes: CodeType | tuple[CodeType, ...]) -> None:
        if self.closed:
            return
        fid = next(self._fids)
        ident = _get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self._by_id[id(fut)] = fid
        self.log.append((_CREATED, fid, _now(), ident, codes))
        if self.nvtx is not None:
            self._nv_futures[fid] = self.nv_start(f"future {_label(codes)}", "future", fid)

    def chained(self, parent: CudaFuture[Any], child: CudaFuture[Any], fn: object) -> None:
        fid = None if self.closed else self._by_id.get(id(child))
        if fid is not None:
            parent_fid = self._by_id.get(id(parent), 0)
            self._parents[fid] = parent_fid
            self.log.append((_CHAINED, fid, parent_fid, _fn_key(fn)))

    def completing(self, fut: CudaFuture[Any], records: tuple[EventRecord, ...]) -> Completing | None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return None
        ident = _get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        t0 = _now()
        try:
            if self.nvtx is not None:
                self.nv_end(self._nv_futures.pop(fid, None))
            if records:
                self._own(fid, records)
        except Exception as exc:  # noqa: BLE001 - a tracer fault must not break the future
            logger.warning("cudafut: trace: a set could not be recorded: %r", exc)
        return (self, fid, ident, t0, records)

    def completed(self, token: Completing, state: object) -> None:
        _tr, fid, ident, t0, records = token
        self.log.append((_SET, fid, ident, t0, _now(), state, records))

    def _own(self, fid: int, records: tuple[EventRecord, ...]) -> None:
        owner = self.owner
        for rec in records:
            if rec in owner:
                continue  # a parent's (a follower, a gather): its span is the parent's
            owner[rec] = fid
            if fid in self._fn_timed or rec.t < self.t0:
                continue
            key = rec.stream_key
            if not _events.is_newest(rec):
                continue  # not the newest record on its stream
            if rec.stream == 2 and rec.stream_key[2] != _get_ident():
                continue  # another thread's per-thread stream: not reachable from here
            # Nothing was recorded on the stream since: a timing event now marks
            # the same point, and the previous one on the stream starts the work.
            self.tick(rec.device, rec.stream, key, fid, self.last_tick.get(key))

    def timed(
        self, fut: CudaFuture[Any], fn: Callable[..., Any], streams: Mapping[int, Any]
    ) -> Callable[..., Any]:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return fn
        name = _fn_key(fn)
        parent = self._parents.get(fid)
        kind = "submit" if parent is None else "then"
        self._fn_timed.add(fid)
        log = self.log

        def run(*args: Any, **kwargs: Any) -> Any:
            starts = []
            for device, stream in streams.items():
                key = (device, int(stream.ptr))
                prev = self.last_tick.get(key)
                if parent and prev is not None and prev[4] == parent:
                    starts.append(prev)  # right after the parent's work, on its stream
                else:  # after the wait on the parent's events, if any
                    tick = self.tick(device, key[1], key)
                    if tick is not None:
                        starts.append(tick)
            ident = self.tid()
            rng = None if self.nvtx is None else self.nv_start(f"{kind} {_name(name)}", "fn", fid)
            error: str | None = None
            t0 = _now()
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                error = repr(exc)
                raise
            finally:
                t1 = _now()
                if rng is not None:
                    self.nv_end(rng)
                log.append((_CALL, fid, kind, name, ident, t0, t1, error))
                if error is None:
                    for start in starts:
                        self.tick(start[1], start[2][1], start[2], fid, start)

        return run

    def timed_callback(self, fn: Callable[[Any], object], future: object) -> Callable[[Any], object]:
        fid = None if self.closed else self._by_id.get(id(future))
        if fid is None:
            return fn
        name = _fn_key(fn)

        def run(arg: Any) -> object:
            ident = self.tid()
            rng = None if self.nvtx is None else self.nv_start(f"callback {_name(name)}", "fn", fid)
            error: str | None = None
            t0 = _now()
            try:
                return fn(arg)
            except BaseException as exc:
                error = repr(exc)
                raise
            finally:
                t1 = _now()
                if rng is not None:
                    self.nv_end(rng)
                self.log.append((_CALL, fid, "callback", name, ident, t0, t1, error))

        return run

    def wait_start(self, fut: object, kind: str) -> tuple[int, float, Any] | None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return None
        return fid, _now(), None if self.nvtx is None else self.nv_start(kind, "wait", fid)

    def waited(self, kind: str, token: tuple[int, float, Any]) -> None:
        if self.closed:
            return
        fid, t0, rng = token
        if rng is not None:
            self.nv_end(rng)
        self.log.append((_WAIT, fid, kind, self.tid(), t0, _now()))

    def waited_at_once(self, fut: object, kind: str) -> None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is not None:
            t = _now()
            self.log.append((_WAIT, fid, kind, self.tid(), t, t))

    # The waiters' plans: each waiter's track holds one range at a time.

    def _close(self, w: _Waiter, t: float, timer_fired: bool | None = None) -> None:
        kind, start, planned, rng = w.open  # type: ignore[misc]
        w.open = None
        self.nv_end(rng)
        args: dict[str, Any] = {}
        if kind == "sleep":
            args["planned_us"] = round((planned - start) * 1e6, 1)
            if timer_fired is False:
                args["woken_early"] = True
            else:
                args["late_us"] = round(max(0.0, t - planned) * 1e6, 1)
        w.slices.append((kind, start, max(t, start), args, ()))

    def planned(self, w: _Waiter, delay: float | None, kind: str = "spin") -> None:
        if self.closed:
            return
        t = _now()
        opened = w.open
        if delay is None:
            if opened is not None:
                self._close(w, t)
            return
        if not delay:
            if opened is not None and opened[0] == kind:
                return  # spinning on
            if opened is not None:
                self._close(w, t)
            w.open = [kind, t, t, self.nv_start(kind, "spin")]
            return
        if opened is not None:
            self._close(w, t)
        w.open = ["sleep", t, t + delay, self.nv_start("sleep", "sleep")]

    def polled(
        self, w: _Waiter, now: float, timer_fired: bool | None, records: Sequence[EventRecord]
    ) -> None:
        if self.closed:
            return
        opened = w.open
        if opened is not None and (opened[0] == "sleep" or records):
            self._close(w, now, timer_fired)
        if records:
            self.wake(w, now, records)

    def wake(self, w: _Waiter, now: float, records: Sequence[EventRecord]) -> None:
        owner, seen = self.owner, self.seen
        index = len(w.slices)
        mine = []
        for rec in records:
            if rec in owner:
                mine.append(rec)
                if rec not in seen:
                    seen[rec] = (now, w, index)
        fids = sorted({owner[rec] for rec in mine})
        if self.nvtx is not None:
            self.nvtx.mark("wake-up", color=_NVTX_COLOURS["wake-up"], domain=_NVTX_DOMAIN)
        w.slices.append(("wake-up", now, _now(), {"futures": fids}, tuple(mine)))

    # -- the end --------------------------------------------------------------------------

    def stop(self) -> None:
        self.closed = True
        self.t_stop = _now()
        for w in self.waiters:
            if w.open is not None:
                self._close(w, self.t_stop)
        for rng in list(self.open_nvtx):
            self.nv_end(rng)

    def pending_gpu(self) -> list[Tick]:
        """The newest tick of each stream that has not completed (work on a
        stream completes in order: the older ones are complete when it is)."""
        if not self.gpu_timing:
            return []
        out = []
        for tick in list(self.last_tick.values()):
            try:
                if not _timing.done(tick[0]):
                    out.append(tick)
            except Exception:  # noqa: BLE001 - an error is not worth waiting for
                pass
        return out

    def wait_gpu(self, timeout: float) -> None:
        """Block (sleeping, GIL released) until the traced GPU work completed
        or ``timeout`` seconds passed."""
        deadline = _now() + timeout
        pending = self.pending_gpu()
        while pending and _now() < deadline:
            time.sleep(_EXIT_POLL_S)
            pending = [t for t in pending if not _timing.done(t[0])]

    async def wait_gpu_async(self, timeout: float) -> None:
        """As :meth:`wait_gpu`, sleeping on the running asyncio or trio loop."""
        sleep = _async_sleep()
        deadline = _now() + timeout
        pending = self.pending_gpu()
        while pending and _now() < deadline:
            await sleep(_EXIT_POLL_S)
            pending = [t for t in pending if not _timing.done(t[0])]

    def futures(self) -> list[_Future]:
        """Every traced future, folded from the log, in the order made."""
        futures: dict[int, _Future] = {}
        for entry in list(self.log):
            kind, fid = entry[0], entry[1]
            if kind == _CREATED:
                futures[fid] = _Future(fid, _label(entry[4]), entry[2], entry[3])
                continue
            f = futures[fid]
            if kind == _CHAINED:
                f.parent = futures.get(entry[2])
                f.label = f"then({_name(entry[3])})"
            elif kind == _SET:
                f.set = (entry[2], entry[3], entry[4])
                f.state = entry[5].value
                f.records = entry[6]
            elif kind == _CALL:
                kind_, fn, *rest = entry[2:]
                f.calls.append((kind_, _name(fn), *rest))
                if kind_ == "submit":
                    f.label = f"submit({_name(fn)})"
            elif kind == _WAIT:
                f.waits.append(entry[2:])
        for tick in list(self.ticks):
            if tick[4]:
                futures[tick[4]].gpu.append(_Span(tick[2], tick[5], tick))
        return list(futures.values())

    def document(self, error: BaseException | None) -> dict[str, Any]:
        """The trace-event JSON document (a dict); releases the timing events."""
        try:
            return _Writer(self).document(error)
        finally:
            self._release()

    def _release(self) -> None:
        if not self.gpu_timing:
            return
        try:
            for tick in [*self.refs.values(), *self.ticks]:
                _timing.release(tick[1], tick[0])
        except Exception as exc:  # noqa: BLE001 - at worst a few events leak
            logger.warning("cudafut: trace: could not release timing events: %s", exc)
        self.ticks.clear()
        self.refs.clear()
        self.last_tick.clear()


#: Functions that make futures for another one of cudafut's: the label names that one.
_INNER: Final = frozenset({"set_future", "complete_future", "__init__"})
#: Where cudafut's own code lives (labels name cudafut's public functions only).
_PACKAGE: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _label(codes: CodeType | tuple[CodeType, ...]) -> str:
    """What made a future, from the code of the functions that called
    ``CudaFuture()``, innermost first: cudafut's public function among them,
    or ``CudaFuture()`` for the application's own."""
    for code in (codes,) if isinstance(codes, CodeType) else codes:
        if not code.co_filename.startswith(_PACKAGE):
            break
        name = code.co_name
        if name not in _INNER and not name.startswith("_"):
            return name
    return "CudaFuture()"


def _no_owner() -> None:
    return None


def _fn_key(fn: object) -> str:
    """What the log keeps of a function: its qualified name (a string the
    function already holds: cheap, and it keeps nothing alive), shortened
    when the file is written."""
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    target = inner if inner is not None and callable(inner) else fn
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return str(name) if name else type(target).__name__


def _name(key: str) -> str:
    """A function's name for the file: ``f.<locals>.g`` is ``g``."""
    return key.rsplit("<locals>.", 1)[-1]


def _async_sleep() -> Callable[[float], Any]:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        trio = sys.modules.get("trio")
        if trio is None:
            raise RuntimeError("async with cudafut.trace(...) needs a running asyncio or trio loop") from None
        return trio.sleep  # type: ignore[no-any-return]
    return asyncio.sleep


async def _in_thread(fn: Callable[[], None]) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        trio = sys.modules["trio"]
        await trio.to_thread.run_sync(fn)
        return
    await loop.run_in_executor(None, fn)


# -- the file --------------------------------------------------------------------------------


class _Writer:
    """Turns a stopped tracer into trace-event dicts."""

    def __init__(self, tracer: Tracer) -> None:
        self.tr = tracer
        self.events: list[dict[str, Any]] = []
        self.meta: list[dict[str, Any]] = []
        self.host_tids: dict[int, int] = {}
        self.waiter_tids: dict[int, int] = {}
        self.stream_tids: dict[tuple[int, ...], tuple[int, int]] = {}
        self.ids = itertools.count(1)
        #: id(tick) -> µs on the timeline (None: pending or failed).
        self.times: dict[int, float | None] = {}

    def us(self, t: float) -> float:
        return round((t - self.tr.t0) * 1e6, 3)

    def slice(
        self, name: str, cat: str, t0: float, t1: float, pid: int, tid: int, args: dict[str, Any]
    ) -> dict[str, Any]:
        """An ``X`` event from host times ``t0`` to ``t1``."""
        ts = self.us(t0)
        event = _event("X", name, cat, ts, pid, tid, args, dur=round(max(0.0, self.us(t1) - ts), 3))
        self.events.append(event)
        return event

    # tracks

    def host_tid(self, ident: int) -> int:
        tid = self.host_tids.get(ident)
        if tid is None:
            tid = self.host_tids[ident] = len(self.host_tids) + 1
            self.meta.append(_thread_name(_HOST_PID, tid, self.tr.threads.get(ident, f"thread {ident}")))
            self.meta.append(_sort(_HOST_PID, tid, tid * 10))
        return tid

    def waiter_tid(self, w: _Waiter) -> int:
        """A waiter's track, sorted right after its thread's."""
        tid = self.waiter_tids.get(id(w))
        if tid is None:
            thread = self.host_tid(w.tid)
            tid = self.waiter_tids[id(w)] = 1000 + len(self.waiter_tids)
            self.meta.append(_thread_name(_HOST_PID, tid, f"waiter: {w.name}"))
            self.meta.append(_sort(_HOST_PID, tid, thread * 10 + min(9, len(self.waiter_tids))))
        return tid

    def stream_track(self, key: tuple[int, ...]) -> tuple[int, int]:
        track = self.stream_tids.get(key)
        if track is None:
            device = key[0]
            pid = _GPU_PID + device
            if not any(k[0] == device for k in self.stream_tids):
                self.meta += _process(pid, f"GPU {device}", 1 + device)
            tid = sum(1 for k in self.stream_tids if k[0] == device) + 1
            track = self.stream_tids[key] = (pid, tid)
            self.meta.append(_thread_name(pid, tid, _stream_name(key)))
            self.meta.append(_sort(pid, tid, tid))
        return track

    # GPU times

    def align(self) -> None:
        """Place every tick on the host timeline. Each device's offset is its
        reference event's host time, moved later where an event would
        otherwise have completed before the host recorded it (a reference
        that waited behind other work)."""
        tr = self.tr
        offsets: dict[int, float] = {}
        ticks = list(tr.ticks)
        for device, ref in tr.refs.items():
            offset = self.us(ref[3])
            for tick in ticks:
                if tick[1] != device:
                    continue
                try:
                    ms = _timing.elapsed_ms(ref[0], tick[0])
                except Exception:  # noqa: BLE001 - an event that failed has no time
                    ms = None
                if ms is None or math.isnan(ms):
                    self.times[id(tick)] = None
                    continue
                self.times[id(tick)] = ms * 1e3
                offset = max(offset, self.us(tick[3]) - ms * 1e3)
            offsets[device] = offset
        for tick in ticks:
            rel = self.times.get(id(tick))
            if rel is not None:
                self.times[id(tick)] = round(rel + offsets[tick[1]], 3)

    def at(self, tick: Tick | None) -> float | None:
        return None if tick is None else self.times.get(id(tick))

    # the document

    def document(self, error: BaseException | None) -> dict[str, Any]:
        tr = self.tr
        self.align()
        self.meta += _process(_HOST_PID, f"host (pid {os.getpid()})", 0)
        futures = tr.futures()
        slots: dict[int, dict[str, Any]] = {}  # fid -> its slices, for the flows
        for f in futures:
            slots[f.fid] = self.future(f)
        for w in list(tr.waiters):
            self.waiter(w, slots)
        for f in futures:
            self.then_flow(f, slots)
        self.events.sort(key=lambda e: e["ts"])
        other: dict[str, Any] = {
            "cudafut": _version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(tr.wall0)),
            "duration_us": self.us(tr.t_stop),
            "futures": len(futures),
            "gpu_incomplete": sum(s["incomplete"] for s in slots.values()),
            "gpu_timing": bool(tr.gpu_timing),
            "clock": "µs since the trace started (host perf_counter); GPU times from CUDA timing "
            "events, aligned to the host clock at a reference event per device",
        }
        if tr.gpu_error:
            other["gpu_timing_error"] = tr.gpu_error
        if error is not None:
            other["exception"] = repr(error)
        return {"traceEvents": self.meta + self.events, "displayTimeUnit": "ms", "otherData": other}

    def future(self, f: _Future) -> dict[str, Any]:
        name = f"#{f.fid} {f.label}"
        info: dict[str, Any] = {"future": f.fid, "label": f.label}
        if f.parent is not None:
            info["parent"] = f.parent.fid
        out: dict[str, Any] = {"incomplete": 0, "gpu": [], "host": None, "fn": None}
        tid = self.host_tid(f.tid)
        self.events.append(_event("i", f"create {name}", "future", self.us(f.t), _HOST_PID, tid, info, s="t"))
        if f.set is not None:
            ident, t0, t1 = f.set
            verb = {"set": "set", "failed": "fail", "cancelled": "cancel"}.get(f.state, f.state)
            args = {**info, "state": f.state}
            if f.records:
                args["devices"] = sorted({r.device for r in f.records})
                args["streams"] = [_stream_name(k) for k in dict.fromkeys(r.stream_key for r in f.records)]
            out["host"] = self.slice(
                f"{verb} {name}", "future", t0, t1, _HOST_PID, self.host_tid(ident), args
            )
        for kind, fn, ident, t0, t1, error in f.calls:
            args = {**info, "fn": fn}
            if error is not None:
                args["error"] = error
            call = self.slice(f"{kind} #{f.fid} {fn}", kind, t0, t1, _HOST_PID, self.host_tid(ident), args)
            if kind != "callback" and out["fn"] is None:
                out["fn"] = call
        seen = self.observed(f)
        for kind, ident, t0, t1 in f.waits:
            args = {**info, "observed_by": seen[1] if seen else "a query: done when looked at"}
            if seen:
                args["resumed_after_seen_us"] = round(max(0.0, self.us(t1) - self.us(seen[0])), 1)
            tid = self.host_tid(ident)
            if kind == "await":  # tasks overlap on a thread: an async slice each
                wid = next(self.ids)
                self.events.append(_event("b", "await", "await", self.us(t0), _HOST_PID, tid, args, id=wid))
                self.events.append(_event("e", "await", "await", self.us(t1), _HOST_PID, tid, None, id=wid))
            else:
                self.slice(f"{kind} #{f.fid}", "wait", t0, t1, _HOST_PID, tid, args)
        for span in f.gpu:
            # Your own CudaFuture()'s work was launched after it was made:
            # its start is no earlier (it may have no point before it).
            floor = self.us(f.t) if f.label == "CudaFuture()" else None
            self.span(name, info, span, seen, out, floor)
        if f.state == "pending":
            args = {**info, "state": "pending when the trace ended"}
            self.events.append(
                _event(
                    "i", f"never set {name}", "future", self.us(self.tr.t_stop), _HOST_PID, tid, args, s="t"
                )
            )
        return out

    def span(
        self,
        name: str,
        info: dict[str, Any],
        span: _Span,
        seen: tuple[float, str] | None,
        out: dict[str, Any],
        floor: float | None,
    ) -> None:
        pid, tid = self.stream_track(span.key)
        start, end = self.at(span.start), self.at(span.end)
        if floor is not None and end is not None and (start is None or start < floor):
            start = min(floor, end)
        args: dict[str, Any] = dict(info)
        if end is None:
            out["incomplete"] += 1
            args["incomplete"] = "the GPU work was still running when the trace was written"
            ts = self.us(self.tr.t_stop)
            self.events.append(_event("i", f"{name} (not complete)", "gpu", ts, pid, tid, args, s="t"))
            return
        if seen is not None:
            args["observed_by"] = seen[1]
            args["observed_late_us"] = round(max(0.0, self.us(seen[0]) - end), 1)
        if start is None or start > end:
            args["start"] = "unknown: the first point cudafut recorded on this stream in the trace"
            self.events.append(_event("i", f"{name} done", "gpu", end, pid, tid, args, s="t"))
            return
        args["gpu_us"] = round(end - start, 1)
        gpu = _event("X", name, "gpu", start, pid, tid, args, dur=round(end - start, 3))
        self.events.append(gpu)
        out["gpu"].append((span, gpu))

    def observed(self, f: _Future) -> tuple[float, str] | None:
        """When, and by which waiter, the last of ``f``'s records was seen complete."""
        best: tuple[float, str] | None = None
        for rec in f.records:
            seen = self.tr.seen.get(rec)
            if seen is None:
                return None
            if best is None or seen[0] > best[0]:
                best = (seen[0], seen[1].name)
        return best

    def waiter(self, w: _Waiter, slots: dict[int, dict[str, Any]]) -> None:
        owner, seen = self.tr.owner, self.tr.seen
        if not w.slices:
            return  # a waiter that only went idle: no track
        tid = self.waiter_tid(w)
        for index, (kind, t0, t1, args, records) in enumerate(w.slices):
            wake = self.slice(kind, "waiter", t0, t1, _HOST_PID, tid, args)
            for rec in records:
                fid, first = owner.get(rec), seen.get(rec)
                if fid is None or first is None or first[1] is not w or first[2] != index:
                    continue  # another wake-up saw it first
                for span, gpu in slots[fid]["gpu"]:
                    if span.key == rec.stream_key:
                        self.flow("wake-up", gpu, wake)

    def then_flow(self, f: _Future, slots: dict[int, dict[str, Any]]) -> None:
        if f.parent is None:
            return
        parent, child = slots[f.parent.fid], slots[f.fid]
        if parent["gpu"] and child["gpu"]:
            self.flow("then", parent["gpu"][0][1], child["gpu"][0][1])
        elif parent["host"] is not None and (child["fn"] or child["host"]) is not None:
            self.flow("then", parent["host"], child["fn"] or child["host"])

    def flow(self, cat: str, src: dict[str, Any], dst: dict[str, Any]) -> None:
        """An arrow from the end of slice ``src`` to the start of slice ``dst``
        (at points strictly inside each, where viewers bind them)."""
        if src["dur"] <= 0 or dst["dur"] <= 0:
            return
        fid = next(self.ids)
        s_ts = round(src["ts"] + src["dur"] - min(src["dur"] / 4, 0.01), 4)
        f_ts = round(dst["ts"] + min(dst["dur"] / 4, 0.01), 4)
        self.events.append(_event("s", cat, cat, s_ts, src["pid"], src["tid"], None, id=fid))
        self.events.append(_event("f", cat, cat, f_ts, dst["pid"], dst["tid"], None, id=fid, bp="e"))


def _event(
    ph: str, name: str, cat: str, ts: float, pid: int, tid: int, args: dict[str, Any] | None, **more: Any
) -> dict[str, Any]:
    event = {"ph": ph, "name": name, "cat": cat, "ts": ts, "pid": pid, "tid": tid, **more}
    if args is not None:
        event["args"] = args
    return event


def _process(pid: int, name: str, index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": index}},
    ]


def _thread_name(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _sort(pid: int, tid: int, index: int) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": index}}


def _stream_name(key: tuple[int, ...]) -> str:
    stream = key[1]
    if stream == 0:
        return "legacy default stream"
    if stream == 1:
        return "legacy default stream (cudaStreamLegacy)"
    if stream == 2:
        return (
            f"per-thread default stream (thread {key[2]:#x})" if len(key) > 2 else "per-thread default stream"
        )
    pooled = _pools.streams.lookup(stream, 0) is not None or _pools.streams.lookup(stream, -1024) is not None
    return f"stream {stream:#x}" + (" (cudafut pool)" if pooled else "")


def _version() -> str:
    cudafut = sys.modules.get("cudafut")
    return str(getattr(cudafut, "__version__", "?"))


def _write(path: Path, doc: dict[str, Any]) -> None:
    """One event a line (diffable, greppable), atomically (a temporary file
    renamed over ``path``)."""
    encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder: 5x faster
    lines = [encode(e) for e in doc["traceEvents"]]
    rest = {k: v for k, v in doc.items() if k != "traceEvents"}
    text = '{"traceEvents":[\n' + ",\n".join(lines) + "\n],\n"
    text += json.dumps(rest, ensure_ascii=False, indent=1)[1:].lstrip("\n") + "\n"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        # A full disk, a directory at ``path``, Ctrl-C: leave nothing behind.
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# -- the public face ---------------------------------------------------------------------------


class Trace:
    """A recording of every future made while it is active; see :func:`trace`.

    Use it as a context manager, ``with`` or ``async with``, or call
    :meth:`start` and :meth:`stop`; it records once. After the block,
    :attr:`events` holds the trace events written (and :attr:`path` the
    file, unless ``path`` was None).

    Making one costs nothing and blocks nothing; :meth:`start` imports
    ``nvtx`` when asked to. While it records, each future costs a few µs of
    host time and one or two CUDA timing events (docs/tracing.md, "What it
    costs"). Leaving a ``with`` block blocks the thread (:meth:`stop`);
    leaving an ``async with`` block blocks the loop for none of it.

    Raises:
        TypeError: ``path`` is neither a path nor None; ``nvtx`` or
            ``gpu_timing`` neither None nor a bool; ``timeout`` not a real number.
        ValueError: ``timeout`` is negative or NaN (huge means no limit).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        timeout: float = 5.0,
        nvtx: bool | None = None,
        gpu_timing: bool | None = None,
    ) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"trace() needs a file path (str or os.PathLike) or None, not {path!r}")
        seconds = _checks.timeout_seconds(timeout, "trace(timeout=...)")
        if nvtx is not None and not isinstance(nvtx, bool):
            raise TypeError(f"trace(nvtx=...) must be None, True or False, not {nvtx!r}")
        if gpu_timing is not None and not isinstance(gpu_timing, bool):
            raise TypeError(f"trace(gpu_timing=...) must be None, True or False, not {gpu_timing!r}")
        #: Where the file is written (None: no file, :attr:`events` only).
        self.path: Path | None = None if path is None else Path(path)
        #: Seconds the exit waits at most for the traced GPU work.
        self.timeout = seconds
        #: The trace events, once written (a list of dicts, as in the file).
        self.events: list[dict[str, Any]] | None = None
        self._nvtx = nvtx
        self._gpu_timing = gpu_timing
        self._tracer: Tracer | None = None
        self._used = False

    def __repr__(self) -> str:
        state = "recording" if self._tracer is not None else "written" if self.events is not None else "new"
        return f"<cudafut.Trace {state} path={str(self.path) if self.path else None!r}>"

    def start(self) -> Trace:
        """Start recording (what entering the block does); returns ``self``.

        Raises:
            RuntimeError: a trace records already (one at a time per
                process), or this one recorded before.
            ImportError: ``nvtx=True`` and the ``nvtx`` package is missing.
        """
        global active
        if self._used:
            raise RuntimeError(
                "this cudafut.Trace has recorded already: make a new one with cudafut.trace(path)"
            )
        nv = None
        if self._nvtx is not False:
            try:
                nv = importlib.import_module("nvtx")  # optional; lazily: only tracing needs it
            except ImportError:
                if self._nvtx:
                    raise ImportError(
                        "cudafut.trace(nvtx=True) needs the nvtx package: pip install nvtx"
                    ) from None
                nv = None
        with _start_lock:
            if active is not None:
                raise RuntimeError(
                    "a cudafut trace is recording already: traces record every future of the "
                    "process, so they cannot nest or overlap; end the other one first"
                )
            self._used = True
            self._tracer = Tracer(self._gpu_timing, nv)
            active = self._tracer
        return self

    def _stop(self) -> Tracer:
        global active
        tracer = self._tracer
        if tracer is None:
            raise RuntimeError("this cudafut.Trace is not recording")
        with _start_lock:
            if active is tracer:
                active = None
        tracer.stop()
        return tracer

    def _finish(self, tracer: Tracer, error: BaseException | None) -> None:
        """Build and write; a failure to write is raised, unless the block
        raised (then it is logged, and the block's exception goes on)."""
        self._tracer = None
        try:
            doc = tracer.document(error)
            self.events = doc["traceEvents"]
            if self.path is not None:
                _write(self.path, doc)
        except Exception as exc:
            if error is None:
                raise
            logger.error("cudafut: could not write the trace %s", self.path, exc_info=exc)

    def stop(self) -> None:
        """Stop recording, wait for the traced GPU work, write the file.

        What leaving a ``with`` block does. Blocks the calling thread: at most
        ``timeout`` seconds for GPU work still running (polling its timing
        events every ms, sleeping with the GIL released; what is still running
        then is marked incomplete), then the time to build and write the file
        (docs/tracing.md gives the cost per future). On an event loop, use
        ``async with`` instead, which blocks the loop for none of this.

        Raises:
            RuntimeError: this trace is not recording.
            OSError: the file could not be written.
        """
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        tracer = self._stop()
        try:
            tracer.wait_gpu(self.timeout)
        finally:
            self._finish(tracer, error)

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._end(exc)

    async def __aenter__(self) -> Trace:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tracer = self._stop()
        writing = False
        try:
            await tracer.wait_gpu_async(self.timeout)
            writing = True
            await _in_thread(lambda: self._finish(tracer, exc))
        except BaseException:
            if not writing:  # cancelled while waiting: write what there is, now
                self._finish(tracer, exc)
            raise


def trace(
    path: str | os.PathLike[str] | None,
    *,
    timeout: float = 5.0,
    nvtx: bool | None = None,
    gpu_timing: bool | None = None,
) -> Trace:
    """Record a timeline of every future made in the block; write it to ``path``.

    ::

        with cudafut.trace("trace.json"):
            ...                      # or: async with cudafut.trace(...)

    Open the file in https://ui.perfetto.dev or chrome://tracing
    (docs/tracing.md explains the tracks). For each future made inside the
    block, in any thread, it records: created; set, failed or cancelled
    (with the streams and devices of its events, and the ``then()``
    callbacks that ran inside); its GPU work, from the previous point cudafut
    recorded on the stream (for ``then()``/``submit()``: from just before
    ``fn`` enqueued it) to its event, measured with CUDA timing events; the
    waiter that saw it done, and when (a flow arrow from the GPU work); its
    ``then()`` and ``submit()`` functions and done callbacks with their host
    time; its awaits and ``result()`` calls; ``then()`` parent to child as
    flow arrows. Each waiter (the loop's, the watcher thread, a thread in
    ``result()``) has a track of its spins, sleeps (planned and how late they
    woke) and wake-ups, which says why a wake-up came late.

    Traces record the whole process, one at a time: starting one while
    another records raises :class:`RuntimeError` (nested or overlapping
    blocks, in any thread). Events after the block ends are not recorded.

    Args:
        path: the JSON file to write (``str`` or ``os.PathLike``), replaced
            if it exists; ``None``: write no file (see :attr:`Trace.events`,
            or use it for NVTX ranges alone).
        timeout: seconds the exit waits at most for traced GPU work still
            running; what is still running then is marked incomplete.
        nvtx: NVTX ranges for Nsight Systems: ``None`` (default) when the
            ``nvtx`` package is installed, ``True`` to require it, ``False``
            for none. Start/end ranges (futures overlap), in domain
            ``"cudafut"``: each future from created to set, each callback,
            await and ``result()``, each waiter spin and sleep.
        gpu_timing: ``None`` (default): time the GPU work when CUDA is in
            use; ``False``: record host events only, no timing event.

    Costs, only while recording: about 2-5 µs of host time per future
    (docs/tracing.md has the measured figures), two CUDA timing events per
    stream a ``then()``/``submit()`` runs on and one per event a producer
    records, and memory for the events until the file is written. Starting
    costs nothing on the GPU; the first timing event on each device records
    a reference event on a stream of the trace's own. Off (no trace
    recording), each hook in the library is one test of a module global.

    Leaving a ``with`` block blocks the thread (see :meth:`Trace.stop`):
    at most ``timeout`` seconds for the GPU, then the writing. Leaving an
    ``async with`` block waits for the GPU on the loop (polling every ms,
    never blocking it) and writes the file in a worker thread. The file is
    written when the block raises too (the exception goes on, and is noted
    in the file's ``otherData``).

    Raises:
        TypeError: ``path`` is neither a path nor None; ``nvtx`` or
            ``gpu_timing`` not None or a bool; ``timeout`` not a real number.
        ValueError: ``timeout`` is negative or NaN (huge means no limit).
    """
    return Trace(path, timeout=timeout, nvtx=nvtx, gpu_timing=gpu_timing)


# -- the hooks: ``if _trace.active is not None: _trace.<hook>(...)`` in the library ------------


def _fault(tr: Tracer, exc: Exception) -> None:
    """A fault of the tracer's own, in a hook: logged once per trace, and the
    traced work goes on as if no trace recorded (a trace must never break
    what it watches, least of all a waiter's poll)."""
    if not tr.faulted:
        tr.faulted = True
        logger.warning(
            "cudafut: trace: an event could not be recorded; the trace may miss some", exc_info=exc
        )


def created(fut: CudaFuture[Any]) -> None:
    """``CudaFuture.__init__``: a future was made (labelled by its maker)."""
    tr = active
    if tr is None:
        return
    try:
        # Who called CudaFuture() (0: here, 1: __init__), and, while that is
        # one of cudafut's helpers, who called it: named when the file is written.
        frame: FrameType | None = sys._getframe(2)
        code = frame.f_code  # type: ignore[union-attr]
        name = code.co_name
        if name not in _INNER and name[0] != "_":
            tr.created(fut, code)  # the common case: one frame
            return
        codes = [code]
        frame = frame.f_back  # type: ignore[union-attr]
        while frame is not None and len(codes) < 4:
            code = frame.f_code
            codes.append(code)
            name = code.co_name
            if name not in _INNER and name[0] != "_":
                break
            frame = frame.f_back
        tr.created(fut, tuple(codes))
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)


def chained(parent: CudaFuture[Any], child: CudaFuture[Any], fn: object) -> None:
    """``then()``: ``child`` runs ``fn`` once ``parent`` is set."""
    tr = active
    if tr is not None:
        try:
            tr.chained(parent, child, fn)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def completing(fut: CudaFuture[Any], records: tuple[EventRecord, ...]) -> Completing | None:
    """``_complete``/``cancel``: ``fut`` left the pending state with
    ``records`` and is about to wake its waiters and run its listeners (the
    traced set slice starts). Returns the token for :func:`completed`, or
    None when ``fut`` is not traced. Only observes: the future notifies."""
    tr = active
    if tr is None:
        return None
    try:
        return tr.completing(fut, records)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return None


def completed(token: Completing, state: object) -> None:
    """The future of :func:`completing`'s ``token`` woke its waiters and ran
    its listeners, ending in ``state`` (the traced set slice ends)."""
    tr = token[0]
    try:
        tr.completed(token, state)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)


def timed_fn(fut: CudaFuture[Any], fn: Callable[..., Any], streams: Mapping[int, Any]) -> Callable[..., Any]:
    """``_settle``: ``fn`` of a ``then()``/``submit()``, wrapped to time it."""
    tr = active
    if tr is None:
        return fn
    try:
        return tr.timed(fut, fn, streams)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return fn


def timed_callback(fn: Callable[[Any], object], future: object) -> Callable[[Any], object]:
    """``Driver.run_callback``: a done callback, wrapped to time it."""
    tr = active
    if tr is None:
        return fn
    try:
        return tr.timed_callback(fn, future)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return fn


def wait_start(fut: object, kind: str) -> tuple[int, float, Any] | None:
    """An await or ``result()`` begins; the token goes to :func:`waited`."""
    tr = active
    if tr is None:
        return None
    try:
        return tr.wait_start(fut, kind)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return None


def waited_at_once(fut: object, kind: str) -> None:
    """An await or ``result()`` found the future done already."""
    tr = active
    if tr is not None:
        try:
            tr.waited_at_once(fut, kind)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def waited(kind: str, token: tuple[int, float, Any]) -> None:
    """The await or ``result()`` of :func:`wait_start` returns."""
    tr = active
    if tr is not None:
        try:
            tr.waited(kind, token)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def _driver_track(tr: Tracer, driver: Any) -> _Waiter:
    return tr.waiter(id(driver), driver, getattr(driver, "name", type(driver).__name__))


def planned(driver: Any, delay: float | None, kind: str = "spin") -> None:
    """A driver's plan: ``None`` idle, ``0.0`` spin, else sleep ``delay`` s."""
    tr = active
    if tr is not None:
        try:
            tr.planned(_driver_track(tr, driver), delay, kind)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def polled(driver: Any, now: float, timer_fired: bool, fired: Sequence[tuple[Any, EventRecord]]) -> None:
    """``Driver.poll``: a poll at ``now`` ran what ``fired``."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_driver_track(tr, driver), now, timer_fired, [rec for _cb, rec in fired])
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def seen_alone(driver: Any, record: EventRecord, now: float) -> None:
    """``LoopDriver.spin_alone``: the awaiting task saw ``record`` complete."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_driver_track(tr, driver), now, None, (record,))
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def _blocking_track(tr: Tracer) -> _Waiter:
    return tr.waiter(("result", threading.get_ident()), None, "result()")


def blocking_planned(delay: float) -> None:
    """``block_until_complete``: spin (``0.0``) or sleep ``delay`` s."""
    tr = active
    if tr is not None:
        try:
            tr.planned(_blocking_track(tr), delay)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def blocking_seen(record: EventRecord, now: float) -> None:
    """``block_until_complete`` saw ``record`` complete at ``now``."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_blocking_track(tr), now, True, (record,))
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)
