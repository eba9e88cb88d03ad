"""The Llama-family decoder: Llama (rope scaling default / linear / llama3), Mistral, Qwen2
(q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Plain PyTorch, shapes in comments.

Tokens of a step are flattened: ``T`` = total new tokens over all requests. Attention goes through
the backend, which owns the paged KV cache layout; nothing here knows about blocks.

Under tensor parallelism (engine/parallel.py) every projection stays a plain ``nn.Linear``
holding this rank's shard (the checkpoint is read sliced: ``tp_slice``), so a pass applied from
outside can still swap linears by name (CPU layouts, GEMV, quantization); the collectives are
in the forward of the embedding, ``Attention.output``, ``MLP`` and ``compute_logits``. Shapes
below are per rank: ``H``, ``KVH``, ``I`` and ``V`` are this rank's heads, KV heads,
intermediate size and vocabulary rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig, RopeConfig
from engine.ops import TorchOps, apply_rotary, rms_norm
from engine.parallel import TPGroup, TPLayout, tp_layout
from engine.weights import TensorSlice

__all__ = ["LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]


@dataclass
class StepContext:
    """What every layer needs for one forward pass, besides its own input."""

    ops: TorchOps  # or TritonOps (engine/ops.py): same interface
    rope: object  # the ops' rotary state for this step's positions
    meta: AttentionMetadata | None  # None inside graphed pieces (no attention there)
    backend: AttentionBackend | None
    # The backend rotates q and k as it writes the KV (one kernel: kernels/rotary.py's
    # apply_rotary_write_kv), so ``Attention.project`` leaves them unrotated.
    rope_in_attention: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops=None, residual: torch.Tensor | None = None, into=None):
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``. ``into``: the
        projection the norm feeds, which ``ops`` may hand the norm already quantized
        (engine/ops.py ``TritonOps``, an FP8 projection)."""
        if residual is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps, into)
        if ops is None:
            return rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps, into)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by ``factor``, short ones
    kept, the band between interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_wave = old_len / rope.low_freq_factor
    short_wave = old_len / rope.high_freq_factor
    scaled = torch.where(wavelen > long_wave, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = ~(wavelen < short_wave) & ~(wavelen > long_wave)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)

    def build(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin tables on ``device`` (after the model left ``meta``)."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope)
        freqs = torch.arange(self.max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)


def _all_reduce(tp: TPGroup | None, x: torch.Tensor) -> torch.Tensor:
    return x if tp is None else tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout, tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layout.num_heads,
            layout.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        # row-parallel: its bias is rank 0's alone (the others hold zeros), added once by the sum
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # An fp8 KV cache stores k / k_scale and v / v_scale: the checkpoint's (KV_SCALE_NAMES),
        # else 1.0. Caches of the model's dtype ignore them.
        self.k_scale, self.v_scale = 1.0, 1.0

    def project(self, step: StepContext, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new tokens' q ``[T, H, D]``, k and v ``[T, KVH, D]``: projection, the per-head
        norms (Qwen3) and rotary (views of one qkv tensor, rotated in place under TritonOps)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, step.ops), self.k_norm(k, step.ops)
        if not step.rope_in_attention:
            q, k = step.ops.apply_rotary(q, k, step.rope)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output ``[T, H * D]`` through o_proj: ``[T, hidden]``, summed over the
        ranks (each holds the columns of its own heads)."""
        return _all_reduce(self.tp, self.o_proj(o))

    def attend(self, step: StepContext, q, k, v, kv_cache, out=None) -> torch.Tensor:
        """Writes k, v into the layer's cache and attends: ``[T, H * D]`` (into ``out``);
        rotates q and k first when ``project`` left that to the backend."""
        rope = {"rope": step.rope} if step.rope_in_attention else {}
        return step.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            step.meta,
            self.scale,
            out,
            self.k_scale,
            self.v_scale,
            **rope,
        )


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout, tp: TPGroup | None = None):
        super().__init__()
        inter = layout.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)  # [gate I | up I]
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.tp = tp

    def forward(self, step: StepContext, x):
        """Column-parallel gate/up, row-parallel down, summed over the ranks."""
        return _all_reduce(self.tp, step.ops.gated_mlp(self.gate_up_proj, self.down_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layout, tp)
        self.mlp = MLP(cfg, layout, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(self, step: StepContext, x, residual):
        """Input norm and q, k, v: ``(q, k, v, residual)``. The residual stream is
        ``x + residual`` (vLLM's way, so the add folds into the next norm); ``residual`` is
        None at layer 0."""
        qkv = self.self_attn.qkv_proj
        if residual is None:
            x, residual = self.input_layernorm(x, step.ops, into=qkv), x
        else:
            x, residual = self.input_layernorm(x, step.ops, residual, into=qkv)
        return (*self.self_attn.project(step, x), residual)

    def post_attention(self, step: StepContext, o, residual):
        """Attention output ``o`` ``[T, H * D]`` to the layer's output ``(x, residual)``:
        o_proj, the residual add folded into the post-attention norm, MLP."""
        x, residual = self.post_attention_layernorm(
            self.self_attn.output(o), step.ops, residual, into=self.mlp.gate_up_proj
        )
        return self.mlp(step, x), residual

    def forward(self, step: StepContext, x, residual, kv_cache):
        """``(x, residual)`` in and out."""
        q, k, v, residual = self.pre_attention(step, x, residual)
        o = self.self_attn.attend(step, q, k, v, kv_cache)
        return self.post_attention(step, o, residual)


# Per-layer KV cache scales as checkpoints name them, after ``layers.N.self_attn.``:
# llm-compressor / vLLM's (``k_scale``, ``v_scale``), the older compressed-tensors output scales
# of k_proj / v_proj, and the legacy single ``kv_scale`` for both. Query and probability scales
# (fp8 attention) have no use here: they are skipped.
KV_SCALE_NAMES = {
    "k_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",),
    "v_proj.output_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
    "q_scale": (),
    "prob_scale": (),
}


class LlamaForCausalLM(nn.Module):
    float_logits = False  # class-wide: benchmarks set True to time the float32 copy as before
    # HF checkpoint names of the pieces we store fused: (ours, theirs, shard index)
    STACKED = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None):
        """``tp``: this rank's group when the model is split over several (None: one device
        holds all of it)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.layout = tp_layout(cfg, tp.size, tp.rank) if tp is not None else tp_layout(cfg, 1)
        vocab = self.layout.vocab_size
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)  # this rank's vocabulary rows
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.layout, tp) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.ops = TorchOps()  # the runner swaps in TritonOps on GPUs
        # set by the runner where the attention backend rotates q, k as it writes the KV
        self.rope_in_attention = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after ``to_empty``, which unties them)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, slots, KVH, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # hidden states [T, hidden], before the final norm
        """``layer_hook(i)``, when given, is called once layer ``i`` has written this step's KV
        (queued on the current stream): the prefill worker streams that layer out from there."""
        x = self.embed(input_ids)
        rope = self.ops.rope_state(self.rotary, positions, x.dtype)
        step = StepContext(self.ops, rope, meta, backend, self.rope_in_attention)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(step, x, residual, kv_cache)
            if layer_hook is not None:
                layer_hook(i)
        return x + residual

    # -- the same forward in pieces, cut at attention (engine/cuda_graphs.py graphs the pieces) ----
    #
    #   first_piece -> attend(0) -> middle_piece(1) -> attend(1) -> ... -> attend(L-1) -> last_piece
    #
    # Each piece is row-independent (no token reads another token's row): padded rows beyond a
    # step's real tokens change nothing in the real ones.

    def first_piece(self, step: StepContext, input_ids, positions):
        """Embedding, the step's rotary state (into ``step.rope``) and layer 0 up to attention:
        ``(q, k, v, residual)``."""
        x = self.embed(input_ids)
        step.rope = self.ops.rope_state(self.rotary, positions, x.dtype)
        return self.layers[0].pre_attention(step, x, None)

    def middle_piece(self, step: StepContext, i: int, o, residual):
        """Layer ``i - 1`` from its attention output ``o``, then layer ``i`` up to attention."""
        x, residual = self.layers[i - 1].post_attention(step, o, residual)
        return self.layers[i].pre_attention(step, x, residual)

    def last_piece(self, step: StepContext, o, residual) -> torch.Tensor:
        """The last layer from its attention output: hidden states ``[T, hidden]`` as
        ``forward`` returns them."""
        x, residual = self.layers[-1].post_attention(step, o, residual)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The embedding; split over ranks, each looks up the ids in its vocabulary rows (zeros
        for the others') and the sum over the ranks is the row (exact: one rank adds it)."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V]
        """Split over ranks: each rank's logits of its vocabulary rows, gathered on every rank
        (no sum: the same values as one device's), the padding rows cut off. In the model's
        dtype, as the LM head rounds them: the sampler takes greedy rows' argmax from them
        as they are and copies them to float32 where it computes with them (at batch 256 a
        float32 copy of every row cost 0.1 ms a step)."""
        logits = self.lm_head(self.norm(hidden, self.ops))
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        return logits.float() if self.float_logits else logits

    # -- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set.
        KV cache scales (``KV_SCALE_NAMES``) set their layer's ``k_scale`` / ``v_scale``."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = self._locate(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.cfg.architecture}"
                )
            if target.endswith(("embed_tokens.weight", "lm_head.weight")):
                tensor = _pad_rows(tensor, self.layout.vocab_size)  # the last rank's padding
            if target.endswith("o_proj.bias") and self.layout.rank != 0:
                tensor = torch.zeros_like(tensor)  # added once, by rank 0, in the sum
            _copy_shard(params[target], tensor, shard, self._shard_sizes(target))
            loaded.add(target if shard is None else f"{target}#{shard}")
        missing = self._expected_loads() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Set a layer's KV cache scale from ``layers.N.self_attn.<KV_SCALE_NAMES>``; False
        for any other tensor. One positive finite value per tensor (per-head scales are not
        supported)."""
        head, sep, what = name.partition(".self_attn.")
        if not sep or what not in KV_SCALE_NAMES:
            return False
        index = head.removeprefix("layers.")
        if not index.isdigit() or int(index) >= len(self.layers):
            raise ValueError(f"checkpoint tensor {name!r} names no layer of this model")
        if not KV_SCALE_NAMES[what]:
            return True
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
        if value is None or not (value > 0 and math.isfinite(value)):
            shape = tuple(tensor.shape)
            raise ValueError(
                f"{name} must be one positive finite KV cache scale (per-head scales are not "
                f"supported), got {value if value is not None else f'a tensor of shape {shape}'}"
            )
        for attr in KV_SCALE_NAMES[what]:
            setattr(self.layers[int(index)].self_attn, attr, value)
        return True

    def _locate(self, name: str) -> tuple[str, int | None]:
        for ours, theirs, shard in self.STACKED:
            if f".{theirs}." in name:
                return name.replace(theirs, ours), shard
        return name, None

    def _shard_sizes(self, target: str) -> list[int]:
        if "qkv_proj" in target:
            q = self.layout.num_heads * self.cfg.head_dim
            kv = self.layout.num_kv_heads * self.cfg.head_dim
            return [q, kv, kv]
        return [self.layout.intermediate_size] * 2

    def tp_slice(self, hf_name: str) -> TensorSlice | None:
        """The part of checkpoint tensor ``hf_name`` this rank holds (None: all of it), so
        each rank reads only its slice (engine/weights.py ``iterate_weights``)."""
        lay, d = self.layout, self.cfg.head_dim
        if lay.size == 1:
            return None
        name = hf_name.removeprefix("model.")
        if not name.endswith((".weight", ".bias")):
            return None  # KV cache scales: one per layer, on every rank
        stem = name.rsplit(".", 1)[0]
        if stem.endswith("q_proj"):
            return TensorSlice(0, lay.head_start * d, lay.num_heads * d)
        if stem.endswith(("k_proj", "v_proj")):
            return TensorSlice(0, lay.kv_head_start * d, lay.num_kv_heads * d)
        if stem.endswith("o_proj") and name.endswith(".weight"):
            return TensorSlice(1, lay.head_start * d, lay.num_heads * d)
        inter = lay.intermediate_size
        if stem.endswith(("gate_proj", "up_proj")):
            return TensorSlice(0, lay.rank * inter, inter)
        if stem.endswith("down_proj"):
            return TensorSlice(1, lay.rank * inter, inter)
        if stem in ("embed_tokens", "lm_head"):
            return TensorSlice(0, lay.vocab_start, lay.vocab_rows())
        return None  # norms (and o_proj's bias: rank 0's alone, load_weights)

    def _expected_loads(self) -> set[str]:
        expected = set()
        for name, _ in self.named_parameters():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected |= {f"{name}#{i}" for i in range(3)}
            elif name.endswith("gate_up_proj.weight"):
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        return expected


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (the padded end of the vocabulary)."""
    if tensor.shape[0] >= rows:
        return tensor
    pad = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad])


def _copy_shard(
    param: nn.Parameter, tensor: torch.Tensor, shard: int | None, sizes: list[int]
) -> None:
    dst = param.data
    if shard is not None:
        offset = sum(sizes[:shard])
        dst = dst.narrow(0, offset, sizes[shard])
    if dst.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}"
        )
    dst.copy_(tensor)
