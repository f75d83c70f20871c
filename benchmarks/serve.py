"""Section ``serve``: a real torchvision model served from asyncio, every way.

Two parts:

- ``launch``: what :func:`cudafut.launch` costs the calling thread (p50,
  p99 of single calls, with up to 1,000 launches in flight), next to
  ``submit()``, ``record()`` and ``run_in_executor``'s submission in the
  same run; and how long an asyncio loop stalls (a 1 ms ticker's lateness)
  while 1,000 launches of a trivial function, then 200 of a ResNet-50
  forward, are in flight, against ``run_in_executor`` on as many threads,
  the two alternated round by round (10 and 8 warm rounds each after a
  cold one): the first round (cold launcher threads) apart from the later
  ones, whose max and p99 are judged with the median of their rounds'
  maxima beside them and every garbage collection of 1 ms or more in them;
  and again on new launcher threads warmed first by
  :func:`cudafut.warm_launchers`.
- ``models``: examples/service/compare.py for ResNet-50 and ViT-B/16 in
  fp16 (random weights): each handler of examples/service/server.py and
  LitServe, the server in its own process, 64 closed-loop clients, then
  open loop (Poisson arrivals) at half the no-GPU ceiling (batching
  servers) and half ``run_in_executor``'s maximum (unbatched ones); every
  answer checked against the model run eagerly on one image. The no-GPU
  ceiling runs again after the other handlers (it has been seen to rise
  within a run), and the targets take the higher of its two runs. Also
  the launcher thread count (1, 2, 4) for ``launch`` and ``batch_graph``,
  and open loop at a fixed rate (``CUDAFUT_BENCH_SERVE_RATES``,
  space-separated req/s; 4,000 unless set, ``""`` for none) for ``nogpu``
  and ``batch_graph``. Every row reports the server's garbage collections
  of 5 ms or more in its window (examples/service/pauses.py): how many,
  the longest, and the longest itself (generation, objects tracked).
  ``batch_floor`` is ``batch_graph``'s batching and graph replays written
  by hand, without cudafut on the loop (server.py): the floor beside it,
  closed and open loop. ``nogpu``, ``batch_graph`` and ``batch_floor`` also
  run closed loop with :data:`MORE_CLIENTS` clients: the one-process
  capacity, which 64 clients do not reach for the GPU modes.

- ``processes`` (with ``CUDAFUT_BENCH_SERVE_DEVICES``, e.g. ``"1 2 4"``):
  examples/service/multiproc.py for ResNet-50 on each number of GPUs the
  machine has, 8 front processes and 256 closed-loop clients per GPU (16
  load processes at most), beside LitServe with as many API servers and a
  worker per GPU, and the GPU's own limit measured in the same run; with 1
  GPU also the fronts without GPU work, and open loop. With that variable
  set, the section runs this part alone.

``CUDAFUT_BENCH_SERVE_MODELS`` and ``CUDAFUT_BENCH_SERVE_MODES``
(space-separated) restrict the models and handlers, to split the section
over runs (one JSON each); ``launch()``'s own figures and the thread counts
run only in a run of every handler with ResNet-50, and
``CUDAFUT_BENCH_SERVE_PARTS=launch`` runs ``launch()``'s figures alone
(about a minute). About 4 minutes per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .support.common import Progress, Ticker, service_module, stall_ms

NAME = "serve"

ALL_MODELS = ("resnet50", "vit_b_16")
THREADS = (1, 4)  # besides the default (2)
#: Closed loop with more clients (nogpu, batch_graph, batch_floor): the
#: one-process capacity; 64 clients are too few once a request waits for its
#: batch and the GPU (Little's law), for the GPU modes, not for nogpu.
MORE_CLIENTS = (256,)


def _models() -> tuple[str, ...]:
    names = os.environ.get("CUDAFUT_BENCH_SERVE_MODELS", "").split()
    return tuple(n for n in ALL_MODELS if n in names) if names else ALL_MODELS


def _modes() -> tuple[str, ...] | None:
    """The handlers to run (``CUDAFUT_BENCH_SERVE_MODES``), None for all."""
    names = os.environ.get("CUDAFUT_BENCH_SERVE_MODES", "").split()
    return tuple(names) or None


#: The fixed open-loop rate(s) unless CUDAFUT_BENCH_SERVE_RATES says otherwise (req/s).
RATES = (4000.0,)


def _rates() -> tuple[float, ...]:
    """Fixed open-loop rates (``CUDAFUT_BENCH_SERVE_RATES``; :data:`RATES` unset)."""
    text = os.environ.get("CUDAFUT_BENCH_SERVE_RATES")
    if text is None:
        return RATES
    try:
        rates = tuple(float(r) for r in text.split())
    except ValueError:
        rates = (0.0,)
    if any(r <= 0 for r in rates):
        raise ValueError(f"CUDAFUT_BENCH_SERVE_RATES must be request rates such as '4000', not {text!r}")
    return rates


def _launch_only() -> bool:
    """Whether this run measures ``launch()``'s own figures alone
    (``CUDAFUT_BENCH_SERVE_PARTS=launch``)."""
    return os.environ.get("CUDAFUT_BENCH_SERVE_PARTS", "").split() == ["launch"]


def _whole() -> bool:
    """Whether this run measures launch() itself and the thread counts:
    once, with ResNet-50 and every handler."""
    return "resnet50" in _models() and _modes() is None


def _devices() -> tuple[int, ...]:
    """GPU counts for the ``processes`` part (``CUDAFUT_BENCH_SERVE_DEVICES``)."""
    text = os.environ.get("CUDAFUT_BENCH_SERVE_DEVICES", "")
    try:
        counts = tuple(int(n) for n in text.split())
    except ValueError:
        counts = (0,)
    if any(n < 1 for n in counts):
        raise ValueError(f"CUDAFUT_BENCH_SERVE_DEVICES must be GPU counts such as '1 2 4', not {text!r}")
    return counts


#: Front processes and closed-loop clients per GPU in the ``processes`` part.
FRONTS_PER_GPU = 8
CLIENTS_PER_GPU = 256
#: The ``processes`` part's wait policy in every process of the service
#: (multiproc.py's ``--wait-policy``, its default): timed polls measured
#: better than CUDA notices there (docs/processes.md), and a run records it.
PROCESSES_WAIT_POLICY = "polls"


def _processes_part(quick: bool, progress: Progress) -> dict[str, Any]:
    from cudafut import _backend

    compare = _compare_module()
    have = _backend.current.device_count()
    out: dict[str, Any] = {}
    for n in _devices():
        if n > have:
            progress.step(f"serve: processes: {n} GPUs asked for, {have} here; skipped")
            continue
        first = not out
        modes = ("nogpu_fronts", "fronts", "litserve_fronts") if first else ("fronts", "litserve_fronts")
        out[str(n)] = compare.compare(
            ("resnet50",),
            modes,
            seconds=2.0 if quick else 5.0,
            warmup=0.5 if quick else 1.0,
            open_loop=first,
            clients=CLIENTS_PER_GPU * n,
            procs=min(8 * n, 16),
            fronts=FRONTS_PER_GPU * n,
            devices=n,
            step=progress.step,
            multiproc_args=("--wait-policy", PROCESSES_WAIT_POLICY),
        )
        out[str(n)]["wait_policy"] = PROCESSES_WAIT_POLICY
    return out


def _compare_module() -> Any:
    return service_module("compare")


def steps(quick: bool) -> int:
    if _launch_only():
        return 5
    n_models = len(_models())
    # closed rows + open rows + fixed-rate rows + capacity rows
    per_model = 10 + 7 + 2 * len(_rates()) + 3 * len(MORE_CLIENTS)
    if _modes() is not None:
        per_model = len(_modes() or ()) + 4 + 2 * len(_rates()) + 3 * len(MORE_CLIENTS)
    return n_models * per_model + (6 + 2 * len(THREADS) if _whole() else 0)


def _q(samples: list[float]) -> dict[str, float]:
    arr = np.asarray(samples) * 1e6
    return {
        "p50_us": round(float(np.percentile(arr, 50)), 2),
        "p99_us": round(float(np.percentile(arr, 99)), 2),
    }


def _caller_costs(quick: bool) -> dict[str, Any]:
    """Calling-thread time of one call, in flight batches of 1,000."""
    import cudafut
    from cudafut import _backend

    cp = _backend.current.cupy()
    x = cp.ones(16, dtype=cp.float32)
    cp.cuda.Device().synchronize()

    def fn() -> Any:
        return x + 1

    rounds = 5 if quick else 20
    pool = ThreadPoolExecutor(4)
    ways: dict[str, Any] = {
        "launch": lambda: cudafut.launch(fn),
        "submit": lambda: cudafut.submit(fn),
        "record": lambda: cudafut.record(x),
        "executor_submit": lambda: pool.submit(fn),
    }
    out: dict[str, Any] = {}
    samples: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):  # interleaved: drift hits all alike
        for name, call in ways.items():
            held = []
            for _ in range(1000):
                t0 = time.perf_counter()
                held.append(call())
                samples[name].append(time.perf_counter() - t0)
            for h in held:
                h.result()
    for name in ways:
        out[name] = _q(samples[name])
    pool.shutdown()
    return out


#: Warm rounds of each way after its cold first one (``--quick``: 2 each):
#: the ways alternate round by round, so a garbage collection or a
#: preemption lands in either; one round's max is noise (the switch interval
#: is 5 ms), the median of the rounds' maxima is not.
STALL_WARM_ROUNDS = {"trivial": 10, "resnet50": 8}
#: Garbage collections at least this long are recorded in each stall round (ms).
STALL_GC_MS = 1.0
#: Whether the later stall rounds run with what the first (cold) round left
#: frozen (``gc.freeze()``, as the serving recipe does before serving):
#: unfrozen, a full collection of about 150 ms over PyTorch's objects landed
#: in one way's rounds or the other's, and set that way's max.
STALL_FREEZE = True


def _warm_rounds(quick: bool) -> dict[str, int]:
    return {kind: 2 if quick else n for kind, n in STALL_WARM_ROUNDS.items()}


class AndWait:
    """A way of :func:`_stall`: ``run_in_executor`` on ``pool``, then an
    ``await`` of the GPU work the call enqueued (an event recorded on the
    legacy default stream, the stream of the executor's threads): the
    completion that the loop also learns for ``launch()``, which
    ``run_in_executor`` alone does not wait for."""

    def __init__(self, pool: ThreadPoolExecutor, stream: Any = None) -> None:
        self.pool = pool
        self.stream = stream  # None: CuPy's legacy default stream, found at first use

    def gpu_stream(self) -> Any:
        if self.stream is None:
            from cudafut import _backend

            self.stream = _backend.current.cupy().cuda.Stream.null
        return self.stream


#: The name of the :class:`AndWait` way in the results.
THEN_AWAIT = "run_in_executor_then_await"


def _round_order(names: list[str], r: int) -> list[str]:
    """The ways' order in round ``r``: as given in even rounds, reversed in
    odd ones (launch, executor, executor, launch, ...): neither way always
    follows the other."""
    return names if r % 2 == 0 else names[::-1]


async def _stall(
    launches: int,
    warm_rounds: int,
    make: Any,
    ways: Mapping[str, ThreadPoolExecutor | AndWait | None],
    prepare: Any = None,
) -> dict[str, dict[str, Any]]:
    """A 1 ms ticker's lateness while ``launches`` tasks each launch and
    await one call (``make(round, i)`` gives ``launch()``'s arguments), for
    each way of ``ways``: ``None`` awaits ``cudafut.launch``, an executor
    awaits ``loop.run_in_executor(executor, ...)`` of the same call (the
    host part only: no wait for the GPU), an :class:`AndWait` the same and
    then the call's GPU work. One cold round of each way, then
    ``warm_rounds`` warm ones, the ways alternating round by round on one
    loop (:func:`_round_order`). The first round is reported apart
    (``cold_*``: the first model call on a thread or stream costs PyTorch
    its per-thread and per-stream set-up), the later ones as ``warm_*``
    (max and p99 over all of them, and the median of their maxima), and
    all of them together as before (``max_stall_ms``, ``p99_stall_ms``).
    Every garbage collection of :data:`STALL_GC_MS` or more within a round
    is recorded with its round (examples/service/pauses.py's recorder,
    without its count of tracked objects, which would stall the loop
    itself). ``prepare()``, if given, returns a future awaited first, under
    the ticker too (``prepare_*``: ``cudafut.warm_launchers``), reported
    with the first way."""
    import cudafut

    loop = asyncio.get_running_loop()
    ticker = Ticker()
    late = ticker.late

    async def one(way: ThreadPoolExecutor | AndWait | None, r: int, i: int) -> None:
        if way is None:
            await cudafut.launch(*make(r, i))
        elif isinstance(way, AndWait):
            await loop.run_in_executor(way.pool, *make(r, i))
            await cudafut.record(None, stream=way.gpu_stream())
        else:
            await loop.run_in_executor(way, *make(r, i))

    names = list(ways)
    by_round: dict[str, list[list[float]]] = {n: [] for n in names}
    gcs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    walls = dict.fromkeys(names, 0.0)
    recorder = service_module("pauses").PauseRecorder(STALL_GC_MS, count_tracked=False)
    ticker.start()
    await asyncio.sleep(0.05)
    idle = list(late)
    late.clear()
    first: dict[str, float] = {}
    with contextlib.ExitStack() as unfreeze, recorder:
        if STALL_FREEZE:
            # Everything, whenever the rounds end (a benchmark process freezes
            # nothing else): the next part starts unfrozen, as this one did.
            unfreeze.callback(gc.unfreeze)
        if prepare is not None:
            t0 = time.perf_counter()
            await prepare()
            first["prepare_s"] = round(time.perf_counter() - t0, 3)
            first["prepare_max_stall_ms"] = round(max(late, default=0.0) * 1e3, 3)
        for r in range(1 + warm_rounds):
            if r == 1 and STALL_FREEZE:
                # The serving recipe (docs/serving.md): what start-up and the
                # cold rounds left is frozen, so a full collection does not
                # walk PyTorch's objects in whichever way's round it lands.
                service_module("pauses").freeze_warm_objects()
                # The freeze held the loop (a full collection, then a walk of
                # the frozen objects): the ticker's late tick lands here, not
                # in the next round, which clears what came before it.
                await asyncio.sleep(0.01)
            for name in _round_order(names, r):
                late.clear()
                recorder.pauses.clear()
                t0 = time.perf_counter()
                await asyncio.gather(*(one(ways[name], r, i) for i in range(launches)))
                walls[name] += time.perf_counter() - t0
                by_round[name].append(list(late))
                gcs[name] += [
                    {"round": r, "ms": p["ms"], "generation": p["generation"], "collected": p["collected"]}
                    for p in recorder.pauses
                ]
    await ticker.stop()
    return {
        name: {
            **_stall_figures(by_round[name], gcs[name], idle, launches / walls[name] * (1 + warm_rounds)),
            **(first if name == names[0] else {}),
        }
        for name in names
    }


def _stall_figures(
    by_round: list[list[float]], gcs: list[dict[str, Any]], idle: list[float], per_s: float
) -> dict[str, Any]:
    """One way's figures from its rounds' lateness samples (the first round
    cold) and the collections recorded in them (see :func:`_stall`)."""
    every = [x for lates in by_round for x in lates]
    warm = [x for lates in by_round[1:] for x in lates]
    ms = stall_ms
    maxima = [ms(lates) for lates in by_round]
    p99s = [ms(lates, 99) for lates in by_round]
    warm_gcs = [g for g in gcs if g["round"] > 0]
    # The warm round that holds the longest stall, and the longest collection in it.
    worst = 1 + maxima[1:].index(max(maxima[1:])) if len(maxima) > 1 else 0
    in_worst = [g["ms"] for g in warm_gcs if g["round"] == worst]
    generations = [0, 0, 0]
    for g in warm_gcs:
        if 0 <= g["generation"] < 3:
            generations[g["generation"]] += 1
    return {
        "max_stall_ms": ms(every),
        "p99_stall_ms": ms(every, 99),
        "cold_max_stall_ms": ms(by_round[0]),
        "cold_p99_stall_ms": ms(by_round[0], 99),
        "warm_max_stall_ms": ms(warm),
        "warm_p99_stall_ms": ms(warm, 99),
        "warm_rounds": len(by_round) - 1,
        "round_max_stall_ms": maxima,
        "warm_median_round_max_ms": round(float(np.median(maxima[1:])), 3) if len(maxima) > 1 else 0.0,
        # Each round's p99 and their median over the warm rounds: how far a
        # p99 moves from round to round, beside the difference between ways.
        "round_p99_stall_ms": p99s,
        "warm_median_round_p99_ms": round(float(np.median(p99s[1:])), 3) if len(p99s) > 1 else 0.0,
        "idle_max_stall_ms": ms(idle),
        "launches_per_s": round(per_s, 1),
        "gc_over_ms": STALL_GC_MS,
        "gc": gcs,
        "warm_gc": {
            "count": len(warm_gcs),
            "longest_ms": max((g["ms"] for g in warm_gcs), default=None),
            "total_ms": round(sum(g["ms"] for g in warm_gcs), 3),
            "by_generation": generations,
            "in_longest_stall_round_ms": max(in_worst, default=None),
        },
    }


def _stalls(quick: bool, make_trivial: Any, make_model: Any, warm_model: Any) -> dict[str, Any]:
    """:func:`_stall` for trivial and model launches, through ``launch()``
    and, as the baseline, ``run_in_executor`` on as many threads, round by
    round; then the model again through new launcher threads warmed first by
    ``cudafut.warm_launchers(*warm_model)`` (``launch_warmed``)."""
    import cudafut
    from cudafut import _backend, _launch

    warm = _warm_rounds(quick)
    pool = ThreadPoolExecutor(_launch.launcher_threads())
    ways: dict[str, ThreadPoolExecutor | AndWait | None] = {
        "launch": None,
        "run_in_executor": pool,
        THEN_AWAIT: AndWait(pool),
    }
    try:
        trivial = asyncio.run(_stall(1000, warm["trivial"], make_trivial, ways))
        model = asyncio.run(_stall(200, warm["resnet50"], make_model, ways))
    finally:
        pool.shutdown()
    out: dict[str, Any] = {way: {"trivial": trivial[way], "resnet50": model[way]} for way in ways}
    device = _backend.current.current_device()
    _backend.current.cupy().cuda.Device(device).synchronize()
    if not _launch.stop(device):  # new threads and streams, as cold as the first ones were
        raise RuntimeError("the launcher threads did not end")
    warmed = _stall(
        200, warm["resnet50"], make_model, {"launch": None}, lambda: cudafut.warm_launchers(*warm_model)
    )
    out["launch_warmed"] = {"resnet50": asyncio.run(warmed)["launch"]}
    return out


def _stall_settings(quick: bool) -> dict[str, Any]:
    """What the stall figures depend on beside the code: the interpreter's
    switch interval (how long a thread that wants the GIL waits before
    asking its holder to drop it: the loop thread's wait behind a launcher
    or executor thread), the launcher threads, the rounds."""
    from cudafut import _launch

    return {
        "switch_interval_s": sys.getswitchinterval(),
        "launcher_threads": _launch.launcher_threads(),
        "warm_rounds": _warm_rounds(quick),
        "alternated": True,
        "gc_over_ms": STALL_GC_MS,
        "gc_frozen_after_first_round": STALL_FREEZE,
    }


def _launch_part(quick: bool, progress: Progress) -> dict[str, Any]:
    from cudafut import _backend

    out: dict[str, Any] = {"caller": _caller_costs(quick)}
    c = out["caller"]
    progress.step(
        f"serve: launch() costs the caller {c['launch']['p50_us']} us p50, {c['launch']['p99_us']} us p99 "
        f"(submit {c['submit']['p50_us']}, executor {c['executor_submit']['p50_us']})"
    )
    cp = _backend.current.cupy()
    x = cp.ones(16, dtype=cp.float32)
    served = service_module("models").Served("resnet50")
    out["stall_settings"] = _stall_settings(quick)
    out["stalls"] = _stalls(
        quick,
        lambda r, i: (lambda: x + 1,),
        lambda r, i: (served.answer, [i % 256]),
        (served.answer, [0]),
    )
    for key, s in out["stalls"].items():
        trivial = f"1,000 trivial calls {s['trivial']['max_stall_ms']} ms, " if "trivial" in s else ""
        m = s["resnet50"]
        progress.step(
            f"serve: {key}: loop stall with {trivial}200 ResNet-50 calls {m['cold_max_stall_ms']} ms "
            f"in the first round, {m['warm_max_stall_ms']} ms after (p99 {m['warm_p99_stall_ms']} ms, "
            f"median round's max {m['warm_median_round_max_ms']} ms, {m['warm_gc']['count']} collections "
            f"of {STALL_GC_MS:g} ms or more)"
        )
    return out


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _devices():  # this part alone: the others are a run of their own
        out["processes"] = _processes_part(quick, progress)
        return out
    if _launch_only():  # launch()'s own figures alone
        out["launch"] = _launch_part(quick, progress)
        return out
    if _whole():
        out["launch"] = _launch_part(quick, progress)
    compare = _compare_module()
    out["models"] = compare.compare(
        _models(),
        _modes() or compare.MODES,
        seconds=2.0 if quick else 5.0,
        warmup=0.5 if quick else 1.0,
        open_loop=True,
        open_rates=_rates(),
        more_clients=MORE_CLIENTS,
        threads=THREADS if _whole() else (),
        step=progress.step,
    )
    return out


def _goal(value: float | None, target: float, *, at_least: bool, unit: str = "") -> str:
    """A goal's target and whether this run met it: ``target >= 5: met``."""
    if value is None:
        return f"target {'>=' if at_least else '<='} {target:g}{unit}: not measured"
    met = value >= target if at_least else value <= target
    return f"target {'>=' if at_least else '<='} {target:g}{unit}: {'met' if met else '**missed**'}"


def _targets(result: dict[str, Any]) -> list[str]:
    lines = ["The project's goals, checked on this run:", ""]
    for model, m in result.get("models", {}).items():
        closed = m["closed"]
        best = closed.get("batch_graph")
        if best and "nogpu" in closed:
            ceiling = first = closed["nogpu"]["rps"]
            which = " ("  # a run from before the ceiling was measured twice
            again = m.get("again", {}).get("nogpu")
            if again is not None:  # against the higher of the two: the ceiling moves within a run
                ceiling = max(first, again["rps"])
                which = (
                    f", the higher of its two runs ({first:,.0f} req/s first, "
                    f"{again['rps']:,.0f} after the others; "
                )
            lines.append(
                f"- {model}: launch + Batcher + graphs at {best['rps'] / ceiling:.2f}x the no-GPU "
                f"ceiling{which}{_goal(best['rps'] / ceiling, 0.75, at_least=True)})"
            )
        for n, group in m.get("capacity", {}).items():
            graph, floor, base = (group.get(k) for k in ("batch_graph", "batch_floor", "nogpu"))
            if graph is None:
                continue
            against = (
                [f"the hand-written floor {floor['rps']:,.0f} ({graph['rps'] / floor['rps']:.2f}x)"]
                if floor
                else []
            )
            against += [f"no GPU {base['rps']:,.0f} ({graph['rps'] / base['rps']:.2f}x)"] if base else []
            lines.append(
                f"- {model}, closed loop with {n} clients: batch_graph {graph['rps']:,.0f} req/s, against "
                + (", ".join(against) or "nothing")
            )
        if best and "litserve" in closed:
            ratio = best["rps"] / closed["litserve"]["rps"]
            lines.append(f"- {model}: {ratio:.1f}x LitServe ({_goal(ratio, 5, at_least=True)})")
        if "launch" in closed and "executor" in closed:
            ratio = closed["launch"]["rps"] / closed["executor"]["rps"]
            lines.append(
                f"- {model}: unbatched launch {ratio:.2f}x run_in_executor "
                f"({_goal(ratio, 0.95, at_least=True)})"
            )
        if "launch_graph" in closed and "sync" in closed:
            ratio = closed["launch_graph"]["rps"] / closed["sync"]["rps"]
            lines.append(
                f"- {model}: launch + graph {ratio:.1f}x the synchronising handler "
                f"({_goal(ratio, 4, at_least=True)})"
            )
        for group in m["open"].values():
            base = group.get("nogpu")
            for mode in ("batch_graph", "launch"):
                r = group.get(mode)
                if r is None or base is None:
                    continue
                dh = _delta(r["health"]["p99_ms"], base["health"]["p99_ms"])
                dp = _delta(r["p99_ms"], base["p99_ms"])
                request = f", request p99 {_signed(dp)} ({_goal(dp, 10, at_least=False, unit=' ms')})"
                lines.append(
                    f"- {model}, open loop at {group['rate']:,.0f}/s: {mode} /health p99 over no-GPU "
                    f"{_signed(dh)} ({_goal(dh, 1, at_least=False, unit=' ms')})"
                    + (request if mode == "batch_graph" else "")
                )
            lines += _pause_targets(model, group)
    lines += _process_targets(result.get("processes") or {})
    launch = result.get("launch")
    if launch:
        c = launch["caller"]["launch"]
        lines.append(
            f"- launch() on the calling thread: p50 {c['p50_us']} us "
            f"({_goal(c['p50_us'], 3, at_least=False, unit=' us')}), "
            f"p99 {c['p99_us']} us ({_goal(c['p99_us'], 20, at_least=False, unit=' us')}; issue 46's targets)"
        )
        stalls = launch["stalls"]
        for kind, s in stalls["launch"].items():
            base = stalls["run_in_executor"][kind]
            if "warm_max_stall_ms" not in s:  # a run before the rounds were told apart
                lines.append(
                    f"- loop stall, {kind} launches in flight: max {s['max_stall_ms']} ms "
                    f"({_goal(s['max_stall_ms'], 2, at_least=False, unit=' ms')}; "
                    f"run_in_executor {base['max_stall_ms']} ms)"
                )
                continue
            lines.append(
                f"- loop stall, {kind} launches in flight: first round max {s['cold_max_stall_ms']} ms"
                f"{_cold_gc_text(s)}, "
                f"later rounds max {s['warm_max_stall_ms']} ms "
                f"({_goal(s['warm_max_stall_ms'], 2, at_least=False, unit=' ms')}; run_in_executor "
                f"{base['cold_max_stall_ms']}{_cold_gc_text(base)} and {base['warm_max_stall_ms']} ms)"
            )
            lines.append(
                f"- loop stall, {kind} launches in flight, later rounds against run_in_executor: max "
                f"{s['warm_max_stall_ms']} / {base['warm_max_stall_ms']} ms "
                f"({_ratio(s['warm_max_stall_ms'], base['warm_max_stall_ms'])}), p99 "
                f"{s['warm_p99_stall_ms']} / {base['warm_p99_stall_ms']} ms "
                f"({_ratio(s['warm_p99_stall_ms'], base['warm_p99_stall_ms'])}) (target: at most 1x each: "
                + (
                    "met)"
                    if s["warm_max_stall_ms"] <= base["warm_max_stall_ms"]
                    and s["warm_p99_stall_ms"] <= base["warm_p99_stall_ms"]
                    else "**missed**)"
                )
                + _rounds_beside(s, base)
            )
            waited = stalls.get(THEN_AWAIT, {}).get(kind)
            if waited is not None:  # runs from before this way have none
                lines.append(
                    f"- loop stall, {kind} launches in flight, later rounds against run_in_executor followed "
                    f"by an await of the call's GPU work (what the loop also learns for launch()): max "
                    f"{s['warm_max_stall_ms']} / {waited['warm_max_stall_ms']} ms "
                    f"({_ratio(s['warm_max_stall_ms'], waited['warm_max_stall_ms'])}), p99 "
                    f"{s['warm_p99_stall_ms']} / {waited['warm_p99_stall_ms']} ms "
                    f"({_ratio(s['warm_p99_stall_ms'], waited['warm_p99_stall_ms'])}); median round's p99 "
                    f"{s['warm_median_round_p99_ms']} / {waited['warm_median_round_p99_ms']} ms"
                )
        for kind, s in stalls.get("launch_warmed", {}).items():
            worst = max(s["cold_max_stall_ms"], s["warm_max_stall_ms"])
            median = (
                f", median round's max {s['warm_median_round_max_ms']} ms"
                if "warm_median_round_max_ms" in s
                else ""
            )
            lines.append(
                f"- loop stall, {kind} launches after warm_launchers(): first round max "
                f"{s['cold_max_stall_ms']} ms, later rounds {s['warm_max_stall_ms']} ms{median} "
                f"({_goal(worst, 2, at_least=False, unit=' ms')}); "
                f"warm_launchers() itself {s['prepare_s']} s, loop stall {s['prepare_max_stall_ms']} ms"
            )
    return [*lines, ""]


def _rounds_beside(s: dict[str, Any], base: dict[str, Any]) -> str:
    """Beside the stall target (max and p99 over every later round): the
    median of the rounds' maxima and the collections seen in those rounds,
    for runs that alternated the ways round by round (none before)."""
    if "warm_median_round_max_ms" not in s or "warm_median_round_max_ms" not in base:
        return ""
    mine, theirs = s["warm_median_round_max_ms"], base["warm_median_round_max_ms"]
    p99 = ""
    if "warm_median_round_p99_ms" in s and "warm_median_round_p99_ms" in base:
        a, b = s["warm_median_round_p99_ms"], base["warm_median_round_p99_ms"]
        own, theirs_own = s["round_p99_stall_ms"][1:] or [a], base["round_p99_stall_ms"][1:] or [b]
        low, high, blow, bhigh = min(own), max(own), min(theirs_own), max(theirs_own)
        p99 = (
            f"; median round's p99 {a} / {b} ms ({_ratio(a, b)}; a round's own p99 {low}-{high} ms "
            f"and {blow}-{bhigh} ms)"
        )
    return (
        f"; median round's max {mine} / {theirs} ms ({_ratio(mine, theirs)}){p99}, "
        f"{s['warm_rounds']} and {base['warm_rounds']} later rounds alternated; garbage collections "
        f"of {s['gc_over_ms']:g} ms or more in them: launch {_gc_text(s['warm_gc'])}, "
        f"run_in_executor {_gc_text(base['warm_gc'])}"
    )


def _cold_gc(s: dict[str, Any]) -> float | None:
    """The longest collection recorded in a way's first round, if any: that
    round runs unfrozen, and a full collection over PyTorch's objects may
    set its max (said beside it)."""
    return max((g["ms"] for g in s.get("gc", ()) if g["round"] == 0), default=None)


def _cold_gc_text(s: dict[str, Any]) -> str:
    longest = _cold_gc(s)
    return "" if longest is None else f" (a {longest} ms garbage collection in it)"


def _gc_text(g: dict[str, Any]) -> str:
    """A way's collections in its later stall rounds, in words."""
    if not g["count"]:
        return "none"
    held = g["in_longest_stall_round_ms"]
    where = "none" if held is None else f"{held} ms"
    return f"{g['count']} (longest {g['longest_ms']} ms; {where} in the round of its longest stall)"


def _delta(value: float | None, base: float | None) -> float | None:
    """``value - base``, None where either was not measured."""
    return None if value is None or base is None else value - base


def _signed(delta: float | None) -> str:
    """A difference over the no-GPU server; a negative one says the baseline
    itself was slower (a goal met against it proves little)."""
    if delta is None:
        return "not measured"
    return f"{delta:+.1f} ms" + (", the no-GPU server the slower" if delta < 0 else "")


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _pause_targets(model: str, group: dict[str, Any]) -> list[str]:
    """Issue 47's open-loop targets for ``batch_graph``: request p99, the
    longest ``/health`` probe and the longest garbage collection, where the
    run recorded collections (``gc``)."""
    r = group.get("batch_graph")
    if r is None or "gc" not in r:
        return []
    g = r["gc"]
    longest = "none over 5 ms" if g["longest_ms"] is None else f"longest {g['longest_ms']} ms"
    gen = "" if g["longest"] is None else f", generation {g['longest']['generation']}"
    tracked = "" if g["longest"] is None else f", {g['longest']['tracked']:,} objects tracked"
    over = g["longest_ms"] is not None and g["longest_ms"] > 10
    return [
        f"- {model}, open loop at {group['rate']:,.0f}/s: batch_graph request p99 {r['p99_ms']} ms "
        f"({_goal(r['p99_ms'], 25, at_least=False, unit=' ms')}), /health max {r['health']['max_ms']} ms "
        f"({_goal(r['health']['max_ms'], 10, at_least=False, unit=' ms')}), garbage collections "
        f"of 5 ms or more: {g['count']}, {longest}{gen}{tracked} "
        f"(target: none over 10 ms: {'**missed**' if over else 'met'})"
    ]


def _process_targets(processes: dict[str, Any]) -> list[str]:
    """Issue 33's targets, for the ``processes`` part."""
    lines = []
    one = processes.get("1", {}).get("resnet50", {}).get("closed", {}).get("fronts")
    for n, result in processes.items():
        m = result.get("resnet50")
        if not m:
            continue
        fronts = m["closed"].get("fronts")
        if fronts is None:
            continue
        limit = m.get("gpu_limit_images_per_s")
        if limit:
            share = fronts["rps"] / (limit * int(n))
            # More GPUs: the scaling below is their goal.
            goal = f" ({_goal(share, 0.9, at_least=True)})" if n == "1" else ""
            lines.append(f"- {n} GPU(s): fronts at {share:.2f}x the GPUs' own limit{goal}")
        peer = m["closed"].get("litserve_fronts")
        if peer and peer["rps"]:
            ratio = fronts["rps"] / peer["rps"]
            lines.append(
                f"- {n} GPU(s): {ratio:.1f}x LitServe with the same processes "
                f"({_goal(ratio, 5, at_least=True)})"
            )
        health = fronts["health"]["p99_ms"]
        lines.append(
            f"- {n} GPU(s): /health p99 {health} ms ({_goal(health, 2, at_least=False, unit=' ms')})"
        )
        if one and n != "1" and one["rps"]:
            want = {"2": 1.9, "4": 3.7}.get(n)
            scale = fronts["rps"] / one["rps"]
            goal = f" ({_goal(scale, want, at_least=True)})" if want else ""
            lines.append(f"- {n} GPUs: {scale:.2f}x one GPU{goal}")
    return lines


def _stall_settings_text(settings: dict[str, Any] | None) -> str:
    """How the stall rounds ran, for the table's heading (nothing for a run
    from before they alternated)."""
    if not settings:
        return ""
    rounds = ", ".join(f"{kind} {n}" for kind, n in settings["warm_rounds"].items())
    return (
        f"; later rounds of each way: {rounds}, the ways alternated round by round; "
        f"garbage collections of {settings['gc_over_ms']:g} ms or more recorded in each round"
        + (
            " (the later rounds with what the first left frozen, `gc.freeze()`, as the serving recipe does)"
            if settings.get("gc_frozen_after_first_round")
            else ""
        )
        + f"; {settings['launcher_threads']} launcher threads, switch interval "
        f"{settings['switch_interval_s'] * 1e3:g} ms (`sys.getswitchinterval()`)"
    )


#: How the calling-thread table names each call it timed.
_CALLS = {
    "launch": "`cudafut.launch(fn)`",
    "submit": "`cudafut.submit(fn)` (runs `fn` at once, on a pool stream)",
    "record": "`cudafut.record(x)`",
    "executor_submit": "`ThreadPoolExecutor.submit(fn)`",
}


def markdown(result: dict[str, Any]) -> list[str]:
    lines = ["## Serving (section `serve`)", ""]
    launch = result.get("launch")
    if launch:
        lines += ["Calling-thread time of one call (µs; 1,000 in flight):", ""]
        lines += ["| call | p50 | p99 |", "|---|---|---|"]
        lines += [
            f"| {_CALLS.get(k, f'`{k}`')} | {v['p50_us']} | {v['p99_us']} |"
            for k, v in launch["caller"].items()
        ]
        lines.append("")
        lines += [
            "Loop stalls (a 1 ms ticker's lateness) with launches in flight; the first round apart "
            "(cold: new threads and streams), then the later rounds (`launch_warmed`: new launcher "
            "threads, warmed by `warm_launchers()` first); idle: the same ticker with nothing in flight"
            + _stall_settings_text(launch.get("stall_settings"))
            + ":",
            "",
        ]
        # The median round's max and the collections: runs since the ways alternate.
        rounds = any("warm_gc" in s for by_kind in launch["stalls"].values() for s in by_kind.values())
        over = launch.get("stall_settings", {}).get("gc_over_ms", STALL_GC_MS)
        added = f"| later rounds' median max ms | later GCs of {over:g} ms or more: count, longest ms "
        added = added if rounds else ""
        lines += [
            "| way | calls in flight | first round max ms | later max ms | later p99 ms "
            + added
            + "| all max ms | all p99 ms | idle max ms | calls/s |",
            "|---" * (11 if rounds else 9) + "|",
        ]
        for way, by_kind in launch["stalls"].items():
            for kind, s in by_kind.items():
                n = "1,000 trivial" if kind == "trivial" else f"200 {kind}"
                g = s.get("warm_gc")
                gcs = "-" if g is None else f"{g['count']}, {g['longest_ms'] or '-'}"
                median = f"| {s.get('warm_median_round_max_ms', '-')} | {gcs} " if rounds else ""
                cold = s.get("cold_max_stall_ms", "-")
                longest = _cold_gc(s)
                if longest is not None:
                    cold = f"{cold} (GC {longest})"
                lines.append(
                    f"| {way} | {n} | {cold} | {s.get('warm_max_stall_ms', '-')} "
                    f"| {s.get('warm_p99_stall_ms', '-')} {median}"
                    f"| {s['max_stall_ms']} | {s['p99_stall_ms']} "
                    f"| {s['idle_max_stall_ms']} | {s['launches_per_s']:,.0f} |"
                )
        lines.append("")
    models = result.get("models")
    if models:
        lines += _compare_module().table(models)
    for n, part in (result.get("processes") or {}).items():
        policy = f", `--wait-policy {part['wait_policy']}`" if "wait_policy" in part else ""
        lines += [f"Several processes, {n} GPU(s) (examples/service/multiproc.py{policy}):", ""]
        lines += _compare_module().table(part)
    if models or result.get("processes"):
        lines += [_COLUMNS, ""]
    lines += _targets(result)
    return lines


#: What the serving tables' columns measure, once under them.
_COLUMNS = (
    "Columns: `/health`, a GET every 10 ms during the load (the loop's free time); server CPU, the "
    "server's processes' CPU seconds per second (in brackets its main thread's: the event loop, where "
    "one loop serves); GPU busy, NVML's utilisation over the window; mean batch, the Batcher's "
    "(its `statistics()`); GC pauses, the server's collections of 5 ms or more; wrong / errors, "
    "answers that differ from the model run on one image, and failed requests."
)


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    models = result.get("models")
    if not models:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.6 * len(models)), squeeze=False)
    for row, (model, m) in enumerate(models.items()):
        modes = list(m["closed"])
        rps = [m["closed"][k]["rps"] for k in modes]
        health = [m["closed"][k]["health"]["p99_ms"] or 0 for k in modes]
        ax = axes[row][0]
        ax.barh(modes, rps, color="tab:blue")
        ax.set_xlabel("requests/s (closed loop, 64 clients)")
        ax.set_title(f"{model}: throughput")
        ax.invert_yaxis()
        ax = axes[row][1]
        ax.barh(modes, health, color="tab:red")
        ax.set_xscale("log")
        ax.set_xlabel("/health p99 (ms, log)")
        ax.set_title(f"{model}: how long the loop is blocked")
        ax.invert_yaxis()
    fig.tight_layout()
    path = out / f"{stem}-serve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
