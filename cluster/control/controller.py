"""The controller: a named, detached Ray actor that owns the workers and their membership.

It starts every worker actor (so the workers belong to it, not to a gateway process: a gateway
can die and restart without taking them down) and is composed of one component per concern,
each a module of cluster/control/ that gets what it needs in its constructor::

    EventLog          events.py       every state change, scale, decision, migration and policy
                                      change, with sequence numbers; ``events(since)`` long-polls
    MembershipTable   membership.py   the workers, their states (STARTING / ACTIVE / SUSPECT /
                                      DRAINING / DEAD) and the table's version, long-polled by
                                      routers (``watch``); the health loop; ``report_dead`` /
                                      ``report_unresponsive`` from routers           (EventLog)
    Spawner           spawn.py        one worker actor per role from the ``WorkerSpec`` (spec.py);
                                      KV channels between prefill and decode workers (table)
    Migrator          migrations.py   ``migrate``, a decode worker's drain, the rebalance loop
                                                                           (table, EventLog)
    Scaler            scaling.py      ``start``, ``scale`` out and in, ``drain`` / ``undrain``,
                                      ``switch_role`` of flex workers
                                                      (table, Spawner, Migrator, EventLog)
    Autoscaling       autoscaling.py  the autoscaler's loop: pool signals and the routers'
                                      ``report_load`` -> Autoscaler (autoscaler.py) decides ->
                                      ``scale`` or ``switch_role``    (table, Scaler, EventLog)

The actor's methods (what routers, the launcher, the operator service and tests call) are thin
delegations to them; the actor itself joins them where an answer needs several: ``status()``
(the table with each worker's stats, the policies, the scales running), ``policy()`` /
``set_policy()`` (the rebalancer's, the health checks' and the autoscaler's settings, all
checked before any applies) and ``shutdown()``. The operator's gRPC API
(cluster/control/operator.py, ``start_operator``) serves all of it from this actor's event loop.

A cluster's life here::

    start(n_prefill, n_decode, n_colocated)   spawn -> ready() -> ACTIVE, published; the health
                                              loop starts, the autoscaler's if enabled, and the
                                              KV channels form
    serving                                   routers watch the table, report failures and load;
                                              health checks, rebalance and the autoscaler run
    scale / drain / switch_role / migrate     the operator's (and the autoscaler's) changes
    shutdown()                                the operator API, background work and loops stop;
                                              every worker shut down and killed, DEAD, published
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import Any

from cluster.control.autoscaler import Autoscaler, AutoscalerConfig, PoolSignals
from cluster.control.autoscaling import Autoscaling
from cluster.control.events import EventLog
from cluster.control.membership import HealthConfig, MembershipTable
from cluster.control.migrations import Migrator
from cluster.control.operations import DRAIN_DEADLINE_S, Refused
from cluster.control.scaling import Scaler
from cluster.control.spawn import Spawner
from cluster.control.spec import ROLES, WorkerSpec
from engine.messages import Membership, MigrationResult, WorkerInfo, WorkerState, brief

__all__ = ["ROLES", "Controller", "HealthConfig", "Refused", "WorkerSpec"]

logger = logging.getLogger(__name__)


class Controller:
    def __init__(
        self,
        spec: WorkerSpec,
        health: HealthConfig | None = None,
        autoscale: AutoscalerConfig | dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(autoscale, AutoscalerConfig):
            autoscale = AutoscalerConfig(**(autoscale or {}))
        self.spec = spec
        self.event_log = EventLog()
        self.membership = MembershipTable(spec, health or HealthConfig(), self.event_log)
        self.spawner = Spawner(spec, self.membership)
        self.migrator = Migrator(self.membership, self.event_log)
        self.scaler = Scaler(spec, self.membership, self.spawner, self.migrator, self.event_log)
        self.autoscaler = Autoscaler(autoscale)
        self.autoscaling = Autoscaling(
            self.autoscaler, self.membership, self.scaler, self.event_log
        )
        self._operator: Any = None  # cluster.control.operator.OperatorServer once started

    # -- membership and health (membership.py) -------------------------------------------------

    async def watch(self, version: int, timeout_s: float = 10.0) -> Membership:
        """The table once it is newer than ``version`` (or after ``timeout_s``, as it is)."""
        return await self.membership.watch(version, timeout_s)

    async def members(self) -> Membership:
        return self.membership.table()

    async def report_dead(self, name: str, why: str = "") -> None:
        """A router saw ``name`` fail: confirm (its actor does not answer) and mark it dead."""
        await self.membership.report_dead(name, why)

    async def report_unresponsive(self, name: str, why: str = "") -> None:
        """A router saw ``name`` go silent: check it now (a miss makes it SUSPECT at once)."""
        await self.membership.report_unresponsive(name, why)

    async def kill(self, name: str) -> None:
        """Kill one worker's actor (fault tests; drain comes with the operator API)."""
        await self.membership.kill(name)

    # -- starting and scaling (scaling.py) -----------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int, num_colocated: int) -> Membership:
        """Start workers and wait until every one answers; returns the table with them
        active. Raises (and kills what it started) when one fails to start."""
        await self.scaler.start(num_prefill, num_decode, num_colocated)
        self.autoscaling.sync()
        await self.spawner.connect_kv_pairs()
        return self.membership.table()

    async def scale(
        self,
        role: str,
        replicas: int,
        wait: bool = True,
        force: bool = False,
        drain_deadline_s: float = DRAIN_DEADLINE_S,
        reason: str = "operator",
        engine: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Make ``role`` have ``replicas`` live workers (``Scaler.scale``; ``engine``: the
        added workers' own engine settings); refused (``Refused``) below one worker or the
        running load unless ``force``."""
        return await self.scaler.scale(
            role, replicas, wait, force, drain_deadline_s, reason, engine=engine
        )

    async def drain(self, worker: str, deadline_s: float = DRAIN_DEADLINE_S) -> dict[str, Any]:
        """Stop placing requests on ``worker`` and empty it (``Scaler.drain``)."""
        return await self.scaler.drain(worker, deadline_s)

    async def undrain(self, worker: str) -> WorkerState:
        """Place requests on a drained worker again; returns its state after."""
        return await self.scaler.undrain(worker)

    async def switch_role(
        self,
        worker: str,
        role: str,
        deadline_s: float = DRAIN_DEADLINE_S,
        reason: str = "operator",
    ) -> dict[str, Any]:
        """Make a flex worker play ``role`` without reloading its weights
        (``Scaler.switch_role``)."""
        return await self.scaler.switch_role(worker, role, deadline_s, reason)

    # -- the autoscaler (autoscaling.py) -------------------------------------------------------

    async def autoscale_once(self) -> list[dict[str, Any]]:
        """One look at every pool and the decisions taken (``Autoscaling.once``)."""
        return await self.autoscaling.once()

    async def pool_signals(self, role: str) -> PoolSignals:
        return await self.autoscaling.pool_signals(role)

    async def report_load(self, router: str, load: dict[str, Any]) -> dict[str, Any]:
        """A router's admission figures; answers the autoscaler's counts, pools and latest
        look (``Autoscaling.report_load``)."""
        return await self.autoscaling.report_load(router, load)

    def autoscale_stats(self) -> dict[str, Any]:
        return self.autoscaling.stats()

    # -- migrations (migrations.py) ------------------------------------------------------------

    async def migrate(
        self,
        request_id: str | None = None,
        *,
        to: str | None = None,
        from_: str | None = None,
        count: int = 1,
    ) -> list[MigrationResult]:
        """Live-migrate one request (``request_id``) or ``count`` of ``from_``'s to ``to``
        (None: the least loaded other decode worker). Raises ValueError on a bad name."""
        return await self.migrator.migrate(request_id, to=to, from_=from_, count=count)

    async def rebalance(self, **settings: Any) -> dict[str, Any]:
        """The rebalancer's settings (mode off | on | dry-run, high, low, interval_s,
        max_moves) changed by ``settings``, and what it has done."""
        return self.migrator.configure(**settings)

    async def rebalance_once(self, dry_run: bool | None = None) -> list[dict[str, Any]]:
        """One rebalance round now, in the configured mode (dry-run: planned moves only), or
        planning only / moving when ``dry_run`` says so."""
        return await self.migrator.rebalance_once(dry_run)

    async def migration_stats(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.migrator.outcomes),
            "rebalance": self.migrator.rebalance_state.as_dict(),
        }

    # -- events (events.py) --------------------------------------------------------------------

    async def events(self, since: int | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """The kept events with ``seq`` > ``since``, once there is one (or after
        ``timeout_s``, none); ``since`` None: none, only where the log is (``last_seq``).
        ``missed``: events after ``since`` that the log no longer keeps."""
        return await self.event_log.poll(since, timeout_s)

    # -- status --------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Every live worker (role, node, state, load, KV use, latencies, migrations in
        flight), the policies and the scales running: what ``tandem status`` shows."""
        live = self.membership.live()
        stats = await self.membership.stats_of(live)
        return {
            "cluster_id": self.spec.cluster_id,
            "model": self.membership.meta.get("model_dir", self.spec.model_dir),
            "membership_version": self.membership.version,
            "workers": [self._worker_row(w, s) for w, s in zip(live, stats, strict=True)],
            "policy": self.policy(),
            "migrations_in_flight": self.migrator.in_flight,
            "migration_outcomes": dict(self.migrator.outcomes),
            "scaling": list(self.scaler.running.values()),
            "autoscale": self.autoscale_stats(),
            "last_event_seq": self.event_log.last_seq,
        }

    def _worker_row(self, w: WorkerInfo, s: dict[str, Any] | BaseException) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": w.name,
            "role": w.role,
            "state": w.state.name.lower(),
            **self.membership.nodes.get(w.name, {}),
            "pid": w.pid,
            "max_num_seqs": w.max_num_seqs,
        }
        if isinstance(s, BaseException):
            starting = w.state == WorkerState.STARTING
            row["error"] = "starting: loading its model" if starting else brief(s)
            return row
        total = max(int(s.get("total_blocks", 0)), 1)
        latency = s.get("latency") or {}
        migrating = s.get("migrating") or {}
        row.update(
            running=s.get("running", 0),
            waiting=s.get("waiting", 0),
            kv_blocks_total=s.get("total_blocks", 0),
            kv_blocks_used=s.get("in_use_blocks", 0),
            kv_use=s.get("in_use_blocks", 0) / total,
            kv_projected_use=s.get("projected_blocks", 0) / total,
            ttft=latency.get("ttft_s"),
            # a decode step gives each running request a token: the gap between two steps is
            # the inter-token latency (a prefill worker's steps are prompt chunks: none)
            itl=latency.get("step_gap_s") if w.role != "prefill" else None,
            migrations_out=migrating.get("out", 0),
            migrations_in=migrating.get("in", 0),
            ranks=s.get("ranks") or [],
            **tier_use(s.get("kv_tiers")),
        )
        return row

    # -- policy --------------------------------------------------------------------------------

    def policy(self) -> dict[str, Any]:
        """Every setting the operator may change: the rebalancer's, the health checks' and the
        autoscaler's."""
        return {
            "rebalance": asdict(self.migrator.rebalance_state.settings),
            "health": asdict(self.membership.health),
            "autoscale": asdict(self.autoscaler.config),
        }

    async def set_policy(
        self,
        rebalance: dict[str, Any] | None = None,
        health: dict[str, Any] | None = None,
        autoscale: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Change some settings (``rebalance``: RebalanceSettings fields, ``health``:
        HealthConfig fields, ``autoscale``: AutoscalerConfig fields, a pool's as a dict of
        PoolPolicy fields under its role); all are checked before any applies (ValueError)."""
        rebalance, health, autoscale = rebalance or {}, health or {}, autoscale or {}
        try:
            new_health = replace(self.membership.health, **health)
            replace(self.migrator.rebalance_state.settings, **rebalance)  # checks it
            current = asdict(self.autoscaler.config)
            for key, value in autoscale.items():
                if isinstance(value, dict) and isinstance(current.get(key), dict):
                    current[key] = {**current[key], **value}
                else:
                    current[key] = value
            new_autoscale = AutoscalerConfig(**current)
        except TypeError as exc:  # an unknown field
            raise ValueError(str(exc)) from None
        if rebalance:
            self.migrator.configure(**rebalance)
        self.membership.health = new_health
        self.autoscaler.config = new_autoscale
        self.autoscaling.sync()
        policy = self.policy()
        self.event_log.add("policy", policy=policy)
        return policy

    # -- the operator API ----------------------------------------------------------------------

    async def start_operator(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        tls_cert: str | None = None,
        tls_key: str | None = None,
        audit_log: str | None = None,
    ) -> str:
        """Serve the gRPC operator API (cluster/control/operator.py) from this actor's event loop on
        ``host``:``port`` (0: a free port), asking every call for ``token``; TLS with
        ``tls_cert`` / ``tls_key`` (PEM files on this node). Returns the bound address."""
        from cluster.control.operator import OperatorServer

        if self._operator is not None:
            raise ValueError(f"the operator API already listens on {self._operator.address}")
        server = OperatorServer(self, token=token, audit_log=audit_log)
        address = await server.start(host, port, tls_cert=tls_cert, tls_key=tls_key)
        self._operator = server
        return address

    async def stop_operator(self) -> None:
        if self._operator is not None:
            server, self._operator = self._operator, None
            await server.stop()

    async def shutdown(self) -> None:
        await self.stop_operator()
        self.scaler.stop()
        self.membership.stop_health()
        self.autoscaling.stop()
        self.migrator.stop()
        await self.membership.shutdown_workers()


def tier_use(tiers: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """A worker's KV tiers (its stats' ``kv_tiers``) as ``tandem status`` shows them: each
    tier's bytes held and bound, and the blocks it served; nothing for a tier it lacks."""
    if not tiers:
        return {}
    keys = ("used_bytes", "capacity_bytes", "hits")
    out = {}
    if tiers["host"]["enabled"]:
        out["kv_host"] = {k: tiers["host"][k] for k in keys}
    if tiers.get("disk"):
        out["kv_disk"] = {k: tiers["disk"][k] for k in keys}
    return out
