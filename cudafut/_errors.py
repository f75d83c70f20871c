"""Exceptions raised by cudafut.

Every error says what went wrong and what to do about it. The classes also
subclass the standard-library errors that play the same role, so code written
against ``asyncio`` or ``concurrent.futures`` catches them unchanged.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import sys

__all__ = [
    "CancelledError",
    "CudaError",
    "CudaUnavailableError",
    "InvalidStateError",
    "TimeoutError",
]

#: Raised by :meth:`CudaFuture.result` and friends when the future was
#: cancelled before it was set.  It is :class:`concurrent.futures.CancelledError`;
#: ``await`` on a cancelled future raises :class:`asyncio.CancelledError` instead.
CancelledError = concurrent.futures.CancelledError

# CUDA errors after which the context is corrupt: every later call on that
# device fails with the same code, so the only remedy is a new process.
_STICKY = frozenset(
    {
        700,  # cudaErrorIllegalAddress
        702,  # cudaErrorLaunchTimeout
        710,  # cudaErrorAssert
        714,  # cudaErrorHardwareStackError
        715,  # cudaErrorIllegalInstruction
        716,  # cudaErrorMisalignedAddress
        717,  # cudaErrorInvalidAddressSpace
        718,  # cudaErrorInvalidPc
        719,  # cudaErrorLaunchFailure
    }
)


class CudaError(RuntimeError):
    """The GPU work behind a future failed with a CUDA error.

    Attributes:
        code: the ``cudaError_t`` value, e.g. ``700``.
        name: its symbolic name, e.g. ``"cudaErrorIllegalAddress"``.
        device: the device whose event reported the error, if known.
        sticky: ``True`` when the error corrupts the CUDA context (illegal
            address, kernel assert, ...): every later CUDA call on that device
            in this process fails too, and only a new process recovers.
    """

    def __init__(
        self,
        code: int,
        name: str = "",
        description: str = "",
        device: int | None = None,
    ) -> None:
        self.code = code
        self.name = name or f"cudaError{code}"
        self.description = description
        self.device = device
        self.sticky = code in _STICKY
        where = "" if device is None else f" on device {device}"
        text = f"CUDA error {code} ({self.name}){where}"
        if description:
            text += f": {description}"
        if self.sticky:
            text += (
                ". This error is sticky: the CUDA context is corrupt and every "
                "later CUDA call in this process fails; restart the process "
                "(run the faulting kernel under compute-sanitizer to find it)"
            )
        super().__init__(text)

    def __reduce__(self) -> tuple[type[CudaError], tuple[int, str, str, int | None]]:
        return (type(self), (self.code, self.name, self.description, self.device))


class CudaUnavailableError(RuntimeError):
    """CUDA cannot be used here: CuPy, the driver or a device is missing.

    ``import cudafut`` never raises this; the first call that needs the GPU
    does, with the reason and the fix in its message.
    """


class SharingError(RuntimeError):
    """A future could not cross to another process, or its producing process
    is gone: it died before the work completed, the pickled future expired
    or was received already, or the processes run on different machines."""


class InvalidStateError(asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
    """The call does not fit the future's state, e.g. setting it twice."""


if sys.version_info >= (3, 11):

    class TimeoutError(builtins.TimeoutError):
        """A blocking call ran out of time; the future itself is unchanged."""

else:  # pragma: no cover - Python 3.10 has three distinct timeout errors

    class TimeoutError(builtins.TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
        """A blocking call ran out of time; the future itself is unchanged."""
