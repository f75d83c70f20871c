"""Section 6, ``pipeline``: copy in / compute / copy out over N chunks:
cudafut (``to_device(chunk)``, ``.then(compute)``, ``to_host(future,
out=chunk)``), serial and hand-written multi-stream CuPy with events, with
pinned host chunks; the same cudafut code and a hand-written CuPy version
with pageable host chunks; a timeline of one run of each of two variants
(the plot)."""

from __future__ import annotations

import asyncio
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import cudafut
from cudafut import _pools

from .support.common import Progress, pyplot, save_figure

NAME = "pipeline"

PIPELINES = [(32, 16 << 20), (64, 4 << 20)]  # (chunks, float32 elements per chunk)
REPEATS = 7

# The variants (row names in the JSON and the tables), the ratios, the timelines.
SERIAL = "serial (one stream)"
HAND = "hand-written CuPy (3 streams + events)"
PER_CHUNK = "hand-written CuPy (a stream per chunk, 32)"
CUDAFUT = "cudafut to_device().then().to_host() + gather"
HAND_PAGEABLE = "hand-written CuPy, pageable (3 streams + events)"
CUDAFUT_PAGEABLE = "cudafut to_device().then().to_host() + gather, pageable"
CUDAFUT_OVER_HAND = "cudafut / hand-written"
CUDAFUT_OVER_SERIAL = "cudafut / serial"
HAND_OVER_SERIAL = "hand-written / serial"
CUDAFUT_OVER_PER_CHUNK = "cudafut / hand-written per chunk"
PAGEABLE_OVER_HAND = "cudafut pageable / hand-written pageable"
PAGEABLE_OVER_PINNED = "cudafut pageable / cudafut pinned"
TIMELINES = "timelines_ms"
COPY_IN, COMPUTE, COPY_OUT = "copy in", "compute", "copy out"  # the stages in a timeline
VARIANTS = (SERIAL, HAND, PER_CHUNK, CUDAFUT, HAND_PAGEABLE, CUDAFUT_PAGEABLE)
PAGEABLE = (HAND_PAGEABLE, CUDAFUT_PAGEABLE)  # the variants on pageable host chunks
#: Target (issue 10): cudafut / hand-written (pinned) at 16 MB chunks.
TARGET_RATIO, TARGET_CHUNK_MB = 0.95, 16

# CuPy and the GPU helpers, bound by _load() when run() starts, so that
# importing this module (report.py does) needs no CuPy. Module globals, as
# they always were, on the timed enqueue path.
cp: Any = None
cupyx: Any = None
gpu: Any = None
stream: Any = None


def _load() -> None:
    global cp, cupyx, gpu, stream
    cp = importlib.import_module("cupy")
    cupyx = importlib.import_module("cupyx")
    gpu = importlib.import_module(".support.gpu", __package__)
    stream = gpu.stream


def steps(quick: bool) -> int:
    return len(VARIANTS) * len(PIPELINES)


class Pipeline:
    """N chunks: host -> device, ``rounds`` of a*x+b, device -> host; the host
    chunks pinned (``h_in``, ``h_out``) or pageable (``p_in``, ``p_out``)."""

    def __init__(self, chunks: int, size: int, rounds: int) -> None:
        self.chunks, self.size, self.rounds = chunks, size, rounds
        self.h_in = [cupyx.empty_pinned(size, dtype="float32") for _ in range(chunks)]
        self.h_out = [cupyx.empty_pinned(size, dtype="float32") for _ in range(chunks)]
        self.p_in = [np.empty(size, dtype=np.float32) for _ in range(chunks)]
        self.p_out = [np.zeros(size, dtype=np.float32) for _ in range(chunks)]
        for i, (h, pg) in enumerate(zip(self.h_in, self.p_in, strict=True)):
            h[:] = i
            pg[:] = i
        self.d_in = [cp.empty(size, dtype=cp.float32) for _ in range(chunks)]
        self.d_out = [cp.empty(size, dtype=cp.float32) for _ in range(chunks)]
        self.timeline: list[tuple[str, int, int, Any, Any]] | None = None

    def _mark(self, stage: str, i: int) -> Callable[[], None]:
        if self.timeline is None:
            return lambda: None
        s = cp.cuda.get_current_stream()
        start = cp.cuda.Event()
        start.record(s)

        def end() -> None:
            stop = cp.cuda.Event()
            stop.record(s)
            assert self.timeline is not None
            self.timeline.append((stage, i, s.ptr, start, stop))

        return end

    def copy_in(self, i: int) -> Any:
        end = self._mark(COPY_IN, i)
        self.d_in[i].set(self.h_in[i])
        end()
        return self.d_in[i]

    def compute(self, i: int, x: Any) -> Any:
        end = self._mark(COMPUTE, i)
        gpu.axpb(x, self.d_out[i], 1.0001, 0.5, self.rounds)
        end()
        return self.d_out[i]

    def copy_out(self, i: int, y: Any) -> Any:
        end = self._mark(COPY_OUT, i)
        y.get(out=self.h_out[i], blocking=False)
        end()
        return self.h_out[i]

    def serial(self) -> None:
        t = time.perf_counter()
        with stream:
            for i in range(self.chunks):
                self.copy_out(i, self.compute(i, self.copy_in(i)))
        self.enqueue_s = time.perf_counter() - t
        stream.synchronize()

    def hand_written(self) -> None:
        """The classic: one stream per stage, events between stages."""
        s_in, s_comp, s_out = self._hand_streams
        t = time.perf_counter()
        for i in range(self.chunks):
            with s_in:
                x = self.copy_in(i)
                e1 = s_in.record()
            s_comp.wait_event(e1)
            with s_comp:
                y = self.compute(i, x)
                e2 = s_comp.record()
            s_out.wait_event(e2)
            with s_out:
                self.copy_out(i, y)
        self.enqueue_s = time.perf_counter() - t
        s_out.synchronize()

    def per_chunk_streams(self) -> None:
        """Hand-written, the way cudafut schedules it: each chunk's three
        stages on one stream, chunks round robin over 32 streams."""
        streams = self._chunk_streams
        t = time.perf_counter()
        for i in range(self.chunks):
            with streams[i % len(streams)]:
                self.copy_out(i, self.compute(i, self.copy_in(i)))
        self.enqueue_s = time.perf_counter() - t
        gpu.sync_all()

    def hand_written_pageable(self) -> None:
        """The classic on pageable host chunks. A copy from or to pageable
        memory blocks the host (the driver stages it), so each chunk's copy
        out is issued one chunk late: after the next chunk's copy in and
        compute are queued."""
        s_in, s_comp, s_out = self._hand_streams
        t = time.perf_counter()
        pending: tuple[int, Any] | None = None
        for i in range(self.chunks):
            with s_in:
                self.d_in[i].set(self.p_in[i])
                e1 = s_in.record()
            s_comp.wait_event(e1)
            with s_comp:
                gpu.axpb(self.d_in[i], self.d_out[i], 1.0001, 0.5, self.rounds)
                e2 = s_comp.record()
            if pending is not None:
                self._copy_out_pageable(*pending)
            pending = (i, e2)
        if pending is not None:
            self._copy_out_pageable(*pending)
        self.enqueue_s = time.perf_counter() - t
        s_out.synchronize()

    def _copy_out_pageable(self, i: int, computed: Any) -> None:
        s_out = self._hand_streams[2]
        s_out.wait_event(computed)
        with s_out:
            self.d_out[i].get(out=self.p_out[i])  # returns once the data is on the host

    async def with_cudafut(self, pageable: bool = False) -> None:
        h_in, h_out = (self.p_in, self.p_out) if pageable else (self.h_in, self.h_out)
        t = time.perf_counter()
        futs = []
        for i in range(self.chunks):
            x = self._to_device(i, h_in[i])
            y = x.then(lambda x, i=i: self.compute(i, x))  # type: ignore[misc]
            futs.append(self._to_host(i, y, h_out[i]))
        self.enqueue_s = time.perf_counter() - t
        await cudafut.gather(*futs)

    def _to_device(self, i: int, host: Any) -> cudafut.CudaFuture[Any]:
        if self.timeline is None:
            return cudafut.to_device(host)
        # The timeline run (pinned chunks): the copy stream to_device() would
        # take next, named, so that events around the call bracket the copy
        # (one cudaMemcpyAsync, enqueued within the call).
        s = _pools.copy_streams.get(cp.cuda.Device().id, 0)
        with s:
            end = self._mark(COPY_IN, i)
            x = cudafut.to_device(host, stream=s)
            end()
        return x

    def _to_host(self, i: int, fut: cudafut.CudaFuture[Any], out: Any) -> cudafut.CudaFuture[Any]:
        if self.timeline is None:
            return cudafut.to_host(fut, out=out)

        # The timeline run: what to_host(fut) does (the copy on the stream
        # then() makes current), between two events.
        def copy(y: Any) -> cudafut.CudaFuture[Any]:
            end = self._mark(COPY_OUT, i)
            back = cudafut.to_host(y, out=out, stream=cp.cuda.get_current_stream())
            end()
            return back

        return fut.then(copy)

    def outputs(self, variant: str) -> list[Any]:
        return self.p_out if variant in PAGEABLE else self.h_out

    def clear(self, outs: list[Any]) -> None:
        """Zero the chunks check() reads, so that a run that wrote nothing fails."""
        for i in (0, self.chunks - 1):
            outs[i].fill(0)

    def check(self, outs: list[Any]) -> None:
        for i in (0, self.chunks - 1):
            expect = cp.empty(self.size, dtype=cp.float32)
            gpu.axpb(cp.asarray(self.h_in[i]), expect, 1.0001, 0.5, self.rounds)
            if not (cp.asnumpy(expect) == outs[i]).all():
                raise AssertionError(f"pipeline chunk {i}: wrong output")

    def prepare(self) -> None:
        self._hand_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
        self._chunk_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(32)]


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    _load()
    return {
        f"{chunks} x {size * 4 >> 20} MB": _pipeline(progress, chunks, size) for chunks, size in PIPELINES
    }


def _pipeline(progress: Progress, chunks: int, size: int) -> dict[str, Any]:
    # Calibrate compute to take about as long as one copy: the overlap case.
    p = Pipeline(chunks, size, rounds=1)
    p.prepare()
    x, y = p.d_in[0], p.d_out[0]
    copy_t = _gpu_time(lambda: x.set(p.h_in[0]))
    per_round = _gpu_time(lambda: gpu.axpb(x, y, 1.0001, 0.5, 256)) / 256
    rounds = max(1, round(copy_t / per_round))
    p.rounds = rounds
    res: dict[str, Any] = {
        "chunks": chunks,
        "chunk_mb": size * 4 / 2**20,
        "rounds": rounds,
        "copy_in_ms": copy_t * 1e3,
    }
    loop = asyncio.new_event_loop()  # one loop for all runs, as a service has
    variants: dict[str, Callable[[], None]] = {
        SERIAL: p.serial,
        HAND: p.hand_written,
        PER_CHUNK: p.per_chunk_streams,
        CUDAFUT: lambda: loop.run_until_complete(p.with_cudafut()),
        HAND_PAGEABLE: p.hand_written_pageable,
        CUDAFUT_PAGEABLE: lambda: loop.run_until_complete(p.with_cudafut(pageable=True)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    enqueue: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
        gpu.sync_all()
    for _ in range(REPEATS):  # interleaved, so that drift hits all variants alike
        for name, fn in variants.items():
            p.clear(p.outputs(name))
            times[name].append(_wall(fn))
            enqueue[name].append(p.enqueue_s)
            p.check(p.outputs(name))
    for name in variants:
        med = statistics.median(times[name])
        res[name] = {
            "seconds_median": med,
            "seconds_all": times[name],
            "chunks_per_s": chunks / med,
            "host_enqueue_us_per_chunk": statistics.median(enqueue[name]) / chunks * 1e6,
        }
        progress.step(f"pipeline {chunks} x {size * 4 >> 20} MB: {name}: {chunks / med:.0f} chunks/s")
    hand = res[HAND]["chunks_per_s"]
    ser = res[SERIAL]["chunks_per_s"]
    mine = res[CUDAFUT]["chunks_per_s"]
    res[CUDAFUT_OVER_HAND] = mine / hand
    res[CUDAFUT_OVER_SERIAL] = mine / ser
    res[HAND_OVER_SERIAL] = hand / ser
    res[CUDAFUT_OVER_PER_CHUNK] = mine / res[PER_CHUNK]["chunks_per_s"]
    res[PAGEABLE_OVER_HAND] = res[CUDAFUT_PAGEABLE]["chunks_per_s"] / res[HAND_PAGEABLE]["chunks_per_s"]
    res[PAGEABLE_OVER_PINNED] = res[CUDAFUT_PAGEABLE]["chunks_per_s"] / mine
    print(
        f"pipeline {chunks} x {size * 4 >> 20} MB: cudafut / hand-written {res[CUDAFUT_OVER_HAND]:.3f} "
        f"(target {TARGET_RATIO} at {TARGET_CHUNK_MB} MB chunks); pageable chunks, cudafut / "
        f"hand-written {res[PAGEABLE_OVER_HAND]:.3f}",
        file=sys.stderr,
        flush=True,
    )
    # Timelines, in a separate instrumented run.
    timelines = {}
    for name in (HAND, CUDAFUT):
        p.timeline = []
        variants[name]()
        gpu.sync_all()
        ref = p.timeline[0][3]
        spans = [
            (stage, i, ptr, cp.cuda.get_elapsed_time(ref, a), cp.cuda.get_elapsed_time(ref, b))
            for stage, i, ptr, a, b in p.timeline
        ]
        t0 = min(span[3] for span in spans)
        timelines[name] = [(st, i, ptr, a - t0, b - t0) for st, i, ptr, a, b in spans]
        p.timeline = None
    loop.close()
    res[TIMELINES] = timelines
    return res


def _gpu_time(fn: Callable[[], object]) -> float:
    a, b = cp.cuda.Event(), cp.cuda.Event()
    fn()
    a.record()
    for _ in range(5):
        fn()
    b.record()
    b.synchronize()
    return float(cp.cuda.get_elapsed_time(a, b)) / 5 / 1e3


def _wall(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    gpu.sync_all()
    return time.perf_counter() - t


def _ratio(pipe: dict[str, Any], key: str) -> str:
    return f"{pipe[key]:.3f}" if key in pipe else "-"


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """cudafut / hand-written (pinned chunks) against TARGET_RATIO, at
    TARGET_CHUNK_MB chunks."""
    return {
        f"{label}: cudafut / hand-written >= {TARGET_RATIO}": pipe[CUDAFUT_OVER_HAND] >= TARGET_RATIO
        for label, pipe in result.items()
        if round(pipe["chunk_mb"]) == TARGET_CHUNK_MB
    }


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        "## 6. Pipeline: copy in, compute, copy out",
        "",
        "Chunks per second of each variant over those of hand-written CuPy (3 streams + events) on "
        "the same chunks, same run; pinned host chunks unless said pageable.",
        "",
        "| chunks | cudafut / hand-written | cudafut / hand-written per chunk | cudafut / serial | "
        "cudafut pageable / hand-written pageable | cudafut pageable / cudafut pinned |",
        "|---|---|---|---|---|---|",
    ]
    for label, pipe in result.items():
        lines.append(
            f"| {label} | **{pipe[CUDAFUT_OVER_HAND]:.3f}** | {_ratio(pipe, CUDAFUT_OVER_PER_CHUNK)} | "
            f"{_ratio(pipe, CUDAFUT_OVER_SERIAL)} | {_ratio(pipe, PAGEABLE_OVER_HAND)} | "
            f"{_ratio(pipe, PAGEABLE_OVER_PINNED)} |"
        )
    lines.append("")
    for name, ok in targets(result).items():
        lines += [f"Target (issue 10), {name}: {'met' if ok else '**missed**'}.", ""]
    for label, pipe in result.items():
        lines += [
            f"## 6. Pipeline, {label} chunks: copy in, compute, copy out",
            "",
            f"{pipe['chunks']} chunks of {pipe['chunk_mb']:.0f} MB; compute calibrated to one copy "
            f"({pipe['copy_in_ms']:.2f} ms).",
            "",
            "| variant | chunks/s | host enqueue µs / chunk |",
            "|---|---|---|",
        ]
        for k, v in pipe.items():
            if isinstance(v, dict) and "chunks_per_s" in v:
                lines.append(f"| {k} | {v['chunks_per_s']:.0f} | {v['host_enqueue_us_per_chunk']:.0f} |")
        lines += [
            "",
            f"cudafut / hand-written: {pipe[CUDAFUT_OVER_HAND]:.3f}; cudafut / serial: "
            f"{pipe[CUDAFUT_OVER_SERIAL]:.2f}; hand-written / serial: {pipe[HAND_OVER_SERIAL]:.2f}; "
            "cudafut / hand-written with a stream per chunk: "
            f"{pipe[CUDAFUT_OVER_PER_CHUNK]:.3f}"
            + (
                f"; pageable chunks, cudafut / hand-written: {pipe[PAGEABLE_OVER_HAND]:.3f}, "
                f"cudafut pageable / pinned: {pipe[PAGEABLE_OVER_PINNED]:.3f}"
                if PAGEABLE_OVER_HAND in pipe
                else ""
            )
            + ".",
            "",
        ]
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """The timelines of the first pipeline."""
    pipes = list(result.values())
    if not (pipes and pipes[0].get(TIMELINES)):
        return []
    plt = pyplot()
    if plt is None:
        return []
    tls = pipes[0][TIMELINES]
    fig, axes = plt.subplots(len(tls), 1, figsize=(13, 2.2 + 1.2 * len(tls)), sharex=True)
    colors = {COPY_IN: "tab:blue", COMPUTE: "tab:orange", COPY_OUT: "tab:green"}
    for ax, (name, events) in zip(list(axes), tls.items(), strict=True):
        streams = sorted({e[2] for e in events})
        for stage, _i, ptr, a, b in events:
            ax.barh(streams.index(ptr), b - a, left=a, color=colors[stage], height=0.8)
        ax.set_yticks(range(len(streams)), [f"stream {k}" for k in range(len(streams))], fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[-1].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right")
    return [save_figure(plt, fig, out / f"{stem}-pipeline.png")]
