"""Running a function on N ranks, one process per GPU, as torchrun would.

:func:`run_ranks` writes a body (Python source defining ``main(rank, world)``,
plain or ``async``) to a file and starts one ``python -c BOOTSTRAP`` per
rank with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free port) and NVLink multicast off
(``NCCL_NVLS_ENABLE=0`` and the like: NO_MULTICAST).
Each rank calls ``cudafut.distributed.init_process_group()``, runs ``main``
(an ``async`` one on the loop named by ``BACKEND``: asyncio, uvloop or trio),
prints ``RESULT_MARK + json.dumps(result)`` and tears the world down (or, if
the body sets ``HARD_EXIT = True``, leaves at once with ``os._exit(0)``: the
teardown of an aborted communicator may hang).

Nothing can hang the caller: past ``timeout``, or ``grace`` seconds after a
rank failed (its peers would wait for it in a collective until their own
timeout), every rank still running gets SIGUSR1 (its faulthandler prints the
stack of every thread to its stderr) and then SIGKILL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from tests.subproc import ROOT

#: The rank's result line starts with it (NCCL may print on stdout too).
RESULT_MARK = "CUDAFUT_RANK_RESULT "

#: The default timeout of the world's collectives in the ranks, and of
#: init_process_group (which includes importing torch for its TCPStore):
#: shorter than run_ranks' timeout, so that a rank whose peer is missing
#: fails with CollectiveError rather than being killed.
GROUP_TIMEOUT_S = 60.0

#: NVLink multicast stays off on the lent machines (it can take the host's
#: shared GPUs out of service): forced in every rank, whatever else is set.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

BOOTSTRAP = """
import faulthandler, inspect, json, os, runpy, signal, sys
faulthandler.enable()
faulthandler.register(signal.SIGUSR1, all_threads=True)
import cudafut.distributed as dist

rank = int(os.environ["RANK"])
world = dist.init_process_group(timeout=float(os.environ["CUDAFUT_DIST_TIMEOUT"]))
body = runpy.run_path(sys.argv[1], run_name="__rank_body__")
main = body["main"]
if inspect.iscoroutinefunction(main):
    from tests.runners import run_on
    result = run_on(os.environ.get("BACKEND", "asyncio"), main, rank, world)
else:
    result = main(rank, world)
sys.stdout.write("\\n" + MARK + json.dumps(result) + "\\n")
sys.stdout.flush()
if body.get("HARD_EXIT"):
    sys.stderr.flush()
    os._exit(0)
dist.destroy_process_group()
""".replace("MARK", repr(RESULT_MARK))


#: Every variable a launcher sets for the rank: cleared for a one-process world.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)


@dataclasses.dataclass
class Result:
    """What one rank did."""

    rank: int
    #: None only if the process could not be reaped after SIGKILL.
    returncode: int | None
    stdout: str
    stderr: str
    #: The JSON the rank printed last (after RESULT_MARK), or None.
    value: Any
    #: Killed by the harness (past the timeout, or a peer failed).
    killed: bool

    def tail(self, chars: int = 4000) -> str:
        return (
            f"--- rank {self.rank}: returncode {self.returncode}"
            f"{' (killed by the harness)' if self.killed else ''}\n"
            f"stdout: ...{self.stdout[-chars:]}\nstderr: ...{self.stderr[-chars:]}"
        )


def describe(results: list[Result]) -> str:
    """Every rank's exit and output tails, for an assertion message."""
    return "\n".join(r.tail() for r in results)


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _value(stdout: str) -> Any:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    return None


def run_ranks(
    nproc: int,
    body: str,
    *,
    timeout: float = 120,
    extra_env: dict[str, str] | None = None,
    grace: float = 15,
) -> list[Result]:
    """Run ``body`` on ``nproc`` ranks at once; every rank's outcome, by rank.

    Args:
        nproc: the world size; rank ``r`` runs on device ``r`` (``LOCAL_RANK``).
        body: Python source defining ``main(rank, world)``: ``world`` is the
            ProcessGroup that init_process_group returned; what main returns
            (JSON-serialisable) comes back as ``Result.value``.
        timeout: seconds for the whole run; then the ranks are killed.
        extra_env: more environment variables for every rank (``BACKEND``...).
        grace: seconds the other ranks may go on once one rank failed
            (non-zero exit) before they are killed.
    """
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="cudafut-dist-"))
    procs: list[subprocess.Popen[bytes]] = []
    files: list[tuple[Any, Any]] = []
    killed: set[int] = set()
    try:
        path = tmp / "body.py"
        path.write_text(textwrap.dedent(body))
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        base = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
            "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CUDAFUT_DIST_TIMEOUT": str(GROUP_TIMEOUT_S),
            **(extra_env or {}),
            **NO_MULTICAST,
        }
        base.setdefault("NCCL_DEBUG", "WARN")
        for rank in range(nproc):
            out = open(tmp / f"rank{rank}.out", "wb")  # noqa: SIM115 - closed below
            err = open(tmp / f"rank{rank}.err", "wb")  # noqa: SIM115 - closed below
            files.append((out, err))
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BOOTSTRAP, str(path)],
                    stdout=out,
                    stderr=err,
                    cwd=ROOT,
                    env=env,
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, now + grace)
            if now > deadline:
                killed = {i for i, c in enumerate(codes) if c is None}
                _stop([procs[i] for i in sorted(killed)])
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # only if something above raised: never leave a rank running
            if p.poll() is None:
                _stop([p])
        for out, err in files:
            out.close()
            err.close()
        results = []
        for rank, p in enumerate(procs):
            stdout = (tmp / f"rank{rank}.out").read_text(errors="replace")
            stderr = (tmp / f"rank{rank}.err").read_text(errors="replace")
            results.append(Result(rank, p.returncode, stdout, stderr, _value(stdout), rank in killed))
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Dump every thread's stack (faulthandler, SIGUSR1), then kill."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable: returncode stays None
            p.wait(timeout=10)
