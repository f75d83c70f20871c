"""Every Python example in README.md and docs/ runs, as a newcomer would run
it, and prints what it says it computes.

The examples the documentation must keep are listed in ``KNOWN``, each by a
line that makes it what it is: one that is removed or loses that line fails
``test_the_documented_examples_are_there``; one that breaks fails its run.
An example not listed still runs, under its position in its file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import cudafut
from tests.subproc import ROOT, run_python

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Known:
    """An example the documentation must keep."""

    name: str
    file: str  # relative to the repository root
    line: str  # a line (stripped) that makes the example what it is
    check: Callable[[str], bool]  # on what the example prints (stripped)
    prints: str  # what check() accepts, for the failure message


def _balanced() -> str:
    old = cudafut.set_wait_policy("balanced")
    try:
        return repr(cudafut.get_wait_policy())
    finally:
        cudafut.set_wait_policy(old)


KNOWN = [
    Known(
        "readme-await",
        "README.md",
        "y = await fut  # the loop serves others meanwhile",
        # sum(sqrt(x * x + 1) for x in range(10**6)) = 499999500008.09 (float32 rounds)
        lambda out: math.isclose(float(out), 499_999_500_008, rel_tol=1e-3),
        "about 4.999995e11",
    ),
    Known(
        "readme-then",
        "README.md",
        "fut.then(lambda a: a @ a)  # on a pool stream that waits for x",
        # (a @ a) / max(a @ a) over 2048 x 2048 positive entries
        lambda out: 0 < float(out) <= 2048 * 2048,
        "a sum in (0, 2048**2]",
    ),
    Known(
        "readme-result",
        "README.md",
        "spectrum = fut.result(timeout=10)  # raises cudafut.TimeoutError if late",
        # the FFT of 2**20 ones: 2**20, then zeros
        lambda out: out.startswith("[") and ("1048576." in out or "1.048576" in out),
        "[1048576.+0.j ...",
    ),
    Known(
        "performance-policy",
        "docs/performance.md",
        'cudafut.set_wait_policy("balanced")  # the default',
        lambda out: out == _balanced(),
        "the balanced policy's repr",
    ),
    Known(
        "semantics-keep",
        "docs/semantics.md",
        "out = cudafut.record(v + 1)  # no record(..., keep=v) needed: wait() recorded this stream on v",
        lambda out: out == "[1. 2. 3. 4.]",
        "[1. 2. 3. 4.]",
    ),
    Known(
        "interop-torch",
        "docs/interop.md",
        "back = cudafut.from_torch(tf.then(lambda f: f.value() * 10))",
        lambda out: out == "[10.0, 30.0, 50.0, 70.0]",
        "[10.0, 30.0, 50.0, 70.0]",
    ),
    Known(
        "interop-cupy-events",
        "docs/interop.md",
        "fut = cudafut.record(x, stream=producer)  # an event on the producer",
        lambda out: out == "[ 1.  2.  5. 10.]",
        "[ 1.  2.  5. 10.]",
    ),
    Known(
        "interop-bridges",
        "docs/interop.md",
        "total = sum(int(f.result().sum()) for f in cudafut.as_completed_sync(futs, timeout=30))",
        lambda out: out == "[3, 42, 3]",
        "[3, 42, 3]",
    ),
    Known(
        "tracing-record",
        "docs/tracing.md",
        "async with cudafut.trace(path):",
        lambda out: out == "['#1 submit(arange)', '#2 then(<lambda>)']",
        "['#1 submit(arange)', '#2 then(<lambda>)']",
    ),
    Known(
        "index-await",
        "docs/index.md",
        "total = fut.then(lambda y: y.sum())  # chained on the GPU, the host does not wait",
        # sum(sqrt(x * x + 1) for x in range(2**20)) = 549755289607.9 (float32 rounds)
        lambda out: math.isclose(float(out), 549_755_289_608, rel_tol=1e-3),
        "about 5.497553e11",
    ),
    Known(
        "choose-service",
        "docs/choose.md",
        "n, m = await cudafut.gather(norms, means)  # both done on the GPU",
        lambda out: out == "[0.0, 257.0, 1026.0]",
        "[0.0, 257.0, 1026.0]",
    ),
    Known(
        "choose-pipeline",
        "docs/choose.md",
        ".then(lambda a: a * 2)  # on a pool stream that waits for the copy",
        lambda out: out == "[0.0, 131072.0, 262144.0, 393216.0]",
        "[0.0, 131072.0, 262144.0, 393216.0]",
    ),
    Known(
        "choose-wait",
        "docs/choose.md",
        "y = fut.wait() * 10  # the consumer stream waits on the GPU, the host does not",
        lambda out: out == "[ 0. 10. 20. 30.]",
        "[ 0. 10. 20. 30.]",
    ),
    Known(
        "choose-set-result",
        "docs/choose.md",
        "fut.set_result(cp.arange(4) * 2)  # an event on the current stream, after the work",
        lambda out: out == "[0 2 4 6]",
        "[0 2 4 6]",
    ),
    Known(
        "choose-result",
        "docs/choose.md",
        "futs = [cudafut.submit(lambda n: cp.full(1000, n, dtype=cp.int64).sum(), n) for n in (1, 2, 3)]",
        lambda out: out == "[1000, 2000, 3000]",
        "[1000, 2000, 3000]",
    ),
]


def documented_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fences(path: Path) -> list[str]:
    return [match.group(1) for match in FENCE.finditer(path.read_text())]


def owner(path: Path, code: str) -> Known | None:
    """The known example that ``code`` (in ``path``) is, if any."""
    lines = {line.strip() for line in code.splitlines()}
    for known in KNOWN:
        if ROOT / known.file == path and known.line in lines:
            return known
    return None


def examples() -> list[Any]:
    found = []
    for path in documented_files():
        for i, code in enumerate(fences(path)):
            known = owner(path, code)
            name = known.name if known is not None else f"{path.name}-{i}"
            found.append(pytest.param(code, known, id=name))
    return found


def test_the_documented_examples_are_there() -> None:
    for known in KNOWN:
        path = ROOT / known.file
        holders = [code for code in fences(path) if owner(path, code) is known]
        assert len(holders) == 1, (
            f"{known.file} should have one ```python example with the line {known.line!r} "
            f"({known.name}); it has {len(holders)}. If the example changed on purpose, "
            "update KNOWN in tests/test_docs.py"
        )


def test_every_example_is_collected() -> None:
    ids = [param.id for param in examples()]
    assert {known.name for known in KNOWN} <= set(ids)
    assert len(ids) == len(set(ids)), ids


def test_every_example_compiles() -> None:
    # Without a GPU the examples do not run; they must still be Python.
    for path in documented_files():
        for i, code in enumerate(fences(path)):
            compile(code, f"{path.name}, example {i}", "exec")


def test_the_api_reference_has_every_public_name() -> None:
    import cudafut.distributed

    documented = set(re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.M))
    names = {f"cudafut.{name}" for name in cudafut.__all__}
    assert names <= documented, f"docs/api.md lacks {sorted(names - documented)}"
    # cudafut.distributed is documented whole, with its members.
    assert "cudafut.distributed" in documented
    assert cudafut.distributed.__all__, "cudafut.distributed should export its API"


#: The line of docs/serving.md's runnable example (a Batcher over CuPy).
SERVING_EXAMPLE = "async with cudafut.Batcher(run_batch, max_batch=32, max_delay_s=0.002) as batcher:"


def test_the_serving_example_runs_on_the_fake_gpu_with_numpy_in_cupys_place() -> None:
    # What docs/serving.md says of its runnable example: under the fake GPU it
    # runs as written with `import numpy as cp`, since every CuPy call it makes
    # is NumPy's too (CuPy itself needs CUDA, which the fake does not fake).
    path = ROOT / "docs" / "serving.md"
    [code] = [code for code in fences(path) if SERVING_EXAMPLE in map(str.strip, code.splitlines())]
    assert "import cupy as cp\n" in code
    # The fake for the whole run (kept referenced: a collected context manager ends it).
    prelude = (
        "import cudafut.testing\n_fake = cudafut.testing.fake_cuda(auto_complete=True)\n_fake.__enter__()\n"
    )
    proc = run_python(prelude + code.replace("import cupy as cp\n", "import numpy as cp\n"), CUDAFUT_PURE="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "100 True True"


@pytest.mark.gpu
@pytest.mark.parametrize(("code", "known"), examples())
def test_example_runs(code: str, known: Known | None) -> None:
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out, "an example should print its result"
    if known is not None:
        assert known.check(out), f"{known.name} printed {out!r}, expected {known.prints}"
