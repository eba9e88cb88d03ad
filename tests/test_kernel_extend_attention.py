"""The Triton extend (prefill) attention kernel against its plain-torch reference, on small random
batches of chunks: odd lengths, prefixes off block boundaries, shuffled block tables, GQA / MQA,
strided q/k/v, and poisoned cache slots that the kernel must not read.

fp8 caches (e4m3 with a K and a V scale) are read against the reference over the same cache
dequantized. Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); the interpreter cannot multiply bf16 tiles, so bf16 runs only on CUDA (here and
in tests/gpu).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from kernels.extend_attention import (
    _launch,
    attention_flops,
    extend_attention,
    extend_attention_ref,
)
from kernels.fp8 import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# Chunks of one step: new tokens and cached prefix (0 = fresh prompt, others off block bounds).
LENS = [37, 5, 70, 1, 16, 0]
PREFIXES = [0, 13, 100, 7, 33, 21]


def make_batch(heads, kv_heads, head_dim, block_size, dtype, lens=LENS, prefixes=PREFIXES, seed=0):
    """A step of chunks: q/k/v as views of one fused qkv tensor, a [2, KVH, slots, D] cache
    with random contents, shuffled block tables padded with a block of NaNs."""
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    total = sum(lens)
    width = max(math.ceil((p + t) / block_size) for p, t in zip(prefixes, lens, strict=True)) + 1
    num_blocks = n * width + 2
    perm = torch.randperm(num_blocks - 1, generator=g)[: n * width].view(n, width)
    poison_block = num_blocks - 1
    tables = perm.clone()
    for i, (p, t) in enumerate(zip(prefixes, lens, strict=True)):
        tables[i, math.ceil((p + t) / block_size) :] = poison_block
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(total, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    cache[:, :, poison_block * block_size :] = float("nan")
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    batch = {
        "q": q,
        "k": k,
        "v": v,
        "k_cache": cache[0],
        "v_cache": cache[1],
        "block_tables": tables.to(torch.int32),
        "cu_seqlens_q": cu,
        "prefix_lens": torch.tensor(prefixes, dtype=torch.int32),
    }
    return {name: t.to(DEVICE) for name, t in batch.items()}


def slots_of(batch, i, start, end, block_size):
    pos = torch.arange(start, end, device=DEVICE)
    return batch["block_tables"][i, pos // block_size].long() * block_size + pos % block_size


KERNEL_ARGS = ("q", "k", "v", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "prefix_lens")


def kernel_args(batch) -> list:
    """The batch's tensors in the order extend_attention takes them."""
    return [batch[name] for name in KERNEL_ARGS]


def run(batch, block_size, config=None, out=None, use_tma=None, kv_scales=None):
    args = kernel_args(batch)
    scale = batch["q"].shape[-1] ** -0.5
    max_len = int((batch["cu_seqlens_q"][1:] - batch["cu_seqlens_q"][:-1]).max())
    if kv_scales is not None:  # an fp8 cache
        got = _launch(*args, max_len, block_size, scale, out, block_m=config[0],
                      block_n=config[1], num_warps=4, num_stages=2, use_tma=use_tma,
                      k_scale=kv_scales[0], v_scale=kv_scales[1])  # fmt: skip
        return got, extend_attention_ref(*args, block_size, scale, *kv_scales)
    if config is None:
        got = extend_attention(*args, max_len, block_size, scale, out=out)
    else:
        bm, bn = config
        got = _launch(
            *args,
            max_len,
            block_size,
            scale,
            out,
            block_m=bm,
            block_n=bn,
            num_warps=4,
            num_stages=2,
            use_tma=use_tma,
        )
    return got, extend_attention_ref(*args, block_size, scale)


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if not INTERPRETED else [])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "config"),
    [
        (4, 4, 32, 16, None),  # MHA, default tiles (one m-block per short chunk)
        (4, 2, 64, 4, (32, 16)),  # GQA 2; several m-blocks, off-diagonal and diagonal tiles
        (8, 2, 16, 1, (32, 32)),  # GQA 4, one-token blocks (per-token gather)
        (4, 1, 32, 32, (32, 16)),  # MQA, blocks larger than a tile (one table entry per tile)
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(heads, kv_heads, head_dim, block_size, config, dtype):
    batch = make_batch(heads, kv_heads, head_dim, block_size, dtype, seed=heads + block_size)
    got, ref = run(batch, block_size, config)
    assert got.dtype == dtype and got.shape == batch["q"].shape
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("use_tma", [False, True])
def test_tma_and_pointer_loads(use_tma):
    """q and the new k, v through TMA descriptors (Hopper) or plain loads: same answer; TMA
    tiles past a chunk's end read the next chunk's rows, which the causal mask must hide."""
    if use_tma and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper-class GPU")
    batch = make_batch(4, 2, 32, 16, torch.float16, seed=11)
    got, ref = run(batch, 16, (32, 16), use_tma=use_tma)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[torch.float16])


def fp8_batch(heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale, seed=0):
    """``make_batch`` with its cache quantized as the engine stores it (value / scale in e4m3;
    the poisoned padding block stays NaN); also the unquantized cache, for comparison."""
    batch = make_batch(heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    raw = {"k_cache": batch["k_cache"].float(), "v_cache": batch["v_cache"].float()}
    batch["k_cache"] = quantize_fp8(raw["k_cache"], k_scale)
    batch["v_cache"] = quantize_fp8(raw["v_cache"], v_scale)
    return batch, raw


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "config", "k_scale", "v_scale"),
    [
        (4, 2, 32, 4, (32, 16), 0.01, 0.02),  # prefixes off block bounds, several m-blocks
        (4, 1, 16, 32, (32, 16), 1.0, 0.05),  # MQA, blocks larger than a tile
        (8, 2, 16, 1, (32, 32), 0.5, 1.0),  # one-token blocks
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_matches_dequantized_reference(
    heads, kv_heads, head_dim, block_size, config, k_scale, v_scale, dtype
):
    """The prefix read from an fp8 cache (upcast exactly, scales in fp32) against the reference
    over the same cache dequantized: the dtype's own tolerance. Against the unquantized cache:
    e4m3's 3 mantissa bits (relative error up to 1/16 per cached element) move the outputs of
    this unit-scale attention by about 0.1 at most; the new tokens are read unquantized."""
    batch, raw = fp8_batch(heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale, 7)
    got, ref = run(batch, block_size, config, use_tma=False, kv_scales=(k_scale, v_scale))
    assert got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
    unquantized = extend_attention_ref(
        batch["q"].float(), batch["k"].float(), batch["v"].float(), raw["k_cache"],
        raw["v_cache"], *kernel_args(batch)[5:], block_size, head_dim**-0.5,
    )  # fmt: skip
    err = (got.float() - unquantized).abs()
    assert err.max() < 0.25 and err.mean() < 0.03


def test_fp8_fresh_prompts_read_no_cache():
    """Chunks with no prefix never touch the cache: an fp8 cache and its scales change nothing."""
    batch = make_batch(4, 2, 32, 4, torch.float32, lens=[9, 20], prefixes=[0, 0], seed=2)
    plain, _ = run(batch, 4, (32, 16))
    batch["k_cache"], batch["v_cache"] = (
        torch.full_like(batch[name], float("nan")).to(torch.float8_e4m3fn)
        for name in ("k_cache", "v_cache")
    )
    got, _ = run(batch, 4, (32, 16), use_tma=False, kv_scales=(0.3, 7.0))
    assert torch.equal(got, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_caches_of_q_dtype_ignore_the_scales(dtype):
    """The fp8 branch is a constexpr: caches in q's dtype run the kernel they always ran, and
    scales passed with them change no bit of the output (bf16: tests/gpu)."""
    batch = make_batch(4, 2, 32, 4, dtype, seed=9)
    args = (*kernel_args(batch), 70, 4, 32**-0.5, None)
    tiles = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2, "use_tma": False}
    plain = _launch(*args, **tiles)
    scaled = _launch(*args, **tiles, k_scale=0.1, v_scale=9.0)
    assert torch.equal(plain, scaled)


def test_head_dim_128_default_tiles():
    batch = make_batch(4, 2, 128, 16, torch.float16, lens=[70, 9], prefixes=[45, 0])
    got, ref = run(batch, 16)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[torch.float16])


def test_out_is_filled_in_place():
    batch = make_batch(4, 2, 32, 4, torch.float32, seed=3)
    big = torch.full((batch["q"].shape[0], 4, 64), float("nan"), device=DEVICE)
    out = big[:, :, 16:48]  # strided: rows of 256 elements, heads of 64
    got, ref = run(batch, 4, (32, 16), out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert big[:, :, :16].isnan().all() and big[:, :, 48:].isnan().all()


def test_reads_prefix_from_cache_and_new_tokens_from_k_v():
    """NaN in the cache slots of the new tokens (the caller writes them later) and in the
    tables' padding blocks must not reach the output: those keys come from k, v only."""
    block_size = 4
    batch = make_batch(4, 2, 32, block_size, torch.float32, seed=5)
    for i, (p, t) in enumerate(zip(PREFIXES, LENS, strict=True)):
        slots = slots_of(batch, i, p, p + t, block_size)
        batch["k_cache"][:, slots] = float("nan")
        batch["v_cache"][:, slots] = float("nan")
    # Same answer as attending over a cache that holds the new tokens too.
    clean = dict(batch)
    for name, new in (("k_cache", "k"), ("v_cache", "v")):
        clean[name] = batch[name].clone()
        for i, (p, t) in enumerate(zip(PREFIXES, LENS, strict=True)):
            first = int(batch["cu_seqlens_q"][i])
            clean[name][:, slots_of(batch, i, p, p + t, block_size)] = batch[new][
                first : first + t
            ].transpose(0, 1)
    want = dense_attention(clean, block_size)
    for config in (None, (32, 16)):
        got, _ = run(batch, block_size, config)
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def dense_attention(batch, block_size):
    """Float64 softmax(q k^T * scale + causal) v per chunk and head, every key (prefix and new)
    read from the cache: an independent check of the reference."""
    q = batch["q"].double()
    heads, kv_heads, head_dim = q.shape[1], batch["k"].shape[1], q.shape[2]
    out = torch.zeros_like(q)
    for i in range(len(batch["prefix_lens"])):
        first, last = int(batch["cu_seqlens_q"][i]), int(batch["cu_seqlens_q"][i + 1])
        prefix = int(batch["prefix_lens"][i])
        slots = slots_of(batch, i, 0, prefix + last - first, block_size)
        for h in range(heads):
            keys = batch["k_cache"][h // (heads // kv_heads), slots].double()
            values = batch["v_cache"][h // (heads // kv_heads), slots].double()
            for r in range(last - first):
                scores = keys[: prefix + r + 1] @ q[first + r, h] * head_dim**-0.5
                out[first + r, h] = scores.softmax(0) @ values[: prefix + r + 1]
    return out.to(batch["q"].dtype)


def test_reference_matches_dense_computation():
    block_size = 4
    batch = make_batch(4, 2, 16, block_size, torch.float32, lens=[6, 3, 1], prefixes=[0, 5, 9])
    for name, new in (("k_cache", "k"), ("v_cache", "v")):
        for i, (p, t) in enumerate(zip([0, 5, 9], [6, 3, 1], strict=True)):
            first = int(batch["cu_seqlens_q"][i])
            batch[name][:, slots_of(batch, i, p, p + t, block_size)] = batch[new][
                first : first + t
            ].transpose(0, 1)
    args = kernel_args(batch)
    ref = extend_attention_ref(*args, block_size, 16**-0.5)
    torch.testing.assert_close(ref, dense_attention(batch, block_size), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_with_the_values():
    batch = make_batch(4, 2, 32, 4, torch.float32, lens=[3], prefixes=[2])
    args = kernel_args(batch)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        extend_attention(*args, 3, 6, 0.1)
    with pytest.raises(ValueError, match="prefix_lens must be contiguous int32"):
        extend_attention(*args[:7], args[7].long(), 3, 4, 0.1)
    with pytest.raises(ValueError, match="H a multiple of KVH"):
        extend_attention(args[0][:, :3], *args[1:], 3, 4, 0.1)
    with pytest.raises(ValueError, match="share one of fp32/fp16/bf16"):
        extend_attention(args[0].half(), *args[1:], 3, 4, 0.1)
    fp8 = [a.to(torch.float8_e4m3fn) for a in args[3:5]]
    with pytest.raises(ValueError, match="or both"):  # one cache fp8, the other not
        extend_attention(*args[:3], fp8[0], *args[4:], 3, 4, 0.1)
    with pytest.raises(ValueError, match="v_scale must be a positive"):
        extend_attention(*args[:3], *fp8, *args[5:], 3, 4, 0.1, v_scale=float("inf"))
    with pytest.raises(ValueError, match="multiple of block_n"):
        _launch(*args, 3, 4, 0.1, block_m=16, block_n=32, num_warps=4, num_stages=2)


def test_flops_count_visible_pairs():
    # chunk 0: 3 new tokens, no prefix -> 6 pairs; chunk 1: 2 new over 4 cached -> 8 + 3 pairs
    assert attention_flops([0, 3, 5], [0, 4], num_heads=2, head_dim=8) == 4 * 8 * 2 * 17
