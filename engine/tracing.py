"""Wall-clock milestones of a request across processes (``TANDEM_TRACE=1``)."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("tandem.trace")
_TRACE = bool(os.environ.get("TANDEM_TRACE"))


def trace(request_id: str, event: str) -> None:
    """With TANDEM_TRACE=1: log a wall-clock timestamp for a request's milestone (every process
    on one host shares the clock, so a request's path can be laid out across workers)."""
    if _TRACE:
        logger.warning("TRACE %s %s %.6f", request_id, event, time.time())
