"""The seam to CUDA: start-up and devices, and the namespace every caller
reaches CUDA through.

This module initialises CUDA (CuPy imported on first use, so ``import
cudafut`` works on a machine without a GPU; the first call that needs CUDA
raises :class:`CudaUnavailableError` with the reason), refuses it in a
forked child, and answers for devices. The seam's other jobs live in
modules of their own, re-exported here, and callers call every function
here as ``_cuda.name(...)``, looked up at each call:

=====================  ==================================================
``_streams``           stream handles, CuPy's current streams, new streams
``_event_calls``       CUDA's event calls and stream waits
``_notices``           CUDA closes a descriptor when work ends
``_copy_calls``        copies and pinned host memory
``_cupy_objects``      CuPy's allocator, CUDA graphs
``_ipc``               interprocess events and memory, PCI bus ids
``_backend``           the swap: cudafut.testing's fake in place of CUDA
=====================  ==================================================

:func:`cudafut._backend.swap` rebinds the functions of :data:`SEAM` in this
namespace (:func:`replace_seam`), and those modules call each other's
functions through it too, so that the fake, and a test's replacement of
one function, reach every caller.

Costs (measured with CuPy 14.2, see docs/performance.md): an event record is
under 1 µs, a query about 1.7 µs and holds the GIL, a stream wait about
0.4 µs and releases the GIL.

The native core (cudafut/_core.pyx) makes the event calls of its records
from C where it can, and comes here for the rest; each record asks the
backend that made it through :class:`RecordCalls`, so that the fake's
records never reach CUDA.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from . import _lifetimes
from ._errors import CudaError, CudaUnavailableError

# Re-entrant: a finalizer the garbage collector runs during the first
# initialisation (a cudafut-allocated block's, which records an event) calls
# runtime() on the same thread; the nested call initialises, and the hooks
# it runs twice (the allocator's install) do nothing the second time.
_init_lock = threading.RLock()
#: Called with the cupy module once CUDA is found usable (see on_initialise()).
_init_hooks: list[Callable[[Any], None]] = []
_cupy: Any = None
_rt: Any = None
_count = 0

_DRIVER_HINTS = {
    35: (
        "the NVIDIA driver is missing or older than the CUDA version CuPy was "
        "built for; install a newer driver, or the cudafut extra that matches "
        "it ('cudafut[cuda12]' or 'cudafut[cuda13]')"
    ),
    100: ("no CUDA-capable device is visible; check `nvidia-smi` and the CUDA_VISIBLE_DEVICES variable"),
    3: "the CUDA driver failed to initialise; check `nvidia-smi` and dmesg",
    999: "the CUDA driver reported an unknown error; check `nvidia-smi`",
}

#: Ends every message of a machine without a usable GPU: the fake GPU.
NO_GPU_TESTING: Final = "or test without a GPU: cudafut.testing (docs/testing.md)"

_FORK_MESSAGE = (
    "CUDA cannot be used in a process forked after CUDA was initialised in its "
    "parent (CUDA does not survive fork()); start worker processes with "
    "multiprocessing's 'spawn' or 'forkserver' method, or initialise CUDA only "
    "in the children"
)


class _Forked:
    """Stands in for CuPy in a forked child: every use raises, clearly."""

    def __getattr__(self, name: str) -> Any:
        raise CudaUnavailableError(_FORK_MESSAGE)


#: True in a child forked after CUDA was initialised: see check_usable().
forked = False


def _after_fork_in_child() -> None:
    # Registered before any other module's reset (_notices' among them): the
    # child refuses CUDA before anything else is reset.
    global _cupy, _rt, forked
    if _rt is not None:  # CUDA was initialised in the parent
        _cupy = _rt = _Forked()
        forked = True


def check_usable() -> None:
    """Raise the fork error in a forked child (a flag test: costs nothing).

    Called at every entry point, because some calls would otherwise reach
    CuPy through an array (``__cuda_array_interface__``) or return a value
    the parent computed as if nothing had happened."""
    if forked:
        raise CudaUnavailableError(_FORK_MESSAGE)


_lifetimes.at_fork_in_child(_after_fork_in_child)


def runtime() -> Any:
    """``cupy.cuda.runtime``, after checking once that CUDA is usable."""
    rt = _rt
    if rt is None:
        rt = _initialise()
    return rt


def cupy() -> Any:
    """The ``cupy`` module, after checking once that CUDA is usable."""
    if _rt is None:  # set last, after the hooks (the allocator's wrapper) ran
        _initialise()
    return _cupy


def _initialise() -> Any:
    global _cupy, _rt, _count
    with _init_lock:
        if _rt is not None:
            return _rt
        try:
            # import_module, not an import statement: compiled, the statement
            # would take a None in sys.modules (a blocked CuPy) for the module.
            cp = importlib.import_module("cupy")
        except ImportError as exc:
            raise CudaUnavailableError(
                "CuPy is not installed. Install cudafut with the extra that "
                "matches your CUDA driver: pip install 'cudafut[cuda12]' or "
                f"'cudafut[cuda13]'; {NO_GPU_TESTING}"
            ) from exc
        rt = cp.cuda.runtime
        try:
            count = rt.getDeviceCount()
        except rt.CUDARuntimeError as exc:
            hint = _DRIVER_HINTS.get(exc.status, "CUDA could not be initialised")
            raise CudaUnavailableError(f"{hint} (CUDA said: {exc}); {NO_GPU_TESTING}") from exc
        if count == 0:
            raise CudaUnavailableError(f"{_DRIVER_HINTS[100]}; {NO_GPU_TESTING}")
        _cupy, _count = cp, count
        for hook in _init_hooks:
            hook(cp)
        _rt = rt
        return rt


def on_initialise(hook: Callable[[Any], None]) -> None:
    """Call ``hook(cupy)`` when cudafut first finds CUDA usable (at once if
    it has), and, if CuPy is imported already, now: hooks must not need the
    GPU (the allocator wrapper of ``_memory``)."""
    _init_hooks.append(hook)
    cp = _cupy if _cupy is not None else sys.modules.get("cupy")
    if cp is not None and hasattr(cp, "cuda"):
        hook(cp)


def device_count() -> int:
    """Number of visible CUDA devices; raises if CUDA is unusable."""
    runtime()
    return _count


def check_device(device: object) -> int:
    """Validate a device index and return it as an int.

    The argument is checked before CUDA is touched, so a wrong type or a
    negative index is a ``TypeError`` or ``ValueError`` even where CUDA
    cannot be used; only an index that may exist needs the device count.

    Raises:
        TypeError: ``device`` is not an int.
        ValueError: ``device`` is negative, or not below the device count.
        CudaUnavailableError: CUDA cannot be used here.
    """
    if type(device) is int and 0 <= device < _count:
        return device  # the common case, once CUDA is initialised
    device = check_device_argument(device)
    n = device_count()
    if not 0 <= device < n:
        raise ValueError(
            f"device {device} is out of range: this process sees {n} CUDA "
            f"device(s), numbered 0 to {n - 1} (see CUDA_VISIBLE_DEVICES)"
        )
    return device


def check_device_argument(device: object) -> int:
    """What can be checked of a device index without CUDA: an int, not negative.

    Raises:
        TypeError: ``device`` is not an int.
        ValueError: ``device`` is negative.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"a device is an int index (a CUDA device ordinal: 0, 1, ...), not {device!r}")
    if device < 0:
        raise ValueError(
            f"device {device} is out of range: CUDA devices are numbered from 0 (see CUDA_VISIBLE_DEVICES)"
        )
    return device


def current_device() -> int:
    return int(runtime().getDevice())


class on_device:  # noqa: N801 - used as a function: ``with on_device(d):``
    """Make ``device`` current for the block, restoring the previous one.

    Costs one ``cudaGetDevice``, plus two ``cudaSetDevice`` when the
    device is not current already. A class rather than a
    ``contextlib.contextmanager``: the copies and event calls enter one or
    more per operation, and a generator-based context costs about 1 µs
    more each. One instance serves one ``with`` at a time."""

    __slots__ = ("_device", "_prev", "_rt")

    def __init__(self, device: int) -> None:
        self._device = device

    def __enter__(self) -> None:
        rt = self._rt = runtime()
        prev = self._prev = rt.getDevice()
        if prev != self._device:
            rt.setDevice(self._device)

    def __exit__(self, *exc: object) -> None:
        if self._prev != self._device:
            self._rt.setDevice(self._prev)


def pointer_device(ptr: int) -> int:
    """The device that owns a device pointer."""
    return int(runtime().pointerGetAttributes(ptr).device)


def use_device(device: int) -> None:
    """Make ``device`` the calling thread's current device, for CuPy too
    (``cupy.cuda.Device(device).use()``: a ``cudaSetDevice``, under a µs)."""
    cupy().cuda.Device(device).use()


def initialise() -> None:
    """Initialise CUDA in this process, once (later calls cost a global
    read).

    Raises:
        CudaUnavailableError: CUDA cannot be used here (and under
            cudafut.testing's fake CUDA, which has no runtime).
    """
    runtime()


def cuda_error(code: int, device: int | None = None, *, driver: bool = False) -> CudaError:
    """A :class:`CudaError` for a raw status, with CUDA's name and text: a
    runtime ``cudaError_t``, or with ``driver=True`` a driver ``CUresult``."""
    name, description = (f"CUresult {code}", "") if driver else ("", "")
    if _cupy is not None and not forked:
        error = _cupy.cuda.driver.CUDADriverError if driver else _cupy.cuda.runtime.CUDARuntimeError
        # CuPy formats the message as "<name>: <description>".
        name, _, description = str(error(code)).partition(": ")
    return CudaError(code, name, description, device=device)


def initialised() -> bool:
    """Whether CUDA is initialised in this process (and usable: not in a
    forked child); never initialises it."""
    return _rt is not None and not forked


def devices_of_host_value() -> tuple[int, ...]:
    """The devices a value holding no GPU array is recorded on, where the
    caller named none: none with CUDA (``set_result()`` refuses it); the
    current device under :mod:`cudafut.testing`'s fake, whose device arrays
    are NumPy arrays. Called only on that refusal's path."""
    return ()


def device_synchronize(device: int) -> None:
    """``cudaDeviceSynchronize`` on ``device``: block the calling thread (CuPy
    releases the GIL) until all of this process's work there has ended."""
    rt = runtime()
    with on_device(device):
        rt.deviceSynchronize()


def replace_seam(functions: Mapping[str, Any], count: int) -> tuple[dict[str, Any], int]:
    """Rebind this namespace's functions named in ``functions`` and the
    device count (``device_count()``'s, ``check_device``'s fast path);
    return what they were, for the swap (:func:`cudafut._backend.swap`) to
    put back. A dictionary update: costs the functions nothing."""
    global _count
    namespace = globals()
    saved = {name: namespace[name] for name in functions}
    saved_count, _count = _count, count
    namespace.update(functions)
    return saved, saved_count


# -- the seam's other jobs, re-exported: callers call them here --------------------------
# Imported last: each of these modules calls this one's functions (looked up
# at each call), and the fork reset above must be registered before theirs.
from ._backend import CUDA as CUDA  # noqa: E402
from ._backend import NOT_FAKED as NOT_FAKED  # noqa: E402
from ._backend import SEAM as SEAM  # noqa: E402
from ._backend import Backend as Backend  # noqa: E402
from ._backend import RecordCalls as RecordCalls  # noqa: E402
from ._backend import faked as faked  # noqa: E402
from ._backend import on_swap as on_swap  # noqa: E402
from ._backend import record_calls as record_calls  # noqa: E402
from ._backend import swap as swap  # noqa: E402
from ._copy_calls import free_host as free_host  # noqa: E402
from ._copy_calls import host_alloc as host_alloc  # noqa: E402
from ._copy_calls import memcpy_to_device as memcpy_to_device  # noqa: E402
from ._copy_calls import memcpy_to_host as memcpy_to_host  # noqa: E402
from ._copy_calls import pointer_is_pinned as pointer_is_pinned  # noqa: E402
from ._cupy_objects import capture_cupy_graph as capture_cupy_graph  # noqa: E402
from ._cupy_objects import cupy_allocator as cupy_allocator  # noqa: E402
from ._cupy_objects import cupy_module as cupy_module  # noqa: E402
from ._cupy_objects import imported_cupy as imported_cupy  # noqa: E402
from ._cupy_objects import owner_of as owner_of  # noqa: E402
from ._cupy_objects import replay_cupy_graph as replay_cupy_graph  # noqa: E402
from ._cupy_objects import set_cupy_allocator as set_cupy_allocator  # noqa: E402
from ._cupy_objects import wrap_cupy_allocator as wrap_cupy_allocator  # noqa: E402
from ._event_calls import NOT_READY as NOT_READY  # noqa: E402
from ._event_calls import event_create as event_create  # noqa: E402
from ._event_calls import event_destroy as event_destroy  # noqa: E402
from ._event_calls import event_elapsed_ms as event_elapsed_ms  # noqa: E402
from ._event_calls import event_error as event_error  # noqa: E402
from ._event_calls import event_query as event_query  # noqa: E402
from ._event_calls import event_record as event_record  # noqa: E402
from ._event_calls import event_synchronize as event_synchronize  # noqa: E402
from ._event_calls import stream_wait as stream_wait  # noqa: E402
from ._event_calls import timing_event_create as timing_event_create  # noqa: E402
from ._ipc import array_over as array_over  # noqa: E402
from ._ipc import device_bus_id as device_bus_id  # noqa: E402
from ._ipc import device_of_bus_id as device_of_bus_id  # noqa: E402
from ._ipc import ipc_close_memory as ipc_close_memory  # noqa: E402
from ._ipc import ipc_event_create as ipc_event_create  # noqa: E402
from ._ipc import ipc_memory_handle as ipc_memory_handle  # noqa: E402
from ._ipc import ipc_open_event as ipc_open_event  # noqa: E402
from ._ipc import ipc_open_memory as ipc_open_memory  # noqa: E402
from ._notices import close_after as close_after  # noqa: E402
from ._notices import notice_stream as notice_stream  # noqa: E402
from ._notices import set_native_notices as set_native_notices  # noqa: E402
from ._streams import PAGE_SIZE as PAGE_SIZE  # noqa: E402
from ._streams import call_on_streams as call_on_streams  # noqa: E402
from ._streams import check_stream_address as check_stream_address  # noqa: E402
from ._streams import cupy_stream as cupy_stream  # noqa: E402
from ._streams import current_stream as current_stream  # noqa: E402
from ._streams import current_stream_getter as current_stream_getter  # noqa: E402
from ._streams import mapped_pages as mapped_pages  # noqa: E402
from ._streams import new_stream as new_stream  # noqa: E402
from ._streams import stream_device as stream_device  # noqa: E402
from ._streams import stream_handle as stream_handle  # noqa: E402
from ._streams import stream_synchronize as stream_synchronize  # noqa: E402

if TYPE_CHECKING:  # mypy: this namespace's functions implement the interface
    from . import _cuda as _this

    _implements: Backend = _this
