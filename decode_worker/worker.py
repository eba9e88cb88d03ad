"""The decode worker: reserves blocks, receives a prompt's KV from a prefill worker, decodes.

A request's life here (prefill_worker/worker.py has the other half)::

    1. reserve(request_id, prompt, params, client)   validate (``Rejected`` on bad input), then
       hold blocks for the prompt plus the first decode step (``Reserved(endpoint)``), or answer
       ``Full`` at once so the caller can pick another decode worker; the KV receiver now
       expects the transfer; the request's deltas will go to ``client``'s stream
    2. the prefill worker streams the prompt's KV layer by layer; the receiver writes each
       layer into the reserved blocks as it arrives (its own thread; over NCCL its own stream)
    3. ``done`` after every layer: the request is admitted into the running batch with the
       first token the prefill worker sampled (that token is its first stream output)
    4. decode steps, batched with every other running request; each step's deltas go out on
       the client's ``outputs`` stream (engine/runtime.py), one batch per step
    5. completion or abort frees the blocks. A transfer that fails (prefill abort, broken
       channel, timeout) frees them too and ends the request with a retryable error delta
       before any token, so the caller can run the request on another pair

A running request can move to another decode worker while it decodes (``migrate_out`` here,
``migrate_in`` there): decode_worker/migration.py has that protocol.
"""

from __future__ import annotations

import math
import time
from typing import Any

from decode_worker.migration import Arrival, MigrationConfig, MigrationMixin
from engine.kv_transfer import KVLimits, TransferEvent, TransferOutcome, make_receiver
from engine.kv_transfer.streamer import token_from_dict
from engine.messages import Full, Rejected, Reserved, ReserveResult, aborted
from engine.runtime import EngineWorker
from engine.sampling_params import SamplingParams
from engine.tracing import trace


class DecodeWorker(MigrationMixin, EngineWorker):
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
        the prefix index (a decode worker computes none; one that can also prefill does)."""
        self.transfer_timeout_s = transfer_timeout_s
        self.token = token
        self.kv_limits = KVLimits(**(kv_limits or {}))
        self._init_migration(MigrationConfig(**(migration or {})))
        self._arriving: dict[str, Arrival] = {}  # transfer id -> its KV still coming in
        self.kv_transfer_seconds = 0.0  # reservation -> every layer in, summed over transfers
        super().__init__(engine_config, name, index)
        if host == "node":  # multi-node: listen where prefill workers on other nodes reach us
            import ray

            host = ray.util.get_node_ip_address()
        self.receiver = make_receiver(
            transport,
            self.kv_spec(),
            self.engine.runner.kv_caches,
            self.engine.cfg.block_size,
            self._on_transfer_event,
            token=token,
            host=host,
            limits=self.kv_limits,
        )

    async def endpoint(self) -> str:
        return self.receiver.endpoint

    async def ready(self) -> dict[str, Any]:
        return {**await super().ready(), "endpoint": self.receiver.endpoint}

    async def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        client: str = "",
        predicted_tokens: int | None = None,
        **kwargs: Any,
    ) -> ReserveResult:
        """``Reserved(endpoint)``, ``Full`` (no room now) or ``Rejected`` (invalid request:
        retrying elsewhere will not help). Outputs go to ``outputs(client)``. With
        ``output_token_ids`` (a resumed request) the KV expected covers them too.
        ``predicted_tokens``: the router's estimate of its whole output (projections)."""

        def reserve() -> ReserveResult:
            trace(request_id, "decode.reserve")
            try:
                table = self.engine.reserve_remote(request_id, prompt, params, **kwargs)
            except ValueError as exc:
                return Rejected(str(exc))
            if table is None:
                return Full()
            tracked = self._register(request_id, client)
            if predicted_tokens:  # (its 90th percentile): what projections count, not max_tokens
                tracked.predicted = int(predicted_tokens)
            carried = len(kwargs.get("output_token_ids") or ())
            self.receiver.expect(request_id, table, len(prompt) + carried)
            self._arriving[request_id] = Arrival(time.monotonic() + self.transfer_timeout_s)
            return Reserved(self.receiver.endpoint)

        return await self.call(reserve)

    async def fail_transfer(self, request_id: str, reason: str) -> None:
        """The caller saw the prefill side fail: drop the transfer, end the stream retryably."""
        await self.call(lambda: self._cancel(request_id, reason))

    # -- engine thread ---------------------------------------------------------------------------

    def _on_transfer_event(self, event: TransferEvent) -> None:
        """From a receiver thread: hand the event to the engine thread."""
        self.post(lambda: self._handle_transfer_event(event))

    def _handle_transfer_event(self, event: TransferEvent) -> None:
        rid = event.transfer_id
        arrival = self._arriving.pop(rid, None)
        complete = event.kind is TransferOutcome.COMPLETE
        cancelled = arrival.cancel_reason if arrival is not None else None
        if rid in self._in:  # a migration's copy (not counted in kv_transfer_seconds)
            self._migration_event(event, cancelled)
            return
        if complete and arrival is not None:
            self.kv_transfer_seconds += time.monotonic() - arrival.reserved_at
        if complete and cancelled is None:
            trace(rid, "decode.admit")
            try:
                first = token_from_dict(event.token)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed peer: this one fails
                event = TransferEvent(TransferOutcome.FAILED, rid, reason=f"bad first token: {exc}")
            else:
                cached = event.token.get("num_cached_tokens", 0)
                self._emit(self.engine.admit_remote(rid, first, num_cached_tokens=cached))
                return
        self.engine.abort_request(rid)  # frees the blocks: the receiver no longer writes them
        reason = event.reason if event.kind is TransferOutcome.FAILED else cancelled
        if reason:
            self._fail(rid, f"KV transfer failed: {reason}", retryable=True)
        else:
            self._emit([aborted(rid)])  # cancelled by the caller's abort

    def _cancel(self, request_id: str, reason: str | None) -> None:
        """Stop a transfer still arriving. Exactly one receiver event follows (``released``, or
        a ``complete``/``failed`` already on its way); its handler frees the blocks."""
        arrival = self._arriving.get(request_id)
        if arrival is not None and arrival.cancel_reason is None:
            arrival.cancel_reason = reason or ""
            arrival.deadline = math.inf
            self.receiver.cancel(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self._arriving:
            self._cancel(request_id, None)
        else:
            super()._abort(request_id)

    def _wait_timeout(self) -> float | None:
        deadline = min((a.deadline for a in self._arriving.values()), default=math.inf)
        return None if deadline == math.inf else max(0.0, deadline - time.monotonic())

    def _on_tick(self) -> None:
        now = time.monotonic()
        for rid, arrival in list(self._arriving.items()):
            if arrival.deadline <= now:
                self._cancel(rid, f"no KV after {self.transfer_timeout_s:.0f} s")

    async def kv_timings(self) -> list[tuple[int, float]]:
        """(bytes, ms) of each layer message received since the last call (NCCL backend: CUDA
        events around each recv on its pair stream; empty for other backends)."""
        timings = getattr(self.receiver, "timings", None)
        return timings.drain() if timings is not None else []

    async def migration_candidates(self) -> list[dict[str, Any]]:
        """Every request streaming from here, with its length and what it may still need."""
        return await self.call(self._migration_candidates, control=True)

    def _stats(self) -> dict[str, Any]:
        stats = super()._stats()
        stats["kv_bytes_received"] = self.receiver.bytes_received
        stats["kv_transfer_seconds"] = self.kv_transfer_seconds
        stats["transfers_pending"] = len(self.receiver.pending())
        if self._connector is not None:
            stats["kv_bytes_sent"] = self._connector.bytes_sent
        stats["migrations"] = self.migration_stats.as_dict(self.engine.cfg.block_size)
        stats["migrating"] = {"out": len(self._out), "in": len(self._in)}
        stats["projected_blocks"] = self._projected_blocks()
        return stats

    def _projected_blocks(self) -> int:
        """Blocks in use plus what the running requests will still need to finish (by the
        router's predicted length while they are short of it, else by their max_tokens; a
        request without one is counted to the context limit)."""
        bm, engine = self.engine.block_manager, self.engine
        need = 0
        for c in self._migration_candidates():
            end = min(c["num_tokens"] + c["remaining"], engine.max_model_len)
            need += bm.blocks_needed(end) - bm.blocks_needed(c["num_tokens"])
        return bm.num_blocks - bm.num_free_blocks + need

    def shutdown(self) -> None:
        self.receiver.close()
        if self._connector is not None:
            self._connector.close()
        super().shutdown()
