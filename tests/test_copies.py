"""Host logic of the copies, without a GPU: argument checks, the pinned
pool's size classes, and the cutting of a transfer into chunks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cudafut
from cudafut import _copies, _pinned


def test_size_classes_are_pages_powers_of_two_then_multiples_of_16_mb() -> None:
    assert _pinned.size_class(1) == 4096
    assert _pinned.size_class(4096) == 4096
    assert _pinned.size_class(4097) == 8192
    assert _pinned.size_class(3 << 20) == 4 << 20
    assert _pinned.size_class(16 << 20) == 16 << 20
    assert _pinned.size_class((16 << 20) + 1) == 32 << 20
    assert _pinned.size_class((100 << 20) + 1) == 112 << 20


def test_argument_errors_need_no_gpu() -> None:
    with pytest.raises(TypeError, match=r"numpy\.asarray"):
        cudafut.to_device([1, 2, 3])
    with pytest.raises(TypeError, match="dtype"):
        cudafut.to_device(np.array([object()]))
    with pytest.raises(TypeError, match="dtype"):
        cudafut.to_device(np.array(["text"]))
    with pytest.raises(TypeError, match="int"):
        cudafut.to_device(np.zeros(3), device="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"negative|numbered from 0"):
        cudafut.to_device(np.zeros(3), device=-1)
    with pytest.raises(TypeError, match="NumPy array"):
        cudafut.to_host(object(), out=[1])
    with pytest.raises(TypeError, match="shape"):
        cudafut.empty_pinned("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        cudafut.empty_pinned((2, -1))
    with pytest.raises(TypeError, match="dtype"):
        cudafut.empty_pinned(3, dtype="no such dtype")
    with pytest.raises(TypeError, match="objects"):
        cudafut.empty_pinned(3, dtype=object)
    with pytest.raises(TypeError, match="int"):
        cudafut.set_pinned_limit(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        cudafut.set_pinned_limit(-1)


def test_set_pinned_limit_returns_the_previous_limit() -> None:
    old = cudafut.get_pinned_limit()
    assert old == cudafut.memory_statistics().pinned_limit > 0
    try:
        assert cudafut.set_pinned_limit(old + 4096) == old
        assert cudafut.get_pinned_limit() == old + 4096
    finally:
        assert cudafut.set_pinned_limit(old) == old + 4096
    assert cudafut.get_pinned_limit() == old


def _simulate(host: np.ndarray[Any, Any], chunk: int) -> bytes:
    """What the copy threads would put in the device buffer, piece by piece."""
    device = bytearray(host.nbytes)
    pieces = _copies._pieces(host, chunk)
    jobs = _copies._split(pieces, 3)
    assert [p for job in jobs for p in job] == pieces  # every piece once, in order
    assert len(jobs) <= 3
    stage = np.empty(max(n for _, _, n in pieces), np.uint8)
    for piece, offset, n in pieces:
        view = _copies._view(stage, piece, n)
        np.copyto(view, piece)
        device[offset : offset + n] = stage[:n].tobytes()
    return bytes(device)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    dtype=st.sampled_from([np.uint8, np.int16, np.float32, np.complex128]),
    layout=st.sampled_from(["c", "f", "reversed", "strided"]),
    chunk=st.sampled_from([1, 7, 64, 4096]),
)
def test_the_pieces_rebuild_the_array_in_c_order(
    shape: list[int], dtype: Any, layout: str, chunk: int
) -> None:
    base = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
    host = {
        "c": base,
        "f": np.asfortranarray(base),
        "reversed": np.ascontiguousarray(base[::-1])[::-1],
        "strided": np.repeat(base, 2, axis=-1)[..., ::2],
    }[layout]
    assert np.array_equal(host, base)
    assert _simulate(host, chunk) == base.tobytes()


def test_chunks_are_page_multiples_between_the_bounds() -> None:
    for nbytes in (1, 1 << 20, 16 << 20, 1 << 30):
        threads, chunk = _copies._plan(nbytes)
        assert chunk % 4096 == 0
        assert _copies.CHUNK_MIN <= chunk <= _copies.CHUNK_MAX
        assert 1 <= threads <= _copies.WORKERS


def test_a_copy_uses_one_thread_per_job_bytes() -> None:
    # A thread's share costs a wake-up: small copies stay on few threads.
    assert _copies._plan(4 << 20)[0] == 1
    assert _copies._plan(16 << 20)[0] == min(2, _copies.WORKERS)
    assert _copies._plan(1 << 30)[0] == _copies.WORKERS


def test_to_devices_docstring_tells_of_the_allocation_on_the_caller() -> None:
    # Issue 34: it said "returns at once, whatever the size", yet the first
    # call of a size runs the destination's cudaMalloc on the calling thread.
    doc = " ".join(cudafut.to_device.__doc__.split())  # type: ignore[union-attr]
    assert "Returns at once" not in doc
    assert "allocated on the calling thread" in doc and "cudaMalloc" in doc
