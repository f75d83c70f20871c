"""Recorded events: one CUDA event recorded once on one stream.

An :class:`EventRecord` owns its event handle exclusively; the handle returns
to the pool when the record is garbage. Its completion status, once seen, is
kept, so every future sharing the record learns it once.

Records carry a per-stream sequence number. Work on one stream completes in
order, so a waiter that finds record *n* of a stream pending takes every
later record of that stream as pending too, and queries only the oldest (for
records two threads make at once on one stream, see ``_counters``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Final

from . import _backend, _compiled, _cuda, _pools
from ._errors import CudaError

# Per stream, the numbers handed out (next() on an itertools.count is one C
# call: atomic under the GIL, no lock) and the newest one. No lock is held
# across cudaEventRecord: one queued the copy threads and the loop thread
# behind a holder waiting for the GIL (stalls of several ms with 64 tasks
# copying, measured), and a lock around the numbering alone cost about
# 0.4 µs per record. A record is numbered just after it reaches its stream,
# so two threads recording on one stream at once may be numbered in the
# other order: the waiter, which queries the lowest pending number first,
# then notices the earlier event when the later one completes: a delay as
# long as the work between the two, never a completion reported early.
_counters: dict[tuple[int, ...], Iterator[int]] = {}
_sequence: dict[tuple[int, ...], int] = {}

#: The status of a record failed from the host (:meth:`EventRecord.fail`):
#: not a CUDA error code.
FAILED: Final = -1


class EventRecord:
    """A CUDA event recorded on a stream, and what is known of its status.

    ``status`` is ``None`` while the work may be pending, ``0`` once it is
    complete, or the CUDA error code the event reported. ``calls`` is the
    backend that made it (:class:`cudafut._backend.Backend`: CUDA's, the
    default, or :mod:`cudafut.testing`'s fake), which it asks for as long as
    it lives;
    ``pool``, the event pool its handle returns to when it is garbage
    (``None``: it owns no pooled event).
    """

    __slots__ = (
        "calls",
        "confirm",
        "device",
        "failure",
        "handle",
        "pool",
        "seen",
        "seq",
        "status",
        "stream",
        "stream_key",
        "t",
    )

    #: Whether a newer record of the stream seen complete answers for this
    #: one without a query: never in this twin (the native core's watermark).
    ordered: ClassVar[bool] = False

    def __init__(
        self,
        handle: int,
        device: int,
        stream: int,
        stream_key: tuple[int, ...],
        seq: int,
        t: float,
        calls: Any = None,
        pool: Any = None,
    ) -> None:
        self.handle = handle
        self.device = device
        self.stream = stream
        self.stream_key = stream_key
        self.seq = seq
        self.status: int | None = None
        #: ``perf_counter()`` when recorded, and when a waiter last saw it
        #: pending (0.0: never): what the duration predictor learns from.
        self.t = t
        self.seen = 0.0
        #: An error decided on the host for the work behind this record (a
        #: collective that timed out): see :meth:`fail_with`.
        self.failure: Exception | None = None
        #: Asked once the event completes: an error means the work did not
        #: succeed after all (an NCCL kernel that an abort ended early).
        self.confirm: Callable[[], CudaError | None] | None = None
        self.calls: Any = _backend.cuda() if calls is None else calls
        self.pool: Any = pool

    def query(self) -> int | None:
        """Non-blocking: the status, asking CUDA only while it is unknown."""
        status = self.status
        if status is None:
            raw = self.calls.event_query(self.handle)
            if raw != _cuda.NOT_READY and self.failure is None:
                return self.settle(raw)
            return self.status
        return status

    def probe(self) -> int | None:
        """The status as an ``await`` or ``result()`` asks it: :meth:`query`
        here (the native twin may first ask its stream's newest record, whose
        completion answers for this one from the watermark)."""
        return self.query()

    def known(self) -> int | None:
        """The status if it is known without asking CUDA, else None: never
        a driver call (finalizers ask this; the watcher thread asks CUDA)."""
        return self.status

    def settle(self, raw: int) -> int | None:
        """Take ``raw``, the event's final status (0 or an error code), once
        the event is no longer pending; a ``confirm`` that finds an error
        fails the record instead. Returns the status kept."""
        if self.status is not None:  # failed from the host, or settled by another thread: final
            return self.status
        confirm = self.confirm
        if raw == 0 and confirm is not None:
            error = confirm()
            if error is not None:
                self.fail_with(error)
                return self.status
            if self.status is not None:  # failed from the host meanwhile: that is final
                return self.status
        self.status = raw
        return raw

    def error(self) -> Exception | None:
        """The :class:`CudaError` this record reported, if any (or the
        error :meth:`fail_with` gave it)."""
        status = self.status
        if status:
            return self.failure or self.calls.event_error(status, self.device)
        return None

    def fail_with(self, error: Exception) -> None:
        """Fail the work behind this record from the host (callable from any
        thread): every waiter sees ``error`` at its next poll, whatever the
        event reports later. For work that can never complete (a collective
        whose peer died), so that nobody waits on it for ever."""
        if self.status is None:  # complete already: the work did finish
            self.failure = error
            self.status = FAILED

    def wait_on(self, stream: int, device: int) -> None:
        """Make ``stream`` wait for this record, unless it is known complete."""
        if self.status is None:
            self.calls.stream_wait(stream, self.handle, device)

    def ended(self) -> str | None:
        """Why this record's backend can no longer be used, or None: a
        record of :mod:`cudafut.testing`'s fake once the fake has ended
        says so (asked only when a call on its future failed for want of
        CUDA, to name the real cause)."""
        return self.calls.ended()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        state = {None: "pending", 0: "complete", FAILED: "failed"}.get(self.status, f"error {self.status}")
        return f"<EventRecord device={self.device} stream={self.stream:#x} seq={self.seq} {state}>"

    def __del__(self) -> None:
        pool = self.pool
        if pool is not None:
            # Not contextlib.suppress: it costs a µs, and this runs for every record.
            try:  # noqa: SIM105
                pool.release(self.device, self.handle)
            except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at shutdown)
                pass


#: The first member of an imported record's stream key (``cudafut._shared``):
#: an event another process records, keyed apart from every stream of this
#: process and ordered with no other record.
IMPORTED: Final = -1


def _stream_key(stream: int, device: int) -> tuple[int, ...]:
    if stream == 2:  # cudaStreamPerThread is one stream per thread
        return (device, stream, threading.get_ident())
    return (device, stream)


def record(
    stream: int, device: int, confirm: Callable[[], CudaError | None] | None = None, owner: object = None
) -> EventRecord:
    """Record a pooled event on ``stream`` of ``device`` (host: < 2 µs).

    ``confirm``, if given, is called (in the polling thread) when the event
    is first seen complete; an error it returns fails the record instead.
    ``owner``: the stream object whose handle ``stream`` is, if the caller
    has it (the native core's watermark needs it; this twin has none).
    """
    pool = _pools.events
    handle = pool.acquire(device)
    key = (device, stream) if stream != 2 else _stream_key(stream, device)
    backend = _backend.current
    try:
        backend.event_record(handle, stream, device)
    except BaseException:
        pool.release(device, handle)
        raise
    counter = _counters.get(key)
    if counter is None:
        counter = _counters.setdefault(key, itertools.count(1))  # one count, whichever thread wins
    seq = next(counter)
    _sequence[key] = seq
    rec = EventRecord(handle, device, stream, key, seq, time.perf_counter(), backend, pool)
    rec.confirm = confirm
    return rec


def current_device() -> int:
    """The calling thread's current device: the backend's (one
    ``cudaGetDevice`` through CuPy's runtime; the native twin asks the
    driver from C). Blocks nothing."""
    return _backend.current.current_device()


def follow_current(stream: int, device: int) -> None:
    """Make ``stream`` of ``device`` wait for the calling thread's current
    stream of ``device``: a record there and a stream wait (a few Python
    calls here, C in the native twin; never blocks the GPU, only ``stream``
    waits). Nothing when the current stream is ``stream`` itself (in order
    already)."""
    caller = _backend.current.current_stream(device)
    ptr = int(caller.ptr)
    if ptr != stream:
        record(ptr, device, None, caller).wait_on(stream, device)


def record_current(device: int) -> EventRecord:
    """Record on the calling thread's current stream of ``device``."""
    stream = _backend.current.current_stream(device)
    return record(int(stream.ptr), device, None, stream)


def is_newest(rec: EventRecord) -> bool:
    """Whether nothing was recorded on ``rec``'s stream after it (by cudafut).

    Two threads recording on one stream at once may leave the older number
    as the newest: then the newest record reads False (``then()`` takes
    another pool stream and a wait it could have skipped), and the other
    reads True (``then()`` continues on the stream without a wait, behind
    the later record's work too: still in order, only later; a trace shows
    the span there)."""
    return _sequence.get(rec.stream_key) == rec.seq


def first_error(records: Sequence[EventRecord]) -> Exception | None:
    """The error of the first record known to have failed, or None (no CUDA call)."""
    for rec in records:
        if rec.status:
            return rec.error()
    return None


# The native twin (cudafut/_core.pyx) replaces this module's records where it
# was built, as CPython's _asyncio replaces asyncio.futures.Future: the
# classes and functions above stay the reference (CUDAFUT_PURE=1).
# record_current() stays Python in both cores: it calls this module's
# record(), which tests and the mutation check replace.
_native = _compiled.native()
if _native is not None:
    _native.bind(_pools, is_newest)
    globals().update(
        EventRecord=_native.EventRecord,
        record=_native.record,
        is_newest=_native.is_newest,
        first_error=_native.first_error,
        current_device=_native.current_device,
        follow_current=_native.follow_current,
    )
