"""Per-device pools of CUDA events and streams.

Events are handed out exclusively: a handle goes back to the pool only when
the :class:`~cudafut._events.EventRecord` that owns it is garbage, so no live
object can ever observe a re-recorded event (the aliasing bug of shared event
rings, DESIGN.md hazard 7).

Streams are shared round-robin, as PyTorch does: 32 per device and priority,
created on first use.
"""

from __future__ import annotations

import itertools
import sys
import threading
from typing import Any, Final

from . import _cuda

#: Accepted values of the ``priority`` argument, and the CUDA priority asked
#: for.  CUDA clamps the number into the device's range, so -1024 means "the
#: highest priority this device has".
PRIORITIES: Final = {"normal": 0, "high": -1024}

STREAMS_PER_POOL: Final = 32

# Free events kept per device; beyond this they are destroyed.
_MAX_FREE_EVENTS: Final = 4096


def check_priority(priority: object) -> int:
    try:
        return PRIORITIES[priority]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"priority must be 'normal' or 'high', not {priority!r}") from None


class EventPool:
    """Free event handles per device.

    ``list.append`` and ``list.pop`` are atomic under the GIL, so acquiring
    and releasing take no lock.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self.created = 0

    def acquire(self, device: int) -> int:
        try:
            return self._free[device].pop()
        except (KeyError, IndexError):
            self.created += 1
            return _cuda.event_create(device)

    def release(self, device: int, handle: int) -> None:
        try:
            free = self._free[device]
        except KeyError:
            free = self._free.setdefault(device, [])
        if len(free) < _MAX_FREE_EVENTS:
            free.append(handle)
        elif not sys.is_finalizing():
            _cuda.event_destroy(handle)


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
                stream = _cuda.new_stream(device, priority)
                self._owned[int(stream.ptr)] = (stream, priority)
                streams.append(stream)
            return streams[i]


events: Final = EventPool()
streams: Final = StreamPool()
