"""One CUDA seam: only cudafut/_cuda.py and the modules of its jobs that it
re-exports (and, for NCCL and the store, cudafut/distributed/_nccl.py)
import CuPy or call CUDA (docs/design.md).

Read from the source (the AST), so it holds on a machine without a GPU."""

from __future__ import annotations

import ast
import ctypes
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cudafut
from cudafut import _backend, _copies, testing
from cudafut.distributed import _nccl

PACKAGE = Path(__file__).resolve().parent.parent / "cudafut"

#: The seams: the modules that may import CuPy and call CUDA.
SEAMS = frozenset(
    {
        "_cuda.py",
        "_runtime.py",
        "_streams.py",
        "_event_calls.py",
        "_notices.py",
        "_copy_calls.py",
        "_cupy_objects.py",
        "_ipc.py",
        "distributed/_nccl.py",
    }
)

#: Modules that may use CuPy directly, and why.
EXEMPT = {
    # The command line diagnoses the CuPy install (an import that may fail,
    # the CUDA versions it was built for) and times raw CuPy as the baseline
    # cudafut is measured against: neither may go through cudafut's seam.
    "_cli/selfcheck.py": "diagnoses the CuPy install",
    "_cli/headline.py": "raw CuPy is the benchmark's baseline",
}

_CUPY = ("cupy", "cupyx", "cupy_backends")
# The whole string is a CuPy module name: importlib.import_module("cupy"),
# sys.modules.get("cupy"), __import__("cupyx.distributed").
_CUPY_NAME = re.compile(r"(cupy|cupyx|cupy_backends)(\.[A-Za-z_]\w*)*")
# What CuPy's runtime, driver and NCCL modules call CUDA's functions.
_RAW_CALLS = frozenset(
    {
        "NcclCommunicator",
        "allGather",
        "allReduce",
        "ctxGetCurrent",
        "ctxGetDevice",
        "ctxSetCurrent",
        "deviceSynchronize",
        "eventCreateWithFlags",
        "eventDestroy",
        "eventElapsedTime",
        "eventQuery",
        "eventRecord",
        "eventSynchronize",
        "freeHost",
        "getDevice",
        "getDeviceCount",
        "get_unique_id",
        "groupEnd",
        "groupStart",
        "hostAlloc",
        "memcpyAsync",
        "pointerGetAttributes",
        "reduceScatter",
        "setDevice",
        "streamGetCtx",
        "streamSynchronize",
        "streamWaitEvent",
    }
)
# The seam's private state, and its raw runtime: callers use its functions.
_SEAM_PRIVATE = frozenset({"runtime", "_rt", "_cupy"})
# Where callers find the seam: its namespace, its start-up module, the backend in force.
_SEAM_NAMES = frozenset({"_cuda", "_runtime", "current"})
# CuPy's private attributes cudafut reads (UnownedMemory's owner): the seam alone knows them.
_CUPY_PRIVATE = frozenset({"_owner"})


def _cupy_name(node: ast.AST) -> str | None:
    """The CuPy module ``node`` names, if it is a string naming one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUPY_NAME.fullmatch(node.value):
        return node.value
    return None


def violations(source: str) -> list[str]:
    """Where ``source`` (a module's text) reaches CuPy or CUDA other than
    through the seam's functions: ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in _CUPY]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] in _CUPY:
                found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            names = [_cupy_name(arg) for arg in node.args]
            found += [f"{line}: CuPy looked up by name ({name!r})" for name in names if name]
            found += [
                f"{line}: CuPy's private attribute {arg.value!r}"
                for arg in node.args[1:2]
                if isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr"}
                if isinstance(arg, ast.Constant) and arg.value in _CUPY_PRIVATE
            ]
            if isinstance(node.func, ast.Attribute) and node.func.attr in _RAW_CALLS:
                found.append(f"{line}: raw CUDA call .{node.func.attr}()")
        elif isinstance(node, ast.Subscript):
            name = _cupy_name(node.slice)
            if name:
                found.append(f"{line}: CuPy looked up by name ({name!r})")
        elif isinstance(node, ast.Attribute):
            value = node.value
            if node.attr in _CUPY_PRIVATE:
                found.append(f"{line}: CuPy's private attribute .{node.attr}")
            elif node.attr in _SEAM_PRIVATE and (
                (isinstance(value, ast.Name) and value.id in _SEAM_NAMES)
                or (isinstance(value, ast.Attribute) and value.attr in _SEAM_NAMES)
            ):
                found.append(f"{line}: .{node.attr} of the seam: call a function of the seam instead")
            elif isinstance(value, ast.Attribute) and value.attr == "cuda":
                base = value.value
                if not (isinstance(base, ast.Name) and base.id == "torch"):  # PyTorch's own API
                    found.append(f"{line}: CuPy's CUDA API (.cuda.{node.attr})")
    return sorted(set(found), key=lambda text: int(text.split(":")[0]))


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", [m for m in _modules() if m not in SEAMS and m not in EXEMPT])
def test_only_the_seam_reaches_cupy_and_cuda(module: str) -> None:
    found = violations((PACKAGE / module).read_text())
    assert not found, (
        f"cudafut/{module} reaches CuPy or CUDA outside the seam (cudafut/_cuda.py, "
        f"cudafut/distributed/_nccl.py); add a typed function there and call it:\n  " + "\n  ".join(found)
    )


def test_the_seams_and_exemptions_exist() -> None:
    modules = set(_modules())
    assert modules >= SEAMS
    assert set(EXEMPT) <= modules, "an exempt module moved or went: update EXEMPT"


@pytest.mark.parametrize(
    "source",
    [
        "import cupy",
        "import cupyx.distributed",
        "from cupy.cuda import nccl",
        "from cupy_backends.cuda.api import runtime",
        "importlib.import_module('cupy.cuda.nccl')",
        "sys.modules.get('cupy')",
        "sys.modules['cupy']",
        "_backend.current.runtime().memcpyAsync(1, 2, 3, 1, 0)",
        "rt.hostAlloc(10, 1)",
        "_backend.current.cupy().cuda.Device(0).use()",
        "cp.cuda.Stream(non_blocking=True)",
        "x = _cuda._rt",
        "x = _runtime._rt",
        "_runtime.runtime().getDevice()",
        "comm.allReduce(1, 1, 4, 7, 0, 0)",
        "getattr(array.data.mem, '_owner', None)",
        "array.data.mem._owner",
    ],
)
def test_the_check_sees_each_way_to_reach_cuda(source: str) -> None:
    assert violations(source), source


@pytest.mark.parametrize(
    "source",
    [
        "from . import _cuda",
        "_backend.current.memcpy_to_device(1, 2, 3, 0)",
        "cp = _backend.current.cupy(); cp.empty((2,), 'f4')",
        "torch.cuda.ExternalStream(1, device=0)",
        "raise TypeError('pass cupy.asarray(x) instead')",
        "sys.modules.get('torch')",
    ],
)
def test_the_check_lets_the_seams_callers_be(source: str) -> None:
    assert not violations(source), source


# -- PyTorch only through _torch.py, asyncio-or-trio only through _loops.py ----------------

#: The one module that looks each library up.
LIBRARY_SEAMS = {"torch": "_torch.py", "trio": "_loops.py"}
#: Modules that may look one up too, and why.
LIBRARY_EXEMPT = {
    ("torch", "_values.py"): "below _torch, which walks values with it: reads torch.Tensor itself",
}


def library_lookups(source: str, library: str) -> list[str]:
    """Where ``source`` imports ``library`` or looks it up by name
    (``sys.modules``, ``import_module``): ``line: what``."""
    name = re.compile(rf"{library}(\.[A-Za-z_]\w*)*")
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] == library]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] == library:
                found.append(f"{line}: from {node.module} import ...")
        else:
            keys = (
                node.args
                if isinstance(node, ast.Call)
                else [node.slice]
                if isinstance(node, ast.Subscript)
                else []
            )
            found += [
                f"{line}: {library} looked up by name ({key.value!r})"
                for key in keys
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and name.fullmatch(key.value)
            ]
    return sorted(set(found), key=lambda text: int(text.split(":")[0]))


@pytest.mark.parametrize("library", sorted(LIBRARY_SEAMS))
def test_only_its_module_reaches_torch_or_trio(library: str) -> None:
    seam = LIBRARY_SEAMS[library]
    for module in _modules():
        if module == seam or (library, module) in LIBRARY_EXEMPT or module.startswith("_cli/"):
            continue  # the command line only lists the optional packages it finds
        found = library_lookups((PACKAGE / module).read_text(), library)
        assert not found, (
            f"cudafut/{module} reaches {library} itself; add a function to cudafut/{seam} and call "
            "it:\n  " + "\n  ".join(found)
        )
    assert library_lookups((PACKAGE / seam).read_text(), library), f"{seam} no longer finds {library}"
    assert {m for _, m in LIBRARY_EXEMPT} <= set(_modules()), "an exempt module moved or went"


@pytest.mark.parametrize(
    "source",
    [
        "import trio",
        "from torch.distributed import TCPStore",
        "sys.modules.get('torch')",
        "sys.modules['trio']",
    ],
)
def test_the_check_sees_each_way_to_reach_torch_or_trio(source: str) -> None:
    assert library_lookups(source, "torch") or library_lookups(source, "trio"), source


# -- the seam's functions: CUDA's calls, with CUDA's arguments ----------------------------


class _Recorder:
    """Stands for CuPy's runtime (or an NCCL communicator): records each call."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answers = answers or {}

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            answer = self.answers.get(name)
            return answer(*args) if callable(answer) else answer

        return call


class _StatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


def test_the_seams_copies_and_pinned_memory_call_cuda_with_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt = _Recorder({"hostAlloc": 0x1000, "pointerGetAttributes": types.SimpleNamespace(type=1)})
    monkeypatch.setattr(_backend.current, "runtime", lambda: rt)
    _backend.current.memcpy_to_device(10, 20, 30, 40)
    _backend.current.memcpy_to_host(11, 21, 31, 41)
    assert _backend.current.host_alloc(4096) == 0x1000
    _backend.current.free_host(0x1000)
    _backend.current.event_synchronize(7)
    _backend.current.stream_synchronize(8)
    assert _backend.current.pointer_is_pinned(0x1000)
    assert rt.calls == [
        ("memcpyAsync", (10, 20, 30, 1, 40)),  # cudaMemcpyHostToDevice
        ("memcpyAsync", (11, 21, 31, 2, 41)),  # cudaMemcpyDeviceToHost
        ("hostAlloc", (4096, 1)),  # cudaHostAllocPortable
        ("freeHost", (0x1000,)),
        ("eventSynchronize", (7,)),
        ("streamSynchronize", (8,)),
        ("pointerGetAttributes", (0x1000,)),
    ]
    rt.answers["pointerGetAttributes"] = types.SimpleNamespace(type=0)  # cudaMemoryTypeUnregistered
    assert not _backend.current.pointer_is_pinned(0x2000)

    def refuse(*args: Any) -> Any:
        raise _StatusError(2)

    rt.answers["pointerGetAttributes"] = rt.answers["hostAlloc"] = refuse
    assert not _backend.current.pointer_is_pinned(0x3000)  # unknown to CUDA: pageable
    with pytest.raises(cudafut.CudaError) as info:
        _backend.current.host_alloc(4096)
    assert info.value.code == 2


def test_the_nccl_seam_calls_nccl_with_its_arguments() -> None:
    raw = _Recorder()
    comm = _nccl.Communicator(raw)
    comm.all_reduce(1, 2, 3, 7, 0, 9)
    comm.all_gather(1, 2, 3, 7, 9)
    comm.reduce_scatter(1, 2, 3, 7, 4, 9)
    comm.broadcast(1, 1, 3, 7, 0, 9)
    comm.reduce(1, 1, 3, 7, 2, 1, 9)
    comm.send(1, 3, 7, 1, 9)
    comm.recv(2, 3, 7, 0, 9)
    comm.check_async_error()
    comm.destroy()
    comm.abort()
    assert raw.calls == [
        ("allReduce", (1, 2, 3, 7, 0, 9)),
        ("allGather", (1, 2, 3, 7, 9)),
        ("reduceScatter", (1, 2, 3, 7, 4, 9)),
        ("broadcast", (1, 1, 3, 7, 0, 9)),
        ("reduce", (1, 1, 3, 7, 2, 1, 9)),
        ("send", (1, 3, 7, 1, 9)),
        ("recv", (2, 3, 7, 0, 9)),
        ("check_async_error", ()),
        ("destroy", ()),
        ("abort", ()),
    ]


# -- a test fakes the seam itself: the staged copies on the CPU ----------------------------


def _memmove(dst: int, src: int, nbytes: int, stream: int) -> None:
    ctypes.memmove(dst, src, nbytes)  # under the fake, device memory is host memory


@pytest.mark.parametrize("pinned_stages", [True, False], ids=["staged", "past-the-pinned-limit"])
def test_staged_copies_run_through_the_seam_alone(pinned_stages: bool) -> None:
    host = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    device = np.zeros_like(host)  # "device" memory: the fake's arrays are NumPy's
    back = np.zeros_like(host)
    chunk = 4096
    with testing.fake_cuda(auto_complete=True), pytest.MonkeyPatch.context() as mp:
        for name in ("memcpy_to_device", "memcpy_to_host"):
            mp.setattr(_backend.current, name, _memmove)
        for name in ("event_synchronize", "stream_synchronize"):
            mp.setattr(_backend.current, name, lambda handle: None)
        stream = int(_backend.current.current_stream(0).ptr)

        def stages() -> list[Any]:
            if not pinned_stages:
                return [None, None]
            made = []
            for _ in range(2):
                block = np.empty(chunk, np.uint8)
                holder = types.SimpleNamespace(
                    allocation=types.SimpleNamespace(ptr=block.ctypes.data), guard=None
                )
                made.append((block, holder))
            return made

        _copies._stage_in(_copies._pieces(host, chunk), stages(), stream, 0, device.ctypes.data)
        np.testing.assert_array_equal(device, host)
        _copies._stage_out(_copies._pieces(back, chunk), stages(), stream, 0, device.ctypes.data)
        np.testing.assert_array_equal(back, host)
