"""Futures across processes on a GPU: a CudaFuture pickled through a pipe
to another process, which awaits the same work.

The producers are slow (a ``%globaltimer`` spin kernel writes the value
after 300 ms), so a receiver that did not wait for the producer's work
through the interprocess event would read zeros: the ``share_event``
mutation (scripts/mutation-check) records that event after nothing, and
these tests fail. Lifetimes: the producer holds the memory until the
receiver lets go, or dies; a producer that dies fails the receiver's wait;
10,000 futures crossed leave nothing behind on either side.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
from typing import Any

import pytest

import cudafut
from tests import shared_worker
from tests.children import Child, until
from tests.fakes import count_notices

pytestmark = pytest.mark.gpu

N = 1 << 16


def _released_by_producer(child: Child) -> None:
    gc.collect()
    until(lambda: child.ask()[0] == 0, "the producer let go of what it sent")


def test_await_in_another_process_waits_for_the_producers_work(children: list[Child]) -> None:
    child = Child(shared_worker.produce_slow, N, 7.0, 300.0, False)
    children.append(child)
    fut = child.get()
    assert isinstance(fut, cudafut.CudaFuture)

    async def main(fut: cudafut.CudaFuture[Any]) -> Any:
        return await fut

    value = asyncio.run(main(fut))
    host = value.get()
    assert (host == 7.0).all(), f"read {host[:4]} before the producer's kernel wrote"
    del fut, value
    _released_by_producer(child)


def test_an_await_of_a_received_future_asks_cuda_for_no_notice(
    children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = cudafut.get_wait_policy()
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=True))  # the default, said
    asked = count_notices(monkeypatch)
    child = Child(shared_worker.produce_slow, N, 7.0, 300.0, False)
    children.append(child)
    fut = child.get()

    async def main(fut: cudafut.CudaFuture[Any]) -> Any:
        return await fut

    try:
        value = asyncio.run(main(fut))
    finally:
        cudafut.set_wait_policy(before)
    assert (value.get() == 7.0).all(), "read before the producer's kernel wrote"
    assert asked == [], "a notice was armed for another process's event"
    del fut, value
    _released_by_producer(child)


def test_then_in_another_process_orders_the_gpu_after_the_producer(children: list[Child]) -> None:
    child = Child(shared_worker.produce_slow, N, 7.0, 300.0, False)
    children.append(child)
    fut = child.get()
    # then() enqueues at once, on a stream that waits (on the GPU) for the
    # producer's interprocess event
    out = fut.then(lambda v: v + 1).result(60)
    host = out.get()
    assert (host == 8.0).all(), f"read {host[:4]}: the consumer's kernel ran before the producer's"
    del fut, out
    _released_by_producer(child)


def test_values_cross_as_cupy_arrays_and_torch_tensors(children: list[Child]) -> None:
    import cupy as cp
    import torch

    child = Child(shared_worker.produce_values)
    children.append(child)
    value = child.get().result(60)
    assert isinstance(value["cupy"], cp.ndarray)
    cp.testing.assert_array_equal(value["cupy"], cp.arange(1000, dtype=cp.float64)[::3])
    t = value["torch"]
    assert t.is_cuda and t.dtype == torch.float16
    expected = torch.arange(24, device="cuda", dtype=torch.float16).reshape(4, 6)[:, 1::2]
    assert torch.equal(t, expected) and t.stride() == expected.stride()
    bf16 = value["bf16"]
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, torch.arange(10, device="cuda", dtype=torch.float32).to(torch.bfloat16))
    assert value["host"] == [1, "two"]
    assert value["empty"].shape == (0, 3)
    del value, t, bf16
    _released_by_producer(child)


def test_a_launched_future_crosses_once_enqueued(children: list[Child]) -> None:
    child = Child(shared_worker.produce_launched)
    children.append(child)
    first = child.get()
    if isinstance(first, tuple):  # pending when sent: refused, saying what to do
        assert first[0] == "refused" and "enqueued(fut)" in first[1]
        fut = child.get()
    else:  # the launcher was already done: it crossed at once
        fut = first
    assert (fut.result(60).get() == 5.0).all()
    del fut, first
    _released_by_producer(child)


def test_a_producer_that_dies_mid_work_fails_the_wait(children: list[Child]) -> None:
    child = Child(shared_worker.produce_slow, N, 7.0, 20_000.0, True)
    children.append(child)
    fut = child.get()
    child.conn.send("die")
    child.process.join(30)
    with pytest.raises(cudafut.SharingError, match="died before its GPU work completed"):
        fut.result(60)


def test_a_receiver_that_dies_holding_the_value_frees_it(children: list[Child], cp: Any) -> None:
    from tests import kernels

    before = cudafut.shared_statistics().held
    x = cp.zeros(N, dtype=cp.float32)
    kernels.spin_fill(x, 3.0, 50.0)
    child = Child(shared_worker.receive_and_die)
    children.append(child)
    child.conn.send(cudafut.record(x))
    assert child.get() == 3.0
    assert cudafut.shared_statistics().held == before + 1
    child.conn.send("die")
    child.process.join(30)
    until(lambda: cudafut.shared_statistics().held <= before, "the producer freed what a dead receiver held")


def test_unpickled_in_the_same_process_is_the_same_future(cp: Any) -> None:
    fut = cudafut.record(cp.ones(4))
    assert pickle.loads(pickle.dumps(fut)) is fut


def test_memory_cuda_ipc_cannot_share_is_refused(cp: Any) -> None:
    pool = cp.cuda.MemoryAsyncPool()
    with cp.cuda.using_allocator(pool.malloc):
        x = cp.ones(1024)
    fut = cudafut.record(x)
    with pytest.raises(TypeError, match="stream-ordered pool"):
        pickle.dumps(fut)


def test_the_rows_of_a_batch_cross_with_one_event(children: list[Child]) -> None:
    """The futures of one batch share their work: they cross with one
    interprocess event between them (and one IPC handle), yet each waits."""
    rows = 32
    child = Child(shared_worker.produce_batch, rows)
    children.append(child)
    futs = child.get()
    assert len(futs) == rows
    for i, fut in enumerate(futs):
        host = fut.result(60).get()
        assert (host == 5.0 + i).all(), f"row {i} read {host[:4]} before the producer's kernel wrote"
    _held, events, _used, _fds = child.ask()
    assert events == 1, f"{events} interprocess events made for the {rows} rows of one batch"
    del futs, fut
    _released_by_producer(child)


def test_ten_thousand_futures_cross_and_leave_nothing(children: list[Child]) -> None:
    count = 10_000
    child = Child(shared_worker.produce_many, count, 256)
    children.append(child)
    fds_before = None
    for i in range(count):
        fut = child.get()
        value = fut.result(60)
        if i % 1000 == 0:
            assert int(value[0]) == i
        del fut, value
        if i == 100:
            gc.collect()
            fds_before = len(os.listdir("/proc/self/fd"))
        if i % 500 == 499:
            # Releases travel asynchronously (after a device synchronize, which
            # a busy GPU delays): let them land, so the count below is of reuse
            # and not of how far the releases lagged.
            gc.collect()
            until(lambda: child.ask("held") == 0, "the producer let go of the futures released so far")
        child.conn.send("next")
    gc.collect()
    until(lambda: child.ask()[0] == 0, "the producer let go of every future sent")
    _held, events, used, _fds = child.ask()
    mine = cudafut.shared_statistics()
    assert events < count // 10, f"{events} interprocess events made for {count} futures: not reused"
    assert used < 64 * 1024 * 1024, f"the producer's pool holds {used} bytes after the futures ended"
    assert mine.mapped <= 64 + 8 and mine.opened_events <= 256 + 8, mine
    assert mine.watched == 0, mine
    assert fds_before is not None and len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_a_future_pickled_on_a_thread_new_to_cuda_crosses(children: list[Child]) -> None:
    child = Child(shared_worker.produce_on_a_new_thread)
    children.append(child)
    fut = child.get()
    assert isinstance(fut, cudafut.CudaFuture), fut  # else: the error pickling raised there
    assert (fut.result(60).get() == 4.0).all()
    del fut
    _released_by_producer(child)
