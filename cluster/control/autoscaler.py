"""The autoscaler's decisions: when a pool (prefill, decode, colocated) grows or shrinks, and why.

Off by default. Each pool is judged on its own measured signals, each turned into a *pressure*
(1.0 = at its target)::

    prefill    queue   uncached prompt tokens waiting per worker / ``queue_tokens``
               ttft    the workers' time-to-first-token p90 / ``slo_s``
    decode     slots   requests holding or waiting for a running slot (the routers' admitted and
                       queued requests; without router reports, the workers' running and
                       waiting) / the pool's slots (max_num_seqs each)
               kv      blocks in use / blocks (the pool's)
               demand  projected blocks (what running requests will hold at their predicted
                       end: the length predictor's p90, else max_tokens) / blocks
               itl     the workers' inter-token (step gap) p90 / ``slo_s``
    colocated  all of the above that its workers report

The pool's pressure is the largest; the signal that gave it is the decision's reason. A pool
grows by ``step`` when its pressure has stayed above ``high`` for ``up_after_s``; it shrinks
by one when its pressure *as if it had one worker fewer* (pressure x n / (n - 1)) has stayed
below ``low`` for ``down_after_s`` (so a shrink never lands it straight back above ``high``:
the gap between the marks is the hysteresis). After any decision the pool waits
``cooldown_s``; it never leaves [``min_replicas``, ``max_replicas``]. Shrinking is always a
drain first (the controller's ``scale``): no request is aborted by it.

This module decides and explains; the controller gathers the signals and acts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from engine.settings import check, nested, setting

ROLES = ("prefill", "decode", "colocated")


@dataclass
class PoolPolicy:
    """How the autoscaler sizes one pool. A pool's pressure is its largest signal over its
    target (1.0 at target). One definition for the code, the serve config file's
    ``autoscale.<role>`` sections and their rows in docs/config.md (engine/settings.py)."""

    min_replicas: int = setting(1, "Workers the pool never goes below.", ge=1)
    max_replicas: int = setting(4, "Workers the pool never goes above.", ge=1)
    high: float = setting(0.85, "Pressure above which, for `up_after_s`, the pool grows.", gt=0)
    low: float = setting(
        0.5,
        "Pressure (as if the pool had one worker fewer) below which, for `down_after_s`, it "
        "shrinks by one, by a drain.",
        gt=0,
    )
    up_after_s: float = setting(10.0, "Seconds over `high` before growing.", ge=0)
    down_after_s: float = setting(60.0, "Seconds under `low` before shrinking.", ge=0)
    cooldown_s: float = setting(
        60.0, "Seconds after any decision of this pool before the next.", ge=0
    )
    step: int = setting(1, "Workers added per scale-out.", ge=1)
    slo_s: float | None = setting(
        None,
        "Latency target: TTFT p90 (prefill, colocated) or ITL p90 (decode), over the workers' "
        "last 30 s. Default: 2 s (prefill, colocated), 0.25 s (decode).",
        gt=0,
    )
    queue_tokens: float = setting(
        8192.0, "Prefill: prompt tokens waiting per worker that make a pressure of 1.0.", gt=0
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        check(self)
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")


# Each role's latency target unless set: TTFT p90 (prefill, colocated), ITL p90 (decode).
DEFAULT_SLO_S = {"prefill": 2.0, "decode": 0.25, "colocated": 2.0}


@dataclass
class AutoscalerConfig:
    """The controller's autoscaler; one definition for the code, the serve config file's
    ``autoscale`` section and its rows in docs/config.md (engine/settings.py). A pool given as
    a mapping (a file's section, ``tandem policy --pool``) sets its fields over the role's
    defaults."""

    enabled: bool = setting(False, "Size the pools from their measured signals.")
    interval_s: float = setting(5.0, "Seconds between looks at the signals.", gt=0)
    prefill: PoolPolicy = nested(
        lambda: PoolPolicy(slo_s=DEFAULT_SLO_S["prefill"]),
        "How the autoscaler sizes this pool (fields left out: defaults).",
    )
    decode: PoolPolicy = nested(
        lambda: PoolPolicy(slo_s=DEFAULT_SLO_S["decode"]),
        "How the autoscaler sizes this pool (fields left out: defaults).",
    )
    colocated: PoolPolicy = nested(
        lambda: PoolPolicy(slo_s=DEFAULT_SLO_S["colocated"]),
        "How the autoscaler sizes this pool (fields left out: defaults).",
    )

    def __post_init__(self) -> None:
        for role in ROLES:
            policy = getattr(self, role)
            if isinstance(policy, Mapping):  # the fields it sets, over the role's defaults
                setattr(self, role, PoolPolicy(**{"slo_s": DEFAULT_SLO_S[role], **policy}))
            getattr(self, role).check()
        check(self)


@dataclass
class PoolSignals:
    """What the controller measured of one pool (None: not measured; it adds no pressure)."""

    role: str
    replicas: int  # workers that take new requests (ACTIVE)
    queued_tokens: float | None = None  # prefill: uncached prompt tokens waiting, pool total
    slots_used: float | None = None  # requests running or queued for a slot / slots
    ttft_p90_s: float | None = None
    kv_used: float | None = None  # blocks in use / blocks, over the pool
    kv_demand: float | None = None  # projected blocks / blocks, over the pool
    itl_p90_s: float | None = None

    def pressures(self, policy: PoolPolicy) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.queued_tokens is not None and self.role != "decode":
            out["queue"] = self.queued_tokens / max(self.replicas, 1) / policy.queue_tokens
        if self.ttft_p90_s is not None and policy.slo_s and self.role != "decode":
            out["ttft"] = self.ttft_p90_s / policy.slo_s
        if self.slots_used is not None and self.role != "prefill":
            out["slots"] = self.slots_used
        if self.kv_used is not None and self.role != "prefill":
            out["kv"] = self.kv_used
        if self.kv_demand is not None and self.role != "prefill":
            out["demand"] = self.kv_demand
        if self.itl_p90_s is not None and policy.slo_s and self.role == "decode":
            out["itl"] = self.itl_p90_s / policy.slo_s
        return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class Decision:
    role: str
    direction: str  # "out" | "in"
    replicas: int  # before
    target: int  # after
    reason: str  # the signal that drove it, e.g. "kv 0.93 > 0.85 for 10 s"
    signal: str  # its name: queue, ttft, slots, kv, demand, itl (the metric's reason label)
    inputs: dict[str, Any]  # the signals and pressures it saw
    at: float  # wall time

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Pool:
    def __init__(self) -> None:
        self.over_since: float | None = None  # pressure above high since
        self.under_since: float | None = None  # pressure with one fewer below low since
        self.last_decision: float = -math.inf


class Autoscaler:
    """Decisions from signals (``observe``); ``clock`` is monotonic seconds (tests pass one)."""

    def __init__(
        self, config: AutoscalerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self._pools = {role: _Pool() for role in ROLES}
        self.decisions: list[Decision] = []  # the latest 200, oldest first
        self.counts: dict[tuple[str, str, str], int] = {}  # (role, direction, signal): all time
        self.latest: dict[str, dict[str, Any]] = {}  # role -> what its last look saw

    def note(self, signals: PoolSignals) -> dict[str, Any]:
        """What a look at a pool sees (its pressures, the largest and its signal), kept as the
        pool's ``latest`` without deciding anything (``observe`` decides)."""
        policy: PoolPolicy = getattr(self.config, signals.role)
        pressures = signals.pressures(policy)
        signal, pressure = max(pressures.items(), key=lambda kv: kv[1], default=("none", 0.0))
        look = {
            "replicas": signals.replicas,
            "pressures": {k: round(v, 4) for k, v in pressures.items()},
            "signals": {k: v for k, v in asdict(signals).items() if k not in ("role", "replicas")},
            "signal": signal,
            "pressure": round(pressure, 4),
        }
        self.latest[signals.role] = look
        return look

    def observe(self, signals: PoolSignals) -> Decision | None:
        """One look at a pool: the decision to take now, or None."""
        policy: PoolPolicy = getattr(self.config, signals.role)
        pool, now, n = self._pools[signals.role], self.clock(), signals.replicas
        look = self.note(signals)
        signal, pressure = look["signal"], look["pressure"]
        fewer = pressure * n / (n - 1) if n > 1 else math.inf
        if pressure <= policy.high:
            pool.over_since = None
        elif pool.over_since is None:
            pool.over_since = now
        if fewer >= policy.low:
            pool.under_since = None
        elif pool.under_since is None:
            pool.under_since = now
        inputs = {k: look[k] for k in ("replicas", "pressures", "signals")}
        if now - pool.last_decision < policy.cooldown_s:
            return None
        over = pool.over_since is not None and now - pool.over_since >= policy.up_after_s
        under = pool.under_since is not None and now - pool.under_since >= policy.down_after_s
        role, decision = signals.role, None
        if n < policy.min_replicas:
            why = f"{n} workers < min_replicas {policy.min_replicas}"
            decision = self._decide(
                role, "out", n, policy.min_replicas, "min_replicas", why, inputs
            )
        elif n > policy.max_replicas:
            why = f"{n} workers > max_replicas {policy.max_replicas}"
            decision = self._decide(role, "in", n, policy.max_replicas, "max_replicas", why, inputs)
        elif over and n < policy.max_replicas:
            why = f"{signal} {pressure:.2f} > {policy.high} for {now - pool.over_since:.0f} s"
            target = min(n + policy.step, policy.max_replicas)
            decision = self._decide(role, "out", n, target, signal, why, inputs)
        elif under and n > policy.min_replicas:
            why = (
                f"{signal} {pressure:.2f} (x{n}/{n - 1} = {fewer:.2f}) < {policy.low} "
                f"for {now - pool.under_since:.0f} s"
            )
            decision = self._decide(role, "in", n, n - 1, signal, why, inputs)
        if decision is not None:
            pool.last_decision = now
            pool.over_since = pool.under_since = None
        return decision

    def _decide(self, role, direction, n, target, signal, reason, inputs) -> Decision:
        d = Decision(role, direction, n, target, reason, signal, inputs, time.time())
        self.decisions = [*self.decisions[-199:], d]
        key = (role, direction, signal)
        self.counts[key] = self.counts.get(key, 0) + 1
        return d

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.config.enabled,
            "latest": self.latest,
            "decisions": [d.as_dict() for d in self.decisions[-20:]],
            "counts": [
                {"role": r, "direction": dr, "reason": s, "count": c}
                for (r, dr, s), c in sorted(self.counts.items())
            ],
        }
