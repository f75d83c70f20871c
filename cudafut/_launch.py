"""launch(): enqueue GPU work from a launcher thread, off the calling thread.

A real model's *launch* costs host time: PyTorch dispatches each operator in
C++ and Python, and enqueuing a ResNet-50 takes milliseconds of CPU, about as
long as the GPU takes to run it (docs/serving.md). On an event loop's thread
that blocks every other task exactly as a ``synchronize()`` would, however
cheaply the result is then awaited. :func:`launch` moves the enqueue to a
launcher thread of the device and returns a pending :class:`CudaFuture` at
once; the future is set when ``fn`` has enqueued its work (with events on
the launcher's stream), so ``await``, ``then()``, ``wait()`` and
``result()`` cover both the host enqueue and the GPU work.

How the launchers work, and why (docs/serving.md, "`launch()`"):

- Each device has ``CUDAFUT_LAUNCH_THREADS`` launcher threads (default 2),
  started on the first launch for the device. They share one queue
  (``queue.SimpleQueue``: a put costs the caller well under a µs and never
  blocks). Each owns one non-blocking stream, made current for CuPy and
  PyTorch while ``fn`` runs: work from two threads can overlap on the GPU,
  work from one thread is in order.
- PyTorch releases the GIL inside each operator, so two threads enqueue a
  model concurrently; more threads add little throughput and take the GIL
  from the event loop more often (the ``serve`` benchmark measures 1, 2 and
  4 threads).
- The caller's side: no CUDA call. :func:`launch` notes the caller's
  current streams (CuPy's, and PyTorch's when that differs) in the job; the
  launcher thread that takes the job records an event on each and makes its
  own stream wait for them before ``fn`` runs, so ``fn`` sees what the
  caller enqueued before calling :func:`launch` (and what it enqueued there
  since: the event comes later, never earlier). Recording on the calling
  thread released the GIL (the native core records without it), and each
  release while the launcher threads run a model's Python hands them the
  GIL, which the caller then waits for: 200 launches from one loop
  iteration stalled the loop for 2-10 times ``run_in_executor``'s longest
  stall (``benchmarks/stalls_cpu.py``). The per-thread default stream
  (``cudaStreamPerThread``) is the caller's own, so an event on it is still
  recorded by the caller.
- :func:`warm_launchers` runs a function once on *each* thread: a job
  taken from the shared queue may land on any thread, so each thread also
  has its own list of warm-up jobs, which it runs before it next takes from
  the shared queue. A thread blocked on the queue is woken by one of the
  copies of the warm-up put there (one per thread); a thread that takes a
  copy it has no use for puts it back only while a thread that still owes
  the warm-up may be asleep on the queue (and waits, ``_HAND_OVER_S`` at
  most, for that thread to take it). A thread busy with a long job delays
  only its own warm-up, never the others', and nothing polls meanwhile.
"""

from __future__ import annotations

import collections
import inspect
import os
import queue
import threading
import types
from collections.abc import Callable
from typing import Any, Final, TypeVar, overload

from . import _backend, _checks, _compiled, _cuda, _events, _lifetimes, _pools, _runtime, _torch
from ._events import EventRecord
from ._future import CudaFuture, new_pending
from ._interface import (
    adopt,
    complete_with,
    fail_future,
    new_future,
    records_of,
    succeeded,
    wait_for,
    when_set,
)
from ._log import logger
from ._producers import settle_launched
from ._trace import hooks as _trace

__all__ = ["enqueue", "launch", "launcher_threads", "stop", "warm_launchers"]

U = TypeVar("U")

_DEFAULT_THREADS: Final = 2


def launcher_threads() -> int:
    """How many launcher threads each device gets: ``CUDAFUT_LAUNCH_THREADS``
    (read when a device's launchers start), default 2.

    Raises:
        ValueError: the variable is set but is not a whole number from 1 to 64.
    """
    text = os.environ.get("CUDAFUT_LAUNCH_THREADS", "").strip()
    if not text:
        return _DEFAULT_THREADS
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise ValueError(f"CUDAFUT_LAUNCH_THREADS must be a whole number from 1 to 64, not {text!r}")
    return n


#: ``cudaStreamPerThread``: a handle that names the calling thread's own
#: default stream, which only that thread can record on.
_PER_THREAD: Final = 2

#: One of the caller's streams, for the launcher to record on: its handle,
#: the ``owner`` to record with (a CuPy stream; None for PyTorch's, as
#: ``_torch`` records it), and the stream object, kept alive (so its handle
#: names it) until the launcher has recorded.
Caller = tuple[int, Any, Any]


#: One launch, as the shared queue carries it: a plain tuple (built by the
#: caller without a Python-level call) of ``(fn, args, kwargs, future,
#: after, callers)``: what to call, its future, and what its stream must
#: wait for first: ``after``, records made already, and ``callers``, streams
#: of the caller that the launcher records on when it takes the job.
_Job = tuple[
    Callable[..., Any],
    tuple[Any, ...],
    dict[str, Any],
    CudaFuture[Any],
    tuple[EventRecord, ...],
    tuple[Caller, ...],
]


class _Warm:
    """One :func:`warm_launchers` call: a job for each launcher thread.

    Each thread's job sits in that thread's ``todo`` list; the object itself
    goes into the shared queue once per thread, to wake the threads that
    sleep on it (see ``_Launchers``)."""

    __slots__ = ("cond", "jobs", "left")

    def __init__(self, jobs: list[_Job | None]) -> None:
        self.jobs = jobs
        # The threads that have not taken their job from their todo list yet.
        self.left: set[int] = set(range(len(jobs)))
        self.cond = threading.Condition(threading.Lock())


class _Launchers:
    """The launcher threads of one device and their shared queue.

    Besides the shared queue, each thread has a ``todo`` list of warm-up
    jobs meant for it alone (:func:`warm_launchers`), which it empties before
    each take from the shared queue, and an ``idle`` flag, set while it may
    be asleep on the shared queue."""

    def __init__(self, device: int, threads: int) -> None:
        self.device = device
        self.queue: queue.SimpleQueue[_Job | _Warm | None] = queue.SimpleQueue()
        self.todo: list[collections.deque[_Warm]] = [collections.deque() for _ in range(threads)]
        self.idle = [False] * threads
        # Made here, on the thread of the first launch(): a stream CUDA
        # refuses fails that launch() instead of killing a launcher thread
        # (and hanging every later launch on the device).
        with _backend.current.on_device(device):
            self.streams = [_backend.current.new_stream(device, 0) for _ in range(threads)]
        for stream in self.streams:
            _pools.keep_stream(stream, device)
        self.threads = [
            threading.Thread(
                target=_serve,
                args=(self, i),
                name=f"cudafut-launcher-{device}-{i}",
                daemon=True,
            )
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()


_lock = threading.Lock()
# Indexed by device; None until the device's first launch.
_launchers: list[_Launchers | None] = []


def _launchers_of(device: int) -> _Launchers:
    with _lock:
        if len(_launchers) <= device:
            _launchers.extend([None] * (device + 1 - len(_launchers)))
        found = _launchers[device]
        if found is None:
            found = _launchers[device] = _Launchers(device, launcher_threads())
        return found


def _serve(launchers: _Launchers, index: int) -> None:
    """A launcher thread: take jobs in turn, run each on this thread's stream."""
    device = launchers.device
    jobs = launchers.queue
    todo = launchers.todo[index]
    idle = launchers.idle
    stream = launchers.streams[index]
    ptr = int(stream.ptr)
    streams = {device: stream}
    while True:
        while todo:
            _warm_here(todo.popleft(), index, ptr, device, streams)
        idle[index] = True
        if todo:  # a warm-up came since the test above: run it before sleeping
            idle[index] = False
            continue
        job = jobs.get()
        idle[index] = False
        if job is None:
            while todo:  # a warm-up queued for this thread: it does not end owing it
                _warm_here(todo.popleft(), index, ptr, device, streams)
            return
        if type(job) is _Warm:
            _pass_on(launchers, job, index)
            continue
        _run(job, ptr, device, streams)  # type: ignore[arg-type]
        del job  # not kept alive while waiting for the next job


def _run(job: _Job, ptr: int, device: int, streams: dict[int, Any]) -> None:
    """Run one job on this launcher thread's stream (``ptr``)."""
    fn, args, kwargs, future, after, callers = job
    if future.cancelled():  # cancelled before it started: never run
        return
    try:
        for rec in after:
            rec.wait_on(ptr, device)
        for handle, owner, _ in callers:  # the caller's streams, recorded here (see the module)
            _events.record(handle, device, None, owner).wait_on(ptr, device)
        settle_launched(future, _no_awaitable(fn), args, kwargs, streams)
        if future.cancelled():
            # Cancelled while fn ran: its work still reads the arguments.
            _lifetimes.hold((_events.record(ptr, device),), (args, kwargs))
    except BaseException as exc:  # noqa: BLE001 - a launcher thread never dies of fn
        # settle_launched stores fn's Exception in the future; this is
        # KeyboardInterrupt/SystemExit from fn, or a failure of CUDA
        # itself: the awaiting side raises it, this thread goes on.
        if not isinstance(exc, Exception):
            logger.warning("cudafut: %r from a launched function fails its future", exc)
        try:
            fail_future(future, exc)
        except BaseException:  # noqa: BLE001
            logger.exception("cudafut: a launcher could not fail %r", future)


def _warm_here(warm: _Warm, index: int, ptr: int, device: int, streams: dict[int, Any]) -> None:
    """Run this thread's job of a warm-up (taken from its todo list)."""
    with warm.cond:
        warm.left.discard(index)
        warm.cond.notify_all()
    job = warm.jobs[index]
    warm.jobs[index] = None  # its future keeps what it needs
    if job is not None:
        # A service's start-up: the device's notice streams made now, not by
        # its first notice behind the requests' work (docs/design.md, hazard 11).
        try:
            _backend.current.prepare_notices(device, _backend.PREPARE_NOTICES_S)
        except Exception:  # noqa: BLE001 - a launcher thread never dies of it, and fn still runs
            logger.warning(
                "cudafut: a launcher thread could not prepare device %d's notices", device, exc_info=True
            )
        _run(job, ptr, device, streams)


#: How long a launcher thread that put a warm-up's copy back on the queue (for
#: a thread asleep there) waits for that thread to take it, at most, before
#: it takes jobs again: without the wait it could take the copy back itself,
#: over and over. The sleeping thread wakes in µs; the limit matters only
#: where it took another job first (it then runs the warm-up after that job).
_HAND_OVER_S: Final = 0.001


def _pass_on(launchers: _Launchers, warm: _Warm, index: int) -> None:
    """A copy of a warm-up taken from the shared queue: it woke this thread,
    whose own job (if any) is in its todo list. Where a thread that still
    owes the warm-up may be asleep on the queue, the copy goes back there
    for it."""
    idle = launchers.idle
    with warm.cond:
        if index in warm.left:
            return  # this thread's own copy: its todo list has the job
        waiting = len(warm.left)
        if not any(idle[j] for j in warm.left):
            return  # the threads that owe it are busy: they look at their todo list next
        launchers.queue.put(warm)
        warm.cond.wait_for(lambda: len(warm.left) < waiting, _HAND_OVER_S)


#: launch()'s own test of a plain function (see _checks.is_async_callable).
_FunctionType: Final = types.FunctionType
_CO_COROUTINE: Final = inspect.CO_COROUTINE
_MARKER: Final = "_is_coroutine_marker"

#: What launch() and warm_launchers() say to do instead of a coroutine function.
_INSTEAD_OF_ASYNC: Final = (
    "Make it a plain function (def) that enqueues the GPU work, or await the coroutine on your "
    "loop itself (cudafut.Batcher takes an async run_batch)"
)

#: launch()'s refusal of an awaitable ``fn`` returned.


_AWAITABLE: Final = (
    "launch() runs fn on a launcher thread, which has no event loop to await what fn returned: "
    "{fn!r} returned {kind}. Make fn a plain function that enqueues the GPU work and returns its "
    "value (or a CudaFuture), or await the awaitable on your loop itself"
)


def _no_awaitable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, raising :class:`TypeError` where it returns an awaitable other
    than a :class:`CudaFuture` (a coroutine is closed, so Python does not
    warn later that it was never awaited). Costs the launcher thread a call
    and a type test, under a µs."""

    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if not isinstance(out, CudaFuture) and inspect.isawaitable(out):
            if inspect.iscoroutine(out):
                out.close()
            raise TypeError(_AWAITABLE.format(fn=fn, kind=f"an awaitable ({type(out).__name__})"))
        return out

    name = getattr(getattr(fn, "func", fn), "__qualname__", None)  # as the trace names fn
    call.__qualname__ = name if isinstance(name, str) else type(fn).__qualname__
    return call


@overload
def launch(
    fn: Callable[..., CudaFuture[U]], /, *args: Any, device: int | None = ..., **kwargs: Any
) -> CudaFuture[U]: ...
@overload
def launch(fn: Callable[..., U], /, *args: Any, device: int | None = ..., **kwargs: Any) -> CudaFuture[U]: ...
def launch(
    fn: Callable[..., Any], /, *args: Any, device: int | None = None, **kwargs: Any
) -> CudaFuture[Any]:
    """Run ``fn(*args, **kwargs)`` on a launcher thread of ``device``; return its future at once.

    For work whose *enqueue* costs host time (a PyTorch model: milliseconds
    for a ResNet-50), so that it never runs on the event loop's thread. ``fn``
    runs on one of the device's launcher threads (``device``: default the
    current device), with that thread's own non-blocking stream current for
    CuPy and, when the program imported torch, for PyTorch. That stream
    first waits for the work already enqueued on the caller's current
    streams (CuPy's, and PyTorch's), as in :func:`submit`: the launcher
    thread records an event on each as it takes the job, so the wait also
    covers what the caller enqueued there between :func:`launch` and then
    (on the per-thread default stream, ``cudaStreamPerThread``, which only
    the caller can record on, the event is recorded in :func:`launch`).

    The returned future is pending until ``fn`` has returned; it is then set
    with ``fn``'s return value and an event recorded on the launcher's
    stream after what ``fn`` enqueued (if ``fn`` returns a
    :class:`CudaFuture`, the future follows it), or failed with the
    exception ``fn`` raised, its type kept. So one future covers the host
    enqueue and the GPU work: ``await``, ``then()``, ``wait()`` and
    ``result()`` work as on any future (``wait()`` and ``result()`` block
    the calling thread until the future is set). ``then()`` callbacks of a
    future completed by a launcher run on that launcher thread.

    A future cancelled before ``fn`` starts never runs it. Cancelled while
    ``fn`` runs, the future stays cancelled and what ``fn`` enqueued still
    runs; its result is dropped. ``args`` and ``kwargs`` are kept alive until
    the future's events complete.

    Launches from one thread may run on different launcher threads, and so
    on different streams: two launches are not ordered with each other
    unless one waits for the other's future (pass the future in and call
    ``fut.wait()`` inside ``fn`` once it is set, or chain with ``then()``).
    ``fn`` must not block on a future that a later :func:`launch` sets: the
    launcher threads may all be busy with it.

    Cost on the calling thread: the current streams looked up, a future and
    a queue put, no CUDA call, and the GIL held throughout: a CUDA call
    made without the GIL (as the native core records events) hands the GIL
    to the launcher threads while they run a model's Python, and the caller
    then waits for it (docs/serving.md, "`launch()`", which shows what the
    loop's stalls come to under 200 launches in flight beside
    ``run_in_executor``: ``python -m benchmarks.stalls``). It blocks neither
    the thread nor the GPU. The first launch on a device also creates its launcher threads and
    their streams.

    The launcher threads have PyTorch's per-thread defaults, whatever the
    caller set: grad mode on, no autocast. Enter ``torch.inference_mode()``
    (or ``no_grad``, ``autocast``) inside ``fn``.

    ``fn`` must be a plain function: a launcher thread runs no event loop.
    A coroutine function (``async def``) is refused at the call, before
    anything is enqueued; if ``fn`` returns an awaitable all the same (a
    coroutine, an asyncio future; a :class:`CudaFuture` is followed), the
    future fails with :class:`TypeError` and a coroutine is closed unrun.

    Raises:
        TypeError: ``fn`` is not callable, or is a coroutine function, or
            ``device`` is not an int.
        ValueError: ``device`` is out of range.
        CudaUnavailableError: CUDA cannot be used here.
    """
    # The caller's path, trimmed to what it must do (benchmarks/serve.py
    # measures it): a plain function, the common case, is judged by its
    # code's flag here (what _checks.is_async_callable tests first); anything
    # else goes through the full checks. The forked test is a flag's.
    if type(fn) is not _FunctionType or fn.__code__.co_flags & _CO_COROUTINE or _MARKER in fn.__dict__:
        if not callable(fn):
            raise TypeError(f"launch() needs a callable, not {fn!r}")
        _checks.not_async(fn, "launch()", "on a launcher thread", _INSTEAD_OF_ASYNC)
    if _runtime.forked:
        _runtime.check_usable()
    dev = _backend.current.current_device() if device is None else _cuda.check_device(device)
    callers = _caller_streams(dev)
    for handle, _, _ in callers:
        if handle == _PER_THREAD:  # the caller's own stream: only the caller can record on it
            after = tuple(_events.record(h, dev, None, owner) for h, owner, _ in callers)
            return enqueue(fn, args, kwargs, dev, after)
    # enqueue(), inline.
    launchers = _launchers[dev] if dev < len(_launchers) else None
    if launchers is None:
        launchers = _launchers_of(dev)
    future: CudaFuture[Any] = new_pending() if _trace.active is None else new_future("launch")
    launchers.queue.put((fn, args, kwargs, future, (), callers))
    return future


def _caller_streams_py(device: int) -> tuple[Caller, ...]:
    """The calling thread's current streams of ``device`` (CuPy's, and
    PyTorch's where the program imported torch and its current stream is
    another), for a launcher to record on: what ``_torch.current_records``
    records, without recording. Holds the GIL throughout (no CUDA call)."""
    stream = _backend.current.current_stream(device)
    ptr = int(stream.ptr)
    torch = _torch.loaded()
    if torch is not None:
        other = torch.cuda.current_stream(device)
        handle = int(other.cuda_stream)
        if handle != ptr:
            return ((ptr, stream, stream), (handle, None, other))
    return ((ptr, stream, stream),)


# The native core's twin (cudafut/_core.pyx, caller_streams) where it runs:
# the same lookups without the Python frames around CuPy's getter.
_native = _compiled.native()
_caller_streams: Callable[[int], tuple[Caller, ...]] = (
    _caller_streams_py if _native is None else _native.caller_streams
)


def warm_launchers(
    fn: Callable[..., Any], /, *args: Any, device: int | None = None, **kwargs: Any
) -> CudaFuture[None]:
    """Run ``fn(*args, **kwargs)`` once on *each* launcher thread of ``device``; return a future at once.

    For a service's start-up, before it takes requests. The first call of a
    PyTorch model on a launcher thread pays for what PyTorch makes per
    thread and per stream (a cuBLAS handle and workspace for the thread's
    stream, cuDNN's handle, the choice of kernels), and holds the GIL for
    part of it: 200 tasks launching a fp16 ResNet-50 at once stall their
    event loop some twenty times longer in their first round than in any
    later round (docs/serving.md, "Cold launcher threads"). Call
    ``warm_launchers(model, example)`` at start-up and that first call runs
    there instead. A torch.compile'd model with ``mode="reduce-overhead"``
    needs it too: CUDA cannot create a thread's cuBLAS handle inside the
    graph capture that a first compiled call on that thread may start.

    ``fn`` runs exactly once on every launcher thread of ``device`` (default:
    the current device; its threads start here if no launch started them),
    as :func:`launch` runs it: that thread's stream is current for CuPy and
    PyTorch, and first waits for what the caller enqueued on its current
    streams. A thread busy with a launch runs ``fn`` after that launch; it
    delays no other thread's run. The returned future is set (to None) once
    every thread's ``fn`` has returned, with events after what each
    enqueued, so ``await``, ``wait()`` and ``result()`` also wait for that
    GPU work. Where ``fn`` raised on some threads, the future fails, once
    every thread has run ``fn``, with the first of those exceptions.
    Cancelling it does not stop the runs.

    Each thread first makes sure the device's CUDA notice streams exist
    (:class:`WaitPolicy`'s ``notify``), waiting up to 10 s for them: made
    by the first notice instead, their creation could wait behind the
    requests' work and hold other CUDA calls of the process meanwhile
    (docs/design.md, hazard 11). Once made, that costs a lookup; until
    then, each thread runs no launch while it waits.

    Blocks neither the calling thread nor the loop: the cost there is that
    of one :func:`launch` per thread (an event recorded, a future and a
    queue put each; starting the threads and their streams, if this is the
    first use of the device's launchers). ``result()`` on the future blocks
    the thread until all have run. Each launcher thread runs no launch
    while it runs ``fn``; the GIL that ``fn`` holds on a cold thread stalls
    the loop all the same, which is why this belongs before serving.

    Raises:
        TypeError: ``fn`` is not callable, or is a coroutine function, or
            ``device`` is not an int (before anything is enqueued).
        ValueError: ``device`` is out of range.
        CudaUnavailableError: CUDA cannot be used here.
    """
    if not callable(fn):
        raise TypeError(f"warm_launchers() needs a callable, not {fn!r}")
    _checks.not_async(fn, "warm_launchers()", "on the launcher threads", _INSTEAD_OF_ASYNC)
    _cuda.check_usable()
    dev = _backend.current.current_device() if device is None else _cuda.check_device(device)
    launchers = _launchers[dev] if dev < len(_launchers) else None
    if launchers is None:
        launchers = _launchers_of(dev)
    after = _torch.current_records(dev)
    futures: list[CudaFuture[Any]] = [new_future("warm_launchers") for _ in launchers.threads]
    out: CudaFuture[None] = new_future("warm_launchers")
    _join(out, futures)
    warm = _Warm([(fn, args, kwargs, fut, after, ()) for fut in futures])
    for todo in launchers.todo:
        todo.append(warm)
    for _ in launchers.threads:  # wakes the threads asleep on the queue
        launchers.queue.put(warm)
    return out


def _join(out: CudaFuture[None], futures: list[CudaFuture[Any]]) -> None:
    """Once all ``futures`` are completed: set ``out`` to None with the
    events of all, or, where some failed, fail it with the first to fail
    (every failure counts as retrieved: ``out`` stands for them)."""
    wait_for(out, futures)
    lock = threading.Lock()
    left = [len(futures)]
    failed: list[CudaFuture[Any]] = []

    def one_completed(fut: CudaFuture[Any]) -> Any:
        with lock:
            if not succeeded(fut):
                failed.append(fut)
            left[0] -= 1
            if left[0]:
                return None
        if not failed:
            records = tuple(rec for f in futures for rec in records_of(f))
            complete_with(out, None, records, tuple(futures))
            return None
        pending = adopt(out, (failed[0],))
        for other in failed[1:]:
            adopt(out, (other,))  # out is failed already: this only marks its error retrieved
        return pending

    for fut in futures:
        when_set(fut, lambda fut=fut: one_completed(fut))  # type: ignore[misc]


def enqueue(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: int,
    after: tuple[EventRecord, ...],
    callers: tuple[Caller, ...] = (),
) -> CudaFuture[Any]:
    """:func:`launch` with its arguments checked: queue ``fn`` for the
    launchers of ``device``, its stream to wait for ``after`` first, and for
    events the launcher records on ``callers`` (streams of the caller) when
    it takes the job."""
    launchers = _launchers[device] if device < len(_launchers) else None
    if launchers is None:
        launchers = _launchers_of(device)
    future: CudaFuture[Any] = new_future("launch")
    launchers.queue.put((fn, args, kwargs, future, after, callers))
    return future


def enqueue_as_caller(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: int,
    after: tuple[EventRecord, ...],
) -> CudaFuture[Any]:
    """:func:`enqueue`, its stream to wait for ``after`` and, as
    :func:`launch` has it, for the calling thread's current streams of
    ``device``: noted here, recorded by the launcher that takes the job (no
    CUDA call on the calling thread, unless a stream is the per-thread
    default stream, which only its thread can record on)."""
    callers = _caller_streams(device)
    for handle, _, _ in callers:
        if handle == _PER_THREAD:
            mine = tuple(_events.record(h, device, None, owner) for h, owner, _ in callers)
            return enqueue(fn, args, kwargs, device, mine + after)
    return enqueue(fn, args, kwargs, device, after, callers)


def stop(device: int, timeout: float = 60.0) -> bool:
    """End the launcher threads of ``device`` once they have run what is
    queued for them; the next launch on the device starts new ones, with
    new streams (for the ``serve`` benchmark, which measures cold
    launchers). Blocks the calling thread until they end or ``timeout``
    passes; returns whether they all ended. Call it only while no other
    thread launches on the device: a launch queued behind the threads' end
    would never run."""
    with _lock:
        found = _launchers[device] if device < len(_launchers) else None
        if found is None:
            return True
        _launchers[device] = None
    for _ in found.threads:
        found.queue.put(None)
    ended = True
    for thread in found.threads:
        thread.join(timeout)
        ended = ended and not thread.is_alive()
    return ended


def _after_fork_in_child() -> None:
    # The launcher threads did not survive the fork; a child that may use
    # CUDA again (it did not initialise it before) starts new ones.
    global _lock
    _lock = threading.Lock()
    _launchers.clear()


_lifetimes.at_fork_in_child(_after_fork_in_child)


#: How long removing cudafut.testing's fake waits for each of its launcher
#: threads to finish the jobs queued on it.
_FAKE_JOIN_S: Final = 10.0


def _swap_launchers(backend: object) -> Callable[[], None]:
    """Launchers of their own while cudafut.testing's fake CUDA is
    installed (a launcher owns a stream of the backend that started it);
    when it is removed, the fake's launchers end after their queued jobs and
    the previous ones come back."""
    with _lock:
        saved = list(_launchers)
        _launchers.clear()

    def restore() -> None:
        with _lock:
            mine = [found for found in _launchers if found is not None]
            _launchers[:] = saved
        for launchers in mine:
            for _ in launchers.threads:
                launchers.queue.put(None)
        for launchers in mine:
            for thread in launchers.threads:
                thread.join(_FAKE_JOIN_S)
                if thread.is_alive():
                    logger.warning("cudafut: %s still runs a job as the fake CUDA is removed", thread.name)

    return restore


_cuda.on_swap(_swap_launchers)
