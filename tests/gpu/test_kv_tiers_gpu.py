"""The KV tiers on a CUDA GPU (skipped without CUDA): blocks go down to pinned host slots and
come back bit-exact through the offload and load streams, and an engine whose prefixes come back
from the host tier and from disk (async scheduling, CUDA graphs) gives the tokens it gives when
it computes them."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

transformers = pytest.importorskip("transformers")


def test_blocks_round_trip_bit_exact_through_pinned_host_slots():
    from engine.kv_tiers import BlockLayout, KVTiers

    layout = BlockLayout(4, 2, 16, 64, torch.bfloat16)
    caches = [torch.randn(2, 2, 32 * 16, 64, device="cuda").to(torch.bfloat16) for _ in range(4)]
    tiers = KVTiers(caches, layout, 16, None)
    assert tiers.host.data.is_pinned()
    hashes = [bytes([i]) * 32 for i in range(5)]
    tiers.save(list(zip([3, 7, 8, 20, 31], hashes, strict=True)))
    assert tiers.flush()
    before = [c.clone() for c in caches]
    for c in caches:
        c.zero_()
    tiers.start_load("r", hashes, [0, 1, 2, 3, 4])
    deadline = 0
    while not (landed := tiers.landed()):
        deadline += 1
        assert deadline < 100_000
    assert landed == {"r": 5}
    for new, old in zip(caches, before, strict=True):
        for dst, src in enumerate([3, 7, 8, 20, 31]):
            assert torch.equal(
                new[:, :, dst * 16 : dst * 16 + 16], old[:, :, src * 16 : src * 16 + 16]
            )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-tiers", **GPU_TINY, max_position_embeddings=1024)


def test_prefixes_from_host_and_disk_give_the_computed_tokens(tiny, tmp_path):
    """fp32: a prefix hit's extend attention sums in another order than the whole prompt's
    prefill; in fp32 that does not move a greedy token of this model (bf16's bits are covered
    by the round trip above)."""
    dtype = "float32"
    from engine import LLM, SamplingParams
    from engine.kv_tiers import TierCosts

    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(200)] for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = LLM(tiny, dtype=dtype, device="cuda", num_kv_blocks=256, block_size=16)
    expect = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    del reference
    llm = LLM(
        tiny,
        dtype=dtype,
        device="cuda",
        num_kv_blocks=32,  # 512 tokens: each 200-token prompt pushes an older one out
        block_size=16,
        kv_offload_cpu_gb=0.01,
        kv_offload_disk_dir=str(tmp_path),
    )
    tiers = llm.engine.tiers
    tiers.costs = TierCosts(1e-6, 1e-5, 1.0)  # a tiny model: load whatever is below
    for p, want in zip(prompts, expect, strict=True):
        assert llm.generate([p], greedy)[0].outputs[0].token_ids == want
    out = llm.generate([prompts[0]], greedy)[0]
    assert out.num_cached_tokens == 192 and out.outputs[0].token_ids == expect[0]
    assert tiers.snapshot()["host"]["hits"] == 12
    tiers.flush()
    llm.engine.block_manager.check_invariant(expect_idle=True)
    del llm
    again = LLM(
        tiny,
        dtype=dtype,
        device="cuda",
        num_kv_blocks=32,
        block_size=16,
        kv_offload_disk_dir=str(tmp_path),
    )
    again.engine.tiers.costs = TierCosts(1e-6, 1e-5, 1.0)
    outs = again.generate(prompts, greedy)  # all at once: loads beside running steps
    assert [o.outputs[0].token_ids for o in outs] == expect
    assert sum(o.num_cached_tokens for o in outs) >= 192
    again.engine.block_manager.check_invariant(expect_idle=True)
