"""Greedy tokens and logprobs against Hugging Face transformers (fp32, CPU) for random tiny models
of every supported architecture, on every scheduling path: plain, chunked prefill, forced
preemption, prefix hits, n > 1."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_oracle import hf_greedy_ids, tiny_config

from engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

BASE = {"vocab_size": 320}
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama-tied-mqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
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
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "tie_word_embeddings": False}),
}

PROMPT_LENS = [1, 5, 16, 17, 40, 131]
MAX_TOKENS = 10


def _make_model(tmp_path_factory, name):
    cfg_cls, model_cls, extra = CONFIGS[name]
    config = getattr(transformers, cfg_cls)(**tiny_config(**extra))
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    model, path = _make_model(tmp_path_factory, request.param)
    rng = random.Random(7)
    prompts = [[rng.randrange(BASE["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]
    expected = [hf_greedy(model, p) for p in prompts]
    return model, path, prompts, expected


def hf_greedy(model, prompt, max_new_tokens=MAX_TOKENS):
    return hf_greedy_ids(model, prompt, max_new_tokens)


def run_engine(path, prompts, params=None, **kwargs):
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params)
    llm.engine.block_manager.check_invariant(expect_idle=True)
    return llm, outs


def test_config_is_what_hf_saved(tiny):
    path = tiny[1]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"][0] in {m for _, m, _ in CONFIGS.values()}


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 7, "block_size": 4},  # chunked prefill, decode+prefill mixed
        {"num_kv_blocks": 12, "block_size": 16},  # forced preemption (recompute)
        # Async scheduling: step N+1 scheduled and launched before N's tokens are read
        {"async_scheduling": True},
        {"max_num_batched_tokens": 7, "block_size": 4, "async_scheduling": True},
        {"num_kv_blocks": 12, "block_size": 16, "async_scheduling": True},
    ],
    ids=["plain", "chunked", "preempt", "async", "async-chunked", "async-preempt"],
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_matches_hf(tiny, engine_kwargs, backend, monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", backend)
    _, path, prompts, expected = tiny
    llm, outs = run_engine(path, prompts, **engine_kwargs)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert llm.engine.runner.backend.name == ("torch" if backend == "torch" else "cpu")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_happens_and_tokens_match(tmp_path_factory, async_scheduling):
    model, path = _make_model(tmp_path_factory, "llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(BASE["vocab_size"]) for _ in range(30)] for _ in range(6)]
    expected = [hf_greedy(model, p, 40) for p in prompts]
    llm = LLM(str(path), num_kv_blocks=14, block_size=8, async_scheduling=async_scheduling)
    seen = []
    original = llm.engine.scheduler._preempt

    def spy(request):
        seen.append(request.request_id)
        original(request)

    llm.engine.scheduler._preempt = spy
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    assert seen, "the pool was sized to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.engine.block_manager.check_invariant(expect_idle=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_hits_give_same_tokens(tiny, async_scheduling):
    model, path, prompts, expected = tiny
    shared = prompts[-1][:96]
    tails = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    batch = [shared + t for t in tails]
    expected = [hf_greedy(model, p) for p in batch]
    llm = LLM(str(path), block_size=16, async_scheduling=async_scheduling)
    first = llm.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(batch[1:], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.num_cached_tokens for o in rest] == [96, 96]
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == expected
    llm.engine.block_manager.check_invariant(expect_idle=True)


@pytest.fixture(scope="module")
def one_tiny(tmp_path_factory):
    """One of the tiny models (for engine behaviour that does not depend on the model)."""
    return _make_model(tmp_path_factory, "llama")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(one_tiny, async_scheduling):
    """A workload run twice hits its own prefixes the second time unless the cache is reset
    between (as benchmarks that repeat one workload do); a reset while a request is unfinished
    refuses and forgets nothing; after ``generate`` returns, even an asynchronously scheduled
    engine has nothing in flight that would refuse it."""
    model, path = one_tiny
    prompt = [(7 * i + 3) % BASE["vocab_size"] for i in range(98)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(str(path), block_size=16, async_scheduling=async_scheduling)
    first = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 96  # hit: no reset
    llm.engine.add_request("busy", prompt, params)
    assert not llm.reset_prefix_cache()  # a request is unfinished
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache()
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model, prompt)
    assert llm.reset_prefix_cache()  # straight after generate
    llm.engine.block_manager.check_invariant(expect_idle=True)


def test_logprobs_match_hf_log_softmax(tiny):
    model, path, prompts, expected = tiny
    prompt = prompts[3]
    llm, outs = run_engine(
        path, [prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=5)
    )
    out = outs[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(model(full).logits[0, len(prompt) - 1 :].float(), dim=-1)
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert len(entry) == 5 or (len(entry) == 6 and tok not in ref[step].topk(5).indices)
        for t, lp in entry.items():
            assert abs(lp - ref[step, t].item()) < 1e-4
        assert set(ref[step].topk(5).indices.tolist()) <= set(entry)


def test_n_greater_than_one_shares_prompt_blocks(tiny):
    model, path, prompts, expected = tiny
    prompt, expected = prompts[-1], expected[-1]
    llm = LLM(str(path), block_size=16)
    allocated = []
    bm = llm.engine.block_manager
    original = bm.allocate_slots

    def spy(request, num_new_tokens, computed_blocks=()):
        new = original(request, num_new_tokens, computed_blocks)
        allocated.append((request.request_id, list(computed_blocks), new))
        return new

    bm.allocate_slots = spy
    outs = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3))
    assert [c.token_ids for c in outs[0].outputs] == [expected] * 3
    admissions = {rid: hits for rid, hits, _ in allocated if hits}
    full_blocks = (len(prompt) - 1) // 16
    assert len(admissions) == 2 and all(len(h) == full_blocks for h in admissions.values())
    bm.check_invariant(expect_idle=True)


def test_n_samples_differ_and_are_seeded(tiny):
    _, path, prompts, _ = tiny
    llm = LLM(str(path))
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    a = llm.generate([prompts[2]], params)[0]
    b = llm.generate([prompts[2]], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
