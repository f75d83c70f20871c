"""Scenarios of ``cudafut.launch`` shared by the fake-GPU and the GPU tests."""

from __future__ import annotations

import threading

import cudafut
from cudafut import _launch


def check_a_queued_launch_cancelled_never_runs(timeout: float) -> None:
    """Every launcher thread busy, a launch queued behind them and
    cancelled: once the queue is past it, on every thread, it never ran."""
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> int:
        started.release()
        release.wait(timeout)
        return 0

    cudafut.launch(lambda: 0).result(timeout=timeout)  # the launchers exist
    threads = len(_launch._launchers[0].threads)  # type: ignore[union-attr]
    holders = [cudafut.launch(hold) for _ in range(threads)]
    for _ in range(threads):
        assert started.acquire(timeout=timeout)  # every launcher is busy now
    ran: list[int] = []
    victim = cudafut.launch(ran.append, 1)
    assert victim.cancel()
    release.set()
    for fut in holders:
        fut.result(timeout=timeout)
    for _ in range(threads + 1):  # the queue is past the victim, on every launcher thread
        cudafut.launch(lambda: 0).result(timeout=timeout)
    assert ran == []
    assert victim.cancelled()
