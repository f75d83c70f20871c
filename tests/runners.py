"""Running a coroutine function to completion on a loop of a given kind, as a
user's program does (``asyncio.run``, ``uvloop.run``, ``trio.run``): for the
GPU tests that start their own loops, in this process, in threads, or in a
subprocess (importable there as ``tests.runners``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: The loops cudafut supports.
BACKENDS = ("asyncio", "uvloop", "trio")


def run_on(backend: str, async_fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """``async_fn(*args)`` on a new loop of ``backend`` (one of BACKENDS)
    in the calling thread; returns its result once the loop has closed."""
    if backend == "asyncio":
        return asyncio.run(async_fn(*args))
    if backend == "uvloop":
        import uvloop

        return uvloop.run(async_fn(*args))
    if backend == "trio":
        import trio

        return trio.run(async_fn, *args)
    raise ValueError(f"unknown backend {backend!r}: choose one of {BACKENDS}")
