"""cudafut.distributed: NCCL collectives as CudaFutures, across GPUs and processes.

A collective returns a :class:`~cudafut.CudaFuture` that is *set* as soon as
its work is enqueued: its event is on the group's communication stream,
which first waits on the caller's current stream. Compute overlaps
communication, and ``await``, ``then()``, ``wait()`` and ``result()`` compose
with communication exactly as with compute::

    import cudafut.distributed as dist

    dist.init_process_group()        # ranks from torchrun / mpirun
    fut = dist.all_reduce(grad)      # returns at once
    ...                              # more GPU work meanwhile
    grad = await fut                 # or fut.result(), fut.then(...)

A collective that cannot finish (a dead peer) or that NCCL reports failed
fails every pending future of its group with :class:`CollectiveError` within
its timeout, and the group's communicator is aborted: nothing hangs.
``import cudafut.distributed`` needs neither CuPy, NCCL nor torch; they are
imported by the first call that needs them. See docs/distributed.md.
"""

from ._errors import CollectiveError as CollectiveError
from ._group import ProcessGroup as ProcessGroup
from ._group import destroy_process_group as destroy_process_group
from ._group import get_rank as get_rank
from ._group import get_world_size as get_world_size
from ._group import init_process_group as init_process_group
from ._group import is_initialized as is_initialized
from ._group import new_group as new_group
from ._ops import all_gather as all_gather
from ._ops import all_reduce as all_reduce
from ._ops import all_to_all as all_to_all
from ._ops import broadcast as broadcast
from ._ops import recv as recv
from ._ops import reduce as reduce
from ._ops import reduce_scatter as reduce_scatter
from ._ops import send as send

__all__ = [
    "CollectiveError",
    "ProcessGroup",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
