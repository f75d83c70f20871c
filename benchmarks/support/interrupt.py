"""Ctrl-C during ``result()`` while the GPU works: a fresh interpreter that
blocks in ``result()`` on 20 s of GPU work, and the SIGINT sent to it.

``python -m benchmarks.reliability`` times it (docs/reliability.md) and
tests/test_gpu_reliability.py checks the behaviour with it. It needs a GPU;
nothing here imports CuPy (the child does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CTRL_C = """
import sys, time
import cudafut
from cudafut import _backend, _cuda
from cudafut._kernels import GSLEEP
cp = _backend.current.cupy()
gsleep = cp.RawModule(code=GSLEEP).get_function("gsleep")
s = cp.cuda.Stream(non_blocking=True)
x = cp.zeros(4, dtype=cp.float32)
with s:
    gsleep((1,), (1,), (cp.int64(20_000_000_000),))  # 20 s of GPU work
    fut = cudafut.record(x)
print("waiting", flush=True)
try:
    fut.result()
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), fut.done(), flush=True)
import os
os._exit(0)                          # do not wait for the kernel at exit
"""


def ctrl_c_during_result() -> tuple[float, str]:
    """Run CTRL_C, send SIGINT during result(); (latency in s, its output:
    ``interrupted <time> <fut.done()>``)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CTRL_C)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    if first != "waiting":
        proc.kill()
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"the child did not start waiting: {first + out + err}")
    time.sleep(0.5)  # well inside result()
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    words = out.split()
    assert words[:1] == ["interrupted"], out + err
    return float(words[1]) - sent, out
