"""The hooks: ``if _trace.active is not None: _trace.<hook>(...)`` in the library.

:data:`active` is the one flag every hook site tests (``_trace`` there is
this module), so tracing off costs one test of a module global per site.
Hooks re-read :data:`active`, so a trace that ends in another thread between
a site's test and its call costs nothing but a return. Hooks receive what
happened and hand it to the recorder; they never complete or notify a
future. A fault of the tracer is logged once per trace and the work goes on.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .._log import logger
from .recorder import INNER

_T = TypeVar("_T")

# CudaFuture.__init__'s file, to step over its frame in created() (pure Python).
_FUTURE_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_future.py")

if TYPE_CHECKING:
    from .._events import EventRecord
    from .recorder import Completing, Tracer, Track


#: The trace that records now, or None. The one flag every hook tests; set
#: it through :func:`set_active`, which tells the native core too.
active: Tracer | None = None

# Called with whether a trace records, at each set_active(): the native
# core keeps it as a C flag, so its hot paths look up no module attribute.
_watchers: list[Callable[[bool], object]] = []


def set_active(tracer: Tracer | None) -> None:
    """Make ``tracer`` the trace that records (None: none does), and tell
    the watchers (:func:`on_change`). Costs a call per watcher."""
    global active
    active = tracer
    for watcher in _watchers:
        watcher(tracer is not None)


def on_change(watcher: Callable[[bool], object]) -> None:
    """Call ``watcher(whether a trace records)`` now and at each
    :func:`set_active`."""
    _watchers.append(watcher)
    watcher(active is not None)


def _fault(tr: Tracer, exc: Exception) -> None:
    """A fault of the tracer's own, in a hook: logged once per trace, and the
    traced work goes on as if no trace recorded (a trace must never break
    what it watches, least of all a waiter's poll)."""
    if not tr.faulted:
        tr.faulted = True
        logger.warning(
            "cudafut: trace: an event could not be recorded; the trace may miss some", exc_info=exc
        )


class _Making(threading.local):
    name: str | None = None


#: The public function of cudafut making a future on this thread, where its
#: frame cannot tell: compiled functions have none (cudafut/_compiled.py).
making: Final = _Making()


def make(cls: Callable[[], _T], name: str) -> _T:
    """``cls()``, labelled as made by cudafut's ``name`` while tracing (a
    compiled caller has no frame for :func:`created` to find)."""
    making.name = name
    try:
        return cls()
    finally:
        making.name = None


def created(fut: object) -> None:
    """``CudaFuture.__init__``: a future was made (labelled by its maker)."""
    tr = active
    if tr is None:
        return
    try:
        name = making.name
        if name is not None:
            tr.created(fut, name)
            return
        # Who called CudaFuture() (0: here, 1: __init__, which has no frame
        # where cudafut's core is compiled), and, while that is one of
        # cudafut's helpers, who called it: named when the file is written.
        frame: FrameType | None = sys._getframe(1)
        if frame.f_code.co_name == "__init__" and frame.f_code.co_filename == _FUTURE_FILE:  # type: ignore[union-attr]
            frame = frame.f_back  # type: ignore[union-attr]
        code = frame.f_code  # type: ignore[union-attr]
        name = code.co_name
        if name not in INNER and name[0] != "_":
            tr.created(fut, code)  # the common case: one frame
            return
        codes = [code]
        frame = frame.f_back  # type: ignore[union-attr]
        while frame is not None and len(codes) < 4:
            code = frame.f_code
            codes.append(code)
            name = code.co_name
            if name not in INNER and name[0] != "_":
                break
            frame = frame.f_back
        tr.created(fut, tuple(codes))
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)


def chained(parent: object, child: object, fn: object) -> None:
    """``then()``: ``child`` runs ``fn`` once ``parent`` is set."""
    tr = active
    if tr is not None:
        try:
            tr.chained(parent, child, fn)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def completing(fut: object, records: tuple[EventRecord, ...]) -> Completing | None:
    """``_complete``/``cancel``: ``fut`` left the pending state with
    ``records`` and is about to wake its waiters and run its listeners (the
    traced set slice starts). Returns the token for :func:`completed`, or
    None when ``fut`` is not traced. Only observes: the future notifies."""
    tr = active
    if tr is None:
        return None
    try:
        return tr.completing(fut, records)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return None


def completed(token: Completing, state: object) -> None:
    """The future of :func:`completing`'s ``token`` woke its waiters and ran
    its listeners, ending in ``state`` (the traced set slice ends)."""
    tr = token[0]
    try:
        tr.completed(token, state)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)


def timed_fn(fut: object, fn: Callable[..., Any], streams: Mapping[int, Any]) -> Callable[..., Any]:
    """``_settle``: ``fn`` of a ``then()``/``submit()``, wrapped to time it."""
    tr = active
    if tr is None:
        return fn
    try:
        return tr.timed(fut, fn, streams)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return fn


def timed_callback(fn: Callable[[Any], object], future: object) -> Callable[[Any], object]:
    """``Driver.run_callback``: a done callback, wrapped to time it."""
    tr = active
    if tr is None:
        return fn
    try:
        return tr.timed_callback(fn, future)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return fn


def wait_start(fut: object, kind: str) -> tuple[int, float, Any] | None:
    """An await or ``result()`` begins; the token goes to :func:`waited`."""
    tr = active
    if tr is None:
        return None
    try:
        return tr.wait_start(fut, kind)
    except Exception as exc:  # noqa: BLE001 - see _fault
        _fault(tr, exc)
        return None


def waited_at_once(fut: object, kind: str) -> None:
    """An await or ``result()`` found the future done already."""
    tr = active
    if tr is not None:
        try:
            tr.waited_at_once(fut, kind)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def waited(kind: str, token: tuple[int, float, Any]) -> None:
    """The await or ``result()`` of :func:`wait_start` returns."""
    tr = active
    if tr is not None:
        try:
            tr.waited(kind, token)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def _driver_track(tr: Tracer, driver: Any) -> Track:
    return tr.waiter(id(driver), driver, getattr(driver, "name", type(driver).__name__))


def planned(driver: Any, delay: float | None, kind: str = "spin") -> None:
    """A driver's plan: ``None`` idle, ``0.0`` spin, else sleep ``delay`` s."""
    tr = active
    if tr is not None:
        try:
            tr.planned(_driver_track(tr, driver), delay, kind)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def polled(driver: Any, now: float, timer_fired: bool, fired: Sequence[tuple[Any, EventRecord]]) -> None:
    """``Driver.poll``: a poll at ``now`` ran what ``fired``."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_driver_track(tr, driver), now, timer_fired, [rec for _cb, rec in fired])
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def seen_alone(driver: Any, record: EventRecord, now: float) -> None:
    """``LoopDriver.spin_alone``: the awaiting task saw ``record`` complete."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_driver_track(tr, driver), now, None, (record,))
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def _blocking_track(tr: Tracer) -> Track:
    return tr.waiter(("result", threading.get_ident()), None, "result()")


def blocking_planned(delay: float) -> None:
    """``block_until_complete``: spin (``0.0``) or sleep ``delay`` s."""
    tr = active
    if tr is not None:
        try:
            tr.planned(_blocking_track(tr), delay)
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)


def blocking_seen(record: EventRecord, now: float) -> None:
    """``block_until_complete`` saw ``record`` complete at ``now``."""
    tr = active
    if tr is not None:
        try:
            tr.polled(_blocking_track(tr), now, True, (record,))
        except Exception as exc:  # noqa: BLE001 - see _fault
            _fault(tr, exc)
