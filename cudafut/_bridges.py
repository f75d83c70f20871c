"""Bridges into CudaFutures, and the older name of one out of them.

- :func:`wrap_future`: ``fut.to_asyncio()`` under its older public name
  ``cudafut.wrap_future``;
- :func:`from_torch`: a CudaFuture set when a ``torch.futures.Future``
  completes, stream order kept.

And the bridges out of a CudaFuture, behind its methods ``to_asyncio()``,
``to_concurrent()`` and ``to_torch()`` (:func:`to_asyncio`,
:func:`to_concurrent`, :func:`to_torch`): each is one done callback (or a
``then``-like listener, for the stream-ordered torch path) on the
CudaFuture, the machinery of ``add_done_callback`` with its waiters.
Cancelling the other future never cancels the CudaFuture: set GPU work cannot
be taken back, and a CudaFuture may have other consumers. This module sits
above ``_future`` and uses its internal interface (``_interface``) only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from . import _future, _loops, _runtime, _torch, _waiter
from ._errors import CancelledError
from ._events import EventRecord, first_error
from ._future import CudaFuture
from ._interface import complete_with, fail_future, given_devices, set_value, settled, when_done, when_set

__all__ = ["from_torch", "wrap_future"]

T = TypeVar("T")


def wrap_future(fut: CudaFuture[T], *, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[T]:
    """``fut.to_asyncio(loop=loop)``, under an older name: an :class:`asyncio.Future`
    done when ``fut`` is done (GPU work complete).

    An alias, kept for code that calls it; prefer
    :meth:`CudaFuture.to_asyncio <cudafut.CudaFuture.to_asyncio>`, which
    says what it costs and blocks (a few µs; nothing) and what cancelling
    the returned future does (it never reaches ``fut`` nor its GPU work).
    Despite the name, it is not the reverse of :func:`asyncio.wrap_future`
    (which takes only ``concurrent.futures.Future`` objects).

    Raises:
        TypeError: ``fut`` is not a CudaFuture, or ``loop`` is not an
            asyncio event loop.
        RuntimeError: no ``loop`` given and no asyncio (or uvloop) loop runs
            in this thread (on trio, ``await`` the CudaFuture itself).
    """
    if not isinstance(fut, CudaFuture):
        raise TypeError(f"wrap_future() takes a CudaFuture, not {type(fut).__name__}")
    return fut.to_asyncio(loop=loop)


# -- PyTorch -------------------------------------------------------------------------------------


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
    torch = _torch.required("from_torch()")
    _runtime.check_usable()
    if not _torch.is_future(torch, torch_future):
        raise TypeError(f"from_torch() takes a torch.futures.Future, not {type(torch_future).__name__}")
    fut: CudaFuture[Any] = CudaFuture(devices)
    given = given_devices(fut)

    def done(completed: Any) -> None:  # torch's callback: in the completing thread
        try:
            value = completed.value()  # raises the torch future's error
        except Exception as exc:  # noqa: BLE001 - the CudaFuture carries it
            fail_future(fut, exc)
            return
        try:
            cuda = _torch.loaded()
            records = () if cuda is None else _torch.record_value(cuda, value, given, on_torch=True)
        except Exception as exc:  # noqa: BLE001 - never leave the CudaFuture pending
            fail_future(fut, exc)
            return
        complete_with(fut, value, records)

    torch_future.add_done_callback(done)
    return fut


# -- out of a CudaFuture: CudaFuture.to_asyncio/to_concurrent/to_torch ----------------------------


def to_asyncio(fut: CudaFuture[T], loop: asyncio.AbstractEventLoop | None) -> asyncio.Future[T]:
    """:meth:`CudaFuture.to_asyncio <cudafut.CudaFuture.to_asyncio>`, which says what it costs and raises."""
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
    if _runtime.forked:  # a flag test, without a call
        _runtime.check_usable()
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
    when_done(fut, callback, driver or _waiter.thread_waiter())

    def forget(_out: asyncio.Future[T]) -> None:
        if out.cancelled():
            fut.remove_done_callback(callback)

    out.add_done_callback(forget)
    return out


def to_concurrent(fut: CudaFuture[T]) -> concurrent.futures.Future[T]:
    """:meth:`CudaFuture.to_concurrent <cudafut.CudaFuture.to_concurrent>`."""
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

    when_done(fut, copy, _waiter.thread_waiter())
    return out


def to_torch(fut: CudaFuture[T]) -> Any:
    """:meth:`CudaFuture.to_torch <cudafut.CudaFuture.to_torch>`, which says what it costs and raises."""
    torch = _torch.required("to_torch()")
    if _runtime.forked:  # a flag test, without a call
        _runtime.check_usable()

    def tensor_devices(value: object) -> set[int]:
        return {t.get_device() for t in _torch.torch_tensors(torch, value)}

    def ordered_by_torch(value: object, records: tuple[EventRecord, ...], devices: Iterable[int]) -> bool:
        """Whether the events torch records at set_result(), for the devices of
        the torch CUDA tensors it finds in the value, cover every one of ours
        (torch refuses a tensor on a device the future was not made for)."""
        covered = tensor_devices(value)
        return covered <= set(devices) and {r.device for r in records} <= covered

    # The torch future's devices are fixed now. A future already set is
    # known: with devices only if torch can order its value (for another
    # value, torch would pickle it at set_result() to look for tensors:
    # a copy to the host of every CuPy array). A pending one: the devices
    # given to CudaFuture(), if any.
    devices: tuple[int, ...] = ()
    if _torch.loaded() is not None:
        now = set_value(fut)
        if now is not None:
            if first_error(now[1]) is None and ordered_by_torch(*now, fut.devices):
                devices = fut.devices
        elif not fut.cancelled():
            devices = given_devices(fut) or ()
    out = _torch.torch_future(torch, devices)

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
        now = set_value(fut)
        if now is None or first_error(now[1]) is not None:
            complete(fut)  # failed or cancelled: nothing to wait for
            return
        pending = [r for r in now[1] if r.status is None]
        if pending and devices and ordered_by_torch(*now, devices):
            # torch records its events on its current streams at set_result():
            # make them wait on ours first.
            for rec in pending:
                rec.wait_on(_torch.current_handle(torch, rec.device), rec.device)
            complete(fut)
        elif pending:  # torch cannot order what it does not see: complete once done
            when_done(fut, complete, _waiter.thread_waiter())
        else:
            complete(fut)

    when_set(fut, on_set)
    return out


_future.set_bridges(sys.modules[__name__])
