"""What the benchmark sections share and what needs no CuPy: the registry of
sections, progress lines, the wait-policy switch, statistics, CPU metering.

Importing this (or a section module) needs neither CuPy nor a GPU, so that
``python -m benchmarks.support.report`` redraws a committed JSON anywhere; GPU helpers
(kernels, streams) are in ``gpu.py``, which sections import inside ``run()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

from cudafut import WaitPolicy, set_wait_policy

#: The sections, in the order in which they run and appear in the report: one
#: module each, ``benchmarks/<name>.py``, with the interface of ``Section``.
SECTIONS = (
    "wake",
    "sweep",
    "vary",
    "many",
    "host",
    "batcher",
    "shared",
    "copies",
    "pipeline",
    "tracing",
    "tracking",
    "collectives",
    "serve",
)

#: JSON keys older results used for a section, newest last: report.py reads
#: committed JSON written before a section had its own module.
LEGACY_KEYS: dict[str, tuple[str, ...]] = {"many": ("many_awaits",)}

# The sections sit one level above this support package: benchmarks/<name>.py.
_SECTIONS_PACKAGE = __name__.rsplit(".", 2)[0]
_SECTIONS_DIR = Path(__file__).resolve().parent.parent

Samples = list[float]


class Section(Protocol):
    """What each ``benchmarks/<name>.py`` module exposes."""

    NAME: str  # the --only name and the JSON key

    def steps(self, quick: bool) -> int:
        """How many ``progress.step()`` calls ``run()`` makes."""
        ...

    def run(self, progress: Progress, quick: bool) -> dict[str, Any]:
        """Measure (needs CuPy and a GPU); the result is stored under ``NAME``."""
        ...

    def markdown(self, result: dict[str, Any]) -> list[str]:
        """This section's lines of the Markdown report (no CuPy)."""
        ...

    def plots(self, result: dict[str, Any], out: Path, stem: str) -> list[Path]:
        """Write this section's PNGs into ``out`` (no CuPy); the paths written."""
        ...


def section(name: str) -> Section:
    """Import ``benchmarks/<name>.py``; a clear error if it is not there or
    lacks the interface."""
    if name not in SECTIONS:
        raise ValueError(f"unknown benchmark section {name!r}; the sections are {', '.join(SECTIONS)}")
    full = f"{_SECTIONS_PACKAGE}.{name}"
    try:
        module: ModuleType = importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise  # the module is there but one of its imports is not
        raise ModuleNotFoundError(
            f"benchmark section {name!r} is registered but {_SECTIONS_DIR / (name + '.py')} does not exist",
            name=full,
        ) from exc
    missing = [attr for attr in ("NAME", "steps", "run", "markdown", "plots") if not hasattr(module, attr)]
    if missing or name != module.NAME:
        raise TypeError(
            f"{full} does not implement a benchmark section: "
            + (f"it lacks {', '.join(missing)}" if missing else f"its NAME is {module.NAME!r}")
        )
    return cast(Section, module)


#: examples/service: the serving example, whose helpers some sections reuse.
SERVICE = _SECTIONS_DIR.parent / "examples" / "service"


def service_module(name: str) -> ModuleType:
    """The module ``name`` of examples/service (the folder put on the path):
    its ``pauses`` recorder, its servers, its comparison driver."""
    if str(SERVICE) not in sys.path:
        sys.path.insert(0, str(SERVICE))
    return importlib.import_module(name)


def error_line(exc: BaseException) -> str:
    """``exc`` and the last three frames of its traceback on one line: what a
    section stores in its JSON for a part that failed."""
    return (
        "".join(traceback.format_exception_only(type(exc), exc)).strip()
        + " | "
        + "".join(traceback.format_tb(exc.__traceback__)[-3:]).replace("\n", " ")
    )


def stored(results: dict[str, Any], name: str) -> Any:
    """A section's result in a whole-run JSON, under its name or an older key."""
    for key in (name, *LEGACY_KEYS.get(name, ())):
        if key in results:
            return results[key]
    return None


class Result(dict[str, Any]):
    """A section's result as report.py hands it to ``markdown()`` and
    ``plots()``: the JSON dict itself, with the run's ``meta`` (GPU name,
    versions) as an attribute, for titles."""

    def __init__(self, data: dict[str, Any], meta: dict[str, Any]) -> None:
        super().__init__(data)
        self.meta = meta


def meta_of(result: dict[str, Any]) -> dict[str, Any]:
    """The run's meta that report.py attached to ``result`` ({} if none)."""
    return result.meta if isinstance(result, Result) else {}


class Progress:
    """One status line per step on stderr, with the time spent so far."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        print(f"[{self.done:3d}/{self.total}] {elapsed:6.1f}s  {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def policy(p: WaitPolicy | str) -> Iterator[None]:
    """The default wait policy set to ``p`` for the block."""
    old = set_wait_policy(p)  # type: ignore[arg-type]
    try:
        yield
    finally:
        set_wait_policy(old)


def with_policy(pol: WaitPolicy | str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under the wait policy ``pol``."""
    with policy(pol):
        return fn(*args)


class Ticker:
    """A task that sleeps 1 ms at a time and records how late each wake-up
    comes, in seconds: the event loop's stalls while it runs. :meth:`start`
    it in a running loop, read or clear :attr:`late`, then ``await``
    :meth:`stop`."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stopped = False
        self._task: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self._stopped:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.late.append(time.perf_counter() - t0 - 0.001)

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            await self._task


def stall_ms(samples: list[float], q: float | None = None) -> float:
    """The longest of ``samples`` (seconds), or their ``q``-th percentile,
    in ms to the µs; 0 without samples."""
    if not samples:
        return 0.0
    import numpy as np

    value = max(samples) if q is None else float(np.percentile(samples, q))
    return round(value * 1e3, 3)


def quantiles(samples: list[float]) -> dict[str, float]:
    """p50 / p99 / mean in µs."""
    s = sorted(samples)
    return {
        "p50_us": s[len(s) // 2] * 1e6,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "mean_us": statistics.fmean(s) * 1e6,
        "n": len(s),
    }


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """The wall time of each of ``n`` calls of ``fn``, in seconds."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class CpuMeter:
    """Process CPU seconds over wall seconds for a block."""

    def __enter__(self) -> CpuMeter:
        self.c0, self.t0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.ratio = self.cpu / self.wall


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None without matplotlib
    (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are optional
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
