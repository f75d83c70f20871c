"""Where a service's garbage-collected objects come from, and what cudafut adds per request: no GPU needed.

``python scripts/gc-objects.py [--torch] [--requests N]`` (from the
repository root; the ``service`` extra installed) prints one JSON line per
part, then a summary:

- ``imports``: objects the cyclic collector tracks after this script's
  imports (cudafut, aiohttp, NumPy), and with ``--torch`` after importing
  PyTorch and torchvision and building a ResNet-50 (on the CPU), with
  their commonest types: what a full (generation-2) collection walks.
- ``library``: cudafut's own share per request on its fake GPU
  (:func:`cudafut.testing.fake_cuda`): a :class:`cudafut.Batcher` over a
  NumPy model, ``N`` requests in waves of 64 concurrent ``submit()``\\ s:
  objects alive per pending request, objects left per request once all
  are answered (a leak would show here), and the collections of each
  generation the requests caused.
- ``server``: examples/service/server.py ``--mode nogpu`` (with and
  without its ``gc.freeze()``) under load.py's closed loop: its tracked
  and frozen objects (``GET /stats?objects=10``) after warm-up and after
  the load, and its collections per 1,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "examples" / "service"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(SERVICE))

import aiohttp  # noqa: E402, F401 - counted among the imports, as a server has it
import numpy as np  # noqa: E402

import cudafut  # noqa: E402
import cudafut.testing  # noqa: E402


def tracked(top: int = 8) -> dict[str, Any]:
    """The objects the collector tracks now (frozen ones apart) and their commonest types."""
    gc.collect()
    objects = gc.get_objects()
    counts = collections.Counter(type(o).__name__ for o in objects).most_common(top)
    out = {"tracked": len(objects), "frozen": gc.get_freeze_count(), "types": counts}
    del objects
    return out


def imports(with_torch: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"after_imports": tracked()}
    if with_torch:
        import torch

        out["after_torch_import"] = tracked()
        import torchvision

        out["after_torchvision_import"] = tracked()
        net = torchvision.models.resnet50(weights=None).eval()
        with torch.inference_mode():
            net(torch.zeros(1, 3, 224, 224))
        out["after_resnet50"] = tracked()
        t0 = time.perf_counter()
        gc.collect()
        out["full_collection_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        del net
    return out


def library(requests: int, wave: int = 64) -> dict[str, Any]:
    """cudafut's objects per request on the fake GPU (see the module)."""
    from ray_serve import Toy

    toy = Toy()

    async def main() -> dict[str, Any]:
        async with cudafut.Batcher(toy.answer, max_batch=32, max_delay_s=0.002) as batcher:
            await asyncio.gather(*(batcher.submit(i % 256) for i in range(wave)))  # warm-up
            gc.collect()
            before = len(gc.get_objects())
            gc.disable()  # counted, not collected, while the wave is pending
            try:
                pending = [asyncio.ensure_future(batcher.submit(i % 256)) for i in range(wave)]
                await asyncio.sleep(0)  # each task has submitted, none answered yet
                alive = len(gc.get_objects()) - before
                await asyncio.gather(*pending)
            finally:
                gc.enable()
            del pending
            stats0 = [g["collections"] for g in gc.get_stats()]
            for start in range(0, requests, wave):
                await asyncio.gather(*(batcher.submit(i % 256) for i in range(start, start + wave)))
            stats1 = [g["collections"] for g in gc.get_stats()]
            gc.collect()
            left = len(gc.get_objects()) - before
        done = requests // wave * wave
        return {
            "objects_per_pending_request": round(alive / wave, 1),
            "objects_left_per_request": round(left / done, 3),
            "collections_per_1000_requests": [
                round((b - a) * 1000 / done, 1) for a, b in zip(stats0, stats1, strict=True)
            ],
            "requests": done,
        }

    with cudafut.testing.fake_cuda(auto_complete=True):
        return asyncio.run(main())


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
        return json.loads(resp.read())


def server(seconds: float, freeze: bool) -> dict[str, Any]:
    """server.py --mode nogpu under load.py's closed loop (see the module)."""
    import socket

    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref.npy"
        np.save(ref, np.random.default_rng(1).standard_normal((256, 1000)).astype(np.float32))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        cmd = [sys.executable, str(SERVICE / "server.py"), "--mode", "nogpu", "--port", str(port)]
        cmd += ["--reference", str(ref), *([] if freeze else ["--no-gc-freeze"])]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None
            if not proc.stdout.readline().startswith("READY"):
                raise SystemExit("gc-objects.py: server.py did not start")
            for _ in range(100):
                try:
                    warm = _get(port, "/stats?objects=10")
                    break
                except OSError:
                    time.sleep(0.1)
            load = [sys.executable, str(SERVICE / "load.py"), "--port", str(port), "--reference", str(ref)]
            load += ["--clients", "32", "--seconds", str(seconds), "--warmup", "0.5", "--procs", "1"]
            subprocess.run(load, check=True, capture_output=True, cwd=ROOT)
            after = _get(port, "/stats?objects=10")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    n = after["requests"] - warm["requests"]
    return {
        "freeze": freeze,
        "after_warmup": {k: warm[k] for k in ("gc_tracked", "gc_frozen", "gc_types")},
        "after_load": {k: after[k] for k in ("gc_tracked", "gc_frozen", "gc_types")},
        "requests": n,
        "tracked_growth_per_request": round((after["gc_tracked"] - warm["gc_tracked"]) / max(n, 1), 4),
        "collections_per_1000_requests": [
            round((b - a) * 1000 / max(n, 1), 1)
            for a, b in zip(warm["gc_collections"], after["gc_collections"], strict=True)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--torch", action="store_true", help="also import PyTorch and torchvision (CPU is enough)"
    )
    parser.add_argument("--requests", type=int, default=20_000, help="library part: requests")
    parser.add_argument("--seconds", type=float, default=3.0, help="server part: seconds of load per run")
    args = parser.parse_args()
    os.environ.pop("CUDAFUT_GC_PAUSES", None)
    results = {"imports": imports(args.torch), "library": library(args.requests)}
    print(json.dumps({"imports": results["imports"]}))
    print(json.dumps({"library": results["library"]}))
    for freeze in (True, False):
        r = server(args.seconds, freeze)
        print(json.dumps({"server": r}))


if __name__ == "__main__":
    main()
