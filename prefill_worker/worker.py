"""The prefill role: runs prompts and streams each layer's KV to the decode worker that
continues the request. ``PrefillRole`` does it on a worker's engine; ``PrefillWorker`` is the
actor that holds this role and no other (cluster/control/flex_worker.py holds it beside decode).

A request's life here (decode_worker/decode.py has the other half)::

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
    6. the request ends here: its prompt blocks stay in this worker's prefix cache; an abort,
       a broken channel or a full channel queue (KVLimits.max_pending_bytes) aborts the
       transfer (the decode worker frees its side on ``abort`` or when the channel drops) and
       ``prefill`` returns the error (``PrefillFailed``: the caller retries elsewhere)

The role holds, per request, a waiter (the ``prefill`` call's future, until its result), a
gate (until ``release``) and the streamer's transfer (until ``done`` is queued); an abort of a
request it holds ends all three (``PrefillRole.abort``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any

from engine.kv_transfer import KVConnector, KVLimits
from engine.kv_transfer.streamer import KVStreamer, token_from_dict
from engine.messages import PrefillDone, PrefillFailed, PrefillResult
from engine.runtime import EngineWorker, Role, delegate
from engine.sampling_params import SamplingParams
from engine.tracing import trace


class PrefillRole(Role):
    """``prefill`` / ``release`` and the KV streaming behind them, on ``worker``'s engine: the
    KV connector to decode workers and the streamer that feeds it from each step's layers
    (``attach_streamer`` puts it on the engine)."""

    def __init__(
        self, worker: EngineWorker, *, token: str, max_channels: int, limits: KVLimits
    ) -> None:
        super().__init__(worker)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._gates: dict[str, threading.Event] = {}
        self.connector = KVConnector(
            worker.kv_spec(),
            self._on_channel_failure,
            token=token,
            max_channels=max_channels,
            limits=limits,
        )
        self.streamer = KVStreamer(self.connector, self.engine.cfg.block_size)
        self.streamer.on_done = self._on_done

    def attach_streamer(self, on: bool = True) -> None:
        """The streamer observes every engine step (it must while prefills stream; without
        an observer a failing step is retried request by request instead)."""
        self.engine.step_observer = self.streamer if on else None

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        endpoint: str,
        *,
        gated: bool = False,
        **kwargs: Any,
    ) -> PrefillResult:
        """Compute the prompt, stream its KV to ``endpoint`` (transfer id = request id) and
        return the first token (``PrefillDone``) or why not (``PrefillFailed``). A resumed
        request (``output_token_ids``) computes prompt + output and returns the next token.

        ``gated``: the decode worker is reserving at the same time; the prompt computes at once
        but none of its KV leaves before ``release(request_id)`` (or an abort)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if request_id in self._waiters:
            return PrefillFailed(f"request_id {request_id!r} is already in use")
        self._waiters[request_id] = (loop, fut)
        gate = None
        if gated:  # registered before the first await, so a release() that follows finds it
            gate = self._gates.pop(request_id, None) or threading.Event()
            if not gate.is_set():  # (set already: the release overtook this call)
                self._gates[request_id] = gate
        # One new token: after the prompt, or after the output a resumed request carries.
        carried = len(kwargs.get("output_token_ids") or ())
        upto = carried + 1
        one = replace(
            params, max_tokens=upto, min_tokens=min(params.min_tokens, upto), stop=[], n=1
        )

        called_at = time.monotonic()

        def add() -> None:
            trace(request_id, "prefill.add")
            self.engine.add_request(request_id, prompt, one, **kwargs)
            self.worker.register(request_id, "")  # no stream (the result is the call's); TTFT
            self.streamer.add(
                request_id, request_id, endpoint, len(prompt) + carried, gate, called_at=called_at
            )

        try:
            await self.worker.call(add)
            return await fut
        except asyncio.CancelledError:
            # The caller went away (a cancelled actor call): nothing of the request may stay.
            # add() is queued to the engine thread or done; the abort queues behind it.
            self.worker.post(lambda: self.abort(request_id))
            raise
        except Exception as exc:  # noqa: BLE001 - add() refused the request: the caller's answer
            self._waiters.pop(request_id, None)
            return PrefillFailed(str(exc))

    async def connect_kv(self, endpoints: list[str], timeout_s: float = 60.0) -> dict[str, str]:
        """Form the KV channels to these decode workers now rather than on the first request
        to each (the controller calls this when workers join). An NCCL channel's communicator
        takes ~1 s to form on 2 x H100, and a request on a channel still forming waits for it:
        a resume after a decode worker's death waited ~0.9 s behind one (benchmarks/NOTES.md,
        the resume stall). Returns each endpoint's outcome: "ok", "forming" (past
        ``timeout_s``) or the channel's error."""
        senders = await self.worker.call(lambda: self.connector.connect(endpoints))
        deadline = time.monotonic() + timeout_s

        def wait() -> None:
            for sender in senders:
                sender.formed.wait(max(0.0, deadline - time.monotonic()))

        await asyncio.get_running_loop().run_in_executor(None, wait)
        return {s.endpoint: (s.error or "ok") if s.formed.is_set() else "forming" for s in senders}

    async def release(self, request_id: str) -> None:
        """The decode worker has reserved: a gated request's KV may leave."""
        self._release(request_id)

    async def release_many(self, request_ids: list[str]) -> list[None]:
        """``release`` for several requests in one actor call (the router sends a burst's
        releases together: router/dispatch.py ``_Batch``); None each."""
        for request_id in request_ids:
            self._release(request_id)
        return [None] * len(request_ids)

    def _release(self, request_id: str) -> None:
        trace(request_id, "prefill.release")
        gate = self._gates.pop(request_id, None)
        if gate is None:  # overtook its prefill() call: leave it open for that call
            gate = self._gates[request_id] = threading.Event()
        gate.set()

    async def kv_timings(self) -> list[tuple[float, ...]]:
        """(bytes, post lag ms, send ms) of each layer message sent since the last call (NCCL
        backend: CUDA events at the pack, at the send's start and at its end; empty otherwise)."""
        return self.connector.drain_timings()

    def _resolve(self, request_id: str, result: PrefillResult) -> None:
        if isinstance(result, PrefillFailed):
            gate = self._gates.pop(request_id, None)
            if gate is not None:
                gate.set()  # a failed or aborted request must not hold its channel
        entry = self._waiters.pop(request_id, None)
        if entry is not None:
            loop, fut = entry
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    def _on_done(self, request_id: str, token: dict, phases: tuple[float, float, float]) -> None:
        first = token_from_dict(token)
        cached = int(token.get("num_cached_tokens", 0))
        self._resolve(request_id, PrefillDone(first, cached, phases))

    def _on_channel_failure(self, transfer_ids: list[str], reason: str) -> None:
        """From a sender thread: the channel to a decode worker broke."""

        def fail() -> None:
            for tid in transfer_ids:
                self.streamer.transfers.pop(tid, None)
                self.engine.abort_request(tid)
                self.worker.retire(tid)
                self._resolve(tid, PrefillFailed(reason))

        self.worker.post(fail)

    # -- the worker's calls (engine thread; Role has the contract) -------------------------------

    def holds(self) -> dict[str, int]:
        return {"prefills": len(self._waiters), "KV bytes out": self.connector.pending_bytes}

    def abort(self, request_id: str) -> bool:
        """A prefill of ours: still computing (a waiter), or computed and gated (its KV held
        until the decode worker's reservation; the router aborts it when that answered Full),
        or streaming. Its gate opens now, or it would hold the channel's queue until its
        timeout."""
        if not (
            request_id in self._waiters
            or request_id in self._gates
            or request_id in self.streamer.transfers
        ):
            return False
        self.streamer.drop(request_id, "aborted by the caller")
        self.engine.abort_request(request_id)
        self.worker.retire(request_id)
        self._resolve(request_id, PrefillFailed("aborted"))
        return True

    def fail_everything(self, why: str) -> None:
        for rid in list(self._waiters):
            self.abort(rid)

    def stats(self) -> dict[str, Any]:
        return {
            "kv_channels": self.connector.num_channels,
            "kv_bytes_sent": self.connector.bytes_sent,
            "kv_pending_bytes": self.connector.pending_bytes,
        }

    def close(self) -> None:
        self.connector.close()


class PrefillWorker(EngineWorker):
    """The prefill actor: an engine thread and a ``PrefillRole``."""

    role = "prefill"
    length_probe = "auto"

    def __init__(
        self,
        engine_config: dict[str, Any],
        name: str = "",
        *,
        token: str = "",
        max_channels: int = 8,
        index: dict[str, Any] | None = None,
        kv_limits: dict[str, Any] | None = None,
    ) -> None:
        """``kv_limits``: KVLimits fields to change (its queue cap, socket and NCCL timeouts)."""
        super().__init__(engine_config, name, index)
        limits = KVLimits(**(kv_limits or {}))
        self.prefill_role = PrefillRole(self, token=token, max_channels=max_channels, limits=limits)
        self.prefill_role.attach_streamer()
        self.roles = [self.prefill_role]

    prefill = delegate("prefill_role", PrefillRole.prefill)
    release = delegate("prefill_role", PrefillRole.release)
    release_many = delegate("prefill_role", PrefillRole.release_many)
    connect_kv = delegate("prefill_role", PrefillRole.connect_kv)
    kv_timings = delegate("prefill_role", PrefillRole.kv_timings)
