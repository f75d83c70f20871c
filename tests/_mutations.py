"""Mutations for scripts/mutation-check: each disables one synchronisation
point of cudafut, so that the GPU tests can prove they notice it.

"Disabling" a stream wait makes it a no-op; disabling an event record moves
it to an idle stream, where it completes at once and orders nothing. The
list, and what caught each mutation in the last run, is in
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

import cudafut
from cudafut import (
    _backend,
    _compiled,
    _cuda,
    _events,
    _future,
    _lifetimes,
    _loops,
    _pools,
    _producers,
    _shared,
    _tasks,
    _tracked,
    _values,
)
from cudafut._future import _SET, CudaFuture

_idle: dict[int, Any] = {}
_real_event_record = _events.record  # before any mutation replaces it


def _await_one_at_once(self: Any) -> Any:
    """An await among others (asyncio's one-object wait) ends at once, as if
    its record had completed."""
    self._state = 4  # finished
    raise StopIteration(self._finish(self._future, asyncio.CancelledError))


def _await_one_mutated() -> None:
    native = _compiled.native()
    if native is not None:  # the native core's one-object await
        native._mutate("await_one")
    else:
        _loops._AsyncioAwait.__next__ = _await_one_at_once  # type: ignore[method-assign]


def _idle_stream(device: int) -> int:
    stream = _idle.get(device)
    if stream is None:
        stream = _idle[device] = _backend.current.new_stream(device, 0)
    return int(stream.ptr)


def _idle_record(device: int) -> _events.EventRecord:
    """An event recorded on a stream with no work: ordered after nothing.
    (The real ``_events.record``: a mutation may have replaced it with a
    call to this function.)"""
    return _real_event_record(_idle_stream(device), device)


def _no_stream_wait(stream: int, event: int, device: int) -> None:
    pass


def _always_complete(handle: int) -> int:
    return 0  # cudaSuccess: the event's work is reported done, whatever it is


def _wait_without_stream_wait(self: CudaFuture[Any], timeout: float | None = None) -> Any:
    self._block_until_set(_future.check_timeout(timeout), timeout)
    return self._outcome(cudafut.CancelledError)


def _then_streams_without_wait(parent: CudaFuture[Any], priority: int) -> dict[int, Any]:
    return {rec.device: _pools.streams.get(rec.device, priority) for rec in parent._records}


def _submit_without_wait(
    fn: Any, /, *args: Any, device: Any = None, priority: Any = "normal", **kw: Any
) -> Any:
    dev = _backend.current.current_device() if device is None else device
    stream = _pools.streams.get(dev, _pools.check_priority(priority))
    fut: CudaFuture[Any] = CudaFuture()
    _future.settle(fut, fn, args, kw, {dev: stream}, (args, kw))
    return fut


def _set_result_recorded_early(self: CudaFuture[Any], value: Any) -> None:
    devices = self._devices or _values.find_devices(value)
    self._complete(_SET, value, None, tuple(_idle_record(d) for d in devices))


def _record_recorded_early(value: Any, *, stream: Any = None, keep: object = None) -> Any:
    devices = [_cuda.stream_handle(stream)[1]] if stream is not None else _values.find_devices(value)
    fut: CudaFuture[Any] = CudaFuture()
    fut._complete(_SET, value, None, tuple(_idle_record(d) for d in devices), keep)
    return fut


def _record_without_keep(value: Any, *, stream: Any = None, keep: object = None) -> Any:
    return _record(value, stream=stream)


_record = _producers.record
_settle = _future.settle


def _settle_recorded_early(fut, fn, args, kwargs, streams, keep):
    real = _events.record
    _events.record = lambda stream, device, confirm=None, owner=None: _idle_record(device)
    try:
        _settle(fut, fn, args, kwargs, streams, keep)
    finally:
        _events.record = real


def _settle_without_keep(fut, fn, args, kwargs, streams, keep):
    _settle(fut, fn, args, kwargs, streams, None)


def _tracked_no_wait(rec: _events.EventRecord, stream: int, device: int) -> int:
    return _tracked._SAME_STREAM


def _tracked_exit_recorded_early(leave: Any) -> Any:
    def mutated(self: Any, *exc: Any) -> None:
        real = _events.record
        _events.record = lambda stream, device, confirm=None, owner=None: _idle_record(device)
        try:
            leave(self, *exc)
        finally:
            _events.record = real

    return mutated


def _patch_tracked_record() -> None:
    _tracked._Read.__exit__ = _tracked_exit_recorded_early(_tracked._Read.__exit__)  # type: ignore[method-assign]
    _tracked._Write.__exit__ = _tracked_exit_recorded_early(_tracked._Write.__exit__)  # type: ignore[method-assign]


def _patch_tracked_free() -> None:
    _tracked._register = lambda tracked, stream, handle: None
    _tracked.Tracked.__del__ = lambda self: None  # type: ignore[method-assign]


def _patch_record(replacement: Any) -> None:
    _producers.record = replacement
    cudafut.record = replacement


def _patch_submit(replacement: Any) -> None:
    _producers.submit = replacement
    cudafut.submit = replacement


def _patch_launch_wait() -> None:
    """launch(): the launcher's stream no longer waits for the caller's streams."""
    from cudafut import _launch

    # The caller's streams, which the launcher records on, are none.
    _launch._caller_streams = lambda device: ()


def _close_never(record: Any, fd: int, lane: object) -> None:
    pass  # the descriptor is kept open: CUDA never closes it (a lost notice)


def _close_at_once(record: Any, fd: int, lane: object) -> None:
    import os

    os.close(fd)  # before the work ends: a notice that orders nothing


def _share_event_unordered(pending: list[_events.EventRecord]) -> tuple[int, int, bytes]:
    """A shared future's interprocess event, recorded after nothing."""
    device = pending[0].device
    event, handle = _backend.current.ipc_event_create(device)
    _backend.current.event_record(event, _idle_stream(device), device)
    return device, event, handle


MUTATIONS = {
    # every cudaStreamWaitEvent becomes a no-op
    "stream_wait": lambda: _both("stream_wait", _backend.current, "stream_wait", _no_stream_wait),
    # wait(): the caller's current stream no longer waits on the events
    "wait_stream_wait": lambda: setattr(CudaFuture, "wait", _wait_without_stream_wait),
    # then(): the child's pool stream no longer waits on the parent
    "then_stream_wait": lambda: setattr(_future, "_then_streams", _then_streams_without_wait),
    # submit(): the pool stream no longer waits on the caller's current stream
    "submit_stream_wait": lambda: _patch_submit(_submit_without_wait),
    # launch(): the launcher's stream no longer waits on the caller's current streams
    "launch_stream_wait": _patch_launch_wait,
    # set_result(): the event no longer follows the producer's work
    "set_result_record": lambda: setattr(CudaFuture, "set_result", _set_result_recorded_early),
    # record(): likewise
    "record_record": lambda: _patch_record(_record_recorded_early),
    # then() / submit(): the child's events no longer follow fn's work
    # (and in the native core's then() of a set future)
    "settle_record": lambda: _both("settle_record", _future, "settle", _settle_recorded_early),
    # every event query reports "complete" at once (await, result(), done()):
    # CUDA's query (CUDA's backend's event_query, which CUDA's records ask),
    # and in the native core, whose records ask CUDA from C
    "query": lambda: _both("query", _backend.cuda(), "event_query", _always_complete),
    # an await among others (asyncio) returns without waiting for its record
    "await_one": lambda: _await_one_mutated(),
    # then() children and submit() futures stop keeping their inputs alive
    "keep": lambda: _both("keep", _future, "settle", _settle_without_keep),
    # record(keep=...) keeps nothing
    "record_keep": lambda: _patch_record(_record_without_keep),
    # nothing is kept alive until its events complete: a dropped pending future's
    # value, a pinned block under a copy, a CuPy block whose free waits (_lifetimes)
    "hold": lambda: setattr(_lifetimes, "hold", lambda records, obj: None),
    # own_stream: a finished task's work is no longer joined to its awaiter or parent
    "task_join": lambda: setattr(_tasks, "_finish", lambda state, root: None),
    # own_stream: the task's steps no longer run with its stream current
    "task_switch": lambda: setattr(_tasks, "_switch", lambda streams: _tasks._NOTHING),
    # Tracked: no block (nor to_host) waits for another stream's writer or readers
    "tracked_wait": lambda: setattr(_tracked, "_wait_for", _tracked_no_wait),
    # Tracked: a block's reader/writer event no longer follows the block's work
    "tracked_record": _patch_tracked_record,
    # Tracked: the streams that used the array are not recorded for its free
    "tracked_free": _patch_tracked_free,
    # notices never come (as after a context error): the waiter falls back to polls.
    # Notices are off by default: only tests that set WaitPolicy(notify=True)
    # arm them (tests/test_gpu_notices.py, and the notice variants of
    # test_gpu.py, test_gpu_waiter.py and test_gpu_reliability.py)
    "notice_drop": lambda: setattr(_backend.current, "close_after", _close_never),
    # notices come at once, before the work they follow has ended (likewise)
    "notice_early": lambda: setattr(_backend.current, "close_after", _close_at_once),
    # a pickled future's interprocess event no longer follows its work (in
    # the producing process: tests/shared_worker.py applies it there too)
    "share_event": lambda: setattr(_shared, "_event_after", _share_event_unordered),
}


def _both(name: str, owner: Any, attr: str, mutated: Any) -> None:
    """A mutation of the seam (a call of the backend in force, or a module's
    function), and the same in the native core, whose records call CUDA
    from C."""
    setattr(owner, attr, mutated)
    native = _compiled.native()
    if native is not None:
        native._mutate(name)


def apply(name: str) -> None:
    try:
        MUTATIONS[name]()
    except KeyError:
        raise SystemExit(f"unknown mutation {name!r}; choose from {sorted(MUTATIONS)}") from None
