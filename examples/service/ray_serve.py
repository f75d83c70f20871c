"""The same model behind Ray Serve: one replica per GPU, a cudafut.Batcher inside each.

Ray Serve runs ``--replicas`` copies of :class:`Replica`, each a Ray actor
holding one GPU (``ray_actor_options={"num_gpus": 1}``); Ray's router sends
each request (HTTP on port 8000, or a ``DeploymentHandle`` call) to one of
them. Inside a replica, the requests it has in flight are awaited on its
asyncio loop, and a :class:`cudafut.Batcher` gathers them into batches that
run through :func:`cudafut.launch`, off that loop: the model is captured as
one CUDA graph per bucket, as in ``server.py --mode batch_graph``.
docs/serving.md ("Beyond one machine: Ray Serve") compares this with Ray's
own ``@serve.batch``.

Run it (from the repository root, on a machine with a GPU, torchvision built
for your CUDA, and ``pip install -e '.[ray]'``)::

    python examples/service/ray_serve.py --model resnet50 --replicas 1 --requests 512

It starts Ray on this machine, deploys, sends ``--requests`` requests through
a ``DeploymentHandle`` (``--clients`` at a time), checks every answer
against the model run eagerly on one image (models.py), prints what the
replicas' batchers did, and shuts Ray down; ``--serve`` then keeps serving
HTTP (``curl -d '{"i": 3}' http://127.0.0.1:8000/``) until Ctrl-C.

``--model toy`` runs the same replica without a GPU: its model is a few
NumPy operations under cudafut's fake GPU (:mod:`cudafut.testing`), for
tests/test_ray_serve.py and for trying the recipe on a laptop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import (
    BUCKETS,
    IMAGES,
    MODELS,
    SEED,
    TOP,
    Served,
    check,
    missing,
    require_model_packages,
    tolerance,
)

import cudafut

#: What installs Ray Serve for this example (pyproject.toml's `ray` extra).
RAY_EXTRA = "pip install 'cudafut[ray]', or pip install -e '.[ray]' in a checkout"
TOY = "toy"


class Toy:
    """A model for the fake GPU: ``answer(indices)`` as :class:`models.Served`
    gives it (the top ``TOP`` logits of each bank item, then their classes),
    computed with NumPy, which is what values are under
    :func:`cudafut.testing.fake_cuda`. The same in every process (fixed seed)."""

    FEATURES, CLASSES = 64, 100

    def __init__(self) -> None:
        rng = np.random.default_rng(SEED)
        self.bank = rng.standard_normal((IMAGES, self.FEATURES)).astype(np.float32)
        self.w = (rng.standard_normal((self.FEATURES, self.CLASSES)) / math.sqrt(self.FEATURES)).astype(
            np.float32
        )

    def logits(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out: np.ndarray[Any, Any] = np.tanh(x @ self.w)
        return out

    def answer(self, indices: list[int]) -> np.ndarray[Any, Any]:
        """One row per index: TOP logits, then their classes (float32)."""
        logits = self.logits(self.bank[indices])
        classes = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
        values = np.take_along_axis(logits, classes, axis=1)
        return np.concatenate([values, classes.astype(np.float32)], axis=1)

    def reference(self) -> np.ndarray[Any, Any]:
        """Every bank item's logits, one item at a time."""
        return np.stack([self.logits(self.bank[i : i + 1])[0] for i in range(IMAGES)])


class Replica:
    """One replica: ``model``'s batch function behind a :class:`cudafut.Batcher`.

    Ray Serve makes one per replica (:func:`deployment`); a test makes one
    directly. ``model`` is one of models.MODELS (on the GPU, one captured
    graph per bucket of ``BUCKETS``) or ``"toy"`` (:class:`Toy`, under a
    fake GPU that this replica installs for its process and removes in
    :meth:`close`). The batcher starts with the first request, on the loop
    that serves it (Ray Serve's replica loop), and stops in :meth:`close`.
    """

    def __init__(self, model: str = "resnet50", *, max_batch: int = 32, max_delay_s: float = 0.002) -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._stack = contextlib.AsyncExitStack()
        self.model: Any
        run_batch: Callable[[list[int]], Any]
        buckets: tuple[int, ...] | None
        if model == TOY:
            from cudafut.testing import fake_cuda

            self._stack.enter_context(fake_cuda(auto_complete=True))
            self.model = Toy()
            run_batch, buckets = self.model.answer, None
        else:
            self.model = Served(model, graphs=True)
            run_batch, buckets = self.model.answer_graphed, BUCKETS
        # A plain function: each batch runs through cudafut.launch(), on a
        # launcher thread, and its future is awaited on the replica's loop.
        self.batcher: cudafut.Batcher[int, Any] = cudafut.Batcher(
            run_batch, max_batch=max_batch, max_delay_s=max_delay_s, buckets=buckets
        )
        self._started = False
        self.requests = 0

    async def __call__(self, request: Any) -> dict[str, list[float]]:
        """``{"top": [TOP logits, then their classes]}`` for bank image ``i``:
        ``request`` is ``i`` (a handle's call) or an HTTP request whose JSON
        body is ``{"i": i}`` (Ray Serve passes a Starlette request)."""
        i = request
        if hasattr(request, "json"):
            body = await request.json()
            i = body.get("i") if isinstance(body, dict) else None
        return {"top": await self.predict(i)}

    async def predict(self, i: int) -> list[float]:
        """The answer for bank image ``i``, computed in a batch with the
        replica's other requests."""
        if type(i) is not int or not 0 <= i < IMAGES:
            raise ValueError(f"i must be an int from 0 to {IMAGES - 1}, not {i!r}")
        if not self._started:  # the first request: the loop that serves requests runs now
            self._started = True
            await self._stack.enter_async_context(self.batcher)  # does not yield on asyncio
        self.requests += 1
        row: list[float] = (await self.batcher.submit(i)).tolist()
        return row

    async def stats(self) -> dict[str, Any]:
        """What this replica's batcher did so far."""
        s = self.batcher.statistics()
        return {
            "replica": self.name,
            "requests": self.requests,
            "batches": s.batches,
            "mean_batch": round(s.mean_batch, 2),
            "sizes": s.sizes,
            "padded": s.padded,
        }

    async def close(self) -> None:
        """Run what is queued, stop the batcher, remove the fake GPU (toy)."""
        await self._stack.aclose()


def deployment(serve: Any, *, replicas: int = 1, gpus: float = 1, max_ongoing_requests: int = 128) -> Any:
    """:class:`Replica` as a Ray Serve deployment: ``replicas`` replicas, each
    reserving ``gpus`` GPUs (1: one replica per GPU; 0 for the toy model).

    ``max_ongoing_requests`` is how many requests Ray lets one replica hold
    at once (Ray's default is 5): a batch can never be larger, so it must be
    well above ``max_batch``.
    """

    class CudafutReplica(Replica):
        async def __del__(self) -> None:  # Ray Serve awaits it when the replica stops
            await self.close()

    return serve.deployment(
        CudafutReplica,
        name="cudafut",
        num_replicas=replicas,
        ray_actor_options={"num_gpus": gpus},
        max_ongoing_requests=max_ongoing_requests,
    )


async def _drive(handle: Any, indices: list[int], clients: int) -> list[list[float]]:
    """Send each index through ``handle``, ``clients`` at a time; the answers in order."""
    answers: list[list[float]] = [[] for _ in indices]
    todo = iter(range(len(indices)))

    async def client() -> None:
        for n in todo:
            answers[n] = (await handle.remote(indices[n]))["top"]

    await asyncio.gather(*(client() for _ in range(clients)))
    return answers


def _reference(model: str) -> np.ndarray[Any, Any]:
    if model == TOY:
        return Toy().reference()
    from models import reference

    return reference(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*MODELS, TOY), default="resnet50")
    parser.add_argument("--replicas", type=int, default=1, help="replicas, one GPU each (toy: none)")
    parser.add_argument("--requests", type=int, default=512, help="requests to send and check")
    parser.add_argument("--clients", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--max-batch", type=int, default=32, help="the largest batch")
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="the longest wait for a batch")
    parser.add_argument("--serve", action="store_true", help="then keep serving HTTP until Ctrl-C")
    args = parser.parse_args(argv)
    try:
        import ray
        from ray import serve
    except ImportError as exc:  # one line that says what to install, not a traceback
        sys.exit(missing("ray_serve.py", "ray", exc, RAY_EXTRA))
    if args.model != TOY:
        from cudafut._cli.selfcheck import require_gpu

        require_gpu()
        require_model_packages("ray_serve.py --model " + args.model)
    ref = _reference(args.model)
    tol = tolerance(ref)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        app = deployment(
            serve,
            replicas=args.replicas,
            gpus=0 if args.model == TOY else 1,
            max_ongoing_requests=4 * args.max_batch,
        ).bind(args.model, max_batch=args.max_batch, max_delay_s=args.max_delay_ms / 1e3)
        handle = serve.run(app, name="cudafut", route_prefix="/")
        indices = [n % IMAGES for n in range(args.requests)]
        answers = asyncio.run(_drive(handle, indices, args.clients))
        wrong = sum(not check(a, ref[i], tol) for a, i in zip(answers, indices, strict=True))
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(4 * args.replicas):  # each call reaches one replica, chosen by Ray
            s = handle.stats.remote().result()
            seen[s["replica"]] = s
        for s in sorted(seen.values(), key=lambda s: str(s["replica"])):
            print(
                f"replica {s['replica']}: {s['requests']} requests in {s['batches']} batches "
                f"(mean {s['mean_batch']}, sizes {s['sizes']})"
            )
        print(f"{len(answers)} answers checked, {wrong} wrong")
        if args.serve and not wrong:
            print('serving on http://127.0.0.1:8000/ (POST {"i": k}); Ctrl-C stops', flush=True)
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # either stops Serve and Ray below
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
