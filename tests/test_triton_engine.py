"""The GPU path's kernels end to end: the engine with the Triton attention backend and the Triton
fused ops (KV write, RMSNorm + residual, rotary, SiLU-and-mul), against transformers' greedy
tokens in fp32. Without a GPU this runs in Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1``), so the models are tiny; tests/gpu runs the same path on CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import hf_greedy_ids, tiny_config

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from engine import LLM, SamplingParams  # noqa: E402

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mqa-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 1,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CONFIGS[request.param]
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**tiny_config(**extra)))
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path)
    return model, path


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")


def test_triton_path_greedy_equals_transformers(tiny, triton_backend):
    """Chunked prefill (budget 16 splits the 45-token prompt over steps, mixed with decodes),
    prefix hits (the third prompt extends the second: its first 32 tokens come from cache) and
    batched decodes of different lengths, all through the Triton kernels."""
    model, path = tiny
    rng = random.Random(3)
    shared = [rng.randrange(320) for _ in range(40)]
    prompts = [[rng.randrange(320)], shared[:35], shared + [7, 8, 9, 10, 11]]
    expected = [hf_greedy_ids(model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=16,
    )
    runner = llm.engine.runner
    assert runner.backend.name == "triton" and runner.model.ops.name == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate(prompts[:2], params)
    second = llm.generate(prompts[2:], params)
    assert second[0].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in first + second] == expected
    llm.engine.block_manager.check_invariant(expect_idle=True)
