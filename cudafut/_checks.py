"""Argument checks that several modules share: timeouts and other seconds,
and the refusal of coroutine functions where no event loop would run them.

One rule for every number of seconds cudafut takes: any real number
(``int``, ``float``, NumPy scalars, ``fractions.Fraction``, anything
registered as :class:`numbers.Real`), but not a bool; never NaN. A
timeout of ``threading.TIMEOUT_MAX`` seconds (about 292 years on Linux) or
more, ``math.inf`` and an ``int`` too large for a float included, means no
limit: threads cannot wait longer than that anyway.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import threading
import types
from typing import Final

__all__ = [
    "NO_LIMIT",
    "check_callable",
    "is_async_callable",
    "not_async",
    "real_number",
    "returned_coroutine",
    "timeout_seconds",
]

#: The longest a thread can wait (``threading`` refuses more with
#: ``OverflowError``): timeouts at or beyond it mean "no limit".
NO_LIMIT: Final = float(threading.TIMEOUT_MAX)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def real_number(value: object, what: str) -> float:
    """``value`` as a float: a real number that is not a bool, not NaN, and
    fits a float. Costs about a µs.

    Raises:
        TypeError: not a real number (a bool, a string, a complex, None...).
        ValueError: NaN, or too large for a float (an ``int`` beyond
            1.8e308).
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{what} must be a number, not {value!r}")
    if value != value:  # NaN, of any real type
        raise ValueError(f"{what} must be a number, not NaN")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large to be a float: {_short(value)}") from None


def timeout_seconds(timeout: object, what: str = "timeout", *, positive: bool = False) -> float:
    """A timeout in seconds, checked; :data:`NO_LIMIT` for no limit.

    ``timeout``: a real number (see the module docstring) of seconds, at
    least 0 (more than 0 with ``positive``); one of ``threading.TIMEOUT_MAX``
    or more (``math.inf``, ``10**400``) gives :data:`NO_LIMIT`. ``None`` is
    the caller's to handle (it is a ``TypeError`` here). Costs about a µs.

    Raises:
        TypeError: ``timeout`` is not a real number (a bool included).
        ValueError: ``timeout`` is negative (or 0 with ``positive``) or NaN.
    """
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(f"{what} must be a number of seconds, not {timeout!r}")
    sign = "positive" if positive else "non-negative"
    # Compared before any float(): an int or Fraction too large for a float
    # compares exactly, and means no limit.
    if timeout != timeout or timeout < 0 or (positive and timeout == 0):
        raise ValueError(f"{what} must be a {sign} number of seconds, not {timeout!r}")
    if timeout >= NO_LIMIT:  # type: ignore[operator]  # numbers.Real declares no comparison with float
        return NO_LIMIT
    return float(timeout)


#: Callables that :func:`inspect.iscoroutinefunction` judges alone: no
#: ``__call__`` of theirs to look at (a class's makes an instance). The
#: common case, a function, then costs one isinstance more, not a lookup.
_NOT_ASYNC_IF_NOT_ABOVE: Final = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)


def check_callable(fn: object, what: str) -> None:
    """Raise unless ``fn`` is callable (a ``callable()`` test: costs nothing).

    Raises:
        TypeError: ``fn`` is not callable; ``what`` names the call refusing it.
    """
    if not callable(fn):
        raise TypeError(f"{what} needs a callable, not {fn!r}")


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine: a coroutine function
    (``async def``), a bound method or a :func:`functools.partial` of one
    (partials of partials included), or an object whose ``__call__`` is one.
    A class is not (calling it makes an instance, whatever its
    ``__call__``). Costs well under a µs for a function, about one for other
    callables; ``fn`` is not called."""
    func = fn.__func__ if type(fn) is types.MethodType else fn
    if type(func) is types.FunctionType:
        # A function or a bound method of one (every launch() passes one):
        # its code's flag, without inspect's general walk; inspect answers
        # for a function marked by inspect.markcoroutinefunction (3.12).
        if func.__code__.co_flags & inspect.CO_COROUTINE:
            return True
        return "_is_coroutine_marker" in func.__dict__ and inspect.iscoroutinefunction(func)
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    if isinstance(fn, _NOT_ASYNC_IF_NOT_ABOVE):
        return False
    # An instance's __call__, looked up as Python calls it (on the type).
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - callable() cannot tell async
    return inspect.iscoroutinefunction(call)


def not_async(fn: object, call: str, where: str, instead: str) -> None:
    """Refuse ``fn`` where it would make a coroutine that nothing awaits.

    ``call`` names the refusing call (``"then()"``), ``where`` says where it
    runs ``fn``, ``instead`` what to do. The one
    check behind :meth:`CudaFuture.then`, :func:`cudafut.submit`,
    :func:`cudafut.launch` and :func:`cudafut.warm_launchers`: called before
    they enqueue anything. Costs what :func:`is_async_callable` costs.

    Raises:
        TypeError: ``fn`` is async (see :func:`is_async_callable`).
    """
    if is_async_callable(fn):
        raise TypeError(
            f"{call} runs fn {where}: no event loop would await the coroutine it returns. {fn!r} "
            f"is a coroutine function (async def). {instead}"
        )


def returned_coroutine(fn: object, coro: types.CoroutineType[object, object, object]) -> TypeError:
    """The error that fails the future of ``then()`` or ``submit()`` whose
    ``fn`` returned the coroutine ``coro``: a plain function that calls an
    ``async def`` one (``lambda v: afn(v)``), which :func:`not_async`
    cannot see before it runs. Closes ``coro`` if it never started (then
    Python does not also warn that it was never awaited, and no code of
    it runs); one that started is someone else's, and is left as it is."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()
    return TypeError(
        f"fn returned a coroutine ({coro.__qualname__}), which nothing would await: then() and "
        f"submit() run fn as a plain function, and {fn!r} must return the value (or a CudaFuture). "
        "Await the coroutine on your loop instead, e.g. `await afn(await fut)`"
    )
