"""The native pacer (cudafut/_core.pyx's ``Pacer``) against its pure-Python
reference (cudafut/_policy.py's ``Pacer``), in one process: random programs
run on both over the same predictor histories and policy, and after every
step each must have returned the same, to the bit, and be in the same state.

A program sets a policy (spins of 0, 100 µs and infinity, prediction and
notices on and off), fills the duration predictor with histories (points
from a few durations, exact or not, modes found or still to find, the
newest one a surprise or not, work started before or after the last
completion), then calls ``new_wait``, ``sleeping_until``, ``woke``,
``interrupted``, ``retract``, ``margin`` and ``next_poll`` (over some of the streams,
with and without an ``arm`` whose answers the program gives) at times
around the learnt windows, alone or as a sleeper's run of polls. Compared after each step: what it returned,
``spin_until``, ``spin_ends``, the back-off, the lateness history and its
summaries, and the records ``arm`` was asked about, in order.

The reference class is rebuilt from _policy.py's source: where the native
core runs, ``cudafut._policy`` rebinds ``Pacer`` to the native one at
import. Its definition runs in a copy of the module's namespace (the same
predictor, logger and functions), whose ``_policy`` this test sets beside
:func:`cudafut.set_wait_policy`.

Checked to fail on a broken native pacer (scratch builds): the margin's
``min`` taking the later time; the back-off not capped at ``max_sleep_s``;
``next_poll`` not setting ``spin_ends`` to the bound where the spin runs
past it; a plan that finds a stream's modes afresh taking the newest
observation's surprise the wrong way round (the last test; the random one
steps either pacer first, so that each finds modes afresh, and catches it
from about 2,000 programs).

``CUDAFUT_DIFF_EXAMPLES`` programs run (default 200; about a second).
Skipped where the native core does not run (``CUDAFUT_PURE=1``, no current
extension): there is one pacer only.
"""

from __future__ import annotations

import ast
import math
import os
import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cudafut
from cudafut import _compiled, _policy

NATIVE = _compiled.native()
pytestmark = pytest.mark.skipif(
    NATIVE is None, reason=f"the native core does not run here ({_compiled.core()})"
)

EXAMPLES = int(os.environ.get("CUDAFUT_DIFF_EXAMPLES", "200"))


def _reference_pacer() -> Any:
    path = pathlib.Path(_policy.__file__)
    tree = ast.parse(path.read_text(), str(path))
    # ``from __future__ import annotations`` first: annotations stay
    # unevaluated, as in the module.
    body: list[ast.stmt] = [
        node
        for node in tree.body
        if (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        or (isinstance(node, ast.ClassDef) and node.name == "Pacer")
    ]
    assert len(body) == 2, "_policy.py no longer defines Pacer at top level"
    namespace = dict(vars(_policy))  # the module's globals, but its own Pacer
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", dont_inherit=True), namespace)
    namespace["__reference__"] = namespace["Pacer"]
    return namespace


REFERENCE = _reference_pacer()


class Rec:
    """Stands for an event record: what the pacer reads of one."""

    def __init__(self, key: tuple[int, ...], t: float) -> None:
        self.stream_key = key
        self.t = t
        self.seen = 0.0
        self.seq = 1

    def __repr__(self) -> str:
        return f"Rec({self.stream_key}, {self.t})"


T0 = 1000.0
DURATIONS = (0.0, 20e-6, 500e-6, 2e-3, 20e-3)

policies = st.builds(
    cudafut.WaitPolicy,
    spin_s=st.sampled_from((0.0, 100e-6, 1e-3, math.inf)),
    first_sleep_s=st.sampled_from((50e-6, 200e-6)),
    max_sleep_s=st.sampled_from((1e-3, 5e-3)),
    predict=st.booleans(),
    cpu_budget=st.sampled_from((0.0, 0.05, 1.0)),
    notify=st.booleans(),
    notice_sleep_s=st.sampled_from((0.0, 20e-3)),
    predicted_sleep_s=st.sampled_from((0.0, 3e-3, 20e-3)),
)
history = st.tuples(
    st.lists(  # (duration index, jitter, exact)
        st.tuples(st.integers(0, len(DURATIONS) - 1), st.integers(-3, 3), st.booleans()), max_size=12
    ),
    st.booleans(),  # modes found already (else found when the pacer asks)
    st.booleans(),  # the newest observation a surprise
    st.integers(-2, 2),  # when the last completion was, against the record
)
times = st.integers(-50, 30_000).map(lambda us: T0 + us * 1e-6)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("new_wait"), times),
        st.tuples(st.just("sleeping_until"), times),
        st.tuples(st.just("woke"), times),
        st.tuples(st.just("interrupted")),
        st.tuples(st.just("retract")),
        st.tuples(st.just("margin"), st.sampled_from(DURATIONS)),
        st.tuples(
            st.just("next_poll"),
            st.lists(st.integers(0, 3), max_size=4),
            times,
            st.one_of(st.none(), st.lists(st.booleans(), min_size=4, max_size=4)),
        ),
        # A sleeper's run: each poll at the time the last one planned.
        st.tuples(
            st.just("sleeps"), st.lists(st.integers(0, 3), min_size=1, max_size=4), times, st.integers(1, 12)
        ),
    ),
    max_size=40,
)


@contextmanager
def _state(policy: cudafut.WaitPolicy, histories: list[Any]) -> Iterator[list[Rec]]:
    before = cudafut.get_wait_policy()
    cudafut.set_wait_policy(policy)
    REFERENCE["_policy"] = policy
    table = _policy.predictor.histories
    saved = dict(table)
    table.clear()
    recs = []
    try:
        for k, (points, found, surprised, done) in enumerate(histories):
            key = (0, 0x1000 + k)
            rec = Rec(key, T0 + 1e-3 * k)
            recs.append(rec)
            if not points:
                continue  # a stream with no history
            hist = _policy._History(rec.t + done * 1e-4)
            for d, jitter, exact in points:
                hist.points.append((DURATIONS[d] * (1 + jitter * 0.02), exact))
            hist.modes = _policy._find_modes(hist.points) if found else None
            hist.surprised = surprised
            table[key] = hist
        yield recs
    finally:
        table.clear()
        table.update(saved)
        cudafut.set_wait_policy(before)


def _observe(pacer: Any) -> tuple[Any, ...]:
    return (
        pacer.spin_until,
        pacer.spin_ends,
        pacer._backoff,
        pacer._retract,
        pacer._asked,
        list(pacer._lateness),
        pacer._late_median,
    )


def _step(pacer: Any, op: tuple[Any, ...], recs: list[Rec], asked: list[Any]) -> Any:
    name = op[0]
    if name in ("interrupted", "retract"):
        return getattr(pacer, name)()
    if name == "margin":
        return pacer.margin(op[1], cudafut.get_wait_policy())
    if name == "sleeps":
        _, which, now, count = op
        chosen = [recs[i] for i in which if i < len(recs)]
        plans = []
        for _ in range(count):
            now = max(pacer.next_poll(chosen, now), now + 1e-6)
            plans.append(now)
        return plans
    if name == "next_poll":
        _, which, now, answers = op
        chosen = [recs[i] for i in which if i < len(recs)]
        arm = None
        if answers is not None:

            def arm(rec: Rec) -> bool:
                asked.append(rec.stream_key)
                return bool(answers[int(rec.stream_key[1]) % 4])

        return pacer.next_poll(chosen, now, arm)
    return getattr(pacer, name)(op[1])


@settings(max_examples=EXAMPLES, deadline=None)
@given(policies, st.lists(history, min_size=1, max_size=4), ops, st.booleans(), st.booleans())
def test_the_native_pacer_plans_as_its_reference(
    policy: cudafut.WaitPolicy, histories: list[Any], program: list[Any], shared: bool, native_first: bool
) -> None:
    with _state(policy, histories) as recs:
        lateness: Any = None
        if shared:  # as result()'s pacers share one history
            from collections import deque

            lateness = (deque([1e-4, 3e-4, 2e-4], maxlen=32), deque([1e-4, 3e-4, 2e-4], maxlen=32))
        ref = REFERENCE["Pacer"](None if lateness is None else lateness[0], name="reference")
        native = _policy.Pacer(None if lateness is None else lateness[1], name="native")
        assert type(native) is not type(ref)
        assert _observe(native) == _observe(ref)
        for op in program:
            asked_ref: list[Any] = []
            asked_native: list[Any] = []
            # Whichever steps first finds the modes still to find (the
            # predictor's path): each pacer must take it.
            if native_first:
                out_native = _step(native, op, recs, asked_native)
                out_ref = _step(ref, op, recs, asked_ref)
            else:
                out_ref = _step(ref, op, recs, asked_ref)
                out_native = _step(native, op, recs, asked_native)
            assert out_native == out_ref, op
            assert type(out_native) is type(out_ref), op
            assert asked_native == asked_ref, op
            assert _observe(native) == _observe(ref), op


def test_the_native_pacer_follows_a_new_policy_at_once() -> None:
    """Its policy's fields are kept in C, refreshed when another policy is
    set: a plan made after set_wait_policy() uses the new one."""
    before = cudafut.get_wait_policy()
    try:
        pacer: Any = _policy.Pacer()  # the native one (typed as the twin, which takes records)
        for max_sleep in (1e-3, 7e-3, 2e-3):
            cudafut.set_wait_policy(cudafut.WaitPolicy(max_sleep_s=max_sleep, predict=False, spin_s=0))
            pacer.new_wait(T0)
            for _ in range(20):  # backs off to the bound
                when = pacer.next_poll([Rec((0, 0x2000), T0)], T0)
            assert when == T0 + max_sleep
    finally:
        cudafut.set_wait_policy(before)


def test_a_plan_that_finds_a_streams_modes_afresh_is_the_twins() -> None:
    """After a surprise or every few observations a stream's modes are
    found again at the next plan (``predictor.modes()``, the one Python
    call the native plan makes): that plan too is the twin's, for a
    stream whose newest observation fell in a mode and for one whose did
    not."""
    policy = cudafut.WaitPolicy()
    for surprised in (False, True):
        points = [(3, 0, True), (3, 1, True), (3, -1, True), (3, 0, True)]
        with _state(policy, [(points, False, surprised, 0)]) as recs:
            hist = _policy.predictor.histories[recs[0].stream_key]
            plans = []
            makers: tuple[Any, ...] = (_policy.Pacer, REFERENCE["Pacer"])
            for make in makers:
                hist.modes = None  # to be found by this pacer's plan
                pacer = make()
                pacer.new_wait(T0)
                now = T0 + 200e-6  # past the new wait's spin, before the 2 ms window
                plans.append((pacer.next_poll(recs, now), _observe(pacer)))
            assert hist.modes  # found: a 2 ms mode
            assert plans[0] == plans[1], (surprised, plans)
