"""The self-check of ``python -m cudafut``: what this machine offers cudafut.

Gathers, without failing: the NVIDIA driver and the CUDA version it
supports, CuPy and the CUDA it was built for, each visible device, the
optional packages cudafut works with (torch, trio, uvloop, NCCL through
CuPy, nvtx), whether event-loop waiters can sleep on a timerfd, and the wait
policy in force; and, when CUDA cannot be used, why and how to fix it.

Nothing here is imported by ``import cudafut``; the benchmarks reuse
:func:`nvidia_driver_version` for their metadata, and the examples and the
benchmark suite (``python -m benchmarks``, which ``python -m cudafut bench``
runs in a child process) start with :func:`require_gpu`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import math
import os
import platform
import subprocess
import sys
import warnings
from typing import Any

from .. import _backend, _compiled, _cuda, _policy, _timer
from .._errors import CudaUnavailableError

#: The optional packages reported (distribution names), besides NCCL.
OPTIONAL = ("torch", "trio", "uvloop", "nvtx")

_EXTRAS = "pip install 'cudafut[cuda12]' (CUDA 12 driver) or 'cudafut[cuda13]' (CUDA 13 driver)"


def cuda_version(code: int) -> str | None:
    """A CUDA version number as CUDA reports it (12090) written as "12.9";
    None for 0 (what the runtime reports when there is no driver)."""
    if code <= 0:
        return None
    return f"{code // 1000}.{code % 1000 // 10}"


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version ("550.54.15"), or None if none is found.

    Asks NVML (``pynvml``, if installed), then ``/proc/driver/nvidia/version``,
    then ``nvidia-smi``."""
    with contextlib.suppress(Exception):
        pynvml = importlib.import_module("pynvml")  # optional
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    with contextlib.suppress(OSError, IndexError):
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..."
        for word in words:
            if word[:1].isdigit() and word.count(".") >= 1:
                return word
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        lines = out.stdout.strip().splitlines()
        if out.returncode == 0 and lines and lines[0].strip():
            return lines[0].strip()
    return None


def _package(name: str) -> dict[str, Any]:
    try:
        return {"present": True, "version": importlib.metadata.version(name)}
    except importlib.metadata.PackageNotFoundError:
        return {"present": False, "version": None}


def _cupy_facts() -> tuple[Any, dict[str, Any]]:
    """(the cupy module or None, what we know of it)."""
    facts: dict[str, Any] = {"present": False, "version": None, "distribution": None, "cuda_runtime": None}
    try:
        cp = importlib.import_module("cupy")
    except Exception as exc:  # noqa: BLE001 - a broken CuPy is reported, not raised
        if not isinstance(exc, ImportError):
            facts["error"] = f"{type(exc).__name__}: {exc}"
        return None, facts
    facts["present"] = True
    facts["version"] = getattr(cp, "__version__", None)
    with contextlib.suppress(Exception):
        dists = importlib.metadata.packages_distributions().get("cupy") or []
        facts["distribution"] = dists[0] if dists else None
    with contextlib.suppress(Exception):
        facts["cuda_runtime"] = cuda_version(int(cp.cuda.runtime.runtimeGetVersion()))
    return cp, facts


def _nccl_facts(cp: Any) -> dict[str, Any]:
    if cp is None:
        return {"present": False, "version": None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
            nccl = importlib.import_module("cupy.cuda.nccl")
        if not getattr(nccl, "available", True):
            return {"present": False, "version": None}
        code = int(nccl.get_version())
    except Exception:  # noqa: BLE001 - optional
        return {"present": False, "version": None}
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return {"present": True, "version": f"{major}.{rest // 100}.{rest % 100}"}


def _timerfd() -> bool:
    timer = _timer.make_timer()
    if timer is None:
        return False
    timer.close()
    return True


def _policy_facts() -> dict[str, Any]:
    current = _policy.get_wait_policy()
    name = next((n for n, p in _policy.PRESETS.items() if p == current), None)
    return {"name": name, "repr": repr(current), "summary": _policy_summary(current)}


def _us(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:g} µs"


def _policy_summary(policy: _policy.WaitPolicy) -> str:
    """What a policy does, in words: the self-check's line (docs/performance.md,
    "Choosing a policy", says what each part costs)."""
    if math.isinf(policy.spin_s):
        return "spins for the whole wait (a busy core per waiting loop or thread)"
    spins = f"spins {_us(policy.spin_s)} after a new wait" if policy.spin_s > 0 else "does not spin"
    parts = [spins, f"sleeps at most {_us(policy.max_sleep_s)} between polls"]
    if policy.predict:
        parts.append("spins around learnt durations")
    if policy.notify:
        parts.append("CUDA notices on")
    return ", ".join(parts)


def _fixes(cupy_facts: dict[str, Any], driver: str | None, driver_cuda: str | None) -> list[str]:
    if not cupy_facts["present"]:
        if "error" in cupy_facts:
            return [f"CuPy is installed but fails to import; reinstall it: {_EXTRAS}", _cuda.NO_GPU_TESTING]
        return [
            f"install CuPy with cudafut's extra: {_EXTRAS}; `nvidia-smi` shows the driver's CUDA version",
            _cuda.NO_GPU_TESTING,
        ]
    fixes = []
    if driver is None and driver_cuda is None:
        fixes.append(
            "install the NVIDIA driver (https://www.nvidia.com/drivers); `nvidia-smi` must list your GPU"
        )
    elif driver_cuda and cupy_facts["cuda_runtime"] and _older(driver_cuda, cupy_facts["cuda_runtime"]):
        fixes.append(
            f"the driver supports CUDA {driver_cuda} but CuPy was built for CUDA "
            f"{cupy_facts['cuda_runtime']}: update the driver, or install the CuPy that matches it: {_EXTRAS}"
        )
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        fixes.append(
            f"CUDA_VISIBLE_DEVICES is set to {os.environ['CUDA_VISIBLE_DEVICES']!r}: "
            "unset it or name a device that exists"
        )
    if not fixes:
        fixes.append("check that `nvidia-smi` lists your GPU and that this process may use it")
    return [*fixes, _cuda.NO_GPU_TESTING]


def _older(a: str, b: str) -> bool:
    try:
        return tuple(map(int, a.split("."))) < tuple(map(int, b.split(".")))
    except ValueError:
        return False


def gather() -> dict[str, Any]:
    """The self-check, as a JSON-ready dict; never raises for a missing GPU.

    ``usable`` says whether cudafut can use CUDA here; when it cannot,
    ``problem`` says why (the :class:`cudafut.CudaUnavailableError`
    message) and ``fix`` lists what to do. ``devices`` lists each visible
    device (name, total memory in bytes, compute capability)."""
    from .. import __version__

    cp, cupy_facts = _cupy_facts()
    driver = nvidia_driver_version()
    driver_cuda = None
    if cp is not None:
        with contextlib.suppress(Exception):
            driver_cuda = cuda_version(int(cp.cuda.runtime.driverGetVersion()))
    check: dict[str, Any] = {
        "cudafut": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "driver": {"nvidia": driver, "cuda": driver_cuda},
        "cupy": cupy_facts,
        "devices": [],
        "packages": {name: _package(name) for name in OPTIONAL},
        "timerfd": _timerfd(),
        "policy": _policy_facts(),
        "core": _compiled.core(),
        "usable": False,
        "problem": None,
        "fix": [],
    }
    check["packages"]["nccl"] = _nccl_facts(cp)
    try:
        count = _backend.current.device_count()
    except CudaUnavailableError as exc:
        check["problem"] = str(exc).removesuffix(f"; {_cuda.NO_GPU_TESTING}")  # the last fix says it
        check["fix"] = _fixes(cupy_facts, driver, driver_cuda)
        return check
    except Exception as exc:  # noqa: BLE001 - a broken CuPy install: reported, not raised
        check["problem"] = f"CUDA could not be initialised: {type(exc).__name__}: {exc}"
        check["fix"] = _fixes(cupy_facts, driver, driver_cuda)
        return check
    rt = _backend.current.runtime()
    for i in range(count):
        props = rt.getDeviceProperties(i)
        name = props["name"]
        check["devices"].append(
            {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "total_memory_bytes": int(props["totalGlobalMem"]),
                "compute_capability": f"{props['major']}.{props['minor']}",
                "multiprocessors": int(props["multiProcessorCount"]),
            }
        )
    check["usable"] = True
    return check


def _version(facts: dict[str, Any], missing: str = "not installed") -> str:
    if not facts["present"]:
        return missing
    return str(facts["version"] or "installed (version unknown)")


def lines(check: dict[str, Any]) -> list[str]:
    """The self-check as aligned text lines, for a terminal."""
    out = [f"cudafut {check['cudafut']}, Python {check['python']}, {check['platform']}"]

    def row(key: str, value: str) -> None:
        out.append(f"  {key:<15} {value}")

    drv = check["driver"]
    row(
        "NVIDIA driver",
        (drv["nvidia"] or "not found") + (f" (supports CUDA {drv['cuda']})" if drv["cuda"] else ""),
    )
    cupy = check["cupy"]
    if cupy["present"]:
        what = str(cupy["version"]) + (f" ({cupy['distribution']})" if cupy["distribution"] else "")
        row("CuPy", what + (f", built for CUDA {cupy['cuda_runtime']}" if cupy["cuda_runtime"] else ""))
    else:
        row("CuPy", "fails to import: " + cupy["error"] if "error" in cupy else "not installed")
    for dev in check["devices"]:
        row(
            f"GPU {dev['index']}",
            f"{dev['name']}, {dev['total_memory_bytes'] / 2**30:.1f} GiB, "
            f"compute capability {dev['compute_capability']}, {dev['multiprocessors']} SMs",
        )
    if not check["usable"]:
        row("GPU", "none usable (see below)")
    for name in (*OPTIONAL, "nccl"):
        label = "NCCL (CuPy)" if name == "nccl" else name
        row(label, _version(check["packages"][name]))
    row(
        "timerfd",
        "yes (waiters sleep to the microsecond)"
        if check["timerfd"]
        else "no (waiters sleep with the loop's millisecond timers)",
    )
    row("core", check["core"])
    pol = check["policy"]
    row("wait policy", (pol["name"] or "custom") + f": {pol['summary']}")
    return out


#: What works without a GPU: the lines after the fixes, where a command needs one.
WITHOUT_A_GPU = [
    "Without a GPU, `import cudafut` works and pytest runs the test suite (the GPU tests skip); "
    "the fix above names the fake GPU for your own tests.",
]


def failure_lines(problem: str, fix: list[str]) -> list[str]:
    """What ``python -m cudafut`` prints when no GPU is usable: the reason,
    then what to do."""
    out = [f"cudafut cannot use a GPU here: {problem}"]
    if fix:
        out.append("To fix it:")
        out.extend(f"  - {line}" for line in fix)
    return out


def unusable() -> list[str] | None:
    """None when cudafut can use CUDA here (a flag test once CUDA is
    initialised); otherwise the lines :func:`failure_lines` makes of the
    self-check (which takes up to a few seconds: it asks the driver, CuPy,
    and perhaps ``nvidia-smi``)."""
    try:
        _backend.current.device_count()
    except CudaUnavailableError:
        pass
    except Exception:  # noqa: BLE001 - a broken CuPy install: the self-check says what
        pass
    else:
        return None
    check = gather()
    if check["usable"]:
        return None
    return failure_lines(check["problem"] or "CUDA is unusable", check["fix"])


def require_gpu() -> None:
    """Exit with status 1 and the self-check's reason and fix (what
    ``python -m cudafut`` says), without a traceback, unless cudafut can use
    CUDA here; return at once (a flag test) when it can.

    For scripts that need a GPU (the examples, ``python -m cudafut bench``):
    call it first, before CuPy is used, so that a machine without a GPU gets
    a message instead of CuPy's traceback.
    """
    lines = unusable()
    if lines is None:
        return
    print("\n".join(lines), file=sys.stderr)
    print("(python -m cudafut checks this machine and says more)", file=sys.stderr)
    raise SystemExit(1)
