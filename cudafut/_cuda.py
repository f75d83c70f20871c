"""The seam to CUDA: the one place its calls are reached from, and where
CUDA's backend is assembled.

The seam's jobs are modules of their own, each over CuPy (imported on
first use, so ``import cudafut`` works on a machine without a GPU), each
function typed, its docstring saying what it costs and blocks:

=====================  ==================================================
``_backend``           the interface (``Backend``), the backend in force
                       (``current``), the swap for cudafut.testing's fake
``_runtime``           start-up (CUDA found usable, refused after fork),
                       devices
``_streams``           stream handles, CuPy's current streams, new streams
``_event_calls``       CUDA's event calls and stream waits (a record's
                       queries among them)
``_notices``           CUDA closes a descriptor when work ends
``_copy_calls``        copies and pinned host memory
``_cupy_objects``      CuPy's allocator, CUDA graphs
``_ipc``               interprocess events and memory, PCI bus ids
=====================  ==================================================

The calls of the interface (``_backend.SEAM``) are made as
``_backend.current.name(...)``, by every module: :class:`CudaBackend` is
CUDA's implementation, installed here at import, and
:func:`cudafut._backend.swap` replaces it by the fake. The rest of the
seam (checks, constants, CuPy's allocator and graphs, ...) is re-exported
here and called as ``_cuda.name(...)``.

Costs (measured with CuPy 14.2, see docs/performance.md): an event record is
under 1 µs, a query about 1.7 µs and holds the GIL, a stream wait about
0.4 µs and releases the GIL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import (
    _backend,
    _copy_calls,
    _event_calls,
    _ipc,
    _notices,
    _runtime,
    _streams,
)
from ._backend import NOT_FAKED as NOT_FAKED
from ._backend import SEAM as SEAM
from ._backend import Backend as Backend
from ._backend import faked as faked
from ._backend import on_swap as on_swap
from ._backend import swap as swap
from ._cupy_objects import capture_cupy_graph as capture_cupy_graph
from ._cupy_objects import cupy_allocator as cupy_allocator
from ._cupy_objects import cupy_module as cupy_module
from ._cupy_objects import imported_cupy as imported_cupy
from ._cupy_objects import owner_of as owner_of
from ._cupy_objects import replay_cupy_graph as replay_cupy_graph
from ._cupy_objects import set_cupy_allocator as set_cupy_allocator
from ._cupy_objects import wrap_cupy_allocator as wrap_cupy_allocator
from ._event_calls import NOT_READY as NOT_READY
from ._event_calls import event_elapsed_ms as event_elapsed_ms
from ._event_calls import event_error as event_error
from ._event_calls import timing_event_create as timing_event_create
from ._ipc import array_over as array_over
from ._notices import set_native_notices as set_native_notices
from ._runtime import NO_GPU_TESTING as NO_GPU_TESTING
from ._runtime import check_device as check_device
from ._runtime import check_device_argument as check_device_argument
from ._runtime import check_usable as check_usable
from ._runtime import cuda_error as cuda_error
from ._runtime import on_initialise as on_initialise
from ._streams import PAGE_SIZE as PAGE_SIZE
from ._streams import check_stream_address as check_stream_address
from ._streams import mapped_pages as mapped_pages
from ._streams import stream_handle as stream_handle


class CudaBackend:
    """CUDA's implementation of :class:`cudafut._backend.Backend`: the
    functions of the seam's modules, each the call of the same name."""

    call_on_streams = staticmethod(_streams.call_on_streams)
    close_after = staticmethod(_notices.close_after)
    cupy = staticmethod(_runtime.cupy)
    cupy_stream = staticmethod(_streams.cupy_stream)
    current_device = staticmethod(_runtime.current_device)
    current_stream = staticmethod(_streams.current_stream)
    current_stream_getter = staticmethod(_streams.current_stream_getter)
    device_count = staticmethod(_runtime.device_count)
    device_bus_id = staticmethod(_ipc.device_bus_id)
    device_of_bus_id = staticmethod(_ipc.device_of_bus_id)
    device_synchronize = staticmethod(_runtime.device_synchronize)
    devices_of_host_value = staticmethod(_runtime.devices_of_host_value)
    ended = staticmethod(_event_calls.ended)
    event_create = staticmethod(_event_calls.event_create)
    event_destroy = staticmethod(_event_calls.event_destroy)
    event_error = staticmethod(_event_calls.event_error)
    event_query = staticmethod(_event_calls.event_query)
    event_record = staticmethod(_event_calls.event_record)
    event_synchronize = staticmethod(_event_calls.event_synchronize)
    free_host = staticmethod(_copy_calls.free_host)
    host_alloc = staticmethod(_copy_calls.host_alloc)
    initialise = staticmethod(_runtime.initialise)
    initialised = staticmethod(_runtime.initialised)
    ipc_close_memory = staticmethod(_ipc.ipc_close_memory)
    ipc_event_create = staticmethod(_ipc.ipc_event_create)
    ipc_memory_handle = staticmethod(_ipc.ipc_memory_handle)
    ipc_open_event = staticmethod(_ipc.ipc_open_event)
    ipc_open_memory = staticmethod(_ipc.ipc_open_memory)
    memcpy_to_device = staticmethod(_copy_calls.memcpy_to_device)
    memcpy_to_host = staticmethod(_copy_calls.memcpy_to_host)
    new_stream = staticmethod(_streams.new_stream)
    notice_stream = staticmethod(_notices.notice_stream)
    on_device = _runtime.on_device
    pointer_device = staticmethod(_runtime.pointer_device)
    pointer_is_pinned = staticmethod(_copy_calls.pointer_is_pinned)
    prepare_notices = staticmethod(_notices.prepare_notices)
    runtime = staticmethod(_runtime.runtime)
    stream_device = staticmethod(_streams.stream_device)
    stream_synchronize = staticmethod(_streams.stream_synchronize)
    stream_wait = staticmethod(_event_calls.stream_wait)
    use_device = staticmethod(_runtime.use_device)

    #: Stream types beyond CuPy's whose ``ptr`` and ``device_id`` are their
    #: handle and device: none (the native core finds CuPy's itself).
    stream_types: tuple[type, ...] = ()

    def __init__(self) -> None:
        # Each call held by the instance itself: a call through
        # _backend.current is then one dictionary lookup, and a test can
        # replace one (monkeypatch.setattr(_backend.current, name, f)).
        for name in SEAM:
            setattr(self, name, getattr(type(self), name))


_backend.install_cuda(CudaBackend())


if TYPE_CHECKING:  # mypy: CUDA's backend implements the interface
    _implements: Backend = CudaBackend()
