"""The seam to NCCL and to cupyx's TCP store: the only module of
cudafut.distributed that reaches CuPy (through ``cupy.cuda.nccl`` and
``cupyx.distributed``), as :mod:`cudafut._cuda` is for the rest of cudafut.

NCCL is loaded on first use, after :func:`cudafut._backend.current.cupy` has checked
that CUDA is usable. The collectives of :class:`Communicator` enqueue on a
stream and return: a few µs on the host each, plus what NCCL does on its
first call to a peer (which may block until the peer calls too).
"""

from __future__ import annotations

import atexit
import socket
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

from .. import _backend
from .._errors import CudaUnavailableError

_module: Any = None


def _nccl() -> Any:
    """``cupy.cuda.nccl``, after checking once that CUDA and NCCL are usable."""
    nccl = _module
    if nccl is None:
        nccl = _load()
    return nccl


def _load() -> Any:
    global _module
    _backend.current.cupy()  # CUDA usable (the fork check, the driver), before NCCL loads
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise CudaUnavailableError(
            "cudafut.distributed needs NCCL, which this CuPy cannot load; install the NCCL "
            "package matching your CUDA (e.g. pip install nvidia-nccl-cu12) or a CuPy with NCCL"
        )
    _module = nccl
    return nccl


def check_available() -> None:
    """Load NCCL, once (later calls cost a global read).

    Raises:
        CudaUnavailableError: CUDA cannot be used here, or this CuPy cannot
            load NCCL.
    """
    _nccl()


def unique_id() -> bytes:
    """A new ``ncclUniqueId`` (what the leader of a group hands the other
    ranks): a few µs on the host, no GPU work."""
    return bytes(_nccl().get_unique_id())


def communicator(size: int, uid: bytes, rank: int) -> Communicator:
    """``ncclCommInitRank`` on the current device: blocks the calling
    thread until all ``size`` ranks have called it with ``uid`` (no time
    limit: call it in a thread you can leave)."""
    return Communicator(_nccl().NcclCommunicator(size, uid, rank))


def cupy_array_type() -> tuple[type, bool] | None:
    """``(cupy.ndarray, readable)`` once CuPy is imported (None before; no
    import, no CUDA call): ``readable``, whether an array's pointer, size,
    dtype, contiguity and device can be read from its attributes as its
    ``__cuda_array_interface__`` gives them (not under HIP, where CuPy's
    arrays have no interface)."""
    cupy = sys.modules.get("cupy")
    cls = getattr(cupy, "ndarray", None)
    if not isinstance(cls, type):
        return None
    hip = getattr(getattr(getattr(cupy, "cuda", None), "runtime", None), "is_hip", None)
    return cls, hip is False and hasattr(cls, "_c_contiguous")


def group_start() -> None:
    """``ncclGroupStart``: the point-to-point calls until :func:`group_end`
    are issued as one (no host wait)."""
    _nccl().groupStart()


def group_end() -> None:
    """``ncclGroupEnd``: issue the calls since :func:`group_start`."""
    _nccl().groupEnd()


class Communicator:
    """One rank's NCCL communicator: its collectives, typed.

    Buffers are device addresses; ``count`` is in elements of ``dtype``
    (``ncclDataType_t``); ``op`` is an ``ncclRedOp_t``; ``stream`` the
    handle of a stream of the communicator's device. Each call enqueues and
    returns (a few µs on the host, the GIL held), except that a first call
    to a peer may block until the peer calls too. NCCL's errors are raised
    as CuPy's ``NcclError``.
    """

    __slots__ = ("_comm",)

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._comm.allReduce(send, recv, count, dtype, op, stream)

    def all_gather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self._comm.allGather(send, recv, count, dtype, stream)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._comm.reduceScatter(send, recv, count, dtype, op, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._comm.broadcast(send, recv, count, dtype, root, stream)

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, stream: int) -> None:
        self._comm.reduce(send, recv, count, dtype, op, root, stream)

    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._comm.send(buf, count, dtype, peer, stream)

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._comm.recv(buf, count, dtype, peer, stream)

    def check_async_error(self) -> None:
        """``ncclCommGetAsyncError``: raise the error NCCL met in the
        background, if any (about a µs)."""
        self._comm.check_async_error()

    def destroy(self) -> None:
        """``ncclCommDestroy``: free the communicator once its work is done
        (blocks the calling thread until then)."""
        self._comm.destroy()

    def abort(self) -> None:
        """``ncclCommAbort``: end the communicator's pending work now. May
        hang on a broken network: call it in a thread you can leave."""
        self._comm.abort()


class CupyxStore:
    """cupyx.distributed's TCP store (used when torch is absent), with a
    blocking ``get``. It is a private module of CuPy: if it changes, pass a
    store of your own (``store=``).

    Making one on rank 0 starts the server (a process of cupyx's); ``set``
    and ``get`` are a round trip to it each, ``get`` retrying every 10 ms
    until the key is there. Each call ends within ``timeout`` seconds
    (``wait``: its own), ``TimeoutError`` at the latest: cupyx's own client
    retries for 25 s when nobody listens, so it is called only once the
    server takes connections."""

    def __init__(self, rank: int, size: int, addr: str, port: int, timeout: float) -> None:
        from cupyx.distributed import _store

        self._address = (addr, port)
        self._server = None
        if rank == 0:
            self._server = _store.TCPStore(size)
            self._server.run(addr, port)
            # Its process runs until stopped, and multiprocessing joins it at
            # exit (after cupyx's own exit hook, which stops nothing): stop it
            # first, else a world not destroyed holds up the exit for ever.
            atexit.register(_stop_server, weakref.ref(self._server))
        self._proxy = _store.TCPStoreProxy(addr, port)
        self._timeout = timeout

    def _wait_for_server(self, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nobody took connections at {self._address[0]}:{self._address[1]}")
            try:
                with socket.create_connection(self._address, timeout=min(left, 1.0)):
                    return
            except OSError:
                time.sleep(min(0.01, left))

    def set(self, key: str, value: bytes) -> None:
        self._wait_for_server(time.monotonic() + self._timeout)
        self._proxy[key] = value

    def get(self, key: str) -> bytes:
        return self._get(key, time.monotonic() + self._timeout)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Block until every key is set, at most ``timeout`` (as torch's
        ``Store.wait``)."""
        deadline = time.monotonic() + timeout.total_seconds()
        for key in keys:
            self._get(key, deadline)

    def _get(self, key: str, deadline: float) -> bytes:
        while True:
            self._wait_for_server(deadline)
            try:
                return bytes(self._proxy[key])
            except Exception:  # not there yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def _stop_server(server: weakref.ref[Any]) -> None:
    alive = server()
    if alive is not None:
        alive.stop()
