"""What the controller and the operator API (cluster/control/operator.py) both speak: the refusal an
operation ends in, a drain's default deadline, and what a drain report leaves behind. Its own
module so the controller, which starts the operator server, and the server, which calls the
controller, import it instead of each other."""

from __future__ import annotations

from typing import Any

DRAIN_DEADLINE_S = 60.0


class Refused(ValueError):
    """The operator asked for something the controller will not do as things are (scaling
    below one worker or below the running load without ``force``; a new pool that no router
    would route to, or of a role the cluster was not started with, without ``force``; a second
    scale of a role while one runs). The message says why and what would make it go through."""


def not_moved(report: dict[str, Any]) -> int:
    """Requests a drain report leaves on its worker (still running, or their moves failed)."""
    counts = report.get("counts", {})
    return sum(n for k, n in counts.items() if k not in ("migrated", "finished"))
