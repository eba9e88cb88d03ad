"""Scaling: the pools' sizes, drains and role switches, the operator's and the autoscaler's way in.

``scale(role, replicas)``::

    out   refused unless forced for a new pool no router would use (prefill without decode,
          or the other way round) or of a role the cluster was not started with; spawn each
          new worker (cluster/control/spawn.py, on a node with the role's resource when the
          cluster has them): STARTING, routers send it nothing -> ready() answers -> ACTIVE,
          published
    in    pick the least loaded (refused below 1 worker or below the running load unless
          forced; a pool the cluster was not started with may go back to 0) -> drain
          (decode: migrate away; prefill, colocated: wait until idle)
          -> shutdown() + kill -> out of the table and of the prefix index, published

One scale or switch per role at a time (``running``); ``wait`` False leaves it running as a
background task (``background``: kept until it ends, cancelled by ``stop``); its start, end and
refusals are events. ``switch_role(worker, role)`` drains a flex worker in its old role, then
``set_role()`` on it and publishes: its weights stay loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from cluster.control.events import EventLog
from cluster.control.membership import MembershipTable, kill_actor, worker_index
from cluster.control.migrations import Migrator
from cluster.control.operations import DRAIN_DEADLINE_S, Refused, not_moved
from cluster.control.spawn import Spawner, check_engine_overrides
from cluster.control.spec import ROLES, WorkerSpec
from engine.aio import within
from engine.messages import WorkerInfo, WorkerState, brief, control

logger = logging.getLogger(__name__)


class Scaler:
    """Starts, grows, shrinks, drains and switches the pools of the membership table."""

    def __init__(
        self,
        spec: WorkerSpec,
        membership: MembershipTable,
        spawner: Spawner,
        migrator: Migrator,
        events: EventLog,
    ) -> None:
        self.spec = spec
        self.membership = membership
        self.spawner = spawner
        self.migrator = migrator
        self.events = events
        self.roles: set[str] = set()  # roles the cluster runs (the pools the autoscaler sizes)
        self.running: dict[str, dict[str, Any]] = {}  # role -> the scale or switch running now
        self._tasks: set[asyncio.Task] = set()  # scales running without a caller waiting

    def stop(self) -> None:
        """Cancel what runs in the background (scales, switches)."""
        for task in list(self._tasks):
            task.cancel()

    # -- starting ------------------------------------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int, num_colocated: int) -> None:
        """Start workers and wait until every one answers: they are active, their roles the
        pools the cluster runs. Raises (and kills what it started) when one fails to start."""
        names = [
            *(self.spawner.spawn("prefill") for _ in range(num_prefill)),
            *(self.spawner.spawn("decode") for _ in range(num_decode)),
            *(self.spawner.spawn("colocated") for _ in range(num_colocated)),
        ]
        self.membership.publish()
        try:
            infos = await asyncio.gather(
                *(control(self.membership.workers[n].handle.ready).remote() for n in names)
            )
        except Exception:
            for n in names:
                await self.membership.kill(n)
            raise
        for n, info in zip(names, infos, strict=True):
            self.membership.activate(n, info)
        self.membership.publish()
        self.membership.start_health()
        self.roles |= {self.membership.workers[n].role for n in names}

    # -- drain -------------------------------------------------------------------------------

    async def drain(self, worker: str, deadline_s: float = DRAIN_DEADLINE_S) -> dict[str, Any]:
        """Stop placing requests on ``worker`` and empty it: a decode worker's requests are
        migrated away, a prefill or colocated worker's finish there. Returns what happened to
        each (decode) and whether it is idle (it can be removed)."""
        info = self.membership.workers.get(worker)
        if info is None:
            raise ValueError(f"no worker named {worker!r}")
        if deadline_s <= 0:
            raise ValueError(f"the drain deadline must be > 0 s, got {deadline_s}")
        if info.role == "decode":
            return await self.migrator.drain(worker, deadline_s)
        return await self._drain_by_waiting(worker, deadline_s)

    async def undrain(self, worker: str) -> WorkerState:
        """Place requests on a drained worker again; returns its state after."""
        info = self.membership.workers.get(worker)
        if info is None or info.state == WorkerState.DEAD:
            raise ValueError(f"no live worker named {worker!r}")
        if info.state == WorkerState.DRAINING:
            self.membership.set_state(worker, WorkerState.ACTIVE, "undrained by the operator")
        return self.membership.workers[worker].state

    async def _drain_by_waiting(self, name: str, deadline_s: float) -> dict[str, Any]:
        """A prefill or colocated worker: DRAINING (routers send it nothing new), then wait
        until it runs and queues nothing and has no KV left to send."""
        if self.membership.workers[name].state == WorkerState.DEAD:
            raise ValueError(f"worker {name!r} is dead")
        self.membership.set_state(name, WorkerState.DRAINING, "drained by the operator")
        t0 = time.monotonic()
        note, idle = "deadline passed", False
        s: dict[str, Any] | BaseException = {}
        while time.monotonic() - t0 < deadline_s:
            (s,) = await self.membership.stats_of([self.membership.workers[name]])
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

    # -- scale -------------------------------------------------------------------------------

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
        """Make ``role`` have ``replicas`` live workers. Out: new workers start and join the
        membership once ready; ``engine``: their own engine settings over the role's
        (``spawn.WORKER_ENGINE_KEYS``: a decode pool of TP 1 and TP 2 workers, say). In: the
        least loaded are drained, then stopped and removed; refused (``Refused``) below one
        worker or below the running load unless ``force``, which also stops a worker its drain
        could not empty. ``wait`` False: the plan now, the work goes on (its end is an
        event). Returns added / removed / failed workers."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if engine:
            check_engine_overrides(engine)
            if replicas <= len(self.membership.pool(role)):
                raise ValueError(
                    "engine settings are for the workers a scale adds; this one adds none "
                    f"({role} has {len(self.membership.pool(role))} live, {replicas} wanted)"
                )
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if drain_deadline_s <= 0:
            raise ValueError(f"the drain deadline must be > 0 s, got {drain_deadline_s}")
        if role in self.running:
            running = self.running[role]
            raise self._refuse(
                role,
                replicas,
                reason,
                f"a scale of {role} to {running['replicas']} is still running: wait for it "
                "(`tandem events` shows its end)",
            )
        t0 = time.monotonic()
        self.running[role] = {"role": role, "replicas": replicas, "started": time.time()}
        try:
            pool = self.membership.pool(role)
            plan = {"role": role, "previous_replicas": len(pool), "replicas": replicas}
            if replicas > len(pool) and not pool and not force:
                self._check_routable(role, replicas)
            if replicas > len(pool):
                added = [self.spawner.spawn(role, engine) for _ in range(replicas - len(pool))]
                self.membership.publish()
                plan |= {"added": added, "removed": []}
                work = self._scale_out(added)
            elif replicas < len(pool):
                victims = await self._pick_for_removal(role, pool, replicas, force)
                plan |= {"added": [], "removed": victims}
                work = self._scale_in(victims, drain_deadline_s, force)
            else:
                self.running.pop(role)
                return self._scale_result(plan | {"added": [], "removed": []}, {}, t0, done=True)
        except Refused as exc:
            self.running.pop(role, None)
            raise self._refuse(role, replicas, reason, str(exc)) from None
        except BaseException:
            self.running.pop(role, None)
            raise
        self.events.add(
            "scale",
            phase="started",
            role=role,
            from_replicas=len(pool),
            to_replicas=replicas,
            reason=reason,
            added=plan["added"],
            removed=plan["removed"],
        )
        task = self.background(self._finish_scale(plan, work, t0, reason))
        if wait:
            return await asyncio.shield(task)  # a caller that goes away leaves it running
        return self._scale_result(plan, {}, t0, done=False)

    def background(self, coro) -> asyncio.Task:
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
        runs = [r for r in ROLES if r in self.roles]
        started = ", ".join(f"{r} {len(self.membership.pool(r))}" for r in runs)
        if role not in self.roles:
            # grow a pool it runs: its colocated one, else the first of its roles
            grow = "colocated" if "colocated" in runs else next(iter(runs), None)
            instead = (
                f"`tandem scale --role {grow} --replicas {len(self.membership.pool(grow)) + 1}`"
                if grow
                else "a role the cluster runs"
            )
            unpaired = pair is not None and not self.membership.pool(pair)
            raise Refused(
                f"this cluster was started without {role} workers (its pools: {started or 'none'})"
                f"{f'; {role} workers get no request without a {pair} worker' if unpaired else ''}"
                f". To serve more, scale a pool it runs: {instead}. To change its topology, "
                f"pass --force" + (f" and scale --role {pair} as well" if unpaired else "")
            )
        if pair is not None and not self.membership.pool(pair):
            raise Refused(
                f"{replicas} {role} worker(s) would get no request: this cluster has no "
                f"{pair} worker, and routers place a request on a prefill and a decode worker "
                f"together. Run `tandem scale --role {pair} --replicas 1` first, or pass --force"
            )

    def _refuse(self, role: str, replicas: int, reason: str, why: str) -> Refused:
        """A refused scale: logged as an event, returned to be raised."""
        self.events.add(
            "scale",
            phase="refused",
            role=role,
            from_replicas=len(self.membership.pool(role)),
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
            self.running.pop(plan["role"], None)
        result = self._scale_result(plan, outcome, t0, done=True)
        self.events.add(
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
            call = control(self.membership.workers[name].handle.ready).remote()
            return await within(call, self.spec.start_timeout_s)

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
                await kill_actor(self.membership.workers[name])
                await self.membership.mark_dead(name, f"did not start: {why}")
            elif self.membership.workers[name].state == WorkerState.STARTING:
                self.membership.activate(name, info)
        self.membership.publish()
        self.membership.start_health()
        self.background(self.spawner.connect_kv_pairs())
        return {"failed": failed}

    async def _pick_for_removal(
        self, role: str, pool: list[WorkerInfo], replicas: int, force: bool
    ) -> list[str]:
        """The ``len(pool) - replicas`` workers to remove: draining ones first, then suspect
        ones, then the least loaded (the newest among equals). Refused, unless ``force``,
        when fewer than one would be left or the rest cannot hold what runs now."""
        if replicas < 1 and not force and role in self.roles:
            # (a pool the cluster was not started with may go back to 0)
            raise Refused(
                f"scaling {role} to 0 leaves no {role} worker: at least 1 stays (--force to "
                "remove every one)"
            )
        stats = await self.membership.stats_of(pool)
        load = {w.name: s for w, s in zip(pool, stats, strict=True) if isinstance(s, dict)}
        order = {WorkerState.DRAINING: 0, WorkerState.SUSPECT: 1}

        def key(w: WorkerInfo):
            s = load.get(w.name, {})
            busy = s.get("running", 0) + s.get("waiting", 0)
            return (order.get(w.state, 2), busy, s.get("in_use_blocks", 0), -worker_index(w.name))

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
            await self.membership.remove(
                name, "scaled in" + (f" (forced: {left} running)" if left else "")
            )
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
        info = self.membership.workers.get(worker)
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
        busy = [r for r in (old, role) if r in self.running]
        if busy:
            raise Refused(f"a scale or switch of {busy[0]} is still running: wait for it")
        if len(self.membership.pool(old)) <= 1:
            raise Refused(f"{worker} is the last {old} worker: at least 1 stays")
        for r in (old, role):
            self.running[r] = {
                "role": r,
                "replicas": len(self.membership.pool(r)),
                "started": time.time(),
            }
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
            self.membership.set_role(worker, role, f"{old} -> {role} ({reason})")
            self.background(self.spawner.connect_kv_pairs())
        finally:
            for r in (old, role):
                self.running.pop(r, None)
        counts = report.get("counts", {})
        return result | {
            "migrated": counts.get("migrated", 0),
            "aborted": not_moved(report),
            "seconds": round(time.monotonic() - t0, 3),
        }
