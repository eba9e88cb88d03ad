"""CUDA graphs: whole decode steps per batch-size bucket, and prefill / mixed steps in pieces
per token-count bucket.

A decode step of a Llama-8B is ~500 kernel launches; launched one by one from Python they cost
more than the GPU time of a small batch. Each bucket's whole step (embedding, every layer, final
norm, LM head) is captured once into a graph that reads its inputs from static device buffers:

    host (pinned)                  device (static)                graph[b]
    ids / positions / slots  ───►  input_ids[:b] ...        ───►  forward + logits ──► logits[b]
    context lens / tables          context_lens[:b], tables[:b]

A step of ``n`` decodes replays the smallest bucket ``b >= n``; rows ``n..b`` are padding: slot
-1 (the KV write skips them), context length 1 over block 0 (read, never written). The host fills
pinned mirrors and queues non-blocking copies, so nothing in a step waits on the GPU. The pinned
mirrors are reused every step: before refilling them the host waits on an event recorded after
the last step's copies (with async scheduling the next step is prepared while one runs). A token
still pending from the step before (async scheduling) is written over ``input_ids`` on the
device after the copy (``fill``).

A step that carries a prefill chunk has metadata of a shape no graph can fix (chunks, their
lengths, the extend kernel's grid), so ``PiecewiseGraphs`` graphs everything but attention: per
token-count bucket ``T``, the forward is cut at each layer's attention into ``L + 1`` pieces
(``LlamaForCausalLM.first_piece`` / ``middle_piece`` / ``last_piece``), each one graph, and
attention runs eagerly between them on the step's real rows only::

    ids, positions ─► [embed, rotary state, layer 0 to q/k/v] ─► q k v ─► attention 0 (eager,
    writes KV, n real rows) ─► o ─► [layer 0 o_proj..MLP, layer 1 to q/k/v] ─► q k v ─► ...
    ─► attention L-1 ─► o ─► [layer L-1 o_proj..MLP, + residual] ─► hidden [T, hidden]

Rows ``n..T`` are padding: never written to the KV cache, never attended, and the dense pieces
are row-independent, so they cannot change a real row. The step's own logits are taken
eagerly from the sampled rows, as on the eager path.

Every graph of both kinds shares one memory pool. A graph's outputs are held *borrowed* (a view
that does not keep the memory allocated), so later captures reuse that memory: the pool holds
about one bucket's working set, not one per piece and bucket. That is sound because graphs of a
pool replay one at a time, on one stream, and each output is read before the next replay
(the q/k/v of piece i by attention i, the hidden states and logits by the step's own sampling).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, ChunkSpec
from engine.models.llama import StepContext

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (vLLM's spacing: padding wastes
    at most 7 rows, and a bucket costs only graph memory)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def piecewise_sizes(max_tokens: int) -> list[int]:
    """16, 32, every multiple of 64 up to 1024, then 8 buckets per doubling (1152, 1280, ...,
    2048, 2304, ...), up to ``max_tokens`` (always a bucket). Padding wastes at most 1/9 of a
    bucket above 512 rows; below that the dense layers are bound by reading the weights, so
    padded rows cost little."""
    sizes, n = [16, 32], 64
    while n < max_tokens:
        sizes.append(n)
        n += max(64, 1 << (n.bit_length() - 4))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


@dataclass
class GraphPool:
    """The memory pool and capture stream every graph of one runner shares."""

    handle: tuple = field(default_factory=torch.cuda.graph_pool_handle)
    stream: torch.cuda.Stream = field(default_factory=torch.cuda.Stream)


def borrowed(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep that memory allocated (what vLLM calls a weak
    reference tensor; torch's own graph trees rebuild their outputs the same way). Valid while
    the graph that wrote it is the last one of its pool to have replayed."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(weak, t.storage_offset(), t.size(), t.stride())


def pinned_mirror(device: torch.device, dtype: torch.dtype, *shape: int) -> tuple:
    """A graph's static input: (pinned host tensor, its numpy view, the device tensor the graph
    reads). The host fills the numpy view and queues a non-blocking copy."""
    host = torch.zeros(shape, dtype=dtype, pin_memory=True)
    return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)


def device_memory_in_use(device: torch.device) -> int:
    """Bytes in use on the device: live tensors, graph pools and graphs' own memory (the
    default pool's cached free blocks, e.g. left by warm-ups, are released first)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend,
        kv_caches,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        pool: GraphPool | None = None,
    ):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.pool = pool or GraphPool()
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        width = -(-max_model_len // block_size)
        device = kv_caches[0].device
        b = self.max_batch
        self._ids = pinned_mirror(device, torch.int64, b)
        self._positions = pinned_mirror(device, torch.int64, b)
        self._slots = pinned_mirror(device, torch.int64, b)
        self._lens = pinned_mirror(device, torch.int32, b)
        self._tables = pinned_mirror(device, torch.int32, b, width)
        self._copied = torch.cuda.Event()  # the last step's input copies have left the mirrors
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
        device = self.kv_caches[0].device
        used = device_memory_in_use(device)
        self._slots[2].fill_(-1)  # warm-up and capture write no KV
        self._lens[2].fill_(1)
        # Largest first: the smaller graphs reuse its pool memory.
        for b in sorted(sizes or self.sizes, reverse=True):
            self._forward(b)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool.handle, stream=self.pool.stream):
                logits = self._forward(b)
            self._logits[b] = borrowed(logits)  # the sampler reads it before any other replay
            self._graphs[b] = graph
            del logits
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = device_memory_in_use(device) - used
        logger.info(
            "captured %d decode graphs (batch 1..%d) in %.1f s, %.0f MiB",
            len(sizes or self.sizes),
            self.max_batch,
            self.capture_s,
            self.memory_bytes / 2**20,
        )

    def release(self) -> None:
        """Destroy the captured graphs now (before the NCCL communicator their all-reduces
        captured: NCCL tears a communicator down only once no graph holds its work)."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._logits.clear()

    def fits(self, chunks: list[ChunkSpec]) -> bool:
        return len(chunks) <= self.max_batch and all(c.num_tokens == 1 for c in chunks)

    def run(
        self,
        chunks: list[ChunkSpec],
        input_ids: list[int],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` (fp32) of a decode-only step; ``fill``: (rows, token
        ids) written over ``input_ids`` on the device."""
        n = len(chunks)
        b = next(s for s in self.sizes if s >= n)
        ids, positions, slots, lens, tables = (
            buf[1] for buf in (self._ids, self._positions, self._slots, self._lens, self._tables)
        )
        self._copied.synchronize()  # the mirrors may still be read by the last step's copies
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
        self._copied.record()
        if fill is not None:
            self._ids[2].index_copy_(0, *fill)
        self._graphs[b].replay()
        return self._logits[b][:n]


@dataclass
class _Bucket:
    """One token-count bucket's pieces: graph ``i`` ends at layer ``i``'s q, k, v (``qkv[i]``)
    and residual stream (``residual[i]``); the last one ends at the hidden states."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    residual: list[torch.Tensor] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class PiecewiseGraphs:
    """Steps of up to ``max_tokens`` tokens (any mix of prefill chunks and decodes) with the
    dense layers replayed from per-bucket graphs and attention launched eagerly between them
    (module docstring)."""

    def __init__(self, model, backend, kv_caches, max_tokens: int, pool: GraphPool | None = None):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.pool = pool or GraphPool()
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        device = kv_caches[0].device
        cfg = model.cfg
        t = self.max_tokens
        self._ids = pinned_mirror(device, torch.int64, t)
        self._positions = pinned_mirror(device, torch.int64, t)
        self._copied = torch.cuda.Event()  # the last step's input copies have left the mirrors
        dtype = model.embed_tokens.weight.dtype
        heads = model.layout.num_heads  # this rank's (all of them on one device)
        self._o = torch.zeros(t, heads * cfg.head_dim, dtype=dtype, device=device)
        self._buckets: dict[int, _Bucket] = {}

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def release(self) -> None:
        """Destroy the captured pieces now (as ``DecodeGraphs.release``)."""
        for bucket in self._buckets.values():
            for graph in bucket.graphs:
                graph.reset()
        self._buckets.clear()

    # -- capture ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture every bucket (or only ``sizes``, e.g. again after a kernel switch)."""
        t0 = time.perf_counter()
        device = self.kv_caches[0].device
        used = device_memory_in_use(device)
        sizes = sorted(sizes or self.sizes, reverse=True)  # largest first, as the decode graphs
        for t in sizes:
            self._warm_up(t)
            self._buckets[t] = self._capture_bucket(t)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = device_memory_in_use(device) - used
        num = sum(len(self._buckets[t].graphs) for t in sizes)
        logger.info(
            "captured %d piecewise graphs (%d token buckets 16..%d, %d pieces each) in %.1f s, "
            "%.0f MiB",
            num,
            len(sizes),
            self.max_tokens,
            len(self.model.layers) + 1,
            self.capture_s,
            self.memory_bytes / 2**20,
        )

    def _warm_up(self, t: int) -> None:
        """Each kind of piece once at this size, outside capture: Triton compiles and cuBLAS
        sets up here, not in a graph."""
        model, o = self.model, self._o[:t]
        step = StepContext(model.ops, None, None, None, model.rope_in_attention)
        *_, residual = model.first_piece(step, self._ids[2][:t], self._positions[2][:t])
        if len(model.layers) > 1:
            model.middle_piece(step, 1, o, residual)
        model.last_piece(step, o, residual)
        torch.cuda.synchronize()

    def _capture_bucket(self, t: int) -> _Bucket:
        """Capture the ``L + 1`` pieces of bucket ``t`` in order. Each piece's inputs stay
        allocated until the bucket is captured (``step`` holds the rotary state, ``residual``
        the residual stream); its q, k, v and the hidden states are kept borrowed."""
        model, o, bucket = self.model, self._o[:t], _Bucket()
        step = StepContext(model.ops, None, None, None, model.rope_in_attention)

        def piece(fn, *args):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.pool.stream):
                graph.capture_begin(self.pool.handle)
                try:
                    result = fn(step, *args)
                finally:
                    graph.capture_end()
            bucket.graphs.append(graph)
            return result

        q, k, v, residual = piece(model.first_piece, self._ids[2][:t], self._positions[2][:t])
        for i in range(1, len(model.layers) + 1):
            bucket.qkv.append((borrowed(q), borrowed(k), borrowed(v)))
            bucket.residual.append(borrowed(residual))
            del q, k, v  # their memory goes back to the pool for the next pieces
            if i == len(model.layers):
                break
            q, k, v, residual = piece(model.middle_piece, i, o, residual)
        bucket.hidden = borrowed(piece(model.last_piece, o, residual))
        return bucket

    # -- a step ----------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
        tap_rows: torch.Tensor | None = None,
        tap_layers: tuple[int, ...] = (),
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Hidden states ``[n, hidden]`` of the step's ``n`` tokens, as ``model.forward``
        returns them, and ``{layer: its output at tap_rows}`` for ``tap_layers`` (a copy each).
        ``layer_hook(i)`` is called once attention ``i`` has queued its KV writes; ``fill``:
        (rows, token ids) written over ``input_ids`` on the device. The hidden states are valid
        until the next replay of any graph of the pool."""
        n = len(input_ids)
        t = next(s for s in self.sizes if s >= n)
        bucket = self._buckets[t]
        self._copied.synchronize()  # the mirrors may still be read by the last step's copies
        for (host, mirror, device), values in (
            (self._ids, input_ids),
            (self._positions, positions),
        ):
            mirror[:n] = values
            mirror[n:t] = 0  # padding rows: token 0 at position 0
            device[:t].copy_(host[:t], non_blocking=True)
        self._copied.record()
        if fill is not None:
            self._ids[2].index_copy_(0, *fill)
        model = self.model
        rope = None
        if model.rope_in_attention:  # the eager attention rotates q, k: the step's positions
            rope = model.ops.rope_state(model.rotary, self._positions[2][:n], self._o.dtype)
        step = StepContext(model.ops, rope, meta, self.backend, model.rope_in_attention)
        o = self._o[:n]
        taps: dict[int, torch.Tensor] = {}
        layers = self.model.layers
        for i, (layer, kv_cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            bucket.graphs[i].replay()
            if i - 1 in tap_layers:  # piece i folded layer i-1's output into the residual
                taps[i - 1] = bucket.residual[i][tap_rows]
            q, k, v = bucket.qkv[i]
            layer.self_attn.attend(step, q[:n], k[:n], v[:n], kv_cache, out=o)
            if layer_hook is not None:
                layer_hook(i)
        bucket.graphs[-1].replay()
        hidden = bucket.hidden[:n]
        if len(layers) - 1 in tap_layers:
            taps[len(layers) - 1] = hidden[tap_rows]
        return hidden, taps
