"""The GPU clock of traces: CUDA timing events, made only while tracing and
pooled across traces (through ``_cuda``, the seam). Tests replace
:data:`timing` with a fake of the same methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .. import _backend, _cuda, _event_calls

if TYPE_CHECKING:
    pass


#: Timing events kept for the next trace, per device; beyond this destroyed.
_MAX_FREE_TIMING: Final = 8192


class CudaTiming:
    """Timing events through ``_cuda`` (the seam): made only while tracing,
    pooled across traces. Tests replace the module's ``pool.timing`` with a fake
    of the same methods."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._ref_streams: dict[int, Any] = {}

    def usable(self) -> bool:
        """Whether CUDA is initialised in this process (records exist only then)."""
        return _backend.current.initialised()

    def acquire(self, device: int) -> int:
        try:
            return self._free[device].pop()
        except (KeyError, IndexError):
            return _cuda.timing_event_create(device)

    def release(self, device: int, handle: int) -> None:
        free = self._free.setdefault(device, [])
        if len(free) < _MAX_FREE_TIMING:
            free.append(handle)
        else:
            _backend.current.event_destroy(handle)

    def record(self, handle: int, stream: int, device: int) -> None:
        _backend.current.event_record(handle, stream, device)

    def ref_stream(self, device: int) -> int:
        """An idle stream of the tracer's own: the reference event recorded
        there completes at once, whatever the application's streams run."""
        stream = self._ref_streams.get(device)
        if stream is None:
            stream = self._ref_streams[device] = _backend.current.new_stream(device, 0)
        return int(stream.ptr)

    def elapsed_ms(self, ref: int, handle: int) -> float | None:
        """ms from ``ref`` to ``handle``, or None while ``handle`` is pending."""
        if _event_calls.event_query(handle) != 0:
            return None
        return _cuda.event_elapsed_ms(ref, handle)

    def done(self, handle: int) -> bool:
        return bool(_event_calls.event_query(handle) != _cuda.NOT_READY)


timing: Any = CudaTiming()
