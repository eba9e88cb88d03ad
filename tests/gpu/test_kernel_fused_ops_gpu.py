"""The fused elementwise Triton kernels on a CUDA GPU at Llama-3-8B and SmolLM2-like sizes, in
bf16, against their plain-torch references (skipped without CUDA).

    python -m pytest -q tests/gpu/test_kernel_fused_ops_gpu.py

On the GPU both sides round fp32 to bf16 to nearest even, so nearly every element is equal; the
rest differ by 1 ulp (sum order, the GPU's approximate rsqrt/exp, fused multiply-adds).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.models.llama import RotaryEmbedding
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_write_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (hidden, intermediate, heads, kv_heads, head_dim)
LLAMA3_8B = (4096, 14336, 32, 8, 128)
SMALL = (576, 1536, 9, 3, 64)
SIZES = [pytest.param(LLAMA3_8B, id="llama3-8b"), pytest.param(SMALL, id="small")]
ROWS = [1, 64, 4096]
BF16 = torch.bfloat16


def check(got, want, min_equal=0.99):
    """Within bf16 tolerance everywhere, and bitwise equal on nearly all elements."""
    torch.testing.assert_close(got, want)
    assert (got == want).float().mean().item() >= min_equal


def qkv_views(t, size, gen):
    _, _, heads, kv_heads, d = size
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device="cuda", generator=gen).to(BF16)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return qkv, q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_kv_cache_write(size, t, gen):
    _, k, v = qkv_views(t, size, gen)[1:]
    slots = torch.randperm(2 * t + 16, device="cuda", generator=gen)[:t]
    slots[::5] = -1
    cache = torch.randn(2, k.shape[1], 2 * t + 16, k.shape[2], device="cuda").to(BF16)
    want = cache.clone()
    write_kv_cache_ref(k, v, want[0], want[1], slots)
    write_kv_cache(k, v, cache[0], cache[1], slots.int())
    assert torch.equal(cache, want)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_rms_norm_and_fused_add(size, t, gen):
    hidden = size[0]
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(BF16)
    x = torch.randn(t, hidden, device="cuda", generator=gen).to(BF16)
    residual = torch.randn(t, hidden, device="cuda", generator=gen).to(BF16)
    check(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    want_out, want_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out, total = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out is x and total is residual
    assert torch.equal(residual, want_sum)  # one rounding of the sum, as torch's bf16 add
    check(x, want_out)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_per_head_rms_norm(size, t, gen):
    _, q, k, _ = qkv_views(t, size, gen)
    weight = (1 + 0.1 * torch.randn(q.shape[2], device="cuda", generator=gen)).to(BF16)
    check(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6))
    check(rms_norm(k, weight, 1e-6), rms_norm_ref(k, weight, 1e-6))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_rotary(size, t, gen):
    rope = RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    rotary = RotaryEmbedding(size[4], 16384, rope)
    rotary.build(torch.device("cuda"))
    qkv, q, k, _ = qkv_views(t, size, gen)
    positions = torch.randint(0, 16384, (t,), device="cuda", generator=gen)
    tail = qkv[:, q.shape[1] * q.shape[2] + k.shape[1] * k.shape[2] :].clone()
    want_q, want_k = apply_rotary_ref(q, k, positions, rotary.cos, rotary.sin)
    apply_rotary(q, k, positions.int(), rotary.cos, rotary.sin)
    check(q, want_q)
    check(k, want_k)
    assert torch.equal(qkv[:, -tail.shape[1] :], tail)


@pytest.mark.parametrize("cache_dtype", [BF16, torch.float8_e4m3fn])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_rotary_write_kv_equals_rotary_then_write(size, t, cache_dtype, gen):
    """The fused kernel (one a layer in the engine) stores bit for bit what rotary and then the
    KV write store: q and k in place, k and v (fp8: quantized with their scales) in their
    slots, nothing for padding rows."""
    rotary = RotaryEmbedding(size[4], 16384, RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192))
    rotary.build(torch.device("cuda"))
    qkv, q, k, v = qkv_views(t, size, gen)
    positions = torch.randint(0, 16384, (t,), device="cuda", generator=gen)
    num_slots = 2 * t + 8
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:t]
    slots[::5] = -1
    cache = torch.randn(2, size[3], num_slots, size[4], device="cuda", generator=gen)
    cache = cache.to(cache_dtype)
    scales = (0.05, 0.02) if cache_dtype != BF16 else (1.0, 1.0)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    cut = [q.shape[1] * q.shape[2], k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]]
    wq, wk, wv = (x.view(t, -1, size[4]) for x in want_qkv[:, : sum(cut)].split(cut, dim=-1))
    apply_rotary(wq, wk, positions, rotary.cos, rotary.sin)
    write_kv_cache(wk, wv, want_cache[0], want_cache[1], slots, *scales)
    apply_rotary_write_kv(q, k, v, positions, rotary.cos, rotary.sin, cache[0], cache[1], slots,
                          *scales)  # fmt: skip
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("t", ROWS)
def test_silu_and_mul(size, t, gen):
    x = (3 * torch.randn(t, 2 * size[1], device="cuda", generator=gen)).to(BF16)
    check(silu_and_mul(x), silu_and_mul_ref(x))


def test_all_four_in_a_cuda_graph(gen):
    """Captured once, replayed on new inputs: no host sync, grids from shapes only."""
    hidden, inter, heads, kv_heads, d = LLAMA3_8B
    t = 64
    rotary = RotaryEmbedding(d, 4096, RopeConfig(500000.0))
    rotary.build(torch.device("cuda"))
    qkv, q, k, v = qkv_views(t, LLAMA3_8B, gen)
    x, residual = (torch.empty(t, hidden, device="cuda", dtype=BF16) for _ in range(2))
    gate_up = torch.empty(t, 2 * inter, device="cuda", dtype=BF16)
    weight = torch.ones(hidden, device="cuda", dtype=BF16)
    positions = torch.zeros(t, device="cuda", dtype=torch.long)
    slots = torch.zeros(t, device="cuda", dtype=torch.long)
    cache = torch.zeros(2, kv_heads, 256, d, device="cuda", dtype=BF16)

    def step():
        fused_add_rms_norm(x, residual, weight, 1e-5)
        apply_rotary(q, k, positions, rotary.cos, rotary.sin)
        write_kv_cache(k, v, cache[0], cache[1], slots)
        return silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act = step()

    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for buf in (qkv, x, residual, gate_up):
            buf.copy_(torch.randn(buf.shape, device="cuda", generator=g))
        positions.copy_(torch.randint(0, 4096, (t,), device="cuda", generator=g))
        slots.copy_(torch.randperm(256, device="cuda", generator=g)[:t])
        slots[::7] = -1
        want_norm, want_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
        want_q, want_k = apply_rotary_ref(q, k, positions, rotary.cos, rotary.sin)
        want_cache = cache.clone()
        write_kv_cache_ref(want_k, v, want_cache[0], want_cache[1], slots)
        want_act = silu_and_mul_ref(gate_up)
        graph.replay()
        check(x, want_norm)
        assert torch.equal(residual, want_sum)
        check(q, want_q)
        check(cache, want_cache, min_equal=0.98)
        check(act, want_act)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gated_gemv_equals_the_projection_then_silu_and_mul(size, fp8, gen):
    """Batch-1 gate/up GEMV with the activation in its epilogue (the engine's default under
    TritonOps): bit for bit the projection's GEMV then ``silu_and_mul`` with the same tiles,
    and within bf16 tolerance of it with each kernel's own default tiles (PDL as the engine
    launches it)."""
    from kernels.fp8_gemv import fp8_gemv_quantizing
    from kernels.fp8_quant import FP8
    from kernels.gemv import gemv, gemv_silu_mul

    hidden, inter = size[0], size[1]
    x = torch.randn(1, hidden, device="cuda", generator=gen).to(BF16)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(BF16)
    if fp8:
        ws = (w.float().abs().amax(dim=1) / 448).reshape(1, -1).contiguous()
        wq = (w.float() / ws.reshape(-1, 1)).to(FP8)

        def fused(**cfg):
            return fp8_gemv_quantizing(x, wq, ws, None, BF16, gated=True, **cfg)

        def apart(**cfg):
            return silu_and_mul(fp8_gemv_quantizing(x, wq, ws, None, BF16, **cfg))
    else:

        def fused(**cfg):
            return gemv_silu_mul(x, w, **cfg)

        def apart(**cfg):
            return silu_and_mul(gemv(x, w, **cfg))

    tiles = {"block_n": 4, "block_k": 1024, "num_warps": 8, "num_stages": 3}
    assert torch.equal(fused(**tiles), apart(**tiles))
    check(fused(), apart(), min_equal=0.98)


@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_argmax_rows_at_the_llama3_vocabulary(rows, dtype, gen):
    """Greedy's argmax kernel picks torch's token over 128,256 logits, ties included (bf16
    logits tie often: a row with its maximum repeated in two blocks)."""
    from kernels.argmax import argmax_rows

    x = torch.randn(rows, 128256, device="cuda", generator=gen).to(dtype)
    x[0, 90000] = x[0, 5000] = x[0].max() + 1
    got = argmax_rows(x)
    assert got[0].item() == 5000
    assert torch.equal(got, x.max(dim=-1).indices)
