"""Tracing: a timeline of every future made while a trace records.

For each future made inside the block: when it was created and set (on which
streams of which devices), when the GPU ran the work between its recording
points (CUDA timing events, made only while tracing), which waiter saw it done
and when, and the host time of the callbacks it ran; ``then()`` links become
flow arrows. The file is written when the block exits, in the Chrome
trace-event JSON format that https://ui.perfetto.dev and chrome://tracing
open. docs/tracing.md explains the tracks.

The package, bottom up:

- ``pool``: the GPU clock, CUDA timing events pooled across traces;
- ``recorder``: :class:`~.recorder.Tracer`, one recording trace's log;
- ``writer``: the log folded and written as trace-event JSON;
- ``hooks``: the flag ``active`` and the functions the library calls
  (``from ._trace import hooks as _trace``; ``if _trace.active is not None:
  _trace.<hook>(...)``): they receive what happened and never complete or
  notify a future;
- ``api``: the public :func:`trace` and :class:`Trace`.

Cost when off: every hook site in the library is one test of the flag.
Everything else runs only while a trace records. Nothing here takes a lock on
the hot paths: appends and dict stores are atomic under the GIL, and hooks run
in whichever thread the library runs them.
"""

from .api import Trace, trace

__all__ = ["Trace", "trace"]
