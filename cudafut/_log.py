"""The package logger, ``logging.getLogger("cudafut")``.

Exceptions raised by user callbacks outside an event loop, and failed
futures that were never consumed, are reported here (never lost).
"""

from __future__ import annotations

import logging
from typing import Final

logger: Final = logging.getLogger("cudafut")
