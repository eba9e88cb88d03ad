"""The Triton paged decode attention kernel on a CUDA GPU at serving shapes, against the
plain-torch reference (run on the GPU machine; skipped without CUDA).

    python -m pytest -q tests/gpu/test_kernel_decode_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import (
    _launch,
    paged_decode_attention,
    paged_decode_attention_ref,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Relative error bounds: ||out - ref|| / ||ref|| (bf16/fp16 round P to the cache dtype before P@V
# as flash kernels do) and the worst element.
REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_case(batch, max_ctx, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Random lengths in [1, max_ctx] (the first one max_ctx), shuffled blocks from a pool with
    spare blocks, K/V as views of one ``[2, KVH, slots, D]`` tensor, q a slice of a fused qkv."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    lens[0] = max_ctx
    width = (max_ctx + block_size - 1) // block_size
    num_blocks = batch * width + 7
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[: batch * width]
    tables = tables.view(batch, width).to(torch.int32)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g, device="cuda")
    cache = cache.to(dtype)
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=g, device="cuda")
    return qkv.to(dtype)[:, :heads], cache[0], cache[1], tables, lens


def assert_close(got, ref):
    assert not got.isnan().any()
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < REL[got.dtype], f"relative error {rel:.2e}"
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=ATOL[got.dtype])


SHAPES = [
    # batch, max_ctx, heads, kv_heads, head_dim, block_size, dtype
    (64, 4096, 32, 8, 128, 16, torch.bfloat16),
    (64, 1024, 32, 8, 128, 32, torch.float16),
    (1, 512, 32, 8, 128, 16, torch.bfloat16),
    (8, 2048, 32, 8, 64, 16, torch.bfloat16),
    (8, 2000, 32, 8, 64, 32, torch.float16),
    (5, 333, 32, 32, 128, 16, torch.bfloat16),  # MHA
    (5, 333, 16, 1, 128, 1, torch.float16),  # MQA, one slot per block
    (3, 1500, 8, 2, 256, 256, torch.bfloat16),  # block larger than the tile
    (4, 1000, 8, 2, 128, 16, torch.float32),
]


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize(
    ("batch", "max_ctx", "heads", "kv_heads", "head_dim", "block_size", "dtype"), SHAPES
)
def test_matches_reference(
    batch, max_ctx, heads, kv_heads, head_dim, block_size, dtype, num_splits
):
    q, k, v, tables, lens = make_case(
        batch, max_ctx, heads, kv_heads, head_dim, block_size, dtype, seed=batch + max_ctx
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    paged_decode_attention(q, k, v, tables, lens, block_size, scale, out=out, num_splits=num_splits)
    assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, block_size, scale))


@pytest.mark.parametrize("config", [(32, 4, 2), (64, 4, 3), (128, 8, 3), (64, 8, 4)])
def test_launch_configs(config):
    block_n, num_warps, num_stages = config
    q, k, v, tables, lens = make_case(16, 1200, 32, 8, 128, 16, torch.bfloat16, seed=block_n)
    got = _launch(
        q, k, v, tables, lens, 16, 0.1, block_n=block_n, num_warps=num_warps, num_stages=num_stages
    )
    assert_close(got, paged_decode_attention_ref(q, k, v, tables, lens, 16, 0.1))


def test_cuda_graph_replay_follows_new_lengths_and_tables():
    """Captured once, replayed after the lengths and tables change in place: nothing about them
    may be baked into the launch (grid, splits) or read on the host."""
    q, k, v, tables, lens = make_case(8, 3000, 32, 8, 128, 16, torch.bfloat16, seed=11)
    out = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.1, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, tables, lens, 16, 0.1, out=out)
    for seed in (1, 2):
        _, _, _, new_tables, new_lens = make_case(8, 3000, 32, 8, 128, 16, torch.bfloat16, seed)
        tables.copy_(new_tables)
        lens.copy_(new_lens.roll(seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, 16, 0.1))
