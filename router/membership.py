"""The router's view of the workers: which exist, their handles, their state.

Membership has one owner, the controller (cluster/controller.py, a named detached Ray actor).
Each router follows it: ``follow()`` long-polls ``controller.watch(version)`` and applies every
newer table. A router that sees a worker die (a call raises ``RayActorError``) stops routing
to it at once (``forget``) and tells the controller, which confirms and publishes the change.
Only ACTIVE workers are routed to; a DRAINING one keeps serving what it has.
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


class MembershipView:
    def __init__(self, table: Membership, controller: Any = None) -> None:
        self.controller = controller
        self.version = -1
        self._workers: dict[str, WorkerRef] = {}
        self._forgotten: set[str] = set()
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
            ref.state, ref.endpoint, ref.handle = info.state, info.endpoint, info.handle
            ref.index_id, ref.pid = info.index_id, info.pid
            workers[info.name] = ref
        self._workers = workers

    def _pool(self, role: str) -> list[WorkerRef]:
        return [
            w
            for w in self._workers.values()
            if w.role == role and w.state == WorkerState.ACTIVE and w.name not in self._forgotten
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
    def workers(self) -> list[WorkerRef]:
        """Every worker not known dead (draining ones included: they still answer)."""
        return [
            w
            for w in self._workers.values()
            if w.state != WorkerState.DEAD and w.name not in self._forgotten
        ]

    def get(self, name: str) -> WorkerRef | None:
        return self._workers.get(name)

    def forget(self, name: str, why: str = "") -> None:
        """Stop routing to a worker now (its actor died); the controller hears of it."""
        if name in self._forgotten:
            return
        self._forgotten.add(name)
        logger.warning("worker %s is dead, no longer routed to: %s", name, why)
        if self.controller is not None:
            with contextlib.suppress(Exception):
                self.controller.report_dead.remote(name, why)

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
