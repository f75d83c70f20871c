"""Bridges into CudaFutures, and the older name of one out of them.

- :func:`wrap_future`: ``fut.to_asyncio()`` under its older public name
  ``cudafut.wrap_future``;
- :func:`from_torch`: a CudaFuture set when a ``torch.futures.Future``
  completes, stream order kept.

The bridges out of a CudaFuture (``fut.to_asyncio()``, ``fut.to_concurrent()``,
``fut.to_torch()``) live with it in ``_future``: each is one done callback (or
a ``then``-like listener, for the stream-ordered torch path) on the
CudaFuture, the machinery of ``add_done_callback`` with its waiters.
Cancelling the other future never cancels the CudaFuture: set GPU work cannot
be taken back, and a CudaFuture may have other consumers. This module sits
above ``_future`` and uses its internal interface only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, TypeVar

from . import _cuda, _torch
from ._future import CudaFuture, complete_with, fail_future, given_devices

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
    _cuda.check_usable()
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
