"""Batched next-token sampler: one call per step on the logits of the rows that sample.

Pipeline per row (vLLM v1 / HF semantics)::

    raw logits ──► log_softmax ─────────────────────────────► logprobs (raw distribution)
        │
        └─► logit_bias ─► repetition / frequency / presence penalties ─► min_tokens mask
              ─► grammar mask
              ├─► greedy rows: argmax
              └─► random rows: / temperature ─► top-k ─► top-p ─► min-p ─► draw

Cost model: this runs every decode step (batch 64, vocab 49152, a 2-core CPU), so every
stage is vectorised over the rows that need it and skipped when no row does. The tricks
that keep the random path cheap, each in its own function below:

* Relative weights. Random rows work on ``exp(logit / T - max)`` in place: probabilities up
  to each row's normaliser, with the best token at exactly 1. Min-p's threshold is then
  ``min_p`` itself, and only top-p ever needs the normaliser (a row sum).
* Truncation as a threshold. Top-k, top-p and min-p each keep the tokens whose weight is
  >= some per-row threshold, so they combine (by max) into one threshold and one masking
  pass. Ties at a threshold are kept, as in HF's and vLLM's masking.
* No full sort for top-p. The nucleus is looked for among the best 256 candidates
  (``topk``), widening to 4096 and then the whole vocabulary only for rows that need it.
* Inverse-CDF draws. Each row takes a single uniform and picks the token by
  ``searchsorted`` in its cumulative weights: one random number per row rather than one
  per vocabulary entry (a vocabulary's worth of exponentials for an exponential race costs
  more than everything else here on a CPU).
* Counter-based seeds. A seeded row's uniform is a hash of (seed, output position), not
  the next number of a stateful generator, so its token depends only on its own logits,
  its seed and how many tokens it has produced: whatever else is in the batch, on CPU and
  CUDA alike, and on whichever worker continues the request (a prefill worker that drew
  the first token, a worker that resumes or receives it mid-stream). Unseeded rows draw
  from the sampler's default generator.
* Grammar masks (structured outputs). A row with a grammar matcher gets the tokens its
  grammar forbids set to -inf. The matchers fill a bitmask (one bit per token) on the host,
  in parallel (engine/grammar.py ``fill_bitmasks``); on CUDA it crosses to the device once
  per step (pinned, non-blocking, so the host runs on) and a Triton kernel masks the rows
  (kernels/token_bitmask.py; the torch reference on CPU): no [rows, vocab] mask is built on
  the host. A row whose grammar fails (in error, or allowing nothing) is left unmasked and
  its matcher keeps the error: its request ends with it after the step, the batch goes on.
  The matcher must have accepted every earlier token, so such a row has none pending (the
  engine queues a constrained step's sampling after the step before is read:
  ``ModelRunner.sample``). Its ``min_tokens`` is not applied: the grammar decides the end.
* Reused scratch buffers. On CPU, fresh multi-megabyte tensors every step cost page faults
  that about double the step; the sampler keeps its [rows, vocab] scratch tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.grammar import GrammarMatcher, bitmask_words, fill_bitmasks
from engine.histogram import Buckets
from engine.outputs import SampledToken
from engine.sampling_params import SamplingParams
from kernels.token_bitmask import apply_token_bitmask_ref

__all__ = ["SampledBatch", "SampledToken", "Sampler", "SamplingRow", "seeded_uniform"]

_NEG_INF = float("-inf")
# Candidate-set sizes tried for top-p before falling back to a full sort of the row.
_TOP_P_CANDIDATES = (256, 4096)


@dataclass
class SamplingRow:
    """One sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (before this step's token), known ids
    # Tokens generated before this one whose ids are not known yet (a step still running: async
    # scheduling). They count for positions (seeds, min_tokens); penalties need every id, so a
    # row with penalties never has any.
    num_pending: int = 0
    # Structured outputs: the row's grammar, past every token of ``output_token_ids`` (so a
    # row with one never has pending tokens either).
    grammar: GrammarMatcher | None = None

    @property
    def num_output(self) -> int:
        """Tokens generated before this step's, known or pending."""
        return len(self.output_token_ids) + self.num_pending


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit words with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """U[0, 1) for output token ``position`` of a request seeded with ``seed``: a pure
    function of the two (53 random bits), so any worker reproduces it."""
    x = _mix64((seed & _MASK64) ^ 0x9E3779B97F4A7C15)
    x = _mix64((x + position * 0x9E3779B97F4A7C15) & _MASK64)
    return (x >> 11) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------- penalties


def _apply_repetition_penalty(row: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> None:
    """HF: for every token seen in prompt or output, positive logits / penalty, others * penalty."""
    seen = torch.unique(token_ids)
    values = row[seen]
    row[seen] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_frequency_presence(
    row: torch.Tensor, output_ids: torch.Tensor, frequency: float, presence: float
) -> None:
    """OpenAI: logit -= frequency * count + presence * (count > 0), over generated tokens."""
    seen, counts = torch.unique(output_ids, return_counts=True)
    row[seen] -= counts.to(row.dtype) * frequency + presence


def _apply_penalties(row: torch.Tensor, sampling_row: SamplingRow) -> None:
    params = sampling_row.params
    if sampling_row.num_pending:
        raise ValueError("penalties need every output token id: none may be pending")
    output = torch.as_tensor(sampling_row.output_token_ids, dtype=torch.long, device=row.device)
    if params.repetition_penalty != 1.0:
        prompt = torch.as_tensor(sampling_row.prompt_token_ids, dtype=torch.long, device=row.device)
        _apply_repetition_penalty(row, torch.cat((prompt, output)), params.repetition_penalty)
    if output.numel() and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        _apply_frequency_presence(row, output, params.frequency_penalty, params.presence_penalty)


def _apply_logit_bias(work: torch.Tensor, rows: Sequence[SamplingRow], biased: list[int]) -> None:
    """Add each row's ``logit_bias`` to its logits, first of the processors (as OpenAI and
    vLLM apply it): one scatter-add for every biased row of the batch."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i in biased:
        bias = rows[i].params.logit_bias
        row_ids += [i] * len(bias)
        token_ids += bias.keys()
        values += bias.values()
    device = work.device
    index = (
        torch.tensor(row_ids, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True),
    )
    work.index_put_(index, torch.tensor(values, dtype=work.dtype).to(device), accumulate=True)


def _min_tokens_banned(sampling_row: SamplingRow, vocab_size: int) -> list[int]:
    """Token ids to forbid this step because the row has not reached ``min_tokens`` yet:
    the stop token ids, and the EOS ids unless ``ignore_eos`` (none under a grammar)."""
    params = sampling_row.params
    if sampling_row.num_output >= params.min_tokens or sampling_row.grammar is not None:
        return []
    banned = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        banned.extend(params._eos_token_ids)
    return [t for t in banned if 0 <= t < vocab_size]


# --------------------------------------------------------------------------- grammar


MASK_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
"""Upper edges (seconds) of the per-step mask-time histogram (``Sampler.mask_seconds``)."""


class _Bitmasks:
    """Host bitmask buffers of the grammar rows, reused across steps. On CUDA they are
    pinned (the copy to the device is non-blocking) and two alternate, each reused only once
    the copy out of it has run (its event)."""

    def __init__(self) -> None:
        self._buffers: list[list] = []  # [host tensor, its copy's event or None]
        self._turn = 0

    def take(self, rows: int, words: int, device: torch.device) -> tuple[torch.Tensor, list]:
        pinned = device.type == "cuda"
        if len(self._buffers) < (2 if pinned else 1):
            self._buffers.append([torch.empty(0, dtype=torch.int32), None])
        self._turn = (self._turn + 1) % len(self._buffers)
        slot = self._buffers[self._turn]
        if slot[1] is not None:
            slot[1].synchronize()  # (long done: a step ago)
        if slot[0].numel() < rows * words:
            slot[0] = torch.empty(rows * words, dtype=torch.int32, pin_memory=pinned)
        return slot[0][: rows * words].view(rows, words), slot


def _apply_grammar_masks(
    work: torch.Tensor, rows: Sequence[SamplingRow], index: list[int], bitmasks: _Bitmasks
) -> None:
    """-inf in ``work`` where the grammar of row ``index[j]`` forbids a token."""
    vocab, device = work.shape[-1], work.device
    for i in index:
        if rows[i].num_pending:
            raise ValueError("a grammar needs every output token id: none may be pending")
    host, slot = bitmasks.take(len(index), bitmask_words(vocab), device)
    fill_bitmasks([rows[i].grammar for i in index], host.numpy())
    target = torch.tensor(index, dtype=torch.long)
    if device.type == "cpu":
        apply_token_bitmask_ref(work, host, target)
        return
    from kernels.token_bitmask import apply_token_bitmask_

    words = host.to(device, non_blocking=True)
    slot[1] = torch.cuda.Event()
    slot[1].record()
    apply_token_bitmask_(work, words, target.pin_memory().to(device, non_blocking=True))


# --------------------------------------------------------------------------- weights


def _scaled_rows(
    logits: torch.Tensor, index: torch.Tensor | None, temperature: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Rows ``index`` of ``logits`` (all when None) divided by their temperature, into ``out``."""
    if index is None:
        return torch.div(logits, temperature[:, None], out=out)
    return torch.index_select(logits, 0, index, out=out).div_(temperature[:, None])


def _relative_weights_(scaled: torch.Tensor) -> torch.Tensor:
    """In place, exp(x - row max): probabilities up to the normaliser; the best token is 1."""
    return scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()


# --------------------------------------------------------------------------- truncation
# Thresholds are on the relative weights: a row keeps the tokens whose weight is >= its
# threshold, and 0 keeps everything.


def _candidate_sizes(vocab_size: int, largest_top_k: int, any_top_p_only: bool) -> Iterator[int]:
    """Sizes of the best-token candidate sets to try: enough for every top-k, then wider."""
    size = min(vocab_size, max(largest_top_k, _TOP_P_CANDIDATES[0] if any_top_p_only else 1))
    yield size
    for wider in (*_TOP_P_CANDIDATES[1:], vocab_size):
        if size < wider <= vocab_size:
            size = wider
            yield size


def _best_weights(weights: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` largest weights of each row, best first."""
    if size >= weights.shape[-1]:
        return weights.sort(dim=-1, descending=True).values
    return weights.topk(size, dim=-1, sorted=True).values


def _candidate_thresholds(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    row_totals: torch.Tensor,
    size: int,
    any_top_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p thresholds from each row's ``size`` most likely tokens.

    ``row_totals`` is each row's whole weight (used by top-p rows without top-k). Returns
    ``(threshold, resolved)``; a top-p row without top-k whose nucleus is wider than
    ``size`` is not resolved: its candidates hold less than ``top_p`` of the mass.
    """
    vocab_size = weights.shape[-1]
    best = _best_weights(weights, size)
    zeros = best.new_zeros(best.shape[0])
    has_k = top_k > 0
    k_index = (top_k.clamp(1, size) - 1)[:, None]
    k_threshold = torch.where(has_k, best.gather(1, k_index).squeeze(1), zeros)
    if not any_top_p:  # (known on the host: no device round trip)
        return k_threshold, torch.ones_like(has_k)
    has_p = top_p < 1.0

    # Top-p acts on the top-k-truncated distribution: drop candidates past k, renormalise.
    positions = torch.arange(size, device=weights.device)
    kept_by_k = positions[None, :] < torch.where(has_k, top_k, size)[:, None]
    cumulative = torch.where(kept_by_k, best, 0.0).cumsum_(dim=-1)
    total = torch.where(has_k, cumulative.gather(1, k_index).squeeze(1), row_totals)
    target = top_p * total
    # Smallest prefix reaching top_p: the best token, plus each token before which the
    # cumulative mass is still below top_p.
    n_keep = 1 + (cumulative[:, :-1] < target[:, None]).sum(dim=-1)
    p_threshold = torch.where(has_p, best.gather(1, (n_keep - 1)[:, None]).squeeze(1), zeros)
    covered = cumulative[:, -1] >= target
    resolved = ~has_p | has_k | covered | (size >= vocab_size)
    return torch.maximum(k_threshold, p_threshold), resolved


def _top_k_top_p_thresholds(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    largest_top_k: int,
    any_top_p: bool,
    any_top_p_only: bool,
) -> torch.Tensor:
    """Per row, the smallest weight kept by top-k (0 = off) then top-p (1 = off).
    ``largest_top_k``, ``any_top_p`` (a row with top-p) and ``any_top_p_only`` (one with top-p
    and no top-k) come from the host, so a step with no top-p-only row never waits on the device.

    Avoids a full sort: top-k needs only k candidates, and the top-p nucleus is looked for
    among the best 256 tokens, then 4096, then the whole (sorted) row, per unresolved row.
    """
    n_rows, vocab_size = weights.shape
    thresholds = weights.new_zeros(n_rows)
    if not any_top_p_only:  # every row resolves on its top-k candidates: one pass
        size = min(vocab_size, max(largest_top_k, 1))
        threshold, _ = _candidate_thresholds(weights, top_k, top_p, thresholds, size, any_top_p)
        return threshold
    pending = torch.arange(n_rows, device=weights.device)
    row_totals = weights.sum(dim=-1)
    for size in _candidate_sizes(vocab_size, largest_top_k, any_top_p_only):
        if pending.numel() == n_rows:
            rows, k, p, totals = weights, top_k, top_p, row_totals
        else:
            rows, k, p = weights[pending], top_k[pending], top_p[pending]
            totals = row_totals[pending]
        threshold, resolved = _candidate_thresholds(rows, k, p, totals, size)
        thresholds[pending[resolved]] = threshold[resolved]
        pending = pending[~resolved]
        if pending.numel() == 0:
            break
    return thresholds


def _zero_below(weights: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Zero each row's weights below its threshold (0 keeps the row as it is)."""
    if weights.device.type != "cpu":
        return torch.where(weights >= thresholds[:, None], weights, 0.0)
    # On CPU an in-place F.threshold_ per truncated row is ~5x faster than the masked
    # torch.where. threshold_ keeps x > bound, so pass the float just below the threshold.
    bounds = torch.nextafter(thresholds, thresholds.new_full((), _NEG_INF)).tolist()
    for i, (bound, threshold) in enumerate(zip(bounds, thresholds.tolist(), strict=True)):
        if threshold > 0.0:
            F.threshold_(weights[i], bound, 0.0)
    return weights


class SampledBatch:
    """One step's sampled tokens (and the logprobs asked for), still on the device, with their
    copies to the host queued behind them; ``wait`` returns them. The copies go through pinned
    memory and an event: with a plain ``tolist()`` or ``.cpu()`` (a pageable device-to-host
    copy) other threads' CUDA calls waited until the whole forward pass had run (a prefill
    worker's KV sender sat in ``Event.record`` for ~75 ms at 8k tokens: benchmarks/NOTES.md,
    disaggregation, change 7), and the engine could not schedule the next step meanwhile.

    ``tokens`` (device, one per row) may feed the next step's inputs before ``wait``."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """``logprobs``: (rows that want them, how many top entries each, the chosen token's
        logprob, the top ids, the top values), the tensors one row per wanting row."""
        self.tokens = tokens
        self._wanting, self._n_top = (logprobs[0], logprobs[1]) if logprobs else ([], [])
        tensors = [tokens, *(logprobs[2:] if logprobs else ())]
        if tokens.device.type == "cpu":
            self._host, self._done = tensors, None
            return
        self._host = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.append(host.copy_(t, non_blocking=True))
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list[SampledToken]:
        if self._done is not None:
            self._done.synchronize()
        results = [SampledToken(t, None, None) for t in self._host[0].tolist()]
        if not self._wanting:
            return results
        chosen, top_ids, top_values = (t.tolist() for t in self._host[1:])
        for j, (i, n) in enumerate(zip(self._wanting, self._n_top, strict=True)):
            results[i].logprob = chosen[j]
            results[i].top_logprobs = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        return results


# --------------------------------------------------------------------------- picking


GREEDY_KERNEL = True  # benchmarks set False to time torch's reduction instead


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Most likely token per row (ties -> lowest id, as documented for ``torch.max``).

    ``max(dim).indices`` is twice as fast as ``argmax`` on CPU and picks the same token; on
    CUDA kernels/argmax.py picks it too, in ~1/10 of torch's time for a batch-1 row.
    """
    if GREEDY_KERNEL and logits.is_cuda and logits.stride(-1) == 1:
        from kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.max(dim=-1).indices


def _draw_uniforms(
    rows: Sequence[SamplingRow], default_generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One U[0, 1) per row: (seed, position) for seeded rows, the default generator's next
    number for the others."""
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
    if len(seeded) < len(rows):
        uniforms = torch.rand(len(rows), generator=default_generator, device=device)
    else:
        uniforms = torch.empty(len(rows), device=device)
    if seeded:
        values = [seeded_uniform(rows[i].params.seed, rows[i].num_output) for i in seeded]
        if len(seeded) == len(rows):
            uniforms.copy_(torch.tensor(values, dtype=torch.float32))
        else:
            uniforms[torch.tensor(seeded, device=device)] = torch.tensor(values).to(device)
    return uniforms


def _inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds u * total weight.

    ``weights`` need not be normalised; it is overwritten with its cumulative sum.
    Zero-weight tokens can never be picked.
    """
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1]
    # u < 1, but u * total can round up to total; stay strictly below it.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)


# --------------------------------------------------------------------------- helpers


class _Workspace:
    """Float32 [rows, vocab] scratch tensors kept across steps (CPU only), grown on demand.

    A view handed out is valid until the same name is taken again.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, n_rows: int, n_cols: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":  # the CUDA caching allocator already recycles memory
            return torch.empty(n_rows, n_cols, dtype=torch.float32, device=device)
        numel = n_rows * n_cols
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32)
            self._buffers[name] = buffer
        return buffer[:numel].view(n_rows, n_cols)


def _row_index(indices: list[int], n_rows: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of ``indices``, or None when they are all ``n_rows`` rows in order."""
    if len(indices) == n_rows:
        return None
    return torch.tensor(indices, dtype=torch.long, device=device)


def _select(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(0, index)


def _column(
    values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device)


# --------------------------------------------------------------------------- sampler


class Sampler:
    """Picks one token per row of ``logits`` according to each row's ``SamplingParams``.

    Not thread-safe: it reuses scratch buffers between calls.
    """

    def __init__(self, default_generator: torch.Generator) -> None:
        self.default_generator = default_generator
        self._workspace = _Workspace()
        self._bitmasks = _Bitmasks()
        self.mask_seconds = Buckets(MASK_BUCKETS)  # per step with grammar rows: fill + apply

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Sample from ``logits`` [len(rows), vocab]; ``logits`` itself is left unchanged."""
        if logits.dim() == 2 and not rows and logits.shape[0] == 0:
            return []
        return self.sample(logits, rows).wait()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampledBatch:
        """Queue the sampling of ``logits`` [len(rows), vocab] (>= 1 row) on the device; the
        result is read with ``wait``. ``logits`` itself is left unchanged."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or not rows:
            raise ValueError(
                f"logits must be [len(rows)={len(rows)} >= 1, vocab], got {tuple(logits.shape)}."
            )
        n_rows, device = len(rows), logits.device
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        processed = self._processed(logits, rows, greedy_only=not random)
        tokens = torch.empty(n_rows, dtype=torch.long, device=device)
        if greedy:
            index = _row_index(greedy, n_rows, device)
            picked = _greedy(self._gather(processed, index, "greedy", len(greedy)))
            tokens = picked if index is None else tokens.index_copy_(0, index, picked)
        if random:
            index = _row_index(random, n_rows, device)
            picked = self._sample_random(processed, index, [rows[i] for i in random])
            tokens = picked if index is None else tokens.index_copy_(0, index, picked)
        return self._results(logits, rows, tokens)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """float32 logits after penalties and min_tokens masking, as a new tensor."""
        return self._processed(logits, rows, greedy_only=False).to(torch.float32, copy=True)

    # ------------------------------------------------------------------ stages

    def _gather(
        self, source: torch.Tensor, index: torch.Tensor | None, name: str, n_rows: int
    ) -> torch.Tensor:
        """Rows ``index`` of ``source`` (``source`` itself when None), in a scratch buffer."""
        if index is None:
            return source
        out = self._workspace.take(name, n_rows, source.shape[-1], source.device)
        return torch.index_select(source, 0, index, out=out)

    def _processed(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], greedy_only: bool
    ) -> torch.Tensor:
        """float32 logits after penalties and min_tokens masking.

        ``logits`` is never modified: changes go to a scratch copy. With nothing to change
        the result is ``logits`` itself (when float32, or in the model's dtype when every row
        is greedy: the argmax of bf16 logits is the argmax of their exact fp32 values, so
        the copy would change nothing), so it must be treated as read-only.
        """
        vocab_size = logits.shape[-1]
        biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
        penalised = [i for i, row in enumerate(rows) if row.params.uses_penalties]
        banned = {
            i: ids for i, row in enumerate(rows) if (ids := _min_tokens_banned(row, vocab_size))
        }
        structured = [i for i, row in enumerate(rows) if row.grammar is not None]
        unchanged = not biased and not penalised and not banned and not structured
        if unchanged and (logits.dtype == torch.float32 or greedy_only):
            return logits
        work = self._workspace.take("processed", len(rows), vocab_size, logits.device)
        work.copy_(logits)
        if biased:
            _apply_logit_bias(work, rows, biased)
        for i in penalised:
            _apply_penalties(work[i], rows[i])
        for i, ids in banned.items():
            work[i, ids] = _NEG_INF
        if structured:
            t0 = time.perf_counter()
            _apply_grammar_masks(work, rows, structured, self._bitmasks)
            self.mask_seconds.observe(time.perf_counter() - t0)
        return work

    def _sample_random(
        self, processed: torch.Tensor, index: torch.Tensor | None, rows: list[SamplingRow]
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row."""
        n_rows, vocab_size = len(rows), processed.shape[-1]
        temperature = _column([r.params.temperature for r in rows], processed, torch.float32)
        weights = self._workspace.take("weights", n_rows, vocab_size, processed.device)
        weights = _relative_weights_(_scaled_rows(processed, index, temperature, out=weights))
        thresholds = self._truncation_thresholds(weights, rows)
        if thresholds is not None:
            weights = _zero_below(weights, thresholds)
        uniforms = _draw_uniforms(rows, self.default_generator, processed.device)
        return _inverse_cdf_sample(weights, uniforms)

    def _truncation_thresholds(
        self, weights: torch.Tensor, rows: list[SamplingRow]
    ) -> torch.Tensor | None:
        """Combined top-k/top-p/min-p threshold per row, or None when no row truncates."""
        uses_kp = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
        uses_min_p = any(r.params.min_p > 0.0 for r in rows)
        if not uses_kp and not uses_min_p:
            return None
        thresholds = weights.new_zeros(len(rows))
        if uses_kp:
            index = _row_index(uses_kp, len(rows), weights.device)
            top_k = _column([rows[i].params.top_k for i in uses_kp], weights, torch.long)
            top_p = _column([rows[i].params.top_p for i in uses_kp], weights, torch.float32)
            candidates = self._gather(weights, index, "candidates", len(uses_kp))
            kp_params = [rows[i].params for i in uses_kp]
            kp = _top_k_top_p_thresholds(
                candidates,
                top_k,
                top_p,
                max(p.top_k for p in kp_params),
                any(p.top_p < 1.0 for p in kp_params),
                any(p.top_p < 1.0 and p.top_k <= 0 for p in kp_params),
            )
            thresholds = kp if index is None else thresholds.index_copy_(0, index, kp)
        if uses_min_p:
            # The best token's weight is 1 and top-k/top-p always keep it, so min-p's
            # threshold is min_p itself and combines with theirs by a max.
            min_p = _column([r.params.min_p for r in rows], weights, torch.float32)
            thresholds = torch.maximum(thresholds, min_p)
        return thresholds

    def _results(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
    ) -> SampledBatch:
        """Package tokens, with logprobs of the raw distribution for the rows that ask."""
        wanting = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanting:
            return SampledBatch(tokens, None)
        index = _row_index(wanting, len(rows), logits.device)
        # Not a scratch buffer: with async scheduling the next step samples before these are read.
        logprobs = torch.log_softmax(_select(logits, index), -1, dtype=torch.float32)
        chosen = logprobs.gather(1, _select(tokens, index)[:, None]).squeeze(1)
        n_each = [rows[i].params.logprobs or 0 for i in wanting]
        top = logprobs.topk(min(max(n_each), logprobs.shape[-1]), dim=-1, sorted=True)
        return SampledBatch(tokens, (wanting, n_each, chosen, top.indices, top.values))
