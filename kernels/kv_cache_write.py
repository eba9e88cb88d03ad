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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + h * kc_stride_h + slot * kc_stride_s + d, k, mask=mask)
    tl.store(v_cache_ptr + h * vc_stride_h + slot * vc_stride_s + d, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [KVH, num_slots, D]
    v_cache: torch.Tensor,  # [KVH, num_slots, D]
    slot_mapping: torch.Tensor,  # [T] int32 / int64; negative = skip the row
) -> None:
    """``k_cache[:, slot_mapping[t]] = k[t]`` (and V) for every row with a slot >= 0, in place.
    Slots must be < num_slots (not checked: that would need a host sync)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
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
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_h * block_d * k.element_size()),
    )


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Plain torch, in place like the kernel: the definition it is tested against."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[:, slots] = k[keep].transpose(0, 1)
    v_cache[:, slots] = v[keep].transpose(0, 1)


def _num_warps(row_bytes: int) -> int:
    """One warp per 512 bytes of each of K and V (16 bytes a thread), 1 to 8 warps."""
    return max(1, min(8, row_bytes // 512))


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
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
    if k.dtype not in _DTYPES or any(x.dtype != k.dtype for x in (v, k_cache, v_cache)):
        raise ValueError(
            f"k, v and the caches must share one of {_DTYPES}, got "
            f"{[x.dtype for x in (k, v, k_cache, v_cache)]}"
        )
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)):
        raise ValueError("k, v, k_cache and v_cache need a contiguous last (head_dim) dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
