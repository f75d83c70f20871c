"""Copies between host and device (to_device, to_host, empty_pinned) on a GPU.

Each hazard has a slow producer or consumer (a kernel that spins on
%globaltimer first, tests/kernels.py) so that a missing wait, or memory
freed too early, shows up as wrong data.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _backend, _copies, _pools
from tests.kernels import spin_fill

pytestmark = pytest.mark.gpu

SLOW_MS = 50.0
DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
_streams: list[Any] = []


def stream() -> Any:
    s = _backend.current.cupy().cuda.Stream(non_blocking=True)
    _streams.append(s)  # kept for the session: see test_gpu_outcome.py
    return s


def sample(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 100, size=shape) % (2 if dtype is np.bool_ else 100)).astype(dtype)


def layouts(base: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The same values in several host layouts."""
    out = {"c": base}
    if base.ndim == 2:
        out["fortran"] = np.asfortranarray(base)
        out["transposed"] = np.ascontiguousarray(base.T).T
        out["reversed"] = np.ascontiguousarray(base[::-1])[::-1]
        wide = np.zeros((base.shape[0], base.shape[1] * 2), base.dtype)
        wide[:, ::2] = base
        out["strided"] = wide[:, ::2]
    return out


SHAPES = [(), (0,), (3, 0), (7,), (33, 17), (1024, 600)]  # the last one is staged (2.4 MB of float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_and_small_shape(dtype: Any) -> None:
    for shape in SHAPES[:5]:
        for name, host in layouts(sample(shape, dtype)).items():
            dev = cudafut.to_device(host).result(timeout=30)
            assert dev.shape == host.shape and dev.dtype == host.dtype, (shape, name)
            assert np.array_equal(_backend.current.cupy().asnumpy(dev), host), (shape, name)
            back = cudafut.to_host(dev).result(timeout=30)
            assert back.shape == host.shape and back.dtype == host.dtype
            assert np.array_equal(back, host), (shape, name)


@pytest.mark.parametrize("where", ["pageable", "pinned"])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.complex128])
def test_round_trip_of_staged_sizes_in_every_layout(where: str, dtype: Any) -> None:
    base = sample((1024, 600), dtype, seed=1)
    for name, host in layouts(base).items():
        if where == "pinned":
            pinned = cudafut.empty_pinned(host.shape, host.dtype)
            pinned[...] = host
            host = pinned
        dev = cudafut.to_device(host).result(timeout=30)
        assert np.array_equal(_backend.current.cupy().asnumpy(dev), base), name
        for out_name, out in {
            "none": None,
            "pageable": np.empty(base.shape, base.dtype),
            "fortran": np.empty(base.shape, base.dtype, order="F"),
            "pinned": cudafut.empty_pinned(base.shape, base.dtype),
        }.items():
            got = cudafut.to_host(dev, out=out).result(timeout=30)
            assert np.array_equal(got, base), (name, out_name)
            if out is not None:
                assert got is out


def test_a_non_contiguous_device_array_is_copied_in_c_order() -> None:
    cp = _backend.current.cupy()
    dev = cp.arange(60, dtype=cp.float64).reshape(6, 10)[:, ::3].T
    assert np.array_equal(cudafut.to_host(dev).result(), cp.asnumpy(dev))


def test_buffer_protocol_and_array_interface_sources() -> None:
    assert np.array_equal(
        _backend.current.cupy().asnumpy(cudafut.to_device(b"\x01\x02\x03").result()), [1, 2, 3]
    )
    ba = bytearray(range(10))
    assert _backend.current.cupy().asnumpy(cudafut.to_device(memoryview(ba)[2:5]).result()).tolist() == [
        2,
        3,
        4,
    ]

    class Interface:
        def __init__(self, a: np.ndarray[Any, Any]) -> None:
            self.__array_interface__ = a.__array_interface__
            self._a = a

    a = np.arange(5, dtype=np.int32)
    assert np.array_equal(_backend.current.cupy().asnumpy(cudafut.to_device(Interface(a)).result()), a)


def test_to_host_of_a_future_waits_on_the_device_for_a_slow_producer() -> None:
    cp = _backend.current.cupy()
    n = 1 << 20
    for out in (None, np.empty(n, np.float32), cudafut.empty_pinned(n, np.float32)):
        producer = stream()
        with producer:
            x = cp.zeros(n, dtype=cp.float32)
            spin_fill(x, 7.0, SLOW_MS)
            fut = cudafut.record(x)
        got = cudafut.to_host(fut, out=out)
        assert not fut.done()  # the copy was enqueued without the host waiting
        assert np.all(got.result(timeout=30) == 7.0)


def test_to_host_of_an_array_follows_the_callers_current_stream() -> None:
    cp = _backend.current.cupy()
    n = 1 << 20
    for out in (None, np.empty(n, np.float32)):
        producer = stream()
        with producer:
            x = cp.zeros(n, dtype=cp.float32)
            spin_fill(x, 3.0, SLOW_MS)
            got = cudafut.to_host(x, out=out)  # the copy stream waits for `producer`
        assert np.all(got.result(timeout=30) == 3.0)


def test_a_cold_pinned_result_is_pinned_off_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # With no cached block of the size, to_host() without out= leaves the
    # cudaHostAlloc (about 1 ms per 100 MB) to a copy thread, which then
    # enqueues the copy: it must still follow the producer on the caller's
    # stream, and the result must still be pinned.
    from cudafut import _pinned

    cp = _backend.current.cupy()
    n = 3 << 20  # 12 MB of float32, after every cached block was freed
    allocating: list[int] = []
    host_alloc = _backend.current.host_alloc

    def spied(size: int) -> int:
        allocating.append(threading.get_ident())
        return host_alloc(size)

    monkeypatch.setattr(_backend.current, "host_alloc", spied)
    _pinned.pool.free_cached()
    producer = stream()
    with producer:
        x = cp.zeros(n, dtype=cp.float32)
        spin_fill(x, 5.0, SLOW_MS)
        got = cudafut.to_host(x)
    value = got.result(timeout=30)
    assert np.all(value == 5.0)
    assert allocating, "no block was pinned: the test would prove nothing"
    assert threading.get_ident() not in allocating, "the calling thread ran cudaHostAlloc"
    assert _copies._pinned_address(value)


def test_to_host_of_a_pending_future_copies_once_it_is_set() -> None:
    cp = _backend.current.cupy()
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    got = cudafut.to_host(fut)
    assert not got.done()
    x = cp.full(100, 4.0, dtype=cp.float32)
    fut.set_result(x)
    assert np.all(got.result(timeout=30) == 4.0)


def test_dropping_everything_right_after_the_copy_never_corrupts() -> None:
    """The source and the destination outlive the copy even when the caller
    drops every reference at once and the memory is reallocated at once."""
    cp = _backend.current.cupy()
    n = 4 << 20  # float32: 16 MB, staged when pageable
    for pinned in (False, True):
        slow = stream()
        with slow:
            spin_fill(cp.empty(1, cp.float32), 0.0, SLOW_MS)  # the copy queues behind this
        expected = np.arange(n, dtype=np.float32)
        host = cudafut.empty_pinned(n, np.float32) if pinned else expected.copy()
        host[:] = expected
        fut = cudafut.to_device(host, stream=slow)
        del host
        gc.collect()
        junk = [np.full(n, -1.0, np.float32) for _ in range(2)]  # malloc may hand out the same pages
        if pinned:
            junk.append(cudafut.empty_pinned(n, np.float32))
            junk[-1][:] = -1.0
        assert np.array_equal(cp.asnumpy(fut.result(timeout=30)), expected), pinned

    for out in (None, "pageable", "pinned"):
        slow = stream()
        dev = cp.arange(n, dtype=cp.float32)
        with slow:
            spin_fill(cp.empty(1, cp.float32), 0.0, SLOW_MS)
        buffer = None if out is None else np.empty(n, np.float32)
        if out == "pinned":
            buffer = cudafut.empty_pinned(n, np.float32)
        fut2 = cudafut.to_host(dev, out=buffer, stream=slow)
        del dev, buffer
        gc.collect()
        again = cp.full(n, -1.0, dtype=cp.float32)  # the pool may hand out the same block
        assert np.array_equal(fut2.result(timeout=30), np.arange(n, dtype=np.float32)), out
        del again


def test_a_dropped_to_host_future_keeps_its_pinned_block_until_the_copy_is_done() -> None:
    """The pool result's block may not serve another request while the DMA
    into it is still coming."""
    cp = _backend.current.cupy()
    n = 1 << 20
    slow = stream()
    dev = cp.full(n, 9.0, dtype=cp.float32)
    with slow:
        spin_fill(cp.empty(1, cp.float32), 0.0, SLOW_MS)
    fut = cudafut.to_host(dev, stream=slow)
    del fut
    gc.collect()
    mine = cudafut.empty_pinned(n, np.float32)  # same size class
    mine[:] = 1.0
    slow.synchronize()
    assert np.all(mine == 1.0), "the DMA of a dropped to_host() wrote into a reused pinned block"


def test_bad_arguments_are_refused_before_anything_is_enqueued() -> None:
    cp = _backend.current.cupy()
    dev = cp.zeros((4, 5), dtype=cp.float32)
    with pytest.raises(ValueError, match="shape"):
        cudafut.to_host(dev, out=np.empty((5, 4), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        cudafut.to_host(dev, out=np.empty((4, 5), np.float64))
    ro = np.empty((4, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cudafut.to_host(dev, out=ro)
    overlapping = np.lib.stride_tricks.as_strided(np.empty(5, np.float32), shape=(4, 5), strides=(0, 4))
    with pytest.raises(ValueError, match="zero stride"):
        cudafut.to_host(dev, out=overlapping)
    with pytest.raises(TypeError, match="NumPy array"):
        cudafut.to_host(dev, out=[0] * 20)
    with pytest.raises(TypeError, match="GPU array"):
        cudafut.to_device(dev)
    with pytest.raises(TypeError, match="GPU array"):
        cudafut.to_host(np.zeros(3))
    with pytest.raises(TypeError, match="dtype"):
        cudafut.to_device(np.array(["a", "b"]))
    with pytest.raises(TypeError, match=r"numpy\.asarray"):
        cudafut.to_device([1, 2, 3])
    with pytest.raises(TypeError, match="stream"):
        cudafut.to_device(np.zeros(3), stream="the copy stream")
    with pytest.raises(ValueError, match="out of range"):
        cudafut.to_device(np.zeros(3), device=_backend.current.device_count())
    with pytest.raises(ValueError, match="negative"):
        cudafut.empty_pinned((-1, 2))
    # A future not set yet: the error arrives through the returned future.
    pending: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    got = cudafut.to_host(pending, out=np.empty(3, np.float64))
    pending.set_result(cp.zeros(4, dtype=cp.float32))
    with pytest.raises(ValueError, match="shape"):
        got.result(timeout=30)


@pytest.mark.anyio
async def test_copies_on_every_loop_and_cancelling_an_awaiting_task_does_not_stop_them() -> None:
    cp = _backend.current.cupy()
    n = 2 << 20
    expected = np.arange(n, dtype=np.float32)
    dev = await cudafut.to_device(expected.copy())
    assert np.array_equal(await cudafut.to_host(dev, out=np.empty(n, np.float32)), expected)

    slow = stream()
    with slow:
        x = cp.zeros(n, dtype=cp.float32)
        spin_fill(x, 2.0, SLOW_MS)
        fut = cudafut.record(x)
    copy = cudafut.to_host(fut, out=np.empty(n, np.float32))
    with anyio.move_on_after(0.005):
        await copy  # cancelled while the producer still spins
    assert not copy.cancelled()
    assert np.all(await copy == 2.0)

    many = [cudafut.to_device(np.full(1 << 16, float(i), np.float32)) for i in range(64)]
    values = await cudafut.gather(*many)
    assert [float(v[0]) for v in values] == [float(i) for i in range(64)]


def _other_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.name.startswith("cudafut-copy")}


def test_the_pinned_pool_and_the_threads_return_to_where_they_started() -> None:
    rng = np.random.default_rng(3)
    warm = [
        cudafut.to_device(np.zeros(1 << 21, np.uint8)),
        cudafut.to_host(_backend.current.cupy().zeros(1 << 21)),
    ]
    cudafut.wait_all(warm)
    del warm
    gc.collect()
    before = cudafut.memory_statistics()
    others = _other_threads()
    events_before = sum(_pools.pool_statistics().events_in_use.values())
    for _ in range(20):
        futs = []
        for _ in range(50):
            n = int(rng.integers(1, 1 << 20))
            h = np.ones(n, np.uint8) if rng.random() < 0.5 else cudafut.empty_pinned(n, np.uint8)
            d = cudafut.to_device(h)
            futs.append(cudafut.to_host(d, out=None if rng.random() < 0.5 else np.empty(n, np.uint8)))
        for f in futs:
            f.result(timeout=30)
        del futs, f, d, h
    gc.collect()
    deadline = time.monotonic() + 5
    while cudafut.memory_statistics().held and time.monotonic() < deadline:
        time.sleep(0.01)
    after = cudafut.memory_statistics()
    # At most where it started: a block an earlier test left in use (1 MB,
    # held by nothing the statistics count) was seen going back meanwhile.
    assert after.pinned_in_use <= before.pinned_in_use
    assert after.pinned_blocks_in_use <= before.pinned_blocks_in_use
    assert after.held == 0
    assert _other_threads() == others  # nothing started per copy
    copy_threads = [t for t in threading.enumerate() if t.name.startswith("cudafut-copy")]
    assert len(copy_threads) <= _copies.WORKERS
    assert sum(_pools.pool_statistics().events_in_use.values()) <= events_before + 8


def test_a_pinned_limit_falls_back_to_pageable_and_refuses_empty_pinned() -> None:
    from cudafut import _pinned

    cp = _backend.current.cupy()
    old = _pinned.pool.limit
    used = cudafut.memory_statistics().pinned_in_use
    try:
        cudafut.set_pinned_limit(used + (64 << 10))
        with pytest.raises(MemoryError, match="set_pinned_limit"):
            cudafut.empty_pinned(1 << 20, np.uint8)
        dev = cp.arange(1 << 20, dtype=cp.uint8)
        got = cudafut.to_host(dev).result(timeout=30)  # no pinned result: pageable, staged through the driver
        assert np.array_equal(got, cp.asnumpy(dev))
        back = cudafut.to_device(got).result(timeout=30)
        assert bool((back == dev).all())
        assert cudafut.memory_statistics().pinned_refused > 0
    finally:
        cudafut.set_pinned_limit(old)
