"""Frozen configuration of a model and of an engine, read once and passed down."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.settings import setting

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = ("float32", "bfloat16", "float16")
# What the KV pool may hold: "auto" is the model's dtype; "fp8" is e4m3 (torch.float8_e4m3fn,
# max 448) with a per-layer K and V scale (engine/attention.py, kernels/).
KV_CACHE_DTYPES = ("auto", "fp8")
# Weight quantizations (engine/quant.py): "fp8" is e4m3 weights with per-output-channel scales.
QUANTIZATIONS = ("fp8",)
FP8_KV_DTYPE = "float8_e4m3fn"
# Largest piecewise graph bucket allowed: each bucket is L + 1 graphs and a working set that grows
# with its tokens; past this a step is GPU-bound and graphs win nothing.
PIECEWISE_MAX_TOKENS = 16384
# What max_num_batched_tokens / max_num_seqs default to on each device. CUDA: the fastest of
# benchmarks/gpu_sweep.py on one H100 on vLLM's own ShareGPT sample (Llama-3-8B shape, 1000
# prompts at once: 36.4 req/s at 512 / 2048, 35.0-36.2 at the former 256 / 2048, 31.2 at
# 512 / 8192); on the 110-in / 275-out lengths file 512 / 8192 led (37.4 vs 33.1 req/s):
# benchmarks/NOTES.md "Engine defaults".
DEVICE_DEFAULTS = {
    "cuda": {"max_num_batched_tokens": 2048, "max_num_seqs": 512, "block_size": 16},
    # blocks of 128 on CPU, as vLLM's CPU backend: a sequence's KV is read in longer runs
    # (benchmarks/NOTES.md, "The CPU engine against vLLM's, phase by phase")
    "cpu": {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 128},
}


def device_defaults(device: str) -> dict[str, int]:
    """What ``DEVICE_DEFAULTS`` gives ``device`` (``cuda``, ``cuda:1``, ``cpu``)."""
    return DEVICE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The parts of an HF config.json the Llama-family decoder needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when config.attention_bias
    o_proj_bias: bool  # Llama/Qwen3 when config.attention_bias
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: the trained context, capped by a sliding window (which this
        engine does not implement, so it never lets a sequence grow past it)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """Per element size is applied by the caller: layers * (K + V) * kv heads * head dim."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; tandem supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        if cfg.get("mlp_bias"):
            raise ValueError(
                "mlp_bias=true is not supported (no released Llama-family model uses it)"
            )
        bias = bool(cfg.get("attention_bias", False)) and arch != "MistralForCausalLM"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_config(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or bias,
            o_proj_bias=bias and arch != "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            eos_token_ids=eos_ids,
            raw=cfg,
        )


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    """Reads both spellings: ``rope_scaling`` + ``rope_theta`` (transformers 4) and
    ``rope_parameters`` (transformers 5)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int | None = None  # tokens per KV block; None: the device's (DEVICE_DEFAULTS)
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0  # used on CPU when num_kv_blocks is None
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "what the KV cache stores: 'auto' (the model's dtype) or 'fp8' (e4m3, one "
            "scale per layer for K and one for V, from the checkpoint's k_scale / v_scale or "
            "1.0): half the bytes of bf16 per token, so twice the blocks in the same memory "
            "and half the bytes a decode step reads and a KV transfer sends"
        },
    )
    gpu_memory_utilization: float = 0.9
    quantization: str | None = setting(
        None,
        "'fp8': the decoder layers' projections quantized at load to e4m3 with a scale per "
        "output channel, activations quantized per token at each matmul (torch._scaled_mm: "
        "CUDA compute capability 8.9+, or torch's CPU kernel); the LM head, embedding and "
        "norms stay in dtype. Half the weight bytes of bf16. None: weights as loaded",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks one worker's model is split over (tensor parallelism: a process and a device "
        "each, NCCL on GPUs, gloo on CPU); query heads and intermediate size must divide by it, "
        "KV heads divide by it or it by them (then replicated)",
        ge=1,
    )
    # None: the device's default (DEVICE_DEFAULTS: on CUDA the fastest of the sweep in
    # benchmarks/gpu_sweep.py, NOTES "engine defaults"; on CPU what the CPU benchmarks ran)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launched kernel by kernel)
    # largest decode batch captured (capped at max_num_seqs; None: max_num_seqs); 0: no decode
    # graphs (a prefill worker never runs a decode step; its steps go to the piecewise graphs)
    cuda_graph_max_batch: int | None = None
    cuda_graph_max_tokens: int = field(
        default=2048,
        metadata={
            "help": "CUDA: largest step (tokens) whose dense layers replay from piecewise CUDA "
            "graphs, attention launched between them (steps carrying prefill chunks, and decode "
            "batches above cuda_graph_max_batch); capped at max_num_batched_tokens; bigger steps "
            "run eagerly; 0 turns piecewise graphs off",
            "min": 0,
            "max": PIECEWISE_MAX_TOKENS,
        },
    )
    kv_offload_cpu_gb: float = field(
        default=0.0,
        metadata={
            "help": "host-memory KV tier under the device pool, in GiB (pinned on CUDA): full "
            "blocks are copied down as they fill, a prefix found there is loaded back instead "
            "of recomputed; 0 turns it off",
            "min": 0.0,
        },
    )
    kv_offload_disk_dir: str | None = field(
        default=None,
        metadata={
            "help": "folder of the disk KV tier (one checked file per block; kept across "
            "restarts, shareable by the workers of a node); unset turns it off",
        },
    )
    kv_offload_disk_gb: float = field(
        default=16.0,
        metadata={"help": "size bound of the disk KV tier, in GiB", "min": 0.0},
    )
    sm_carveout: int = 0  # CUDA: SMs cuBLAS matmuls leave free (for the KV stream's NCCL kernels)
    # Schedule and prepare step N+1 while step N runs on the device, its sampled tokens fed to
    # N+1 on the device (vLLM V1's async scheduling, SGLang's overlap scheduler). None: on for
    # CUDA; on CPU the forward pass runs on the host's own cores, so there is nothing to hide
    # behind (True runs the same pipeline there, as the tests do).
    async_scheduling: bool | None = None
    # Build text and check stop strings in the engine (offline). Workers turn it off: the router
    # detokenizes their token-id streams in its own process, off the engine thread (as vLLM's
    # front end does), and aborts a request whose text hit a stop string.
    detokenize: bool = True
    # Output-length refinement: a LengthProbe artifact (engine/length_probe.py; the path of its
    # .npz/.json pair), or "auto": the probe shipped in engine/data for a model of this shape,
    # if any (prefill and colocated workers default to it). At the end of each prompt's prefill
    # the probe reads the model's hidden state at the last prompt token; the estimate rides on
    # the request's first output.
    length_probe: str | None = None
    # Hidden states to hand back on each RequestOutput (``prompt_hidden``) at the last prompt
    # token: a layer's output, or -1 for after the final norm (collecting a probe's data).
    prompt_hidden_layers: tuple[int, ...] = ()
    grammar_compile_threads: int = field(
        default=2,
        metadata={
            "help": "structured outputs: threads compiling grammars off the engine thread (a "
            "request waits for its grammar while the batch goes on)",
            "min": 1,
            "max": 64,
        },
    )

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_offload_cpu_gb > 0 or bool(self.kv_offload_disk_dir)

    def __post_init__(self) -> None:
        for name, value in device_defaults(self.device).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.cuda_graph_max_batch is None:
            object.__setattr__(self, "cuda_graph_max_batch", self.max_num_seqs)
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", self.device.startswith("cuda"))
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} ('auto': the model's dtype), "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None (weights in dtype), got "
                f"{self.quantization!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"cuda_graph_max_batch must be >= 0 (0: no decode graphs), got "
                f"{self.cuda_graph_max_batch}"
            )
        if not 0 <= self.cuda_graph_max_tokens <= PIECEWISE_MAX_TOKENS:
            raise ValueError(
                f"cuda_graph_max_tokens must be in [0, {PIECEWISE_MAX_TOKENS}] (0: no piecewise "
                f"graphs), got {self.cuda_graph_max_tokens}"
            )
        if self.kv_offload_cpu_gb < 0 or self.kv_offload_disk_gb < 0:
            raise ValueError(
                f"kv_offload_cpu_gb and kv_offload_disk_gb must be >= 0, got "
                f"{self.kv_offload_cpu_gb}, {self.kv_offload_disk_gb}"
            )
        if self.kv_tiers_enabled and not self.enable_prefix_caching:
            raise ValueError(
                "the KV tiers (kv_offload_cpu_gb, kv_offload_disk_dir) find blocks by their "
                "prefix hashes: they need enable_prefix_caching=True"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(
            self.tensor_parallel_size, int
        ):
            raise ValueError(
                f"tensor_parallel_size must be an integer, got {self.tensor_parallel_size!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kv_tiers_enabled:
            raise ValueError(
                "the KV tiers (kv_offload_cpu_gb, kv_offload_disk_dir) do not run with "
                f"tensor_parallel_size={self.tensor_parallel_size} yet: each rank holds a slice "
                "of every block; set tensor_parallel_size=1 or turn the tiers off"
            )
        if not 1 <= self.grammar_compile_threads <= 64:
            raise ValueError(
                f"grammar_compile_threads must be in [1, 64], got {self.grammar_compile_threads}"
            )
        if self.sm_carveout < 0:
            raise ValueError(f"sm_carveout must be >= 0, got {self.sm_carveout}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def kv_dtype(self) -> str:
        """The dtype the KV pool holds, by torch's name: the model's, or ``float8_e4m3fn``."""
        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8" else self.dtype
