"""The hot path, step by step: what each internal step of ``record()``,
``await`` and ``then()`` costs, beside the CUDA and CuPy calls beneath it.

On a machine with a GPU, from a source checkout::

    python -m benchmarks.support.steps            # the core in force
    CUDAFUT_PURE=1 python -m benchmarks.support.steps --profile

Prints one line per step: µs per call, best of five timings of 20,000
calls; then the ``host`` section's own await rows (``benchmarks/host.py``).
``--profile`` adds a cProfile of 20,000 ``record()``, a chain of 3,000
``then()`` and 20,000 awaits (on the pure core, where cudafut's own
functions show). A diagnostic, not a benchmark section: it names where the
time goes; ``python -m cudafut bench --only host`` is what is compared.

The raw rows (``ctypes`` calls of the driver, CuPy's runtime calls) are the
floor beneath cudafut: a ``ctypes`` call itself costs about what
``ctypes libc getpid`` shows.
"""

from __future__ import annotations

import asyncio
import cProfile
import ctypes
import io
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import cupy as cp

import cudafut
from cudafut import (
    _backend,
    _compiled,
    _cuda,
    _engine,
    _event_calls,
    _events,
    _memory,
    _pools,
    _torch,
    _values,
)
from cudafut._future import CudaFuture
from cudafut._interface import new_future, set_future

from .. import host
from ..host import per_call_us

N = 20_000


def best_us(fn: Callable[[], object], n: int = N) -> float:
    """µs per ``fn()``, best of five timings of ``n`` calls, after a warm-up."""
    per_call_us(fn, n // 10)
    return min(per_call_us(fn, n) for _ in range(5))


def _row(name: str, us: float) -> None:
    print(f"{name:55s} {us:8.3f} us", flush=True)


def steps(stream: Any, token: Any) -> None:
    """The synchronous steps, timed one by one on ``stream`` (current)."""
    ptr = int(stream.ptr)
    handle = _pools.events.acquire(0)
    record = _events.record(ptr, 0)
    records = (record,)
    stream.synchronize()
    rt = cp.cuda.runtime
    libc = ctypes.CDLL(None)
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libcuda.cuEventQuery.argtypes = [ctypes.c_void_p]
    current = _backend.current.current_stream(0)
    consumers = [(int(current.ptr), 0, current)]

    def consumer(_device: int) -> tuple[int, int]:
        return ptr, 0

    key = (0, ptr)

    def numbered() -> None:
        _events._sequence[key] = next(_events._counters[key])

    rows: list[tuple[str, Callable[[], object]]] = [
        ("empty python call", lambda: None),
        ("ctypes libc getpid", libc.getpid),
        ("ctypes cuEventRecord", lambda: libcuda.cuEventRecord(handle, ptr)),
        ("ctypes cuEventQuery", lambda: libcuda.cuEventQuery(handle)),
        ("cupy rt.eventRecord", lambda: rt.eventRecord(handle, ptr)),
        ("cupy rt.eventQuery", lambda: rt.eventQuery(handle)),
        ("cupy Event() + record", lambda: cp.cuda.Event(disable_timing=True).record(stream)),
        ("_backend.current.event_record", lambda: _backend.current.event_record(handle, ptr, 0)),
        ("_event_calls.event_query", lambda: _event_calls.event_query(handle)),
        ("rt.getDevice", rt.getDevice),
        ("pool acquire+release", lambda: _pools.events.release(0, _pools.events.acquire(0))),
        ("_events.record(ptr,0) (+drop)", lambda: _events.record(ptr, 0)),
        ("perf_counter", time.perf_counter),
        ("numbering (_counters)", numbered),
        ("_cuda.stream_handle(stream)", lambda: _cuda.stream_handle(stream)),
        ("_backend.current.current_stream(0)", lambda: _backend.current.current_stream(0)),
        ("cp.cuda.get_current_stream(0)", lambda: cp.cuda.get_current_stream(0)),
        ("order_foreign(token, lam)", lambda: _values.order_foreign(token, consumer)),
        ("find_devices(token)", lambda: _values.find_devices(token)),
        ("gpu_arrays(token)", lambda: _values.gpu_arrays(token)),
        ("_torch.loaded()", _torch.loaded),
        ("CudaFuture()", CudaFuture),
        ("new_future('record')", lambda: new_future("record")),
        ("set_future(token, recs)", lambda: set_future(token, records, None, "record")),
        (
            "record_current_consumers",
            lambda: _engine.record_current_consumers(token, records, untracked=False),
        ),
        ("record_streams_of", lambda: _memory.record_streams_of([token], consumers, untracked=False)),
        ("cudafut.record(token)", lambda: cudafut.record(token)),
        ("cudafut.record(token, stream=)", lambda: cudafut.record(token, stream=stream)),
        ("CudaFuture(devices=0).set_result", lambda: CudaFuture(devices=0).set_result(token)),
    ]
    for name, fn in rows:
        _row(name, best_us(fn))
    done = cudafut.record(token, stream=stream)
    done.result()
    _row("done.done()", best_us(done.done))
    _row("done._outcome", best_us(lambda: done._outcome(cudafut.CancelledError)))
    _row("done.result()", best_us(done.result))
    stream.synchronize()
    _pools.events.release(0, handle)


def then_per_link(stream: Any, token: Any, links: int = 1000) -> float:
    fut: CudaFuture[Any] = cudafut.record(token, stream=stream)
    t = time.perf_counter()
    for _ in range(links):
        fut = fut.then(lambda v: v)
    per = (time.perf_counter() - t) / links * 1e6
    fut.result()
    return per


def profile(stream: Any, token: Any) -> str:
    """The top 45 functions by own time over the three operations."""

    def work() -> None:
        with stream:
            for _ in range(N):
                cudafut.record(token, stream=stream)
        fut: CudaFuture[Any] = cudafut.record(token, stream=stream)
        for _ in range(3000):
            fut = fut.then(lambda v: v)
        fut.result()

        async def await_all() -> None:
            futs = [cudafut.record(token, stream=stream) for _ in range(N)]
            stream.synchronize()
            for f in futs:
                await f

        asyncio.run(await_all())

    profiler = cProfile.Profile()
    profiler.enable()
    work()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(45)
    return out.getvalue()


def main(argv: list[str]) -> None:
    print("core:", _compiled.core())
    stream = cp.cuda.Stream(non_blocking=True)
    token = cp.zeros(1, dtype=cp.float32)
    with stream:
        steps(stream, token)
    for name, value in host._awaits(stream, token).items():  # the host section's await rows (µs, ratios)
        print(f"{name:55s} {value:8.3f}", flush=True)
    then_per_link(stream, token)
    _row("then() per link", min(then_per_link(stream, token) for _ in range(3)))
    if "--profile" in argv:
        print(profile(stream, token))


if __name__ == "__main__":
    main(sys.argv[1:])
