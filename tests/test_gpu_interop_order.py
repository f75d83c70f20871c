"""Other libraries' work is ordered before cudafut's streams (docs/design.md,
hazard 9): never stale data, whichever library made the array.

Each library here makes an array with a SLOW producer on a stream of its own
choice (a JAX computation calibrated to run about 150 ms; for the others the
%globaltimer spin kernel of tests/kernels.py on the library's stream), with a
value that is new for every array. Each path of cudafut that takes the array
(``record()`` then ``wait()`` or ``result()``, ``record(stream=)``,
``set_result()`` then ``wait()``, ``to_host()``, and a ``then()`` callback
that returns it) must give the final values. The values are read through a
plain CuPy view of the memory on a consumer stream that only cudafut
ordered (``raw``): what ``cupy.asarray`` does with an array interface that
names no stream, as JAX's does. ``test_control_*`` shows that such a read,
unordered, sees stale data, so the harness can see the bug.

- CuPy: the kernel on CuPy's current stream (ordered as before).
- PyTorch: the kernel on PyTorch's current stream, a torch side stream that
  is not CuPy's current stream.
- JAX: ``lax.fori_loop`` of matmuls in a jitted function that then fills
  the output; JAX orders its work by ``__dlpack__(stream=...)``.
- Numba: the kernel on a Numba stream that made the array: its
  ``__cuda_array_interface__`` names that stream (version 3).

Each library is skipped where it does not import or cannot use the GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cudafut
from tests.kernels import spin_fill

# Before JAX is imported (in a fixture): JAX must not take most of the GPU's
# memory for itself, which the other libraries of this process need.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = [
    pytest.mark.gpu,
    # CuPy 14 deprecates ExternalStream (the kernels run on other libraries'
    # streams through it); JAX and Numba deprecate parts of their APIs.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

N = 1 << 20
SLOW_MS = 100.0
#: How long the JAX producer is calibrated to run.
JAX_S = 0.15

_values = itertools.count(3)


def next_value() -> float:
    """A value no earlier array had: a stale read never shows it by chance."""
    return float(next(_values))


def raw(cp: Any, x: Any) -> Any:
    """A CuPy view of ``x``'s float32 memory that orders nothing (its array
    interface's stream, if any, is ignored)."""
    interface = x.__cuda_array_interface__
    shape = tuple(interface["shape"])
    memory = cp.cuda.UnownedMemory(interface["data"][0], 4 * math.prod(shape), x)
    return cp.ndarray(shape, cp.float32, cp.cuda.MemoryPointer(memory, 0))


def host(arr: Any, stream: Any) -> Any:
    """Copy to the host on ``stream`` only (no implicit wait on others)."""
    out = arr.get(stream=stream)
    stream.synchronize()
    return out


# -- the producers ---------------------------------------------------------------------------------


class Producer:
    """Makes a float32 array of N that a slow producer fills with a new value."""

    name = ""

    def make(self) -> tuple[Any, float]:
        raise NotImplementedError

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Active while the array is made and handed to cudafut."""
        return contextlib.nullcontext()

    def stream_for(self, caller: Any) -> Any:
        """What the caller passes as ``record(x, stream=...)``: the stream it
        made ``x`` on, as far as it knows (for JAX and Numba: its own)."""
        return caller


class CupyProducer(Producer):
    name = "cupy"

    def __init__(self, cp: Any) -> None:
        self.cp = cp

    def make(self) -> tuple[Any, float]:
        value = next_value()
        x = self.cp.zeros(N, dtype=self.cp.float32)  # on CuPy's current stream
        spin_fill(x, value, SLOW_MS)
        return x, value


class TorchProducer(Producer):
    name = "torch"

    def __init__(self, cp: Any, torch: Any) -> None:
        self.cp, self.torch = cp, torch
        self.stream = torch.cuda.Stream()

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self.torch.cuda.stream(self.stream)  # type: ignore[no-any-return]

    def stream_for(self, caller: Any) -> Any:
        return self.stream

    def make(self) -> tuple[Any, float]:
        value = next_value()
        torch = self.torch
        t = torch.zeros(N, dtype=torch.float32, device="cuda")  # on torch's current stream
        with self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream, 0):
            spin_fill(raw(self.cp, t), value, SLOW_MS)
        return t, value


class JaxProducer(Producer):
    name = "jax"

    def __init__(self, fill: Callable[..., Any], m: Any, iters: int) -> None:
        self.fill, self.m, self.iters = fill, m, iters

    def make(self) -> tuple[Any, float]:
        value = next_value()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.fill(self.m, self.iters, np.float32(value)), value


class NumbaProducer(Producer):
    name = "numba"

    def __init__(self, cp: Any, numba_cuda: Any) -> None:
        self.cp, self.numba_cuda = cp, numba_cuda
        self.stream = numba_cuda.stream()

    def make(self) -> tuple[Any, float]:
        value = next_value()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            array = self.numba_cuda.device_array(N, dtype=np.float32, stream=self.stream)
        stream = array.__cuda_array_interface__["stream"]
        assert isinstance(stream, int) and stream > 2  # the array names its stream
        with self.cp.cuda.ExternalStream(stream, 0):
            spin_fill(raw(self.cp, array), value, SLOW_MS)
        return array, value


@pytest.fixture(scope="module")
def torch_producer(warm_kernels: None) -> TorchProducer:
    from cudafut import _backend

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build cannot use CUDA")
    producer = TorchProducer(_backend.current.cupy(), torch)
    with producer.context():  # warm: a first use takes longer than the producer spins
        x, _ = producer.make()
        warm = [x + 1, x.cpu()]
    torch.cuda.synchronize()
    del warm
    return producer


@pytest.fixture(scope="module")
def jax_producer(warm_kernels: None) -> JaxProducer:
    """The jitted producer, compiled and calibrated to run about JAX_S.

    Its loop has a trip count known when it is compiled: XLA runs a loop
    whose count is a traced value by copying the condition to the host at
    every iteration, so the call itself would return only once the work is
    done (measured with JAX 0.11 on an H100), and there would be nothing
    left to order.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax = pytest.importorskip("jax")
        try:
            (gpu, *_) = jax.devices("gpu")
        except RuntimeError as exc:
            pytest.skip(f"JAX cannot use the GPU here: {exc}")
        jnp, lax = jax.numpy, jax.lax
        size = 4096  # a few ms per matmul: few launches, each long

        def body(_i: Any, m: Any) -> Any:
            return jnp.tanh(m @ m * (1.0 / size))

        def slow_fill(m: Any, iters: int, value: Any) -> Any:
            m = lax.fori_loop(0, iters, body, m)
            # Written after the loop: the output depends on its result (never NaN).
            return jnp.where(jnp.isnan(m[0, 0]), jnp.float32(-1), jnp.full((N,), value, jnp.float32))

        fill = jax.jit(slow_fill, static_argnums=1)
        m = jax.device_put(jnp.full((size, size), 0.5, jnp.float32), gpu)
        fill(m, 4, np.float32(1)).block_until_ready()  # compiled
        start = time.perf_counter()
        fill(m, 4, np.float32(1)).block_until_ready()
        per_iteration = (time.perf_counter() - start) / 4
        iters = max(4, min(10_000, int(JAX_S / max(per_iteration, 1e-6))))
        fill(m, iters, np.float32(1)).block_until_ready()  # compiled for that count
    return JaxProducer(fill, m, iters)


@pytest.fixture(scope="module")
def numba_producer(warm_kernels: None) -> NumbaProducer:
    from cudafut import _backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        numba_cuda = pytest.importorskip("numba.cuda")
        try:
            if not numba_cuda.is_available():
                pytest.skip("numba cannot use the GPU here")
            producer = NumbaProducer(_backend.current.cupy(), numba_cuda)
            producer.make()
        except Exception as exc:  # numba's own failures (versions, drivers)
            pytest.skip(f"numba cannot use this GPU: {exc}")
    _backend.current.cupy().cuda.Device().synchronize()
    return producer


@pytest.fixture(params=["cupy", "torch", "jax", "numba"])
def lib(request: pytest.FixtureRequest, cp: Any) -> Iterator[Producer]:
    name = request.param
    producer = CupyProducer(cp) if name == "cupy" else request.getfixturevalue(f"{name}_producer")
    yield producer
    cp.cuda.Device().synchronize()  # no producer left running into the next test


@pytest.fixture
def streams(cp: Any) -> tuple[Any, Any]:
    """The caller's stream (current while the array is made and handed to
    cudafut) and the consumer's stream: both non-blocking, so nothing but
    cudafut orders the one after the other."""
    return cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)


# -- the harness itself ------------------------------------------------------------------------------


def test_control_an_unordered_read_sees_stale_data(cp: Any, lib: Producer, streams: tuple[Any, Any]) -> None:
    caller, consumer = streams
    with lib.context(), caller:
        x, value = lib.make()
    got = host(raw(cp, x), consumer)
    if lib.name == "jax" and (got == value).all():
        pytest.skip("JAX finished before the read: calibrated too short on this GPU to show stale data")
    assert not (got == value).all()


# -- every path that takes the array ----------------------------------------------------------------


def record_wait(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    with lib.context(), caller:
        x, value = lib.make()
        fut = cudafut.record(x)
    with consumer:
        v = fut.wait()
    return value, host(raw(cp, v), consumer)


def record_result(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    with lib.context(), caller:
        x, value = lib.make()
        fut = cudafut.record([x])
    (v,) = fut.result(timeout=30)
    return value, host(raw(cp, v), consumer)


def record_on_stream(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    with lib.context(), caller:
        x, value = lib.make()
    fut = cudafut.record(x, stream=lib.stream_for(caller))
    with consumer:
        v = fut.wait()
    return value, host(raw(cp, v), consumer)


def set_result_wait(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    fut: cudafut.CudaFuture[Any] = cudafut.CudaFuture()
    with lib.context(), caller:
        x, value = lib.make()
        fut.set_result({"x": x})
    with consumer:
        v = fut.wait()["x"]
    return value, host(raw(cp, v), consumer)


def to_host(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    with lib.context(), caller:
        x, value = lib.make()
        out = cudafut.to_host(x)
    return value, out.result(timeout=30)


def then_returns(cp: Any, lib: Producer, caller: Any, consumer: Any) -> tuple[float, Any]:
    values: list[float] = []

    def fn(_v: Any) -> Any:
        x, value = lib.make()  # with the pool stream current (CuPy's and PyTorch's)
        values.append(value)
        return x

    with lib.context(), caller:
        parent = cudafut.record(cp.zeros(1, dtype=cp.float32))
    v = parent.then(fn).result(timeout=30)
    return values[0], host(raw(cp, v), consumer)


PATHS = [record_wait, record_result, record_on_stream, set_result_wait, to_host, then_returns]


@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_every_path_gives_the_final_values(
    cp: Any, lib: Producer, streams: tuple[Any, Any], path: Callable[..., tuple[float, Any]]
) -> None:
    """Fails without hazard 9's fix for JAX and Numba (stale values), and
    for PyTorch's ``to_host`` (the copy did not wait for PyTorch's stream)."""
    value, got = path(cp, lib, *streams)
    assert (got == value).all(), f"{lib.name} {path.__name__}: stale values {np.unique(got)[:4]}, not {value}"


def test_jax_is_ordered_on_the_gpu_not_by_waiting_on_the_host(
    cp: Any, jax_producer: JaxProducer, streams: tuple[Any, Any]
) -> None:
    """``__dlpack__(stream=...)`` makes the stream wait for JAX's work on
    the GPU: the future is set at once, pending until JAX is done."""
    caller, consumer = streams
    with caller:
        x, value = jax_producer.make()
        fut = cudafut.record(x)
    assert not fut.done()  # JAX still runs (about JAX_S): record() did not wait for it
    got = host(raw(cp, fut.result(timeout=30)), consumer)
    assert (got == value).all()
    cp.cuda.Device().synchronize()
