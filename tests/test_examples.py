"""The examples' logic without a GPU: examples/trio_app.py end to end on
cudafut.testing's fake GPU with a NumPy model, examples/service_hooks.py
(a Batcher started and closed by aiohttp's hooks) under ``--fake``, the toy
model's NumPy reference, a notebook awaiting on its kernel's loop, and every example's
``--help``. cudafut.Batcher's own rules are tested in tests/test_batcher.py;
examples/service/ in tests/test_examples_service.py.
tests/test_gpu_examples.py runs the examples themselves on a GPU."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from cudafut.testing import fake_cuda
from tests.notebooks import REASON, execute_notebook, printed
from tests.subproc import ROOT
from tests.test_gpu_examples import run_example

EXAMPLES = ROOT / "examples"


def load_example(path: Path) -> ModuleType:
    """``path`` as a module, leaving sys.path and sys.modules as they were (the
    examples put their own folder on sys.path and import their neighbours)."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(f"cudafut_example_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved_path
        for name in ("toy_model", "model", "models", "batcher", "load", "pauses", "stalltrace"):
            if name not in saved_modules:
                sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def toy_model() -> ModuleType:
    return load_example(EXAMPLES / "toy_model.py")


def test_the_toy_model_reference_is_what_clients_check(toy_model: ModuleType) -> None:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, toy_model.DIM)).astype(np.float32)
    ys = toy_model.reference(xs)
    assert ys.shape == (5, toy_model.OUT)
    assert all(toy_model.matches(ys[i].astype(np.float32).tolist(), xs[i]) for i in range(5))
    assert not toy_model.matches((ys[0] + 0.01).tolist(), xs[0])
    assert not toy_model.matches(ys[0][:-1].tolist(), xs[0])
    w1, _, _ = toy_model.weights()
    assert w1.dtype == np.float32 and w1.shape == (toy_model.DIM, toy_model.HIDDEN)


class NumpyToyModel:
    """examples/toy_model.py's Model in NumPy, for cudafut.testing's fake GPU
    (whose values are NumPy arrays): ``forward`` returns the reference, or
    the reference plus ``error``."""

    def __init__(self, toy_model: ModuleType, error: float = 0.0) -> None:
        self.toy_model, self.error = toy_model, error
        self.batches: list[int] = []

    def __call__(self, fixed_us: float, per_item_us: float) -> NumpyToyModel:
        return self  # stands in for the class: trio_app calls Model(fixed_us, per_item_us)

    def warm_up(self, max_batch: int) -> None:
        pass

    def forward(self, xs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.batches.append(len(xs))
        out: np.ndarray[Any, Any] = (self.toy_model.reference(xs) + self.error).astype(np.float32)
        return out


def _run_trio_app(model: NumpyToyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    trio = pytest.importorskip("trio")
    app = load_example(EXAMPLES / "trio_app.py")
    monkeypatch.setattr(app, "Model", model)
    args = argparse.Namespace(
        clients=16, requests=5, duration=60.0, fixed_us=0.0, per_item_us=0.0, max_batch=8, max_delay_ms=1.0
    )
    with fake_cuda(auto_complete=True):
        trio.run(app.main, args)


def test_the_trio_app_batches_and_checks_every_answer(
    toy_model: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/trio_app.py's main() on the fake GPU: its batched run goes
    through cudafut.Batcher on trio (launch and to_host per batch), its
    unbatched run one launch per request, and every answer is checked."""
    model = NumpyToyModel(toy_model)
    _run_trio_app(model, monkeypatch)
    out = capsys.readouterr().out
    assert "| batched | 80 |" in out and "| unbatched | 80 |" in out, out
    assert "results checked: all 160 answers matched the model's NumPy reference" in out, out
    # warm-up (a batch of 1), the batched run (at most 8 a batch), then 80 single requests
    served = model.batches[1:]
    assert served[-80:] == [1] * 80
    assert sum(served[:-80]) == 80 and max(served[:-80]) <= 8


def test_the_trio_app_fails_on_a_wrong_answer(
    toy_model: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run_trio_app(NumpyToyModel(toy_model, error=0.01), monkeypatch)
    assert exit_info.value.code == 1
    assert "FAILED: wrong answers" in capsys.readouterr().err


def test_a_notebook_awaits_a_future_on_the_kernels_loop(tmp_path: Path) -> None:
    """How tests/test_gpu_examples.py runs examples/notebook.ipynb, here without
    a GPU: the kernel imports this checkout's cudafut, and a cell's top-level
    ``await`` of a CudaFuture (set with scripted events, completed 0.3 s
    later) runs on the kernel's asyncio loop, which keeps running a ticker
    meanwhile; ``as_completed`` yields in completion order there too."""
    nbformat = pytest.importorskip("nbformat", reason=REASON)
    cells = [
        """
import asyncio
import time

import cudafut
from tests.fakes import FakeRecord, set_future

print(cudafut.__file__)
""",
        """
async def tick(ticks):
    while True:
        await asyncio.sleep(0.01)
        ticks.append(time.perf_counter())


ticks, record = [], FakeRecord()
fut = set_future(42, [record])
asyncio.get_running_loop().call_later(0.3, record.complete)
ticker = asyncio.create_task(tick(ticks))
value = await fut
ticker.cancel()
print(value, len(ticks))
""",
        """
records = [FakeRecord() for _ in range(3)]
futs = [set_future(i, [r]) for i, r in enumerate(records)]
for i, r in enumerate(records):
    asyncio.get_running_loop().call_later(0.05 * (3 - i), r.complete)
print([await f async for f in cudafut.as_completed(futs)])
""",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in cells])
    out = printed(execute_notebook(nb, tmp_path)).splitlines()
    assert out[0] == str(ROOT / "cudafut" / "__init__.py"), out
    value, ticks = map(int, out[1].split())
    assert value == 42 and ticks >= 5, out  # about 30 ticks: the loop ran while the cell awaited
    assert out[2] == "[2, 1, 0]", out


@pytest.mark.parametrize(
    ("script", "needs"),
    [
        ("pipeline.py", "cupy"),
        ("trio_app.py", "trio"),
        ("service/server.py", "aiohttp"),
        ("service_hooks.py", "aiohttp"),
        ("service/load.py", "aiohttp"),
        ("service/compare.py", "aiohttp,psutil"),  # Ray Serve brings aiohttp without psutil
        ("service/litserve_server.py", "litserve"),
        ("service/ray_serve.py", "numpy"),  # parses its arguments before importing Ray
    ],
)
def test_every_example_explains_itself(script: str, needs: str) -> None:
    for module in needs.split(","):
        pytest.importorskip(module)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_service_hooks_serves_and_closes_its_batcher_with_the_app_on_the_fake_gpu() -> None:
    # aiohttp's on_startup starts the Batcher, on_cleanup closes it: every
    # answer is checked against NumPy, and a submit after the cleanup is refused.
    pytest.importorskip("aiohttp")
    proc = run_example("service_hooks.py", "--fake", "--requests", "64", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "results checked: all; the Batcher closed with the app" in proc.stdout, proc.stdout
    assert "64 requests in" in proc.stdout
