"""Structured outputs on a CUDA GPU (skipped without CUDA): the grammar-mask kernel against its
reference at Llama 3's vocabulary, and an engine with async scheduling and CUDA graphs whose
constrained answers (masks filled while the forward runs, copied pinned, applied on the device)
all validate, beside free requests that keep their tokens.

The engine test needs a tokenizer: SmolLM2's (``TANDEM_GPU_TOKENIZER_DIR``, or the model hub's
smollm2 folder) on a tiny random model of its vocabulary."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")


def test_kernel_matches_the_reference_at_llama3_vocab():
    from kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, rows = 128256, 64
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    words = torch.randint(
        -(2**31), 2**31 - 1, (40, (vocab + 31) // 32), device="cuda", dtype=torch.int32, generator=g
    )
    index = torch.randperm(rows, device="cuda", generator=g)[:40]
    got = apply_token_bitmask_(logits.clone(), words, index)
    assert torch.equal(got, apply_token_bitmask_ref(logits.clone(), words, index))
    assert torch.isinf(got[index]).any() and torch.isfinite(got[index]).any()


def tokenizer_dir() -> Path:
    where = os.environ.get("TANDEM_GPU_TOKENIZER_DIR")
    if where:
        return Path(where)
    from engine.model_hub import resolve_model

    try:
        return Path(resolve_model("smollm2"))
    except Exception as exc:  # noqa: BLE001 - no network on the GPU machine: say what to set
        pytest.skip(f"no SmolLM2 tokenizer ({exc}); set TANDEM_GPU_TOKENIZER_DIR")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = Path(
        save_tiny(tmp_path_factory, "tiny-structured-gpu", **{**GPU_TINY, "vocab_size": 49152})
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir() / name, path / name)
    return str(path)


def test_constrained_answers_validate_with_async_scheduling_and_graphs(tiny):
    from engine import LLM, SamplingParams
    from engine.sampling_params import StructuredSpec

    llm = LLM(tiny, dtype="bfloat16", device="cuda", max_num_seqs=16, gpu_memory_utilization=0.3)
    assert llm.engine.cfg.async_scheduling
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    }
    spec = StructuredSpec.json_schema(schema)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[100 + i, 200, 300 + i] for i in range(12)]
    alone = llm.generate(prompts[0], free)[0].outputs[0].token_ids
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured=spec) if i % 3 else free
        for i in range(12)
    ]
    params[0] = free
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == alone
    for p, out in zip(params, outs, strict=True):
        if p.structured is not None:
            o = out.outputs[0]
            assert o.finish_reason == "stop", (o.finish_reason, o.text)
            value = json.loads(o.text)
            assert set(value) == {"name", "n", "tags"} and len(value["name"]) <= 8
            assert isinstance(value["n"], int) and 0 <= value["n"] <= 99
            assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
    stats = llm.engine.grammar_stats()
    assert stats["errors"] == 0 and stats["mask_sum"] > 0
