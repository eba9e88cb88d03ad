"""Attention over the paged KV cache, behind a small backend interface.

The KV cache of one layer is two tensors (K and V) of ``[kv_heads, num_blocks * block_size, head_dim]``:
heads outermost, so one head's slots are contiguous and a gathered context is already laid out
for a batched matmul. Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; a request's block
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
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block tables, padded with 0
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, max_blocks * block_size] 0 / -inf
    # Prefill chunks: (first row, rows, context slots or None when no cached prefix, start pos)
    prefills: list[tuple[int, int, torch.Tensor | None, int]]


class AttentionBackend(abc.ABC):
    """Contract: ``build`` turns a step's chunks (decode chunks first) into metadata once per
    step; ``forward`` is called once per layer with that step's q, k, v and writes k, v into the
    layer's cache before reading it. Output is ``[num_tokens, num_heads * head_dim]``."""

    name: str

    @abc.abstractmethod
    def build(
        self, chunks: list[ChunkSpec], block_size: int, device: torch.device
    ) -> AttentionMetadata: ...

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

    def build(
        self, chunks: list[ChunkSpec], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        slot_mapping: list[int] = []
        for c in chunks:
            slot_mapping += slots_for(c.block_table, c.start, c.start + c.num_tokens, block_size)
        decodes = [c for c in chunks if c.num_tokens == 1]
        num_decodes = len(decodes)
        if chunks[:num_decodes] != decodes:
            raise ValueError("decode chunks must come first")
        decode_blocks = decode_mask = None
        if decodes:
            tables = [c.block_table[: c.start // block_size + 1] for c in decodes]
            max_blocks = max(len(t) for t in tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in tables]
            decode_blocks = torch.tensor(padded, dtype=torch.long, device=device)
            lens = torch.tensor([c.start + 1 for c in decodes])
            valid = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
            mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
            decode_mask = mask.view(1, num_decodes, 1, -1).to(device)
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
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            prefills=prefills,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale).reshape(nd, -1)
        for row, n, ctx, start in meta.prefills:
            if ctx is None:
                ks, vs = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            else:
                ks, vs = k_cache[:, ctx], v_cache[:, ctx]
            o = _prefill_attention(q[row : row + n], ks, vs, start, scale)
            out[row : row + n] = o.reshape(n, -1)
        return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [B, H, D] against each row's gathered blocks; GQA by grouping the heads of a KV head."""
    b, num_heads, head_dim = q.shape
    kvh = k_cache.shape[0]
    blocks = meta.decode_blocks
    ks = k_cache.view(kvh, -1, _block_size(meta, k_cache), head_dim)[:, blocks]
    vs = v_cache.view(kvh, -1, ks.shape[3], head_dim)[:, blocks]
    ks = ks.view(kvh, b, -1, head_dim)  # [KVH, B, L, D]
    vs = vs.view(kvh, b, -1, head_dim)
    qg = q.view(b, kvh, num_heads // kvh, head_dim).transpose(0, 1)  # [KVH, B, G, D]
    scores = torch.matmul(qg, ks.transpose(-1, -2)).float() * scale  # [KVH, B, G, L]
    probs = torch.softmax(scores + meta.decode_mask, dim=-1).to(vs.dtype)
    return torch.matmul(probs, vs).transpose(0, 1)  # [B, KVH, G, D]


def _block_size(meta: AttentionMetadata, k_cache: torch.Tensor) -> int:
    return meta.decode_mask.shape[-1] // meta.decode_blocks.shape[1]


def _prefill_attention(q, k, v, start: int, scale: float) -> torch.Tensor:
    """Causal attention of ``n`` queries at positions ``start..start+n-1`` (q ``[n, H, D]``) over
    ``start+n`` keys (k, v ``[KVH, start+n, D]``)."""
    n = q.shape[0]
    qt = q.transpose(0, 1)
    gqa = k.shape[0] != q.shape[1]
    if start == 0:
        o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]
        mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)
