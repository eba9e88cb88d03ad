"""Attention over the paged KV cache, behind a small backend interface.

The KV cache of one layer is two tensors of slots, ``[num_blocks * block_size, kv_heads, head_dim]``
(K and V). Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; a request's block
table lists its blocks in order, so the token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``::

    block table [7, 2, 9]      block_size 4
    positions    0 1 2 3 | 4 5 6 7 | 8 9
    slots       28..31   |  8..11  | 36 37

A step's tokens are flattened (``[num_tokens, heads, head_dim]``), decode rows first (one query
token each), then the prefill chunks. Every layer first writes the step's new K/V into their
slots, then attends: a request admitted in this step on top of blocks another request is filling
in this same step reads them after they are written.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ChunkSpec:
    """One request's share of a step as the attention backend sees it."""

    start: int  # position of the first new token (= tokens already in the cache)
    num_tokens: int
    block_table: list[int]


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] slots to read, padded with 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] additive (0 / -inf)
    # Prefill chunks: (first row, rows, context slots or None when no cached prefix, start pos)
    prefills: list[tuple[int, int, torch.Tensor | None, int]]


class AttentionBackend(abc.ABC):
    """Contract: ``build`` turns a step's chunks (decode chunks first) into metadata once per
    step; ``forward`` is called once per layer with that step's q, k, v and writes k, v into the
    layer's cache before reading it. Output is ``[num_tokens, num_heads * head_dim]``."""

    name: str

    @abc.abstractmethod
    def build(self, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> AttentionMetadata: ...

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def slots_for(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch, CPU and GPU: batched gather for decodes, SDPA per prefill chunk."""

    name = "torch"

    def build(self, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> AttentionMetadata:
        slot_mapping: list[int] = []
        for c in chunks:
            slot_mapping += slots_for(c.block_table, c.start, c.start + c.num_tokens, block_size)
        decodes = [c for c in chunks if c.num_tokens == 1]
        num_decodes = len(decodes)
        if chunks[:num_decodes] != decodes:
            raise ValueError("decode chunks must come first")
        decode_slots = decode_mask = None
        if decodes:
            max_ctx = max(c.start + 1 for c in decodes)
            padded = [slots_for(c.block_table, 0, c.start + 1, block_size) for c in decodes]
            lens = torch.tensor([len(p) for p in padded])
            padded = [p + [0] * (max_ctx - len(p)) for p in padded]
            decode_slots = torch.tensor(padded, dtype=torch.long, device=device)
            valid = torch.arange(max_ctx)[None, :] < lens[:, None]
            mask = torch.zeros(num_decodes, max_ctx).masked_fill_(~valid, float("-inf"))
            decode_mask = mask.view(num_decodes, 1, 1, max_ctx).to(device)
        prefills = []
        row = num_decodes
        for c in chunks[num_decodes:]:
            ctx = None
            if c.start > 0:
                ctx_slots = slots_for(c.block_table, 0, c.start + c.num_tokens, block_size)
                ctx = torch.tensor(ctx_slots, dtype=torch.long, device=device)
            prefills.append((row, c.num_tokens, ctx, c.start))
            row += c.num_tokens
        return AttentionMetadata(
            num_tokens=len(slot_mapping),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            num_decodes=num_decodes,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale).reshape(nd, -1)
        for row, n, ctx, start in meta.prefills:
            if ctx is None:
                ks, vs = k[row : row + n], v[row : row + n]
            else:
                ks, vs = k_cache[ctx], v_cache[ctx]
            o = _prefill_attention(q[row : row + n], ks, vs, start, scale)
            out[row : row + n] = o.reshape(n, -1)
        return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [B, H, D] against each row's gathered context [B, L, KVH, D]; GQA by grouping heads."""
    b, num_heads, head_dim = q.shape
    ks = k_cache[meta.decode_slots]  # [B, L, KVH, D]
    vs = v_cache[meta.decode_slots]
    kvh = ks.shape[2]
    qg = q.view(b, kvh, num_heads // kvh, head_dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, ks.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    scores = scores.float() + meta.decode_mask
    probs = torch.softmax(scores, dim=-1).to(vs.dtype)
    return torch.matmul(probs, vs.transpose(1, 2))  # [B, KVH, G, D]


def _prefill_attention(q, k, v, start: int, scale: float) -> torch.Tensor:
    """Causal attention of ``n`` queries at positions ``start..start+n-1`` over ``start+n`` keys."""
    n, num_heads, _ = q.shape
    kvh = k.shape[1]
    if kvh != num_heads:
        k = k.repeat_interleave(num_heads // kvh, dim=1)
        v = v.repeat_interleave(num_heads // kvh, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if start == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]
        mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)
