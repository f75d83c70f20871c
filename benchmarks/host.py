"""Section 5, ``host``: create + set, ``record()``, ``then()`` chains, next to
a bare kernel launch and to ``torch.futures``."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cudafut

from .support.common import Progress

NAME = "host"

LINKS = 1000

# The operations timed one by one; each is stored as "<name> us".
LAUNCH = "bare kernel launch"
CREATE_SET = "cudafut create + set_result"
RECORD = "cudafut record()"
#: record() alone: the futures are kept, so their finalizers (a query each
#: for a record whose status nobody asked: hazard 5) run after the timing.
RECORD_KEPT_US = "cudafut record(), futures kept, us"
LAUNCH_US = LAUNCH + " us"
CREATE_SET_US = CREATE_SET + " us"
THEN_US = "cudafut then() per link us"
THEN_TORCH_US = "cudafut then() per link, torch imported us"
#: With torch imported: record() of the same CuPy array, and then() links
#: whose value is a torch CUDA tensor (each link records it on the pool
#: stream for torch's allocator, as torch.futures' own chain does).
RECORD_TORCH_US = "cudafut record(), torch imported us"
THEN_TENSOR_US = "cudafut then() per link, a torch tensor value us"
#: What each such link pays torch itself: its Tensor.record_stream, alone.
TENSOR_RECORD_FLOOR_US = "floor: torch Tensor.record_stream per call us"
#: The host's speed moves within a run (a virtual machine's CPUs are
#: shared): cudafut's and torch's chains alternated, a ratio per round.
THEN_ROUNDS_RATIO = "ratio then() per link, torch imported / torch's, median of 7 alternated rounds"
THEN_TENSOR_ROUNDS_RATIO = (
    "ratio then() per link, a torch tensor value / torch's, median of 7 alternated rounds"
)
ROUNDS = 7
LAUNCH_X1000_US = "bare kernel launch x1000, per launch us"
RATIO = "ratio create+set / bare launch"
TORCH_CREATE_SET_US = "peer: torch Future(devices) create + set_result us"
TORCH_THEN_US = "peer: torch then() per link us"
AWAIT_DONE_US = "cudafut await of done work us"
AWAIT_FRESH_US = "cudafut await of done work, a new future each us"
ASYNCIO_ROUND_TRIP_US = "peer: asyncio future create + set + await us"
AWAIT_RATIO = "ratio await of done work / asyncio round trip"
AWAIT_FRESH_RATIO = "ratio await of done work, a new future each / asyncio round trip"
#: The floors beside them: the least the same work costs written by hand
#: with CuPy (what an issue's target is weighed against where the target
#: is below the driver's own cost).
RECORD_FLOOR_US = "floor: a pooled CuPy event recorded + a two-slot object, kept, us"
AWAIT_FRESH_FLOOR_US = "floor: a CuPy event query + an asyncio round trip us"
RECORD_FLOOR_RATIO = "ratio record(), futures kept / its floor"
AWAIT_FRESH_FLOOR_RATIO = "ratio await of done work, a new future each / its floor"
#: The case the await's probe of the stream's newest record cannot help:
#: newer work on the stream still pending (the probe finds it so, once).
AWAIT_BEHIND_US = "cudafut await of done work, a new future each, newer work pending us"
AWAIT_BEHIND_FLOOR_US = "floor: a CuPy event query + an asyncio round trip, newer work pending us"
AWAIT_BEHIND_FLOOR_RATIO = "ratio await of done work, a new future each, newer work pending / its floor"
FN_RETURNS = " (fn returns)"
FN_LAUNCHES = " (fn launches a kernel)"


def steps(quick: bool) -> int:
    torch = importlib.util.find_spec("torch") is not None
    return 4 + 1 + 2 + 8 * torch


def run(progress: Progress, quick: bool) -> dict[str, Any]:
    return measure(progress)


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def measure(progress: Progress, links: int = LINKS) -> dict[str, Any]:
    import cupy as cp

    from .support.gpu import gsleep, stream, token

    res: dict[str, Any] = {}
    kernel = gsleep
    zero = cp.int64(0)

    def launch() -> None:
        kernel((1,), (1,), (zero,))

    def create_set() -> None:
        cudafut.CudaFuture(devices=0).set_result(token)

    def record() -> None:
        cudafut.record(token)

    with stream:
        for name, fn in (
            (LAUNCH, launch),
            (CREATE_SET, create_set),
            (RECORD, record),
        ):
            per_call_us(fn, 2000)
            res[name + " us"] = min(per_call_us(fn, 20_000) for _ in range(3))
            stream.synchronize()
            progress.step(f"host: {name}: {res[name + ' us']:.2f} us")
        kept: list[Any] = []
        res[RECORD_KEPT_US] = _kept(kept, lambda: kept.append(cudafut.record(token)))
        stream.synchronize()
        res[RECORD_FLOOR_US] = _record_floor(stream, token)
        res[RECORD_FLOOR_RATIO] = res[RECORD_KEPT_US] / res[RECORD_FLOOR_US]
        progress.step(
            f"host: record(), futures kept: {res[RECORD_KEPT_US]:.2f} us, floor {res[RECORD_FLOOR_US]:.2f} us"
        )

    def chain_cudafut(with_kernel: bool, value: Any = token) -> float:
        return cudafut_chain(stream, value, links, launch if with_kernel else None)

    res.update(_awaits(stream, token))
    progress.step(
        f"host: await of done work: {res[AWAIT_DONE_US]:.2f} us, a new future each "
        f"{res[AWAIT_FRESH_US]:.2f} us; asyncio round trip: {res[ASYNCIO_ROUND_TRIP_US]:.2f} us"
    )

    for with_kernel in (False, True):
        chain_cudafut(with_kernel)
        key = THEN_US + (FN_LAUNCHES if with_kernel else FN_RETURNS)
        res[key] = min(chain_cudafut(with_kernel) for _ in range(3))
        progress.step(f"host: {key}: {res[key]:.2f}")
    with stream:
        res[LAUNCH_X1000_US] = min(per_call_us(launch, links) for _ in range(3))
    stream.synchronize()
    res.update(_torch_host(progress, links))
    if "torch" not in res:  # torch is imported now: then() also makes the pool stream torch's current one
        import torch

        with stream:
            per_call_us(record, 2000)
            res[RECORD_TORCH_US] = min(per_call_us(record, 20_000) for _ in range(3))
        stream.synchronize()
        tensor = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        for with_kernel in (False, True):
            chain_cudafut(with_kernel)
            key = THEN_TORCH_US + (FN_LAUNCHES if with_kernel else FN_RETURNS)
            res[key] = min(chain_cudafut(with_kernel) for _ in range(3))
            progress.step(f"host: {key}: {res[key]:.2f}")
            key = THEN_TENSOR_US + (FN_LAUNCHES if with_kernel else FN_RETURNS)
            res[key] = min(chain_cudafut(with_kernel, tensor) for _ in range(3))
            progress.step(f"host: {key}: {res[key]:.2f}")
        other = torch.cuda.Stream()  # another stream than the tensor's, as then()'s pool stream

        def record_tensor() -> None:
            tensor.record_stream(other)

        per_call_us(record_tensor, 2000)
        res[TENSOR_RECORD_FLOOR_US] = min(per_call_us(record_tensor, 20_000) for _ in range(3))
        theirs_chain = torch_chain(torch, tensor, links)
        for name, value in ((THEN_ROUNDS_RATIO, token), (THEN_TENSOR_ROUNDS_RATIO, tensor)):
            rounds = []
            for i in range(ROUNDS):  # which goes first alternates too
                if i % 2:
                    theirs = theirs_chain(False)
                    ours = chain_cudafut(False, value)
                else:
                    ours = chain_cudafut(False, value)
                    theirs = theirs_chain(False)
                rounds.append(ours / theirs)
            rounds.sort()
            res[name] = rounds[ROUNDS // 2]
            progress.step(f"host: {name}: {res[name]:.2f}x (rounds {rounds[0]:.2f}x-{rounds[-1]:.2f}x)")
    launch_us = res[LAUNCH_US]
    res[RATIO] = res[CREATE_SET_US] / launch_us
    return res


def _kept(kept: list[Any], make: Callable[[], None], n: int = 4000) -> float:
    """µs per ``make()`` that appends what it makes to ``kept``, best of
    seven; ``kept`` is emptied after each timing, untimed. ``n`` stays
    under the 16,384 free events the pool keeps per device: more live
    records would make each timing create new CUDA events (and each
    emptying destroy them), and time that instead."""
    times = []
    for _ in range(8):
        t = time.perf_counter()
        for _ in range(n):
            make()
        times.append((time.perf_counter() - t) / n * 1e6)
        kept.clear()
    return min(times[1:])  # the first warms up


class _HandFuture:
    """The least a recorded future is: its value and its event."""

    __slots__ = ("event", "value")

    def __init__(self, value: object, event: Any) -> None:
        self.value = value
        self.event = event


def _record_floor(stream: Any, token: Any, n: int = 4000) -> float:
    """µs per hand-written record, timed as record() is (:func:`_kept`):
    an event taken from a free list made beforehand (cudafut's pool does
    the same), recorded on ``stream`` through CuPy, and an object holding
    it with the value, kept."""
    import cupy as cp

    # n events, each taken once per timing of n records (kept is emptied between)
    free = itertools.cycle([cp.cuda.Event(disable_timing=True) for _ in range(n)])
    kept: list[Any] = []

    def make() -> None:
        event = next(free)
        event.record(stream)
        kept.append(_HandFuture(token, event))

    per = _kept(kept, make, n)
    stream.synchronize()
    return per


def _awaits(stream: Any, token: Any, n: int = 20_000) -> dict[str, float]:
    """``await`` of cudafut futures whose work is done, next to what the
    issue compares it with: a plain asyncio future created, set and
    awaited, each timed in one coroutine (neither yields to the loop).
    Two cudafut rows: the same done future again and again (its event's
    status is known: no ``cudaEventQuery``), and ``n`` futures recorded
    beforehand and completed, each awaited once (one query each), which
    is what a service meets; neither counts making the future. The latter
    again with newer work on the stream still pending, where asking the
    stream's newest record first does not answer for the older ones."""
    done = cudafut.record(token, stream=stream)
    done.result()

    async def await_same() -> float:
        t = time.perf_counter()
        for _ in range(n):
            await done
        return (time.perf_counter() - t) / n * 1e6

    async def await_fresh() -> float:
        futs = [cudafut.record(token, stream=stream) for _ in range(n)]
        stream.synchronize()
        t = time.perf_counter()
        for fut in futs:
            await fut
        return (time.perf_counter() - t) / n * 1e6

    from .support.gpu import work

    async def await_behind() -> float:
        # The futures' work is done, but the stream's newest record (made
        # after a kernel that outlasts the timing) is pending.
        futs = [cudafut.record(token, stream=stream) for _ in range(n)]
        stream.synchronize()
        work(500_000_000, on=stream)
        pending = cudafut.record(token, stream=stream)
        t = time.perf_counter()
        for fut in futs:
            await fut
        per = (time.perf_counter() - t) / n * 1e6
        if pending.done():
            raise AssertionError("the newer work ended before the timing did: lengthen its kernel")
        await pending
        return per

    async def floor_fresh(behind: bool = False) -> float:
        # What await_fresh cannot do without: learn from the driver that each
        # event completed (one query), and an asyncio round trip; with
        # ``behind``, while newer work on the stream runs (await_behind's).
        import cupy as cp

        events = [cp.cuda.Event(disable_timing=True) for _ in range(n)]
        for event in events:
            event.record(stream)
        stream.synchronize()
        if behind:
            work(500_000_000, on=stream)
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        for event in events:
            if not event.done:
                raise AssertionError("the event of finished work reads pending")
            fut = loop.create_future()
            fut.set_result(None)
            await fut
        per = (time.perf_counter() - t) / n * 1e6
        stream.synchronize()
        return per

    async def round_trip() -> float:
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        for _ in range(n):
            fut = loop.create_future()
            fut.set_result(None)
            await fut
        return (time.perf_counter() - t) / n * 1e6

    async def main() -> dict[str, float]:
        await await_same()  # warm
        await await_fresh()
        await round_trip()
        await floor_fresh()
        same, fresh, theirs, floor, behind, floor_behind = [], [], [], [], [], []
        for _ in range(3):  # interleaved, best of three each
            same.append(await await_same())
            fresh.append(await await_fresh())
            theirs.append(await round_trip())
            floor.append(await floor_fresh())
            behind.append(await await_behind())
            floor_behind.append(await floor_fresh(behind=True))
        return {
            AWAIT_DONE_US: min(same),
            AWAIT_FRESH_US: min(fresh),
            ASYNCIO_ROUND_TRIP_US: min(theirs),
            AWAIT_FRESH_FLOOR_US: min(floor),
            AWAIT_BEHIND_US: min(behind),
            AWAIT_BEHIND_FLOOR_US: min(floor_behind),
        }

    res = asyncio.run(main())
    res[AWAIT_RATIO] = res[AWAIT_DONE_US] / res[ASYNCIO_ROUND_TRIP_US]
    res[AWAIT_FRESH_RATIO] = res[AWAIT_FRESH_US] / res[ASYNCIO_ROUND_TRIP_US]
    res[AWAIT_FRESH_FLOOR_RATIO] = res[AWAIT_FRESH_US] / res[AWAIT_FRESH_FLOOR_US]
    res[AWAIT_BEHIND_FLOOR_RATIO] = res[AWAIT_BEHIND_US] / res[AWAIT_BEHIND_FLOOR_US]
    return res


def _torch_host(progress: Progress, links: int) -> dict[str, Any]:
    try:
        torch = importlib.import_module("torch")  # an optional peer
    except Exception as exc:  # noqa: BLE001
        return {"torch": f"unavailable: {exc}"}
    res: dict[str, Any] = {}
    t = torch.zeros(1, device="cuda")

    def create_set() -> None:
        torch.futures.Future(devices=["cuda:0"]).set_result(t)

    per_call_us(create_set, 2000)
    key = TORCH_CREATE_SET_US
    res[key] = min(per_call_us(create_set, 20_000) for _ in range(3))

    chain = torch_chain(torch, t, links)
    for with_kernel in (False, True):
        chain(with_kernel)
        key = TORCH_THEN_US + (FN_LAUNCHES if with_kernel else FN_RETURNS)
        res[key] = min(chain(with_kernel) for _ in range(3))
        progress.step(f"host: {key}: {res[key]:.2f}")
    return res


def cudafut_chain(stream: Any, value: Any, links: int, work: Callable[[], None] | None = None) -> float:
    """µs per link of a chain of ``links`` ``then()`` links from ``value``
    recorded on ``stream``, each ``fn`` returning its value (after calling
    ``work``, a kernel launch, if given); waits for the chain's end, untimed."""
    fut = cudafut.record(value, stream=stream)

    def link(v: Any) -> Any:
        if work is not None:
            work()
        return v

    t = time.perf_counter()
    for _ in range(links):
        fut = fut.then(link)
    per = (time.perf_counter() - t) / links * 1e6
    fut.result()
    return per


def torch_chain(torch: Any, t: Any, links: int) -> Callable[[bool], float]:
    """``chain(with_kernel)``: µs per link of a ``torch.futures`` chain of
    ``links`` links on ``t``, ``fn`` returning the value (or launching a
    kernel first)."""
    import cupy as cp

    from .support.gpu import gsleep

    zero = cp.int64(0)

    def chain(with_kernel: bool) -> float:
        fut = torch.futures.Future(devices=["cuda:0"])
        fut.set_result(t)

        def link(f: Any) -> Any:
            if with_kernel:
                gsleep((1,), (1,), (zero,))
            return f.value()

        t0 = time.perf_counter()
        for _ in range(links):
            fut = fut.then(link)
        per = (time.perf_counter() - t0) / links * 1e6
        fut.wait()
        torch.cuda.synchronize()
        return per

    return chain


def markdown(result: dict[str, Any]) -> list[str]:
    lines = ["## 5. Host costs", "", "| operation | µs, or ratio |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in map(_row, result.items())]
    lines.append("")
    return lines


def _row(item: tuple[str, Any]) -> tuple[str, str]:
    """A result's key and value as the table shows them: keys end in "us"
    (a time) or start with "ratio" (then the value is an "x")."""
    key, value = item
    if key.startswith("ratio "):
        return key.removeprefix("ratio "), f"{_fmt(value)}x"
    return key.removesuffix(" us").removesuffix(",").replace(" us (", " ("), _fmt(value)


def _fmt(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def plots(result: dict[str, Any], out: Path, stem: str) -> list[Path]:
    return []
