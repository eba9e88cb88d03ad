"""Continuous batching with chunked prefill and preemption by recompute. Plain Python.

One loop closes each step::

    out = scheduler.schedule()            # who runs, how many tokens each, which blocks
    sampled = model_runner.execute(out)    # one forward pass over all of them
    scheduler.update_from_output(out, sampled)

``schedule`` moves each request's ``num_computed_tokens`` past its chunk at once, and counts
the token a sampling chunk will produce as *pending*; ``update_from_output`` appends it. So the
next step can be scheduled while this one runs (the engine's async scheduling): a request whose
token is pending decodes it next (its id reaches the next step's inputs on the device), and a
request that will surely have finished by then (``max_tokens``, the context length) is left
out. A request the pending token turns out to stop has its next token dropped.

Each step has a token budget (``max_num_batched_tokens``). Running requests are served first, in
priority order: a decoding request takes 1 token, a request mid-prefill takes what is left of its
prompt up to the budget (chunked prefill), so decodes and prefill chunks share one step. When a
running request's next block does not fit, the lowest-priority running request is preempted:
its blocks are freed and it goes back to the waiting queue, in (priority, arrival) order (so at
the front under FCFS), to be recomputed later (its prefix-cached blocks usually make that
cheap). Waiting requests are admitted, best first, while the budget, ``max_num_seqs`` and the
free blocks allow, and only in steps with no preemption.

With lower KV tiers (engine.kv_tiers, the ``LowerTiers`` below), admission looks past the
device's prefix hits: the leading blocks found in host memory or on disk, when loading them is
cheaper than recomputing them, get fresh blocks and are loaded while the request waits in
``LOADING`` (out of the batch, counted against ``max_num_seqs``); the step after they land it
runs from the end of its loaded prefix. A request aborted mid-load keeps its blocks until the
load lands (a copy may still be writing them), then frees them::

    waiting --admit--> running --preempt--> waiting
       |                  ^
       +--admit--> loading  (landed: computed = device hits + loaded blocks)

Structured outputs: a request whose grammar is still compiling (off the engine thread) waits
in ``WAITING_FOR_GRAMMAR``, passed over by admission (requests behind it go first) until
``land_grammars`` finds it landed. A grammar that fails (a spec that did not compile, a token
it refuses) ends its request alone with ``FINISHED_ERROR``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LowerTiers(Protocol):
    """KV tiers below the device pool, as the scheduler sees them (engine.kv_tiers.KVTiers)."""

    def plan(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` to load (found below, cheaper than recompute)."""

    def start_load(
        self, request_id: str, hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> None:
        """Start filling ``block_ids`` with those blocks."""

    def landed(self) -> dict[str, int]:
        """Request id -> blocks loaded, for each load finished since the last call."""

    def on_preempt(self, num_full_blocks: int) -> str:
        """A preemption: ``swap`` (its blocks are below and cheap to load) or ``recompute``."""


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_tokens)`` of its sequence."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    # Whether this chunk reaches the end of the request's tokens, pending ones included (so
    # its logits are sampled); fixed when the chunk is made.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens_with_pending


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        tiers: LowerTiers | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.tiers = tiers
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # their KV coming up from a lower tier
        self._abandoned: dict[str, Request] = {}  # aborted mid-load: freed once it lands
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # in total (a metric)

    # -- queue -----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``: WAITING, or WAITING_FOR_GRAMMAR while its grammar compiles."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        needed = self.block_manager.blocks_needed(request.num_tokens + 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs {needed} KV blocks but the pool "
                f"has {self.block_manager.num_blocks}; raise num_kv_blocks or shorten the prompt"
            )
        self.requests[request.request_id] = request
        if request.grammar_pending is not None:  # (landed by the next land_grammars)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._enqueue(request)

    def land_grammars(self) -> list[Request]:
        """Requests whose grammar compiled since the last call wait to be admitted (in their
        place in the queue); one whose compile failed ends (``FINISHED_ERROR``, its error on
        its grammar). Returns those that ended."""
        ended = []
        for request in [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]:
            if not request.land_grammar():
                continue
            if request.grammar_error is not None:
                ended += self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            else:
                request.status = RequestStatus.WAITING
        return ended

    def add_running(self, request: Request) -> None:
        """Take in a request whose blocks are already held and whose KV is computed up to
        ``num_computed_tokens`` (a remote prefill finished it): it runs from the next step."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def detach(self, request_id: str) -> Request:
        """Take a running request out of the batch, its blocks still held (a migration's last
        stage: its KV is being copied out); ``add_running`` puts it back."""
        request = self.requests.pop(request_id)
        self.running.remove(request)
        request.status = RequestStatus.PAUSED
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self._abandoned)

    @property
    def num_seqs(self) -> int:
        """Requests holding a place in the batch: running, and loading to run."""
        return len(self.running) + len(self.loading)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests wherever they are (abort, stop string); frees their blocks at once, or,
        mid-load, once the load lands (a copy may still be writing them)."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.LOADING:
                del self.loading[request_id]
                self._abandoned[request_id] = request
            else:
                queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
                queue.remove(request)
                self.block_manager.free(request)
            request.status = status
            finished.append(request)
        return finished

    # -- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loading or self._abandoned:
            self._land_loads()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=Request.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if request.num_pending and self._length_capped(request, request.num_pending):
                continue  # its pending token ends it: a step for it would be thrown away
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # ``request`` itself was preempted: everything after it already was
            out.scheduled.append(self._chunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while self.block_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()  # lowest priority, latest arrival
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit from the head of the queue, passing over requests whose grammar compiles."""
        skip = 0  # requests at the head waiting for their grammar
        while len(self.waiting) > skip and budget > 0 and self.num_seqs < self.config.max_num_seqs:
            request = self.waiting[skip]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skip += 1
                continue
            if request.num_pending:
                break  # preempted while its last token was pending: it is known next step
            hits = self.block_manager.get_computed_blocks(request)
            if self.tiers is not None:
                loads = self._admit_loading(request, hits, skip)
                if loads is None:
                    break
                if loads:
                    continue
            num_hit_tokens = len(hits) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.block_manager.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.pop(skip)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            out.scheduled.append(self._chunk(request, num_hit_tokens, num_new))
            budget -= num_new

    def _admit_loading(self, request: Request, hits: list[int], at: int = 0) -> bool | None:
        """Admit ``request`` to ``LOADING`` when blocks after its prefix hits are worth loading
        from a lower tier. True: admitted; False: nothing to load (admit it as usual); None:
        its blocks do not fit now."""
        bm = self.block_manager
        limit = (request.num_tokens - 1) // bm.block_size  # one token is always computed
        below = request.block_hashes[len(hits) : limit]
        num_load = self.tiers.plan(below) if below else 0
        if not num_load:
            return False
        fresh = bm.allocate_for_load(request, hits, num_load)
        if fresh is None:
            return None
        self.waiting.pop(at)
        request.status = RequestStatus.LOADING
        request.num_computed_tokens = len(hits) * bm.block_size
        self.loading[request.request_id] = request
        self.tiers.start_load(request.request_id, below[:num_load], fresh)
        return True

    def _land_loads(self) -> None:
        """Requests whose loads landed run from the end of what arrived (a block that could
        not be read is recomputed, with every block after it)."""
        bs = self.block_manager.block_size
        for request_id, num_blocks in self.tiers.landed().items():
            abandoned = self._abandoned.pop(request_id, None)
            if abandoned is not None:
                self.block_manager.free(abandoned)
                continue
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            request.num_computed_tokens += num_blocks * bs
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _chunk(self, request: Request, start: int, num_tokens: int) -> ScheduledRequest:
        """The chunk ``[start, start + num_tokens)`` of ``request``; its progress moves past it
        now (the step writes that KV before any later step reads it)."""
        table = self.block_manager.block_table(request.request_id)
        chunk = ScheduledRequest(request, start, num_tokens, table)
        request.num_computed_tokens = start + num_tokens
        if chunk.samples:
            request.num_pending += 1
        return chunk

    def _preempt(self, request: Request) -> None:
        if self.tiers is not None:
            self.tiers.on_preempt(request.num_computed_tokens // self.block_manager.block_size)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)  # by (priority, arrival): ahead of later arrivals of its priority

    def _enqueue(self, request: Request) -> None:
        """Insert by (priority, arrival); FCFS when every priority is equal."""
        key = request.sort_key()
        pos = len(self.waiting)
        while pos > 0 and self.waiting[pos - 1].sort_key() > key:
            pos -= 1
        self.waiting.insert(pos, request)

    # -- closing the loop ------------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> tuple[list[Request], list[Request]]:
        """Take a step's sampled tokens in: ``sampled`` maps request id to the token sampled for
        every chunk that ``samples``. Returns
        (requests that got a token, requests finished by a token-level stop: eos,
        stop_token_ids, max_tokens, context length). A request that finished after the step
        was scheduled (aborted, or stopped by the step before) drops its token."""
        progressed, finished = [], []
        for chunk in out.scheduled:
            request = chunk.request
            if not chunk.samples or request.is_finished:
                continue
            request.num_pending -= 1
            request.append_output_token(sampled[request.request_id])
            progressed.append(request)
            status = self.check_stop(request)
            if status is not None:
                finished.extend(self.finish_requests([request.request_id], status))
        return progressed, finished

    def check_stop(self, request: Request) -> RequestStatus | None:
        """The token-level stop (if any) that its last output token triggers."""
        params = request.params
        token = request.output_token_ids[-1]
        if request.grammar_error is not None:
            return RequestStatus.FINISHED_ERROR  # its grammar refused the token (or failed)
        if params.structured is not None and token in params._eos_token_ids:
            # Its grammar allowed the end only because the answer is complete: nothing may
            # follow (ignore_eos and min_tokens do not apply to a structured answer).
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in params._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._length_capped(request):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _length_capped(self, request: Request, more: int = 0) -> bool:
        """Whether ``request``, ``more`` tokens from now (tokens pending: whatever their ids),
        reaches a length limit: ``max_tokens``, the context length, or the whole pool."""
        outputs, total = request.num_output_tokens + more, request.num_tokens + more
        if request.params.max_tokens is not None and outputs >= request.params.max_tokens:
            return True
        bm = self.block_manager
        return total >= self.config.max_model_len or total > bm.num_blocks * bm.block_size
