"""The native and the pure-Python core do the same (cudafut/_compiled.py):
hypothesis drives random sequences of operations (record, set, fail,
cancel, then, gather, callbacks, result, await, the fake GPU completing its
work) through two worker processes, one per core, on cudafut.testing's fake
GPU, and every observable outcome must be the same. Where no extension is
built, both workers run the pure core (the test still runs, and says so in
its first line)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.subproc import ROOT, python_env

OPS = [
    "new",
    "record",
    "set",
    "fail",
    "cancel",
    "then",
    "gather",
    "callback",
    "complete",
    "result",
    "await",
    "state",
]


class _Worker:
    def __init__(self, pure: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.core_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=python_env(CUDAFUT_PURE="1" if pure else "0"),
        )
        self.core = json.loads(self._line())["core"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the worker died"
        return line

    def run(self, ops: list[list[Any]]) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ops) + "\n")
        self.proc.stdin.flush()
        result: list[str] = json.loads(self._line())
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[_Worker, _Worker]]:
    compiled, pure = _Worker(pure=False), _Worker(pure=True)
    assert pure.core == "pure (CUDAFUT_PURE=1)"
    try:
        yield compiled, pure
    finally:
        compiled.close()
        pure.close()


op = st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 7)).map(list)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=25))
def test_both_cores_observe_the_same(workers: tuple[_Worker, _Worker], ops: list[list[Any]]) -> None:
    compiled, pure = workers
    assert compiled.run(ops) == pure.run(ops)


def test_the_workers_run_the_cores_they_say(workers: tuple[_Worker, _Worker]) -> None:
    compiled, pure = workers
    assert pure.core.startswith("pure")
    if compiled.core.startswith("pure"):
        pytest.skip(f"no native core here ({compiled.core}): both workers ran the pure core")
    assert compiled.core == "native"
