"""The ``vary`` benchmark's patterns under variants of the default waiter,
alternated in one process beside the blocked thread and the waiters told
each duration (benchmarks/vary.py): an A/B of a change to the waiter's
rules, on the GPU.

    python scripts/waiter-variants.py [--rounds 3] > out.txt

Variants (a policy, and the cap on the warm-up spin, ``_policy._WARM_S``,
set in turn for each; both cores' pacers read it):

* A: the waiter before notices for predicted work and the 0.4 ms cap:
  ``WaitPolicy(predicted_sleep_s=0)``, warm-up up to 2 ms;
* B: notices for a lone stream's predicted work, warm-up up to 2 ms;
* C: the default (B with the warm-up up to 0.4 ms);
* D: B with ``cpu_budget=0.02``.

Each line: extra p50 / p90 / max over the floor in µs, and CPU / wall over
all rounds, then that CPU over the blocked thread's; ``OK`` where p50 and
p90 are no later than the thread's and CPU at most 1.5x its.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import vary
from benchmarks.support.common import Progress
from cudafut import WaitPolicy, _compiled, _policy

VARIANTS = {
    "A: before (no notices for predicted work, warm-up up to 2 ms)": (
        WaitPolicy(predicted_sleep_s=0.0),
        2e-3,
    ),
    "B: notices for predicted work, warm-up up to 2 ms": (WaitPolicy(), 2e-3),
    "C: the default (notices, warm-up up to 0.4 ms)": (WaitPolicy(), 0.4e-3),
    "D: notices, cpu_budget 0.02, warm-up up to 2 ms": (WaitPolicy(cpu_budget=0.02), 2e-3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the whole result here too")
    args = parser.parse_args()
    native = _compiled.native()
    default_warm = _policy._WARM_S
    inner = vary._strategy

    def set_warm(warm: float) -> None:
        _policy._WARM_S = warm  # type: ignore[misc]
        if native is not None:
            native.bind_policy(_policy)

    def strategy(name: str, gpu: Any, pool: Any) -> Any:
        run = inner(name, gpu, pool)
        warm = VARIANTS[name][1] if name in VARIANTS else default_warm

        def wrapped(*a: Any) -> Any:
            set_warm(warm)
            try:
                return run(*a)
            finally:
                set_warm(default_warm)

        return wrapped

    vary._PRESETS.update({name: policy for name, (policy, _warm) in VARIANTS.items()})
    vary._strategy = strategy  # type: ignore[assignment]
    vary._rounds = lambda quick: args.rounds  # type: ignore[assignment]
    vary.STRATEGIES = (*VARIANTS, vary.THREAD, vary.TOLD[0.0], vary.TOLD[0.2e-3], vary.LOW_LATENCY)
    vary.BALANCED = next(iter(VARIANTS))
    result = vary.run(Progress(10**6), quick=False)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for pattern, layouts in result["patterns"].items():
        for layout, rows in layouts.items():
            th = rows[vary.THREAD]
            print(
                f"== {pattern} [{layout}] thread {th['extra_p50_us']:.0f}/{th['extra_p90_us']:.0f} "
                f"cpu {th['cpu_per_wall']:.3f}"
            )
            for name in vary.STRATEGIES:
                r = rows[name]
                ok = (
                    r["extra_p50_us"] <= th["extra_p50_us"]
                    and r["extra_p90_us"] <= th["extra_p90_us"]
                    and r["cpu_per_wall"] <= 1.5 * th["cpu_per_wall"]
                )
                mark = "OK" if ok else "  "
                print(
                    f"  {mark} {name[:40]:40s} {r['extra_p50_us']:6.0f} {r['extra_p90_us']:6.0f} "
                    f"{r['extra_max_us']:6.0f}  cpu {r['cpu_per_wall']:.3f} "
                    f"({r['cpu_per_wall'] / th['cpu_per_wall']:.2f}x)"
                )


if __name__ == "__main__":
    main()
