"""Per-device pools of CUDA events and streams.

Events are handed out exclusively: a handle goes back to the pool only when
the :class:`~cudafut._events.EventRecord` that owns it is garbage, so no live
object can ever observe a re-recorded event (the aliasing bug of shared event
rings, docs/design.md, hazard 7).

Streams are shared round-robin, as PyTorch does: 32 per device and priority,
created on first use.

:func:`pool_statistics` (public as ``cudafut.pool_statistics``) is a
snapshot of the pools, for tests, benchmarks and leak hunts.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from . import _backend, _compiled, _cuda

#: Accepted values of the ``priority`` argument, and the CUDA priority asked
#: for.  CUDA clamps the number into the device's range, so -1024 means "the
#: highest priority this device has".
PRIORITIES: Final = {"normal": 0, "high": -1024}

STREAMS_PER_POOL: Final = 32
COPY_STREAMS_PER_POOL: Final = 8
#: Task streams (:func:`cudafut.task_stream`) per device before tasks share.
TASK_STREAMS_PER_DEVICE: Final = 64

# Free events kept per device; beyond this they are destroyed. Above the
# 10,000 awaits of the many benchmark: with 4,096, each burst of them made
# and destroyed about 6,000 events (a driver call each way, per future).
_MAX_FREE_EVENTS: Final = 16384


def check_priority(priority: object) -> int:
    try:
        return PRIORITIES[priority]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"priority must be 'normal' or 'high', not {priority!r}") from None


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of cudafut's event and stream pools (:func:`pool_statistics`).

    Frozen; its mappings are fresh dicts (keyed by device) that no
    pool changes afterwards. Not atomic: other threads may acquire and
    release events meanwhile (the free lists take no lock), so a device's
    counts may be off by the events changing hands at that instant.

    Attributes:
        events_created: events created since the process started, all devices.
        events_free: per device, handles in the pool, ready for reuse.
        events_in_use: per device, handles owned by live event records
            (created, neither free nor destroyed): a live future set with
            a value holds one per device of the value, so for leak checks
            this returns to where it started once the futures are dropped.
        streams: per ``(device, priority)``, pool streams created (at most
            32 each; ``then()`` and ``submit()`` use them); ``priority`` is
            ``"normal"`` or ``"high"``.
        copy_streams: per device, streams of the copies created (at most 8;
            :func:`to_device` and :func:`to_host` use them when given no
            stream).
        task_streams: per device, ``(streams created, leases)``: the task
            streams made so far (at most 64), and how many tasks hold one now.
    """

    events_created: int
    events_free: Mapping[int, int]
    events_in_use: Mapping[int, int]
    streams: Mapping[tuple[int, str], int]
    copy_streams: Mapping[int, int]
    task_streams: Mapping[int, tuple[int, int]]


class EventPool:
    """Free event handles per device.

    ``list.append`` and ``list.pop`` are atomic under the GIL, so acquiring
    and releasing take no lock.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self.created = 0
        # Per device, created and destroyed (beyond _MAX_FREE_EVENTS): off the
        # hot path, counted under a lock only when CUDA is called anyway.
        # Re-entrant: a finalizer (a dropped record) can release an event while
        # this thread holds the lock.
        self._count_lock = threading.RLock()
        self._created: dict[int, int] = {}
        self._destroyed: dict[int, int] = {}
        self._closed = False

    def acquire(self, device: int) -> int:
        try:
            return self._free[device].pop()
        except (KeyError, IndexError):
            handle = _backend.current.event_create(device)
            with self._count_lock:
                self.created += 1
                self._created[device] = self._created.get(device, 0) + 1
            return handle

    def release(self, device: int, handle: int) -> None:
        if self._closed:
            return
        try:
            free = self._free[device]
        except KeyError:
            free = self._free.setdefault(device, [])
        if len(free) < _MAX_FREE_EVENTS:
            free.append(handle)
        elif not sys.is_finalizing():
            _backend.current.event_destroy(handle)
            with self._count_lock:
                self._destroyed[device] = self._destroyed.get(device, 0) + 1

    def close(self) -> None:
        """Take no handle back from now on (the pool of a backend that has
        ended: cudafut.testing's fake, whose records may outlive it)."""
        self._closed = True

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Per device: (free handles, handles in use)."""
        free = {device: len(handles) for device, handles in list(self._free.items())}
        with self._count_lock:
            in_use = {
                device: n - self._destroyed.get(device, 0) - free.get(device, 0)
                for device, n in self._created.items()
            }
        return free, in_use


class StreamPool:
    """Round-robin pool of non-blocking streams per (device, priority)."""

    def __init__(self, size: int = STREAMS_PER_POOL) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int], list[Any]] = {}
        self._next: dict[tuple[int, int], itertools.count[int]] = {}
        # Pool streams by handle, with their priority.
        self._owned: dict[int, tuple[Any, int]] = {}

    def lookup(self, handle: int, priority: int) -> Any:
        """The pool stream with this handle and priority, or None."""
        found = self._owned.get(handle)
        if found is not None and found[1] == priority:
            return found[0]
        return None

    def get(self, device: int, priority: int) -> Any:
        """The next stream of the pool; creates it on first use."""
        key = (device, priority)
        counter = self._next.get(key)
        if counter is None:
            with self._lock:
                counter = self._next.setdefault(key, itertools.count())
                self._streams.setdefault(key, [])
        i = next(counter) % self._size
        streams = self._streams[key]
        if i < len(streams):
            return streams[i]
        with self._lock:
            while len(streams) <= i:
                stream = _backend.current.new_stream(device, priority)
                keep_stream(stream, device)
                self._owned[int(stream.ptr)] = (stream, priority)
                streams.append(stream)
            return streams[i]

    def counts(self) -> dict[tuple[int, str], int]:
        """Per ``(device, priority name)``: the pool streams created."""
        names = {number: name for name, number in PRIORITIES.items()}
        with self._lock:
            return {
                (device, names.get(prio, str(prio))): len(s) for (device, prio), s in self._streams.items()
            }


class TaskStreamPool:
    """Streams lent to tasks, per device: a free one if any, else a new one
    up to ``cap``, else the one lent to the fewest tasks (those tasks then
    share it: their work is ordered one after the other, never wrong).

    Stream creation (a CUDA call, about 10 µs) happens outside the lock.
    """

    def __init__(self, cap: int = TASK_STREAMS_PER_DEVICE) -> None:
        self._cap = cap
        self._lock = threading.Lock()
        self._streams: dict[int, list[Any]] = {}
        self._free: dict[int, list[Any]] = {}
        self._leases: dict[int, int] = {}  # by stream handle
        # Streams given back, not yet counted: release() runs from a task's
        # finalizer, which the garbage collector may run on a thread inside
        # acquire(), under the lock (waiting for it there deadlocked, and a
        # re-entrant lock let a release land in the middle of a lease). An
        # append is atomic; whoever holds the lock next counts them.
        self._returned: collections.deque[tuple[int, Any]] = collections.deque()

    def acquire(self, device: int) -> Any:
        with self._lock:
            self._count_returned()
            streams = self._streams.setdefault(device, [])
            free = self._free.setdefault(device, [])
            if free:
                stream = free.pop()
                self._leases[int(stream.ptr)] = 1
                return stream
            if len(streams) >= self._cap:
                stream = min(streams, key=lambda s: self._leases[int(s.ptr)])
                self._leases[int(stream.ptr)] += 1
                return stream
        stream = _backend.current.new_stream(device, 0)
        keep_stream(stream, device)
        with self._lock:
            self._streams[device].append(stream)
            self._leases[int(stream.ptr)] = 1
        return stream

    def release(self, device: int, stream: Any) -> None:
        """Give back a lease of ``stream``. Never waits: where the lock is
        busy (another thread, or this one inside :meth:`acquire`), the lease
        is counted by the next call that takes it."""
        self._returned.append((device, stream))
        if self._lock.acquire(blocking=False):
            try:
                self._count_returned()
            finally:
                self._lock.release()

    def _count_returned(self) -> None:
        # Under the lock.
        returned = self._returned
        while returned:
            device, stream = returned.popleft()
            handle = int(stream.ptr)
            left = self._leases[handle] - 1
            self._leases[handle] = left
            if left == 0:
                self._free[device].append(stream)

    def counts(self) -> dict[int, tuple[int, int]]:
        """Per device: (streams created, leases now)."""
        with self._lock:
            self._count_returned()
            return {
                device: (len(streams), sum(self._leases[int(s.ptr)] for s in streams))
                for device, streams in self._streams.items()
            }


# The streams keep_stream was told of, by handle: cudafut's streams of the
# process's life (a fake backend's get a dict of their own: _swap_pools).
_kept: dict[int, Any] = {}


def keep_stream(stream: Any, device: int) -> None:
    """Say that ``stream``, made by cudafut and kept for the process's life,
    never gives its handle to another stream (the native core may then
    answer for its older records from its newest one known complete), and
    keep it (:func:`kept` tells it apart)."""
    _mark_stream(stream, device)
    _kept[int(stream.ptr)] = stream


def kept(handle: int, stream: object) -> bool:
    """Whether ``stream`` (whose handle is ``handle``) is one of cudafut's
    streams of the process's life (its pools', its launchers'), which no one
    destroys; a dictionary lookup."""
    return _kept.get(handle) is stream


def _mark_stream(stream: Any, device: int) -> None:
    """The core's side of :func:`keep_stream`: nothing in the pure core."""


# The native twins (cudafut/_core.pyx) where they were built: the event pool
# in C arrays, and the streams' state that keep_stream marks.
_native = _compiled.native()
if _native is not None:
    globals().update(EventPool=_native.EventPool, _mark_stream=_native.keep_stream)

# Not Final: cudafut.testing's fake CUDA gets pools of its own (_swap_pools).
events = EventPool()
streams = StreamPool()
#: Streams of cudafut's copies (to_device, to_host) that name no stream: apart
#: from the compute pool, so a copy never queues behind an unrelated kernel
#: that round-robin put on the same stream.
copy_streams = StreamPool(COPY_STREAMS_PER_POOL)
#: The streams of tasks (cudafut.task_stream(), @own_stream).
task_streams = TaskStreamPool()


def _swap_pools(backend: object) -> Callable[[], None]:
    """Fresh pools while another backend (cudafut.testing's fake) is
    installed: a stream or event of one backend is meaningless to the
    other. The previous pools come back with the previous backend."""
    global events, streams, copy_streams, task_streams, _kept
    saved = (events, streams, copy_streams, task_streams, _kept)
    events, streams = EventPool(), StreamPool()
    copy_streams, task_streams = StreamPool(COPY_STREAMS_PER_POOL), TaskStreamPool()
    _kept = {}

    def restore() -> None:
        global events, streams, copy_streams, task_streams, _kept
        events, streams, copy_streams, task_streams, _kept = saved

    return restore


_cuda.on_swap(_swap_pools)


def pool_statistics() -> PoolStatistics:
    """A snapshot of cudafut's event and stream pools (see :class:`PoolStatistics`).

    Process-wide, so a function (an object's statistics are its
    ``statistics()`` method: :meth:`Batcher.statistics`,
    :meth:`Tracked.statistics`). Costs a few µs per device on the host; no
    CUDA call, no GPU needed; blocks nothing but stream creation, for the
    instant it takes to count. Under :func:`cudafut.testing.fake_cuda`, the
    counts are the fake GPU's own pools, fresh when it is installed.
    """
    free, in_use = events.counts()
    copies: dict[int, int] = {}
    for (device, _priority), n in copy_streams.counts().items():
        copies[device] = copies.get(device, 0) + n
    return PoolStatistics(
        events_created=events.created,
        events_free=free,
        events_in_use=in_use,
        streams=streams.counts(),
        copy_streams=copies,
        task_streams=task_streams.counts(),
    )
