"""The error of a failed collective."""

from __future__ import annotations

from .._errors import CudaError


class CollectiveError(CudaError):
    """A collective failed: NCCL reported an error, or it did not complete
    within its timeout (a peer died, hung, or never called it).

    Every pending future of the group fails with it, and the group's
    communicator is aborted: later calls on the group raise it at once.
    Restart the processes (or at least make new groups) to go on. It
    subclasses :class:`cudafut.CudaError`, so code that handles failed GPU
    work handles it too; it is not a CUDA error, though: its ``code`` is -1,
    and its message and repr speak of the collective only.

    Attributes:
        rank: this process's rank in the group.
        op: the collective, e.g. ``"all_reduce"``.
        size: the number of ranks in the group.
        reason: NCCL's message, or what timed out.
    """

    def __init__(self, rank: int, op: str, size: int, reason: str, device: int | None = None) -> None:
        self.rank = rank
        self.op = op
        self.size = size
        self.reason = reason
        super().__init__(
            -1,
            "CollectiveError",
            f"{op} failed on rank {rank} of {size}: {reason}",
            device,
        )
        # RuntimeError's repr shows args: CudaError's "CUDA error -1 (...)" text.
        self.args = (str(self),)

    def __str__(self) -> str:
        where = "" if self.device is None else f" (device {self.device})"
        return f"{self.op} failed on rank {self.rank} of {self.size}{where}: {self.reason}"

    def __reduce__(self) -> tuple[type[CollectiveError], tuple[int, str, int, str, int | None]]:  # type: ignore[override]
        return (type(self), (self.rank, self.op, self.size, self.reason, self.device))
