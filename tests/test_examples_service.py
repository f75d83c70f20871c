"""examples/service/ without a GPU: the answer check, the load generator
against the no-GPU server on loopback, and the comparison table (each
script's ``--help``: tests/test_examples.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.subproc import ROOT
from tests.test_examples import EXAMPLES, load_example

SERVICE = EXAMPLES / "service"


def _reference(n: int = 256) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((n, 1000)).astype(np.float32)


def test_an_answer_is_checked_against_the_reference_logits() -> None:
    models = load_example(SERVICE / "models.py")
    ref = _reference(2)
    tol = models.tolerance(ref)
    right = models.top_of(ref[0])
    assert models.check(right, ref[0], tol)
    assert not models.check(right, ref[1], tol)  # another image's answer
    off = list(right)
    off[0] += 10 * tol
    assert not models.check(off, ref[0], tol)
    wrong_class = list(right)
    wrong_class[models.TOP] = float(int(np.argmin(ref[0])))
    assert not models.check(wrong_class, ref[0], tol)
    assert not models.check(right[:-1], ref[0], tol)
    assert not models.check([*right[:-1], 0.5], ref[0], tol)  # not a class number


def test_a_servers_wait_policy_name_sets_the_policy_and_polls_turns_notices_off() -> None:
    import cudafut

    models = load_example(SERVICE / "models.py")
    before = cudafut.get_wait_policy()
    try:
        models.use_wait_policy("polls")
        assert cudafut.get_wait_policy() == cudafut.WaitPolicy(notify=False)
        models.use_wait_policy("balanced")
        assert cudafut.get_wait_policy() == cudafut.WaitPolicy()
        with pytest.raises(ValueError, match="unknown wait policy 'fast'"):
            models.use_wait_policy("fast")
        assert cudafut.get_wait_policy() == cudafut.WaitPolicy()
    finally:
        cudafut.set_wait_policy(before)


def test_the_comparison_table_has_a_row_per_handler() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("psutil")  # Ray Serve brings aiohttp without psutil
    compare = load_example(SERVICE / "compare.py")
    r = {
        "rps": 1234.5, "p50_ms": 5.0, "p99_ms": 12.5, "server_cpu": 0.98, "gpu_busy": 0.5, "mean_batch": 12.0,
        "wrong": 0, "errors": 0, "health": {"p50_ms": 0.4, "p99_ms": 1.2, "max_ms": 3.0},
    }  # fmt: skip
    results = {
        "resnet50": {
            "closed": {"nogpu": r, "batch_graph": r, "batch": {**r, "main_thread_cpu": 0.71}},
            "open": {"nogpu/2": {"rate": 617.0, "nogpu": r}},
            "threads": {"launch": {"1": r}},
        }
    }
    text = "\n".join(compare.table(results))
    assert "| batch_graph | 1,234 | 5.00 | 12.5 | 0.40 / 1.20 / 3.00 | 98 % | 50 % | 12.0 | 0 / 0 |" in text
    assert "| batch | 1,234 | 5.00 | 12.5 | 0.40 / 1.20 / 3.00 | 98 % (71 %) | 50 % | 12.0 | 0 / 0 |" in text
    assert "open loop at 617 req/s" in text
    assert "| 1 thread(s) |" in text


def test_compare_records_the_command_that_measures_again() -> None:
    # Committed results name their command in their caption: without the
    # output path (``--json``) or an empty option.
    pytest.importorskip("aiohttp")  # compare.py needs it to load
    compare = load_example(SERVICE / "compare.py")
    argv = ["--models", "resnet50", "--server-args=", "--json", "/tmp/x.json", "--seconds", "5"]
    assert compare._producer(argv) == "python examples/service/compare.py --models resnet50 --seconds 5"
    argv = ["--server-args=--max-batch 64", "--json=/tmp/y.json"]
    assert compare._producer(argv) == "python examples/service/compare.py '--server-args=--max-batch 64'"


def test_compare_asks_for_the_loops_cpu_of_server_py_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # LitServe's and multiproc.py's main processes supervise others: their
    # main thread is no event loop, so no row of theirs reports one.
    pytest.importorskip("aiohttp")
    pytest.importorskip("psutil")
    compare = load_example(SERVICE / "compare.py")
    asked: dict[tuple[str, bool], bool] = {}

    @contextlib.contextmanager
    def serving(model: str, mode: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield types.SimpleNamespace(pid=0, mode=mode)

    def measure(proc: Any, port: int, *, one_loop: bool = True, **kwargs: Any) -> dict[str, Any]:
        asked[proc.mode, "rate" in kwargs] = one_loop
        health = {"p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}
        return {
            "rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0, "health": health, "server_cpu": 1.0,
            "main_thread_cpu": 0.5 if one_loop else None, "gpu_busy": None, "mean_batch": None,
            "wrong": 0, "errors": 0,
        }  # fmt: skip

    monkeypatch.setattr(compare, "serving", serving)
    monkeypatch.setattr(compare, "measure", measure)
    monkeypatch.setattr(compare, "reference", lambda model: np.zeros((2, 3), np.float32))
    monkeypatch.setattr(compare, "has_litserve", lambda: True)
    monkeypatch.setattr(compare, "gpu_limit", lambda model: 1000.0)
    modes = (
        "nogpu",
        "batch_graph",
        "litserve",
        "nogpu_fronts",
        *("fronts", "fronts_per_request"),
        "litserve_fronts",
    )
    compare.compare(("resnet50",), modes, seconds=0.1, warmup=0.0, step=lambda text: None)
    closed = {mode: one for (mode, open_loop), one in asked.items() if not open_loop}
    assert closed == {
        "nogpu": True, "batch_graph": True, "litserve": False,
        "nogpu_fronts": False, "fronts": False, "fronts_per_request": False, "litserve_fronts": False,
    }  # fmt: skip
    assert asked["batch_graph", True] and not asked["fronts", True]  # open loop likewise
    assert compare._one_loop("launch") and not compare._one_loop("unknown")


def test_the_sampler_reads_the_servers_gpus_by_bus_id_not_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML numbers every GPU of the host and ignores CUDA_VISIBLE_DEVICES: a
    # server on the host's second GPU is CUDA device 0 to itself, NVML's 1.
    pytest.importorskip("aiohttp")
    compare = load_example(SERVICE / "compare.py")
    buses = {0: "0000:2B:00.0", 1: "0000:3C:00.0"}  # CUDA_VISIBLE_DEVICES=1,2 of a 3-GPU host
    cuda = types.SimpleNamespace(Device=lambda i: types.SimpleNamespace(pci_bus_id=buses[i]))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    by_bus = {b"0000:1A:00.0": "nvml 0", b"0000:2B:00.0": "nvml 1", b"0000:3C:00.0": "nvml 2"}
    nvml = types.SimpleNamespace(nvmlDeviceGetHandleByPciBusId=by_bus.__getitem__)
    assert compare._nvml_handles(nvml, 1) == ["nvml 1"]
    assert compare._nvml_handles(nvml, 2) == ["nvml 1", "nvml 2"]
    assert compare._gpus("fronts", 2) == 2 and compare._gpus("batch_graph", 2) == 1


def test_the_sampler_tells_the_main_threads_cpu_from_the_whole_servers() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("psutil")
    compare = load_example(SERVICE / "compare.py")
    sampler = compare._Sampler(os.getpid(), 0.0, 0.0)
    total0, main0 = sampler._cpu_seconds()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        deadline = time.thread_time() + 0.2
        while time.thread_time() < deadline:  # this (main) thread's CPU, the worker's beside it
            pass
    finally:
        stop.set()
        worker.join()
    total1, main1 = sampler._cpu_seconds()
    assert 0 < main1 - main0 < total1 - total0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_up(server: subprocess.Popen[Any], port: int, limit_s: float, what: str) -> None:
    """Until ``server``'s ``/health`` answers (``limit_s``: it did not start)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.1)


def _load(port: int, ref_path: Path, *args: str) -> dict:
    """load.py as a user runs it (its load processes are spawned: they import it by path)."""
    cmd = [sys.executable, str(SERVICE / "load.py"), "--port", str(port), "--reference", str(ref_path)]
    cmd += ["--seconds", "0.5", "--warmup", "0.2", "--procs", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_load_generator_checks_every_answer_of_the_no_gpu_server(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    ref_path = tmp_path / "ref.npy"
    np.save(ref_path, _reference())
    port = _free_port()
    cmd = [sys.executable, str(SERVICE / "server.py"), "--mode", "nogpu", "--port", str(port)]
    # These parse without a GPU (the policy also applies).
    cmd += ["--wait-policy", "low_cpu", "--max-in-flight", "3"]
    server = subprocess.Popen([*cmd, "--reference", str(ref_path)], cwd=ROOT, env=dict(os.environ))
    try:
        _wait_until_up(server, port, 60, "the server")
        out = _load(port, ref_path, "--clients", "4")
        assert out["requests"] > 0 and out["wrong"] == 0 and out["errors"] == 0
        assert out["health"]["p50_ms"] is not None
        out = _load(port, ref_path, "--rate", "200")  # open loop
        assert out["mode"] == "open" and out["requests"] > 0 and out["wrong"] == 0
        # compare.py's measurement of it (in a process of its own: load.py's
        # clients are spawned and import it by name): the server's CPU, and
        # its main thread's (its event loop) only where asked
        script = (
            "import json, sys, types; sys.path.insert(0, sys.argv[1]); import compare; "
            "proc = types.SimpleNamespace(pid=int(sys.argv[2])); "
            "print(json.dumps([compare.measure(proc, int(sys.argv[3]), sys.argv[4], seconds=0.5, warmup=0.2, "
            "procs=1, clients=2, one_loop=one) for one in (True, False)]))"
        )
        cmd = [sys.executable, "-c", script, str(SERVICE), str(server.pid), str(port), str(ref_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        for r, one_loop in zip(json.loads(proc.stdout.strip().splitlines()[-1]), (True, False), strict=True):
            assert r["requests"] > 0 and r["wrong"] == 0 and r["server_cpu"] > 0
            if one_loop:
                assert 0 < r["main_thread_cpu"] <= r["server_cpu"] + 0.05
            else:
                assert r["main_thread_cpu"] is None
        # answers checked against another reference are caught
        np.save(ref_path, _reference() + 1.0)
        assert _load(port, ref_path, "--clients", "2")["wrong"] > 0
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- a missing dependency: one line that says what to install, at once ---------------------

_BLOCKER = """
import os, sys


class _Blocker:
    # Makes the modules named in CUDAFUT_TEST_BLOCK unimportable, as if not installed.
    names = set(os.environ.get("CUDAFUT_TEST_BLOCK", "").split(","))

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
"""


@pytest.mark.parametrize(
    ("script", "args", "missing", "install"),
    [
        ("load.py", ["--port", "PORT", "--seconds", "0.5", "--procs", "2"], "aiohttp", "cudafut[service]"),
        ("server.py", ["--mode", "nogpu", "--reference", "ref.npy"], "aiohttp", "cudafut[service]"),
        ("compare.py", ["--quick"], "aiohttp", "cudafut[service]"),
        ("litserve_server.py", ["--port", "PORT"], "litserve", "pip install litserve"),
        ("ray_serve.py", ["--model", "toy"], "ray", "cudafut[ray]"),
    ],
)
def test_a_missing_dependency_is_named_at_once(
    script: str, args: list[str], missing: str, install: str, tmp_path: Path
) -> None:
    """Each script, its dependency made unimportable (in the processes it
    spawns too: a sitecustomize on PYTHONPATH): a non-zero exit within
    seconds, one line on stderr saying what to install, no traceback."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "CUDAFUT_TEST_BLOCK": missing}
    port = str(_free_port())  # nothing listens there
    cmd = [sys.executable, str(SERVICE / script), *(port if a == "PORT" else a for a in args)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} without {missing} still ran after {exc.timeout} s")
    took = time.monotonic() - t0
    assert proc.returncode not in (0, None), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert missing in lines[0].lower() and install in lines[0], lines[0]
    assert took < 15, took


def test_the_load_generator_stops_when_a_load_process_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load process that died (an exception, a kill) ends the wait for
    results at once, with a line, instead of after the two-minute limit."""
    monkeypatch.setitem(sys.modules, "aiohttp", types.ModuleType("aiohttp"))  # load.py imports it
    load = load_example(SERVICE / "load.py")
    out: queue.Queue[Any] = queue.Queue()
    alive, dead = types.SimpleNamespace(exitcode=None), types.SimpleNamespace(exitcode=1)
    out.put({"latencies": []})
    assert load._collect(out, 1, [alive, alive], 60) == [{"latencies": []}]
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"1 load process\(es\) failed \(exit status 1\)"):
        load._collect(out, 1, [alive, dead], 60)
    with pytest.raises(SystemExit, match="no result from the load processes in 0 s"):
        load._collect(out, 1, [alive, alive], 0.1)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("way", [[], ["--per-request"]], ids=["batched", "per_request"])
def test_the_multi_process_service_answers_from_every_front_without_a_gpu(
    tmp_path: Path, way: list[str]
) -> None:
    """multiproc.py with its toy model: two front processes and a GPU
    process on cudafut's fake GPU; the answers cross the pipes as futures
    (done ones, under the fake) and the load generator checks every one.
    A front killed afterwards leaves the service serving from the other."""
    pytest.importorskip("aiohttp")
    toy = load_example(SERVICE / "ray_serve.py").Toy()
    ref_path = tmp_path / "toy.npy"
    np.save(ref_path, toy.reference())
    port = _free_port()
    cmd = [
        sys.executable,
        str(SERVICE / "multiproc.py"),
        "--model",
        "toy",
        "--fronts",
        "2",
        "--port",
        str(port),
        *way,
    ]
    server = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ))
    try:
        _wait_until_up(server, port, 120, "the service")
        # A longer warm-up than _load's: /health answers before the GPU
        # process's first batch, which a loaded CI host may take 0.5 s to run.
        out = _load(port, ref_path, "--clients", "8", "--warmup", "2", "--seconds", "1")
        assert out["requests"] > 0 and out["wrong"] == 0 and out["errors"] == 0, out
        # Each new connection goes to a front the kernel picks (SO_REUSEPORT):
        # ask until both have answered. The load's few connections may all
        # have gone to one front, so only a front that served is held to
        # its batch counts.
        fronts: dict[int, dict[str, Any]] = {}
        for _ in range(200):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as resp:
                stats = json.loads(resp.read())
            fronts[stats["pid"]] = stats
            if len(fronts) == 2:
                break
        assert len(fronts) == 2, fronts
        assert sum(s["requests"] for s in fronts.values()) >= out["requests"] > 0, fronts
        for stats in fronts.values():
            # A front froze what its imports and warm-up left before it was ready (docs/serving.md).
            assert stats["gc_frozen"] > 10_000
            if not way and stats["requests"]:  # the GPU batches its rows were in, and its own
                assert stats["gpu_batches"] > 0 and stats["gpu_items"] >= stats["gpu_batches"], stats
                assert 0 < stats["front_batches"] <= stats["front_items"] <= stats["requests"], stats
        os.kill(max(fronts.values(), key=lambda s: s["requests"])["pid"], 9)
        time.sleep(1.0)
        for k in range(20):  # new connections go to the front that lives
            body = json.dumps({"i": k}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert np.allclose(json.loads(resp.read())["top"], toy.answer([k])[0], atol=1e-5)
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode == 0  # SIGTERM stops every process of the service


def test_the_multi_process_outbox_never_waits_for_a_full_pipe() -> None:
    """multiproc.py's pipes are written on the event loop: a peer that does
    not read (its pipe full) must not block the loop (two such processes
    would deadlock); what did not fit goes out, in order and whole, once
    the peer reads."""
    import asyncio
    import threading

    n, size = 400, 64 * 1024  # 25 MB: far more than a socket buffer holds
    received: list[Any] = []
    with _outbox_pipe() as (multiproc, ours, theirs):
        # A write that waits for room fails after 5 s instead of hanging the test.
        with socket.socket(fileno=os.dup(ours.fileno())) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))

        async def main() -> None:
            loop = asyncio.get_running_loop()
            outbox = multiproc._Outbox(loop, [ours], "the test could not write")
            for i in range(n):
                outbox.put(0, (i, b"x" * size))
                await asyncio.sleep(0)  # one message per loop iteration
            assert any(outbox.unsent), "the pipe took all of it: the test proves nothing"
            reader = threading.Thread(target=lambda: received.extend(theirs.recv() for _ in range(n)))
            reader.start()
            while any(outbox.unsent):  # the loop, not a blocked write, sends the rest
                await asyncio.sleep(0.01)
            await asyncio.to_thread(reader.join, 30)
            outbox.close()

        asyncio.run(asyncio.wait_for(main(), 60))
    assert [batch[0][0] for batch in received] == list(range(n))
    assert all(len(batch) == 1 and batch[0][1] == b"x" * size for batch in received)


def test_the_multi_process_outbox_packs_and_writes_in_one_loop_iteration() -> None:
    """The GPU process groups its answers in the outbox's pack hook, called
    by the write itself: an answer set in one loop iteration is in the pipe
    after the next, not two later (a hop to group, then one to write)."""
    import asyncio

    gathered: list[str] = []
    packs: list[int] = []
    with _outbox_pipe() as (multiproc, ours, theirs):

        async def main() -> None:
            loop = asyncio.get_running_loop()

            def pack() -> None:
                packs.append(len(gathered))
                for item in gathered:
                    outbox.put(0, item)
                gathered.clear()

            outbox = multiproc._Outbox(loop, [ours], "the test could not write", pack=pack)
            gathered.extend(["a", "b"])
            outbox.wake()
            outbox.wake()  # one write per iteration, whoever asks
            assert not theirs.poll()
            await asyncio.sleep(0)
            assert theirs.poll(5) and theirs.recv() == ["a", "b"]
            assert packs == [2] and not outbox.scheduled
            outbox.put(0, "c")  # put() alone writes too, with an empty pack
            await asyncio.sleep(0)
            assert theirs.poll(5) and theirs.recv() == ["c"] and packs == [2, 0]
            outbox.close()

        asyncio.run(asyncio.wait_for(main(), 60))


@contextlib.contextmanager
def _outbox_pipe() -> Iterator[tuple[Any, Any, Any]]:
    """multiproc.py loaded, and a pipe: ``(multiproc, ours, theirs)``, the
    test's _Outbox writing ``ours``; both ends closed afterwards."""
    import multiprocessing as mp

    sys.path.insert(0, str(SERVICE))  # multiproc imports models from next to it
    multiproc = load_example(SERVICE / "multiproc.py")
    ours, theirs = mp.get_context("spawn").Pipe()
    try:
        yield multiproc, ours, theirs
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize(("argv", "policy"), [((), "polls"), (("--wait-policy", "low_cpu"), "low_cpu")])
def test_every_process_of_the_multi_process_service_gets_its_wait_policy(
    monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], policy: str
) -> None:
    sys.path.insert(0, str(SERVICE))  # multiproc imports models from next to it
    multiproc = load_example(SERVICE / "multiproc.py")
    made: list[dict[str, Any]] = []

    class Child:  # a process that ends before it is ready: main() stops there
        exitcode = 1

        def __init__(self, *, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
            made.append({"target": target.__name__, **kwargs})
            self.name = name

        def start(self) -> None: ...
        def is_alive(self) -> bool:
            return False

        def terminate(self) -> None: ...

    class End:
        def close(self) -> None: ...

    ctx = types.SimpleNamespace(
        Event=lambda: types.SimpleNamespace(wait=lambda timeout: False, set=lambda: None),
        Pipe=lambda: (End(), End()),
        Process=Child,
    )
    monkeypatch.setattr(multiproc.mp, "get_context", lambda method: ctx)
    with pytest.raises(SystemExit, match="exited with 1 before it was ready"):
        multiproc.main(["--model", "toy", "--fronts", "2", "--devices", "0,1", *argv])
    assert sorted(child["target"] for child in made) == ["front_main", "front_main", "gpu_main", "gpu_main"]
    assert {child["wait_policy"] for child in made} == {policy}


# -- multiproc.py's hand-off: front batches, GPU batches (on the fake GPU) ----------


@contextlib.contextmanager
def _gpu_process(
    fronts: int, per_request: bool, max_batch: int = 64, max_delay_s: float = 0.002
) -> Iterator[tuple[Any, list[Any], Any]]:
    """multiproc.py's GPU process with its toy model, for ``fronts`` fronts:
    ``(multiproc, our ends of the pipes, the process)``; killed afterwards."""
    import multiprocessing as mp

    from tests import service_children

    sys.path.insert(0, str(SERVICE))  # multiproc imports models from next to it
    multiproc = load_example(SERVICE / "multiproc.py")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(fronts)]
    ready = ctx.Event()
    args = ([theirs for _, theirs in pipes], per_request, max_batch, max_delay_s, ready)
    gpu = ctx.Process(target=service_children.gpu, args=args, daemon=True)
    gpu.start()
    for _, theirs in pipes:
        theirs.close()
    try:
        assert ready.wait(120), "the GPU process was not ready in 120 s"
        yield multiproc, [ours for ours, _ in pipes], gpu
    finally:
        gpu.kill()
        gpu.join(30)
        for ours, _ in pipes:
            ours.close()


def _toy_rows() -> np.ndarray:
    """Every image's answer, as the toy model gives it."""
    toy = load_example(SERVICE / "ray_serve.py").Toy()
    return np.asarray(toy.answer(np.arange(256)))


@pytest.mark.parametrize("per_request", [False, True], ids=["batched", "per_request"])
def test_the_hand_off_answers_each_request_with_its_own_row(per_request: bool) -> None:
    """Two fronts ask at once for 600 answers: front batches of 16 joined
    into GPU batches of 24 (a front batch split between two GPU batches,
    rows of both fronts in one), and each request gets its own image's row."""
    import asyncio

    from tests.service_children import link

    asked = [(f, (7 * i + 3 * f) % 256) for i in range(300) for f in range(2)]
    with _gpu_process(2, per_request, max_batch=24, max_delay_s=0.005) as (multiproc, conns, _gpu):

        async def main() -> tuple[list[Any], list[Any]]:
            loop = asyncio.get_running_loop()
            links = [link(multiproc, loop, conn, per_request, 16) for conn in conns]
            rows = await asyncio.gather(*(links[f].ask(k) for f, k in asked))
            for one in links:
                one.close()
            return rows, links

        rows, links = asyncio.run(asyncio.wait_for(main(), 60))
    expected = _toy_rows()
    wrong = [(f, k) for (f, k), row in zip(asked, rows, strict=True) if not np.allclose(row, expected[k])]
    assert not wrong, wrong[:10]
    if not per_request:
        counts = [one.counts for one in links]
        assert all(c["front_items"] == 300 and c["front_batches"] >= 300 / 16 for c in counts), counts
        # GPU batches of 24 rows (front batches of 16 split and joined), each front in several.
        assert all(c["gpu_items"] / c["gpu_batches"] > 16 for c in counts), counts


@pytest.mark.parametrize("per_request", [False, True], ids=["batched", "per_request"])
def test_a_front_that_dies_mid_batch_loses_no_other_fronts_requests(per_request: bool) -> None:
    """Three fronts share a GPU process: one is killed (SIGKILL) while it
    has requests in the GPU process's batches, one dies in the middle of a
    message; the third's requests, before, during and after, are all
    answered, each with its own row, and the GPU process lives on."""
    import asyncio
    import multiprocessing as mp
    import signal

    from tests import service_children

    ctx = mp.get_context("spawn")
    asked: list[int] = []
    rows: list[Any] = []
    with _gpu_process(3, per_request, max_batch=32, max_delay_s=0.003) as (multiproc, conns, gpu):
        ours, partial, killed = conns
        asking = ctx.Event()
        dying = ctx.Process(target=service_children.front, args=(killed, per_request, asking), daemon=True)
        dying.start()
        killed.close()  # its only end now: the GPU process sees it die
        try:
            assert asking.wait(60), "the dying front got no answer in 60 s"

            async def main() -> None:
                loop = asyncio.get_running_loop()
                me = service_children.link(multiproc, loop, ours, per_request, 16)
                tasks = []
                for round_ in range(30):
                    ks = [(round_ * 11 + j) % 256 for j in range(10)]
                    asked.extend(ks)
                    tasks += [asyncio.ensure_future(me.ask(k)) for k in ks]
                    if round_ == 10:  # half a message, then the pipe closes
                        os.write(partial.fileno(), struct.pack("!i", 1000) + b"\0" * 100)
                        partial.close()
                    if round_ == 15 and dying.pid is not None:
                        os.kill(dying.pid, signal.SIGKILL)
                    await asyncio.sleep(0.005)
                rows.extend(await asyncio.gather(*tasks))
                me.close()

            asyncio.run(asyncio.wait_for(main(), 60))
            dying.join(30)
            assert dying.exitcode == -signal.SIGKILL
            assert gpu.is_alive()
        finally:
            dying.kill()
    expected = _toy_rows()
    assert len(rows) == len(asked) == 300
    assert all(np.allclose(row, expected[k]) for k, row in zip(asked, rows, strict=True))


@pytest.mark.parametrize("per_request", [False, True], ids=["batched", "per_request"])
def test_a_dead_gpu_process_answers_every_waiting_request_with_an_error(per_request: bool) -> None:
    """Requests waiting in a GPU process (its batch waits 60 s to fill) when
    it is killed each fail with GpuProcessGoneError within a bound (the
    pipe's end, not a timeout: 10 s is generous), and later ones at once."""
    import asyncio
    import signal

    from tests.service_children import link

    errors: list[BaseException] = []
    with _gpu_process(1, per_request, max_batch=64, max_delay_s=60.0) as (multiproc, conns, gpu):

        async def main() -> float:
            loop = asyncio.get_running_loop()
            me = link(multiproc, loop, conns[0], per_request, 64)
            tasks = [asyncio.ensure_future(me.ask(k)) for k in range(10)]
            await asyncio.sleep(0.5)  # in the GPU process's queue
            assert not any(task.done() for task in tasks)
            os.kill(gpu.pid, signal.SIGKILL)
            t0 = time.monotonic()
            done, _ = await asyncio.wait(tasks, timeout=10)
            took = time.monotonic() - t0
            errors.extend(task.exception() for task in done)
            with pytest.raises(multiproc.GpuProcessGoneError, match="every GPU process"):
                me.ask(0) if not per_request else await me.ask(0)
            me.close()
            return took

        took = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(errors) == 10 and took < 10
    assert all(type(e).__name__ == "GpuProcessGoneError" for e in errors), errors


def test_the_hand_off_measurement_runs_both_ways_and_checks_every_answer(tmp_path: Path) -> None:
    """handoff.py, briefly: both hand-offs, every answer checked (it exits
    non-zero on a wrong one), the GPU process's CPU per request reported."""
    out = tmp_path / "handoff.json"
    cmd = [
        sys.executable,
        str(SERVICE / "handoff.py"),
        "--rate",
        "200",
        "--seconds",
        "0.3",
        "--warmup",
        "0.2",
    ]
    cmd += ["--rounds", "1", "--batch-ms", "5", "--profile", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())["summary"]
    for way in ("per_request", "batched"):
        assert summary[way]["wrong"] == summary[way]["errors"] == 0
        assert summary[way]["cpu_us_per_request_median"] > 0 and summary[way]["loop_calls_per_request"][0] > 0
