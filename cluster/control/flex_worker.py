"""A worker that can take either role: prefill or decode, switched without reloading weights.

``tandem serve --role-switching`` (``ClusterConfig.role_switching``) starts every prefill and
decode worker as a FlexWorker: a decode worker (its KV receiver, live migration) with the
prefill role mixed in (prefill_worker/worker.py ``PrefillMixin``: the KV connector and the
streamer), on one engine and one copy of the weights. Which role it plays is the membership
table's: routers send it what its role there says. The controller switches it
(``Controller.switch_role``): drain it in its old role (a decode worker's requests migrate
away; a prefill worker finishes what it runs), ``set_role`` here once it is idle, then publish
the new role. The autoscaler does this, rather than start a worker, when the pool it grows is
short and the other pool has a worker to spare.

The streamer observes engine steps only while the worker prefills (an observed step that fails
fails the whole batch, where a decode step alone is retried request by request). Both roles'
KV sockets stay open: the receiver (its endpoint in the table) and the connector. It lives
here, above both worker packages, because it is both.
"""

from __future__ import annotations

from typing import Any

from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillMixin

ROLES = ("prefill", "decode")


class FlexWorker(PrefillMixin, DecodeWorker):
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
        self.role = role
        self._init_prefill_state()
        super().__init__(
            engine_config,
            name,
            transport=transport,
            token=token,
            host=host,
            transfer_timeout_s=transfer_timeout_s,
            kv_limits=kv_limits,
            migration=migration,
            index=index,
        )
        self._init_prefill(token, max_channels, kv_limits)
        self.attach_streamer(role == "prefill")
        self.switches = 0

    async def set_role(self, role: str) -> dict[str, Any]:
        """Play ``role`` from now on. Refused (ValueError) unless the worker is idle: nothing
        running, waiting, arriving or streaming out (the controller drains it first)."""
        if role not in ROLES:
            raise ValueError(f"a flex worker's role is prefill or decode, got {role!r}")

        def switch() -> dict[str, Any]:
            busy = {
                "requests": self.engine.num_unfinished_requests,
                "transfers in": len(self.receiver.pending()),
                "prefills": len(self._waiters),
                "KV bytes out": self.connector.pending_bytes,
                "migrations": len(self._out) + len(self._in),
            }
            if any(busy.values()):
                left = ", ".join(f"{k} {v}" for k, v in busy.items() if v)
                raise ValueError(f"{self.name} is not idle ({left}): drain it first")
            old, self.role = self.role, role
            self.attach_streamer(role == "prefill")
            self.switches += old != role
            return {"name": self.name, "from": old, "role": role, "switches": self.switches}

        return await self.call(switch, control=True)

    def _abort(self, request_id: str) -> None:
        # A prefill of ours: still computing (a waiter), or computed and gated (its KV held
        # until the decode worker's reservation; the router aborts it when that answered Full),
        # or streaming. Its gate must open now, or it holds the channel's queue until its
        # timeout.
        if (
            request_id in self._waiters
            or request_id in self._gates
            or request_id in self.streamer.transfers
        ):
            PrefillMixin._abort(self, request_id)
        else:
            DecodeWorker._abort(self, request_id)

    def _stats(self) -> dict[str, Any]:
        stats = super()._stats()  # the prefill side's over the decode side's
        if self._connector is not None:  # live migrations send KV too
            stats["kv_bytes_sent"] += self._connector.bytes_sent
        stats["role_switches"] = self.switches
        return stats

    def shutdown(self) -> None:
        self.connector.close()
        super().shutdown()
