"""Paged decode attention on the GPU (Triton): one query token per sequence against its paged
K/V, GQA-aware, split along the context (split-K / flash-decoding), CUDA-graph safe.

Two launches::

    split kernel, grid (B, KVH, S)                      reduce kernel, grid (B, H)
    program (b, kvh, s): the G = H / KVH query heads     combines the S partials of one
    of kv head kvh, over tokens [s*chunk, (s+1)*chunk)   (b, h) by log-sum-exp into out
    of sequence b, in tiles of BLOCK_N tokens

    context_lens[b] = 10, S = 3, BLOCK_N = 2  ->  chunk = cdiv(cdiv(10, 3), 2) * 2 = 4
    positions   0 1 2 3 | 4 5 6 7 | 8 9
    split           0   |    1    |  2     (a split past the end is empty: max -inf, sum 0)

The chunk is computed in the kernel from ``context_lens``, so the grid depends on shapes only:
no host read of lengths or tables, the same launch is replayable in a CUDA graph, and sequences
of any length share their work evenly across the splits. With ``S == 1`` the split kernel
normalises and writes ``out`` itself (no workspace, no second launch).

Each tile gathers its tokens' slots, ``table[pos // block_size] * block_size + pos % block_size``
(so any power-of-two block size works, also one larger than the tile), loads the K and V rows of
those slots once, and scores them for all G query heads with one ``tl.dot`` (``[G_PAD, D] x
[D, BLOCK_N]``, G padded up to the 16 rows the tensor-core instruction needs; padded rows are
zeros and never stored). Scores, online softmax and accumulation are fp32; P is rounded to the
cache dtype for the P @ V product, as flash kernels do.

An fp8 cache (``torch.float8_e4m3fn``, ``FP8`` a constexpr) holds ``K / k_scale`` and
``V / v_scale`` (kernels/kv_cache_write.py). Each tile is upcast in registers to q's dtype, which
is exact (every e4m3 value is a bf16 / fp16 / fp32 value), and the scales are applied in fp32
where they cost one multiply per output instead of one per element: ``k_scale`` in the score
scale (``q . (K8 * ks) = (q . K8) * ks``) and ``v_scale`` on the accumulator
(``sum p V8 * vs = vs * sum p V8``). That is the dequantization ``fp8 * scale`` of every K/V
element, without the rounding of ``K8 * ks`` back to bf16. Half the bytes per tile is the point:
decode attention is bound by reading the cache.

Why ``tl.dot`` even for G = 1 (MHA) rather than an elementwise multiply-and-sum: the kernel is
bound by HBM reads, and the 16x padded tensor-core work stays far below what the SM can issue
(H100: the MHA shape, batch 64, ctx 1k, reads K/V at 0.99 of copy bandwidth with the padded dot,
benchmarks/gpu_decode_attention.py); one code path serves every group size.

Tuning (H100, bf16, head_dim 128, block size 16; benchmarks/gpu_decode_attention.py): 64-token
tiles, 4 warps, 3 stages are best or within 2% of the best at batch 64 (ctx 1k, 4k) and batch 8
(ctx 8k); 8 warps lose 10-25%. One split is best once batch x kv heads gives two programs per SM;
more splits only add programs that each pay a prologue (batch 64: 2 splits 8% slower).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import FP8, check_kv_scales
from kernels.pdl import gdc_launch_dependents, gdc_wait
from kernels.pdl import start as pdl_start

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _slots(table_row, pos, valid, BLOCK_SIZE: tl.constexpr):
    """Cache slots of positions ``pos`` of one sequence, from its block table row."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _rows(head, slot, stride_s, dims, mask, Q_DTYPE: tl.constexpr, FP8: tl.constexpr,
          F16_DOT: tl.constexpr):  # fmt: skip
    """K or V rows at ``slot`` (zeros where ``mask`` is off), upcast from an fp8 cache to the
    dtype of the products (exact; e4m3 -> fp16 is one conversion instruction a pair, -> bf16
    goes through it)."""
    x = tl.load(head + slot[:, None] * stride_s + dims[None, :], mask=mask[:, None], other=0.0)
    if FP8:
        x = x.to(tl.float16 if F16_DOT else Q_DTYPE)
    return x


@triton.jit
def _accumulate(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: scores of ``valid`` tokens, the running max and sum
    rescaled, P @ V added. A tile must hold a valid token (so the max is finite after it)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_tb", "table_width"])  # the width varies per step
def _split_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [KVH, slots, D]
    v_ptr,
    tables_ptr,  # [B, W]
    lens_ptr,  # [B]
    out_ptr,  # [B, H, D], written when DIRECT
    ws_ptr,  # fp32 workspace, when not DIRECT: acc [B, H, S, D] (unnormalised sums), then
    # ml [B, H, S, 2] (running max in log2 units, sum of exp2); one buffer, one pointer
    qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
    v_scale,  # fp8 cache: the accumulator's scale
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_tb,
    stride_ob,
    stride_oh,
    table_width,
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens)
    BLOCK_N: tl.constexpr,  # tokens per tile
    DIRECT: tl.constexpr,  # one split: normalise and write out, no workspace
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # the cache holds e4m3: upcast each tile to q's dtype
    F16_DOT: tl.constexpr,  # FP8 with a 16-bit q: upcast to fp16 instead (q and P rounded to it)
    PREFETCH: tl.constexpr,  # PDL: the first tile's older tokens read before the wait
    PDL: tl.constexpr,  # kernels/pdl.py
):
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    rows = tl.arange(0, G_PAD)  # query heads of this kv head (padded)
    dims = tl.arange(0, D)
    heads = kvh * G + rows
    row_ok = rows < G

    # Tokens past the table's capacity have no block: clamp instead of reading past the row.
    ctx = tl.minimum(tl.load(lens_ptr + b), table_width * BLOCK_SIZE)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    first = start
    if PREFETCH:
        # The first tile's older tokens are read before waiting for the kernels before this
        # one (PDL): lengths and tables come from the step's host copies, and every token but
        # the newest (position ctx - 1, which this step's KV write stores) was written by an
        # earlier step. The newest is read after the wait.
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = _slots(table_row, pos, valid, BLOCK_SIZE)
        old = valid & (pos < ctx - 1)
        k = _rows(k_head, slot, stride_ks, dims, old, q_ptr.dtype.element_ty, FP8, F16_DOT)
        v = _rows(v_head, slot, stride_vs, dims, old, q_ptr.dtype.element_ty, FP8, F16_DOT)
    if PDL:
        gdc_wait()
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if F16_DOT:  # saturated: a bf16 q past fp16's range stays finite
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if PREFETCH:
        new = valid & (pos == ctx - 1)
        k_new = _rows(k_head, slot, stride_ks, dims, new, q_ptr.dtype.element_ty, FP8, F16_DOT)
        v_new = _rows(v_head, slot, stride_vs, dims, new, q_ptr.dtype.element_ty, FP8, F16_DOT)
        k = tl.where(new[:, None], k_new, k)
        v = tl.where(new[:, None], v_new, v)
        if start < end:  # (an empty split keeps max -inf and sum 0)
            m_i, l_i, acc = _accumulate(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = _slots(table_row, pos, valid, BLOCK_SIZE)
        k = _rows(k_head, slot, stride_ks, dims, valid, q_ptr.dtype.element_ty, FP8, F16_DOT)
        v = _rows(v_head, slot, stride_vs, dims, valid, q_ptr.dtype.element_ty, FP8, F16_DOT)
        m_i, l_i, acc = _accumulate(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    if FP8:
        acc = acc * v_scale
    if DIRECT:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (b * (G * tl.num_programs(1)) + heads).to(tl.int64) * num_splits + split
        ml_ptr = ws_ptr + (tl.num_programs(0) * G * tl.num_programs(1)).to(tl.int64) * (
            num_splits * D
        )
        tl.store(ws_ptr + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    ws_ptr,  # fp32: acc [B, H, S, D] then ml [B, H, S, 2], as the split kernel wrote them
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    D: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D)
    ok = splits < num_splits
    part = (b * num_heads + h).to(tl.int64) * num_splits + splits
    ml_ptr = ws_ptr + (tl.num_programs(0) * num_heads).to(tl.int64) * (num_splits * D)
    m = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=0)
    # Empty splits (m = -inf) weigh 0; an all-empty row (length 0) would give -inf - -inf: guard.
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(w * l_s, axis=0)
    acc = tl.load(ws_ptr + part[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dims
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


def _cdiv(a: int, b: int) -> int:  # host side: triton.cdiv costs ~5 us a call, this ~0.1
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: behave like an H100 so CPU tests see the same split counts
    return torch.cuda.get_device_properties(device).multi_processor_count


# Programs wanted per SM: a few resident per SM hide the gather latency and even out the tail.
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device) -> int:
    """Splits per (sequence, kv head) from shapes only (CUDA-graph safe): enough programs to give
    every SM ``_PROGRAMS_PER_SM`` of them, at most one split per block of the table's width
    ``max_blocks`` and at most ``_MAX_SPLITS``."""
    programs = batch * num_kv_heads
    want = _cdiv(
        _PROGRAMS_PER_SM
        * _num_sms(device if isinstance(device, torch.device) else torch.device(device)),
        programs,
    )
    return max(1, min(want, max_blocks, _MAX_SPLITS))


def launch_config(
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    programs: int | None = None,
    device=None,
) -> dict:
    """Default tile and launch parameters of ``_launch`` for q's ``dtype`` and the cache's
    (``kv_dtype``, default q's; benchmarks/gpu_decode_attention.py sweeps them). An fp8 cache
    also looks at ``programs``, the grid before splits (batch x kv heads; None: a full one):
    below the SM count, from ``FP8_LARGE_GRID_WAVES`` times it, and between."""
    if dtype == torch.float32 or head_dim >= 256:
        return {"block_n": 32, "num_warps": 4, "num_stages": 2}
    if kv_dtype == FP8:
        sms = _num_sms(torch.device(device or "cuda"))
        if programs is not None and programs < sms:
            return dict(FP8_SMALL_GRID_CONFIG)
        if programs is not None and programs >= FP8_LARGE_GRID_WAVES * sms:
            return dict(FP8_LARGE_GRID_CONFIG)
        return dict(FP8_CONFIG)
    return {"block_n": 64, "num_warps": 4, "num_stages": 3}


# An fp8 cache under a 16-bit q (benchmarks/gpu_decode_attention.py --kv-dtype fp8 --tiles ...,
# H200, benchmarks/NOTES.md): the tile is compute- and latency-bound, not bound by its bytes
# (at 4 warps a 128-token tile held 2 programs an SM, by shared memory or registers). Two
# warps a program and the products in fp16 (e4m3 -> fp16 is one conversion a pair, -> bf16
# three; q and P rounded to fp16 are also the more accurate: 8e-4 relative error against
# 2.4e-3) took batch 256 x 512 from 121 to 98 us, 64 x 4k from 253 to 174 and 64 x 1k from 68
# to 49. A grid smaller than the GPU (few sequences: splits fill it) takes 64-token tiles,
# so a short context still splits: batch 1 x 512 from 9.8 to 7.0 us, 8 x 8k level (74 us).
# A large grid (batch x kv heads of 12 or more programs an SM: batch 256 and up with 8 KV heads
# on an H200) takes 64-token tiles in 3 stages again: 6-12 % faster there (256 x 256 54.8 ->
# 49.2 us, 256 x 512 96.6 -> 87.4, 256 x 1k 174 -> 163, 512 x 512 183 -> 166), while at 4-8
# programs an SM the 128-token tiles stay ahead (64 x 1k 48.2 against 55.9, 128 x 512 51.7
# against 53.8): benchmarks/NOTES.md, "The fp8-KV decode tiles by grid size".
FP8_CONFIG = {"block_n": 128, "num_warps": 2, "num_stages": 2, "f16_dot": True}
FP8_SMALL_GRID_CONFIG = {"block_n": 64, "num_warps": 2, "num_stages": 2, "f16_dot": True}
FP8_LARGE_GRID_CONFIG = {"block_n": 64, "num_warps": 2, "num_stages": 3, "f16_dot": True}
FP8_LARGE_GRID_WAVES = 12  # programs per SM from which a grid is large


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its paged context.

    q ``[B, H, D]`` (last dim contiguous, may be a view of a fused qkv), k_cache / v_cache
    ``[KVH, slots, D]`` (last dim contiguous), block_tables ``[B, W]`` int32 (int64 works),
    context_lens ``[B]`` int32 >= 1 (clamped to ``W * block_size``). Returns ``[B, H, D]`` in
    q's dtype, written into ``out`` when given. ``num_splits`` defaults to
    ``default_num_splits`` of the shapes, capped so that no split is shorter than one tile of
    the longest context the table can hold. The caches may be fp8 (``torch.float8_e4m3fn``)
    with q in any of the three: each element then reads as ``cache * k_scale`` (``v_scale``);
    the scales are ignored for caches of q's dtype. ``prefetch``: see ``_launch`` (None: where
    it pays)."""
    programs = q.shape[0] * k_cache.shape[0]
    config = launch_config(q.shape[-1], q.dtype, k_cache.dtype, programs, q.device)
    args = (q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out, num_splits)
    return _launch(*args, k_scale=k_scale, v_scale=v_scale, prefetch=prefetch, **config)


def pick_num_splits(batch, kv_heads, max_blocks, block_size, block_n, device) -> int:
    """``default_num_splits``, capped at one tile per split of a full table."""
    splits = default_num_splits(batch, kv_heads, max_blocks, device)
    return max(1, min(splits, _cdiv(max_blocks * block_size, block_n)))


def _launch(
    q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out=None,
    num_splits=None, *, block_n: int = 64, num_warps: int = 4, num_stages: int = 3,
    k_scale: float = 1.0, v_scale: float = 1.0, f16_dot: bool = False,
    prefetch: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """The launcher with its tile and launch parameters open, for tests and benchmarks.
    ``f16_dot`` (an fp8 cache, q bf16 or fp16): the products in fp16, q and P rounded to it.
    ``prefetch``: the first tile read before the PDL wait (None: where it pays, below)."""
    _check(q, k_cache, v_cache, block_tables, context_lens, block_size, out)
    fp8 = k_cache.dtype == FP8
    f16_dot = bool(f16_dot and fp8 and q.dtype != torch.float32)
    qk_scale = scale * _LOG2E
    if fp8:
        check_kv_scales(k_scale, v_scale)
        qk_scale *= k_scale
    batch, num_heads, head_dim = q.shape
    kv_heads, width = k_cache.shape[0], block_tables.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = pick_num_splits(batch, kv_heads, width, block_size, block_n, q.device)
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"want num_splits >= 1 and block_n a power of two >= 16, got "
                         f"{num_splits}, {block_n}")  # fmt: skip
    group = num_heads // kv_heads
    direct = num_splits == 1
    launch = pdl.launch_options(q.device)
    # A grid that is one wave (at most _PROGRAMS_PER_SM a SM: small batches, which the splits
    # fill up to it) is bound by each program's chain of reads, table then K/V; reading the
    # first tile while the KV write before it still runs took 0.2 ms off a batch-1 step of the
    # Llama-3-8B shape on an H100. Larger grids are bound by bandwidth, and holding the tile
    # through the wait cost them (+2.6 % at batch 256): benchmarks/NOTES.md.
    programs = batch * kv_heads * num_splits
    if prefetch is None:
        prefetch = launch["PDL"] and programs <= _PROGRAMS_PER_SM * _num_sms(q.device)
    # Workspace (fp32): acc [B, H, S, D] then (max, sum) [B, H, S, 2], one allocation.
    ws = out if direct else torch.empty(batch * num_heads * num_splits * (head_dim + 2),
                                        dtype=torch.float32, device=q.device)  # fmt: skip
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, ws,
        qk_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), width,
        G=group, G_PAD=max(16, _next_pow2(group)), D=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8, F16_DOT=f16_dot,
        PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages, **launch,
    )  # fmt: skip
    if not direct:
        _reduce_kernel[(batch, num_heads)](
            ws, out, out.stride(0), out.stride(1), num_heads, num_splits,
            D=head_dim, S_PAD=_next_pow2(num_splits), num_warps=4,
            **launch,
        )  # fmt: skip
    return out


def _check(q, k_cache, v_cache, block_tables, context_lens, block_size, out) -> None:
    """Shapes, dtypes, devices and strides the kernels rely on; errors say what was passed."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"want q [B, H, D] and k/v caches [KVH, slots, D] of one shape, got q "
            f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    if k_cache.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head_dim must "
            f"match and heads must be a multiple of kv heads"
        )
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    cache_dtype = k_cache.dtype if k_cache.dtype == FP8 else q.dtype
    if q.dtype not in _DTYPES or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(
            f"q must be fp32/fp16/bf16 and k_cache, v_cache q's dtype (or both {FP8}), got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    int_types = (torch.int32, torch.int64)
    if block_tables.dtype not in int_types or context_lens.dtype not in int_types:
        raise ValueError(
            f"block_tables and context_lens must be int32 (or int64), got "
            f"{block_tables.dtype}, {context_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(
            f"want block_tables [B, W] and context_lens [B] for B={batch}, got "
            f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if not context_lens.is_contiguous():
        raise ValueError("context_lens must be contiguous")
    devices = {t.device for t in (*tensors.values(), context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def paged_decode_attention_ref(
    q, k_cache, v_cache, block_tables, context_lens, block_size, scale, k_scale=1.0, v_scale=1.0
):
    """Plain torch, one sequence at a time, fp32 math: the definition the kernel is tested
    against. Each query head ``h`` attends with kv head ``h // (H // KVH)``. An fp8 cache is
    dequantized first (``cache * scale``, in fp32)."""
    if k_cache.dtype == FP8:
        k_cache, v_cache = k_cache.float() * k_scale, v_cache.float() * v_scale
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[0]
    out = torch.empty_like(q)
    for i in range(batch):
        n = int(context_lens[i])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[:, slots].float().repeat_interleave(group, dim=0)  # [H, n, D]
        v = v_cache[:, slots].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


__all__ = ["default_num_splits", "paged_decode_attention", "paged_decode_attention_ref"]
