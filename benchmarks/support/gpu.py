"""GPU helpers shared by the benchmarks: exact-duration kernels, streams, a
native host function. Imports CuPy (sections import it inside ``run()``); the
CuPy-free helpers are in ``common.py`` (re-exported here for convenience)."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import cupy as cp

from cudafut._cli.selfcheck import nvidia_driver_version
from cudafut._kernels import GSLEEP

from .common import CpuMeter, quantiles, timed

__all__ = [
    "CpuMeter",
    "HostFunc",
    "axpb",
    "environment",
    "gsleep",
    "quantiles",
    "stream",
    "sync_all",
    "timed",
    "token",
    "work",
]

_AXPB = r"""
extern "C" __global__ void axpb(const float* x, float* y, long long n, float a, float b, int rounds) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long step = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += step) {
        float v = x[i];
        for (int r = 0; r < rounds; r++) v = v * a + b;
        y[i] = v;
    }
}
"""
_module = cp.RawModule(code=GSLEEP + _AXPB)
_gsleep = _module.get_function("gsleep")
gsleep = _gsleep  # the raw kernel: gsleep((1,), (1,), (cp.int64(ns),)) on the current stream
_axpb = _module.get_function("axpb")

stream = cp.cuda.Stream(non_blocking=True)
token = cp.zeros(1, dtype=cp.float32)  # the value the benchmark futures carry


def work(ns: int, on: Any = None) -> None:
    """Enqueue a kernel that runs for exactly ``ns`` ns (0: an empty kernel)."""
    with on or stream:
        _gsleep((1,), (1,), (cp.int64(ns),))


def axpb(x: Any, y: Any, a: float, b: float, rounds: int) -> None:
    """``y = (x * a + b)`` iterated ``rounds`` times, on the current stream."""
    _axpb((264,), (256,), (x, y, cp.int64(x.size), cp.float32(a), cp.float32(b), cp.int32(rounds)))


def sync_all() -> None:
    cp.cuda.Device().synchronize()


class HostFunc:
    """A native host function that closes a file descriptor: the GIL-free
    wake-up that docs/design.md measured and did not take (``libc close()``
    launched with ``cuLaunchHostFunc``)."""

    def __init__(self) -> None:
        self.libcuda = ctypes.CDLL("libcuda.so.1")
        self.libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        libc = ctypes.CDLL(None)
        self.close_ptr = ctypes.cast(libc.close, ctypes.c_void_p).value
        self.watch = cp.cuda.Stream(non_blocking=True)

    def close_after(self, event: Any, fd: int) -> None:
        self.watch.wait_event(event)
        rc = self.libcuda.cuLaunchHostFunc(
            ctypes.c_void_p(self.watch.ptr), ctypes.c_void_p(self.close_ptr), ctypes.c_void_p(fd)
        )
        if rc:
            os.close(fd)
            raise RuntimeError(f"cuLaunchHostFunc failed: {rc}")


def environment() -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(0)
    driver = cp.cuda.runtime.driverGetVersion()
    return {
        "gpu": props["name"].decode(),
        "cuda_driver_api": driver,
        "nvidia_driver": nvidia_driver_version(),  # shared with `python -m cudafut`
        "cupy": cp.__version__,
        "cpu_count": os.cpu_count(),
    }
