"""Placement: which prefill worker and which decode worker take a request.

A policy sees the request (prompt length, the prefix index's cached blocks per worker and the
tier of each, an output length estimate when a predictor gives one) and a load view of every
candidate worker, and returns its choice with a reason (counted in
``tandem:routing_decisions_total``). Policies:

``cache_aware`` (default)
    prefill: the least estimated prefill work, in tokens recomputed: ``uncached prompt tokens +
    the cached prefix's load cost + tokens already queued there``. A block in the device pool is
    free; one in host memory or on disk costs a block's tokens times its measured load time over
    its recompute time (the worker's ``TierCosts``); a miss costs every token. So a device hit
    beats a host hit, which beats a disk hit, which beats a miss, until the holder's queue costs
    more than the difference. Reasons: ``prefix_hit`` (the chosen worker's prefix saves the
    most, all on device), ``prefix_hit_host`` / ``prefix_hit_disk`` (part of it loads from host
    memory / disk), ``prefix_overloaded`` (a better holder's queue outweighed its hit), ``load``
    (no worker holds any of it).
    decode: among workers with room for the prompt (+ the predicted output's 90th percentile) in
    free blocks, the least work: with a length predictor the output tokens its requests are
    still predicted to produce, else requests (running + waiting + in flight). Ties: a random
    pick among the equals, never the first in the list (concurrent requests must not herd onto
    one worker).
``least_loaded``
    prefill and decode by queued work only (no index): the fallback when Redis is down.
``round_robin``
    each pool in turn: the baseline of the shared-prefix benchmark.

A colocated cluster uses ``choose_prefill`` only (the worker does both).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.prefix_index import DEVICE, DISK, HOST


@dataclass
class WorkerView:
    """What the router knows of one worker when placing a request."""

    name: str
    role: str
    outstanding: int = 0  # requests this router has in flight on it
    # Prefill work this router sent here, first token not back: prompt tokens to compute, a
    # lower-tier hit's loads priced in (``RouteRequest.prefill_tokens``).
    queued_prefill_tokens: int = 0
    # From the worker's last stats poll (None before the first):
    free_blocks: int | None = None
    running: int = 0
    waiting: int = 0
    # Output tokens this router's requests on it are still predicted to produce (None: no
    # length predictor); the decode choice then balances predicted work, not request counts.
    predicted_work: float | None = None
    # Tier code (HOST, DISK) -> loading a block from there over recomputing it, from the worker's
    # measured costs (``load_fractions``); a tier missing (no stats yet, no such tier, or a load
    # slower than the recompute) is priced as a recompute.
    tier_load: dict[str, float] = field(default_factory=dict)


def load_fractions(costs: Mapping[str, float] | None) -> dict[str, float]:
    """``WorkerView.tier_load`` from a worker's ``TierCosts.as_dict()`` (its stats'
    ``kv_tiers.costs``): each lower tier's load time per block over the recompute time per
    block, for the tiers the engine loads from (cheaper than recomputing)."""
    if not costs:
        return {}
    recompute = costs.get("recompute_s", 0.0)
    if not 0 < recompute < math.inf:
        return {}
    out = {}
    for code, key in ((HOST, "host_load_s"), (DISK, "disk_load_s")):
        load = costs.get(key)
        if load is not None and 0 <= load < recompute:
            out[code] = load / recompute
    return out


@dataclass
class RouteRequest:
    prompt_len: int
    block_size: int
    # Worker name -> the tier code of each leading block of this prompt it holds, per the global
    # index (engine.prefix_index: "0" device, "1" host, "2" disk), e.g. "0011".
    cached_tiers: dict[str, str] = field(default_factory=dict)
    index_available: bool = True
    # A length predictor's estimate of the output tokens; None: no predictor (the decode
    # choice then sizes the request by its prompt only). The predictor issue fills this in.
    predicted_output_tokens: int | None = None
    hashes: list[bytes] = field(default_factory=list)  # the prompt's chained block hashes

    @property
    def cached_blocks(self) -> dict[str, int]:
        """Worker name -> leading blocks of this prompt it holds, at any tier."""
        return {w: len(tiers) for w, tiers in self.cached_tiers.items()}

    def cached_tokens(self, worker: str) -> int:
        # The engine always recomputes at least the last prompt token.
        return min(len(self.cached_tiers.get(worker, "")) * self.block_size, self.prompt_len - 1)

    def _used_tiers(self, worker: str) -> str:
        """The tiers of the cached blocks a prefill on ``worker`` uses (the last one partly)."""
        return self.cached_tiers.get(worker, "")[
            : -(-self.cached_tokens(worker) // self.block_size)
        ]

    def prefill_tokens(self, worker: str, tier_load: Mapping[str, float]) -> float:
        """What prefilling this prompt on ``worker`` costs, in tokens recomputed: the uncached
        tokens, plus a block's tokens times ``tier_load`` of its tier for each cached block
        loaded from below (a tier missing: a recompute). A device block is free as part of the
        leading run the engine finds in its pool; after the first block below, the engine
        loads the rest from below (write-through left a copy in host memory), so a device
        block there is priced as a host one."""
        cached = self.cached_tokens(worker)
        tiers = self._used_tiers(worker)
        below = tiers.lstrip(DEVICE)
        if not below:
            return float(self.prompt_len - cached)
        host, disk = tier_load.get(HOST, 1.0), tier_load.get(DISK, 1.0)
        on_disk = below.count(DISK)
        loaded = ((len(below) - on_disk) * host + on_disk * disk) * self.block_size
        # the last block used is used in part when the prompt ends in it
        loaded -= (len(tiers) * self.block_size - cached) * (disk if tiers[-1] == DISK else host)
        return self.prompt_len - cached + loaded

    def hit_reason(self, worker: str) -> str:
        """``prefix_hit``, or ``prefix_hit_host`` / ``prefix_hit_disk`` when part of
        ``worker``'s cached prefix comes from host memory / disk (the lowest tier counts)."""
        below = self._used_tiers(worker).lstrip(DEVICE)
        return "prefix_hit_disk" if DISK in below else "prefix_hit_host" if below else "prefix_hit"


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
        work = {w.name: req.prefill_tokens(w.name, w.tier_load) for w in workers}
        chosen = _pick_min(workers, lambda w: work[w.name] + w.queued_prefill_tokens, self._rng)
        if not req.index_available:
            return chosen.name, "load_no_index"
        least = min(work.values())
        if least < req.prompt_len and work[chosen.name] == least:
            return chosen.name, req.hit_reason(chosen.name)
        if least < req.prompt_len:
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
