"""The hot path's Python work does not grow unnoticed (CPU, fake GPU).

``benchmarks/calls.py`` counts, on cudafut.testing's fake GPU, the Python
calls cudafut makes per operation and the objects each pending await keeps
for the garbage collector. The counts are nearly deterministic (the
watcher thread's share varies by a fraction of a call), so this holds them
under budgets: today's counts (Python 3.11-3.13 agree within a call or two).
A change that adds work to the hot path fails here; if the work is wanted,
measure its cost on a GPU (``python -m cudafut bench --only host --only
many``) and raise the budget in the same change. A change that saves calls
lowers the budget, so that the saving stays.

Counts, not timings: no assertion here depends on the machine's speed.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import calls
from cudafut import _compiled

#: cudafut's own Python calls per operation, at most: (native core, pure
#: core). The native core's event records make no Python call of their own.
CALL_BUDGETS = {
    # A dropped pending future hands its value to the watcher thread (no
    # query in a finalizer): the counts vary by a fraction with its timing.
    ("single", "record(x, stream=s)"): (8, 27),
    ("single", "result() of done work"): (13, 14),
    ("single", "then() per link, on done work"): (20, 53),
    ("single", "await of done work"): (8, 11),
    # Python 3.12 counts this one a call or two higher than 3.11 under pytest.
    ("concurrent", "cudafut await (record on a stream, completed in bulk)"): (23, 53),
}

#: Objects tracked by the garbage collector per pending await, over what a
#: plain asyncio future's await keeps (its task, coroutine, future...):
#: (native core, pure core), the fake's events (the driver's, on a GPU) left
#: out, counted with the collector off. The native core's: the future's lock
#: and its records' tuple, and a tuple of ints that a collection untracks
#: (at most 3, the bound issue 46 set); the pure core's also the event
#: record and its stream key (the native core's records are not tracked).
#: A hundredth or so above the whole number is the loop's own bookkeeping.
GC_OBJECTS_OVER_PLAIN = (3.1, 5.1)

NATIVE = _compiled.native() is not None

PLAIN = "peer: plain asyncio futures, set in bulk"
CONCURRENT = "cudafut await (record on a stream, completed in bulk)"


@pytest.fixture(scope="module")
def counts() -> dict[str, Any]:
    # 2,000 awaits: the loop's own dozen objects, and any a thread left from
    # an earlier test makes meanwhile, count for a hundredth of one per await.
    return calls.measure(n=2000)


@pytest.mark.parametrize(("part", "operation"), list(CALL_BUDGETS))
def test_cudafut_calls_per_operation_stay_within_budget(
    counts: dict[str, Any], part: str, operation: str
) -> None:
    got = counts[part][operation]["cudafut calls"]
    budget = CALL_BUDGETS[part, operation][0 if NATIVE else 1]
    assert got <= budget, (
        f"{operation}: {got} cudafut calls per operation, over its budget of {budget}: measure the "
        "added work on a GPU and raise the budget in tests/test_calls.py if it is wanted"
    )


def test_a_pending_await_keeps_few_objects_for_the_collector(counts: dict[str, Any]) -> None:
    mine = counts["concurrent"][CONCURRENT]["gc objects per pending await"]
    plain = counts["concurrent"][PLAIN]["gc objects per pending await"]
    assert mine - plain <= GC_OBJECTS_OVER_PLAIN[0 if NATIVE else 1], (mine, plain)


def test_the_plain_asyncio_peer_makes_no_cudafut_call(counts: dict[str, Any]) -> None:
    # The counter tells cudafut's frames from the rest: the peers make none.
    assert counts["concurrent"][PLAIN]["cudafut calls"] == 0
    assert counts["single"]["peer: asyncio future create + set + await"]["cudafut calls"] == 0
    mine = counts["concurrent"][CONCURRENT]
    assert mine["cudafut calls"] > 0


def test_the_markdown_has_a_row_per_operation(counts: dict[str, Any]) -> None:
    text = "\n".join(calls.markdown(counts))
    for part in ("single", "concurrent"):
        for operation in counts[part]:
            assert f"| {operation} |" in text


def test_the_command_line_writes_json(tmp_path: Any) -> None:
    out = tmp_path / "calls.json"
    assert calls.main(["-n", "20", "--json", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("{")
    with pytest.raises(SystemExit):
        calls.main(["-n", "0"])
