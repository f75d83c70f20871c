"""A sticky CUDA error (illegal address) must fail futures, never hang them.

Each case runs in a subprocess: the error poisons the CUDA context for good.
"""

from __future__ import annotations

import pytest

from tests.subproc import run_python

pytestmark = pytest.mark.gpu

SCRIPT = """
import sys
import cudafut
from cudafut import _cuda
from tests.kernels import spin_fault

cp = _cuda.cupy()
backend = sys.argv[1]
s = cp.cuda.Stream(non_blocking=True)
x = cp.zeros(4, dtype=cp.float32)
x + 1                          # compile now: a compile takes longer than the spin
cp.cuda.Device().synchronize()
with s:
    spin_fault(300)            # the await below starts before the fault
    fut = cudafut.record(x)
child = fut.then(lambda v: v + 1)

async def main():
    try:
        await fut
    except cudafut.CudaError as exc:
        print("await", exc.code, exc.name, exc.sticky)

if backend == "trio":
    import trio
    trio.run(main)
elif backend == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    import asyncio
    asyncio.run(main())
for name, f in (("result", fut), ("child", child)):
    try:
        f.result(timeout=30)
    except cudafut.CudaError as exc:
        print(name, exc.code, exc.name)
print("done", fut.done(), type(fut.exception()).__name__)
"""


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_illegal_address_fails_awaits_results_and_children(backend: str) -> None:
    proc = run_python(SCRIPT, backend, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [
        "await 700 cudaErrorIllegalAddress True",
        "result 700 cudaErrorIllegalAddress",
        "child 700 cudaErrorIllegalAddress",
        "done True CudaError",
    ], proc.stdout + proc.stderr
