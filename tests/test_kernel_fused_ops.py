"""The fused elementwise Triton kernels (KV cache write, RMSNorm, rotary, SiLU-and-mul) against
their plain-torch references on random odd sizes and strided views; the references against the
engine's own torch code. Without a GPU the kernels run in Triton's interpreter (conftest.py).

Tolerances: fp32 tight. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to
nearest even), so a bf16 result here may sit 1 ulp (2**-8 relative) off per rounding; fp16 it
rounds to nearest. tests/gpu/test_kernel_fused_ops_gpu.py checks bf16 on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.models.llama import RMSNorm, RotaryEmbedding, apply_rotary
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fp8 import quantize_fp8
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary as apply_rotary_kernel
from kernels.rotary import apply_rotary_ref, apply_rotary_write_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def close(got, want):
    torch.testing.assert_close(got, want, **TOL[want.dtype])


def fused_qkv(t, heads, kv_heads, head_dim, dtype, gen, bias_cols=0):
    """q, k, v as the model makes them: views of one ``[T, (H + 2 KVH) D]`` projection output
    (plus ``bias_cols`` extra columns, so rows are longer than the three together)."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(t, q_size + 2 * kv_size + bias_cols, generator=gen).to(dtype)
    q, k, v = qkv[:, : q_size + 2 * kv_size].split([q_size, kv_size, kv_size], dim=-1)
    view = lambda x, h: x.view(t, h, head_dim)  # noqa: E731
    return qkv, view(q, heads), view(k, kv_heads), view(v, kv_heads)


# -- KV cache write --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(8, 128), (3, 64), (1, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_cache_write(dtype, kv_heads, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    num_slots = 64
    for t in (1, 3, 17):
        _, _, k, v = fused_qkv(t, 2 * kv_heads, kv_heads, head_dim, dtype, gen, bias_cols=8)
        slots = torch.randperm(num_slots, generator=gen)[:t]
        slots[1::3] = -1  # padding rows of a graphed batch
        slots = slots.to(slot_dtype)
        cache = torch.randn(2, kv_heads, num_slots, head_dim, generator=gen).to(dtype)
        want = cache.clone()
        write_kv_cache_ref(k, v, want[0], want[1], slots)
        write_kv_cache(k, v, cache[0], cache[1], slots)
        assert torch.equal(cache, want)
        kept = slots[slots >= 0].long()
        assert torch.equal(cache[0][:, kept], k[slots >= 0].transpose(0, 1))
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[kept] = False
        assert torch.equal(cache[:, :, untouched], want[:, :, untouched])


def test_kv_cache_write_ref_matches_engine_index_copy():
    """Without padding rows the reference is the torch backend's ``index_copy_``."""
    gen = torch.Generator().manual_seed(0)
    _, _, k, v = fused_qkv(5, 6, 3, 64, torch.float32, gen)
    slots = torch.randperm(40, generator=gen)[:5]
    ours, engine = torch.zeros(2, 3, 40, 64), torch.zeros(2, 3, 40, 64)
    write_kv_cache_ref(k, v, ours[0], ours[1], slots)
    engine[0].index_copy_(1, slots, k.transpose(0, 1))
    engine[1].index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(ours, engine)


def fp8_grid_values(shape, scale: float, gen) -> torch.Tensor:
    """Random e4m3 values times ``scale`` (a power of two, so ``x / scale`` is exact), a few
    of them past +-448 * scale (clamped on store): inputs whose quantization is exact."""
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN
    x = bits.view(torch.float8_e4m3fn).float()
    x.view(-1)[::7] *= 4  # 4 * 448 and friends: clamped
    return x * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_fp8(dtype):
    """Quantize on store: value / scale clamped to +-448, cast to e4m3, byte for byte what the
    torch reference stores. The interpreter's own fp32 -> fp8 rounding is wrong when the
    mantissa carries (Triton 3.6), so these inputs need no rounding; tests/gpu rounds."""
    gen = torch.Generator().manual_seed(3)
    t, kv_heads, head_dim, num_slots = 9, 2, 32, 40
    k_scale, v_scale = 0.25, 2.0
    k = fp8_grid_values((t, kv_heads, head_dim), k_scale, gen).to(dtype)
    v = fp8_grid_values((t, kv_heads, head_dim), v_scale, gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots[2] = -1
    cache = torch.zeros(2, kv_heads, num_slots, head_dim, dtype=torch.float8_e4m3fn)
    want = cache.clone()
    write_kv_cache(k, v, cache[0], cache[1], slots, k_scale, v_scale)
    write_kv_cache_ref(k, v, want[0], want[1], slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    kept = slots[slots >= 0]
    stored = cache[0][:, kept].float() * k_scale  # dequantized: the input, clamped
    expect = k[slots >= 0].transpose(0, 1).float().clamp(-448 * k_scale, 448 * k_scale)
    assert torch.equal(stored, expect)
    assert cache[1][:, kept].float().abs().max() == 448  # some of v clamped
    assert not cache[:, :, slots[2]].float().any()  # the padding row's slot: untouched


def test_fp8_reference_rounds_to_nearest_even():
    """The reference is torch's cast: round to nearest, ties to even, after the clamp."""
    x = torch.tensor([1.0625, 1.1875, 17.0, 500.0, -1e9, 0.0009765625 * 1.5])
    got = quantize_fp8(x, 1.0).float()  # ties: 1.0625 -> 1.0, 1.1875 -> 1.25, 17 -> 16
    assert got.tolist() == [1.0, 1.25, 16.0, 448.0, -448.0, 0.001953125]
    assert quantize_fp8(torch.tensor([3.0]), 0.5).float().item() == 6.0  # stored: value / scale


def test_kv_cache_write_all_padding_and_empty():
    k = torch.randn(2, 2, 16)
    cache = torch.randn(2, 2, 8, 16)
    want = cache.clone()
    write_kv_cache(k, k, cache[0], cache[1], torch.tensor([-1, -7]))
    write_kv_cache(k[:0], k[:0], cache[0], cache[1], torch.zeros(0, dtype=torch.long))
    assert torch.equal(cache, want)


def test_kv_cache_write_rejects_mismatch():
    k = torch.randn(2, 2, 16)
    cache = torch.zeros(2, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="share one of"):
        write_kv_cache(k, k, cache[0], cache[1], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache[0].float(), cache[1].float(), torch.tensor([0.0, 1.0]))
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale must be a positive finite"):
        write_kv_cache(k, k, fp8[0], fp8[1], torch.tensor([0, 1]), k_scale=-1.0)
    with pytest.raises(ValueError, match="share one of"):  # one cache fp8, the other not
        write_kv_cache(k, k, fp8[0], cache[1].float(), torch.tensor([0, 1]))


# -- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [4096, 576, 100, 64])
def test_rms_norm(dtype, n):
    gen = torch.Generator().manual_seed(n)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    for t in (1, 3, 17):
        wide = torch.randn(t, n + 24, generator=gen).to(dtype)
        x = wide[:, 8 : 8 + n]  # strided rows
        close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
        out = torch.full((t, 2 * n), 7.0, dtype=dtype)
        got = rms_norm(x, weight, 1e-5, out=out[:, :n])
        assert got.data_ptr() == out.data_ptr() and (out[:, n:] == 7).all()
        close(out[:, :n], rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (4, 128), (3, 16)])
def test_rms_norm_per_head(dtype, heads, head_dim):
    """Qwen3's q/k norm: [T, heads, D] views of the fused qkv output, normalised per head."""
    gen = torch.Generator().manual_seed(heads)
    weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    for t in (1, 3, 17):
        _, q, k, _ = fused_qkv(t, heads, 1, head_dim, dtype, gen, bias_cols=5)
        close(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6))
        close(rms_norm(k, weight, 1e-6), rms_norm_ref(k, weight, 1e-6))
        want = rms_norm_ref(q, weight, 1e-6)
        rms_norm(q, weight, 1e-6, out=q)  # in place through the strided view
        close(q, want)
    x4 = torch.randn(2, 3, heads, head_dim, generator=gen).to(dtype)
    close(rms_norm(x4, weight, 1e-6), rms_norm_ref(x4, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 100])
def test_fused_add_rms_norm_in_place(dtype, n):
    gen = torch.Generator().manual_seed(n + 1)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    for t in (1, 3, 17):
        x = torch.randn(t, n, generator=gen).to(dtype)
        residual_wide = torch.randn(t, n + 3, generator=gen).to(dtype)
        residual = residual_wide[:, :n]  # strided
        want_out, want_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
        x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
        out, total = fused_add_rms_norm(x, residual, weight, 1e-6)
        assert (out.data_ptr(), total.data_ptr()) == (x_ptr, r_ptr)  # vLLM's convention
        close(x, want_out)  # x now holds the normed sum
        close(residual, want_sum)  # residual now holds x + residual
        if dtype != torch.bfloat16:  # the sum is one rounding (bf16: interpreter truncates)
            assert torch.equal(residual, want_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_is_the_engines(dtype):
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(576, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-5), norm(x))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)


# -- rotary ----------------------------------------------------------------------------------


def rope_tables(head_dim, max_positions=4096, rope=None):
    rotary = RotaryEmbedding(head_dim, max_positions, rope or RopeConfig(theta=500000.0))
    rotary.build(torch.device("cpu"))
    return rotary.cos, rotary.sin


LLAMA3 = RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)


def check_rotary(t, heads, kv_heads, head_dim, dtype, pos_dtype, gen, cos, sin):
    qkv, q, k, _ = fused_qkv(t, heads, kv_heads, head_dim, dtype, gen, bias_cols=4)
    positions = torch.randint(0, cos.shape[0], (t,), generator=gen).to(pos_dtype)
    before = qkv.clone()
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)
    apply_rotary_kernel(q, k, positions, cos, sin)
    close(q, want_q)
    close(k, want_k)
    rest = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, rest:], before[:, rest:])  # v and the tail untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (4, 2, 16)])
def test_rotary(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads + head_dim)
    cos, sin = rope_tables(head_dim, rope=LLAMA3 if head_dim == 128 else None)
    for t, pos_dtype in ((1, torch.int64), (3, torch.int32), (17, torch.int64)):
        check_rotary(t, heads, kv_heads, head_dim, dtype, pos_dtype, gen, cos, sin)


def test_rotary_prefill_block_shape():
    """More than 64 rows take larger head blocks per program."""
    gen = torch.Generator().manual_seed(1)
    cos, sin = rope_tables(64)
    check_rotary(80, 9, 3, 64, torch.float32, torch.int32, gen, cos, sin)


def test_rotary_ref_is_the_engines():
    gen = torch.Generator().manual_seed(5)
    cos, sin = rope_tables(64, rope=LLAMA3)
    _, q, k, _ = fused_qkv(7, 9, 3, 64, torch.float32, gen)
    positions = torch.randint(0, 4096, (7,), generator=gen)
    want_q, want_k = apply_rotary(q, k, cos[positions][:, None, :], sin[positions][:, None, :])
    got_q, got_k = apply_rotary_ref(q, k, positions, cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)


def test_rotary_rejects_odd_head_dim_and_half_tables():
    q = torch.randn(2, 2, 7)
    with pytest.raises(ValueError, match="even"):
        apply_rotary_kernel(q, q, torch.tensor([0, 1]), torch.ones(8, 7), torch.ones(8, 7))
    q = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="fp32"):
        apply_rotary_kernel(q, q, torch.tensor([0, 1]), torch.ones(8, 8).half(), torch.ones(8, 8))


def check_rotary_write_kv(t, heads, kv_heads, head_dim, dtype, gen, num_slots=48):
    """The fused kernel stores exactly what rotary then the KV write store, one after the other:
    q and k rotated in place, k's rotated heads and v in their slots, padding rows (slot -1)
    writing nothing."""
    cos, sin = rope_tables(head_dim)
    qkv, q, k, v = fused_qkv(t, heads, kv_heads, head_dim, dtype, gen, bias_cols=4)
    positions = torch.randint(0, cos.shape[0], (t,), generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots[1::4] = -1
    cache = torch.randn(2, kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    wq, wk, wv = (x.view(t, -1, head_dim) for x in want_qkv[:, : sum(split)].split(split, dim=-1))
    apply_rotary_kernel(wq, wk, positions, cos, sin)
    write_kv_cache(wk, wv, want_cache[0], want_cache[1], slots)
    apply_rotary_write_kv(q, k, v, positions, cos, sin, cache[0], cache[1], slots)
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(cache, want_cache)
    kept = slots >= 0
    assert torch.equal(cache[0][:, slots[kept]], k[kept].transpose(0, 1))  # rotated k stored


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (4, 1, 16)])
def test_rotary_write_kv_equals_rotary_then_write(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(7 * heads + head_dim)
    for t in (1, 5, 70):  # 70: the prefill head blocks
        check_rotary_write_kv(t, heads, kv_heads, head_dim, dtype, gen, num_slots=96)


def test_rotary_write_kv_fp8_cache():
    """An fp8 cache: the rotated k and v stored as value / scale in e4m3, byte for byte what
    the separate write stores (the inputs rotate to values whose quantization is exact:
    position 0, where the rotation is the identity)."""
    gen = torch.Generator().manual_seed(11)
    t, heads, kv_heads, head_dim, num_slots = 6, 4, 2, 32, 20
    cos, sin = rope_tables(head_dim)
    k_scale, v_scale = 0.5, 4.0
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = fp8_grid_values((t, kv_heads, head_dim), k_scale, gen)
    v = fp8_grid_values((t, kv_heads, head_dim), v_scale, gen)
    positions = torch.zeros(t, dtype=torch.int64)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots[3] = -1
    cache = torch.zeros(2, kv_heads, num_slots, head_dim, dtype=torch.float8_e4m3fn)
    want = cache.clone()
    wk = k.clone()
    apply_rotary_kernel(q.clone(), wk, positions, cos, sin)
    write_kv_cache_ref(wk, v, want[0], want[1], slots, k_scale, v_scale)
    apply_rotary_write_kv(q, k, v, positions, cos, sin, cache[0], cache[1], slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert cache[1].float().abs().max() == 448  # some of v clamped


def test_rotary_write_kv_rejects_a_mismatched_cache():
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = rope_tables(16)
    cache = torch.zeros(2, 2, 8, 32)  # head_dim 32, not 16
    with pytest.raises(ValueError):
        apply_rotary_write_kv(q, k, k, torch.tensor([0, 1]), cos, sin, cache[0], cache[1],
                              torch.tensor([0, 1]))  # fmt: skip


# -- SiLU and mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 100, 64])
def test_silu_and_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    for t in (1, 3, 17):
        wide = (3 * torch.randn(t, 2 * inter + 16, generator=gen)).to(dtype)
        x = wide[:, 8 : 8 + 2 * inter]  # strided rows
        close(silu_and_mul(x), silu_and_mul_ref(x))
    out = torch.zeros(t, inter + 5, dtype=dtype)
    got = silu_and_mul(x, out=out[:, :inter])
    assert got.data_ptr() == out.data_ptr() and (out[:, inter:] == 0).all()
    close(out[:, :inter], silu_and_mul_ref(x))


def test_silu_and_mul_qwen2_width():
    x = 3 * torch.randn(2, 2 * 8960, generator=torch.Generator().manual_seed(2))
    close(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_ref_is_the_models():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 2 * 96, generator=gen)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_ref(x), torch.nn.functional.silu(gate) * up)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul(torch.randn(2, 7))
