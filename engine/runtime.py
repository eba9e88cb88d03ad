"""What every worker role shares: one engine, one thread that owns it, async streams out.

The engine is plain single-threaded code, so exactly one thread touches it: the *engine
thread*. Everything else (Ray method calls on the actor's event loop, KV receiver threads,
KV sender threads) hands it work through one queue, the inbox, and gets results back as
asyncio futures or stream items on the actor's event loop. When the engine has nothing to
compute the thread blocks on the inbox, so an idle worker burns no CPU and a new request
wakes it at once; no loop polls.

Stream items a caller reads from ``stream(request_id)`` (a Ray streaming generator) are
``RequestOutput`` (cumulative + delta fields, ``finished`` on the last) or ``StreamError``,
which ends the stream (``retryable`` when the request never produced a token and may be
retried elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)
_TRACE = bool(os.environ.get("TANDEM_TRACE"))


def trace(request_id: str, event: str) -> None:
    """With TANDEM_TRACE=1: log a wall-clock timestamp for a request's milestone (every process
    on one host shares the clock, so a request's path can be laid out across workers)."""
    if _TRACE:
        logger.warning("TRACE %s %s %.6f", request_id, event, time.time())


@dataclass(frozen=True)
class StreamError:
    """Ends a stream: the request failed. ``retryable``: no token was produced, so the caller
    may run it again on other workers."""

    request_id: str
    message: str
    retryable: bool = False
    finished: bool = True


class EngineWorker:
    """Base of PrefillWorker, DecodeWorker and ColocatedWorker (plain classes: ``ray.remote``
    wraps them in cluster/local.py, tests may also use them in-process)."""

    role = "engine"

    def __init__(
        self, engine_config: dict[str, Any], name: str = "", index: dict[str, Any] | None = None
    ) -> None:
        """``index``: ``{"url", "namespace", "worker"}`` of the global prefix index (Redis); when
        given, the blocks this worker caches and evicts are published there as ``worker``."""
        threads = os.environ.get("TANDEM_TORCH_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        self.name = name or self.role
        self.engine = LLMEngine(EngineConfig(**engine_config))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self.steps = 0
        self._publisher = None
        if index is not None:
            from router.prefix_index import IndexPublisher, PrefixIndex

            self._publisher = IndexPublisher(
                PrefixIndex(index["url"], index["namespace"]), index["worker"]
            )
            self.engine.block_manager.record_events = True
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-engine", daemon=True)
        self._thread.start()

    def kv_spec(self):
        """This worker's per-layer KV shape and dtype, as pair channels compare them."""
        from cluster.kv_transport import KVSpec

        mc = self.engine.model_config
        return KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.engine.cfg.dtype)

    # -- the engine thread -----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished_requests()

    def _wait_timeout(self) -> float | None:
        """How long the idle engine thread may block (None: until the inbox has something)."""
        return None

    def _run(self) -> None:
        while not self._closed:
            try:
                self._drain_inbox(block=not self._has_work())
                self._on_tick()
                if self._has_work():
                    outputs = self.engine.step()
                    self.steps += 1
                    self._on_outputs(outputs)
                    self._publish_blocks()
            except Exception:  # noqa: BLE001 - a bug must not kill the thread silently
                logger.error("engine thread of %s:\n%s", self.name, traceback.format_exc())
                self._fail_everything(traceback.format_exc(limit=3))
                time.sleep(0.1)  # a persistent fault must not flood the log

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
        """Hand the step's block-stored / block-evicted hashes to the index publisher (its own
        thread talks to Redis; this never blocks or raises)."""
        if self._publisher is None:
            return
        stored, evicted = self.engine.block_manager.drain_events()
        if stored or evicted:
            self._publisher.push(stored, evicted)

    def _on_tick(self) -> None:
        """Hook run once per loop iteration in the engine thread (deadlines)."""

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._push(out.request_id, out)

    def _fail_everything(self, message: str) -> None:
        """Last resort after an engine exception: end every request with an error."""
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._push(rid, StreamError(rid, f"engine failure in {self.name}: {message}"))

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the engine thread (from any thread)."""
        self._inbox.put(fn)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the engine thread and await its result (or exception)."""
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

    # -- streams ---------------------------------------------------------------------------------

    def _open_stream(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use on {self.name}")
        self._streams[request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    def _push(self, request_id: str, item: RequestOutput | StreamError) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput | StreamError]:
        """Outputs of a request as the engine produces them, ending with a finished one."""
        entry = self._streams.get(request_id)
        if entry is None:
            yield StreamError(request_id, f"no request {request_id!r} on {self.name}")
            return
        try:
            while True:
                item = await entry[1].get()
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    # -- operator / test surface -----------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        cfg = self.engine.cfg
        return {
            "name": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "model_dir": cfg.model_dir,
            "device": cfg.device,
            "block_size": cfg.block_size,
            "max_model_len": self.engine.max_model_len,
            "index_id": self._publisher.worker if self._publisher is not None else "",
        }

    async def stats(self) -> dict[str, Any]:
        return await self.call(self._stats)

    def _stats(self) -> dict[str, Any]:
        bm = self.engine.block_manager
        counts = bm.counts()
        sched = self.engine.scheduler
        return {
            "name": self.name,
            "role": self.role,
            "total_blocks": bm.num_blocks,
            "free_blocks": counts["free"],
            "cached_blocks": counts["cached"],
            "in_use_blocks": counts["in_use"],
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "remote_pending": self.engine.num_remote_pending(),
            "open_streams": len(self._streams),
            "steps": self.steps,
            "prefix_queries_tokens": bm.prefix_queries,
            "prefix_hit_tokens": bm.prefix_hits,
        }

    async def check_idle(self) -> str | None:
        """None when idle with free + cached + in-use == total and nothing in use; else why not."""

        def check() -> str | None:
            try:
                self.engine.block_manager.check_invariant(expect_idle=True)
            except AssertionError as exc:
                return str(exc)
            if self.engine.has_unfinished_requests():
                return f"{self.engine.num_unfinished_requests} requests unfinished"
            return None

        return await self.call(check)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)
            self._push(request_id, _aborted(request_id))

    def shutdown(self) -> None:
        self._closed = True
        self.post(lambda: None)
        if self._publisher is not None:
            self._publisher.close()  # its entries stop counting at once


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id, None, [], 0, [CompletionOutput(0, finish_reason="abort")], True, time.time()
    )


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
