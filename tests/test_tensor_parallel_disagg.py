"""KV between tensor-parallel layouts on CPU (gloo ranks, real TCP pair channels, workers in
this process): a prefill worker at TP p streams to a decode worker at TP d, and a running
request migrates between decode workers of different TP sizes, with transformers' greedy
tokens and exact block accounting on every worker afterwards.

On the wire a KV payload holds every KV head in one device's layout, whatever either side's
TP size: a TP sender's rank 0 gathers its ranks' heads (after the step), a TP receiver's rank
0 takes them into a buffer of the request's own and scatters each rank its heads when the
transfer completes. So any two layouts that each divide the model pair up; a pair whose
models differ is refused at the handshake (tests/test_kv_transport.py)."""

from __future__ import annotations

import asyncio

import pytest
from hf_oracle import hf_greedy_ids
from test_disagg_inprocess import disagg as run_disagg
from test_migration_inprocess import there_and_back
from test_tensor_parallel import _prompts, _save

from decode_worker.worker import DecodeWorker
from engine import SamplingParams
from engine.messages import Reserved
from prefill_worker.worker import PrefillWorker

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ENGINE = {"max_num_batched_tokens": 24, "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4}
MIGRATION = {"last_stage_blocks": 2, "headroom_blocks": 1, "chunk_tokens": 8, "timeout_s": 20}
LENGTHS = [1, 5, 23, 60]  # 60 > the 24-token budget: a prompt streamed over three steps
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


async def disagg(p, d, rid: str, prompt: list[int], params=GREEDY) -> list[int]:
    """One request through ``p`` then ``d``, read from ``d``'s stream: its tokens."""
    deltas = await run_disagg(p, d, rid, prompt, params)
    assert isinstance(deltas, list), deltas  # (else the reservation's answer)
    assert deltas[-1].error is None, deltas[-1]
    return [t for x in deltas for t in x.token_ids]


def check_idle(*workers) -> None:
    for w in workers:
        assert asyncio.run(w.check_idle()) is None, w.name


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """A tiny Llama with 8 KV heads: split 2 per rank at TP 4, 4 at TP 2."""
    model, path = _save(
        tmp_path_factory, "llama8-pd", num_attention_heads=8, num_key_value_heads=8, hidden_size=128
    )
    prompts = _prompts(LENGTHS, seed=5)
    return model, path, prompts, [hf_greedy_ids(model, x, 8) for x in prompts]


@pytest.fixture(scope="module")
def workers(llama8):
    """P at TP 4; decode A at TP 2 and decode B at TP 1 (7 rank processes in all)."""
    _, path, _, _ = llama8
    cfg = {"model_dir": path, **ENGINE}
    p = PrefillWorker({**cfg, "tensor_parallel_size": 4}, "p")
    a = DecodeWorker({**cfg, "tensor_parallel_size": 2}, "a", transport="tcp", migration=MIGRATION)
    b = DecodeWorker(cfg, "b", transport="tcp", migration=MIGRATION)
    for w in (p, a, b):
        w.start()
    yield p, a, b
    for w in (p, a, b):
        w.shutdown()


def test_p_tp4_streams_to_d_tp2_and_d_tp1(llama8, workers):
    _, _, prompts, expected = llama8
    p, a, b = workers

    async def both():
        to_a = [disagg(p, a, f"a{i}", x) for i, x in enumerate(prompts)]
        to_b = [disagg(p, b, f"b{i}", x) for i, x in enumerate(prompts)]
        return await asyncio.gather(*to_a, *to_b)

    got = asyncio.run(both())
    assert got == expected + expected
    # The second round hits P's prefix cache: cached blocks are read and sent like fresh ones.
    hits_before = asyncio.run(p.stats())["prefix_hit_tokens"]
    assert asyncio.run(disagg(p, a, "again", prompts[3])) == expected[3]
    assert asyncio.run(p.stats())["prefix_hit_tokens"] >= hits_before + 56
    check_idle(p, a, b)


def test_migration_from_d_tp2_to_d_tp1_and_back(llama8, workers):
    """A request decoding on A (TP 2) moves to B (TP 1) and back to A mid-stream: A's ranks
    gather what B receives into its pool, then B's pool goes to A's staging buffer and A's
    ranks. Its tokens equal transformers'."""
    model, _, prompts, _ = llama8
    p, a, b = workers
    # (room after the second move: on a quick host 20 tokens could end before it did)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    expected = hf_greedy_ids(model, prompts[2], 100)
    named = {"a": a, "b": b}
    client, results = asyncio.run(there_and_back(p, named, "mig", prompts[2], params))
    assert [r.outcome for r in results] == ["migrated", "migrated"], results
    assert client.moves == ["b", "a"]
    assert client.tokens == expected
    check_idle(p, a, b)


def test_tp_staging_is_bounded(llama8, workers):
    """A TP decode worker's rank 0 holds arriving KV (every head) outside the pool: past
    ``KVLimits.max_staged_bytes`` a reservation is answered Full, and a transfer that ends
    (here: failed by its caller) gives its buffer back."""
    from decode_worker.decode import STAGING_FULL
    from engine.messages import Full

    _, _, prompts, _ = llama8
    _, a, _ = workers
    role = a.decode_role
    params = SamplingParams(max_tokens=4)
    saved, role.max_staged_bytes = role.max_staged_bytes, 1  # room for one transfer at a time
    try:
        assert isinstance(asyncio.run(a.reserve("s1", prompts[2], params, "s1")), Reserved)
        held = role.staged_bytes
        spec = role.receiver.spec  # 23 tokens + 1: 6 blocks of 4, every head and layer
        assert held == spec.payload_bytes(24) * spec.num_layers > 0
        assert asyncio.run(a.stats())["kv_staged_bytes"] == held  # (/metrics shows it)
        full = asyncio.run(a.reserve("s2", prompts[1], params, "s2"))
        assert isinstance(full, Full) and full.reason == STAGING_FULL
        asyncio.run(a.fail_transfer("s1", "gone"))
        # (its release event comes back to the engine thread: any later call runs after it)
        asyncio.run(a.check_idle())
        assert role.staged_bytes == 0
        assert isinstance(asyncio.run(a.reserve("s2", prompts[1], params, "s2")), Reserved)
        asyncio.run(a.fail_transfer("s2", "gone"))
        asyncio.run(a.check_idle())
    finally:
        role.max_staged_bytes = saved
    assert role.staged_bytes == 0
    check_idle(a)


def test_smollm2_p_tp3_streams_to_d_tp1(smollm2_dir):
    """SmolLM2-135M with its real weights (9 query heads, 3 KV heads: one per prefill rank,
    all three on the decode worker; tied embeddings, a vocabulary of 49152 split in three):
    transformers' greedy text, token for token (the row-parallel sums' order changes no
    token on these prompts)."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
    prompts = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = [hf_greedy_ids(model.eval(), x, 16) for x in prompts]
    cfg = {"model_dir": smollm2_dir, **ENGINE, "block_size": 16, "max_num_batched_tokens": 64}
    p = PrefillWorker({**cfg, "tensor_parallel_size": 3}, "p3")
    d = DecodeWorker(cfg, "d1", transport="tcp")
    p.start(), d.start()
    try:

        async def run():
            jobs = (disagg(p, d, f"s{i}", x, params) for i, x in enumerate(prompts))
            return await asyncio.gather(*jobs)

        assert asyncio.run(run()) == expected
        check_idle(p, d)
    finally:
        p.shutdown()
        d.shutdown()
