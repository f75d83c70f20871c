"""A sticky CUDA error (illegal address) must fail futures, never hang them.

Each case runs in a subprocess: the error poisons the CUDA context for good.
"""

from __future__ import annotations

import pytest

from tests.runners import BACKENDS
from tests.subproc import run_python

pytestmark = pytest.mark.gpu

SCRIPT = """
import sys
import anyio
import cupyx
import cudafut
from cudafut import _backend, _cuda, _loops
from tests.runners import run_on

cp = _backend.current.cupy()
backend = sys.argv[1]
# A kernel that faults once the host releases it through pinned host memory
# (which the kernel reads): the fault comes while the await is in the waiter.
fault = cp.RawKernel(r'''
extern "C" __global__ void fault_when_released(const volatile int* release) {
    while (*release == 0) {
    }
    *(volatile float*)(0x10) = 1.0f;  // an illegal address: a sticky error
}
''', "fault_when_released")
release = cupyx.zeros_pinned(1, dtype=cp.int32)
s = cp.cuda.Stream(non_blocking=True)
x = cp.zeros(4, dtype=cp.float32)
x + 1                          # compile the child's kernel now, before the fault
cp.cuda.Device().synchronize()
try:
    with s:
        fault((1,), (1,), (cp.uint64(release.ctypes.data),))
        fut = cudafut.record(x)
    child = fut.then(lambda v: v + 1)

    async def wait():
        try:
            await fut
        except cudafut.CudaError as exc:
            print("await", exc.code, exc.name, exc.sticky)

    async def main():
        driver = _loops.current_driver()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            with anyio.fail_after(30):
                while not driver.watchlist.pending:  # until the await is in the waiter
                    await anyio.sleep(0)
            print("waiting", fut.done())
            release[0] = 1     # now the kernel faults

    run_on(backend, main)
finally:
    release[0] = 1             # never leave the kernel spinning
for name, f in (("result", fut), ("child", child)):
    try:
        f.result(timeout=30)
    except cudafut.CudaError as exc:
        print(name, exc.code, exc.name)
print("done", fut.done(), type(fut.exception()).__name__)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_illegal_address_fails_awaits_results_and_children(backend: str) -> None:
    proc = run_python(SCRIPT, backend, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [
        "waiting False",
        "await 700 cudaErrorIllegalAddress True",
        "result 700 cudaErrorIllegalAddress",
        "child 700 cudaErrorIllegalAddress",
        "done True CudaError",
    ], proc.stdout + proc.stderr
