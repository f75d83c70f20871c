"""``python -m cudafut``: check this machine, then measure cudafut on its GPU.

``python -m cudafut bench`` runs the full benchmark suite of a source
checkout (benchmarks/, see :mod:`.bench`); ``python -m cudafut --help`` says
the rest. The self-check is :mod:`.selfcheck`, the measuring :mod:`.headline`;
``cudafut/__main__.py`` only calls :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_CLI_EXTRA = "pip install 'cudafut[cli]'"

_DESCRIPTION = """\
Check this machine for cudafut, then measure cudafut on its GPU.

First a self-check: the NVIDIA driver and the CUDA version it supports, CuPy
and the CUDA it was built for, each device (name, memory, compute
capability), the optional packages (torch, trio, uvloop, NCCL through CuPy,
nvtx), whether waiters can sleep on a timerfd, and the wait policy in force.
Without a usable GPU it says what is missing and how to fix it, and exits
with status 1.

Then a benchmark of about 20 seconds (--quick: about 5), each figure next to
a baseline measured in the same run, on GPU 0 (set CUDA_VISIBLE_DEVICES to
pick another):

  waking up   GPU work of an exact duration, short (50 us), long (20 ms) and
              varying (random, 0.1-5 ms), learnt finished by: the floor
              (launch + stream.synchronize(), spinning), `await` of a cudafut
              future, and a thread blocked on a blocking-sync event
              (cupy.cuda.Event(block=True), event.synchronize() through
              loop.run_in_executor). Reported: the median lateness after the
              work's duration, await's and the thread's over the floor's
              (extra us), await's over the thread's (ratio; under 1: await
              wakes sooner), and the process CPU time over wall time of each.
  copies      64 MB between pinned host memory (cudafut.empty_pinned) and the
              GPU: cudafut.to_device(pinned) and to_host(dev, out=pinned)
              against raw cudaMemcpyAsync + stream.synchronize(), in GB/s of
              the median copy, and their ratio.

The results are a table and a plot (PNG, its path printed) in --out. A
progress bar and the plot need the `cli` extra (rich, matplotlib):
pip install 'cudafut[cli]'; without it, progress is plain lines and the plot
is skipped, with a note.

Exit status: 0 measured; 1 no usable GPU (or CuPy cannot compile a kernel);
2 bad arguments.
"""

_EPILOG = """\
python -m cudafut bench [--help | options]
  the full benchmark suite (every section, against the peers; minutes), from
  benchmarks/ of a source checkout; writes JSON, Markdown and plots.
"""


_NEEDS = (
    "python -m cudafut needs an NVIDIA GPU (with its driver, and CuPy built for the driver's CUDA): "
    "it checks the GPU, then measures cudafut on it."
)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m cudafut`` (``bench`` aside)."""
    p = argparse.ArgumentParser(
        prog="python -m cudafut",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a benchmark of about 5 s instead of 20 s")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (self-check and results) and nothing else on stdout "
        "(progress still goes to stderr)",
    )
    p.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="folder for the plot, created if missing (default: the current directory)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument(
        "--policy",
        choices=("balanced", "low_latency", "low_cpu"),
        default=None,
        help="the wait policy to measure under (default: the one in force, 'balanced')",
    )
    p.add_argument("--check-only", action="store_true", help="the self-check alone, no benchmark")
    return p


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _progress(total: int, fancy: bool) -> Iterator[Callable[[str], None]]:
    """``step(what)``, to call as each part starts: a rich progress bar on
    stderr if ``fancy``, otherwise one plain line per part."""
    if fancy:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("starting", total=total)
            started = False

            def fancy_step(what: str) -> None:
                nonlocal started
                if started:
                    bar.advance(task)
                started = True
                bar.update(task, description=what)

            yield fancy_step
            bar.update(task, completed=total)
        return
    t0 = time.perf_counter()
    done = 0

    def plain_step(what: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done:2d}/{total}] {time.perf_counter() - t0:5.1f}s  {what}", file=sys.stderr, flush=True)

    yield plain_step


def _print_tables(results: dict[str, Any], fancy: bool) -> None:
    from . import headline

    if fancy:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        console = Console() if sys.stdout.isatty() else Console(width=130)
        for title, headers, rows in headline.tables(results):
            table = Table(*headers, title=title, title_justify="left", box=box.SIMPLE_HEAD)
            for column, right in zip(table.columns, headline.numeric_columns(headers, rows), strict=True):
                column.justify = "right" if right else "left"
            for row in rows:
                table.add_row(*row)
            console.print(table)
        return
    for title, headers, rows in headline.tables(results):
        print()
        print("\n".join(headline.plain_table(title, headers, rows)))


def _fail(doc: dict[str, Any], as_json: bool, reason: str, fix: list[str]) -> int:
    doc["ok"] = False
    doc["error"] = {"reason": reason, "fix": fix}
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        from . import selfcheck

        lines = [_NEEDS, *selfcheck.failure_lines(reason, fix), *selfcheck.WITHOUT_A_GPU]
        print("\n" + "\n".join(lines), file=sys.stderr)
    return 1


def run(argv: list[str]) -> int:
    """The main job: the self-check, then the headline benchmark (see
    ``python -m cudafut --help``); the exit status."""
    args = parser().parse_args(argv)
    from .. import __version__, set_wait_policy
    from .._errors import CudaUnavailableError
    from . import headline, selfcheck

    if args.policy is not None:
        set_wait_policy(args.policy)
    doc: dict[str, Any] = {
        "cudafut": __version__,
        "ok": True,
        "error": None,
        "selfcheck": None,
        "results": None,
        "plot": None,
        "notes": [],
    }
    check = selfcheck.gather()
    doc["selfcheck"] = check
    if not args.json:
        print("\n".join(selfcheck.lines(check)), flush=True)
    if not check["usable"]:
        return _fail(doc, args.json, check["problem"] or "CUDA is unusable", check["fix"])
    if args.check_only:
        if args.json:
            print(json.dumps(doc, indent=1))
        return 0

    rich_ok, plot_ok = _have("rich"), _have("matplotlib")
    missing = [name for name, ok in (("rich", rich_ok), ("matplotlib", plot_ok)) if not ok]
    if missing:
        what = "a progress bar" if plot_ok else ("a plot" if rich_ok else "a progress bar and a plot")
        note = f"for {what}, {_CLI_EXTRA} ({' and '.join(missing)} missing)"
        doc["notes"].append(note)
        print(f"note: {note}", file=sys.stderr)
    pol = check["policy"]["name"] or "custom"
    print(
        f"Measuring for about {headline.planned_seconds(args.quick):.0f} s (policy {pol})"
        f"{'' if args.quick else '; --quick: about a quarter'}...",
        file=sys.stderr,
        flush=True,
    )
    try:
        with _progress(headline.steps(), rich_ok and sys.stderr.isatty()) as step:
            results = headline.run(args.quick, step)
    except CudaUnavailableError as exc:
        return _fail(doc, args.json, str(exc), [])
    doc["results"] = results
    if not args.no_plot and plot_ok:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        dev = results["device"]
        title = f"cudafut {__version__} on {dev['name']} (GPU {dev['index']}), wait policy {pol}"
        path = headline.plot(results, out / headline.plot_name(results), title)
        doc["plot"] = str(path.resolve())
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_tables(results, rich_ok)
        if doc["plot"]:
            print(f"\nplot: {doc['plot']}")
    return 0


def main(argv: list[str]) -> int:
    """``python -m cudafut [options]`` (see :func:`run`), or ``python -m
    cudafut bench [options]``: the benchmark suite of a source checkout."""
    if argv and argv[0] == "bench":
        from .bench import bench

        return bench(argv[1:])
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
