"""The examples' logic without a GPU: the batchers of examples/service/ and
examples/trio_app.py with a fake model, the model's NumPy reference, the load
generator's percentiles and table, and every example's ``--help``.
tests/test_gpu_examples.py runs the examples themselves on a GPU."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.notebooks import REASON, execute_notebook, printed
from tests.subproc import ROOT

EXAMPLES = ROOT / "examples"
SERVICE = EXAMPLES / "service"


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
        for name in ("batcher", "model", "load"):
            if name not in saved_modules:
                sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def batcher() -> ModuleType:
    return load_example(SERVICE / "batcher.py")


@pytest.fixture(scope="module")
def model() -> ModuleType:
    return load_example(SERVICE / "model.py")


class FakeModel:
    """Doubles each item; records each batch; can be held to pile requests up."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.running = 0
        self.most_running = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
            return [2 * x for x in items]
        finally:
            self.running -= 1


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_batcher_fills_batches_up_to_max(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> list[int]:
        async with batcher.Batcher(fake, max_batch=4, max_delay_s=0.2, max_in_flight=1) as b:
            return list(await asyncio.gather(*(b.submit(i) for i in range(10))))

    assert run(main()) == [2 * i for i in range(10)]
    assert [len(batch) for batch in fake.batches] == [4, 4, 2]
    assert sorted(x for batch in fake.batches for x in batch) == list(range(10))


def test_batcher_sends_a_lone_request_after_the_delay(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> tuple[int, Any]:
        async with batcher.Batcher(fake, max_batch=64, max_delay_s=0.001) as b:
            return await b.submit(21), b.stats

    result, stats = run(main())
    assert result == 42
    assert fake.batches == [[21]]
    assert (stats.batches, stats.items, stats.mean_batch) == (1, 1, 1.0)


def test_batcher_runs_at_most_max_in_flight_batches(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> list[int]:
        fake.gate = asyncio.Event()
        async with batcher.Batcher(fake, max_batch=2, max_delay_s=0.0, max_in_flight=2) as b:
            tasks = [asyncio.create_task(b.submit(i)) for i in range(8)]
            for _ in range(20):
                await asyncio.sleep(0)
            assert fake.running == 2  # the others wait for a slot, queued
            fake.gate.set()
            return list(await asyncio.gather(*tasks))

    assert run(main()) == [2 * i for i in range(8)]
    assert fake.most_running == 2


def test_requests_queue_while_the_gpu_is_busy_and_form_one_batch(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> list[int]:
        fake.gate = asyncio.Event()
        async with batcher.Batcher(fake, max_batch=64, max_delay_s=0.0, max_in_flight=1) as b:
            first = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.01)  # batch [0] is running, held
            rest = [asyncio.create_task(b.submit(i)) for i in range(1, 6)]
            await asyncio.sleep(0.01)
            fake.gate.set()
            return list(await asyncio.gather(first, *rest))

    assert run(main()) == [0, 2, 4, 6, 8, 10]
    assert fake.batches == [[0], [1, 2, 3, 4, 5]]


def test_a_failed_batch_fails_each_of_its_requests(batcher: ModuleType) -> None:
    boom = ValueError("the model failed")

    async def failing(items: list[int]) -> list[int]:
        raise boom

    async def main() -> list[Any]:
        async with batcher.Batcher(failing, max_batch=8, max_delay_s=0.01) as b:
            return list(await asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True))

    assert run(main()) == [boom, boom, boom]


def test_a_batch_with_the_wrong_number_of_results_fails(batcher: ModuleType) -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async def main() -> None:
        async with batcher.Batcher(short, max_batch=8, max_delay_s=0.01) as b:
            with pytest.raises(ValueError, match="returned 1 results for 2 items"):
                await asyncio.gather(b.submit(1), b.submit(2))

    run(main())


def test_a_cancelled_request_is_not_computed(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> int:
        fake.gate = asyncio.Event()
        async with batcher.Batcher(fake, max_batch=64, max_delay_s=0.0, max_in_flight=1) as b:
            first = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.01)
            gone = asyncio.create_task(b.submit(1))
            kept = asyncio.create_task(b.submit(2))
            await asyncio.sleep(0)
            gone.cancel()
            await asyncio.sleep(0.01)
            fake.gate.set()
            await first
            return int(await kept)

    assert run(main()) == 4
    assert fake.batches == [[0], [2]]


def test_a_closed_batcher_refuses_and_fails_what_it_held(batcher: ModuleType) -> None:
    fake = FakeModel()

    async def main() -> None:
        fake.gate = asyncio.Event()
        b = batcher.Batcher(fake, max_batch=64, max_delay_s=0.0, max_in_flight=1)
        b.start()
        running = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(b.submit(1))  # no slot: never taken into a batch
        await asyncio.sleep(0.01)
        closing = asyncio.create_task(b.aclose())
        await asyncio.sleep(0.01)
        fake.gate.set()  # the running batch finishes
        await closing
        assert await running == 0
        with pytest.raises(RuntimeError, match="closed"):
            await waiting
        with pytest.raises(RuntimeError, match="not running"):
            await b.submit(2)

    run(main())


def test_the_trio_batcher_batches_and_checks_like_the_asyncio_one() -> None:
    trio = pytest.importorskip("trio")
    app = load_example(EXAMPLES / "trio_app.py")
    seen: list[list[int]] = []

    async def double(items: list[int]) -> list[int]:
        seen.append(list(items))
        await trio.sleep(0)
        return [2 * x for x in items]

    async def main() -> list[int]:
        b = app.TrioBatcher(double, max_batch=4, max_delay_s=0.2, max_in_flight=1)
        results = [0] * 10

        async def client(i: int) -> None:
            results[i] = await b.submit(i)

        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve)
            async with trio.open_nursery() as clients:
                for i in range(10):
                    clients.start_soon(client, i)
            await b.close()
        return results

    assert trio.run(main) == [2 * i for i in range(10)]
    assert [len(batch) for batch in seen] == [4, 4, 2]

    async def failing(items: list[int]) -> list[int]:
        raise ValueError("the model failed")

    async def fails() -> None:
        b = app.TrioBatcher(failing, max_batch=4, max_delay_s=0.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve)
            with pytest.raises(ValueError, match="the model failed"):
                await b.submit(1)
            await b.close()
        with pytest.raises(RuntimeError, match="the batcher is closed"):
            await b.submit(2)

    trio.run(fails)


BAD_OPTIONS = [
    pytest.param({"max_batch": 0}, ValueError, "max_batch must be at least 1, not 0", id="batch-0"),
    pytest.param({"max_batch": 2.5}, TypeError, "max_batch must be an int, not float", id="batch-float"),
    pytest.param({"max_batch": True}, TypeError, "max_batch must be an int, not bool", id="batch-bool"),
    pytest.param({"max_in_flight": -1}, ValueError, "max_in_flight must be at least 1", id="in-flight"),
    pytest.param({"max_delay_s": -0.001}, ValueError, "max_delay_s must be a finite", id="delay-neg"),
    pytest.param({"max_delay_s": math.nan}, ValueError, "max_delay_s must be a finite", id="delay-nan"),
    pytest.param({"max_delay_s": math.inf}, ValueError, "max_delay_s must be a finite", id="delay-inf"),
    pytest.param({"max_delay_s": "2ms"}, TypeError, "max_delay_s must be a number", id="delay-str"),
    pytest.param({"run_batch": None}, TypeError, "run_batch must be an async function", id="run-batch"),
]


@pytest.mark.parametrize("which", ["asyncio", "trio"])
@pytest.mark.parametrize(("options", "error", "message"), BAD_OPTIONS)
def test_both_batchers_refuse_bad_options(
    batcher: ModuleType, which: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    if which == "trio":
        pytest.importorskip("trio")
        make = load_example(EXAMPLES / "trio_app.py").TrioBatcher
    else:
        make = batcher.Batcher
    kwargs = {"run_batch": FakeModel(), **options}
    with pytest.raises(error, match=re.escape(message)):
        make(kwargs.pop("run_batch"), **kwargs)


def test_the_batchers_take_numpy_integers_and_a_zero_delay(batcher: ModuleType) -> None:
    b = batcher.Batcher(FakeModel(), max_batch=np.int64(8), max_delay_s=0, max_in_flight=np.int32(1))
    assert (b.max_batch, b.max_delay_s) == (8, 0)


def test_the_model_reference_is_what_clients_check(model: ModuleType) -> None:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, model.DIM)).astype(np.float32)
    ys = model.reference(xs)
    assert ys.shape == (5, model.OUT)
    assert all(model.matches(ys[i].astype(np.float32).tolist(), xs[i]) for i in range(5))
    assert not model.matches((ys[0] + 0.01).tolist(), xs[0])
    assert not model.matches(ys[0][:-1].tolist(), xs[0])
    w1, _, _ = model.weights()
    assert w1.dtype == np.float32 and w1.shape == (model.DIM, model.HIDDEN)


def test_the_load_generator_reports_percentiles_and_a_table() -> None:
    pytest.importorskip("aiohttp")
    load = load_example(SERVICE / "load.py")
    values = [float(v) for v in range(1, 101)]
    assert load.percentile(values, 50) == 50.0
    assert load.percentile(values, 99) == 99.0
    assert load.percentile([3.0], 99) == 3.0
    row = {key: 1.0 for _, key, _ in load.COLUMNS} | {"mode": "batched", "requests": 10, "wrong": 0}
    text = load.table([row])
    assert "| batched | 10 |" in text and text.count("\n") == 2


def test_the_load_generator_refuses_other_hosts() -> None:
    pytest.importorskip("aiohttp")
    load = load_example(SERVICE / "load.py")
    with pytest.raises(SystemExit, match="only talks to loopback"):
        asyncio.run(load.run_load("http://example.com", clients=1, requests=1, duration=1, health_every_s=1))


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
        ("service/load.py", "aiohttp"),
        ("service/compare.py", "aiohttp"),
    ],
)
def test_every_example_explains_itself(script: str, needs: str) -> None:
    pytest.importorskip(needs)
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
