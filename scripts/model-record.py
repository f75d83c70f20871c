"""The ``host`` section's ``record()`` rows on a machine without a GPU:
``cudafut.record(x)`` with its futures kept, and dropped at once, over a
libcuda that does nothing, with the driver calls each makes.

``python scripts/model-record.py`` (from the repository root) runs CUDA's
backend over the null libcuda of ``scripts/nullcuda.c`` and a stand-in for
CuPy's runtime (``scripts/profile-collective.py``'s, reused): build it
(``gcc -shared -fPIC -O2 -o /tmp/nullcuda/libcuda.so.1 scripts/nullcuda.c``)
and run with ``LD_LIBRARY_PATH=/tmp/nullcuda``. As ``benchmarks/host.py``
does, ``cudafut.record(token)`` of one CuPy array on the current stream (a
stream whose watermark holds, as a CuPy stream's does), timed per call:

- **kept**: each future appended to a list, emptied untimed after each
  timing of 4,000 (``host.py``'s ``_kept``);
- **dropped**: each future dropped at once (fire and forget), 20,000 per
  timing.

Three GPUs are modelled, by what an event query answers: ``complete``
(every event is), ``lag`` (an event reads pending until ``--lag`` more
records were made after it: a GPU trailing the host) and ``pending``
(never complete: work that runs for long). The timings of a mode run back
to back, as ``host.py``'s do; then the GPU finishes, and the script waits
until cudafut has let go of every value it kept alive (whose queries count
too). Per mode the best of ``--rounds`` timings is printed,
with the driver calls per record (cuEventRecord, cuEventQuery,
cuEventCreate, cuEventDestroy), counted by the null libcuda over the
timings and the cleanup after them.

What it models: the Python and C that cudafut runs per record, with driver
calls that cost nothing (on an H200 a query costs about 1.4 µs, a record
0.3 µs: add them by the counts). Compare two trees on one machine, their
runs alternated.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())

_spec = importlib.util.spec_from_file_location("profile_collective", "scripts/profile-collective.py")
assert _spec is not None
assert _spec.loader is not None
_pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pc)

import cupy as cp  # noqa: E402 - after the helpers, which set CuPy's interface version

import cudafut  # noqa: E402
from cudafut import _compiled, _cuda, _lifetimes  # noqa: E402

KEPT, DROPPED = "kept", "dropped"
CALLS = ("cuEventRecord", "cuEventQuery", "cuEventCreate", "cuEventDestroy")


def set_lag(lag: int) -> None:
    ctypes.c_long.in_dll(_pc.libcuda(), "null_query_lag").value = lag


def settle(gpu: str, lag: int) -> None:
    """The GPU finishes; wait until cudafut lets go of what it kept alive."""
    _pc.set_query_status(0)
    set_lag(-1)
    deadline = time.monotonic() + 10
    while _lifetimes.holding() and time.monotonic() < deadline:
        time.sleep(0.001)
    gc.collect()
    _pc.set_query_status(_cuda.NOT_READY if gpu == "pending" else 0)
    set_lag(lag if gpu == "lag" else -1)


def timing(mode: str, token: Any, n: int) -> float:
    record = cudafut.record
    if mode == KEPT:
        kept: list[Any] = []
        append = kept.append
        t = time.perf_counter()
        for _ in range(n):
            append(record(token))
        per = (time.perf_counter() - t) / n * 1e6
        kept.clear()
        return per
    t = time.perf_counter()
    for _ in range(n):
        record(token)
    return (time.perf_counter() - t) / n * 1e6


def measure(mode: str, gpu: str, token: Any, rounds: int, lag: int) -> tuple[float, dict[str, float]]:
    _pc.set_query_status(_cuda.NOT_READY if gpu == "pending" else 0)
    set_lag(lag if gpu == "lag" else -1)
    n = 4000 if mode == KEPT else 20_000
    timing(mode, token, n)  # warm-up
    settle(gpu, lag)
    before = _pc.null_counts()
    times = []
    for _ in range(rounds):  # back to back, as host.py times them
        times.append(timing(mode, token, n))
    settle(gpu, lag)
    after = _pc.null_counts()
    calls = {name: (after[name] - before[name]) / (n * rounds) for name in CALLS}
    set_lag(-1)
    return min(times), calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lag", type=int, default=8, help="records an event trails by, for --gpu lag")
    ap.add_argument("--gpu", nargs="*", default=["complete", "lag", "pending"])
    args = ap.parse_args()
    if not _pc.libcuda():
        sys.exit(
            "build scripts/nullcuda.c to /tmp/nullcuda/libcuda.so.1 "
            "(gcc -shared -fPIC -O2 -o /tmp/nullcuda/libcuda.so.1 scripts/nullcuda.c) "
            "and run with LD_LIBRARY_PATH=/tmp/nullcuda"
        )
    try:
        set_lag(-1)
    except ValueError:
        sys.exit("this null libcuda has no null_query_lag: build scripts/nullcuda.c again")
    _pc.install_nullcuda()
    memory = [ctypes.create_string_buffer(64) for _ in range(2)]
    with warnings.catch_warnings():  # CuPy 14 deprecates it; the native path takes it as a Stream
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cp.cuda.ExternalStream(ctypes.addressof(memory[0]), 0)
    native = _compiled.native()
    if native is not None:
        # Numbered and watermarked as a CuPy stream is (an ExternalStream
        # may outlive its handle: the core would not trust its order).
        native.keep_stream(stream, 0)
    current: Callable[..., Any] = lambda device=-1: stream  # noqa: E731
    cp.cuda.get_current_stream = current
    held = cp.cuda.UnownedMemory(ctypes.addressof(memory[1]), 4, memory[1], device_id=0)
    token = cp.ndarray((1,), cp.float32, memptr=cp.cuda.MemoryPointer(held, 0))
    print(f"cudafut core: {_compiled.core()}; cudafut.record(x), µs per call (best of {args.rounds})")
    print(f"  driver calls per record: {', '.join(CALLS)}")
    for gpu in args.gpu:
        for mode in (KEPT, DROPPED):
            per, calls = measure(mode, gpu, token, args.rounds, args.lag)
            label = f"{gpu} (lag {args.lag})" if gpu == "lag" else gpu
            counts = "  ".join(f"{calls[name]:5.3f}" for name in CALLS)
            print(f"  {label:14s} {mode:8s} {per:6.3f} µs   calls {counts}")


if __name__ == "__main__":
    main()
