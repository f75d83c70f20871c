"""Processes of examples/service/multiproc.py's hand-off tests
(tests/test_examples_service.py), started with multiprocessing's ``spawn``
method: a GPU process of the toy model on the fake GPU, and a front that
asks without end until it is killed."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

SERVICE = Path(__file__).resolve().parent.parent / "examples" / "service"


def _multiproc() -> Any:
    sys.path.insert(0, str(SERVICE))  # multiproc imports its neighbours
    return importlib.import_module("multiproc")


def link(
    multiproc: Any, loop: asyncio.AbstractEventLoop, conn: Any, per_request: bool, max_batch: int
) -> Any:
    """A front's side of the hand-off on ``conn``, as multiproc.py's fronts make it."""
    if per_request:
        return multiproc._PerRequestLink(loop, [conn])
    return multiproc._Link(loop, [conn], max_batch, 0.0)


def gpu(conns: list[Any], per_request: bool, max_batch: int, max_delay_s: float, ready: Any) -> None:
    """multiproc.py's GPU process with its toy model."""
    multiproc = _multiproc()
    multiproc.gpu_main(
        0, multiproc.TOY, conns, max_batch, max_delay_s, ready, freeze=False, per_request=per_request
    )


def front(conn: Any, per_request: bool, asking: Any) -> None:
    """A front that asks for 8 answers a millisecond until it is killed;
    ``asking`` is set once its first answer came."""
    multiproc = _multiproc()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        me = link(multiproc, loop, conn, per_request, 16)
        tasks: set[asyncio.Task[Any]] = set()

        async def one(k: int) -> None:
            await me.ask(k)
            asking.set()

        k = 0
        while True:
            for _ in range(8):
                task = loop.create_task(one(k % 256))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
            await asyncio.sleep(0.001)

    asyncio.run(main())
