"""The prefill worker: runs prompts and streams each layer's KV to the decode worker that
continues the request.

A request's life here (the decode worker's module has the other half)::

    1. the caller picks a decode worker (its KV endpoint) and asks it to reserve the request's
       blocks; at the same time it calls
    2. prefill(request_id, prompt, params, endpoint, gated=True)   queued in the engine as a
       one-token request; the prompt is chunked and batched with other prompts, and
       whole-block prefix hits skip recomputation. Until release(request_id) (the reservation
       succeeded) the request's KV waits at the head of that pair's channel; if the decode
       worker was full the caller aborts it here
    3. each step, before the forward pass, the streamer plans which token positions of which
       request go to which decode worker: the chunk's new tokens, plus on the first chunk the
       prefix-cache hits (skipped here, still needed there)
    4. as soon as layer L has written its KV the hook gathers those positions into one
       contiguous buffer per decode worker (on the compute stream, so a later step can never
       overwrite the blocks first) and queues it on that pair's channel, whose own thread (and,
       over NCCL, own CUDA stream) sends it while layer L + 1 computes
    5. the step that completes the prompt samples the first token and queues ``done`` behind
       the last layer; ``prefill`` returns that token to its caller
    6. the request ends here: its prompt blocks stay in this worker's prefix cache; an abort or
       a broken channel aborts the transfer (the decode worker frees its side on ``abort`` or
       when the channel drops) and ``prefill`` returns the error
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from cluster.kv_transport import KVConnector
from cluster.worker import EngineWorker, trace
from engine.attention import host_to_device, slot_array
from engine.sampler import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput


def token_to_dict(token: SampledToken) -> dict:
    return {
        "token_id": token.token_id,
        "logprob": token.logprob,
        "top_logprobs": [[t, lp] for t, lp in token.top_logprobs or []],
    }


def token_from_dict(d: dict) -> SampledToken:
    top = d.get("top_logprobs") or None
    return SampledToken(
        int(d["token_id"]),
        d.get("logprob"),
        [(int(t), float(lp)) for t, lp in top] if top else None,
    )


@dataclass
class _Outgoing:
    transfer_id: str
    endpoint: str
    num_tokens: int
    sent_upto: int = 0  # positions [0, sent_upto) are queued for every layer


class KVStreamer:
    """The engine's step observer on a prefill worker (engine.llm_engine.StepObserver)."""

    def __init__(self, connector: KVConnector, kv_caches: list[torch.Tensor], block_size: int):
        self.connector, self.kv_caches, self.block_size = connector, kv_caches, block_size
        self.transfers: dict[str, _Outgoing] = {}
        self.on_done = lambda request_id, token: None  # set by the worker

    def add(
        self,
        request_id: str,
        transfer_id: str,
        endpoint: str,
        num_tokens: int,
        gate: threading.Event | None = None,
        gate_timeout_s: float = 60.0,
    ) -> None:
        sender = self.connector.sender(endpoint)  # opened now: its handshake overlaps the queue
        if gate is not None:
            sender.hold(transfer_id, gate, gate_timeout_s)
        self.transfers[request_id] = _Outgoing(transfer_id, endpoint, num_tokens)

    def drop(self, request_id: str, reason: str) -> _Outgoing | None:
        t = self.transfers.pop(request_id, None)
        if t is not None and t.sent_upto > 0:
            self.connector.sender(t.endpoint).send_abort(t.transfer_id, reason)
        return t

    def begin_step(self, out: SchedulerOutput):
        plan: dict[str, tuple[list[np.ndarray], list[tuple[str, int, int]]]] = {}
        for chunk in out.scheduled:
            t = self.transfers.get(chunk.request.request_id)
            end = chunk.start + chunk.num_tokens
            if t is None or end <= t.sent_upto:
                continue
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
                sender.send_layer(layer, entries, cache.index_select(2, index))
            trace(sends[0][2][0][0], f"prefill.hook{layer}")

        return hook

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
            self.connector.sender(t.endpoint).send_done(t.transfer_id, t.num_tokens, token)
            trace(rid, "prefill.sampled")
            self.on_done(rid, token)


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(
        self,
        engine_config: dict[str, Any],
        name: str = "",
        *,
        token: str = "",
        max_channels: int = 8,
        index: dict[str, Any] | None = None,
    ) -> None:
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._gates: dict[str, threading.Event] = {}
        super().__init__(engine_config, name, index)
        self.connector = KVConnector(
            self.kv_spec(), self._on_channel_failure, token=token, max_channels=max_channels
        )
        kv_caches = self.engine.runner.kv_caches
        self.streamer = KVStreamer(self.connector, kv_caches, self.engine.cfg.block_size)
        self.streamer.on_done = self._on_done
        self.engine.step_observer = self.streamer

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        endpoint: str,
        *,
        gated: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Compute the prompt, stream its KV to ``endpoint`` (transfer id = request id) and
        return ``{"ok": True, "token": first token}`` or ``{"ok": False, "error": ...}``.

        ``gated``: the decode worker is reserving at the same time; the prompt computes at once
        but none of its KV leaves before ``release(request_id)`` (or an abort)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if request_id in self._waiters:
            return {"ok": False, "error": f"request_id {request_id!r} is already in use"}
        self._waiters[request_id] = (loop, fut)
        gate = None
        if gated:  # registered before the first await, so a release() that follows finds it
            gate = self._gates.pop(request_id, None) or threading.Event()
            if not gate.is_set():  # (set already: the release overtook this call)
                self._gates[request_id] = gate
        one = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=[], n=1)

        def add() -> None:
            trace(request_id, "prefill.add")
            self.engine.add_request(request_id, prompt, one, **kwargs)
            self.streamer.add(request_id, request_id, endpoint, len(prompt), gate)

        try:
            await self.call(add)
        except BaseException as exc:
            self._waiters.pop(request_id, None)
            return {"ok": False, "error": str(exc)}
        return await fut

    async def release(self, request_id: str) -> None:
        """The decode worker has reserved: a gated request's KV may leave."""
        trace(request_id, "prefill.release")
        gate = self._gates.pop(request_id, None)
        if gate is None:  # overtook its prefill() call: leave it open for that call
            gate = self._gates[request_id] = threading.Event()
        gate.set()

    def _resolve(self, request_id: str, result: dict[str, Any]) -> None:
        if not result["ok"]:
            gate = self._gates.pop(request_id, None)
            if gate is not None:
                gate.set()  # a failed or aborted request must not hold its channel
        entry = self._waiters.pop(request_id, None)
        if entry is not None:
            loop, fut = entry
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    def _on_done(self, request_id: str, token: dict) -> None:
        self._resolve(request_id, {"ok": True, "token": token})

    def _on_channel_failure(self, transfer_ids: list[str], reason: str) -> None:
        """From a sender thread: the channel to a decode worker broke."""

        def fail() -> None:
            for tid in transfer_ids:
                self.streamer.transfers.pop(tid, None)
                self.engine.abort_request(tid)
                self._resolve(tid, {"ok": False, "error": reason})

        self.post(fail)

    def _abort(self, request_id: str) -> None:
        self.streamer.drop(request_id, "aborted by the caller")
        self.engine.abort_request(request_id)
        self._resolve(request_id, {"ok": False, "error": "aborted"})

    def _fail_everything(self, message: str) -> None:
        for rid in list(self._waiters):
            self._abort(rid)
        super()._fail_everything(message)

    async def kv_timings(self) -> list[tuple[float, ...]]:
        """(bytes, post lag ms, send ms) of each layer message sent since the last call (NCCL
        backend: CUDA events at the pack, at the send's start and at its end; empty otherwise)."""
        return self.connector.drain_timings()

    def _stats(self) -> dict[str, Any]:
        stats = super()._stats()
        stats["kv_channels"] = self.connector.num_channels
        stats["kv_bytes_sent"] = self.connector.bytes_sent
        return stats
