"""Shared fixtures: GPU detection, the async backends, and the GPU kernels."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cudafut import CudaUnavailableError, _cuda


def _gpu_missing() -> str | None:
    try:
        _cuda.device_count()
    except CudaUnavailableError as exc:
        return f"no usable CUDA device: {str(exc).split(' (CUDA said')[0]}"
    return None


GPU_MISSING = _gpu_missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_MISSING is None:
        return
    if os.environ.get("CUDAFUT_REQUIRE_GPU"):
        pytest.exit(f"CUDAFUT_REQUIRE_GPU is set but {GPU_MISSING}", returncode=3)
    skip = pytest.mark.skip(reason=GPU_MISSING)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    if GPU_MISSING is not None:
        return f"cudafut: GPU tests skip ({GPU_MISSING})"
    cp = _cuda.cupy()
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"cudafut: {_cuda.device_count()} GPU(s), device 0 {name}, CuPy {cp.__version__}"


if os.environ.get("CUDAFUT_MUTATE"):
    # A mutation run (scripts/mutation-check): disable one synchronisation
    # point in the library; the ordering tests must then fail.
    from tests import _mutations

    _mutations.apply(os.environ["CUDAFUT_MUTATE"])


ANYIO_BACKENDS: list[Any] = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param
