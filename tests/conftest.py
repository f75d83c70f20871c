"""Shared fixtures: GPU detection, the async backends, the GPU kernels, and
a check that every async test runs on the loop it says it runs on."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cudafut import CudaUnavailableError, _backend

# cudafut.testing's fixture (the plugin's own, where the entry point is not
# installed: a source checkout run without `pip install -e .`).
from cudafut._pytest_plugin import fake_cuda as fake_cuda


def _gpu_missing() -> str | None:
    try:
        _backend.current.device_count()
    except CudaUnavailableError as exc:
        return f"no usable CUDA device: {str(exc).split(' (CUDA said')[0]}"
    return None


GPU_MISSING = _gpu_missing()

# The tests not marked ``gpu`` fake CUDA piecemeal (a patched backend call,
# records and streams with made-up handles); where a real driver is loaded,
# a path they do not patch hands those handles to it, and the process dies
# instead of failing. They run where no GPU is usable, as CI runs them;
# those marked ``anywhere`` (cudafut.testing's fake, one backend object that
# the native core calls through) run everywhere.
WITH_A_GPU = (
    "a test that fakes CUDA: with a GPU its made-up handles could reach the driver; "
    "it runs on a machine without one (as CI does)"
)


def _check_one_async_runner(items: list[pytest.Item]) -> None:
    """An item marked both ``anyio`` and ``asyncio`` runs on pytest-asyncio's
    plain loop whatever its ``anyio_backend`` says: its uvloop and trio
    variants would pass without running there. Refuse the mix."""
    mixed = [
        item.nodeid
        for item in items
        if item.get_closest_marker("anyio") is not None and item.get_closest_marker("asyncio") is not None
    ]
    if mixed:
        raise pytest.UsageError(
            "these tests carry both the anyio and the asyncio marker, so pytest-asyncio runs "
            "every anyio_backend variant on its own asyncio loop: keep one marker (anyio, and "
            "read the loop through the running loop or anyio_backend):\n  " + "\n  ".join(mixed)
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_one_async_runner(items)
    if GPU_MISSING is not None and os.environ.get("CUDAFUT_REQUIRE_GPU"):
        pytest.exit(f"CUDAFUT_REQUIRE_GPU is set but {GPU_MISSING}", returncode=3)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Without a usable GPU, every test marked ``gpu`` skips, before its
    fixtures, from this one line: ``pytest -ra`` then reports them all in
    one line with the reason (a skip marker would report each test's own
    location, one line per test). With one, the tests that fake CUDA
    piecemeal skip so (``WITH_A_GPU``)."""
    if GPU_MISSING is not None and "gpu" in item.keywords:
        pytest.skip(GPU_MISSING)
    if GPU_MISSING is None and "gpu" not in item.keywords and "anywhere" not in item.keywords:
        pytest.skip(WITH_A_GPU)


def pytest_report_header(config: pytest.Config) -> str:
    if GPU_MISSING is not None:
        return f"cudafut: GPU tests skip ({GPU_MISSING})"
    cp = _backend.current.cupy()
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return (
        f"cudafut: {_backend.current.device_count()} GPU(s), device 0 {name}, CuPy {cp.__version__}; "
        "the tests that fake CUDA skip here (CI runs them)"
    )


if os.environ.get("CUDAFUT_MUTATE"):
    # A mutation run (scripts/mutation-check): disable one synchronisation
    # point in the library; the ordering tests must then fail.
    from tests import _mutations

    _mutations.apply(os.environ["CUDAFUT_MUTATE"])


# -- the async backends ---------------------------------------------------------
# As anyio's own test suite runs: asyncio in debug mode (which also refuses
# a loop call from another thread), uvloop through a loop factory, on
# Python 3.12+ an asyncio loop whose tasks start eagerly, and trio. A test
# marked ``no_asyncio_debug(reason=...)`` runs its asyncio variants without
# debug mode, which records a stack for every task and callback.

try:
    import uvloop

    _new_uvloop: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # uvloop is a test dependency everywhere but on Windows
    _new_uvloop = None

ANYIO_BACKENDS: list[Any] = [
    pytest.param(("asyncio", {"debug": True}), id="asyncio"),
    pytest.param(
        ("asyncio", {"debug": True, "loop_factory": _new_uvloop}),
        id="uvloop",
        marks=pytest.mark.skipif(_new_uvloop is None, reason="uvloop is not installed"),
    ),
]
if sys.version_info >= (3, 12):

    def _eager_task_loop() -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        loop.set_task_factory(asyncio.eager_task_factory)
        return loop

    ANYIO_BACKENDS.append(
        pytest.param(("asyncio", {"debug": True, "loop_factory": _eager_task_loop}), id="eager")
    )
ANYIO_BACKENDS.append(pytest.param(("trio", {}), id="trio"))


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    name, options = request.param
    if "debug" in options and request.node.get_closest_marker("no_asyncio_debug") is not None:
        options = {**options, "debug": False}
    return name, options


# -- the GPU ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def warm_kernels() -> None:
    """Compile and load every kernel the in-process GPU tests use, on every
    device they use, before any of them runs: a first-use compile takes
    longer than the slow producers spin, and would order an unordered
    consumer by accident (the control tests would then fail, and a missing
    wait could pass)."""
    from tests.kernels import spin_copy, spin_fill

    cp = _backend.current.cupy()
    for device in range(min(2, _backend.current.device_count())):
        with cp.cuda.Device(device):
            a = cp.zeros(4, dtype=cp.float32)
            warm = [a + 1, a + 1.0, a + 0, a - 1, a * 2, a * 2.0, a * 3, a * 2 + 1, a + a]
            warm += [cp.full(4, 7, dtype=cp.float32), cp.full(4, -1.0, dtype=cp.float32), cp.empty_like(a)]
            spin_fill(a, 1, 0)
            spin_copy(a, a, 0)
            del warm
            cp.cuda.Device(device).synchronize()


@pytest.fixture(autouse=True)
def _warm_gpu_tests(request: pytest.FixtureRequest) -> None:
    """Every test marked ``gpu`` gets the warm kernels; no other test touches
    CUDA for them (without a GPU, the gpu tests are skipped before this)."""
    if GPU_MISSING is None and request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("warm_kernels")


@pytest.fixture
def cp(warm_kernels: None) -> Any:
    """CuPy, with the kernels warm and the current device idle: nothing a
    previous test left running can order (or slow) this one."""
    cupy = _backend.current.cupy()
    cupy.cuda.Device().synchronize()
    return cupy


@pytest.fixture
def children() -> Iterator[list[Any]]:
    """Processes the test starts (tests/children.py's ``Child``), ended
    after it."""
    started: list[Any] = []
    yield started
    for child in started:
        child.end()
