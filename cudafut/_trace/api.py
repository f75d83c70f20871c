"""The public face: :func:`trace` and :class:`Trace`, which start and stop
a :class:`~.recorder.Tracer`, set the hooks' flag and write the file."""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from .. import _checks
from .._log import logger
from . import hooks, writer
from .recorder import Tracer

if TYPE_CHECKING:
    pass


__all__ = ["Trace", "trace"]

_start_lock: Final = threading.Lock()


class Trace:
    """A recording of every future made while it is active; see :func:`trace`.

    Use it as a context manager, ``with`` or ``async with``, or call
    :meth:`start` and :meth:`stop`; it records once. After the block,
    :attr:`events` holds the trace events written (and :attr:`path` the
    file, unless ``path`` was None).

    Making one costs nothing and blocks nothing; :meth:`start` imports
    ``nvtx`` when asked to. While it records, each future costs a few µs of
    host time and one or two CUDA timing events (docs/tracing.md, "What it
    costs"). Leaving a ``with`` block blocks the thread (:meth:`stop`);
    leaving an ``async with`` block blocks the loop for none of it.

    Raises:
        TypeError: ``path`` is neither a path nor None; ``nvtx`` or
            ``gpu_timing`` neither None nor a bool; ``timeout`` not a real number.
        ValueError: ``timeout`` is negative or NaN (huge means no limit).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        timeout: float = 5.0,
        nvtx: bool | None = None,
        gpu_timing: bool | None = None,
    ) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"trace() needs a file path (str or os.PathLike) or None, not {path!r}")
        seconds = _checks.timeout_seconds(timeout, "trace(timeout=...)")
        if nvtx is not None and not isinstance(nvtx, bool):
            raise TypeError(f"trace(nvtx=...) must be None, True or False, not {nvtx!r}")
        if gpu_timing is not None and not isinstance(gpu_timing, bool):
            raise TypeError(f"trace(gpu_timing=...) must be None, True or False, not {gpu_timing!r}")
        #: Where the file is written (None: no file, :attr:`events` only).
        self.path: Path | None = None if path is None else Path(path)
        #: Seconds the exit waits at most for the traced GPU work.
        self.timeout = seconds
        #: The trace events, once written (a list of dicts, as in the file).
        self.events: list[dict[str, Any]] | None = None
        self._nvtx = nvtx
        self._gpu_timing = gpu_timing
        self._tracer: Tracer | None = None
        self._used = False

    def __repr__(self) -> str:
        state = "recording" if self._tracer is not None else "written" if self.events is not None else "new"
        return f"<cudafut.Trace {state} path={str(self.path) if self.path else None!r}>"

    def start(self) -> Trace:
        """Start recording (what entering the block does); returns ``self``.

        Raises:
            RuntimeError: a trace records already (one at a time per
                process), or this one recorded before.
            ImportError: ``nvtx=True`` and the ``nvtx`` package is missing.
        """
        if self._used:
            raise RuntimeError(
                "this cudafut.Trace has recorded already: make a new one with cudafut.trace(path)"
            )
        nv = None
        if self._nvtx is not False:
            try:
                nv = importlib.import_module("nvtx")  # optional; lazily: only tracing needs it
            except ImportError:
                if self._nvtx:
                    raise ImportError(
                        "cudafut.trace(nvtx=True) needs the nvtx package: pip install nvtx"
                    ) from None
                nv = None
        with _start_lock:
            if hooks.active is not None:
                raise RuntimeError(
                    "a cudafut trace is recording already: traces record every future of the "
                    "process, so they cannot nest or overlap; end the other one first"
                )
            self._used = True
            self._tracer = Tracer(self._gpu_timing, nv)
            hooks.set_active(self._tracer)
        return self

    def _stop(self) -> Tracer:
        tracer = self._tracer
        if tracer is None:
            raise RuntimeError("this cudafut.Trace is not recording")
        with _start_lock:
            if hooks.active is tracer:
                hooks.set_active(None)
        tracer.stop()
        return tracer

    def _finish(self, tracer: Tracer, error: BaseException | None) -> None:
        """Build and write; a failure to write is raised, unless the block
        raised (then it is logged, and the block's exception goes on)."""
        self._tracer = None
        try:
            doc = writer.document(tracer, error)
            self.events = doc["traceEvents"]
            if self.path is not None:
                writer.write_file(self.path, doc)
        except Exception as exc:
            if error is None:
                raise
            logger.error("cudafut: could not write the trace %s", self.path, exc_info=exc)

    def stop(self) -> None:
        """Stop recording, wait for the traced GPU work, write the file.

        What leaving a ``with`` block does. Blocks the calling thread: at most
        ``timeout`` seconds for GPU work still running (polling its timing
        events every ms, sleeping with the GIL released; what is still running
        then is marked incomplete), then the time to build and write the file
        (docs/tracing.md gives the cost per future). On an event loop, use
        ``async with`` instead, which blocks the loop for none of this.

        Raises:
            RuntimeError: this trace is not recording.
            OSError: the file could not be written.
        """
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        tracer = self._stop()
        try:
            tracer.wait_gpu(self.timeout)
        finally:
            self._finish(tracer, error)

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._end(exc)

    async def __aenter__(self) -> Trace:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Here, not at the top: _loops imports this package's hooks, and the
        # package imports this module first (docs/design.md, "Layers").
        from .. import _loops

        tracer = self._stop()
        writing = False
        try:
            library = _loops.current_library()
            if library is None:
                raise RuntimeError("async with cudafut.trace(...) needs a running asyncio or trio loop")
            await tracer.wait_gpu_async(self.timeout, library.sleep)
            writing = True
            await _loops.run_in_thread(lambda: self._finish(tracer, exc))
        except BaseException:
            if not writing:  # cancelled while waiting: write what there is, now
                self._finish(tracer, exc)
            raise


def trace(
    path: str | os.PathLike[str] | None,
    *,
    timeout: float = 5.0,
    nvtx: bool | None = None,
    gpu_timing: bool | None = None,
) -> Trace:
    """Record a timeline of every future made in the block; write it to ``path``.

    ::

        with cudafut.trace("trace.json"):
            ...                      # or: async with cudafut.trace(...)

    Open the file in https://ui.perfetto.dev or chrome://tracing
    (docs/tracing.md explains the tracks). For each future made inside the
    block, in any thread, it records: created; set, failed or cancelled
    (with the streams and devices of its events, and the ``then()``
    callbacks that ran inside); its GPU work, from the previous point cudafut
    recorded on the stream (for ``then()``/``submit()``: from just before
    ``fn`` enqueued it) to its event, measured with CUDA timing events; the
    waiter that saw it done, and when (a flow arrow from the GPU work); its
    ``then()`` and ``submit()`` functions and done callbacks with their host
    time; its awaits and ``result()`` calls; ``then()`` parent to child as
    flow arrows. Each waiter (the loop's, the watcher thread, a thread in
    ``result()``) has a track of its spins, sleeps (planned and how late they
    woke) and wake-ups, which says why a wake-up came late.

    Traces record the whole process, one at a time: starting one while
    another records raises :class:`RuntimeError` (nested or overlapping
    blocks, in any thread). Events after the block ends are not recorded.

    Args:
        path: the JSON file to write (``str`` or ``os.PathLike``), replaced
            if it exists; ``None``: write no file (see :attr:`Trace.events`,
            or use it for NVTX ranges alone).
        timeout: seconds the exit waits at most for traced GPU work still
            running; what is still running then is marked incomplete.
        nvtx: NVTX ranges for Nsight Systems: ``None`` (default) when the
            ``nvtx`` package is installed, ``True`` to require it, ``False``
            for none. Start/end ranges (futures overlap), in domain
            ``"cudafut"``: each future from created to set, each callback,
            await and ``result()``, each waiter spin and sleep.
        gpu_timing: ``None`` (default): time the GPU work when CUDA is in
            use; ``False``: record host events only, no timing event.

    Costs, only while recording: 4.6 µs more host time per future
    created, set and awaited (an H200, bench-h200-tracing.json;
    docs/tracing.md has more figures), two CUDA timing events per
    stream a ``then()``/``submit()`` runs on and one per event a producer
    records, and memory for the events until the file is written. Starting
    costs nothing on the GPU; the first timing event on each device records
    a reference event on a stream of the trace's own. Off (no trace
    recording), each hook in the library is one test of a module global.

    Leaving a ``with`` block blocks the thread (see :meth:`Trace.stop`):
    at most ``timeout`` seconds for the GPU, then the writing. Leaving an
    ``async with`` block waits for the GPU on the loop (polling every ms,
    never blocking it) and writes the file in a worker thread. The file is
    written when the block raises too (the exception goes on, and is noted
    in the file's ``otherData``).

    Raises:
        TypeError: ``path`` is neither a path nor None; ``nvtx`` or
            ``gpu_timing`` not None or a bool; ``timeout`` not a real number.
        ValueError: ``timeout`` is negative or NaN (huge means no limit).
    """
    return Trace(path, timeout=timeout, nvtx=nvtx, gpu_timing=gpu_timing)
