"""Streams per task: :func:`task_stream`, :func:`own_stream`,
:func:`use_task_streams` and :func:`use_stream`.

CuPy's and PyTorch's current stream belongs to a thread, so every asyncio
(or trio) task of a thread shares it, and a ``with stream:`` held across an
``await`` leaks into whichever task runs next (docs/design.md, hazard 4).
Here each task gets a stream of its own, kept in a context variable (which
follows the task, not the thread), and a coroutine under :func:`own_stream`
runs each of its steps with that stream current: it is made current when
the task resumes and the previous one restored when the task yields.

When such a coroutine ends, the work it queued is joined to whoever goes on
with its result, on the device (no host wait): an event is recorded on the
task's stream, and

- the task that started it (whose context it inherited), if that task runs
  its steps on its own stream too, makes its stream wait for the event at
  its next step (``await task``, ``gather``, task groups and nurseries alike:
  the join comes when the child ends, not when its result is read);
- otherwise the thread's current stream waits for it: the stream the
  awaiter's CuPy calls use, when the awaiter is a plain task or the same
  task (a decorated coroutine awaited inline).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterator
from contextlib import contextmanager
from typing import Any, Final, ParamSpec, TypeVar

from . import _backend, _cuda, _events, _loops, _pools, _torch
from ._errors import CudaUnavailableError
from ._events import EventRecord

__all__ = ["own_stream", "task_stream", "use_stream", "use_task_streams"]

P = ParamSpec("P")
T = TypeVar("T")


class _TaskStreams:
    """The streams of one task (or of one thread outside any loop)."""

    __slots__ = ("__weakref__", "current", "depth", "joins", "overrides", "owner", "parent", "streams")

    def __init__(self, owner: object, parent: _TaskStreams | None) -> None:
        self.owner = owner
        #: The state of the task this one was started from (its context's).
        self.parent = parent
        #: Own streams, per device, leased from the pool for the task's life.
        self.streams: dict[int, Any] = {}
        #: ``use_stream`` blocks in force, innermost last: (device, stream).
        self.overrides: list[tuple[int, Any]] = []
        #: The stream each step makes current, per device.
        self.current: dict[int, Any] = {}
        #: Steppers running the task's steps now (own_stream coroutines).
        self.depth = 0
        #: Final events of finished child tasks, waited for at the next step.
        self.joins: list[EventRecord] = []

    def stream(self, device: int) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            pool = _pools.task_streams  # once: the release goes back to the lending pool
            stream = self.streams[device] = pool.acquire(device)
            weakref.finalize(self, pool.release, device, stream)
            self.refresh()
        return stream

    def refresh(self) -> None:
        current = dict(self.streams)
        for device, stream in self.overrides:
            current[device] = stream
        self.current = current


_state: Final[contextvars.ContextVar[_TaskStreams | None]] = contextvars.ContextVar(
    "cudafut_task_streams", default=None
)


def _state_of_task(owner: object | None = None) -> _TaskStreams:
    """The calling task's state, made on first use (a task inherits its
    parent's context variable: that is its parent's, not its own)."""
    if owner is None:
        owner = _loops.current_task()
    state = _state.get()
    if state is None or state.owner is not owner:
        state = _TaskStreams(owner, state)
        _state.set(state)
    return state


def _root_frame(frame: types.FrameType | None, task: object) -> bool:
    """Whether ``frame`` is the frame of ``task``'s own coroutine (the
    task's root), not of one awaited inside the task."""
    coro = getattr(task, "get_coro", None)
    coro = coro() if coro is not None else getattr(task, "coro", None)
    return frame is not None and getattr(coro, "cr_frame", None) is frame


def task_stream(device: int | None = None) -> Any:
    """The calling task's own CuPy stream for ``device`` (default: the
    current device).

    In an asyncio (or uvloop) or trio task: a non-blocking stream taken from
    cudafut's pool on the task's first call for that device and kept for
    the task's life, whichever thread it runs in (a context variable follows
    the task); a task started from another gets a stream of its own. Outside
    any event loop, the calling thread's. After 64 streams on one device,
    tasks share the least used (their work is then ordered, never wrong).

    Under :func:`own_stream` (or :func:`use_task_streams`) this is the
    stream the task's steps make current, unless a :func:`use_stream` block
    overrides it.

    Cost: about a µs once the stream exists (a context variable and a
    dictionary); the first call per task and device about 10 µs more, and
    creating the stream when the pool has none free (a CUDA call). Blocks
    nothing. The stream goes back to the pool when the task, and the tasks
    started from it, are gone.

    Raises:
        TypeError: ``device`` is not an int.
        ValueError: ``device`` is negative, or not below the device count.
        CudaUnavailableError: CUDA cannot be used here.
    """
    device = _backend.current.current_device() if device is None else _cuda.check_device(device)
    return _state_of_task().stream(device)


def own_stream(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Run each step of the decorated ``async def`` on its task's own stream.

    Every step (the code between two ``await`` points that yield to the
    loop) runs with CuPy's current stream (and PyTorch's, when torch is
    imported) of each device the task uses set to the task's stream
    (:func:`task_stream`; the current device's is taken at the first step),
    or to the stream of a :func:`use_stream` block; the previous streams are
    restored when the step yields, so other tasks never see them, however
    many ``await`` the coroutine holds. cudafut's calls in the coroutine
    (:func:`submit`, :meth:`~CudaFuture.then`, :func:`record`,
    ``set_result``, :meth:`~CudaFuture.wait`, ``await``, the copies) use that
    stream as they use CuPy's current stream.

    When the coroutine ends, its awaiter's current stream waits on the
    device for an event recorded on the task's stream, so the value it
    returned is ready to use with no ``synchronize()``: the task that
    started it waits at its next step when it runs on its own stream too,
    else the thread's current stream waits (the module docstring of
    ``cudafut._tasks`` details it). A decorated coroutine awaited inline in
    a task that already runs on its own stream simply runs in it.

    Works on asyncio, uvloop and trio. Cost: about a µs per step (two stream
    switches); a few µs more per step with torch imported; an event record
    and a stream wait when the coroutine ends. Blocks nothing.

    Raises:
        TypeError: ``fn`` is not an ``async def`` function.
    """
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"own_stream() decorates an async def function, not {fn!r}: its steps are what get the stream"
        )

    @functools.wraps(fn)
    async def run_on_own_stream(*args: P.args, **kwargs: P.kwargs) -> T:
        owner = _loops.current_task()
        root = _root_frame(sys._getframe(), owner)
        result: T = await _steps(fn(*args, **kwargs), root=root, owner=owner)
        return result

    return run_on_own_stream


def use_task_streams() -> None:
    """Make every task created from now on, on the running asyncio (or
    uvloop) loop, run as if its coroutine were decorated with
    :func:`own_stream`.

    Installs a task factory, chained to the loop's current one (calling it
    twice installs it once). The cost is :func:`own_stream`'s, for every
    task: about a µs per task step, and a stream lease, an event record and
    a stream wait per task. Tasks created before keep running as they were;
    ``Task.get_coro()`` of the new tasks returns cudafut's wrapper around
    the coroutine.

    Raises:
        RuntimeError: no asyncio loop runs in this thread (under trio,
            decorate the task functions with :func:`own_stream`).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "use_task_streams() needs a running asyncio (or uvloop) loop: call it from a "
            "coroutine; under trio, decorate the task functions with @cudafut.own_stream"
        ) from None
    previous = loop.get_task_factory()
    if getattr(previous, "cudafut_task_streams", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        wrapped = _task_root(coro)
        if previous is None:
            return asyncio.Task(wrapped, loop=loop, **kwargs)
        return previous(loop, wrapped, **kwargs)

    factory.cudafut_task_streams = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


async def _task_root(coro: Coroutine[Any, Any, T]) -> T:
    try:
        _backend.current.initialise()
    except CudaUnavailableError:
        # Without CUDA the task runs as it would without the factory: every
        # task of the loop comes here, asyncio's own and GPU-free ones too.
        return await coro
    return await _steps(coro, root=True, owner=_loops.current_task())


@contextmanager
def use_stream(stream: Any) -> Iterator[Any]:
    """Make ``stream`` the calling task's stream for the block; yields it.

    In a task that runs its steps on its own stream (:func:`own_stream`,
    :func:`use_task_streams`), the block's steps run with ``stream`` as
    CuPy's (and PyTorch's) current stream of its device, and cudafut's calls
    use it; it is task-local, so the block may hold any number of
    ``await``: other tasks never see the stream. Outside any event loop,
    it is ``with stream:`` for the calling thread. Blocks may nest. Inserts
    no synchronisation between ``stream`` and the task's stream: order them
    yourself, or share arrays through :class:`Tracked`.

    ``stream``: a CuPy or PyTorch stream, or any object with
    ``__cuda_stream__``; kept alive for the block.

    Cost: a few µs to enter and leave. Blocks nothing.

    Raises:
        TypeError: ``stream`` is not a stream.
        ValueError: its handle is at an address where nothing is mapped
            (not a stream of this process: CUDA would crash on it; a
            handle into mapped memory that is no live stream cannot be
            checked, docs/interop.md).
        RuntimeError: called in a task that does not run on its own stream:
            CuPy's current stream belongs to the thread, and could not follow
            the task across an ``await``. Decorate the coroutine with
            :func:`own_stream` or call :func:`use_task_streams` first.
    """
    ptr, device = _cuda.stream_handle(stream)
    cupy_stream = _backend.current.cupy_stream(stream, ptr, device)
    owner = _loops.current_task()
    if isinstance(owner, threading.Thread):
        with cupy_stream:
            yield stream
        return
    state = _state.get()
    if state is None or state.owner is not owner or state.depth == 0:
        raise RuntimeError(
            "use_stream() in a task needs the task to run its steps on its own stream: decorate "
            "its coroutine with @cudafut.own_stream, or call cudafut.use_task_streams() before "
            "creating it (CuPy's current stream belongs to the thread and would leak to other "
            "tasks across an await); for a block without await, use `with stream:`"
        )
    entry = (device, cupy_stream)
    state.overrides.append(entry)
    state.refresh()
    previous = _switch(state.current)
    try:
        yield stream
    finally:
        # Back to the streams current when the block began (this step's
        # stepper restores the thread's own when the step yields).
        _restore(previous)
        state.overrides.remove(entry)
        state.refresh()


# -- the steps -------------------------------------------------------------------


# What a switch replaced: CuPy's streams, and PyTorch's (with the device
# that torch.cuda.set_stream made current) when torch is imported.
_Saved = tuple[list[Any], list[Any], int]
_NO_TORCH: Final[list[Any]] = []
_NOTHING: Final[_Saved] = ([], _NO_TORCH, -1)


def _switch(streams: dict[int, Any]) -> _Saved:
    """Make each of ``streams`` current for its device (for CuPy, and for
    PyTorch when it is imported); return what was current."""
    get = _get_current_stream
    if get is None:
        get = _bind()
    cupy_before: list[Any] = []
    for device, stream in streams.items():
        before = get(device)
        if before is not stream:
            stream.use()
            cupy_before.append(before)
    torch = _torch.loaded()
    if torch is None:
        return (cupy_before, _NO_TORCH, -1) if cupy_before else _NOTHING
    torch_before, device_before = _torch.use_pool_streams(torch, streams)
    return cupy_before, torch_before, device_before


_get_current_stream: Callable[[int], Any] | None = None


def _bind() -> Callable[[int], Any]:
    global _get_current_stream
    get = _backend.current.current_stream_getter()
    _get_current_stream = get
    return get


def _swap_binding(backend: object) -> Callable[[], None]:
    """Under cudafut.testing's fake CUDA, own_stream binds again (and
    fails: the fake has no CuPy) instead of using CuPy's real streams."""
    global _get_current_stream
    saved, _get_current_stream = _get_current_stream, None

    def restore() -> None:
        global _get_current_stream
        _get_current_stream = saved

    return restore


_cuda.on_swap(_swap_binding)


def _restore(saved: _Saved) -> None:
    cupy_before, torch_before, device_before = saved
    for stream in reversed(cupy_before):
        stream.use()
    if torch_before:
        _torch.restore_streams(torch_before, device_before)


@types.coroutine
def _steps(coro: Coroutine[Any, Any, T], *, root: bool, owner: object) -> Generator[Any, Any, T]:
    """Drive ``coro`` step by step on its task's streams (see the module
    docstring); ``root``: ``coro`` is its task's own coroutine; ``owner``:
    the running task (:func:`cudafut._loops.current_task`)."""
    state = _state.get()
    if not root and state is not None and state.owner is owner and state.depth > 0:
        # Inline in a task that runs on its own stream already: its steps
        # are ours, and the join would be a stream waiting on itself.
        return (yield from coro.__await__())
    try:
        state = _state_of_task(owner)
        state.stream(_backend.current.current_device())
    except BaseException:
        coro.close()  # never started: Python must not warn that it was never awaited
        raise
    state.depth += 1
    # One generator drives the coroutine (no inner `yield from`): each layer
    # costs every step of the task a frame resumption.
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            saved = _switch(state.current)
            try:
                if state.joins:
                    _join(state.joins, state.current)
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                result: T = stop.value
                break
            finally:
                _restore(saved)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - cancellation or an error thrown in: the coroutine's
                value, error = None, exc
    except BaseException:
        if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()  # its first step could not start: no "never awaited" warning
        state.depth -= 1
        if state.depth == 0:
            try:  # noqa: SIM105 - the coroutine's exception is the one to see
                _finish(state, root=root)
            except Exception:  # noqa: BLE001
                pass
        raise
    state.depth -= 1
    if state.depth == 0:
        _finish(state, root=root)
    return result


def _join(joins: list[EventRecord], streams: dict[int, Any]) -> None:
    """Make the task's streams wait for the final events of its children."""
    records = joins[:]
    del joins[: len(records)]
    for rec in records:
        stream = streams.get(rec.device)
        if stream is None:
            stream = _backend.current.current_stream(rec.device)
        handle = int(stream.ptr)
        if handle != rec.stream:
            rec.wait_on(handle, rec.device)


def _finish(state: _TaskStreams, *, root: bool) -> None:
    """The coroutine ended: join its work to whoever goes on with its result.

    ``root``: the coroutine is known to be its task's own (the task factory,
    or a frame check): its result then goes to the task's awaiters only.
    Where that is not known (a library's wrapper around the coroutine, such
    as anyio's, or a coroutine awaited inline) the thread's current stream
    waits too, for a plain awaiter in this task."""
    records = [_events.record(int(stream.ptr), device) for device, stream in state.streams.items()]
    parent = state.parent
    if parent is not None and parent.depth > 0 and parent.owner is not state.owner:
        parent.joins.extend(records)
        if root:
            return
    torch = _torch.loaded()
    for rec in records:
        current = int(_backend.current.current_stream(rec.device).ptr)
        if current != rec.stream:
            rec.wait_on(current, rec.device)
        if torch is not None:
            handle = _torch.current_handle(torch, rec.device)
            if handle not in (current, rec.stream):
                rec.wait_on(handle, rec.device)
