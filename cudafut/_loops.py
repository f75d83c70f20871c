"""Event-loop drivers: one waiter per running loop, for asyncio and trio.

Each running loop gets one :class:`~cudafut._waiter.Driver`, created on the
first ``await`` in it. The driver polls only while somebody waits: on every
loop iteration for ``SPIN_S`` after a new wait (short GPU work is noticed
within microseconds), then once per ``SLEEP_S``. With nothing to wait for it
schedules nothing at all.

asyncio (and uvloop) drive the poll with ``call_soon`` / ``call_later``
callbacks, no task; trio with one system task per run. trio is imported only
when a trio loop is found running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

from ._waiter import SLEEP_S, SPIN_S, Driver

Register = Callable[[Callable[[], None]], Callable[[], None]]


class AsyncioDriver(Driver):
    """Polls from asyncio loop callbacks."""

    cancelled_error: Final = asyncio.CancelledError

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = weakref.ref(loop)  # the registry is keyed weakly by the loop
        self._thread = threading.get_ident()
        self._handle: asyncio.Handle | None = None
        self._sleeping = False
        self._spin_until = 0.0

    def kick(self) -> None:
        self._spin_until = time.perf_counter() + SPIN_S
        handle = self._handle
        if handle is not None:
            if not self._sleeping:
                return  # a spin poll is already queued
            handle.cancel()  # cut the sleep short: poll the new wait now
        loop = self._loop()
        if loop is not None:
            self._sleeping = False
            self._handle = loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._handle = None
        self.run_fired(self.watchlist.poll())
        if not self.watchlist.pending or self._handle is not None:
            return
        loop = self._loop()
        if loop is None:
            return
        if time.perf_counter() < self._spin_until:
            self._sleeping = False
            self._handle = loop.call_soon(self._tick)
        else:
            self._sleeping = True
            self._handle = loop.call_later(SLEEP_S, self._tick)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return  # nobody is left to wake
        if threading.get_ident() == self._thread:
            loop.call_soon(fn)
        else:
            loop.call_soon_threadsafe(fn)

    def report(self, message: str, exc: BaseException, future: object = None) -> None:
        loop = self._loop()
        if loop is None:
            super().report(message, exc, future)
            return
        context: dict[str, Any] = {"message": message, "exception": exc}
        if future is not None:
            context["future"] = future
        loop.call_exception_handler(context)

    async def until(self, register: Register) -> None:
        """Wait until ``register``'s wake function is called in this loop.

        ``register(wake)`` arranges the call and returns a cancel function,
        which runs however the wait ends (cancellation included).
        """
        loop = self._loop()
        assert loop is not None
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        cancel = register(wake)
        try:
            await waiter
        finally:
            cancel()


class TrioDriver(Driver):
    """Polls from one trio system task per run."""

    # trio cancels with scopes; a cancelled *future* is a plain error there.
    cancelled_error: Final = concurrent.futures.CancelledError

    def __init__(self, trio: Any) -> None:
        super().__init__()
        self._trio = trio
        # Weakly: the registry is keyed by the token, and a strong reference
        # from its value would keep every finished run alive.
        self._token = weakref.ref(trio.lowlevel.current_trio_token())
        self._wakeup = trio.Event()
        self._spin_until = 0.0
        trio.lowlevel.spawn_system_task(self._run, name="cudafut-waiter")

    def kick(self) -> None:
        self._spin_until = time.perf_counter() + SPIN_S
        self._wakeup.set()

    async def _run(self) -> None:
        trio = self._trio
        while True:
            if not self.watchlist.pending:
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            self.run_fired(self.watchlist.poll())
            if not self.watchlist.pending:
                continue
            if time.perf_counter() < self._spin_until:
                await trio.lowlevel.checkpoint()
            else:
                with trio.move_on_after(SLEEP_S):
                    await self._wakeup.wait()

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        token = self._token()
        if token is None:
            return
        with contextlib.suppress(self._trio.RunFinishedError):  # the run ended
            token.run_sync_soon(fn)

    async def until(self, register: Register) -> None:
        event = self._trio.Event()
        cancel = register(event.set)
        try:
            await event.wait()
        finally:
            cancel()


LoopDriver = AsyncioDriver | TrioDriver

_asyncio_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioDriver] = (
    weakref.WeakKeyDictionary()
)
_trio_drivers: weakref.WeakKeyDictionary[Any, TrioDriver] = weakref.WeakKeyDictionary()


def current_driver() -> LoopDriver | None:
    """The driver of the loop running in this thread, or None."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        driver = _asyncio_drivers.get(loop)
        if driver is None:
            driver = _asyncio_drivers[loop] = AsyncioDriver(loop)
        return driver
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        trio_driver = _trio_drivers.get(token)
        if trio_driver is None:
            trio_driver = _trio_drivers[token] = TrioDriver(trio)
        return trio_driver
    return None


def require_driver() -> LoopDriver:
    driver = current_driver()
    if driver is None:
        raise RuntimeError(
            "awaiting a CudaFuture needs a running asyncio (or uvloop) or trio "
            "event loop in this thread; outside a loop use fut.result()"
        )
    return driver
