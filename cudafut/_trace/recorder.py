"""The recorder: the state of one recording trace (:class:`Tracer`).

Each hook call appends a tuple to its log (or a slice to a waiter's track,
a tick to its timing events); nothing is folded until the file is written
(``writer``). It observes only: the library completes and notifies its
futures, and hands the recorder what happened.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import CodeType
from typing import TYPE_CHECKING, Any, Final

from .. import _events
from .._log import logger
from . import pool

if TYPE_CHECKING:
    from .._events import EventRecord


#: NVTX domain and colours (names the ``nvtx`` package knows without matplotlib).
NVTX_DOMAIN: Final = "cudafut"
NVTX_COLOURS: Final = {
    "future": "blue",
    "fn": "green",
    "wait": "yellow",
    "spin": "red",
    "sleep": "cyan",
    "wake-up": "orange",
}

#: Sleep between two looks at the GPU work of a trace that is ending.
_EXIT_POLL_S: Final = 1e-3


#: A timing event: (handle, device, stream key, host time it was recorded,
#: fid of the future whose GPU work it ends (0: none), the tick that work
#: started at (None: not known)). The ticks with a fid are the GPU spans.
Tick = tuple[int, int, tuple[int, ...], float, int, Any]
# What completing() hands to completed(): (tracer, fid, thread, t0, records).
Completing = tuple["Tracer", int, int, float, "tuple[EventRecord, ...]"]

# What the log holds: one tuple per hook call, the kind first. Folded into
# one Traced per future only when the file is written, so that recording
# costs a tuple and an append.
# Functions are logged as their code object (or their name, for callables
# without one), named when the file is written; never the function itself,
# which may hold arrays alive.
_CREATED: Final = 0  # (kind, fid, t, thread, code of the caller(s) of CudaFuture())
_CHAINED: Final = 1  # (kind, fid, parent fid or 0, fn)
_SET: Final = 2  # (kind, fid, thread, t0, t1, state, records)
_CALL: Final = 4  # (kind, fid, "then"|"submit"|"callback", fn, thread, t0, t1, error)
_WAIT: Final = 5  # (kind, fid, "await"|"result()", thread, t0, t1)


class Span:
    """The GPU work of a future on one stream: from ``start`` (None: not
    known) to ``end``."""

    __slots__ = ("end", "key", "start")

    def __init__(self, key: tuple[int, ...], start: Tick | None, end: Tick) -> None:
        self.key = key
        self.start = start
        self.end = end


class Traced:
    """What a trace knows of one future (folded from the log when written)."""

    __slots__ = ("calls", "fid", "gpu", "label", "parent", "records", "set", "state", "t", "tid", "waits")

    def __init__(self, fid: int, label: str, t: float, tid: int) -> None:
        self.fid = fid
        self.label = label
        self.t = t
        self.tid = tid
        self.parent: Traced | None = None
        self.state = "pending"
        #: (thread, start, end) of set_result()/set_exception()/cancel(), with
        #: the listeners it ran (then() callbacks).
        self.set: tuple[int, float, float] | None = None
        self.records: tuple[EventRecord, ...] = ()
        self.gpu: list[Span] = []
        #: (kind, name, thread, start, end, error): then()/submit() fn, done callbacks.
        self.calls: list[tuple[str, str, int, float, float, str | None]] = []
        #: (kind, thread, start, end): awaits and result() calls.
        self.waits: list[tuple[str, int, float, float]] = []


class Track:
    """One waiter's track: its spins, sleeps and wake-ups, one after another."""

    __slots__ = ("name", "open", "slices", "tid")

    def __init__(self, name: str, tid: int) -> None:
        self.name = name
        self.tid = tid
        #: The range in progress: [kind, start, planned end (sleeps), nvtx range].
        self.open: list[Any] | None = None
        #: (kind, start, end, args, records seen).
        self.slices: list[tuple[str, float, float, dict[str, Any], tuple[EventRecord, ...]]] = []


get_ident: Final = threading.get_ident
clock: Final = time.perf_counter


class Tracer:
    """The state of one recording trace; see :class:`Trace` for the public face.

    Hooks run in any thread; each appends to lists and stores into dicts
    (atomic under the GIL). Once :attr:`closed`, every hook returns at once.
    """

    def __init__(self, gpu_timing: bool | None, nvtx: Any) -> None:
        self.t0 = clock()
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
        self._waiters: dict[Any, tuple[Callable[[], object], Track]] = {}
        self.waiters: list[Track] = []
        #: The traced future that made each record (for "seen by" and wake-up arrows).
        self.owner: dict[EventRecord, int] = {}
        #: The first sighting of each owned record: (time, waiter, slice index).
        self.seen: dict[EventRecord, tuple[float, Track, int]] = {}
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
        ident = get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        return ident

    def waiter(self, key: Any, owner: object, name: str) -> Track:
        """The track of the waiter ``owner`` (a driver, kept weakly; None for
        the blocking waits of one thread)."""
        found = self._waiters.get(key)
        if found is not None and found[0]() is owner:
            return found[1]
        tid = self.tid()
        track = Track(f"{name} ({self.threads[tid]})", tid)
        ref: Callable[[], object] = no_owner if owner is None else weakref.ref(owner)
        self._waiters[key] = (ref, track)
        self.waiters.append(track)
        return track

    # -- NVTX ---------------------------------------------------------------------------

    def nv_start(self, message: str, kind: str, payload: int | None = None) -> Any:
        nv = self.nvtx
        if nv is None:
            return None
        rng = nv.start_range(message, color=NVTX_COLOURS[kind], domain=NVTX_DOMAIN, payload=payload)
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
        timing = pool.timing
        try:
            if self.gpu_timing is None:
                if not timing.usable():
                    return None
                self.gpu_timing = True
            if device not in self.refs:
                ref_handle = timing.acquire(device)
                ref_t = clock()
                timing.record(ref_handle, timing.ref_stream(device), device)
                self.refs[device] = (ref_handle, device, (device, -1), ref_t, 0, None)
            handle = timing.acquire(device)
            t = clock()
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

    def created(self, fut: object, codes: CodeType | tuple[CodeType, ...] | str) -> None:
        if self.closed:
            return
        fid = next(self._fids)
        ident = get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self._by_id[id(fut)] = fid
        self.log.append((_CREATED, fid, clock(), ident, codes))
        if self.nvtx is not None:
            self._nv_futures[fid] = self.nv_start(f"future {label_of(codes)}", "future", fid)

    def chained(self, parent: object, child: object, fn: object) -> None:
        fid = None if self.closed else self._by_id.get(id(child))
        if fid is not None:
            parent_fid = self._by_id.get(id(parent), 0)
            self._parents[fid] = parent_fid
            self.log.append((_CHAINED, fid, parent_fid, fn_key(fn)))

    def completing(self, fut: object, records: tuple[EventRecord, ...]) -> Completing | None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return None
        ident = get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        t0 = clock()
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
        self.log.append((_SET, fid, ident, t0, clock(), state, records))

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
            if rec.stream == 2 and rec.stream_key[2] != get_ident():
                continue  # another thread's per-thread stream: not reachable from here
            # Nothing was recorded on the stream since: a timing event now marks
            # the same point, and the previous one on the stream starts the work.
            self.tick(rec.device, rec.stream, key, fid, self.last_tick.get(key))

    def timed(self, fut: object, fn: Callable[..., Any], streams: Mapping[int, Any]) -> Callable[..., Any]:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return fn
        name = fn_key(fn)
        parent = self._parents.get(fid)
        kind = "submit" if parent is None else "then"
        self._fn_timed.add(fid)

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
            result = self._call_timed(kind, name, fid, fn, args, kwargs)
            for start in starts:  # not after an exception: fn enqueued nothing to follow
                self.tick(start[1], start[2][1], start[2], fid, start)
            return result

        return run

    def timed_callback(self, fn: Callable[[Any], object], future: object) -> Callable[[Any], object]:
        fid = None if self.closed else self._by_id.get(id(future))
        if fid is None:
            return fn
        name = fn_key(fn)

        def run(arg: Any) -> object:
            return self._call_timed("callback", name, fid, fn, (arg,), {})

        return run

    def _call_timed(
        self,
        kind: str,
        name: str,
        fid: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``fn(*args, **kwargs)`` inside an NVTX range (if on), its host
        interval and error logged as a ``_CALL`` of ``kind``; re-raises."""
        ident = self.tid()
        rng = None if self.nvtx is None else self.nv_start(f"{kind} {short_name(name)}", "fn", fid)
        error: str | None = None
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            t1 = clock()
            if rng is not None:
                self.nv_end(rng)
            self.log.append((_CALL, fid, kind, name, ident, t0, t1, error))

    def wait_start(self, fut: object, kind: str) -> tuple[int, float, Any] | None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is None:
            return None
        return fid, clock(), None if self.nvtx is None else self.nv_start(kind, "wait", fid)

    def waited(self, kind: str, token: tuple[int, float, Any]) -> None:
        if self.closed:
            return
        fid, t0, rng = token
        if rng is not None:
            self.nv_end(rng)
        self.log.append((_WAIT, fid, kind, self.tid(), t0, clock()))

    def waited_at_once(self, fut: object, kind: str) -> None:
        fid = None if self.closed else self._by_id.get(id(fut))
        if fid is not None:
            t = clock()
            self.log.append((_WAIT, fid, kind, self.tid(), t, t))

    # The waiters' plans: each waiter's track holds one range at a time.

    def _close(self, w: Track, t: float, timer_fired: bool | None = None) -> None:
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

    def planned(self, w: Track, delay: float | None, kind: str = "spin") -> None:
        if self.closed:
            return
        t = clock()
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

    def polled(self, w: Track, now: float, timer_fired: bool | None, records: Sequence[EventRecord]) -> None:
        if self.closed:
            return
        opened = w.open
        if opened is not None and (opened[0] == "sleep" or records):
            self._close(w, now, timer_fired)
        if records:
            self.wake(w, now, records)

    def wake(self, w: Track, now: float, records: Sequence[EventRecord]) -> None:
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
            self.nvtx.mark("wake-up", color=NVTX_COLOURS["wake-up"], domain=NVTX_DOMAIN)
        w.slices.append(("wake-up", now, clock(), {"futures": fids}, tuple(mine)))

    # -- the end --------------------------------------------------------------------------

    def stop(self) -> None:
        self.closed = True
        self.t_stop = clock()
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
                if not pool.timing.done(tick[0]):
                    out.append(tick)
            except Exception:  # noqa: BLE001 - an error is not worth waiting for
                pass
        return out

    def wait_gpu(self, timeout: float) -> None:
        """Block (sleeping, GIL released) until the traced GPU work completed
        or ``timeout`` seconds passed."""
        deadline = clock() + timeout
        pending = self.pending_gpu()
        while pending and clock() < deadline:
            time.sleep(_EXIT_POLL_S)
            pending = [t for t in pending if not pool.timing.done(t[0])]

    async def wait_gpu_async(self, timeout: float, sleep: Callable[[float], Awaitable[object]]) -> None:
        """As :meth:`wait_gpu`, sleeping with ``sleep`` (the running loop's
        library's ``sleep``)."""
        deadline = clock() + timeout
        pending = self.pending_gpu()
        while pending and clock() < deadline:
            await sleep(_EXIT_POLL_S)
            pending = [t for t in pending if not pool.timing.done(t[0])]

    def futures(self) -> list[Traced]:
        """Every traced future, folded from the log, in the order made."""
        futures: dict[int, Traced] = {}
        for entry in list(self.log):
            kind, fid = entry[0], entry[1]
            if kind == _CREATED:
                futures[fid] = Traced(fid, label_of(entry[4]), entry[2], entry[3])
                continue
            f = futures[fid]
            if kind == _CHAINED:
                f.parent = futures.get(entry[2])
                f.label = f"then({short_name(entry[3])})"
            elif kind == _SET:
                f.set = (entry[2], entry[3], entry[4])
                f.state = entry[5].value
                f.records = entry[6]
            elif kind == _CALL:
                kind_, fn, *rest = entry[2:]
                f.calls.append((kind_, short_name(fn), *rest))
                if kind_ == "submit":
                    f.label = f"submit({short_name(fn)})"
            elif kind == _WAIT:
                f.waits.append(entry[2:])
        for tick in list(self.ticks):
            if tick[4]:
                futures[tick[4]].gpu.append(Span(tick[2], tick[5], tick))
        return list(futures.values())

    def release(self) -> None:
        """Give the timing events back to the pool (once written)."""
        if not self.gpu_timing:
            return
        try:
            for tick in [*self.refs.values(), *self.ticks]:
                pool.timing.release(tick[1], tick[0])
        except Exception as exc:  # noqa: BLE001 - at worst a few events leak
            logger.warning("cudafut: trace: could not release timing events: %s", exc)
        self.ticks.clear()
        self.refs.clear()
        self.last_tick.clear()


#: Functions that make futures for another one of cudafut's: the label names that one.
INNER: Final = frozenset({"set_future", "complete_with", "__init__"})
#: Where cudafut's own code lives (labels name cudafut's public functions only).
PACKAGE: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def label_of(codes: CodeType | tuple[CodeType, ...] | str) -> str:
    """What made a future, from the code of the functions that called
    ``CudaFuture()``, innermost first: cudafut's public function among them,
    or ``CudaFuture()`` for the application's own; or the name a compiled
    maker gave (``hooks.make``)."""
    if isinstance(codes, str):
        return codes
    for code in (codes,) if isinstance(codes, CodeType) else codes:
        if not code.co_filename.startswith(PACKAGE):
            break
        name = code.co_name
        if name not in INNER and not name.startswith("_"):
            return name
    return "CudaFuture()"


def no_owner() -> None:
    return None


def fn_key(fn: object) -> str:
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


def short_name(key: str) -> str:
    """A function's name for the file: ``f.<locals>.g`` is ``g``."""
    return key.rsplit("<locals>.", 1)[-1]
