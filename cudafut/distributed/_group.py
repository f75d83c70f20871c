"""Process groups: NCCL communicators, their streams, the rendezvous, and the
watchdog that turns a hung or failed collective into an error.

A :class:`ProcessGroup` owns one NCCL communicator on one device and one
communication stream at high priority. Every collective is enqueued under the
group's lock (so that the calls of several threads reach NCCL in one order),
after a stream wait on the caller's current stream, and followed by one event
recorded on the communication stream: the event of the future it returns.

NCCL never reports a dead peer by itself on one node: the collective's kernel
just spins. So one watchdog thread per process looks, every few ms while any
collective is pending, at the oldest pending collective of each group, at
``ncclCommGetAsyncError`` and at the deadlines; on an error or a timeout it
fails every pending future of the group with :class:`CollectiveError` (the
waiters see it at their next poll) and aborts the communicator from a daemon
thread, since ``ncclCommAbort`` can itself hang.
"""

from __future__ import annotations

import atexit
import collections
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Final, Protocol

from .. import _backend, _checks, _cuda, _events, _lifetimes, _torch
from .._future import CudaFuture
from .._interface import KEPT_BY_PRODUCER, set_future
from .._log import logger
from . import _env, _nccl
from ._errors import CollectiveError

#: How often the watchdog looks while collectives are pending.
WATCH_EVERY_S: Final = 5e-3
#: A collective that completes in this last share of its timeout is taken
#: as failed: the peers' watchdogs abort then, which can end it early.
_DOUBT: Final = 0.1
#: torch.distributed's default for NCCL.
DEFAULT_TIMEOUT_S: Final = 600.0
#: The store's calls made by a start-up end this long after its deadline:
#: the deadline, not the store's own timeout, tells of a silent store.
_STORE_SLACK_S: Final = 0.05
#: How long a start-up whose timeout ran out waits more for its store's
#: thread, whose calls were given the same deadline, to leave the store
#: (torch's TCPStore, connecting, overshoots its timeout by a retry delay
#: of about a second).
STORE_GRACE_S: Final = 2.0
#: At exit, how long past its deadline a store's thread still inside the
#: store (see _join_left) is waited for.
EXIT_GRACE_S: Final = 5.0


class Store(Protocol):
    """What the rendezvous needs of a key-value store (torch's ``TCPStore``
    has it): ``get`` blocks until the key is set."""

    def set(self, key: str, value: bytes) -> Any: ...

    def get(self, key: str) -> bytes: ...


def check_timeout(timeout: object, what: str = "timeout") -> float:
    """A positive timeout in seconds (any real number; ``math.inf`` and
    anything beyond ``threading.TIMEOUT_MAX`` give that: no limit).

    Raises:
        TypeError: not a real number.
        ValueError: zero, negative or NaN.
    """
    return _checks.timeout_seconds(timeout, what, positive=True)


class _Pending:
    """A collective enqueued (``record`` set) or being enqueued (None).

    Once enqueued it also holds what the collective reads and writes
    (``keep``): its future leaves that to the group (``KEPT_BY_PRODUCER``),
    which keeps it until the watchdog sees the record complete, or the
    group fails it.

    It is its record's ``confirm`` too (``entry()``: no closure per call),
    so the two refer to each other until :meth:`forget` breaks the cycle."""

    __slots__ = ("deadline", "group", "keep", "op", "record", "timeout", "trusted_until")

    def __init__(self, group: ProcessGroup, op: str, timeout: float) -> None:
        self.group = group
        self.record: _events.EventRecord | None = None
        self.op = op
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        # The end of the window in which a completion is believed (see ProcessGroup.confirm).
        self.trusted_until = self.deadline
        self.keep: object = None

    def __call__(self) -> CollectiveError | None:
        """The record's confirm: asked once its event is first seen complete."""
        return self.group.confirm(self.op, self.trusted_until)

    def query(self) -> int | None:
        return None if self.record is None else self.record.query()

    def fail(self, error: CollectiveError) -> None:
        if self.record is not None:
            self.record.fail_with(error)

    def forget(self) -> None:
        """Let go of the arrays (handed elsewhere, or free to go) and, once
        the record's status is final (it asks its confirm no more), of the
        record's reference to this entry: reference counting then frees
        both, without the cyclic collector."""
        self.keep = None
        record = self.record
        if record is not None and record.status is not None:
            record.confirm = None


class ProcessGroup:
    """Some ranks of the world, with their own NCCL communicator.

    Made by :func:`init_process_group` (the world) and :func:`new_group`.

    Attributes:
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        ranks: the members' ranks in the world, in group-rank order.
        device: the CUDA device of this process's rank.
        stream: the communication stream (a CuPy stream at the device's
            highest priority): every collective of the group runs on it.
        timeout: the default timeout of the group's collectives, seconds.
    """

    def __init__(
        self,
        comm: Any,
        rank: int,
        ranks: Sequence[int],
        device: int,
        timeout: float,
        name: str,
        stream: Any = None,
    ) -> None:
        self._comm = comm
        self.rank = rank
        self.size = len(ranks)
        self.ranks = tuple(ranks)
        self.device = device
        self.timeout = timeout
        self.name = name
        if stream is None:
            # Clamped by CUDA into the device's range: the highest priority.
            stream = _backend.current.new_stream(device, -1000)
            # The device's notice streams made now, before any collective:
            # made by the first notice instead, their creation could wait
            # behind a collective whose peer died, and hold up its abort
            # (docs/design.md, hazard 11).
            _backend.current.prepare_notices(device, _backend.PREPARE_NOTICES_S)
        self.stream = stream
        # Calls reach NCCL in one order, whichever threads make them.
        self._call_lock = threading.Lock()
        # Guards the bookkeeping below; never held across an NCCL call, so
        # that the watchdog can always look (a call can block: the first
        # send to a peer that never comes does). Re-entrant: a query under
        # it can run a finalizer that aborts the group.
        self._lock = threading.RLock()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._aborted: str | None = None
        self._calling: _Pending | None = None
        # The communication stream's handle, read at the first call (a
        # group made for a test may have a stream object without one).
        self._stream_ptr: int | None = None

    @property
    def aborted(self) -> str | None:
        """None, or why the group's communicator was aborted."""
        return self._aborted

    def __repr__(self) -> str:
        state = f" aborted: {self._aborted}" if self._aborted else ""
        where = f"rank {self.rank} of {self.size} on device {self.device}"
        return f"<cudafut.distributed.ProcessGroup {self.name} {where}{state}>"

    def enqueue(
        self,
        op: str,
        args: tuple[Any, ...],
        value: Any,
        keep: object,
        timeout: float | None,
        launch: Callable[[Any, int], None] | None = None,
    ) -> CudaFuture[Any]:
        """Enqueue one collective: the communication stream waits on the
        caller's current stream, NCCL is called (``getattr(comm, op)(*args,
        stream_ptr)``, or ``launch(comm, stream_ptr)`` where given: several
        NCCL calls), and an event follows. Returns the future, set already;
        ``value`` and ``keep`` live until the collective ends (kept by the
        group's entry for it, whether or not the future is dropped). A call
        that NCCL took while another thread aborted the group returns a
        future failed with that abort's :class:`CollectiveError`.

        Costs a few µs on the host, NCCL's own call aside (less with the
        native core: the device check and the stream wait are made from C);
        blocks while another thread's call of the group is inside NCCL
        (calls reach NCCL in one order), never the GPU.

        Raises:
            CollectiveError: the group was aborted, NCCL refused the call,
                or no event could be recorded after NCCL took it (the group
                is aborted then, and the arrays are never freed: a kernel
                may still use them).
        """
        limit = self.timeout if timeout is None else check_timeout(timeout)
        if self._aborted is not None:
            self._raise_if_aborted(op)
        device = self.device
        if _events.current_device() == device:  # the common case: no device switch
            return self._enqueue(op, args, value, keep, limit, launch, device)
        with _backend.current.on_device(device):
            return self._enqueue(op, args, value, keep, limit, launch, device)

    def _enqueue(
        self,
        op: str,
        args: tuple[Any, ...],
        value: Any,
        keep: object,
        limit: float,
        launch: Callable[[Any, int], None] | None,
        device: int,
    ) -> CudaFuture[Any]:
        stream = self._stream_ptr
        if stream is None:
            stream = self._stream_handle()
        with self._call_lock:
            if self._aborted is not None:
                self._raise_if_aborted(op)
            # (Nothing when called on the communication stream itself: in order already.)
            _events.follow_current(stream, device)
            # Visible to the watchdog from here on: a call that blocks (the
            # first send to a peer that never comes) times out too.
            pending = self._calling = _Pending(self, op, limit)
            if self not in _watchdog.watched:  # (read unlocked: see _Watchdog.watch)
                _watchdog.watch(self)
            try:
                if launch is None:
                    getattr(self._comm, op)(*args, stream)
                else:
                    launch(self._comm, stream)
            except Exception as exc:
                self._calling = None
                reason = self._aborted or f"NCCL refused the call: {exc}"
                raise CollectiveError(self.rank, op, self.size, reason, device) from exc
            except BaseException:
                # Interrupted (Ctrl-C) in the binding's Python, before or
                # after NCCL took the call: which, nothing says. The arrays
                # stay until the stream passes a fence recorded now (at once
                # where NCCL took nothing), and the group stays usable.
                with self._lock:
                    self._calling = None
                self._keep_past([(value, keep)])
                raise
            now = time.monotonic()
            # The same entry, now enqueued: its deadline counts from here.
            pending.deadline = now + limit
            pending.trusted_until = now + limit * (1 - _DOUBT)
            try:
                record = _events.record(stream, device, pending)
            except BaseException as exc:
                reason = self._record_failed(pending, op, (value, keep), exc)
                if not isinstance(exc, Exception):
                    raise  # Ctrl-C stays itself; the group is aborted all the same
                raise CollectiveError(self.rank, op, self.size, reason, device) from exc
            pending.record = record
            pending.keep = (value, keep)
            with self._lock:
                self._calling = None
                aborted = self._aborted
                if aborted is None:
                    self._pending.append(pending)
            if aborted is not None:
                self._abort_late(pending, aborted)
        return set_future(value, (record,), KEPT_BY_PRODUCER)

    def _stream_handle(self) -> int:
        """The communication stream's handle, read once (at the first call:
        a group made for a test may have a stream object without one)."""
        stream = self._stream_ptr
        if stream is None:
            stream = self._stream_ptr = int(self.stream.ptr)
        return stream

    def _abort_late(self, pending: _Pending, reason: str) -> None:
        """NCCL took the call while another thread aborted the group (the
        watchdog, past the call's deadline; destroy(), a call still inside
        NCCL): that abort failed the entries it saw, not this one. Fail it
        as they were, and keep its arrays past a fence recorded after its
        kernel, as abort() keeps theirs: appended to the group's entries it
        would stay there (abort() runs once; destroy() has let the group go),
        with its arrays, and its future would fail only if its event ends."""
        self._fail_entries([pending], reason)

    def _fail_entries(self, entries: list[_Pending], reason: str) -> None:
        """Fail ``entries`` (taken out of the group) from the host with
        ``reason``, keep their arrays past a fence (their kernels may run
        until the abort ends them), and let go of them."""
        for p in entries:
            p.fail(CollectiveError(self.rank, p.op, self.size, reason, self.device))
        self._keep_past([p.keep for p in entries if p.keep is not None])
        for p in entries:
            p.forget()

    def _record_failed(self, pending: _Pending, op: str, keep: object, exc: BaseException) -> str:
        """NCCL took the call but no event could follow it: nothing can say
        when its kernel ends, so its arrays are never freed (a kernel may
        still read or write them), and the group is aborted (its later
        calls raise; NCCL's abort ends the kernel)."""
        _lifetimes.keep_forever(keep)
        with self._lock:
            if self._calling is pending:
                self._calling = None
        reason = f"no event could be recorded after NCCL took {op} ({type(exc).__name__}: {exc})"
        self.abort(reason)
        return reason

    def busy(self) -> bool:
        """Whether a collective is pending or being enqueued (read under the
        group's lock: an enqueue appends its entry and clears ``_calling``
        under it, so no read falls between the two)."""
        with self._lock:
            return bool(self._pending) or self._calling is not None

    def _raise_if_aborted(self, op: str) -> None:
        if self._aborted is not None:
            raise CollectiveError(
                self.rank,
                op,
                self.size,
                f"the group's communicator was aborted earlier ({self._aborted}); "
                "restart the processes, or make a new group",
                self.device,
            )

    def _async_error(self) -> str | None:
        if self._aborted is not None:
            return self._aborted
        try:
            self._comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - NCCL's error, reported in the futures
            return f"NCCL reported an error: {exc}"
        return None

    def confirm(self, op: str, trusted_until: float) -> CollectiveError | None:
        # A collective's event also completes when an abort ended its kernel
        # early: ours, NCCL's own, or a peer's (on one node a peer's abort
        # can end this rank's kernel with no error reported here: seen on 4
        # H200s, one run in five). So it succeeded only if NCCL reports no
        # error and it did not end in the last part of its timeout, when the
        # peers' watchdogs abort. One ncclCommGetAsyncError per collective.
        reason = self._async_error()
        if reason is None and time.monotonic() > trusted_until:
            reason = (
                f"{op} ended within the last {_DOUBT:.0%} of its timeout, when peers abort "
                "theirs: its data cannot be trusted (a peer may have died, hung, or not called it)"
            )
        if reason is None:
            return None
        self.abort(reason)
        return CollectiveError(self.rank, op, self.size, reason, self.device)

    def check(self, now: float) -> bool:
        """The watchdog's look: drop what completed, fail the group on an
        NCCL error or a deadline passed. Returns whether work is pending."""
        with self._lock:
            items = list(self._pending)
            calling = self._calling
        # Queried outside the lock: a query may abort the group (confirm).
        done = 0
        for p in items:
            if p.query() is None:
                break
            done += 1
        with self._lock:
            # Only what this look saw complete: another thread's check()
            # (destroy()) may have popped some already, abort() all.
            pending = self._pending
            popped = []
            for p in items[:done]:
                if pending and pending[0] is p:
                    pending.popleft()
                    popped.append(p)
        # Only what this look popped: an entry an abort took meanwhile (its
        # record failed from the host, so "done" here while its kernel may
        # still run) is that abort's to keep past its fence.
        for p in popped:
            p.forget()
        items = items[done:]
        if not items and calling is None:
            return False
        late = next((p for p in items if now > p.deadline), None)
        if late is None and calling is not None and now > calling.deadline:
            late = calling
        reason = self._async_error()
        if reason is None and late is not None:
            reason = (
                f"{late.op} did not complete within its timeout of {late.timeout:g} s: "
                "a peer may have died, hung, or not called it"
            )
        if reason is not None:
            self.abort(reason)
            return False
        return True

    def abort(self, reason: str) -> None:
        """Fail every pending collective of the group with
        :class:`CollectiveError` and abort its communicator (in a daemon
        thread: ``ncclCommAbort`` can hang). Later calls raise at once.

        The failed collectives' arrays are kept until the communication
        stream passes an event recorded now (their kernels may run until
        the abort ends them): one event record on the host, no wait."""
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = reason
            failed = list(self._pending)
            self._pending.clear()
        self._fail_entries(failed, reason)
        logger.error("cudafut.distributed: %s; aborting the communicator of %r", reason, self)
        threading.Thread(target=_abort, args=(self._comm,), name="cudafut-nccl-abort", daemon=True).start()

    def _keep_past(self, keeps: list[object]) -> None:
        """Keep ``keeps`` (what failed collectives read and write) until the
        communication stream passes a fence recorded now, after their
        kernels: their own records, failed from the host, no longer tell
        when those end. Where no fence can be recorded, kept for ever."""
        if not keeps:
            return
        try:
            stream = self._stream_handle()
            with _backend.current.on_device(self.device):
                fence = _events.record(stream, self.device)
        except Exception as exc:  # noqa: BLE001 - CUDA broken, or no stream: never freed then
            logger.warning(
                "cudafut.distributed: no event could be recorded after the aborted collectives of %r "
                "(%s); their arrays are never freed",
                self,
                exc,
            )
            _lifetimes.keep_forever(keeps)
            return
        _lifetimes.hold((fence,), keeps)

    def destroy(self) -> None:
        """Wait for the group's work (up to its timeout) and free the communicator.

        Blocks the calling thread up to the group's timeout (then, for a
        communicator still busy, as long as ``ncclCommDestroy`` waits for
        its work). A call of another thread still inside NCCL when the
        timeout runs out is ended by an abort instead: the communicator is
        never freed under a call. One that holds the group only for its few
        µs of bookkeeping around NCCL then is waited for."""
        if self._aborted is None:
            deadline = time.monotonic() + self.timeout
            while self.check(time.monotonic()) and time.monotonic() < deadline:
                time.sleep(WATCH_EVERY_S)
            # Held while the communicator is freed: no call enters NCCL then,
            # and a call waiting for it sees the group destroyed.
            got = self._call_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))
            while not got and self._calling is None:
                # The lock's holder is not inside NCCL (its few µs of
                # bookkeeping around a call): wait for it, rather than abort
                # a group whose call may succeed.
                got = self._call_lock.acquire(timeout=WATCH_EVERY_S)
            try:
                if not got:
                    self.abort(
                        "the group was destroyed while a call was still inside NCCL "
                        f"after the group's timeout ({self.timeout:g} s)"
                    )
                elif self._aborted is None:
                    with self._lock:
                        self._aborted = "the group was destroyed"
                    with _backend.current.on_device(self.device):
                        self._comm.destroy()
            finally:
                if got:
                    self._call_lock.release()
        _watchdog.forget(self)
        # Still pending past the timeout: nothing looks at these entries
        # again, so what their collectives read and write goes to the
        # lifetimes' watcher, which keeps it until the records end (as a
        # dropped future's finalizer would have); the entries go.
        with self._lock:
            left = list(self._pending)
            self._pending.clear()
        for p in left:
            if p.record is not None and p.keep is not None:
                _lifetimes.hold((p.record,), p.keep)
            p.forget()


def _abort(comm: Any) -> None:
    try:
        comm.abort()
    except Exception as exc:  # noqa: BLE001 - reported; nothing more to do
        logger.error("cudafut.distributed: ncclCommAbort failed: %s", exc)


class _Watchdog:
    """One daemon thread per process, awake only while collectives are pending."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: The groups watched now: changed under the lock only; read it, never change it.
        self.watched: set[ProcessGroup] = set()
        self._thread: threading.Thread | None = None

    def watch(self, group: ProcessGroup) -> None:
        """Watch ``group``, which has work pending (or being enqueued).

        A caller that marked ``group`` busy first (``_calling`` or
        ``_pending``) may skip the call when ``group`` is in
        :attr:`watched`, read without the lock: the thread drops a group
        from it first and then asks whether it is busy, putting it back if
        so (see ``_run``)."""
        with self._cond:
            if group in self.watched:
                return
            self.watched.add(group)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cudafut-nccl-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, group: ProcessGroup) -> None:
        with self._cond:
            self.watched.discard(group)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.watched:
                    self._cond.wait()
                groups = list(self.watched)
            now = time.monotonic()
            idle = [g for g in groups if not self._check(g, now)]
            with self._cond:
                # Dropped first, then looked at again: a call marks its group
                # busy first, then reads `watched` (unlocked) to skip watch();
                # so either it sees the group gone and watches it again, or
                # the group is seen busy here and stays.
                for g in idle:
                    self.watched.discard(g)
                    if g.busy():
                        self.watched.add(g)
            time.sleep(WATCH_EVERY_S)

    @staticmethod
    def _check(group: ProcessGroup, now: float) -> bool:
        # The thread must outlive any error: without it, nothing times out.
        try:
            return group.check(now)
        except Exception as exc:  # noqa: BLE001 - reported; the group is failed, not forgotten
            group.abort(f"the watchdog could not check the group: {exc!r}")
            return False


_watchdog: Final = _Watchdog()


# -- the world and its groups ------------------------------------------------------


class _World:
    def __init__(self, group: ProcessGroup, store: Store | None, rank: int, size: int) -> None:
        self.group = group
        self.store = store
        self.rank = rank
        self.size = size
        self.groups: list[ProcessGroup] = [group]
        self.next_index = 1


_world: _World | None = None
_world_lock: Final = threading.Lock()


def _left_seconds(deadline: float) -> float:
    """The timeout of a store's call that must end just after ``deadline``
    (never zero: torch reads a zero timeout as none)."""
    return max(deadline - time.monotonic(), 0.0) + _STORE_SLACK_S


def _make_store(rank: int, size: int, timeout: float, deadline: float) -> Store:
    """The default store, made by ``deadline``; ``timeout`` is its calls'."""
    addr, port = _env.store_address()
    tcp_store = _torch.tcp_store_type()
    if tcp_store is None:
        return _nccl.CupyxStore(rank, size, addr, port, timeout)
    # Under torchrun the agent hosts a store on MASTER_PORT already: every
    # rank is a client then (a second server on that port would fail).
    host = rank == 0 and not _env.agent_store()
    # Made (connected, the workers waited for) within the time left, so that
    # its thread leaves torch's C++ code by itself (see _bounded).
    store = tcp_store(addr, port, size, host, timedelta(seconds=_left_seconds(deadline)))
    store.set_timeout(timedelta(seconds=timeout))
    return store  # type: ignore[no-any-return]


def _has_wait(store: object) -> bool:
    """Whether ``store`` has ``wait(keys, timeout)``: a
    ``torch.distributed.Store`` (torch imported already) or cupyx's."""
    if isinstance(store, _nccl.CupyxStore):
        return True
    cls = _torch.store_type()
    return cls is not None and isinstance(store, cls)


_left_lock: Final = threading.Lock()
#: Threads left inside a store by a call that gave up: (thread, when its
#: store's own timeout has surely ended its call).
_left: list[tuple[threading.Thread, float]] = []


def _leave(thread: threading.Thread, until: float) -> None:
    with _left_lock:
        if not _left:
            atexit.register(_join_left)  # at most once: nothing is left then
        _left.append((thread, until))


def _join_left() -> None:
    """At exit, after the non-daemon threads and before the interpreter
    finalizes: wait (each until its ``until``) for the threads left inside
    a store. A daemon thread that comes back from C++ (torch's ``TCPStore``)
    into Python while the interpreter finalizes is ended by it, which can
    abort the whole process ("terminate called without an active
    exception", SIGABRT) whatever status the script exits with."""
    with _left_lock:
        left = list(_left)
        _left.clear()
    for thread, until in left:
        thread.join(max(0.0, until - time.monotonic()))


def _bounded(
    fn: Callable[[], Any], deadline: float, name: str, *, ends_by: float | None = None
) -> tuple[bool, Any]:
    """Run ``fn()`` in a daemon thread until ``deadline`` (``time.monotonic``);
    ``(True, its result)``, ``(True, the exception it raised)``, or
    ``(False, None)`` when the deadline came first.

    ``ends_by``: when ``fn`` returns by itself (its store's calls were
    given that deadline), if known. Past ``deadline``, such a thread is
    waited for up to :data:`STORE_GRACE_S` more, so that it is out of the
    store before the caller raises; if it is not, it is waited for at exit
    (up to :data:`EXIT_GRACE_S` past ``ends_by``). Any other call that never
    returns (NCCL, a store of the user's with no timeout) is left to its
    thread, a daemon: it never holds up the exit."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if result:
        return True, result[0]
    if ends_by is not None:
        thread.join(max(0.0, ends_by + STORE_GRACE_S - time.monotonic()))
        if thread.is_alive():
            _leave(thread, ends_by + EXIT_GRACE_S)
    return False, None


def _communicator(
    size: int, uid: bytes, rank: int, device: int, timeout: float, what: str, deadline: float
) -> Any:
    """``ncclCommInitRank`` in a thread, so that a peer that never comes
    fails the call at ``deadline`` (``time.monotonic``; the start-up's
    ``timeout`` runs out then) instead of hanging it."""
    _nccl.check_available()

    def init() -> _nccl.Communicator:
        with _backend.current.on_device(device):
            return _nccl.communicator(size, uid, rank)

    done, comm = _bounded(init, deadline, "cudafut-nccl-init")
    if not done:
        raise CollectiveError(
            rank,
            what,
            size,
            f"not every rank joined within {timeout:g} s (is every process started?)",
            device,
        )
    if isinstance(comm, BaseException):
        raise CollectiveError(rank, what, size, f"NCCL could not make the communicator: {comm}", device)
    return comm


def check_store(store: object) -> None:
    """Refuse, before anything waits, a ``store=`` without ``set`` and ``get``.

    Raises:
        TypeError: ``store`` lacks a callable ``set`` or ``get``.
    """
    missing = [name for name in ("set", "get") if not callable(getattr(store, name, None))]
    if missing:
        raise TypeError(
            f"store must have set(key, value) and get(key) methods (a key-value store such as "
            f"torch.distributed.TCPStore); {type(store).__name__} has no {' or '.join(missing)}()"
        )


def _rendezvous(
    store: Store | None,
    key: str,
    leader: bool,
    *,
    make_store: Callable[[], Store] | None = None,
    deadline: float,
    timeout: float,
    rank: int,
    size: int,
    device: int,
    what: str,
) -> tuple[bytes, Store | None]:
    """The leader's NCCL id, through the store (made first by
    ``make_store`` when given); ``(id, store)``. The store's calls run in a
    thread bounded by ``deadline`` (``timeout`` is what the message says):
    a store that never answers, or nobody listening at its address, is a
    :class:`CollectiveError` in time."""
    _nccl.check_available()
    if store is None and make_store is None:  # one rank
        return _nccl.unique_id(), None
    uid = _nccl.unique_id() if leader else b""

    def exchange() -> tuple[bytes, Store]:
        s = make_store() if make_store is not None else store
        assert s is not None
        if leader:
            s.set(key, uid)
            return uid, s
        if _has_wait(s):
            # Its get() waits up to the store's own timeout: wait() is told
            # the time left instead, so that the thread leaves it in time.
            s.wait([key], timedelta(seconds=_left_seconds(deadline)))  # type: ignore[attr-defined]
        return bytes(s.get(key)), s

    # A store made here, or torch's, returns by the deadline by itself.
    bounded = make_store is not None or _has_wait(store)
    ends_by = deadline + _STORE_SLACK_S if bounded else None
    done, result = _bounded(exchange, deadline, "cudafut-store", ends_by=ends_by)
    if not done:
        if make_store is not None:
            addr, port = _env.store_address()
            why = (
                f"the store at {addr}:{port} (MASTER_ADDR:MASTER_PORT) did not answer within "
                f"{timeout:g} s: is rank 0 started, and that address reachable from here?"
            )
        else:
            why = (
                f"the store given (store=) did not answer within {timeout:g} s: its get() must "
                "return once the leader's set() of the key is done"
            )
        raise CollectiveError(rank, what, size, why, device)
    if isinstance(result, BaseException):
        raise CollectiveError(
            rank, what, size, f"the store failed: {type(result).__name__}: {result}", device
        ) from result
    return result  # type: ignore[no-any-return]


def init_process_group(
    backend: str = "nccl",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: Store | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    device: int | None = None,
) -> ProcessGroup:
    """Join the world: make the NCCL communicator of all ranks.

    Every process calls it once. ``rank`` and ``world_size`` default to the
    launcher's variables (torchrun: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``; mpirun: ``OMPI_COMM_WORLD_*``); with none, the world is
    this process alone (rank 0 of 1), which needs no store. The ranks meet
    through ``store``, by default a ``torch.distributed.TCPStore`` at
    ``MASTER_ADDR:MASTER_PORT`` (127.0.0.1:29500) hosted by rank 0 when
    torch is installed, else cupyx.distributed's store. ``device`` defaults
    to the local rank modulo the device count, and becomes the thread's
    current CuPy device.

    Blocks the calling thread until every rank has joined, at most
    ``timeout`` seconds in all, the store's calls included (a store that
    never answers, or nobody listening at its address, fails the call when
    the timeout runs out); ``timeout`` is also the default timeout of every
    collective of the world. The store's calls run in a thread and are
    given the same deadline (the default store's own timeout, ``wait()`` on
    a torch store): when it runs out, the call waits up to 2 s more for
    that thread to leave the store before it raises (torch's ``TCPStore``
    overshoots its timeout by a retry delay), and the exit waits for one
    still inside, so that no thread comes back from torch's C++ code as
    the interpreter ends (which aborts the process). Only a store of yours
    that is not torch's and never answers is left to a daemon thread.

    Raises:
        TypeError: ``store`` without callable ``set`` and ``get``, or a
            timeout that is not a number (checked before anything waits).
        ValueError: an unknown backend, inconsistent ranks, a bad timeout,
            or a world already initialised.
        CollectiveError: not every rank joined within ``timeout`` (the
            store did not answer, or a peer never came), the store failed,
            or NCCL could not make the communicator.
        CudaUnavailableError: no usable GPU or no NCCL.
    """
    global _world
    if backend != "nccl":
        raise ValueError(f"cudafut.distributed supports the 'nccl' backend only, not {backend!r}")
    limit = check_timeout(timeout)
    if store is not None:
        check_store(store)
    r, n, local = _env.launch_env(rank, world_size)
    _cuda.check_usable()
    count = _backend.current.device_count()
    dev = _cuda.check_device(local % count if device is None and local is not None else (device or 0))
    with _world_lock:
        if _world is not None:
            raise ValueError("the process group is initialised already; call destroy_process_group() first")
        deadline = time.monotonic() + limit
        _backend.current.use_device(dev)
        make = None
        if n > 1 and store is None:
            make = functools.partial(_make_store, r, n, limit, deadline)
        uid, store = _rendezvous(
            store if n > 1 else None,
            _env.key("group/0/uid"),
            leader=r == 0,
            make_store=make,
            deadline=deadline,
            timeout=limit,
            rank=r,
            size=n,
            device=dev,
            what="init_process_group",
        )
        comm = _communicator(n, uid, r, dev, limit, "init_process_group", deadline)
        group = ProcessGroup(comm, r, range(n), dev, limit, "world")
        _world = _World(group, store, r, n)
        return group


def _require_world() -> _World:
    world = _world
    if world is None:
        raise RuntimeError(
            "cudafut.distributed is not initialised: call cudafut.distributed.init_process_group() first"
        )
    return world


def resolve(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the world's group."""
    if group is None:
        return _require_world().group
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, not {group!r}")
    return group


def new_group(ranks: Iterable[int], *, timeout: float | None = None) -> ProcessGroup | None:
    """A group of some ranks of the world, with its own communicator.

    Every rank of the world calls it, with the same ranks, in the same order
    as its other ``new_group`` calls; members get the group, other ranks
    None. Blocks until the members joined (at most ``timeout``, by default
    the world's).

    Repeated ranks count once; the group's ranks are ordered by world rank.

    Raises:
        ValueError: ranks out of the world, or none.
        CollectiveError: a member did not join in time.
    """
    world = _require_world()
    members = sorted({int(r) for r in ranks})
    if not members:
        raise ValueError("new_group() needs at least one rank")
    if members[0] < 0 or members[-1] >= world.size:
        raise ValueError(f"ranks must be in [0, {world.size}), got {members}")
    limit = world.group.timeout if timeout is None else check_timeout(timeout)
    with _world_lock:
        index = world.next_index
        world.next_index += 1
    if world.rank not in members:
        return None
    me = members.index(world.rank)
    dev = world.group.device
    key = _env.key(f"group/{index}/uid")
    deadline = time.monotonic() + limit
    uid, _ = _rendezvous(
        world.store if len(members) > 1 else None,
        key,
        leader=me == 0,
        deadline=deadline,
        timeout=limit,
        rank=me,
        size=len(members),
        device=dev,
        what="new_group",
    )
    comm = _communicator(len(members), uid, me, dev, limit, "new_group", deadline)
    group = ProcessGroup(comm, me, members, dev, limit, f"group {index} {members}")
    world.groups.append(group)
    return group


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Free a group's communicator (waiting for its work, up to its
    timeout), or, with no argument, every group and the world.

    Blocks the calling thread up to each group's timeout. A call of another
    thread still inside NCCL then is ended by an abort instead (the
    communicator is never freed under a call): the group's pending futures
    fail with :class:`CollectiveError`."""
    global _world
    if group is not None:
        resolve(group).destroy()
        return
    with _world_lock:
        world, _world = _world, None
    if world is None:
        return
    errors = []
    for g in reversed(world.groups):
        try:
            g.destroy()
        except Exception as exc:  # noqa: BLE001 - the others are destroyed too; raised after
            errors.append(exc)
    if errors:
        raise errors[0]


def is_initialized() -> bool:
    """Whether :func:`init_process_group` was called (and not undone)."""
    return _world is not None


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return resolve(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    return resolve(group).size
