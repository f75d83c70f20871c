"""Tracked's bookkeeping on the host: which waits a block inserts or skips,
which event it records, what statistics() counts, the off switches and the
argument errors. CUDA is replaced by scripted records (tests/fakes.py) and a
fake current stream, so this runs without a GPU; tests/test_gpu_tracked.py
proves the ordering on one."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _backend, _copies, _events, _memory, _tracked
from tests.fakes import FakeRecord

S1, S2, S3, S4, COPY = 0x100, 0x200, 0x300, 0x400, 0x900


class FakeArray:
    """A GPU array as far as cudafut can tell without CUDA."""

    def __init__(self, device: int = 0) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x1000, False),
            "version": 3,
        }
        self.device = SimpleNamespace(id=device)


class OwnedLock:
    """A lock that knows which thread holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> None:
        self.lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self.lock.release()


class FakeCuda:
    """The calls Tracked makes to CUDA, scripted and logged. Every call also
    checks that the calling thread holds no Tracked's lock (the lock covers
    bookkeeping only)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.records: list[FakeRecord] = []
        self.waits: list[tuple[int, int, int]] = []
        self.marked: list[tuple[tuple[int, ...], bool]] = []
        self.tracked: list[cudafut.Tracked[Any]] = []
        self.streams: dict[int, Any] = {}

    def use(self, handle: int) -> None:
        """Make ``handle`` this thread's current stream."""
        self.local.stream = self.streams.setdefault(handle, SimpleNamespace(ptr=handle))

    def current_stream(self, device: int) -> Any:
        self.check_unlocked()
        return self.local.stream

    def record(self, stream: int, device: int, confirm: Any = None, owner: Any = None) -> FakeRecord:
        self.check_unlocked()
        rec = FakeRecord(stream, device=device)
        self.records.append(rec)
        return rec

    def stream_wait(self, stream: int, event: int, device: int) -> None:
        self.check_unlocked()
        self.waits.append((stream, event, device))

    def record_streams_of(self, arrays: Any, streams: Any, *, untracked: bool) -> None:
        self.marked.append((tuple(handle for handle, _, _ in streams), untracked))

    def check_unlocked(self) -> None:
        me = threading.get_ident()
        owners = [getattr(t._lock, "owner", None) for t in self.tracked]
        assert me not in owners, "a CUDA call under a Tracked's lock"

    def new(self, **kwargs: Any) -> cudafut.Tracked[FakeArray]:
        t = cudafut.Tracked(FakeArray(), **kwargs)
        t._lock = OwnedLock()  # type: ignore[assignment]
        self.tracked.append(t)
        return t


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    cuda = FakeCuda()
    cuda.use(S1)
    monkeypatch.setattr(_backend.current, "current_stream", cuda.current_stream)
    monkeypatch.setattr(_backend.current, "stream_wait", cuda.stream_wait)
    monkeypatch.setattr(_events, "record", cuda.record)
    monkeypatch.setattr(_memory, "record_streams_of", cuda.record_streams_of)
    previous = cudafut.set_tracking(True)
    yield cuda
    cudafut.set_tracking(previous)
    cuda.tracked.clear()


def stats(t: cudafut.Tracked[Any]) -> tuple[int, int, int, int]:
    s = t.statistics()
    return (s.waits_inserted, s.waits_skipped_same_stream, s.waits_skipped_complete, s.events_recorded)


def write(fake: FakeCuda, t: cudafut.Tracked[Any], stream: int) -> FakeRecord:
    """A write block on ``stream``; its writer event."""
    fake.use(stream)
    with t.write():
        pass
    return fake.records[-1]


def read(fake: FakeCuda, t: cudafut.Tracked[Any], stream: int) -> FakeRecord:
    fake.use(stream)
    with t.read():
        pass
    return fake.records[-1]


# -- which waits ----------------------------------------------------------------------


def test_a_read_on_another_stream_waits_for_a_pending_writer(fake: FakeCuda) -> None:
    t = fake.new()
    writer = write(fake, t, S1)
    assert fake.waits == []  # the first writer (the making) was on S1 too
    fake.use(S2)
    with t.read() as a:
        assert a is t.array
        assert fake.waits == [(S2, writer.handle, 0)]  # before the block's work
    assert writer.queries == 1
    assert stats(t) == (1, 1, 0, 3)


def test_the_work_that_made_the_array_is_its_first_writer(fake: FakeCuda) -> None:
    t = fake.new()  # on S1
    made = fake.records[-1]
    assert (made.stream, stats(t)) == (S1, (0, 0, 0, 1))
    read(fake, t, S2)
    assert fake.waits == [(S2, made.handle, 0)]
    fake.use(S3)
    cudafut.Tracked(FakeArray(), enabled=False)
    cudafut.set_tracking(False)
    cudafut.Tracked(FakeArray())
    assert len(fake.records) == 2  # the read's: nothing recorded for either


def test_blocks_on_one_stream_insert_no_wait_and_query_nothing(fake: FakeCuda) -> None:
    t = fake.new()
    writer = write(fake, t, S1)
    read(fake, t, S1)
    write(fake, t, S1)
    read(fake, t, S1)
    assert fake.waits == []
    assert writer.queries == 0  # the stream decided it: no cudaEventQuery
    # write: the making; read: writer; write: writer + S1's reader; read: writer.
    assert stats(t) == (0, 5, 0, 5)


def test_a_complete_writer_is_not_waited_for_and_queried_once(fake: FakeCuda) -> None:
    t = fake.new()
    writer = write(fake, t, S1)
    writer.complete()
    read(fake, t, S2)
    read(fake, t, S3)
    assert fake.waits == []
    assert writer.queries == 1  # the second read used the cached status
    assert stats(t) == (0, 1, 2, 4)


def test_a_write_waits_for_the_writer_and_the_newest_reader_of_every_other_stream(fake: FakeCuda) -> None:
    t = fake.new()
    writer = write(fake, t, S1)
    read(fake, t, S2)
    newest_s2 = read(fake, t, S2)
    s3 = read(fake, t, S3)
    read(fake, t, S4).complete()
    fake.waits.clear()
    write(fake, t, S4)
    expected = [(S4, writer.handle, 0), (S4, newest_s2.handle, 0), (S4, s3.handle, 0)]
    assert sorted(fake.waits) == sorted(expected)


def test_two_readers_on_two_streams_do_not_replace_each_other(fake: FakeCuda) -> None:
    """docs/design.md, hazard 8: one reader event per stream, not per array."""
    t = fake.new()
    write(fake, t, S1).complete()
    r2 = read(fake, t, S2)
    r3 = read(fake, t, S3)
    fake.waits.clear()
    write(fake, t, S1)
    assert {event for _, event, _ in fake.waits} == {r2.handle, r3.handle}


def test_a_write_replaces_the_readers(fake: FakeCuda) -> None:
    t = fake.new()
    write(fake, t, S1)
    read(fake, t, S2)
    w2 = write(fake, t, S3)
    fake.waits.clear()
    write(fake, t, S4)
    assert fake.waits == [(S4, w2.handle, 0)]  # S2's read came before w2


def test_a_read_after_a_write_waits_for_the_writer_only(fake: FakeCuda) -> None:
    t = fake.new()
    write(fake, t, S1).complete()
    read(fake, t, S2)
    w = write(fake, t, S3)
    fake.waits.clear()
    read(fake, t, S4)
    assert fake.waits == [(S4, w.handle, 0)]


def test_the_event_goes_on_the_stream_of_the_entry_even_if_the_block_raises(fake: FakeCuda) -> None:
    t = fake.new()
    fake.use(S1)

    def block() -> None:
        with t.write():
            fake.use(S2)  # a block must keep its stream; the event follows the work it waited for
            raise KeyError("boom")

    with pytest.raises(KeyError):
        block()
    writer = fake.records[-1]
    assert writer.stream == S1
    fake.use(S3)
    with t.read():
        pass
    assert fake.waits == [(S3, writer.handle, 0)]


def test_nested_blocks_of_one_array_on_one_stream(fake: FakeCuda) -> None:
    t = fake.new()
    fake.use(S1)
    with t.read() as a, t.write() as b:
        assert a is b is t.array
    assert fake.waits == []
    write(fake, t, S2)
    # The writer, and S1's reader: the read block was left after the write.
    assert len(fake.waits) == 2


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["queried", "cached"])
def test_a_failed_writer_fails_every_block_and_to_host(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    t = fake.new()
    writer = write(fake, t, S1)
    writer.fail(700)
    if how == "cached":
        writer.query()
    monkeypatch.setattr(_copies, "to_host_after", lambda *a, **k: pytest.fail("enqueued a copy"))
    recorded = len(fake.records)
    for block in (t.read, t.write):
        fake.use(S2)
        with pytest.raises(cudafut.CudaError) as info, block():
            pytest.fail("the block ran")
        assert info.value.code == 700
    with pytest.raises(cudafut.CudaError):
        t.to_host()
    assert fake.waits == [] and len(fake.records) == recorded


def test_a_failed_reader_fails_a_write(fake: FakeCuda) -> None:
    t = fake.new()
    write(fake, t, S1).complete()
    read(fake, t, S2).fail(719)
    fake.use(S3)
    with pytest.raises(cudafut.CudaError, match="719"), t.write():
        pass


# -- memory -----------------------------------------------------------------------------


def test_each_stream_is_marked_on_the_array_once_and_all_of_them_at_the_end(fake: FakeCuda) -> None:
    gc.collect()  # earlier tests' garbage (frames of expected exceptions) must not report here
    fake.marked.clear()
    t = fake.new()
    read(fake, t, S3)
    read(fake, t, S3)
    write(fake, t, S4)
    read(fake, t, S4)
    assert fake.marked == [((S3,), False), ((S4,), False)]
    # The stream objects are kept reachable from the module (a collection
    # must not destroy them before the Tracked's finalizer records on them).
    key = id(t)
    assert set(_tracked._used[key]) == {S3, S4}
    fake.tracked.clear()
    del t
    gc.collect()
    assert fake.marked[2:] == [((S3, S4), True)]  # memory the wrapper did not allocate
    assert key not in _tracked._used


def test_an_unused_tracked_array_marks_nothing(fake: FakeCuda) -> None:
    gc.collect()
    fake.marked.clear()
    t = fake.new()
    fake.tracked.clear()
    del t
    gc.collect()
    assert fake.marked == []


# -- to_host --------------------------------------------------------------------------------


def fake_copy(fake: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def to_host_after(array: Any, order: Any, *, out: Any = None) -> tuple[Any, FakeRecord]:
        order(COPY)
        calls.append((array, out))
        return "future", fake.record(COPY, 0)

    monkeypatch.setattr(_copies, "to_host_after", to_host_after)
    return calls


def test_to_host_waits_for_the_writer_only_and_reads_on_the_copy_stream(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_copy(fake, monkeypatch)
    t = fake.new()
    writer = write(fake, t, S1)
    read(fake, t, S2)  # a reader: not waited for by the copy
    fake.waits.clear()
    out = np.empty(4, np.float32)
    got: Any = t.to_host(out=out)
    assert got == "future"
    assert calls == [(t.array, out)]
    assert fake.waits == [(COPY, writer.handle, 0)]
    copy_read = fake.records[-1]
    fake.waits.clear()
    write(fake, t, S3)  # waits for the copy to have read the array
    assert (S3, copy_read.handle, 0) in fake.waits
    # made; write (same stream); read (1 wait); to_host (1 wait); write (writer, S2, copy)
    assert stats(t) == (5, 1, 0, 5)


def test_to_host_of_an_array_never_written_waits_for_its_making(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_copy(fake, monkeypatch)
    t = fake.new()
    made = fake.records[-1]
    t.to_host()
    assert fake.waits == [(COPY, made.handle, 0)]
    assert stats(t) == (1, 0, 0, 2)


def test_to_host_after_checks_its_arguments_before_ordering_anything() -> None:
    def order(stream: int) -> None:
        pytest.fail("ordered a copy that cannot be made")

    with pytest.raises(TypeError, match="NumPy array"):
        _copies.to_host_after(FakeArray(), order, out=[0.0] * 4)
    with pytest.raises(ValueError, match="shape"):
        _copies.to_host_after(FakeArray(), order, out=np.empty(5, np.float32))
    with pytest.raises(TypeError, match="GPU array"):
        _copies.to_host_after(np.zeros(4), order)


# -- off ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["per array", "globally"])
def test_tracking_off_hands_out_the_array_and_touches_nothing(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "globally":
        assert cudafut.set_tracking(False) is True
    t = fake.new(enabled=how != "per array")
    block = t.read()
    assert t.read() is block and t.write() is block  # made once: no allocation per block
    for _ in range(3):
        fake.use(S2)
        with t.write() as a:
            assert a is t.array
        fake.use(S3)
        with t.read() as a:
            assert a is t.array
    plain: list[Any] = []

    def to_host(array: Any, out: Any = None) -> str:
        plain.append((array, out))
        return "plain"

    monkeypatch.setattr(_copies, "to_host", to_host)
    got: Any = t.to_host()
    assert got == "plain"
    assert plain == [(t.array, None)]  # after the caller's current stream, as cudafut.to_host
    assert fake.records == [] and fake.waits == [] and fake.marked == []
    assert stats(t) == (0, 0, 0, 0)
    assert cudafut.set_tracking(True) is (how == "per array")


def test_get_tracking_reads_what_set_tracking_set() -> None:
    assert cudafut.get_tracking() is True
    try:
        assert cudafut.set_tracking(False) is True
        assert cudafut.get_tracking() is False
    finally:
        assert cudafut.set_tracking(True) is False
    assert cudafut.get_tracking() is True


def test_blocks_run_while_tracking_was_off_are_not_recorded(fake: FakeCuda) -> None:
    t = fake.new()
    w = write(fake, t, S1)
    cudafut.set_tracking(False)
    write(fake, t, S2)  # fake.records[-1] is still w: nothing recorded
    cudafut.set_tracking(True)
    read(fake, t, S3)
    assert fake.waits == [(S3, w.handle, 0)]


# -- arguments ------------------------------------------------------------------------------


def test_argument_errors_say_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"one GPU array.*ndarray: copy host data.*to_device"):
        cudafut.Tracked(np.zeros(3))
    with pytest.raises(TypeError, match="list: wrap each array of a container in its own Tracked"):
        cudafut.Tracked([FakeArray(), FakeArray()])
    with pytest.raises(TypeError, match="dict: wrap each"):
        cudafut.Tracked({"x": FakeArray()})
    with pytest.raises(TypeError, match="True or False"):
        cudafut.Tracked(FakeArray(), enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True or False"):
        cudafut.Tracked(FakeArray(), enabled=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"True or False.*enabled=False"):
        cudafut.set_tracking(0)  # type: ignore[arg-type]
    assert cudafut.set_tracking(True) is True  # unchanged by the refusal


def test_attributes_statistics_and_repr(fake: FakeCuda) -> None:
    a = FakeArray(device=3)
    t = cudafut.Tracked(a)
    assert (t.array, t.device, t.enabled) == (a, 3, True)
    assert not cudafut.Tracked(a, enabled=False).enabled
    s = t.statistics()
    assert s == cudafut.TrackingStatistics(0, 0, 0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.waits_inserted = 1  # type: ignore[misc]
    assert "writer on 0x100" in repr(t) and "device 3" in repr(t)
    assert "untracked" in repr(cudafut.Tracked(a, enabled=False))
    assert cudafut.Tracked.__module__ == cudafut.set_tracking.__module__ == "cudafut"


# -- threads --------------------------------------------------------------------------------


def test_blocks_from_many_threads_keep_the_bookkeeping_whole(fake: FakeCuda) -> None:
    t = fake.new()
    per_thread, threads = 300, 8
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def run(i: int) -> None:
        try:
            fake.use(0x1000 + i)
            start.wait()
            for j in range(per_thread):
                with t.write() if j % 3 == 0 else t.read():
                    pass
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    s = t.statistics()
    assert s.events_recorded == per_thread * threads + 1
    assert len(t._readers) <= threads
    # Every wait decision was counted once: one per read after the first
    # write, one per writer and reader a write found.
    decisions = s.waits_inserted + s.waits_skipped_same_stream + s.waits_skipped_complete
    assert decisions >= per_thread * threads - threads * 3
    assert _tracked._tracking
