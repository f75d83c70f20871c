"""The native core (cudafut/_core.pyx) against its Python twin, on the fake
GPU (CPU): its entry points refuse wrong arguments with an exception, never
a crash; records on a stream whose handle is never reused are answered
from the stream's watermark once a newer one is seen complete, and records
on a user's stream are each queried; records are not tracked by the cyclic
garbage collector. The same behaviour holds on both cores; where only the
native core can show it (the watermark, the counters), the test says so.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _compiled, _events, _pools, testing
from cudafut._future import records_of

NATIVE = _compiled.native()
native_only = pytest.mark.skipif(
    NATIVE is None, reason=f"the native core does not run here ({_compiled.core()})"
)


def _record_on(stream: Any) -> cudafut.CudaFuture[Any]:
    return cudafut.record(np.zeros(2), stream=stream)


# -- wrong arguments: an exception, never a crash ----------------------------------------

BAD_CALLS = [
    ("record, a str stream", lambda: _events.record("s", 0)),  # type: ignore[arg-type]
    ("record, a str device", lambda: _events.record(0x10, "d")),  # type: ignore[arg-type]
    ("record, a stream past 64 bits", lambda: _events.record(1 << 80, 0)),
    ("record, None", lambda: _events.record(None, None)),  # type: ignore[arg-type]
    ("is_newest, None", lambda: _events.is_newest(None)),  # type: ignore[arg-type]
    ("is_newest, an int", lambda: _events.is_newest(3)),  # type: ignore[arg-type]
    ("first_error, not records", lambda: _events.first_error((object(),))),  # type: ignore[arg-type]
    ("first_error, None", lambda: _events.first_error(None)),  # type: ignore[arg-type]
    ("EventRecord, a str handle", lambda: _events.EventRecord("h", 0, 0, (0, 0), 1, 0.0)),  # type: ignore[arg-type]
    ("EventPool.acquire, a str", lambda: _pools.EventPool().acquire("d")),  # type: ignore[arg-type]
    ("EventPool.release, a str handle", lambda: _pools.EventPool().release(0, "h")),  # type: ignore[arg-type]
    ("keep_stream, no stream", lambda: _pools.keep_stream(object(), 0)),
]


@native_only
@pytest.mark.parametrize("call", [c for _, c in BAD_CALLS], ids=[n for n, _ in BAD_CALLS])
def test_native_entry_points_refuse_wrong_arguments(fake_cuda: testing.FakeCuda, call: Any) -> None:
    with pytest.raises((TypeError, OverflowError, AttributeError, ValueError)):
        call()


@native_only  # the twin's slots and methods take any object
def test_a_records_methods_refuse_wrong_arguments(fake_cuda: testing.FakeCuda) -> None:
    rec = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    with pytest.raises(TypeError):
        rec.settle("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        rec.wait_on("s", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        rec.seq = "1"  # type: ignore[assignment]
    fake_cuda.complete_all()


# -- the watermark -------------------------------------------------------------------------


@native_only
def test_a_newer_record_seen_complete_answers_for_the_older_ones_of_a_pool_stream(
    fake_cuda: testing.FakeCuda,
) -> None:
    assert NATIVE is not None
    stream = _pools.streams.get(0, 0)  # cudafut's own: its handle is never reused
    futs = [_record_on(stream) for _ in range(4)]
    records = [records_of(f)[0] for f in futs]
    assert all(r.ordered for r in records)
    assert [r.query() for r in records] == [None] * 4
    fake_cuda.complete(futs[-1])  # the fake completes a stream in order, as CUDA does
    queried, answered = NATIVE.counts()
    assert records[-1].query() == 0
    assert [r.query() for r in records[:-1]] == [0, 0, 0]
    assert NATIVE.counts() == (queried + 1, answered + 3)


class _StreamObject:
    """Stands for a user's stream object (the fake keeps its own streams for
    ever; a CuPy stream destroys its handle when it is garbage)."""


@native_only
def test_a_users_stream_is_ordered_while_its_object_lives(fake_cuda: testing.FakeCuda) -> None:
    owner = _StreamObject()
    named = [_events.record(0x5555, 0, None, owner) for _ in range(2)]  # as record(x, stream=s) does
    by_handle = _events.record(0x5555, 0)  # the handle alone, while the object lives: the same stream
    assert all(r.ordered for r in (*named, by_handle))
    assert by_handle.seq == named[-1].seq + 1
    del owner
    gc.collect()
    after = _events.record(0x5555, 0)  # the object is gone: the handle may name a new stream
    assert not after.ordered and after.seq == 1
    fake_cuda.complete_all()


@native_only
def test_records_on_a_handle_nobody_named_are_each_queried(fake_cuda: testing.FakeCuda) -> None:
    assert NATIVE is not None
    records = [_events.record(0x7777, 0) for _ in range(3)]
    assert not any(r.ordered for r in records)
    fake_cuda.complete_all()
    queried, answered = NATIVE.counts()
    assert [r.query() for r in reversed(records)] == [0, 0, 0]
    assert NATIVE.counts() == (queried + 3, answered)


@native_only
def test_a_finalizer_asks_cuda_nothing_of_records_a_newer_one_answered(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = _pools.streams.get(0, 0)
    futs = [_record_on(stream) for _ in range(3)]
    fake_cuda.complete(futs[-1])
    assert futs[-1].done()  # asks CUDA: the stream's watermark now answers the older ones
    backend = records_of(futs[0])[0].calls
    real = backend.event_query
    askers: list[int] = []

    def event_query(handle: int) -> int:
        askers.append(threading.get_ident())
        return int(real(handle))

    monkeypatch.setattr(backend, "event_query", event_query)
    del futs
    gc.collect()
    assert askers == []


def test_a_failed_record_is_not_answered_by_a_newer_one(fake_cuda: testing.FakeCuda) -> None:
    # A host failure (a collective whose peer died) is final, whatever the
    # stream's newer records report.
    stream = _pools.streams.get(0, 0)
    older, newer = _record_on(stream), _record_on(stream)
    rec = records_of(older)[0]
    rec.fail_with(RuntimeError("peer died"))
    fake_cuda.complete(newer)
    assert records_of(newer)[0].query() == 0
    assert rec.query() == _events.FAILED
    assert isinstance(rec.error(), RuntimeError)


def test_numbers_follow_the_order_of_records_on_a_stream(fake_cuda: testing.FakeCuda) -> None:
    stream = _pools.streams.get(0, 0)
    records = [records_of(_record_on(stream))[0] for _ in range(5)]
    seqs = [r.seq for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert _events.is_newest(records[-1]) and not _events.is_newest(records[0])
    fake_cuda.complete_all()


# -- the garbage collector ---------------------------------------------------------------------


@native_only
def test_records_are_not_tracked_by_the_cyclic_gc(fake_cuda: testing.FakeCuda) -> None:
    rec = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    assert not gc.is_tracked(rec)
    fake_cuda.complete_all()


def test_a_dropped_record_gives_its_event_back_to_its_pool(fake_cuda: testing.FakeCuda) -> None:
    stream = _pools.streams.get(0, 0)
    fut = _record_on(stream)
    fake_cuda.complete_all()
    fut.result(timeout=0)
    free, in_use = _pools.events.counts()
    del fut
    gc.collect()
    free_after, in_use_after = _pools.events.counts()
    assert (free_after[0], in_use_after[0]) == (free.get(0, 0) + 1, in_use[0] - 1)
