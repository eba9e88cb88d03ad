"""The engine on a CUDA GPU (run on the GPU machine; skipped without CUDA).

    python -m pytest -q tests/gpu

Random tiny Llama-family models (built here by transformers, no download): greedy tokens in fp32
on CUDA must equal transformers' on CUDA; in bf16, where summation order differs, at least 90% of
prompts must match exactly (issue 3 tightens this with the Triton path).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def tiny(request, tmp_path_factory, tiny_cfg):
    cfg_cls = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config"}[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, request.param)(
        getattr(transformers, cfg_cls)(
            **tiny_cfg(
                vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=8
            )
        )
    )
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 7, 33, 100, 257)]
    return model, path, prompts


def run_engine(path, prompts, dtype, **kwargs):
    from engine import LLM, SamplingParams

    kwargs = {"num_kv_blocks": 256, "max_num_batched_tokens": 64, **kwargs}
    llm = LLM(str(path), dtype=dtype, device="cuda", **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    llm.engine.block_manager.check_invariant(expect_idle=True)
    return [o.outputs[0].token_ids for o in outs]


# The default CUDA path (Triton kernels, decode steps replayed from CUDA graphs), the same kernels
# launched one by one, and the plain-torch backend.
MODES = {
    "graphs": ({}, "triton"),
    "eager": ({"enforce_eager": True}, "triton"),
    "torch": ({}, "torch"),
}


@pytest.mark.parametrize("mode", MODES)
def test_fp32_greedy_on_cuda_equals_transformers(tiny, hf_greedy, mode, monkeypatch):
    kwargs, backend = MODES[mode]
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", backend)
    model, path, prompts = tiny
    hf = model.to(device="cuda", dtype=torch.float32)
    assert run_engine(path, prompts, "float32", **kwargs) == [hf_greedy(hf, p, 16) for p in prompts]


def test_graphs_cover_every_batch_size_and_match_eager(tiny):
    """13 concurrent requests with chunked prefill: decode batches shrink from 13 through every
    size as requests finish at different lengths, replaying padded buckets (16, 8, 4, 2, 1)."""
    from engine import LLM, SamplingParams

    _, path, _ = tiny
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 90))] for _ in range(13)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(13)
    ]
    results = []
    for eager in (False, True):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,
            max_num_batched_tokens=64,
            enforce_eager=eager,
        )
        assert (llm.engine.runner.graphs is None) == eager
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.engine.block_manager.check_invariant(expect_idle=True)
    assert results[0] == results[1]


def test_pdl_and_the_fused_rotary_change_no_token(tiny):
    """Programmatic dependent launch (kernels/pdl.py) reorders nothing a kernel computes, and
    the rotary fused into the KV write stores the same values: bf16 greedy tokens under graphs
    are the same with each off, for a batch that shrinks through the graph sizes."""
    from engine import LLM, SamplingParams
    from kernels import pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    _, path, _ = tiny
    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 90))] for _ in range(11)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(11)
    ]
    results = {}
    try:
        for name, on, fused in (("default", None, True), ("no pdl", False, True),
                                ("unfused", None, False)):  # fmt: skip
            pdl.force(on)
            llm = LLM(str(path), dtype="bfloat16", device="cuda", num_kv_blocks=256,
                      max_num_batched_tokens=64)  # fmt: skip
            runner = llm.engine.runner
            assert pdl.enabled(runner.device) == (on is not False)
            runner.model.rope_in_attention = fused
            runner.graphs.capture()
            if runner.piecewise is not None:
                runner.piecewise.capture()
            results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            llm.engine.block_manager.check_invariant(expect_idle=True)
    finally:
        pdl.force(None)
    assert results["default"] == results["no pdl"] == results["unfused"]


def test_bf16_greedy_picks_transformers_argmax_up_to_rounding(tiny):
    """bf16 reorders sums, so random tiny models (flat logits) part at near-ties; what must hold
    is that every token we pick is transformers' argmax on our own sequence, up to bf16 rounding
    of the logits (teacher forcing)."""
    model, path, prompts = tiny
    hf = model.to(device="cuda", dtype=torch.bfloat16)
    for prompt, ours in zip(prompts, run_engine(path, prompts, "bfloat16"), strict=True):
        seq = torch.tensor([prompt + ours[:-1]], device="cuda")
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1 :].float()
        gap = (
            logits.max(dim=-1).values
            - logits.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
        )
        tolerance = 0.04 * logits.abs().max().item()  # a few bf16 ulps at the logits' scale
        assert gap.max().item() <= tolerance, (gap.max().item(), tolerance)


def test_kv_pool_sized_from_gpu_memory(tiny):
    from engine import LLM

    _, path, _ = tiny
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=4)
    # Memory is plentiful for a tiny model: the pool is capped at what max_num_seqs can use.
    assert llm.engine.runner.num_kv_blocks == 4 * 512 // 16
