"""How long the event loop stalls with 200 eager launches in flight: launch() against run_in_executor.

``python -m benchmarks.stalls [--json PATH]``: a CPU-only model of the
``serve`` benchmark's stall measurement (``serve.py``'s ``_stall``): a 1 ms
ticker on an asyncio loop (its lateness is the stall), while 200 tasks each
run one call of a pure-Python "eager model" and await it, through
:func:`cudafut.launch` under cudafut.testing's fake GPU (and as it was
before its launcher threads recorded the caller's events: recorded by the
caller, which releases the GIL once per launch), and through
``loop.run_in_executor`` (the default executor, and one of as many threads
as ``launch()`` has launchers), in rounds alternated so that drift hits all
alike, in one process. Reports max and p99 stall of each way and their
ratio to ``run_in_executor``'s.

The "model" is what the stall depends on, not a network: ``ops`` operators,
each some Python bytecode holding the GIL (``hold_us``) then a C call
releasing it (``release_us``: hashing a buffer, which CPython does without
the GIL, as PyTorch runs an operator), so the threads that run it take and
drop the GIL as an eager PyTorch forward does. Two profiles: ``torch``
(short holds, an operator every few tens of µs: ResNet-50's shape) and
``python`` (a millisecond of Python between releases: heavier host code).
Timings, not counts: a machine's own figures (its CPUs, its Python).

``--model resnet50`` (on a GPU, with torch and torchvision) runs the same
ways with a real eager model instead, examples/service's ResNet-50 fp16
(``Served.answer``, as the ``serve`` benchmark's stall part calls it; the
launcher threads warmed by :func:`cudafut.warm_launchers` first): a few
minutes' check on a GPU of what the CPU model shows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import cudafut
from cudafut import _backend, _launch, _torch, testing

from .support.common import Ticker, stall_ms

#: (ops, hold_us, release_us) per profile.
#: The way where the caller records its streams' events, as launch() did
#: until the launcher thread recorded them.
RECORDED = "launch, the caller records its streams' events"
#: Names results written by earlier versions of this module gave the ways.
_LABELS = {"launch, events recorded by the caller (before)": RECORDED}


PROFILES: dict[str, tuple[int, float, float]] = {
    "torch": (160, 15.0, 15.0),
    "python": (4, 1000.0, 30.0),
}


def _calibrate() -> tuple[float, float]:
    """Seconds per loop step of :func:`_spin` and per byte hashed."""
    n = 200_000
    t0 = time.perf_counter()
    _spin(n)
    spin = (time.perf_counter() - t0) / n
    data = bytes(1 << 20)
    t0 = time.perf_counter()
    for _ in range(20):
        hashlib.sha1(data).digest()
    per_byte = (time.perf_counter() - t0) / (20 << 20)
    return spin, per_byte


def _spin(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i
    return acc


def make_model(ops: int, hold_us: float, release_us: float) -> Callable[[int], int]:
    """A pure-Python stand-in for an eager forward: ``ops`` times, ``hold_us``
    of bytecode with the GIL, then ``release_us`` of hashing without it."""
    spin, per_byte = _calibrate()
    steps = max(1, int(hold_us * 1e-6 / spin))
    size = max(4096, int(release_us * 1e-6 / per_byte))  # CPython hashes >= 2 KiB without the GIL
    data = bytes(size)

    def forward(i: int) -> int:
        acc = i
        for _ in range(ops):
            acc += _spin(steps)
            hashlib.sha1(data).digest()
        return acc

    return forward


def _launch_recorded_by_caller(fn: Callable[[int], int], i: int) -> Any:
    """:func:`cudafut.launch` as it was before the launcher threads recorded
    the caller's events: recorded on the calling thread (``_torch.current_records``,
    which releases the GIL in the native core), the job queued with them."""
    dev = _backend.current.current_device()
    return _launch.enqueue(fn, (i,), {}, dev, _torch.current_records(dev))


async def _stall(
    way: str, launches: int, fn: Callable[[int], int], pool: ThreadPoolExecutor | None
) -> dict[str, Any]:
    """One round: the ticker's lateness (s) while ``launches`` tasks each
    call ``fn`` through ``way`` and await it."""
    loop = asyncio.get_running_loop()

    async def one(i: int) -> Any:
        if way == "launch":
            return await cudafut.launch(fn, i)
        if way == "recorded":
            return await _launch_recorded_by_caller(fn, i)
        return await loop.run_in_executor(pool, fn, i)

    ticker = Ticker()
    ticker.start()
    await asyncio.sleep(0.02)
    ticker.late.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(launches)))
    wall = time.perf_counter() - t0
    await ticker.stop()
    return {"late": ticker.late, "wall": wall}


def _ways(
    threads: int, executor: ThreadPoolExecutor, default: ThreadPoolExecutor
) -> dict[str, tuple[str, ThreadPoolExecutor | None]]:
    """Each way's name: (what :func:`_stall` runs, the executor)."""
    return {
        "launch": ("launch", None),
        RECORDED: ("recorded", None),
        f"run_in_executor ({threads} threads)": ("executor", executor),
        f"run_in_executor (default: {default._max_workers} threads)": ("executor", default),
    }


def _rounds(
    fn: Callable[[int], Any],
    ways: dict[str, tuple[str, ThreadPoolExecutor | None]],
    rounds: int,
    launches: int,
) -> dict[str, Any]:
    """A warm-up round of each way, then ``rounds`` rounds of each, alternated."""
    late: dict[str, list[float]] = {w: [] for w in ways}
    per_round: dict[str, list[float]] = {w: [] for w in ways}
    walls: dict[str, float] = dict.fromkeys(ways, 0.0)
    for how, pool in ways.values():  # threads started, pools filled
        asyncio.run(_stall(how, launches, fn, pool))
    for _ in range(rounds):
        for way, (how, pool) in ways.items():
            got = asyncio.run(_stall(how, launches, fn, pool))
            late[way] += got["late"]
            per_round[way].append(stall_ms(got["late"]))
            walls[way] += got["wall"]
    rows: dict[str, Any] = {}
    for way in ways:
        rows[way] = {
            "max_stall_ms": stall_ms(late[way]),
            "p99_stall_ms": stall_ms(late[way], 99),
            "p50_stall_ms": stall_ms(late[way], 50),
            "round_max_stall_ms": per_round[way],
            # One preemption of the process by another sets the max; the
            # median round's max is what the way itself does.
            "median_round_max_ms": round(float(np.median(per_round[way])), 3),
            "calls_per_s": round(launches * rounds / walls[way], 1),
        }
    base = rows[next(w for w in ways if w.startswith("run_in_executor"))]
    for row in rows.values():
        row["max_vs_executor"] = round(row["max_stall_ms"] / max(base["max_stall_ms"], 1e-3), 2)
        row["median_round_max_vs_executor"] = round(
            row["median_round_max_ms"] / max(base["median_round_max_ms"], 1e-3), 2
        )
        row["p99_vs_executor"] = round(row["p99_stall_ms"] / max(base["p99_stall_ms"], 1e-3), 2)
    return rows


def _meta(gpu: str, rounds: int, launches: int) -> dict[str, Any]:
    return {
        "gpu": gpu,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "producer": "python -m benchmarks.stalls",
        "python": platform.python_version(),
        "cudafut": cudafut.__version__,
        "switch_interval_s": sys.getswitchinterval(),
        "launcher_threads": _launch.launcher_threads(),
        "launches": launches,
        "rounds": rounds,
    }


@contextlib.contextmanager
def _executors(threads: int) -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    """``run_in_executor``'s two pools: ``threads`` threads, and the default
    (what ``loop.run_in_executor(None, ...)`` makes); shut down after."""
    executor = ThreadPoolExecutor(threads)
    default = ThreadPoolExecutor()
    try:
        yield executor, default
    finally:
        executor.shutdown()
        default.shutdown()


def _stalls(
    what: str,
    one_call: float,
    fn: Callable[[int], Any],
    pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor],
    rounds: int,
    launches: int,
) -> dict[str, Any]:
    """One model's entry: what it is, one call's time, and every way's stalls."""
    return {
        "model": {"what": what, "one_call_ms": round(one_call * 1e3, 3)},
        "ways": _rounds(fn, _ways(_launch.launcher_threads(), *pools), rounds, launches),
    }


def measure(
    rounds: int = 6, launches: int = 200, profiles: tuple[str, ...] = tuple(PROFILES)
) -> dict[str, Any]:
    """Every figure of the CPU model (see the module's docstring)."""
    out: dict[str, Any] = {"meta": _meta("no GPU (the fake)", rounds, launches), "stalls": {}}
    with _executors(_launch.launcher_threads()) as pools, testing.fake_cuda() as fake:
        fake.auto_complete = True
        for profile in profiles:
            fn = make_model(*PROFILES[profile])
            t0 = time.perf_counter()
            fn(0)
            one_call = time.perf_counter() - t0
            ops, hold, release = PROFILES[profile]
            what = f"{ops} operators of {hold:g} µs with the GIL and {release:g} µs without"
            out["stalls"][profile] = _stalls(what, one_call, fn, pools, rounds, launches)
    return out


def measure_gpu(model: str, rounds: int = 6, launches: int = 200) -> dict[str, Any]:
    """The same ways with examples/service's ``model`` (fp16, eager) on the GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "service"))
    import models  # type: ignore[import-not-found]

    from cudafut import _backend

    served = models.Served(model)
    out: dict[str, Any] = {
        "meta": _meta(
            _backend.current.cupy().cuda.runtime.getDeviceProperties(0)["name"].decode(), rounds, launches
        )
    }
    cudafut.warm_launchers(served.answer, [0]).result(timeout=120)
    threads = _launch.launcher_threads()
    with _executors(threads) as pools:
        for _ in range(threads):  # the executor's threads warm too
            pools[0].submit(served.answer, [0]).result()
        t0 = time.perf_counter()
        served.torch.cuda.synchronize()
        served.answer([0])
        one_call = time.perf_counter() - t0

        def fn(i: int) -> Any:
            return served.answer([i % 256])

        what = f"examples/service {model} fp16, eager"
        out["stalls"] = {model: _stalls(what, one_call, fn, pools, rounds, launches)}
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    meta = result["meta"]
    lines = [
        "# Loop stalls with eager launches in flight: launch() against run_in_executor",
        "",
        f"{meta['gpu']}, Python {meta['python']}, {meta['cpu_count']} CPUs, switch interval "
        f"{meta['switch_interval_s'] * 1e3:g} ms, {meta['launcher_threads']} launcher threads, "
        f"{meta['launches']} calls in flight, {meta['rounds']} rounds alternated "
        "(`python -m benchmarks.stalls`).",
        "",
    ]
    for profile, group in result["stalls"].items():
        m = group["model"]
        lines += [
            f"## `{profile}`: {m['what']} ({m['one_call_ms']} ms a call)",
            "",
            "| way | max ms | median round's max ms | p99 ms | p50 ms | max / executor "
            "| median round's max / executor | p99 / executor | calls/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for way, row in group["ways"].items():
            way = _LABELS.get(way, way)
            lines.append(
                f"| {way} | {row['max_stall_ms']} | {row['median_round_max_ms']} | {row['p99_stall_ms']} "
                f"| {row['p50_stall_ms']} | {row['max_vs_executor']} | {row['median_round_max_vs_executor']} "
                f"| {row['p99_vs_executor']} | {row['calls_per_s']:,.0f} |"
            )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stalls", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each way, alternated (default 6)")
    parser.add_argument("--launches", type=int, default=200, help="calls in flight (default 200)")
    parser.add_argument(
        "--profile", action="append", choices=tuple(PROFILES), help="CPU model (default: all)"
    )
    parser.add_argument(
        "--model", help="a model of examples/service (resnet50) on the GPU, not the CPU model"
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.model:
        result = measure_gpu(args.model, args.rounds, args.launches)
    else:
        result = measure(args.rounds, args.launches, tuple(args.profile or PROFILES))
    print("\n".join(markdown(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
