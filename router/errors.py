"""The router's errors: one hierarchy, raised wherever a request fails (admission, placement,
dispatch), translated to HTTP once, at the gateway's edge (router/gateway.py ``api_error``)::

    ClusterError          the request failed inside the cluster (after its retries)   500
    ├── RequestError      the cluster refused the request's content; nothing started  400
    └── CapacityError     no room now: the router's queue is full, or no worker can   429 / 503
                          take it in time (``status``), with ``retry_after_s``        + Retry-After

After the first byte of a stream the same error goes out in-band as an SSE frame.
"""

from __future__ import annotations


class ClusterError(RuntimeError):
    """A request failed inside the cluster (HTTP 500, or an in-band error once streaming)."""


class RequestError(ClusterError, ValueError):
    """The request is invalid; nothing was started (HTTP 400)."""


class CapacityError(ClusterError):
    """No room for the request now: admission refused it (the router's queue is full, or its
    projected wait too long: ``status`` 429), or no worker can take it (every one dead or
    suspect, or no decode room within the reservation timeout: 503). The gateway answers
    ``status`` with Retry-After ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status: int = 503) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status


def no_live_workers() -> CapacityError:
    """The refusal when no worker can take a request now (every one dead or suspect): 503."""
    return CapacityError("no live workers can take requests now", status=503)
