"""The native core's event records on a real device (cudafut/_core.pyx):
CUDA called from C reports pending work as pending; a stream's watermark
answers for older records only once a newer one has really completed; the
numbers of records made by several threads on one stream follow the
stream's order (or the watermark would report unfinished work done); the
default streams go through the runtime where the fast path cannot name
their device. Each holds on the pure core too, where it applies."""

from __future__ import annotations

import contextlib
import gc
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cudafut import _backend, _compiled, _event_calls, _events, _pools
from tests.kernels import Gate, gated_fill, spin_fill

pytestmark = pytest.mark.gpu

NATIVE = _compiled.native()


def _truly_done(rec: Any) -> bool:
    """What the runtime (CuPy) says of the record's event, past any answer
    cudafut keeps."""
    return _event_calls.event_query(rec.handle) == 0


@contextlib.contextmanager
def _held(cp: Any) -> Iterator[tuple[Any, Any]]:
    """cudafut's own stream of device 0 (ordered), held by a gated kernel
    while the block runs, so what the block records on it stays pending;
    yields the stream and the kernel's output. After the block: the gate
    opens, the stream is synchronised, and a gate that timed out fails."""
    stream = _pools.streams.get(0, 0)
    x = cp.zeros(1024, dtype=cp.float32)
    with stream:
        spin_fill(x, 1, 0.01)  # the module loaded before the gate closes
    stream.synchronize()
    with Gate() as gate:
        with stream:
            gated_fill(x, 7, gate)
        yield stream, x
    stream.synchronize()
    assert not gate.timed_out


def test_a_record_behind_unfinished_work_is_pending_and_older_ones_wait_for_a_newer_one(cp: Any) -> None:
    with _held(cp) as (stream, x):
        older = _events.record(int(stream.ptr), 0)
        with stream:
            spin_fill(x, 8, 0.01)
        newer = _events.record(int(stream.ptr), 0)
        assert older.query() is None and newer.query() is None
        assert not _truly_done(older)
    counts = NATIVE.counts() if NATIVE is not None else None
    assert newer.query() == 0
    assert older.query() == 0 and _truly_done(older)
    if NATIVE is not None:
        queried, answered = NATIVE.counts()
        assert counts is not None and (queried, answered) == (counts[0] + 1, counts[1] + 1)
    assert float(x[0]) == 8.0


def test_records_of_several_threads_on_one_stream_are_numbered_in_the_streams_order(cp: Any) -> None:
    stream = _pools.streams.get(0, 0)
    out = cp.zeros(256, dtype=cp.float32)
    with stream:
        spin_fill(out, 0, 0.001)
    stream.synchronize()
    records: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        cp.cuda.Device(0).use()
        start.wait()
        for _ in range(150):
            with stream:
                spin_fill(out, 1, rng.uniform(0.0, 0.05))
            mine.append(_events.record(int(stream.ptr), 0))
        with lock:
            records.extend(mine)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records.sort(key=lambda r: r.seq)
    assert len({r.seq for r in records}) == len(records) == 600
    # Newest first, while the stream still works: a record the core calls
    # complete must be complete, whichever record answered for it.
    wrong = []
    while not all(r.status == 0 for r in records):
        for rec in reversed(records):
            if rec.query() == 0 and not _truly_done(rec):
                wrong.append(rec.seq)
    stream.synchronize()
    assert not wrong, f"reported complete before their work: {wrong[:10]}"


@pytest.mark.parametrize("special", [0, 2], ids=["legacy default stream", "per-thread stream"])
def test_the_default_streams_are_recorded_on_from_a_fresh_thread(cp: Any, special: int) -> None:
    got: list[Any] = []

    def fresh() -> None:
        try:
            rec = _events.record(special, 0)
            cp.cuda.runtime.deviceSynchronize()
            got.append(rec.query())
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert got == [0]


def test_events_made_and_destroyed_beyond_the_free_list_record_and_complete(
    cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of pending records beyond the pool's free list: the pool makes
    their events (the native core from C, where the device's context is
    current), each records and completes as the runtime sees it, and those
    beyond the free limit are destroyed when their records go."""
    monkeypatch.setattr(_pools, "_MAX_FREE_EVENTS", 4)
    pool = _pools.EventPool()  # the test's own: other tests' records change nothing
    monkeypatch.setattr(_pools, "events", pool)
    # The backend's calls, counted: the native core makes none (it calls the driver).
    calls = {"event_create": 0, "event_destroy": 0}
    for name in calls:
        original = getattr(_backend.current, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(_backend.current, name, counted)
    with _held(cp) as (stream, _):
        recs = [_events.record(int(stream.ptr), 0) for _ in range(32)]
        assert len({rec.handle for rec in recs}) == 32
        assert not any(_truly_done(rec) for rec in recs)
    assert all(rec.query() == 0 and _truly_done(rec) for rec in recs)
    assert pool.created == 32
    del recs
    gc.collect()
    assert pool.counts() == ({0: 4}, {0: 0})  # 4 kept free, 28 destroyed
    if NATIVE is not None:
        assert calls == {"event_create": 0, "event_destroy": 0}
    else:
        assert calls == {"event_create": 32, "event_destroy": 28}


def test_awaits_queued_behind_a_watched_record_of_their_stream_resume_once_it_is_done(cp: Any) -> None:
    """200 awaits of records on one stream held by gated work: on the native
    core, an await behind a watched record of its stream joins the queue
    without asking CUDA (a few queries in all, the waiter's polls, where
    one per await was made before); on both cores every await resumes
    once the gate opened, its record's event complete as the runtime
    reports it."""
    import asyncio

    import cudafut
    from cudafut._interface import records_of

    n = 200
    stream = _pools.streams.get(0, 0)  # cudafut's own: ordered
    x = cp.zeros(1024, dtype=cp.float32)
    with stream:
        spin_fill(x, 1, 0.01)  # the modules loaded before the gate closes
    stream.synchronize()
    opened = False
    seen: list[tuple[bool, bool]] = []

    async def wait(fut: Any) -> None:
        await fut
        seen.append((opened, _truly_done(records_of(fut)[0])))

    async def main() -> int:
        nonlocal opened
        with Gate() as gate:
            with stream:
                gated_fill(x, 7, gate)
            futs = [cudafut.record(i, stream=stream) for i in range(n)]
            queried = NATIVE.counts()[0] if NATIVE is not None else 0
            tasks = [asyncio.ensure_future(wait(f)) for f in futs]
            for _ in range(3):
                await asyncio.sleep(0)
            asked = (NATIVE.counts()[0] - queried) if NATIVE is not None else 0
            assert not seen
            opened = True
            gate.open()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert not gate.timed_out
        return asked

    asked = asyncio.run(main())
    assert seen == [(True, True)] * n
    assert float(x[0]) == 7.0
    if NATIVE is not None:
        assert asked < 20, asked  # 200 and more with a query per await
