"""CUDA C sources of the exact-duration kernels (no CuPy here: only text).

The benchmarks (``benchmarks/support/gpu.py``) and the GPU tests (``tests/kernels.py``)
compile these; they are not a part of the public API.
"""

from __future__ import annotations

#: ``spin(ns)``: a device function that returns after ``ns`` nanoseconds of the
#: GPU's own clock (``%globaltimer``), whatever the GPU's frequency. Forced
#: inline, so that a kernel that calls it is the bare loop.
SPIN = r"""
__device__ __forceinline__ void spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""

#: ``gsleep(long long ns)``: a kernel (launch it ``(1,), (1,)``) that runs for
#: exactly ``ns`` nanoseconds; ``ns = 0`` makes it an empty kernel.
GSLEEP = (
    SPIN
    + r"""
extern "C" __global__ void gsleep(long long ns) {
    spin(ns);
}
"""
)
