"""Mutations for scripts/mutation-check: each disables one synchronisation
point of cudafut, so that the ordering tests can prove they notice."""

from __future__ import annotations

from cudafut import _cuda, _events, _future


def _no_stream_wait(stream: int, event: int, device: int) -> None:
    pass


_settle = _future._settle


def _settle_without_keep(fut, fn, args, kwargs, streams, keep):  # type: ignore[no-untyped-def]
    _settle(fut, fn, args, kwargs, streams, None)


def _always_complete(self: _events.EventRecord) -> int:
    self.status = 0
    return 0


MUTATIONS = {
    # every cudaStreamWaitEvent (wait(), then(), submit()) becomes a no-op
    "stream_wait": lambda: setattr(_cuda, "stream_wait", _no_stream_wait),
    # every event query reports "complete" at once (await, result(), done())
    "query": lambda: setattr(_events.EventRecord, "query", _always_complete),
    # then() children stop keeping their parent's value alive
    "keep": lambda: setattr(_future, "_settle", _settle_without_keep),
}


def apply(name: str) -> None:
    try:
        MUTATIONS[name]()
    except KeyError:
        raise SystemExit(f"unknown mutation {name!r}; choose from {sorted(MUTATIONS)}") from None
