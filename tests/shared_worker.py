"""The other process of tests/test_gpu_shared.py and tests/test_shared.py:
functions run in a process started by multiprocessing's ``spawn`` method,
talking to the test over a pipe (``conn``)."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any


def _warm() -> None:
    """Compile the spin kernel before the timed producer uses it."""
    import cupy as cp

    from tests import kernels

    a = cp.zeros(4, dtype=cp.float32)
    kernels.spin_fill(a, 1, 0)
    cp.cuda.Device().synchronize()


def _start() -> None:
    """Apply the mutation under test here too (scripts/mutation-check): the
    producer's side of a shared future runs in this process."""
    name = os.environ.get("CUDAFUT_MUTATE")
    if name:
        from tests import _mutations

        _mutations.apply(name)


def produce_slow(conn: Any, n: int, value: float, ms: float, die: bool) -> None:
    """Send a future of an array that a kernel fills with ``value`` after
    spinning ``ms``; then wait for a word, or with ``die`` exit at once
    (before the kernel ends)."""
    _start()
    import cupy as cp

    import cudafut
    from tests import kernels

    _warm()
    out = cp.zeros(n, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        kernels.spin_fill(out, value, ms)
        fut = cudafut.record(out)
    conn.send(fut)
    if die:
        conn.recv()  # the receiver has it
        os._exit(3)
    _answer_statistics(conn)


def _answer_statistics(conn: Any) -> None:
    """Answer each word with (held, events made, used bytes, fds), until "end"."""
    import cupy as cp

    import cudafut

    while conn.recv() != "end":
        gc.collect()
        stats = cudafut.shared_statistics()
        used = cp.get_default_memory_pool().used_bytes()
        conn.send((stats.held, stats.events, used, len(os.listdir("/proc/self/fd"))))


def produce_many(conn: Any, count: int, n: int) -> None:
    """Send ``count`` futures of small arrays (each ``i``), one by one, each
    after the receiver's word "next"; the word "held" is answered with how
    many exports this process still holds. Then report what it holds."""
    _start()
    import cupy as cp

    import cudafut

    for i in range(count):
        conn.send(cudafut.record(cp.full(n, i, dtype=cp.int32)))
        while conn.recv() == "held":
            gc.collect()
            conn.send(cudafut.shared_statistics().held)
    _answer_statistics(conn)


def produce_values(conn: Any) -> None:
    """Send futures of CuPy, PyTorch (float16, bfloat16, a strided view) and
    mixed values; then the words asked for, until None."""
    _start()
    import cupy as cp
    import torch

    import cudafut

    a = cp.arange(1000, dtype=cp.float64)
    t = torch.arange(24, device="cuda", dtype=torch.float16).reshape(4, 6)
    b = torch.arange(10, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    value = {"cupy": a[::3], "torch": t[:, 1::2], "bf16": b, "host": [1, "two"], "empty": cp.empty((0, 3))}
    conn.send(cudafut.record(value))
    _answer_statistics(conn)


def produce_launched(conn: Any) -> None:
    """Send a launch() future once it is enqueued (cudafut.enqueued)."""
    _start()
    import cupy as cp

    import cudafut
    from tests import kernels

    _warm()

    def work() -> Any:
        out = cp.zeros(256, dtype=cp.float32)
        kernels.spin_fill(out, 5.0, 200)
        return out

    async def main() -> None:
        fut = cudafut.launch(work)
        try:
            conn.send(fut)
        except cudafut.InvalidStateError as exc:
            conn.send(("refused", str(exc)))
        await cudafut.enqueued(fut)
        conn.send(fut)

    asyncio.run(main())
    _answer_statistics(conn)


def produce_batch(conn: Any, rows: int) -> None:
    """Send the ``rows`` futures of one Batcher batch (Batcher.submit_future),
    once enqueued, in one message: row ``i`` is filled with ``5 + i`` after a
    600 ms spin."""
    _start()
    import cupy as cp

    import cudafut
    from tests import kernels

    _warm()

    def run_batch(items: list[int]) -> Any:
        out = cp.zeros((len(items), 16), dtype=cp.float32)
        kernels.spin_fill(out, 5.0, 600)
        return out + cp.asarray(items, dtype=cp.float32)[:, None]

    # The addition's kernel compiles on first use (longer than the spin):
    # before, or the batch would be done by the time it is sent.
    cp.zeros((2, 16), dtype=cp.float32) + cp.zeros(2, dtype=cp.float32)[:, None]
    cp.cuda.Device().synchronize()

    async def main() -> None:
        async with cudafut.Batcher(run_batch, max_batch=rows, max_delay_s=1.0) as batcher:
            futs = [batcher.submit_future(i) for i in range(rows)]
            for fut in futs:
                await cudafut.enqueued(fut)
            conn.send(futs)

    asyncio.run(main())
    _answer_statistics(conn)


def receive_and_die(conn: Any) -> None:
    """Receive a future, wait for its work, say so, then exit holding it."""
    _start()
    fut = conn.recv()
    value = fut.wait(30)
    conn.send(float(value[0]))
    conn.recv()
    os._exit(4)


def receive_ticket(conn: Any, release: bool) -> None:
    """Receive an export's ticket (tests/test_shared.py makes them of host
    values, without CUDA), import it and send back its value, or the error's
    text; then wait for the word to exit. Without ``release``, this process
    never writes its releases (its cudafut-share thread is stopped first),
    as if it died before it could."""
    from cudafut import _shared

    if not release:
        _shared._state.stopped = True
    try:
        fut = _shared.import_ticket(conn.recv())
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    else:
        conn.send(fut.result(10))
        del fut
    gc.collect()
    conn.recv()


def receive_with_a_fake_event(conn: Any) -> None:
    """Import a ticket whose event is fake (never completes: CUDA is not
    asked); send whether the future is done, then the error its result()
    raises once the test kills the producer named in the ticket."""
    from cudafut import _backend, _cuda, _shared

    setattr(_backend.current, "device_of_bus_id", lambda bus_id: 0)  # noqa: B010 - a method replaced
    setattr(_backend.current, "ipc_open_event", lambda handle, device: 4242)  # noqa: B010
    setattr(_backend.current, "event_query", lambda event: _cuda.NOT_READY)  # noqa: B010
    fut = _shared.import_ticket(conn.recv())
    conn.send(fut.done())
    try:
        fut.result(60)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    else:
        conn.send("no error")
    conn.recv()


def sleep(conn: Any) -> None:
    """A process that lives until killed (a stand-in producer)."""
    conn.recv()


def produce_on_a_new_thread(conn: Any) -> None:
    """Send, from a thread that never used CUDA, a future of done work (a
    sender thread of a service does this: the driver's address-range call
    there has no current context unless cudafut makes one)."""
    import threading

    import cupy as cp

    import cudafut

    fut = cudafut.record(cp.full(N_NEW_THREAD, 4.0, dtype=cp.float32))
    fut.result()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            conn.send(fut)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    thread.join()
    if errors:
        conn.send(f"{type(errors[0]).__name__}: {errors[0]}")
    _answer_statistics(conn)


N_NEW_THREAD = 4096
