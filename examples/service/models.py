"""The models the service serves: torchvision networks in fp16, with random weights.

``Served(name)`` builds ``resnet50`` or ``vit_b_16`` (the same weights in
every process: the seed is fixed), and a bank of ``IMAGES`` random 224x224
RGB images kept on the GPU; a request names an image by its index. What the
figures leave out, so: decoding an upload and copying it to the GPU (about
6 µs per image for the copy).

``answer(indices)`` runs the model on those images, on the current stream,
and returns the top ``TOP`` logits and their classes of each, as one
``(n, 2 * TOP)`` float32 CPU tensor in pinned memory, copied without
waiting (``non_blocking``): the work is only enqueued when ``answer``
returns, so it runs under :func:`cudafut.launch` (or before a
``synchronize()``). ``answer_graphed`` does the same with the model
replayed from captured CUDA graphs (:func:`cudafut.graphed`), one per
bucket of ``BUCKETS``.

:func:`reference` computes every image's logits eagerly, one image at a
time, and :func:`check` compares an answer with them; the load generator
checks every answer it gets.

:func:`missing` is the one line each script of this folder exits with when
a package it needs is not installed.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

import cudafut

#: What installs the service example's packages (pyproject.toml's `service` extra).
SERVICE_EXTRA = "pip install 'cudafut[service]', or pip install -e '.[service]' in a checkout"

MODELS = ("resnet50", "vit_b_16")
IMAGES = 256
SIZE = 224
TOP = 5
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SEED = 20261125
# ImageNet's normalisation, as torchvision's transforms apply it.
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


#: What a server answers (400) to a request that names no bank image.
BAD_REQUEST = f'send {{"i": k}} with 0 <= k < {IMAGES}'

#: The servers' ``--wait-policy`` choices: cudafut's presets, and ``polls``
#: for timed polls without CUDA notices (to compare).
WAIT_POLICIES = ("balanced", "low_latency", "low_cpu", "polls")


def use_wait_policy(name: str) -> None:
    """Set this process's wait policy by its ``--wait-policy`` name (an
    unknown name: :func:`cudafut.set_wait_policy`'s ValueError)."""
    cudafut.set_wait_policy(cudafut.WaitPolicy(notify=False) if name == "polls" else cast(Any, name))


def image_index(body: object) -> int | None:
    """The bank image a request's JSON body ``{"i": k}`` names, or None
    where it names none (the servers answer :data:`BAD_REQUEST`)."""
    k = body.get("i") if isinstance(body, dict) else None
    return k if type(k) is int and 0 <= k < IMAGES else None


def require_model_packages(what: str) -> None:
    """Exit with one line (:func:`missing`) if PyTorch or torchvision is not
    installed; ``what`` names the script (and mode) that needs them."""
    import importlib

    for module in ("torch", "torchvision"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            how = "pip install torch torchvision, the build for your CUDA (https://pytorch.org)"
            raise SystemExit(missing(what, module, exc, how)) from None


def missing(script: str, what: str, exc: ImportError, install: str = SERVICE_EXTRA) -> str:
    """The one line ``script`` exits with (``sys.exit(missing(...))``: status 1,
    no traceback) when importing ``what`` failed with ``exc``."""
    name = getattr(exc, "name", None) or what
    why = "not installed" if name.split(".")[0] == what.split(".")[0].lower() else f"it needs {name}"
    return f"{script} needs {what} ({why}): {install}"


def image_bank(n: int = IMAGES) -> np.ndarray[Any, Any]:
    """``n`` random uint8 images, (n, 224, 224, 3), the same in every process."""
    return np.random.default_rng(SEED).integers(0, 256, size=(n, SIZE, SIZE, 3), dtype=np.uint8)


class Served:
    """A torchvision model on the GPU, ready to answer requests (see the module)."""

    def __init__(self, name: str, *, graphs: bool = False) -> None:
        import torch
        import torchvision

        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
        self.torch = torch
        self.name = name
        torch.manual_seed(SEED)
        self.net = getattr(torchvision.models, name)(weights=None).eval().cuda().half()
        self.bank = torch.from_numpy(image_bank()).cuda()
        self.mean = torch.tensor(_MEAN, device="cuda", dtype=torch.half).view(1, 3, 1, 1)
        self.std = torch.tensor(_STD, device="cuda", dtype=torch.half).view(1, 3, 1, 1)
        self.graphed: cudafut.Graphed | None = None
        if graphs:
            self.graphed = cudafut.graphed(
                self.logits,
                buckets=BUCKETS,
                example=lambda n: torch.zeros((n, SIZE, SIZE, 3), dtype=torch.uint8, device="cuda"),
            )
            self.graphed.capture()
        torch.cuda.synchronize()

    def logits(self, images: Any) -> Any:
        """The logits (n, 1000), fp16, of uint8 images (n, 224, 224, 3) on the GPU."""
        torch = self.torch
        with torch.inference_mode():
            x = images.permute(0, 3, 1, 2).half().div_(255).sub_(self.mean).div_(self.std)
            return self.net(x)

    def _top(self, logits: Any) -> Any:
        torch = self.torch
        with torch.inference_mode():
            values, classes = torch.topk(logits.float(), TOP, dim=1)
            return torch.cat([values, classes.float()], dim=1).to("cpu", non_blocking=True)

    def _images(self, indices: list[int]) -> Any:
        # From pinned memory: a copy from pageable memory would first wait
        # for everything queued on this stream (the previous batch).
        if isinstance(indices, np.ndarray):  # multiproc.py's batches: torch pins no tensor made from NumPy
            indices = indices.tolist()
        idx = self.torch.tensor(indices, dtype=self.torch.int64, pin_memory=True).to(
            "cuda", non_blocking=True
        )
        return self.bank.index_select(0, idx)

    def answer(self, indices: list[int]) -> Any:
        """Top classes of the images ``indices``, eagerly (see the module)."""
        return self._top(self.logits(self._images(indices)))

    def answer_graphed(self, indices: list[int]) -> Any:
        """As :meth:`answer`, replaying the captured graph of the batch's bucket."""
        assert self.graphed is not None, "Served(graphs=True) captures the graphs"
        return self._top(self.graphed(self._images(indices)))

    def answer_on_gpu(self, indices: list[int]) -> Any:
        """As :meth:`answer_graphed` (or :meth:`answer` without graphs), the
        answer left on the GPU: ``(n, 2 * TOP)`` float32, for a process that
        hands it to another (multiproc.py: a shared future's value)."""
        torch = self.torch
        images = self._images(indices)
        logits = self.graphed(images) if self.graphed is not None else self.logits(images)
        with torch.inference_mode():
            values, classes = torch.topk(logits.float(), TOP, dim=1)
            return torch.cat([values, classes.float()], dim=1)


def reference(name: str) -> np.ndarray[Any, Any]:
    """Every bank image's logits (IMAGES, 1000), float32: the model run
    eagerly on one image at a time, synchronised."""
    served = Served(name)
    torch = served.torch
    rows = [served.logits(served.bank[i : i + 1]).float().cpu().numpy()[0] for i in range(IMAGES)]
    torch.cuda.synchronize()
    return np.stack(rows)


def top_of(logits: np.ndarray[Any, Any]) -> list[float]:
    """An answer computed from reference logits: what a correct server returns."""
    classes = np.argsort(-logits)[:TOP]
    return [float(logits[c]) for c in classes] + [float(c) for c in classes]


def tolerance(ref: np.ndarray[Any, Any]) -> float:
    """How far an fp16 answer may be from the eager batch-1 logits: the
    kernels differ with the batch size (1 % of the largest logit)."""
    return 0.01 * float(np.abs(ref).max()) + 1e-3


def check(answer: list[float], ref_row: np.ndarray[Any, Any], tol: float) -> bool:
    """Whether ``answer`` (TOP logits, then their classes) is right for the
    image whose reference logits are ``ref_row``: each logit matches the
    reference's for its class, and the classes are among the reference's
    best (ties within the tolerance allowed)."""
    if len(answer) != 2 * TOP:
        return False
    values, classes = answer[:TOP], answer[TOP:]
    kth = float(np.sort(ref_row)[-TOP])
    for value, cls in zip(values, classes, strict=True):
        c = int(cls)
        if c != cls or not 0 <= c < ref_row.shape[0] or not math.isfinite(value):
            return False
        if abs(value - float(ref_row[c])) > tol or float(ref_row[c]) < kth - 2 * tol:
            return False
    return True
