"""The step API every role wraps: add requests, step, abort, read outputs.

A request's life in one engine::

    1. add_request   validate params, tokenize, check the context length; n > 1 becomes n
                     sequences (children) that share the prompt's blocks through the prefix cache
    2. waiting       admitted by the scheduler when budget, max_num_seqs and blocks allow
                     (prefix hits skip their tokens; a prefix found in a lower KV tier is
                     loaded first, the request out of the batch in LOADING meanwhile)
    3. running       prompt chunks, then one token per step; may be preempted (back to 2, its
                     KV recomputed later) when blocks run out
    4. each step     sampled tokens are detokenized incrementally; stop strings end a sequence
    5. finished      stop / length / abort: blocks freed at once, a final RequestOutput emitted
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import SequenceText
from engine.grammar import DEFAULT_BACKEND, Grammars, make_backend
from engine.kv_tiers import STAGING_BLOCKS, BlockLayout, DiskTier, KVTiers, kv_identity
from engine.length_probe import LengthProbe, model_shape, shipped_for
from engine.messages import Delta
from engine.model_runner import LaunchedStep, ModelRunner
from engine.outputs import CompletionOutput, RequestOutput, SampledToken
from engine.parallel import RankFailure, TPGroup, device_name, tp_layout
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.step_inputs import GatheredLayerHook
from engine.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from engine.tp_ranks import LocalRanks, RayRanks
from engine.tracing import StepLog

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


class StepObserver(Protocol):
    """Sees every step around its forward pass (the prefill worker's KV streamer)."""

    def begin_step(self, out: SchedulerOutput) -> Callable[[int], None] | GatheredLayerHook | None:
        """Called before the forward pass; may return a per-layer hook for it (a
        ``GatheredLayerHook`` gets every KV head of its slots, at any tensor-parallel size)."""

    def end_step(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> None:
        """Called after sampling, before the scheduler applies the sampled tokens."""


@dataclass
class _Sequence:
    """Engine-side state of one child sequence: its scheduler request and its text."""

    request: Request
    output: CompletionOutput
    text: SequenceText | None  # None: the engine does not detokenize
    num_emitted: int = 0  # token ids already handed out in a delta
    finish_emitted: bool = False
    base: int = 0  # output position of its first token here (tokens carried in come before)


@dataclass
class _InFlight:
    """A scheduled step: queued on the device (``launched``), or already run by isolating a
    fault (``sampled``, and the groups it failed)."""

    out: SchedulerOutput
    launched: LaunchedStep | None
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    faulted: list[_Group] = field(default_factory=list)
    observer: StepObserver | None = None  # the step observer that saw it begin


@dataclass
class _Group:
    """A client request: ``n`` sequences with one id and one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    arrival_time: float
    first_token_time: float | None = None
    finished: bool = False
    dirty: set[int] = field(default_factory=set)
    error: str | None = None  # it failed alone in a step (the message its client gets)
    predicted: tuple[float, float, float] | None = None  # the length probe's, after prefill
    prompt_hidden: dict | None = None  # {layer: hidden} at the last prompt token, when asked


def _queue_time(group: _Group, output_token_ids: Sequence[int]) -> float:
    """A request's place among those of its priority: its arrival, except that a request that
    continues output produced elsewhere (resumed after its worker failed, or moved) goes ahead
    of every new one: its client is mid-stream, waiting, and a new request has not started."""
    return float("-inf") if output_token_ids else group.arrival_time


class LLMEngine:
    def __init__(self, cfg: EngineConfig, ranks: type[LocalRanks | RayRanks] = LocalRanks):
        """``ranks``: how the other tensor-parallel ranks start (``tensor_parallel_size`` > 1):
        child processes of this one, or a worker's Ray actors beside it."""
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model_dir)
        max_len = self.model_config.max_model_len
        if cfg.max_model_len is not None:
            if cfg.max_model_len > max_len:
                raise ValueError(
                    f"max_model_len={cfg.max_model_len} exceeds the model's limit of {max_len} tokens"
                )
            max_len = cfg.max_model_len
        self.max_model_len = max_len
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.eos_token_ids = tuple(eos_token_ids(cfg.model_dir, self.tokenizer)) or (
            self.model_config.eos_token_ids
        )
        self.length_probe = self._load_probe(cfg.length_probe)
        capture = self._capture_layers()
        self.ranks: LocalRanks | RayRanks | None = None  # the other TP ranks
        # called (from a watcher thread) when a TP rank is gone; a worker ends its process
        self.on_rank_failure: Callable[[str], None] | None = None
        self.runner = self._make_runner(max_len, ranks)
        # every rank's process and device, rank 0 first (``tandem status``): fixed from here on
        rank0 = {"rank": 0, "pid": os.getpid(), "device": device_name(str(self.runner.device))}
        self.rank_table = [rank0, *(self.ranks.describe() if self.ranks is not None else [])]
        self.runner.capture_layers = capture
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching
        )
        self.tiers = self._make_tiers() if cfg.kv_tiers_enabled else None
        self.block_manager.record_full = self.tiers is not None
        sched_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len)
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self.tiers)
        self._groups: dict[str, _Group] = {}
        self._seq_owner: dict[str, tuple[_Group, _Sequence]] = {}
        self._ids = itertools.count()
        self.step_observer: StepObserver | None = None
        # Async scheduling (EngineConfig.async_scheduling): the step queued on the device while
        # the next is prepared, and outputs the next ``step`` call hands out.
        self._inflight: _InFlight | None = None
        self._ready: list = []
        self._grammars: Grammars | None = None  # structured outputs, made on first use
        self.grammar_errors = 0  # requests ended by their grammar's failure
        # "cumulative": RequestOutputs of every request that progressed; "final": of the
        # requests that finished only (LLM.generate, which keeps nothing else: the per-step
        # copies of every running request's tokens are host time beside the device, ~20 us a
        # request a step); "delta": Deltas, what changed since the last one (workers:
        # per-request bytes on the wire stay O(tokens)).
        self.output_kind = "cumulative"
        self._step_log = StepLog.from_env()  # TANDEM_STEP_LOG: a line per step, to compare runs

    def _make_runner(self, max_len: int, ranks: type[LocalRanks | RayRanks]) -> ModelRunner:
        """One device's runner, or rank 0's of ``tensor_parallel_size`` (a layout that does not
        divide is refused before any rank starts)."""
        cfg, size = self.cfg, self.cfg.tensor_parallel_size
        if size == 1:
            return ModelRunner(cfg, self.model_config, max_len)
        tp_layout(self.model_config, size)
        self.ranks = ranks(cfg, max_len, size)
        self.ranks.on_death = self._rank_died
        try:
            tp = TPGroup(self.ranks.rendezvous, 0, cfg.device)
            runner = ModelRunner(cfg, self.model_config, max_len, tp)
            self.ranks.joined()
            return runner
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(stopped=False)
            raise

    def _rank_died(self, why: str) -> None:
        """A TP rank is gone: no step can run any more (the next one raises RankFailure)."""
        tp = getattr(getattr(self, "runner", None), "tp", None)
        if tp is not None and tp.failed is None:
            tp.failed = why
        if self.on_rank_failure is not None:
            self.on_rank_failure(why)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device)."""
        stopped = self.runner.close()
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        if self.ranks is not None:
            self.ranks.close(stopped)
            self.ranks = None

    def _make_tiers(self) -> KVTiers:
        """The host and disk KV tiers under the device pool (EngineConfig.kv_offload_*), their
        load costs and the recompute cost measured now."""
        cfg, mc = self.cfg, self.model_config
        caches = self.runner.kv_caches
        layout = BlockLayout(
            mc.num_layers, mc.num_kv_heads, cfg.block_size, mc.head_dim, caches[0].dtype
        )
        host_slots = int(cfg.kv_offload_cpu_gb * (1 << 30) // layout.nbytes)
        if cfg.kv_offload_cpu_gb and host_slots < 1:
            raise ValueError(
                f"kv_offload_cpu_gb={cfg.kv_offload_cpu_gb} holds no block of "
                f"{layout.nbytes / 2**20:.1f} MiB; raise it or set 0"
            )
        disk = None
        if cfg.kv_offload_disk_dir:
            identity = kv_identity(mc, cfg, layout)
            disk = DiskTier(
                cfg.kv_offload_disk_dir, identity, int(cfg.kv_offload_disk_gb * (1 << 30)), layout
            )
        staging = host_slots == 0
        tiers = KVTiers(caches, layout, host_slots or STAGING_BLOCKS, disk, host_is_staging=staging)
        tiers.measure(self.runner.time_prefill())
        return tiers

    # -- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> str:
        """Queue a request; returns its id. Raises ValueError on invalid input, changing nothing.

        ``output_token_ids``: tokens this request already produced elsewhere (a request resumed
        or moved from another worker, ``n`` = 1). They are recomputed here as the prefix of its
        output, not folded into the prompt, so ``max_tokens``, ``min_tokens``, penalties and
        seeded draws all continue where they were; outputs report only the new tokens."""
        request_id, group, params = self._new_group(request_id, prompt, params, output_token_ids)
        for i in range(params.n):
            child = Request(
                f"{request_id}#{i}" if params.n > 1 else request_id,
                group.prompt_token_ids,
                params.for_child(i) if params.n > 1 else params,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=_queue_time(group, output_token_ids),
            )
            for token in output_token_ids:
                child.append_output_token(token)
            self._ask_grammar(child)
            seq = _Sequence(child, CompletionOutput(index=i), self._sequence_text(child))
            seq.base = len(output_token_ids)
            if params.logprobs is not None:
                seq.output.logprobs = []
            group.seqs.append(seq)
        for seq in group.seqs:
            self.scheduler.add_request(seq.request)
            self._seq_owner[seq.request.request_id] = (group, seq)
        self._groups[request_id] = group
        return request_id

    def _new_group(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None,
        output_token_ids: Sequence[int] = (),
    ) -> tuple[str, _Group, SamplingParams]:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_length(token_ids, params)
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise ValueError(f"top_k must be <= the vocabulary size ({vocab}), got {params.top_k}.")
        top_id = max(params.logit_bias or [-1])  # (None or a non-empty map)
        if top_id >= vocab:
            raise ValueError(
                f"logit_bias must be a map of token ids < the vocabulary size ({vocab}), got "
                f"{top_id}."
            )
        if output_token_ids:
            self._check_continuation(token_ids, output_token_ids, params)
        if params.structured is not None:
            self.structured_outputs()  # (its compile runs off this thread: _ask_grammar)
        group = _Group(request_id, text, token_ids, [], time.monotonic())
        return request_id, group, params.with_eos(self.eos_token_ids)

    # -- remote prefill (decode role) --------------------------------------------------------------

    def reserve_remote(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
        reserve_tokens: int = 0,
    ) -> list[int] | None:
        """Hold blocks for a request whose KV a prefill worker will write (its prompt, and its
        ``output_token_ids`` when it continues from output produced elsewhere), or another
        decode worker will copy (a live migration: ``reserve_tokens`` of room, its length now
        plus headroom). Returns the block table the KV goes to, or ``None`` (nothing changed)
        when the blocks or the running batch are full now. Raises ValueError on invalid input."""
        request_id, group, params = self._new_group(request_id, prompt, params, output_token_ids)
        if params.n != 1:
            raise ValueError("n > 1 is not supported on the disaggregated path; use n=1")
        request = Request(
            request_id,
            group.prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=_queue_time(group, output_token_ids),
        )
        for token in output_token_ids:
            request.append_output_token(token)
        self._ask_grammar(request)  # compiles while the prompt's KV is computed and sent
        busy = (
            len(self.scheduler.running)
            + len(self.scheduler.waiting)
            + self._count(RequestStatus.WAITING_FOR_REMOTE_KV)
        )
        if busy >= self.cfg.max_num_seqs:
            return None
        # The prompt's KV plus room for the first decode step, so admission never preempts.
        table = self.block_manager.reserve(request, max(request.num_tokens + 1, reserve_tokens))
        if table is None:
            return None
        seq = _Sequence(request, CompletionOutput(index=0), self._sequence_text(request))
        seq.base = len(output_token_ids)
        if params.logprobs is not None:
            seq.output.logprobs = []
        group.seqs.append(seq)
        self._groups[request_id] = group
        self._seq_owner[request_id] = (group, seq)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return table

    def admit_remote(
        self, request_id: str, first: SampledToken, num_cached_tokens: int = 0
    ) -> RequestOutput | list[Delta]:
        """The prompt's KV is in the reserved blocks and ``first`` is the token the prefill
        worker sampled (``num_cached_tokens`` of the prompt came from its prefix cache): the
        request runs from the next step. Returns its first output."""
        request = self._held(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        group, seq = self._seq_owner[request_id]
        request.num_computed_tokens = request.num_tokens  # the prompt (+ carried output)
        request.num_cached_tokens = int(num_cached_tokens)
        request.land_grammar(wait=True)  # (asked for at the reservation; see grammar_pending)
        request.append_output_token(first.token_id)
        self.scheduler.add_running(request)
        status = self.scheduler.check_stop(request)
        if status is not None:
            self.scheduler.finish_requests([request_id], status)
        group.first_token_time = time.monotonic()
        group.predicted = first.predicted
        if status is not RequestStatus.FINISHED_ERROR:
            self._on_token(seq, first)
        if status is not None:
            self._finish_seq(seq, request)
        return self._emit(group)

    def grammar_pending(self, request_id: str) -> Future | None:
        """The future of a held request's grammar while it is still being made (None when it
        has landed, or the request has none): its admission can wait for it without
        blocking the engine thread."""
        request = self._in_status(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        if request is None or request.grammar_pending is None:
            return None
        pending, _ = request.grammar_pending
        return None if pending.done() else pending

    def grow_remote(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Room for ``num_tokens`` in a reservation still waiting for its KV (a migration whose
        request grew while its KV was being copied): the whole block table, or None."""
        self._held(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        return self.block_manager.extend_reservation(request_id, num_tokens)

    def admit_migrated(
        self, request_id: str, output_token_ids: Sequence[int], num_computed: int, num_cached: int
    ) -> None:
        """A migrated request's KV is in its reserved blocks up to ``num_computed`` positions
        and ``output_token_ids`` is everything it produced (on other workers): it runs from the
        next step, and its outputs here start after those tokens (they were streamed there)."""
        request = self._held(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        have = request.output_token_ids
        if list(output_token_ids[: len(have)]) != have or num_computed != (
            request.num_prompt_tokens + len(output_token_ids) - 1
        ):
            raise ValueError(f"migration snapshot of {request_id!r} does not continue its request")
        request.land_grammar(wait=True)  # (asked for at the reservation: usually landed)
        for token in output_token_ids[len(have) :]:
            request.append_output_token(token)
        request.num_computed_tokens = num_computed
        request.num_cached_tokens = int(num_cached)
        self.scheduler.add_running(request)
        group, seq = self._seq_owner[request_id]
        group.first_token_time = time.monotonic()
        seq.base = len(request.output_token_ids)

    # -- migrating out (source side) ---------------------------------------------------------------

    def single_request(self, request_id: str) -> Request | None:
        """The scheduler request of ``request_id`` when it has one sequence (n = 1) here."""
        group = self._groups.get(request_id)
        return group.seqs[0].request if group is not None and len(group.seqs) == 1 else None

    def paused_request(self, request_id: str) -> Request | None:
        return self._in_status(request_id, RequestStatus.PAUSED)

    def _in_status(self, request_id: str, status: RequestStatus) -> Request | None:
        """The request ``request_id`` if it is in ``status``, else None."""
        owner = self._seq_owner.get(request_id)
        return owner[1].request if owner is not None and owner[1].request.status == status else None

    def _held(self, request_id: str, status: RequestStatus) -> Request:
        """The request ``request_id`` in ``status`` (held outside the scheduler), or KeyError."""
        request = self._in_status(request_id, status)
        if request is None:
            raise KeyError(request_id)
        return request

    def _count(self, status: RequestStatus) -> int:
        return sum(1 for _, seq in self._seq_owner.values() if seq.request.status == status)

    def not_decoding(self, request_id: str) -> str | None:
        """Why ``request_id`` is not a running, decoding request of one sequence (None: it is)."""
        group = self._groups.get(request_id)
        if group is None:
            return f"no request {request_id!r} here"
        if len(group.seqs) != 1:
            return "a request with n > 1 cannot migrate"
        request = group.seqs[0].request
        if request.status != RequestStatus.RUNNING:
            return f"request {request_id!r} is not decoding here (it waits)"
        if request.num_computed_tokens != request.num_tokens_with_pending - 1:
            return f"request {request_id!r} is mid-prefill"
        return None

    def migratable(self, request_id: str) -> Request:
        """The running, decoding request ``request_id`` (one sequence), or ValueError why not."""
        why = self.not_decoding(request_id)
        if why is not None:
            raise ValueError(why)
        return self._groups[request_id].seqs[0].request

    def pause(self, request_id: str) -> Request:
        """Take a decoding request out of the batch after a step, keeping its blocks (a
        migration's last stage); ``resume_paused`` puts it back, ``release_paused`` lets go.
        A step still running is waited for first (its outputs come with the next ``step``,
        or call ``drain`` before), so every token of the request is known."""
        self._drain()
        request = self.migratable(request_id)
        self.scheduler.detach(request_id)  # PAUSED
        return request

    def resume_paused(self, request_id: str) -> None:
        request = self.paused_request(request_id)
        if request is not None:
            self.scheduler.add_running(request)

    def release_paused(self, request_id: str) -> None:
        """The request continues elsewhere: free its blocks here, emit nothing."""
        request = self._held(request_id, RequestStatus.PAUSED)
        request.status = RequestStatus.FINISHED_ABORTED
        self.block_manager.free(request)
        group = self._groups.get(request_id)
        if group is not None:
            self._retire(group)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def num_remote_pending(self) -> int:
        return self._count(RequestStatus.WAITING_FOR_REMOTE_KV)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for seq in group.seqs:
                request = seq.request
                match request.status:
                    case RequestStatus.WAITING_FOR_REMOTE_KV | RequestStatus.PAUSED:
                        request.status = RequestStatus.FINISHED_ABORTED  # held outside the
                        self.block_manager.free(request)  # scheduler: free its blocks here
                    case status if not status.finished:
                        self.scheduler.finish_requests(
                            [request.request_id], RequestStatus.FINISHED_ABORTED
                        )
            for seq in group.seqs:
                if seq.output.finish_reason is None:
                    seq.output.finish_reason = "abort"
            self._retire(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._ready) or self._inflight is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every prompt prefix the GPU pool holds, so the next request computes its
        prompt again (benchmarks that repeat one workload; vLLM's ``reset_prefix_cache``).
        Only between requests: False, and nothing forgotten, while any is unfinished. The
        global prefix index hears of it as evictions; a lower KV tier keeps its copies."""
        if self.has_unfinished_requests():
            return False
        return self.block_manager.reset_prefix_cache()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput] | list[Delta]:
        """Run one scheduled forward pass. ``output_kind`` "cumulative": a RequestOutput for
        every request that progressed; "final": for every request that finished; "delta": a
        Delta for every sequence that progressed.

        With async scheduling the step is queued on the device and the call returns the
        outputs of the step before, which ran meanwhile; the host's work (reading and applying
        sampled tokens, stop checks, outputs, the next schedule) runs while the device works.
        A step whose sampled ids the next one needs on the host (penalties), and every step
        of an engine with a step observer, is waited for in the call that launches it."""
        if self._step_log is not None:  # (TANDEM_STEP_LOG: otherwise nothing is timed)
            t0, c0 = time.time(), time.perf_counter()
        self._land_grammars()
        sched_out = self.scheduler.schedule()
        launched = self._launch(sched_out) if not sched_out.is_empty else None
        if launched is None and self._inflight is None and self.scheduler.loading:
            self.tiers.wait(0.005)  # only loads in flight: wait for one, do not spin
        # The step before is forgotten before it is read: one whose read fails (the device
        # faulted) is not read again by every later call.
        before, self._inflight = self._inflight, launched
        if before is not None:  # the step before, run while this one was prepared
            self._ready += self._finish(before)
        if launched is not None and launched.launched is not None:
            # Its grammar rows' tokens of the step before are accepted now: their masks are
            # filled (while the forward pass runs on a GPU) and the sampling queued behind it.
            self._sample(launched)
        if launched is not None and not self._may_overlap(launched):
            self._drain()
        outputs, self._ready = self._ready, []
        if self._step_log is not None and not sched_out.is_empty:
            self._step_log.record(
                t0, time.perf_counter() - c0, sched_out.scheduled, len(sched_out.preempted)
            )
        return outputs

    def _land_grammars(self) -> None:
        """Queued requests whose grammar compiled since wait to be admitted; one whose compile
        failed ends with the error."""
        for request in self.scheduler.land_grammars():
            group, seq = self._seq_owner[request.request_id]
            self._finish_seq(seq, request)
            self._ready += self._outputs([group])

    def _outputs(self, groups: Sequence[_Group]) -> list[RequestOutput] | list[Delta]:
        if self.output_kind == "delta":
            return [d for g in groups for d in self._make_deltas(g)]
        if self.output_kind == "final":
            groups = [g for g in groups if all(s.output.finished for s in g.seqs)]
        return [self._make_output(g) for g in groups]

    def drain(self) -> list[RequestOutput] | list[Delta]:
        """Wait for the step still running (async scheduling) and return every output not
        handed out yet: afterwards each request's tokens are all known."""
        self._drain()
        outputs, self._ready = self._ready, []
        return outputs

    def has_work(self) -> bool:
        """Whether ``step`` has something to do: a request to schedule, a step running, or
        outputs to hand out."""
        return (
            self.scheduler.has_unfinished_requests()
            or self._inflight is not None
            or (bool(self._ready))
        )

    def _drain(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._ready += self._finish(inflight)

    def _may_overlap(self, step: _InFlight) -> bool:
        """Whether the next step may be scheduled while ``step`` runs: not when a request it
        samples for needs that token's id on the host to sample its next one (penalties count
        it). A grammar needs it too, but only to mask the next step's sampling, which waits
        for the step before (``ModelRunner.sample``): the forward pass goes ahead."""
        return (
            self.cfg.async_scheduling
            and step.launched is not None
            and step.observer is None
            and not any(c.samples and c.request.params.uses_penalties for c in step.out.scheduled)
        )

    def _launch(self, sched_out: SchedulerOutput) -> _InFlight:
        observer = self.step_observer
        hook = observer.begin_step(sched_out) if observer is not None else None
        try:
            # A step with constrained rows queues its forward pass only: its sampling waits for
            # the step before's tokens to be in their grammars (step() queues it then).
            constrained = any(
                c.samples and c.request.params.structured is not None for c in sched_out.scheduled
            )
            launched = self.runner.launch(sched_out, hook, sample=not constrained)
            if self.tiers is not None:  # queued behind the step that fills them
                self.tiers.save(self.block_manager.drain_full())
            return _InFlight(sched_out, launched, observer=observer)
        except Exception as exc:
            if self.tiers is not None:
                self.block_manager.drain_full()  # a faulted step's blocks are not copied down
            if observer is not None or isinstance(exc, RankFailure):
                # its hooks already streamed layers of this step, or the TP ranks are out of
                # step: no re-execution
                raise
            self._drain()  # the step before may hold this one's inputs: know them first
            sampled, culprits = self._isolate(sched_out.scheduled, exc)
            return _InFlight(sched_out, None, sampled, self._fail_culprits(culprits, exc))

    def _sample(self, step: _InFlight) -> None:
        """Queue a launched step's sampling; a fault there is isolated as ``_launch``'s (the
        step before is read already, so every input of this one is known)."""
        try:
            self.runner.sample(step.launched)
        except Exception as exc:
            if step.observer is not None:
                raise
            step.launched = None
            step.sampled, culprits = self._isolate(step.out.scheduled, exc)
            step.faulted = self._fail_culprits(culprits, exc)

    def _finish(self, step: _InFlight) -> list[RequestOutput] | list[Delta]:
        """Read a launched step's sampled tokens and apply them: progress, stops, outputs."""
        sched_out, faulted = step.out, step.faulted
        sampled = self.runner.collect(step.launched) if step.launched is not None else step.sampled
        if self.runner.capture_layers:
            self._on_prompt_hidden(sampled)
        if step.observer is not None:  # the one that saw it begin (a role may switch between)
            step.observer.end_step(sched_out, sampled)
        token_ids = {rid: t.token_id for rid, t in sampled.items()}
        progressed, finished = self.scheduler.update_from_output(sched_out, token_ids)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for request in progressed:
            group, seq = self._seq_owner[request.request_id]
            group.first_token_time = group.first_token_time or now
            if request.status is not RequestStatus.FINISHED_ERROR:  # (its token is not sent)
                self._on_token(seq, sampled[request.request_id])
            touched[group.request_id] = group
        for request in finished:
            group, seq = self._seq_owner[request.request_id]
            self._finish_seq(seq, request)
            touched[group.request_id] = group
        if self.output_kind == "delta":
            errors = [Delta(g.request_id, error=g.error) for g in faulted]
            return errors + [d for g in touched.values() for d in self._make_deltas(g)]
        return self._outputs([*faulted, *touched.values()])

    def _isolate(
        self, chunks: list, exc: Exception
    ) -> tuple[dict[str, SampledToken], list[Request]]:
        """The step's forward pass raised: find out whether one request causes it. The chunks
        are run again in halves (a chunk's KV writes and draws are the same each time it runs:
        its blocks are its own, its seeded draws a function of its position): the half that
        fails is split again until one request fails alone; the others' tokens are kept. When
        both halves of a split fail the fault is the engine's, not one request's, and it is
        raised. Returns (tokens of the chunks that ran, the culprit requests)."""
        sampled: dict[str, SampledToken] = {}
        failing = chunks
        while len(failing) > 1:
            half = len(failing) // 2
            failed = []
            for part in (failing[:half], failing[half:]):
                try:
                    sampled.update(self.runner.execute(SchedulerOutput(scheduled=part), None))
                except Exception:  # noqa: BLE001 - narrowing down
                    failed.append(part)
            if len(failed) == 2:
                raise exc
            if not failed:  # it does not fail again: a transient fault, nothing to blame
                return sampled, []
            failing = failed[0]
        return sampled, [failing[0].request]

    def _fail_culprits(self, culprits: list[Request], exc: Exception) -> list[_Group]:
        """End the groups of ``culprits`` with an error (their blocks are freed); the message
        names an error id, the traceback goes to the log under it."""
        groups = []
        for request in culprits:
            group, _ = self._seq_owner[request.request_id]
            error_id = secrets.token_hex(4)
            logger.error(
                "request %s failed alone in the engine (error id %s)",
                group.request_id,
                error_id,
                exc_info=exc,
            )
            self.abort_request(group.request_id)
            group.error = (
                f"the request failed in the engine ({type(exc).__name__}, error id {error_id})"
            )
            groups.append(group)
        return groups

    def _load_probe(self, where: str | None) -> LengthProbe | None:
        """``where``: a probe's path, ``auto`` (the shipped probe trained on this model's
        shape, when there is one), or None / ``none``."""
        if where is None or where == "none":
            return None
        if where == "auto":
            mc = self.model_config
            found = shipped_for(model_shape(mc.vocab_size, mc.hidden_size, mc.num_layers))
            if found is None:
                logger.info("length probe: none shipped for this model; router estimates only")
                return None
            where = str(found)
        return LengthProbe.load(where)

    def _capture_layers(self) -> tuple[int, ...]:
        """The hidden states the runner keeps at each prompt's last token: the probe's layers
        and ``prompt_hidden_layers``. Raises ValueError on a layer the model does not have."""
        mc = self.model_config
        if self.length_probe is not None:
            self.length_probe.check(mc.hidden_size, mc.num_layers)
        asked = self.cfg.prompt_hidden_layers
        bad = [i for i in asked if not -1 <= i < mc.num_layers]
        if bad:
            raise ValueError(
                f"prompt_hidden_layers {bad} out of range: -1 (after the final norm) or a layer "
                f"in [0, {mc.num_layers})"
            )
        probe = self.length_probe.layers if self.length_probe is not None else ()
        return tuple(dict.fromkeys((*probe, *asked)))

    def _on_prompt_hidden(self, sampled: dict[str, SampledToken]) -> None:
        """Requests whose prompt completed this step: the probe's estimate goes on the first
        token (which a prefill worker sends on with the KV), and onto the group's outputs."""
        for rid, hidden in self.runner.take_prompt_hidden().items():
            owner, token = self._seq_owner.get(rid), sampled.get(rid)
            if owner is None or token is None:
                continue  # failed alone in this step
            group, seq = owner
            if self.length_probe is not None:
                token.predicted = self.length_probe.predict(hidden, seq.request.num_prompt_tokens)
                group.predicted = token.predicted
            if self.cfg.prompt_hidden_layers:
                group.prompt_hidden = {i: hidden[i] for i in self.cfg.prompt_hidden_layers}

    def _on_token(self, seq: _Sequence, token: SampledToken) -> None:
        request, out = seq.request, seq.output
        out.token_ids.append(token.token_id)
        if out.logprobs is not None:
            entry = dict(token.top_logprobs or [])
            entry[token.token_id] = token.logprob
            out.logprobs.append(entry)
        if seq.text is None:
            return
        stop_token = request.status == RequestStatus.FINISHED_STOPPED
        stop = seq.text.add(token.token_id, stop_token=stop_token, stop_reason=request.stop_reason)
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            self._finish_seq(seq, request)

    def _finish_seq(self, seq: _Sequence, request: Request) -> None:
        seq.output.finish_reason = request.status.finish_reason
        seq.output.stop_reason = request.stop_reason
        if request.status is RequestStatus.FINISHED_ERROR:
            self._grammar_failed(request)

    def _grammar_failed(self, request: Request) -> None:
        """``request``'s grammar failed: its group ends with the error (its other sequences
        too: its client gets one error), the rest of the batch goes on."""
        group, _ = self._seq_owner[request.request_id]
        self.grammar_errors += 1
        spec = request.params.structured
        logger.warning(
            "request %s: its %s grammar failed: %s", group.request_id, spec.kind,
            request.grammar_error,
        )  # fmt: skip
        group.error = group.error or (
            f"the request's {spec.kind} constraint failed: {request.grammar_error}"
        )
        others = [s.request.request_id for s in group.seqs if not s.request.is_finished]
        self.scheduler.finish_requests(others, RequestStatus.FINISHED_ABORTED)
        for s in group.seqs:
            s.output.finish_reason = s.output.finish_reason or "error"

    def _make_output(self, group: _Group) -> RequestOutput:
        finished = all(s.output.finished for s in group.seqs)
        snapshots = []
        for seq in group.seqs:
            out = seq.output
            out.delta_token_ids = out.token_ids[seq.num_emitted :]
            seq.num_emitted = len(out.token_ids)
            if seq.text is not None:
                out.delta_text = seq.text.next_text(out.finished)
                out.text += out.delta_text
            snapshots.append(
                replace(
                    out,
                    token_ids=list(out.token_ids),
                    logprobs=None if out.logprobs is None else list(out.logprobs),
                )
            )
        output = RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=max(group.seqs[0].request.num_cached_tokens, 0),
            outputs=snapshots,
            finished=finished,
            arrival_time=group.arrival_time,
            first_token_time=group.first_token_time,
            predicted_tokens=group.predicted,
            prompt_hidden=group.prompt_hidden,
            error=group.error,
        )
        if finished:
            self._retire(group)
        return output

    def _emit(self, group: _Group) -> RequestOutput | list[Delta]:
        return self._make_deltas(group) if self.output_kind == "delta" else self._make_output(group)

    def _make_deltas(self, group: _Group) -> list[Delta]:
        """What each sequence of ``group`` added since its last delta (nothing is copied but
        the new tokens: per-request work and bytes stay O(tokens)); an error ends it."""
        if group.error is not None:
            self._retire(group)
            return [Delta(group.request_id, error=group.error)]
        deltas = []
        cached = max(group.seqs[0].request.num_cached_tokens, 0)
        for seq in group.seqs:
            out = seq.output
            new = out.token_ids[seq.num_emitted :]
            finish = out.finish_reason if not seq.finish_emitted else None
            if not new and finish is None:
                continue
            logprobs = out.logprobs[seq.num_emitted :] if out.logprobs is not None else None
            text = seq.text.next_text(out.finished) if seq.text is not None else ""
            first = seq.num_emitted == 0
            start = seq.base + seq.num_emitted
            seq.num_emitted = len(out.token_ids)
            seq.finish_emitted = out.finished
            deltas.append(
                Delta(
                    group.request_id,
                    new,
                    logprobs,
                    text,
                    out.index,
                    finish,
                    out.stop_reason if finish is not None else None,
                    cached if first else 0,
                    start=start,
                    predicted=group.predicted if first else None,
                )
            )
        if all(s.output.finished for s in group.seqs):
            self._retire(group)
        return deltas

    def _retire(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._seq_owner.pop(seq.request.request_id, None)

    # -- input handling ----------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model folder has no tokenizer: pass prompts as lists of token ids"
                )
            return prompt, encode_prompt(self.tokenizer, prompt)
        token_ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return None, token_ids

    def _check_length(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + (params.max_tokens or 0)} tokens ({n} in the messages, "
                f"{params.max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion."
            )

    def _check_continuation(
        self, token_ids: list[int], output_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """A request continued with output it already produced: one sequence, room left."""
        if params.n != 1:
            raise ValueError("only a request with n=1 can continue from its output tokens")
        total = len(token_ids) + len(output_token_ids)
        if total >= self.max_model_len:
            raise ValueError(f"{total} tokens leave no room in max_model_len={self.max_model_len}")
        if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} output tokens already reach max_tokens")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in output_token_ids):
            raise ValueError(f"an output token id is outside the vocabulary [0, {vocab})")

    def structured_outputs(self) -> Grammars:
        """The compiled grammars of this engine's tokenizer (made on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured outputs need the model's tokenizer; this model has none"
                )
            backend = make_backend(
                DEFAULT_BACKEND, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
            self._grammars = Grammars(backend, threads=self.cfg.grammar_compile_threads)
        return self._grammars

    def _ask_grammar(self, request: Request) -> None:
        """Have the request's grammar matcher made off this thread (compiled, caught up over
        the output it already has); the request waits for it (``Request.land_grammar``)."""
        spec = request.params.structured
        if spec is not None:
            made = self.structured_outputs().matcher_async(spec, request.output_token_ids)
            request.grammar_pending = (made, request.num_output_tokens)

    def grammar_stats(self) -> dict | None:
        """Structured outputs' counters (a worker's ``stats()["grammar"]``): compile and
        per-step mask times (``[(upper bound, count), ...]`` and their sums) and the requests
        ended by their grammar's failure; None before the first constrained request."""
        if self._grammars is None:
            return None
        compiles, masks = self._grammars.compile_seconds, self.runner.sampler.mask_seconds
        return {
            "compile_buckets": compiles.pairs(),
            "compile_sum": compiles.total,
            "mask_buckets": masks.pairs(),
            "mask_sum": masks.total,
            "errors": self.grammar_errors,
        }

    def _sequence_text(self, request: Request) -> SequenceText | None:
        if self.tokenizer is None or not self.cfg.detokenize:
            return None
        return SequenceText(self.tokenizer, request.prompt_token_ids, request.params)
