"""Tensor parallelism on CPU (gloo): a model split over 2, 3 and 4 rank processes gives
transformers' greedy tokens (fp32), on every scheduling path, with KV heads split and
replicated; a layout that does not divide is refused naming the sizes; a rank that dies fails
the engine at once with an error naming it, never a hang.

The row-parallel all-reduces (o_proj, down_proj) add each rank's partial sums, an order one
device does not use: logits may differ from transformers' by fp32 rounding. On these models
no greedy token differs; ``test_logprobs_within_fp32_tolerance`` bounds the difference.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from hf_oracle import hf_greedy_ids, save_tiny_model

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.parallel import RankFailure, tp_layout

transformers = pytest.importorskip("transformers")

VOCAB = 320  # not a multiple of 3: the TP 3 vocabulary is padded by one row
MAX_TOKENS = 8


def _save(tmp_path_factory, name: str, **overrides):
    return save_tiny_model(tmp_path_factory, name, vocab_size=VOCAB, **overrides)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _greedy(llm, prompts, max_tokens=MAX_TOKENS):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


# -- the layout (no processes) ---------------------------------------------------------------


def _cfg(heads, kv_heads, inter=96, vocab=VOCAB):
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 16 * heads,
            "intermediate_size": inter,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


def test_layout_splits_or_replicates_kv_heads():
    smol = [tp_layout(_cfg(9, 3), 3, r) for r in range(3)]  # SmolLM2's heads at TP 3: split
    assert [(lay.num_heads, lay.num_kv_heads, lay.kv_head_start) for lay in smol] == [
        (3, 1, 0),
        (3, 1, 1),
        (3, 1, 2),
    ]
    assert [lay.vocab_rows() for lay in smol] == [107, 107, 106]  # 320 padded to 321
    rep = [tp_layout(_cfg(8, 2), 4, r) for r in range(4)]  # 2 KV heads at TP 4: replicated
    assert [(lay.num_kv_heads, lay.kv_head_start, lay.kv_replicas) for lay in rep] == [
        (1, 0, 2),
        (1, 0, 2),
        (1, 1, 2),
        (1, 1, 2),
    ]


@pytest.mark.parametrize(
    "shape, tp, words",
    [
        ((9, 3), 2, ["num_attention_heads=9", "tensor_parallel_size=2"]),
        ((12, 3), 4, ["num_key_value_heads=3", "tensor_parallel_size=4"]),
        ((8, 8, 90), 4, ["intermediate_size=90", "tensor_parallel_size=4"]),
    ],
)
def test_layout_that_does_not_divide_is_refused(shape, tp, words):
    with pytest.raises(ValueError) as err:
        tp_layout(_cfg(*shape), tp)
    assert all(w in str(err.value) for w in words), err.value


def test_engine_refuses_before_starting_ranks(tmp_path_factory):
    _, path = _save(
        tmp_path_factory,
        "smol-shape",
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=144,
    )
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible"):
        LLM(path, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 5  # refused from the config, no rank process started
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(path, tensor_parallel_size=0)


# -- a tiny Llama with 8 KV heads at TP 2: every scheduling path (async scheduling on, so a
# pending token's id goes from rank 0 to the other rank on the device group) ------------------

PROMPT_LENS = [1, 9, 40]  # 40 > the 16-token budget: chunked prefill


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    model, path = _save(
        tmp_path_factory, "llama8", num_attention_heads=8, num_key_value_heads=8, hidden_size=128
    )
    prompts = _prompts(PROMPT_LENS)
    expected = [hf_greedy_ids(model, p, MAX_TOKENS) for p in prompts]
    return model, path, prompts, expected


@pytest.fixture(scope="module")
def tp2(llama8):
    _, path, _, _ = llama8
    llm = LLM(
        path,
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=12,  # 96 slots: the preemption test's batch does not fit
        max_num_batched_tokens=16,
        async_scheduling=True,
    )
    yield llm
    llm.close()


def test_tp2_greedy_matches_hf_with_chunked_prefill(tp2, llama8):
    _, _, prompts, expected = llama8
    assert max(len(p) for p in prompts) > tp2.engine.cfg.max_num_batched_tokens
    assert _greedy(tp2, prompts) == expected
    kv = tp2.engine.runner.kv_caches[0]
    assert kv.shape[1] == 4  # rank 0's pool holds its 4 of the 8 KV heads
    tp2.engine.block_manager.check_invariant(expect_idle=True)


def test_tp2_prefix_hit_same_tokens(tp2, llama8):
    model, _, prompts, _ = llama8
    prompt = prompts[-1][:32] + [5, 6, 7]
    first = tp2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    again = tp2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert again[0].num_cached_tokens == 32
    expected = hf_greedy_ids(model, prompt, MAX_TOKENS)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == expected
    tp2.engine.block_manager.check_invariant(expect_idle=True)


def test_tp2_preemption_same_tokens(tp2, llama8):
    model, _, _, _ = llama8
    prompts = _prompts([20] * 4, seed=3)
    expected = [hf_greedy_ids(model, p, 16) for p in prompts]
    before = tp2.engine.scheduler.num_preemptions
    assert _greedy(tp2, prompts, 16) == expected
    assert tp2.engine.scheduler.num_preemptions > before  # 4 x 36 tokens > 96 slots
    tp2.engine.block_manager.check_invariant(expect_idle=True)


def test_logprobs_within_fp32_tolerance(tp2, llama8):
    """The row-parallel sums change the order of fp32 additions: the logprobs stay within
    1e-4 of transformers' log-softmax."""
    model, _, prompts, _ = llama8
    prompt = prompts[1]
    out = tp2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=5))
    seq = out[0].outputs[0]
    full = torch.tensor([prompt + seq.token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(model(full).logits[0, len(prompt) - 1 :].float(), dim=-1)
    for step, entry in enumerate(seq.logprobs):
        assert set(ref[step].topk(5).indices.tolist()) <= set(entry)
        for token, logprob in entry.items():
            assert abs(logprob - ref[step, token].item()) < 1e-4


# -- TP 4 (one short generation each: four ranks on two cores) and SmolLM2's heads at TP 3 -----


def test_tp4_kv_heads_split(llama8):
    _, path, prompts, expected = llama8
    with LLM(path, tensor_parallel_size=4, block_size=8) as llm:
        assert llm.engine.runner.kv_caches[0].shape[1] == 2
        assert _greedy(llm, prompts[:2]) == expected[:2]


def test_tp4_kv_heads_replicated(tmp_path_factory):
    model, path = _save(
        tmp_path_factory, "llama-kv2", num_attention_heads=8, num_key_value_heads=2, hidden_size=128
    )
    prompts = _prompts([1, 12], seed=5)
    expected = [hf_greedy_ids(model, p, MAX_TOKENS) for p in prompts]
    with LLM(path, tensor_parallel_size=4, block_size=8) as llm:
        assert llm.engine.runner.kv_caches[0].shape[1] == 1  # KV head 0, shared with rank 1
        assert _greedy(llm, prompts) == expected


def test_smollm2_shape_tp3(tmp_path_factory):
    """SmolLM2's layout: 9 query heads, 3 KV heads (one per rank), tied embeddings, and a
    vocabulary padded to a multiple of 3."""
    model, path = _save(
        tmp_path_factory,
        "smol-tp3",
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=144,
        tie_word_embeddings=True,
    )
    prompts = _prompts([3, 21], seed=9)
    expected = [hf_greedy_ids(model, p, MAX_TOKENS) for p in prompts]
    with LLM(path, tensor_parallel_size=3, block_size=8) as llm:
        assert _greedy(llm, prompts) == expected


# -- a rank that dies ----------------------------------------------------------------------------


def test_rank_killed_while_idle_fails_the_next_step(llama8):
    _, path, prompts, _ = llama8
    llm = LLM(path, tensor_parallel_size=2, block_size=8)
    try:
        (pid,) = llm.engine.ranks.pids
        os.kill(pid, signal.SIGKILL)
        assert llm.engine.ranks.died.wait(10), "the watcher saw the rank exit"
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
            _greedy(llm, prompts[:1])
        assert time.monotonic() - t0 < 5
    finally:
        llm.close()


def test_rank_killed_mid_generation_fails_fast(llama8):
    _, path, prompts, _ = llama8
    llm = LLM(path, tensor_parallel_size=2, block_size=8)
    try:
        engine = llm.engine
        engine.add_request(None, prompts[2], SamplingParams(temperature=0.0, max_tokens=200))
        for _ in range(3):
            engine.step()
        os.kill(engine.ranks.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 10
    finally:
        llm.close()
