"""Attention over the paged KV cache, behind a small backend interface.

The KV cache of one layer is two tensors (K and V) of
``[kv_heads, num_blocks * block_size, head_dim]``: heads outermost, so one head's slots are
contiguous and a gathered context is already laid out for a batched matmul. Slot ``s`` is offset
``s % block_size`` of block ``s // block_size``; a request's block table lists its blocks in
order, so the token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``::

    block table [7, 2, 9]      block_size 4
    positions    0 1 2 3 | 4 5 6 7 | 8 9
    slots       28..31   |  8..11  | 36 37

A step's tokens are flattened (``[num_tokens, heads, head_dim]``), decode rows first (one query
token each, shortest context first, so rows of similar length form padded groups), then the
prefill chunks. Every layer first writes the step's new K/V into their
slots, then attends: a request admitted in this step on top of blocks another request is filling
in this same step reads them after they are written.

An fp8 KV cache (``kv_cache_dtype="fp8"``: ``torch.float8_e4m3fn``) stores ``k / k_scale`` and
``v / v_scale`` (kernels/fp8.py), the layer's scales passed with every call; whatever is read
from the cache is dequantized (``fp8 * scale``). A prefill chunk's own new tokens attend to each
other unquantized, as they come from the projection; every later step reads them from the cache.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.fp8 import FP8, dequantize_fp8, quantize_fp8

logger = logging.getLogger(__name__)


@dataclass
class ChunkSpec:
    """One request's share of a step as the attention backend sees it."""

    start: int  # position of the first new token (= tokens already in the cache)
    num_tokens: int
    block_table: list[int]


@dataclass
class DecodeGroup:
    """Decode rows ``[first, first + num_rows)`` whose contexts are padded to one length."""

    first: int
    num_rows: int
    blocks: torch.Tensor  # [num_rows, max_blocks] block tables, padded with block 0
    mask: torch.Tensor  # [1, num_rows, 1, max_blocks * block_size] additive: 0 or -inf


@dataclass
class AttentionMetadata:
    block_size: int
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    num_decodes: int  # rows [0, num_decodes) are single-token decodes, shortest context first
    decode_groups: list[DecodeGroup]  # torch backend: decodes padded per group of similar length
    # Prefill chunks: (first row, rows, context slots or None when no cached prefix, start pos)
    prefills: list[tuple[int, int, torch.Tensor | None, int]]
    # Native backends: every decode's block table (padded) and context length.
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # Triton backend, prefill chunks as one varlen batch: rows per chunk (cumulative, from the
    # first prefill row), tokens already cached before each chunk, block tables, longest chunk.
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_prefix_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_max_len: int = 0


class AttentionBackend(abc.ABC):
    """Contract: ``build`` turns a step's chunks (decode chunks first) into metadata once per
    step; ``forward`` is called once per layer with that step's q, k, v and writes k, v into the
    layer's cache before reading it. Output is ``[num_tokens, num_heads * head_dim]``, written
    into ``out`` when given (a static buffer of the piecewise CUDA graphs). The caches hold q's
    dtype, or fp8 (``torch.float8_e4m3fn``): then k, v are stored as ``k / k_scale`` and
    ``v / v_scale`` and read back times the scales; other caches ignore the scales. The
    Triton backend also takes ``rope=`` (TritonOps' rotary state) with q and k unrotated and
    rotates them as it writes the KV (one kernel); the model passes it only to that backend
    (``LlamaForCausalLM.rope_in_attention``, set by the runner)."""

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
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


def slots_for(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch, CPU and GPU: batched gather for decodes, SDPA per prefill chunk. An fp8
    cache is written through a byte view (torch has no fp8 ``index_copy_`` on CPU) and what is
    gathered from it is dequantized to q's dtype."""

    name = "torch"

    def build(
        self, chunks: list[ChunkSpec], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        slot_mapping: list[int] = []
        for c in chunks:
            slot_mapping += slots_for(c.block_table, c.start, c.start + c.num_tokens, block_size)
        decodes = [c for c in chunks if c.num_tokens == 1]
        num_decodes = len(decodes)
        if chunks[:num_decodes] != decodes or decodes != sorted(decodes, key=lambda c: c.start):
            raise ValueError("decode chunks must come first, shortest context first")
        groups = self._decode_groups(decodes, block_size, device)
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
            block_size=block_size,
            num_tokens=len(slot_mapping),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            num_decodes=num_decodes,
            decode_groups=groups,
            **self._decode_tables(decodes, block_size, device),
            prefills=prefills,
        )

    def _decode_groups(self, decodes, block_size, device) -> list[DecodeGroup]:
        return [_decode_group(first, g, block_size, device) for first, g in _by_length(decodes)]

    def _decode_tables(self, decodes, block_size, device) -> dict:
        return {}

    def _decode(self, q, k_cache, v_cache, meta, scale, out, kv_scales=None) -> None:
        for g in meta.decode_groups:
            rows = slice(g.first, g.first + g.num_rows)
            o = _decode_attention(q[rows], k_cache, v_cache, g, meta.block_size, scale, kv_scales)
            out[rows] = o.reshape(g.num_rows, -1)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out=None, k_scale=1.0, v_scale=1.0):
        if k_cache.dtype == FP8:
            return self._forward_fp8(q, k, v, k_cache, v_cache, meta, scale, out, k_scale, v_scale)
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        num_heads, head_dim = q.shape[1], q.shape[2]
        if out is None:
            out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            self._decode(q[: meta.num_decodes], k_cache, v_cache, meta, scale, out)
        for row, n, ctx, start in meta.prefills:
            if ctx is None:
                ks, vs = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            else:
                ks, vs = k_cache[:, ctx], v_cache[:, ctx]
            self._prefill(q[row : row + n], ks, vs, start, scale, out[row : row + n])
        return out

    def _prefill(self, q, k, v, start: int, scale: float, out) -> None:
        """One prefill chunk's attention (``_prefill_attention``) into its rows of ``out``."""
        out.copy_(_prefill_attention(q, k, v, start, scale).reshape(q.shape[0], -1))

    def _forward_fp8(self, q, k, v, k_cache, v_cache, meta, scale, out, k_scale, v_scale):
        """``forward`` over an fp8 cache: store quantized, read dequantized; a prefill chunk's
        cached prefix comes from the cache, its own tokens from k, v (as the Triton kernel).
        Writes and gathers move bytes (uint8 views): torch lacks fp8 ``index_copy_`` on CPU."""
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        for new, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            quantized = quantize_fp8(new.transpose(0, 1), s).view(torch.uint8)
            cache.index_copy_(1, meta.slot_mapping, quantized)
        if out is None:
            out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            kv_scales = (k_scale, v_scale)
            self._decode(q[: meta.num_decodes], k_cache, v_cache, meta, scale, out, kv_scales)
        for row, n, ctx, start in meta.prefills:
            ks, vs = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            if ctx is not None:
                prefix = ctx[:start]
                ks = torch.cat([dequantize_fp8(k_cache[:, prefix], k_scale, q.dtype), ks], 1)
                vs = torch.cat([dequantize_fp8(v_cache[:, prefix], v_scale, q.dtype), vs], 1)
            self._prefill(q[row : row + n], ks, vs, start, scale, out[row : row + n])
        return out


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decodes in one native pass over the paged cache (CPU, fp32):
    no padded gather, no length groups (kernels/cpu/paged_decode_attention.cpp); and prefill
    chunks in a native flash kernel (kernels/cpu/prefill_attention.cpp, 2.6-3.8x torch's SDPA
    on the 2-core AVX-512 dev host) where this build and head size run it, SDPA elsewhere."""

    name = "cpu"

    def __init__(self, kernel):
        self.kernel = kernel
        self._native_prefill = functools.cache(kernel.prefill_attention_supported)

    def _prefill(self, q, k, v, start: int, scale: float, out) -> None:
        if self._native_prefill(q.shape[2]):
            self.kernel.prefill_attention(q, k, v, start, scale, out.view(q.shape))
        else:
            super()._prefill(q, k, v, start, scale, out)

    def _decode_groups(self, decodes, block_size, device) -> list[DecodeGroup]:
        return []

    def _decode_tables(self, decodes, block_size, device) -> dict:
        if not decodes:
            return {}
        # (numpy rows, not torch.tensor of nested lists: ~1.4 ms -> 0.3 ms at 500 decodes)
        table = _table_np(decodes, block_size, lambda c: c.start + 1, dtype=np.int64)
        return {
            "decode_block_tables": torch.from_numpy(table),
            "decode_context_lens": torch.tensor([c.start + 1 for c in decodes]),
        }

    def _decode(self, q, k_cache, v_cache, meta, scale, out, kv_scales=None) -> None:
        o = self.kernel.paged_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.block_size,
            scale,
        )
        out[: q.shape[0]] = o.view(q.shape[0], -1)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels (kernels/): a scatter of the new K/V into their slots, paged decode
    attention (GQA-grouped, split over the context) for the decode rows, and one varlen
    extend-attention launch for all prefill chunks (cached prefix from the pages, new tokens
    from q/k/v directly). Metadata is built on the host in pinned memory and copied without a
    sync; ``forward`` launches three kernels and never waits on the GPU, so decode steps can be
    captured in a CUDA graph (engine/cuda_graphs.py fills the same metadata from static
    buffers)."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.extend_attention import extend_attention
        from kernels.kv_cache_write import write_kv_cache
        from kernels.paged_decode_attention import paged_decode_attention
        from kernels.rotary import apply_rotary_write_kv

        self._write, self._decode_kernel = write_kv_cache, paged_decode_attention
        self._extend, self._rotary_write = extend_attention, apply_rotary_write_kv

    @torch.inference_mode()
    def warm_up(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        block_size: int,
        dtype: torch.dtype | None = None,
    ):
        """Launch every variant of the four kernels that serving can meet, once, on dummy rows
        (nothing is written to the cache: every slot is -1, and extends read no prefix), so
        Triton compiles them now (or loads them from its disk cache) and not in a live step. A
        variant compiled by a live step held that step 1-2 s on an H100; on 2 GPUs both prefill
        workers did so under the first requests, and a resume that landed then waited for it
        (benchmarks/NOTES.md, the resume stall). Variants: the KV write alone and with the
        rotary (up to 64 rows and more: other head blocks), the extend with and without TMA
        loads (chunks of 1024 tokens or more use them), the decode in one split (written
        directly) and in 2..64 splits (a workspace, then a reduce per power of two of splits),
        each with its first tile read before the PDL wait and after it (kernels/), for one
        sequence, for a batch whose grid fills the GPU and for one whose grid is large (an fp8
        cache's tiles follow the grid: kernels/paged_decode_attention.py ``launch_config``).
        Integer arguments that vary per step (table widths, split counts) are not specialised
        on (``do_not_specialize`` in kernels/), so these are all there are. ``dtype``: the
        model's (q, k, v), when the cache holds another (fp8)."""
        from kernels import pdl
        from kernels.paged_decode_attention import _MAX_SPLITS, FP8_LARGE_GRID_WAVES

        kv_heads, _, head_dim = k_cache.shape
        device, dtype = k_cache.device, dtype or k_cache.dtype
        cos_sin = torch.zeros(2, head_dim, dtype=torch.float32, device=device)
        for t in (16, 1024):  # (the rotary's head blocks change past 64 rows)
            q = torch.zeros(t, num_heads, head_dim, dtype=dtype, device=device)
            k = torch.zeros(t, kv_heads, head_dim, dtype=dtype, device=device)
            skip = torch.full((t,), -1, dtype=torch.int64, device=device)
            self._write(k, k, k_cache, v_cache, skip)
            positions = torch.zeros(t, dtype=torch.int64, device=device)
            self._rotary_write(q, k, k, positions, cos_sin, cos_sin, k_cache, v_cache, skip)
            width = -(-t // block_size)
            table = torch.zeros(1, width, dtype=torch.int32, device=device)
            cu = torch.tensor([0, t], dtype=torch.int32, device=device)
            prefix = torch.zeros(1, dtype=torch.int32, device=device)
            self._extend(q, k, k, k_cache, v_cache, table, cu, prefix, t, block_size, 1.0)
        # (the first tile read before the PDL wait: small grids only, so both variants serve)
        prefetches = (False, True) if pdl.enabled(device) else (False,)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        full, large = -(-sms // kv_heads), -(-sms * FP8_LARGE_GRID_WAVES // kv_heads)
        # (a large grid is never split: default_num_splits splits only grids that leave SMs idle)
        for batch, most_splits in ((1, _MAX_SPLITS), (full, _MAX_SPLITS), (large, 1)):
            splits = 1
            while splits <= most_splits:
                q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
                table = torch.zeros(batch, splits, dtype=torch.int32, device=device)
                lens = torch.full((batch,), splits * block_size, dtype=torch.int32, device=device)
                for prefetch in prefetches:
                    self._decode_kernel(q, k_cache, v_cache, table, lens, block_size, 1.0,
                                        num_splits=splits, prefetch=prefetch)  # fmt: skip
                splits *= 2
        torch.cuda.synchronize(device)

    def build(
        self, chunks: list[ChunkSpec], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        decodes = [c for c in chunks if c.num_tokens == 1]
        num_decodes = len(decodes)
        if chunks[:num_decodes] != decodes:
            raise ValueError("decode chunks must come first")
        prefills = chunks[num_decodes:]
        slots = [
            slot_array(c.block_table, c.start, c.start + c.num_tokens, block_size) for c in prefills
        ]
        fields = {}
        if decodes:
            # each decode's slot read off its row of the table, not one array per decode
            # (a step of ~500 decodes spent ~2 ms in those on an H200's host)
            table = _table_np(decodes, block_size, lambda c: c.start + 1)
            lens = np.array([c.start + 1 for c in decodes], dtype=np.int32)
            starts = lens.astype(np.int64) - 1
            blocks = table[np.arange(num_decodes), starts // block_size]
            slots.insert(0, blocks.astype(np.int64) * block_size + starts % block_size)
            fields["decode_block_tables"] = host_to_device(table, device)
            fields["decode_context_lens"] = host_to_device(lens, device)
        slots = np.concatenate(slots)
        if prefills:
            lens = np.array([c.num_tokens for c in prefills], dtype=np.int32)
            cu = np.zeros(len(prefills) + 1, dtype=np.int32)
            np.cumsum(lens, out=cu[1:])
            fields["prefill_cu_seqlens"] = host_to_device(cu, device)
            fields["prefill_prefix_lens"] = host_to_device(
                np.array([c.start for c in prefills], dtype=np.int32), device
            )
            fields["prefill_block_tables"] = host_to_device(
                _table_np(prefills, block_size, lambda c: c.start + c.num_tokens), device
            )
            fields["prefill_max_len"] = int(lens.max())
        return AttentionMetadata(
            block_size=block_size,
            num_tokens=len(slots),
            slot_mapping=host_to_device(slots, device),
            num_decodes=num_decodes,
            decode_groups=[],
            prefills=[],
            **fields,
        )

    def forward(
        self, q, k, v, k_cache, v_cache, meta, scale, out=None, k_scale=1.0, v_scale=1.0, rope=None
    ):
        """``rope``: TritonOps' rotary state (positions, cos, sin) when q and k come unrotated;
        one kernel rotates them in place and writes the KV."""
        if rope is not None:
            slots = meta.slot_mapping
            self._rotary_write(q, k, v, *rope, k_cache, v_cache, slots, k_scale, v_scale)
        else:
            self._write(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        t, num_heads, head_dim = q.shape
        if out is None:
            out = torch.empty(t, num_heads, head_dim, dtype=q.dtype, device=q.device)
        else:
            out = out.view(t, num_heads, head_dim)
        nd = meta.num_decodes
        if nd:
            self._decode_kernel(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                meta.block_size,
                scale,
                out=out[:nd],
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if nd < t:
            self._extend(
                q[nd:],
                k[nd:],
                v[nd:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_seqlens,
                meta.prefill_prefix_lens,
                meta.prefill_max_len,
                meta.block_size,
                scale,
                out=out[nd:],
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out.view(t, num_heads * head_dim)


def slot_array(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """``slots_for`` as an int64 array, computed without a Python loop over positions."""
    positions = np.arange(start, end)
    blocks = np.asarray(table, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def _table_np(chunks: list[ChunkSpec], block_size: int, tokens, dtype=np.int32) -> np.ndarray:
    """Block tables (``dtype``), each cut to the blocks its ``tokens(c)`` positions use,
    padded with zeros."""
    used = [-(-tokens(c) // block_size) for c in chunks]
    table = np.zeros((len(chunks), max(used)), dtype=dtype)
    for row, (c, n) in enumerate(zip(chunks, used, strict=True)):
        table[row, :n] = c.block_table[:n]
    return table


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array to ``device`` without a host sync: a pageable copy would wait for the GPU
    to drain its queue; a pinned one is queued on the stream like a kernel."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


BACKENDS = ("auto", "torch", "triton")


def select_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The fastest backend that runs here: Triton on CUDA, native CPU decode for fp32 on CPU
    (an fp32 cache: the native kernel reads no fp8), else torch. ``TANDEM_ATTENTION_BACKEND``
    forces one: ``torch`` anywhere, ``triton`` also on CPU under ``TRITON_INTERPRET=1`` (for
    tests). ``kv_dtype``: what the KV cache holds (default: ``dtype``)."""
    choice = os.environ.get("TANDEM_ATTENTION_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"TANDEM_ATTENTION_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "triton":
        return TritonAttentionBackend()
    if choice == "auto" and device.type == "cuda":
        try:
            return TritonAttentionBackend()
        except ImportError as exc:  # no triton for this platform: plain torch still works
            logger.warning("Triton unavailable (%s); using the torch attention backend", exc)
            return TorchAttentionBackend()
    if kv_dtype in (None, dtype) and (kernel := native_cpu_kernels(device, dtype)) is not None:
        return CpuAttentionBackend(kernel)
    return TorchAttentionBackend()


def native_cpu_kernels(device: torch.device, dtype: torch.dtype):
    """The native CPU kernels' module where they may run: an fp32 model on CPU, with
    ``TANDEM_ATTENTION_BACKEND`` not forcing torch or triton; else None. The fused ops use it
    whatever the KV cache holds, the decode attention only over an fp32 cache."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    if os.environ.get("TANDEM_ATTENTION_BACKEND", "auto") != "auto":
        return None
    from kernels.cpu.paged_decode import load_kernel

    return load_kernel()


# Padding a group to its longest context wastes gather and matmul work on the shorter rows; a
# new group starts when the padded size would exceed this factor of the useful size.
MAX_PADDING = 1.3


def _by_length(decodes: list[ChunkSpec]) -> list[tuple[int, list[ChunkSpec]]]:
    """Split decodes (sorted by context length) into runs of similar length: (first row, run)."""
    groups: list[tuple[int, list[ChunkSpec]]] = []
    run: list[ChunkSpec] = []
    useful = 0
    for row, c in enumerate(decodes):
        ctx = c.start + 1
        if run and (len(run) + 1) * ctx > MAX_PADDING * (useful + ctx):
            groups.append((row - len(run), run))
            run, useful = [], 0
        run.append(c)
        useful += ctx
    if run:
        groups.append((len(decodes) - len(run), run))
    return groups


def _decode_group(first: int, run: list[ChunkSpec], block_size: int, device) -> DecodeGroup:
    padded = _table_np(run, block_size, lambda c: c.start + 1, dtype=np.int64)
    max_blocks = padded.shape[1]
    lens = torch.tensor([c.start + 1 for c in run])
    valid = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    return DecodeGroup(
        first=first,
        num_rows=len(run),
        blocks=torch.from_numpy(padded).to(device),
        mask=mask.view(1, len(run), 1, -1).to(device),
    )


def _decode_attention(
    q, k_cache, v_cache, g: DecodeGroup, block_size: int, scale: float, kv_scales=None
) -> torch.Tensor:
    """q [B, H, D] against each row's gathered blocks; GQA by grouping the heads of a KV head.
    ``kv_scales``: (k_scale, v_scale) of an fp8 cache (passed as its bytes, uint8), whose
    gathered blocks are dequantized to fp32."""
    b, num_heads, head_dim = q.shape
    kvh = k_cache.shape[0]
    ks = k_cache.view(kvh, -1, block_size, head_dim)[:, g.blocks].view(kvh, b, -1, head_dim)
    vs = v_cache.view(kvh, -1, block_size, head_dim)[:, g.blocks].view(kvh, b, -1, head_dim)
    if kv_scales is not None:
        ks = dequantize_fp8(ks, kv_scales[0], torch.float32)
        vs = dequantize_fp8(vs, kv_scales[1], torch.float32)
    qg = q.view(b, kvh, num_heads // kvh, head_dim).transpose(0, 1)  # [KVH, B, G, D]
    if qg.dtype != torch.float32:  # keep scores and the weighted sum in fp32, as fused kernels do
        qg, ks, vs = qg.float(), ks.float(), vs.float()
    scores = torch.matmul(qg, ks.transpose(-1, -2)) * scale  # [KVH, B, G, L]
    probs = torch.softmax(scores + g.mask, dim=-1)
    return torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)  # [B, KVH, G, D]


def _prefill_attention(q, k, v, start: int, scale: float) -> torch.Tensor:
    """Causal attention of ``n`` queries at positions ``start..start+n-1`` (q ``[n, H, D]``) over
    ``start+n`` keys (k, v ``[KVH, start+n, D]``). Inputs go in 4-D: with a batch dimension torch
    picks its fused (flash) CPU kernel, 3x faster than the 3-D math path at 512 tokens."""
    n = q.shape[0]
    qt, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]
    gqa = k.shape[0] != q.shape[1]
    if start == 0:
        o = F.scaled_dot_product_attention(qt, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]
        mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qt, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)
