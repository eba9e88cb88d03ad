"""The autoscaler in the controller: each pool's signals measured, its loop, its decisions done.

The decisions are cluster/control/autoscaler.py's (``Autoscaler``: pressures, marks, hysteresis,
cooldown); this component feeds it and acts::

    every interval_s (while enabled)   pool_signals(role) for every pool the cluster runs and no
                                       scale is running on: its active workers' stats (latencies
                                       over their recent window) and the routers' report_load
                                       -> Autoscaler.note (every pool's look first) -> observe
    a decision                         an ``autoscale`` event with its inputs -> out: a flex
                                       worker the other pool can spare switches roles
                                       (``switch_role``), else ``scale``; in: ``scale`` (a drain
                                       first), neither waited for

``report_load`` keeps each router's admission figures for ``ROUTER_LOAD_TTL_S`` and answers the
autoscaler's counts, pool sizes and latest look (what the router's /metrics exports).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from cluster.control.autoscaler import Autoscaler, Decision, PoolSignals
from cluster.control.events import EventLog
from cluster.control.membership import MembershipTable, worker_index
from cluster.control.operations import Refused
from cluster.control.scaling import Scaler
from engine.messages import WorkerState, brief

logger = logging.getLogger(__name__)

ROUTER_LOAD_TTL_S = 5.0  # a router's load report older than this no longer counts


class Autoscaling:
    """Runs ``autoscaler`` over the membership table's pools and carries its decisions out
    through ``scaler``. ``autoscaler.config`` may be replaced (the operator's policy): ``sync``
    then starts or stops the loop."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        membership: MembershipTable,
        scaler: Scaler,
        events: EventLog,
    ) -> None:
        self.autoscaler = autoscaler
        self.membership = membership
        self.scaler = scaler
        self.events = events
        self._loop: asyncio.Task | None = None
        self._router_loads: dict[str, tuple[float, dict[str, Any]]] = {}  # router -> report

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()

    def sync(self) -> None:
        """Run the autoscaler's loop while it is enabled (and the cluster has started)."""
        running = self._loop is not None and not self._loop.done()
        if self.autoscaler.config.enabled and self.scaler.roles and not running:
            self._loop = asyncio.ensure_future(self._forever())
        elif not self.autoscaler.config.enabled and running:
            self._loop.cancel()
            self._loop = None

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.autoscaler.config.interval_s)
            try:
                await self.once()
            except Exception:  # noqa: BLE001 - one bad look must not end the loop
                logger.exception("autoscaler round failed")

    async def once(self) -> list[dict[str, Any]]:
        """One look at every pool the cluster runs: its signals measured, the autoscaler's
        decision logged (an ``autoscale`` event with its inputs) and carried out by ``scale``
        (scale-in drains first), without waiting for the scale to end. A pool being scaled
        now is not looked at. Returns the decisions taken."""
        roles = [r for r in sorted(self.scaler.roles) if r not in self.scaler.running]
        signals = [await self.pool_signals(r) for r in roles]
        for look in signals:  # every pool's look first: a decision may weigh the other pool's
            self.autoscaler.note(look)
        taken, touched = [], set()
        for look in signals:
            if look.role in touched or look.role in self.scaler.running:
                continue  # a switch this round took a worker from (or gave one to) it
            decision = self.autoscaler.observe(look)
            if decision is None:
                continue
            taken.append(decision.as_dict())
            touched |= await self._carry_out(decision)
        return taken

    async def _carry_out(self, d: Decision) -> set[str]:
        """Carry a decision out; returns the pools it touched beyond its own (a switch's)."""
        self.events.add(
            "autoscale",
            role=d.role,
            direction=d.direction,
            from_replicas=d.replicas,
            to_replicas=d.target,
            signal=d.signal,
            reason=d.reason,
            inputs=d.inputs,
        )
        logger.warning("autoscaler: %s %s -> %s (%s)", d.role, d.replicas, d.target, d.reason)
        other = {"prefill": "decode", "decode": "prefill"}.get(d.role)
        spare = self._spare(other) if d.direction == "out" and other else None
        if spare is not None:  # the other pool has one to spare: switch it, no new weights
            why = f"autoscaler: {d.reason}; {other} has one to spare"
            self.scaler.background(self._switch_logged(spare, d.role, why))
            return {other}
        # the decision counts active workers; scale() sizes the live pool (a draining or
        # starting one included): move it by the same difference
        target = len(self.membership.pool(d.role)) + d.target - d.replicas
        with contextlib.suppress(Refused):  # the refusal is an event of its own
            await self.scaler.scale(d.role, target, wait=False, reason=f"autoscaler: {d.reason}")
        return set()

    async def _switch_logged(self, worker: str, role: str, reason: str) -> None:
        try:
            await self.scaler.switch_role(worker, role, reason=reason)
        except Exception as exc:  # noqa: BLE001 - logged; the next look decides again
            logger.warning("autoscaler: switching %s to %s failed: %s", worker, role, exc)
            self.membership.worker_event(
                "switch_failed", worker, f"to {role}: {brief(exc)} ({reason})"
            )

    async def pool_signals(self, role: str) -> PoolSignals:
        """What the autoscaler judges ``role``'s pool by, measured now from its active
        workers' stats (latencies over their recent window only) and the routers' reports."""
        active = [w for w in self.membership.pool(role) if w.state == WorkerState.ACTIVE]
        stats = await self.membership.stats_of(active)
        answered = [(w, s) for w, s in zip(active, stats, strict=True) if isinstance(s, dict)]
        signals = PoolSignals(role, len(active))
        if not answered:
            return signals

        def p90(s: dict[str, Any], name: str) -> float | None:
            q = (s.get("latency_recent") or {}).get(name)
            return q["p90"] if q else None

        def worst(values) -> float | None:
            values = [v for v in values if v is not None]
            return max(values) if values else None

        blocks = sum(s.get("total_blocks", 0) for _, s in answered) or 1
        if role != "decode":
            signals.queued_tokens = float(
                sum(s.get("waiting_prompt_tokens", 0) for _, s in answered)
            )
            signals.ttft_p90_s = worst(p90(s, "ttft_s") for _, s in answered)
        if role != "prefill":
            slots = sum(w.max_num_seqs or s.get("max_num_seqs", 0) for w, s in answered) or 1
            routers = self._fresh_router_loads()
            if routers:  # requests admitted by the routers (in prefill too) and waiting there
                demand = sum(r.get("running", 0) + r.get("queued", 0) for r in routers)
            else:
                demand = sum(s.get("running", 0) + s.get("waiting", 0) for _, s in answered)
            signals.slots_used = demand / slots
            signals.kv_used = sum(s.get("in_use_blocks", 0) for _, s in answered) / blocks
            if any("projected_blocks" in s for _, s in answered):
                signals.kv_demand = sum(s.get("projected_blocks", 0) for _, s in answered) / blocks
            signals.itl_p90_s = worst(p90(s, "step_gap_s") for _, s in answered)
        return signals

    def _fresh_router_loads(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        self._router_loads = {
            k: v for k, v in self._router_loads.items() if now - v[0] < ROUTER_LOAD_TTL_S
        }
        return [load for _, load in self._router_loads.values()]

    async def report_load(self, router: str, load: dict[str, Any]) -> dict[str, Any]:
        """A router's admission figures (``running``: requests holding a slot, ``queued``:
        waiting for one), kept ``ROUTER_LOAD_TTL_S``; answers the autoscaler's counts, pool
        sizes and latest look (what the router's /metrics exports; not its decision log)."""
        self._router_loads[router] = (time.monotonic(), dict(load))
        stats = self.stats()
        return {k: stats[k] for k in ("enabled", "counts", "pools", "latest")}

    def stats(self) -> dict[str, Any]:
        stats = self.autoscaler.stats()
        stats["pools"] = {r: len(self.membership.pool(r)) for r in sorted(self.scaler.roles)}
        return stats

    def _spare(self, role: str) -> str | None:
        """A worker of ``role``'s pool the autoscaler may take for the other pool: a flex
        worker, the pool above its ``min_replicas``, its latest look under its ``low`` mark
        with a worker fewer. The least loaded one (by the look's workers: the newest)."""
        if not self.scaler.spec.role_switching or role not in ("prefill", "decode"):
            return None
        policy = getattr(self.autoscaler.config, role)
        look = self.autoscaler.latest.get(role)
        active = [w for w in self.membership.pool(role) if w.state == WorkerState.ACTIVE]
        n = len(active)
        if look is None or n <= max(policy.min_replicas, 1) or role in self.scaler.running:
            return None
        if look["pressure"] * n / (n - 1) >= policy.low:
            return None
        flex = [w for w in active if w.name.startswith("flex-")]
        return max(flex, key=lambda w: worker_index(w.name)).name if flex else None
