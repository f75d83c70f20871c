"""Futures across processes: pickling a CudaFuture by CUDA IPC.

Pickling a :class:`CudaFuture` (``CudaFuture.__reduce__``) exports it; the
process that unpickles it imports a :class:`CudaFuture` of the same work.
Nothing crosses through host memory: the work is followed by an
interprocess event, and the GPU arrays of the value (CuPy arrays, PyTorch
CUDA tensors, anywhere inside it) by the IPC handles of their allocations.
docs/processes.md tells the user's side; this is how it works.

The producer (the exporting process):

- An export takes a *slot* of the producer's *ledger*: a file in
  ``/dev/shm`` both processes map. The slot holds the export's generation
  (a number never reused), the receiver's pid and start time, written when
  it unpickles, and the generation again, written when the receiver lets go.
  Each field has one writer, so no lock crosses processes.
- Until then the producer keeps the value (so its memory is never reused)
  and the interprocess event (never recorded again). The ``cudafut-share``
  thread reads the ledger every ``_TICK_S`` and frees what receivers let go
  of, what a receiver that died held, and, after ``CUDAFUT_SHARE_CLAIM_S``
  (60 s), what nobody received.
- Events are made once (each costs a few µs to make) and come back
  to a free list when their export is freed. Exports of the same work
  (the rows of one batch: futures with the same records) share one event,
  and exports of one allocation share its IPC handle, each counted: a
  batch crosses for one event record and one handle, not one per row.

The consumer (the importing process):

- Maps the allocations (cached by handle: mapping one is a slow driver call,
  and an allocation is usually sent many times) and opens the event (also
  cached). The future it gets is set, with one record of that event, and
  awaits it like any other: the waiter queries the event.
- While the event is pending, the ``cudafut-share`` thread checks every
  ``_TICK_S`` that the producer lives: a producer that died fails the
  future with :class:`SharingError` (CUDA would leave the event pending for
  ever).
- Once the future, its record and every array of the value are garbage,
  the thread synchronises the devices (this process's work that read the
  memory must end first) and writes the release into the producer's slot.

torch.multiprocessing differs: it shares each tensor's storage with a
reference count in shared memory, and keeps the sender's block until the
count drops, polling it when it allocates; here one slot covers a whole
value, the receiver writes its pid so that its death frees the slot, and an
event carries the order (torch's receivers synchronise on receipt).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import io
import itertools
import mmap
import os
import pickle
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

from . import _backend, _cuda, _lifetimes, _torch
from ._errors import CudaError, InvalidStateError, SharingError
from ._events import IMPORTED, EventRecord, first_error
from ._future import CudaFuture, set_exporter
from ._interface import set_future, share_state, until_set
from ._log import logger

__all__ = ["SharedStatistics", "enqueued", "export", "held_ticket", "import_ticket", "shared_statistics"]

_VERSION: Final = 1
#: How often the cudafut-share thread reads the ledger and checks producers.
_TICK_S: Final = 0.05
#: How often receivers' liveness is checked (a /proc read per receiver).
_ALIVE_S: Final = 0.5
_SLOTS: Final = 1 << 16
# gen, receiver pid, receiver start time, released gen
_FIELDS: Final = 4
# Mapped allocations and opened events kept for reuse once unused.
_IDLE_MAPPINGS: Final = 64
_IDLE_EVENTS: Final = 256


_CLAIM_DEFAULT_S: Final = 60.0


def _claim_s() -> float:
    text = os.environ.get("CUDAFUT_SHARE_CLAIM_S", "").strip()
    if not text:
        return _CLAIM_DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"CUDAFUT_SHARE_CLAIM_S must be a number of seconds above 0, not {text!r}: "
            f"set it to one, or unset it for the default ({_CLAIM_DEFAULT_S:g} s)"
        )
    return value


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: the host name is the best we have
        import socket

        return socket.gethostname()


def _start_time(pid: int) -> int:
    """A process's start time in clock ticks since boot (0: no such process):
    with the pid, names a process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # Field 22; the command name (field 2) may hold spaces and parentheses.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _alive(pid: int, start: int) -> bool:
    return _start_time(pid) == start if start else _pid_exists(pid)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PREFIX: Final = "cudafut-share-"


def _remove_orphans(folder: str) -> None:
    """Remove the ledgers of processes that are gone: a process killed (or
    ended by ``os._exit``) does not run the exit hook that removes its own."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_exists(int(pid_text)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


class Ledger:
    """The slots of one producer: ``_SLOTS`` rows of ``_FIELDS`` int64 in a
    file both sides map (sparse: pages are touched as slots are used)."""

    def __init__(self, path: str, *, create: bool) -> None:
        import numpy as np

        self.path = path
        size = _SLOTS * _FIELDS * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, dtype=np.int64).reshape(_SLOTS, _FIELDS)

    @classmethod
    def create(cls) -> Ledger:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_orphans(folder)
        path = os.path.join(folder, f"{_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        return cls(path, create=True)

    def released(self, used: int) -> Any:
        """The slots below ``used`` whose receiver let go (a vectorised read)."""
        import numpy as np

        rows = self.rows[:used]
        return np.flatnonzero((rows[:, 3] != 0) & (rows[:, 3] == rows[:, 0]))

    def close(self, *, unlink: bool) -> None:
        self.rows = None  # type: ignore[assignment]  # closed: readers check
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class _SharedEvent:
    """An interprocess event recorded after ``records`` (the work of the
    futures it was made for), shared by the exports of that work; given
    back to the free list once the last lets go (``uses``: under the lock)."""

    __slots__ = ("device", "event", "handle", "key", "records", "uses")

    def __init__(
        self, device: int, event: int, handle: bytes, key: tuple[int, ...], records: tuple[EventRecord, ...]
    ) -> None:
        self.device = device
        self.event = event
        self.handle = handle
        self.key = key
        self.records = records
        self.uses = 1


class _Span:
    """An allocation's IPC handle, shared by the exports of arrays inside it
    while any holds one (so the allocation cannot have been freed and its
    address reused): ``uses`` is under the lock."""

    __slots__ = ("base", "bus", "device", "end", "handle", "uses")

    def __init__(self, device: int, base: int, end: int, bus: str, handle: bytes) -> None:
        self.device = device
        self.base = base
        self.end = end
        self.bus = bus
        self.handle = handle
        self.uses = 1


class _Export:
    """What the producer keeps for one export until it is freed."""

    __slots__ = ("event", "future", "gen", "spans", "t", "value")

    def __init__(
        self,
        gen: int,
        future: CudaFuture[Any],
        value: object,
        event: _SharedEvent | None,
        spans: tuple[_Span, ...],
    ) -> None:
        self.gen = gen
        self.future = future
        self.value = value
        self.event = event
        self.spans = spans
        self.t = time.monotonic()


class _Received:
    """The consumer's side of one import: alive while the future's record
    or an array of its value is; its end writes the release (via the
    cudafut-share thread, which first synchronises the devices)."""

    __slots__ = ("__weakref__", "devices", "event_key", "gen", "ledger", "mappings", "slot")

    def __init__(self, ledger: Ledger, slot: int, gen: int) -> None:
        self.ledger = ledger
        self.slot = slot
        self.gen = gen
        self.mappings: list[bytes] = []
        self.devices: set[int] = set()
        self.event_key: bytes | None = None

    def __del__(self) -> None:
        _state.releases.append(
            (self.ledger, self.slot, self.gen, self.mappings, self.devices, self.event_key)
        )
        _state.wake.set()


class _SharedRecord(EventRecord):
    """The record of an imported future: an event another process records.
    Its handle belongs to the event cache, not to the pool."""

    __slots__ = ("__weakref__", "owner")
    owner: _Received

    def __del__(self) -> None:
        pass


class _State:
    """This process's side of sharing, both roles; guarded by ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Held across opening (or closing) other processes' allocations and
        # events, before ``lock``: CUDA may give the same address to a second
        # open of a handle, so an open must never overlap a close of it.
        self.open_lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()
        self.start = _start_time(self.pid)
        self.boot = _boot_id()
        # Producer.
        self.ledger: Ledger | None = None
        self.free_slots: list[int] = []
        self.next_slot = 1  # slot 0 unused: a zeroed row is never a live one
        self.exports: dict[int, _Export] = {}
        self.gens = itertools.count(1)
        self.free_events: dict[int, list[tuple[int, bytes]]] = {}
        # Events of work exported and still held, by the ids of its records.
        self.shared_events: dict[tuple[int, ...], _SharedEvent] = {}
        # Allocations with exports held, by (device, base); the last one
        # used of each device (rows of one batch come one after another).
        self.spans: dict[tuple[int, int], _Span] = {}
        self.last_span: dict[int, _Span] = {}
        self.streams: dict[int, Any] = {}
        self.events_made = 0
        self.last_alive = 0.0
        # Consumer.
        self.ledgers: dict[str, Ledger] = {}
        self.mappings: dict[bytes, list[Any]] = {}  # handle: [ptr, uses, idle since]
        self.events: dict[bytes, list[Any]] = {}  # handle: [event, uses, idle since]
        self.watched: list[tuple[weakref.ref[EventRecord], int, int]] = []
        # Appended by _Received.__del__ (any thread, maybe inside a garbage
        # collection: no lock), popped by the thread.
        self.releases: deque[tuple[Ledger, int, int, list[bytes], set[int], bytes | None]] = deque()
        self.buses: dict[int, str] = {}
        self.stopped = False
        self.devices: dict[str, int] = {}
        self.alive_at: dict[tuple[int, int], float] = {}
        self.received = 0
        self.released = 0


_state = _State()


def _after_fork_in_child() -> None:
    global _state
    old = _state
    _state = _State()  # the child owns none of the parent's exports, maps or events
    if old.ledger is not None:
        old.ledger.close(unlink=False)


_lifetimes.at_fork_in_child(_after_fork_in_child)


# -- the producer ---------------------------------------------------------------------------


def export(fut: CudaFuture[Any]) -> tuple[Callable[..., CudaFuture[Any]], tuple[Any, ...]]:
    """``fut.__reduce__()``: the ticket another process imports ``fut`` by.

    Raises:
        InvalidStateError: ``fut`` is pending (its work is not enqueued).
        TypeError: its value holds a GPU array that cannot cross.
    """
    state, value, exception, records = share_state(fut)
    if state == "pending":
        raise InvalidStateError(
            "a pending CudaFuture cannot cross processes: its work is not enqueued yet, so there "
            "is nothing to wait for in the other process. Send it once it is set: "
            "`await cudafut.enqueued(fut)` (does not wait for the GPU), then send"
        )
    if state == "cancelled":
        return _import, (_VERSION, "cancelled", None)
    if state == "failed":
        return _import, (_VERSION, "failed", _picklable(exception))
    pending = [rec for rec in records if rec.query() is None]
    error = first_error(records)
    if error is not None:
        return _import, (_VERSION, "failed", _picklable(error))
    payload, spans = _dump_value(value, bool(pending))
    if not pending and not spans:
        return _import, (_VERSION, "value", payload)
    event = None
    try:
        if pending:
            event = _shared_event(pending)
        return _import, held_ticket(fut, value, payload, event, spans)
    except BaseException:
        with _state.lock:
            _let_go(event, spans)
        raise


set_exporter(export)


def held_ticket(
    fut: CudaFuture[Any],
    value: object,
    payload: bytes,
    event: _SharedEvent | None,
    spans: tuple[_Span, ...] = (),
) -> tuple[Any, ...]:
    """Hold ``value``, ``event`` and ``spans`` (one use of each, which the
    caller took) in a slot for one receiver; the ticket (``_import``'s
    arguments) it unpickles. Host logic only, without an event:
    tests/test_shared.py drives the ledger through it on the CPU."""
    # Before the slot: once it is taken, the export holds the uses, and an
    # error here would give them back a second time. The claim time is
    # checked here, where the caller sees a bad one, not first in the share
    # thread's round, which could only log it.
    _claim_s()
    shared = None if event is None else (_bus_of(event.device), event.handle)
    slot, gen = _take_slot(fut, value, event, spans)
    ledger = _state.ledger
    assert ledger is not None
    return (
        _VERSION,
        "shared",
        payload,
        _state.boot,
        _state.pid,
        _state.start,
        ledger.path,
        slot,
        gen,
        shared,
    )


def import_ticket(ticket: tuple[Any, ...]) -> CudaFuture[Any]:
    """What unpickling a future's ticket does (tests call it directly)."""
    return _import(*ticket)


def _picklable(exc: BaseException | None) -> BaseException:
    assert exc is not None
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any exception at all: send what can be sent
        return SharingError(
            f"the future failed in the producing process with {exc!r} (which does not pickle)"
        )
    return exc


def _shared_event(pending: list[EventRecord]) -> _SharedEvent:
    """An interprocess event recorded after ``pending``, with one use taken
    for the caller: the one already held for exports of the same records
    (the other rows of a batch), else a new record (:func:`_event_after`)."""
    st = _state
    key = tuple(map(id, pending))
    with st.lock:
        shared = st.shared_events.get(key)
        # The ids name these records only while the entry holds them: compare.
        if shared is not None and all(a is b for a, b in zip(shared.records, pending, strict=True)):
            shared.uses += 1
            return shared
    device, event, handle = _event_after(pending)
    shared = _SharedEvent(device, event, handle, key, tuple(pending))
    with st.lock:
        st.shared_events[key] = shared  # another thread's, made meanwhile, stays counted by its uses
    return shared


def _let_go(event: _SharedEvent | None, spans: tuple[_Span, ...]) -> None:
    """Give back one use of ``event`` and of each of ``spans`` (under the
    lock): an event no export uses returns to the free list."""
    st = _state
    if event is not None:
        event.uses -= 1
        if not event.uses:
            if st.shared_events.get(event.key) is event:
                del st.shared_events[event.key]
            st.free_events.setdefault(event.device, []).append((event.event, event.handle))
    for span in spans:
        span.uses -= 1
        if not span.uses:
            key = (span.device, span.base)
            if st.spans.get(key) is span:
                del st.spans[key]
            if st.last_span.get(span.device) is span:
                del st.last_span[span.device]


def _event_after(pending: list[EventRecord]) -> tuple[int, int, bytes]:
    """An interprocess event, recorded after ``pending`` on a pool stream."""
    device = pending[0].device
    with _state.lock:
        free = _state.free_events.get(device)
        taken = free.pop() if free else None
    if taken is None:
        taken = _backend.current.ipc_event_create(device)
        with _state.lock:
            _state.events_made += 1
    event, handle = taken
    stream = _share_stream(device)
    try:
        for rec in pending:
            rec.wait_on(stream, device)
        _backend.current.event_record(event, stream, device)
    except BaseException:
        with _state.lock:
            _state.free_events.setdefault(device, []).append(taken)
        raise
    return device, event, handle


def _share_stream(device: int) -> int:
    """The stream of ``device`` that interprocess events are recorded on
    (after waits for the exported work): one of its own, which runs nothing
    else, so no unrelated work delays a receiver. Made on the first export
    of the device (creating a stream may wait for the GPU's running work:
    docs/design.md, hazard 11)."""
    stream = _state.streams.get(device)
    if stream is None:
        made = _backend.current.new_stream(device, 0)  # not under the lock: it may wait
        with _state.lock:
            stream = _state.streams.setdefault(device, made)
    return int(stream.ptr)


def _take_slot(
    fut: CudaFuture[Any], value: object, event: _SharedEvent | None, spans: tuple[_Span, ...]
) -> tuple[int, int]:
    st = _state
    # First: once the export is stored it holds the caller's uses, and a
    # failure after that would have the caller give them back a second time.
    _ensure_thread()
    with st.lock:
        if st.ledger is None:
            st.ledger = Ledger.create()
            atexit.register(_stop, st)
        ledger = st.ledger
        if st.free_slots:
            slot = st.free_slots.pop()
        elif st.next_slot < _SLOTS:
            slot = st.next_slot
            st.next_slot += 1
        else:
            raise SharingError(
                f"{_SLOTS - 1:,} futures sent to other processes are still held there (or not "
                "received yet); receivers must drop the futures and values they are done with"
            )
        gen = next(st.gens)
        row = ledger.rows[slot]
        row[1] = row[2] = row[3] = 0
        row[0] = gen
        st.exports[slot] = _Export(gen, fut, value, event, spans)
    return slot, gen


def _free(slot: int) -> _Export:
    """Forget export ``slot`` (under the lock). Returns it: the caller drops
    it (and the value, whose end may cost an allocator call) after the lock."""
    st = _state
    entry = st.exports.pop(slot)
    assert st.ledger is not None
    st.ledger.rows[slot, 0] = 0
    st.free_slots.append(slot)
    _let_go(entry.event, entry.spans)
    return entry


def _free_same(slot: int, gen: int) -> _Export | None:
    """:func:`_free` the export in ``slot`` if it is still export ``gen``
    (under the lock): a slot freed meanwhile may hold a new one."""
    entry = _state.exports.get(slot)
    if entry is None or entry.gen != gen:
        return None
    return _free(slot)


def _reap_exports(now: float) -> None:
    st = _state
    ledger = st.ledger
    if ledger is None or not st.exports:
        return
    with st.lock:
        rows = ledger.rows
        freed = [_free_same(slot, int(rows[slot, 0])) for slot in ledger.released(st.next_slot).tolist()]
    del freed  # the values end here, outside the lock
    if now - st.last_alive < _ALIVE_S:
        return
    st.last_alive = now
    try:
        claim_s = _claim_s()
    except ValueError as exc:  # changed since the exports checked it: dead receivers are still freed
        logger.warning("cudafut: %s; unclaimed exports are freed after %g s", exc, _CLAIM_DEFAULT_S)
        claim_s = _CLAIM_DEFAULT_S
    with st.lock:
        rows = ledger.rows
        claims = [
            (slot, entry.gen, entry.t, int(rows[slot, 1]), int(rows[slot, 2]))
            for slot, entry in st.exports.items()
        ]
    gone: list[tuple[int, int]] = []
    alive = functools.cache(_alive)  # each receiver read once this round
    for slot, gen, t, pid, start in claims:
        if pid:
            if not alive(pid, start):
                gone.append((slot, gen))
        elif now - t > claim_s:
            gone.append((slot, gen))
    if gone:
        with st.lock:
            freed = [_free_same(slot, gen) for slot, gen in gone]
        del freed
        logger.debug(
            "cudafut: freed %d futures sent to processes that died or never received them", len(gone)
        )


# -- the value: GPU arrays by IPC handle ----------------------------------------------------


class _ValuePickler(pickle.Pickler):
    """Pickles a value, sending its GPU arrays by IPC handle."""

    def __init__(self, file: io.BytesIO, pending: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        #: A use of the allocation of each GPU array pickled (see _Span).
        self.spans: list[_Span] = []
        self.pending = pending
        cp = _cuda.imported_cupy()
        self.cupy_array = None if cp is None else cp.ndarray
        self.torch = _torch.loaded()

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is self.cupy_array or (self.cupy_array is not None and isinstance(obj, self.cupy_array)):
            return _export_cupy(obj, self.spans)
        torch = self.torch
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                return _export_torch(torch, obj, self.spans)
            if self.pending:
                self._refuse_host(obj)
            return NotImplemented  # a host tensor: by value, as pickle sends it
        if self.pending and hasattr(cls, "__array_interface__"):
            self._refuse_host(obj)
        if cls.__module__ != "numpy" and hasattr(cls, "__cuda_array_interface__"):
            raise TypeError(
                f"a {cls.__module__}.{cls.__name__} cannot cross processes inside a CudaFuture's "
                "value: only CuPy arrays and PyTorch CUDA tensors travel by CUDA IPC. Convert it "
                "(cupy.asarray(x) shares its memory) before setting the future"
            )
        return NotImplemented

    @staticmethod
    def _refuse_host(obj: object) -> None:
        cls = type(obj)
        raise InvalidStateError(
            f"the value holds a host array ({cls.__module__}.{cls.__name__}) and its GPU work is "
            "still pending: that work may be writing it (a copy to the host), and pickling would "
            "send it half-written. Send the future once its work is done (after `await fut`), "
            "or keep the value on the GPU (it then crosses by CUDA IPC)"
        )


def _dump_value(value: object, pending: bool) -> tuple[bytes, tuple[_Span, ...]]:
    """The pickled value, and a use of each allocation its GPU arrays are in."""
    buf = io.BytesIO()
    pickler = _ValuePickler(buf, pending)
    try:
        pickler.dump(value)
    except BaseException:
        with _state.lock:
            _let_go(None, tuple(pickler.spans))
        raise
    return buf.getvalue(), tuple(pickler.spans)


def _bus_of(device: int) -> str:
    bus = _state.buses.get(device)
    if bus is None:
        bus = _state.buses[device] = _backend.current.device_bus_id(device)
    return bus


def _span(device: int, ptr: int, what: str, spans: list[_Span]) -> tuple[str, bytes, int, int]:
    """``(bus, handle, offset, size)`` of the allocation holding ``ptr``;
    a use of it appended to ``spans``. The allocation of the last array
    exported from ``device`` is asked for first (a batch's rows share one),
    then CUDA (a few µs)."""
    st = _state
    with st.lock:
        span = st.last_span.get(device)
        if span is not None and span.base <= ptr < span.end:
            span.uses += 1
            spans.append(span)
            return span.bus, span.handle, ptr - span.base, span.end - span.base
    try:
        handle, offset, size = _backend.current.ipc_memory_handle(ptr, device)
    except Exception as exc:  # CuPy's CUDARuntimeError, or CudaError from the driver call
        raise TypeError(
            f"{what} cannot cross processes: CUDA cannot share its memory ({exc}); memory from a "
            "stream-ordered pool (cudaMallocAsync, CuPy's MemoryAsyncPool) or a virtual-memory "
            "allocator (PyTorch's expandable_segments) has no IPC handle. Allocate it with CuPy's "
            "default pool or PyTorch's default allocator"
        ) from exc
    base = ptr - offset
    bus = _bus_of(device)
    with st.lock:
        span = st.spans.get((device, base))
        if span is not None and span.handle == handle:
            span.uses += 1
        else:  # a new one (an entry with another handle is an older allocation's, still counted)
            span = st.spans[device, base] = _Span(device, base, base + size, bus, handle)
        st.last_span[device] = span
    spans.append(span)
    return bus, handle, offset, size


def _export_cupy(arr: Any, spans: list[_Span]) -> tuple[Any, tuple[Any, ...]]:
    if arr.size == 0:
        return _empty_cupy, (arr.shape, arr.dtype)
    device = int(arr.device.id)
    bus, handle, offset, size = _span(device, int(arr.data.ptr), "a CuPy array", spans)
    return _open_cupy, (bus, handle, offset, size, arr.shape, arr.strides, arr.dtype)


def _export_torch(torch: Any, t: Any, spans: list[_Span]) -> tuple[Any, tuple[Any, ...]]:
    dtype = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        return _empty_torch, (tuple(t.shape), dtype)
    device = int(t.device.index)
    bus, handle, offset, size = _span(device, int(t.data_ptr()), "a PyTorch tensor", spans)
    return _open_torch, (
        bus,
        handle,
        offset,
        size,
        tuple(t.shape),
        tuple(t.stride()),
        dtype,
        t.element_size(),
    )


# The import under way in this thread: the arrays of the value attach to it.
_importing = threading.local()


def _empty_cupy(shape: tuple[int, ...], dtype: Any) -> Any:
    return _backend.current.cupy().empty(shape, dtype)


def _empty_torch(shape: tuple[int, ...], dtype: str) -> Any:
    torch = _torch.imported()
    return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")


def _mapped(bus: str, handle: bytes) -> tuple[int, int]:
    """``(device, base)`` of a received allocation, mapping it if need be."""
    received: _Received = _importing.received
    device = _device_of(bus)
    base = _opened(_state.mappings, handle, lambda: _backend.current.ipc_open_memory(handle, device))
    received.mappings.append(handle)
    received.devices.add(device)
    return device, base


def _opened(table: dict[bytes, list[Any]], handle: bytes, open_it: Callable[[], int]) -> int:
    """Another process's allocation or event by ``handle``, from ``table``
    (``_State.mappings`` or ``events``), opened by ``open_it`` if need be,
    with one more use counted (a release counts it back)."""
    st = _state
    with st.open_lock:  # see _State.open_lock
        with st.lock:
            entry = table.get(handle)
            if entry is not None:
                entry[1] += 1
                return int(entry[0])
        opened = open_it()
        with st.lock:
            table[handle] = [opened, 1, 0.0]
        return opened


def _open_cupy(
    bus: str,
    handle: bytes,
    offset: int,
    size: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
) -> Any:
    device, base = _mapped(bus, handle)
    return _cuda.array_over(base, size, _importing.received, device, offset, shape, strides, dtype)


class _Interface:
    """``__cuda_array_interface__`` over received memory, for PyTorch, which
    keeps this object (and so the import) alive as long as the tensor."""

    __slots__ = ("__cuda_array_interface__", "received")

    def __init__(self, info: dict[str, Any], received: _Received) -> None:
        self.__cuda_array_interface__ = info
        self.received = received


def _open_torch(
    bus: str,
    handle: bytes,
    offset: int,
    size: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str,
    itemsize: int,
) -> Any:
    torch = _torch.imported()
    device, base = _mapped(bus, handle)
    # Same-size integers, then a view as the dtype: the interface has no
    # bfloat16 (nor float8).
    info = {
        "shape": shape,
        "strides": tuple(s * itemsize for s in strides),
        "typestr": {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8", 16: "<c16"}[itemsize],
        "data": (base + offset, False),
        "version": 3,
        "stream": None,
    }
    raw = torch.as_tensor(_Interface(info, _importing.received), device=f"cuda:{device}")
    target = getattr(torch, dtype)
    return raw if raw.dtype == target else raw.view(target)


# -- the consumer ----------------------------------------------------------------------------


def _device_of(bus: str) -> int:
    device = _state.devices.get(bus)
    if device is None:
        try:
            device = _backend.current.device_of_bus_id(bus)
        except CudaError as exc:
            raise SharingError(
                f"the future's work runs on the GPU at PCI bus {bus}, which this process does not "
                "see (check CUDA_VISIBLE_DEVICES): it cannot wait for it"
            ) from exc
        _state.devices[bus] = device
    return device


def _import(version: int, kind: str, payload: Any, *ticket: Any) -> CudaFuture[Any]:
    """Unpickling: the future of an exported future's work."""
    if version != _VERSION:
        raise SharingError(
            f"this future was pickled by another cudafut (format {version}, this one reads "
            f"{_VERSION}); run the same cudafut in both processes"
        )
    if kind == "cancelled":
        fut: CudaFuture[Any] = CudaFuture()
        fut.cancel()
        return fut
    if kind == "failed":
        fut = CudaFuture()
        fut.set_exception(payload)
        return fut
    if kind == "value":
        return set_future(pickle.loads(payload), ())
    return _import_shared(payload, *ticket)


def _import_shared(
    payload: bytes,
    boot: str,
    pid: int,
    start: int,
    path: str,
    slot: int,
    gen: int,
    event: tuple[str, bytes] | None,
) -> CudaFuture[Any]:
    st = _state
    if boot != st.boot:
        raise SharingError(
            "this future was pickled on another machine: CUDA IPC shares GPU memory and events "
            "between processes of one machine only; send the value itself (e.g. fut.result().get())"
        )
    if pid == st.pid:  # unpickled where it was pickled: the future itself
        with st.lock:
            entry = st.exports.get(slot)
            if entry is None or entry.gen != gen:
                raise SharingError(_expired(slot, gen))
            _free(slot)
        return entry.future
    if not _seen_alive(pid, start):
        raise SharingError(
            f"the process that pickled this future (pid {pid}) has exited: its GPU work and memory are gone"
        )
    ledger = _open_ledger(path)
    row = ledger.rows[slot]
    if int(row[0]) != gen:
        raise SharingError(_expired(slot, gen))
    if int(row[1]):
        raise SharingError(
            f"this pickled future was received already (by pid {int(row[1])}): each pickle crosses "
            "once; pickle the future once per receiver"
        )
    row[2] = st.start
    row[1] = st.pid
    received = _Received(ledger, slot, gen)
    _ensure_thread()
    _importing.received = received
    try:
        value = pickle.loads(payload)
        records: tuple[EventRecord, ...] = ()
        if event is not None:
            records = (_open_record(event, received, pid, start),)
    except BaseException:
        del received  # its end releases the slot
        raise
    finally:
        _importing.received = None
    with st.lock:
        st.received += 1
    return set_future(value, records, None)


def _seen_alive(pid: int, start: int) -> bool:
    """:func:`_alive`, trusting an answer for ``_TICK_S`` (a /proc read
    costs more than the rest of an import)."""
    now = time.monotonic()
    key = (pid, start)
    if now - _state.alive_at.get(key, -1.0) < _TICK_S:
        return True
    if not _alive(pid, start):
        return False
    _state.alive_at[key] = now
    return True


def _expired(slot: int, gen: int) -> str:
    return (
        f"this pickled future (slot {slot}, export {gen}) is no longer held by its producer: it "
        "was received already, or nobody received it within CUDAFUT_SHARE_CLAIM_S seconds "
        "(default 60) of pickling"
    )


def _open_ledger(path: str) -> Ledger:
    ledger = _state.ledgers.get(path)
    if ledger is None:
        try:
            ledger = Ledger(path, create=False)
        except OSError as exc:
            raise SharingError(
                f"the producer's ledger {path} is gone: the producing process has exited"
            ) from exc
        _state.ledgers[path] = ledger
    return ledger


def _open_record(event: tuple[str, bytes], received: _Received, pid: int, start: int) -> EventRecord:
    bus, handle = event
    device = _device_of(bus)
    st = _state
    event_handle = _opened(st.events, handle, lambda: _backend.current.ipc_open_event(handle, device))
    received.event_key = handle
    received.devices.add(device)
    # A stream key of its own: ordered with no other record.
    rec = _SharedRecord(event_handle, device, 0, (IMPORTED, id(received)), 1, time.perf_counter())
    rec.owner = received
    with st.lock:
        st.watched.append((weakref.ref(rec), pid, start))
    return rec


def _watch_producers() -> None:
    """Fail the pending imported records whose producer died."""
    st = _state
    with st.lock:
        watched = st.watched
        st.watched = []
    keep: list[tuple[weakref.ref[EventRecord], int, int]] = []
    alive = functools.cache(_alive)  # each producer read once this round
    for ref, pid, start in watched:
        rec = ref()
        if rec is None or rec.query() is not None:
            continue
        if alive(pid, start):
            keep.append((ref, pid, start))
        else:
            rec.fail_with(
                SharingError(
                    f"the process that produced this future (pid {pid}) died before its GPU work "
                    "completed; the work will never complete"
                )
            )
    with st.lock:
        st.watched.extend(keep)


def _release_received() -> None:
    """Write the releases of the imports that ended, once this process's
    work on their devices (which may read their memory) has ended."""
    st = _state
    releases = []
    while st.releases:
        releases.append(st.releases.popleft())
    if not releases:
        return
    for device in sorted({d for r in releases for d in r[4]}):
        try:
            _backend.current.device_synchronize(device)
        except Exception:  # noqa: BLE001 - a broken context: release anyway, nothing reads now
            logger.debug("cudafut: device_synchronize(%d) failed before a release", device, exc_info=True)
    now = time.monotonic()
    with st.open_lock:  # see _State.open_lock
        with st.lock:
            for ledger, slot, gen, mappings, _devices, event_key in releases:
                rows = ledger.rows
                if rows is not None and int(rows[slot, 0]) == gen:
                    rows[slot, 3] = gen
                events = () if event_key is None else (event_key,)
                for table, handles in ((st.mappings, mappings), (st.events, events)):
                    for handle in handles:  # the uses _opened() counted, back
                        entry = table[handle]
                        entry[1] -= 1
                        entry[2] = now
                st.released += 1
            close_maps = _pop_idle(st.mappings, _IDLE_MAPPINGS)
            close_events = _pop_idle(st.events, _IDLE_EVENTS)
        for close, opened in (
            (_backend.current.ipc_close_memory, close_maps),
            (_backend.current.event_destroy, close_events),
        ):
            for ptr in opened:
                with contextlib.suppress(Exception):
                    close(ptr)


def _pop_idle(table: dict[bytes, list[Any]], keep: int) -> list[int]:
    """Take out of ``table`` (``_State.mappings`` or ``events``, under the
    lock) its unused entries beyond the ``keep`` used last; what they opened,
    for the caller to close."""
    idle = sorted((e[2], h) for h, e in table.items() if e[1] == 0)
    return [table.pop(h)[0] for _t, h in idle[: max(0, len(idle) - keep)]]


# -- the thread -------------------------------------------------------------------------------


def _ensure_thread() -> None:
    st = _state
    if st.thread is not None:
        return
    with st.lock:
        if st.thread is None:
            st.thread = threading.Thread(target=_run, args=(st,), name="cudafut-share", daemon=True)
            st.thread.start()


def _run(st: _State) -> None:
    while st is _state and not st.stopped:
        busy = bool(st.exports or st.watched or st.releases)
        st.wake.wait(_TICK_S if busy else 1.0)
        st.wake.clear()
        try:
            _release_received()
            _watch_producers()
            _reap_exports(time.monotonic())
        except Exception:  # noqa: BLE001 - the thread must go on; say why it did not this time
            logger.exception("cudafut: the cudafut-share thread failed a round")


def _stop(st: _State) -> None:
    """At exit: stop the thread, then remove the ledger (receivers that
    still hold futures find it gone, and their waits fail: see
    _watch_producers)."""
    st.stopped = True
    st.wake.set()
    thread = st.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(1.0)
    if st.ledger is not None:
        st.ledger.close(unlink=True)


# -- the public part ------------------------------------------------------------------------


def enqueued(fut: CudaFuture[Any]) -> Awaitable[None]:
    """``await cudafut.enqueued(fut)``: wait until ``fut`` is set (its work
    enqueued), failed or cancelled, without waiting for the GPU: from then
    on it can be pickled to another process, which waits for the GPU work
    itself.

    For :func:`cudafut.launch` and :meth:`cudafut.Batcher.submit_future`
    futures, which are pending until a launcher thread has enqueued the
    work. Costs the loop one wake-up; works on asyncio, uvloop and trio.

    Raises:
        TypeError: ``fut`` is not a :class:`CudaFuture` (at the call).
        RuntimeError: no asyncio, uvloop or trio loop runs in this thread
            (at the call).
    """
    if not isinstance(fut, CudaFuture):
        raise TypeError(f"enqueued() takes a CudaFuture, not {type(fut).__name__}")
    return until_set(fut)


@dataclasses.dataclass(frozen=True)
class SharedStatistics:
    """Futures this process sent to other processes and received from them
    (:func:`shared_statistics`): all counts."""

    #: Sent futures still held for a receiver (value and event kept).
    held: int
    #: Interprocess events this process made (kept, and reused once let go).
    events: int
    #: Futures received from other processes.
    received: int
    #: Received futures let go of (the producer told).
    released: int
    #: Other processes' allocations mapped here (unused ones kept for reuse).
    mapped: int
    #: Other processes' events opened here (likewise).
    opened_events: int
    #: Received futures whose producer is watched (their work pending).
    watched: int


def shared_statistics() -> SharedStatistics:
    """What this process holds for futures crossing processes (a snapshot,
    under a lock; blocks nothing else). Counts settle within about 0.1 s of
    the futures being dropped, the consumer's device being synchronised
    first."""
    st = _state
    with st.lock:
        return SharedStatistics(
            held=len(st.exports),
            events=st.events_made,
            received=st.received,
            released=st.released,
            mapped=len(st.mappings),
            opened_events=len(st.events),
            watched=len(st.watched),
        )
