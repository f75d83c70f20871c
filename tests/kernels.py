"""Slow producers for ordering tests: kernels that spin on %globaltimer for an
exact time (or until the host opens a :class:`Gate`) before they write, so
that a missing wait shows up as wrong data."""

from __future__ import annotations

import ctypes
import faulthandler
import functools
from typing import Any

from cudafut import _backend
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

// gate[0]: opened by the host; gate[1]: set here if max_ns passed first.
__device__ void wait_gate(volatile int* gate, long long max_ns) {
    if (threadIdx.x == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        } while (gate[0] == 0 && now - start < (unsigned long long)max_ns);
        if (gate[0] == 0) gate[1] = 1;
        __threadfence_system();  // what the host wrote before opening is seen after
    }
    __syncthreads();
}

extern "C" __global__ void gated_copy(const float* src, float* dst, long long n,
                                      volatile int* gate, long long max_ns) {
    wait_gate(gate, max_ns);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void gated_fill(float* out, long long n, float value,
                                      volatile int* gate, long long max_ns) {
    wait_gate(gate, max_ns);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}

extern "C" __global__ void spin_fault(long long ns) {
    spin(ns);
    *(volatile float*)(0x10) = 1.0f;  // an illegal address: a sticky error
}
"""
)


@functools.cache
def _module() -> Any:
    return _backend.current.cupy().RawModule(code=_SOURCE)


def _ns(ms: float) -> Any:
    return _backend.current.cupy().int64(int(ms * 1e6))


def spin_fill(out: Any, value: float, ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then fill ``out`` (float32)."""
    cp = _backend.current.cupy()
    _module().get_function("spin_fill")((1,), (256,), (out, cp.int64(out.size), cp.float32(value), _ns(ms)))


def spin_copy(src: Any, dst: Any, ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then copy ``src`` into ``dst``."""
    cp = _backend.current.cupy()
    _module().get_function("spin_copy")((1,), (256,), (src, dst, cp.int64(src.size), _ns(ms)))


def slow_zeros(stream: Any, n: int, value: float, ms: float) -> Any:
    """``n`` float32 zeros on ``stream``, which then overwrites them with
    ``value`` after ``ms`` ms. Only ``stream`` is synchronised, once the
    zeros are in place (a device-wide synchronisation would also wait for
    other slow producers of the same test)."""
    cp = _backend.current.cupy()
    with stream:
        x = cp.zeros(n, dtype=cp.float32)
        stream.synchronize()
        spin_fill(x, value, ms)
    return x


class Gate:
    """A flag in pinned host memory (the device reads it through unified
    addressing) that :func:`gated_copy` and :func:`gated_fill` wait for: the
    host decides when the reader reads, so a race test does not depend on
    the host's speed. Use it as ``with Gate() as gate:``, which opens it on
    the way out, whatever happens.

    While it is closed, anything that synchronises the device waits for the
    gated kernel, which gives up after its ``max_ms`` and says so in
    :attr:`timed_out` (a test asserts that it did not: its race did not
    happen as planned). Such calls: ``cudaFree`` (a garbage collection that
    frees a pool), ``cudaDeviceSynchronize``, and the first launch of a
    kernel in the process (CUDA's lazy loading may synchronise the context
    to load it): launch every other kernel once before closing a gate.

    Its pinned block is never handed back (a few hundred bytes a gate): a
    kernel that outlives a failed test still polls it, and must not read
    the next test's gate.

    While the gate is used as a context manager, the stacks of every thread
    are dumped to stderr (which pytest shows with a failure) if it stays
    closed over ``STALL_DUMP_S``: a test whose gate gave up then says which
    call waited for the device. Where pytest's ``faulthandler_timeout`` is
    set, this takes its timer (there is one per process) for the rest of
    the test; gates do not nest."""

    #: Seconds with the gate closed before the stacks are dumped.
    STALL_DUMP_S = 2.0

    def __init__(self) -> None:
        mem = _backend.current.cupy().cuda.alloc_pinned_memory(8)
        _gates.append(mem)
        self.ptr = int(mem.ptr)
        self._flags = (ctypes.c_int32 * 2).from_address(self.ptr)
        self._flags[0] = self._flags[1] = 0

    def __enter__(self) -> Gate:
        faulthandler.dump_traceback_later(self.STALL_DUMP_S, file=2)  # fd 2: pytest captures it
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        faulthandler.cancel_dump_traceback_later()

    def open(self) -> None:
        self._flags[0] = 1
        faulthandler.cancel_dump_traceback_later()  # open: whatever waits now is no stall of the gate's

    @property
    def timed_out(self) -> bool:
        """Whether a kernel gave up waiting (read it after synchronising)."""
        return bool(self._flags[1])


#: Every gate's pinned block, for the life of the process (see Gate).
_gates: list[Any] = []


def gated_copy(src: Any, dst: Any, gate: Gate, max_ms: float = 5_000.0) -> None:
    """On the current stream: wait until ``gate`` is opened (at most
    ``max_ms`` ms, so that a test that forgets to open it fails instead of
    hanging), then copy ``src`` into ``dst``."""
    cp = _backend.current.cupy()
    _module().get_function("gated_copy")(
        (1,), (256,), (src, dst, cp.int64(src.size), cp.uint64(gate.ptr), _ns(max_ms))
    )


def gated_fill(out: Any, value: float, gate: Gate, max_ms: float = 5_000.0) -> None:
    """On the current stream: wait until ``gate`` is opened (at most
    ``max_ms`` ms), then fill ``out`` (float32)."""
    cp = _backend.current.cupy()
    _module().get_function("gated_fill")(
        (1,), (256,), (out, cp.int64(out.size), cp.float32(value), cp.uint64(gate.ptr), _ns(max_ms))
    )


def spin_fault(ms: float) -> None:
    """On the current stream: wait ``ms`` ms, then write to an illegal address."""
    _module().get_function("spin_fault")((1,), (1,), (_ns(ms),))
