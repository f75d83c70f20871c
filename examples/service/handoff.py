"""The GPU process's CPU per request in multiproc.py, front batches against a message per request.

No GPU and no HTTP: a GPU process of multiproc.py with its toy model (on
cudafut's fake GPU) and ``--fronts`` front processes, each driving its
side of the hand-off (multiproc.py's own ``_Link``, or ``_PerRequestLink``
for ``--per-request``) with requests arriving at ``--rate`` per second in
all (Poisson arrivals, open loop: the same load for both ways). Over a
window of ``--seconds`` after ``--warmup``, it reads the GPU process's CPU
time (all its threads: the loop's, and the launcher's that runs the toy
model) and divides it by the requests of the window. The two ways run in
alternated rounds (``--rounds``), in this one call; every answer is checked
against the toy model run on its own. ``--profile`` also runs cProfile on
the GPU process's loop thread over each window and reports its Python
function calls per request and where its time went::

    python examples/service/handoff.py --fronts 2 --rate 2000 --seconds 3 --rounds 3 --profile

Prints a line per run and a summary, and with ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # multiproc, models, ray_serve: next to this file

from models import IMAGES  # noqa: E402 - next to this file

#: The two ways, in the order each round runs them.
WAYS = ("per_request", "batched")


def _gpu(
    conns: list[Any], per_request: bool, max_batch: int, max_delay_s: float, batch_s: float, ready: Any,
    prof: str,
) -> None:  # fmt: skip
    """The GPU process: multiproc.py's with the toy model, each batch
    taking ``batch_s`` more on its launcher thread (a sleep, the GIL
    released: the GPU's time, which the fake GPU does not take); SIGUSR1
    starts profiling its loop's thread, SIGUSR2 stops it and writes ``prof``."""
    import multiproc
    from ray_serve import Toy

    from cudafut.testing import fake_cuda

    toy = Toy()

    def run_batch(indices: Any) -> Any:
        if batch_s > 0:
            time.sleep(batch_s)
        return toy.answer(indices)

    profiler = cProfile.Profile(time.thread_time)  # CPU of the loop's thread, not wall time
    if prof:
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())

        def stop(*_: object) -> None:
            profiler.disable()
            profiler.dump_stats(prof)

        signal.signal(signal.SIGUSR2, stop)
    with fake_cuda(auto_complete=True):
        multiproc._run_gpu_loop(  # noqa: SLF001 - gpu_main's, with this run_batch
            run_batch, conns, max_batch, max_delay_s, ready, True, per_request, 2
        )


def _front(
    conn: Any, way: str, max_batch: int, delay_s: float, rate: float, start: float,
    window: tuple[float, float], seed: int, out: Any,
) -> None:  # fmt: skip
    """A front's side of the hand-off, open loop at ``rate``; puts
    ``(requests in the window, answered, wrong, errors)`` on ``out``."""
    import multiproc
    from ray_serve import Toy

    expected = Toy().answer(list(range(IMAGES)))
    counts = {"window": 0, "answered": 0, "wrong": 0, "errors": 0}

    async def one(link: Any, k: int) -> None:
        try:
            row = await link.ask(k)
        except Exception:  # noqa: BLE001 - counted
            counts["errors"] += 1
            return
        counts["answered"] += 1
        if not np.allclose(row, expected[k], rtol=1e-5, atol=1e-5):
            counts["wrong"] += 1

    async def drive() -> None:
        loop = asyncio.get_running_loop()
        conns = [conn]
        if way == "per_request":
            link: Any = multiproc._PerRequestLink(loop, conns)  # noqa: SLF001 - the example's own parts
        else:
            link = multiproc._Link(loop, conns, max_batch, delay_s)  # noqa: SLF001
        rng = random.Random(seed)
        tasks = set()
        await asyncio.sleep(max(0.0, start - time.time()))
        due, end = time.time(), window[1]
        while True:
            now = time.time()
            if now >= end:
                break
            while due <= now:
                if window[0] <= due < end:
                    counts["window"] += 1
                task = loop.create_task(one(link, rng.randrange(IMAGES)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                due += rng.expovariate(rate)
            await asyncio.sleep(min(max(0.0, due - time.time()), 0.001))
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        link.close()

    asyncio.run(drive())
    conn.close()
    out.put(counts)


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user and system, all threads) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(
    way: str, fronts: int, rate: float, seconds: float, warmup: float, max_batch: int,
    max_delay_s: float, front_delay_s: float, batch_s: float, profile: bool, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """One run of ``way``: the GPU process's CPU per request over the window."""
    ctx = mp.get_context("spawn")
    per_request = way == "per_request"
    pipes = [ctx.Pipe() for _ in range(fronts)]
    ready, out = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        prof = str(Path(tmp) / "gpu.prof") if profile else ""
        gpu_args = ([b for _, b in pipes], per_request, max_batch, max_delay_s, batch_s, ready, prof)
        gpu = ctx.Process(target=_gpu, args=gpu_args)
        gpu.start()
        pid = gpu.pid
        assert pid is not None
        if not ready.wait(120):
            gpu.kill()
            raise SystemExit("handoff.py: the GPU process was not ready in 120 s")
        start = time.time() + 1.5  # the fronts' imports
        window = (start + warmup, start + warmup + seconds)
        procs = [
            ctx.Process(
                target=_front,
                args=(a, way, max_batch, front_delay_s, rate / fronts, start, window, seed + i, out),
            )
            for i, (a, _) in enumerate(pipes)
        ]
        for p in procs:
            p.start()
        for a, b in pipes:
            a.close()
            b.close()
        time.sleep(max(0.0, window[0] - time.time()))
        cpu0 = _cpu_s(pid)
        if profile:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(max(0.0, window[1] - time.time()))
        cpu1 = _cpu_s(pid)
        if profile:
            os.kill(pid, signal.SIGUSR2)
        counts = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        gpu.join(60)
        if gpu.exitcode is None:
            gpu.kill()
        total = {key: sum(c[key] for c in counts) for key in counts[0]}
        n = total["window"]
        result: dict[str, Any] = {
            "way": way,
            "requests": n,
            "answered": total["answered"],
            "wrong": total["wrong"],
            "errors": total["errors"],
            "gpu_process_cpu": round((cpu1 - cpu0) / seconds, 3),
            "cpu_us_per_request": round(1e6 * (cpu1 - cpu0) / max(n, 1), 1),
        }
        if profile and Path(prof).exists():
            stats = pstats.Stats(prof)
            result["loop_calls_per_request"] = round(stats.total_calls / max(n, 1), 1)  # type: ignore[attr-defined]
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:8]  # type: ignore[attr-defined]
            result["loop_us_per_request"] = round(1e6 * stats.total_tt / max(n, 1), 1)  # type: ignore[attr-defined]
            result["loop_top"] = [
                {
                    "function": f"{Path(f).name}:{line}({name})",
                    "calls_per_request": round(v[1] / max(n, 1), 2),
                    "own_us_per_request": round(1e6 * v[2] / max(n, 1), 1),
                }
                for (f, line, name), v in rows
            ]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2000.0, help="requests per second, all fronts together")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--front-delay-ms", type=float, default=0.0, help="multiproc.py's --front-delay-ms")
    parser.add_argument(
        "--batch-ms", type=float, default=0.0, help="the GPU time of a batch (a sleep on its launcher)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the GPU process's loop thread")
    parser.add_argument("--json", help="write the runs and the summary here")
    args = parser.parse_args(argv)
    runs = []
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:  # alternated, and each first in turn
            one = run_once(way, args.fronts, args.rate, args.seconds, args.warmup, args.max_batch,
                           args.max_delay_ms / 1e3, args.front_delay_ms / 1e3, args.batch_ms / 1e3,
                           args.profile, seed=1000 * r)  # fmt: skip
            runs.append(one)
            print(json.dumps({k: v for k, v in one.items() if k != "loop_top"}), flush=True)
    keys = ("rate", "fronts", "seconds", "batch_ms", "max_delay_ms", "front_delay_ms")
    summary: dict[str, Any] = {k: getattr(args, k) for k in keys}
    for way in WAYS:
        mine = [one for one in runs if one["way"] == way]
        summary[way] = {
            "cpu_us_per_request_median": statistics.median(one["cpu_us_per_request"] for one in mine),
            "cpu_us_per_request": [one["cpu_us_per_request"] for one in mine],
            "wrong": sum(one["wrong"] for one in mine),
            "errors": sum(one["errors"] for one in mine),
        }
        if args.profile:
            for key in ("loop_calls_per_request", "loop_us_per_request"):
                summary[way][key] = [one.get(key) for one in mine]
            summary[way]["loop_top_last_run"] = mine[-1].get("loop_top")
    medians = [summary[way]["cpu_us_per_request_median"] for way in WAYS]
    summary["ratio_batched_to_per_request"] = round(medians[1] / medians[0], 3)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    if any(summary[way]["wrong"] or summary[way]["errors"] for way in WAYS):
        sys.exit("handoff.py: wrong answers or errors (above)")


if __name__ == "__main__":
    main()
