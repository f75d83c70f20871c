"""Garbage-collection pauses of a server: a ``gc.callbacks`` hook records them, the benchmark reads them.

Python's cyclic garbage collector stops the thread that triggers it,
event loop included, for as long as it walks the objects of the
generations it collects. A service that imported PyTorch and torchvision
holds about 300,000 tracked objects before it serves anything, and a
collection of the oldest generation walks all of them: over 100 ms each on
the CPUs measured (docs/serving.md, "Garbage-collection pauses").

:class:`PauseRecorder` times every collection and keeps those of at least
``threshold_ms``. The servers of this folder install one when the
environment variable :data:`ENV` names a file (:func:`record_from_env`):
each long collection is then appended to that file as one JSON line, at
once, so the benchmark reads them while the server runs and no exit hook
is needed (a server is stopped with SIGTERM); every process of
multiproc.py appends to the same file, each line saying its ``pid``.
compare.py sets the variable and reads the lines of its measuring window
(:func:`read`, then :func:`summary`).
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The environment variable naming the file a server appends its long collections to.
ENV = "CUDAFUT_GC_PAUSES"
#: Collections shorter than this are not recorded (ms).
THRESHOLD_MS = 5.0


class PauseRecorder:
    """Records every garbage collection of at least ``threshold_ms``.

    :attr:`pauses` holds one dict per such collection: ``t`` (its start,
    ``time.time()``), ``ms`` (its duration), ``generation``, ``collected``
    (objects freed), ``tracked`` (objects the collector tracked just
    before it, all generations, frozen ones excluded) and ``pid``; with
    ``path``, each is also appended to that file as a JSON line.

    Costs: two ``perf_counter()`` calls per collection (young ones run
    hundreds of times a second under load); for a recorded collection,
    counting the tracked objects (``len(gc.get_objects())``, after the
    collection is timed: about 0.1 µs an object, 30 ms for 300,000 on a
    slow CPU, which the thread pays too) and one write to ``path``. So it
    is a measuring tool: freezing (docs/serving.md) leaves few objects to
    count in the collections that remain. ``count_tracked=False`` skips
    that count (``tracked`` is then None): for a thread whose own stalls
    are measured with a low threshold (the serve benchmark's loop stalls,
    1 ms), where the walk would cost more than the collection it records.
    """

    def __init__(
        self,
        threshold_ms: float = THRESHOLD_MS,
        path: str | os.PathLike[str] | None = None,
        *,
        count_tracked: bool = True,
    ) -> None:
        self.threshold_ms = threshold_ms
        self.path = None if path is None else Path(path)
        self.count_tracked = count_tracked
        self.pauses: list[dict[str, Any]] = []
        self._start = 0.0
        self._t = 0.0

    def install(self) -> PauseRecorder:
        """Start recording (idempotent); returns ``self``."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        """Stop recording; what was recorded stays in :attr:`pauses`."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def __enter__(self) -> PauseRecorder:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector: it must not raise (the interpreter
        # would only print it) and should do nothing for a short collection.
        if phase == "start":
            self._t = time.time()
            self._start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._start) * 1e3
        if ms < self.threshold_ms:
            return
        collected = info.get("collected", 0)
        pause = {
            "t": round(self._t, 6),
            "ms": round(ms, 3),
            "generation": info.get("generation", -1),
            "collected": collected,
            "tracked": len(gc.get_objects()) + collected if self.count_tracked else None,
            "pid": os.getpid(),
        }
        self.pauses.append(pause)
        if self.path is not None:
            try:
                with open(self.path, "a") as out:  # one write per line: lines of several processes stay whole
                    out.write(json.dumps(pause) + "\n")
            except OSError:
                pass  # a measuring aid must not take the server down


_frozen = [0]


def freeze_warm_objects() -> int:
    """Move every object tracked now to the collector's permanent
    generation, where full collections no longer walk it, and return how
    many are frozen (docs/serving.md, "Garbage-collection pauses").

    Collects first (garbage frozen would never be freed): call it once,
    after imports, model load and warm-up, not per request. It also
    remembers the count for :func:`frozen_count`, because
    ``gc.get_freeze_count()`` walks the whole permanent generation: about
    30 ms with PyTorch loaded, on the loop of whoever asks (a ``/stats``
    that asked it set the ``/health`` max of every measured run).
    """
    gc.collect()
    gc.freeze()
    _frozen[0] = gc.get_freeze_count()
    return _frozen[0]


def frozen_count() -> int:
    """How many objects :func:`freeze_warm_objects` froze (0 before it
    ran): a load, not a walk."""
    return _frozen[0]


def record_from_env() -> PauseRecorder | None:
    """Install a :class:`PauseRecorder` appending to the file that
    :data:`ENV` names, if it names one; None otherwise."""
    path = os.environ.get(ENV)
    return PauseRecorder(path=path).install() if path else None


def read(path: str | os.PathLike[str], start: float = 0.0, end: float = float("inf")) -> list[dict[str, Any]]:
    """The collections recorded in ``path`` that started within
    ``[start, end)`` (``time.time()`` values); none if there is no file.
    A line still being written is skipped."""
    pauses = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            pause = json.loads(line)
        except json.JSONDecodeError:
            continue
        if start <= pause["t"] < end:
            pauses.append(pause)
    return pauses


def summary(pauses: Iterable[dict[str, Any]], over_ms: float = 10.0) -> dict[str, Any]:
    """What a run's collections add up to: ``count``, ``longest_ms`` (None
    if none), ``total_ms``, ``over_ms`` and how many took longer
    (``count_over``), and the longest one itself (``longest``)."""
    pauses = list(pauses)
    longest = max(pauses, key=lambda p: p["ms"], default=None)
    return {
        "count": len(pauses),
        "longest_ms": None if longest is None else longest["ms"],
        "total_ms": round(sum(p["ms"] for p in pauses), 3),
        "over_ms": over_ms,
        "count_over": sum(1 for p in pauses if p["ms"] > over_ms),
        "longest": longest,
    }
