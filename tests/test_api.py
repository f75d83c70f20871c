"""The public face: exports, error types, and behaviour without a GPU."""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import pickle
import re
import types

import pytest

import cudafut
from tests.subproc import ROOT, run_python


def test_all_names_exported_once_and_named_cudafut() -> None:
    # Subpackages (cudafut.distributed) appear once imported: not exports.
    public = {
        name
        for name in dir(cudafut)
        if not name.startswith("_") and not isinstance(getattr(cudafut, name), types.ModuleType)
    }
    assert set(cudafut.__all__) - {"__version__"} == public
    assert len(cudafut.__all__) == len(set(cudafut.__all__))
    for name in public - {"CancelledError"}:
        assert getattr(cudafut, name).__module__ == "cudafut", name
        assert getattr(cudafut, name).__doc__, f"{name} has no docstring"


def test_error_hierarchy_matches_the_standard_library() -> None:
    assert issubclass(cudafut.InvalidStateError, asyncio.InvalidStateError)
    assert issubclass(cudafut.InvalidStateError, concurrent.futures.InvalidStateError)
    assert issubclass(cudafut.TimeoutError, builtins.TimeoutError)
    assert issubclass(cudafut.TimeoutError, asyncio.TimeoutError)
    assert cudafut.CancelledError is concurrent.futures.CancelledError


def test_cuda_error_carries_code_name_and_advice() -> None:
    err = cudafut.CudaError(700, "cudaErrorIllegalAddress", "an illegal memory access", device=1)
    assert (err.code, err.name, err.device, err.sticky) == (700, "cudaErrorIllegalAddress", 1, True)
    text = str(err)
    assert "700" in text and "cudaErrorIllegalAddress" in text and "device 1" in text
    assert "restart the process" in text
    again = pickle.loads(pickle.dumps(err))
    assert (again.code, again.name, again.device, str(again)) == (700, err.name, 1, text)
    assert not cudafut.CudaError(1, "cudaErrorInvalidValue").sticky


def test_import_needs_no_gpu_and_first_cuda_call_explains() -> None:
    proc = run_python(
        """
        import cudafut
        fut = cudafut.CudaFuture()            # no CUDA needed yet
        fut.set_exception(KeyError("k"))
        assert isinstance(fut.exception(), KeyError)
        try:
            cudafut.submit(lambda: None)
        except cudafut.CudaUnavailableError as exc:
            print("unavailable:", exc)
        """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.returncode == 0, proc.stderr
    assert "unavailable:" in proc.stdout
    assert "device" in proc.stdout or "driver" in proc.stdout


def test_missing_cupy_is_explained() -> None:
    proc = run_python(
        """
        import sys
        sys.modules["cupy"] = None            # as if CuPy were not installed
        import cudafut
        try:
            cudafut.CudaFuture(devices=0)
        except cudafut.CudaUnavailableError as exc:
            print(exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "CuPy is not installed" in proc.stdout
    assert "cudafut[cuda12]" in proc.stdout


def test_an_old_driver_and_no_driver_are_told_apart() -> None:
    # CUDA says cudaErrorInsufficientDriver (35) for both: the message asks
    # whether the driver's library loads before it says "older".
    proc = run_python(
        """
        import cupy, cudafut
        from cudafut import _runtime

        def no_device():
            raise cupy.cuda.runtime.CUDARuntimeError(35)

        cupy.cuda.runtime.getDeviceCount = no_device
        for installed in (False, True):
            _runtime._driver_installed = lambda: installed
            try:
                _runtime._initialise()
            except cudafut.CudaUnavailableError as exc:
                print(installed, exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    absent, old = proc.stdout.splitlines()
    assert absent.startswith("False no NVIDIA driver is installed") and "older" not in absent
    assert old.startswith("True the NVIDIA driver is older") and "cudafut.testing" in old


# -- what a package index shows ------------------------------------------------

REPOSITORY = "https://github.com/cudafut/cudafut"


def test_the_mit_license_is_shipped() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 cudafut developers" in text
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert "LICENSE" in (ROOT / "MANIFEST.in").read_text().split()


def test_the_project_urls_point_at_the_repository() -> None:
    tomllib = pytest.importorskip("tomllib")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(url.startswith(REPOSITORY) for url in urls.values()), urls


def test_readme_links_work_on_a_package_index_page() -> None:
    """PyPI renders README.md away from the repository: a relative link breaks."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme) + re.findall(r"^\[[^]]+\]:\s*(\S+)", readme, re.M)
    assert targets, "the README links to its documentation"
    relative = [t for t in targets if not re.match(r"https?://|mailto:|#", t)]
    assert relative == [], f"make these absolute ({REPOSITORY}/blob/main/...): {relative}"
    for target in targets:
        prefix = REPOSITORY + "/blob/main/"
        if target.startswith(prefix):  # and they name files that exist
            assert (ROOT / target[len(prefix) :].split("#")[0]).exists(), target
