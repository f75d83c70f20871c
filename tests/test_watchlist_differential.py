"""The native watch list (cudafut/_core.pyx's ``Watch``, ``_Queue`` and
``Watchlist``) against its pure-Python reference (cudafut/_waiter.py), in one
process: random programs run on both, step by step, and after every step
each must have returned (or raised) the same and be in the same state.

A program adds watches (numbers on a stream in order, out of order and
equal; duck-typed records and the native ``EventRecord``, which the native
list queries through C; through ``add`` and ``add_watch``), completes or
fails records, makes a record's next query raise, removes watches, polls
with and without a limit, and asks ``oldest`` and ``clear``. Compared after each step: what the
step returned, as ``(callback, record)`` pairs in order, or the exception's
type and message; ``pending`` and ``streams``; which watches are still live;
each record's ``seen`` time and number of queries; what the polls put on
``learnt`` for the predictor, in order. At the end both drain: every record completes, and polls
fire the rest.

The native list is held identical to its reference, as
tests/test_differential.py holds the two cores identical. That test drives
whole cores through the public API and leaves out, as timing-dependent, the
event queries and the order across futures of one settle window's
callbacks: the list's own work. Here they are compared exactly, on states
the public API reaches rarely (hundreds of watches on one stream, queues
compacted, a query raising in the middle of a poll). ``_Queue`` alone
is compared too: its ``advance`` refuses a bound outside ``head <= to <=
len(watches)`` with the same IndexError on both.

The reference classes are rebuilt from _waiter.py's source: where the native
core runs, ``cudafut._waiter`` rebinds ``Watch`` and ``Watchlist`` to the
native ones at import, so the module no longer holds the pure ones. Their
definitions (``Watch``, ``_seq``, ``_gone``, ``_GONE``, ``_Queue``,
``Watchlist``) are taken from the file's AST and run in a namespace of
their own.

Checked to fail on a broken reference, at the default counts (scratch copies
of this file that changed the rebuilt classes only): ``poll`` returning
what fired in reverse order; ``poll`` setting ``seen`` off by one; ``poll``
not asking the newest record of an ordered stream; ``_Queue.add`` putting
a watch before its equals (``insort_left``); ``_Queue.advance`` compacting
past 16 entries instead of 32, or without its bounds check (these two by
the queue test alone: no behaviour of the list shows either).

The random tests run ``CUDAFUT_DIFF_EXAMPLES`` short programs (default 200),
3/20 as many long ones, 1/5 as many batched ones and half as many queue
programs (about 2 s in all); a thorough run (about 2 minutes)::

    CUDAFUT_DIFF_EXAMPLES=20000 pytest -p no:cacheprovider tests/test_watchlist_differential.py

Past about 50,000, add ``-o timeout=0``: a test may then run longer than the
project's 120 s timeout.

Skipped where the native core does not run (``CUDAFUT_PURE=1``, no current
extension): there is one watch list only.
"""

from __future__ import annotations

import ast
import os
import pathlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudafut import _compiled, _waiter

NATIVE = _compiled.native()
pytestmark = pytest.mark.skipif(
    NATIVE is None, reason=f"the native core does not run here ({_compiled.core()})"
)

EXAMPLES = int(os.environ.get("CUDAFUT_DIFF_EXAMPLES", "200"))
NOT_READY = 600  # cudaErrorNotReady: what the backend's event_query says of pending work

#: An operation of a program: its name, then small ints, bools and names.
Op = tuple[Any, ...]


def _native() -> Any:
    assert NATIVE is not None
    return NATIVE


# -- the reference, from _waiter.py's source ---------------------------------------------


REFERENCE_NAMES = frozenset({"Watch", "_seq", "_gone", "_GONE", "_Queue", "Watchlist"})


def _reference_namespace() -> dict[str, Any]:
    path = pathlib.Path(_waiter.__file__)
    tree = ast.parse(path.read_text(), str(path))
    body: list[ast.stmt] = []
    for node in tree.body:
        name = None
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            name = node.name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        # The module's imports (``from __future__ import annotations`` first:
        # annotations stay unevaluated, as in the module), but not the
        # package's own.
        if (
            name in REFERENCE_NAMES
            or isinstance(node, ast.Import)
            or (isinstance(node, ast.ImportFrom) and node.level == 0)
        ):
            body.append(node)
    namespace: dict[str, Any] = {"__name__": "reference_waiter"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", dont_inherit=True), namespace)
    assert namespace.keys() >= REFERENCE_NAMES, "_waiter.py no longer defines them all at top level"
    return namespace


REFERENCE = _reference_namespace()


# -- records -----------------------------------------------------------------------------


class Truth:
    """What the "GPU" says of each record, by token: ``None`` pending, else
    its status code; and the tokens whose next query raises."""

    def __init__(self) -> None:
        self.status: dict[int, int | None] = {}
        self.raising: set[int] = set()

    def next_query(self, token: int) -> int | None:
        if token in self.raising:
            self.raising.discard(token)
            raise ValueError(f"query of {token} failed")
        return self.status.get(token)


class DuckRecord:
    """A record of another type than the native ``EventRecord`` (the pure
    core's has this shape): the native list asks it through Python."""

    def __init__(self, truth: Truth, token: int, key: tuple[int, int], seq: int, ordered: bool) -> None:
        self.truth = truth
        self.token = token
        self.stream_key = key
        self.seq = seq
        self.ordered = ordered
        self.seen = 0.0
        self.t = 0.0
        self.queries = 0
        self.status: int | None = None

    def query(self) -> int | None:
        self.queries += 1
        if self.status is None:
            self.status = self.truth.next_query(self.token)
        return self.status


class Calls:
    """The backend a native ``EventRecord`` asks: its handle is its token."""

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        self.queries: dict[int, int] = {}

    def event_query(self, handle: int) -> int:
        self.queries[handle] = self.queries.get(handle, 0) + 1
        status = self.truth.next_query(handle)
        return NOT_READY if status is None else status


class Callback:
    """A watch's callback, known by its token; the list returns callbacks,
    never runs them."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, record: Any) -> None:
        raise AssertionError("the list ran a callback")


def _token(record: Any) -> int:
    token: int = record.token if isinstance(record, DuckRecord) else record.handle
    return token


class Side:
    """One twin with records and watches of its own."""

    def __init__(self, watch: Any, watchlist: Any) -> None:
        self.watch = watch
        self.wl = watchlist()
        self.truth = Truth()
        self.calls = Calls(self.truth)
        self.records: list[Any] = []
        self.watches: list[Any] = []

    def queries(self, record: Any) -> int:
        if isinstance(record, DuckRecord):
            return record.queries
        return self.calls.queries.get(record.handle, 0)

    def state(self) -> dict[str, Any]:
        return {
            "pending": self.wl.pending,
            "streams": self.wl.streams,
            "live": [None if w.callback is None else w.callback.token for w in self.watches],
            "seen": [r.seen for r in self.records],
            "queries": [self.queries(r) for r in self.records],
            "learnt": [(_token(record), now) for record, now in self.wl.learnt],
        }


# -- programs ----------------------------------------------------------------------------

KEYS = [(0, 1), (0, 2), (1, 1)]


def apply(side: Side, op: Op, step: int) -> Any:
    """Run ``op`` on ``side``: what it returned (records and callbacks as
    tokens), or the exception it raised (type and message)."""
    kind = op[0]
    wl = side.wl
    try:
        if kind == "add":
            _, k, seq, ordered, rtype, via_add_watch = op
            token = len(side.records)
            if rtype == "exact":
                record = _native().EventRecord(token, 0, 0, KEYS[k], seq, 0.0, side.calls, None)
            else:
                record = DuckRecord(side.truth, token, KEYS[k], seq, ordered)
            side.records.append(record)
            callback = Callback(len(side.watches))
            watch = wl.add_watch(side.watch(record, callback)) if via_add_watch else wl.add(record, callback)
            side.watches.append(watch)
            return ("added", watch.seq)
        if kind == "add_inc":  # in order: the number is the count of records so far
            _, k, ordered = op
            return apply(side, ("add", k, len(side.records), ordered, "duck", False), step)
        if kind == "complete":
            _, i, code = op
            if i < len(side.records):
                side.truth.status[i] = code
            return None
        if kind in ("complete_upto", "complete_all"):
            upto = op[1] if kind == "complete_upto" else len(side.records)
            for i in range(min(upto, len(side.records))):
                if side.truth.status.get(i) is None:
                    side.truth.status[i] = 0
            return None
        if kind == "raise":
            _, i = op
            if i < len(side.records):
                side.truth.raising.add(i)
            return None
        if kind == "remove":
            _, i = op
            if i < len(side.watches):
                wl.remove(side.watches[i])
            return None
        if kind == "poll":
            _, limit = op
            now = step + 0.5
            fired = wl.poll(now) if limit is None else wl.poll(now, limit)
            return ("fired", [(callback.token, _token(record)) for callback, record in fired])
        if kind == "oldest":
            return ("oldest", [_token(r) for r in wl.oldest()])
        if kind == "clear":
            wl.clear()
            return None
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    raise AssertionError(f"no such op: {op}")


def run_both(program: list[Op]) -> None:
    reference = Side(REFERENCE["Watch"], REFERENCE["Watchlist"])
    native = Side(_native().Watch, _native().Watchlist)
    trace: list[tuple[Op, Any]] = []

    def step(op: Op, number: int) -> None:
        a, b = apply(reference, op, number), apply(native, op, number)
        trace.append((op, a))
        where = f"step {number} {op}"
        assert a == b, f"{where}: reference {a!r} != native {b!r}\n  program so far: {trace}"
        sa, sb = reference.state(), native.state()
        assert sa == sb, f"{where}: reference {sa!r} != native {sb!r}\n  program so far: {trace}"

    for number, op in enumerate(program):
        step(op, number)
    # Then everything completes: the polls must fire the same rest, in
    # the same order, and leave both lists empty.
    end = len(program)
    step(("oldest",), end)
    for side in (reference, native):
        side.truth.raising.clear()
    step(("complete_all",), end + 1)
    for number in range(end + 2, end + 7):
        step(("poll", None), number)
    assert reference.wl.pending == native.wl.pending == 0


# Short programs on three streams, numbers -2..6: out of order and equal
# numbers, every op often.
op_add = st.tuples(
    st.just("add"),
    st.integers(0, 2),
    st.integers(-2, 6),
    st.booleans(),
    st.sampled_from(["duck", "exact"]),
    st.booleans(),
)
op_complete = st.tuples(st.just("complete"), st.integers(0, 40), st.sampled_from([0, 0, 0, 700]))
op_raise = st.tuples(st.just("raise"), st.integers(0, 40))
op_remove = st.tuples(st.just("remove"), st.integers(0, 40))
op_poll = st.tuples(st.just("poll"), st.sampled_from([None, 0, 1, 2, 3, 5, 64, -1]))
op_oldest = st.tuples(st.just("oldest"))
op_clear = st.tuples(st.just("clear"))
op_complete_all = st.tuples(st.just("complete_all"))

short_programs = st.lists(
    st.one_of(
        op_add,
        op_add,
        op_add,
        op_complete,
        op_complete,
        op_raise,
        op_remove,
        op_poll,
        op_poll,
        op_oldest,
        op_clear,
        op_complete_all,
    ),
    max_size=80,
)

# Long programs on two streams, mostly in order: queues past 32 entries, so
# that ``_Queue.advance`` compacts them.
op_add_far = st.tuples(
    st.just("add"),
    st.integers(0, 1),
    st.integers(0, 400),
    st.booleans(),
    st.sampled_from(["duck", "exact"]),
    st.booleans(),
)
op_add_inc = st.tuples(st.just("add_inc"), st.integers(0, 1), st.booleans())
op_complete_far = st.tuples(st.just("complete"), st.integers(0, 300), st.sampled_from([0, 0, 700]))
op_complete_upto = st.tuples(st.just("complete_upto"), st.integers(0, 300))
op_remove_far = st.tuples(st.just("remove"), st.integers(0, 300))
op_raise_far = st.tuples(st.just("raise"), st.integers(0, 300))

long_programs = st.lists(
    st.one_of(
        op_add_far,
        op_add_inc,
        op_add_inc,
        op_add_inc,
        op_add_inc,
        op_complete_far,
        op_complete_upto,
        op_remove_far,
        op_raise_far,
        op_poll,
        op_oldest,
        op_complete_all,
    ),
    min_size=50,
    max_size=300,
)


@st.composite
def batched_programs(draw: st.DrawFn) -> list[Op]:
    """Batches as a server makes them: many in-order adds on a stream, some
    removes, a completed prefix, at times an add out of order or a query
    that raises, then polls (queues of more than 32 entries advance and
    compact)."""
    program: list[Op] = []
    added = 0
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(0, 1))
        n = draw(st.integers(0, 90))
        program += [("add_inc", k, draw(st.booleans())) for _ in range(n)]
        added += n
        program += [("remove", draw(st.integers(0, max(added, 1)))) for _ in range(draw(st.integers(0, 10)))]
        program.append(("complete_upto", draw(st.integers(0, added + 1))))
        if draw(st.booleans()):
            program.append(("add", k, draw(st.integers(0, added)), False, "duck", False))
        if draw(st.booleans()):
            program.append(("raise", draw(st.integers(0, max(added, 1)))))
        program += [draw(st.one_of(op_poll, op_oldest)) for _ in range(draw(st.integers(1, 4)))]
    return program


def _examples(n: int) -> settings:
    # No example database: nothing is written into the tree.
    return settings(
        max_examples=max(n, 1),
        deadline=None,
        database=None,
    )


@_examples(EXAMPLES)
@given(short_programs)
def test_short_programs_agree(program: list[Op]) -> None:
    run_both(program)


@_examples(EXAMPLES * 3 // 20)
@given(long_programs)
def test_long_programs_agree(program: list[Op]) -> None:
    run_both(program)


@_examples(EXAMPLES // 5)
@given(batched_programs())
def test_batched_programs_agree(program: list[Op]) -> None:
    run_both(program)


# -- targeted programs -------------------------------------------------------------------


def test_out_of_order_and_equal_numbers_fire_alike() -> None:
    program: list[Op] = [("add", 0, s, True, "duck", False) for s in (5, 3, 3, 9, 1, 5, 0, 7)]
    program += [("complete", i, 0) for i in range(8)] + [("poll", 2)] * 5
    run_both(program)


def test_streams_completed_together_fire_alike_in_arrival_order() -> None:
    # Interleaved waits on three streams, all complete, fired in slices:
    # the merge by arrival across streams, a slice ending mid-stream.
    program: list[Op] = [("add", i % 3, i // 3, True, "exact" if i % 2 else "duck", False) for i in range(40)]
    program += [("complete_upto", 31), ("remove", 7), ("poll", 5), ("poll", 3), ("oldest",), ("poll", None)]
    run_both(program)


def test_a_queue_compacts_alike() -> None:
    # 50 of 80 fire, then another poll: the queue is compacted (past 32 and
    # past half), and an add out of order lands in the compacted queue.
    program: list[Op] = [("add", 0, s, False, "duck", False) for s in range(80)]
    program += [("complete", i, 0) for i in range(50)]
    program += [
        ("poll", 64),
        ("oldest",),
        ("add", 0, 3, False, "duck", False),
        ("poll", None),
        ("oldest",),
        ("complete_all",),
        ("poll", 64),
        ("poll", 64),
    ]
    run_both(program)


# -- one queue ---------------------------------------------------------------------------

# Adds of runs of numbers, to grow queues past 32 entries (an advance there
# compacts); an advance counts from the head or back from the end, its
# bound out of range at times.
queue_programs = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 60), st.one_of(st.just(1), st.integers(1, 40))),
        st.tuples(st.just("advance"), st.booleans(), st.one_of(st.integers(-1, 2), st.integers(0, 40))),
    ),
    max_size=40,
)


@_examples(EXAMPLES // 2)
@given(queue_programs)
def test_a_queue_adds_and_advances_alike(program: list[Op]) -> None:
    """Bounds out of range included: the list never asks one, but a record's
    query reentering the list could, and the native queue must then raise,
    not write past its end."""
    truth = Truth()
    reference, native = REFERENCE["_Queue"](), _native()._Queue()

    def state(queue: Any) -> tuple[int, list[int | None]]:
        return queue.head, [None if w.callback is None else w.callback.token for w in queue.watches]

    for number, op in enumerate(program):
        if op[0] == "advance":
            _, from_end, n = op
            to = len(reference.watches) - n if from_end else reference.head + n
        outcomes: list[str | None] = []
        for queue, watch in ((reference, REFERENCE["Watch"]), (native, _native().Watch)):
            try:
                if op[0] == "add":
                    _, seq, count = op
                    for i in range(count):
                        record = DuckRecord(truth, number, KEYS[0], seq + i, False)
                        queue.add(watch(record, Callback(number * 100 + i)))
                else:
                    queue.advance(to)
                outcomes.append(None)
            except IndexError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1], f"step {number} {op}: {outcomes[0]} != {outcomes[1]}"
        assert state(reference) == state(native), f"step {number} {op}"


def test_the_module_runs_the_native_twins() -> None:
    """The premise of the rebuild: ``cudafut._waiter`` holds the native
    classes, the rebuilt ones are the code of _waiter.py."""
    assert _waiter.Watch is _native().Watch
    assert _waiter.Watchlist is _native().Watchlist
    assert REFERENCE["Watchlist"].poll.__code__.co_filename == _waiter.__file__
