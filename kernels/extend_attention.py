"""Paged prefill / extend attention (Triton, FlashAttention-2 style) and its plain-torch reference.

A step's prefill chunks are concatenated along the token axis: chunk ``i`` owns rows
``cu_seqlens_q[i] .. cu_seqlens_q[i+1]`` of ``q`` ``[T, H, D]`` and of the new ``k``, ``v``
``[T, KVH, D]``; its first row sits at position ``prefix_lens[i]``, the tokens before it are
already in the paged cache (earlier chunks of a chunked prefill, or a prefix-cache hit). A query
at position ``P`` attends to keys ``0..P``::

    chunk i, prefix_lens[i] = 6, 4 new tokens                 keys
                                   prefix (paged cache)  |  new (k, v tensors)
                                   0 1 2 3 4 5           |  6 7 8 9
    query row 0 (position 6)       x x x x x x           |  x
    query row 1 (position 7)       x x x x x x           |  x x
    query row 2 (position 8)       x x x x x x           |  x x x
    query row 3 (position 9)       x x x x x x           |  x x x x
                                   phase 1: gather slots |  phase 2: causal

One program owns ``BLOCK_M`` query rows of one chunk and one query head. Phase 1 streams the
prefix from the cache in tiles of ``BLOCK_N`` positions (position ``p`` lives in slot
``block_tables[i, p // block_size] * block_size + p % block_size``), masking only the last,
partial tile. Phase 2 streams the chunk's own keys from the contiguous ``k``, ``v``: tiles left of
the program's diagonal need no mask, the ``BLOCK_M / BLOCK_N`` tiles on it take the causal mask.
A fresh prompt (prefix 0) skips phase 1 and runs as plain causal flash attention; the new tokens
are never read back from the cache (the caller writes them there for later steps).

Loads: the cache gather is per-row pointer loads (cp.async on Hopper); q and the new k, v go
through TMA descriptors on 2-D ``[T, heads * D]`` views where the GPU has TMA, heads are adjacent
in memory and rows 16-byte aligned (fused qkv slices are), else through pointer loads too.

Softmax is online in base 2 (``exp2`` with ``scale * log2(e)``), statistics and accumulator in
fp32.

An fp8 cache (``torch.float8_e4m3fn``, ``FP8`` a constexpr) holds ``K / k_scale`` and
``V / v_scale`` (kernels/kv_cache_write.py). Phase 1 upcasts each tile in registers to q's dtype
(exact: every e4m3 value is a bf16 / fp16 / fp32 value) and applies the scales in fp32 where
they are cheapest: ``k_scale`` in the prefix tiles' score scale (``q . (K8 * ks) = (q . K8) *
ks``), ``v_scale`` on the probabilities before the P @ V product (``P (V8 * vs) = (P * vs) V8``).
Phase 2 reads the chunk's own keys unquantized from k, v, as caches of the model's dtype do: a
prompt's tokens see each other at full precision; later steps see them through the cache. The grid is ``(H, m-blocks, N)`` with m-blocks in reverse, so the longest rows of the
causal triangle start first and short ones fill the tail; programs past a chunk's end exit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import pdl
from kernels.fp8 import FP8, check_kv_scales
from kernels.pdl import start as pdl_start

_LOG2E = math.log2(math.e)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters; ``block_m`` must be a multiple of ``block_n``. ``tma``:
    load q and the new k, v through TMA descriptors where the GPU and strides allow it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


def default_config(head_dim: int, dtype: torch.dtype, max_seqlen_q: int) -> KernelConfig:
    """Tiles measured on H100 (benchmarks/gpu_prefill_attention.py; bf16, H32/KVH8, fresh 2k and
    8k prompts and 2k new over 6k cached). D128: 64x64, 4 warps, 3 stages; 128x128 with 8 warps
    is ~10% faster when a long cached prefix dominates but ~10% slower on fresh prompts. D <= 64:
    128x64, 4 warps; D256: 128x64, 8 warps, 2 stages. TMA saves ~5-10% of GPU time on the new
    tokens but costs ~35 us of host time per call (descriptor encoding in Triton's launcher), so
    it is used only for chunks of 1k tokens or more. fp32 runs exact (ieee) dots on the CUDA
    cores, in small tiles."""
    if dtype == torch.float32:
        return KernelConfig(32, 32, 4, 2) if head_dim > 64 else KernelConfig(64, 32, 4, 2)
    tma = max_seqlen_q >= 1024
    if head_dim <= 64:
        return KernelConfig(128, 64, 4, 3, tma)
    if head_dim <= 128:
        return KernelConfig(64, 64, 4, 3, tma)
    return KernelConfig(128, 64, 8, 2, tma)


@triton.jit
def _online_softmax_step(
    acc, l_i, m_i, qk, v, qk_scale, mask, v_scale, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_V: tl.constexpr,
):  # fmt: skip
    """Fold one tile of raw scores ``qk`` [BLOCK_M, BLOCK_N] and its values into the running
    row max ``m_i`` (log2 domain), row sum ``l_i`` and accumulator ``acc``. ``SCALE_V``: the
    values are ``v / v_scale`` (an fp8 tile), so the probabilities take ``v_scale``."""
    if MASKED:
        qk = tl.where(mask, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if SCALE_V:
        acc = tl.dot((p * v_scale).to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefix_tiles(
    acc,
    l_i,
    m_i,
    q,
    kc_head,
    vc_head,
    table_row,
    stride_kcs,
    stride_vcs,
    start,
    end,
    qk_scale,
    v_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """Phase 1: prefix positions ``start..end`` (tiles of BLOCK_N) gathered from the paged cache.
    Unmasked tiles lie wholly below ``end``; the masked call covers the one partial tile. An fp8
    cache's tiles are upcast to q's dtype (``qk_scale`` then carries k_scale)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(start, end, BLOCK_N):
        pos = start_n + offs_n
        if MASKED:
            valid = pos < end
            block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        elif BLOCK_SIZE >= BLOCK_N:  # the tile lies inside one block: one table entry
            block = tl.load(table_row + start_n // BLOCK_SIZE)
            slot = block.to(tl.int64) * BLOCK_SIZE + (start_n % BLOCK_SIZE + offs_n)
            valid = None
        else:
            block = tl.load(table_row + pos // BLOCK_SIZE)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            valid = None
        k_ptrs = kc_head + slot[:, None] * stride_kcs + offs_d[None, :]
        v_ptrs = vc_head + slot[:, None] * stride_vcs + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
            if FP8:
                k = k.to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
            mask = valid[None, :]
        else:
            k = tl.load(k_ptrs)
            if FP8:
                k = k.to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = tl.load(v_ptrs)
            mask = None
        if FP8:
            v = v.to(q.dtype)
        acc, l_i, m_i = _online_softmax_step(
            acc, l_i, m_i, qk, v, qk_scale, mask, v_scale, MASKED, DOT_PRECISION, FP8
        )
    return acc, l_i, m_i


@triton.jit
def _chunk_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_rows,
    v_rows,
    stride_kt,
    stride_vt,
    k_desc,
    v_desc,
    desc_row0,
    desc_col,
    offs_m,
    start,
    end,
    chunk_len,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Phase 2: the chunk's own keys ``start..end`` (chunk-local rows of k, v). Off-diagonal
    tiles are wholly visible; diagonal ones take the causal mask and stop at the chunk's end.
    With TMA, a diagonal tile may read rows of the next chunk: only padding query rows (never
    stored) can see them, as the causal mask hides them from every row of this chunk."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_rows + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_rows + cols[:, None] * stride_vt + offs_d[None, :]
        if USE_TMA:
            k = k_desc.load([desc_row0 + start_n, desc_col])
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = v_desc.load([desc_row0 + start_n, desc_col])
            mask = cols[None, :] <= offs_m[:, None] if DIAGONAL else None
        elif DIAGONAL:
            in_chunk = cols < chunk_len
            k = tl.load(k_ptrs, mask=in_chunk[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = tl.load(v_ptrs, mask=in_chunk[:, None], other=0.0)
            mask = cols[None, :] <= offs_m[:, None]
        else:
            k = tl.load(k_ptrs)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = tl.load(v_ptrs)
            mask = None
        acc, l_i, m_i = _online_softmax_step(
            acc, l_i, m_i, qk, v, qk_scale, mask, 1.0, DIAGONAL, DOT_PRECISION, False
        )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_table"])  # the table's width varies per step
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr, table_ptr, cu_seqlens_ptr, prefix_lens_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kch, stride_kcs, stride_vch, stride_vcs, stride_ot, stride_oh, stride_table,
    q_desc, k_desc, v_desc,  # TMA descriptors of q, k, v as [T, heads * D], or None
    qk_scale,  # scale * log2(e)
    k_scale, v_scale,  # an fp8 cache holds k / k_scale and v / v_scale
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)  # kernels/pdl.py: before any read (and before the early return below)
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest rows of the triangle first
    chunk = tl.program_id(2)
    row0 = tl.load(cu_seqlens_ptr + chunk)
    chunk_len = tl.load(cu_seqlens_ptr + chunk + 1) - row0
    m_start = m_block * BLOCK_M
    if m_start >= chunk_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + chunk)
    kv_head = head // GROUP
    desc_row0 = row0  # int32 coordinates of TMA loads: rows of the 2-D [T, heads * D] views
    row0 = row0.to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)  # chunk-local query rows
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < chunk_len
    if USE_TMA:
        q = q_desc.load([desc_row0 + m_start, head * HEAD_DIM])
    else:
        q_rows = q_ptr + row0 * stride_qt + head * stride_qh
        q = tl.load(q_rows + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Phase 1: the prefix, gathered from the paged cache; only the last tile is masked.
    kc_head = kc_ptr + kv_head.to(tl.int64) * stride_kch
    vc_head = vc_ptr + kv_head.to(tl.int64) * stride_vch
    table_row = table_ptr + chunk.to(tl.int64) * stride_table
    full_end = prefix_len - prefix_len % BLOCK_N
    prefix_qk_scale = qk_scale
    if FP8:
        prefix_qk_scale = qk_scale * k_scale
    acc, l_i, m_i = _prefix_tiles(
        acc, l_i, m_i, q, kc_head, vc_head, table_row, stride_kcs, stride_vcs, 0, full_end,
        prefix_qk_scale, v_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE, False, DOT_PRECISION, FP8,
    )  # fmt: skip
    acc, l_i, m_i = _prefix_tiles(
        acc, l_i, m_i, q, kc_head, vc_head, table_row, stride_kcs, stride_vcs, full_end,
        prefix_len, prefix_qk_scale, v_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE, True,
        DOT_PRECISION, FP8,
    )  # fmt: skip

    # Phase 2: the chunk's own keys from k, v; causal mask only on the diagonal tiles.
    k_rows = k_ptr + row0 * stride_kt + kv_head * stride_kh
    v_rows = v_ptr + row0 * stride_vt + kv_head * stride_vh
    diag_end = tl.minimum(m_start + BLOCK_M, chunk_len)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, k_rows, v_rows, stride_kt, stride_vt, k_desc, v_desc, desc_row0,
        kv_head * HEAD_DIM, offs_m, 0, m_start, chunk_len, qk_scale, BLOCK_N, HEAD_DIM, False,
        USE_TMA, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, k_rows, v_rows, stride_kt, stride_vt, k_desc, v_desc, desc_row0,
        kv_head * HEAD_DIM, offs_m, m_start, diag_end, chunk_len, qk_scale, BLOCK_N, HEAD_DIM,
        True, USE_TMA, DOT_PRECISION,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    o_rows = o_ptr + row0 * stride_ot + head * stride_oh
    o_ptrs = o_rows + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] new tokens
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [KVH, num_slots, D]
    v_cache: torch.Tensor,  # [KVH, num_slots, D]
    block_tables: torch.Tensor,  # int32 [N, W]
    cu_seqlens_q: torch.Tensor,  # int32 [N + 1]
    prefix_lens: torch.Tensor,  # int32 [N]
    max_seqlen_q: int,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D], q.dtype
    k_scale: float = 1.0,  # fp8 caches: the cached prefix reads as cache * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each chunk's new tokens over its cached prefix and itself; see the
    module docstring. Returns ``out`` (allocated when not given), ``[T, H, D]`` in q.dtype.
    The caches may be fp8 (``torch.float8_e4m3fn``) with q, k, v in any of the three; the
    scales are ignored for caches of q's dtype."""
    cfg = default_config(q.shape[-1], q.dtype, max_seqlen_q)
    return _launch(
        q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, max_seqlen_q,
        block_size, scale, out, block_m=cfg.block_m, block_n=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        use_tma=None if cfg.tma else False,  # None: where the GPU and strides allow
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _launch(
    q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, max_seqlen_q: int,
    block_size: int, scale: float, out=None, *, block_m: int, block_n: int, num_warps: int,
    num_stages: int, use_tma: bool | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """``extend_attention`` with an explicit tile shape and launch parameters (benchmarks and
    tests sweep these). ``use_tma``: load q and the new k, v through TMA descriptors (Hopper);
    None picks it where it runs (see ``_tma_ok``)."""
    _check(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, block_size, scale)
    fp8 = k_cache.dtype == FP8
    if fp8:
        check_kv_scales(k_scale, v_scale)
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    num_chunks = prefix_lens.shape[0]
    if num_chunks == 0 or num_tokens == 0 or max_seqlen_q <= 0:
        return out
    if use_tma is None:
        use_tma = _tma_ok(q, k, v)
    descs = (
        [_rows_desc(q, block_m), _rows_desc(k, block_n), _rows_desc(v, block_n)]
        if use_tma
        else [None, None, None]
    )
    grid = (num_heads, triton.cdiv(max_seqlen_q, block_m), num_chunks)
    _extend_attention_kernel[grid](
        q, k, v, k_cache, v_cache, out, block_tables, cu_seqlens_q, prefix_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), *descs, scale * _LOG2E,
        k_scale, v_scale,
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, USE_TMA=use_tma,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(q.device),
    )  # fmt: skip
    return out


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA loads need a Hopper-class GPU and, for the 2-D ``[T, heads * D]`` view of each
    ``[T, heads, D]`` tensor, heads adjacent (stride D), 16-byte aligned base and row stride."""
    if not tensors[0].is_cuda or not _has_tma(tensors[0].get_device()):
        return False
    return all(
        t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and t.stride(0) * t.element_size() % 16 == 0
        for t in tensors
    )


@functools.cache
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _rows_desc(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """``[T, heads, D]`` (heads adjacent) as a 2-D ``[T, heads * D]`` TMA descriptor whose
    tiles are ``block_rows`` tokens of one head."""
    num_tokens, heads, head_dim = t.shape
    return TensorDescriptor(
        t, [num_tokens, heads * head_dim], [t.stride(0), 1], [block_rows, head_dim]
    )


def _check(
    q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, block_size, scale
) -> None:
    """Shapes, dtypes, strides and devices the kernel relies on; errors name the values. Runs
    on every call, so the common case is a few cheap comparisons."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"q must be [T, H, D] and k, v [T, KVH, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)}: need the same T and D and "
            "H a multiple of KVH"
        )
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if k_cache.dim() != 3 or k_cache.shape[0] != kv_heads or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"k_cache must be [{kv_heads}, slots, {head_dim}], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    tensors = (q, k, v, k_cache, v_cache)
    cache_dtype = k_cache.dtype if k_cache.dtype == FP8 else q.dtype
    if (
        q.dtype not in _DTYPES
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or any(c.dtype != cache_dtype for c in (k_cache, v_cache))
    ):
        dtypes = [t.dtype for t in tensors]
        raise ValueError(
            f"q, k, v must share one of fp32/fp16/bf16 and the caches that dtype (or both "
            f"{FP8}), got {dtypes}"
        )
    if any(t.stride(2) != 1 for t in tensors):
        raise ValueError("q, k, v, k_cache and v_cache need a contiguous last dim (stride 1)")
    num_chunks = prefix_lens.shape[0]
    index_tensors = (("cu_seqlens_q", cu_seqlens_q, num_chunks + 1),
                     ("prefix_lens", prefix_lens, num_chunks))  # fmt: skip
    for name, t, n in index_tensors:
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n or t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous int32 ({n},), got {t.dtype} {t.shape}")
    if (
        block_tables.dtype != torch.int32
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_chunks
        or block_tables.stride(1) != 1
    ):
        raise ValueError(
            f"block_tables must be int32 [{num_chunks}, W] with contiguous rows, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    everything = (*tensors, block_tables, cu_seqlens_q, prefix_lens)
    device = q.get_device()
    if any(t.get_device() != device for t in everything):
        raise ValueError(f"all tensors must be on one device, got {[t.device for t in everything]}")


def extend_attention_ref(
    q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, block_size, scale,
    k_scale=1.0, v_scale=1.0,
) -> torch.Tensor:  # fmt: skip
    """Plain torch, one chunk at a time, fp32 math: the definition the kernel is tested against.
    The prefix comes from the cache through the block table (an fp8 cache dequantized first:
    ``cache * scale`` in fp32), the new tokens from k, v."""
    if k_cache.dtype == FP8:
        k_cache, v_cache = k_cache.float() * k_scale, v_cache.float() * v_scale
    num_heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i in range(prefix_lens.shape[0]):
        first, last = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n, prefix = last - first, int(prefix_lens[i])
        if n == 0:
            continue
        pos = torch.arange(prefix, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        keys = torch.cat(  # [KVH, L, D]
            [k_cache[:, slots].float(), k[first:last].transpose(0, 1).float()], dim=1
        )
        values = torch.cat([v_cache[:, slots].float(), v[first:last].transpose(0, 1).float()], 1)
        group = num_heads // kv_heads
        keys = keys.float().repeat_interleave(group, dim=0)  # [H, L, D]
        values = values.float().repeat_interleave(group, dim=0)
        q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        visible = torch.arange(prefix + n, device=q.device)[None, :] <= q_pos  # [n, L]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[first:last].float().transpose(0, 1), keys, values, attn_mask=visible, scale=scale
        )
        out[first:last] = o.transpose(0, 1).to(q.dtype)
    return out


def attention_flops(
    cu_seqlens_q: list[int], prefix_lens: list[int], num_heads: int, head_dim: int
) -> int:
    """FLOPs of the useful work: ``4 * D * H`` per visible (query, key) pair (two matmuls of
    2 FLOPs per multiply-add); a chunk of ``n`` new tokens over ``p`` cached ones has
    ``n * p + n * (n + 1) / 2`` pairs."""
    pairs = 0
    for i, p in enumerate(prefix_lens):
        n = cu_seqlens_q[i + 1] - cu_seqlens_q[i]
        pairs += n * p + n * (n + 1) // 2
    return 4 * head_dim * num_heads * pairs
