"""What the HTTP gateway needs from the cluster behind it: one interface, so the gateway is
tested against a small in-process backend and served by the real router over Ray workers.

A request through it::

    1. the gateway validates the body, renders the chat template, tokenizes, checks the context
       length and builds ``SamplingParams`` (errors are 400s and cost nothing else)
    2. ``Backend.open`` admits it (or raises ``CapacityError``: 429 / 503 with Retry-After),
       places it on workers (``Generation.placement``: the response's x-tandem-prefill /
       x-tandem-decode headers) and starts it; every failure is one of router/errors.py's,
       translated to HTTP by the gateway alone
    3. the gateway iterates ``Generation.outputs()`` (``Step``s, router/outputs.py: what each
       choice gained, the last one ``finished``) into SSE frames, or folds them into an
       ``Answer`` for one response body
    4. ``Generation.aclose()`` (client gone, or an error) aborts it on every worker; calling it
       after the request finished is a no-op
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.sampling_params import SamplingParams
from router.outputs import Step
from router.predictor import PredictInput


@dataclass(frozen=True)
class Placement:
    """Which workers serve a request and why (a routing reason, for metrics)."""

    prefill: str | None  # None: a colocated worker runs the whole request
    decode: str  # the decode (or colocated) worker that produces the tokens
    reason: str = ""
    cached_blocks: int = 0  # the index's longest cached prefix on the chosen prefill worker
    predicted_tokens: int | None = None  # the length predictor's median (x-tandem-predicted-tokens)


class Generation(Protocol):
    placement: Placement

    def outputs(self) -> AsyncIterator[Step]:
        """The request's steps as tokens arrive (never cumulative: each says what its choices
        gained, with the usage counts so far); raises ClusterError on a failure."""

    async def aclose(self) -> None:
        """Abort the request everywhere (idempotent; a no-op once it finished)."""


class Admin(Protocol):
    """The operator's calls (the gateway's /admin routes, router/admin.py), run by the cluster
    controller. A bad worker name or setting raises ValueError (wrapped by Ray as it raises
    it); the results are the controller's own."""

    async def migrate(
        self,
        request_id: str | None = None,
        *,
        to: str | None = None,
        from_: str | None = None,
        count: int = 1,
    ) -> list[Any]:
        """Move one running request (``request_id``), or ``count`` of ``from_``'s, to ``to``
        (None: the least loaded); one MigrationResult each."""

    async def drain(self, worker: str, deadline_s: float) -> dict[str, Any]:
        """Stop placing requests on ``worker`` and empty it; the drain report."""

    async def undrain(self, worker: str) -> Any:
        """Place requests on a drained ``worker`` again."""

    async def rebalance(
        self,
        *,
        mode: str | None = None,
        high: float | None = None,
        low: float | None = None,
        interval_s: float | None = None,
        max_moves: int | None = None,
    ) -> dict[str, Any]:
        """The rebalancer's settings, those given (not None) changed, and what it has done."""

    async def rebalance_once(self) -> list[dict[str, Any]]:
        """One rebalance round now, in the configured mode; its actions."""


class Backend(Protocol):
    model_name: str  # the id clients send as "model" (and /v1/models lists)
    max_model_len: int  # prompt + output tokens, at most
    tokenizer: Any  # a transformers tokenizer (None: token-id prompts only)
    admin: Admin | None  # the operator's calls (None: no controller behind it: /admin is 501)

    async def open(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        hints: PredictInput | None = None,
    ) -> Generation:
        """Admit and start one request. Raises CapacityError, RequestError or ClusterError
        (router/errors.py).
        ``hints``: what the length predictor reads of the request (its text, turns, max_tokens,
        the benchmark's oracle header)."""

    async def healthy(self) -> bool:
        """True while a request can be placed (GET /health); cheap: from the state the backend
        keeps, never a call to every worker."""

    async def worker_stats(self) -> list[dict[str, Any]]:
        """One dict per worker for /metrics; keys (absent ones are skipped): name, role,
        running, waiting, total_blocks, free_blocks, cached_blocks, in_use_blocks,
        prefix_queries_tokens, prefix_hit_tokens, kv_bytes_sent, kv_bytes_received,
        kv_transfer_seconds, kv_transfer_tail_seconds, kv_transfers_in, kv_staged_bytes,
        projected_blocks, migrations (a decode worker's live-migration
        counters: out, in, bytes, blocks, stages, pause_buckets, pause_sum)."""

    def router_stats(self) -> RouterStats:
        """Counters of the router (monotonic) and the workers' states, for /metrics and
        /health."""


@dataclass
class RouterStats:
    decisions: dict[str, int] = field(default_factory=dict)  # placements by reason
    index_unavailable: int = 0  # lookups that fell back to load-only routing (Redis down)
    resumes: dict[str, int] = field(default_factory=dict)  # requests continued elsewhere, by why
    worker_states: dict[str, str] = field(default_factory=dict)  # as this router acts on them
    missed_polls: dict[str, int] = field(default_factory=dict)  # consecutive, per worker
    migrations: int = 0  # requests of this router moved live to another decode worker
    scheduling: dict[str, Any] = field(default_factory=dict)  # router/admission.py stats()
    # the controller's answer to this router's last load report: the autoscaler's decision
    # counts and latest look at each pool (cluster/control/controller.py ``autoscale_stats``)
    control: dict[str, Any] = field(default_factory=dict)
