"""Scripted stand-ins for recorded CUDA events, for host-side tests of the
waiter's internals: one record's status at a time, and how often it was
queried. Tests of the public behaviour use cudafut.testing's fake GPU (the
``fake_cuda`` fixture) instead, as users do."""

from __future__ import annotations

import gc
import itertools
import time
import weakref
from typing import TYPE_CHECKING, Any

from cudafut._events import EventRecord

if TYPE_CHECKING:
    import pytest

    from cudafut import CudaFuture

_handles = itertools.count(1)
_streams = itertools.count(0x1000)


class FakeRecord(EventRecord):
    """An EventRecord whose status the test sets; counts its queries."""

    __slots__ = ("queries", "script")

    def __init__(self, stream: int | None = None, seq: int = 1, device: int = 0) -> None:
        # By default each record is alone on a fresh stream: a real stream
        # completes in order, which scripted records need not follow.
        if stream is None:
            stream = next(_streams)
        super().__init__(-next(_handles), device, stream, (device, stream), seq, time.perf_counter())
        self.queries = 0
        self.script: int | None = None  # what CUDA "returns" next: None = not ready

    def query(self) -> int | None:
        if self.status is None:
            self.queries += 1
            if self.script is not None:
                self.status = self.script
        return self.status

    def complete(self) -> None:
        self.script = 0

    def fail(self, code: int = 700) -> None:
        self.script = code

    def __del__(self) -> None:
        pass  # owns no CUDA event: never return it to the pool


def stream_records(n: int) -> list[FakeRecord]:
    """``n`` records in order on one fresh stream."""
    stream = next(_streams)
    return [FakeRecord(stream, seq) for seq in range(1, n + 1)]


def set_future(value: object, records: list[FakeRecord]) -> CudaFuture[Any]:
    """A CudaFuture set with fake records (no CUDA involved)."""
    from cudafut._interface import set_future as set_with

    return set_with(value, tuple(records))


def inject_watcher_bug(
    monkeypatch: pytest.MonkeyPatch, waiter: Any, bug: BaseException | None = None
) -> None:
    """Make the watcher thread's own loop raise ``bug`` once (a bug in
    cudafut, not in a callback; by default a RuntimeError), at its next
    pass: the supervision tests' fault."""
    take_holds = waiter._take_holds
    bugs = [bug if bug is not None else RuntimeError("an injected bug")]

    def buggy() -> None:
        if bugs:
            raise bugs.pop()
        take_holds()

    monkeypatch.setattr(waiter, "_take_holds", buggy)


def count_notices(mp: pytest.MonkeyPatch) -> list[int]:
    """Wrap the current backend's ``close_after`` (the call that arms a
    CUDA notice: real CUDA's, or the fake's inside ``fake_cuda()``) so that
    each descriptor it is handed is appended to the list returned; the call
    itself goes on as before. ``mp`` undoes it."""
    from cudafut import _backend

    handed: list[int] = []
    close_after = _backend.current.close_after

    def counting(record: Any, fd: int, stream: int) -> None:
        handed.append(fd)
        close_after(record, fd, stream)

    mp.setattr(_backend.current, "close_after", counting)
    return handed


def gone(ref: weakref.ref[Any]) -> bool:
    """Whether ``ref``'s object is collected within 5 s (a hang guard, not
    a timing), collecting garbage meanwhile: a value the watcher thread let
    go of, once its records completed."""
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
        gc.collect()
    return ref() is None
