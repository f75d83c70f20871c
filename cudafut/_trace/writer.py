"""The file: a stopped :class:`~.recorder.Tracer`'s log, written as a
Chrome trace-event JSON document (https://ui.perfetto.dev, chrome://tracing;
docs/tracing.md explains the tracks)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .. import _pools
from . import pool
from .recorder import Span, Tick, Traced, Tracer, Track

if TYPE_CHECKING:
    pass


#: pids of the trace file: the host, and GPU ``d`` as ``_GPU_PID + d``.
_HOST_PID: Final = 1
_GPU_PID: Final = 100


def document(tracer: Tracer, error: BaseException | None) -> dict[str, Any]:
    """The trace-event JSON document (a dict) of a stopped ``tracer``;
    releases its timing events."""
    try:
        return _Writer(tracer).document(error)
    finally:
        tracer.release()


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

    def waiter_tid(self, w: Track) -> int:
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
                    ms = pool.timing.elapsed_ms(ref[0], tick[0])
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

    def future(self, f: Traced) -> dict[str, Any]:
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
        span: Span,
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

    def observed(self, f: Traced) -> tuple[float, str] | None:
        """When, and by which waiter, the last of ``f``'s records was seen complete."""
        best: tuple[float, str] | None = None
        for rec in f.records:
            seen = self.tr.seen.get(rec)
            if seen is None:
                return None
            if best is None or seen[0] > best[0]:
                best = (seen[0], seen[1].name)
        return best

    def waiter(self, w: Track, slots: dict[int, dict[str, Any]]) -> None:
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

    def then_flow(self, f: Traced, slots: dict[int, dict[str, Any]]) -> None:
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


def write_file(path: Path, doc: dict[str, Any]) -> None:
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
