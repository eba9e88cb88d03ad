"""Paged decode attention on CPU: the native kernel (``paged_decode_attention.cpp``, built by
``native.load_kernel``) and its plain-torch reference."""

from __future__ import annotations

import torch

from kernels.cpu.native import load_kernel

__all__ = ["load_kernel", "paged_decode_attention", "paged_decode_attention_ref"]


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [KVH, S, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel is not available here")
    return kernel.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, block_size, scale
    )


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    """Plain torch, one sequence at a time: the definition the kernel is tested against."""
    b, num_heads, head_dim = q.shape
    kvh = k_cache.shape[0]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(context_lens[i])
        pos = torch.arange(n)
        slots = block_tables[i, pos // block_size] * block_size + pos % block_size
        k = k_cache[:, slots].repeat_interleave(num_heads // kvh, dim=0)  # [H, n, D]
        v = v_cache[:, slots].repeat_interleave(num_heads // kvh, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), k.float()) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v.float()).to(q.dtype)
    return out
