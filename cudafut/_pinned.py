"""Pinned (page-locked) host memory: cudafut's pool, with a cap.

Only pinned memory can be copied to or from the GPU asynchronously at full
bandwidth (docs/memory.md). Pinning is slow (``cudaHostAlloc`` takes about a
millisecond per hundred MB and may synchronise the device when freed), so
blocks are cached and reused: sizes are rounded up to a power of two from
4 KB to 16 MB, and to a multiple of 16 MB above, and a freed block waits in
its size class for the next request of that class.

The pool never holds more than its limit (:func:`set_pinned_limit`; a
quarter of the machine's memory by default) in use and cached together:
past it, cached blocks are freed first, and then a request fails
(:func:`empty_pinned` raises ``MemoryError``; :func:`cudafut.to_host` falls
back to pageable memory).

A block goes back to the pool when the last object using it is garbage
collected, and not before the GPU work that reads or writes it (its
*guard*, a set of event records) is complete: a NumPy array dropped while a
copy into it is still running cannot hand its memory to someone else.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from . import _backend, _cuda, _lifetimes
from ._errors import CudaError
from ._events import EventRecord

__all__ = [
    "Allocation",
    "HostBuffer",
    "PinnedPool",
    "empty_pinned",
    "get_pinned_limit",
    "pool",
    "set_pinned_limit",
]

_PAGE: Final = 4096
_LARGE: Final = 16 << 20
# cudaErrorMemoryAllocation: cudaHostAlloc could not pin that much.
_OUT_OF_MEMORY: Final = 2
#: The most dimensions a NumPy array may have (64 in NumPy 2, 32 before).
_MAX_DIMS: Final = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
#: The largest array, in bytes, that NumPy (and the address space) allows.
_MAX_BYTES: Final = int(np.iinfo(np.intp).max)


def size_class(nbytes: int) -> int:
    """The size of the block that serves a request of ``nbytes``."""
    if nbytes <= _PAGE:
        return _PAGE
    if nbytes <= _LARGE:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // _LARGE) * _LARGE


def _default_limit() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return max(total // 4, 64 << 20)


class Allocation:
    """One pinned block of the pool; it returns to the pool when garbage."""

    __slots__ = ("__weakref__", "pool", "ptr", "size")

    def __init__(self, pool: PinnedPool, ptr: int, size: int) -> None:
        self.pool = pool
        self.ptr = ptr
        self.size = size

    def __del__(self) -> None:
        try:  # noqa: SIM105 - a finalizer must not raise (e.g. at shutdown)
            self.pool.give_back(self.ptr, self.size)
        except Exception:  # noqa: BLE001
            pass


class HostBuffer:
    """A NumPy-visible view of an :class:`Allocation`, and its guard.

    ``numpy.asarray(buffer)`` is an array whose ``base`` is this object, so
    the block lives as long as any view of it. ``guard``: records of GPU
    work that reads or writes the block; when the buffer is garbage while one
    is pending, the block is kept (by the watcher thread) until they
    complete, and only then returns to the pool.
    """

    __slots__ = ("__array_interface__", "allocation", "guard")

    def __init__(self, allocation: Allocation, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.allocation = allocation
        self.guard: Sequence[EventRecord] = ()
        interface: dict[str, Any] = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "data": (allocation.ptr, False),
            "strides": None,
        }
        if dtype.fields is not None:
            interface["descr"] = dtype.descr
        self.__array_interface__ = interface

    def __del__(self) -> None:
        guard = self.guard
        if not guard:
            return
        try:
            _lifetimes.keep_until(guard, self.allocation)
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            # The guard could not be checked (CUDA failed at that moment): a
            # copy may still be writing the block, so it is never reused.
            _lifetimes.keep_forever(self.allocation)


class PinnedPool:
    """The pinned host memory cudafut copies through, with a cap.

    Thread-safe. Taking a cached block costs about a µs; a new block costs a
    ``cudaHostAlloc`` (about 1 ms per 100 MB, blocking the calling thread).
    """

    def __init__(self) -> None:
        # Re-entrant: an Allocation's finalizer gives its block back, and the
        # GC may run it while this thread holds the lock.
        self._lock = threading.RLock()
        self._free: dict[int, list[int]] = {}
        self._limit: int | None = None
        self.in_use = 0  # bytes of blocks handed out
        self.cached = 0  # bytes of blocks waiting in the free lists
        self.blocks_in_use = 0
        self.host_allocs = 0  # cudaHostAlloc calls since the start
        self.failures = 0  # requests refused: the limit, or CUDA could not pin more
        self.pin_failures = 0  # ... of them, cudaHostAlloc out of memory

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = _default_limit()
        return self._limit

    def set_limit(self, nbytes: int) -> int:
        """Set the limit; return the previous one."""
        with self._lock:
            old = self.limit
            self._limit = nbytes
            self._trim(nbytes - self.in_use)
            return old

    def take_cached(self, nbytes: int) -> Allocation | None:
        """A cached block of at least ``nbytes``, or None when none is free
        (never a ``cudaHostAlloc``: about a µs either way)."""
        size = size_class(nbytes)
        with self._lock:
            ptr = self._pop_free(size)
        return None if ptr == 0 else Allocation(self, ptr, size)

    def _pop_free(self, size: int) -> int:
        """A free block of ``size`` counted as in use, or 0 when none is
        cached. The caller holds the lock."""
        free = self._free.get(size)
        if not free:
            return 0
        ptr = free.pop()
        self.cached -= size
        self.in_use += size
        self.blocks_in_use += 1
        return ptr

    def take(self, nbytes: int) -> Allocation | None:
        """A block of at least ``nbytes``, or None past the limit or when
        CUDA cannot pin that much more (``cudaErrorMemoryAllocation``).

        Raises:
            CudaError: ``cudaHostAlloc`` failed otherwise.
        """
        size = size_class(nbytes)
        with self._lock:
            ptr = self._pop_free(size)
            if ptr != 0:
                return Allocation(self, ptr, size)
            if self.in_use + self.cached + size > self.limit:
                self._trim(self.limit - self.in_use - size)
                if self.in_use + size > self.limit:
                    self.failures += 1
                    return None
            self.in_use += size
            self.blocks_in_use += 1
        try:
            ptr = _backend.current.host_alloc(size)
        except BaseException as exc:
            with self._lock:
                self.in_use -= size
                self.blocks_in_use -= 1
                if isinstance(exc, CudaError) and exc.code == _OUT_OF_MEMORY:
                    # The machine cannot pin that much: refused as past
                    # the limit (to_host then copies into pageable memory).
                    self.failures += 1
                    self.pin_failures += 1
                    return None
            raise
        with self._lock:
            self.host_allocs += 1
        return Allocation(self, ptr, size)

    def give_back(self, ptr: int, size: int) -> None:
        with self._lock:
            self.in_use -= size
            self.blocks_in_use -= 1
            if self.in_use + self.cached + size <= self.limit:
                self._free.setdefault(size, []).append(ptr)
                self.cached += size
                return
        if not sys.is_finalizing():
            _backend.current.free_host(ptr)

    def free_cached(self) -> int:
        """Free every cached block; return the bytes freed.

        Blocks the calling thread for a ``cudaFreeHost`` per block, which may
        wait for the whole device to be idle.
        """
        with self._lock:
            before = self.cached
            self._trim(0)
            return before

    def _trim(self, target: int) -> None:
        """Free cached blocks, largest first, until ``cached <= target``
        (under the lock)."""
        goal = max(target, 0)
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and self.cached > goal:
                ptr = free.pop()
                self.cached -= size
                _backend.current.free_host(ptr)

    def counts(self) -> tuple[int, int, int, int, int, int]:
        """(limit, in use, cached, blocks in use, host allocations, refusals)."""
        with self._lock:
            return (
                self.limit,
                self.in_use,
                self.cached,
                self.blocks_in_use,
                self.host_allocs,
                self.failures,
            )


pool: Final = PinnedPool()


def set_pinned_limit(nbytes: int) -> int:
    """Cap the pinned host memory cudafut holds (in use and cached), in bytes;
    return the previous cap.

    The default is a quarter of the machine's physical memory. Lowering the
    limit frees cached blocks at once (a ``cudaFreeHost`` each, which may
    wait for the device to be idle: call it at start-up, not in a hot loop);
    blocks in use are never taken back, they are freed instead of cached
    when they return while the pool is over the limit. Raising it, or
    lowering it with nothing cached, costs nothing and makes no CUDA call.
    Blocks the calling thread only for those frees (and, briefly, for the
    pool's lock).

    Returns:
        The previous limit, in bytes: ``set_pinned_limit(old)`` restores it.

    Raises:
        TypeError: ``nbytes`` is not an int.
        ValueError: ``nbytes`` is negative.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"the pinned memory limit is an int number of bytes, not {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"the pinned memory limit must be >= 0 bytes, not {nbytes}")
    return pool.set_limit(nbytes)


def get_pinned_limit() -> int:
    """The cap on the pinned host memory cudafut holds, in bytes (see
    :func:`set_pinned_limit`; also ``memory_statistics().pinned_limit``).

    Costs nothing (the first call of the process reads the machine's
    physical memory size); no CUDA call; blocks nothing.
    """
    return pool.limit


def check_shape(shape: object) -> tuple[int, ...]:
    """A shape argument as a tuple of non-negative ints.

    Raises:
        TypeError: not an int or a sequence of ints.
        ValueError: a negative dimension.
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: tuple[object, ...] = (shape,)
    elif isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        dims = tuple(shape)
    else:
        raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}")
        if d < 0:
            raise ValueError(f"shape must not have negative dimensions: {shape!r}")
        out.append(operator.index(d))
    if len(out) > _MAX_DIMS:
        raise ValueError(f"a NumPy array has at most {_MAX_DIMS} dimensions, not {len(out)}")
    return tuple(out)


def check_size(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    """The bytes an array of ``shape`` and ``dtype`` takes, computed exactly.

    Raises:
        ValueError: more than any array can hold (the address space: about
            9.2e18 bytes on 64-bit machines), whatever memory is free.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _MAX_BYTES or (dtype.itemsize == 0 and math.prod(shape) > _MAX_BYTES):
        raise ValueError(
            f"an array of shape {shape} and dtype {dtype} would take {nbytes} bytes, more than any "
            f"array can hold ({_MAX_BYTES} bytes); check the shape"
        )
    return nbytes


def host_array(
    shape: tuple[int, ...], dtype: np.dtype[Any], *, cached_only: bool = False
) -> tuple[np.ndarray[Any, Any], HostBuffer] | None:
    """A C-contiguous array in pinned memory from the pool, and its buffer
    (to set the guard on); None past the pool's limit, or when CUDA cannot
    pin that much, or (``cached_only``) when no cached block is free.

    Raises:
        ValueError: larger than any array can be (:func:`check_size`).
    """
    nbytes = check_size(shape, dtype)
    size = max(nbytes, 1)
    allocation = pool.take_cached(size) if cached_only else pool.take(size)
    if allocation is None:
        return None
    buffer = HostBuffer(allocation, shape, dtype)
    return np.asarray(buffer), buffer


def empty_pinned(shape: int | Sequence[int], dtype: Any = float) -> np.ndarray[Any, Any]:
    """A new, uninitialised, C-contiguous NumPy array in pinned host memory.

    From cudafut's pinned pool: the memory returns to the pool when the array
    (and every view of it) is garbage collected. Copies to and from it
    (:func:`cudafut.to_device`, :func:`cudafut.to_host` with ``out=``) are one
    ``cudaMemcpyAsync``, at full bandwidth, and never block the thread.

    Costs about a µs when the pool has a free block of the size class (a
    power of two up to 16 MB, a multiple of 16 MB above), otherwise a
    ``cudaHostAlloc`` of that size, which blocks the calling thread (about
    1 ms per 100 MB): allocate staging arrays once, at start-up, and reuse
    them.

    Raises:
        TypeError: ``shape`` is not an int or a sequence of ints, or
            ``dtype`` is not a NumPy dtype.
        ValueError: a negative dimension, more than NumPy's 64 dimensions,
            or a size no array can have (over 2**63 bytes), checked before
            CUDA is touched.
        MemoryError: the array would not fit: the pool's limit
            (:func:`set_pinned_limit`) would be exceeded, or CUDA cannot pin
            that much memory (``cudaHostAlloc`` out of memory); drop pinned
            arrays you no longer need, or raise the limit.
        CudaError: ``cudaHostAlloc`` failed otherwise.
        CudaUnavailableError: CUDA cannot be used here.
    """
    dims = check_shape(shape)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype must be a NumPy dtype, not {dtype!r}") from exc
    except ValueError as exc:
        raise ValueError(f"dtype {dtype!r} is not a valid NumPy dtype: {exc}") from exc
    if dt.hasobject:
        raise TypeError("pinned memory cannot hold Python objects (dtype=object)")
    nbytes = check_size(dims, dt)
    _cuda.check_usable()
    pin_failures = pool.pin_failures
    made = host_array(dims, dt)
    if made is None:
        limit, in_use, *_ = pool.counts()
        if pool.pin_failures != pin_failures:
            raise MemoryError(
                f"CUDA could not pin {nbytes} bytes of host memory (cudaHostAlloc: out of memory; "
                f"cudafut holds {in_use} bytes pinned): drop pinned arrays you no longer need, or "
                "lower the size"
            )
        raise MemoryError(
            f"{nbytes} bytes of pinned memory would exceed cudafut's pinned memory limit ({limit} "
            f"bytes): {in_use} bytes are in use; drop pinned arrays you no longer need, or raise the "
            "limit with cudafut.set_pinned_limit()"
        )
    return made[0]
