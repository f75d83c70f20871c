"""The backend: the CUDA calls cudafut's core makes, as one object.

:data:`current` is the backend in force: CUDA's (``_cuda.CudaBackend``,
the functions of the seam's modules) or :mod:`cudafut.testing`'s fake GPU.
Every call of the interface, from any module, the seam's own included, is
``_backend.current.name(...)``: swapping the fake is :func:`swap` replacing
that one object (and the hooks of :func:`on_swap` setting aside what
modules hold of the previous backend), and a test replaces one call with
``monkeypatch.setattr(_backend.current, name, f)``. A call through it
costs one attribute lookup more than a plain function call.

The native core (cudafut/_core.pyx) keeps its own reference to
:data:`current`, which its :func:`on_swap` hook replaces, and calls it
(``event_record``, ``event_create``, ``event_destroy``, ``current_stream``)
where it cannot make the call from C.

This module is the bottom of the seam: it imports nothing of cudafut's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol, cast


class Backend(Protocol):
    """The CUDA calls cudafut's core makes, as one interface.

    Two implementations: ``_cuda.CudaBackend`` (CUDA through CuPy, the
    native notices of ``_waker.c`` behind ``close_after``: the functions of
    the seam's modules) and :mod:`cudafut.testing`'s fake GPU. mypy checks
    both against this class. Each method's meaning, cost and blocking are
    the docstring of CUDA's function of the same name (``CudaBackend`` says
    which module holds it).

    An event record keeps the backend that made it (its ``calls``) for as
    long as it lives, and asks it ``event_query``, ``stream_wait``,
    ``event_error`` and ``ended``: a record of the fake asks the fake, never
    CUDA, even after the fake is removed. A backend may also name, as
    ``stream_types``, stream types whose ``ptr`` and ``device_id`` are their
    handle and device (the fake's): ``record(x, stream=s)``'s native fast
    path reads them.
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
    def ended(self) -> str | None: ...
    def event_create(self, device: int) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def event_error(self, code: int, device: int) -> Exception: ...
    def event_query(self, event: int) -> int: ...
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
    def prepare_notices(self, device: int, timeout: float) -> bool: ...
    def runtime(self) -> Any: ...
    def stream_device(self, stream: int) -> int: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def stream_wait(self, stream: int, event: int, device: int) -> None: ...
    def use_device(self, device: int) -> None: ...


#: How long a caller of ``prepare_notices`` at start-up (a new process group,
#: ``warm_launchers``) waits for a device's notice streams: made in well under
#: a millisecond on an idle GPU, longer only behind running work.
PREPARE_NOTICES_S: Final = 10.0

#: The calls a backend implements, by name: the methods of :class:`Backend`.
SEAM: Final = tuple(name for name in vars(Backend) if not name.startswith("_"))


class _NotInstalled:
    """:data:`current` before ``_cuda`` installs CUDA's backend (during
    cudafut's own import only): every call says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"cudafut's CUDA backend is not installed yet ({name}): import cudafut first")


#: CUDA's backend, once ``_cuda`` installed it (see install_cuda()).
_cuda_backend: Backend = cast(Backend, _NotInstalled())
#: The backend in force: CUDA's, or cudafut.testing's fake while installed.
#: Looked up at each call (``_backend.current.name(...)``): never bind it.
current: Backend = _cuda_backend


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
    """Install ``backend`` in place of CUDA: make it :data:`current`; return
    the function that removes it.

    One assignment: CUDA's calls cost the same before, during and after.
    The hooks of :func:`on_swap` run after the backend is installed; on
    removal they run first, in reverse order, then CUDA's backend returns.

    Raises:
        RuntimeError: a backend is installed already.
    """
    global _swapped, current
    with _swap_lock:
        if _swapped is not None:
            raise RuntimeError(
                "a fake CUDA (cudafut.testing.fake_cuda) is installed already; leave it before "
                "installing another"
            )
        saved = current
        current = backend
        restores: list[Callable[[], None]] = []
        _swapped = (backend, restores)
        try:
            for hook in _swap_hooks:
                restores.append(hook(backend))
        except BaseException:
            _unswap(restores, saved)
            raise

    def restore() -> None:
        with _swap_lock:
            if _swapped is None or _swapped[0] is not backend:
                return  # removed already
            _unswap(restores, saved)

    return restore


def _unswap(restores: list[Callable[[], None]], saved: Backend) -> None:
    global _swapped, current
    try:
        for undo in reversed(restores):
            undo()
    finally:
        current = saved
        _swapped = None


def cuda() -> Backend:
    """CUDA's backend (whether or not a fake is installed): what a record
    made without naming its backend asks."""
    return _cuda_backend


def install_cuda(backend: Backend) -> None:
    """Make ``backend`` CUDA's: :data:`current` while no fake is installed
    (called once, by ``_cuda`` at import, which assembles it from the
    seam's modules, all above this one)."""
    global current, _cuda_backend
    with _swap_lock:
        _cuda_backend = backend
        if _swapped is None:
            current = backend
