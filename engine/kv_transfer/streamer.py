"""The layer streamer: the prefill side's engine step observer that sends each layer's KV
to the decode worker of every request in the step, as soon as that layer is written.

Each step, before the forward pass, ``begin_step`` plans which token positions of which request
go to which decode worker (the chunk's new tokens, plus on a request's first chunk its
prefix-cache hits: skipped here, still needed there) and returns a per-layer hook; the hook
gathers those positions into one contiguous buffer per decode worker right after layer L wrote
its KV (on the compute stream, so a later step can never overwrite the blocks first) and queues
it on that pair's channel, whose own thread sends it while layer L + 1 computes. ``end_step``
queues ``done`` with the first sampled token behind the last layer. A channel whose queue is
full refuses a layer: its transfers fail through the connector's ``on_failure`` (retryable),
and their ``done`` is not reported.

Under tensor parallelism (``read_tokens`` given) each rank holds a slice of every layer's KV
heads, and only rank 0 runs this observer: after the step, on the engine thread, it reads the
step's positions with every head (``ModelRunner.read_kv_tokens``: the ranks gather to rank 0)
and queues them as one message of every layer. The payload has a one-device pool's layout
whatever the TP size on either side, so any pair of layouts meets; the layers leave after the
step instead of beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import host_to_device, slot_array
from engine.kv_transfer.backends import KVConnector
from engine.kv_transfer.transport import byte_view
from engine.outputs import SampledToken
from engine.scheduler import SchedulerOutput
from engine.tracing import trace


def token_to_dict(token: SampledToken) -> dict:
    d = {
        "token_id": token.token_id,
        "logprob": token.logprob,
        "top_logprobs": [[t, lp] for t, lp in token.top_logprobs or []],
    }
    if token.predicted is not None:  # the length probe's estimate (engine/length_probe.py)
        d["predicted"] = list(token.predicted)
    return d


def token_from_dict(d: dict) -> SampledToken:
    top = d.get("top_logprobs") or None
    return SampledToken(
        int(d["token_id"]),
        d.get("logprob"),
        [(int(t), float(lp)) for t, lp in top] if top else None,
        _estimate(d.get("predicted")),
    )


def _estimate(value: object) -> tuple[float, float, float] | None:
    """A peer's length estimate when it is three finite numbers; advisory, so anything else
    is dropped rather than failing the request."""
    if not isinstance(value, list) or len(value) != 3:
        return None
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value):
        return None
    return (float(value[0]), float(value[1]), float(value[2]))


@dataclass
class _Outgoing:
    transfer_id: str
    endpoint: str
    num_tokens: int
    sent_upto: int = 0  # positions [0, sent_upto) are queued for every layer
    called_at: float = 0.0  # monotonic: the worker's call, added here, first chunk scheduled
    added_at: float = 0.0
    first_step_at: float | None = None


class KVStreamer:
    """The engine's step observer on a prefill worker (engine.llm_engine.StepObserver)."""

    def __init__(
        self,
        connector: KVConnector,
        kv_caches: list[torch.Tensor],
        block_size: int,
        read_tokens: Callable[[list[int], int, int], torch.Tensor] | None = None,
    ):
        self.connector, self.kv_caches, self.block_size = connector, kv_caches, block_size
        self.read_tokens = read_tokens  # tensor parallel: every head of a request's positions
        self.transfers: dict[str, _Outgoing] = {}
        # tensor parallel: per endpoint, (transfer id, block table, start, end) of the step
        self._after_step: dict[str, list[tuple[str, list[int], int, int]]] = {}
        self.on_done = lambda request_id, token, phases: None  # set by the worker

    def add(
        self,
        request_id: str,
        transfer_id: str,
        endpoint: str,
        num_tokens: int,
        gate: threading.Event | None = None,
        gate_timeout_s: float = 60.0,
        called_at: float | None = None,
    ) -> None:
        sender = self.connector.sender(endpoint)  # opened now: its handshake overlaps the queue
        if gate is not None:
            sender.hold(transfer_id, gate, gate_timeout_s)
        now = time.monotonic()
        self.transfers[request_id] = _Outgoing(
            transfer_id, endpoint, num_tokens, called_at=called_at or now, added_at=now
        )

    def drop(self, request_id: str, reason: str) -> _Outgoing | None:
        t = self.transfers.pop(request_id, None)
        if t is not None and t.sent_upto > 0:
            self.connector.sender(t.endpoint).send_abort(t.transfer_id, reason)
        return t

    def begin_step(self, out: SchedulerOutput):
        if self.read_tokens is not None:
            return self._plan_after_step(out)
        plan: dict[str, tuple[list[np.ndarray], list[tuple[str, int, int]]]] = {}
        for chunk in out.scheduled:
            t = self.transfers.get(chunk.request.request_id)
            end = chunk.start + chunk.num_tokens
            if t is None or end <= t.sent_upto:
                continue
            if t.first_step_at is None:
                t.first_step_at = time.monotonic()
            slots, entries = plan.setdefault(t.endpoint, ([], []))
            slots.append(slot_array(chunk.block_table, t.sent_upto, end, self.block_size))
            entries.append((t.transfer_id, t.sent_upto, end - t.sent_upto))
            t.sent_upto = end
        if not plan:
            return None
        device = self.kv_caches[0].device
        sends = [
            (
                self.connector.sender(ep),
                host_to_device(np.concatenate(slots), device),
                entries,
            )
            for ep, (slots, entries) in plan.items()
        ]

        def hook(layer: int) -> None:
            cache = self.kv_caches[layer]
            for sender, index, entries in sends:
                kv = byte_view(cache).index_select(2, index).view(cache.dtype)
                sender.send_layer(layer, entries, kv)
            trace(sends[0][2][0][0], f"prefill.hook{layer}")

        return hook

    def _plan_after_step(self, out: SchedulerOutput) -> None:
        """Tensor parallel: what ``end_step`` reads and sends (no per-layer hook)."""
        self._after_step = {}
        for chunk in out.scheduled:
            t = self.transfers.get(chunk.request.request_id)
            end = chunk.start + chunk.num_tokens
            if t is None or end <= t.sent_upto:
                continue
            if t.first_step_at is None:
                t.first_step_at = time.monotonic()
            reads = self._after_step.setdefault(t.endpoint, [])
            reads.append((t.transfer_id, list(chunk.block_table), t.sent_upto, end))
            t.sent_upto = end

    def _send_after_step(self) -> None:
        """Tensor parallel: the step's positions, every head and layer, one message per
        decode worker."""
        plan, self._after_step = self._after_step, {}
        for endpoint, reads in plan.items():
            parts = [self.read_tokens(table, start, end) for _, table, start, end in reads]
            entries = [(tid, start, end - start) for tid, _, start, end in reads]
            kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
            self.connector.sender(endpoint).send_layers(0, entries, kv)
            trace(entries[0][0], "prefill.sent_after_step")

    def end_step(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> None:
        if self._after_step:
            self._send_after_step()
        for chunk in out.scheduled:
            rid = chunk.request.request_id
            t = self.transfers.get(rid)
            if t is None or rid not in sampled:
                continue
            del self.transfers[rid]
            token = token_to_dict(sampled[rid])
            # The prompt tokens this worker served from its prefix cache (for the client's usage).
            token["num_cached_tokens"] = max(chunk.request.num_cached_tokens, 0)
            if not self.connector.sender(t.endpoint).send_done(t.transfer_id, t.num_tokens, token):
                continue  # refused earlier (a full channel queue): it is failing, not done
            trace(rid, "prefill.sampled")
            first = t.first_step_at or t.added_at
            phases = (t.added_at - t.called_at, first - t.added_at, time.monotonic() - first)
            self.on_done(rid, token, phases)
