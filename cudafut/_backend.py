"""The swap: :mod:`cudafut.testing`'s fake GPU in place of CUDA.

The CUDA calls cudafut's core makes are one interface, :class:`Backend`;
its methods are the seam's functions (:data:`SEAM`), which every caller
looks up as ``_cuda.name`` at each call. :func:`swap` is the one place that
chooses the implementation: it rebinds those names in :mod:`cudafut._cuda`
to the backend's methods (``_cuda.replace_seam``), so that the real
functions run as they are, with no flag tested and no indirection added,
and runs the hooks of the modules that hold objects of a backend
(:func:`on_swap`). An event record keeps the calls of the backend that
made it (:class:`RecordCalls`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol

from . import _cuda
from ._errors import CudaError


class Backend(Protocol):
    """The CUDA calls cudafut's core makes, as one interface.

    Two implementations: the seam's own functions, as :mod:`cudafut._cuda`
    holds them (CUDA through CuPy, the native notices of ``_waker.c``
    behind ``close_after``), and :mod:`cudafut.testing`'s fake GPU. mypy
    checks both against this class (``_cuda`` at its end, the fake as
    :func:`swap`'s argument). :func:`swap` is the one place that chooses:
    it rebinds ``_cuda``'s functions to the backend's methods, so that the
    core's calls (``_cuda.name(...)``, looked up at each call) reach CUDA's
    functions with nothing in between. Each method's meaning is the
    docstring of the function of ``_cuda`` with the same name.
    """

    def call_on_streams(
        self, streams: Mapping[int, Any], primary: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any: ...
    def close_after(self, record: Any, fd: int, stream: int) -> None: ...
    def cupy(self) -> Any: ...
    def cupy_stream(self, stream: object, ptr: int, device: int) -> Any: ...
    def current_device(self) -> int: ...
    def current_stream(self, device: int) -> Any: ...
    def current_stream_getter(self) -> Callable[[int], Any]: ...
    def device_count(self) -> int: ...
    def device_bus_id(self, device: int) -> str: ...
    def device_of_bus_id(self, bus_id: str) -> int: ...
    def device_synchronize(self, device: int) -> None: ...
    def devices_of_host_value(self) -> tuple[int, ...]: ...
    def event_create(self, device: int) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def event_record(self, event: int, stream: int, device: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def free_host(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def initialise(self) -> None: ...
    def initialised(self) -> bool: ...
    def ipc_close_memory(self, ptr: int) -> None: ...
    def ipc_event_create(self, device: int) -> tuple[int, bytes]: ...
    def ipc_memory_handle(self, ptr: int, device: int) -> tuple[bytes, int, int]: ...
    def ipc_open_event(self, handle: bytes, device: int) -> int: ...
    def ipc_open_memory(self, handle: bytes, device: int) -> int: ...
    def memcpy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def memcpy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def new_stream(self, device: int, priority: int) -> Any: ...
    def notice_stream(self, device: int) -> int | None: ...
    def on_device(self, device: int) -> AbstractContextManager[None]: ...
    def pointer_device(self, ptr: int) -> int: ...
    def pointer_is_pinned(self, ptr: int) -> bool: ...
    def runtime(self) -> Any: ...
    def stream_device(self, stream: int) -> int: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def stream_wait(self, stream: int, event: int, device: int) -> None: ...
    def use_device(self, device: int) -> None: ...


#: The functions a backend replaces, by name: the methods of :class:`Backend`.
SEAM: Final = tuple(name for name in vars(Backend) if not name.startswith("_"))

#: Modules holding objects of the backend (pools of streams and events,
#: threads owning streams) and the record type: see on_swap().
_swap_hooks: list[Callable[[Any], Callable[[], None]]] = []
# The backend installed and the restore functions of its hooks; None: CUDA.
_swapped: tuple[Any, list[Callable[[], None]]] | None = None
_swap_lock = threading.RLock()  # a hook may import a module that registers one


def faked() -> bool:
    """Whether :mod:`cudafut.testing`'s fake GPU is installed (for error
    messages: a flag read, no call to CUDA)."""
    return _swapped is not None


#: The end of the refusal of a GPU-array-only call under the fake GPU.
NOT_FAKED: Final = (
    "; under cudafut.testing's fake GPU, NumPy arrays stand for GPU arrays, but {call} is not faked "
    "(it needs GPU memory): test this part on a GPU (docs/testing.md)"
)


def on_swap(hook: Callable[[Any], Callable[[], None]]) -> None:
    """Register ``hook(backend)``, called when :func:`swap` installs a
    backend: it sets aside what the module holds of the previous backend
    (streams, events, threads that own them) so that no object of one
    backend reaches the other, and returns the function that puts it back.
    A hook registered while a backend is installed is called at once."""
    with _swap_lock:
        _swap_hooks.append(hook)
        if _swapped is not None:
            _swapped[1].append(hook(_swapped[0]))


def swap(backend: Backend) -> Callable[[], None]:
    """Install ``backend`` in place of CUDA (``_cuda``'s functions); return
    the function that removes it.

    Costs the real functions nothing: they are rebound, never wrapped. The
    hooks of :func:`on_swap` run after the functions are installed; on
    removal they run first, in reverse order, then the functions return.

    Raises:
        RuntimeError: a backend is installed already.
    """
    global _swapped
    with _swap_lock:
        if _swapped is not None:
            raise RuntimeError(
                "a fake CUDA (cudafut.testing.fake_cuda) is installed already; leave it before "
                "installing another"
            )
        saved, saved_count = _cuda.replace_seam(
            {name: getattr(backend, name) for name in SEAM}, backend.device_count()
        )
        restores: list[Callable[[], None]] = []
        _swapped = (backend, restores)
        try:
            for hook in _swap_hooks:
                restores.append(hook(backend))
        except BaseException:
            _unswap(restores, saved, saved_count)
            raise

    def restore() -> None:
        with _swap_lock:
            if _swapped is None or _swapped[0] is not backend:
                return  # removed already
            _unswap(restores, saved, saved_count)

    return restore


def _unswap(restores: list[Callable[[], None]], saved: dict[str, Any], count: int) -> None:
    global _swapped
    try:
        for undo in reversed(restores):
            undo()
    finally:
        _cuda.replace_seam(saved, count)
        _swapped = None


class RecordCalls:
    """What an event record asks of the backend that made it: its status,
    a stream's wait on it, the error of a status, and whether the backend
    can still be used.

    A record keeps the object of its backend for as long as it lives, so
    that a record of :mod:`cudafut.testing`'s fake asks the fake, never
    CUDA, even after the fake is removed. :data:`CUDA` is CUDA's (``_cuda``'s
    functions); the fake's backend is its own.
    """

    __slots__ = ()

    #: Stream types whose ``ptr`` and ``device_id`` attributes are their
    #: handle and device, beyond CuPy's (which the native core finds once
    #: CuPy is imported): a fast path of ``record(x, stream=s)`` reads them.
    stream_types: tuple[type, ...] = ()

    # The seam's functions looked up in _cuda at each call, as the core's
    # calls do (a test may replace one).
    def event_query(self, event: int) -> int:
        return _cuda.event_query(event)

    def stream_wait(self, stream: int, event: int, device: int) -> None:
        _cuda.stream_wait(stream, event, device)

    def event_error(self, code: int, device: int) -> CudaError:
        return _cuda.event_error(code, device)

    def ended(self) -> str | None:
        """Why this backend can no longer be used, or None (CUDA: never)."""
        return None


#: The record calls of CUDA (see :class:`RecordCalls`).
CUDA: Final = RecordCalls()


def record_calls() -> Any:
    """The record calls of the backend installed now: :data:`CUDA`, or
    :mod:`cudafut.testing`'s fake."""
    return CUDA if _swapped is None else _swapped[0]
