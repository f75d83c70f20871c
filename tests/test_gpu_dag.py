"""Ordering under adversarial timing: random DAGs of futures on a GPU.

Each example builds a random graph of futures from a seed: sources written
by slow producers (kernels that spin on %globaltimer for a random time
before they write) on several streams, with both stream priorities and, when
there are two GPUs, both devices, or uploaded with ``to_device()`` from
pinned, pageable or strided host arrays dropped at once; derived nodes made
with ``then()``, ``wait()`` + ``record()`` (with and without ``keep=``: the
wait marks the value used by the consumer's stream), ``submit()``,
two-parent joins, each of which also spins before it writes, and host nodes
downloaded with ``to_host()`` of a future (into pool, pinned, pageable or
strided memory). Every node is then consumed with one
of ``await`` (asyncio, uvloop or trio), ``result()``, ``gather()`` or
``wait()``, and compared with the value computed on the host. A missing
stream wait shows up as a wrong number.

The number of examples is ``CUDAFUT_DAG_EXAMPLES`` (default 100; the
reliability run uses 2000). A failure prints its seed; replay it with
``CUDAFUT_DAG_SEED=<seed> pytest tests/test_gpu_dag.py``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cudafut
from cudafut import _backend, _copies
from tests.kernels import spin_copy, spin_fill
from tests.runners import BACKENDS, run_on

pytestmark = pytest.mark.gpu

M = 2048
DELAYS_MS = (0.0, 0.02, 0.1, 0.5, 2.0)
EXAMPLES = int(os.environ.get("CUDAFUT_DAG_EXAMPLES", "100"))
PRIORITIES: tuple[Literal["normal", "high"], ...] = ("normal", "high")


class Node:
    __slots__ = ("device", "expected", "fut", "host")

    def __init__(self, fut: cudafut.CudaFuture[Any], expected: float, device: int, host: bool = False):
        self.fut, self.expected, self.device = fut, expected, device
        self.host = host  # a NumPy value (to_host): consumed, never a parent


def host_array(rng: random.Random, value: float) -> np.ndarray[Any, Any]:
    """``M`` float32 ``value``s in pinned, pageable or strided host memory."""
    how = rng.choice(["pinned", "pageable", "strided"])
    if how == "pinned":
        h = cudafut.empty_pinned(M, np.float32)
        h[:] = value
        return h
    if how == "strided":
        return np.full(2 * M, value, dtype=np.float32)[::2]
    return np.full(M, value, dtype=np.float32)


class World:
    """Streams per device (both priorities); the kernels are warm (conftest)."""

    def __init__(self) -> None:
        cp = self.cp = _backend.current.cupy()
        self.devices = list(range(min(2, _backend.current.device_count())))
        self.streams: dict[int, list[Any]] = {}
        for d in self.devices:
            with cp.cuda.Device(d):
                self.streams[d] = [cp.cuda.Stream(non_blocking=True, priority=p) for p in (0, 0, -1, -1)]

    def slow_affine(self, x: Any, a: float, b: float, ms: float) -> Any:
        """``a * x + b`` on the current stream, after spinning ``ms``."""
        tmp = self.cp.empty_like(x)
        spin_copy(x, tmp, ms)
        return tmp * a + b

    def slow_sum(self, x: Any, y: Any, ms: float) -> Any:
        tmp = self.cp.empty_like(x)
        spin_copy(x, tmp, ms)
        return tmp + y


@pytest.fixture(scope="module")
def world(warm_kernels: None) -> Iterator[World]:
    # Pageable copies of M floats staged by several copy threads, in
    # several chunks (they would be copied inline otherwise); to_host is
    # staged anyway.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_copies, "INLINE_BYTES", 4096)
        patch.setattr(_copies, "CHUNK_MIN", 4096)
        patch.setattr(_copies, "JOB_BYTES", 4096)
        yield World()


def build(world: World, rng: random.Random) -> list[Node]:
    cp = world.cp
    nodes: list[Node] = []
    for _ in range(rng.randint(2, 9)):
        kinds = ["source", "upload", "then", "then", "wait", "join", "submit", "download"]
        kind = rng.choice(kinds) if any(not n.host for n in nodes) else rng.choice(["source", "upload"])
        ms = rng.choice(DELAYS_MS)
        a, b = float(rng.choice([1, 2, -1])), float(rng.randint(-5, 5))
        if kind == "upload":
            dev = rng.choice(world.devices)
            value = float(rng.randint(1, 100))
            nodes.append(Node(cudafut.to_device(host_array(rng, value), device=dev), value, dev))
            continue
        if kind == "source":
            dev = rng.choice(world.devices)
            stream = rng.choice(world.streams[dev])
            value = float(rng.randint(1, 100))
            with cp.cuda.Device(dev), stream:
                x = cp.zeros(M, dtype=cp.float32)
                spin_fill(x, value, ms)
                nodes.append(Node(cudafut.record(x), value, dev))
            continue
        parent = rng.choice([n for n in nodes if not n.host])
        if kind == "download":
            out = rng.choice([None, "pinned", "pageable", "strided"])
            buffer: Any = None
            if out == "pinned":
                buffer = cudafut.empty_pinned(M, np.float32)
            elif out == "pageable":
                buffer = np.empty(M, np.float32)
            elif out == "strided":
                buffer = np.empty(2 * M, np.float32)[::2]
            nodes.append(Node(cudafut.to_host(parent.fut, out=buffer), parent.expected, parent.device, True))
            continue
        if kind == "then":
            prio = rng.choice(PRIORITIES)
            child = parent.fut.then(lambda v, a=a, b=b, ms=ms: world.slow_affine(v, a, b, ms), priority=prio)
            nodes.append(Node(child, a * parent.expected + b, parent.device))
            continue
        dev = parent.device
        stream = rng.choice(world.streams[dev])
        with cp.cuda.Device(dev), stream:
            if kind == "wait":
                v = parent.fut.wait()
                out = world.slow_affine(v, a, b, ms)
                keep = v if rng.random() < 0.5 else None  # the wait protects v itself
                nodes.append(Node(cudafut.record(out, keep=keep), a * parent.expected + b, dev))
            elif kind == "join":
                other = rng.choice([n for n in nodes if n.device == dev and not n.host])
                x, y = parent.fut.wait(), other.fut.wait()
                out = world.slow_sum(x, y, ms)
                nodes.append(Node(cudafut.record(out, keep=(x, y)), parent.expected + other.expected, dev))
            else:  # submit: its pool stream waits for this (current) stream
                v = parent.fut.wait()
                fut = cudafut.submit(world.slow_affine, v, a, b, ms, device=dev)
                nodes.append(Node(fut, a * parent.expected + b, dev))
    return nodes


def consume(world: World, nodes: list[Node], rng: random.Random) -> list[tuple[int, str, Any]]:
    """Every node's value on the host, each read one of four ways."""
    cp = world.cp
    modes = [rng.choice(["await", "result", "gather", "wait"]) for _ in nodes]
    got: list[tuple[int, str, Any]] = []
    for i, (node, mode) in enumerate(zip(nodes, modes, strict=True)):
        if mode == "result":
            got.append((i, mode, cp.asnumpy(node.fut.result(timeout=60))))
        elif mode == "wait" and node.host:
            got.append((i, "wait (host: result)", node.fut.result(timeout=60)))
        elif mode == "wait":
            reader = rng.choice(world.streams[node.device])
            with cp.cuda.Device(node.device), reader:
                v = node.fut.wait()
                host = v.get(stream=reader)
                reader.synchronize()
            got.append((i, mode, host))
    gathered = [i for i, m in enumerate(modes) if m == "gather"]
    if gathered:
        values = cudafut.gather(*(nodes[i].fut for i in gathered)).result(timeout=60)
        got += [(i, "gather", cp.asnumpy(v)) for i, v in zip(gathered, values, strict=True)]
    awaited = [i for i, m in enumerate(modes) if m == "await"]
    if awaited:
        backend = rng.choice(BACKENDS)

        async def main() -> list[Any]:
            return [await nodes[i].fut for i in awaited]

        values = run_on(backend, main)
        got += [(i, f"await ({backend})", cp.asnumpy(v)) for i, v in zip(awaited, values, strict=True)]
    return got


def check_seed(world: World, seed: int) -> None:
    rng = random.Random(seed)
    nodes = build(world, rng)
    for i, how, host in consume(world, nodes, rng):
        expected = np.full(M, nodes[i].expected, dtype=np.float32)
        assert np.array_equal(host, expected), (
            f"seed {seed}: node {i} read with {how} holds {host[:4]}..., expected {nodes[i].expected}; "
            f"replay with CUDAFUT_DAG_SEED={seed}"
        )


@pytest.mark.skipif("CUDAFUT_DAG_SEED" in os.environ, reason="replaying one seed")
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    print_blob=True,
    phases=(Phase.explicit, Phase.generate),  # a random seed does not shrink usefully
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_dags_read_the_right_values(world: World, seed: int) -> None:
    check_seed(world, seed)


@pytest.mark.skipif("CUDAFUT_DAG_SEED" not in os.environ, reason="set CUDAFUT_DAG_SEED to replay")
def test_replay_one_seed(world: World) -> None:
    check_seed(world, int(os.environ["CUDAFUT_DAG_SEED"]))


def test_control_an_unordered_read_of_a_slow_source_is_wrong(world: World) -> None:
    """The harness sees a missing wait: read a slow source without one."""
    cp = world.cp
    producer, reader = world.streams[0][0], world.streams[0][1]
    with producer:
        x = cp.zeros(M, dtype=cp.float32)
        spin_fill(x, 5.0, 50)
        fut = cudafut.record(x)
    host = x.get(stream=reader)
    reader.synchronize()
    assert not np.array_equal(host, np.full(M, 5.0, dtype=np.float32))
    fut.result()
