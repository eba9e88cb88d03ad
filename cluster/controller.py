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

Live migration is orchestrated here too (cluster/migrations.py): the admin ``migrate`` call,
``drain`` and the rebalance loop pick what moves where and ask the source decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.migrations import Migrator
from engine.messages import (
    CONTROL_CONCURRENCY,
    CONTROL_GROUP,
    Membership,
    MigrationResult,
    WorkerInfo,
    WorkerState,
    control,
)

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


@dataclass
class HealthConfig:
    interval_s: float = 1.0  # between checks of every worker
    timeout_s: float = 2.0  # a check not answered within this is a miss
    suspect_after: int = 2  # misses in a row that make a worker SUSPECT
    hang_after_s: float = 30.0  # an engine step running this long: SUSPECT (a hung thread)
    dead_after_s: float = 60.0  # SUSPECT this long: DEAD, and its actor is killed


class Controller:
    def __init__(self, spec: WorkerSpec, health: HealthConfig | None = None) -> None:
        self.spec = spec
        self.health = health or HealthConfig()
        self._missed: dict[str, int] = {}  # consecutive missed health checks
        self._suspect_since: dict[str, float] = {}
        self.transitions: list[tuple[float, str, str, str]] = []  # (time, worker, state, why)
        self._workers: dict[str, WorkerInfo] = {}
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0}
        self.version = 0
        self._changed = asyncio.Event()
        self._meta: dict[str, Any] = {}
        self._health: asyncio.Task | None = None
        self.migrator = Migrator(self)

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
            self._workers[n] = replace(
                self._workers[n],
                state=WorkerState.ACTIVE,
                endpoint=info["endpoint"],
                index_id=info["index_id"],
                pid=info["pid"],
                max_num_seqs=info.get("max_num_seqs", 0),
            )
            self._meta.setdefault("model_dir", info["model_dir"])
            self._meta.setdefault("block_size", info["block_size"])
            mml = self._meta.get("max_model_len")
            self._meta["max_model_len"] = (
                min(mml, info["max_model_len"]) if mml else info["max_model_len"]
            )
        self._publish()
        if self._health is None:
            self._health = asyncio.ensure_future(self._check_health())
        return self._table()

    def _spawn(self, role: str) -> str:
        import ray

        from decode_worker.colocated import ColocatedWorker
        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        spec = self.spec
        index = self._counters[role]
        self._counters[role] += 1
        name = f"{role}-{index}"
        actor_name = f"{spec.cluster_id}/{name}"  # also its name in the prefix index
        engine = {"model_dir": spec.model_dir, "device": spec.device, **spec.engine}
        if spec.device == "cpu" and spec.cpu_threads:
            engine["cpu_threads"] = spec.cpu_threads
        kwargs: dict[str, Any] = {}
        if role == "prefill":
            # A prefill worker never decodes: no decode CUDA graphs to capture.
            cls, engine = PrefillWorker, {"enforce_eager": True, **engine, **spec.prefill_engine}
            kwargs = {"token": spec.token}
        elif role == "decode":
            cls, engine = DecodeWorker, {**engine, **spec.decode_engine}
            kwargs = {
                "transport": spec.transport,
                "token": spec.token,
                "host": spec.host,
                "transfer_timeout_s": spec.transfer_timeout_s,
                "migration": spec.migration,
            }
        else:
            cls = ColocatedWorker
        if spec.index_url and role != "decode":  # decode workers compute no prompt blocks
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
        self._publish()

    async def _mark_dead(self, name: str, why: str) -> None:
        info = self._workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        self._missed.pop(name, None)
        self._suspect_since.pop(name, None)
        self._set_state(name, WorkerState.DEAD, why)
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

    async def drain(self, worker: str, deadline_s: float = 60.0) -> dict[str, Any]:
        """Stop placing requests on ``worker`` and migrate every one it runs away; returns
        what happened to each and whether it is idle (it can be removed)."""
        return await self.migrator.drain(worker, deadline_s)

    async def undrain(self, worker: str) -> None:
        """Place requests on a drained worker again."""
        self.migrator.undrain(worker)

    async def rebalance(self, **settings: Any) -> dict[str, Any]:
        """The rebalancer's settings (mode off | on | dry-run, high, low, interval_s,
        max_moves) changed by ``settings``, and what it has done."""
        return self.migrator.configure(**settings)

    async def rebalance_once(self) -> list[dict[str, Any]]:
        """One rebalance round now, in the configured mode (dry-run: planned moves only)."""
        return await self.migrator.rebalance_once()

    async def migration_stats(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.migrator.outcomes),
            "rebalance": self.migrator.rebalance_state.as_dict(),
        }

    async def shutdown(self) -> None:
        import ray

        if self._health is not None:
            self._health.cancel()
        self.migrator.stop()
        live = [w for w in self._workers.values() if w.state != WorkerState.DEAD]
        await asyncio.gather(*(w.handle.shutdown.remote() for w in live), return_exceptions=True)
        for w in live:
            with contextlib.suppress(Exception):
                ray.kill(w.handle, no_restart=True)
            self._workers[w.name] = replace(w, state=WorkerState.DEAD)
        self._publish()
