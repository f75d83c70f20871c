"""PyTorch's side of the streams: its current streams, its allocator.

The package's one way to PyTorch: its other modules reach torch only through
the functions here (``_values``, below this module, reads ``torch.Tensor``
itself to walk values). cudafut never imports torch, but for
:func:`tcp_store_type` (``cudafut.distributed``'s default store). Every
other function works on the module the program imported itself, found by
:func:`loaded` or :func:`module` in ``sys.modules``; without torch
imported, none of this runs (a dictionary lookup per call says so).

With torch imported (and able to use CUDA), the core does, besides what it
does with CuPy's current streams:

- ``then()``/``submit()``: each pool stream is PyTorch's current stream of
  its device too (an ``ExternalStream`` over the same handle) while ``fn``
  runs, so torch ops in ``fn`` are ordered like CuPy's; the torch CUDA
  tensors ``fn`` reads (the parent's value, ``submit``'s arguments) are
  recorded on those streams (``Tensor.record_stream``), so torch's caching
  allocator does not hand their memory out before the pool streams are past
  it; ``submit()``'s pool stream also waits for PyTorch's current stream.
- ``set_result(value)``/``record(value)``: events for the torch CUDA tensors
  in ``value`` are recorded on PyTorch's current stream of their devices
  (other arrays: on CuPy's current stream, as without torch).
- ``wait()``: PyTorch's current stream of each device waits too (where it is
  not CuPy's current stream), and the value's torch tensors are recorded on
  it.
- ``wait()``/``record_stream()`` of a torch tensor on a stream that may be
  destroyed (a user's CuPy stream): the stream object is kept alive until
  PyTorch has recorded its event on it at the free (:func:`keep_owner`).

Each costs a few µs more on the host (torch's stream calls); none blocks
the GPU.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from . import _backend, _cuda, _events, _lifetimes, _pools
from ._events import EventRecord
from ._values import gpu_arrays, placements

__all__ = [
    "all_cuda_tensors",
    "call_on_streams",
    "call_on_torch_streams",
    "capture_graph",
    "current_handle",
    "current_records",
    "follow_current",
    "is_future",
    "is_tensor",
    "keep_owner",
    "loaded",
    "module",
    "pool_stream",
    "record_external",
    "record_tensors",
    "record_value",
    "replay_graph",
    "required",
    "restore_streams",
    "store_type",
    "tcp_store_type",
    "torch_future",
    "torch_tensors",
    "use_pool_streams",
    "wait_current",
]

#: Flags of :func:`cudafut._values.placements`: a device holds a torch CUDA
#: tensor, or another GPU array.
TORCH: Final = 2
OTHER: Final = 1

# (torch module, the same if it can use CUDA else None): known once per module.
_known: tuple[Any, Any] = (None, None)
# torch streams over cudafut's pool streams, which live as long as the process.
_pool_streams: dict[tuple[int, int, int], Any] = {}
# Per torch module: its C entry points beneath torch.cuda.current_stream()
# and set_stream() (see _stream_calls), or None where it has none.
_raw_calls: dict[int, tuple[Callable[[int], tuple[int, int, int]], Callable[..., None]] | None] = {}


def module() -> Any:
    """The ``torch`` module if the program imported it (any build), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "futures"):
        return None  # not imported, or still importing
    return torch


def imported() -> Any:
    """``torch``, imported if need be: for unpickling a value that holds
    tensors (a received future's), as pickle itself imports a pickled
    object's module. Everywhere else cudafut only uses a torch the program
    imported.

    Raises:
        ImportError: PyTorch is not installed here.
    """
    import torch

    return torch


def required(what: str) -> Any:
    """:func:`module`, or RuntimeError naming ``what`` (a call that needs
    PyTorch) when the program did not import it."""
    torch = module()
    if torch is None:
        raise RuntimeError(f"{what} needs PyTorch, and cudafut never imports it: import torch first")
    return torch


def loaded() -> Any:
    """``torch`` if it is imported and can use CUDA here, else None.

    Never imports torch. Once known for the imported module, costs a
    dictionary lookup and a comparison.
    """
    global _known
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    known = _known
    if known[0] is torch:
        return known[1]
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not hasattr(torch, "Tensor"):
        return None  # still importing: ask again next time
    _known = known = (torch, torch if cuda.is_available() else None)
    return known[1]


def _not_loaded() -> Any:
    return None


def _swap_loaded(backend: object) -> Callable[[], None]:
    """Under cudafut.testing's fake CUDA, PyTorch's streams are not the
    fake's: cudafut leaves torch alone (``loaded()`` says None)."""
    global loaded
    saved, loaded = loaded, _not_loaded

    def restore() -> None:
        global loaded
        loaded = saved

    return restore


_cuda.on_swap(_swap_loaded)


def pool_stream(torch: Any, handle: int, device: int) -> Any:
    """A ``torch.cuda.ExternalStream`` over one of cudafut's pool streams
    (made once: pool streams live as long as the process)."""
    key = (id(torch), handle, device)
    stream = _pool_streams.get(key)
    if stream is None:
        stream = _pool_streams[key] = torch.cuda.ExternalStream(handle, device=device)
    return stream


def _stream_calls(torch: Any) -> tuple[Callable[[int], tuple[int, int, int]], Callable[..., None]] | None:
    """``torch._C._cuda_getCurrentStream`` and ``_cuda_setStream``: what
    ``torch.cuda.current_stream()`` and ``set_stream()`` call beneath, as
    ``(stream_id, device_index, device_type)`` triples, without building a
    ``torch.cuda.Stream`` per call (the public pair cost several times a
    whole ``then()`` link: the host section of ``python -m cudafut bench``
    measures a link with torch imported). Private to PyTorch, so
    used only where they take and give triples as expected, and only once
    torch has initialised CUDA (the public calls do that, and report a
    fork); else None, and callers use the public calls."""
    initialized = getattr(torch.cuda, "is_initialized", None)
    if initialized is None or not initialized():
        return None
    key = id(torch)
    if key not in _raw_calls:
        calls = None
        try:
            c = torch._C  # noqa: SLF001 - torch's C entry points, checked below
            get, put = c._cuda_getCurrentStream, c._cuda_setStream  # noqa: SLF001
            now = get(torch.cuda.current_device())
            if type(now) is tuple and len(now) == 3 and all(type(x) is int for x in now):
                put(*now)  # a no-op: the current stream again
                calls = (get, put)
        except Exception:  # noqa: BLE001 - another torch: the public calls
            calls = None
        _raw_calls[key] = calls
    return _raw_calls[key]


def raw_switch(torch: Any, handle: int, device: int) -> tuple[Any, Any, tuple[int, int, int], Any] | None:
    """For the native ``then()``: ``(get, put, triple, stream)``, where
    ``put(*triple)`` makes the pool stream ``handle`` of ``device`` PyTorch's
    current stream (and ``device`` current), ``get(device)`` reads the
    current stream as a triple for ``put`` to restore, and ``stream`` is the
    torch stream over the pool stream (for ``Tensor.record_stream``); None
    where torch's raw stream calls are not usable (see :func:`_stream_calls`).
    The native core keeps it per handle: the same switch
    :func:`call_on_torch_streams` makes, without its Python frames, for a
    value that is a CuPy array or one torch tensor."""
    calls = _stream_calls(torch)
    if calls is None:
        return None
    stream = pool_stream(torch, handle, device)
    return calls[0], calls[1], (stream.stream_id, stream.device_index, stream.device_type), stream


def use_pool_streams(torch: Any, streams: Mapping[int, Any]) -> tuple[list[Any], int]:
    """For :func:`cudafut.own_stream`'s steps: each pool stream of
    ``streams`` made PyTorch's current stream of its device, where it is
    not already. Returns the torch streams it replaced and the device that
    was current, for :func:`restore_streams`."""
    cuda = torch.cuda
    before_streams = []
    device_before = cuda.current_device()
    for device, stream in streams.items():
        before = cuda.current_stream(device)
        if int(before.cuda_stream) != int(stream.ptr):
            cuda.set_stream(pool_stream(torch, int(stream.ptr), device))
            before_streams.append(before)
    if before_streams and cuda.current_device() != device_before:
        cuda.set_device(device_before)  # set_stream made the stream's device current
    return before_streams, device_before


def restore_streams(before_streams: list[Any], device_before: int) -> None:
    """Undo :func:`use_pool_streams` (``before_streams`` not empty)."""
    cuda = module().cuda
    for stream in reversed(before_streams):
        cuda.set_stream(stream)
    if cuda.current_device() != device_before:
        cuda.set_device(device_before)


def current_handle(torch: Any, device: int) -> int:
    """The ``cudaStream_t`` of PyTorch's current stream of ``device``."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def torch_tensors(torch: Any, value: object) -> list[Any]:
    """The torch CUDA tensors in ``value`` (containers walked as for
    :func:`~cudafut._values.find_devices`)."""
    tensor = torch.Tensor
    return [a for a in gpu_arrays(value) if isinstance(a, tensor)]


def is_tensor(torch: Any, value: object) -> bool:
    """Whether ``value`` is a torch tensor (on any device)."""
    return isinstance(value, torch.Tensor)


def record_external(array: object, stream: int, device: int, owner: object = None) -> bool:
    """For :func:`cudafut.record_stream` of memory cudafut did not allocate:
    if ``array`` is a torch tensor (torch imported, whether or not it can
    use CUDA), ``Tensor.record_stream`` on an ``ExternalStream`` over
    ``stream`` of ``device`` where it is a CUDA tensor, and True; else False.

    ``owner``: the stream's object. Where it may be destroyed (see
    :func:`_may_be_destroyed`), it is kept alive while the tensor lives and
    until PyTorch recorded its event on it at the free (:func:`keep_owner`).
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(array, torch.Tensor):
        return False
    if array.is_cuda:
        array.record_stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", device)))
        if owner is not None and _may_be_destroyed(torch, stream, owner):
            keep_owner(array, stream, device, owner)
    return True


def _may_be_destroyed(torch: Any, stream: int, owner: object) -> bool:
    """Whether the stream object ``owner`` (of handle ``stream``) may be
    destroyed while a tensor recorded on it lives: not a special handle
    (0, 1, 2: never destroyed), not one of cudafut's streams of the
    process's life, not a torch stream (PyTorch's own come from its pools
    and are never destroyed; an ``ExternalStream`` does not own its handle,
    so keeping it alive would keep nothing). A user's CuPy ``Stream``, or
    any other ``__cuda_stream__`` object, may."""
    if stream <= 2 or _pools.kept(stream, owner):
        return False
    torch_stream = getattr(torch.cuda, "Stream", None)
    return torch_stream is None or not isinstance(owner, torch_stream)


class _Kept(weakref.ref[Any]):
    """A weak reference to a tensor recorded on streams that may be
    destroyed, with those streams: ``owners`` is ``{id(stream object):
    (stream object, handle, device)}``; ``key`` the tensor's id."""

    __slots__ = ("key", "owners")

    key: int
    owners: dict[int, tuple[object, int, int]]


# The live tensors recorded on streams that may be destroyed, by id. Swapped by tests.
_owners: dict[int, _Kept] = {}
# Re-entrant: a collection may run a finalizer that records a tensor (a
# Tracked value's) at any call inside the locked block, in this thread.
_owners_lock: Final = threading.RLock()


def keep_owner(tensor: Any, stream: int, device: int, owner: object) -> bool:
    """Keep ``owner`` (the object of ``stream``, of ``device``, on which
    ``tensor`` was just recorded with ``Tensor.record_stream``) alive while
    ``tensor`` lives, and after, until PyTorch has recorded its event on
    the stream at the free and the GPU is past that point; return whether
    it does (False: ``tensor`` takes no weak reference; nothing is kept, as
    before).

    PyTorch's caching allocator records an event on each recorded stream
    when the memory is freed, and keeps no stream alive (PyTorch issue
    66936): recorded on a destroyed stream, that is undefined behaviour.
    A weak-reference callback runs at the start of the tensor's
    deallocation, and PyTorch frees the memory after it, with the GIL
    released: no other thread can tell when that free is done. So the
    callback only retires the streams (:func:`cudafut._lifetimes.retire`):
    the thread that dropped the tensor releases them at its next
    ``wait()`` or ``record_stream()`` (the watcher thread at its next
    round), when its free is done; once 10 s old
    (:data:`~cudafut._lifetimes.RETIRED_STALE_S`), any thread's next call
    does, and the watcher thread within 10 s more, idle or not. The release
    records an event on each stream and keeps its object until the event
    completes.

    A long-lived tensor recorded on many short-lived streams keeps every
    one of them until it dies: PyTorch records on each at the free (it
    keeps their handles, which a destroyed stream would give to a new one).

    Not covered: a view (or any tensor sharing the memory) that outlives
    ``tensor`` keeps the memory past the release, and PyTorch records on
    the stream when that memory is freed; a ``wait()`` or
    ``record_stream()`` called from a finalizer that runs inside the
    deallocation (or the collection) of such a tensor may release its
    streams early; a thread held up for 10 s between the callback and the
    free (waiting for PyTorch's allocator lock) may see them released; and
    a free while a CUDA graph is being captured anywhere in the process
    (cudafut's ``graphed()`` included), which PyTorch records on later, at
    a later allocation or free, so the streams may be gone by then.

    Cost, host only (measured on a CPU with a fake torch): about 1 µs more
    per :func:`record_external` the first time a tensor meets such a
    stream (a weak reference and two dictionary entries), about half that
    after; at the tensor's death, the callback and an append; at the
    release, an event record and a query per stream. Special handles,
    cudafut's streams and torch's streams take only the tests that say so.
    """
    key = id(tensor)
    kept = _owners.get(key)
    if kept is None or kept() is not tensor:
        try:
            fresh = _Kept(tensor, _tensor_gone)
        except TypeError:
            return False  # a tensor without weak references: as before this existed
        fresh.key = key
        fresh.owners = {}
        with _owners_lock:
            kept = _owners.get(key)
            if kept is None or kept() is not tensor:
                stale, kept = kept, fresh
                _owners[key] = fresh
            else:
                stale = None  # another thread registered it meanwhile
        if stale is not None:
            # An object that had this id died without the callback (a weak
            # reference made in its own finalizer is cleared without it):
            # its deallocation ended long ago.
            _lifetimes.retire(_release_owners, stale.owners)
    owners = kept.owners
    if id(owner) not in owners:
        owners[id(owner)] = (owner, stream, device)
    return True


def _tensor_gone(kept: _Kept) -> None:
    """The weak-reference callback of :func:`keep_owner`: runs at the start
    of the tensor's deallocation, before PyTorch frees its memory."""
    try:
        if _owners.get(kept.key) is kept:
            del _owners[kept.key]
            _lifetimes.retire(_release_owners, kept.owners)
    except Exception:  # noqa: BLE001 - a callback must not raise (interpreter shutdown)
        pass


def _release_owners(owners: dict[int, tuple[object, int, int]]) -> None:
    """Run (by :func:`cudafut._lifetimes.release_retired`) once the thread
    that freed the tensor moved on: PyTorch has recorded its event on each
    stream. Each stream gets an event, and its object is kept until the
    GPU is past it (it could otherwise go at once)."""
    try:
        places = {(handle, device) for _, handle, device in owners.values()}
        records = [_events.record(handle, device) for handle, device in places]
        _lifetimes.keep_until(records, owners)
    except Exception:  # noqa: BLE001 - CUDA failed (a dead device, a forked child): never destroy them here
        _lifetimes.keep_forever(owners)


def record_tensors(tensors: Iterable[Any], streams: Mapping[int, Any]) -> None:
    """``Tensor.record_stream(streams[device])`` for each tensor on one of
    those devices: torch's allocator then keeps the tensor's memory from new
    allocations until the work queued on that stream at the free is done."""
    for tensor in tensors:
        stream = streams.get(tensor.get_device())
        if stream is not None:
            tensor.record_stream(stream)


def record_value(
    torch: Any,
    value: object,
    given: tuple[int, ...] | None,
    *,
    skip: Iterable[int] = (),
    on_torch: bool = False,
) -> tuple[EventRecord, ...]:
    """The events of ``set_result(value)``/``record(value)`` with torch imported.

    Per device: on CuPy's current stream where ``value`` holds a GPU array
    that is not a torch tensor (or, with ``given`` devices, on each of
    them), on PyTorch's current stream where it holds a torch CUDA tensor;
    each stream once. ``on_torch``: every device on PyTorch's current stream
    only (a value that torch made ready on its streams: ``from_torch``).
    ``skip``: devices recorded already (the pool streams of ``then()``).
    """
    found = placements(value, torch.Tensor)
    wanted: dict[int, int] = {}
    if given:
        for device in given:
            wanted[device] = TORCH if on_torch else OTHER | (found.get(device, 0) & TORCH)
    else:
        skipped = set(skip)
        for device, kinds in found.items():
            if device not in skipped:
                wanted[device] = TORCH if on_torch else kinds
    streams: dict[tuple[int, int], None] = {}
    for device, kinds in wanted.items():
        if kinds & OTHER:
            streams[(device, int(_backend.current.current_stream(device).ptr))] = None
        if kinds & TORCH:
            streams[(device, current_handle(torch, device))] = None
    return tuple(_events.record(handle, device) for device, handle in streams)


def call_on_streams(
    torch: Any, streams: Mapping[int, Any], fn: Callable[..., Any], args: Any, kwargs: Any, reads: object
) -> Any:
    """:func:`cudafut._backend.current.call_on_streams`, with each pool stream of
    ``streams`` PyTorch's current stream of its device too while ``fn``
    runs; the previous streams and device are restored however ``fn`` ends.
    The torch CUDA tensors in ``reads`` are recorded on those streams first.
    """
    primary = next(iter(streams))
    return _backend.current.call_on_streams(
        streams, primary, call_on_torch_streams, (torch, streams, fn, args, kwargs, reads), {}
    )


def call_on_torch_streams(
    torch: Any, streams: Mapping[int, Any], fn: Callable[..., Any], args: Any, kwargs: Any, reads: object
) -> Any:
    """The torch half of :func:`call_on_streams`, for a caller that made
    ``streams`` CuPy's current streams already (the native ``then()`` does it
    from C): the torch CUDA tensors in ``reads`` recorded on them, each made
    PyTorch's current stream of its device while ``fn`` runs (which makes
    that device current), torch's previous streams restored however ``fn``
    ends; the caller restores the device."""
    ours = {device: pool_stream(torch, int(stream.ptr), device) for device, stream in streams.items()}
    record_tensors(torch_tensors(torch, reads), ours)
    cuda = torch.cuda
    calls = _stream_calls(torch)
    if calls is not None:
        get, put = calls
        saved_ids = []
        try:
            for device, stream in ours.items():
                saved_ids.append(get(device))
                put(stream.stream_id, stream.device_index, stream.device_type)  # as set_stream()
            if len(ours) > 1:
                cuda.set_device(next(iter(streams)))
            return fn(*args, **kwargs)
        finally:
            for triple in reversed(saved_ids):
                put(*triple)
    saved = []
    try:
        for device, stream in ours.items():
            saved.append(cuda.current_stream(device))
            cuda.set_stream(stream)  # makes the stream's device current
        if len(ours) > 1:
            cuda.set_device(next(iter(streams)))
        return fn(*args, **kwargs)
    finally:
        for stream in reversed(saved):
            cuda.set_stream(stream)


def _record_if_other(torch: Any, device: int, cupy_stream: int) -> EventRecord | None:
    """An event on PyTorch's current stream of ``device``, unless that is
    ``cupy_stream`` (CuPy's current stream, recorded by the caller)."""
    handle = current_handle(torch, device)
    return None if handle == cupy_stream else _events.record(handle, device)


def current_records(device: int) -> tuple[EventRecord, ...]:
    """Events after what the calling thread (or task) has enqueued so far on
    its current streams of ``device``: CuPy's, and PyTorch's where the
    program imported torch and its current stream is another. ``submit()``'s
    pool stream, a launcher's stream and a batch's stream wait for them."""
    rec = _events.record_current(device)
    torch = loaded()
    if torch is not None:
        other = _record_if_other(torch, device, rec.stream)
        if other is not None:
            return (rec, other)
    return (rec,)


def follow_current(torch: Any, device: int, stream: int) -> None:
    """For ``to_host(tensor)``: ``stream`` (a copy stream of ``device``)
    waits for what the caller enqueued on PyTorch's current stream, where
    that is not CuPy's current stream."""
    other = _record_if_other(torch, device, int(_backend.current.current_stream(device).ptr))
    if other is not None:
        other.wait_on(stream, device)


def wait_current(torch: Any, records: Iterable[EventRecord], value: object) -> None:
    """For ``wait()``: PyTorch's current stream of each device of ``records``
    waits on them too, where it is not CuPy's current stream (which waited
    already), and the torch CUDA tensors of ``value`` are recorded on it.
    First, the streams this thread retired (:func:`keep_owner`) go."""
    _lifetimes.release_retired()
    by_device: dict[int, list[EventRecord]] = {}
    for rec in records:
        by_device.setdefault(rec.device, []).append(rec)
    consumers: dict[int, Any] = {}
    for device, recs in by_device.items():
        stream = torch.cuda.current_stream(device)
        handle = int(stream.cuda_stream)
        if handle == int(_backend.current.current_stream(device).ptr):
            continue
        for rec in recs:
            rec.wait_on(handle, device)
        consumers[device] = stream
    if consumers:
        record_tensors(torch_tensors(torch, value), consumers)


# -- bridges: torch's futures ---------------------------------------------------------------


def torch_future(torch: Any, devices: Iterable[int]) -> Any:
    """A pending ``torch.futures.Future``, with ``devices`` where any
    (torch then orders its value on its current streams of them)."""
    devices = list(devices)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def is_future(torch: Any, value: object) -> bool:
    """Whether ``value`` is a ``torch.futures.Future`` (of any subclass)."""
    return isinstance(value, torch._C.Future)  # noqa: SLF001 - torch's type of its futures


def tcp_store_type() -> Any:
    """``torch.distributed.TCPStore``, for the default store of
    ``cudafut.distributed``: the one call that imports torch (its
    ``torch.distributed``), where it is installed; None where it is not."""
    try:
        from torch.distributed import TCPStore
    except ImportError:
        return None
    return TCPStore


def store_type() -> type | None:
    """``torch.distributed.Store`` if the program imported
    ``torch.distributed`` (never imports it), else None."""
    cls = getattr(sys.modules.get("torch.distributed"), "Store", None)
    return cls if isinstance(cls, type) else None


# -- CUDA graphs: the PyTorch side of cudafut.graphed ---------------------------------------


def all_cuda_tensors(values: Iterable[object]) -> bool:
    """Whether torch is imported and each of ``values`` is a torch CUDA
    tensor (``graphed()`` then captures with torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and all(isinstance(x, torch.Tensor) and x.is_cuda for x in values)


def capture_graph(fn: Callable[..., Any], inputs: tuple[Any, ...], warmup: int) -> tuple[Any, Any]:
    """``fn(*inputs)`` captured into a ``torch.cuda.CUDAGraph`` after
    ``warmup`` runs on a side stream; ``(graph, outputs)``. Blocks the
    calling thread for the warm-up and the capture."""
    torch = sys.modules["torch"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuDNN's choices, lazy inits) off the capture
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other launcher threads keep enqueuing while this one
    # captures; a stream of its own: torch's default capture stream is one
    # per process, shared by threads.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
        outputs = fn(*inputs)
    return graph, outputs


def replay_graph(
    graph: Any, statics: tuple[Any, ...], outputs: tuple[Any, ...], inputs: tuple[Any, ...], n: int, last: Any
) -> tuple[tuple[Any, ...], Any]:
    """Replay a graph of :func:`capture_graph` on torch's current stream,
    after the event ``last`` (if any): ``inputs`` copied into the first
    ``n`` rows of its static inputs ``statics``, and copies of the first
    ``n`` rows of its ``outputs`` returned, with an event after them.

    Raises:
        ValueError: an input's dtype is not its static input's.
    """
    torch = sys.modules["torch"]
    stream = torch.cuda.current_stream()
    if last is not None:
        stream.wait_event(last)
    for static, x in zip(statics, inputs, strict=True):
        if x.dtype != static.dtype:
            raise ValueError(f"a graphed input of dtype {x.dtype} does not match the captured {static.dtype}")
        static[:n].copy_(x, non_blocking=True)
    graph.replay()
    copies = tuple(out[:n].clone() for out in outputs)
    event = torch.cuda.Event()
    event.record(stream)
    return copies, event
