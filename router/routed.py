"""One request as the router carries it from placement through dispatch, and who places it again.

The service (router/service.py) admits a request, places it and builds its ``RoutedRequest``;
the dispatcher (router/dispatch.py) runs it. When an attempt fails retryably, the dispatcher
adds the attempt's workers to ``avoid`` (``RoutedRequest.failed_on``) and asks its ``Placer``
for the next placement (``place_again``)::

    service:    ticket (admission slot + prediction) -> placement (prefill, decode)
                -> RoutedRequest(ids, params, placement, ticket, route, ...)
    dispatch:   attempt on req.prefill / req.decode
                  failed retryably -> req.failed_on(workers)
                                   -> req.prefill, req.decode = placer.place_again(req)
                                   -> attempt again (a retry, or a resume after tokens)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.sampling_params import SamplingParams
from router.admission import Ticket
from router.policy import RouteRequest
from router.predictor import PredictInput


@dataclass
class RoutedRequest:
    """A request, its placement and what its retries must avoid."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prefill: str | None  # the current attempt's prefill worker (None: colocated)
    decode: str  # the current attempt's decode (or colocated) worker
    priority: int = 0
    cache_salt: str | None = None
    # the decode reservation's projected output (None: no prediction, reserve the prompt only)
    predicted_tokens: int | None = None
    ticket: Ticket | None = None  # the admission slot it holds (and its prediction)
    route: RouteRequest | None = None  # what the policy placed it by (prefix hits, hashes)
    hints: PredictInput | None = None  # what the length predictor read of it
    avoid: set[str] = field(default_factory=set)  # workers a failed attempt ran on

    @property
    def colocated(self) -> bool:
        """One worker runs the whole request (no prefill worker)."""
        return self.prefill is None

    def failed_on(self, *workers: str | None) -> None:
        """An attempt on ``workers`` failed retryably: the next placement avoids them."""
        self.avoid.update(w for w in workers if w is not None)

    def worker_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of its calls into workers (``predicted_tokens`` only with a
        prediction; the dispatcher gives it to the decode reservation alone)."""
        kwargs: dict[str, Any] = {"priority": self.priority, "cache_salt": self.cache_salt}
        if self.predicted_tokens is not None:
            kwargs["predicted_tokens"] = self.predicted_tokens
        return kwargs


class Placer(Protocol):
    """Who places a request again after an attempt failed."""

    def place_again(self, req: RoutedRequest) -> tuple[str | None, str]:
        """(prefill or None, decode) for the next attempt of ``req``, from the same pools as
        its first (colocated stays colocated), ``req.avoid`` excluded where others are left.
        Raises when no worker can take it."""
        ...
