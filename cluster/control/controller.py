"""The controller: a named, detached Ray actor that owns the workers and their membership.

It starts every worker actor (so the workers belong to it, not to a gateway process: a gateway
can die and restart without taking them down), keeps the one membership table (each worker's
handle, role, KV endpoint, prefix-index id and state) and publishes each new version to the
routers that long-poll ``watch``.

Health (``HealthConfig``): every ``interval_s`` each worker's ``health()`` is called under its own
``timeout_s`` (one hung worker never delays the others' checks). A worker that misses
``suspect_after`` checks in a row, or whose engine step has run longer than ``hang_after_s``, is
SUSPECT: routers send it nothing new (what it runs may finish, or resume elsewhere when its
stream stalls). It is ACTIVE again when it answers; SUSPECT for ``dead_after_s`` makes it DEAD,
and its actor is killed (it cannot come back with half-served requests). A dead actor
(``RayActorError``) is DEAD at once. A router that sees a worker fail or go silent reports it
(``report_dead``, ``report_unresponsive``) and the controller checks at once. A dead worker is
removed from the global prefix index, so its entries stop counting for every router.

Live migration is orchestrated here too (cluster/control/migrations.py): the admin ``migrate`` call,
``drain`` and the rebalance loop pick what moves where and ask the source decode worker.

Scaling (``scale(role, replicas)``), the operator's way in::

    out   refused unless forced for a new pool no router would use (prefill without decode,
          or the other way round) or of a role the cluster was not started with; _spawn each
          new worker (on a node with the role's resource when the cluster has them):
          STARTING, routers send it nothing -> ready() answers -> ACTIVE, published
    in    pick the least loaded (refused below 1 worker or below the running load unless
          forced; a pool the cluster was not started with may go back to 0) -> drain
          (decode: migrate away; prefill, colocated: wait until idle)
          -> shutdown() + kill -> out of the table and of the prefix index, published

Every state change, scale decision and migration is an event in a bounded log with sequence
numbers (``events(since)`` long-polls it); ``status()`` joins the table with each worker's
stats. The operator's gRPC API (cluster/control/operator.py, ``start_operator``) serves all of it from
this actor's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cluster.control.autoscaler import Autoscaler, AutoscalerConfig, Decision, PoolSignals
from cluster.control.migrations import Migrator
from cluster.control.operations import DRAIN_DEADLINE_S, Refused, not_moved
from engine.messages import (
    CONTROL_CONCURRENCY,
    CONTROL_GROUP,
    Membership,
    MigrationResult,
    WorkerInfo,
    WorkerState,
    brief,
    control,
)
from engine.settings import check, setting

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """How to start every worker of a cluster (built by LocalCluster from ClusterConfig)."""

    model_dir: str
    device: str = "cpu"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    transfer_timeout_s: float = 60.0
    token: str = ""  # KV channels refuse peers without it
    cluster_id: str = ""
    index_url: str | None = None
    index_namespace: str = ""
    engine: dict[str, Any] = field(default_factory=dict)
    prefill_engine: dict[str, Any] = field(default_factory=dict)
    decode_engine: dict[str, Any] = field(default_factory=dict)
    use_role_resources: bool = False  # the cluster defines `prefill` / `decode` resources
    cpu_threads: int | None = None  # CPU: torch threads per worker (its share of the cores)
    # CUDA: GPUs per worker by role (default 1); a fraction lets workers share a GPU (each then
    # sizes its KV cache with kv_cache_memory_gb rather than the GPU's free memory)
    gpus: dict[str, float] = field(default_factory=dict)
    migration: dict[str, Any] = field(default_factory=dict)  # MigrationConfig fields (decode)
    # a worker added by scale() that has not answered after this long is killed (no node with
    # its resources came up, say)
    start_timeout_s: float = 900.0
    # prefill and decode workers are FlexWorkers (cluster/control/flex_worker.py, named flex-N): either
    # role, switched by switch_role() without reloading weights
    role_switching: bool = False


@dataclass
class HealthConfig:
    """The controller's health checks (engine/settings.py: one definition, bounds checked)."""

    interval_s: float = setting(1.0, "Seconds between checks of every worker.", gt=0)
    timeout_s: float = setting(
        2.0, "A check not answered within this many seconds is a miss.", gt=0
    )
    suspect_after: int = setting(2, "Misses in a row that make a worker SUSPECT.", ge=1)
    hang_after_s: float = setting(
        30.0, "An engine step running this long makes its worker SUSPECT (a hung thread).", gt=0
    )
    dead_after_s: float = setting(60.0, "SUSPECT this long: DEAD, and its actor is killed.", gt=0)

    def __post_init__(self) -> None:
        check(self)


ROLES = ("prefill", "decode", "colocated")
EVENTS_KEPT = 4096  # the event log's length (older events are dropped; Watch says how many)
STATS_TIMEOUT_S = 3.0  # status() and scale() wait this long for a worker's stats
ROUTER_LOAD_TTL_S = 5.0  # a router's load report older than this no longer counts


class _EventedMigrator(Migrator):
    """The Migrator, with every migration it asks for counted in flight and logged as an
    event once it ends."""

    async def move(self, source, rid: str, dest, reason: str) -> MigrationResult:
        c = self.controller
        c.migrations_in_flight += 1
        try:
            result = await super().move(source, rid, dest, reason)
        finally:
            c.migrations_in_flight -= 1
        c._event(
            "migration",
            request=result.request_id,
            source=result.source,
            dest=result.dest,
            outcome=result.outcome,
            cause=reason,
            seconds=result.seconds,
            pause_s=result.pause_s,
        )
        return result


class Controller:
    def __init__(
        self,
        spec: WorkerSpec,
        health: HealthConfig | None = None,
        autoscale: AutoscalerConfig | dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.health = health or HealthConfig()
        if not isinstance(autoscale, AutoscalerConfig):
            autoscale = AutoscalerConfig(**(autoscale or {}))
        self.autoscaler = Autoscaler(autoscale)
        self._autoscaling: asyncio.Task | None = None
        self._roles: set[str] = set()  # roles the cluster runs (the pools the autoscaler sizes)
        self._router_loads: dict[str, tuple[float, dict[str, Any]]] = {}  # router -> report
        self._missed: dict[str, int] = {}  # consecutive missed health checks
        self._suspect_since: dict[str, float] = {}
        self.transitions: list[tuple[float, str, str, str]] = []  # (time, worker, state, why)
        self._workers: dict[str, WorkerInfo] = {}
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0, "flex": 0}
        self.version = 0
        self._changed = asyncio.Event()
        self._meta: dict[str, Any] = {}
        self._health: asyncio.Task | None = None
        self.migrator = _EventedMigrator(self)
        self.migrations_in_flight = 0
        self._nodes: dict[str, dict[str, str]] = {}  # worker -> {node_id, node_ip}
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._event_seq = 0
        self._event_added = asyncio.Event()
        self._scaling: dict[str, dict[str, Any]] = {}  # role -> the scale running now
        self._tasks: set[asyncio.Task] = set()  # scales running without a caller waiting
        self._operator: Any = None  # cluster.control.operator.OperatorServer once started

    # -- membership --------------------------------------------------------------------------

    def _table(self) -> Membership:
        return Membership(
            self.version,
            list(self._workers.values()),
            model_dir=self._meta.get("model_dir", self.spec.model_dir),
            block_size=self._meta.get("block_size", 16),
            max_model_len=self._meta.get("max_model_len", 0),
            index_url=self.spec.index_url,
            index_namespace=self.spec.index_namespace,
        )

    def _publish(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def watch(self, version: int, timeout_s: float = 10.0) -> Membership:
        """The table once it is newer than ``version`` (or after ``timeout_s``, as it is)."""
        if self.version <= version and timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self._table()

    async def members(self) -> Membership:
        return self._table()

    # -- starting workers --------------------------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int, num_colocated: int) -> Membership:
        """Start workers and wait until every one answers; returns the table with them
        active. Raises (and kills what it started) when one fails to start."""
        names = [
            *(self._spawn("prefill") for _ in range(num_prefill)),
            *(self._spawn("decode") for _ in range(num_decode)),
            *(self._spawn("colocated") for _ in range(num_colocated)),
        ]
        self._publish()
        try:
            infos = await asyncio.gather(
                *(control(self._workers[n].handle.ready).remote() for n in names)
            )
        except Exception:
            for n in names:
                await self.kill(n)
            raise
        for n, info in zip(names, infos, strict=True):
            self._activate(n, info)
        self._publish()
        if self._health is None:
            self._health = asyncio.ensure_future(self._check_health())
        self._roles |= {self._workers[n].role for n in names}
        self._sync_autoscaler()
        await self._connect_kv_pairs()
        return self._table()

    async def _connect_kv_pairs(self) -> None:
        """Every active prefill worker forms its KV channels to every active decode worker now
        (``connect_kv``), so that no request waits for a channel to form: at start, and in the
        background when workers join or switch roles. Failures are logged, never raised: a
        channel that did not form is formed again by the first request that needs it."""
        active = [w for w in self._workers.values() if w.state == WorkerState.ACTIVE]
        endpoints = [w.endpoint for w in active if w.role == "decode" and w.endpoint]
        prefill = [w for w in active if w.role == "prefill"]
        if not endpoints or not prefill:
            return
        t0 = time.monotonic()

        async def connect(w: WorkerInfo) -> dict[str, str]:
            return await asyncio.wait_for(w.handle.connect_kv.remote(endpoints), 90.0)

        outcomes = await asyncio.gather(*(connect(w) for w in prefill), return_exceptions=True)
        for w, out in zip(prefill, outcomes, strict=True):
            bad = (
                {"call": brief(out)}
                if isinstance(out, BaseException)
                else {ep: why for ep, why in out.items() if why != "ok"}
            )
            if bad:
                logger.warning("KV channels of %s not formed: %s", w.name, bad)
        logger.info(
            "KV channels formed: %d prefill x %d decode workers in %.2f s",
            len(prefill),
            len(endpoints),
            time.monotonic() - t0,
        )

    def _activate(self, name: str, info: dict[str, Any]) -> None:
        """``name`` answered ``ready()`` with ``info``: ACTIVE (the caller publishes)."""
        self._workers[name] = replace(
            self._workers[name],
            state=WorkerState.ACTIVE,
            endpoint=info["endpoint"],
            index_id=info["index_id"],
            pid=info["pid"],
            max_num_seqs=info.get("max_num_seqs", 0),
        )
        self._nodes[name] = {k: info.get(k, "") for k in ("node_id", "node_ip")}
        self._meta.setdefault("model_dir", info["model_dir"])
        self._meta.setdefault("block_size", info["block_size"])
        mml = self._meta.get("max_model_len")
        self._meta["max_model_len"] = (
            min(mml, info["max_model_len"]) if mml else info["max_model_len"]
        )
        self._worker_event("up", name, "answered ready()")

    def _spawn(self, role: str) -> str:
        import ray

        from decode_worker.colocated import ColocatedWorker
        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        spec = self.spec
        flex = spec.role_switching and role in ("prefill", "decode")
        kind = "flex" if flex else role
        index = self._counters[kind]
        self._counters[kind] += 1
        name = f"{kind}-{index}"
        actor_name = f"{spec.cluster_id}/{name}"  # also its name in the prefix index
        base = {"model_dir": spec.model_dir, "device": spec.device, **spec.engine}
        if spec.device == "cpu" and spec.cpu_threads:
            base["cpu_threads"] = spec.cpu_threads
        decode_kwargs = {
            "transport": spec.transport,
            "token": spec.token,
            "host": spec.host,
            "transfer_timeout_s": spec.transfer_timeout_s,
            "migration": spec.migration,
        }
        if flex:
            from cluster.control.flex_worker import FlexWorker

            # either role: the decode side's engine settings win over the prefill side's
            cls, engine = FlexWorker, {**base, **spec.prefill_engine, **spec.decode_engine}
            kwargs = {"role": role, **decode_kwargs}
        elif role == "prefill":
            # A prefill worker never decodes: no decode CUDA graphs to capture (its prompt
            # chunks replay the piecewise graphs, the layer-wise KV sends between their pieces).
            cls, engine = PrefillWorker, {"cuda_graph_max_batch": 0, **base, **spec.prefill_engine}
            kwargs = {"token": spec.token}
        elif role == "decode":
            cls, engine = DecodeWorker, {**base, **spec.decode_engine}
            kwargs = decode_kwargs
        else:
            cls, engine, kwargs = ColocatedWorker, base, {}
        if spec.index_url and (role != "decode" or flex):  # decode workers compute no prompts
            kwargs["index"] = {
                "url": spec.index_url,
                "namespace": spec.index_namespace,
                "worker": actor_name,
            }
        options: dict[str, Any] = {
            "num_cpus": 1,
            "max_concurrency": 1000,
            "name": actor_name,
        }
        if spec.device == "cuda":
            options["num_gpus"] = spec.gpus.get(role, 1)
        if role in ("prefill", "decode") and spec.use_role_resources:
            options["resources"] = {role: 1}
        actor = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})(cls)
        handle = actor.options(**options).remote(engine, name, **kwargs)
        self._workers[name] = WorkerInfo(name, role, handle, WorkerState.STARTING)
        where = f"on a node with the {role!r} resource" if "resources" in options else ""
        self._worker_event("starting", name, f"actor requested {where}".strip())
        return name

    # -- health ------------------------------------------------------------------------------

    async def report_dead(self, name: str, why: str = "") -> None:
        """A router saw ``name`` fail: confirm (its actor does not answer) and mark it dead."""
        info = self._workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        try:
            await asyncio.wait_for(control(info.handle.ready).remote(), 5.0)
        except Exception as exc:  # noqa: BLE001 - dead or hung
            await self._mark_dead(name, why or str(exc))

    async def report_unresponsive(self, name: str, why: str = "") -> None:
        """A router saw ``name`` go silent (its stream or its stats): check it now; a worker
        that does not answer within ``timeout_s`` is SUSPECT at once."""
        info = self._workers.get(name)
        if info is None or info.state not in (WorkerState.ACTIVE, WorkerState.SUSPECT):
            return
        await self._check_one(info, miss_is_suspect=True, why=why)

    def _set_state(self, name: str, state: WorkerState, why: str) -> None:
        info = self._workers[name]
        if info.state == state:
            return
        logger.warning("worker %s: %s -> %s (%s)", name, info.state.name, state.name, why)
        self._workers[name] = replace(info, state=state)
        self.transitions.append((time.time(), name, state.name, why))
        del self.transitions[:-1000]
        self._worker_event(state.name.lower(), name, why)
        self._publish()

    async def _mark_dead(self, name: str, why: str) -> None:
        info = self._workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        self._missed.pop(name, None)
        self._suspect_since.pop(name, None)
        self._set_state(name, WorkerState.DEAD, why)
        await self._forget_index(info)

    async def _forget_index(self, info: WorkerInfo) -> None:
        """Remove a gone worker's entries from the global prefix index."""
        if self.spec.index_url and info.index_id:
            from engine.prefix_index import PrefixIndex

            with contextlib.suppress(Exception):  # Redis down: the heartbeat TTL still ends it
                index = PrefixIndex(self.spec.index_url, self.spec.index_namespace)
                await asyncio.to_thread(index.remove_worker, info.index_id)

    async def _check_one(self, info: WorkerInfo, *, miss_is_suspect: bool = False, why="") -> None:
        """One health check of one worker, and the state change it implies."""
        from ray.exceptions import RayActorError

        h = self.health
        name = info.name
        try:
            report = await asyncio.wait_for(control(info.handle.health).remote(), h.timeout_s)
        except RayActorError as exc:
            await self._mark_dead(name, str(exc).splitlines()[0])
            return
        except Exception as exc:  # noqa: BLE001 - a timeout, or the call failed: a miss
            if self._workers.get(name) is not info:
                return  # the table changed meanwhile (e.g. killed): nothing to judge
            self._missed[name] = self._missed.get(name, 0) + 1
            missed = self._missed[name]
            if miss_is_suspect or missed >= h.suspect_after:
                reason = why or f"{missed} health checks unanswered ({type(exc).__name__})"
                await self._suspect(name, reason)
            return
        if self._workers.get(name) is not info:
            return
        self._missed.pop(name, None)
        age = float(report.get("step_age_s", 0.0))
        if age > h.hang_after_s:
            await self._suspect(name, f"an engine step running for {age:.1f} s")
        elif info.state == WorkerState.SUSPECT:
            self._suspect_since.pop(name, None)
            self._set_state(name, WorkerState.ACTIVE, "answers again")

    async def _suspect(self, name: str, why: str) -> None:
        info = self._workers[name]
        if info.state == WorkerState.ACTIVE:
            self._suspect_since[name] = time.monotonic()
            self._set_state(name, WorkerState.SUSPECT, why)
        elif info.state == WorkerState.SUSPECT:
            since = self._suspect_since.setdefault(name, time.monotonic())
            if time.monotonic() - since > self.health.dead_after_s:
                await self._kill_actor(info)
                await self._mark_dead(
                    name, f"unresponsive for {time.monotonic() - since:.0f} s: {why}"
                )

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_s)
            live = [
                w
                for w in self._workers.values()
                if w.state in (WorkerState.ACTIVE, WorkerState.SUSPECT, WorkerState.DRAINING)
            ]
            await asyncio.gather(*(self._check_one(w) for w in live), return_exceptions=True)

    async def _kill_actor(self, info: WorkerInfo) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(info.handle, no_restart=True)

    # -- operations --------------------------------------------------------------------------

    async def kill(self, name: str) -> None:
        """Kill one worker's actor (fault tests; drain comes with the operator API)."""
        info = self._workers.get(name)
        if info is None:
            raise ValueError(f"no worker named {name!r}")
        await self._kill_actor(info)
        await self._mark_dead(name, "killed")

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

    async def drain(self, worker: str, deadline_s: float = DRAIN_DEADLINE_S) -> dict[str, Any]:
        """Stop placing requests on ``worker`` and empty it: a decode worker's requests are
        migrated away, a prefill or colocated worker's finish there. Returns what happened to
        each (decode) and whether it is idle (it can be removed)."""
        info = self._workers.get(worker)
        if info is None:
            raise ValueError(f"no worker named {worker!r}")
        if deadline_s <= 0:
            raise ValueError(f"the drain deadline must be > 0 s, got {deadline_s}")
        if info.role == "decode":
            return await self.migrator.drain(worker, deadline_s)
        return await self._drain_by_waiting(worker, deadline_s)

    async def undrain(self, worker: str) -> WorkerState:
        """Place requests on a drained worker again; returns its state after."""
        info = self._workers.get(worker)
        if info is None or info.state == WorkerState.DEAD:
            raise ValueError(f"no live worker named {worker!r}")
        if info.state == WorkerState.DRAINING:
            self._set_state(worker, WorkerState.ACTIVE, "undrained by the operator")
        return self._workers[worker].state

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

    # -- events --------------------------------------------------------------------------------

    def _event(self, type_: str, **fields: Any) -> None:
        """Append one event to the log (a worker's state change, a scale decision, a
        migration, a policy change) and wake the ``events`` long-polls."""
        self._event_seq += 1
        self._events.append({"seq": self._event_seq, "time": time.time(), "type": type_, **fields})
        self._event_added.set()
        self._event_added = asyncio.Event()

    def _worker_event(self, kind: str, name: str, reason: str) -> None:
        info = self._workers.get(name)
        self._event(
            "worker",
            kind=kind,
            worker=name,
            role=info.role if info is not None else "",
            reason=reason,
            node_ip=self._nodes.get(name, {}).get("node_ip", ""),
        )

    async def events(self, since: int | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """The kept events with ``seq`` > ``since``, once there is one (or after
        ``timeout_s``, none); ``since`` None: none, only where the log is (``last_seq``).
        ``missed``: events after ``since`` that the log no longer keeps."""
        if since is None:
            return {"events": [], "last_seq": self._event_seq, "missed": 0}
        if self._event_seq <= since and timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event_added.wait(), timeout_s)
        events = [e for e in self._events if e["seq"] > since]
        first = events[0]["seq"] if events else self._event_seq + 1
        return {"events": events, "last_seq": self._event_seq, "missed": max(0, first - since - 1)}

    # -- status --------------------------------------------------------------------------------

    async def _stats_of(self, workers: list[WorkerInfo]) -> list[dict[str, Any] | BaseException]:
        """Each worker's ``stats()``, or the exception instead (a STARTING one is not asked:
        its actor answers nothing before its model is loaded)."""

        async def one(w: WorkerInfo) -> dict[str, Any]:
            if w.state == WorkerState.STARTING:
                raise RuntimeError("starting")
            return await asyncio.wait_for(control(w.handle.stats).remote(), STATS_TIMEOUT_S)

        return await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)

    async def status(self) -> dict[str, Any]:
        """Every live worker (role, node, state, load, KV use, latencies, migrations in
        flight), the policies and the scales running: what ``tandem status`` shows."""
        live = [w for w in self._workers.values() if w.state != WorkerState.DEAD]
        stats = await self._stats_of(live)
        return {
            "cluster_id": self.spec.cluster_id,
            "model": self._meta.get("model_dir", self.spec.model_dir),
            "membership_version": self.version,
            "workers": [self._worker_row(w, s) for w, s in zip(live, stats, strict=True)],
            "policy": self.policy(),
            "migrations_in_flight": self.migrations_in_flight,
            "migration_outcomes": dict(self.migrator.outcomes),
            "scaling": list(self._scaling.values()),
            "autoscale": self.autoscale_stats(),
            "last_event_seq": self._event_seq,
        }

    def _worker_row(self, w: WorkerInfo, s: dict[str, Any] | BaseException) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": w.name,
            "role": w.role,
            "state": w.state.name.lower(),
            **self._nodes.get(w.name, {}),
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
        )
        return row

    # -- policy --------------------------------------------------------------------------------

    def policy(self) -> dict[str, Any]:
        """Every setting the operator may change: the rebalancer's, the health checks' and the
        autoscaler's."""
        return {
            "rebalance": asdict(self.migrator.rebalance_state.settings),
            "health": asdict(self.health),
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
            new_health = replace(self.health, **health)
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
        self.health = new_health
        self.autoscaler.config = new_autoscale
        self._sync_autoscaler()
        policy = self.policy()
        self._event("policy", policy=policy)
        return policy

    # -- scaling -------------------------------------------------------------------------------

    def _pool(self, role: str) -> list[WorkerInfo]:
        """The live workers of ``role`` (starting, active, suspect, draining)."""
        return [w for w in self._workers.values() if w.role == role and w.state != WorkerState.DEAD]

    async def scale(
        self,
        role: str,
        replicas: int,
        wait: bool = True,
        force: bool = False,
        drain_deadline_s: float = DRAIN_DEADLINE_S,
        reason: str = "operator",
    ) -> dict[str, Any]:
        """Make ``role`` have ``replicas`` live workers. Out: new workers start and join the
        membership once ready. In: the least loaded are drained, then stopped and removed;
        refused (``Refused``) below one worker or below the running load unless ``force``,
        which also stops a worker its drain could not empty. ``wait`` False: the plan now,
        the work goes on (its end is an event). Returns added / removed / failed workers."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if drain_deadline_s <= 0:
            raise ValueError(f"the drain deadline must be > 0 s, got {drain_deadline_s}")
        if role in self._scaling:
            running = self._scaling[role]
            raise self._refuse(
                role,
                replicas,
                reason,
                f"a scale of {role} to {running['replicas']} is still running: wait for it "
                "(`tandem events` shows its end)",
            )
        t0 = time.monotonic()
        self._scaling[role] = {"role": role, "replicas": replicas, "started": time.time()}
        try:
            pool = self._pool(role)
            plan = {"role": role, "previous_replicas": len(pool), "replicas": replicas}
            if replicas > len(pool) and not pool and not force:
                self._check_routable(role, replicas)
            if replicas > len(pool):
                added = [self._spawn(role) for _ in range(replicas - len(pool))]
                self._publish()
                plan |= {"added": added, "removed": []}
                work = self._scale_out(added)
            elif replicas < len(pool):
                victims = await self._pick_for_removal(role, pool, replicas, force)
                plan |= {"added": [], "removed": victims}
                work = self._scale_in(victims, drain_deadline_s, force)
            else:
                self._scaling.pop(role)
                return self._scale_result(plan | {"added": [], "removed": []}, {}, t0, done=True)
        except Refused as exc:
            self._scaling.pop(role, None)
            raise self._refuse(role, replicas, reason, str(exc)) from None
        except BaseException:
            self._scaling.pop(role, None)
            raise
        self._event(
            "scale",
            phase="started",
            role=role,
            from_replicas=len(pool),
            to_replicas=replicas,
            reason=reason,
            added=plan["added"],
            removed=plan["removed"],
        )
        task = self._background(self._finish_scale(plan, work, t0, reason))
        if wait:
            return await asyncio.shield(task)  # a caller that goes away leaves it running
        return self._scale_result(plan, {}, t0, done=False)

    def _background(self, coro) -> asyncio.Task:
        """Run ``coro`` without a caller waiting for it (kept until it ends; shutdown cancels
        it)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_routable(self, role: str, replicas: int) -> None:
        """Refused: a new pool of ``role`` that no router would send a request to. A prefill
        worker without a decode worker (or the other way round) gets none: routers place a
        request on a pair, else on a colocated worker. A role the cluster was not started
        with changes its topology: that takes ``force``."""
        pair = {"prefill": "decode", "decode": "prefill"}.get(role)
        runs = [r for r in ROLES if r in self._roles]
        started = ", ".join(f"{r} {len(self._pool(r))}" for r in runs)
        if role not in self._roles:
            # grow a pool it runs: its colocated one, else the first of its roles
            grow = "colocated" if "colocated" in runs else next(iter(runs), None)
            instead = (
                f"`tandem scale --role {grow} --replicas {len(self._pool(grow)) + 1}`"
                if grow
                else "a role the cluster runs"
            )
            unpaired = pair is not None and not self._pool(pair)
            raise Refused(
                f"this cluster was started without {role} workers (its pools: {started or 'none'})"
                f"{f'; {role} workers get no request without a {pair} worker' if unpaired else ''}"
                f". To serve more, scale a pool it runs: {instead}. To change its topology, "
                f"pass --force" + (f" and scale --role {pair} as well" if unpaired else "")
            )
        if pair is not None and not self._pool(pair):
            raise Refused(
                f"{replicas} {role} worker(s) would get no request: this cluster has no "
                f"{pair} worker, and routers place a request on a prefill and a decode worker "
                f"together. Run `tandem scale --role {pair} --replicas 1` first, or pass --force"
            )

    def _refuse(self, role: str, replicas: int, reason: str, why: str) -> Refused:
        """A refused scale: logged as an event, returned to be raised."""
        self._event(
            "scale",
            phase="refused",
            role=role,
            from_replicas=len(self._pool(role)),
            to_replicas=replicas,
            reason=f"{reason}: {why}",
        )
        return Refused(why)

    async def _finish_scale(self, plan: dict[str, Any], work, t0: float, reason: str):
        try:
            outcome = await work
        except Exception as exc:  # noqa: BLE001 - reported as the scale's failure
            logger.exception("scale of %s failed", plan["role"])
            outcome = {"failed": {"*": brief(exc)}}
        finally:
            self._scaling.pop(plan["role"], None)
        result = self._scale_result(plan, outcome, t0, done=True)
        self._event(
            "scale",
            phase="done",
            role=plan["role"],
            from_replicas=plan["previous_replicas"],
            to_replicas=plan["replicas"],
            reason=reason,
            added=result["added"],
            removed=result["removed"],
            failed=result["failed"],
            aborted_requests=result["aborted_requests"],
            migrated_requests=result["migrated_requests"],
        )
        return result

    def _scale_result(self, plan, outcome: dict[str, Any], t0: float, done: bool):
        failed = dict(outcome.get("failed", {}))
        added = [n for n in plan["added"] if n not in failed]
        removed = [n for n in plan["removed"] if n not in failed]
        if not done:
            message = f"{plan['role']}: {plan['previous_replicas']} -> {plan['replicas']} started"
        elif not failed:
            message = f"{plan['role']}: {plan['previous_replicas']} -> {plan['replicas']}"
        else:
            message = f"{plan['role']}: {len(failed)} worker(s) failed: " + "; ".join(
                f"{n}: {why}" for n, why in failed.items()
            )
        return {
            **plan,
            "added": added,
            "removed": removed,
            "failed": failed,
            "aborted_requests": outcome.get("aborted_requests", 0),
            "migrated_requests": outcome.get("migrated_requests", 0),
            "done": done,
            "message": message,
            "seconds": round(time.monotonic() - t0, 3),
        }

    async def _scale_out(self, names: list[str]) -> dict[str, Any]:
        """Wait for each new worker's ``ready()``; one that fails or does not answer within
        ``start_timeout_s`` is killed (and reported), the others join."""

        async def ready(name: str) -> dict[str, Any]:
            call = control(self._workers[name].handle.ready).remote()
            return await asyncio.wait_for(call, self.spec.start_timeout_s)

        infos = await asyncio.gather(*(ready(n) for n in names), return_exceptions=True)
        failed = {}
        for name, info in zip(names, infos, strict=True):
            if isinstance(info, BaseException):
                why = (
                    f"not ready after {self.spec.start_timeout_s:.0f} s"
                    if isinstance(info, asyncio.TimeoutError)
                    else brief(info)
                )
                failed[name] = why
                await self._kill_actor(self._workers[name])
                await self._mark_dead(name, f"did not start: {why}")
            elif self._workers[name].state == WorkerState.STARTING:
                self._activate(name, info)
        self._publish()
        if self._health is None:
            self._health = asyncio.ensure_future(self._check_health())
        self._background(self._connect_kv_pairs())
        return {"failed": failed}

    async def _pick_for_removal(
        self, role: str, pool: list[WorkerInfo], replicas: int, force: bool
    ) -> list[str]:
        """The ``len(pool) - replicas`` workers to remove: draining ones first, then suspect
        ones, then the least loaded (the newest among equals). Refused, unless ``force``,
        when fewer than one would be left or the rest cannot hold what runs now."""
        if replicas < 1 and not force and role in self._roles:
            # (a pool the cluster was not started with may go back to 0)
            raise Refused(
                f"scaling {role} to 0 leaves no {role} worker: at least 1 stays (--force to "
                "remove every one)"
            )
        stats = await self._stats_of(pool)
        load = {w.name: s for w, s in zip(pool, stats, strict=True) if isinstance(s, dict)}
        order = {WorkerState.DRAINING: 0, WorkerState.SUSPECT: 1}

        def key(w: WorkerInfo):
            s = load.get(w.name, {})
            busy = s.get("running", 0) + s.get("waiting", 0)
            return (order.get(w.state, 2), busy, s.get("in_use_blocks", 0), -_index(w.name))

        victims = sorted(pool, key=key)[: len(pool) - replicas]
        if not force:
            self._check_fits(role, pool, victims, load)
        return [w.name for w in victims]

    def _check_fits(self, role, pool, victims, load: dict[str, dict[str, Any]]) -> None:
        """Refused when the workers left cannot hold the requests running or waiting on the
        whole pool now, in running slots or in KV blocks (decode: projected use)."""
        gone = {w.name for w in victims}
        left = [w for w in pool if w.name not in gone and w.state == WorkerState.ACTIVE]
        requests = sum(s.get("running", 0) + s.get("waiting", 0) for s in load.values())
        blocks = sum(s.get("projected_blocks", s.get("in_use_blocks", 0)) for s in load.values())
        slots = sum(load.get(w.name, {}).get("max_num_seqs", w.max_num_seqs) for w in left)
        room = sum(load.get(w.name, {}).get("total_blocks", 0) for w in left)
        if requests > slots or blocks > room:
            raise Refused(
                f"scaling {role} to {len(pool) - len(victims)} leaves {len(left)} active "
                f"worker(s) with {slots} running slots and {room} KV blocks for the "
                f"{requests} requests and {blocks} blocks the {role} pool holds now: wait for "
                "the load to fall, or --force"
            )

    async def _scale_in(self, names: list[str], deadline_s: float, force: bool):
        """Drain each worker (at once), then stop and remove it; one its drain could not empty
        is undrained and kept, unless ``force``."""

        async def one(name: str) -> dict[str, Any]:
            report = await self.drain(name, deadline_s)
            if not report["idle"] and not force:
                with contextlib.suppress(ValueError):
                    await self.undrain(name)
                raise Refused(f"not empty after {deadline_s:g} s ({report['note']}): kept")
            left = not_moved(report)
            await self._remove(name, "scaled in" + (f" (forced: {left} running)" if left else ""))
            return report | {"aborted": left}

        results = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        failed, aborted, migrated = {}, 0, 0
        for name, report in zip(names, results, strict=True):
            if isinstance(report, BaseException):
                failed[name] = str(report) if isinstance(report, Refused) else brief(report)
                continue
            aborted += report["aborted"]
            migrated += report["counts"].get("migrated", 0)
        return {"failed": failed, "aborted_requests": aborted, "migrated_requests": migrated}

    # -- role switching ------------------------------------------------------------------------

    async def switch_role(
        self,
        worker: str,
        role: str,
        deadline_s: float = DRAIN_DEADLINE_S,
        reason: str = "operator",
    ) -> dict[str, Any]:
        """Make a flex worker (a cluster started with ``role_switching``) play ``role``
        (prefill or decode) without reloading its weights: drained in its old role first (its
        decode requests migrate away, its prefills finish), then switched and published.
        Refused (``Refused``) for the last worker of its role, while a scale or switch of either
        role runs, or when its drain leaves requests (it is undrained and stays as it was)."""
        info = self._workers.get(worker)
        if info is None or info.state == WorkerState.DEAD:
            raise ValueError(f"no live worker named {worker!r}")
        if role not in ("prefill", "decode"):
            raise ValueError(f"a worker switches to prefill or decode, got {role!r}")
        if not self.spec.role_switching or not worker.startswith("flex-"):
            raise ValueError(
                f"{worker} cannot switch roles: start the cluster with role switching on "
                "(tandem serve --role-switching) for workers that can"
            )
        old = info.role
        t0 = time.monotonic()
        result = {"worker": worker, "from": old, "to": role, "migrated": 0, "aborted": 0}
        if old == role:
            return result | {"seconds": 0.0}
        busy = [r for r in (old, role) if r in self._scaling]
        if busy:
            raise Refused(f"a scale or switch of {busy[0]} is still running: wait for it")
        if len(self._pool(old)) <= 1:
            raise Refused(f"{worker} is the last {old} worker: at least 1 stays")
        for r in (old, role):
            self._scaling[r] = {"role": r, "replicas": len(self._pool(r)), "started": time.time()}
        try:
            report = await self.drain(worker, deadline_s)
            if not report["idle"]:
                with contextlib.suppress(ValueError):
                    await self.undrain(worker)
                raise Refused(f"{worker} not empty after {deadline_s:g} s ({report['note']}): kept")
            try:
                await control(info.handle.set_role).remote(role)
            except Exception:
                with contextlib.suppress(ValueError):
                    await self.undrain(worker)
                raise
            self._workers[worker] = replace(
                self._workers[worker], role=role, state=WorkerState.ACTIVE
            )
            why = f"{old} -> {role} ({reason})"
            self.transitions.append((time.time(), worker, "ACTIVE", why))
            self._worker_event("switched", worker, why)
            self._publish()
            self._background(self._connect_kv_pairs())
        finally:
            for r in (old, role):
                self._scaling.pop(r, None)
        counts = report.get("counts", {})
        return result | {
            "migrated": counts.get("migrated", 0),
            "aborted": not_moved(report),
            "seconds": round(time.monotonic() - t0, 3),
        }

    def _spare(self, role: str) -> str | None:
        """A worker of ``role``'s pool the autoscaler may take for the other pool: a flex
        worker, the pool above its ``min_replicas``, its latest look under its ``low`` mark
        with a worker fewer. The least loaded one (by the look's workers: the newest)."""
        if not self.spec.role_switching or role not in ("prefill", "decode"):
            return None
        policy = getattr(self.autoscaler.config, role)
        look = self.autoscaler.latest.get(role)
        active = [w for w in self._pool(role) if w.state == WorkerState.ACTIVE]
        n = len(active)
        if look is None or n <= max(policy.min_replicas, 1) or role in self._scaling:
            return None
        if look["pressure"] * n / (n - 1) >= policy.low:
            return None
        flex = [w for w in active if w.name.startswith("flex-")]
        return max(flex, key=lambda w: _index(w.name)).name if flex else None

    async def _drain_by_waiting(self, name: str, deadline_s: float) -> dict[str, Any]:
        """A prefill or colocated worker: DRAINING (routers send it nothing new), then wait
        until it runs and queues nothing and has no KV left to send."""
        if self._workers[name].state == WorkerState.DEAD:
            raise ValueError(f"worker {name!r} is dead")
        self._set_state(name, WorkerState.DRAINING, "drained by the operator")
        t0 = time.monotonic()
        note, idle = "deadline passed", False
        s: dict[str, Any] | BaseException = {}
        while time.monotonic() - t0 < deadline_s:
            (s,) = await self._stats_of([self._workers[name]])
            if isinstance(s, BaseException):
                note = f"no stats: {brief(s)}"
            elif not any(
                s.get(k, 0)
                for k in (
                    "running",
                    "waiting",
                    "open_streams",
                    "remote_pending",
                    "kv_pending_bytes",
                )
            ):
                note, idle = "", True
                break
            await asyncio.sleep(0.1)
        busy = 0 if idle or not isinstance(s, dict) else s.get("running", 0) + s.get("waiting", 0)
        return {
            "worker": name,
            "idle": idle,
            "requests": {},  # not known by id here: they finish where they run
            "counts": {"still running": busy} if busy else {},
            "seconds": round(time.monotonic() - t0, 3),
            "note": note,
        }

    async def _remove(self, name: str, why: str) -> None:
        """Out of the table (routers stop seeing it), then its actor is shut down and killed
        and its prefix-index entries removed."""
        info = self._workers.pop(name)
        self._missed.pop(name, None)
        self._suspect_since.pop(name, None)
        self._publish()
        with contextlib.suppress(Exception):  # it is killed next either way
            await asyncio.wait_for(info.handle.shutdown.remote(), 10.0)
        await self._kill_actor(info)
        await self._forget_index(info)
        self._event(
            "worker",
            kind="removed",
            worker=name,
            role=info.role,
            reason=why,
            node_ip=self._nodes.pop(name, {}).get("node_ip", ""),
        )

    # -- the autoscaler ------------------------------------------------------------------------

    def _sync_autoscaler(self) -> None:
        """Run the autoscaler's loop while it is enabled (and the cluster has started)."""
        running = self._autoscaling is not None and not self._autoscaling.done()
        if self.autoscaler.config.enabled and self._roles and not running:
            self._autoscaling = asyncio.ensure_future(self._autoscale_forever())
        elif not self.autoscaler.config.enabled and running:
            self._autoscaling.cancel()
            self._autoscaling = None

    async def _autoscale_forever(self) -> None:
        while True:
            await asyncio.sleep(self.autoscaler.config.interval_s)
            try:
                await self.autoscale_once()
            except Exception:  # noqa: BLE001 - one bad look must not end the loop
                logger.exception("autoscaler round failed")

    async def autoscale_once(self) -> list[dict[str, Any]]:
        """One look at every pool the cluster runs: its signals measured, the autoscaler's
        decision logged (an ``autoscale`` event with its inputs) and carried out by ``scale``
        (scale-in drains first), without waiting for the scale to end. A pool being scaled
        now is not looked at. Returns the decisions taken."""
        roles = [r for r in sorted(self._roles) if r not in self._scaling]
        signals = [await self.pool_signals(r) for r in roles]
        for look in signals:  # every pool's look first: a decision may weigh the other pool's
            self.autoscaler.note(look)
        taken, touched = [], set()
        for look in signals:
            if look.role in touched or look.role in self._scaling:
                continue  # a switch this round took a worker from (or gave one to) it
            decision = self.autoscaler.observe(look)
            if decision is None:
                continue
            taken.append(decision.as_dict())
            touched |= await self._carry_out(decision)
        return taken

    async def _carry_out(self, d: Decision) -> set[str]:
        """Carry a decision out; returns the pools it touched beyond its own (a switch's)."""
        self._event(
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
            self._background(self._switch_logged(spare, d.role, why))
            return {other}
        # the decision counts active workers; scale() sizes the live pool (a draining or
        # starting one included): move it by the same difference
        target = len(self._pool(d.role)) + d.target - d.replicas
        with contextlib.suppress(Refused):  # the refusal is an event of its own
            await self.scale(d.role, target, wait=False, reason=f"autoscaler: {d.reason}")
        return set()

    async def _switch_logged(self, worker: str, role: str, reason: str) -> None:
        try:
            await self.switch_role(worker, role, reason=reason)
        except Exception as exc:  # noqa: BLE001 - logged; the next look decides again
            logger.warning("autoscaler: switching %s to %s failed: %s", worker, role, exc)
            self._worker_event("switch_failed", worker, f"to {role}: {brief(exc)} ({reason})")

    async def pool_signals(self, role: str) -> PoolSignals:
        """What the autoscaler judges ``role``'s pool by, measured now from its active
        workers' stats (latencies over their recent window only) and the routers' reports."""
        active = [w for w in self._pool(role) if w.state == WorkerState.ACTIVE]
        stats = await self._stats_of(active)
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
        stats = self.autoscale_stats()
        return {k: stats[k] for k in ("enabled", "counts", "pools", "latest")}

    def autoscale_stats(self) -> dict[str, Any]:
        stats = self.autoscaler.stats()
        stats["pools"] = {r: len(self._pool(r)) for r in sorted(self._roles)}
        return stats

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
        import ray

        await self.stop_operator()
        for task in list(self._tasks):
            task.cancel()
        for loop in (self._health, self._autoscaling):
            if loop is not None:
                loop.cancel()
        self.migrator.stop()
        live = [w for w in self._workers.values() if w.state != WorkerState.DEAD]
        await asyncio.gather(*(w.handle.shutdown.remote() for w in live), return_exceptions=True)
        for w in live:
            with contextlib.suppress(Exception):
                ray.kill(w.handle, no_restart=True)
            self._workers[w.name] = replace(w, state=WorkerState.DEAD)
        self._publish()


def _index(name: str) -> int:
    """The number in a worker's name ("decode-3" -> 3)."""
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
