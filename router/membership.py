"""The router's view of the workers: which exist, their handles, their state.

Membership has one owner, the controller (cluster/control/controller.py, a named detached Ray actor).
Each router follows it: ``follow()`` long-polls ``controller.watch(version)`` and applies every
newer table. A router that sees a worker die (a call raises ``RayActorError``) stops routing
to it at once (``forget``) and tells the controller, which confirms and publishes the change.
A router that sees a worker go silent (its output stream, or its stats polls) stops sending it
new requests at once (``suspect``; undone by ``clear`` when it is heard from again) and tells
the controller, which checks and publishes SUSPECT, ACTIVE again, or DEAD.
Only ACTIVE workers that this router does not suspect are routed to; a DRAINING or SUSPECT one
keeps serving what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from engine.messages import Membership, WorkerInfo, WorkerState

logger = logging.getLogger(__name__)


@dataclass
class WorkerRef:
    name: str
    role: str
    handle: Any  # ray.actor.ActorHandle
    endpoint: str = ""
    index_id: str = ""
    state: WorkerState = WorkerState.ACTIVE
    outstanding: int = 0  # requests this router has in flight on it
    pid: int = 0
    max_num_seqs: int = 0  # sequences its engine runs at once (0: not known)


class MembershipView:
    def __init__(self, table: Membership, controller: Any = None) -> None:
        self.controller = controller
        self.version = -1
        self._workers: dict[str, WorkerRef] = {}
        self._forgotten: set[str] = set()
        self._suspects: dict[str, set[str]] = {}  # worker -> why this router suspects it
        self._given_up: dict[str, asyncio.Future] = {}  # worker -> done when suspect or dead
        self.table = table
        self.apply(table)

    @classmethod
    async def from_controller(cls, controller: Any) -> MembershipView:
        return cls(await controller.watch.remote(-1, 0.0), controller)

    def apply(self, table: Membership) -> None:
        """Take a newer table (older ones are ignored); in-flight counts carry over."""
        if table.version <= self.version:
            return
        self.version, self.table = table.version, table
        workers = {}
        for info in table.workers:
            ref = self._workers.get(info.name) or _ref(info)
            if ref.state == WorkerState.SUSPECT and info.state == WorkerState.ACTIVE:
                self._suspects.pop(info.name, None)  # the controller found it answering
            ref.state, ref.endpoint, ref.handle = info.state, info.endpoint, info.handle
            ref.role = info.role  # a flex worker's changes (cluster/control/flex_worker.py)
            ref.index_id, ref.pid = info.index_id, info.pid
            ref.max_num_seqs = info.max_num_seqs
            workers[info.name] = ref
        self._workers = workers
        self._notify()

    def _pool(self, role: str) -> list[WorkerRef]:
        return [
            w
            for w in self._workers.values()
            if w.role == role
            and w.state == WorkerState.ACTIVE
            and w.name not in self._forgotten
            and w.name not in self._suspects
        ]

    @property
    def prefill(self) -> list[WorkerRef]:
        return self._pool("prefill")

    @property
    def decode(self) -> list[WorkerRef]:
        return self._pool("decode")

    @property
    def colocated(self) -> list[WorkerRef]:
        return self._pool("colocated")

    @property
    def token_pool(self) -> list[WorkerRef]:
        """The routable workers that produce tokens: decode workers in a disaggregated
        cluster, else the colocated ones."""
        return self.decode if self.prefill and self.decode else self.colocated

    @property
    def workers(self) -> list[WorkerRef]:
        """Every worker not known dead (draining ones included: they still answer)."""
        return [
            w
            for w in self._workers.values()
            if w.state != WorkerState.DEAD and w.name not in self._forgotten
        ]

    @property
    def all_workers(self) -> list[WorkerRef]:
        """Every worker of the table, the dead ones included."""
        return list(self._workers.values())

    def get(self, name: str) -> WorkerRef | None:
        return self._workers.get(name)

    def forget(self, name: str, why: str = "") -> None:
        """Stop routing to a worker now (its actor died); the controller hears of it."""
        if name in self._forgotten:
            return
        self._forgotten.add(name)
        self._notify()
        w = self._workers.get(name)
        if w is not None and w.state == WorkerState.DRAINING:  # scaled in: stopped after its drain
            logger.info("worker %s (draining) has stopped, no longer routed to", name)
        else:
            logger.warning("worker %s is dead, no longer routed to: %s", name, why)
        if self.controller is not None:
            with contextlib.suppress(Exception):
                self.controller.report_dead.remote(name, why)

    def suspect(self, name: str, reason: str, why: str = "") -> None:
        """Send ``name`` nothing new while ``reason`` ("stream", "stats") holds; the controller
        hears of it (it checks the worker and publishes the state for every router)."""
        reasons = self._suspects.setdefault(name, set())
        if reason in reasons:
            return
        reasons.add(reason)
        self._notify()
        logger.warning("worker %s is suspect, no new requests: %s", name, why or reason)
        if self.controller is not None:
            with contextlib.suppress(Exception):
                self.controller.report_unresponsive.remote(name, why or reason)

    def clear(self, name: str, reason: str) -> None:
        """``name`` was heard from again on the channel that made it suspect (or that channel
        is closed: its suspicion goes with it)."""
        reasons = self._suspects.get(name)
        if reasons is None or reason not in reasons:
            return
        reasons.discard(reason)
        if not reasons:
            del self._suspects[name]
            self._notify()
            logger.warning("worker %s answers again", name)

    def state_of(self, name: str) -> str:
        """The state this router acts on: the table's, or "suspect"/"dead" from what this
        router saw itself."""
        w = self._workers.get(name)
        if w is None or w.state == WorkerState.DEAD or name in self._forgotten:
            return "dead"
        if name in self._suspects and w.state == WorkerState.ACTIVE:
            return "suspect"
        return w.state.name.lower()

    def given_up(self, name: str) -> asyncio.Future:
        """A future done once this router holds ``name`` suspect or dead (at once if it does
        now): a call into it can be left unanswered from then on. One future per worker,
        shared by every waiter, so none polls (``asyncio.wait`` on it and the call)."""
        loop = asyncio.get_running_loop()
        future = self._given_up.get(name)
        if future is None or future.get_loop() is not loop:
            future = self._given_up[name] = loop.create_future()
        if self.state_of(name) in ("suspect", "dead") and not future.done():
            future.set_result(None)
        return future

    def _notify(self) -> None:
        """Complete the ``given_up`` futures of workers now suspect or dead (a cleared
        suspicion gets a fresh future at its next ``given_up``)."""
        for name, future in list(self._given_up.items()):
            if future.done():
                if self.state_of(name) not in ("suspect", "dead"):
                    del self._given_up[name]  # answering again: the next wait gets a new one
            elif self.state_of(name) in ("suspect", "dead"):
                future.set_result(None)

    def routable(self) -> bool:
        """Some request can be placed now: an ACTIVE, unsuspected colocated worker, or such a
        prefill and decode pair."""
        return bool(self.colocated or (self.prefill and self.decode))

    async def follow(self, poll_s: float = 10.0) -> None:
        """Apply every newer table the controller publishes (runs until cancelled)."""
        while True:
            try:
                self.apply(await self.controller.watch.remote(self.version, poll_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - controller restarting: keep the last view
                logger.warning("membership watch failed: %s", exc)
                await asyncio.sleep(1.0)


def _ref(info: WorkerInfo) -> WorkerRef:
    return WorkerRef(info.name, info.role, info.handle, info.endpoint, info.index_id, info.state)
