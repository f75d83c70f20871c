"""TaskStreamPool's host logic (no GPU: streams are stand-ins with a ``ptr``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cudafut import _backend
from cudafut._pools import TaskStreamPool


class _Stream:
    """A stand-in stream; reading ``ptr`` may run a callback, as a garbage
    collection may run a finalizer at any allocation."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr
        self.on_read: Any = None

    @property
    def ptr(self) -> int:
        hook, self.on_read = self.on_read, None
        if hook is not None:
            hook()
        return self._ptr


def _pool_with(monkeypatch: pytest.MonkeyPatch, n: int, cap: int) -> tuple[TaskStreamPool, list[_Stream]]:
    """A pool that has lent ``n`` new stand-in streams, one lease each."""
    made = iter(range(1, n + 1))
    monkeypatch.setattr(_backend.current, "new_stream", lambda device, priority: _Stream(next(made)))
    pool = TaskStreamPool(cap=cap)
    return pool, [pool.acquire(0) for _ in range(n)]


def test_a_release_run_by_a_finalizer_inside_acquire_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task's finalizer gives its stream back (release) while the same
    thread is inside acquire, under the pool's lock: waiting for the lock
    there deadlocked the thread (seen on a GPU, in a full test run), and
    a re-entrant lock let the release land in the middle of a lease (a
    stream both free and lent). The release is counted after acquire."""
    pool, (a, b) = _pool_with(monkeypatch, 2, cap=2)
    a.on_read = lambda: pool.release(0, b)  # runs in acquire's choice, under the lock
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(pool.acquire(0)), daemon=True)
    worker.start()
    worker.join(30)  # a liveness guard, not a timing: it returns at once or never
    assert not worker.is_alive(), "acquire() deadlocked on a release from a finalizer"
    assert got == [a]  # b's lease was still counted when acquire chose: both had one
    assert pool.counts() == {0: (2, 2)}  # then b's release counted: a has 2 leases, b none
    assert pool.acquire(0) is b  # b is free, and lent once only
    assert pool.counts() == {0: (2, 3)}


def test_a_released_stream_is_lent_again_before_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, (_, b) = _pool_with(monkeypatch, 2, cap=4)
    pool.release(0, b)
    assert pool.acquire(0) is b
    assert pool.counts() == {0: (2, 2)}
