"""A one-shot timer with microsecond resolution that an event loop can watch.

asyncio, uvloop and trio round every sleep up to a whole millisecond (their
selectors take milliseconds). A Linux ``timerfd`` does not: it becomes
readable at the time asked, and the loop's selector wakes at once. The event
loop drivers use one to sleep until shortly before predicted GPU completion.

Python 3.13 has ``os.timerfd_create``; older versions reach libc through
ctypes. Where neither works (not Linux), :func:`make_timer` returns None and
the drivers sleep with the loop's own (millisecond) timers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from typing import Any, Final

_CLOCK_MONOTONIC: Final = 1
_TFD_NONBLOCK: Final = 0o4000
_TFD_CLOEXEC: Final = 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc: Any = None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        _libc = libc
    return _libc


#: ``settime(fd, ns)``: Python 3.13's ``os.timerfd_settime_ns``, else the
#: native core's ``timer_settime`` (C), else libc through ctypes (a few µs a
#: call: the pure core's). Chosen by the first Timer (the native core is
#: imported by then).
_settime: Callable[[int, int], None] | None = None


def _os_settime(fd: int, ns: int) -> None:
    os.timerfd_settime_ns(fd, initial=ns)  # type: ignore[attr-defined,unused-ignore]  # Python 3.13


def _ctypes_settime(fd: int, ns: int) -> None:
    spec = _Itimerspec()
    spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
    if _libc.timerfd_settime(fd, 0, ctypes.byref(spec), None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _choose_settime() -> Callable[[int, int], None]:
    global _settime
    if _settime is None:
        if hasattr(os, "timerfd_settime_ns"):
            _settime = _os_settime
        else:
            from . import _compiled

            native = _compiled.native()
            if native is not None:
                _settime = native.timer_settime
            else:
                _load_libc()
                _settime = _ctypes_settime
    return _settime


def _os_drain(fd: int) -> bool:
    try:
        os.read(fd, 8)
    except (BlockingIOError, InterruptedError):
        return False
    return True


def _choose_drain() -> Callable[[int], bool]:
    """The native core's ``timer_drain`` (the read from C, the GIL held),
    else ``os.read`` (which releases the GIL)."""
    from . import _compiled

    native = _compiled.native()
    return _os_drain if native is None else native.timer_drain


class Timer:
    """A non-blocking timerfd: :meth:`arm` it, watch :attr:`fd` for reading."""

    __slots__ = ("_drain", "_settime", "fd")

    def __init__(self) -> None:
        if hasattr(os, "timerfd_create"):
            self.fd = os.timerfd_create(_CLOCK_MONOTONIC, flags=_TFD_NONBLOCK | _TFD_CLOEXEC)
        else:
            fd = _load_libc().timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            self.fd = fd
        self._settime = _choose_settime()
        self._drain = _choose_drain()

    def arm(self, delay: float) -> None:
        """Become readable ``delay`` seconds from now (at least 1 ns); replaces
        an earlier arming. Costs a system call (under a µs; a few µs through
        ctypes on the pure core before Python 3.13); never blocks."""
        ns = int(delay * 1e9)
        self._settime(self.fd, ns if ns > 1 else 1)

    def disarm(self) -> None:
        """Stop a pending expiry; costs and blocks as :meth:`arm`. Errors
        are ignored (a closed timer has nothing to stop)."""
        with contextlib.suppress(OSError):
            self._settime(self.fd, 0)

    def drain(self) -> bool:
        """Consume the expiry, so that the fd stops being readable; whether
        there was one (False: the timer had not expired, or was re-armed).
        On the native core the read keeps the GIL (``os.read`` releases it,
        and the loop's thread then waits to take it back)."""
        return self._drain(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def make_timer() -> Timer | None:
    """A new :class:`Timer`, or None where timerfd is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return Timer()
    except (OSError, AttributeError):
        return None
