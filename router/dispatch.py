"""The request protocol, owned by the router: place, reserve, prefill, stream, retry.

One request, disaggregated (``attempt`` below; colocated is steps 1 and 4 on one worker)::

    1. (prefill P, decode D): where the service placed it (``RoutedRequest``); a retry's
       from ``placer.place_again``, the failed workers excluded (``RoutedRequest.avoid``)
    2. P.prefill(rid, prompt, endpoint of D, gated)   ┐ at once: the prompt computes while D
       D.reserve(rid, prompt, client)                 ┘ reserves; its KV waits at the channel
         Reserved -> P.release(rid)                      until released
         Full     -> P.abort(rid); the next decode worker, or back off until reserve_timeout_s
         (no answer while D turns suspect or dead: as Full, and D.abort(rid); no call into a
         worker waits on one the router has given up on)
         Rejected -> RequestError (bad input: no retry)
       (the reservations, releases and colocated starts bound for one worker share actor
       calls: ``_Batch``; the prefills do not, each answers when its KV has left)
    3. P's result: PrefillFailed -> D.fail_transfer(rid) (D ends the request retryably)
    4. D's deltas arrive on this router's one stream from D (a socket of D's, a batch per
       engine step for every request of this router on D: ``worker_stream``); the request's
       queue takes its own, and the ``Assembler`` makes each batch taken one ``Step``
       (router/outputs.py): what each choice gained, its text built here (detokenization and
       stop strings: off the engine thread); nothing cumulative leaves it
    5. a retryable failure (transfer failed, worker died, worker silent for ``stall_timeout_s``:
       no delta and no heartbeat, or one engine step older than ``hang_timeout_s``) -> run
       again on other workers. Before any token that is a new attempt, up to
       ``max_attempts``; after tokens it is a *resume*, up to ``max_resumes``: the request
       continues from its snapshot (prompt + the tokens it produced, carried as output and
       recomputed there), and its client's stream goes on with the next token, no gap, no
       duplicate (the old attempt's id is dropped). Seeded draws are a function of (seed,
       output position), so greedy and seeded requests continue exactly
    6. finish, stop string (the worker is told to abort) or client gone: abort everywhere
    7. a live migration moves the request to another decode worker (decode_worker/migration.py):
       the old worker's last word on it is a ``moved_to`` delta; the attempt then follows the
       new worker (its stream, its failures, aborts go there). Deltas carry their output
       position, so the two streams may be read in either order (_Inflight orders them)

Errors (router/errors.py): ``RequestError`` (invalid, nothing started), ``CapacityError`` (no
room within ``reserve_timeout_s``), ``ClusterError`` (failed after retrying); the gateway turns
them into HTTP errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from engine.aio import within
from engine.detokenizer import SequenceText
from engine.messages import (
    Delta,
    Full,
    PrefillFailed,
    Rejected,
    Reserved,
    StreamBatch,
    brief,
    control,
)
from engine.output_stream import StreamError, read_stream
from engine.sampling_params import SamplingParams
from engine.tracing import trace
from router.errors import CapacityError, ClusterError, RequestError
from router.membership import MembershipView, WorkerRef
from router.outputs import ChoiceDelta, Step, TokenTexts, Usage, merge_choices
from router.routed import Placer, RoutedRequest

logger = logging.getLogger(__name__)


class _Retry(Exception):
    """An attempt failed in a way another worker may not: the request may continue elsewhere.
    ``reason``: a short label for metrics (worker_died, stalled, transfer_failed)."""

    def __init__(self, message: str, reason: str = "worker_failed") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Inflight:
    """One attempt's deltas, as the worker streams deliver them, in output order.

    Deltas carry their output position (``start``): after a live migration the request's
    deltas come from two streams (the old worker's last ones, the new worker's first ones),
    which this router may read in either order. A delta ahead of the next expected position
    waits for the gap to fill; a repeated one is trimmed or dropped."""

    ref: WorkerRef  # the worker it runs on (changes when it migrates)
    base: int = 0  # output position of its first token (tokens carried in come before)
    deltas: list[Delta] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # why a retryable error delta ended it: the worker's own ones are failed KV transfers, the
    # router's own say what it saw (the worker died, or went silent)
    reason: str = "transfer_failed"
    _next: dict[int, int] = field(default_factory=dict)  # sequence index -> next position
    _held: dict[tuple[int, int], Delta] = field(default_factory=dict)  # ahead of a gap

    @property
    def worker(self) -> str:
        return self.ref.name

    def push(self, d: Delta) -> None:
        if d.start >= 0 and d.error is None and d.moved_to is None:
            d = self._in_order(d)
            if d is None:
                return
        self.deltas.append(d)
        self.ready.set()

    def _in_order(self, d: Delta) -> Delta | None:
        """``d`` trimmed to what is new (None: nothing new yet, or nothing new at all); a
        delta that closes a gap brings the held ones after it."""
        nxt = self._next.get(d.index, self.base if d.index == 0 else 0)
        if d.start > nxt:
            self._held[(d.index, d.start)] = d
            return None
        skip = nxt - d.start
        if skip >= len(d.token_ids) and (skip > len(d.token_ids) or d.finish_reason is None):
            return None  # a stale repeat (the old worker's, after a migration)
        if skip:
            logprobs = d.logprobs[skip:] if d.logprobs is not None else None
            d = replace(d, token_ids=d.token_ids[skip:], logprobs=logprobs, start=nxt)
        end = nxt + len(d.token_ids)
        self._next[d.index] = end
        held = self._held.pop((d.index, end), None)
        if held is not None:
            merged = self._in_order(held)
            if merged is not None:
                d = d.merge(merged)
        return d

    async def take(self) -> list[Delta]:
        await self.ready.wait()
        self.ready.clear()
        deltas, self.deltas = self.deltas, []
        return deltas


def _for_prefill(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's arguments without ``predicted_tokens``: that one is for a decode worker's
    reservation only (its projected KV demand); prefill and colocated workers take none."""
    return {k: v for k, v in kwargs.items() if k != "predicted_tokens"}


class Assembler:
    """A request's steps, built from its engine deltas (the work per delta is O(its tokens)):
    detokenizes and checks stop strings when the worker did not, and keeps per choice only
    counts and where its text stands, plus the tokens a resume carries (n = 1). One Assembler
    serves every attempt of a request, so tokens carried into a resume are never sent twice.

    ::

        apply(delta) ... apply(delta)   one batch's deltas (several per choice when a reader
            |                           fell behind)
        step() -> Step                  one ChoiceDelta per choice that changed, in index order
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer,
        texts: TokenTexts | None = None,
    ):
        self.request_id = request_id
        self.params = params
        n = params.n
        self._texts = [
            SequenceText(tokenizer, prompt_ids, params.for_child(i) if n > 1 else params)
            if tokenizer is not None
            else None
            for i in range(n)
        ]
        # completions' text offsets need each token's own text (only with logprobs)
        self._token_texts = None
        if params.logprobs is not None:
            self._token_texts = texts if texts is not None else TokenTexts(tokenizer)
        self._counts = [0] * n  # tokens per choice
        self._offsets = [0] * n  # text offset of each choice's next token
        self._finished = [False] * n
        self._produced: list[int] = []  # choice 0's tokens, when n = 1: what a resume carries
        self._pending: list[ChoiceDelta] = []  # since the last step
        self.usage = Usage(len(prompt_ids))
        self.predicted_tokens: tuple[float, float, float] | None = None

    def produced(self) -> list[int] | None:
        """The tokens a resumed attempt carries (n = 1), or None when nothing was produced."""
        return list(self._produced) if self._produced else None

    @property
    def has_output(self) -> bool:
        return any(self._counts)

    @property
    def finished(self) -> bool:
        return all(self._finished)

    def apply(self, d: Delta) -> bool:
        """Add one delta; True when a stop string ended its sequence here (the worker keeps
        generating until told to abort)."""
        i = d.index
        if self._finished[i]:
            return False
        if d.num_cached_tokens and not self.usage.cached_tokens:  # the first attempt's
            u = self.usage
            self.usage = Usage(u.prompt_tokens, u.completion_tokens, d.num_cached_tokens)
        if d.predicted is not None and self.predicted_tokens is None:  # prefill's probe
            self.predicted_tokens = d.predicted
        ids, logprobs, stopped = self._tokens(d)
        if stopped is not None:
            finish, stop = "stop", stopped
        else:
            finish, stop = d.finish_reason, d.stop_reason
        self._finished[i] = finish is not None
        text = self._texts[i]
        new_text = text.next_text(self._finished[i]) if text is not None else d.text
        self._count(i, ids)
        if new_text or ids or finish is not None:
            offset = self._offsets[i]
            if self._token_texts is not None:
                self._offsets[i] += self._token_texts.length(ids)
            self._pending.append(ChoiceDelta(i, new_text, ids, logprobs, finish, stop, offset))
        return stopped is not None

    def _tokens(self, d: Delta) -> tuple[list[int], list[dict[int, float]] | None, str | None]:
        """The tokens of ``d`` up to a stop string, their logprobs, and the stop string."""
        text = self._texts[d.index]
        logprobs = [] if self.params.logprobs is not None else None
        ids: list[int] = []
        stopped = None
        for k, tok in enumerate(d.token_ids):
            ids.append(tok)
            if logprobs is not None and d.logprobs is not None:
                logprobs.append(d.logprobs[k])
            if text is None:
                continue
            stop_token = k == len(d.token_ids) - 1 and d.finish_reason == "stop"
            stopped = text.add(tok, stop_token=stop_token, stop_reason=d.stop_reason)
            if stopped is not None:
                break
        return ids, logprobs, stopped

    def _count(self, i: int, ids: list[int]) -> None:
        self._counts[i] += len(ids)
        if len(self._counts) == 1:
            self._produced.extend(ids)
        # built directly, not by dataclasses.replace: once a delta, 8 % of a busy gateway's
        # time in a profile of 1000 streams on an H200 (benchmarks/NOTES.md)
        u = self.usage
        self.usage = Usage(u.prompt_tokens, u.completion_tokens + len(ids), u.cached_tokens)

    def step(self) -> Step:
        """What the request gained since the last step."""
        choices, self._pending = merge_choices(self._pending), []
        return Step(choices, self.usage, self.finished, self.predicted_tokens)


class LeastLoaded:
    """Places a request again on the workers with the fewest requests of this router in
    flight: the dispatcher's placer unless it is given one (scripts and tests that place the
    first attempt themselves; the gateway's router places again through its policy)."""

    def __init__(self, members: MembershipView) -> None:
        self.members = members

    def place_again(self, req: RoutedRequest) -> tuple[str | None, str]:
        members = self.members
        if req.colocated:
            return None, _least_loaded(members.colocated, req.avoid)
        return _least_loaded(members.prefill, req.avoid), _least_loaded(members.decode, req.avoid)


def _least_loaded(pool: list[WorkerRef], avoid: set[str]) -> str:
    preferred = [w for w in pool if w.name not in avoid] or pool
    if not preferred:
        raise ClusterError("no live workers")
    return min(preferred, key=lambda w: w.outstanding).name


class Dispatcher:
    """Runs requests on the workers of ``members``; one per router process. ``placer``
    places a failed attempt's request again (default: ``LeastLoaded``)."""

    def __init__(
        self,
        members: MembershipView,
        tokenizer: Any,
        *,
        client_id: str | None = None,
        reserve_timeout_s: float = 30.0,
        max_attempts: int = 2,
        max_resumes: int = 2,
        stall_timeout_s: float = 10.0,
        hang_timeout_s: float = 60.0,
        placer: Placer | None = None,
    ) -> None:
        self.members = members
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)  # completions' text offsets (logprobs)
        self.placer: Placer = placer or LeastLoaded(members)
        self.client_id = client_id or f"router-{secrets.token_hex(4)}"
        self.reserve_timeout_s = reserve_timeout_s
        self.max_attempts = max_attempts
        self.max_resumes = max_resumes
        self.stall_timeout_s = stall_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self._inflight: dict[str, _Inflight] = {}
        self._streams: dict[str, asyncio.Task] = {}
        self._seen: dict[str, float] = {}  # worker -> when its stream last delivered anything
        self._step_age: dict[str, tuple[float, float]] = {}  # worker -> (its step's age, when)
        self._watchdog: asyncio.Task | None = None
        self.coalesced_batches = 0
        self.resumes: Counter[str] = Counter()  # by reason
        # One timeline per resume (wall-clock seconds, so a harness on the same host can set a
        # fault's instant beside them): failed, placed, reserved, prefilled, first, second
        # (the resumed attempt's first two deltas with tokens), prefill_phases (the prefill
        # worker's own split: to its engine thread, queued, computing), tokens recomputed.
        self.resume_log: deque[dict[str, Any]] = deque(maxlen=256)
        self.migrations = 0  # requests of this router that moved to another worker
        self._orphans: dict[tuple[str, str], None] = {}
        self._batches: dict[tuple[str, str], _Batch] = {}  # (worker, method) -> its calls
        # (worker, client) -> its batches; a socket of the worker's (worker_stream), a test's
        # fake in unit tests
        self.open_stream = worker_stream

    # -- a request ---------------------------------------------------------------------------

    async def run(self, req: RoutedRequest) -> AsyncIterator[Step]:
        """The steps of one request, one per batch of its deltas (the last is ``finished``). The
        first attempt runs where ``req`` was placed; a retry or a resume where ``placer`` places
        it again. Closing the iterator early aborts it everywhere (and it is never resumed)."""
        request_id, prompt_ids = req.request_id, req.prompt_ids
        assembler = Assembler(request_id, prompt_ids, req.params, self.tokenizer, self.texts)
        kwargs = req.worker_kwargs()
        failures = resumes = 0
        timeline: dict[str, Any] | None = None  # of the resume under way
        while True:
            attempt = failures + resumes
            irid = request_id if attempt == 0 else f"{request_id}~{attempt}"
            carried = assembler.produced()
            extra = {**kwargs, "output_token_ids": carried} if carried else kwargs
            if attempt:
                req.prefill, req.decode = self.placer.place_again(req)
            prefill = self.members.get(req.prefill) if req.prefill is not None else None
            decode = self.members.get(req.decode)
            if timeline is not None:
                timeline["placed"] = time.time()
            try:
                async for out in self._attempt(
                    irid, prompt_ids, req.params, extra, prefill, decode, assembler, timeline
                ):
                    yield out
                return
            except _Retry as exc:
                req.failed_on(decode.name, prefill.name if prefill is not None else None)
                if not assembler.has_output:
                    failures += 1
                    logger.warning("request %s attempt %d failed: %s", request_id, failures, exc)
                    if failures >= self.max_attempts:
                        raise ClusterError(
                            f"request {request_id} failed on {failures} attempts: {exc}"
                        ) from None
                    continue
                produced = assembler.produced()
                if produced is None or resumes >= self.max_resumes:
                    why = "n > 1" if produced is None else f"{resumes} resumes"
                    raise ClusterError(
                        f"request {request_id} failed mid-stream ({why}): {exc}"
                    ) from None
                resumes += 1
                self.resumes[exc.reason] += 1
                timeline = {
                    "request_id": request_id,
                    "reason": exc.reason,
                    "tokens": len(prompt_ids) + len(produced),
                    "failed": time.time(),
                }
                self.resume_log.append(timeline)
                logger.warning(
                    "request %s resumes after %d tokens (%s): %s",
                    request_id,
                    len(produced),
                    exc.reason,
                    exc,
                )

    async def _attempt(self, irid, ids, params, kwargs, prefill, decode, assembler, timeline=None):
        finished = False
        workers = [decode] + ([prefill] if prefill is not None else [])
        for w in workers:
            w.outstanding += 1
        try:
            if prefill is None:
                inflight = await self._start_colocated(irid, ids, params, kwargs, decode)
            else:
                inflight, placed, irid = await self._start_disagg(
                    irid, ids, params, kwargs, prefill, decode, timeline
                )
                if placed is not decode:  # the chosen one was full: another had room
                    decode.outstanding -= 1
                    placed.outstanding += 1
                    decode = workers[0] = placed
            while True:
                for d in await inflight.take():
                    if d.error is not None:
                        if d.retryable:
                            raise _Retry(d.error, inflight.reason)
                        raise ClusterError(d.error)
                    if d.moved_to is not None:  # migrated: read its new worker from now on
                        workers[0] = self._moved(irid, inflight, d.moved_to)
                        continue
                    if timeline is not None and d.token_ids and "second" not in timeline:
                        timeline["second" if "first" in timeline else "first"] = time.time()
                    stopped = assembler.apply(d)  # a stop string: the worker does not know
                    finished = assembler.finished
                    if stopped and finished:
                        _quietly(control(workers[0].handle.abort), irid)
                    if finished:
                        break
                yield assembler.step()
                if finished:
                    return
        finally:
            self._inflight.pop(irid, None)
            for w in workers:
                w.outstanding -= 1
            if not finished:
                for w in workers:
                    _quietly(control(w.handle.abort), irid)

    def _moved(self, irid: str, inflight: _Inflight, name: str) -> WorkerRef:
        """A live migration moved ``irid`` to ``name``: its deltas (and its failure, if that
        worker fails) come from there now."""
        new = self.members.get(name)
        if new is None:
            raise _Retry(f"request moved to unknown worker {name!r}", "worker_died")
        old = inflight.ref
        old.outstanding -= 1
        new.outstanding += 1
        inflight.ref = new
        self._ensure_stream(new)
        self.migrations += 1
        trace(irid, "router.moved")
        return new

    async def _start_colocated(self, irid, ids, params, kwargs, worker: WorkerRef) -> _Inflight:
        kwargs = _for_prefill(kwargs)
        inflight = self._expect(irid, worker, _carried(kwargs))
        try:
            res = await self._batch(worker, "generate_many", self.client_id).add(
                (irid, ids, params, kwargs)
            )
        except Exception as exc:  # noqa: BLE001 - the worker died: another may serve it
            self._worker_failed(worker, exc)
            raise _Retry(f"worker {worker.name} failed: {brief(exc)}", "worker_died") from None
        if res is _UNRESPONSIVE:
            raise _Retry(f"worker {worker.name} is unresponsive", "stalled")
        if res is not None:
            kind, message = res
            if kind == "invalid":
                raise RequestError(message.splitlines()[-1])
            raise _Retry(f"worker {worker.name} could not start it: {message}", "worker_failed")
        return inflight

    def _batch(self, worker: WorkerRef, method: str, *extra) -> _Batch:
        """``worker``'s batch of ``method(items, *extra)`` calls (a worker restarted under its
        name gets a new one)."""
        batch = self._batches.get((worker.name, method))
        if batch is None or batch.worker.handle is not worker.handle:
            batch = self._batches[worker.name, method] = _Batch(self, worker, method, *extra)
        return batch

    def _release(self, p: WorkerRef, irid: str) -> None:
        """Let a gated prefill's KV leave (its decode worker has reserved); fire and forget,
        as ``_quietly``: a dead prefill worker fails the prefill, which its watcher reports."""
        future = self._batch(p, "release_many").add(irid)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _start_disagg(self, irid, ids, params, kwargs, p: WorkerRef, d: WorkerRef, timeline):
        """Reserve on ``d`` while ``p`` computes the prompt (gated), falling back to the other
        decode workers when ``d`` is full. Returns (the request's inflight, its decode worker,
        the id it runs under). ``kwargs["predicted_tokens"]`` goes to the reservation only.
        ``timeline``: a resume's, which gets its reservation's and its prefill's instants."""
        reserve, kwargs = kwargs, _for_prefill(kwargs)
        inflight = self._expect(irid, d, _carried(kwargs))
        pref = p.handle.prefill.remote(irid, ids, params, d.endpoint, gated=True, **kwargs)
        res = await self._reserve_on(d, irid, ids, params, reserve)
        if isinstance(res, Reserved):
            self._release(p, irid)
        else:
            _quietly(control(p.handle.abort), irid)
            self._inflight.pop(irid, None)
            irid = f"{irid}~r"  # a new id: the dropped prefill may still be finishing
            d = await self._reserve_anywhere(irid, ids, params, reserve, avoid={d.name})
            inflight = self._inflight[irid]
            pref = p.handle.prefill.remote(irid, ids, params, d.endpoint, **kwargs)
        if timeline is not None:
            timeline["reserved"] = time.time()
        asyncio.ensure_future(self._watch_prefill(pref, p, d, irid, timeline))
        return inflight, d, irid

    async def _reserve_on(self, d: WorkerRef, irid, ids, params, kwargs):
        """``d``'s answer to a reservation; a dead or unresponsive ``d`` is as if full (the
        caller tries the others), its reservation aborted in case it ever wakes up."""
        try:
            res = await self._batch(d, "reserve_many", self.client_id).add(
                (irid, ids, params, kwargs)
            )
        except Exception as exc:  # noqa: BLE001 - a dead decode worker: as if full
            self._worker_failed(d, exc)
            return Full(str(exc))
        if res is _UNRESPONSIVE:
            _quietly(control(d.handle.abort), irid)
            return Full(f"decode worker {d.name} is unresponsive")
        if isinstance(res, Rejected):
            raise RequestError(res.message)
        return res

    async def _answer_of(self, worker: WorkerRef, call) -> Any:
        """What ``call`` (a call into ``worker``) returns or raises, or ``_UNRESPONSIVE`` as
        soon as this router holds ``worker`` suspect or dead: a hung process answers nothing,
        so a request must not wait on it past the moment the router knows (health polls
        missed, a silent stream, a stuck step). A late answer is dropped. No polling: the
        call and the membership's ``given_up`` future, whichever comes first (a burst of
        1000 prefills polling every 0.25 s woke the event loop ~16,000 times)."""

        async def answer():
            return await call

        waiting = asyncio.ensure_future(answer())
        gone = self.members.given_up(worker.name)
        try:
            done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiting.cancel()
            raise
        if waiting in done:
            return waiting.result()
        waiting.cancel()
        return _UNRESPONSIVE

    async def _reserve_anywhere(self, irid, ids, params, kwargs, avoid: set[str]) -> WorkerRef:
        """The first decode worker with room (least loaded first), backing off while all are
        full, up to ``reserve_timeout_s``."""
        deadline = time.monotonic() + self.reserve_timeout_s
        delay = 0.005
        while True:
            pool = self.members.decode
            candidates = sorted(
                [w for w in pool if w.name not in avoid] or pool, key=lambda w: w.outstanding
            )
            for d in candidates:
                self._expect(irid, d, _carried(kwargs))
                if isinstance(await self._reserve_on(d, irid, ids, params, kwargs), Reserved):
                    return d
                self._inflight.pop(irid, None)
            if time.monotonic() > deadline or not pool:
                raise CapacityError(
                    f"no decode worker had room for a {len(ids)}-token prompt within "
                    f"{self.reserve_timeout_s:.0f} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _watch_prefill(self, pref, p: WorkerRef, d: WorkerRef, irid: str, timeline=None):
        """The prefill's result; a failure ends the request on ``d`` retryably. A prefill
        worker that hangs (this router or the controller holds it suspect: health polls
        missed, a stuck step) fails its prefills at once, not after the transfer timeout."""

        try:
            res = await self._answer_of(p, pref)
        except Exception as exc:  # noqa: BLE001 - the prefill worker died or raised
            res = PrefillFailed(f"prefill worker failed: {brief(exc)}")
        if res is _UNRESPONSIVE:
            _quietly(control(p.handle.abort), irid)
            res = PrefillFailed(f"prefill worker {p.name} is unresponsive")
        trace(irid, "router.prefilled")
        if timeline is not None:
            timeline["prefilled"] = time.time()
            timeline["prefill_phases"] = getattr(res, "phases", None)
        if isinstance(res, PrefillFailed):
            _quietly(d.handle.fail_transfer, irid, res.message)

    # -- the workers' output streams ---------------------------------------------------------

    def _expect(self, irid: str, worker: WorkerRef, base: int = 0) -> _Inflight:
        """Register a request's queue before it can produce anything, and make sure this
        router reads ``worker``'s stream. ``base``: output tokens it carries in."""
        inflight = self._inflight[irid] = _Inflight(worker, base)
        self._ensure_stream(worker)
        return inflight

    def _ensure_stream(self, worker: WorkerRef) -> None:
        task = self._streams.get(worker.name)
        if task is None or task.done():
            self._seen[worker.name] = time.monotonic()
            self._streams[worker.name] = asyncio.ensure_future(self._read(worker))
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch_streams())

    async def _read(self, worker: WorkerRef) -> None:
        """Demultiplex ``worker``'s batches to the requests they belong to."""
        why = "its output stream ended"
        try:
            async for batch in self.open_stream(worker, self.client_id):
                now = time.monotonic()
                self._seen[worker.name] = now
                self._step_age[worker.name] = (batch.step_age_s, now)
                if batch.step_age_s < self.hang_timeout_s:
                    self.members.clear(worker.name, "stream")
                self.coalesced_batches += batch.coalesced
                for d in batch.deltas:
                    inflight = self._inflight.get(d.request_id)
                    if inflight is not None:
                        inflight.push(d)
                    elif not d.finished and d.moved_to is None:
                        self._orphan(worker, d.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the worker died
            why = f"worker {worker.name} died: {brief(exc)}"
            self._worker_failed(worker, exc)
        self._seen.pop(worker.name, None)  # no stream to watch until one is started again
        self._step_age.pop(worker.name, None)
        self._fail_inflight(worker.name, why, "worker_died")

    async def _watch_streams(self) -> None:
        """Every stall_timeout_s / 4: a worker whose stream has been silent (no delta, not even
        its heartbeat) for longer than ``stall_timeout_s`` (its process is hung or gone), or
        whose heartbeats say one engine step has run for longer than ``hang_timeout_s`` (its
        engine thread is stuck), is suspect (nothing new goes there until its stream shows
        progress again) and every request of this router running there fails retryably (it
        resumes elsewhere)."""
        while True:
            await asyncio.sleep(self.stall_timeout_s / 4)
            now = time.monotonic()
            for name, seen in list(self._seen.items()):
                age, when = self._step_age.get(name, (0.0, now))
                step_age = age + (now - when) if age > 0 else 0.0
                if now - seen > self.stall_timeout_s:
                    why = f"worker {name} silent for {now - seen:.1f} s"
                elif step_age > self.hang_timeout_s:
                    why = f"worker {name} stuck in one engine step for {step_age:.1f} s"
                else:
                    continue
                self.members.suspect(name, "stream", why)
                self._fail_inflight(name, why, "stalled")

    def _orphan(self, worker: WorkerRef, irid: str) -> None:
        """Output for a request this router no longer runs (it resumed elsewhere while a
        migration handed it over, say): the worker is told to stop it, once."""
        key = (worker.name, irid)
        if key in self._orphans:
            return
        self._orphans[key] = None
        while len(self._orphans) > 4096:
            self._orphans.pop(next(iter(self._orphans)))
        logger.warning("%s runs %s for nobody here: aborting it", worker.name, irid)
        _quietly(control(worker.handle.abort), irid)

    def _fail_inflight(self, worker: str, why: str, reason: str) -> None:
        """End every in-flight attempt of this router on ``worker`` with a retryable error."""
        for rid, inflight in list(self._inflight.items()):
            if inflight.worker == worker:
                inflight.reason = reason
                inflight.push(Delta(rid, error=why, retryable=True))

    def _worker_failed(self, worker: WorkerRef, exc: BaseException) -> None:
        from ray.exceptions import RayActorError

        if isinstance(exc, RayActorError):
            self.members.forget(worker.name, str(exc).splitlines()[0])

    async def aclose(self) -> None:
        tasks = [*self._streams.values(), *([self._watchdog] if self._watchdog else [])]
        tasks += [b.task for b in self._batches.values() if b.task is not None]
        self._batches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in self._streams:  # what these streams suspected, nobody will clear now
            self.members.clear(name, "stream")
        self._streams.clear()
        self._watchdog = None


_UNRESPONSIVE = object()  # _answer_of: the worker went suspect or dead before it answered


class _Batch:
    """The calls of one kind bound for one worker, sent together: the first of a loop turn goes
    on the next turn with every call queued by then, and those that come while a call is in
    flight go in the next one; ``FLUSH`` queued calls go at once, from ``add`` (so at most
    ``FLUSH`` a call). A burst of 1000 requests then makes a few dozen actor calls of each kind
    instead of 1000; each cost the router's event loop ~0.5 ms of Ray's client work (argument
    checks, serialisation, submission), a fifth of its time in a burst on CPU
    (benchmarks/NOTES.md). ``add`` sends a full batch itself because the next loop turn comes
    only after every other request of a burst has been taken in (~1 ms each), and the worker
    should have the first ones meanwhile. Kinds: colocated starts (``generate_many``),
    reservations (``reserve_many``), a prefill's release (``release_many``).
    ``method(items, *extra)`` answers one value per item, in order; each item gets its own, or
    the call's failure (raised) or ``_UNRESPONSIVE``."""

    FLUSH = 32

    def __init__(self, dispatcher: Dispatcher, worker: WorkerRef, method: str, *extra) -> None:
        self.dispatcher, self.worker, self.method, self.extra = dispatcher, worker, method, extra
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.task: asyncio.Task | None = None
        self.settling: set[asyncio.Task] = set()  # answers of the calls ``add`` sent at once

    def add(self, item: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
        if len(self.pending) >= self.FLUSH:
            batch = self._take()
            settling = asyncio.ensure_future(self._settle(batch, self._call(batch)))
            self.settling.add(settling)  # (held until done: the loop keeps weak references)
            settling.add_done_callback(self.settling.discard)
        elif self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._send())
        return future

    def _take(self) -> list[tuple[Any, asyncio.Future]]:
        """Every queued call whose caller still waits (fewer than ``FLUSH``, or ``add``'s
        full batch)."""
        batch, self.pending = self.pending, []
        return [(item, f) for item, f in batch if not f.done()]  # (callers cancelled)

    def _call(self, batch: list[tuple[Any, asyncio.Future]]) -> Any:
        """The actor call for ``batch``, submitted now (its ObjectRef), or why it could not be."""
        try:
            method = getattr(self.worker.handle, self.method)
            return method.remote([item for item, _ in batch], *self.extra)
        except Exception as exc:  # noqa: BLE001 - the call's failure is each item's
            return exc

    async def _send(self) -> None:
        while self.pending:
            batch = self._take()
            if batch:
                await self._settle(batch, self._call(batch))

    async def _settle(self, batch: list[tuple[Any, asyncio.Future]], call: Any) -> None:
        """Each item of ``batch`` gets its answer from ``call``."""
        if isinstance(call, Exception):
            answers: Any = [call] * len(batch)
        else:
            try:
                answers = await self.dispatcher._answer_of(self.worker, call)
            except Exception as exc:  # noqa: BLE001 - the call's failure is each item's
                answers = [exc] * len(batch)
        if answers is _UNRESPONSIVE:
            answers = [_UNRESPONSIVE] * len(batch)
        for (_, future), answer in zip(batch, answers, strict=True):
            if future.done():
                continue
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)


async def worker_stream(worker: WorkerRef, client: str) -> AsyncIterator[StreamBatch]:
    """``client``'s output stream from ``worker``, on a socket of its own (the endpoint and its
    token come over Ray; engine/output_stream.py). It ends when the worker closes it: at its
    shutdown, or at its death, which the actor's next answer then raises (RayActorError)."""
    host, port, token = await worker.handle.stream_endpoint.remote(_node_ip())
    try:
        async for batch in read_stream(host, port, token, client):
            yield batch
    except (OSError, StreamError):  # cut: the worker died, or the network failed
        await _alive(worker)
        raise
    await _alive(worker)


STREAM_END_PROBE_S = 5.0


async def _alive(worker: WorkerRef) -> None:
    """Raises the actor's death (RayActorError) when it is dead; returns when it answers or
    is too busy to answer within STREAM_END_PROBE_S."""
    with contextlib.suppress(TimeoutError):
        await within(control(worker.handle.health).remote(), STREAM_END_PROBE_S)


def _node_ip() -> str:
    """This process's Ray node address (where a worker on another node must listen)."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # noqa: BLE001 - outside Ray: this host
        return "127.0.0.1"


def _carried(kwargs: dict[str, Any]) -> int:
    """Output tokens a (resumed) attempt carries in: its deltas' positions start there."""
    return len(kwargs.get("output_token_ids") or ())


def _quietly(method, *args) -> None:
    """Fire-and-forget a Ray actor call (its failure is not the caller's concern)."""
    with contextlib.suppress(Exception):
        method.remote(*args)
