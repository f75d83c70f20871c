"""Bridges between CudaFutures and the other futures of Python programs.

- :func:`wrap_future` (``fut.to_asyncio()``): an :class:`asyncio.Future`;
- :func:`to_concurrent` (``fut.to_concurrent()``): a
  :class:`concurrent.futures.Future`;
- :func:`to_torch` (``fut.to_torch()``) and :func:`from_torch`: PyTorch's
  ``torch.futures.Future``, stream order kept both ways.

Every bridge is one done callback (or a ``then``-like listener, for the
stream-ordered torch path) on the CudaFuture: the machinery of
``add_done_callback``, with its waiters. Cancelling the other future never
cancels the CudaFuture: set GPU work cannot be taken back, and a CudaFuture
may have other consumers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable
from typing import Any, TypeVar

from . import _cuda, _loops, _torch, _waiter
from ._errors import CancelledError
from ._events import first_error
from ._future import _CANCELLED, _FAILED, _SET, CudaFuture

__all__ = ["from_torch", "to_concurrent", "to_torch", "wrap_future"]

T = TypeVar("T")


def settled(fut: CudaFuture[Any]) -> tuple[bool, Any, BaseException | None]:
    """``(cancelled, value, exception)`` of a completed future whose events
    completed (or failed). An exception handed over counts as retrieved here
    (the other future carries it now, and reports it if nobody asks), and
    starts from the traceback it had when it was stored."""
    state = fut._state
    if state is _CANCELLED:
        return True, None, None
    if state is _FAILED:
        fut._retrieved = True
        exc = fut._exception
        assert exc is not None
        return False, None, exc.with_traceback(fut._traceback)
    assert state is _SET, "settled() needs a completed future"
    error = first_error(fut._records)
    if error is not None:
        return False, None, error
    return False, fut._value, None


def _check_future(fut: object, what: str) -> None:
    if not isinstance(fut, CudaFuture):
        raise TypeError(f"{what} takes a CudaFuture, not {type(fut).__name__}")


# -- asyncio ------------------------------------------------------------------------------------


def wrap_future(fut: CudaFuture[T], *, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[T]:
    """An :class:`asyncio.Future` done when ``fut`` is done (GPU work complete).

    ``asyncio.wrap_future``'s counterpart for CudaFutures (that function
    takes only ``concurrent.futures.Future`` objects, and says so for a
    CudaFuture). Use it where asyncio wants a real future: callbacks that
    take an ``asyncio.Future`` (``add_done_callback`` with a context),
    libraries that check ``asyncio.isfuture``, code that hands the future to
    another thread's loop (``loop=``). A plain ``await fut`` needs none of
    this.

    The returned future gets ``fut``'s value, its exception (the same
    object, a :class:`CudaError` for failed GPU work) or, if ``fut`` was
    cancelled, is cancelled. **Cancelling the returned future cancels
    neither ``fut`` nor its GPU work**: the work is enqueued and cannot be
    taken back, and ``fut`` may have other consumers; the pending watch is
    dropped.

    Costs a few µs and blocks nothing. ``loop`` running in the calling
    thread (the default: the running loop): its waiter watches the GPU work
    as for ``await`` (a poll per loop iteration while the wait policy says
    spin, otherwise one per sleep of at most ``max_sleep_s``) and completes
    the future on the loop. Another thread's ``loop``: cudafut's watcher
    thread watches the work and hands the result over with
    ``loop.call_soon_threadsafe``. Callable from any thread.

    Raises:
        TypeError: ``fut`` is not a CudaFuture, or ``loop`` is not an
            asyncio event loop.
        RuntimeError: no ``loop`` given and no asyncio (or uvloop) loop runs
            in this thread (on trio, ``await`` the CudaFuture itself).
    """
    _check_future(fut, "wrap_future()")
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None:
        if running is None:
            raise RuntimeError(
                "wrap_future() and to_asyncio() make a future of the running asyncio (or uvloop) "
                "loop: call them in a coroutine, or pass loop=...; on trio, await the CudaFuture "
                "itself, and in threads use fut.to_concurrent()"
            )
        loop = running
    elif not isinstance(loop, asyncio.AbstractEventLoop):
        raise TypeError(f"loop must be an asyncio event loop, not {type(loop).__name__}")
    _cuda.check_usable()
    out: asyncio.Future[T] = loop.create_future()

    def copy(done: CudaFuture[T]) -> None:  # on the loop
        if out.done():
            return  # cancelled by its owner meanwhile
        cancelled, value, exc = settled(done)
        if cancelled:
            out.cancel()
        elif exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(value)

    if loop is running:
        callback = copy
        driver: _waiter.Driver | None = _loops.current_driver()
    else:
        target = loop

        def callback(done: CudaFuture[T]) -> None:  # in the watcher thread
            if not target.is_closed():
                target.call_soon_threadsafe(copy, done)

        driver = None
    fut._when_done(callback, driver or _waiter.thread_waiter())

    def forget(_out: asyncio.Future[T]) -> None:
        if out.cancelled():
            fut.remove_done_callback(callback)

    out.add_done_callback(forget)
    return out


# -- concurrent.futures --------------------------------------------------------------------------


def to_concurrent(fut: CudaFuture[T]) -> concurrent.futures.Future[T]:
    """A :class:`concurrent.futures.Future` done when ``fut`` is done.

    See :meth:`CudaFuture.to_concurrent`: cudafut's watcher thread watches
    the GPU work and completes the returned future there (its callbacks run
    in that thread); cancelling it cancels neither ``fut`` nor its GPU work.
    """
    _check_future(fut, "to_concurrent()")
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def copy(done: CudaFuture[T]) -> None:  # in the watcher thread
        cancelled, value, exc = settled(done)
        if cancelled:
            out.cancel()
            out.set_running_or_notify_cancel()
            return
        if not out.set_running_or_notify_cancel():
            return  # cancelled by its owner meanwhile
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(value)

    fut._when_done(copy, _waiter.thread_waiter())
    return out


# -- PyTorch -------------------------------------------------------------------------------------


def _torch_module(what: str) -> Any:
    torch = _torch.module()
    if torch is None:
        raise RuntimeError(f"{what} needs PyTorch, and cudafut never imports it: import torch first")
    return torch


def to_torch(fut: CudaFuture[T]) -> Any:
    """A ``torch.futures.Future`` completed like ``fut``: see
    :meth:`CudaFuture.to_torch`."""
    _check_future(fut, "to_torch()")
    torch = _torch_module("to_torch()")
    _cuda.check_usable()

    def tensor_devices() -> set[int]:
        return {t.get_device() for t in _torch.torch_tensors(torch, fut._value)}

    def ordered_by_torch(devices: Iterable[int]) -> bool:
        """Whether the events torch records at set_result(), for the devices of
        the torch CUDA tensors it finds in the value, cover every one of ours
        (torch refuses a tensor on a device the future was not made for)."""
        covered = tensor_devices()
        return covered <= set(devices) and {r.device for r in fut._records} <= covered

    # The torch future's devices are fixed now. A future already set is
    # known: with devices only if torch can order its value (for another
    # value, torch would pickle it at set_result() to look for tensors:
    # a copy to the host of every CuPy array). A pending one: the devices
    # given to CudaFuture(), if any.
    devices: tuple[int, ...] = ()
    if _torch.loaded() is not None:
        if fut._state is _SET:
            if first_error(fut._records) is None and ordered_by_torch(fut.devices):
                devices = fut.devices
        elif fut._state is not _CANCELLED and fut._devices:
            devices = fut._devices
    out = torch.futures.Future(devices=list(devices)) if devices else torch.futures.Future()

    def complete(done: CudaFuture[T]) -> None:
        if out.done():
            return  # completed by its owner
        cancelled, value, exc = settled(done)
        if cancelled:
            out.set_exception(CancelledError("the CudaFuture was cancelled before it was set"))
        elif exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(value)

    def on_set() -> None:  # in the thread that completes fut
        if fut._state is not _SET or first_error(fut._records) is not None:
            complete(fut)  # failed or cancelled: nothing to wait for
            return
        pending = [r for r in fut._records if r.status is None]
        if pending and devices and ordered_by_torch(devices):
            # torch records its events on its current streams at set_result():
            # make them wait on ours first.
            for rec in pending:
                rec.wait_on(_torch.current_handle(torch, rec.device), rec.device)
            complete(fut)
        elif pending:  # torch cannot order what it does not see: complete once done
            fut._when_done(complete, _waiter.thread_waiter())
        else:
            complete(fut)

    fut._on_set(on_set)
    return out


def from_torch(torch_future: Any, *, devices: int | Iterable[int] | None = None) -> CudaFuture[Any]:
    """A CudaFuture set when a ``torch.futures.Future`` completes, ordered like it.

    For the futures of ``torch.distributed`` (``work.get_future()``), RPC
    and ``torch.futures`` code: ``await`` them, chain them with
    :meth:`~CudaFuture.then`, gather them with cudafut's futures.

    torch runs the callback that sets the CudaFuture in the thread that
    completes the torch future (at once, in the calling thread, if it is
    complete already), with PyTorch's current streams set to streams that
    wait for the torch future's value (for a torch future with devices).
    The CudaFuture records its events there, on PyTorch's current stream of
    each device of the value (or of ``devices``): so it is done when that
    value is ready on the GPU, and ``then()``/``wait()`` on it order work
    after it. A value on no GPU (a torch future without CUDA tensors) sets
    the CudaFuture with no events: it is done when the torch future is. An
    error of the torch future fails the CudaFuture with it. Setting it runs
    the CudaFuture's pending ``then()`` callbacks in that same thread, as
    :meth:`~CudaFuture.set_result` does.

    A torch future made without ``devices`` whose value holds CUDA tensors
    gives torch no streams to order on (torch's own limitation): its
    callbacks run on the completing thread's current streams, and the
    events are recorded there.

    Costs a few µs (and a µs per device when it completes); blocks nothing.

    Args:
        torch_future: a ``torch.futures.Future``.
        devices: the devices whose PyTorch current streams to record on, as
            for :class:`CudaFuture`; ``None``: the value's own.

    Raises:
        TypeError: ``torch_future`` is not a ``torch.futures.Future``, or
            ``devices`` is not a device or an iterable of them.
        ValueError: ``devices`` names a device this process does not see.
        RuntimeError: PyTorch is not imported.
    """
    torch = _torch_module("from_torch()")
    _cuda.check_usable()
    if not isinstance(torch_future, torch._C.Future):
        raise TypeError(f"from_torch() takes a torch.futures.Future, not {type(torch_future).__name__}")
    fut: CudaFuture[Any] = CudaFuture(devices)
    given = fut._devices

    def done(completed: Any) -> None:  # torch's callback: in the completing thread
        try:
            value = completed.value()  # raises the torch future's error
        except Exception as exc:  # noqa: BLE001 - the CudaFuture carries it
            fut._try_fail(exc)
            return
        try:
            cuda = _torch.loaded()
            records = () if cuda is None else _torch.record_value(cuda, value, given, on_torch=True)
        except Exception as exc:  # noqa: BLE001 - never leave the CudaFuture pending
            fut._try_fail(exc)
            return
        fut._try_complete(_SET, value, None, records)

    torch_future.add_done_callback(done)
    return fut
