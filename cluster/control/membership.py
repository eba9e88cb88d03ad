"""The membership table and the health checks: which workers there are, in what state.

The controller keeps the one table (each worker's handle, role, KV endpoint, prefix-index id
and state) and publishes each new version to the routers that long-poll ``watch``. A worker's
states::

    STARTING   spawned (cluster/control/spawn.py): routers send it nothing until ready()
    ACTIVE     answered ready() (``activate``); routers place requests on it
    SUSPECT    misses health checks, or its engine step hangs: routers send it nothing new
    DRAINING   being emptied (a drain, a scale-in, a role switch): nothing new either
    DEAD       its actor is gone or was killed: out of the prefix index; a removed worker
               (``remove``) leaves the table instead

Health (``HealthConfig``): every ``interval_s`` each worker's ``health()`` is called under its own
``timeout_s`` (one hung worker never delays the others' checks). A worker that misses
``suspect_after`` checks in a row, or whose engine step has run longer than ``hang_after_s``, is
SUSPECT: routers send it nothing new (what it runs may finish, or resume elsewhere when its
stream stalls). It is ACTIVE again when it answers; SUSPECT for ``dead_after_s`` makes it DEAD,
and its actor is killed (it cannot come back with half-served requests). A dead actor
(``RayActorError``) is DEAD at once. A router that sees a worker fail or go silent reports it
(``report_dead``, ``report_unresponsive``) and the table checks at once. A dead worker is
removed from the global prefix index, so its entries stop counting for every router.

Every state change is an event (cluster/control/events.py) and a line of ``transitions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from cluster.control.events import EventLog
from cluster.control.spec import WorkerSpec, tp_group_name
from engine.aio import within
from engine.messages import Membership, WorkerInfo, WorkerState, control
from engine.settings import check, setting

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 3.0  # status() and scale() wait this long for a worker's stats


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


class MembershipTable:
    """The workers by name, the table's version and its long poll, their state changes and
    the health loop that drives them. ``health`` may be replaced (the operator's policy)."""

    def __init__(self, spec: WorkerSpec, health: HealthConfig, events: EventLog) -> None:
        self.spec = spec
        self.health = health
        self.events = events
        self.workers: dict[str, WorkerInfo] = {}
        self.version = 0
        self.transitions: list[tuple[float, str, str, str]] = []  # (time, worker, state, why)
        self.meta: dict[str, Any] = {}  # model_dir, block_size, max_model_len (from ready())
        self.nodes: dict[str, dict[str, str]] = {}  # worker -> {node_id, node_ip}
        self._changed = asyncio.Event()
        self._missed: dict[str, int] = {}  # consecutive missed health checks
        self._suspect_since: dict[str, float] = {}
        self._loop: asyncio.Task | None = None

    # -- the table -----------------------------------------------------------------------------

    def table(self) -> Membership:
        return Membership(
            self.version,
            list(self.workers.values()),
            model_dir=self.meta.get("model_dir", self.spec.model_dir),
            block_size=self.meta.get("block_size", 16),
            max_model_len=self.meta.get("max_model_len", 0),
            index_url=self.spec.index_url,
            index_namespace=self.spec.index_namespace,
        )

    def publish(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def watch(self, version: int, timeout_s: float = 10.0) -> Membership:
        """The table once it is newer than ``version`` (or after ``timeout_s``, as it is)."""
        if self.version <= version and timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._changed.wait(), timeout_s)
        return self.table()

    def pool(self, role: str) -> list[WorkerInfo]:
        """The live workers of ``role`` (starting, active, suspect, draining)."""
        return [w for w in self.workers.values() if w.role == role and w.state != WorkerState.DEAD]

    def live(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.state != WorkerState.DEAD]

    async def stats_of(self, workers: list[WorkerInfo]) -> list[dict[str, Any] | BaseException]:
        """Each worker's ``stats()``, or the exception instead (a STARTING one is not asked:
        its actor answers nothing before its model is loaded)."""

        async def one(w: WorkerInfo) -> dict[str, Any]:
            if w.state == WorkerState.STARTING:
                raise RuntimeError("starting")
            return await within(control(w.handle.stats).remote(), STATS_TIMEOUT_S)

        return await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)

    # -- joining and leaving -------------------------------------------------------------------

    def add(self, info: WorkerInfo, why: str) -> None:
        """A spawned worker, STARTING (the caller publishes)."""
        self.workers[info.name] = info
        self.worker_event("starting", info.name, why)

    def activate(self, name: str, info: dict[str, Any]) -> None:
        """``name`` answered ``ready()`` with ``info``: ACTIVE (the caller publishes)."""
        self.workers[name] = replace(
            self.workers[name],
            state=WorkerState.ACTIVE,
            endpoint=info["endpoint"],
            index_id=info["index_id"],
            pid=info["pid"],
            max_num_seqs=info.get("max_num_seqs", 0),
        )
        self.nodes[name] = {k: info.get(k, "") for k in ("node_id", "node_ip")}
        self.meta.setdefault("model_dir", info["model_dir"])
        self.meta.setdefault("block_size", info["block_size"])
        mml = self.meta.get("max_model_len")
        self.meta["max_model_len"] = (
            min(mml, info["max_model_len"]) if mml else info["max_model_len"]
        )
        self.worker_event("up", name, "answered ready()")

    def set_role(self, name: str, role: str, why: str) -> None:
        """A flex worker switched to ``role``: ACTIVE in it, published."""
        self.workers[name] = replace(self.workers[name], role=role, state=WorkerState.ACTIVE)
        self.transitions.append((time.time(), name, "ACTIVE", why))
        self.worker_event("switched", name, why)
        self.publish()

    async def remove(self, name: str, why: str) -> None:
        """Out of the table (routers stop seeing it), then its actor is shut down and killed
        and its prefix-index entries removed."""
        info = self.workers.pop(name)
        self._missed.pop(name, None)
        self._suspect_since.pop(name, None)
        self.publish()
        with contextlib.suppress(Exception):  # it is killed next either way
            await within(info.handle.shutdown.remote(), 10.0)
        await kill_actor(info)
        self._release_ranks(name)
        await self._forget_index(info)
        self.events.add(
            "worker",
            kind="removed",
            worker=name,
            role=info.role,
            reason=why,
            node_ip=self.nodes.pop(name, {}).get("node_ip", ""),
        )

    async def kill(self, name: str) -> None:
        """Kill one worker's actor (fault tests; drain comes with the operator API)."""
        info = self.workers.get(name)
        if info is None:
            raise ValueError(f"no worker named {name!r}")
        await kill_actor(info)
        await self.mark_dead(name, "killed")

    async def shutdown_workers(self) -> None:
        """Every live worker shut down and killed: DEAD, published."""
        import ray

        live = self.live()
        await asyncio.gather(*(w.handle.shutdown.remote() for w in live), return_exceptions=True)
        for w in live:
            with contextlib.suppress(Exception):
                ray.kill(w.handle, no_restart=True)
            self.workers[w.name] = replace(w, state=WorkerState.DEAD)
            self._release_ranks(w.name)
        self.publish()

    # -- state changes -------------------------------------------------------------------------

    def worker_event(self, kind: str, name: str, reason: str) -> None:
        info = self.workers.get(name)
        self.events.add(
            "worker",
            kind=kind,
            worker=name,
            role=info.role if info is not None else "",
            reason=reason,
            node_ip=self.nodes.get(name, {}).get("node_ip", ""),
        )

    def set_state(self, name: str, state: WorkerState, why: str) -> None:
        info = self.workers[name]
        if info.state == state:
            return
        logger.warning("worker %s: %s -> %s (%s)", name, info.state.name, state.name, why)
        self.workers[name] = replace(info, state=state)
        self.transitions.append((time.time(), name, state.name, why))
        del self.transitions[:-1000]
        self.worker_event(state.name.lower(), name, why)
        self.publish()

    async def mark_dead(self, name: str, why: str) -> None:
        info = self.workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        self._missed.pop(name, None)
        self._suspect_since.pop(name, None)
        self.set_state(name, WorkerState.DEAD, why)
        self._release_ranks(name)
        await self._forget_index(info)

    def _release_ranks(self, name: str) -> None:
        """Remove the placement group of a gone worker's tensor-parallel ranks, if it had one
        (its rank actors end with it, their CPUs and GPUs come back)."""
        if self.spec.engine.get("tensor_parallel_size", 1) == 1:
            return
        from ray.util import get_placement_group, remove_placement_group

        with contextlib.suppress(Exception):  # none by that name: nothing to release
            remove_placement_group(
                get_placement_group(tp_group_name(f"{self.spec.cluster_id}/{name}"))
            )

    async def _forget_index(self, info: WorkerInfo) -> None:
        """Remove a gone worker's entries from the global prefix index."""
        if self.spec.index_url and info.index_id:
            from engine.prefix_index import PrefixIndex

            with contextlib.suppress(Exception):  # Redis down: the heartbeat TTL still ends it
                index = PrefixIndex(self.spec.index_url, self.spec.index_namespace)
                await asyncio.to_thread(index.remove_worker, info.index_id)

    # -- health --------------------------------------------------------------------------------

    def start_health(self) -> None:
        """Run the health loop (once workers have joined; a second call does nothing)."""
        if self._loop is None:
            self._loop = asyncio.ensure_future(self._check_health())

    def stop_health(self) -> None:
        if self._loop is not None:
            self._loop.cancel()

    async def report_dead(self, name: str, why: str = "") -> None:
        """A router saw ``name`` fail: confirm (its actor does not answer) and mark it dead."""
        info = self.workers.get(name)
        if info is None or info.state == WorkerState.DEAD:
            return
        try:
            await within(control(info.handle.ready).remote(), 5.0)
        except Exception as exc:  # noqa: BLE001 - dead or hung
            await self.mark_dead(name, why or str(exc))

    async def report_unresponsive(self, name: str, why: str = "") -> None:
        """A router saw ``name`` go silent (its stream or its stats): check it now; a worker
        that does not answer within ``timeout_s`` is SUSPECT at once."""
        info = self.workers.get(name)
        if info is None or info.state not in (WorkerState.ACTIVE, WorkerState.SUSPECT):
            return
        await self.check_one(info, miss_is_suspect=True, why=why)

    async def check_one(self, info: WorkerInfo, *, miss_is_suspect: bool = False, why="") -> None:
        """One health check of one worker, and the state change it implies."""
        from ray.exceptions import RayActorError

        h = self.health
        name = info.name
        try:
            report = await within(control(info.handle.health).remote(), h.timeout_s)
        except RayActorError as exc:
            await self.mark_dead(name, str(exc).splitlines()[0])
            return
        except Exception as exc:  # noqa: BLE001 - a timeout, or the call failed: a miss
            if self.workers.get(name) is not info:
                return  # the table changed meanwhile (e.g. killed): nothing to judge
            self._missed[name] = self._missed.get(name, 0) + 1
            missed = self._missed[name]
            if miss_is_suspect or missed >= h.suspect_after:
                reason = why or f"{missed} health checks unanswered ({type(exc).__name__})"
                await self._suspect(name, reason)
            return
        if self.workers.get(name) is not info:
            return
        self._missed.pop(name, None)
        age = float(report.get("step_age_s", 0.0))
        if age > h.hang_after_s:
            await self._suspect(name, f"an engine step running for {age:.1f} s")
        elif info.state == WorkerState.SUSPECT:
            self._suspect_since.pop(name, None)
            self.set_state(name, WorkerState.ACTIVE, "answers again")

    async def _suspect(self, name: str, why: str) -> None:
        info = self.workers[name]
        if info.state == WorkerState.ACTIVE:
            self._suspect_since[name] = time.monotonic()
            self.set_state(name, WorkerState.SUSPECT, why)
        elif info.state == WorkerState.SUSPECT:
            since = self._suspect_since.setdefault(name, time.monotonic())
            if time.monotonic() - since > self.health.dead_after_s:
                await kill_actor(info)
                await self.mark_dead(
                    name, f"unresponsive for {time.monotonic() - since:.0f} s: {why}"
                )

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_s)
            live = [
                w
                for w in self.workers.values()
                if w.state in (WorkerState.ACTIVE, WorkerState.SUSPECT, WorkerState.DRAINING)
            ]
            await asyncio.gather(*(self.check_one(w) for w in live), return_exceptions=True)


async def kill_actor(info: WorkerInfo) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.kill(info.handle, no_restart=True)


def worker_index(name: str) -> int:
    """The number in a worker's name ("decode-3" -> 3)."""
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
