"""The producers: :func:`record` (a future for GPU work already enqueued),
:func:`submit` (run a function on a pool stream now) and
:func:`settle_launched` (:func:`cudafut.launch`'s, on a launcher thread).

Each makes its future through the internal interface
(cudafut/_interface.py) and settles it from a function through
``_future.settle``, looked up at each call (the mutation check replaces
it). The native core's fast path of ``record()`` is bound here at import,
where that core runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from . import _backend, _checks, _compiled, _cuda, _events, _future, _pools, _runtime, _torch
from ._engine import record_consumers
from ._future import CudaFuture, Priority
from ._interface import fail_future, new_future, set_future
from ._values import consumer_on, find_devices, order_foreign

__all__ = ["record", "settle_launched", "submit"]

T = TypeVar("T")
U = TypeVar("U")

#: What submit() says to do instead of a coroutine function.
_SUBMIT_INSTEAD: Final = (
    "Pass a plain function (def) that enqueues the GPU work and returns its value, and await "
    "async code on your loop itself (a cudafut.Batcher's run_batch may be async)"
)


def record(value: T, *, stream: Any = None, keep: object = None) -> CudaFuture[T]:
    """A future, already set, for GPU work already enqueued.

    Records one event on ``stream`` (a CuPy or PyTorch stream, or any object
    with ``__cuda_stream__``) or, by default, on the current stream of each
    device of ``value`` (with PyTorch imported, PyTorch's current stream for
    the torch CUDA tensors in ``value``, a few µs more). Costs about 1 µs
    per event on the host; blocks neither the thread nor the GPU.

    ``keep``: objects the recorded work reads, kept alive until the events
    complete, even if every other reference is dropped. CuPy arrays taken
    from a future need no ``keep``: the consumer's streams are recorded on
    their memory (:func:`cudafut.record_stream`). Pass ``keep`` for what
    cudafut cannot see: memory of other libraries or allocators, or arrays
    used on a stream cudafut did not order::

        v = fut.wait()
        out = cudafut.record(v + 1)  # v may be dropped now
        out2 = cudafut.record(torch_op(t), keep=t)  # keep a torch input alive

    Arrays of other libraries in ``value`` are ordered before the stream
    recorded on first (JAX's by DLPack, Numba's by their stream:
    docs/interop.md, "Work queued by other libraries").

    Raises:
        ValueError: no ``stream`` and ``value`` holds no GPU array (a NumPy
            array is a host array: copy it with :func:`to_device`); or
            ``value`` holds an array whose producer cannot be ordered.
    """
    if _runtime.forked:  # a flag test, without a call
        _runtime.check_usable()
    if stream is None:
        order_foreign(value)  # docs/design.md, hazard 9
        torch = _torch.loaded()
        if torch is None:
            records = tuple(_events.record_current(d) for d in find_devices(value))
        else:  # torch tensors are recorded on PyTorch's current streams
            records = _torch.record_value(torch, value, None)
        if not records:  # under cudafut.testing's fake: its current device
            records = tuple(_events.record_current(d) for d in _backend.current.devices_of_host_value())
        if not records:
            if hasattr(value, "__array_interface__"):  # NumPy's (or another host array's)
                raise ValueError(
                    f"record() got a host array ({type(value).__module__}.{type(value).__name__}), "
                    "which it does not take: it records GPU work, and a host array is on no GPU. "
                    "Copy it to the GPU first (cudafut.to_device() returns its future), or pass "
                    "stream=... if GPU work on that stream produces it; to test without a GPU, use "
                    "cudafut.testing's fake GPU, where NumPy arrays stand for GPU arrays "
                    "(docs/testing.md)"
                )
            raise ValueError(
                f"record() got a value on no GPU ({type(value).__name__}); pass "
                "stream=... to say which stream produces it"
            )
    else:
        ptr, device = _cuda.stream_handle(stream)
        order_foreign(value, lambda _d: (ptr, device))
        records = (_events.record(ptr, device, None, stream),)
    return set_future(value, records, keep, "record")


@overload
def submit(
    fn: Callable[..., CudaFuture[U]],
    /,
    *args: Any,
    device: int | None = ...,
    priority: Priority = ...,
    **kwargs: Any,
) -> CudaFuture[U]: ...
@overload
def submit(
    fn: Callable[..., U], /, *args: Any, device: int | None = ..., priority: Priority = ..., **kwargs: Any
) -> CudaFuture[U]: ...
def submit(
    fn: Callable[..., Any],
    /,
    *args: Any,
    device: int | None = None,
    priority: Priority = "normal",
    **kwargs: Any,
) -> CudaFuture[Any]:
    """Run ``fn(*args, **kwargs)`` now, on a pool stream; return its future.

    ``fn`` runs synchronously in the calling thread with a pool stream of
    ``device`` (default: the current device) made current. That stream first
    waits for the work already enqueued on the caller's current stream, so
    ``fn`` sees inputs the caller produced (other libraries' arrays among
    ``args`` are ordered before it as :func:`record` orders them). The future's events are recorded
    on the pool stream after ``fn`` returns; an exception from ``fn`` is
    stored in the future. The future keeps ``args`` and ``kwargs`` alive until
    its events complete. Host cost: ``fn`` plus a few µs; the GPU is not
    synchronised.

    ``fn`` must be a plain function: a coroutine function (``async def``,
    a :func:`functools.partial` of one, or an object whose ``__call__`` is
    one) is refused before anything is enqueued; a plain ``fn`` that returns
    a coroutine fails the future with :class:`TypeError`, the coroutine
    closed.

    Raises:
        TypeError: ``fn`` is not callable, or is a coroutine function, or
            ``device`` is not an int.
        ValueError: ``device`` is out of range, or ``priority`` is neither
            ``"normal"`` nor ``"high"``.
    """
    _checks.check_callable(fn, "submit()")
    _checks.not_async(fn, "submit()", "at once, in the calling thread", _SUBMIT_INSTEAD)
    prio = _pools.check_priority(priority)
    if _runtime.forked:  # a flag test, without a call
        _runtime.check_usable()
    dev = _backend.current.current_device() if device is None else _cuda.check_device(device)
    stream = _pools.streams.get(dev, prio)
    ptr = int(stream.ptr)
    for rec in _torch.current_records(dev):  # the caller's CuPy and torch streams
        rec.wait_on(ptr, dev)
    order_foreign((args, kwargs), lambda _d: (ptr, dev))  # and JAX's streams
    record_consumers((args, kwargs), {dev: stream}, untracked=False)
    fut: CudaFuture[Any] = new_future("submit")
    _future.settle(fut, fn, args, kwargs, {dev: stream}, (args, kwargs))
    return fut


def settle_launched(
    fut: CudaFuture[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    streams: Mapping[int, Any],
) -> None:
    """For :func:`cudafut.launch`, on a launcher thread: run ``fn`` with
    ``streams`` current and complete ``fut`` from it, as :func:`submit`
    does; ``args`` and ``kwargs`` are consumed on ``streams`` and kept alive
    until ``fut``'s events complete."""
    keep = (args, kwargs)
    try:  # other libraries' arrays among the arguments, as submit() orders them
        order_foreign(keep, consumer_on(streams))
    except Exception as exc:  # noqa: BLE001 - the future carries it
        fail_future(fut, exc)
        return
    # The launcher's stream is known to read them (not guessed): untracked
    # arrays are recorded too.
    record_consumers(keep, streams, untracked=True)
    _future.settle(fut, fn, args, kwargs, streams, keep)


# Where the native core runs (cudafut/_core.pyx), cudafut.record is its
# function: its path for a known stream, or one CuPy array, without a Python
# frame, and record() above (the reference twin, CUDAFUT_PURE=1) for every
# other case; help() and the docs read the twin's.
_native = _compiled.native()
if _native is not None and not TYPE_CHECKING:  # typed as the function above
    _native.bind_record(record)
    _entry = _native.future_record
    for _attr in ("__doc__", "__name__", "__qualname__", "__module__"):
        setattr(_entry, _attr, getattr(record, _attr))
    _entry.__signature__ = inspect.signature(record)
    record = _entry
    del _entry, _attr
