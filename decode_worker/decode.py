"""The decode role: reserves blocks, receives a prompt's KV from a prefill worker, decodes.

``DecodeRole`` does it on a worker's engine; the actors that hold it are ``DecodeWorker``
(decode_worker/worker.py: with the migration role) and the flex worker (cluster/). A request's
life here (prefill_worker/worker.py has the other half)::

    1. reserve(request_id, prompt, params, client)   validate (``Rejected`` on bad input), then
       hold blocks for the prompt plus the first decode step (``Reserved(endpoint)``), or answer
       ``Full`` at once so the caller can pick another decode worker; the KV receiver now
       expects the transfer (an ``Arrival`` with its deadline); the request's deltas will go to
       ``client``'s stream
    2. the prefill worker streams the prompt's KV layer by layer; the receiver writes each
       layer into the reserved blocks as it arrives (its own thread; over NCCL its own stream)
    3. ``done`` after every layer: the request is admitted into the running batch with the
       first token the prefill worker sampled (that token is its first stream output); a
       constrained request whose grammar still compiles (off the engine thread, since the
       reservation) is admitted when it lands
    4. decode steps, batched with every other running request; each step's deltas go out on
       the client's ``outputs`` stream (engine/runtime.py), one batch per step
    5. completion or abort frees the blocks. A transfer that fails (prefill abort, broken
       channel, timeout: ``tick`` checks the deadlines) frees them too and ends the request
       with a retryable error delta before any token, so the caller can run the request on
       another pair

A running request can move to another decode worker while it decodes (``migrate_out`` here,
``migrate_in`` there): decode_worker/migration.py has that protocol. Its KV arrives through
this role's receiver too (``expect`` with the migration role's ``on_end``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_transfer import KVLimits, TransferEvent, TransferOutcome, make_receiver
from engine.kv_transfer.streamer import token_from_dict
from engine.messages import Full, Rejected, Reserved, ReserveResult, aborted
from engine.runtime import EngineWorker, Role
from engine.sampling_params import SamplingParams
from engine.tracing import trace

logger = logging.getLogger(__name__)


@dataclass
class Arrival:
    """A request whose KV is still coming in (from a prefill worker, or a migration's source):
    until when it may take, why it was cancelled ("" for the caller's abort) once it was, and
    who ends it: None for a prefill's transfer (admitted here), a migration's handler for a
    migration's. The receiver's event for it ends it, in one place
    (``DecodeRole._on_transfer_end``)."""

    deadline: float  # monotonic
    reserved_at: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None
    on_end: Callable[[TransferEvent, str | None], None] | None = None
    # tensor parallel: the KV arrives here, every head, and goes to the request's blocks (its
    # block table, as long as this buffer is: a migration's grows with both) on completion
    staged: torch.Tensor | None = None


STAGING_FULL = "tensor-parallel staging full: KV still arriving for other requests"


class DecodeRole(Role):
    """``reserve`` / ``fail_transfer`` / ``endpoint``, the KV receiver and its arrivals."""

    def __init__(
        self,
        worker: EngineWorker,
        *,
        transport: str,
        token: str,
        host: str,
        transfer_timeout_s: float,
        limits: KVLimits,
    ) -> None:
        super().__init__(worker)
        self.transfer_timeout_s = transfer_timeout_s
        self.arriving: dict[str, Arrival] = {}  # transfer id -> its KV still coming in
        self.max_staged_bytes = limits.max_staged_bytes
        self.staged_bytes = 0  # tensor parallel: bytes in the arrivals' buffers now
        self.kv_transfer_seconds = 0.0  # reservation -> every layer in, summed over transfers
        # the prefill's first token sampled -> every layer in here: what the layer-wise stream
        # leaves exposed in TTFT, summed over the completed prefill transfers (counted)
        self.kv_tail_seconds = 0.0
        self.kv_transfers_in = 0
        if host == "node":  # multi-node: listen where prefill workers on other nodes reach us
            import ray

            host = ray.util.get_node_ip_address()
        self.receiver = make_receiver(
            transport,
            worker.kv_spec(),
            self.engine.runner.kv_caches,
            self.engine.cfg.block_size,
            self._on_transfer_event,
            token=token,
            host=host,
            limits=limits,
        )

    async def endpoint(self) -> str:
        return self.receiver.endpoint

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
        args = (request_id, prompt, params, client, predicted_tokens)
        return await self.worker.call(lambda: self._reserve(*args, **kwargs))

    async def reserve_many(
        self, items: list[tuple[str, list[int], SamplingParams, dict[str, Any]]], client: str = ""
    ) -> list[ReserveResult]:
        """``reserve`` for several requests, ``(request_id, prompt, params, kwargs)`` each
        (``kwargs`` with ``predicted_tokens`` and the rest), in one actor call and one hop to
        the engine thread: the router sends a burst's reservations together (router/dispatch.py
        ``_Batch``). Each request gets its own answer; one whose reservation raised gets
        ``Full`` with the error (the router then tries another worker), never the others'."""

        def reserve_all() -> list[ReserveResult]:
            out: list[ReserveResult] = []
            for request_id, prompt, params, kwargs in items:
                kwargs = dict(kwargs)
                predicted = kwargs.pop("predicted_tokens", None)
                try:
                    out.append(
                        self._reserve(request_id, prompt, params, client, predicted, **kwargs)
                    )
                except Exception as exc:  # noqa: BLE001 - that request's, reported to its caller
                    logger.exception("reserving %s failed", request_id)
                    out.append(Full(f"reserve failed: {type(exc).__name__}: {exc}"))
            return out

        return await self.worker.call(reserve_all)

    def _reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        client: str,
        predicted_tokens: int | None,
        **kwargs: Any,
    ) -> ReserveResult:
        """(engine thread) One reservation: blocks for the prompt (and carried output), the
        receiver told to expect its KV, the request registered to ``client``'s stream."""
        trace(request_id, "decode.reserve")
        carried = len(kwargs.get("output_token_ids") or ())
        if not self.staging_room(len(prompt) + carried + 1):
            return Full(STAGING_FULL)
        try:
            table = self.engine.reserve_remote(request_id, prompt, params, **kwargs)
        except ValueError as exc:
            return Rejected(str(exc))
        if table is None:
            return Full()
        tracked = self.worker.register(request_id, client)
        if predicted_tokens:  # (its 90th percentile): what projections count, not max_tokens
            tracked.predicted = int(predicted_tokens)
        deadline = time.monotonic() + self.transfer_timeout_s
        self.expect(request_id, table, len(prompt) + carried, deadline)
        return Reserved(self.receiver.endpoint)

    async def fail_transfer(self, request_id: str, reason: str) -> None:
        """The caller saw the prefill side fail: drop the transfer, end the stream retryably."""
        await self.worker.call(lambda: self.cancel(request_id, reason))

    async def kv_timings(self) -> list[tuple[int, float]]:
        """(bytes, ms) of each layer message received since the last call (NCCL backend: CUDA
        events around each recv on its pair stream; empty for other backends)."""
        timings = getattr(self.receiver, "timings", None)
        return timings.drain() if timings is not None else []

    # -- engine thread ---------------------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        table: list[int],
        num_tokens: int,
        deadline: float,
        *,
        exact: bool = True,
        on_end: Callable[[TransferEvent, str | None], None] | None = None,
    ) -> None:
        """The receiver writes positions ``[0, num_tokens)`` of ``request_id`` into ``table``
        (``exact=False``: up to, the length comes with ``done``) until ``deadline``; its
        event ends it (``on_end``: a migration's handler; None: admitted as a prefill's).

        A tensor-parallel worker's rank 0 receives every KV head (the layout any sender
        has) into a buffer of the request's own, and scatters it to the ranks' pools when the
        transfer completes, before the request is admitted."""
        staged = self._staging(table)
        self.receiver.expect(request_id, table, num_tokens, exact=exact, into=staged)
        arrival = self.arriving[request_id] = Arrival(deadline, on_end=on_end)
        self._hold(arrival, staged)

    def extend(self, request_id: str, table: list[int], num_tokens: int) -> bool:
        """Room for ``num_tokens`` positions in ``table`` for an inexact transfer (a
        migration's) still arriving; False when it no longer is."""
        arrival = self.arriving.get(request_id)
        if arrival is None:
            return False
        staged = self._staging(table)
        if not self.receiver.extend(request_id, table, num_tokens, into=staged):
            return False
        self._hold(arrival, staged)
        return True

    def staging_room(self, num_tokens: int) -> bool:
        """Whether a transfer of ``num_tokens`` positions may be expected now: always on one
        device; under tensor parallelism while the staging buffers stay within
        ``KVLimits.max_staged_bytes`` (or none is held)."""
        if self.engine.runner.tp is None or not self.staged_bytes:
            return True
        spec = self.receiver.spec
        slots = -(-num_tokens // spec.block_size) * spec.block_size
        return self.staged_bytes + spec.payload_bytes(slots) * spec.num_layers <= (
            self.max_staged_bytes
        )

    def _staging(self, table: list[int]) -> torch.Tensor | None:
        """Tensor parallel: a zeroed buffer for every head of ``table``'s slots (None: the
        receiver writes into this one-device pool directly)."""
        runner = self.engine.runner
        if runner.tp is None:
            return None
        spec = self.receiver.spec
        shape = (spec.num_layers, 2, spec.num_kv_heads, len(table) * spec.block_size)
        return torch.zeros(
            (*shape, spec.head_dim), dtype=spec.torch_dtype, device=runner.kv_caches[0].device
        )

    def _hold(self, arrival: Arrival, staged: torch.Tensor | None) -> None:
        """``staged`` becomes the arrival's buffer (None: it holds none from now on)."""
        for t, sign in ((arrival.staged, -1), (staged, 1)):
            if t is not None:
                self.staged_bytes += sign * t.numel() * t.element_size()
        arrival.staged = staged

    def _unstage(self, request_id: str, arrival: Arrival) -> None:
        """Tensor parallel: the complete transfer's KV into its blocks on every rank."""
        if arrival.staged is not None:
            staged = arrival.staged
            self._hold(arrival, None)
            table = self.engine.block_manager.block_table(request_id)
            self.engine.runner.write_kv_blocks(table, staged)

    def _on_transfer_event(self, event: TransferEvent) -> None:
        """From a receiver thread: hand the event to the engine thread."""
        tail = None
        sampled_at = (event.token or {}).get("sampled_at")
        if event.kind is TransferOutcome.COMPLETE and isinstance(sampled_at, (int, float)):
            tail = max(0.0, time.time() - sampled_at)
        self.worker.post(lambda: self._on_transfer_end(event, tail))

    def _on_transfer_end(self, event: TransferEvent, tail: float | None = None) -> None:
        rid = event.transfer_id
        if event.kind is TransferOutcome.COMPLETE and self._wait_for_grammar(event):
            return
        arrival = self.arriving.pop(rid, None)
        complete = event.kind is TransferOutcome.COMPLETE
        cancelled = arrival.cancel_reason if arrival is not None else None
        if arrival is not None:
            if complete and cancelled is None:
                self._unstage(rid, arrival)
            self._hold(arrival, None)  # (a failed or cancelled transfer's buffer goes)
        if arrival is not None and arrival.on_end is not None:
            arrival.on_end(event, cancelled)  # a migration's copy (not in kv_transfer_seconds)
            return
        if complete and arrival is not None:
            self.kv_transfer_seconds += time.monotonic() - arrival.reserved_at
            if tail is not None:
                self.kv_tail_seconds += tail
                self.kv_transfers_in += 1
        if complete and cancelled is None:
            trace(rid, "decode.admit")
            try:
                first = token_from_dict(event.token)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed peer: this one fails
                event = TransferEvent(TransferOutcome.FAILED, rid, reason=f"bad first token: {exc}")
            else:
                cached = event.token.get("num_cached_tokens", 0)
                self.worker.emit(self.engine.admit_remote(rid, first, num_cached_tokens=cached))
                return
        self.engine.abort_request(rid)  # frees the blocks: the receiver no longer writes them
        reason = event.reason if event.kind is TransferOutcome.FAILED else cancelled
        if reason:
            self.worker.fail(rid, f"KV transfer failed: {reason}", retryable=True)
        else:
            self.worker.emit([aborted(rid)])  # cancelled by the caller's abort

    def _wait_for_grammar(self, event: TransferEvent) -> bool:
        """A prefill's KV is in but the request's grammar still compiles (it started at the
        reservation): admit it when the compile lands instead of blocking the engine thread.
        Its arrival stays (an abort meanwhile still ends it here), its deadline off."""
        arrival = self.arriving.get(event.transfer_id)
        if arrival is None or arrival.on_end is not None or arrival.cancel_reason is not None:
            return False
        pending = self.engine.grammar_pending(event.transfer_id)
        if pending is None:
            return False
        arrival.deadline = math.inf
        again = lambda: self._on_transfer_end(event)  # noqa: E731
        pending.add_done_callback(lambda _: self.worker.post(again))
        return True

    def cancel(self, request_id: str, reason: str | None) -> None:
        """Stop a transfer still arriving. Exactly one receiver event follows (``released``, or
        a ``complete``/``failed`` already on its way); its handler frees the blocks."""
        arrival = self.arriving.get(request_id)
        if arrival is not None and arrival.cancel_reason is None:
            arrival.cancel_reason = reason or ""
            arrival.deadline = math.inf
            self.receiver.cancel(request_id)

    # -- the worker's calls (engine thread; Role has the contract) -------------------------------

    def holds(self) -> dict[str, int]:
        return {"transfers in": len(self.receiver.pending())}

    def abort(self, request_id: str) -> bool:
        """A transfer still arriving is cancelled (its event ends it); a running request is
        not this role's to end (the worker aborts it in its engine)."""
        if request_id not in self.arriving:
            return False
        self.cancel(request_id, None)
        return True

    def tick(self) -> float | None:
        """Cancel the transfers past their deadline; the next deadline."""
        now = time.monotonic()
        for rid, arrival in list(self.arriving.items()):
            if arrival.deadline <= now:
                self.cancel(rid, f"no KV after {self.transfer_timeout_s:.0f} s")
        deadline = min((a.deadline for a in self.arriving.values()), default=math.inf)
        return None if deadline == math.inf else deadline

    def stats(self) -> dict[str, Any]:
        out = {
            "kv_bytes_received": self.receiver.bytes_received,
            "kv_transfer_seconds": self.kv_transfer_seconds,
            "kv_transfer_tail_seconds": self.kv_tail_seconds,
            "kv_transfers_in": self.kv_transfers_in,
            "transfers_pending": len(self.receiver.pending()),
        }
        if self.engine.runner.tp is not None:  # KV held outside the pool until it is scattered
            out["kv_staged_bytes"] = self.staged_bytes
        return out

    def close(self) -> None:
        self.receiver.close()
