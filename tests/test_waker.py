"""The native notice threads (cudafut._waker, compiled from C) without a GPU:
every entry point refuses wrong arguments with an exception, never a crash,
and a waker that was not started takes no work. On a GPU:
tests/test_gpu_notices.py."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cudafut._waker") is None, reason="cudafut._waker is not built (pure install)"
)


@pytest.fixture
def waker() -> Any:
    from cudafut import _waker

    return _waker


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((), TypeError),
        (("1",), TypeError),
        ((None,), TypeError),
        ((0,), ValueError),
        ((-5,), ValueError),
        ((2000,), ValueError),
        ((2**70,), OverflowError),
        ((1, 2), TypeError),
    ],
)
def test_start_refuses_wrong_arguments(waker: Any, args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        waker.start(*args)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((), TypeError),
        ((1, 2), TypeError),
        (("ctx", 1, 3), TypeError),
        ((1, None, 3), TypeError),
        ((1, 2, "3"), TypeError),
        ((1, 2, -1), ValueError),
        ((1, 0, 3), ValueError),
        ((1, 2**65, 3), OverflowError),
        ((-1, 2, 3), OverflowError),
        ((1, 2, 2**40), OverflowError),
        ((1, 2, 3, 4), TypeError),
        ((1.5, 2, 3), TypeError),
    ],
)
def test_notice_refuses_wrong_arguments(waker: Any, args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        waker.notice(*args)


def test_statistics_is_a_snapshot_of_five_counts(waker: Any) -> None:
    stats = waker.statistics()
    assert len(stats) == 5 and all(isinstance(n, int) and n >= 0 for n in stats)
    with pytest.raises(TypeError):
        waker.statistics(1)


def test_a_waker_without_libcuda_takes_no_work_and_leaves_the_fd(waker: Any) -> None:
    """Without a driver (this machine, CI) start() says False and notice()
    refuses, leaving the descriptor to the caller."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a CUDA driver is present")
    assert waker.start(4) is False
    r, w = os.pipe()
    try:
        assert waker.notice(1, 2, w) is False
        os.fstat(w)  # still open: ours
    finally:
        os.close(r)
        os.close(w)


def test_pure_mode_never_loads_the_waker() -> None:
    from tests.subproc import run_python

    proc = run_python(
        "import sys, cudafut\nfrom cudafut import _backend, _cuda, _notices\n"
        "_backend.current.notice_stream\nprint(_notices._load_waker(), 'cudafut._waker' in sys.modules)",
        CUDAFUT_PURE="1",
    )
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
