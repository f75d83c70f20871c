"""Futures across processes, the host's part (cudafut._shared): what may be
pickled and the errors that say why not, and the ledger's protocol between
real processes (claim, release, a receiver that dies, a ticket nobody
takes). The CUDA part (events, memory) is tests/test_gpu_shared.py's."""

from __future__ import annotations

import pickle
import time
from typing import Any

import anyio
import numpy as np
import pytest

import cudafut
from cudafut import _shared
from cudafut._interface import set_future
from tests import shared_worker
from tests.children import Child, until


def _freed(ticket: tuple[Any, ...]) -> bool:
    """Whether the producer (this process) let go of ``ticket``'s export."""
    entry = _shared._state.exports.get(ticket[7])
    return entry is None or entry.gen != ticket[8]


def _held() -> int:
    return cudafut.shared_statistics().held


def _ticket(value: object) -> tuple[Any, ...]:
    """An export of a host value held for one receiver, as a GPU value is."""
    fut = set_future(value, ())
    return _shared.held_ticket(fut, value, pickle.dumps(value), None)


# -- the rules --------------------------------------------------------------------------------


def test_a_pending_future_does_not_cross() -> None:
    with pytest.raises(cudafut.InvalidStateError, match=r"enqueued\(fut\)"):
        pickle.dumps(cudafut.CudaFuture())


def test_a_cancelled_future_crosses_cancelled() -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    fut.cancel()
    assert pickle.loads(pickle.dumps(fut)).cancelled()


def test_a_failed_future_crosses_with_its_exception() -> None:
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    fut.set_exception(ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        pickle.loads(pickle.dumps(fut)).result(0)


def test_an_exception_that_does_not_pickle_crosses_as_its_repr() -> None:
    class LocalError(Exception):  # a local class does not pickle
        pass

    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    fut.set_exception(LocalError("lost"))
    with pytest.raises(cudafut.SharingError, match=r"LocalError\('lost'\).*does not pickle"):
        pickle.loads(pickle.dumps(fut)).result(0)


def test_done_work_with_a_host_value_crosses_by_value(fake_cuda: Any) -> None:
    fut = cudafut.record(np.arange(3.0))  # the fake's "GPU" arrays are NumPy's
    fake_cuda.complete_all()
    got = pickle.loads(pickle.dumps(fut))
    assert got is not fut
    np.testing.assert_array_equal(got.result(0), np.arange(3.0))


def test_pending_work_on_the_fake_says_it_cannot_cross(fake_cuda: Any) -> None:
    fut = cudafut.record("done later", stream=fake_cuda.stream())
    with pytest.raises(cudafut.CudaUnavailableError, match="fake GPU cannot share"):
        pickle.dumps(fut)


def test_a_host_array_of_pending_work_does_not_cross(fake_cuda: Any) -> None:
    """The GPU may still be writing it (a copy to the host)."""
    fut = cudafut.record({"copy": np.zeros(4)}, stream=fake_cuda.stream())
    with pytest.raises(cudafut.InvalidStateError, match=r"host array \(numpy.ndarray\).*half-written"):
        pickle.dumps(fut)


def test_a_gpu_array_ipc_cannot_share_is_refused_by_name() -> None:
    class DeviceArray:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {}

    fut = set_future({"x": [DeviceArray()]}, ())
    with pytest.raises(TypeError, match=r"DeviceArray cannot cross.*cupy\.asarray"):
        pickle.dumps(fut)


def test_a_ticket_from_another_machine_is_refused() -> None:
    ticket = list(_ticket(1))
    ticket[3] = "another-boot-id"
    with pytest.raises(cudafut.SharingError, match="another machine"):
        _shared.import_ticket(tuple(ticket))


def test_a_ticket_of_another_format_is_refused() -> None:
    with pytest.raises(cudafut.SharingError, match="same cudafut"):
        _shared.import_ticket((99, "value", b""))


def test_unpickled_where_pickled_gives_the_future_itself() -> None:
    fut = set_future("v", ())
    before = _held()
    ticket = _shared.held_ticket(fut, "v", pickle.dumps("v"), None)
    assert _held() == before + 1
    assert _shared.import_ticket(ticket) is fut
    assert _held() == before
    with pytest.raises(cudafut.SharingError, match="no longer held"):
        _shared.import_ticket(ticket)


def test_exports_sharing_an_event_and_an_allocation_give_them_back_after_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows of a batch share one interprocess event and one IPC handle,
    a use each: freeing one export keeps both; freeing the last returns the
    event to the free list, once, and forgets the allocation."""
    from cudafut import _backend

    monkeypatch.setattr(_backend.current, "device_bus_id", lambda device: "0000:00:00.0")
    st = _shared._state
    # Device -9: a free list no real export takes from.
    event = _shared._SharedEvent(-9, 11, b"e" * 64, (), ())
    span = _shared._Span(-9, 0x1000, 0x2000, "0000:00:00.0", b"m" * 64)
    with st.lock:
        st.shared_events[event.key] = event
        st.spans[-9, 0x1000] = span
        st.last_span[-9] = span
    event.uses = span.uses = 2  # as _shared_event() and _span() take them, one per export
    tickets = [_shared.held_ticket(set_future(i, ()), i, pickle.dumps(i), event, (span,)) for i in range(2)]
    try:
        _shared.import_ticket(tickets[0])  # where it was pickled: frees the export
        assert (event.uses, span.uses) == (1, 1)
        assert st.shared_events.get(event.key) is event and st.last_span.get(-9) is span
        assert not st.free_events.get(-9)
        _shared.import_ticket(tickets[1])
        assert (event.uses, span.uses) == (0, 0)
        assert st.free_events[-9] == [(11, b"e" * 64)]
        assert event.key not in st.shared_events
        assert (-9, 0x1000) not in st.spans and -9 not in st.last_span
    finally:
        st.free_events.pop(-9, None)


@pytest.mark.anyio
async def test_enqueued_returns_once_set_not_once_done(fake_cuda: Any) -> None:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    returned = anyio.Event()

    async def wait() -> None:
        await cudafut.enqueued(fut)
        returned.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await anyio.sleep(0.01)
        assert not returned.is_set()
        fut.set_result(np.zeros(3))  # records an event the fake leaves pending
    assert not fut.done()
    fake_cuda.complete_all()


@pytest.mark.anyio
async def test_enqueued_takes_only_a_future() -> None:
    with pytest.raises(TypeError, match="takes a CudaFuture"):
        await cudafut.enqueued(object())  # type: ignore[arg-type]


# -- the ledger, between processes -------------------------------------------------------------


def test_a_receiver_that_lets_go_frees_the_export(children: list[Child]) -> None:
    child = Child(shared_worker.receive_ticket, True)
    children.append(child)
    ticket = _ticket({"answer": 42})
    assert child.ask(ticket, limit_s=60) == {"answer": 42}
    until(lambda: _freed(ticket), "the export freed once the receiver let go")


def test_a_receiver_that_dies_frees_the_export(children: list[Child]) -> None:
    child = Child(shared_worker.receive_ticket, False)  # never writes its release
    children.append(child)
    ticket = _ticket(7)
    assert child.ask(ticket, limit_s=60) == 7
    time.sleep(1.0)  # several of the producer's rounds: the receiver lives
    assert not _freed(ticket)
    child.process.kill()
    child.process.join(30)
    until(lambda: _freed(ticket), "the export freed once its receiver died")


def test_a_ticket_received_twice_is_refused(children: list[Child]) -> None:
    ticket = _ticket(3)
    first = Child(shared_worker.receive_ticket, False)
    second = Child(shared_worker.receive_ticket, False)
    children += [first, second]
    assert first.ask(ticket, limit_s=60) == 3
    assert "received already" in second.ask(ticket, limit_s=60)


def test_a_ticket_nobody_takes_expires(children: list[Child], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDAFUT_SHARE_CLAIM_S", "0.2")
    ticket = _ticket(5)
    until(lambda: _freed(ticket), "an export nobody received freed after CUDAFUT_SHARE_CLAIM_S")
    child = Child(shared_worker.receive_ticket, True)
    children.append(child)
    assert "no longer held" in child.ask(ticket, limit_s=60)


@pytest.mark.parametrize("text", ["soon", "0", "-1", "nan"])
def test_a_claim_time_that_is_not_a_number_is_refused_when_pickled(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    # Refused to the caller, before a slot holds anything: not first in the
    # share thread's round, which could only log it.
    monkeypatch.setenv("CUDAFUT_SHARE_CLAIM_S", text)
    held = _held()
    with pytest.raises(ValueError, match="CUDAFUT_SHARE_CLAIM_S must be a number of seconds above 0"):
        _ticket(5)
    assert _held() == held


def test_a_claim_time_spoiled_after_export_still_frees_what_a_dead_receiver_held(
    children: list[Child], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    child = Child(shared_worker.receive_ticket, False)  # never writes its release
    children.append(child)
    ticket = _ticket(7)
    assert child.ask(ticket, limit_s=60) == 7
    monkeypatch.setenv("CUDAFUT_SHARE_CLAIM_S", "soon")
    child.process.kill()
    child.process.join(30)
    until(lambda: _freed(ticket), "the export freed once its receiver died")
    assert "unclaimed exports are freed after 60 s" in caplog.text


def test_a_producer_that_dies_fails_the_receivers_wait(
    children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver's side without CUDA: its event never completes (faked),
    and the producer named in the ticket (a stand-in process) is killed."""
    from cudafut import _backend

    monkeypatch.setattr(_backend.current, "device_bus_id", lambda device: "0000:00:00.0")
    stand_in = Child(shared_worker.sleep)
    receiver = Child(shared_worker.receive_with_a_fake_event)
    children += [stand_in, receiver]
    fut = set_future(None, ())
    # Device -7: the fake event joins a free list no real export takes from.
    ticket = list(
        _shared.held_ticket(fut, None, pickle.dumps(None), _shared._SharedEvent(-7, 1, b"h" * 64, (), ()))
    )
    pid = stand_in.process.pid
    assert pid is not None
    ticket[4], ticket[5] = pid, _shared._start_time(pid)
    assert receiver.ask(tuple(ticket), limit_s=60) is False  # pending: the event has not completed
    stand_in.process.kill()
    stand_in.process.join(30)
    if not receiver.conn.poll(60):
        pytest.fail("the receiver's wait did not end in 60 s")
    assert receiver.conn.recv().startswith("SharingError: the process that produced this future")


def test_the_ledger_of_a_process_that_is_gone_is_removed(tmp_path: Any) -> None:
    """A killed producer leaves its ledger file; the next producer on the
    machine removes it (and leaves the living ones)."""
    gone = tmp_path / "cudafut-share-999999999-dead"
    alive = tmp_path / f"cudafut-share-{_shared._state.pid}-mine"
    other = tmp_path / "unrelated-999999999-file"
    for path in (gone, alive, other):
        path.write_bytes(b"")
    _shared._remove_orphans(str(tmp_path))
    assert not gone.exists() and alive.exists() and other.exists()
