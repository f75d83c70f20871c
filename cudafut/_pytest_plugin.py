"""cudafut's pytest plugin (the ``pytest11`` entry point ``cudafut``): the
``fake_cuda`` fixture of :mod:`cudafut.testing`. Loaded by pytest wherever
cudafut is installed; ``-p no:cudafut`` leaves it out, ``-p cudafut`` loads
it where plugin autoloading is off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cudafut import testing


@pytest.fixture
def fake_cuda() -> Iterator[testing.FakeCuda]:
    """A fake GPU in place of CUDA for the test (:func:`cudafut.testing.fake_cuda`
    with one device; events complete when the test says, or set
    ``fake_cuda.auto_complete = True``; a wait on work still pending after
    5 s logs a warning that says so). Works on machines with and without
    a GPU, on asyncio, uvloop and trio."""
    with testing.fake_cuda() as fake:
        yield fake
