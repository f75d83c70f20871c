"""Reader/writer tracking of one GPU array: :class:`Tracked`.

MXNet's engine orders every GPU operation after the ones it depends on by
keeping, per variable, one writer event and reader events (docs/design.md,
"Sources"). ``Tracked`` does the same for one array, at the granularity of a
``with`` block: entering ``read()`` makes the current stream wait for the
last writer; entering ``write()`` makes it wait for the last writer and for
the newest reader of every other stream; leaving records one event on the
stream, kept as that stream's reader event or as the writer (which replaces
every reader, since it came after them all). Readers are kept per stream,
never one per array (docs/design.md, hazard 8): two readers on two streams
must not overwrite each other's record.

The hot path is a few attribute loads, one ``cudaEventRecord`` and, only
where the streams differ and the event is not known complete, one
``cudaEventQuery`` and one ``cudaStreamWaitEvent``. A per-array lock covers
the bookkeeping and never a CUDA call (see ``_counters`` in _events.py
for the convoys a lock held across CUDA calls caused).
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from . import _backend, _copies, _cuda, _events, _memory
from ._events import EventRecord
from ._future import CudaFuture
from ._values import find_devices, gpu_arrays, order_foreign

__all__ = ["Tracked", "TrackingStatistics", "get_tracking", "set_tracking"]

A = TypeVar("A")

# What one wait came to: indices into Tracked._counts.
_INSERTED: Final = 0
_SAME_STREAM: Final = 1
_COMPLETE: Final = 2
_RECORDED: Final = 3
_NOTHING: Final = 4  # a read with no writer yet: nothing to wait for

_tracking = True


def set_tracking(enabled: bool) -> bool:
    """Turn reader/writer tracking on or off for every :class:`Tracked`.

    For programs that order their streams by hand: with tracking off,
    ``read()`` and ``write()`` return a ready-made context manager whose
    ``__enter__`` returns the array (a few hundred ns per block, nothing
    enqueued, nothing recorded), and ``to_host()`` is :func:`cudafut.to_host`
    of the array (after the caller's current stream). Blocks run while
    tracking is off are not recorded, nor is the first writer of a
    ``Tracked`` made then: turning it on again orders new blocks after the
    blocks recorded before, not after those.

    Costs nothing beyond the assignment; no CUDA call.

    Args:
        enabled: ``True`` to track (the default at import), ``False`` not to.

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _tracking
    if type(enabled) is not bool:
        raise TypeError(
            f"set_tracking() takes True or False, not {enabled!r}; "
            "to turn tracking off for one array, use Tracked(array, enabled=False)"
        )
    previous = _tracking
    _tracking = enabled
    return previous


def get_tracking() -> bool:
    """Whether reader/writer tracking is on for every :class:`Tracked` (see
    :func:`set_tracking`). Costs nothing; no CUDA call; blocks nothing."""
    return _tracking


@dataclasses.dataclass(frozen=True)
class TrackingStatistics:
    """What one :class:`Tracked` has done since it was made
    (:meth:`Tracked.statistics`).

    Attributes:
        waits_inserted: ``cudaStreamWaitEvent`` calls: a block's stream, or
            the copy stream of :meth:`Tracked.to_host`, made to wait for an
            event of another stream that was still pending.
        waits_skipped_same_stream: events not waited for because they were
            recorded on the stream that would have waited (work on one stream
            runs in order).
        waits_skipped_complete: events not waited for because they were
            complete (known, or found by one ``cudaEventQuery``).
        events_recorded: events recorded: on making the ``Tracked`` (its
            first writer), on leaving blocks, and for :meth:`Tracked.to_host`
            copies.
    """

    waits_inserted: int
    waits_skipped_same_stream: int
    waits_skipped_complete: int
    events_recorded: int


def _wait_for(rec: EventRecord, stream: int, device: int) -> int:
    """Make ``stream`` wait for ``rec`` unless it need not; what it came to.

    The cached status first (no CUDA call), then the stream (no CUDA call),
    and only then a query, so that a wait is inserted only for pending
    work of another stream."""
    status = rec.status
    if status is None:
        # Handle 2 is the per-thread default stream: one stream per thread.
        if rec.stream == stream and (stream != 2 or rec.stream_key[-1] == threading.get_ident()):
            return _SAME_STREAM
        status = rec.query()
        if status is None:
            _backend.current.stream_wait(stream, rec.handle, device)
            return _INSERTED
    if status:
        raise rec.error() or _cuda.cuda_error(status, device)
    return _COMPLETE


# The streams each live Tracked has used, by id(): ``{id: {handle: stream
# object}}`` (the same dictionaries as their ``_streams``). Reachable from
# this module, so that a garbage collection that finds a Tracked in a cycle
# never finalizes (destroys) these streams before Tracked.__del__ records on
# them (see ``_readers`` in _memory.py: that crashed the process).
_used: dict[int, dict[int, Any]] = {}


def _register(tracked: Tracked[Any], stream: Any, handle: int) -> None:
    """First use of the array on ``stream``: its memory is freed only after
    the work queued there up to the free (docs/design.md, hazard 5)."""
    _memory.record_streams_of((tracked._array,), ((handle, tracked._device, stream),), untracked=False)
    streams = tracked._streams
    if not streams:
        _used[id(tracked)] = streams
    streams[handle] = stream


class Tracked(Generic[A]):
    """A GPU array whose readers and writers are ordered on the GPU.

    ``with t.read() as a:`` and ``with t.write() as a:`` hand you the array
    to use on the calling thread's current CuPy stream of its device (with
    ``cudafut.use_stream()`` or an ``@cudafut.own_stream`` task, the task's
    stream). Entering a block makes that stream wait for exactly what it
    must: a read for the last writer; a write for the last writer and for
    the newest reader of every other stream. Nothing is waited for on the
    same stream (work there runs in order) or for events already complete.
    Leaving the block records one event on the stream: the stream's reader
    event, or the writer event, which replaces every reader (it came after
    them all). Enqueue the block's work on that stream, and keep it current
    for the whole block.

    Nothing blocks the thread or the event loop: the waits are
    ``cudaStreamWaitEvent`` calls, the GPU does the waiting. Per block, on
    the host: a few µs with nothing to wait for (one ``cudaEventRecord``;
    docs/performance.md, "Tasks sharing arrays", has the figures), about
    2 µs more per wait (one ``cudaEventQuery`` and one
    ``cudaStreamWaitEvent``); a write
    waits at most for the writer and for one reader per stream. With tracking off (``enabled=False``, or
    :func:`set_tracking`), a few hundred ns and nothing enqueued.

    Making one records an event on the current stream of the array's device
    (about 2 µs, unless tracking is off): the work queued there so far,
    which should include what produced the array, is its first writer. Make
    it where the array was made, or order that work yourself.

    Memory: the first time a stream reads or writes the array, it is marked
    used by that stream (:func:`cudafut.record_stream`), so that once freed
    the memory goes back to CuPy's pool only after that stream's work. For
    memory cudafut's allocator wrapper did not allocate, the array is kept
    alive, once the ``Tracked`` is garbage, until the work queued by then
    on those streams is done.

    Threads: the bookkeeping is thread-safe; the order of blocks entered by
    several threads at once is the order in which they reach the lock, so
    order conflicting blocks on the host as you would for any shared data.

    Args:
        array: a CuPy array, or any GPU array (``__cuda_array_interface__``
            object, PyTorch CUDA tensor) on one device.
        enabled: ``False`` to order this array by hand: its blocks then only
            hand out the array.

    Raises:
        TypeError: ``array`` is not one GPU array, or ``enabled`` is not a
            bool (before anything is recorded).
        CudaUnavailableError: CUDA cannot be used here.
    """

    __slots__ = (
        "__weakref__",
        "_array",
        "_counts",
        "_device",
        "_enabled",
        "_lock",
        "_plain",
        "_readers",
        "_streams",
        "_writer",
    )

    def __init__(self, array: A, *, enabled: bool = True) -> None:
        if type(enabled) is not bool:
            raise TypeError(
                f"enabled must be True or False, not {enabled!r} "
                "(False: this array's blocks wait for nothing, you order its streams by hand)"
            )
        found = gpu_arrays(array)
        if len(found) != 1 or found[0] is not array:
            hint = (
                "copy host data to the GPU first (cudafut.to_device)"
                if not found
                else "wrap each array of a container in its own Tracked"
            )
            if _cuda.faked():
                hint += _cuda.NOT_FAKED.format(call="Tracked")
            raise TypeError(
                "Tracked() takes one GPU array (a CuPy array, a PyTorch CUDA tensor, or any "
                f"__cuda_array_interface__ object), not {type(array).__name__}: {hint}"
            )
        (self._device,) = find_devices(array)
        self._array = array
        self._enabled = enabled
        self._lock = threading.Lock()
        self._writer: EventRecord | None = None
        #: The newest reader event of each stream, by its ``stream_key``.
        self._readers: dict[tuple[int, ...], EventRecord] = {}
        #: Streams that used the array (by handle), kept alive until the free.
        self._streams: dict[int, Any] = {}
        self._counts = [0, 0, 0, 0, 0]
        self._plain = _Plain(array)
        if enabled and _tracking:
            # The work that made the array, queued on the current stream so
            # far, is its first writer: a block on another stream waits for it.
            order_foreign(array)  # another library's work first (docs/design.md, hazard 9)
            self._writer = _events.record(_backend.current.current_stream(self._device).ptr, self._device)
            self._counts[_RECORDED] = 1

    @property
    def array(self) -> A:
        """The array itself, untracked: work you enqueue on it outside the
        blocks is ordered by nobody."""
        return self._array

    @property
    def device(self) -> int:
        """The device the array lives on."""
        return self._device

    @property
    def enabled(self) -> bool:
        """Whether this array is tracked (see also :func:`set_tracking`)."""
        return self._enabled

    def read(self) -> AbstractContextManager[A]:
        """A block that reads the array on the current stream.

        Entering makes the current stream of the array's device wait for the
        last writer (unless it is on the same stream or complete) and
        returns the array; leaving records the stream's reader event. Costs
        the host about 2 µs, plus about 2 µs if a wait is inserted; blocks
        neither the thread nor the loop. The work you enqueue in the block
        must only read the array.

        Raises:
            CudaError: on entering, the last writer's work failed.
            CudaUnavailableError: on entering, CUDA cannot be used here.
        """
        if self._enabled and _tracking:
            return _Read(self)
        return self._plain

    def write(self) -> AbstractContextManager[A]:
        """A block that writes (or reads and writes) the array on the
        current stream.

        Entering makes the current stream of the array's device wait for the
        last writer and for the newest reader of every other stream (each
        unless on the same stream or complete) and returns the array;
        leaving records the writer event, which replaces the readers. Costs
        the host about 2 µs, plus about 2 µs per wait inserted; blocks
        neither the thread nor the loop.

        Raises:
            CudaError: on entering, an event it would wait for reported an
                error.
            CudaUnavailableError: on entering, CUDA cannot be used here.
        """
        if self._enabled and _tracking:
            return _Write(self)
        return self._plain

    def to_host(self, *, out: Any = None) -> CudaFuture[Any]:
        """Copy the array to host memory once the last writer is done.

        Like :func:`cudafut.to_host`, but ordered after the last writer only,
        not after the caller's current stream: the copy runs on one of
        cudafut's copy streams, which waits for the writer (if pending), and
        counts as a reader of that stream, so a later ``write()`` waits for
        the copy. A pageable destination (a pageable ``out``, or past the
        pinned pool's limit) is staged later by cudafut's copy threads, so
        they copy a snapshot of the array taken on the copy stream (device
        memory for one more copy of it, until they are done).

        Returns at once: about 25 µs of work on the calling thread for a
        pinned destination; ``await`` the future (never blocks the loop) or
        call its :meth:`~CudaFuture.result` (blocks the thread) for the NumPy
        array. With tracking off, :func:`cudafut.to_host` of the array.

        Args:
            out: where to copy, as for :func:`cudafut.to_host`.

        Raises:
            CudaError: the last writer's work failed.
            TypeError, ValueError: ``out`` is not a writeable NumPy array of
                the array's shape and dtype (before anything is enqueued).
            CudaUnavailableError: CUDA cannot be used here.
        """
        if not (self._enabled and _tracking):
            return _copies.to_host(self._array, out=out)
        device = self._device
        writer = self._writer
        codes: list[int] = []

        def after(stream: int) -> None:
            if writer is not None:
                codes.append(_wait_for(writer, stream, device))

        if writer is not None and writer.status:
            raise writer.error() or _cuda.cuda_error(writer.status, device)
        fut, rec = _copies.to_host_after(self._array, after, out=out)
        with self._lock:
            old = self._readers.get(rec.stream_key)
            self._readers[rec.stream_key] = rec
            counts = self._counts
            for code in codes:
                counts[code] += 1
            counts[_RECORDED] += 1
        del old  # its event goes back to the pool outside the lock
        return fut

    def statistics(self) -> TrackingStatistics:
        """The waits this array's blocks inserted and skipped, and the
        events they recorded (a snapshot; no CUDA call; under 1 µs).

        Exact even with several threads: counted under the array's lock
        when a block is left (a block being run is not counted yet)."""
        with self._lock:
            inserted, same, complete, recorded, _ = self._counts
        return TrackingStatistics(
            waits_inserted=inserted,
            waits_skipped_same_stream=same,
            waits_skipped_complete=complete,
            events_recorded=recorded,
        )

    def __repr__(self) -> str:
        if not self._enabled:
            state = "untracked"
        else:
            writer = "none" if self._writer is None else f"{self._writer.stream:#x}"
            state = f"writer on {writer}, readers on {len(self._readers)} stream(s)"
        return f"<cudafut.Tracked {type(self._array).__name__} on device {self._device}: {state}>"

    def __del__(self) -> None:
        # Memory cudafut's allocator did not allocate cannot be watched at its
        # free: keep the array until the streams that used it pass this point
        # (for the wrapper's memory, this adds nothing to _register()).
        try:
            streams = _used.pop(id(self), None)
            if streams:
                device = self._device
                triples = [(handle, device, stream) for handle, stream in streams.items()]
                _memory.record_streams_of((self._array,), triples, untracked=True)
        except Exception:  # noqa: BLE001 - a destructor must not raise (shutdown, a dead device)
            pass


# The blocks are plain classes, not Generic ones: instantiating a Generic
# subclass costs about 150 ns more, per block.


class _Plain:
    """The block of an untracked array: hands out the array, nothing else.
    Made once per ``Tracked``, so that a block costs no allocation."""

    __slots__ = ("_array",)

    def __init__(self, array: Any) -> None:
        self._array = array

    def __enter__(self) -> Any:
        return self._array

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


class _Read:
    __slots__ = ("_code", "_stream", "_tracked")

    def __init__(self, tracked: Tracked[Any]) -> None:
        self._tracked = tracked

    def __enter__(self) -> Any:
        t = self._tracked
        device = t._device
        current = _backend.current.current_stream(device)
        stream = self._stream = current.ptr
        if stream not in t._streams:
            _register(t, current, stream)
        writer = t._writer  # one load: atomic, no lock needed
        self._code = _NOTHING if writer is None else _wait_for(writer, stream, device)
        return t._array

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Recorded even when the block raised: what it enqueued still reads.
        t = self._tracked
        rec = _events.record(self._stream, t._device)
        key = rec.stream_key
        with t._lock:
            readers = t._readers
            old = readers.get(key)
            readers[key] = rec
            counts = t._counts
            counts[self._code] += 1
            counts[_RECORDED] += 1
        del old  # its event goes back to the pool outside the lock


class _Write:
    __slots__ = ("_codes", "_stream", "_tracked")

    def __init__(self, tracked: Tracked[Any]) -> None:
        self._tracked = tracked

    def __enter__(self) -> Any:
        t = self._tracked
        device = t._device
        current = _backend.current.current_stream(device)
        stream = self._stream = current.ptr
        if stream not in t._streams:
            _register(t, current, stream)
        with t._lock:
            writer = t._writer
            readers = tuple(t._readers.values()) if t._readers else ()
        codes = self._codes = [] if writer is None else [_wait_for(writer, stream, device)]
        for rec in readers:
            codes.append(_wait_for(rec, stream, device))
        return t._array

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        t = self._tracked
        rec = _events.record(self._stream, t._device)
        with t._lock:
            old = t._writer, t._readers
            t._writer = rec
            if t._readers:
                t._readers = {}
            counts = t._counts
            for code in self._codes:
                counts[code] += 1
            counts[_RECORDED] += 1
        del old  # their events go back to the pool outside the lock
