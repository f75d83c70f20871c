"""Where a server's event loop stalls: a heartbeat on the loop and faulthandler's watchdog.

A ``/health`` probe that takes 30 ms says the loop was held for 30 ms, not
by what. :func:`start` puts a heartbeat on the loop (a callback every
``period_ms``) that appends each late beat to ``DIR/late.jsonl`` (``t``,
``time.time()``; ``late_ms``; ``pid``) and re-arms
:func:`faulthandler.dump_traceback_later`. When the loop misses its beats
for ``dump_after_ms``, faulthandler's own thread, which does not need the
GIL, writes every Python thread's stack to ``DIR/stacks-<pid>.txt``: the
loop's thread shows where it is held, the others what ran meanwhile (a
thread holding the GIL in Python code, a C call that did not release it).

A diagnostic, not for production: each re-arm starts a thread of
faulthandler's (tens of µs, ``1000 / period_ms`` times a second, here
every 4 ms by default), and the heartbeat itself runs on the loop. And the
dump reads the other threads' frames while they run, without the GIL: it
can, rarely, crash the process it traces (CPython issues 116008 and
140815; seen here in 2 of about 10 test runs whose loop, traced, walked
every tracked object under a loaded CPU). Trace a server while you look
for a stall, not while it serves.
faulthandler keeps one such watchdog per process: the trace replaces any
other ``dump_traceback_later`` (pytest's ``faulthandler_timeout``), and a
server stopped without ``stop()`` may dump one last "stall" while it
shuts down.

The servers of this folder start it when :data:`ENV` names a directory
(:func:`start_from_env`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

#: The environment variable naming the directory the trace is written to.
ENV = "CUDAFUT_STALL_TRACE"


def start(
    loop: asyncio.AbstractEventLoop,
    directory: str | os.PathLike[str],
    *,
    period_ms: float = 4.0,
    late_ms: float = 5.0,
    dump_after_ms: float = 12.0,
) -> Callable[[], None]:
    """Beat every ``period_ms`` on ``loop``; log beats ``late_ms`` late;
    dump every thread's stack when no beat came for ``dump_after_ms``.
    Returns ``stop()``, which ends the beats and closes the files (a
    server stopped by a signal leaves that to the process's end)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    late_log: IO[str] = open(out / "late.jsonl", "a", buffering=1)  # noqa: SIM115 - lives as the process
    try:
        stacks: IO[str] = open(out / f"stacks-{pid}.txt", "a", buffering=1)  # noqa: SIM115
    except OSError:
        late_log.close()
        raise
    period = period_ms / 1e3
    due = [loop.time() + period]
    handle: list[asyncio.TimerHandle] = []

    def beat() -> None:
        now = loop.time()
        late = (now - due[0]) * 1e3
        if late >= late_ms:
            late_log.write(json.dumps({"t": time.time(), "late_ms": round(late, 2), "pid": pid}) + "\n")
        faulthandler.dump_traceback_later(dump_after_ms / 1e3, repeat=False, file=stacks)
        due[0] = now + period
        handle[:] = [loop.call_at(due[0], beat)]

    def stop() -> None:
        for h in handle:
            h.cancel()
        faulthandler.cancel_dump_traceback_later()
        late_log.close()
        stacks.close()

    handle.append(loop.call_at(due[0], beat))
    return stop


def start_from_env(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """:func:`start` into the directory :data:`ENV` names, if it names one;
    returns its ``stop()`` (one that does nothing otherwise): call it as
    the service shuts down, so that a slow shutdown is not dumped as a
    stall."""
    directory = os.environ.get(ENV)
    if not directory:
        return lambda: None
    return start(loop, directory)
