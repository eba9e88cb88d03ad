"""The layer streamer: the prefill side's engine step observer that sends each layer's KV
to the decode worker of every request in the step, as soon as that layer is written.

Each step, before the forward pass, ``begin_step`` plans which token positions of which request
go to which decode worker (the chunk's new tokens, plus on a request's first chunk its
prefix-cache hits: skipped here, still needed there) and returns a per-layer hook
(``GatheredLayerHook``: the KV slots of those positions); right after layer L wrote its KV the
model runner gathers every head of those slots into one contiguous buffer (on the compute
stream, so a later step can never overwrite the blocks first) and the hook queues each decode
worker's columns on that pair's channel, whose own thread sends them while layer L + 1
computes. ``end_step`` queues ``done`` with the first sampled token behind the last layer. A
channel whose queue is full refuses a layer: its transfers fail through the connector's
``on_failure`` (retryable), and their ``done`` is not reported.

Under tensor parallelism each rank holds a slice of every layer's KV heads, and only rank 0
runs this observer: the slots go to every rank with the step's inputs, and after each layer the
ranks gather their heads of them to rank 0 (``ModelRunner._layer_hook``), so the payload has a
one-device pool's layout whatever the TP size on either side (any pair of layouts meets) and
the layers still leave one by one, beside the next layer's compute.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import slot_array
from engine.kv_transfer.backends import KVConnector
from engine.outputs import SampledToken
from engine.scheduler import SchedulerOutput
from engine.step_inputs import GatheredLayerHook
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

    def __init__(self, connector: KVConnector, block_size: int):
        self.connector, self.block_size = connector, block_size
        self.transfers: dict[str, _Outgoing] = {}
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
        """End ``request_id``'s transfer here and tell its decode worker, whether or not any
        layer went yet: a reservation that no KV has reached would otherwise wait out its
        timeout (the decode side ignores an abort of a transfer it does not hold)."""
        t = self.transfers.pop(request_id, None)
        if t is not None:
            self.connector.sender(t.endpoint).send_abort(t.transfer_id, reason)
        return t

    def begin_step(self, out: SchedulerOutput) -> GatheredLayerHook | None:
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
        sends, col = [], 0  # (sender, entries, its columns of the gathered layer)
        for ep, (slots, entries) in plan.items():
            n = sum(len(x) for x in slots)
            sends.append((self.connector.sender(ep), entries, col, col + n))
            col += n

        def on_layer(layer: int, kv: torch.Tensor) -> None:
            for sender, entries, start, stop in sends:
                part = kv if len(sends) == 1 else kv[:, :, start:stop].contiguous()
                sender.send_layer(layer, entries, part)
            trace(sends[0][1][0][0], f"prefill.hook{layer}")

        all_slots = np.concatenate([x for slots, _ in plan.values() for x in slots])
        return GatheredLayerHook(all_slots, on_layer)

    def end_step(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> None:
        for chunk in out.scheduled:
            rid = chunk.request.request_id
            t = self.transfers.get(rid)
            if t is None or rid not in sampled:
                continue
            del self.transfers[rid]
            token = token_to_dict(sampled[rid])
            # The prompt tokens this worker served from its prefix cache (for the client's usage).
            token["num_cached_tokens"] = max(chunk.request.num_cached_tokens, 0)
            # when the first token existed here: the decode side's share of TTFT that is the
            # transfer's tail (wall clock: one node's, or NTP's agreement across nodes)
            token["sampled_at"] = time.time()
            if not self.connector.sender(t.endpoint).send_done(t.transfer_id, t.num_tokens, token):
                continue  # refused earlier (a full channel queue): it is failing, not done
            trace(rid, "prefill.sampled")
            first = t.first_step_at or t.added_at
            phases = (t.added_at - t.called_at, first - t.added_at, time.monotonic() - first)
            self.on_done(rid, token, phases)
