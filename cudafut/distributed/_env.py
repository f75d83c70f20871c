"""What the launcher says: rank, world size, local rank and the store's address.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; Open MPI's mpirun sets ``OMPI_COMM_WORLD_RANK``,
``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_LOCAL_RANK``. With none of them
(and no arguments) the world is this one process. Nothing here touches CUDA.
"""

from __future__ import annotations

import os
from typing import Final

_LAUNCHERS: Final = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)
DEFAULT_ADDR: Final = "127.0.0.1"
#: torchrun's default port, so that a script written for torch.distributed
#: finds the same rendezvous.
DEFAULT_PORT: Final = 29500


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer, not {value!r}") from None
    raise TypeError(f"{name} must be an int, not {value!r}")


def launch_env(rank: object = None, world_size: object = None) -> tuple[int, int, int | None]:
    """``(rank, world_size, local_rank)`` from the arguments, else from the
    launcher's environment variables; ``local_rank`` is None when no launcher
    said it.

    Raises:
        TypeError: an argument that is not an int.
        ValueError: a value that is not an integer, a negative one, a rank
            not below the world size, or only one of rank and world size.
    """
    env = os.environ
    local: object = None
    for rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var in env or size_var in env:
            if rank is None:
                rank = _env_int(rank_var)
            if world_size is None:
                world_size = _env_int(size_var)
            local = env.get(local_var)
            break
    if rank is None and world_size is None:
        return 0, 1, None
    if rank is None or world_size is None:
        raise ValueError(
            "init_process_group() needs both rank and world_size (or neither, for a "
            f"one-process world); got rank={rank!r}, world_size={world_size!r}. Launch "
            "with torchrun or mpirun, or pass both"
        )
    r, n = _int("rank", rank), _int("world_size", world_size)
    if n < 1:
        raise ValueError(f"world_size must be at least 1, not {n}")
    if not 0 <= r < n:
        raise ValueError(f"rank must be in [0, world_size), got rank={r} with world_size={n}")
    local_rank = None if local is None else _int("local rank", local)
    if local_rank is not None and local_rank < 0:
        raise ValueError(f"the local rank must not be negative, not {local_rank}")
    return r, n, local_rank


def _env_int(var: str) -> int:
    value = os.environ.get(var)
    if value is None:
        raise ValueError(
            f"the launcher set some of its variables but not {var}: set it, or pass the argument"
        )
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{var} must be an integer, not {value!r}") from None


def store_address() -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, with torchrun's defaults."""
    addr = os.environ.get("MASTER_ADDR") or DEFAULT_ADDR
    port = _int("MASTER_PORT", os.environ.get("MASTER_PORT") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port (1-65535), not {port}")
    return addr, port


def agent_store() -> bool:
    """Whether torchrun's agent hosts the store on ``MASTER_PORT`` (it says so
    with ``TORCHELASTIC_USE_AGENT_STORE``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


def key(name: str) -> str:
    """A store key of cudafut's, unique to this attempt: torchrun's agent
    store outlives a restart (``TORCHELASTIC_RESTART_COUNT``), and a key of
    the previous attempt must not be read."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"cudafut/{attempt}/{name}"
