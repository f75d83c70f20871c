"""Processes a test talks to over a pipe (multiprocessing's ``spawn``
method, as CUDA needs), and waiting for what other processes do: for
tests/test_shared.py and tests/test_gpu_shared.py (the ``children`` fixture
of tests/conftest.py ends them)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

CTX = mp.get_context("spawn")


class Child:
    """``target(conn, *args)`` in a process of its own; ``conn`` is its end
    of a pipe to the test."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, theirs = CTX.Pipe()
        self.process = CTX.Process(target=target, args=(theirs, *args), daemon=True)
        self.process.start()
        theirs.close()

    def get(self, limit_s: float = 120.0) -> Any:
        """What the child sends next; ``limit_s`` only ends a test that
        would otherwise hang."""
        if not self.conn.poll(limit_s):
            pytest.fail(f"the other process sent nothing in {limit_s} s")
        return self.conn.recv()

    def ask(self, message: object = "stats", limit_s: float = 120.0) -> Any:
        self.conn.send(message)
        return self.get(limit_s)

    def end(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # it may be gone already
                self.conn.send("end")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Wait for ``condition`` (another process's doing: the share threads'
    rounds are 0.05-0.5 s); ``limit_s`` only ends a test that would
    otherwise hang, times ``CUDAFUT_TEST_SLOWDOWN`` (under compute-sanitizer,
    every CUDA call is many times slower)."""
    limit_s *= float(os.environ.get("CUDAFUT_TEST_SLOWDOWN", "1"))
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {limit_s} s")
        time.sleep(0.02)
