"""Section ``collectives``: NCCL collectives as futures (``cudafut.distributed``)
against NCCL called directly, on every GPU of the machine.

The suite runs in one process, so ``run()`` starts one worker process per GPU
(``python -m benchmarks.collectives_worker``, with the environment torchrun
would give it: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; and ``NCCL_NVLS_ENABLE=0``), follows rank 0's progress lines
and takes its result from its stdout. ``CUDAFUT_DIST_NPROC`` chooses how many
GPUs (default: all); with fewer than 2 the section is skipped. A worker that
fails or hangs is reported, with the end of every rank's stderr, and killed:
nothing waits longer than ``TIMEOUT_S``.

Each worker measures, in one run:

- bus bandwidth (nccl-tests' definitions) of ``all_reduce``, ``all_gather``
  and ``reduce_scatter`` on float32, 1 MB to 1 GB (``--quick``: to 64 MB):
  K back-to-back calls then one wait, through cudafut
  (``fut = dist.all_reduce(x)`` ... ``fut.result()``) and through CuPy's
  ``NcclCommunicator`` on a stream (``comm.allReduce(...)`` ...
  ``stream.synchronize()``), interleaved, median of ``REPEATS``;
- the host cost of one call on 4 KB, both ways;
- ``examples/bucket_overlap.py``: gradient buckets all-reduced while the next
  is computed, against the same work done serially, compute per bucket
  calibrated to one bucket's all-reduce.

The result is keyed by nothing but ``nproc``, so runs on 2, 4 and 8 GPUs can
sit side by side: ``markdown()`` and ``plots()`` also take
``{"by_nproc": {"2": run, "4": run, ...}}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from .support.common import Progress, meta_of, pyplot, save_figure

NAME = "collectives"

ROOT = Path(__file__).resolve().parent.parent
WORKER = "benchmarks.collectives_worker"

#: Environment: how many GPUs (worker processes) to use; default all.
NPROC_ENV = "CUDAFUT_DIST_NPROC"
#: Environment of the workers: the folder where rank 0 leaves NCCL's unique id.
RENDEZVOUS_ENV = "CUDAFUT_BENCH_RENDEZVOUS"
#: Lines of rank 0's stdout that the parent reads (anything else is ignored:
#: NCCL_DEBUG, for one, prints on stdout).
PROGRESS = "@@cudafut-bench-progress "
RESULT = "@@cudafut-bench-result "

#: Longest the whole section may take, from the first worker's start.
TIMEOUT_S = 300.0
#: After one worker failed: how long the others get to notice and exit.
FAIL_GRACE_S = 15.0
#: After rank 0 gave its result: how long the others get to exit.
EXIT_GRACE_S = 30.0
#: In the workers: init_process_group's timeout and every collective's.
COLLECTIVE_TIMEOUT_S = 60.0

OPS = ("all_reduce", "all_gather", "reduce_scatter")
CUDAFUT, DIRECT = "cudafut", "direct"  # the two paths
#: The host-cost floor: NCCL with the ordering cudafut adds, by hand.
FLOOR = "floor"
REPEATS = 5
MB = 1 << 20

# Targets (docs/distributed.md): busbw within 5 % of NCCL called directly
# from 16 MB up; the bucket overlap at least 1.6x the serial work.
MIN_RATIO = 0.95
RATIO_FROM_BYTES = 16 * MB
MIN_SPEEDUP = 1.6

# The overlap variants (names as in examples/bucket_overlap.py's VARIANTS).
OVERLAPPED = "overlapped"
SERIAL_GPU = "serial on the GPU (wait() each)"
SERIAL_HOST = "serial (result() each)"


def sizes(quick: bool) -> list[int]:
    """Full buffer sizes in bytes (all_gather: gathered; reduce_scatter:
    before the scatter): 1 MB to 1 GB (quick: 64 MB), x4 steps."""
    top = 64 * MB if quick else 1024 * MB
    out, b = [], MB
    while b <= top:
        out.append(b)
        b *= 4
    return out


def calls_per_repeat(nbytes: int) -> int:
    """Back-to-back calls per timed repetition: 16 GB moved, 8 to 1000 calls
    (tens of ms on an H200 pair from 16 MB up, so that the final wait's
    wake-up, at most the wait policy's 1 ms sleep, weighs a few %). The same
    on every rank."""
    return max(8, min(1000, (16 << 30) // nbytes))


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw, as nccl-tests defines them."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def steps(quick: bool) -> int:
    # Workers up, each op and size, host cost, calibration, overlap.
    return 1 + len(OPS) * len(sizes(quick)) + 3


# -- the parent: start the workers, follow rank 0, kill what is left ------------------


def _nproc() -> tuple[int, str | None]:
    """How many workers, or why none: (n, reason to skip)."""
    import cupy as cp

    devices = int(cp.cuda.runtime.getDeviceCount())
    wanted = os.environ.get(NPROC_ENV)
    n = int(wanted) if wanted else devices
    if n > devices:
        return n, f"{NPROC_ENV}={n} but this machine has {devices} GPU(s)"
    if n < 2:
        return n, f"needs 2 GPUs (found {devices}{f', {NPROC_ENV}={wanted}' if wanted else ''})"
    return n, None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    n, skip = _nproc()
    if skip is not None:
        progress.step(f"collectives: skipped, {skip}")
        return {"skipped": skip, "nproc": n}
    result = _launch(n, quick, progress)
    if "error" not in result:
        result["targets"] = _targets(result)
    return result


def _worker_env(rank: int, n: int, port: int, rendezvous: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD_", "TORCHELASTIC_"))}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NCCL_NVLS_ENABLE="0",  # NVLink multicast stays off on shared machines
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    env[RENDEZVOUS_ENV] = rendezvous
    return env


def _launch(n: int, quick: bool, progress: Progress) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cudafut-collectives-") as tmp:
        folder = Path(tmp)
        port = _free_port()
        procs: list[subprocess.Popen[bytes]] = []
        files: list[IO[bytes]] = []
        try:
            for rank in range(n):
                out = open(folder / f"rank{rank}.out", "wb")  # noqa: SIM115 - closed below
                err = open(folder / f"rank{rank}.err", "wb")  # noqa: SIM115 - closed below
                files += [out, err]
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", WORKER, *(["--quick"] if quick else [])],
                        cwd=ROOT,
                        env=_worker_env(rank, n, port, tmp),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,  # its own group: killed with whatever it started
                    )
                )
            result, problem = _follow(procs, folder / "rank0.out", progress)
        finally:
            _kill(procs)
            for f in files:
                f.close()
        codes = {str(rank): p.returncode for rank, p in enumerate(procs)}
        if result is not None and problem is None:
            result["nproc"] = n
            return result
        logs = {str(rank): _tail(folder / f"rank{rank}.err") for rank in range(n)}
        print(f"collectives: {problem}; exit codes {codes}", file=sys.stderr)
        for name, text in logs.items():
            print(f"--- rank {name} stderr (end) ---\n{text}", file=sys.stderr)
        return {"error": problem, "nproc": n, "exit_codes": codes, "stderr_tails": logs, "partial": result}


def _follow(
    procs: list[subprocess.Popen[bytes]], rank0_out: Path, progress: Progress
) -> tuple[dict[str, Any] | None, str | None]:
    """Follow rank 0's stdout until every worker exited, or one failed, or
    time ran out. Returns (rank 0's result or None, the problem or None)."""
    start = time.monotonic()
    deadline = start + TIMEOUT_S
    result: dict[str, Any] | None = None
    offset, pending = 0, b""
    failed_at: float | None = None
    result_at: float | None = None
    problem: str | None = None
    while True:
        with contextlib.suppress(FileNotFoundError):
            with open(rank0_out, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if line.startswith(PROGRESS):
                    progress.step(line[len(PROGRESS) :])
                elif line.startswith(RESULT):
                    try:
                        result = json.loads(line[len(RESULT) :])
                    except ValueError as exc:
                        problem = f"rank 0's result is not JSON: {exc}"
                    result_at = time.monotonic()
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        bad = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad and failed_at is None:
            failed_at = now
            what = f"rank {bad[0]} exited with {codes[bad[0]]} after {now - start:.0f} s"
            if result is None:
                problem = problem or what
            else:  # measured and reported already: a failure in teardown is only told
                print(f"collectives: {what}, after its result", file=sys.stderr)
        if all(code is not None for code in codes):
            if result is None and problem is None:
                problem = "the workers exited without a result"
            return result, problem
        if failed_at is not None and result is None and now > failed_at + FAIL_GRACE_S:
            return result, problem
        if result_at is not None and now > result_at + EXIT_GRACE_S:
            # Measured and reported: a worker stuck in teardown is killed, not waited for.
            stuck = [rank for rank, code in enumerate(codes) if code is None]
            print(f"collectives: ranks {stuck} still running after the result: killed", file=sys.stderr)
            return result, problem
        if now > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            return result, problem or f"timed out after {TIMEOUT_S:.0f} s (ranks {running} still running)"
        time.sleep(0.2)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """To each worker still running (only the processes this section
    started): SIGUSR1 (its faulthandler writes every thread's stack to its
    stderr), then SIGTERM, then SIGKILL to its process group."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGUSR1)
    if alive:
        time.sleep(1.0)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + wait_s
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, end - time.monotonic()))


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return text[-chars:]


# -- targets, Markdown and plots (no CuPy) --------------------------------------------


def _runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs in a result: one, or several keyed by nproc, fewest GPUs first."""
    if "by_nproc" in result:
        return [result["by_nproc"][k] for k in sorted(result["by_nproc"], key=int)]
    return [result]


def _targets(run: dict[str, Any]) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    for op, rows in run["busbw"].items():
        big = [row for row in rows if row["bytes"] >= RATIO_FROM_BYTES]
        if big:
            checks[f"{op}: cudafut / direct >= {MIN_RATIO} from {RATIO_FROM_BYTES // MB} MB"] = all(
                row["ratio"] >= MIN_RATIO for row in big
            )
    if "overlap" in run:
        checks[f"bucket overlap >= {MIN_SPEEDUP}x serial on the GPU"] = (
            run["overlap"]["speedup_vs_serial_gpu"] >= MIN_SPEEDUP
        )
    return checks


def _size(nbytes: int) -> str:
    return f"{nbytes // (1 << 30)} GB" if nbytes >= 1 << 30 else f"{nbytes // MB} MB"


def markdown(result: dict[str, Any]) -> list[str]:
    lines = ["## collectives: NCCL collectives as futures (`cudafut.distributed`)", ""]
    for run in _runs(result):
        lines += _run_markdown(run)
    return lines


def _run_markdown(run: dict[str, Any]) -> list[str]:
    n = run.get("nproc", "?")
    if "skipped" in run:
        return [f"Skipped: {run['skipped']}.", ""]
    if "error" in run:
        return [f"**Failed** on {n} GPUs: {run['error']} (exit codes {run.get('exit_codes')}).", ""]
    lines = [
        f"### {n} GPUs",
        "",
        f"{n} processes, one GPU each ({run.get('gpu', 'GPU')}), NCCL {run.get('nccl', '?')}, "
        f"CuPy {run.get('cupy', '?')}, NCCL_NVLS_ENABLE=0. Bus bandwidth as nccl-tests defines it "
        "(all_reduce: algbw x 2(n-1)/n; all_gather, reduce_scatter: algbw x (n-1)/n; algbw: the full "
        f"buffer's bytes / time), float32, in GB/s; median of {run['repeats']} repetitions, each K "
        "back-to-back calls then one wait (cudafut: `fut.result()` on the last; direct: CuPy's "
        "`NcclCommunicator` on a stream, `stream.synchronize()`), the two interleaved. Ratio: "
        "cudafut / direct.",
        "",
        "| size | K | " + " | ".join(f"{op} cudafut | direct | ratio" for op in run["busbw"]) + " |",
        "|---|---|" + "---|---|---|" * len(run["busbw"]),
    ]
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for op, rows in run["busbw"].items():
        for row in rows:
            by_size.setdefault(row["bytes"], {})[op] = row
    for nbytes in sorted(by_size):
        rows = by_size[nbytes]
        cells = []
        for op in run["busbw"]:
            row = rows.get(op)
            cells.append(
                "- | - | -"
                if row is None
                else f"{row['cudafut_busbw_gbs']:.1f} | {row['direct_busbw_gbs']:.1f} | {row['ratio']:.3f}"
            )
        k = next(iter(rows.values()))["calls"]
        lines.append(f"| {_size(nbytes)} | {k} | " + " | ".join(cells) + " |")
    lines.append("")
    host = run.get("host")
    if host:
        lines += [
            f"Host cost of one all_reduce of {host['bytes'] // 1024} KB, µs (median of {host['batches']} "
            f"batches of {host['calls']} back-to-back calls): enqueue only, and enqueue + completion "
            "(the batch's wall time / calls).",
            "",
            "| path | enqueue µs / call | total µs / call |",
            "|---|---|---|",
            f"| cudafut `dist.all_reduce` | {host['cudafut_enqueue_us']:.1f} | "
            f"{host['cudafut_total_us']:.1f} |",
            f"| direct `comm.allReduce` | {host['direct_enqueue_us']:.1f} | {host['direct_total_us']:.1f} |",
        ]
        if "floor_enqueue_us" in host:
            lines.append(
                "| floor: `comm.allReduce` with the ordering cudafut adds, by hand (CuPy: an event "
                "recorded on the caller's stream, the NCCL stream waits on it, an event after) | "
                f"{host['floor_enqueue_us']:.1f} | {host['floor_total_us']:.1f} |"
            )
        lines += [
            "",
            f"cudafut - direct: {host['cudafut_enqueue_us'] - host['direct_enqueue_us']:+.1f} µs per call "
            f"enqueued ({host['cudafut_enqueue_us'] / host['direct_enqueue_us']:.2f}x).",
            "",
        ]
        if "floor_enqueue_us" in host:
            lines += [
                f"cudafut / the floor: {host['cudafut_enqueue_us'] / host['floor_enqueue_us']:.2f}x "
                f"(the floor / direct: {host['floor_enqueue_us'] / host['direct_enqueue_us']:.2f}x).",
                "",
            ]
    ov = run.get("overlap")
    if ov:
        lines += [
            f"Bucket overlap (`examples/bucket_overlap.py`): {ov['buckets']} buckets of "
            f"{ov['bucket_mb']:.0f} MB; per bucket, all-reduce {ov['allreduce_ms']:.2f} ms and compute "
            f"{ov['compute_ms']:.2f} ms ({ov['rounds']} rounds, calibrated to it); median of "
            f"{ov['repeats']} runs, interleaved; every run's reduced buckets checked.",
            "",
            "| variant | ms | speed-up of overlapped |",
            "|---|---|---|",
        ]
        best = ov["variants"][OVERLAPPED]["seconds_median"]
        for name in (OVERLAPPED, SERIAL_GPU, SERIAL_HOST):
            med = ov["variants"][name]["seconds_median"]
            gain = "" if name == OVERLAPPED else f"{med / best:.2f}x"
            lines.append(f"| {name} | {med * 1e3:.2f} | {gain} |")
        lines += [
            "",
            f"Perfect overlap of these durations would give {ov['ideal_speedup']:.2f}x over the serial "
            "work (one compute and one all-reduce not hidden).",
            "",
        ]
    targets = run.get("targets") or _targets(run)
    if targets:
        lines += ["Targets:", ""]
        lines += [f"- {name}: {'met' if ok else '**missed**'}" for name, ok in targets.items()]
        lines.append("")
    return lines


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    runs = [run for run in _runs(result) if run.get("busbw")]
    if not runs:
        return []
    plt = pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 5), sharey=True, squeeze=False)
    colors = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green"}
    for ax, run in zip(axes[0], runs, strict=True):
        for op, rows in run["busbw"].items():
            xs = [row["bytes"] for row in rows]
            color = colors.get(op)
            ax.plot(xs, [row["cudafut_busbw_gbs"] for row in rows], "-o", color=color, label=f"{op} cudafut")
            ax.plot(xs, [row["direct_busbw_gbs"] for row in rows], "--x", color=color, label=f"{op} direct")
        ax.set_xscale("log", base=2)
        ticks = sorted({row["bytes"] for rows in run["busbw"].values() for row in rows})
        ax.set_xticks(ticks, [_size(b) for b in ticks])
        ax.set_xlabel("buffer size")
        ax.set_title(f"{run['nproc']} GPUs")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth, GB/s")
    axes[0][0].legend(fontsize=8)
    gpu = runs[0].get("gpu") or meta_of(result).get("gpu", "GPU")
    fig.suptitle(f"cudafut.distributed against NCCL called directly ({gpu}, float32)")
    return [save_figure(plt, fig, out / f"{stem}-collectives.png")]
