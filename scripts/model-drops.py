"""Host time per dropped pending future, dropped oldest first or newest
first, over a libcuda that does nothing.

``LD_LIBRARY_PATH=/tmp/nullcuda python scripts/model-drops.py`` (from the
repository root; build the null libcuda as ``scripts/model-many.py`` says).
Futures recorded on one stream, every event query saying "not ready", are
dropped at once: a list freed by CPython drops its newest first. A drop
that costs more as more are held (the stream's list moved per drop) shows
as a per-drop time that grows with the count. The native core only (the
pure core keeps no drop list).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.getcwd())

_spec = importlib.util.spec_from_file_location("model_many", "scripts/model-many.py")
assert _spec is not None
assert _spec.loader is not None
_mm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mm)

import cudafut  # noqa: E402
from cudafut import _cuda  # noqa: E402


def main() -> None:
    _mm._pc.install_nullcuda()
    _mm._pc.set_query_status(_cuda.NOT_READY)
    model = _mm.Model()
    gc.disable()
    for n in (2_000, 8_000, 32_000):
        for order in ("newest first", "oldest first"):
            futures = [cudafut.record(model.token, stream=model.streams[0]) for _ in range(n)]
            if order == "oldest first":
                futures.reverse()
            t = time.perf_counter()
            del futures
            per = (time.perf_counter() - t) / n * 1e6
            print(f"{n:>6} futures dropped {order}: {per:.3f} us per drop")


if __name__ == "__main__":
    main()
