"""examples/service/ray_serve.py without a GPU: its replica driven directly
on cudafut's fake GPU (always), and the recipe run under Ray Serve on this
machine (where Ray is installed: ``pip install -e '.[ray]'``)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import pytest

from cudafut.testing import fake_cuda
from tests.conftest import ANYIO_BACKENDS
from tests.subproc import ROOT
from tests.test_examples import load_example
from tests.test_examples_service import SERVICE


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return load_example(SERVICE / "ray_serve.py")


# Ray Serve runs a replica's requests on an asyncio loop (uvloop where installed), never trio.
@pytest.fixture(params=[p for p in ANYIO_BACKENDS if p.id != "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    name, options = request.param
    return name, options


class _HttpRequest:
    """What Ray Serve passes for an HTTP request: a Starlette request (its ``json()``)."""

    def __init__(self, body: Any) -> None:
        self.body = body

    async def json(self) -> Any:
        await anyio.sleep(0)
        return self.body


@pytest.mark.anyio
async def test_a_replica_batches_concurrent_requests_and_answers_each(recipe: ModuleType) -> None:
    """40 requests at once, as Ray Serve hands a replica the requests it
    holds (handle calls and HTTP requests): each gets its own right answer,
    and they ran in batches of at most max_batch."""
    ref = recipe.Toy().reference()
    tol = recipe.tolerance(ref)
    replica = recipe.Replica("toy", max_batch=8, max_delay_s=0.05)
    indices = [(7 * n) % recipe.IMAGES for n in range(40)]
    answers: list[Any] = [None] * len(indices)

    async def one(n: int) -> None:
        i = indices[n]
        answers[n] = await replica(i if n % 2 else _HttpRequest({"i": i}))

    try:
        async with anyio.create_task_group() as tg:
            for n in range(len(indices)):
                tg.start_soon(one, n)
        stats = await replica.stats()
    finally:
        await replica.close()
    assert all(recipe.check(a["top"], ref[i], tol) for a, i in zip(answers, indices, strict=True))
    assert not recipe.check(answers[0]["top"], ref[indices[1]], tol)  # the check tells answers apart
    assert stats["requests"] == 40
    assert sum(size * count for size, count in stats["sizes"].items()) == 40
    assert max(stats["sizes"]) <= 8
    assert stats["batches"] < 40  # they were batched
    with fake_cuda():  # close() removed the replica's fake GPU
        pass


@pytest.mark.anyio
async def test_a_replica_refuses_a_bad_index_before_batching(recipe: ModuleType) -> None:
    replica = recipe.Replica("toy")
    try:
        for bad in (-1, recipe.IMAGES, "3", True, None, _HttpRequest({"i": 2.0}), _HttpRequest([2])):
            with pytest.raises(ValueError, match="i must be an int from 0 to 255"):
                await replica(bad)
        assert (await replica(3))["top"] == recipe.Toy().answer([3])[0].tolist()
        assert (await replica.stats())["batches"] == 1
    finally:
        await replica.close()


async def _del(cls: Any, replica: Any) -> bool:
    # What Ray Serve awaits when the replica stops (on a plain Replica: an
    # instance of cls would call its async __del__ once more when collected).
    await cls.__del__(replica)
    with fake_cuda():  # the replica's fake GPU is gone
        return True


def test_the_deployment_is_one_replica_per_gpu_and_holds_full_batches(recipe: ModuleType) -> None:
    """deployment() as Ray Serve gets it (a stand-in for ``ray.serve``): the
    Replica class, one GPU per replica, room for more requests in flight
    than one batch, and an async ``__del__`` that closes the replica."""
    calls: list[tuple[Any, dict[str, Any]]] = []

    def deployment(cls: Any, **options: Any) -> Any:
        calls.append((cls, options))
        return cls

    serve = SimpleNamespace(deployment=deployment)
    cls = recipe.deployment(serve, replicas=3, max_ongoing_requests=128)
    ((got, options),) = calls
    assert got is cls and issubclass(cls, recipe.Replica)
    assert options["num_replicas"] == 3
    assert options["ray_actor_options"] == {"num_gpus": 1}
    assert options["max_ongoing_requests"] == 128
    assert inspect.iscoroutinefunction(cls.__del__)
    assert anyio.run(_del, cls, recipe.Replica("toy"))


@pytest.mark.timeout(300)
def test_the_recipe_runs_under_ray_serve() -> None:
    """ray_serve.py as a user runs it, with the toy model on the fake GPU:
    Ray starts on this machine, serve.run deploys one replica (no GPU
    reserved), 256 requests go through a DeploymentHandle, 64 at a time,
    every answer is checked, and Serve and Ray shut down."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")
    cmd = [sys.executable, str(SERVICE / "ray_serve.py"), "--model", "toy", "--requests", "256"]
    cmd += ["--clients", "64", "--max-batch", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "256 answers checked, 0 wrong" in proc.stdout, proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("replica ")]
    requests, batches = (int(word) for word in line.split(": ")[1].split()[:4:3])
    assert requests == 256 and batches < 256, line  # one replica got them all, in batches
