"""What every worker role shares: one engine, one thread that owns it, batched delta streams.

The engine is plain single-threaded code, so exactly one thread touches it: the *engine
thread*. Everything else (Ray method calls on the actor's event loop, KV receiver threads,
KV sender threads) hands it work through one queue, the inbox, and gets results back as
asyncio futures on the actor's event loop. When the engine has nothing to compute the thread
blocks on the inbox, so an idle worker burns no CPU and a new request wakes it at once.

Outputs leave as one message per engine step per *client* (a router process), never one per
token and never cumulative, on a socket of their own (engine/output_stream.py)::

    engine thread, each step                                         router's event loop
    ────────────────────────                                         ───────────────────
    deltas of the step's requests ──► streams.offer(client, deltas) ──► one msgpack frame,
    grouped by their client            merged into the client's channel,  StreamBatch(deltas)
                                       written at once when its socket    (empty: a heartbeat,
                                       can take it                        from the event loop)

A channel holds what its reader has not taken yet, merged per sequence: a router that falls
behind gets fewer, larger batches (``coalesced`` counts the merged steps), never an unbounded
queue of messages, and what is held is bounded by the tokens its running requests produce.
When a router's reader goes away and none comes back within ``orphan_grace_s``, that router's
requests are aborted (their blocks are freed). ``outputs(client)`` reads the same stream
in-process (tests) or as a Ray generator.

With a global prefix index (engine.prefix_index), the engine thread hands the publisher each
tier's block-stored / block-evicted hashes after every step (the device pool's, and the host and
disk tiers' below it), and at start what the tiers hold already (the disk files found); while
disk writes are in flight an idle thread wakes every ``TIER_EVENTS_S`` to hand theirs over too.

A worker actor is an ``EngineWorker`` (the thread, the inbox, the channels, one ``Tracked``
record per request) plus a list of ``Role`` components: prefill (prefill_worker/), decode and
migration (decode_worker/). Its abort, tick, stats, fault handling and shutdown loop over the
roles in one place each; its public methods are its roles' own (``delegate``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import os
import queue
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.messages import Delta, StreamBatch, aborted
from engine.output_stream import OutputStreams
from engine.parallel import RankFailure
from engine.tp_ranks import LocalRanks, RayRanks
from engine.tracing import StallWatch, trace

logger = logging.getLogger(__name__)

__all__ = ["EngineWorker", "Role", "Tracked", "delegate"]

LATENCY_WINDOW = 256  # latency samples a worker keeps (its stats() report their p50 / p99)
# stats()["latency_recent"]: the kept samples of the last this many seconds only (the
# autoscaler's view: a worker that has gone quiet has no recent latency, not its old one)
LATENCY_RECENT_S = 30.0
# The idle engine thread wakes this often while disk writes are in flight, to publish their
# block events (engine.prefix_index)
TIER_EVENTS_S = 0.05
IDLE_TAIL_S = 2.0  # check_idle waits this long for a step in flight after the last request
SHUTDOWN_JOIN_S = 10.0  # how long shutdown waits for the engine thread's step to end


@dataclass
class Tracked:
    """What a worker keeps of one request beside its engine's own state, from ``register``
    to ``retire``: where its deltas go, when it arrived (until its first token: the TTFT),
    and the router's estimate of its output (a decode worker's projections)."""

    client: str  # "": not streamed (a prefill worker's request: the call returns its token)
    arrived: float | None  # monotonic, until its first token
    predicted: int | None = None


class Role:
    """One job a worker does with its engine (prefill, decode, migration): a component the
    worker holds in ``worker.roles``, never a base class of it. It reaches the engine thread,
    the inbox and the output channels through ``self.worker`` (``call``, ``post``,
    ``register``, ``retire``, ``emit``, ``fail``, ``send``). The worker asks each of its roles
    in their order, every method but ``close`` on the engine thread; the defaults do nothing,
    a role overrides what it has."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.engine = worker.engine

    def holds(self) -> dict[str, int]:
        """What this role holds now that a role switch must wait for, counted by kind
        (``{"prefills": 2}``); every count 0: idle."""
        return {}

    def abort(self, request_id: str) -> bool:
        """End ``request_id`` if this role holds it. True: it did, and no later role is asked;
        when no role claims it the worker aborts it in its engine."""
        return False

    def tick(self) -> float | None:
        """The engine loop's periodic hook (deadlines), once per loop iteration. Returns the
        monotonic time it next needs to run even if no work comes (None: not before work
        comes); the earliest of its roles' bounds how long the idle engine thread blocks."""
        return None

    def stats(self) -> dict[str, Any]:
        """Its entries of the worker's ``stats()``. A key two roles of one worker report is a
        counter the worker adds up (``kv_bytes_sent``: prefill streaming and migration)."""
        return {}

    def fail_everything(self, why: str) -> None:
        """An engine fault that is not one request's: end what only this role knows of (the
        worker then fails every request it tracks). ``why`` names the logged error id."""

    def close(self) -> None:
        """Shutdown (any thread): close this role's sockets and channels."""


def delegate(role: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """An actor method that awaits ``method`` on the worker's ``role`` attribute: the actor
    keeps the role's public call by name, signature and docstring (Ray reads the signature
    through ``functools.wraps``), the role keeps the code::

        class PrefillWorker(EngineWorker):
            prefill = delegate("prefill_role", PrefillRole.prefill)
    """

    @functools.wraps(method)
    async def call_role(self: EngineWorker, *args: Any, **kwargs: Any) -> Any:
        return await method(getattr(self, role), *args, **kwargs)

    return call_role


class EngineWorker:
    """The engine thread of a worker actor and its roles: base of PrefillWorker, DecodeWorker,
    ColocatedWorker and FlexWorker (plain classes: the controller wraps them in
    ``ray.remote``; tests may also use them in-process). A subclass builds its roles after
    this constructor (the engine exists, its thread has not started) into ``self.roles``."""

    role = "engine"
    # The engine's length probe when the config names none: roles that prefill new prompts
    # refine the router's length estimate with the shipped probe ("auto"); decode needs none.
    length_probe: str | None = None

    def __init__(
        self, engine_config: dict[str, Any], name: str = "", index: dict[str, Any] | None = None
    ) -> None:
        """``index``: ``{"url", "namespace", "worker"}`` of the global prefix index (Redis); when
        given, the blocks this worker caches and evicts are published there as ``worker``."""
        # Ray gives an actor with num_cpus=1 one OpenMP thread; on CPU the launcher hands each
        # worker its share of the node's cores instead (TANDEM_TORCH_THREADS overrides).
        engine_config = {"length_probe": self.length_probe, **engine_config}
        threads = engine_config.pop("cpu_threads", None)
        threads = os.environ.get("TANDEM_TORCH_THREADS") or threads
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        self.name = name or self.role
        # Tensor parallelism: a worker actor's other ranks are Ray actors of its placement
        # group (cluster/control/spawn.py); a worker built in-process starts child processes.
        self._in_placement_group = _in_placement_group()
        ranks = RayRanks if self._in_placement_group else LocalRanks
        self._closed = False
        # The engine thread exists from here: the engine is built on it, as every later call
        # into the engine runs there. On CPU that keeps the process to one OpenMP thread team:
        # a second team (torch work on the actor's main thread, then steps on this one) puts
        # more OpenMP threads than cores under libgomp, which then sleeps its workers between
        # parallel regions, and a 135M model's decode step took 1.5x as long (NOTES, "The CPU
        # served gap, found").
        self._boot: queue.SimpleQueue = queue.SimpleQueue()  # its work before ``start()``
        self._started = False
        self._thread = threading.Thread(
            target=self._main, name=f"{name or self.role}-engine", daemon=True
        )
        self._thread.start()
        try:
            # Workers stream token ids; the router detokenizes (and checks stop strings).
            config = EngineConfig(**{**engine_config, "detokenize": False})
            self.engine = self.on_engine_thread(lambda: LLMEngine(config, ranks))
        except BaseException:
            self._closed = True
            self._boot.put(None)
            raise
        self.engine.output_kind = "delta"
        self.engine.on_rank_failure = self._rank_failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # What this worker keeps per request beside the engine (engine thread only).
        self.requests: dict[str, Tracked] = {}
        self.roles: list[Role] = []  # its subclass's, in the order they are asked
        self._wake_at: float | None = None  # the earliest time a role's tick asked for
        # client -> its stream of deltas (engine/output_stream.py): a socket per router
        self.streams = OutputStreams(self.name, self._step_age, self._orphaned)
        self.steps = 0
        self._step_started: float | None = None  # monotonic start of the step running now
        # Latency, as this worker sees it (stats()["latency"]): the time between two engine
        # steps in a row (a decode step gives every running request a token: the inter-token
        # latency), and from a request's arrival here to its first token (TTFT here); each
        # sample is (monotonic time it was taken, seconds).
        self._step_gaps: deque[tuple[float, float]] = deque(maxlen=LATENCY_WINDOW)
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=LATENCY_WINDOW)
        self._publisher = None
        if index is not None:
            from engine.prefix_index import IndexPublisher, PrefixIndex

            self._publisher = IndexPublisher(
                PrefixIndex(index["url"], index["namespace"]), index["worker"]
            )
            self.engine.block_manager.record_events = True
            if self.engine.tiers is not None:  # what the tiers hold now: the disk files found
                held = self.engine.tiers.record_events()
                for tier in ("host", "disk"):
                    self._publisher.push([h for t, h in held if t == tier], [], tier)
        # The engine thread's loop starts with ``start()`` once every role is built
        # (``ready()`` calls it: the first call the controller makes), so no constructor races
        # it.

    def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Before ``start()``: run ``fn`` on the engine thread and return what it returns (or
        raise what it raised). For construction that does torch work (the engine, a role's
        buffers), so one thread does all of it."""
        if self._started:
            raise RuntimeError("on_engine_thread is for construction, before start()")
        done: Future = Future()

        def job() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

        self._boot.put(job)
        return done.result()

    def start(self) -> None:
        """Start the engine thread's loop (once; later calls do nothing). In a worker actor's
        process, the heap built so far is frozen first (``freeze_startup_heap``)."""
        if not self._started and not self._closed:
            self._started = True
            if _in_ray_actor():
                freeze_startup_heap()
            self._boot.put(None)

    def _main(self) -> None:
        """The engine thread: construction work until ``start()`` (or ``shutdown()``), then
        the loop."""
        while (job := self._boot.get()) is not None:
            job()
        if not self._closed:
            self._run()

    def kv_spec(self):
        """This worker's per-layer KV shape, KV cache dtype and block size, as pair channels
        (prefill to decode, migration) compare them: every KV head of the model, at any
        tensor-parallel size (rank 0 gathers and scatters the ranks' slices), so workers of
        different TP sizes pair."""
        from engine.kv_transfer import KVSpec

        mc, cfg = self.engine.model_config, self.engine.cfg
        return KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.kv_dtype, cfg.block_size)

    # -- the engine thread -----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self.engine.has_work()

    def _wait_timeout(self) -> float | None:
        """How long the idle engine thread may block (None: until the inbox has something).
        While disk writes are in flight, ``TIER_EVENTS_S`` at most: their events (a file
        stored, an older one evicted) reach the prefix index without waiting for a step."""
        wait = None if self._wake_at is None else max(0.0, self._wake_at - time.monotonic())
        tiers = self.engine.tiers
        if self._publisher is not None and tiers is not None and tiers.writes_pending:
            wait = TIER_EVENTS_S if wait is None else min(wait, TIER_EVENTS_S)
        return wait

    def _run(self) -> None:
        last_end: float | None = None  # the previous step's end, while steps follow each other
        watch = StallWatch(self.name)  # TANDEM_TRACE=1: where this loop is when it stalls
        while not self._closed:
            try:
                idle = not self._has_work()
                if idle:
                    watch.idle()
                self._drain_inbox(block=idle)
                watch.beat()
                if idle:
                    last_end = None
                self._tick()
                if self._has_work():
                    start = self._step_started = time.monotonic()
                    deltas = self.engine.step()
                    end = time.monotonic()
                    self._step_started = None
                    self._step_gaps.append((end, end - (start if last_end is None else last_end)))
                    last_end = end
                    self.steps += 1
                    self.emit(deltas)
                self._publish_blocks()
            except Exception as exc:  # noqa: BLE001 - a bug must not kill the thread silently
                if isinstance(exc, RankFailure):
                    self._rank_failed(str(exc))
                self._step_started = None
                error_id = secrets.token_hex(4)
                logger.error(
                    "engine thread of %s (error id %s):\n%s",
                    self.name,
                    error_id,
                    traceback.format_exc(),
                )
                self._fail_everything(f"{type(exc).__name__}, error id {error_id}")
                time.sleep(0.1)  # a persistent fault must not flood the log
        watch.stop()

    def _rank_failed(self, why: str) -> None:
        """A tensor-parallel rank of this worker is gone: the worker cannot step again. As an
        actor it ends its process, so Ray, the controller and the routers see it dead and its
        requests resume on other workers (their snapshots: prompt and tokens so far); built
        in-process, its requests fail (the engine refuses every step from now on)."""
        logger.critical("worker %s: %s; the worker ends", self.name, why)
        if self._in_placement_group:
            os._exit(1)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = (
                self._inbox.get(timeout=self._wait_timeout()) if block else self._inbox.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish_blocks(self) -> None:
        """Hand the block-stored / block-evicted hashes of every tier (the device pool's, and
        the host and disk tiers' below it) to the index publisher, after each step and each
        idle wake (its own thread talks to Redis; this never blocks or raises)."""
        if self._publisher is None:
            return
        try:
            stored, evicted = self.engine.block_manager.drain_events()
            self._publisher.push(stored, evicted, "device")
            if self.engine.tiers is not None:
                for tier, (stored, evicted) in self.engine.tiers.drain_events().items():
                    self._publisher.push(stored, evicted, tier)
        except Exception:  # noqa: BLE001 - the index is a hint: never fail the engine for it
            logger.exception("publishing block events of %s failed", self.name)

    def _tick(self) -> None:
        """Engine thread, once per loop iteration: every role's tick (deadlines); the earliest
        time one asks to run again bounds the next idle wait."""
        wakes = [t for t in (role.tick() for role in self.roles) if t is not None]
        self._wake_at = min(wakes, default=None)

    def register(self, request_id: str, client: str) -> Tracked:
        """Engine thread: start keeping ``request_id``: its deltas go to ``client``'s channel
        ("": nowhere); its first token's delay is counted from now (the TTFT in ``stats()``).
        Retired by ``retire`` when it ends, whichever way."""
        tracked = self.requests[request_id] = Tracked(client, time.monotonic())
        trace(request_id, "worker.added")
        return tracked

    def retire(self, request_id: str) -> Tracked | None:
        """Engine thread: forget ``request_id`` (it ended here, or continues elsewhere)."""
        return self.requests.pop(request_id, None)

    def _streams(self) -> dict[str, str]:
        """Request id -> client of every request whose deltas go to a client."""
        return {rid: t.client for rid, t in self.requests.items() if t.client}

    def emit(self, deltas: list[Delta]) -> None:
        """Engine thread: hand a step's deltas to the event loop, grouped by client, in one
        call (the channels and their readers live there)."""
        if not deltas:
            return
        now = time.monotonic()
        by_client: dict[str, list[Delta]] = {}
        ended: set[str] = set()
        for d in deltas:
            tracked = self.requests.get(d.request_id)
            if tracked is None:
                continue
            if tracked.arrived is not None and (d.token_ids or d.finished):
                if d.token_ids and d.start == 0:  # (continued from elsewhere: no TTFT here)
                    self._ttfts.append((now, now - tracked.arrived))
                    trace(d.request_id, "worker.first_token")
                tracked.arrived = None
            if tracked.client:
                by_client.setdefault(tracked.client, []).append(d)
            if d.finished and self._all_finished(d):
                ended.add(d.request_id)
        # retired only after the whole step: the n sequences of a request that end in one
        # step each have a delta here, and the first one's end must not drop the others
        for rid in ended:
            self.retire(rid)
        for client, batch in by_client.items():
            self.streams.offer(client, batch)

    def send(self, client: str, deltas: list[Delta]) -> None:
        """Engine thread: hand ``deltas`` to ``client``'s stream as they are (for a request
        no longer tracked here: a migration's ``moved_to``)."""
        self.streams.offer(client, deltas)

    def _all_finished(self, delta: Delta) -> bool:
        return delta.error is not None or not self.engine.has_request(delta.request_id)

    def fail(self, request_id: str, message: str, retryable: bool = False) -> None:
        """Engine thread: end a request's stream with an error."""
        self.emit([Delta(request_id, error=message, retryable=retryable)])
        self.retire(request_id)

    def _fail_everything(self, message: str) -> None:
        """Last resort after an engine fault that is not one request's (the engine isolates
        those: LLMEngine._isolate): every role ends what only it knows of, then every request
        tracked here ends with an error. ``message`` names the error id the traceback is logged
        under; no traceback goes to a client."""
        for role in self.roles:
            role.fail_everything(message)
        for rid in list(self.requests):
            self.engine.abort_request(rid)
            self.fail(rid, f"engine failure in {self.name}: {message}")

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the engine thread (from any thread)."""
        self._inbox.put(fn)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the engine thread and await its result (or exception), on the calling
        event loop (the request group's or the control group's)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self.post(run)
        return await fut

    async def add_requests(
        self, items: list[tuple[str, list[int], Any, dict[str, Any]]], client: str = ""
    ) -> list[tuple[str, str] | None]:
        """Queue whole requests here, prefill and decode, ``(request_id, prompt, params,
        kwargs)`` each, in one hop to the engine thread (the colocated worker's
        ``generate_many``, and a decode worker's for the short turns it prefills itself). Per
        request, None (queued) or why not: ``("invalid", message)`` for bad input, ``("failed",
        message)`` for anything else, so one request's problem is never another's."""
        for request_id, *_ in items:
            trace(request_id, "worker.called")

        def add() -> list[tuple[str, str] | None]:
            out: list[tuple[str, str] | None] = []
            for request_id, prompt, params, kwargs in items:
                try:
                    self.engine.add_request(request_id, prompt, params, **kwargs)
                    self.register(request_id, client)
                except ValueError as exc:
                    out.append(("invalid", str(exc) or "invalid request"))
                except Exception as exc:  # noqa: BLE001 - that request's, reported to its caller
                    out.append(("failed", f"{type(exc).__name__}: {exc}"))
                else:
                    out.append(None)
            return out

        return await self.call(add)

    # -- the stream of outputs -------------------------------------------------------------------

    async def stream_endpoint(self, peer_ip: str = "") -> tuple[str, int, str]:
        """(host, port, token) where a router on node ``peer_ip`` reads its output stream
        (engine/output_stream.py: one socket per router, written by the engine thread)."""
        own = _ray_node().get("node_ip", "127.0.0.1")
        return await self.streams.endpoint(peer_ip, own)

    async def outputs(self, client: str) -> AsyncIterator[StreamBatch]:
        """``client``'s stream read in-process (or as a Ray generator): one StreamBatch per
        engine step (merged when the reader is behind), and an empty one after
        ``streams.heartbeat_s`` without any: the reader tells a live worker from a hung one by
        them (and a hung engine thread by their ``step_age_s``). Runs until the worker shuts
        down; a client whose readers are all gone for ``streams.orphan_grace_s`` has its
        requests aborted."""
        async for batch in self.streams.iterate(client):
            yield batch

    def _orphaned(self, client: str) -> None:
        """(event loop) ``client``'s readers went away and none came back: abort its requests."""

        def abort_orphans() -> None:
            orphans = [rid for rid, c in self._streams().items() if c == client]
            if orphans:
                logger.warning(
                    "%s: client %s went away, aborting %d", self.name, client, len(orphans)
                )
            for rid in orphans:
                self._abort(rid)

        self.post(abort_orphans)

    # -- operator / test surface -----------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        """What this worker is; starts its engine thread (the controller calls this first)."""
        self.start()
        cfg = self.engine.cfg
        return {
            "name": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "model_dir": cfg.model_dir,
            "device": cfg.device,
            "block_size": cfg.block_size,
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "index_id": self._publisher.worker if self._publisher is not None else "",
            "endpoint": "",
            **_ray_node(),
        }

    # ``ready``, ``health``, ``stats``, ``check_idle`` and ``abort`` are control methods: callers
    # send them to the actor's CONTROL_GROUP (engine.messages), its own event loop and
    # concurrency, so that no number of streams and pending request calls can starve them.

    async def health(self) -> dict[str, Any]:
        """Cheap liveness, answered on the event loop without the engine thread: how long the
        step running now has been running (0 when none is). A hung engine thread shows here as
        a growing age; a hung or dead process does not answer at all."""
        return {"name": self.name, "steps": self.steps, "step_age_s": self._step_age()}

    def _step_age(self) -> float:
        started = self._step_started
        return time.monotonic() - started if started is not None else 0.0

    async def stats(self) -> dict[str, Any]:
        stats = await self.call(self._stats)
        channels = list(self.streams.channels.values())
        stats["stream_coalesced_steps"] = sum(ch.coalesced for ch in channels)
        stats["stream_clients"] = len(channels)
        # quantiles off the engine thread, over copies (appends there are atomic)
        ttfts, gaps = tuple(self._ttfts), tuple(self._step_gaps)
        since = time.monotonic() - LATENCY_RECENT_S
        stats["latency"] = {"ttft_s": _quantiles(ttfts), "step_gap_s": _quantiles(gaps)}
        stats["latency_recent"] = {
            "window_s": LATENCY_RECENT_S,
            "ttft_s": _quantiles(ttfts, since),
            "step_gap_s": _quantiles(gaps, since),
        }
        return stats

    def _stats(self) -> dict[str, Any]:
        bm = self.engine.block_manager
        counts = bm.counts()
        sched = self.engine.scheduler
        stats = {
            "name": self.name,
            "role": self.role,
            "total_blocks": bm.num_blocks,
            "free_blocks": counts["free"],
            "cached_blocks": counts["cached"],
            "in_use_blocks": counts["in_use"],
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            # prompt tokens not computed yet, of the queued requests and of the running ones
            # still in prefill (the prefill pool's backlog; a remote request being received
            # has its prompt computed elsewhere)
            "waiting_prompt_tokens": sum(
                max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                for r in (*sched.waiting, *sched.running)
            ),
            "preemptions": sched.num_preemptions,
            "remote_pending": self.engine.num_remote_pending(),
            "open_streams": len(self._streams()),
            "steps": self.steps,
            "prefix_queries_tokens": bm.prefix_queries,
            "prefix_hit_tokens": bm.prefix_hits,
            "loading": len(sched.loading),
            "ranks": self.engine.rank_table,  # its tensor-parallel ranks' processes, devices
            # Python's collector: objects it no longer scans (freeze_startup_heap), and its
            # collections so far of the oldest generation, the ones that scan the whole heap
            "gc_frozen_objects": _frozen_objects,
            "gc_full_collections": gc.get_stats()[2]["collections"],
        }
        if self.engine.tiers is not None:  # per tier use, counters, and the measured costs
            stats["kv_tiers"] = self.engine.tiers.snapshot()  # the router prices hits by them
        grammar = self.engine.grammar_stats()
        if grammar is not None:  # structured outputs: compile and mask times, failures
            stats["grammar"] = grammar
        for role in self.roles:
            for key, value in role.stats().items():
                stats[key] = stats[key] + value if key in stats else value
        return stats

    async def check_idle(self) -> str | None:
        """None when idle (free + cached + in-use == total, nothing in use, no request still
        tracked here); else why not. A step still in flight after the last request ended
        (async scheduling queues one ahead; its outputs go nowhere) is waited out, up to
        ``IDLE_TAIL_S``: the engine thread finishes it on its next turn."""

        def check() -> tuple[str | None, bool]:
            try:
                self.engine.block_manager.check_invariant(expect_idle=True)
            except AssertionError as exc:
                return str(exc), False
            if self.engine.has_unfinished_requests():
                tail = self.engine.num_unfinished_requests == 0  # only the step in flight
                return f"{self.engine.num_unfinished_requests} requests unfinished", tail
            if self.requests:  # ended in the engine, still kept here: a leak
                held = sorted(self.requests)[:4]
                return f"{len(self.requests)} requests still tracked: {held}", False
            return None, False

        deadline = time.monotonic() + IDLE_TAIL_S
        while True:
            why, tail = await self.call(check)
            if not tail or time.monotonic() > deadline:
                return why
            await asyncio.sleep(0.01)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        """Engine thread: the first role that holds ``request_id`` ends it; none: the engine."""
        if any(role.abort(request_id) for role in self.roles):
            return
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)
            self.emit([aborted(request_id)])
        self.retire(request_id)

    def shutdown(self) -> None:
        for role in self.roles:
            role.close()
        self._closed = True
        self._boot.put(None)  # (the loop never started: the thread ends)
        self.post(lambda: None)
        self.streams.close()
        if self._publisher is not None:
            self._publisher.close()  # its entries stop counting at once
        if self.engine.tiers is not None:
            self.engine.tiers.close()  # blocks on their way to disk land there
        if threading.current_thread() is not self._thread:
            if self._thread.is_alive():
                self._thread.join(SHUTDOWN_JOIN_S)
            if not self._thread.is_alive():  # (a step still running keeps its ranks)
                self.engine.close()  # tensor-parallel ranks stop with the worker, not at exit


def _quantiles(
    samples: tuple[tuple[float, float], ...], since: float = -math.inf
) -> dict[str, float] | None:
    """p50, p90 and p99 (nearest rank) of the ``(taken, seconds)`` samples taken after
    ``since``, and their number; None without any."""
    ordered = sorted(v for t, v in samples if t > since)
    if not ordered:
        return None
    n = len(ordered)

    def rank(q: int) -> float:
        return ordered[min(n - 1, max(0, -(-q * n // 100) - 1))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "n": n}


def _ray_node() -> dict[str, str]:
    """The Ray node this worker runs on (none outside Ray: in-process tests)."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
        }
    except Exception:  # noqa: BLE001 - where it runs is for the operator's table only
        return {}


# objects freeze_startup_heap moved to the permanent generation: counted once there, since
# gc.get_freeze_count() walks all of them (millions in a worker: ~10 ms), and stats() ran it on
# the engine thread 4 times a second (4.6 % of the thread in a served run on an H200)
_frozen_objects = 0


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive to the collector's permanent generation
    (``gc.freeze``), as vLLM's engine core does after start-up. A worker's start-up heap
    (torch, the model's modules, the tokenizer, Ray's) lives as long as its process, and each
    full collection scanned all of it while the engine thread waited: on an H200 serving
    ShareGPT offline with FP8 weights the collector paused 1.09-1.17 s of 15-16 s, the longest
    216-217 ms; frozen, 0.45-0.65 s, the longest 12-14 ms (benchmarks/gpu_async.py
    --gc-freeze, benchmarks/NOTES.md). Only for a process that holds one worker for its life
    (a Ray actor's): objects frozen never return to the collector, so a process that builds
    and drops engines (tests, benchmarks) would keep their cycles."""
    global _frozen_objects
    gc.collect()
    gc.freeze()
    _frozen_objects = gc.get_freeze_count()


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor's (a worker's own process)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _in_placement_group() -> bool:
    """Whether this process is a Ray actor placed in a placement group (a TP worker's)."""
    try:
        import ray
        from ray.util import get_current_placement_group
    except ImportError:
        return False
    return ray.is_initialized() and get_current_placement_group() is not None


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
