"""What ``pytest -ra`` says of the GPU tests on a machine without a usable
GPU: one line for them all, with the reason (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.subproc import ROOT

GPU_FILES = ["tests/test_gpu_waiter.py", "tests/test_gpu_faults.py", "tests/test_gpu_main.py"]


def test_the_gpu_tests_skip_in_one_line_per_reason() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDAFUT_REQUIRE_GPU"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, on a GPU machine too
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *GPU_FILES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    skipped = int(re.search(r"(\d+) skipped", out).group(1))  # type: ignore[union-attr]
    assert skipped > len(GPU_FILES), out
    lines = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith(f"SKIPPED [{skipped}] tests/conftest.py:"), lines[0]
    assert "no usable CUDA device" in lines[0], lines[0]
