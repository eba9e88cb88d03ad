"""Write a step's new K and V rows into their slots of the paged KV cache (Triton), and the
plain-torch reference.

One program per token row ``t`` moves that row's K and V for every kv head::

    k, v        [T, KVH, D]          (views of the fused qkv output: any row/head stride)
    k_cache     [KVH, num_slots, D]  (layer[0] of a [2, KVH, slots, D] tensor: any strides)

    row t, head h  ->  k_cache[h, slot_mapping[t], :] = k[t, h, :]   (same for v)
    slot_mapping[t] < 0  ->  row t is padding (a CUDA-graph batch): nothing is written

The grid is ``(T,)`` from the shape alone and the slot is read on the device, so the launch
never syncs with the host and can be replayed in a CUDA graph. Cache offsets are 64-bit
(``slot * stride`` passes 2**31 elements on large caches).

An fp8 cache (``torch.float8_e4m3fn``) stores each value quantized with its layer's scale
(kernels/fp8.py)::

    cache = fp8(clamp(k / k_scale, -448, 448))      (dequantized: cache * k_scale)

in fp32, rounded to nearest even by the cast (``FP8`` is a constexpr: caches of the model's
dtype compile the plain copy above, unchanged). Triton's interpreter (3.6) rounds fp32 -> fp8
wrongly when the mantissa carries into the exponent (127.3 -> 64, not 128); the GPU's cvt does not, so
CPU tests feed values the cast keeps exactly and tests/gpu checks rounding on random values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import FP8, check_kv_scales, quantize_fp8
from kernels.pdl import start as pdl_start

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def to_cache(x, scale, CACHE_DTYPE: tl.constexpr, FP8: tl.constexpr):
    """Values of the model's dtype as a cache of ``CACHE_DTYPE`` stores them: an fp8 cache
    ``x / scale`` clamped to +-448 (the rule above), any other ``x`` as it is. Also
    kernels/rotary.py's, which writes the KV from its own kernel."""
    if FP8:
        return tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0).to(CACHE_DTYPE)
    return x.to(CACHE_DTYPE)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kc_stride_h,
    kc_stride_s,
    vc_stride_h,
    vc_stride_s,
    k_scale,  # fp8 caches: value / scale is stored
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    k = to_cache(k, k_scale, k_cache_ptr.dtype.element_ty, FP8)
    v = to_cache(v, v_scale, v_cache_ptr.dtype.element_ty, FP8)
    tl.store(k_cache_ptr + h * kc_stride_h + slot * kc_stride_s + d, k, mask=mask)
    tl.store(v_cache_ptr + h * vc_stride_h + slot * vc_stride_s + d, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [KVH, num_slots, D]
    v_cache: torch.Tensor,  # [KVH, num_slots, D]
    slot_mapping: torch.Tensor,  # [T] int32 / int64; negative = skip the row
    k_scale: float = 1.0,  # fp8 caches only: the stored value is k / k_scale
    v_scale: float = 1.0,
) -> None:
    """``k_cache[:, slot_mapping[t]] = k[t]`` (and V) for every row with a slot >= 0, in place.
    Slots must be < num_slots (not checked: that would need a host sync). An fp8 cache gets
    ``k / k_scale`` clamped to +-448; the scales are ignored for other caches."""
    check_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    block_h, block_d = triton.next_power_of_2(kv_heads), triton.next_power_of_2(head_dim)
    _write_kv_cache_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k_scale,
        v_scale,
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8=k_cache.dtype == FP8,
        num_warps=_num_warps(block_h * block_d * k.element_size()),
        **pdl.launch_options(k.device),
    )


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Plain torch, in place like the kernel: the definition it is tested against."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = new[keep].transpose(0, 1)
        if cache.dtype == FP8:
            cache.view(torch.uint8)[:, slots] = quantize_fp8(rows, scale).view(torch.uint8)
        else:
            cache[:, slots] = rows


def _num_warps(row_bytes: int) -> int:
    """One warp per 512 bytes of each of K and V (16 bytes a thread), 1 to 8 warps."""
    return max(1, min(8, row_bytes // 512))


def check_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k, v must both be [T, KVH, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    t, kv_heads, head_dim = k.shape
    want = (kv_heads, head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or (c.shape[0], c.shape[2]) != want:
            raise ValueError(
                f"{name} must be [{kv_heads}, slots, {head_dim}], got {tuple(c.shape)}"
            )
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [{t}] int32/int64, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    cache_dtype = k_cache.dtype if k_cache.dtype == FP8 else k.dtype
    if (
        k.dtype not in _DTYPES
        or v.dtype != k.dtype
        or any(c.dtype != cache_dtype for c in (k_cache, v_cache))
    ):
        raise ValueError(
            f"k, v must share one of {_DTYPES} and the caches that dtype or {FP8}, got "
            f"{[x.dtype for x in (k, v, k_cache, v_cache)]}"
        )
    if k_cache.dtype == FP8:
        check_kv_scales(k_scale, v_scale)
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)):
        raise ValueError("k, v, k_cache and v_cache need a contiguous last (head_dim) dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
