"""graphed(): one captured CUDA graph per batch size, replayed with fresh inputs.

Capturing and replaying are the frameworks' own (``torch.cuda.CUDAGraph``
and ``torch.cuda.graph`` for PyTorch, stream capture for CuPy); what they
leave to the user, and this module adds, is what serving needs around them:
a graph per bucket of batch sizes, static inputs that each call fills,
outputs copied out of the graph's memory before the next replay overwrites
them, and replays from several threads (cudafut's launchers) ordered on the
GPU. docs/serving.md, "CUDA graphs", says what is safe and what is not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import _cuda, _torch

__all__ = ["Graphed", "graphed"]


def _check_buckets(buckets: object) -> tuple[int, ...]:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise TypeError(f"buckets must be a sequence of batch sizes (ints), not {type(buckets).__name__}")
    sizes = set()
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"a bucket is a batch size (an int), not {b!r}")
        if b < 1:
            raise ValueError(f"a bucket must be at least 1, not {b}")
        sizes.add(b)
    if not sizes:
        raise ValueError("buckets must hold at least one batch size")
    return tuple(sorted(sizes))


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class _Bucket:
    """One captured graph: its static inputs and outputs; for CuPy, the
    event after its capture (the first replay waits for it). The event after
    the last replay is the :class:`Graphed` object's, shared by its buckets."""

    __slots__ = ("graph", "inputs", "last", "outputs", "single", "stream_keep")

    def __init__(self, graph: Any, inputs: tuple[Any, ...], outputs: Any, keep: Any = None) -> None:
        self.graph = graph
        self.inputs = inputs
        self.single = not isinstance(outputs, (tuple, list))
        self.outputs = _as_tuple(outputs)
        self.last: Any = None
        self.stream_keep = keep


class Graphed:
    """A function replayed from captured CUDA graphs, one per batch size.

    Made by :func:`graphed`; see there. Calling it (``g(x)`` or ``g(x1,
    x2)``) copies the inputs into the static inputs of the graph of the
    smallest bucket that holds their batch, replays that graph on the
    current stream (the launcher's, under :func:`cudafut.launch`) and
    returns copies of its outputs, sliced to the batch. Host cost: one copy
    per input and output, a graph launch (far less host time than the
    eager launch it replaces: docs/serving.md), and a lock; the first call
    of a bucket captures it first (seconds).

    Attributes:
        buckets: the batch sizes, ascending.
        framework: ``"torch"`` or ``"cupy"``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        buckets: tuple[int, ...],
        example: Callable[[int], Any],
        warmup: int,
        framework: str,
    ) -> None:
        self.fn = fn
        self.buckets = buckets
        self.framework = framework
        self._example = example
        self._warmup = warmup
        self._graphs: dict[int, _Bucket] = {}
        self._arity: int | None = None
        self._last: Any = None  # the event after the last replay's copies out
        # One lock for all buckets: a replay's few enqueues are short, and a
        # capture must not interleave with another thread's replay of the
        # same memory.
        self._lock = threading.RLock()

    def bucket_for(self, n: int) -> int:
        """The smallest bucket of at least ``n``.

        Raises:
            ValueError: ``n`` is below 1 or above the largest bucket.
        """
        for size in self.buckets:
            if size >= n:
                if n < 1:
                    break
                return size
        raise ValueError(f"a batch of {n} does not fit the buckets {self.buckets}")

    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture the graphs of ``sizes`` (default: every bucket) now.

        Blocks the calling thread for the warm-up runs and the capture
        (seconds for a real model): call it at start-up, or through
        :func:`cudafut.launch` to keep it off an event loop.
        """
        for size in self.buckets if sizes is None else sizes:
            self._bucket(self.bucket_for(size))

    def _bucket(self, size: int) -> _Bucket:
        found = self._graphs.get(size)
        if found is None:
            with self._lock:
                found = self._graphs.get(size)
                if found is None:
                    capture = _capture_torch if self.framework == "torch" else _capture_cupy
                    found = self._graphs[size] = capture(self.fn, self._example(size), self._warmup)
        return found

    def __call__(self, *inputs: Any) -> Any:
        if not inputs:
            raise TypeError("a graphed function takes its batch inputs (at least one array)")
        n = _batch_of(inputs)
        size = self.bucket_for(n)
        arity = self._arity
        if arity is not None and len(inputs) != arity:  # checked before a capture, once known
            raise TypeError(f"this graph takes {arity} input(s), not {len(inputs)}")
        bucket = self._bucket(size)
        self._arity = len(bucket.inputs)
        if len(inputs) != len(bucket.inputs):
            raise TypeError(f"this graph takes {len(bucket.inputs)} input(s), not {len(inputs)}")
        for static, x in zip(bucket.inputs, inputs, strict=True):
            if tuple(x.shape[1:]) != tuple(static.shape[1:]):
                raise ValueError(
                    f"a graphed input of shape {tuple(x.shape)} does not match the captured "
                    f"{tuple(static.shape)} beyond its batch axis"
                )
        replay = _replay_torch if self.framework == "torch" else _replay_cupy
        with self._lock:
            # All replays of this object are ordered on the GPU, one after
            # the other, whatever their bucket: two graphs captured by one
            # library may share workspace memory (cuBLAS's, per stream).
            outputs, self._last = replay(bucket, inputs, n, self._last)
        return outputs[0] if bucket.single else outputs

    def __repr__(self) -> str:
        captured = sorted(self._graphs)
        return f"<cudafut.Graphed {self.framework} buckets={self.buckets} captured={captured}>"


def _batch_of(inputs: tuple[Any, ...]) -> int:
    sizes = set()
    for x in inputs:
        shape = getattr(x, "shape", None)
        if not isinstance(shape, tuple) and not (shape is not None and hasattr(shape, "__len__")):
            raise TypeError(
                f"graphed inputs are arrays whose first axis is the batch, not {type(x).__name__}"
            )
        if len(shape) < 1:
            raise ValueError("graphed inputs need a batch axis (their first axis)")
        sizes.add(int(shape[0]))
    if len(sizes) != 1:
        raise ValueError(f"graphed inputs disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


# -- PyTorch ------------------------------------------------------------------


def _capture_torch(fn: Callable[..., Any], example: Any, warmup: int) -> _Bucket:
    inputs = _as_tuple(example)
    graph, outputs = _torch.capture_graph(fn, inputs, warmup)
    return _Bucket(graph, inputs, outputs)


def _replay_torch(bucket: _Bucket, inputs: tuple[Any, ...], n: int, last: Any) -> tuple[tuple[Any, ...], Any]:
    return _torch.replay_graph(bucket.graph, bucket.inputs, bucket.outputs, inputs, n, last)


# -- CuPy -----------------------------------------------------------------------


def _capture_cupy(fn: Callable[..., Any], example: Any, warmup: int) -> _Bucket:
    inputs = _as_tuple(example)
    graph, outputs, keep = _cuda.capture_cupy_graph(fn, inputs, warmup)
    bucket = _Bucket(graph, inputs, outputs, keep=keep)
    bucket.last = keep[1].record()  # after the capture stream's work (the warm-up)
    return bucket


def _replay_cupy(bucket: _Bucket, inputs: tuple[Any, ...], n: int, last: Any) -> tuple[tuple[Any, ...], Any]:
    # The first replay also waits for the capture (its stream's last event).
    out: tuple[tuple[Any, ...], Any] = _cuda.replay_cupy_graph(
        bucket.graph, bucket.inputs, bucket.outputs, inputs, n, last if last is not None else bucket.last
    )
    return out


def graphed(
    fn: Callable[..., Any],
    *,
    buckets: Sequence[int],
    example: Callable[[int], Any],
    warmup: int = 3,
) -> Graphed:
    """Capture ``fn`` as one CUDA graph per batch size; return a function that replays them.

    Serving a model eagerly costs its whole host dispatch per batch
    (milliseconds for a ResNet-50 in PyTorch); replaying its captured graph is
    one graph launch, to which a call here adds a copy per input and output
    and an event (docs/serving.md). Use it with :class:`cudafut.Batcher`'s
    ``buckets`` (the same sizes) and :func:`cudafut.launch`::

        g = cudafut.graphed(
            lambda x: model(x),
            buckets=(1, 2, 4, 8, 16, 32, 64),
            example=lambda n: torch.zeros(n, 3, 224, 224, device="cuda", dtype=torch.half),
        )
        g.capture()  # at start-up: seconds; or lazily, per bucket, on first use
        y = await cudafut.launch(g, batch)  # batch: up to 64 rows

    Args:
        fn: the computation, called with the static inputs of a bucket (what
            ``example(size)`` returned: one array, or a tuple of arrays, each
            with the batch on its first axis); returns an array or a tuple of
            arrays, each with the batch on its first axis. It must be
            capturable: no host synchronisation, no host-dependent control
            flow, no new memory from outside the framework's allocator.
            With PyTorch, run it under ``torch.inference_mode()`` (or
            ``no_grad``) when serving.
        buckets: the batch sizes to capture (one graph each).
        example: ``example(size)`` makes the static inputs of a bucket:
            PyTorch CUDA tensors (captured with ``torch.cuda.graph``) or
            CuPy arrays (captured with CuPy's stream capture, allocating
            from a private memory pool); their contents do not matter.
        warmup: how many times ``fn`` runs before each capture (PyTorch and
            cuDNN choose kernels and allocate on the first runs).

    Calling the result with a batch of ``n`` rows (``n`` up to the largest
    bucket) fills the first ``n`` rows of the smallest bucket that holds
    them, replays its graph on the current stream and returns copies of the
    first ``n`` rows of its outputs. Rows beyond ``n`` keep what an earlier
    call left there: ``fn`` must treat rows independently (true of
    inference models in eval mode, not of batch statistics).

    What is safe: calls from several threads at once (cudafut's launchers):
    each replay waits on the GPU for the previous replay of this object
    (whatever its bucket: two graphs of one library may share workspace
    memory) to have copied its outputs before overwriting inputs, and the
    host side is serialised by a lock; the returned outputs are fresh arrays
    (the graph's own memory is overwritten by the next replay). Each bucket
    keeps its graph's memory (its own PyTorch graph pool, or a private CuPy
    memory pool) for the life of the :class:`Graphed` object.

    Raises:
        TypeError: ``fn`` or ``example`` is not callable, or ``buckets`` is
            not a sequence of ints.
        ValueError: a bucket is below 1, or ``warmup`` is negative.
    """
    if not callable(fn):
        raise TypeError(f"graphed() needs a callable, not {fn!r}")
    if not callable(example):
        raise TypeError(f"example must be a function of a batch size, not {example!r}")
    sizes = _check_buckets(buckets)
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup must be an int, not {warmup!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, not {warmup}")
    probe = _as_tuple(example(sizes[0]))
    if _torch.all_cuda_tensors(probe):
        framework = "torch"
    else:
        cp = _cuda.imported_cupy()
        if cp is None or not all(isinstance(x, cp.ndarray) for x in probe):
            raise TypeError(
                "example(size) must return PyTorch CUDA tensors or CuPy arrays (one, or a tuple), "
                f"not {', '.join(type(x).__name__ for x in probe)}"
            )
        framework = "cupy"
    return Graphed(fn, sizes, example, warmup, framework)
