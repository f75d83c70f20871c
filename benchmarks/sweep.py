"""Section ``sweep``: await on repeating work of 2 and 20 ms for a range of
``WaitPolicy(cpu_budget=...)``: the latency / CPU trade-off the policy offers.

The JSON only (docs/performance.md tabulates it): no table, no plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cudafut import WaitPolicy

from .support.common import Progress, quantiles, with_policy
from .wake import REPS, floor, run_async, s_cudafut_await

NAME = "sweep"

SWEEP_MS = [2.0, 20.0]
SWEEP_BUDGETS = [0.0, 0.01, 0.02, 0.05, 0.1, 0.2]

FLOOR_P50 = "floor_p50_us"


def steps(quick: bool) -> int:
    return len(SWEEP_MS) * len(SWEEP_BUDGETS)


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    """Await on repeating work of 2 and 20 ms for a range of ``cpu_budget``:
    the latency / CPU trade-off the policy offers."""
    out: dict[str, Any] = {}
    for ms in SWEEP_MS:
        ns = int(ms * 1e6)
        n = max(20, REPS[ms] // (5 if quick else 1))
        base = quantiles(floor(ns, n)[0])
        row: dict[str, Any] = {FLOOR_P50: base["p50_us"]}
        for budget in SWEEP_BUDGETS:
            pol = WaitPolicy(cpu_budget=budget)
            samples, cpu = with_policy(pol, run_async, s_cudafut_await, ns, n)
            q = quantiles(samples)
            row[f"{budget}"] = {
                "extra_p50_us": q["p50_us"] - base["p50_us"],
                "extra_p99_us": q["p99_us"] - base["p99_us"],
                "cpu_per_wall": cpu,
            }
            extra = row[f"{budget}"]["extra_p50_us"]
            progress.step(f"sweep {ms} ms, cpu_budget {budget}: +{extra:.1f} us, cpu {cpu:.3f}")
        out[f"{ms}"] = row
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    return []


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    return []
