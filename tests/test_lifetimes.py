"""_lifetimes: keep-alives, deferred frees and the one fork registry (CPU)."""

from __future__ import annotations

import ast
import asyncio
import gc
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _copies, _launch, _lifetimes, _loops, _runtime, _waiter
from tests.fakes import FakeRecord, gone
from tests.runners import BACKENDS, run_on
from tests.subproc import ROOT, run_python


def _calls_to_register_at_fork(path: Path) -> int:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "register_at_fork"
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def test_one_module_registers_with_os_at_fork() -> None:
    # Every reset goes through _lifetimes.at_fork_in_child, so their order is
    # the registry's (the order of import) and one place lists them.
    sites = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "cudafut").rglob("*.py"))
        if (n := _calls_to_register_at_fork(path))
    }
    assert sites == {"cudafut/_lifetimes.py": 1}, (
        f"os.register_at_fork is called in {sites}; register a reset with "
        "_lifetimes.at_fork_in_child() instead"
    )


def test_the_resets_run_in_import_order_cuda_first() -> None:
    resets = _lifetimes._fork_resets
    assert resets[0] is _runtime._after_fork_in_child  # the child refuses CUDA before anything else resets
    for reset in (
        _waiter.thread_waiter()._reset_after_fork,
        _launch._after_fork_in_child,
        _copies._reset_after_fork,
    ):
        assert reset in resets


def test_the_memory_modules_sit_below_the_waiter() -> None:
    for name in ("_pinned", "_memory"):
        tree = ast.parse((ROOT / "cudafut" / f"{name}.py").read_text(encoding="utf-8"))
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
            for alias in node.names
        } | {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
        assert "_waiter" not in imported and "_future" not in imported, name


class _Value:
    pass


def test_keep_until_holds_while_a_record_is_pending() -> None:
    done, pending = FakeRecord(), FakeRecord()
    done.complete()
    value = _Value()
    ref = weakref.ref(value)
    assert _lifetimes.keep_until([done, pending], value)
    del value
    time.sleep(0.02)
    gc.collect()
    assert ref() is not None  # kept by the watcher thread
    pending.complete()
    assert gone(ref)


def test_keep_until_holds_nothing_when_the_records_are_done() -> None:
    rec = FakeRecord()
    rec.complete()
    holding = _lifetimes.holding()
    assert not _lifetimes.keep_until([rec], _Value())
    assert _lifetimes.holding() == holding


def test_a_retired_release_waits_for_its_thread_or_for_staleness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lifetimes, "retired", {})
    released: list[str] = []
    other = threading.Thread(target=_lifetimes.retire, args=(released.append, "theirs"))
    other.start()
    other.join()
    _lifetimes.retire(released.append, "mine")
    _lifetimes.release_retired()
    assert released == ["mine"]  # another thread's may still be inside the deallocation that retired it
    monkeypatch.setattr(_lifetimes, "RETIRED_STALE_S", 0.0)
    _lifetimes.release_retired()
    assert released == ["mine", "theirs"]  # stale: any thread releases it
    assert not any(_lifetimes.retired.values())


def test_a_thread_releases_its_own_without_taking_the_fresh_ones_of_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_lifetimes, "retired", {})
    released: list[object] = []

    def retire_many() -> None:
        for n in range(1000):
            _lifetimes.retire(released.append, n)

    other = threading.Thread(target=retire_many)
    other.start()
    other.join()
    _lifetimes.retire(released.append, "mine")
    _lifetimes.retire(released.append, "mine too")
    _lifetimes.release_retired()
    assert released == ["mine", "mine too"]
    assert sum(len(queue) for queue in _lifetimes.retired.values()) == 1000  # untouched, in order
    monkeypatch.setattr(_lifetimes, "RETIRED_STALE_S", 0.0)
    _lifetimes.release_retired()
    assert released[2:] == list(range(1000))


def test_a_failed_release_is_logged_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_lifetimes, "retired", {})
    ran: list[object] = []

    def broken(arg: object) -> None:
        raise RuntimeError("an injected bug")

    _lifetimes.retire(broken, 1)
    _lifetimes.retire(ran.append, 2)
    _lifetimes.release_retired()
    assert ran == [2]
    assert any("deferred release failed" in r.getMessage() for r in caplog.records)


def test_a_failed_reset_is_logged_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("an injected bug")

    monkeypatch.setattr(_lifetimes, "_fork_resets", [broken, lambda: ran.append("after")])
    _lifetimes._after_fork_in_child()
    assert ran == ["after"]
    assert any("reset after fork failed" in r.getMessage() for r in caplog.records)


FORK = """
import gc, os, sys, time, weakref
import cudafut
from cudafut import _lifetimes, _waiter
from tests.fakes import FakeRecord, gone

class Value:
    pass

rec = FakeRecord()
_lifetimes.hold([rec], Value())                  # the parent's watcher thread runs
assert _waiter.thread_waiter()._thread is not None
pid = os.fork()
if pid == 0:
    code = 1
    try:
        waiter = _waiter.thread_waiter()
        assert waiter._thread is None and waiter.holding == 0   # reset: no thread, nothing held
        child_rec, value = FakeRecord(), Value()
        ref = weakref.ref(value)
        _lifetimes.hold([child_rec], value)       # a new watcher thread keeps it
        del value
        gc.collect()
        assert ref() is not None
        child_rec.complete()
        assert gone(ref)
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
rec.complete()
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)")
def test_a_forked_child_gets_a_fresh_watcher_thread() -> None:
    proc = run_python(FORK, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child 0"], proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loop_ended_with_a_callback_waiting_lets_its_future_go(fake_cuda: Any, backend: str) -> None:
    # A callback that reaches back into its loop (here: the loop, or trio's
    # token) made the loop's waiter hold its own key in the registry of
    # waiters, and with it every future it still watched, their records and
    # their memory, for good.
    refs: list[weakref.ref[Any]] = []

    async def main() -> None:
        trio = sys.modules.get("trio") if backend == "trio" else None
        run = asyncio.get_running_loop() if trio is None else trio.lowlevel.current_trio_token()
        fut = cudafut.record(np.ones(2), stream=fake_cuda.stream())
        fut.add_done_callback(lambda _f: run)
        refs.append(weakref.ref(fut))
        # The callback's watch is added on the loop's waiter meanwhile.
        await (asyncio.sleep(0.01) if trio is None else trio.sleep(0.01))

    run_on(backend, main)
    gc.collect()
    assert refs[0]() is None, "the ended loop's waiter still holds the future"
    assert not _loops._trio_drivers


def test_a_callback_whose_loop_ended_does_not_keep_the_loops_waiter(fake_cuda: Any) -> None:
    # The callback never runs (its loop ended first) and stays with the
    # future; it must not keep the ended loop's waiter, and its timer's
    # descriptor, alive for as long as the future lives.
    fut: cudafut.CudaFuture[int] = cudafut.CudaFuture()
    waiters: list[weakref.ref[Any]] = []

    async def main() -> None:
        fut.add_done_callback(lambda _f: None)
        waiters.append(weakref.ref(_loops.current_driver()))

    asyncio.run(main())
    fut.set_result(1)
    gc.collect()
    assert waiters[0]() is None, "the ended loop's waiter is kept by the future's callback"
