"""Rotary position embedding applied in place to q and k in one launch (Triton), and the
plain-torch reference.

NeoX / HF "rotate_half" style on each head of ``D`` values, with ``c, s`` = the first ``D/2``
columns of the cos/sin tables at the token's position::

    x = [x1 | x2]   (halves of D/2)        out = [x1*c - x2*s | x2*c + x1*s]

which is ``x * cos + rotate_half(x) * sin`` for tables built as ``RotaryEmbedding.build`` builds
them (``emb = cat(freqs, freqs)``: both halves of a row are equal, so the kernel reads only the
first). Any rope scaling is already folded into the tables. Math in fp32 from the fp32 tables,
rounded once to the dtype; the plain model instead rounds cos/sin to the dtype and each product
and the sum (HF does the same), so in bf16 the kernel is the more exact of the two and the two
differ by about 1 ulp of bf16 on some elements.

Grid ``(T, q_blocks + k_blocks)``: program ``(t, j)`` rotates heads
``[j * BLOCK_H, (j + 1) * BLOCK_H)`` of q (``j < q_blocks``) or of k (the rest) of token ``t``::

    j:      0       1       2       3    |   4
            q heads 0-7, 8-15, 16-23, 24-31 | k heads 0-7      (Llama-3-8B, BLOCK_H = 8)

``apply_rotary_write_kv`` also writes the step's K and V into the paged cache from the same
launch (what kernels/kv_cache_write.py does after it): the programs of k's heads store the
rotated heads they hold in registers, and v's same heads, in the token's slot. A decode step
then runs one kernel a layer for both (the attention backend calls it when the model leaves
rotary to it: ``StepContext.rope_in_attention``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import FP8
from kernels.kv_cache_write import check_cache, to_cache
from kernels.pdl import start as pdl_start

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_heads(
    x_ptr,
    head_stride,
    first_head,
    num_heads,
    cos,
    sin,
    cols,
    cmask,
    c_ptr,  # CACHE: the heads' row in the cache (its slot), written with the rotated values
    c_head_stride,
    c_ok,  # CACHE: the row has a slot (padding rows have none)
    c_scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE: tl.constexpr,
    FP8: tl.constexpr,
):
    h = first_head + tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & cmask[None, :]
    p1 = x_ptr + h.to(tl.int64)[:, None] * head_stride + cols[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    if CACHE:
        c1 = c_ptr + h.to(tl.int64)[:, None] * c_head_stride + cols[None, :]
        c_dtype: tl.constexpr = c_ptr.dtype.element_ty
        tl.store(c1, to_cache(o1, c_scale, c_dtype, FP8), mask=mask & c_ok)
        tl.store(c1 + HALF, to_cache(o2, c_scale, c_dtype, FP8), mask=mask & c_ok)


@triton.jit
def _copy_heads(
    x_ptr,
    head_stride,
    first_head,
    num_heads,
    cols,
    cmask,
    c_ptr,
    c_head_stride,
    c_ok,
    c_scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
):
    """V's heads of one token into their cache row, unrotated (the same halves as q and k)."""
    h = first_head + tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & cmask[None, :] & c_ok
    p1 = x_ptr + h.to(tl.int64)[:, None] * head_stride + cols[None, :]
    c1 = c_ptr + h.to(tl.int64)[:, None] * c_head_stride + cols[None, :]
    c_dtype: tl.constexpr = c_ptr.dtype.element_ty
    tl.store(c1, to_cache(tl.load(p1, mask=mask), c_scale, c_dtype, FP8), mask=mask)
    tl.store(c1 + HALF, to_cache(tl.load(p1 + HALF, mask=mask), c_scale, c_dtype, FP8), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    v_ptr,  # CACHE: v and the caches, as kernels/kv_cache_write.py takes them
    kc_ptr,
    vc_ptr,
    slot_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cos_stride,
    sin_stride,
    v_stride_t,
    v_stride_h,
    kc_stride_h,
    kc_stride_s,
    vc_stride_h,
    vc_stride_s,
    k_scale,
    v_scale,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    cos = tl.load(cos_ptr + pos * cos_stride + cols, mask=cmask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * sin_stride + cols, mask=cmask, other=0.0)[None, :]
    q_blocks: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    if j < q_blocks:
        x_ptr, stride, first, heads = q_ptr + t * q_stride_t, q_stride_h, j * BLOCK_H, NUM_Q_HEADS
        _rotate_heads(
            x_ptr, stride, first, heads, cos, sin, cols, cmask, q_ptr, 0, False, 1.0,
            HALF, BLOCK_H, False, False,
        )  # fmt: skip
    else:
        x_ptr, stride, first = k_ptr + t * k_stride_t, k_stride_h, (j - q_blocks) * BLOCK_H
        if CACHE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            ok = slot >= 0
            slot = tl.maximum(slot, 0)
            _rotate_heads(
                x_ptr, stride, first, NUM_K_HEADS, cos, sin, cols, cmask,
                kc_ptr + slot * kc_stride_s, kc_stride_h, ok, k_scale, HALF, BLOCK_H, True, FP8,
            )  # fmt: skip
            _copy_heads(
                v_ptr + t * v_stride_t, v_stride_h, first, NUM_K_HEADS, cols, cmask,
                vc_ptr + slot * vc_stride_s, vc_stride_h, ok, v_scale, HALF, BLOCK_H, FP8,
            )  # fmt: skip
        else:
            _rotate_heads(
                x_ptr, stride, first, NUM_K_HEADS, cos, sin, cols, cmask, k_ptr, 0, False, 1.0,
                HALF, BLOCK_H, False, False,
            )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [T, H, D], last dim contiguous (a view of the fused qkv output is fine)
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int32 / int64
    cos: torch.Tensor,  # [max_positions, D] fp32 (RotaryEmbedding.build)
    sin: torch.Tensor,  # [max_positions, D] fp32
) -> None:
    """Rotate q and k IN PLACE. Positions must be < max_positions (not checked: host sync)."""
    _check(q, k, positions, cos, sin)
    _launch(q, k, positions, cos, sin, None)


def apply_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [KVH, num_slots, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; negative = no slot (nothing written)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``apply_rotary`` and then ``write_kv_cache(k, v, ...)`` (kernels/kv_cache_write.py) in
    one launch: the programs that rotate k's heads also store them, and v's, in their slots,
    the same values the two kernels store one after the other."""
    _check(q, k, positions, cos, sin)
    check_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _launch(q, k, positions, cos, sin, (v, k_cache, v_cache, slot_mapping, k_scale, v_scale))


def _launch(q, k, positions, cos, sin, cache) -> None:
    t, num_heads, head_dim = q.shape
    if t == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h, num_warps = _config(t, block_half, max(num_heads, k.shape[1]))
    grid = (t, triton.cdiv(num_heads, block_h) + triton.cdiv(k.shape[1], block_h))
    v, k_cache, v_cache, slots, k_scale, v_scale = cache or (k, k, k, positions, 1.0, 1.0)
    _rotary_kernel[grid](
        q, k, positions, cos, sin, v, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), k_scale, v_scale,
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, CACHE=cache is not None, FP8=cache is not None and k_cache.dtype == FP8,
        num_warps=num_warps, **pdl.launch_options(q.device),
    )  # fmt: skip


def apply_rotary_ref(q, k, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, new tensors: ``x * cos + rotate_half(x) * sin`` in fp32, rounded once."""
    c, s = cos[positions.long()][:, None, :], sin[positions.long()][:, None, :]  # [T, 1, D]

    def rotate(x):
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    return rotate(q), rotate(k)


def _config(num_tokens: int, block_half: int, max_heads: int) -> tuple[int, int]:
    """Heads a program and warps. Small programs for decode (more of them to spread one token
    over SMs), larger ones for prefill: about 512 or 2048 (x1, x2) pairs a program, a warp per
    128 pairs (at most 8). Swept on an H100 (1-32 heads, 1-8 warps): the best or within 5%."""
    pairs = 512 if num_tokens <= 64 else 2048
    block_h = max(1, min(triton.next_power_of_2(max_heads), pairs // block_half))
    return block_h, max(1, min(8, block_h * block_half // 128))


def _check(q, k, positions, cos, sin) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q, k must be [T, H, D], [T, KVH, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one of {_DTYPES}, got {q.dtype}, {k.dtype}")
    if positions.shape != q.shape[:1] or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be [{q.shape[0]}] int32/int64, got {tuple(positions.shape)} "
            f"{positions.dtype}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32:
            raise ValueError(
                f"{name} must be [max_positions, {head_dim}] fp32, got {tuple(table.shape)} "
                f"{table.dtype}"
            )
    if any(x.stride(-1) != 1 for x in (q, k, cos, sin)) or not positions.is_contiguous():
        raise ValueError("q, k, cos and sin need a contiguous last dim, positions contiguous")
