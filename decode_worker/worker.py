"""The decode actor: an engine thread with two roles, in this order:

- ``DecodeRole`` (decode_worker/decode.py, with the request's lifecycle here): reserve,
  receive a prompt's KV from a prefill worker, admit, decode, stream
- ``MigrationRole`` (decode_worker/migration.py, with its protocol): move a running request
  to another decode worker (``migrate_out``) or take one in (``migrate_in``); its KV arrives
  through the decode role's receiver

The actor's public methods are the roles' own (``delegate``); what the worker does for every
request (abort, deadlines, stats, shutdown) it asks each role in turn (engine/runtime.py).
"""

from __future__ import annotations

from typing import Any

from decode_worker.decode import DecodeRole
from decode_worker.migration import MigrationConfig, MigrationRole
from engine.kv_transfer import KVLimits
from engine.runtime import EngineWorker, delegate


def decode_roles(
    worker: EngineWorker,
    *,
    transport: str,
    token: str,
    host: str,
    transfer_timeout_s: float,
    limits: KVLimits,
    migration: MigrationConfig,
) -> tuple[DecodeRole, MigrationRole]:
    """The decode role and the migration role over it, for ``worker`` (a DecodeWorker, or a
    flex worker beside its prefill role)."""
    decode = DecodeRole(
        worker,
        transport=transport,
        token=token,
        host=host,
        transfer_timeout_s=transfer_timeout_s,
        limits=limits,
    )
    return decode, MigrationRole(worker, decode, migration, token=token, limits=limits)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(
        self,
        engine_config: dict[str, Any],
        name: str = "",
        *,
        transport: str = "tcp",
        token: str = "",
        host: str = "127.0.0.1",
        transfer_timeout_s: float = 60.0,
        kv_limits: dict[str, Any] | None = None,
        migration: dict[str, Any] | None = None,
        index: dict[str, Any] | None = None,
    ) -> None:
        """``kv_limits``: KVLimits fields to change (listener caps, socket and NCCL timeouts);
        ``migration``: MigrationConfig fields to change; ``index``: publish cached blocks to
        the prefix index (its requests' prompts and answers: a next turn may prefill here)."""
        super().__init__(engine_config, name, index)
        self.decode_role, self.migration_role = decode_roles(
            self,
            transport=transport,
            token=token,
            host=host,
            transfer_timeout_s=transfer_timeout_s,
            limits=KVLimits(**(kv_limits or {})),
            migration=MigrationConfig(**(migration or {})),
        )
        self.roles = [self.decode_role, self.migration_role]

    async def ready(self) -> dict[str, Any]:
        return {**await super().ready(), "endpoint": self.decode_role.receiver.endpoint}

    async def generate_many(
        self, items: list[tuple[str, list[int], Any, dict[str, Any]]], client: str = ""
    ) -> list[tuple[str, str] | None]:
        """Whole requests, prefill included, here: a conversation's next turn, when this
        worker holds all of its prompt but a short suffix (the router's
        ``local_prefill_tokens``), is prefilled where its history is rather than recomputed
        or loaded on a prefill worker and streamed back. Answers as the colocated worker's
        ``generate_many`` (``EngineWorker.add_requests``)."""
        return await self.add_requests(items, client)

    endpoint = delegate("decode_role", DecodeRole.endpoint)
    reserve = delegate("decode_role", DecodeRole.reserve)
    reserve_many = delegate("decode_role", DecodeRole.reserve_many)
    fail_transfer = delegate("decode_role", DecodeRole.fail_transfer)
    kv_timings = delegate("decode_role", DecodeRole.kv_timings)
    migrate_out = delegate("migration_role", MigrationRole.migrate_out)
    migrate_in = delegate("migration_role", MigrationRole.migrate_in)
    migrate_grow = delegate("migration_role", MigrationRole.migrate_grow)
    migrate_wait = delegate("migration_role", MigrationRole.migrate_wait)
    migrate_cancel = delegate("migration_role", MigrationRole.migrate_cancel)
    migration_candidates = delegate("migration_role", MigrationRole.migration_candidates)
    migration_timings = delegate("migration_role", MigrationRole.migration_timings)
