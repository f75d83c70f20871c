"""cudafut: asyncio-native GPU futures on CuPy.

A :class:`CudaFuture` stands for a value whose GPU work has been enqueued but
may not have run yet. Consume it with ``await fut`` (never blocks the event
loop), ``fut.then(fn)`` (chains GPU work without the host waiting for it),
``fut.wait()`` (orders your current streams after it) or ``fut.result()``
(blocks the thread until the GPU is done).

What waiting on an event loop costs (``await``, :func:`as_completed`,
``add_done_callback``): while the wait policy (:func:`set_wait_policy`) says spin
(for ``spin_s``, 100 µs by default, after a new wait, and around the
predicted end of work whose duration the waiter has learnt), the loop runs
one poll (one ``cudaEventQuery``, about 2 µs) per loop iteration, taking
that CPU but never blocking other tasks; otherwise it polls once per sleep,
sleeps being at most ``max_sleep_s`` (1 ms by default). See
docs/performance.md for the CPU measured.

``import cudafut`` needs no GPU; the first call that does raises
:class:`CudaUnavailableError` if CUDA cannot be used.
"""

import typing as _typing

from ._batcher import Batcher as Batcher
from ._batcher import BatcherStatistics as BatcherStatistics
from ._bridges import from_torch as from_torch
from ._bridges import wrap_future as wrap_future
from ._combinators import as_completed as as_completed
from ._combinators import as_completed_sync as as_completed_sync
from ._combinators import gather as gather
from ._combinators import wait_all as wait_all
from ._copies import to_device as to_device
from ._copies import to_host as to_host
from ._errors import CancelledError as CancelledError
from ._errors import CudaError as CudaError
from ._errors import CudaUnavailableError as CudaUnavailableError
from ._errors import InvalidStateError as InvalidStateError
from ._errors import SharingError as SharingError
from ._errors import TimeoutError as TimeoutError
from ._future import CudaFuture as CudaFuture
from ._graphs import Graphed as Graphed
from ._graphs import graphed as graphed
from ._launch import launch as launch
from ._launch import warm_launchers as warm_launchers
from ._memory import MemoryStatistics as MemoryStatistics
from ._memory import memory_statistics as memory_statistics
from ._memory import record_stream as record_stream
from ._pinned import empty_pinned as empty_pinned
from ._pinned import get_pinned_limit as get_pinned_limit
from ._pinned import set_pinned_limit as set_pinned_limit
from ._policy import WaitPolicy as WaitPolicy
from ._policy import get_wait_policy as get_wait_policy
from ._policy import set_wait_policy as set_wait_policy
from ._pools import PoolStatistics as PoolStatistics
from ._pools import pool_statistics as pool_statistics
from ._producers import record as record
from ._producers import submit as submit
from ._shared import SharedStatistics as SharedStatistics
from ._shared import enqueued as enqueued
from ._shared import shared_statistics as shared_statistics
from ._tasks import own_stream as own_stream
from ._tasks import task_stream as task_stream
from ._tasks import use_stream as use_stream
from ._tasks import use_task_streams as use_task_streams
from ._trace import Trace as Trace
from ._trace import trace as trace
from ._tracked import Tracked as Tracked
from ._tracked import TrackingStatistics as TrackingStatistics
from ._tracked import get_tracking as get_tracking
from ._tracked import set_tracking as set_tracking

__version__ = "0.1.0.dev0"

__all__ = [
    "Batcher",
    "BatcherStatistics",
    "CancelledError",
    "CudaError",
    "CudaFuture",
    "CudaUnavailableError",
    "Graphed",
    "InvalidStateError",
    "MemoryStatistics",
    "PoolStatistics",
    "SharedStatistics",
    "SharingError",
    "TimeoutError",
    "Trace",
    "Tracked",
    "TrackingStatistics",
    "WaitPolicy",
    "__version__",
    "as_completed",
    "as_completed_sync",
    "empty_pinned",
    "enqueued",
    "from_torch",
    "gather",
    "get_pinned_limit",
    "get_tracking",
    "get_wait_policy",
    "graphed",
    "launch",
    "memory_statistics",
    "own_stream",
    "pool_statistics",
    "record",
    "record_stream",
    "set_pinned_limit",
    "set_tracking",
    "set_wait_policy",
    "shared_statistics",
    "submit",
    "task_stream",
    "to_device",
    "to_host",
    "trace",
    "use_stream",
    "use_task_streams",
    "wait_all",
    "warm_launchers",
    "wrap_future",
]

# Named so in tracebacks, reprs and docs: users import them from cudafut.
# (CancelledError is concurrent.futures' own class, and stays so.)
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("cudafut."):
        _obj.__module__ = "cudafut"
del _name, _obj


#: Submodules that ``import cudafut`` leaves out (the fake GPU, NCCL
#: collectives): each is imported by name, so that cudafut's import stays
#: light. Looked up here only when the attribute is missing.
_SUBMODULES = ("testing", "distributed")


if not _typing.TYPE_CHECKING:  # a typed __getattr__ would let type checkers take any cudafut.<name>

    def __getattr__(name: str) -> object:
        # PEP 562: called only for names the module lacks; a newcomer writing
        # `cudafut.testing.fake_cuda()` after `import cudafut` learns the fix.
        if name in _SUBMODULES:
            raise AttributeError(
                f"module 'cudafut' has no attribute {name!r} until it is imported: add "
                f"`import cudafut.{name}` beside `import cudafut` (`import cudafut` does not import it)"
            )
        raise AttributeError(f"module 'cudafut' has no attribute {name!r}")
