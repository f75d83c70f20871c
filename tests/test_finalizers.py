"""Finalizers the garbage collector runs while cudafut holds a lock.

The collector runs at any allocation (3.11) or any call (3.12), on whatever
thread is running: a finalizer that waits for a lock its own thread holds
waits for ever. Each test drives the collector into every such window it
can (cyclic garbage holding the finalizer, and collection thresholds from 2
up, so that a collection lands inside each of the locked sections), on a
worker thread that the test joins with a generous liveness guard: it
returns in seconds, or never. No GPU (cudafut.testing's fake).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _memory, testing


class _Cycle:
    """Cyclic garbage: only the collector frees it (and what it holds)."""

    def __init__(self, held: object) -> None:
        self.me = self
        self.held = held


@pytest.fixture
def thresholds() -> Iterator[None]:
    """The collector's thresholds restored after the test, and the heap the
    test found frozen (:func:`gc.freeze`) meanwhile: its collections then
    scan only the objects the test makes, not the rest of the suite's (a
    full suite's heap made each of its many collections slow, and the test
    took tens of seconds on a loaded machine). The objects under test are
    all made after the freeze, so every collection still sees them."""
    saved = gc.get_threshold()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def _returns(body: Callable[[], None]) -> None:
    """Run ``body`` on a worker thread; it must return (a deadlock never does)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)  # a liveness guard, not a timing
    assert not worker.is_alive(), "a finalizer run by the garbage collector deadlocked its thread"
    if errors:
        raise errors[0]


@pytest.mark.usefixtures("thresholds")
def test_a_collected_as_completed_sync_takes_no_lock_of_its_futures() -> None:
    """An abandoned as_completed_sync() generator, closed by the collector
    while its thread is inside a method of one of its futures (under that
    future's lock), does not wait for that lock."""

    def body() -> None:
        with testing.fake_cuda() as fake:
            fake.auto_complete = True
            futs: list[cudafut.CudaFuture[Any]] = [cudafut.CudaFuture(devices=0) for _ in range(2)]
            futs[0].set_result(np.zeros(1))
            for threshold in range(2, 300):
                gc.collect()
                gen = cudafut.as_completed_sync(futs, timeout=60)
                next(gen)  # suspended in its try: closing it runs its finally
                _Cycle(gen)
                del gen
                gc.set_threshold(threshold)
                for _ in range(30):
                    futs[1].add_done_callback(_ignore)  # allocates under futs[1]'s lock
                    futs[1].remove_done_callback(_ignore)
                gc.set_threshold(700)
            futs[1].set_result(np.ones(1))  # the callbacks left behind run, and do nothing
            assert futs[1].result(timeout=60)[0] == 1.0

    _returns(body)


@pytest.mark.usefixtures("thresholds")
def test_a_block_collected_inside_the_fake_backend_does_not_deadlock_it() -> None:
    """A cudafut-allocated block with a reader stream, collected while its
    thread is inside the fake GPU (under its lock), records its free
    there."""

    def body() -> None:
        with testing.fake_cuda() as fake:
            fake.auto_complete = True
            for threshold in range(2, 400):
                for _ in range(2):
                    block = _memory._Block(object(), 0, 111)
                    block.add_reader(222, 0, object())
                    _Cycle(block)
                    del block
                    if _ == 0:
                        gc.collect()
                gc.set_threshold(threshold)
                for _ in range(3):
                    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
                    fut.set_result(np.zeros(3))  # records an event: the fake's lock
                    fake.complete_all()
                gc.set_threshold(700)

    _returns(body)


def _ignore(fut: cudafut.CudaFuture[Any]) -> None:
    pass


def test_a_record_landing_inside_another_on_the_fake_keeps_the_stream_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record the collector's finalizer makes on a stream while another
    record on it is half done (the fake's lock is re-entrant) stays in the
    stream's order: completing the later work completes it too."""
    with testing.fake_cuda() as fake:
        nested: list[cudafut.CudaFuture[Any]] = []
        armed = [True]
        original = testing._Event.__init__

        def init(self: Any, number: int, deps: Any) -> None:
            original(self, number, deps)
            if armed.pop() if armed else False:  # once, as a finalizer would: same stream, mid-record
                nested.append(cudafut.record(np.zeros(1)))

        monkeypatch.setattr(testing._Event, "__init__", init)
        outer = cudafut.record(np.ones(1))
        monkeypatch.undo()
        assert nested and not nested[0].done()
        fake.complete(outer)
        assert outer.done() and nested[0].done()
