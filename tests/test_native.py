"""The native core (cudafut/_core.pyx) against its Python twin, on the fake
GPU (CPU): its entry points refuse wrong arguments with an exception, never
a crash (each once by hand, and all of them, found by the test itself, with
random wrong arguments in a child process); records on a stream whose handle is never reused are answered
from the stream's watermark once a newer one is seen complete, and records
on a user's stream are each queried; records are not tracked by the cyclic
garbage collector. The same behaviour holds on both cores; where only the
native core can show it (the watermark, the counters), the test says so.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib.util
import sys
import sysconfig
import threading
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import CudaFuture, _backend, _compiled, _events, _lifetimes, _loops, _pools, testing
from cudafut._interface import records_of
from tests.children import until
from tests.subproc import run_python

NATIVE = _compiled.native()
native_only = pytest.mark.skipif(
    NATIVE is None, reason=f"the native core does not run here ({_compiled.core()})"
)


def _record_on(stream: Any) -> cudafut.CudaFuture[Any]:
    return cudafut.record(np.zeros(2), stream=stream)


def _query_askers(monkeypatch: pytest.MonkeyPatch, fut: cudafut.CudaFuture[Any]) -> list[int]:
    """The threads that query an event through ``fut``'s backend from now
    on (each query's thread, appended to the list returned)."""
    backend = records_of(fut)[0].calls
    real = backend.event_query
    askers: list[int] = []

    def event_query(handle: int) -> int:
        askers.append(threading.get_ident())
        return int(real(handle))

    monkeypatch.setattr(backend, "event_query", event_query)
    return askers


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
    # Every other entry point of cudafut/_core.pyx, once each with a wrong type,
    # value or number of arguments (the fuzz below tries them at random).
    ("record, one argument too many", lambda: _events.record(0x10, 0, None, None, 1)),  # type: ignore[call-arg]
    ("first_error, an int", lambda: _events.first_error(1)),  # type: ignore[arg-type]
    ("EventRecord, no arguments", lambda: _events.EventRecord()),  # type: ignore[call-arg]
    ("EventRecord, a str seq", lambda: _events.EventRecord(1, 0, 0, (0, 0), "1", 0.0)),  # type: ignore[arg-type]
    ("EventRecord, a str time", lambda: _events.EventRecord(1, 0, 0, (0, 0), 1, "t")),  # type: ignore[arg-type]
    ("EventPool.acquire, past 32 bits", lambda: _pools.EventPool().acquire(1 << 40)),
    ("EventPool.release, a handle past 64 bits", lambda: _pools.EventPool().release(0, 1 << 80)),
    ("EventPool.close, an argument", lambda: _pools.EventPool().close(1)),  # type: ignore[call-arg]
    ("EventPool.counts, an argument", lambda: _pools.EventPool().counts(1)),  # type: ignore[call-arg]
    ("EventPool.created, set", lambda: setattr(_pools.EventPool(), "created", 1)),
    ("keep_stream, a str device", lambda: _pools.keep_stream(_pools.streams.get(0, 0), "d")),  # type: ignore[arg-type]
    ("counts, an argument", lambda: _native().counts(1)),
    ("_mutate, an int", lambda: _native()._mutate(1)),
    ("_mutate, no such mutation", lambda: _native()._mutate("nothing")),
    ("bind, no arguments", lambda: _native().bind()),
    ("_swap_streams, no backend", lambda: _native()._swap_streams()),
    ("_after_fork, an argument", lambda: _native()._after_fork(1)),
    ("_Stream, no arguments", lambda: _native()._Stream()),
    ("_Stream, a str device", lambda: _native()._Stream((0, 1), "d")),
    ("current_device, an argument", lambda: _native().current_device(1)),
    ("follow_current, a str stream", lambda: _native().follow_current("s", 0)),
    ("follow_current, a stream past 64 bits", lambda: _native().follow_current(1 << 80, 0)),
    ("set_future, records not a tuple", lambda: _native().set_future(1, [])),
    ("bind_set_future, no arguments", lambda: _native().bind_set_future()),
]

# A record's methods and attributes: native only (the twin's take any object).
BAD_RECORD_CALLS = [
    ("settle, a str", lambda rec: rec.settle("0")),
    ("settle, past 32 bits", lambda rec: rec.settle(1 << 40)),
    ("settle, None", lambda rec: rec.settle(None)),
    ("wait_on, a str stream", lambda rec: rec.wait_on("s", 0)),
    ("wait_on, a stream past 64 bits", lambda rec: rec.wait_on(1 << 80, 0)),
    ("query, an argument", lambda rec: rec.query(1)),
    ("known, an argument", lambda rec: rec.known(1)),
    ("error, an argument", lambda rec: rec.error(1)),
    ("fail_with, no argument", lambda rec: rec.fail_with()),
    ("ended, an argument", lambda rec: rec.ended(1)),
    ("seq, a str", lambda rec: setattr(rec, "seq", "1")),
    ("handle, None", lambda rec: setattr(rec, "handle", None)),
    ("device, a str", lambda rec: setattr(rec, "device", "d")),
    ("stream, a str", lambda rec: setattr(rec, "stream", "s")),
    ("t, a str", lambda rec: setattr(rec, "t", "t")),
    ("seen, None", lambda rec: setattr(rec, "seen", None)),
    ("status, a str", lambda rec: setattr(rec, "status", "x")),
    ("ordered, set", lambda rec: setattr(rec, "ordered", True)),
]


def _native() -> Any:
    assert NATIVE is not None
    return NATIVE


@native_only
@pytest.mark.parametrize("call", [c for _, c in BAD_CALLS], ids=[n for n, _ in BAD_CALLS])
def test_native_entry_points_refuse_wrong_arguments(fake_cuda: testing.FakeCuda, call: Any) -> None:
    with pytest.raises((TypeError, OverflowError, AttributeError, ValueError)):
        call()


@native_only  # the twin's slots and methods take any object
@pytest.mark.parametrize("call", [c for _, c in BAD_RECORD_CALLS], ids=[n for n, _ in BAD_RECORD_CALLS])
def test_a_records_methods_refuse_wrong_arguments(fake_cuda: testing.FakeCuda, call: Any) -> None:
    rec = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    with pytest.raises((TypeError, OverflowError, AttributeError)):
        call(rec)
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


def _record_with_another_inside(monkeypatch: pytest.MonkeyPatch, stream: Any) -> tuple[Any, Any]:
    """A record of ``stream`` made on the runtime's path (the fake's), and
    one made while its event was being enqueued (a finalizer, another
    thread): the second is numbered lower, though it follows in the stream."""
    ptr, real = int(stream.ptr), _backend.current.event_record
    inner: list[Any] = []

    def record_then_another(event: int, on: int, device: int) -> None:
        real(event, on, device)
        if not inner:
            inner.append(None)
            inner[0] = _events.record(on, device, None, stream)

    monkeypatch.setattr(_backend.current, "event_record", record_then_another)
    outer = _events.record(ptr, 0, None, stream)
    monkeypatch.setattr(_backend.current, "event_record", real)
    return outer, inner[0]


def _own_queries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fake's event queries made by this thread from now on (the handles
    asked, appended to the list returned); the watcher thread's, sweeping
    an earlier test's records, are left out."""
    backend = _backend.current
    real, me = backend.event_query, threading.get_ident()
    asked: list[int] = []

    def event_query(handle: int) -> int:
        if threading.get_ident() == me:
            asked.append(handle)
        return int(real(handle))

    monkeypatch.setattr(backend, "event_query", event_query)
    return asked


@native_only
@pytest.mark.parametrize("how", ["await", "result"])
def test_finished_work_asks_the_newest_record_once(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Futures recorded, their work finished, then each awaited (or its
    # result() taken) once, as a service does after a synchronize(): the
    # first asks the stream's newest record, whose completion answers for
    # all the others from the watermark.
    stream = _pools.streams.get(0, 0)
    futs = [_record_on(stream) for _ in range(5)]
    fake_cuda.complete_all()
    asked = _own_queries(monkeypatch)

    async def main() -> None:
        for fut in futs:
            await fut

    if how == "await":
        asyncio.run(main())
    else:
        for fut in futs:
            fut.result()
    assert asked == [records_of(futs[-1])[0].handle]


@native_only
def test_a_newest_record_found_pending_is_asked_again_only_after_more_records(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipeline: the newest work is pending whenever an older future is
    # awaited. A probe that finds it pending costs one query, and the next
    # is 1, 2, 4, ... records later, so the extra queries stay rare.
    stream = _pools.streams.get(0, 0)
    records = [records_of(_record_on(stream))[0] for _ in range(2)]
    asked = _own_queries(monkeypatch)
    for _ in range(100):
        older = records[-2]
        older.calls.complete([older.calls.event_of(older.handle)])
        assert older.probe() == 0
        records.append(records_of(_record_on(stream))[0])
    probes = len(asked) - 100  # beyond each record's own query
    assert 0 < probes <= 10
    fake_cuda.complete_all()


@native_only
def test_a_probe_never_asks_a_record_that_is_gone_or_that_does_not_follow(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The newest record gone (its event back in the pool, perhaps recorded
    # again elsewhere), or made on the runtime's path before an
    # older-numbered one (it does not vouch for it): each is asked itself.
    stream = _pools.streams.get(0, 0)
    ptr = int(stream.ptr)
    first, newest = (_events.record(ptr, 0, None, stream) for _ in range(2))
    first.calls.complete([first.calls.event_of(first.handle)])
    del newest
    asked = _own_queries(monkeypatch)
    assert first.probe() == 0
    assert asked == [first.handle]

    outer, later = _record_with_another_inside(monkeypatch, stream)
    assert later.seq < outer.seq
    outer.calls.complete([outer.calls.event_of(outer.handle)])
    asked.clear()
    assert later.probe() is None
    assert asked == [later.handle]
    fake_cuda.complete_all()


class Stream:
    """Stands for a user's CuPy stream, which owns its handle and destroys
    it when it is garbage (the fake keeps its own streams for ever)."""


@native_only
def test_a_users_stream_is_ordered_while_its_object_lives(fake_cuda: testing.FakeCuda) -> None:
    owner = Stream()
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
    askers = _query_askers(monkeypatch, futs[0])
    del futs
    gc.collect()
    assert askers == []


@native_only
def test_another_object_naming_a_handle_starts_a_stream_of_its_own(fake_cuda: testing.FakeCuda) -> None:
    # A wrapper kept alive after its stream was destroyed (an ExternalStream)
    # must not lend the old stream's watermark to a new stream on that handle.
    old_owner, new_owner = Stream(), Stream()
    old = _events.record(0x6666, 0, None, old_owner)
    new = _events.record(0x6666, 0, None, new_owner)
    assert new.seq == 1 and new.stream_key == old.stream_key
    new.settle(0)
    assert old.known() is None
    fake_cuda.complete_all()


@native_only
def test_a_wrapper_of_a_handle_made_elsewhere_is_not_trusted(fake_cuda: testing.FakeCuda) -> None:
    class ExternalStream:
        pass

    owner = ExternalStream()
    assert not _events.record(0x6667, 0, None, owner).ordered
    fake_cuda.complete_all()


def test_a_record_enqueued_outside_the_streams_lock_vouches_only_for_those_numbered_before(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime's path (the fake's always) enqueues before it numbers: a
    # record made in between (a finalizer, another thread) is numbered lower
    # though it follows in the stream. The first's completion must not
    # answer for it.
    stream = _pools.streams.get(0, 0)
    first, later = _record_with_another_inside(monkeypatch, stream)
    assert later.seq < first.seq  # numbered out of the stream's order
    backend = first.calls
    ev = backend.event_of(first.handle)
    backend.complete([ev])
    assert first.query() == 0
    assert later.known() is None and later.query() is None
    fake_cuda.complete_all()


@native_only
def test_a_new_thread_never_shares_an_ended_threads_per_thread_stream(fake_cuda: testing.FakeCuda) -> None:
    made: list[Any] = []

    def record_on_the_per_thread_stream() -> None:
        made.append(_events.record(2, 0))

    for _ in range(2):
        t = threading.Thread(target=record_on_the_per_thread_stream)
        t.start()
        t.join()  # the next thread may get the same ident
    old, new = made
    assert old.stream_key != new.stream_key and new.seq == 1
    new.settle(0)
    assert old.known() is None
    fake_cuda.complete_all()


def test_a_failed_and_raised_future_is_collected(fake_cuda: testing.FakeCuda) -> None:
    # The error's traceback holds the future, which holds the record, which
    # holds the error: a cycle the collector must see.
    class Value:
        pass

    refs = []
    for _ in range(3):
        value = Value()
        fut = cudafut.record(value)
        records_of(fut)[0].fail_with(RuntimeError("peer died"))
        with pytest.raises(RuntimeError):
            fut.result()
        refs.append(weakref.ref(value))
        del fut, value
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_failure_from_the_host_while_confirm_runs_is_final(fake_cuda: testing.FakeCuda) -> None:
    rec = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    rec.confirm = lambda: rec.fail_with(RuntimeError("aborted meanwhile"))  # returns None: "fine"
    fake_cuda.complete_all()
    assert rec.query() == _events.FAILED
    assert isinstance(rec.error(), RuntimeError)


@native_only
def test_known_never_runs_a_confirm(fake_cuda: testing.FakeCuda) -> None:
    stream = _pools.streams.get(0, 0)
    older, newer = (records_of(_record_on(stream))[0] for _ in range(2))
    asked: list[bool] = []
    older.confirm = lambda: asked.append(True)
    fake_cuda.complete_all()
    assert newer.query() == 0
    assert older.known() is None and asked == []  # left to the polling thread
    assert older.query() == 0 and asked == [True]


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


# -- dropped futures: kept by their stream, reclaimed in batch ----------------------------------


@native_only
def test_a_dropped_pending_future_asks_cuda_nothing_and_keeps_its_value_until_its_work_completes(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = _pools.streams.get(0, 0)
    value = np.zeros(2)
    ref = weakref.ref(value)
    fut = cudafut.record(value, stream=stream)
    askers = _query_askers(monkeypatch, fut)
    del fut, value
    gc.collect()
    assert threading.get_ident() not in askers  # the finalizer asked nothing (the watcher thread may)
    assert ref() is not None  # kept: its work may still read it
    fake_cuda.complete_all()
    until(lambda: ref() is None, "the dropped future's value let go once its work completed")


@native_only
@pytest.mark.parametrize("order", ["each at once", "newest first"])
def test_a_record_reclaims_its_streams_dropped_futures_in_batch(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    # The watcher thread kept out (the sweeper it would get is kept here,
    # never let go): the next record on the stream reclaims alone. A list of
    # futures freed at once drops its newest first (CPython's list frees from
    # its end): the stream's list, appended out of order, reads by number.
    sweepers: list[object] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: sweepers.append(obj))
    stream = _pools.streams.get(0, 0)
    values = [np.zeros(2) for _ in range(64)]
    refs = [weakref.ref(v) for v in values]
    if order == "each at once":
        for v in values:
            cudafut.record(v, stream=stream)  # dropped at once
        del v
    else:
        futures = [cudafut.record(v, stream=stream) for v in values]
        while futures:
            futures.pop()
    del values
    gc.collect()
    assert len(sweepers) == 1  # one for the stream, not one per drop
    assert all(r() is not None for r in refs)
    fake_cuda.complete_all()
    free_before = _pools.events.counts()[0].get(0, 0)
    asked: list[int] = []
    real = _backend.current.event_query

    def event_query(handle: int) -> int:
        asked.append(handle)
        return int(real(handle))

    monkeypatch.setattr(_backend.current, "event_query", event_query)
    kept = _record_on(stream)
    assert len(asked) <= 2  # the newest dropped one answers for the older ones
    assert all(r() is None for r in refs)
    # Their 64 events back in the pool before the record took one.
    assert _pools.events.counts()[0][0] == free_before + 63
    fake_cuda.complete_all()
    assert kept.done()


@native_only
def test_dropped_pending_futures_give_the_collector_nothing_to_track(fake_cuda: testing.FakeCuda) -> None:
    stream = _pools.streams.get(0, 0)
    value = np.zeros(2)
    for _ in range(50):
        cudafut.record(value, stream=stream)  # dropped at once, pending: the value is kept
    # By the stream's list alone, which the collector does not see (no tuple
    # or closure of a hold per drop, as the Python twin's).
    here = sys._getframe()
    assert [r for r in gc.get_referrers(value) if r is not here] == []
    fake_cuda.complete_all()


@native_only
def test_a_dropped_future_whose_record_has_a_confirm_runs_it_though_a_newer_record_answered(
    fake_cuda: testing.FakeCuda,
) -> None:
    # A collective's record (a confirm that finds its group aborted) under a
    # future that is not kept by its producer (gather of one): a newer record
    # seen complete must not settle it as a success without its confirm.
    from cudafut._interface import KEPT_BY_PRODUCER, set_future

    stream = _pools.streams.get(0, 0)
    asked: list[int] = []

    def confirm() -> cudafut.CudaError:
        asked.append(1)
        return cudafut.CudaError(999, "collective aborted: peer died")

    rec = _events.record(int(stream.ptr), 0, confirm, stream)
    produced = set_future(np.zeros(2), (rec,), KEPT_BY_PRODUCER)
    joined = cudafut.gather(produced)
    later = _record_on(stream)
    fake_cuda.complete_all()
    assert later.done()  # the stream's watermark now answers for the older record
    del joined
    gc.collect()
    until(lambda: produced.done(), "the collective's future settled")
    assert asked
    assert isinstance(produced.exception(), cudafut.CudaError)


@native_only
def test_a_drop_whose_sweeper_could_not_start_is_reclaimed_by_the_next_record(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = _pools.streams.get(0, 0)
    value = np.zeros(2)
    ref = weakref.ref(value)
    refused: list[object] = []

    def hold(records: Any, obj: object) -> None:
        refused.append(obj)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_lifetimes, "hold", hold)
    cudafut.record(value, stream=stream)  # dropped at once, pending: kept on the stream's list
    del value
    gc.collect()
    assert refused and ref() is not None
    monkeypatch.undo()
    fake_cuda.complete_all()
    kept = _record_on(stream)  # one record, not 64: an arm failed, so it reclaims at once
    assert ref() is None
    fake_cuda.complete_all()
    assert kept.done()


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


# -- the futures' native paths (record_value, the await, the finalizer) ------------------


class _OwnAwait(CudaFuture[Any]):
    def __await__(self) -> Any:
        return super().__await__()


class _InheritsAwait(_OwnAwait):
    pass


class _Seq:
    seq = 1


FUTURE_BAD_CALLS = [
    ("record_value, no arguments", lambda: NATIVE.record_value()),  # type: ignore[union-attr]
    ("__await__, not a future", lambda: NATIVE.FutureCore.__await__(object())),  # type: ignore[union-attr]
    ("__await__, None", lambda: NATIVE.FutureCore.__await__(None)),  # type: ignore[union-attr]
    ("__del__, not a future", lambda: NATIVE.FutureCore.__del__(object())),  # type: ignore[union-attr]
    ("future_result, not a future", lambda: NATIVE.future_result(object())),  # type: ignore[union-attr]
    ("future_result, None", lambda: NATIVE.future_result(None)),  # type: ignore[union-attr]
    ("future_then, None", lambda: NATIVE.future_then(None, lambda v: v)),  # type: ignore[union-attr]
    ("awaited, None", lambda: NATIVE.awaited(None, None)),  # type: ignore[union-attr]
    ("install_await, not a subclass", lambda: NATIVE.install_await(int)),  # type: ignore[union-attr]
    ("install_await, None", lambda: NATIVE.install_await(None)),  # type: ignore[union-attr]
    ("install_await, an __await__ of its own", lambda: NATIVE.install_await(_OwnAwait)),  # type: ignore[union-attr]
    ("install_await, one inherited", lambda: NATIVE.install_await(_InheritsAwait)),  # type: ignore[union-attr]
    ("future_then, not a future", lambda: NATIVE.future_then(object(), lambda v: v)),  # type: ignore[union-attr]
    ("future_then, no fn", lambda: NATIVE.future_then(None)),  # type: ignore[union-attr]
    ("awaited, not a future", lambda: NATIVE.awaited(object(), None)),  # type: ignore[union-attr]
    ("AsyncioAwait, a record without seq", lambda: NATIVE.AsyncioAwait(None, None, None, object(), None)),  # type: ignore[union-attr]
    ("AsyncioAwait, a driver for its entry", lambda: NATIVE.AsyncioAwait(object(), None, None, _Seq(), None)),  # type: ignore[union-attr]
]


@native_only
@pytest.mark.parametrize("call", [c for _, c in FUTURE_BAD_CALLS], ids=[n for n, _ in FUTURE_BAD_CALLS])
def test_the_futures_native_paths_refuse_wrong_arguments(fake_cuda: testing.FakeCuda, call: Any) -> None:
    with pytest.raises((TypeError, AttributeError)):
        call()


@native_only
def test_a_native_await_made_without_its_loops_entry_refuses_to_wait() -> None:
    wait = NATIVE.AsyncioAwait(None, None, None, _Seq(), None)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="without its loop's AsyncioEntry"):
        next(wait)
    wait.close()  # nothing to remove


@native_only
def test_the_native_finalizer_ignores_a_future_whose_init_never_ran() -> None:
    fut = CudaFuture.__new__(CudaFuture)
    fut.__del__()  # its state reads None: nothing to do
    del fut
    NATIVE.FutureCore.__del__(NATIVE.FutureCore())  # type: ignore[union-attr]


def _am_await(cls: type) -> int:
    """``cls``'s ``tp_as_async->am_await``: the C function ``await`` calls
    (PyTypeObject's 11th word on a build with the GIL; ``am_await`` is the
    first word of what it points to)."""
    words = ctypes.cast(id(cls), ctypes.POINTER(ctypes.c_void_p))
    as_async = ctypes.cast(words[10], ctypes.POINTER(ctypes.c_void_p))
    return int(as_async[0] or 0)


@native_only
@pytest.mark.skipif(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")), reason="a free-threaded build lays types out otherwise"
)
def test_the_native_core_is_the_futures_base_and_its_slots() -> None:
    assert CudaFuture.__mro__[1] is NATIVE.FutureCore  # type: ignore[union-attr]
    # Neither twin in the class: await and the finalizer are the base's C slots.
    assert "__await__" not in vars(CudaFuture)
    assert "__del__" not in vars(CudaFuture)
    assert _am_await(CudaFuture) == _am_await(NATIVE.FutureCore)  # type: ignore[union-attr]

    class Plain:
        def __await__(self) -> Any:
            yield

    assert _am_await(Plain) != _am_await(NATIVE.FutureCore)  # type: ignore[union-attr]  # the generic slot
    fut = CudaFuture.__new__(CudaFuture)
    assert fut._state is None  # a member not set yet reads None
    with pytest.raises(AttributeError):
        fut.unknown = 1  # no __dict__: only the members


@native_only
def test_record_on_a_known_stream_takes_the_native_path_and_makes_the_same_future(
    fake_cuda: testing.FakeCuda,
) -> None:
    stream = fake_cuda.stream()
    x = np.arange(3.0)
    keep = object()
    first = cudafut.record(x, stream=stream, keep=keep)  # the twin checks the handle once
    fast = NATIVE.record_value(x, stream, keep)  # type: ignore[union-attr]
    assert fast is not None
    assert type(fast) is cudafut.CudaFuture
    for fut in (first, fast):
        assert fut._state is first._state and fut._value is x and fut._keep is keep
        assert fut._devices is None and fut._exception is None and not fut._retrieved
        assert fut.devices == (stream.device_id,)
    (r1,), (r2,) = records_of(first), records_of(fast)
    assert (r2.stream, r2.device, r2.stream_key) == (r1.stream, r1.device, r1.stream_key)
    assert r2.seq == r1.seq + 1
    assert not fast.done()
    fake_cuda.complete_all()
    assert fast.done() and fast.result() is x


@native_only
def test_the_native_path_leaves_to_the_twin_what_it_does_not_handle(
    fake_cuda: testing.FakeCuda, tmp_path: Any
) -> None:
    x = np.arange(3.0)
    stream = fake_cuda.stream()

    class Protocol:  # a stream of a type the fast path does not know
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, stream.ptr)

        device_id = stream.device_id

    assert NATIVE.record_value(x, None, None) is None  # type: ignore[union-attr]
    assert NATIVE.record_value(x, Protocol(), None) is None  # type: ignore[union-attr]
    assert cudafut.record(x, stream=Protocol()).devices == (stream.device_id,)
    with cudafut.trace(tmp_path / "trace.json"):
        assert NATIVE.record_value(x, stream, None) is None  # type: ignore[union-attr]  # traced: the twin
    fake_cuda.complete_all()


def test_await_of_a_done_or_failed_future_takes_its_outcome(fake_cuda: testing.FakeCuda) -> None:
    import asyncio

    stream = fake_cuda.stream()
    done = cudafut.record(np.arange(2.0), stream=stream)
    failed = cudafut.record(np.arange(2.0), stream=stream)
    fake_cuda.complete(done)
    fake_cuda.fail(failed)

    async def main() -> None:
        assert (await done).tolist() == [0.0, 1.0]
        assert (await done).tolist() == [0.0, 1.0]  # again: each await its own iterator
        with pytest.raises(cudafut.CudaError):
            await failed

    asyncio.run(main())


def test_the_native_methods_keep_the_twins_documentation() -> None:
    doc = cudafut.CudaFuture.__await__.__doc__
    assert doc is not None and doc.startswith("``await fut``")
    doc = cudafut.CudaFuture.result.__doc__
    assert doc is not None and doc.startswith("Block the calling thread until the GPU work is done")


# -- the review of the futures' native paths: each failed on the first version -------------


def test_a_dropped_future_asks_nothing_of_cuda_while_the_interpreter_finalizes(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fut = cudafut.record(np.zeros(2), stream=fake_cuda.stream())
    calls = records_of(fut)[0].calls
    asked: list[int] = []
    real = calls.event_query

    def query(handle: int) -> int:
        asked.append(handle)
        return int(real(handle))

    monkeypatch.setattr(calls, "event_query", query)
    held: list[Any] = []
    monkeypatch.setattr(_lifetimes, "hold", lambda records, obj: held.append(obj))
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    del fut
    gc.collect()
    monkeypatch.undo()
    assert asked == [] and held == []
    fake_cuda.complete_all()


def test_an_unused_await_iterator_of_a_done_future_does_not_leak_it(fake_cuda: testing.FakeCuda) -> None:
    box: list[Any] = [np.zeros(2)]
    fut = cudafut.record(box, stream=fake_cuda.stream())
    fake_cuda.complete_all()
    assert fut.done()
    box.append(fut.__await__())  # fut -> its value -> the iterator -> fut: a cycle the collector sees
    ref = weakref.ref(fut)
    del fut, box
    gc.collect()
    assert ref() is None


def test_the_await_iterator_of_a_done_future_is_driven_as_a_generator(fake_cuda: testing.FakeCuda) -> None:
    fut = cudafut.record(np.arange(2.0), stream=fake_cuda.stream())
    fake_cuda.complete_all()
    it: Any = fut.__await__()
    with pytest.raises(StopIteration) as stop:
        it.send(None)
    assert stop.value.value.tolist() == [0.0, 1.0]
    fut.__await__().close()
    with pytest.raises(KeyError):
        fut.__await__().throw(KeyError("thrown in"))


def test_a_stream_handle_past_63_bits_is_a_value_error(fake_cuda: testing.FakeCuda) -> None:
    stream = fake_cuda.stream()
    stream.ptr = 1 << 63
    with pytest.raises(ValueError, match="not a CUDA stream of this process"):
        cudafut.record(np.zeros(2), stream=stream)


@native_only
def test_record_is_the_native_entry_which_falls_back_on_python(fake_cuda: testing.FakeCuda) -> None:
    import inspect

    assert cudafut.record is NATIVE.future_record  # type: ignore[union-attr]
    assert list(inspect.signature(cudafut.record).parameters) == ["value", "stream", "keep"]
    assert (cudafut.record.__doc__ or "").startswith("A future, already set, for GPU work already enqueued.")
    fut = cudafut.record(np.zeros(2))  # a NumPy array: Python records it (the fake's current device)
    assert fut.devices == (0,)
    with pytest.raises(TypeError):
        cudafut.record()
    with pytest.raises(TypeError):
        cudafut.record(np.zeros(2), fake_cuda.stream())  # stream is keyword-only
    fake_cuda.complete_all()


@native_only
def test_the_native_methods_keep_the_twins_signatures() -> None:
    import inspect

    for name in ("result", "then"):  # __await__ and __del__: FutureCore's slots
        sig = inspect.signature(getattr(cudafut.CudaFuture, name))
        assert next(iter(sig.parameters)) == "self"
    sig = inspect.signature(cudafut.CudaFuture.result)
    assert list(sig.parameters) == ["self", "timeout"]
    assert sig.return_annotation is not inspect.Signature.empty
    sig = inspect.signature(cudafut.CudaFuture.then)
    assert list(sig.parameters) == ["self", "fn", "priority"]
    assert sig.parameters["priority"].kind is inspect.Parameter.KEYWORD_ONLY


# -- then() on a set future: the native path, and what it leaves to the twin ---------------


def fake_cuda_current_stream() -> int:
    """The calling thread's current stream handle of device 0, under the fake."""
    return int(_backend.current.current_stream(0).ptr)


@pytest.fixture
def twin_then(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The parents whose then() callback the Python twin ran (its
    ``_run_then``, which the native path never calls)."""
    from cudafut import _future

    ran: list[Any] = []
    real = _future._run_then

    def spy(parent: Any, fn: Any, priority: int, child: Any) -> Any:
        ran.append(parent)
        return real(parent, fn, priority, child)

    monkeypatch.setattr(_future, "_run_then", spy)
    return ran


@native_only
def test_then_of_a_set_future_runs_natively_and_makes_the_twins_child(
    fake_cuda: testing.FakeCuda, twin_then: list[Any]
) -> None:
    stream = fake_cuda.stream()
    x = np.arange(3.0)
    parent = cudafut.record(x, stream=stream)
    seen: list[Any] = []

    def fn(v: Any) -> Any:
        seen.append((v, fake_cuda_current_stream()))
        return v + 1

    child = parent.then(fn)
    assert twin_then == []  # the native path
    assert seen[0][0] is x
    assert child._state is parent._state and child._keep is x and not child._retrieved
    (r,) = records_of(child)
    assert r.stream != stream.ptr  # a pool stream, made to wait for the parent
    assert seen[0][1] == r.stream  # fn ran with it current
    grand = child.then(lambda v: v * 2)  # the child's own pool stream: no wait, same stream
    assert twin_then == []
    assert records_of(grand)[0].stream == r.stream
    fake_cuda.complete_all()
    assert (grand.result() == (x + 1) * 2).all()


@native_only
@pytest.mark.parametrize(
    "case", ["pending parent", "bound method", "priority high", "bad priority", "async fn", "traced"]
)
def test_then_leaves_to_the_twin_what_the_native_path_does_not_handle(
    fake_cuda: testing.FakeCuda, twin_then: list[Any], case: str, tmp_path: Any
) -> None:
    stream = fake_cuda.stream()
    parent: cudafut.CudaFuture[Any] = (
        cudafut.CudaFuture() if case == "pending parent" else cudafut.record(np.arange(2.0), stream=stream)
    )

    class Holder:
        def method(self, v: Any) -> Any:
            return v

    async def coro(v: Any) -> Any:
        return v

    if case == "pending parent":
        child = parent.then(lambda v: v)
        parent.set_result(1)
        fake_cuda.complete_all()
        assert child.result() == 1
    elif case == "bound method":
        parent.then(Holder().method)
    elif case == "priority high":
        parent.then(lambda v: v, priority="high")
    elif case == "bad priority":
        with pytest.raises(ValueError, match="priority"):
            parent.then(lambda v: v, priority="urgent")  # type: ignore[call-overload]
    elif case == "async fn":
        with pytest.raises(TypeError, match="coroutine function"):
            parent.then(coro)
    else:
        with cudafut.trace(tmp_path / "trace.json"):
            parent.then(lambda v: v)
    # Refused arguments raise before any callback is registered.
    expected = 0 if case in ("priority high", "bad priority", "async fn") else 1
    assert len(twin_then) == expected, case
    fake_cuda.complete_all()


@native_only
@pytest.mark.parametrize("raised", [ValueError("fn broke"), KeyboardInterrupt()])
def test_native_then_fails_the_child_with_what_fn_raised(
    fake_cuda: testing.FakeCuda, twin_then: list[Any], raised: BaseException
) -> None:
    parent = cudafut.record(np.arange(2.0), stream=fake_cuda.stream())

    def fn(v: Any) -> Any:
        raise raised

    if isinstance(raised, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            parent.then(fn)  # raised again to the caller, as the twin does
        assert twin_then == []
        return
    child = parent.then(fn)
    assert twin_then == []
    with pytest.raises(ValueError, match="fn broke"):
        child.result()


@native_only
def test_a_future_finalized_by_the_interpreters_last_collection_raises_nothing() -> None:
    # The test above leaves futures to the interpreter's last collection, in
    # which a finalizer that asked the sys module whether the interpreter
    # ends raised on Python 3.12 (printed at exit as "Error in sys.excepthook").
    test = "tests/test_native.py::test_native_then_fails_the_child_with_what_fn_raised"
    args = ["-q", "-p", "no:cacheprovider", test]
    done = run_python(f"import sys, pytest; sys.exit(pytest.main({args!r}))")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "Error in sys.excepthook" not in done.stderr + done.stdout
    assert "Exception ignored" not in done.stderr + done.stdout


@native_only
def test_native_then_follows_a_future_fn_returns(fake_cuda: testing.FakeCuda, twin_then: list[Any]) -> None:
    stream = fake_cuda.stream()
    parent = cudafut.record(np.arange(2.0), stream=stream)
    inner: cudafut.CudaFuture[str] = cudafut.CudaFuture()
    child = parent.then(lambda v: inner)
    assert twin_then == [] and not child.done()
    inner.set_result("inner")
    fake_cuda.complete_all()
    assert child.result() == "inner"


# -- every entry point, random wrong arguments: an exception or a result, never a crash ------

#: Run in a child (a crash must fail the test, not end pytest). Finds the
#: native core's entry points itself (module functions, classes, their
#: methods and settable attributes on a live record and pool), so that an
#: entry point added later is fuzzed too, and calls each with 0 to 4
#: arguments drawn from wrong and borderline values mixed with valid ones.
FUZZ = """
import random, sys
import anyio
import numpy as np
import cudafut
from cudafut import CudaFuture
from cudafut import _compiled, testing

core = _compiled.native()
# Global switches, each refused one by one in BAD_CALLS: a fuzzed call that
# took its arguments would leave the core unbound (bind), on another backend
# (_swap_streams), mutated (_mutate) or its futures' paths unbound (bind_future,
# bind_then, bind_record, bind_set_future).
SKIP = {"bind", "bind_future", "bind_then", "bind_record", "bind_set_future", "_swap_streams", "_mutate"}
calls = 0
with testing.fake_cuda(devices=2) as fake:
    stream = fake.stream(0)
    ptr = int(stream.ptr)

    def fresh():
        return core.record(ptr, 0, None, stream)

    values = [None, "s", b"b", -1, 0, 1, 2, 64, 1 << 31, 1 << 63, 1 << 80, -(1 << 80), 3.5, float("nan"),
              object(), [], (object(),), {}, (0, 0), lambda *a: None, stream, ptr, fresh(), core.EventPool()]

    def entry_points():
        for name, obj in sorted(vars(core).items()):
            if name in SKIP or name.startswith("__") and not name.startswith("__pyx"):
                continue
            if isinstance(obj, type) and obj.__module__ == core.__name__:
                yield name, obj
                made = {"EventRecord": fresh, "EventPool": core.EventPool}.get(name)
                if made is None:
                    continue
                inst = made()
                for attr in sorted(dir(obj)):
                    if attr in SKIP or attr.startswith("__") and not attr.endswith("cython__"):
                        continue
                    member = getattr(obj, attr)
                    if callable(member):
                        yield f"{name}.{attr}", getattr(inst, attr)
                    elif hasattr(member, "__set__"):
                        yield f"{name}.{attr} =", lambda v, inst=inst, attr=attr: setattr(inst, attr, v)
            elif callable(obj) and type(obj).__name__.endswith("function_or_method"):
                yield name, obj

    names = []
    for seed in range(3):
        rng = random.Random(seed)
        for name, fn in entry_points():
            names.append(name)
            for n in range(5):
                for _ in range(40 if n else 1):
                    calls += 1
                    try:
                        fn(*[rng.choice(values) for _ in range(n)])
                    except Exception:
                        pass
    fut = cudafut.record(np.ones(2), stream=fake.stream(1))  # the core still works
    fake.complete_all()
    assert fut.result(timeout=0).tolist() == [1.0, 1.0]
print(calls, " ".join(sorted(set(names))))
"""


@native_only
def test_every_native_entry_point_survives_random_wrong_arguments() -> None:
    proc = run_python(FUZZ, timeout=120)
    crashed = f"the fuzz crashed the native core (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, crashed
    calls, *names = proc.stdout.split()
    assert int(calls) > 10_000
    some = {"record", "first_error", "EventRecord.settle", "EventRecord.wait_on", "EventPool.release"}
    assert some <= set(names)


@native_only
def test_a_record_is_not_pickled_and_has_no_pickle_state_to_set() -> None:
    # Cython's generated pickling read a state tuple unchecked (boundscheck
    # off): a short tuple was a segmentation fault. The core's classes are
    # not picklable (auto_pickle=False); a future crosses processes through
    # its own __reduce__ (docs/processes.md).
    import pickle

    rec = _events.EventRecord(1, 0, 0, (0, 0), 1, 0.0)
    assert not hasattr(rec, "__setstate_cython__")
    assert not hasattr(NATIVE, "__pyx_unpickle_EventRecord")
    with pytest.raises(TypeError):
        pickle.dumps(rec)


def test_the_core_calls_the_backend_in_force_and_records_keep_it(
    fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both cores: record(), the pool's misses and current_stream go to
    # _backend.current (the fake here), and the record asks the backend that
    # made it, through the interface's calls.
    backend = _backend.current
    made: list[str] = []
    for name in ("event_create", "event_record", "current_stream", "event_query"):
        real = getattr(backend, name)

        def call(*args: Any, _real: Any = real, _name: str = name) -> Any:
            made.append(_name)
            return _real(*args)

        monkeypatch.setattr(backend, name, call)
    monkeypatch.setattr(_pools, "events", _pools.EventPool())  # empty: the first acquire creates
    rec = _events.record_current(0)
    assert rec.calls is backend
    assert made == ["current_stream", "event_create", "event_record"]
    fake_cuda.complete_all()
    assert rec.query() == 0
    assert made[3:] == ["event_query"]


def test_a_record_made_without_a_backend_asks_cudas(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _backend.cuda()
    monkeypatch.setattr(cuda, "event_query", lambda handle: 0)
    rec = _events.EventRecord(-1, 0, 0x77, (0, 0x77), 1, 0.0)
    assert rec.calls is cuda
    assert rec.query() == 0 and rec.error() is None
    assert rec.ended() is None


class _DlpackOnDevice1:
    """A DLPack producer on device 1 (as a JAX array): what it was asked to
    order before."""

    def __init__(self) -> None:
        self.streams: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 1)

    def __dlpack__(self, stream: Any = None) -> None:
        self.streams.append(stream)


def test_then_orders_fns_foreign_output_on_another_device_before_that_devices_stream() -> None:
    with testing.fake_cuda(devices=2, auto_complete=True) as gpu:
        parent = cudafut.record(np.ones(3), stream=gpu.stream(0))
        out = _DlpackOnDevice1()
        child = parent.then(lambda v: out)
        assert out.streams == [int(_backend.current.current_stream(1).ptr)]
        assert sorted({r.device for r in records_of(child)}) == [0, 1]


def test_then_follows_a_returned_future_of_a_subclass(fake_cuda: testing.FakeCuda) -> None:
    class Mine(cudafut.CudaFuture[Any]):
        pass

    fake_cuda.auto_complete = True
    parent = cudafut.record(np.ones(3), stream=fake_cuda.stream())
    inner = Mine()
    inner.set_result("inner")
    assert parent.then(lambda v: inner).result() == "inner"


@native_only
def test_native_then_on_cuda_gives_the_caller_its_device_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of the native then() (CuPy's getDevice/setDevice, the
    stream entered): the caller's device comes back whatever fn set, and
    when entering the stream raises. CuPy's runtime is a stand-in, and
    CUDA's backend calls the fake's."""
    import types

    from cudafut import _backend

    with testing.fake_cuda(devices=2, auto_complete=True) as gpu:
        fake = _backend.current
        local = threading.local()
        runtime = types.SimpleNamespace(
            getDevice=lambda: getattr(local, "device", 0), setDevice=lambda d: setattr(local, "device", d)
        )
        cuda = types.ModuleType("cupy.cuda")
        cuda.runtime = runtime  # type: ignore[attr-defined]
        cuda.Stream = cuda.ExternalStream = type("Stream", (), {})  # type: ignore[attr-defined]
        cupy = types.ModuleType("cupy")
        cupy.cuda = cuda  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        cuda_backend = _backend.cuda()
        for name in ("event_record", "event_create", "current_stream", "event_query", "stream_wait"):
            monkeypatch.setattr(cuda_backend, name, getattr(fake, name))
        restore = NATIVE._swap_streams(cuda_backend)  # type: ignore[union-attr]
        try:
            # Each future's status is learnt while CUDA's backend calls the
            # fake: a future dropped with its status unknown waits on its
            # stream's list for a later query, which would reach the real
            # backend (no driver here) once the patches are undone.
            parent = cudafut.record(np.ones(3), stream=gpu.stream(0))

            def switches(v: Any) -> Any:
                runtime.setDevice(1)  # as cupy.cuda.Device(1).use()
                return v

            child = parent.then(switches)
            assert child.exception() is None
            assert runtime.getDevice() == 0
            assert parent.done()

            runtime.setDevice(1)
            parent = cudafut.record(np.ones(3), stream=gpu.stream(0))
            assert parent.done()

            def refuse(self: Any) -> None:
                raise RuntimeError("enter failed")

            monkeypatch.setattr(testing.FakeStream, "__enter__", refuse)
            child = parent.then(lambda v: v)
            assert isinstance(child.exception(), RuntimeError)
            assert runtime.getDevice() == 1
        finally:
            restore()


def test_a_known_status_is_final_whatever_settle_is_told(fake_cuda: testing.FakeCuda) -> None:
    # Both cores: a record failed from the host (an aborted collective) or
    # settled already keeps its status when another thread settles it late.
    failed = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    failed.fail_with(RuntimeError("aborted"))
    assert failed.settle(0) == _events.FAILED and failed.settle(700) == _events.FAILED
    assert isinstance(failed.error(), RuntimeError)
    done = records_of(_record_on(_pools.streams.get(0, 0)))[0]
    asked: list[bool] = []
    done.confirm = lambda: asked.append(True)
    assert done.settle(0) == 0 and asked == [True]
    assert done.settle(700) == 0 and asked == [True]  # settled once: no confirm again
    fake_cuda.complete_all()


# -- many awaits: a new wait from C while a poll is queued ---------------------------------

_LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


def _spin_many(loop: str, fake_cuda: testing.FakeCuda, n: int) -> list[int]:
    """``n`` tasks await records of one stream while the policy spins (a
    plain loop, not in debug mode); the records complete after a few loop
    iterations. Returns the tasks' values."""
    from tests.runners import run_on

    async def main() -> list[int]:
        stream = fake_cuda.stream()
        futs = [cudafut.record(i, stream=stream) for i in range(n)]

        async def one(fut: CudaFuture[int]) -> int:
            return await fut

        tasks = [asyncio.ensure_future(one(f)) for f in futs]
        for _ in range(20):  # every await joins the waiter; it spins meanwhile
            await asyncio.sleep(0)
        fake_cuda.complete_all()
        return await asyncio.gather(*tasks)

    previous = cudafut.set_wait_policy("low_latency")
    try:
        return run_on(loop, main)
    finally:
        cudafut.set_wait_policy(previous)


@native_only
@pytest.mark.parametrize("loop", _LOOPS)
def test_an_await_among_others_asks_for_a_poll_only_where_none_is_queued(
    loop: str, fake_cuda: testing.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ensure_polling() returns at once while a poll is queued (spinning): the
    # native await does not call it then. Where none is queued it must, or
    # the await would never be polled: the tasks' values prove it was.
    modes: list[int] = []
    ensure = _loops.AsyncioDriver.ensure_polling

    def counted(self: Any) -> None:
        modes.append(self._mode)
        ensure(self)

    monkeypatch.setattr(_loops.AsyncioDriver, "ensure_polling", counted)
    assert _spin_many(loop, fake_cuda, 200) == list(range(200))
    # (The first await spun alone in its task; it joins the others through
    # the driver's Python path, Driver.watch, which asks in any mode.)
    assert modes.count(_loops._SPIN) <= 1, modes


@native_only
def test_the_native_await_reads_the_asyncio_drivers_spinning_mode_by_its_value() -> None:
    # AsyncioEntry._watch compares the driver's _mode with a C constant.
    assert _loops._SPIN == 1


@native_only
def test_an_await_behind_an_older_watched_record_of_its_stream_asks_cuda_nothing(
    fake_cuda: testing.FakeCuda,
) -> None:
    """A stream completes in order, and the loop's poll walks its queue
    oldest first: an await of a record behind a live watch of the same
    stream joins the queue without a query (10,000 concurrent awaits on a
    few streams make one query per stream per poll, not one per await),
    and still completes with its stream. An older record, a record of
    another stream, or one behind a watch that was removed is queried."""
    assert NATIVE is not None
    s, t, u = fake_cuda.stream(), fake_cuda.stream(), fake_cuda.stream()

    async def wait(fut: cudafut.CudaFuture[Any]) -> Any:
        return await fut

    def queries_to_start(fut: cudafut.CudaFuture[Any]) -> int:
        queried = int(NATIVE.counts()[0])
        it = fut.__await__()
        asked = int(NATIVE.counts()[0]) - queried
        it.close()
        return asked

    async def main() -> None:
        older = cudafut.record(0, stream=s)
        watched = cudafut.record(1, stream=s)
        elsewhere = cudafut.record(2, stream=t)
        newer = cudafut.record(3, stream=s)
        waiting = [asyncio.ensure_future(wait(f)) for f in (watched, elsewhere)]
        for _ in range(3):
            await asyncio.sleep(0)
        driver = _loops.current_driver()
        assert driver is not None and driver.watchlist.pending == 2
        assert queries_to_start(newer) == 0
        assert queries_to_start(watched) == 0  # the watched record itself
        assert queries_to_start(cudafut.record(4, stream=t)) == 0
        assert queries_to_start(older) == 1
        assert queries_to_start(cudafut.record(5, stream=u)) == 1
        behind = asyncio.ensure_future(wait(newer))
        await asyncio.sleep(0)
        assert driver.watchlist.pending == 3
        fake_cuda.complete(newer)
        with anyio.fail_after(10):
            assert await behind == 3
            assert await waiting[0] == 1
        waiting[1].cancel()  # the only watch of t goes
        await asyncio.gather(waiting[1], return_exceptions=True)
        assert queries_to_start(cudafut.record(6, stream=t)) == 1
        fake_cuda.complete_all()

    asyncio.run(main())


@native_only
def test_then_continues_on_its_parents_pool_stream_of_the_same_priority(fake_cuda: testing.FakeCuda) -> None:
    """A child continues on its parent's pool stream only where that stream
    has the child's priority (the native then() remembers the lookup per
    stream and priority): fails if the remembered stream is reused for
    another priority."""
    parent = cudafut.record(np.arange(2.0), stream=fake_cuda.stream())

    def stream_of(fut: CudaFuture[Any]) -> int:
        [rec] = records_of(fut)
        return int(rec.stream)

    a = parent.then(lambda v: v)  # the pool's next normal stream
    b = a.then(lambda v: v)  # continues there
    assert stream_of(b) == stream_of(a)
    high = b.then(lambda v: v, priority="high")
    assert stream_of(high) != stream_of(b)
    assert _pools.streams.lookup(stream_of(high), _pools.PRIORITIES["high"]) is not None
    high2 = high.then(lambda v: v, priority="high")  # continues on the high stream
    assert stream_of(high2) == stream_of(high)
    normal = high2.then(lambda v: v)  # not on the high stream: a normal one
    assert stream_of(normal) != stream_of(high2)
    assert _pools.streams.lookup(stream_of(normal), _pools.PRIORITIES["normal"]) is not None
    normal2 = normal.then(lambda v: v)
    assert stream_of(normal2) == stream_of(normal)
    fake_cuda.complete_all()
    assert (normal2.result() == np.arange(2.0)).all()
