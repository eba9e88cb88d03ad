"""The controller: a named, detached Ray actor that owns the workers and their membership.

It starts every worker actor (so the workers belong to it, not to a gateway process: a gateway
can die and restart without taking them down), keeps the one membership table (each worker's
handle, role, KV endpoint, prefix-index id and state: starting -> active -> draining -> dead)
and publishes each new version to the routers that long-poll ``watch``. A worker is marked dead
when its health check or a router's report finds its actor gone; the controller then removes it
from the global prefix index, so its entries stop counting for every router at once.

Drain, scale, rebalance and migration orchestration (the operator API) build on this actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from engine.messages import Membership, WorkerInfo, WorkerState

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


class Controller:
    health_interval_s = 1.0

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._workers: dict[str, WorkerInfo] = {}
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0}
        self.version = 0
        self._changed = asyncio.Event()
        self._meta: dict[str, Any] = {}
        self._health: asyncio.Task | None = None

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
            infos = await asyncio.gather(*(self._workers[n].handle.ready.remote() for n in names))
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
            }
        else:
            cls = ColocatedWorker
        if spec.index_url and role != "decode":  # decode workers compute no prompt blocks
            kwargs["index"] = {
                "url": spec.index_url,
                "namespace": spec.index_namespace,
                "worker": actor_name,
            }
        options: dict[str, Any] = {"num_cpus": 1, "max_concurrency": 1000, "name": actor_name}
        if spec.device == "cuda":
            options["num_gpus"] = 1
        if role in ("prefill", "decode") and spec.use_role_resources:
            options["resources"] = {role: 1}
        handle = ray.remote(cls).options(**options).remote(engine, name, **kwargs)
        self._workers[name] = WorkerInfo(name, role, handle, WorkerState.STARTING)
        return name

    # -- health ------------------------------------------------------------------------------

    async def report_dead(self, name: str, why: str = "") -> None:
        """A router saw ``name`` fail: confirm (its actor does not answer) and mark it dead."""
        info = self._workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        try:
            await asyncio.wait_for(info.handle.ready.remote(), 5.0)
        except Exception as exc:  # noqa: BLE001 - dead or hung
            await self._mark_dead(name, why or str(exc))

    async def _mark_dead(self, name: str, why: str) -> None:
        info = self._workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        logger.warning("worker %s is dead: %s", name, why)
        self._workers[name] = replace(info, state=WorkerState.DEAD)
        self._publish()
        if self.spec.index_url and info.index_id:
            from engine.prefix_index import PrefixIndex

            with contextlib.suppress(Exception):  # Redis down: the heartbeat TTL still ends it
                index = PrefixIndex(self.spec.index_url, self.spec.index_namespace)
                await asyncio.to_thread(index.remove_worker, info.index_id)

    async def _check_health(self) -> None:
        from ray.exceptions import RayActorError

        while True:
            await asyncio.sleep(self.health_interval_s)
            live = [w for w in self._workers.values() if w.state != WorkerState.DEAD]
            results = await asyncio.gather(
                *(w.handle.ready.remote() for w in live), return_exceptions=True
            )
            for w, r in zip(live, results, strict=True):
                if isinstance(r, RayActorError):
                    await self._mark_dead(w.name, str(r).splitlines()[0])

    # -- operations --------------------------------------------------------------------------

    async def kill(self, name: str) -> None:
        """Kill one worker's actor (fault tests; drain comes with the operator API)."""
        import ray

        info = self._workers.get(name)
        if info is None:
            raise ValueError(f"no worker named {name!r}")
        with contextlib.suppress(Exception):
            ray.kill(info.handle, no_restart=True)
        await self._mark_dead(name, "killed")

    async def shutdown(self) -> None:
        import ray

        if self._health is not None:
            self._health.cancel()
        live = [w for w in self._workers.values() if w.state != WorkerState.DEAD]
        await asyncio.gather(*(w.handle.shutdown.remote() for w in live), return_exceptions=True)
        for w in live:
            with contextlib.suppress(Exception):
                ray.kill(w.handle, no_restart=True)
            self._workers[w.name] = replace(w, state=WorkerState.DEAD)
        self._publish()
