"""CUDA graphs of decode steps, one per batch-size bucket.

A decode step of a Llama-8B is ~500 kernel launches; launched one by one from Python they cost
more than the GPU time of a small batch. Each bucket's whole step (embedding, every layer, final
norm, LM head) is captured once into a graph that reads its inputs from static device buffers:

    host (pinned)                  device (static)                graph[b]
    ids / positions / slots  ───►  input_ids[:b] ...        ───►  forward + logits ──► logits[b]
    context lens / tables          context_lens[:b], tables[:b]

A step of ``n`` decodes replays the smallest bucket ``b >= n``; rows ``n..b`` are padding: slot
-1 (the KV write skips them), context length 1 over block 0 (read, never written). The host fills
pinned mirrors and queues non-blocking copies, so nothing in a step waits on the GPU until the
sampler reads the tokens back. The pinned mirrors are reused every step: safe because each
step ends in that read-back, after which the previous step's copies have completed.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata, ChunkSpec

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (vLLM's spacing: padding wastes
    at most 7 rows, and a bucket costs only graph memory)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, backend, kv_caches, block_size: int, max_model_len: int, max_batch):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        width = -(-max_model_len // block_size)
        device = kv_caches[0].device
        b = self.max_batch

        def buffers(dtype, *shape):
            host = torch.zeros(shape, dtype=dtype, pin_memory=True)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self._ids = buffers(torch.int64, b)
        self._positions = buffers(torch.int64, b)
        self._slots = buffers(torch.int64, b)
        self._lens = buffers(torch.int32, b)
        self._tables = buffers(torch.int32, b, width)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            block_size=self.block_size,
            num_tokens=b,
            slot_mapping=self._slots[2][:b],
            num_decodes=b,
            decode_groups=[],
            prefills=[],
            decode_block_tables=self._tables[2][:b],
            decode_context_lens=self._lens[2][:b],
        )
        ids, positions = self._ids[2][:b], self._positions[2][:b]
        hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture every bucket (or only ``sizes``, e.g. to re-capture after a layer swap)."""
        t0 = time.perf_counter()
        self._slots[2].fill_(-1)  # warm-up and capture write no KV
        self._lens[2].fill_(1)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse its pool memory.
        for b in sorted(sizes or self.sizes, reverse=True):
            self._forward(b)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch 1..%d) in %.1f s",
            len(self.sizes),
            self.max_batch,
            time.perf_counter() - t0,
        )

    def fits(self, chunks: list[ChunkSpec]) -> bool:
        return len(chunks) <= self.max_batch and all(c.num_tokens == 1 for c in chunks)

    def run(self, chunks: list[ChunkSpec], input_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` (fp32) of a decode-only step."""
        n = len(chunks)
        b = next(s for s in self.sizes if s >= n)
        ids, positions, slots, lens, tables = (
            buf[1] for buf in (self._ids, self._positions, self._slots, self._lens, self._tables)
        )
        bs = self.block_size
        ids[:n] = input_ids
        for row, c in enumerate(chunks):
            used = c.start // bs + 1
            tables[row, :used] = c.block_table[:used]
            positions[row] = c.start
            slots[row] = c.block_table[c.start // bs] * bs + c.start % bs
            lens[row] = c.start + 1
        ids[n:b], positions[n:b], slots[n:b], lens[n:b] = 0, 0, -1, 1
        tables[n:b, 0] = 0
        for host, _, device in (self._ids, self._positions, self._slots, self._lens):
            device[:b].copy_(host[:b], non_blocking=True)
        self._tables[2][:b].copy_(self._tables[0][:b], non_blocking=True)
        self._graphs[b].replay()
        return self._logits[b][:n]
