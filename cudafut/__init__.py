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

from ._combinators import as_completed as as_completed
from ._combinators import gather as gather
from ._combinators import wait_all as wait_all
from ._errors import CancelledError as CancelledError
from ._errors import CudaError as CudaError
from ._errors import CudaUnavailableError as CudaUnavailableError
from ._errors import InvalidStateError as InvalidStateError
from ._errors import TimeoutError as TimeoutError
from ._future import CudaFuture as CudaFuture
from ._future import record as record
from ._future import submit as submit
from ._policy import WaitPolicy as WaitPolicy
from ._policy import get_wait_policy as get_wait_policy
from ._policy import set_wait_policy as set_wait_policy

__version__ = "0.1.0.dev0"

__all__ = [
    "CancelledError",
    "CudaError",
    "CudaFuture",
    "CudaUnavailableError",
    "InvalidStateError",
    "TimeoutError",
    "WaitPolicy",
    "__version__",
    "as_completed",
    "gather",
    "get_wait_policy",
    "record",
    "set_wait_policy",
    "submit",
    "wait_all",
]

# Named so in tracebacks, reprs and docs: users import them from cudafut.
# (CancelledError is concurrent.futures' own class, and stays so.)
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("cudafut."):
        _obj.__module__ = "cudafut"
del _name, _obj
