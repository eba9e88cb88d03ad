"""Runs one scheduled step on the device: inputs -> forward -> logits -> sampled tokens.

The runner owns the model and the KV cache tensors; it keeps no request state (every step's
inputs come from the SchedulerOutput, and seeded sampling is a function of each request's seed
and output position).

Under tensor parallelism (engine/parallel.py) there is one runner per rank, each with its model
shard and a KV pool of its own KV heads (as many blocks on every rank). Rank 0's runner
prepares each step from the scheduler's output (``StepInputs``), sends it to the other ranks
(engine/step_inputs.py), and all run the same forward pass in lockstep, their collectives
meeting inside it; the other ranks' runners loop in ``follow``. Rank 0 alone samples: sampling
reads per-request state (penalties' token counts, grammars, seeds, logprobs) that only its
scheduler has, and the sampled ids are all the other ranks ever need (a pending token's id, sent
on the device group), so nothing of a request's state is replicated. Between steps rank 0 can
read or write every KV head of given blocks (``read_kv_blocks`` / ``write_kv_blocks``), the
other ranks sending or taking their heads' part: one path at any tensor-parallel size for what
moves whole-model KV (P/D transfer, migration, the KV tiers).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import (
    AttentionBackend,
    ChunkSpec,
    host_to_device,
    native_cpu_kernels,
    select_backend,
)
from engine.config import EngineConfig, ModelConfig
from engine.cpu_layout import use_cpu_linears
from engine.cuda_graphs import DecodeGraphs, GraphPool, PiecewiseGraphs
from engine.models import model_class
from engine.ops import CpuOps, TritonOps, use_skinny_linears
from engine.outputs import SampledToken
from engine.parallel import RankFailure, TPGroup, tp_layout
from engine.quant import fp8_problem, quantize_model
from engine.sampler import SampledBatch, Sampler, SamplingRow
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import (
    GatheredLayerHook,
    KVBlocksOp,
    StepInputs,
    receive,
    send_kv_op,
    send_step,
    send_stop,
)
from engine.weights import init_dummy_weights, iterate_weights

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # kv_cache_dtype="fp8" (EngineConfig.kv_dtype)
}


class ModelRunner:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        max_model_len: int,
        tp: TPGroup | None = None,
    ):
        """``tp``: this rank's group when the model is split over several ranks (every rank
        builds its runner with the same settings, in step: their set-up meets in collectives)."""
        self.cfg, self.model_cfg = cfg, model_cfg
        self.tp = tp
        # held while rank 0 sends a step or a KV read / write and runs its collectives: one
        # thread at a time talks to the other ranks (``_group_turn``)
        self._turn = threading.Lock()
        self.device = torch.device(tp.device if tp is not None else cfg.device)
        self.max_model_len = max_model_len
        self.dtype = _DTYPES[cfg.dtype]
        self.kv_dtype = _DTYPES[cfg.kv_dtype]  # what the KV pool holds
        if self.device.type == "cpu" and self.dtype == torch.float16:
            raise ValueError("dtype float16 is not supported on CPU; use float32 or bfloat16")
        self.memory_report: dict[str, float] = {}  # CUDA: how the KV pool was sized
        if self.device.type == "cuda" and cfg.sm_carveout:
            # cuBLAS targets (SM count - carveout) SMs per matmul, so kernels on other streams (the
            # KV stream's NCCL sends) get SMs during a prefill instead of waiting for its GEMMs.
            # Process-wide: one engine per worker process.
            torch._C._set_sm_carveout_experimental(cfg.sm_carveout)
        if cfg.quantization == "fp8" and (problem := fp8_problem(self.device, self.dtype)):
            raise ValueError(problem)  # before loading: refused at once
        self.model = self._load_model(max_model_len)
        self.backend: AttentionBackend = select_backend(self.device, self.dtype, self.kv_dtype)
        if self.backend.name == "triton":
            self.model.ops = TritonOps()
            self.model.rope_in_attention = True  # rotary and the KV write: one kernel a layer
            if self.device.type == "cuda":
                use_skinny_linears(self.model)
        elif (kernel := native_cpu_kernels(self.device, self.dtype)) is not None:
            self.model.ops = CpuOps(kernel)  # fused elementwise layers, whatever the KV holds
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(cfg.seed))
        if self.device.type == "cuda":  # the sampler's kernels, so none compiles mid-run
            from kernels import argmax, token_bitmask

            token_bitmask.warm_up(model_cfg.vocab_size, self.device)
            argmax.warm_up(model_cfg.vocab_size, self.device, (self.dtype, torch.float32))
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv(self.num_kv_blocks)
        if self.device.type == "cuda" and self.backend.name == "triton":
            t0 = time.perf_counter()
            kv = self.kv_caches[0]
            heads = self.model.layout.num_heads
            self.backend.warm_up(kv[0], kv[1], heads, cfg.block_size, self.dtype)
            logger.info("attention kernels warmed up in %.1f s", time.perf_counter() - t0)
        # Hidden states kept at each new prompt's last token (``take_prompt_hidden``): layer i's
        # output (before the final norm), or -1: after the final norm, what feeds the LM head.
        self.capture_layers: tuple[int, ...] = ()
        self._prompt_hidden: dict[str, dict[int, np.ndarray]] = {}
        # The last launched step's sampled tokens (device) and each request's row in them: the
        # next step's inputs read the tokens still pending from there.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.steps_run = 0  # forward passes launched (on every rank: they run the same)
        # CUDA, for benchmarks: set to a list and each launch appends (start, end) events around
        # its device work; the gaps between one step's end and the next one's start are the
        # time the device waited for the host (benchmarks/gpu_async.py).
        self.timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        # CUDA graphs: whole decode steps, and every other step of up to piecewise_max_tokens
        # tokens in pieces around attention (engine/cuda_graphs.py); both share one pool.
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if self._use_graphs:
            pool = GraphPool()
            max_batch = min(cfg.max_num_seqs, cfg.cuda_graph_max_batch)
            if max_batch >= 1:
                self.graphs = DecodeGraphs(
                    self.model,
                    self.backend,
                    self.kv_caches,
                    cfg.block_size,
                    max_model_len,
                    max_batch,
                    pool,
                )
                self.graphs.capture()
            if self.piecewise_max_tokens:
                self.piecewise = PiecewiseGraphs(
                    self.model, self.backend, self.kv_caches, self.piecewise_max_tokens, pool
                )
                self.piecewise.capture()

    @property
    def _use_graphs(self) -> bool:
        cfg = self.cfg
        return (
            self.device.type == "cuda" and self.backend.name == "triton" and not cfg.enforce_eager
        )

    @property
    def piecewise_max_tokens(self) -> int:
        """Largest step (in tokens) the piecewise graphs take; 0 when they are off."""
        if not self._use_graphs:
            return 0
        return min(self.cfg.cuda_graph_max_tokens, self.cfg.max_num_batched_tokens)

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        """Per layer ``[2, kv_heads, num_blocks * block_size, head_dim]`` (attention.py) in
        ``kv_dtype``: the consecutive slices of one allocation, so the KV tiers gather a block's
        every layer in one kernel (engine.kv_tiers.BlockLayout.stacked). ``kv_heads``: this
        rank's."""
        mc = self.model_cfg
        heads = self.model.layout.num_kv_heads
        shape = (2, heads, num_blocks * self.cfg.block_size, mc.head_dim)
        pool = torch.zeros((mc.num_layers, *shape), dtype=self.kv_dtype, device=self.device)
        return list(pool.unbind(0))

    # -- set-up ----------------------------------------------------------------------------------

    def _load_model(self, max_model_len: int) -> torch.nn.Module:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = model_class(self.model_cfg)(self.model_cfg, max_model_len, tp=self.tp)
        model = model.to(dtype=self.dtype).to_empty(device=self.device)
        model.tie_weights()
        if self.cfg.load_format == "dummy":
            init_dummy_weights(model, self.cfg.seed)
        else:
            model.load_weights(iterate_weights(self.cfg.model_dir, model.tp_slice))
        if self.cfg.quantization == "fp8":  # before any pass below swaps the linears
            logger.info("fp8 weights: %d projections quantized", quantize_model(model, self.device))
        model.rotary.build(self.device)
        if self.device.type == "cpu":
            use_cpu_linears(model)
        model.eval()
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        if self.kv_dtype == torch.float8_e4m3fn:  # 1.0 unless the checkpoint has k/v_scale
            ks = [layer.self_attn.k_scale for layer in model.layers]
            vs = [layer.self_attn.v_scale for layer in model.layers]
            logger.info(
                "fp8 KV cache: k_scale %g..%g, v_scale %g..%g", min(ks), max(ks), min(vs), max(vs)
            )
        return model

    def _num_kv_blocks(self) -> int:
        """Blocks of the KV pool; under tensor parallelism the fewest any rank can hold (one
        block table addresses every rank's pool)."""
        blocks = self._kv_blocks_here()
        return self.tp.min_int(blocks) if self.tp is not None else blocks

    def _kv_blocks_here(self) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        mc, heads = self.model_cfg, self.model.layout.num_kv_heads
        block_bytes = mc.num_layers * 2 * heads * mc.head_dim * elem * self.cfg.block_size
        if self.device.type == "cuda":
            activations = self._profile_peak_activations()
            free, total = torch.cuda.mem_get_info(self.device)
            # The KV pool gets what is left of utilization x total once the weights, the CUDA
            # context and the peak of a full-budget step (measured just now) are counted.
            budget = self.cfg.gpu_memory_utilization * total - (total - free) - activations
            self.memory_report = {
                "total": total,
                "in_use": total - free,
                "activations": activations,
                "utilization": self.cfg.gpu_memory_utilization,
                "kv_budget": budget,
            }
            logger.info(
                "KV budget %.2f GiB (GPU %.1f GiB, in use %.2f GiB, activations %.2f GiB)",
                budget / 2**30,
                total / 2**30,
                (total - free) / 2**30,
                activations / 2**30,
            )
        else:
            budget = self.cfg.kv_cache_memory_gb * (1 << 30)
        # More blocks than max_num_seqs full-length sequences can use would only cost memory.
        useful = self.cfg.max_num_seqs * -(-self.max_model_len // self.cfg.block_size)
        num_blocks = min(int(budget // block_bytes), useful)
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB); raise "
                "kv_cache_memory_gb / gpu_memory_utilization or set num_kv_blocks"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_peak_activations(self) -> int:
        """Bytes a worst-case step needs beyond the weights and the KV pool: one prefill chunk
        of ``max_num_batched_tokens`` tokens, logits for ``max_num_seqs`` rows and the sampler's
        copies of them, the same logits once more for the graphs' private pool, and that pool's
        working set for the largest piecewise bucket (as much as the eager chunk, pro rata)."""
        tokens = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        rows = min(self.cfg.max_num_seqs, tokens)
        bs = self.cfg.block_size
        blocks = -(-tokens // bs)
        kv = self._allocate_kv(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        spec = ChunkSpec(0, tokens, list(range(blocks)))
        meta = self.backend.build([spec], bs, self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device)
        hidden = self.model(ids, positions, kv, meta, self.backend)
        logits = self.model.compute_logits(hidden[:rows])
        # the sampler's copies are float32 (the model's logits may not be)
        logits_bytes = logits.numel() * 4
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv, hidden, logits
        torch.cuda.empty_cache()
        graph_pool = peak * min(self.piecewise_max_tokens, tokens) // tokens
        return peak + 3 * logits_bytes + graph_pool

    @torch.inference_mode()
    def time_prefill(self, num_tokens: int | None = None) -> float:
        """Seconds per token of a prefill chunk (the second of two runs, into the first blocks
        of the empty pool: call it before serving). What recomputing a prefix costs, against
        which the KV tiers price loading it."""
        cap = self.num_kv_blocks * self.cfg.block_size
        default = 512 if self.device.type == "cuda" else 128
        tokens = max(
            1,
            min(
                num_tokens or default, self.cfg.max_num_batched_tokens, self.max_model_len - 1, cap
            ),
        )
        blocks = list(range(-(-tokens // self.cfg.block_size)))
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device)
        elapsed = 0.0
        for _ in range(2):
            meta = self.backend.build(
                [ChunkSpec(0, tokens, blocks)], self.cfg.block_size, self.device
            )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[-1:])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - t0
        return elapsed / tokens

    # -- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> dict[str, SampledToken]:
        """One forward pass and sampling, waited for. ``layer_hook(i)`` runs once layer ``i``
        has written its KV (queued on the current stream)."""
        return self.collect(self.launch(out, layer_hook))

    @torch.inference_mode()
    def launch(
        self,
        out: SchedulerOutput,
        layer_hook: Callable[[int], None] | None = None,
        *,
        sample: bool = True,
    ) -> LaunchedStep:
        """Queue one forward pass and its sampling on the device and return without waiting
        for them (``collect`` does). A token still pending in the step launched before this one
        (async scheduling) is read from that step's device tensor of sampled tokens. Under
        tensor parallelism the step goes to the other ranks first (RankFailure: one is gone).

        ``sample=False`` queues the forward pass only; ``sample(step)`` queues the sampling
        later (the engine first takes in the tokens of the step before, which grammar masks
        need), and must come before the next ``launch``."""
        marks = None
        if self.timeline is not None:
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
            self.timeline.append(marks)
        inputs, sampling, capture = self._prepare(out, layer_hook)
        capture_rows = self._to_device(list(capture.values())) if capture else None
        with self._group_turn():
            logits, hidden, taps = self._run_everywhere(inputs, layer_hook, capture_rows)
        hidden_rows = None
        if capture:
            hidden_rows = (list(capture), self._prompt_taps(hidden[capture_rows], taps))
        ids = [c.request.request_id for c in sampling]
        step = LaunchedStep(ids, None, hidden_rows)
        step.to_sample = (logits, sampling, marks) if sampling else None
        if sample or not sampling:
            self.sample(step, marks)
        return step

    def _prepare(
        self, out: SchedulerOutput, layer_hook: Callable[[int], None] | None
    ) -> tuple[StepInputs, list[ScheduledRequest], dict[str, int]]:
        """The step's inputs from the scheduler's output (host work only: whatever is wrong
        with them raises before any rank starts the step), the chunks that sample in row order,
        and the rows of prompts' last tokens whose hidden states are kept."""
        # Decodes first, shortest context first (the attention backend groups them by length).
        chunks = sorted(out.scheduled, key=lambda c: (c.num_tokens != 1, c.start))
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        capture: dict[str, int] = {}  # request id -> row of its prompt's last token
        pending: list[tuple[int, str]] = []  # (input row, request id) of pending tokens
        for c in chunks:
            known = c.request.all_token_ids[c.start : c.start + c.num_tokens]
            input_ids += known
            if len(known) < c.num_tokens:  # its last token is pending: filled on the device
                if len(known) != c.num_tokens - 1:
                    raise RuntimeError(f"{c.request.request_id}: more than one token pending")
                input_ids.append(0)
                pending.append((len(input_ids) - 1, c.request.request_id))
            if c.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(c)
                if self.capture_layers and not c.request.output_token_ids:
                    capture[c.request.request_id] = len(input_ids) - 1
        inputs = StepInputs(
            specs=[ChunkSpec(c.start, c.num_tokens, c.block_table) for c in chunks],
            input_ids=input_ids,
            sample_rows=sample_rows,
            pending_rows=[row for row, _ in pending],
            pending_sources=self._pending_sources(pending),
            num_captured=len(capture),
            whole_graph=layer_hook is None and not capture,
            gather_slots=(
                layer_hook.slots.tolist() if isinstance(layer_hook, GatheredLayerHook) else []
            ),
        )
        return inputs, sampling, capture

    def _run_everywhere(
        self,
        inputs: StepInputs,
        layer_hook: Callable[[int], None] | None,
        capture_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """``_run`` here, and under tensor parallelism on the other ranks too (sent first)."""
        if self.tp is None:
            return self._run(inputs, layer_hook, capture_rows)
        self._send(inputs)
        try:
            return self._run(inputs, layer_hook, capture_rows)
        except Exception as exc:
            raise self._group_failed("a step", exc) from exc

    def _group_failed(self, what: str, exc: BaseException) -> RankFailure:
        """``what`` failed on rank 0 mid-way: the other ranks are somewhere inside it, or gone,
        so the group is never in step again (every later call refuses); the error to raise."""
        self.tp.failed = self.tp.failed or (
            f"{what} failed on rank 0 of {self.tp.size} ({type(exc).__name__}: {exc})"
        )
        return RankFailure(self.tp.failed)

    def _send(self, inputs: StepInputs) -> None:
        if self.tp.failed is not None:
            raise RankFailure(self.tp.failed)
        try:
            send_step(self.tp, inputs)
        except RuntimeError as exc:
            self.tp.failed = f"a tensor-parallel rank is gone: {exc}"
            raise RankFailure(self.tp.failed) from exc

    @contextmanager
    def _group_turn(self) -> Iterator[None]:
        """Rank 0: this thread alone sends to the other ranks and runs collectives until the
        block ends. Steps and KV reads / writes all come from the engine thread, one after
        another; a second thread here would interleave its messages with a step's (each rank
        would read the other's payload as its own), so it raises at once instead."""
        if self.tp is None:
            yield
            return
        if not self._turn.acquire(blocking=False):
            raise RuntimeError(
                "two threads at once sent to the tensor-parallel ranks: steps and KV block reads "
                "and writes must all come from the engine thread"
            )
        try:
            yield
        finally:
            self._turn.release()

    def _run(
        self,
        inputs: StepInputs,
        layer_hook: Callable[[int], None] | None,
        capture_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """What every rank runs of a step: the forward pass and the sampled rows' logits
        (``(logits or None, hidden states or None, captured layers)``)."""
        self.steps_run += 1
        fill = self._pending_fill(inputs)
        specs, sample_rows = inputs.specs, inputs.sample_rows
        if self.graphs is not None and inputs.whole_graph and self.graphs.fits(specs):
            logits = self.graphs.run(specs, inputs.input_ids, fill)
            if len(sample_rows) < len(specs) and sample_rows:
                logits = logits[self._to_device(sample_rows)]
            return logits, None, {}
        hook = self._layer_hook(inputs, layer_hook)
        hidden, taps = self._forward(
            specs, inputs.input_ids, inputs.positions, hook, capture_rows, fill
        )
        logits = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[self._to_device(sample_rows)])
        return logits, hidden, taps

    def _layer_hook(
        self, inputs: StepInputs, layer_hook: Callable[[int], None] | GatheredLayerHook | None
    ) -> Callable[[int], None] | None:
        """What the forward pass calls after each layer: ``layer_hook``, or for gathered
        slots (a ``GatheredLayerHook`` on rank 0, ``inputs.gather_slots`` on every rank) the
        gather of every KV head of them, handed to the hook's ``on_layer`` on rank 0. Each rank
        gathers at the same point of its forward pass, between the same collectives."""
        if not inputs.gather_slots:
            return layer_hook
        slots = self._to_device(inputs.gather_slots)
        on_layer = layer_hook.on_layer if isinstance(layer_hook, GatheredLayerHook) else None

        def gather(layer: int) -> None:
            part = self.kv_caches[layer].view(torch.uint8).index_select(2, slots)
            if self.tp is not None:
                parts = self.tp.gather_device(part)
                if parts is None:  # not rank 0
                    return
                part = self._all_heads(parts, dim=1)
            on_layer(layer, part.view(self.kv_dtype))

        return gather

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, marks: tuple | None = None) -> None:
        """Queue the sampling of a step launched with ``sample=False`` (nothing when it is
        queued already): each row's grammar mask is filled on the host now, from the tokens
        its request has now."""
        if step.to_sample is not None:
            logits, sampling, marks = step.to_sample
            step.to_sample = None
            step.batch = self.sampler.sample(logits, [self._sampling_row(c) for c in sampling])
            self._last_sampled = (
                step.batch.tokens,
                {rid: i for i, rid in enumerate(step.request_ids)},
            )
        if marks is not None:
            marks[1].record()

    # -- the other ranks -------------------------------------------------------------------------

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run every step rank 0 sends, until it says stop (or its group
        fails, which raises)."""
        try:
            while (op := receive(self.tp)) is not None:
                if isinstance(op, StepInputs):
                    self._run(op, None, None)
                elif op.write:
                    raw = torch.empty(self._raw_shape(op), dtype=torch.uint8, device=self.device)
                    self._write_local(op, self.tp.scatter_device(None, raw))
                else:
                    self.tp.gather_device(self._read_local(op))
        finally:
            self._release_group()

    def close(self) -> bool:
        """Rank 0: tell the other ranks to stop (they return from ``follow``) and let go of
        the group. False when they could not be told (the group had failed)."""
        if self.tp is None:
            return False
        if self.tp.failed is not None:
            self._release_group()
            return False
        try:
            send_stop(self.tp)
        except RuntimeError as exc:  # one is gone already: nothing to stop there
            logger.warning("tensor-parallel ranks not stopped: %s", exc)
            return False
        finally:
            self.tp.failed = "the runner is closed"
            self._release_group()
        return True

    def _release_group(self) -> None:
        """The runner steps no more: its graphs go first (NCCL waits, without bound, for every
        graph that captured a communicator's collectives to be gone before it tears that
        communicator down), then the group's communicators."""
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.piecewise = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tp.release()

    def collect(self, step: LaunchedStep) -> dict[str, SampledToken]:
        """Wait for a launched step's sampled tokens (and its prompts' hidden states, which
        ``take_prompt_hidden`` hands out from then on)."""
        self.sample(step)
        tokens = step.batch.wait() if step.batch is not None else []
        if step.prompt_hidden is not None:
            request_ids, taps = step.prompt_hidden
            host = {i: taps[i].float().cpu().numpy() for i in self.capture_layers}
            for k, rid in enumerate(request_ids):
                self._prompt_hidden[rid] = {i: host[i][k] for i in self.capture_layers}
        return dict(zip(step.request_ids, tokens, strict=True))

    def _pending_sources(self, pending: list[tuple[int, str]]) -> list[int]:
        """Where each pending token (input row, request id) is in the sampled tokens of the
        step launched last."""
        if not pending:
            return []
        if self._last_sampled is None:
            raise RuntimeError("a pending token with no step launched before")
        row_of = self._last_sampled[1]
        try:
            return [row_of[rid] for _, rid in pending]
        except KeyError as exc:
            raise RuntimeError(f"request {exc} has a token pending from an older step") from None

    def _pending_fill(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input rows, their token ids on the device) for the tokens still pending: rank 0
        reads them from the step it launched last and sends them to the other ranks."""
        if not inputs.pending_rows:
            return None
        if self.tp is None or self.tp.rank == 0:
            tokens = self._last_sampled[0].index_select(0, self._to_device(inputs.pending_sources))
        else:
            tokens = torch.empty(len(inputs.pending_rows), dtype=torch.int64, device=self.device)
        if self.tp is not None:
            tokens = self.tp.broadcast_device(tokens)
        return self._to_device(inputs.pending_rows), tokens

    def _forward(
        self,
        specs: list[ChunkSpec],
        input_ids: list[int],
        positions: list[int],
        layer_hook: Callable[[int], None] | None,
        capture_rows: torch.Tensor | None,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Hidden states of every row, and each captured layer's output at ``capture_rows``:
        through the piecewise graphs when the step fits the largest bucket, else eagerly.
        ``fill``: (rows, token ids) written over ``input_ids`` on the device."""
        meta = self.backend.build(specs, self.cfg.block_size, self.device)
        if self.piecewise is not None and self.piecewise.fits(len(input_ids)):
            layers = (
                tuple(i for i in self.capture_layers if i >= 0) if capture_rows is not None else ()
            )
            return self.piecewise.forward(
                input_ids, positions, meta, layer_hook, capture_rows, layers, fill
            )
        ids = self._to_device(input_ids)
        if fill is not None:
            ids.index_copy_(0, *fill)
        with self._layer_taps(capture_rows) as taps:
            hidden = self.model(
                ids,
                self._to_device(positions),
                self.kv_caches,
                meta,
                self.backend,
                layer_hook,
            )
        return hidden, taps

    # -- every KV head of given blocks (P/D transfer, migration, the KV tiers) --------------------

    @torch.no_grad()
    def read_kv_blocks(self, blocks: Sequence[int], layers: range | None = None) -> torch.Tensor:
        """Every KV head of ``blocks`` (the model's heads, in its order), layers ``layers`` (all
        when None): ``[layers, 2, num_kv_heads, len(blocks) * block_size, head_dim]`` in the
        pool's dtype on this runner's device, ``blocks[i]``'s slots at ``[i * block_size,
        (i + 1) * block_size)``. That is what a one-device pool holds there (per layer
        ``cache[:, :, slots]``, as migration gathers it), so a caller reads the same way at any
        tensor-parallel size; the KV tiers' per-block layout is a ``view`` and ``permute`` of
        it. Under tensor parallelism every rank gathers its heads to rank 0, which takes each
        head from the first rank that holds it (replicated heads are read once).

        Rank 0's engine thread, between steps (the thread that sends the steps, so a KV
        read's messages never interleave with a step's; from another thread while a step is
        being sent it raises RuntimeError). Bad ``blocks`` or ``layers`` raise ValueError
        before any rank hears of the call; a rank that is gone raises RankFailure."""
        op = self._kv_op(False, blocks, layers)
        if not op.blocks:
            return torch.empty(self._full_shape(op), dtype=self.kv_dtype, device=self.device)
        if self.tp is None:
            return self._read_local(op).view(self.kv_dtype)
        parts = self._in_lockstep(op, lambda: self.tp.gather_device(self._read_local(op)))
        return self._all_heads(parts, dim=2).view(self.kv_dtype)

    def _all_heads(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's heads (``parts``, in rank order, heads along ``dim``) as the model's:
        each head from the first rank that holds it (replicated heads are taken once)."""
        owners = {}  # first head of a rank's slice -> the first rank holding that slice
        for rank, start in enumerate(self._kv_head_starts):
            owners.setdefault(start, rank)
        return torch.cat([parts[owners[s]] for s in sorted(owners)], dim=dim)

    def read_kv_tokens(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Every KV head of token positions ``[start, end)`` of a request whose blocks are
        ``block_table``, every layer: ``[layers, 2, num_kv_heads, end - start, head_dim]``,
        contiguous (the payload of a KV message carrying them). ``read_kv_blocks`` of the
        blocks that hold them, cut to the positions; same thread rule and errors."""
        bs = self.cfg.block_size
        if not 0 <= start < end <= len(block_table) * bs:
            raise ValueError(
                f"positions [{start}, {end}) do not lie in {len(block_table)} blocks of {bs}"
            )
        first = start // bs
        kv = self.read_kv_blocks(block_table[first : -(-end // bs)])
        return kv[:, :, :, start - first * bs : end - first * bs].contiguous()

    @torch.no_grad()
    def write_kv_blocks(
        self, blocks: Sequence[int], kv: torch.Tensor, layers: range | None = None
    ) -> None:
        """The inverse of ``read_kv_blocks``: ``kv`` (every KV head, its shape and the pool's
        dtype, on any device) into ``blocks``, layers ``layers``; under tensor parallelism rank
        0 scatters each rank its heads' slice (every rank holding a replicated head writes it).
        Same thread rule and errors as ``read_kv_blocks``; a block listed twice is refused."""
        op = self._kv_op(True, blocks, layers)
        shape = self._full_shape(op)
        if (
            not isinstance(kv, torch.Tensor)
            or tuple(kv.shape) != shape
            or kv.dtype != self.kv_dtype
        ):
            got = f"{kv.dtype} {list(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv)
            raise ValueError(
                f"kv must be a {self.kv_dtype} tensor of shape {list(shape)} (layers, K and V, "
                f"KV heads, {len(op.blocks)} blocks x {self.cfg.block_size} slots, head_dim); "
                f"got {got}"
            )
        if not op.blocks:
            return
        raw = kv.to(self.device).contiguous().view(torch.uint8)
        if self.tp is None:
            self._write_local(op, raw)
            return
        heads = self.model.layout.num_kv_heads
        parts = [raw[:, :, s : s + heads] for s in self._kv_head_starts]
        out = torch.empty(self._raw_shape(op), dtype=torch.uint8, device=self.device)
        self._in_lockstep(op, lambda: self._write_local(op, self.tp.scatter_device(parts, out)))

    def _kv_op(self, write: bool, blocks: Sequence[int], layers: range | None) -> KVBlocksOp:
        """The checked request (ValueError naming what is wrong: nothing is sent yet)."""
        n, num_layers = self.num_kv_blocks, self.model_cfg.num_layers
        try:
            ids = [operator.index(b) for b in blocks]
        except TypeError:
            raise ValueError(f"block ids must be integers, got {blocks!r:.200}") from None
        if bad := [b for b in ids if not 0 <= b < n]:
            raise ValueError(f"block ids {bad[:8]} out of range: the KV pool has blocks 0..{n - 1}")
        if write and len(set(ids)) < len(ids):
            raise ValueError(f"a block listed twice in one KV write: {ids[:16]}")
        layers = range(num_layers) if layers is None else layers
        if not (
            isinstance(layers, range)
            and layers.step == 1
            and 0 <= layers.start < layers.stop <= num_layers
        ):
            raise ValueError(
                f"layers must be a non-empty range(start, stop) within range(0, {num_layers}), "
                f"got {layers!r}"
            )
        return KVBlocksOp(write, ids, layers)

    def _in_lockstep(self, op: KVBlocksOp, collective: Callable[[], object]):
        """Rank 0: announce ``op`` to the other ranks and run its collective with them. Any
        fault fails the group: the ranks are out of step from the first message on."""
        with self._group_turn():
            if self.tp.failed is not None:
                raise RankFailure(self.tp.failed)
            try:
                send_kv_op(self.tp, op)
                return collective()
            except RuntimeError as exc:
                what = f"a KV {'write' if op.write else 'read'} of {len(op.blocks)} blocks"
                raise self._group_failed(what, exc) from exc

    @property
    def _kv_head_starts(self) -> list[int]:
        """Each rank's first KV head in the model's (every rank holds as many)."""
        return [
            tp_layout(self.model_cfg, self.tp.size, r).kv_head_start for r in range(self.tp.size)
        ]

    def _full_shape(self, op: KVBlocksOp) -> tuple[int, ...]:
        mc = self.model_cfg
        slots = len(op.blocks) * self.cfg.block_size
        return (len(op.layers), 2, mc.num_kv_heads, slots, mc.head_dim)

    def _raw_shape(self, op: KVBlocksOp) -> tuple[int, ...]:
        """This rank's heads of ``op`` as bytes (collectives and index copies move bytes: fp8
        lacks some kernels, and the backends some dtypes)."""
        c = self.kv_caches[0]
        slots = len(op.blocks) * self.cfg.block_size
        return (len(op.layers), 2, c.shape[1], slots, c.shape[3] * c.element_size())

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        bs = self.cfg.block_size
        slots = np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)
        return host_to_device(slots.ravel(), self.device)

    def _read_local(self, op: KVBlocksOp) -> torch.Tensor:
        """This rank's heads of ``op``'s blocks, bytes in ``_raw_shape``."""
        index = self._slots(op.blocks)
        out = torch.empty(self._raw_shape(op), dtype=torch.uint8, device=self.device)
        for i, layer in enumerate(op.layers):
            torch.index_select(self.kv_caches[layer].view(torch.uint8), 2, index, out=out[i])
        return out

    def _write_local(self, op: KVBlocksOp, raw: torch.Tensor) -> None:
        """``raw`` (this rank's heads, bytes in ``_raw_shape``) into ``op``'s blocks."""
        index = self._slots(op.blocks)
        for i, layer in enumerate(op.layers):
            self.kv_caches[layer].view(torch.uint8).index_copy_(2, index, raw[i])

    # -- hidden states at the prompt's last token (the length probe's input) ----------------------

    def take_prompt_hidden(self) -> dict[str, dict[int, np.ndarray]]:
        """Per request whose prompt completed in the steps run since the last call: its hidden
        state at the last prompt token, ``{layer: float32 [hidden]}`` for ``capture_layers``."""
        taken, self._prompt_hidden = self._prompt_hidden, {}
        return taken

    @contextmanager
    def _layer_taps(self, rows: torch.Tensor | None) -> Iterator[dict[int, torch.Tensor]]:
        """Forward hooks on the captured intermediate layers, only for this forward pass:
        each copies its residual stream (the layer's output) at ``rows``."""
        taps: dict[int, torch.Tensor] = {}
        handles = []
        for i in [i for i in self.capture_layers if i >= 0] if rows is not None else []:

            def tap(_module, _args, out, i=i) -> None:
                x, residual = out
                taps[i] = x[rows] + residual[rows]  # a copy: later layers may fuse in place

            handles.append(self.model.layers[i].register_forward_hook(tap))
        try:
            yield taps
        finally:
            for h in handles:
                h.remove()

    def _prompt_taps(
        self, last: torch.Tensor, taps: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every captured layer's output at the captured rows, on the device; ``last``: the
        final layer's output there (before the final norm)."""
        if -1 in self.capture_layers:
            taps[-1] = self.model.norm(last, self.model.ops)
        return taps

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return host_to_device(np.asarray(values, dtype=np.int64), self.device)

    def _sampling_row(self, chunk: ScheduledRequest) -> SamplingRow:
        request = chunk.request
        return SamplingRow(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            # (none once finished: by the token of the step before; this draw is thrown away)
            grammar=request.grammar if not request.is_finished else None,
            # Inputs of this chunk not known yet (a token pending from the step before).
            num_pending=chunk.start + chunk.num_tokens - request.num_tokens,
        )


@dataclass
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``): who samples, in row order, their
    tokens on their way to the host, and the hidden states captured at prompts' last tokens
    (request ids, ``{layer: [rows, hidden]}`` on the device)."""

    request_ids: list[str]
    batch: SampledBatch | None
    prompt_hidden: tuple[list[str], dict[int, torch.Tensor]] | None = None
    # Until its sampling is queued (``ModelRunner.sample``): the logits of the rows that
    # sample, their chunks, and the timeline's marks
    to_sample: tuple[torch.Tensor, list[ScheduledRequest], tuple | None] | None = None
