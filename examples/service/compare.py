"""Serve a torchvision model every way server.py knows (and with LitServe), load each, compare.

For each model and mode: the server in its own process, the load generator
(load.py) in others; closed loop (64 clients, ``--clients``: the most each server does)
and, with ``--open``, open loop at a fixed rate (latency and loop health at
a load the server can carry: half the no-GPU ceiling for the batching
servers, half ``run_in_executor``'s maximum for the unbatched ones, and
for several processes half the no-GPU fronts' ceiling or, where lower,
half the GPUs' own limit). Each
row has req/s, latency, ``/health`` latency, the server's CPU (its worker
processes included) and, for server.py, its main thread's (the event
loop), the GPU's busy fraction, the mean batch and the number
of wrong answers (every answer is checked against the model run eagerly on
one image). ``python -m cudafut bench --only serve`` runs this and commits
the figures; run it alone with::

    python examples/service/compare.py --models resnet50 --seconds 5 [--open] [--quick]

``--server-args`` passes options to every server.py (not to LitServe's
or multiproc.py's servers), e.g. the batcher's pipeline
(``--server-args="--max-batch 32 --max-in-flight 2"``, a shallower one than the defaults), or
``--server-args=--no-gc-freeze`` to see the garbage collector's pauses.

``--open-rate R`` (with ``--open``) also runs the open loop of ``nogpu``
and ``batch_graph`` (and the several-process modes) at ``R`` requests a
second. Every row reports the garbage collections of 5 ms or more in the
server's processes during its window (pauses.py: the servers append them
to a file that this script names in ``CUDAFUT_GC_PAUSES``): how many, and
the longest.

Needs a GPU, torchvision and the ``service`` extra (``pip install -e
'.[service]'``: aiohttp, psutil, uvloop); LitServe where installed
(``pip install litserve``; its row is skipped otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models, load: next to this file

from models import IMAGES, MODELS, Served, missing, reference

try:  # before load.py, which would say the same of itself
    import aiohttp  # noqa: F401 - load.py's clients
    import psutil  # noqa: F401 - the server's CPU time
except ImportError as exc:  # one line that says what to install, not a traceback
    sys.exit(missing("compare.py", exc.name or "aiohttp", exc))

from load import run_load
from pauses import ENV as PAUSES_ENV
from pauses import read as read_pauses
from pauses import summary as pause_summary

HERE = Path(__file__).resolve().parent

#: The rows, in the order they run: the harness's ceiling, what people write
#: first, the peers, then cudafut's ways.
MODES = (
    "nogpu",
    "sync",
    "executor",
    "litserve",
    "await",
    "launch",
    "launch_graph",
    "batch",
    "batch_graph",
    "batch_floor",
)
#: The modes that also run closed loop with more clients (``more_clients``):
#: the one-process capacity, which 64 clients cannot reach once a request
#: waits milliseconds for its batch and the GPU (Little's law: 64 clients /
#: 11 ms is 5,800 req/s), beside the no-GPU server and the hand-written floor.
CAPACITY = ("nogpu", "batch_graph", "batch_floor")
#: Several processes (multiproc.py, with front batches, and
#: ``fronts_per_request``, its hand-off of a message per request; LitServe
#: with as many API servers and a worker per GPU): not among the defaults,
#: chosen with --modes, sized by --fronts and --devices.
MULTI_MODES = ("nogpu_fronts", "fronts", "fronts_per_request", "litserve_fronts")
#: The modes that run multiproc.py with the GPU.
FRONTS_GPU = ("fronts", "fronts_per_request")
#: Open loop: which modes run at half the no-GPU ceiling's rate (the
#: batching server with graphs: the others cannot carry that rate) and
#: which at half run_in_executor's maximum (the unbatched ones).
OPEN_BATCHED = ("nogpu", "batch_graph", "batch_floor")
OPEN_UNBATCHED = ("nogpu", "executor", "launch", "launch_graph")
OPEN_FRONTS = ("nogpu_fronts", "fronts", "fronts_per_request")


def _free_port() -> int:
    """A port of 18400-19399 no one listens on now (two comparisons may run
    at once; the servers bind with ``SO_REUSEPORT``, which would share a
    port silently, so the check binds without it)."""
    start = random.randrange(1000)
    for i in range(1000):
        port = 18400 + (start + i) % 1000
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18400-19399")


def _get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except Exception:  # noqa: BLE001 - not up yet
        return 0, b""


@contextlib.contextmanager
def serving(
    model: str,
    mode: str,
    port: int,
    ref_path: str,
    log: Path,
    threads: int | None = None,
    extra: tuple[str, ...] = (),
    fronts: int = 4,
    devices: int = 1,
    gpu_procs: int = 1,
    multiproc_args: tuple[str, ...] = (),
) -> Iterator[subprocess.Popen[bytes]]:
    """A server of ``mode`` on ``port`` until the block ends; waits until
    ``/health`` answers (model loaded, graphs captured). ``fronts`` and
    ``devices`` size the modes of :data:`MULTI_MODES`; ``multiproc_args``
    are more options for multiproc.py's GPU modes."""
    if mode in ("litserve", "litserve_fronts"):
        cmd = [sys.executable, str(HERE / "litserve_server.py"), "--model", model, "--port", str(port)]
        if mode == "litserve_fronts":
            cmd += ["--api-servers", str(fronts), "--devices", str(devices)]
    elif mode in ("nogpu_fronts", *FRONTS_GPU):
        cmd = [sys.executable, str(HERE / "multiproc.py"), "--model", model, "--port", str(port)]
        cmd += ["--fronts", str(fronts), "--devices", ",".join(str(d) for d in range(devices))]
        cmd += ["--gpu-procs", str(gpu_procs)]
        if mode == "nogpu_fronts":
            cmd += ["--nogpu", ref_path]
        else:
            cmd += [*multiproc_args, *(["--per-request"] if mode == "fronts_per_request" else [])]
    else:
        cmd = [sys.executable, str(HERE / "server.py"), "--model", model, "--mode", mode, "--port", str(port)]
        cmd += ["--reference", ref_path, *extra]
    # The server's processes append their long garbage collections here
    # (pauses.py): measure() reads those of its window.
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{PAUSES_ENV: str(pauses_file(log))})
    if threads is not None:
        env["CUDAFUT_LAUNCH_THREADS"] = str(threads)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _get(port, "/health")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the {mode} server did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


class _Sampler:
    """The server's CPU time (its children included), its main thread's,
    and the GPU's busy fraction over a window of wall time: the mean over
    the server's ``gpus`` (this process's CUDA devices 0..gpus-1)."""

    def __init__(self, pid: int, start: float, end: float, gpus: int = 1) -> None:
        self.pid, self.start, self.end, self.gpus = pid, start, end, gpus
        self.cpu: float | None = None
        self.main_cpu: float | None = None
        self.gpu: float | None = None
        self.stats: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _cpu_seconds(self) -> tuple[float, float]:
        """The CPU seconds of the server with its children, and of its main
        thread alone (on Linux a process's main thread has its pid)."""
        import psutil

        proc = psutil.Process(self.pid)
        total = main = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        with contextlib.suppress(psutil.Error):
            main = sum(t.user_time + t.system_time for t in proc.threads() if t.id == self.pid)
        return total, main

    def _run(self) -> None:
        nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            nvml = (pynvml, _nvml_handles(pynvml, self.gpus))
        except Exception:  # noqa: BLE001 - no NVML: no GPU figure
            nvml = None
        time.sleep(max(0.0, self.start - time.time()))
        cpu0, main0 = self._cpu_seconds()
        stats0 = _stats(self.port)
        busy: list[float] = []
        while time.time() < self.end:
            if nvml is not None and nvml[1]:
                rates = [nvml[0].nvmlDeviceGetUtilizationRates(h).gpu for h in nvml[1]]
                busy.append(sum(rates) / len(rates) / 100.0)
            time.sleep(0.1)
        cpu1, main1 = self._cpu_seconds()
        self.cpu = (cpu1 - cpu0) / (self.end - self.start)
        self.main_cpu = (main1 - main0) / (self.end - self.start)
        self.stats = (stats0, _stats(self.port))
        self.gpu = float(np.mean(busy)) if busy else None


def _nvml_handles(pynvml: Any, gpus: int) -> list[Any]:
    """NVML's handles of this process's CUDA devices 0..gpus-1. NVML numbers
    every GPU of the host and ignores ``CUDA_VISIBLE_DEVICES``, so the
    devices are matched by PCI bus id, not by index."""
    import cupy

    handles = []
    for device in range(gpus):
        bus_id = cupy.cuda.Device(device).pci_bus_id
        handles.append(pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode()))
    return handles


def pauses_file(log: Path) -> Path:
    """Where :func:`serving`'s server, logging to ``log``, records its
    garbage collections of 5 ms or more (one JSON line each)."""
    return log.with_name(log.name + ".gc.jsonl")


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def _stats(port: int) -> dict[str, Any]:
    status, body = _get(port, "/stats")
    return json.loads(body) if status == 200 else {}


def measure(
    proc: subprocess.Popen[bytes],
    port: int,
    ref_path: str,
    *,
    seconds: float,
    warmup: float,
    one_loop: bool = True,
    pauses: Path | None = None,
    gpus: int = 1,
    **load: Any,
) -> dict[str, Any]:
    """One load run against the server ``proc`` on ``port``, with its CPU,
    the GPU's busy fraction and the batcher's mean batch over the window;
    with ``one_loop`` (a server.py: its main thread runs the event loop)
    also its main thread's CPU; with ``pauses`` (the file its processes
    record long garbage collections in: :func:`pauses_file`) those that
    started in the window (``gc``: :func:`pauses.summary`); ``gpus``: the
    server's GPUs (CUDA devices 0..gpus-1), whose busy fractions are averaged."""
    start = time.time() + 2.0
    sampler = _Sampler(proc.pid, start + warmup, start + warmup + seconds, gpus)
    sampler.port = port
    sampler.thread.start()
    out = run_load(port, reference=ref_path, seconds=seconds, warmup=warmup, start=start, **load)
    sampler.thread.join(timeout=60)
    out["server_cpu"] = None if sampler.cpu is None else round(sampler.cpu, 3)
    main = sampler.main_cpu if one_loop else None  # elsewhere the main thread only supervises
    out["main_thread_cpu"] = None if main is None else round(main, 3)
    out["gpu_busy"] = None if sampler.gpu is None else round(sampler.gpu, 3)
    mean_batch = None
    if sampler.stats is not None:
        before, after = sampler.stats
        batches = after.get("batches", 0) - before.get("batches", 0)
        if batches:
            mean_batch = round((after.get("items", 0) - before.get("items", 0)) / batches, 2)
    out["mean_batch"] = mean_batch
    if sampler.stats is not None and all("gc_collections" in s for s in sampler.stats):
        # Collections of each generation in the window (server.py's /stats).
        before, after = sampler.stats
        counts = zip(before["gc_collections"], after["gc_collections"], strict=True)
        out["gc_collections"] = [b - a for a, b in counts]
    if pauses is not None:
        out["gc"] = pause_summary(read_pauses(pauses, sampler.start, sampler.end))
    return out


def gpu_limit(model: str, batch: int = 64, seconds: float = 3.0) -> float:
    """The GPU's own limit, in images per second: batch-``batch`` replays of
    the captured graphs (with the answer's top-k), back to back in this
    process, no HTTP, no batching wait."""
    served = Served(model, graphs=True)
    torch = served.torch
    indices = [i % IMAGES for i in range(batch)]
    for _ in range(5):
        served.answer_on_gpu(indices)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            served.answer_on_gpu(indices)
        torch.cuda.synchronize()
        n += 10
    rate = n * batch / (time.perf_counter() - t0)
    del served
    torch.cuda.empty_cache()
    return rate


def has_litserve() -> bool:
    try:
        import litserve  # noqa: F401
    except ImportError:
        return False
    return True


def compare(
    models: tuple[str, ...] = MODELS,
    modes: tuple[str, ...] = MODES,
    *,
    seconds: float = 5.0,
    warmup: float = 1.0,
    open_loop: bool = True,
    open_rates: tuple[float, ...] = (),
    threads: tuple[int, ...] = (),
    clients: int = 64,
    more_clients: tuple[int, ...] = (),
    procs: int = 4,
    fronts: int = 4,
    devices: int = 1,
    gpu_procs: int = 1,
    server_args: tuple[str, ...] = (),
    multiproc_args: tuple[str, ...] = (),
    step: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> dict[str, Any]:
    """Every model and mode, closed loop (and open loop); see the module.
    ``open_rates``: fixed rates (req/s) at which the open loop of
    ``nogpu``, ``batch_graph`` and the several-process modes also runs.
    ``threads``: launcher thread counts to also try with ``launch`` and
    ``batch_graph`` (closed loop, the first model). ``more_clients``: closed
    loops with these many clients too, for the modes of :data:`CAPACITY`
    (``row["capacity"][str(n)][mode]``). ``server_args``: more
    options for every server.py; ``multiproc_args``: for multiproc.py's GPU
    modes."""
    if any(m.startswith("litserve") for m in modes) and not has_litserve():
        modes = tuple(m for m in modes if not m.startswith("litserve"))
        step("LitServe is not installed: its rows are skipped")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            ref_path = str(Path(tmp) / f"{model}.npy")
            t0 = time.perf_counter()
            ref = reference(model)
            np.save(ref_path, ref)
            row: dict[str, Any] = {"closed": {}, "open": {}, "threads": {}, "capacity": {}}
            row["reference_s"] = round(time.perf_counter() - t0, 1)
            results[model] = row
            if any(mode in FRONTS_GPU for mode in modes):
                limit = row["gpu_limit_images_per_s"] = round(gpu_limit(model), 1)
                step(f"{model}: the GPU alone, batch-64 graph replays: {limit:,.0f} images/s")

            run = functools.partial(measure, ref_path=ref_path, seconds=seconds, warmup=warmup, procs=procs)

            for mode in modes:
                port = _free_port()
                log = Path(tmp) / f"{model}-{mode}.log"
                with serving(
                    model,
                    mode,
                    port,
                    ref_path,
                    log,
                    extra=server_args,
                    fronts=fronts,
                    devices=devices,
                    gpu_procs=gpu_procs,
                    multiproc_args=multiproc_args,
                ) as proc:
                    # This server's runs, closed loop and open: what only the mode sets.
                    run_mode = functools.partial(
                        run,
                        proc,
                        port,
                        one_loop=_one_loop(mode),
                        pauses=pauses_file(log),
                        gpus=_gpus(mode, devices),
                    )
                    try:
                        r = run_mode(clients=clients)
                    except BaseException:  # the server's own account of what went wrong, then the error
                        step(f"{model} {mode}: the load failed; the server's log ends:\n{_tail(log)}")
                        raise
                    row["closed"][mode] = r
                    step(f"{model} {mode} closed: {_line(r)}")
                    if mode in CAPACITY:
                        for n in more_clients:
                            r = run_mode(clients=n)
                            row["capacity"].setdefault(str(n), {})[mode] = r
                            step(f"{model} {mode} closed, {n} clients: {_line(r)}")
                    if open_loop:
                        for group, base in (
                            (OPEN_BATCHED, "nogpu"),
                            (OPEN_UNBATCHED, "executor"),
                            (OPEN_FRONTS, "nogpu_fronts"),
                        ):
                            if mode not in group or base not in row["closed"]:
                                continue
                            rate = round(row["closed"][base]["rps"] / 2, 1)
                            label = f"{base}/2"
                            gpus = row.get("gpu_limit_images_per_s", 0.0) * devices
                            if group is OPEN_FRONTS and gpus and gpus / 2 < rate:
                                # Half what the GPUs can do, not more: a rate
                                # beyond them measures only a growing queue.
                                rate, label = round(gpus / 2, 1), "GPU limit/2"
                            r = run_mode(clients=0, rate=rate)
                            row["open"].setdefault(label, {"rate": rate})[mode] = r
                            step(f"{model} {mode} open at {rate}/s: {_line(r)}")
                        if mode in OPEN_BATCHED + OPEN_FRONTS:
                            for rate in open_rates:
                                r = run_mode(clients=0, rate=rate)
                                row["open"].setdefault(f"{rate:g}/s", {"rate": rate})[mode] = r
                                step(f"{model} {mode} open at {rate:g}/s: {_line(r)}")
            # The no-GPU ceiling again, after the other handlers: within one
            # call it was seen to rise from run to run (10,365 to 16,461
            # req/s), so a ratio to its first run alone could flatter them.
            if "nogpu" in row["closed"] and len(row["closed"]) > 1:
                port = _free_port()
                log = Path(tmp) / f"{model}-nogpu-again.log"
                with serving(model, "nogpu", port, ref_path, log, extra=server_args) as proc:
                    r = run(proc, port, clients=clients, pauses=pauses_file(log))
                row["again"] = {"nogpu": r}
                step(f"{model} nogpu closed again, after the others: {_line(r)}")
            if threads and model == models[0]:
                for mode in ("launch", "batch_graph"):
                    for n in threads:
                        port = _free_port()
                        log = Path(tmp) / f"{model}-{mode}-{n}.log"
                        with serving(model, mode, port, ref_path, log, threads=n, extra=server_args) as proc:
                            r = run(proc, port, clients=clients, pauses=pauses_file(log))
                        row["threads"].setdefault(mode, {})[str(n)] = r
                        step(f"{model} {mode} with {n} launcher threads: {_line(r)}")
    return results


def _gpus(mode: str, devices: int) -> int:
    """How many GPUs the server of ``mode`` uses: ``devices`` for the
    several-process modes, one otherwise."""
    return devices if mode in MULTI_MODES else 1


def _one_loop(mode: str) -> bool:
    """Whether ``mode``'s server is server.py: one process whose main thread
    runs the event loop (LitServe's and multiproc.py's supervise others)."""
    return mode in MODES and mode != "litserve"


def _line(r: dict[str, Any]) -> str:
    main = "" if r.get("main_thread_cpu") is None else f" (main thread {r['main_thread_cpu']})"
    return (
        f"{r['rps']} req/s, p50 {r['p50_ms']} p99 {r['p99_ms']} ms, /health p99 {r['health']['p99_ms']} "
        f"max {r['health']['max_ms']} ms, cpu {r['server_cpu']}{main}, gpu {r['gpu_busy']}, "
        f"batch {r['mean_batch']}, wrong {r['wrong']}, errors {r['errors']}{_gc_text(r)}"
    )


def _gc_text(r: dict[str, Any]) -> str:
    g = r.get("gc")
    if g is None:
        return ""
    longest = "" if g["longest_ms"] is None else f", longest {g['longest_ms']} ms"
    return f", gc pauses >= 5 ms: {g['count']}{longest}"


def table(results: dict[str, Any]) -> list[str]:
    """Markdown tables of :func:`compare`'s results. A table whose rows
    recorded garbage collections (``gc``) has a column for them."""
    lines: list[str] = []
    head = (
        "| handler | req/s | p50 ms | p99 ms | /health p50 / p99 / max ms | server CPU (main thread) "
        "| GPU busy | mean batch | wrong / errors |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|"

    def row(name: str, r: dict[str, Any], gc_column: bool) -> str:
        h = r["health"]
        cells = [
            name,
            f"{r['rps']:,.0f}",
            _num(r["p50_ms"]),
            _num(r["p99_ms"]),
            f"{_num(h['p50_ms'])} / {_num(h['p99_ms'])} / {_num(h['max_ms'])}",
            _pct(r["server_cpu"])
            + ("" if r.get("main_thread_cpu") is None else f" ({_pct(r['main_thread_cpu'])})"),
            _pct(r["gpu_busy"]),
            "" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}",
            f"{r['wrong']} / {r['errors']}",
        ]
        if gc_column:  # before the answers' check, which stays the last column
            g = r.get("gc")
            cells.insert(-1, "-" if g is None else f"{g['count']} / {_num(g['longest_ms'])}")
        return "| " + " | ".join(cells) + " |"

    def block(title: str, rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
        gc_column = any("gc" in r for _, r in rows)
        top = (
            [
                head.replace(
                    "| wrong / errors |", "| GC pauses >= 5 ms: count / longest ms | wrong / errors |"
                ),
                rule + "---|",
            ]
            if gc_column
            else [head, rule]
        )
        return [title, "", *top, *(row(name, r, gc_column) for name, r in rows), ""]

    for model, m in results.items():
        if not isinstance(m, dict) or "closed" not in m:
            continue
        clients = sorted({r.get("clients", 64) for r in m["closed"].values()})
        rows = list(m["closed"].items())
        rows += [(f"{mode} (again, after the others)", r) for mode, r in m.get("again", {}).items()]
        lines += block(f"**{model}, closed loop** ({'/'.join(map(str, clients))} clients):", rows)
        for n, group in m.get("capacity", {}).items():
            title = f"**{model}, closed loop, {n} clients** (the one-process capacity, beside its floors):"
            lines += block(title, list(group.items()))
        for base, group in m["open"].items():
            if base == "GPU limit/2":
                why = "half the GPUs' own limit"
            elif base.endswith("/s"):
                why = "a fixed rate"
            else:
                why = f"{base} of the closed loop"
            title = f"**{model}, open loop at {group['rate']:,.0f} req/s** ({why}):"
            lines += block(title, [(mode, r) for mode, r in group.items() if mode != "rate"])
        for mode, by_threads in m["threads"].items():
            rows = [(f"{n} thread(s)", r) for n, r in by_threads.items()]
            lines += block(f"**{model}, {mode}, launcher threads** (closed loop):", rows)
    return lines


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["resnet50"])
    parser.add_argument("--modes", nargs="+", choices=MODES + MULTI_MODES, default=list(MODES))
    parser.add_argument("--fronts", type=int, default=4, help="multi-process modes: HTTP processes")
    parser.add_argument("--devices", type=int, default=1, help="multi-process modes: GPUs (0..N-1)")
    parser.add_argument("--gpu-procs", type=int, default=1, help="fronts mode: GPU processes per GPU")
    parser.add_argument("--load-procs", type=int, help="load generator processes (default 4; --quick 2)")
    parser.add_argument(
        "--clients",
        type=int,
        default=64,
        help="closed loop: clients (64; with several GPU processes, more keep their batches full)",
    )
    parser.add_argument(
        "--more-clients",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also closed loop with N clients for nogpu, batch_graph and batch_floor; repeatable",
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--open", action="store_true", help="also measure open loop")
    parser.add_argument(
        "--open-rate",
        type=float,
        action="append",
        default=[],
        metavar="R",
        help="with --open: also at R req/s (nogpu, batch_graph and the several-process modes); repeatable",
    )
    parser.add_argument("--quick", action="store_true", help="1 s per run, 2 load processes (a smoke run)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--server-args",
        default="",
        help="more options for every server.py (not LitServe's or multiproc.py's), one string, "
        "e.g. '--max-batch 32 --max-in-flight 2'",
    )
    parser.add_argument(
        "--multiproc-args",
        default="",
        help="more options for multiproc.py in the fronts modes, one string, "
        "e.g. '--max-in-flight 3 --front-delay-ms 0.5'",
    )
    args = parser.parse_args(argv)
    from cudafut._cli.selfcheck import require_gpu

    require_gpu()
    seconds, procs = (1.0, 2) if args.quick else (args.seconds, 4)
    procs = args.load_procs or procs
    results = compare(
        tuple(args.models),
        tuple(args.modes),
        seconds=seconds,
        warmup=0.5 if args.quick else 1.0,
        open_loop=args.open,
        open_rates=tuple(args.open_rate),
        procs=procs,
        clients=args.clients,
        more_clients=tuple(args.more_clients),
        fronts=args.fronts,
        devices=args.devices,
        gpu_procs=args.gpu_procs,
        server_args=tuple(shlex.split(args.server_args)),
        multiproc_args=tuple(shlex.split(args.multiproc_args)),
    )
    print("\n".join(table(results)))
    if args.json:
        meta = {
            "gpu": _gpu_name(),
            "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "producer": _producer(argv if argv is not None else sys.argv[1:]),
        }
        Path(args.json).write_text(json.dumps({"meta": meta, **results}, indent=1))


def _producer(argv: list[str]) -> str:
    """The command that measures again: ``argv`` without where the results
    went (``--json``) nor empty options."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json=") and not arg.endswith("="):
            kept.append(arg)
    return shlex.join(["python", "examples/service/compare.py", *kept])


def _gpu_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


if __name__ == "__main__":
    main()
