"""CUDA's event calls: create, record, query, destroy and synchronise
events, make a stream wait for one, and time two (the tracer's).

A part of the CUDA seam (:mod:`cudafut._cuda` re-exports every function,
and callers call them there). Each call gets CuPy's runtime through
``_cuda.runtime()`` (a global read once CUDA is initialised), so that the
fork check and a test's stand-in runtime reach these calls too. The native
core (cudafut/_core.pyx) makes its records' calls from C where it can, and
comes here, through the backend object (``_cuda.CudaBackend``), for the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from . import _backend, _runtime
from ._errors import CudaError
from ._streams import SPECIAL_STREAMS

#: ``cudaErrorNotReady``: what a query returns while the work is pending.
NOT_READY = 600


def event_create(device: int) -> int:
    """A new event on ``device``, created with timing disabled (cheapest).
    Not blocking-sync: such events cost more to query and wait on, and
    10,000 awaits with them stalled a loop for the GPU's whole busy time
    (the notices' own events are blocking-sync: :func:`close_after`)."""
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
        return int(rt.eventCreateWithFlags(rt.eventDisableTiming))


def event_destroy(event: int) -> None:
    _backend.current.runtime().eventDestroy(event)


def timing_event_create(device: int) -> int:
    """A new event on ``device`` with timing enabled (for tracing only:
    recording one costs a little more than a timing-disabled event)."""
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
        return int(rt.eventCreateWithFlags(rt.eventDefault))


def event_elapsed_ms(start: int, end: int) -> float:
    """``cudaEventElapsedTime``: ms from ``start`` to ``end`` (both complete,
    both timing events of one device); negative if ``end`` ran first."""
    return float(_backend.current.runtime().eventElapsedTime(start, end))


def event_record(event: int, stream: int, device: int) -> None:
    """Record ``event`` on ``stream`` of ``device`` (under 1 µs, no wait)."""
    rt = _backend.current.runtime()
    if stream in SPECIAL_STREAMS:
        _on_device_of(device, rt.eventRecord, event, stream)
    else:  # the common case, without the call: an explicit stream carries its device
        rt.eventRecord(event, stream)


def event_query(event: int) -> int:
    """Raw ``cudaEventQuery`` status: 0 done, 600 pending, else an error.

    Non-blocking, holds the GIL (CuPy does not release it here).
    """
    return int(_backend.current.runtime().eventQuery(event))


def event_error(code: int, device: int) -> CudaError:
    """The :class:`CudaError` of an event that reported ``code`` (a runtime
    ``cudaError_t``) on ``device``."""
    return _runtime.cuda_error(code, device)


def stream_wait(stream: int, event: int, device: int) -> None:
    """Make ``stream`` (on ``device``) wait for ``event``; the host does not wait."""
    rt = _backend.current.runtime()
    if stream in SPECIAL_STREAMS:
        _on_device_of(device, rt.streamWaitEvent, stream, event)
    else:
        rt.streamWaitEvent(stream, event)


def _on_device_of(device: int, call: Callable[[int, int], object], a: int, b: int) -> None:
    # For a special stream handle only (the callers test for it): it means
    # "the default stream of the *current* device", so switch to the device
    # it is meant for; an explicit stream carries its device itself.
    if _backend.current.runtime().getDevice() != device:
        with _backend.current.on_device(device):
            call(a, b)
    else:
        call(a, b)


def event_synchronize(event: int) -> None:
    """``cudaEventSynchronize``: block the calling thread until ``event``
    has completed."""
    _backend.current.runtime().eventSynchronize(event)


def ended() -> str | None:
    """Why CUDA's backend can no longer be used: never (None). The fake's
    says so once it has ended."""
    return None
