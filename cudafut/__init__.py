"""cudafut: asyncio-native GPU futures on CuPy.

A :class:`CudaFuture` stands for a value whose GPU work has been enqueued but
may not have run yet. Consume it with ``await fut`` (costs the event loop
nothing), ``fut.then(fn)`` (chains GPU work without touching the host),
``fut.wait()`` (orders your current streams after it) or ``fut.result()``
(blocks the thread until the GPU is done).

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

for _name in (
    "CudaError",
    "CudaUnavailableError",
    "InvalidStateError",
    "TimeoutError",
    "WaitPolicy",
    "as_completed",
    "gather",
    "get_wait_policy",
    "set_wait_policy",
    "wait_all",
):
    globals()[_name].__module__ = "cudafut"
del _name
