"""The pinned pool's bookkeeping, with CUDA's allocations faked (no GPU)."""

from __future__ import annotations

import itertools

import pytest

from cudafut import _backend, _pinned


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> _pinned.PinnedPool:
    addresses = itertools.count(0x10000, 0x10000)
    monkeypatch.setattr(_backend.current, "host_alloc", lambda size: next(addresses))
    monkeypatch.setattr(_backend.current, "free_host", lambda ptr: None)
    fresh = _pinned.PinnedPool()
    fresh.set_limit(1 << 30)
    return fresh


def test_take_cached_never_allocates(pool: _pinned.PinnedPool, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(size: int) -> int:
        raise AssertionError("take_cached called cudaHostAlloc")

    allocs = pool.host_allocs
    monkeypatch.setattr(_backend.current, "host_alloc", refuse)
    assert pool.take_cached(1 << 20) is None
    assert pool.counts()[1:5] == (0, 0, 0, allocs)
    assert pool.failures == 0  # no free block is not a refusal


def test_take_cached_hands_out_a_freed_block_of_the_size_class(pool: _pinned.PinnedPool) -> None:
    block = pool.take(3 << 20)
    assert block is not None
    ptr, size = block.ptr, block.size
    del block  # back to the free list
    assert pool.counts()[1:3] == (0, size)
    assert pool.take_cached(1 << 20) is None  # another size class
    again = pool.take_cached(size - 1)
    assert again is not None and again.ptr == ptr
    assert pool.counts()[1:4] == (size, 0, 1)
