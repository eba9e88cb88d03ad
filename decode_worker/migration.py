"""Live migration of a running request from one decode worker (A) to another (B).

A drives it (``migrate_out``; the controller calls it for the admin API, drain and rebalance).
The KV moves over the same transport as prefill -> decode (NCCL on GPUs, TCP on CPU), on a pair
channel from A to B::

    1. A: the request must be decoding here, one sequence; A snapshots its prompt, parameters
       and output so far
    2. B.migrate_in(...)     B reserves blocks for the request's length now plus headroom and
                             expects its KV (a transfer whose length comes with ``done``), or
                             answers Full at once
    3. copy stages, while the request keeps decoding on A: the first copies every full block
       computed so far, each later one the full blocks added since; a stage ends when its bytes
       have left A, so the next one sees what is really left
    4. last stage, once at most ``last_stage_blocks`` blocks are left (or after ``max_stages``):
       A takes the request out of its running batch after a step (its blocks held), copies the
       rest (the partial block too) and queues ``done`` with the snapshot: every output token
       and how many positions are computed. Its sampler position is its output count, its
       detokenizer and stop strings live in the router: nothing else is needed
    5. B, once every layer is in: the request joins B's running batch; its deltas go to the same
       client, positioned after the snapshot's tokens. ``B.migrate_wait`` tells A
    6. A frees the request's blocks and sends its router a ``moved_to`` delta on the request's
       stream: the router reads B's stream for it from now on. Deltas carry their output
       position, so whichever stream the router reads first, no token is lost or repeated

Failure is a value at every step (``MigrationResult.outcome``):

    B full, dead or refusing (2, 3)     abandoned; A never stopped decoding
    B dead or silent in 4-5             A puts the request back in its batch; B frees its blocks
                                        when the channel drops or its deadline passes
    finished / aborted / preempted      B is told to cancel (it frees); nothing else changes
    A dies                              B's channel drops (or its deadline passes): it frees;
                                        the router resumes the request from its own snapshot

At most ``max_out`` migrations leave and ``max_in`` arrive per worker at a time (1 each).

``MigrationRole`` is both halves, on a worker that also holds a ``DecodeRole``
(decode_worker/decode.py): B's copy arrives through that role's receiver, as a prefill's KV
does, and ends in this role (``_arrived``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from decode_worker.decode import STAGING_FULL, DecodeRole
from decode_worker.migration_config import MigrationConfig
from engine.aio import within
from engine.attention import host_to_device, slot_array
from engine.histogram import Buckets
from engine.kv_transfer import KVConnector, KVLimits, TransferEvent, TransferOutcome, byte_view
from engine.messages import (
    Delta,
    Full,
    MigrationResult,
    Rejected,
    RequestSnapshot,
    Reserved,
    ReserveResult,
    brief,
)
from engine.runtime import EngineWorker, Role
from engine.sampling_params import SamplingParams
from engine.threads import torch_single_threaded

logger = logging.getLogger(__name__)

SLOT_TAKEN = "a migration is already arriving here"
PAUSE_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _Ended(Exception):
    """The request left the migration's hands on A (outcome: finished or preempted)."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome


@dataclass
class _Out:
    """One migration leaving this worker (event loop and engine thread)."""

    request_id: str
    dest: str
    preemptions: int
    capacity: int = 0  # positions B holds room for
    sent: int = 0  # positions [0, sent) queued on the channel
    need: int = 0  # positions the last stage needs room for on B
    failed: str | None = None  # the channel broke (from a sender thread)
    paused_at: float | None = None
    stages: int = 0  # copy stages done (the last one included once it is)
    copy_s: float = 0.0  # seconds the stages before the last one took
    pause_s: float | None = None  # paused until B answered (set once it has)


@dataclass
class _In:
    """One migration arriving (engine thread)."""

    client: str
    source: str
    capacity: int
    result: str | None = None  # "admitted" or why it failed
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)


class MigrationStats:
    """Per-worker counters (in ``stats()['migrations']``, rendered by the gateway's /metrics)."""

    def __init__(self) -> None:
        self.out: Counter[str] = Counter()  # by outcome
        self.into: Counter[str] = Counter()  # by outcome (admitted / failed)
        # completed ones by who asked: admin, drain, rebalance, preemption (a rebalance move
        # from a worker projected past its whole pool)
        self.reasons: Counter[str] = Counter()
        self.bytes = self.tokens = self.stages = 0
        self.pauses = Buckets(PAUSE_BUCKETS)

    def record(self, r: MigrationResult, reason: str) -> None:
        self.out[r.outcome] += 1
        if r.ok:
            self.reasons[reason] += 1
        self.bytes += r.bytes
        self.tokens += r.tokens
        self.stages += r.stages
        if r.ok:
            self.pauses.observe(r.pause_s)

    def as_dict(self, block_size: int) -> dict[str, Any]:
        return {
            "out": dict(self.out),
            "in": dict(self.into),
            "reasons": dict(self.reasons),
            "bytes": self.bytes,
            "blocks": -(-self.tokens // block_size),
            "stages": self.stages,
            "pause_buckets": self.pauses.pairs(),
            "pause_sum": self.pauses.total,
        }


class MigrationRole(Role):
    """Both halves of the protocol, on ``worker``'s engine; the KV arrives through ``decode``'s
    receiver, and leaves through a connector of its own (made on the first migration out)."""

    def __init__(
        self,
        worker: EngineWorker,
        decode: DecodeRole,
        config: MigrationConfig,
        *,
        token: str,
        limits: KVLimits,
    ) -> None:
        super().__init__(worker)
        self.decode = decode
        self.config = config
        self.token = token
        self.kv_limits = limits
        self._connector: KVConnector | None = None  # made on the first migration out
        self._copy_stream: torch.cuda.Stream | None = None  # copy stages' gathers (CUDA)
        self._gather_times: deque = deque(maxlen=256)  # (bytes, start, end events) per chunk
        self._chunk_times: deque = deque(maxlen=256)  # (ms waiting for room, ms to queue it)
        self._stage_times: deque = deque(maxlen=64)  # (ms: snapshot, queuing chunks, draining)
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self._in_done: dict[str, str] = {}  # results kept for a late migrate_wait / cancel
        self.migration_stats = MigrationStats()

    # -- A: the source -----------------------------------------------------------------------

    async def migrate_out(
        self, request_id: str, dest: Any, dest_name: str, reason: str = "admin"
    ) -> MigrationResult:
        """Move ``request_id`` to ``dest`` (a decode worker's actor handle) while it decodes."""
        t0, name = time.monotonic(), self.worker.name
        if len(self._out) >= self.config.max_out or request_id in self._out:
            return MigrationResult(request_id, "busy", name, dest_name, "a migration is out")
        try:
            snap = await self.worker.call(lambda: self._out_begin(request_id, dest_name))
        except ValueError as exc:
            return MigrationResult(request_id, "not_migratable", name, dest_name, str(exc))
        state = self._out[request_id]
        try:
            outcome, why = await self._migrate(state, snap, dest)
        except _Ended as exc:
            outcome, why = exc.outcome, str(exc)
        finally:
            self._out.pop(request_id, None)
        if outcome != "migrated":  # whatever happened, the request decodes here again
            await self.worker.call(lambda: self.engine.resume_paused(request_id))
            if state.capacity:
                await _ask(dest.migrate_cancel, request_id, timeout=self.config.timeout_s,
                           default="unreachable")  # fmt: skip
        pause = time.monotonic() - state.paused_at if state.paused_at is not None else 0.0
        result = MigrationResult(
            request_id,
            outcome,
            name,
            dest_name,
            why,
            stages=state.stages,
            tokens=state.sent,
            bytes=self._copy_bytes(state.sent),
            pause_s=state.pause_s if state.pause_s is not None else pause,
            seconds=time.monotonic() - t0,
            copy_s=state.copy_s,
        )
        self.migration_stats.record(result, reason)
        if outcome != "migrated":
            logger.info("%s: migration of %s to %s: %s (%s)", name, request_id, dest_name,
                        outcome, why)  # fmt: skip
        return result

    async def _migrate(self, state: _Out, snap: RequestSnapshot, dest: Any) -> tuple[str, str]:
        cfg, bs = self.config, self.engine.cfg.block_size
        reserve = snap.num_tokens + cfg.headroom_blocks * bs
        try:
            res = await _ask(
                dest.migrate_in,
                state.request_id,
                snap.prompt_token_ids,
                snap.params,
                snap.client,
                output_token_ids=snap.output_token_ids,
                reserve_tokens=reserve,
                source=self.worker.name,
                priority=snap.priority,
                cache_salt=snap.cache_salt,
                timeout=cfg.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - B died or did not answer
            return "dest_failed", f"reserve failed: {brief(exc)}"
        if isinstance(res, Full):
            return ("busy" if res.reason == SLOT_TAKEN else "dest_full"), res.reason
        if isinstance(res, Rejected):
            return "dest_failed", f"refused: {res.message}"
        state.capacity = -(-reserve // bs) * bs
        sender = self._sender(res.endpoint)
        while True:
            last = state.stages >= cfg.max_stages
            upto = await self.worker.call(lambda last=last: self._out_plan(state, last))
            if upto is None:
                break  # few enough left: the last stage
            t0 = time.monotonic()
            snapshot_s = await self._copy(state, sender, upto)
            t1 = time.monotonic()
            state.stages += 1
            await self._drained(state, sender)
            t2 = time.monotonic()
            state.copy_s += t2 - t0
            self._stage_times.append(
                (snapshot_s * 1e3, (t1 - t0 - snapshot_s) * 1e3, (t2 - t1) * 1e3)
            )
        # The last stage: pause, copy the rest, done with the snapshot.
        while (step := await self.worker.call(lambda: self._out_last(state, sender))) != "done":
            if step == "grow":  # it outgrew its room on B: ask for more, still decoding
                want = state.need + cfg.headroom_blocks * bs
                grown = await _ask(dest.migrate_grow, state.request_id, want,
                                   timeout=cfg.timeout_s, default=0)  # fmt: skip
                if not grown:
                    return "dest_full", f"no room for {state.need} positions"
                state.capacity = grown
            else:
                await self._pace(state, sender)  # (a long rest: copied in chunks, still paused)
        state.stages += 1
        try:
            answer = await _ask(dest.migrate_wait, state.request_id, timeout=cfg.timeout_s)
        except Exception as exc:  # noqa: BLE001 - dead or silent: did it take the request?
            answer = await _ask(dest.migrate_cancel, state.request_id, timeout=cfg.timeout_s,
                                default=f"unreachable: {brief(exc)}")  # fmt: skip
        state.pause_s = time.monotonic() - (state.paused_at or time.monotonic())
        if answer == "admitted":
            still_here = await self.worker.call(lambda: self._out_finish(state))
            if not still_here:  # aborted while paused: B runs it for nobody
                await _ask(dest.abort, state.request_id, timeout=cfg.timeout_s, default=None)
                return "finished", "aborted during the migration"
            return "migrated", ""
        return "dest_failed", str(answer)

    def _out_begin(self, request_id: str, dest: str) -> RequestSnapshot:
        """Engine thread: check and snapshot the request; registers the migration."""
        request = self.engine.migratable(request_id)
        tracked = self.worker.requests.get(request_id)
        if tracked is None or not tracked.client:
            raise ValueError(f"request {request_id!r} has no stream here")
        client = tracked.client
        self._out[request_id] = _Out(request_id, dest, request.num_preemptions)
        return RequestSnapshot(
            request_id,
            list(request.prompt_token_ids),
            list(request.output_token_ids),
            request.params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            client=client,
        )

    def _out_request(self, state: _Out):
        """Engine thread: the request, still decoding here with its KV, or _Ended."""
        if state.failed is not None:
            raise _Ended("dest_failed", state.failed)
        request = self.engine.single_request(state.request_id)
        if request is None:
            raise _Ended("finished", "the request finished during the migration")
        if request.num_preemptions != state.preemptions or request.is_finished:
            raise _Ended("preempted", "preempted on the source during the migration")
        return request

    def _out_plan(self, state: _Out, last: bool) -> int | None:
        """Engine thread: the end of the next copy stage (full blocks computed), or None when
        the last stage comes next."""
        request = self._out_request(state)
        bs = self.engine.cfg.block_size
        full = request.num_computed_tokens // bs * bs
        left = request.num_computed_tokens - state.sent
        if last or left <= self.config.last_stage_blocks * bs or full <= state.sent:
            return None
        return min(full, state.capacity)

    async def _copy(self, state: _Out, sender, upto: int) -> float:
        """Copy positions ``[sent, upto)``: full blocks, which no later step writes. Their
        block table, and an event after every step queued so far, are taken on the engine
        thread once per stage; the chunks are gathered off it (on CUDA on a stream of their
        own, behind that event) as fast as the channel takes them, never waiting for a step
        boundary. A request that ends meanwhile is caught by the next engine-thread check; what
        was gathered for it goes to a transfer B then cancels. Returns the seconds the snapshot
        waited for the engine thread."""
        t0 = time.monotonic()
        table, ready = await self.worker.call(lambda: self._out_table(state))
        snapshot_s = time.monotonic() - t0
        while state.sent < upto:
            t0 = time.monotonic()
            await self._pace(state, sender)
            t1 = time.monotonic()
            end = min(upto, state.sent + self.config.chunk_tokens)
            if self.engine.runner.tp is not None:  # the ranks gather on the engine thread
                await self.worker.call(partial(self._gather, state, sender, table, end))
            else:
                await asyncio.to_thread(self._gather_beside, state, sender, table, ready, end)
            self._chunk_times.append(((t1 - t0) * 1e3, (time.monotonic() - t1) * 1e3))
        return snapshot_s

    def _out_table(self, state: _Out) -> tuple[list[int], torch.cuda.Event | None]:
        """Engine thread: the request's block table and (CUDA) an event after its queued steps."""
        self._out_request(state)
        table = list(self.engine.block_manager.block_table(state.request_id))
        if self.engine.runner.kv_caches[0].device.type != "cuda":
            return table, None  # the CPU engine's steps are done when the engine thread is here
        ready = torch.cuda.Event()
        ready.record()
        return table, ready

    def _gather_beside(self, state: _Out, sender, table, ready, end: int) -> None:
        """A worker thread: gather and queue ``[sent, end)`` behind ``ready`` on the copy stream."""
        if ready is None:
            torch_single_threaded()  # on CPU: no second OpenMP team (engine/threads.py)
            return self._gather(state, sender, table, end)
        device = self.engine.runner.kv_caches[0].device
        with torch.cuda.device(device):
            if self._copy_stream is None:  # highest priority, as the pair streams: its gathers
                self._copy_stream = torch.cuda.Stream(device, priority=-100)  # take SMs first
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(ready)
                start, stop = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                nbytes = self._copy_bytes(end - state.sent)
                start.record()
                self._gather(state, sender, table, end)
                stop.record()
                self._gather_times.append((nbytes, start, stop))

    def _gather(self, state: _Out, sender, table: list[int], end: int) -> None:
        """Queue positions ``[sent, end)``, every layer, as one message. Under tensor
        parallelism every rank's heads, gathered to rank 0 (on the engine thread)."""
        if end <= state.sent:
            return
        entries = [(state.request_id, state.sent, end - state.sent)]
        runner = self.engine.runner
        if runner.tp is not None:
            sender.send_layers(0, entries, runner.read_kv_tokens(table, state.sent, end))
            state.sent = end
            return
        bs = self.engine.cfg.block_size
        caches = runner.kv_caches
        index = host_to_device(slot_array(table, state.sent, end, bs), caches[0].device)
        c0 = caches[0]
        stacked = c0.new_empty((len(caches), c0.shape[0], c0.shape[1], len(index), c0.shape[3]))
        for layer, cache in enumerate(caches):  # every layer of the chunk: one message
            torch.index_select(byte_view(cache), 2, index, out=byte_view(stacked[layer]))
        sender.send_layers(0, entries, stacked)
        state.sent = end

    def _out_last(self, state: _Out, sender) -> str:
        """Engine thread: pause the request (once) and queue the next chunk of what is left:
        "done" once ``done`` is queued, "more" while chunks are left, "grow" (not paused) when
        the request needs more room on B first."""
        request = self._out_request(state) if state.paused_at is None else None
        if request is not None:
            if request.num_computed_tokens > state.capacity:
                state.need = request.num_computed_tokens
                return "grow"
            # A step still running may hold the request's last token: its outputs go out now,
            # before the request can be handed over (pause waits for that step).
            self.worker.emit(self.engine.drain())
            try:
                self.engine.pause(state.request_id)
            except ValueError as exc:
                raise _Ended("preempted", str(exc)) from None
            state.paused_at = time.monotonic()
        if state.failed is not None:
            raise _Ended("dest_failed", state.failed)
        request = self.engine.paused_request(state.request_id)
        if request is None:  # aborted while paused
            raise _Ended("finished", "aborted during the migration")
        computed = request.num_computed_tokens
        table = self.engine.block_manager.block_table(state.request_id)
        self._gather(state, sender, table, min(computed, state.sent + self.config.chunk_tokens))
        if state.sent < computed:
            return "more"
        token = {
            "token_id": request.output_token_ids[-1],
            "num_cached_tokens": max(request.num_cached_tokens, 0),
            "output_token_ids": list(request.output_token_ids),
            "num_computed": computed,
        }
        if not sender.send_done(state.request_id, computed, token):
            raise _Ended("dest_failed", "the channel refused the copy (queue full)")
        return "done"

    def _out_finish(self, state: _Out) -> bool:
        """Engine thread: B runs the request now; free it here and point its router at B.
        False when it was aborted meanwhile."""
        rid = state.request_id
        request = self.engine.paused_request(rid)
        if request is None:
            return False
        tracked = self.worker.retire(rid)
        client = tracked.client if tracked is not None else ""
        self.engine.release_paused(rid)
        if client:
            moved = Delta(rid, start=request.num_output_tokens, moved_to=state.dest)
            self.worker.send(client, [moved])
        return True

    def _sender(self, endpoint: str):
        if self._connector is None:
            self._connector = KVConnector(
                self.worker.kv_spec(), self._on_out_failure, token=self.token, limits=self.kv_limits
            )
        return self._connector.sender(endpoint)

    def _on_out_failure(self, transfer_ids: list[str], reason: str) -> None:
        """From a sender thread: the channel to B broke (or refused a layer)."""
        for tid in transfer_ids:
            state = self._out.get(tid)
            if state is not None:
                state.failed = reason

    def _copy_bytes(self, positions: int) -> int:
        """KV bytes of ``positions`` token positions, every layer."""
        spec = self.worker.kv_spec()
        return spec.payload_bytes(positions) * spec.num_layers

    async def _pace(self, state: _Out, sender) -> None:
        """Wait until the channel has room for another chunk (bounded by timeout_s)."""
        limit = self._copy_bytes(self.config.chunk_tokens) * self.config.chunks_ahead
        await self._wait_channel(state, sender, lambda: sender.pending_bytes <= limit)

    async def _drained(self, state: _Out, sender) -> None:
        await self._wait_channel(state, sender, lambda: sender.pending_bytes == 0)

    async def _wait_channel(self, state: _Out, sender, ok) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        delay = 0.0002  # a chunk leaves in ~2 ms on NVLink: a coarser poll would pace the copy
        while not ok():
            if state.failed is not None or sender.error is not None:
                raise _Ended("dest_failed", state.failed or sender.error)
            if time.monotonic() > deadline:
                raise _Ended("dest_failed", f"KV copy stalled for {self.config.timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.001)

    # -- B: the destination ------------------------------------------------------------------

    async def migration_timings(self) -> dict[str, list]:
        """Where the copy stages' time went since the last call: ``stages`` (ms of the stage's
        snapshot call on the engine thread, ms queuing its chunks, ms until the channel drained),
        ``chunks`` (ms waiting for room on the channel, ms gathering and queuing), ``gather``
        (bytes, ms on the copy stream), ``send`` (bytes, ms from the gather's end to the send's start, ms of
        the send: the NCCL channel's own timings)."""
        gathers, self._gather_times = list(self._gather_times), deque(maxlen=256)
        chunks, self._chunk_times = list(self._chunk_times), deque(maxlen=256)
        stages, self._stage_times = list(self._stage_times), deque(maxlen=64)
        return {
            "stages": stages,
            "chunks": chunks,
            "gather": [(n, a.elapsed_time(b)) for n, a, b in gathers if b.query()],
            "send": self._connector.drain_timings() if self._connector is not None else [],
        }

    async def migrate_in(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        client: str,
        *,
        output_token_ids: list[int],
        reserve_tokens: int,
        source: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> ReserveResult:
        """Hold room for a request migrating in from ``source`` (step 2)."""

        def reserve() -> ReserveResult:
            if len(self._in) >= self.config.max_in:
                return Full(SLOT_TAKEN)
            if not self.decode.staging_room(
                max(len(prompt) + len(output_token_ids), reserve_tokens)
            ):
                return Full(STAGING_FULL)
            try:
                table = self.engine.reserve_remote(
                    request_id,
                    prompt,
                    params,
                    output_token_ids=output_token_ids,
                    reserve_tokens=reserve_tokens,
                    priority=priority,
                    cache_salt=cache_salt,
                )
            except ValueError as exc:
                return Rejected(str(exc))
            if table is None:
                return Full()
            capacity = len(table) * self.engine.cfg.block_size
            deadline = time.monotonic() + self.config.timeout_s
            self.decode.expect(
                request_id, table, capacity, deadline, exact=False, on_end=self._arrived
            )
            self._in[request_id] = _In(client, source, capacity)
            self._in_done.pop(request_id, None)
            return Reserved(self.decode.receiver.endpoint)

        return await self.worker.call(reserve)

    async def migrate_grow(self, request_id: str, num_tokens: int) -> int:
        """Room for ``num_tokens`` positions: the new capacity, or 0 when it does not fit."""

        def grow() -> int:
            incoming = self._in.get(request_id)
            if incoming is None or incoming.result is not None:
                return 0
            table = self.engine.grow_remote(request_id, num_tokens)
            if table is None:
                return 0
            capacity = len(table) * self.engine.cfg.block_size
            if not self.decode.extend(request_id, table, capacity):
                return 0
            incoming.capacity = capacity
            return capacity

        return await self.worker.call(grow)

    async def migrate_wait(self, request_id: str) -> str:
        """ "admitted" once the request runs here (step 5), else why it failed."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wait() -> None:
            incoming = self._in.get(request_id)
            if incoming is None:
                result = self._in_done.get(request_id, "no such migration here")
                loop.call_soon_threadsafe(_resolve, fut, result)
            else:
                incoming.waiters.append((loop, fut))

        self.worker.post(wait)
        return await fut

    async def migrate_cancel(self, request_id: str) -> str:
        """The source gives up: free what is held. Returns "admitted" when it is too late (the
        request runs here), else "cancelled"."""

        def cancel() -> str:
            if self._in_done.get(request_id) == "admitted":
                return "admitted"
            if request_id in self._in:
                self.decode.cancel(request_id, "cancelled by the source")
            return "cancelled"

        return await self.worker.call(cancel)

    def _arrived(self, event: TransferEvent, cancelled: str | None) -> None:
        """Engine thread: a migration's transfer ended (step 5, or its failure); the decode
        role's receiver event, handed on by its ``Arrival``."""
        rid = event.transfer_id
        incoming = self._in.pop(rid)
        result = None
        if event.kind is TransferOutcome.COMPLETE and cancelled is None:
            token = event.token or {}
            try:
                outputs = [int(t) for t in token["output_token_ids"]]
                self.engine.admit_migrated(
                    rid, outputs, int(token["num_computed"]), int(token.get("num_cached_tokens", 0))
                )
            except (KeyError, TypeError, ValueError) as exc:
                result = f"bad migration snapshot: {exc}"
            else:
                result = "admitted"
                self.worker.register(rid, incoming.client)
        if result != "admitted":
            self.engine.abort_request(rid)  # frees the reservation; nothing goes to the client
            result = result or event.reason or cancelled or "cancelled"
        self.migration_stats.into["admitted" if result == "admitted" else "failed"] += 1
        self._in_done[rid] = result
        while len(self._in_done) > 1024:
            self._in_done.pop(next(iter(self._in_done)))
        for loop, fut in incoming.waiters:
            loop.call_soon_threadsafe(_resolve, fut, result)

    async def migration_candidates(self) -> list[dict[str, Any]]:
        """Every request streaming from here, with its length and what it may still need."""
        return await self.worker.call(self.candidates)

    def candidates(self) -> list[dict[str, Any]]:
        """Engine thread: every request here, for drain and rebalance to pick from."""
        out = []
        for rid, tracked in list(self.worker.requests.items()):
            if not tracked.client:
                continue
            request = self.engine.single_request(rid)
            if request is None:
                continue
            max_tokens = request.params.max_tokens or self.engine.max_model_len
            produced = request.num_output_tokens
            remaining = max(0, max_tokens - produced)
            predicted = tracked.predicted
            if predicted is not None and predicted > produced:  # past it: max_tokens again
                remaining = min(remaining, predicted - produced)
            out.append(
                {
                    "request_id": rid,
                    "num_tokens": request.num_tokens,
                    "remaining": remaining,
                    "decoding": self.engine.not_decoding(rid) is None,
                    "migrating": rid in self._out,
                    "block_size": self.engine.cfg.block_size,
                }
            )
        return out

    def _projected_blocks(self) -> int:
        """Blocks in use plus what the running requests will still need to finish (by the
        router's predicted length while they are short of it, else by their max_tokens; a
        request without one is counted to the context limit)."""
        bm, engine = self.engine.block_manager, self.engine
        need = 0
        for c in self.candidates():
            end = min(c["num_tokens"] + c["remaining"], engine.max_model_len)
            need += bm.blocks_needed(end) - bm.blocks_needed(c["num_tokens"])
        return bm.num_blocks - bm.num_free_blocks + need

    # -- the worker's calls (engine thread; Role has the contract) -------------------------------

    def holds(self) -> dict[str, int]:
        return {"migrations": len(self._out) + len(self._in)}

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        if self._connector is not None:
            stats["kv_bytes_sent"] = self._connector.bytes_sent
        stats["migrations"] = self.migration_stats.as_dict(self.engine.cfg.block_size)
        stats["migrating"] = {"out": len(self._out), "in": len(self._in)}
        stats["projected_blocks"] = self._projected_blocks()
        return stats

    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()


_RAISE = object()


async def _ask(method: Any, *args: Any, timeout: float, default: Any = _RAISE, **kwargs) -> Any:
    """Call another actor's method within ``timeout`` (``default`` given: on any failure,
    return it instead of raising)."""
    try:
        return await within(method.remote(*args, **kwargs), timeout)
    except Exception:
        if default is _RAISE:
            raise
        return default


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


__all__ = ["PAUSE_BUCKETS", "MigrationConfig", "MigrationRole", "MigrationStats"]
