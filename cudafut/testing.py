"""Test code that uses cudafut on a machine without CUDA: a fake GPU.

:func:`fake_cuda` replaces cudafut's backend to CUDA (``cudafut._backend``)
with a fake GPU until the ``with`` block ends. Under it:

- values are NumPy arrays (and any other host value), taken to live on the
  fake's current device (0 unless changed): ``cudafut.record(np_array)``,
  ``CudaFuture().set_result(42)``, ``CudaFuture(devices=1)`` work;
- events complete when the test says so (:meth:`FakeCuda.complete`,
  :meth:`FakeCuda.complete_all`, :meth:`FakeCuda.fail`), or at once with
  ``auto_complete=True``;
- ``await``, :meth:`~cudafut.CudaFuture.then`, :meth:`~cudafut.CudaFuture.result`,
  :meth:`~cudafut.CudaFuture.wait`, ``add_done_callback``, :func:`cudafut.gather`,
  :func:`cudafut.as_completed`, :func:`cudafut.submit`, :func:`cudafut.launch`,
  :func:`cudafut.to_device` and :func:`cudafut.to_host` (NumPy in, NumPy out)
  run cudafut's own code, as on a GPU: the waiter polls the fake's events on
  asyncio, uvloop and trio, ``then()`` callbacks run on fake pool streams.

The fake keeps the order a GPU guarantees, and no more: an event completes
only after the earlier events of its stream and the events its stream was
made to wait for (completing a ``then()`` child completes its parent), but
nothing runs: no kernel, no copy engine, no timing. Work your callbacks
enqueue with CuPy is not faked (CuPy is never imported; CuPy refusing the
NumPy array a callback got is a :class:`TypeError` that says so, and so is
CuPy failing in a callback for want of CUDA, on a machine without a
driver, before it looks at the array). Calls that
need CuPy's runtime (pinned memory, :func:`cudafut.own_stream`,
``cudafut.distributed``) raise :class:`cudafut.CudaUnavailableError`; calls
that take GPU memory only (:class:`cudafut.Tracked`,
:func:`cudafut.record_stream`, :func:`cudafut.graphed`) refuse NumPy arrays
with :class:`TypeError`. :func:`cudafut.task_stream` gives each task a fake
stream of its own (to pass as ``stream=``), and
:func:`cudafut.use_task_streams` changes nothing: no step runs on a stream
of its own. See docs/testing.md.

The pytest fixture ``fake_cuda`` (registered by installing cudafut) gives a
:class:`FakeCuda` for one test. Importing this module imports neither CuPy
nor pytest.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from . import _backend, _checks, _cuda, _pools
from ._errors import CudaError, CudaUnavailableError
from ._events import FAILED
from ._future import CudaFuture
from ._interface import records_of, when_set
from ._log import logger

__all__ = ["FakeCuda", "FakeStream", "fake_cuda"]

NOT_READY: Final = 600

#: Names of the CUDA errors a test is likely to fail an event with.
_ERROR_NAMES: Final = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    701: ("cudaErrorLaunchOutOfResources", "too many resources requested for launch"),
    702: ("cudaErrorLaunchTimeout", "the launch timed out and was terminated"),
    709: ("cudaErrorContextIsDestroyed", "context is destroyed"),
    710: ("cudaErrorAssert", "device-side assert triggered"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
    999: ("cudaErrorUnknown", "unknown error"),
}

_NO_IPC = (
    "cudafut.testing's fake GPU cannot share GPU memory or events between processes: "
    "under the fake, a future crosses processes only once its work is complete and its "
    "value holds no GPU array (docs/processes.md). Test the crossing itself on a GPU"
)
_NOT_MODELLED = (
    "this call needs CuPy's CUDA runtime, which cudafut.testing's fake CUDA does not have: "
    "it fakes events, streams and NumPy values only (pinned memory, @own_stream and "
    "cudafut.distributed are not faked; task_stream() gives a task a fake stream to pass as "
    "stream=; see docs/testing.md). Test this part on a GPU"
)


#: When a fake has ended: for the errors of what is used after it.
_ENDED_WHEN = (
    "(its `with cudafut.testing.fake_cuda()` block, or the test that took the fake_cuda fixture, is over)"
)
_ENDED_FUTURE = (
    f"this future was made under cudafut.testing's fake GPU, which has ended {_ENDED_WHEN}: the "
    "fake's futures and streams cannot be used after it, with real CUDA or another fake. Use them "
    "inside the block (or the test)"
)


_CUPY_ON_NUMPY = (
    "a callback called CuPy on a NumPy array: under cudafut.testing's fake GPU, values are NumPy "
    "arrays, and so are the arrays handed to then(), submit() and launch() callbacks, which CuPy's "
    "functions cannot take. Write the code under test so that it takes the array module (numpy in "
    "tests, cupy in production), or test this part on a GPU (docs/testing.md)"
)


def _cupy_refused_numpy(exc: TypeError) -> bool:
    """Whether ``exc`` is CuPy refusing a NumPy array ("expected
    cupy._core.core._ndarray_base, got numpy.ndarray", "must be a
    cupy.ndarray object", a ufunc's "Unsupported type")."""
    text = str(exc)
    if "numpy.ndarray" not in text:
        return False
    if "cupy" in text:
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "cupy" in tb.tb_frame.f_code.co_filename


#: CUDA's statuses (runtime and driver API alike) for "no usable CUDA here":
#: not initialised, insufficient driver, no device, driver mismatch, a
#: compat package the device does not take.
_NO_CUDA_STATUSES: Final = frozenset({3, 35, 100, 803, 804})

_CUPY_WITHOUT_CUDA = (
    "a callback called CuPy, which needs CUDA, and CUDA cannot be used on this machine ({error}). "
    "cudafut.testing's fake GPU does not fake CuPy: under it, values are NumPy arrays, and so are "
    "the arrays handed to then(), submit() and launch() callbacks (on a machine with a GPU, CuPy "
    "refuses them with a TypeError as this does). Write the code under test so that it takes the "
    "array module (numpy in tests, cupy in production), or test this part on a GPU (docs/testing.md)"
)


def _cupy_without_cuda(exc: Exception) -> bool:
    """Whether ``exc`` is CuPy's error for a machine without usable CUDA
    (``cudaErrorInsufficientDriver`` where no driver is installed): CuPy
    raises it, before it looks at the arguments' types, from most functions
    (``cp.sqrt``, ``cp.tanh``, ``cp.asarray``, ``cp.zeros``). Told by the
    class's module and its status, without importing CuPy."""
    if not type(exc).__module__.startswith(("cupy_backends.", "cupy.")):
        return False
    return getattr(exc, "status", None) in _NO_CUDA_STATUSES


#: The hint a wait on work the fake keeps pending gives (once per fake).
_STILL_PENDING = (
    "cudafut.testing: a future has waited %.3g s on the fake GPU, whose work completes only when "
    "the test says so: set `fake_cuda.auto_complete = True` (or `fake_cuda(auto_complete=True)`), "
    'or call `fake.complete(future)` or `fake.complete_all()` (docs/testing.md, "Completing work '
    'when the test says")'
)


def _fake_error(code: int, device: int) -> CudaError:
    name, description = _ERROR_NAMES.get(code, ("", ""))
    return CudaError(code, name, description, device=device)


class _Event:
    """One recorded event of the fake GPU."""

    __slots__ = ("deps", "number", "status")

    def __init__(self, number: int, deps: tuple[_Event, ...]) -> None:
        self.number = number  # recording order: deps are always older
        self.deps = deps  # what must complete first (cleared once complete)
        self.status: int | None = None


class FakeStream:
    """A stream of the fake GPU: what cudafut's pools, ``then()``, ``submit()``
    and ``launch()`` use under :func:`fake_cuda`; make one with
    :meth:`FakeCuda.stream` to pass as ``stream=``.

    Like a CuPy stream it has ``ptr`` (its handle: the object's address, so
    it is never another stream's), ``device_id`` and ``__cuda_stream__``,
    and ``with stream:`` makes it the calling thread's current stream of its
    device.
    """

    __slots__ = ("__weakref__", "_backend", "device_id", "priority", "ptr")

    def __init__(self, backend: _Backend, device: int, priority: int, ptr: int | None = None) -> None:
        self._backend = backend
        self.device_id = device
        self.priority = priority
        self.ptr = id(self) if ptr is None else ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)

    def __enter__(self) -> FakeStream:
        self._backend.push(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._backend.pop(self)

    def __repr__(self) -> str:
        return f"<FakeStream {self.ptr:#x} device={self.device_id}>"


class _Backend:
    """The fake GPU's state and its implementation of the backend interface
    (``cudafut._backend.Backend``: ``_backend.current`` while installed)."""

    #: The fake's stream type, whose ``ptr`` and ``device_id`` are its
    #: handle and device (``stream_types``, see ``cudafut._backend.Backend``).
    stream_types = (FakeStream,)

    def __init__(self, devices: int, auto_complete: bool, hint_after_s: float = math.inf) -> None:
        self.devices = devices
        self.auto_complete = auto_complete
        #: After how long pending a waited-on event logs the hint; whether it has.
        self.hint_after_s = hint_after_s
        self.hinted = False
        self.active = True
        #: The event pool made for the fake (by cudafut._pools), once installed.
        self.pool: Any = None
        # Re-entrant: finalizers the garbage collector runs (an event record's,
        # a cudafut-allocated block's) record and release events on the fake,
        # possibly on a thread inside one of its methods.
        self._lock = threading.RLock()
        # Notified whenever events settle: event_synchronize() waits on it.
        self._settled = threading.Condition(self._lock)
        self._local = threading.local()
        self._numbers = itertools.count()
        self._handles = itertools.count(-1, -1)  # negative: never a real event's
        # handle -> the event it was last recorded as (a handle is pooled:
        # one entry per handle the fake made), and when a wait first found
        # it pending (monotonic; for the hint).
        self._recorded: dict[int, _Event] = {}
        self._asked: dict[int, float] = {}
        # (device, stream handle) -> [newest event, events it waits for since].
        self._streams: dict[tuple[int, int], list[Any]] = {}
        self._pending: dict[int, _Event] = {}  # by number
        self._defaults = [FakeStream(self, d, 0) for d in range(devices)]
        self._made: dict[int, FakeStream] = {s.ptr: s for s in self._defaults}
        # Notices (close_after): file descriptors to close when their event
        # completes; and those of failed events, which CUDA never closes.
        self._notices: list[tuple[_Event, int]] = []
        self._unclosed: list[int] = []

    # -- the backend interface (cudafut._backend.SEAM) --

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        device: int = getattr(self._local, "device", 0)
        return device

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        previous = self.current_device()
        self._local.device = device
        try:
            yield
        finally:
            self._local.device = previous

    def _stacks(self) -> dict[int, list[FakeStream]]:
        stacks: dict[int, list[FakeStream]] | None = getattr(self._local, "stacks", None)
        if stacks is None:
            stacks = self._local.stacks = {}
        return stacks

    def push(self, stream: FakeStream) -> None:
        self._stacks().setdefault(stream.device_id, []).append(stream)

    def pop(self, stream: FakeStream) -> None:
        stack = self._stacks().get(stream.device_id)
        if stack and stack[-1] is stream:
            stack.pop()

    def current_stream(self, device: int) -> FakeStream:
        stack = self._stacks().get(device)
        if stack:
            return stack[-1]
        if not 0 <= device < self.devices:
            raise ValueError(f"the fake GPU has {self.devices} device(s), not a device {device}")
        return self._defaults[device]

    def new_stream(self, device: int, priority: int) -> FakeStream:
        stream = FakeStream(self, device, priority)
        with self._lock:
            self._made[stream.ptr] = stream
        return stream

    def cupy_stream(self, stream: object, ptr: int, device: int) -> FakeStream:
        if isinstance(stream, FakeStream):
            return stream
        return FakeStream(self, device, 0, ptr)  # non-owning, as CuPy's from_external

    def call_on_streams(
        self, streams: Mapping[int, Any], primary: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        entered = []
        try:
            for stream in streams.values():
                stream.__enter__()
                entered.append(stream)
            with self.on_device(primary):
                try:
                    return fn(*args, **kwargs)
                except TypeError as exc:
                    if _cupy_refused_numpy(exc):
                        raise TypeError(_CUPY_ON_NUMPY) from exc
                    raise
                except Exception as exc:
                    # The same TypeError on a machine without a driver as on
                    # one with a GPU, where CuPy refuses the NumPy array: a
                    # test's outcome must not depend on the CI machine.
                    if _cupy_without_cuda(exc):
                        raise TypeError(_CUPY_WITHOUT_CUDA.format(error=exc)) from exc
                    raise
        finally:
            for stream in reversed(entered):
                stream.__exit__(None, None, None)

    def event_create(self, device: int) -> int:
        return next(self._handles)

    def event_destroy(self, event: int) -> None:
        pass

    def event_record(self, event: int, stream: int, device: int) -> None:
        with self._lock:
            state = self._streams.get((device, stream))
            if state is None:
                state = self._streams[(device, stream)] = [None, []]
            while True:
                newest, waits = state
                seen = len(waits)
                deps = tuple(e for e in (newest, *waits) if e is not None and e.status != 0)
                ev = _Event(next(self._numbers), deps)
                # A finalizer run by the collector in between (the lock is
                # re-entrant) may have recorded on this stream, or made it
                # wait: then again.
                if state[0] is newest and state[1] is waits and len(waits) == seen:
                    break
            if self.auto_complete:
                self._settle([ev, *self._closure(deps)], 0)
            else:
                self._pending[ev.number] = ev
            state[0], state[1] = ev, []
            self._recorded[event] = ev
            self._asked.pop(event, None)

    def stream_wait(self, stream: int, event: int, device: int) -> None:
        ev = self._recorded.get(event)
        if ev is not None:  # else an event of no fake record (a test's): nothing to order
            self.wait(stream, device, ev)

    # -- the calls of the interface that a record asks (cudafut._backend.Backend):
    # the fake's event records ask it, for as long as they live --

    def event_query(self, event: int) -> int:
        ev = self._recorded.get(event)
        if ev is None:  # recorded without event_record() (a test's): nothing to wait for
            return 0
        raw = ev.status
        if raw is None:
            if not self.hinted:  # still pending: hint past hint_after_s
                now = time.monotonic()
                since = self._asked.setdefault(event, now)
                if since != now:
                    self.still_pending(since, now)
            return _cuda.NOT_READY
        return raw

    def event_error(self, code: int, device: int) -> CudaError:
        return _fake_error(code, device)

    def ended(self) -> str | None:
        return None if self.active else _ENDED_FUTURE

    def event_of(self, handle: int) -> _Event | None:
        """The event ``handle`` was last recorded as (None: not by this fake)."""
        return self._recorded.get(handle)

    def notice_stream(self, device: int) -> int:
        return 0  # the fake's notices need no stream

    def prepare_notices(self, device: int, timeout: float) -> bool:
        return True  # nothing to make

    def close_after(self, record: Any, fd: int, stream: int) -> None:
        # As CUDA's host function: ``fd`` is closed when the record's event
        # completes (in the thread that completes it), never if it fails.
        ev = self._recorded.get(record.handle) if getattr(record, "calls", None) is self else None
        with self._lock:
            if ev is not None and ev.status is None:
                self._notices.append((ev, fd))
                return
            if ev is not None and ev.status:
                self._unclosed.append(fd)
                return
        os.close(fd)

    def _fire_notices(self) -> None:
        """Close the descriptors of the notices whose event is no longer
        pending (under the lock)."""
        if not self._notices:
            return
        waiting = []
        for ev, fd in self._notices:
            if ev.status is None:
                waiting.append((ev, fd))
            elif ev.status:
                self._unclosed.append(fd)
            else:
                os.close(fd)
        self._notices = waiting

    def close_notices(self) -> None:
        """The fake GPU is going: close every descriptor left to it (a
        process's exit does the same for CUDA's)."""
        with self._lock:
            fds = [fd for _ev, fd in self._notices] + self._unclosed
            self._notices, self._unclosed = [], []
        for fd in fds:
            os.close(fd)

    def stream_device(self, stream: int) -> int:
        made = self._made.get(stream)
        return self.current_device() if made is None else made.device_id

    def pointer_device(self, ptr: int) -> int:
        return self.current_device()

    def runtime(self) -> Any:
        raise CudaUnavailableError(_NOT_MODELLED)

    def initialise(self) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)  # so task streams stay off (own_stream says why)

    def current_stream_getter(self) -> Callable[[int], Any]:
        raise CudaUnavailableError(_NOT_MODELLED)

    def use_device(self, device: int) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)

    # Copies of NumPy values are made by cudafut._copies itself under the
    # fake (a NumPy copy and an event), so these raw calls are never reached.

    def memcpy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)

    def memcpy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)

    def event_synchronize(self, event: int) -> None:
        # As cudaEventSynchronize: block the calling thread (the GIL
        # released) until the event is no longer pending, here until the
        # test completes or fails it (or the fake ends, completing all).
        # Pending past hint_after_s, it logs the hint as a query does (a
        # Batcher's completion thread waits here).
        with self._settled:
            ev = self._recorded.get(event)
            since = time.monotonic()
            while ev is not None and ev.status is None:
                limit = self.hint_after_s
                if self.hinted or limit == math.inf:
                    self._settled.wait()
                elif not self._settled.wait(max(since + limit - time.monotonic(), 0.0)):
                    self.still_pending(since, time.monotonic())

    def stream_synchronize(self, stream: int) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)

    def pointer_is_pinned(self, ptr: int) -> bool:
        return False  # nothing is pinned under the fake

    # Pinned memory is not faked: the pool would keep a fake block for CUDA
    # after the fake is gone.

    def host_alloc(self, nbytes: int) -> int:
        raise CudaUnavailableError(_NOT_MODELLED)

    def free_host(self, ptr: int) -> None:
        raise CudaUnavailableError(_NOT_MODELLED)

    def cupy(self) -> Any:
        raise CudaUnavailableError(_NOT_MODELLED)

    # A future crossing processes needs CUDA's interprocess events and memory.
    def _no_ipc(self, *args: object) -> Any:
        raise CudaUnavailableError(_NO_IPC)

    ipc_event_create = ipc_open_event = ipc_memory_handle = ipc_open_memory = _no_ipc
    ipc_close_memory = device_bus_id = device_of_bus_id = device_synchronize = _no_ipc

    def initialised(self) -> bool:
        return False  # no GPU timing events (trace) under the fake

    def devices_of_host_value(self) -> tuple[int, ...]:
        return (self.current_device(),)

    # -- events --

    def wait(self, stream: int, device: int, ev: _Event) -> None:
        with self._lock:
            if ev.status is None:
                state = self._streams.get((device, stream))
                if state is None:
                    state = self._streams[(device, stream)] = [None, []]
                state[1].append(ev)

    def _closure(self, events: tuple[_Event, ...] | list[_Event]) -> list[_Event]:
        """``events`` and every pending event they depend on."""
        found: dict[int, _Event] = {}
        stack = list(events)
        while stack:
            ev = stack.pop()
            if ev.status is None and id(ev) not in found:
                found[id(ev)] = ev
                stack.extend(ev.deps)
        return list(found.values())

    def _settle(self, events: list[_Event], status: int) -> None:
        # Oldest first: an event never reads complete before what it follows.
        for ev in sorted(events, key=lambda e: e.number):
            if ev.status is None:
                code = status
                if not code:  # after a failed event: CUDA's errors are sticky
                    code = next((d.status for d in ev.deps if d.status), 0)
                ev.status = code
                ev.deps = ()
                self._pending.pop(ev.number, None)
        self._fire_notices()
        self._settled.notify_all()

    def complete(self, events: list[_Event]) -> None:
        with self._lock:
            self._settle(self._closure(events), 0)

    def fail(self, events: list[_Event], code: int) -> None:
        with self._lock:
            # Work runs in stream order: what the failing work follows runs
            # first (left pending, it would hold back a waiter that learns a
            # stream's completions in order, as on a GPU). Oldest first: work
            # between two failing records then completes after a failed one it
            # follows, and so fails (CUDA's errors are sticky: see _settle).
            pending = [e for e in events if e.status is None]
            failing = {id(e) for e in pending}
            for ev in sorted(self._closure(pending), key=lambda e: e.number):
                self._settle([ev], code if id(ev) in failing else 0)

    def complete_all(self) -> None:
        with self._lock:
            self._settle(list(self._pending.values()), 0)

    def pending(self) -> int:
        return len(self._pending)

    def still_pending(self, since: float, now: float) -> None:
        """A wait has found an event pending since ``since`` (monotonic):
        past ``hint_after_s``, log the hint, once for this fake."""
        waited = now - since
        if waited >= self.hint_after_s and not self.hinted:
            self.hinted = True
            logger.warning(_STILL_PENDING, waited)


def _events_of(backend: _Backend, future: object) -> list[_Event]:
    if not isinstance(future, CudaFuture):
        raise TypeError(f"expected a CudaFuture, not {type(future).__name__}")
    events = (backend.event_of(r.handle) for r in records_of(future) if r.calls is backend)
    return [ev for ev in events if ev is not None]


class FakeCuda:
    """The fake GPU installed by :func:`fake_cuda` (the ``fake_cuda`` fixture).

    Its methods may be called from any thread; none blocks (beyond a lock
    held for µs) and none needs an event loop.

    Attributes:
        auto_complete: whether events complete as they are recorded; may be
            changed at any time (events recorded before stay as they are).
        hint_after_s: after how long a wait on a still pending event logs
            the hint to complete the fake's work (see :func:`fake_cuda`).
    """

    def __init__(self, backend: _Backend) -> None:
        self._backend = backend

    @property
    def auto_complete(self) -> bool:
        """Whether events complete as they are recorded (settable)."""
        return self._backend.auto_complete

    @auto_complete.setter
    def auto_complete(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"auto_complete must be True or False, not {value!r}")
        self._backend.auto_complete = value

    @property
    def hint_after_s(self) -> float | None:
        """After how long a wait on a still pending event logs the hint to
        complete the fake's work (settable; ``None``: never; see
        :func:`fake_cuda`)."""
        value = self._backend.hint_after_s
        return None if value == math.inf else value

    @hint_after_s.setter
    def hint_after_s(self, value: float | None) -> None:
        self._backend.hint_after_s = _hint_after(value)

    @property
    def devices(self) -> int:
        """How many devices the fake GPU has (numbered from 0)."""
        return self._backend.devices

    @property
    def pending(self) -> int:
        """How many events are recorded and neither complete nor failed."""
        return self._backend.pending()

    def complete(self, *futures: CudaFuture[Any]) -> None:
        """Complete the GPU work of each future: its events, and every event
        they follow on the fake's streams (what a GPU would have finished
        first: completing a ``then()`` child completes its parent).

        A future not set yet (a :func:`cudafut.launch` whose ``fn`` has not
        returned, a ``then()`` child of a pending parent) is completed when it
        is set, in the thread that sets it. Awaiting tasks and
        ``result()`` see it at their next poll (within the wait policy's
        ``max_sleep_s``, 1 ms by default). A failed or cancelled future has
        no events: nothing to do.

        Raises:
            TypeError: an argument is not a :class:`cudafut.CudaFuture`.
            RuntimeError: the fake has ended (its ``fake_cuda()`` block is over).
        """
        self._check_active("complete()")
        self._act(futures, self._backend.complete)

    def fail(self, future: CudaFuture[Any], code: int = 700) -> None:
        """Fail the GPU work of ``future`` with the CUDA error ``code``
        (default 700, ``cudaErrorIllegalAddress``): its pending events
        report it, so consumers raise :class:`cudafut.CudaError` with that
        code, as for a kernel that faulted. The work it follows (earlier on
        its streams, and what they wait for) completes first, as on a GPU,
        where work runs in stream order. A future not set yet fails when it
        is set.

        Raises:
            TypeError: ``future`` is not a CudaFuture, or ``code`` not an int.
            ValueError: ``code`` is 0 (success) or 600 (``cudaErrorNotReady``,
                which means pending).
            RuntimeError: the fake has ended (its ``fake_cuda()`` block is over).
        """
        self._check_active("fail()")
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"code must be a CUDA error number (an int), not {code!r}")
        if code in (0, NOT_READY, FAILED):
            raise ValueError(f"code must be a CUDA error: not 0 (success), 600 (pending) or -1, not {code}")
        self._act((future,), lambda events: self._backend.fail(events, code))

    def complete_all(self) -> None:
        """Complete every event recorded so far (events recorded later are
        pending, unless :attr:`auto_complete` is on).

        Raises:
            RuntimeError: the fake has ended (its ``fake_cuda()`` block is over).
        """
        self._check_active("complete_all()")
        self._backend.complete_all()

    def stream(self, device: int = 0, *, priority: str = "normal") -> FakeStream:
        """A new stream of the fake GPU, to pass as ``stream=`` (to
        :func:`cudafut.record`, :func:`cudafut.to_device`, ...) or to make
        current with ``with stream:``.

        Raises:
            TypeError, ValueError: ``device`` is not a device of the fake;
                ``priority`` not ``"normal"`` or ``"high"``.
            RuntimeError: the fake has ended (its ``fake_cuda()`` block is over).
        """
        self._check_active("stream()")
        dev = _cuda.check_device(device)
        return self._backend.new_stream(dev, _pools.check_priority(priority))

    def _check_active(self, call: str) -> None:
        if not self._backend.active:
            raise RuntimeError(
                f"{call}: this fake GPU has ended {_ENDED_WHEN}, and every event it "
                "recorded completed then. Call it inside the block (or the test)"
            )

    def _act(self, futures: tuple[Any, ...], act: Callable[[list[_Event]], None]) -> None:
        backend = self._backend
        for future in futures:
            _events_of(backend, future)  # every TypeError before the first action
        for future in futures:

            def now(future: CudaFuture[Any] = future) -> None:
                act(_events_of(backend, future))

            when_set(future, now)

    def __repr__(self) -> str:
        mode = " auto_complete" if self.auto_complete else ""
        return f"<FakeCuda devices={self.devices} pending={self.pending}{mode}>"


def _hint_after(value: object) -> float:
    if value is None:
        return math.inf
    return _checks.timeout_seconds(value, "hint_after_s")


@contextlib.contextmanager
def fake_cuda(
    *, devices: int = 1, auto_complete: bool = False, hint_after_s: float | None = 5.0
) -> Iterator[FakeCuda]:
    """Run the block with a fake GPU in place of CUDA; yield its :class:`FakeCuda`.

    For the whole process (every thread) until the block ends; not
    re-entrant (one fake at a time). On exit every event still pending
    completes (a GPU finishes what was queued), cudafut's launcher threads
    of the fake end after their queued jobs, and cudafut's pools and
    launchers of real CUDA, if any, come back as they were. Objects made
    under the fake (futures, streams) must not be used with real CUDA, nor
    real ones under the fake.

    Args:
        devices: how many devices the fake GPU has (device 0 is current).
        auto_complete: events complete as they are recorded (see
            :attr:`FakeCuda.auto_complete`).
        hint_after_s: a wait (``await``, ``result()``, ...) that finds the
            same event still pending this many seconds after it first did
            logs a warning, once per fake, on the ``cudafut`` logger: it
            names ``auto_complete=True`` and :meth:`FakeCuda.complete_all`,
            which a test that hangs on the fake most likely lacks. Only a
            log: no test fails or waits less for it. ``None``: never.

    Raises:
        RuntimeError: a fake is installed already.
        TypeError, ValueError: ``devices`` is not an int from 1 to 64;
            ``hint_after_s`` is not a non-negative number of seconds or None.
    """
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise TypeError(f"devices must be an int, not {devices!r}")
    if not 1 <= devices <= 64:
        raise ValueError(f"devices must be from 1 to 64, not {devices}")
    if not isinstance(auto_complete, bool):
        raise TypeError(f"auto_complete must be True or False, not {auto_complete!r}")
    backend = _Backend(devices, auto_complete, _hint_after(hint_after_s))
    restore = _backend.swap(backend)
    backend.pool = _pools.events
    try:
        yield FakeCuda(backend)
    finally:
        backend.complete_all()
        backend.active = False
        backend.pool.close()  # the fake's records no longer go back to its pool
        try:
            restore()
        finally:
            backend.complete_all()  # what the fake's launchers recorded last
            backend.close_notices()
