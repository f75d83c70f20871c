"""Slow producers for ordering tests: kernels that spin on %globaltimer for an
exact time before they write, so that a missing wait shows up as wrong data."""

from __future__ import annotations

import functools
from typing import Any

from cudafut import _cuda
from cudafut._kernels import SPIN

_SOURCE = (
    SPIN
    + r"""
extern "C" __global__ void spin_fill(float* out, long long n, float value, long long ns) {
    spin(ns);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}

extern "C" __global__ void spin_copy(const float* src, float* dst, long long n, long long ns) {
    spin(ns);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void spin_fault(long long ns) {
    spin(ns);
    *(volatile float*)(0x10) = 1.0f;  // an illegal address: a sticky error
}
"""
)


@functools.cache
def _module() -> Any:
    return _cuda.cupy().RawModule(code=_SOURCE)


def _ns(ms: float) -> Any:
    return _cuda.cupy().int64(int(ms * 1e6))


def spin_fill(out: Any, value: float, ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then fill ``out`` (float32)."""
    cp = _cuda.cupy()
    _module().get_function("spin_fill")((1,), (256,), (out, cp.int64(out.size), cp.float32(value), _ns(ms)))


def spin_copy(src: Any, dst: Any, ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then copy ``src`` into ``dst``."""
    cp = _cuda.cupy()
    _module().get_function("spin_copy")((1,), (256,), (src, dst, cp.int64(src.size), _ns(ms)))


def spin_fault(ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then write to an illegal address."""
    _module().get_function("spin_fault")((1,), (1,), (_ns(ms),))
