"""The global router over a Ray cluster: the ``Backend`` the gateway serves.

For each request::

    1. hash the prompt's full blocks (chained sha256, the engine's own function, with the
       request's cache_salt) and ask the prefix index, in one round trip, how many leading
       blocks every prefill (or colocated) worker holds and at which KV tier each (device,
       host, disk); Redis down: no hits, counted, and the policy routes by load alone (no
       client sees an error)
    2. the placement policy picks the prefill and the decode worker from that and the load view
       (this router's in-flight requests and queued prefill tokens, plus each worker's free
       blocks, running and waiting requests and measured KV tier costs, polled every
       ``stats_interval_s``)
    3. the dispatcher (router/dispatch.py) runs it there: reserve, prefill, stream; a failed
       attempt is placed again by the same policy with the failed workers excluded
    4. ``open`` returns once the first output is there, so errors before the first token are
       plain HTTP errors; the queued prefill tokens are released then. Errors are the router's
       own (router/errors.py), raised as they are: the gateway translates them

Which workers exist comes from the controller (router/membership.py follows its table).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from engine.aio import within
from engine.block_manager import prefix_block_hashes
from engine.messages import WorkerState, control
from engine.prefix_index import DEVICE
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.tracing import trace
from router.admission import Admission, QueueConfig, Ticket
from router.backend import Placement, RouterStats
from router.dispatch import Dispatcher
from router.errors import ClusterError, no_live_workers
from router.lookups import PrefixLookups
from router.membership import MembershipView, WorkerRef
from router.outputs import Step, Usage, merge_choices
from router.policy import PlacementPolicy, RouteRequest, WorkerView, load_fractions, make_policy
from router.predictor import LengthPredictor, NoPredictor, PredictInput, make_predictor
from router.routed import RoutedRequest

logger = logging.getLogger(__name__)


class ClusterBackend:
    def __init__(
        self,
        members: MembershipView,
        *,
        tokenizer: Any = None,
        index=None,  # engine.prefix_index.PrefixIndex | None
        policy: PlacementPolicy | str = "cache_aware",
        model_name: str = "",
        stats_interval_s: float = 0.25,
        stats_timeout_s: float = 2.0,
        suspect_after_polls: int = 3,
        reserve_timeout_s: float = 30.0,
        max_resumes: int = 2,
        stall_timeout_s: float = 10.0,
        hang_timeout_s: float = 60.0,
        queue: QueueConfig | None = None,
        predictor: LengthPredictor | str | None = None,
        local_prefill_tokens: int = 0,
    ) -> None:
        """``local_prefill_tokens``: in a disaggregated cluster, a prompt a decode worker holds
        all of but at most this many tokens (a conversation's next turn: its history and the
        last answer are in that worker's pool or tiers) is prefilled there, not on a prefill
        worker (0: never; docs/kv-tiers.md has the measurement)."""
        self.members = members
        self.local_prefill_tokens = local_prefill_tokens
        table = members.table
        self.index = index
        self._lookups = PrefixLookups(index) if index is not None else None
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.model_name = model_name or table.model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.max_model_len = table.max_model_len
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(table.model_dir)
        self.block_size = table.block_size
        self.dispatcher = Dispatcher(
            members,
            self.tokenizer,
            reserve_timeout_s=reserve_timeout_s,
            max_resumes=max_resumes,
            stall_timeout_s=stall_timeout_s,
            hang_timeout_s=hang_timeout_s,
            placer=self,
        )
        self.stats_interval_s, self.stats_timeout_s = stats_interval_s, stats_timeout_s
        self.suspect_after_polls = suspect_after_polls
        self.hang_after_s = hang_timeout_s  # one engine step this old: its thread is stuck
        self._stats = RouterStats(decisions=collections.Counter())
        self._queued: collections.Counter[str] = collections.Counter()
        self._polled: dict[str, dict[str, Any]] = {}
        # consecutive stats polls a worker did not answer in time; ``suspect_after_polls`` of
        # them and this router sends it nothing new until it answers again
        self.missed_polls: collections.Counter[str] = collections.Counter()
        self._poller: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        # Blocks this router just sent somewhere, until the index has had time to hear of them
        # from the worker: concurrent requests of a new prefix then follow the first one.
        self._recent: collections.OrderedDict[bytes, tuple[str, float]] = collections.OrderedDict()
        self.recent_ttl_s = 5.0
        self.recent_max_blocks = 100_000
        # Predicted output tokens still to come per worker (the cache-aware policy's decode
        # load), summed over this router's running requests at most every ``work_ttl_s``;
        # each placement in between adds its own request's estimate (``_predicted_work``).
        self.work_ttl_s = 0.05
        self._work: collections.Counter[str] | None = None
        self._work_at = -math.inf
        if isinstance(predictor, str):
            predictor = make_predictor(predictor)
        self.predictor: LengthPredictor = predictor or NoPredictor()
        self.admission = Admission(queue or QueueConfig(), self._capacity)
        self._refitting: asyncio.Task | None = None
        # The controller hears this router's admission figures (the autoscaler's demand
        # signal) every ``report_interval_s`` and answers its own counts (for /metrics).
        self.report_interval_s = 1.0
        self._reported_at = -math.inf
        self.router_id = f"{socket.gethostname()}/{os.getpid()}/{id(self):x}"
        self.control: dict[str, Any] = {}

    # -- the Backend interface -------------------------------------------------------------------

    async def open(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        hints: PredictInput | None = None,
    ):
        self.watch()
        members = self.members
        if not members.routable():
            raise no_live_workers()
        disagg = bool(members.prefill and members.decode)
        if params.n > 1:
            # The n samples run as n requests on every topology (seeds offset as the engine
            # does for its own children): a decode worker takes single sequences, and each
            # child can then resume after a worker's death or migrate live on its own. The
            # first one's prompt blocks are a prefix hit for the others.
            def child(i: int):
                return self.open(
                    f"{request_id}.{i}",
                    prompt_token_ids,
                    params.for_child(i),
                    prompt=prompt,
                    priority=priority,
                    cache_salt=cache_salt,
                    hints=hints,
                )

            first = await child(0)  # its prompt blocks are cached once it has a token
            try:
                rest = await asyncio.gather(
                    *(child(i) for i in range(1, params.n)), return_exceptions=True
                )
            except BaseException:  # cancelled (the client went away): the first ends too
                await first.aclose()
                raise
            children = [first, *(c for c in rest if not isinstance(c, BaseException))]
            failed = [c for c in rest if isinstance(c, BaseException)]
            if failed:
                for c in children:
                    await c.aclose()
                raise failed[0]
            return _Fanout(request_id, children)
        if hints is None:
            hints = PredictInput(prompt_len=len(prompt_token_ids), max_tokens=params.max_tokens)
        predicted = self.predictor.predict(hints)
        ticket = await self.admission.acquire(request_id, predicted, params.max_tokens)
        trace(request_id, "router.admitted")
        try:
            return await self._start(
                request_id, prompt_token_ids, params, priority, cache_salt, disagg, hints, ticket
            )
        except BaseException:
            self.admission.release(ticket)
            raise

    async def _start(
        self, request_id, prompt_token_ids, params, priority, cache_salt, disagg, hints, ticket
    ):
        """Place and start a request that holds its slot (``ticket``)."""
        if not disagg and len(self.members.colocated) == 1:
            # One worker to place on: the prefix index cannot change the choice, and its lookup
            # is a round trip whose answer waits on the event loop behind a whole burst's new
            # requests before this one could go to the worker.
            req = RouteRequest(len(prompt_token_ids), self.block_size, index_available=False)
        else:
            req = await self._route_request(prompt_token_ids, cache_salt)
        predicted = ticket.predicted
        if predicted is not None:  # room for the likely tail of the answer
            req.predicted_output_tokens = math.ceil(predicted.quantiles[0.9])
        p, d, reason = self._place_ticket(req, disagg, ticket)
        trace(request_id, "router.placed")
        charged = p or d
        self._remember(req.hashes, charged)
        charge = round(req.prefill_tokens(charged, self._tier_load(charged)))
        self._queued[charged] += charge
        median = round(predicted.median) if predicted is not None else None
        placement = Placement(p, d, reason, len(req.cached_tiers.get(charged, "")), median)
        routed = RoutedRequest(
            request_id,
            prompt_token_ids,
            params,
            p,
            d,
            priority=priority,
            cache_salt=cache_salt,
            predicted_tokens=req.predicted_output_tokens if predicted is not None else None,
            ticket=ticket,
            route=req,
            hints=hints,
        )
        generation = _Generation(
            self, routed, self.dispatcher.run(routed), placement, _Charge(charged, charge)
        )
        await generation.start()
        if ticket.refined is not None:  # the header tells the refined estimate (capped)
            median = round(ticket.predicted.median)
            generation.placement = replace(placement, predicted_tokens=median)
        return generation

    async def healthy(self) -> bool:
        """Cheap, from state (no worker is called): some request can be placed now."""
        self.watch()
        return self.members.routable()

    async def worker_stats(self) -> list[dict[str, Any]]:
        """Fresh for each scrape (the routing poll's view may be a poll interval old)."""
        with contextlib.suppress(Exception):  # /metrics shows what answered
            await self._poll()
        return list(self._polled.values())

    def _capacity(self) -> int:
        """Slots of the pool that produces tokens: every routable decode (or colocated)
        worker's running sequences at once."""
        per = self.admission.cfg.slots_per_worker
        return sum(per or w.max_num_seqs or 256 for w in self.members.token_pool)

    def _progress(self, ticket: Ticket, step: Step) -> None:
        if ticket.first_token_at is None:
            self.admission.first_token(ticket)
            # the engine's probe, after the prefill (an exact predictor keeps its own)
            if step.predicted_tokens is not None and self.predictor.refinable:
                self.admission.refine(ticket, step.predicted_tokens)
        ticket.produced = step.usage.completion_tokens  # one sequence (n > 1 is a _Fanout)

    def _ended(self, ticket: Ticket, hints: PredictInput, finished: bool) -> None:
        """The request's end: its slot frees; the length of one that ``finished`` (every
        choice by stop or length) is what the predictor learns from (online adaptation)."""
        actual = ticket.produced if finished else None
        self.admission.release(ticket, actual)
        if actual is None:
            return
        self.predictor.observe(hints, actual)
        if self.predictor.refit_due() and (self._refitting is None or self._refitting.done()):
            self._refitting = asyncio.ensure_future(asyncio.to_thread(self.predictor.maybe_refit))

    def router_stats(self) -> RouterStats:
        members = self.members
        return RouterStats(
            dict(self._stats.decisions),
            self._stats.index_unavailable,
            resumes=dict(self.dispatcher.resumes),
            worker_states={w.name: members.state_of(w.name) for w in members.all_workers},
            missed_polls=dict(self.missed_polls),
            migrations=self.dispatcher.migrations,
            scheduling=self._scheduling_stats(),
            control=self.control,
        )

    def _scheduling_stats(self) -> dict[str, Any]:
        stats = self.admission.stats()
        stats["predictor"] = self.predictor.name
        if online := self.predictor.stats():
            stats["online"] = online
        return stats

    @property
    def admin(self) -> ControllerAdmin | None:
        """The operator's calls on the controller (None without one: /admin answers 501)."""
        controller = self.members.controller
        return ControllerAdmin(controller) if controller is not None else None

    async def aclose(self) -> None:
        for task in (self._poller, self._follower):
            if task is not None:
                task.cancel()
        await self.dispatcher.aclose()

    # -- internals -------------------------------------------------------------------------------

    async def _route_request(self, ids: list[int], cache_salt: str | None) -> RouteRequest:
        req = RouteRequest(len(ids), self.block_size, index_available=self.index is not None)
        if self.index is None:
            return req
        req.hashes = prefix_block_hashes(ids, self.block_size, cache_salt)
        if not req.hashes:
            return req
        from engine.prefix_index import IndexUnavailable

        try:
            held = await self._lookups.lookup(req.hashes)
        except IndexUnavailable as exc:
            self._stats.index_unavailable += 1
            logger.debug("prefix index unavailable, routing by load: %s", exc)
            req.index_available = False
            return req
        names = {w.index_id: w.name for w in self.members.workers if w.index_id}
        req.cached_tiers = {names[k]: tiers for k, tiers in held.items() if k in names}
        for worker, n in self._recently_sent(req.hashes).items():  # computed there: on device
            req.cached_tiers[worker] = DEVICE * n + req.cached_tiers.get(worker, "")[n:]
        return req

    def _remember(self, hashes: list[bytes], worker: str) -> None:
        expiry = time.monotonic() + self.recent_ttl_s
        for h in hashes:
            self._recent[h] = (worker, expiry)
            self._recent.move_to_end(h)
        while len(self._recent) > self.recent_max_blocks:
            self._recent.popitem(last=False)

    def _recently_sent(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading blocks of ``hashes`` this router sent to one worker in the last
        ``recent_ttl_s`` (a prefix in flight: computed there soon, not yet in the index)."""
        now = time.monotonic()
        worker, n = None, 0
        for h in hashes:
            entry = self._recent.get(h)
            if entry is None or entry[1] < now or (worker is not None and entry[0] != worker):
                break
            worker, n = entry[0], n + 1
        return {worker: n} if worker is not None else {}

    def _place_ticket(self, req: RouteRequest, disagg: bool, ticket: Ticket):
        """Place the request holding ``ticket``: (prefill name or None, decode name, reason);
        its predicted work counts on the decode worker from now on."""
        p, d, reason = self._place(req, disagg, set())
        ticket.worker = d
        if self._work is not None:  # until the next full sum (_predicted_work)
            self._work[d] += ticket.remaining()
        self._stats.decisions[reason] += 1
        return p, d, reason

    def place_again(self, req: RoutedRequest) -> tuple[str | None, str]:
        """A retry's or a resume's placement (the dispatcher's ``Placer``): the policy again,
        on the same kind of pool, the workers that failed it excluded. A request its caller
        placed itself (pinned to named workers: scripts and tests) carries no route: the
        policy places it by load alone."""
        route = req.route
        if route is None:
            route = RouteRequest(len(req.prompt_ids), self.block_size, index_available=False)
        # a turn prefilled on a decode worker (local_prefill) is retried as the cluster runs
        # requests: disaggregated when it has no colocated workers
        disagg = not req.colocated or not self.members.colocated
        p, d, _ = self._place(route, disagg, req.avoid)
        return p, d

    def _place(self, req: RouteRequest, disagg: bool, avoid: set[str]):
        """(prefill name or None, decode name, reason) by the policy, ``avoid`` excluded (all
        of a pool when every worker is to be avoided: better the same one than none)."""

        def pool(workers: list[WorkerRef]) -> list[WorkerView]:
            if not workers:  # every one of the role is dead or suspect now
                raise no_live_workers()
            return self._views([w for w in workers if w.name not in avoid] or workers)

        if disagg:
            decode = pool(self.members.decode)
            local = self._local_prefill(req, [v for v in decode if v.name not in avoid])
            if local is not None:
                return None, local, "local_prefill"
            p, reason = self.policy.choose_prefill(req, pool(self.members.prefill))
            d, _ = self.policy.choose_decode(req, decode)
            return p, d, reason
        colocated = self.members.colocated
        if len(colocated) == 1:
            return None, colocated[0].name, "only_worker"
        d, reason = self.policy.choose_prefill(req, pool(colocated))
        return None, d, reason

    def _local_prefill(self, req: RouteRequest, decode: list[WorkerView]) -> str | None:
        """Of ``decode``, the worker that holds the most of this prompt (at any tier) when what
        it lacks is at most ``local_prefill_tokens`` and its last stats show room for that and
        the predicted answer; None when none does or the setting is 0."""
        if self.local_prefill_tokens <= 0 or not req.cached_tiers:
            return None
        best, most = None, 0
        for w in decode:
            cached = req.cached_tokens(w.name)
            missing = req.prompt_len - cached
            if cached <= most or missing > self.local_prefill_tokens:
                continue
            need = -(-(missing + (req.predicted_output_tokens or 0)) // req.block_size)
            if w.free_blocks is not None and w.free_blocks < need:
                continue  # full: a prefill worker and a reservation elsewhere
            best, most = w.name, cached
        return best

    def _remember_answer(self, req: RoutedRequest, answer: list[int]) -> None:
        """A finished request's prompt and answer are in its decode worker's pool: a next turn
        that starts with them finds that worker at once (the index hears of them a publish
        interval later). The last token has no KV yet."""
        ids = req.prompt_ids + answer
        self._remember(prefix_block_hashes(ids[:-1], self.block_size, req.cache_salt), req.decode)

    def _views(self, pool) -> list[WorkerView]:
        # One candidate leaves the policy no choice: its load is not worth computing.
        work = self._predicted_work() if len(pool) > 1 else None
        views = []
        for w in pool:
            s = self._polled.get(w.name, {})
            views.append(
                WorkerView(
                    w.name,
                    w.role,
                    outstanding=w.outstanding,
                    queued_prefill_tokens=self._queued[w.name],
                    free_blocks=s.get("free_blocks", 0) + s.get("cached_blocks", 0) if s else None,
                    running=s.get("running", 0),
                    waiting=s.get("waiting", 0),
                    predicted_work=work.get(w.name, 0.0) if work else None,
                    tier_load=self._tier_load(w.name),
                )
            )
        return views

    def _tier_load(self, name: str) -> dict[str, float]:
        """The worker's lower-tier load costs relative to recompute, from its last stats."""
        return load_fractions((self._polled.get(name, {}).get("kv_tiers") or {}).get("costs"))

    def _predicted_work(self) -> collections.Counter[str] | None:
        """Per worker, the output tokens this router's running requests there are still
        predicted to produce (None without a predictor). Summing ``remaining()`` over every
        running request for each placement made a burst quadratic: 1000 requests at once kept
        the gateway busy for seconds before it streamed a token (2.5 ms per placement at 500
        running), so the sum is kept ``work_ttl_s`` and placements add to it."""
        if isinstance(self.predictor, NoPredictor):
            return None
        now = time.monotonic()
        if self._work is None or now - self._work_at > self.work_ttl_s:
            self._work = collections.Counter()
            for t in self.admission.running:
                self._work[t.worker] += t.remaining()
            self._work_at = now
        return self._work

    def _release(self, worker: str, tokens: int) -> None:
        self._queued[worker] -= tokens
        if self._queued[worker] <= 0:
            del self._queued[worker]

    async def _poll(self) -> list[str]:
        """Every worker's health and stats, each call under its own ``stats_timeout_s``. A
        worker whose ``health()`` (answered without its engine thread) does not come back in
        time, or reports an engine step older than ``hang_after_s``, misses a poll
        (``missed_polls``); after ``suspect_after_polls`` in a row it is suspect: nothing new
        goes there until it answers again. Its stats may lag behind a long step without that
        counting against it (it keeps its last view). A worker whose actor is dead is no longer
        routed to, at once. The controller hears of both (it checks, publishes the state for
        every router, and removes a dead worker from the prefix index). Returns the workers
        that missed this poll."""
        from ray.exceptions import RayActorError

        async def call(method):
            try:
                return await within(control(method).remote(), self.stats_timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported per worker below
                return exc

        # a worker still loading its model answers nothing until it is up: it is STARTING in
        # the table (routed nothing), not a silent one to suspect
        workers = [w for w in self.members.workers if w.state != WorkerState.STARTING]
        results = await asyncio.gather(
            *(call(m) for w in workers for m in (w.handle.health, w.handle.stats))
        )
        names = {w.name for w in workers}
        self._polled = {k: v for k, v in self._polled.items() if k in names}
        silent = []
        for i, w in enumerate(workers):
            health, stats = results[2 * i], results[2 * i + 1]
            if isinstance(stats, dict):
                self._polled[w.name] = stats
            dead = next((r for r in (health, stats) if isinstance(r, RayActorError)), None)
            if dead is not None:
                silent.append(w.name)
                self.members.forget(w.name, str(dead).splitlines()[0])
                self._polled.pop(w.name, None)
                continue
            if isinstance(health, dict) and health.get("step_age_s", 0.0) <= self.hang_after_s:
                self.missed_polls.pop(w.name, None)
                self.members.clear(w.name, "stats")
                continue
            silent.append(w.name)
            self.missed_polls[w.name] += 1
            logger.debug("health of %s: %r", w.name, health)
            if self.missed_polls[w.name] >= self.suspect_after_polls:
                why = (
                    f"an engine step running for {health['step_age_s']:.1f} s"
                    if isinstance(health, dict)
                    else f"{self.missed_polls[w.name]} health polls unanswered"
                )
                self.members.suspect(w.name, "stats", why)
        return silent

    def watch(self) -> None:
        """Follow the workers (health and stats polls, the controller's table) from the running
        event loop, if not already: ``open`` and ``healthy`` call it, and so do callers that
        send requests past ``open`` (``LocalCluster``'s pinned ones). Idempotent."""
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll_forever())
        if self.members.controller is not None and (
            self._follower is None or self._follower.done()
        ):
            self._follower = loop.create_task(self.members.follow())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll()
            except Exception as exc:  # noqa: BLE001 - e.g. membership mid-change: next round
                logger.debug("stats poll failed: %s", exc)
            self.admission.kick()  # the pool may have grown
            if time.monotonic() - self._reported_at >= self.report_interval_s:
                self._reported_at = time.monotonic()
                await self._report_load()
            await asyncio.sleep(self.stats_interval_s)

    async def _report_load(self) -> None:
        controller = self.members.controller
        if controller is None:
            return
        load = {"running": len(self.admission.running), "queued": len(self.admission.queue)}
        try:
            call = controller.report_load.remote(self.router_id, load)
            self.control = await within(call, self.stats_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the controller restarting: next round
            logger.debug("load report failed: %s", exc)


@dataclass(frozen=True)
class _Charge:
    """Prefill work a placement queued on a worker, in tokens recomputed (``_queued``)."""

    worker: str
    tokens: int


class ControllerAdmin:
    """The gateway's /admin calls (``router.backend.Admin``) on the controller's actor handle.
    The controller's own errors come back as Ray raises them (its ValueError for a bad worker
    name or setting inside a RayTaskError)."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    async def migrate(
        self,
        request_id: str | None = None,
        *,
        to: str | None = None,
        from_: str | None = None,
        count: int = 1,
    ) -> list[Any]:
        call = self._controller.migrate.remote(
            request_id=request_id, to=to, from_=from_, count=count
        )
        return await call

    async def drain(self, worker: str, deadline_s: float) -> dict[str, Any]:
        return await self._controller.drain.remote(worker=worker, deadline_s=deadline_s)

    async def undrain(self, worker: str) -> Any:
        return await self._controller.undrain.remote(worker=worker)

    async def rebalance(
        self,
        *,
        mode: str | None = None,
        high: float | None = None,
        low: float | None = None,
        interval_s: float | None = None,
        max_moves: int | None = None,
    ) -> dict[str, Any]:
        given = {"mode": mode, "high": high, "low": low, "interval_s": interval_s}
        given["max_moves"] = max_moves
        settings = {k: v for k, v in given.items() if v is not None}
        return await self._controller.rebalance.remote(**settings)

    async def rebalance_once(self) -> list[dict[str, Any]]:
        return await self._controller.rebalance_once.remote()


class _Generation:
    """One request's steps; the first is fetched by ``start`` (errors before any token raise
    there). Its queued prompt tokens (``charge``) go back once, at the first step or at the
    end; each step is the request's progress to admission; its slot goes back once, at the
    end (``ClusterBackend._ended``)."""

    def __init__(
        self,
        backend: ClusterBackend,
        req: RoutedRequest,
        gen: AsyncIterator[Step],
        placement: Placement,
        charge: _Charge,
    ) -> None:
        self.placement = placement
        self._backend, self._req, self._gen = backend, req, gen
        self._charge: _Charge | None = charge
        self._slot_returned = False
        self._first: Step | None = None
        self._clean = True  # no choice finished other than by stop or length
        self._closed = False
        # its tokens, kept when a next turn may be prefilled where they are (local_prefill):
        # a disaggregated request's, or one that turn was itself
        on_decode = req.prefill is not None or placement.reason == "local_prefill"
        self._answer: list[int] | None = (
            [] if backend.local_prefill_tokens > 0 and on_decode else None
        )

    def _ending(self, finished: bool) -> None:
        """Once: the request's slot is given back (``finished``: it ran to its end)."""
        if not self._slot_returned:
            self._slot_returned = True
            if finished and self._answer is not None:
                self._backend._remember_answer(self._req, self._answer)
            self._backend._ended(self._req.ticket, self._req.hints, finished and self._clean)

    def _settle(self) -> None:
        if self._charge is not None:
            self._backend._release(self._charge.worker, self._charge.tokens)
            self._charge = None

    async def start(self) -> None:
        try:
            self._first = await self._next()
        except BaseException:
            await self.aclose()
            raise
        finally:
            self._settle()

    async def _next(self) -> Step:
        try:
            step = await self._gen.__anext__()
        except StopAsyncIteration:
            raise ClusterError("the request's stream ended without finishing") from None
        self._backend._progress(self._req.ticket, step)
        if self._answer is not None:
            for c in step.choices:
                self._answer.extend(c.token_ids)
        for c in step.choices:
            if c.finish_reason is not None and c.finish_reason not in ("stop", "length"):
                self._clean = False
        if step.finished:
            self._ending(True)
        return step

    async def outputs(self) -> AsyncIterator[Step]:
        step = self._first
        while step is not None:
            yield step
            if step.finished:
                return
            step = await self._next()

    async def aclose(self) -> None:
        self._settle()
        self._ending(False)
        if not self._closed:
            self._closed = True
            await self._gen.aclose()


class _Fanout:
    """``n`` single-sample generations presented as one request with ``n`` choices (choice i
    is child i). Each child is read as fast as it goes; a step of the fanout is everything the
    children gained since the last one (each child's steps merged), the last one when all
    finished."""

    def __init__(self, request_id: str, children: list[_Generation]) -> None:
        self.request_id = request_id
        self.children = children
        self.placement = children[0].placement

    async def outputs(self) -> AsyncIterator[Step]:
        latest: list[Step | None] = [None] * len(self.children)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, child: _Generation) -> None:
            try:
                async for step in child.outputs():
                    await queue.put((i, step))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the reader
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(self.children)]
        try:
            while not all(s is not None and s.finished for s in latest):
                items = [await queue.get()]
                while not queue.empty():  # what the children gained meanwhile comes along
                    items.append(queue.get_nowait())
                failed = next((x for _, x in items if isinstance(x, BaseException)), None)
                steps = [(i, x) for i, x in items if not isinstance(x, BaseException)]
                if failed is None or steps:
                    yield self._merge(latest, steps)
                if failed is not None:
                    raise failed
        finally:
            for t in tasks:
                t.cancel()

    def _merge(self, latest: list[Step | None], steps: list[tuple[int, Step]]) -> Step:
        """One step of the fanout from its children's (each child's choice 0 is choice i)."""
        choices = []
        for i, step in steps:
            latest[i] = step
            choices += [replace(c, index=i) for c in step.choices]
        started = [s for s in latest if s is not None]
        usage = Usage(
            started[0].usage.prompt_tokens,
            sum(s.usage.completion_tokens for s in started),
            min(s.usage.cached_tokens for s in started),
        )
        predicted = next((s.predicted_tokens for _, s in reversed(steps)), None)
        finished = all(s is not None and s.finished for s in latest)
        return Step(merge_choices(choices), usage, finished, predicted)

    async def aclose(self) -> None:
        for child in self.children:
            await child.aclose()
