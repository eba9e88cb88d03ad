"""Placement: which prefill worker and which decode worker take a request.

A policy sees the request (prompt length, the prefix index's cached blocks per worker, an output
length estimate when a predictor gives one) and a load view of every candidate worker, and
returns its choice with a reason (counted in ``tandem:routing_decisions_total``). Policies:

``cache_aware`` (default)
    prefill: the least estimated prefill work, ``uncached prompt tokens + tokens already queued
    there``, so a worker holding the prefix wins until its queue costs more than the recompute
    elsewhere. decode: among workers with room for the prompt (+ the predicted output's 90th
    percentile) in free blocks, the least work: with a length predictor the output tokens its
    requests are still predicted to produce, else requests (running + waiting + in flight). Ties: a random pick among the
    equals, never the first in the list (concurrent requests must not herd onto one worker).
``least_loaded``
    prefill and decode by queued work only (no index): the fallback when Redis is down.
``round_robin``
    each pool in turn: the baseline of the shared-prefix benchmark.

A colocated cluster uses ``choose_prefill`` only (the worker does both).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class WorkerView:
    """What the router knows of one worker when placing a request."""

    name: str
    role: str
    outstanding: int = 0  # requests this router has in flight on it
    queued_prefill_tokens: int = 0  # prompt tokens sent here by this router, first token not back
    # From the worker's last stats poll (None before the first):
    free_blocks: int | None = None
    running: int = 0
    waiting: int = 0
    # Output tokens this router's requests on it are still predicted to produce (None: no
    # length predictor); the decode choice then balances predicted work, not request counts.
    predicted_work: float | None = None


@dataclass
class RouteRequest:
    prompt_len: int
    block_size: int
    # Worker name -> leading blocks of this prompt in its prefix cache, per the global index.
    cached_blocks: dict[str, int] = field(default_factory=dict)
    index_available: bool = True
    # A length predictor's estimate of the output tokens; None: no predictor (the decode
    # choice then sizes the request by its prompt only). The predictor issue fills this in.
    predicted_output_tokens: int | None = None
    hashes: list[bytes] = field(default_factory=list)  # the prompt's chained block hashes

    def cached_tokens(self, worker: str) -> int:
        # The engine always recomputes at least the last prompt token.
        return min(self.cached_blocks.get(worker, 0) * self.block_size, self.prompt_len - 1)


class PlacementPolicy(Protocol):
    name: str

    def choose_prefill(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        """(worker name, reason)."""

    def choose_decode(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        """(worker name, reason)."""


def _pick_min(workers: list[WorkerView], key, rng: random.Random) -> WorkerView:
    best = min(key(w) for w in workers)
    return rng.choice([w for w in workers if key(w) == best])


def _decode_work(w: WorkerView) -> float:
    """Work ahead on a decode worker: with a length predictor, the output tokens this router's
    requests there are still predicted to produce; else requests (running + waiting + in
    flight)."""
    if w.predicted_work is not None:
        return w.predicted_work
    return w.running + w.waiting + w.outstanding


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose_prefill(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        def cost(w: WorkerView) -> int:
            return req.prompt_len - req.cached_tokens(w.name) + w.queued_prefill_tokens

        chosen = _pick_min(workers, cost, self._rng)
        if not req.index_available:
            return chosen.name, "load_no_index"
        best_cached = max(req.cached_tokens(w.name) for w in workers)
        if best_cached > 0 and req.cached_tokens(chosen.name) == best_cached:
            return chosen.name, "prefix_hit"
        if best_cached > 0:
            return chosen.name, "prefix_overloaded"  # the holder's queue outweighed the hit
        return chosen.name, "load"

    def choose_decode(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        output = req.predicted_output_tokens or 0
        need = -(-(req.prompt_len + output) // req.block_size)
        fits = [w for w in workers if w.free_blocks is None or w.free_blocks >= need]
        if not fits:  # every one full: the most room (the reservation then waits or fails)
            return _pick_min(workers, lambda w: -(w.free_blocks or 0), self._rng).name, "full"
        return _pick_min(fits, _decode_work, self._rng).name, "decode_load"


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose_prefill(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        w = _pick_min(workers, lambda w: (w.queued_prefill_tokens, w.outstanding), self._rng)
        return w.name, "least_loaded"

    def choose_decode(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        return _pick_min(workers, _decode_work, self._rng).name, "least_loaded"


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    def _next(self, pool: str, workers: list[WorkerView]) -> str:
        names = sorted(w.name for w in workers)
        return names[next(self._turn[pool]) % len(names)]

    def choose_prefill(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        return self._next("prefill", workers), "round_robin"

    def choose_decode(self, req: RouteRequest, workers: list[WorkerView]) -> tuple[str, str]:
        return self._next("decode", workers), "round_robin"


POLICIES = {p.name: p for p in (CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy)}


def make_policy(name: str, seed: int | None = None) -> PlacementPolicy:
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; one of {sorted(POLICIES)}") from None
