"""A toy model for examples/trio_app.py: a small MLP whose GPU time you choose.

``forward(xs)`` computes ``tanh(xs @ w1 + b1) @ w2`` for a batch ``xs`` of
shape ``(n, DIM)`` on the current CuPy stream: real math, which clients check
against :func:`reference` (NumPy, same weights). It then holds the *whole*
GPU for ``fixed_us + per_item_us * n`` microseconds with a kernel that spins
on the GPU's clock in every thread slot of every SM: a stand-in for a larger
model, whose time is mostly a fixed cost (reading its weights) plus a little
per request. Because it fills the GPU, two launches on two streams queue
rather than overlap, as two real models would.

examples/service/ serves a real torchvision model; here the point is the
batching, so the model's GPU time is set on the command line and every
answer can be checked against its NumPy reference.

CuPy is imported only by :class:`Model`: the reference and the sizes are
usable (by tests/test_examples.py) without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

DIM, HIDDEN, OUT = 32, 256, 4
SEED = 20240513

_SPIN = r"""
extern "C" __global__ void hold(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""


@functools.cache
def weights() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``w1`` (DIM, HIDDEN), ``b1`` (HIDDEN,), ``w2`` (HIDDEN, OUT), float32, the same everywhere."""
    rng = np.random.default_rng(SEED)
    w1 = (rng.standard_normal((DIM, HIDDEN)) / np.sqrt(DIM)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32)
    return w1, b1, w2


def reference(xs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """What ``forward`` computes, in NumPy (float64): shape ``(n, OUT)``."""
    w1, b1, w2 = (w.astype(np.float64) for w in weights())
    result: np.ndarray[Any, Any] = np.tanh(np.asarray(xs, dtype=np.float64) @ w1 + b1) @ w2
    return result


def matches(y: Any, x: np.ndarray[Any, Any]) -> bool:
    """Whether ``y`` (one output) is the model's output for ``x`` (one input)."""
    got = np.asarray(y, dtype=np.float64)
    return got.shape == (OUT,) and bool(np.allclose(got, reference(x[None])[0], rtol=1e-4, atol=1e-4))


class Model:
    """The weights on the GPU and the kernel that holds it (needs CuPy and a GPU)."""

    def __init__(self, fixed_us: float = 2000.0, per_item_us: float = 10.0) -> None:
        import cupy as cp

        self.cp = cp
        self.fixed_us, self.per_item_us = fixed_us, per_item_us
        self.w1, self.b1, self.w2 = (cp.asarray(w) for w in weights())
        self._hold = cp.RawKernel(_SPIN, "hold")
        rt, device = cp.cuda.runtime, cp.cuda.Device().id
        sms = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device)
        threads = rt.deviceGetAttribute(rt.cudaDevAttrMaxThreadsPerMultiProcessor, device)
        # 256-thread blocks, as many as the SMs hold at once: the kernel fills the GPU.
        self._grid = sms * max(1, threads // 256)
        cp.cuda.Device().synchronize()

    def forward(self, xs: np.ndarray[Any, Any]) -> Any:
        """Enqueue the model on the current stream for a batch ``(n, DIM)``; return the
        CuPy array ``(n, OUT)`` (its values are ready once the stream gets there)."""
        cp = self.cp
        x = cp.asarray(xs, dtype=cp.float32)  # a small copy: queued without waiting
        y = cp.tanh(x @ self.w1 + self.b1) @ self.w2
        ns = int((self.fixed_us + self.per_item_us * len(xs)) * 1e3)
        self._hold((self._grid,), (256,), (cp.int64(ns),))
        return y

    def warm_up(self, max_batch: int) -> None:
        """Compile the kernels and create cuBLAS's handle before serving."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            for n in (1, max_batch):
                self.forward(np.zeros((n, DIM), dtype=np.float32))
        stream.synchronize()
