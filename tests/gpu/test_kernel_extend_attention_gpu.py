"""The Triton extend attention kernel at real shapes on a CUDA GPU (skipped without CUDA).

    python -m pytest -q tests/gpu/test_kernel_extend_attention_gpu.py

Llama-style heads (H32/KVH8, D128 and D64), bf16 and fp16, block size 16: a fresh 2k prompt, a
1k-token chunk over a 1k cached prefix, and a batch of mixed chunks, against the fp32 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.extend_attention import extend_attention, extend_attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK_SIZE = 16
CASES = {
    "fresh_2k": ([2048], [0]),
    "prefix_1k_new_1k": ([1024], [1024]),
    "mixed": ([1, 17, 300, 1000, 513, 64], [0, 100, 1000, 0, 2047, 3]),
}


def make_step(lens, prefixes, heads, kv_heads, head_dim, dtype):
    """q/k/v as views of one fused qkv output, the cache as one [2, KVH, slots, D] tensor whose
    slots of the new tokens hold NaN (the kernel must read new tokens from k/v), shuffled tables."""
    g = torch.Generator(device="cuda").manual_seed(sum(lens) + head_dim)
    total = sum(lens)
    width = max(math.ceil((p + n) / BLOCK_SIZE) for p, n in zip(prefixes, lens, strict=True))
    num_blocks = len(lens) * width
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(len(lens), width)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=g)
    qkv = qkv.to(dtype)
    q = qkv[:, : heads * head_dim].view(total, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)
    cache = torch.randn(
        2, kv_heads, num_blocks * BLOCK_SIZE, head_dim, device="cuda", generator=g
    ).to(dtype)
    for i, (p, n) in enumerate(zip(prefixes, lens, strict=True)):
        pos = torch.arange(p, p + n, device="cuda")
        cache[:, :, tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = float("nan")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        q,
        k,
        v,
        cache[0],
        cache[1],
        tables.to(torch.int32),
        cu.cuda(),
        torch.tensor(prefixes, dtype=torch.int32, device="cuda"),
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(case, head_dim, dtype):
    lens, prefixes = CASES[case]
    args = make_step(lens, prefixes, 32, 8, head_dim, dtype)
    scale = head_dim**-0.5
    got = extend_attention(*args, max(lens), BLOCK_SIZE, scale)
    torch.cuda.synchronize()
    ref = extend_attention_ref(*args, BLOCK_SIZE, scale)
    assert got.isfinite().all()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"relative error {rel:.2e}"


@pytest.mark.parametrize("head_dim", [256, 32, 16])
def test_other_head_dims(head_dim):
    lens, prefixes = CASES["mixed"]
    args = make_step(lens, prefixes, 8, 2, head_dim, torch.bfloat16)
    got = extend_attention(*args, max(lens), BLOCK_SIZE, head_dim**-0.5)
    ref = extend_attention_ref(*args, BLOCK_SIZE, head_dim**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_strides_without_tma_fall_back_to_plain_loads():
    """Heads not adjacent in memory (no 2-D TMA view): the default path must still be right."""
    lens, prefixes = [1500, 33], [0, 250]
    q, k, v, *rest = make_step(lens, prefixes, 32, 8, 128, torch.bfloat16)
    q_spread = torch.zeros(q.shape[0], 64, 128, dtype=q.dtype, device="cuda")[:, ::2]
    q_spread.copy_(q)
    got = extend_attention(q_spread, k, v, *rest, 1500, BLOCK_SIZE, 0.088)
    ref = extend_attention_ref(q, k, v, *rest, BLOCK_SIZE, 0.088)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_out_given_and_fp32():
    args = make_step([300, 77], [40, 0], 32, 8, 64, torch.float32)
    out = torch.full_like(args[0], float("nan"))
    got = extend_attention(*args, 300, BLOCK_SIZE, 0.125, out=out)
    assert got is out
    torch.testing.assert_close(
        out, extend_attention_ref(*args, BLOCK_SIZE, 0.125), atol=1e-4, rtol=1e-4
    )
