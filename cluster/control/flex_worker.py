"""A worker that can take either role: prefill or decode, switched without reloading weights.

``tandem serve --role-switching`` (``ClusterConfig.role_switching``) starts every prefill and
decode worker as a FlexWorker: one engine and one copy of the weights with three roles, in
this order: ``PrefillRole`` (prefill_worker/worker.py: the KV connector and the streamer),
``DecodeRole`` (decode_worker/decode.py: the KV receiver) and ``MigrationRole``
(decode_worker/migration.py). The actor offers every public method of the three; the worker's
abort, deadlines, stats and shutdown ask each role in turn (engine/runtime.py), so an abort
ends a prefill of this worker's first, else a transfer arriving, else a running request.

Which role it plays is the membership table's: routers send it what its role there says. The
controller switches it (``Controller.switch_role``): drain it in its old role (a decode
worker's requests migrate away; a prefill worker finishes what it runs), ``set_role`` here
once every role holds nothing, then publish the new role. The autoscaler does this, rather
than start a worker, when the pool it grows is short and the other pool has a worker to spare.

The streamer observes engine steps only while the worker prefills (an observed step that fails
fails the whole batch, where a decode step alone is retried request by request). Both roles'
KV sockets stay open: the receiver (its endpoint in the table) and the connector.

It lives here, in cluster/, because the composition needs both worker packages and
prefill_worker/ and decode_worker/ are siblings that never import each other (the layer
contract); cluster/ is the lowest layer above both. It holds only the list of roles and
``set_role``: everything a role does is in that role's package.
"""

from __future__ import annotations

from typing import Any

from decode_worker.decode import DecodeRole
from decode_worker.migration import MigrationConfig, MigrationRole
from decode_worker.worker import DecodeWorker, decode_roles
from engine.kv_transfer import KVLimits
from engine.runtime import EngineWorker, delegate
from prefill_worker.worker import PrefillRole

ROLES = ("prefill", "decode")


class FlexWorker(EngineWorker):
    role = "decode"
    length_probe = "auto"  # its estimate rides on the first token when it prefills

    def __init__(
        self,
        engine_config: dict[str, Any],
        name: str = "",
        *,
        role: str = "decode",
        token: str = "",
        transport: str = "tcp",
        host: str = "127.0.0.1",
        transfer_timeout_s: float = 60.0,
        migration: dict[str, Any] | None = None,
        index: dict[str, Any] | None = None,
        max_channels: int = 8,
        kv_limits: dict[str, Any] | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"a flex worker's role is prefill or decode, got {role!r}")
        self.role = role  # (before the base: its default name is its role)
        super().__init__(engine_config, name, index)
        limits = KVLimits(**(kv_limits or {}))
        self.prefill_role = PrefillRole(self, token=token, max_channels=max_channels, limits=limits)
        self.decode_role, self.migration_role = decode_roles(
            self,
            transport=transport,
            token=token,
            host=host,
            transfer_timeout_s=transfer_timeout_s,
            limits=limits,
            migration=MigrationConfig(**(migration or {})),
        )
        # prefill first: an abort of a prefill of ours must open its gate (it is no transfer in)
        self.roles = [self.prefill_role, self.decode_role, self.migration_role]
        self.prefill_role.attach_streamer(role == "prefill")
        self.switches = 0

    async def ready(self) -> dict[str, Any]:
        return {**await super().ready(), "endpoint": self.decode_role.receiver.endpoint}

    async def set_role(self, role: str) -> dict[str, Any]:
        """Play ``role`` from now on. Refused (ValueError) unless the worker is idle: nothing
        running or waiting in the engine, and nothing held by any role (a prefill, KV bytes
        out, a transfer in, a migration): the controller drains it first."""
        if role not in ROLES:
            raise ValueError(f"a flex worker's role is prefill or decode, got {role!r}")

        def switch() -> dict[str, Any]:
            busy = {"requests": self.engine.num_unfinished_requests}
            for r in self.roles:
                busy.update(r.holds())
            if any(busy.values()):
                left = ", ".join(f"{k} {v}" for k, v in busy.items() if v)
                raise ValueError(f"{self.name} is not idle ({left}): drain it first")
            old, self.role = self.role, role
            self.prefill_role.attach_streamer(role == "prefill")
            self.switches += old != role
            return {"name": self.name, "from": old, "role": role, "switches": self.switches}

        return await self.call(switch)

    def _stats(self) -> dict[str, Any]:
        return {**super()._stats(), "role_switches": self.switches}

    # the actor methods of its roles (``kv_timings``: the prefill side's, the KV it sends)
    prefill = delegate("prefill_role", PrefillRole.prefill)
    release = delegate("prefill_role", PrefillRole.release)
    release_many = delegate("prefill_role", PrefillRole.release_many)
    connect_kv = delegate("prefill_role", PrefillRole.connect_kv)
    kv_timings = delegate("prefill_role", PrefillRole.kv_timings)
    endpoint = delegate("decode_role", DecodeRole.endpoint)
    reserve = delegate("decode_role", DecodeRole.reserve)
    reserve_many = delegate("decode_role", DecodeRole.reserve_many)
    generate_many = DecodeWorker.generate_many  # a short next turn, prefilled where its KV is
    fail_transfer = delegate("decode_role", DecodeRole.fail_transfer)
    migrate_out = delegate("migration_role", MigrationRole.migrate_out)
    migrate_in = delegate("migration_role", MigrationRole.migrate_in)
    migrate_grow = delegate("migration_role", MigrationRole.migrate_grow)
    migrate_wait = delegate("migration_role", MigrationRole.migrate_wait)
    migrate_cancel = delegate("migration_role", MigrationRole.migrate_cancel)
    migration_candidates = delegate("migration_role", MigrationRole.migration_candidates)
    migration_timings = delegate("migration_role", MigrationRole.migration_timings)
