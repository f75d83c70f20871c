"""Streams per task, the host side: what is refused before CUDA is touched,
and what the decorator keeps of the function (GPU behaviour:
tests/test_gpu_tasks.py)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest

import cudafut


def test_own_stream_decorates_async_def_functions_only() -> None:
    def sync() -> None:
        pass

    async def agen() -> AsyncIterator[int]:
        yield 1

    for fn in (sync, agen, print):
        with pytest.raises(TypeError, match="async def"):
            cudafut.own_stream(fn)  # type: ignore[arg-type]


def test_the_decorated_function_looks_like_the_function() -> None:
    async def compute(x: int) -> int:
        """Doc."""
        return x

    decorated = cudafut.own_stream(compute)
    assert inspect.iscoroutinefunction(decorated)
    assert decorated.__name__ == "compute" and decorated.__doc__ == "Doc."
    assert decorated.__wrapped__ is compute  # type: ignore[attr-defined]


def test_use_task_streams_needs_a_running_asyncio_loop() -> None:
    with pytest.raises(RuntimeError, match="running asyncio"):
        cudafut.use_task_streams()


def test_use_stream_refuses_what_is_not_a_stream_before_touching_cuda() -> None:
    for bad in ("stream", 3, None):
        with pytest.raises(TypeError), cudafut.use_stream(bad):
            pass


def test_task_stream_refuses_a_bad_device_before_touching_cuda() -> None:
    with pytest.raises(TypeError):
        cudafut.task_stream("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        cudafut.task_stream(-1)


def test_use_task_streams_chains_the_loops_task_factory_once() -> None:
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: object, **kwargs: object) -> asyncio.Task[object]:
        made.append("user")
        return asyncio.Task(coro, loop=loop, **kwargs)  # type: ignore[arg-type]

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(factory)  # type: ignore[arg-type]
        cudafut.use_task_streams()
        installed = loop.get_task_factory()
        cudafut.use_task_streams()
        assert loop.get_task_factory() is installed
        task = asyncio.get_running_loop().create_task(asyncio.sleep(0, result=7))
        return [made[:], task.get_coro().__qualname__, installed is not factory]  # type: ignore[union-attr]

    made_then, wrapper, chained = asyncio.run(main())
    assert made_then == ["user"] and wrapper == "_task_root" and chained
