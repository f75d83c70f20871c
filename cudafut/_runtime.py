"""CUDA's start-up and devices: the first part of the seam, below the others.

CuPy is imported on first use, so ``import cudafut`` works on a machine
without a GPU; the first call that needs CUDA raises
:class:`CudaUnavailableError` with the reason. A child forked after CUDA
was initialised refuses every call (:func:`check_usable`). The devices:
their count, checks of an index, the current one, a block with another
current (:class:`on_device`).

Callers reach these functions through :mod:`cudafut._cuda`, and those of
the backend interface through ``_backend.current`` (as this module's own
calls to them do, so that cudafut.testing's fake and a test's replacement
reach every caller).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

from . import _backend, _lifetimes
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
        "the NVIDIA driver is older than the CUDA version CuPy was "
        "built for; install a newer driver, or the cudafut extra that matches "
        "it ('cudafut[cuda12]' or 'cudafut[cuda13]')"
    ),
    100: ("no CUDA-capable device is visible; check `nvidia-smi` and the CUDA_VISIBLE_DEVICES variable"),
    3: "the CUDA driver failed to initialise; check `nvidia-smi` and dmesg",
    999: "the CUDA driver reported an unknown error; check `nvidia-smi`",
}

#: Status 35 where the driver's library is not there at all: not "older".
_NO_DRIVER: Final = (
    "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded); on a machine "
    "with an NVIDIA GPU, install its driver (https://www.nvidia.com/drivers)"
)


@functools.cache
def _driver_installed() -> bool:
    """Whether the driver's library loads (only asked after CUDA failed;
    once: a failed load costs a search of the library path)."""
    import ctypes

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


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
            if exc.status == 35 and not _driver_installed():
                hint = _NO_DRIVER
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
    _backend.current.runtime()
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
    n = _backend.current.device_count()
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
    return int(_backend.current.runtime().getDevice())


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
        rt = self._rt = _backend.current.runtime()
        prev = self._prev = rt.getDevice()
        if prev != self._device:
            rt.setDevice(self._device)

    def __exit__(self, *exc: object) -> None:
        if self._prev != self._device:
            self._rt.setDevice(self._prev)


def pointer_device(ptr: int) -> int:
    """The device that owns a device pointer."""
    return int(_backend.current.runtime().pointerGetAttributes(ptr).device)


def use_device(device: int) -> None:
    """Make ``device`` the calling thread's current device, for CuPy too
    (``cupy.cuda.Device(device).use()``: a ``cudaSetDevice``, under a µs)."""
    _backend.current.cupy().cuda.Device(device).use()


def initialise() -> None:
    """Initialise CUDA in this process, once (later calls cost a global
    read).

    Raises:
        CudaUnavailableError: CUDA cannot be used here (and under
            cudafut.testing's fake CUDA, which has no runtime).
    """
    _backend.current.runtime()


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
    rt = _backend.current.runtime()
    with _backend.current.on_device(device):
        rt.deviceSynchronize()


def _swap_count(backend: Any) -> Callable[[], None]:
    # check_device()'s fast path reads the count of the backend in force:
    # the fake's while it is installed (its first hook: registered first).
    global _count
    saved, _count = _count, backend.device_count()

    def restore() -> None:
        global _count
        _count = saved

    return restore


_backend.on_swap(_swap_count)
