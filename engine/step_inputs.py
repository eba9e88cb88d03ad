"""One step's inputs as the model runner prepares them, and how rank 0 of a tensor-parallel
worker hands them (and the other things the ranks do in lockstep) to the other ranks.

Rank 0 owns the scheduler; the other ranks own only their model shard and KV pool, so each step
they receive exactly what the forward pass needs, as int64 host tensors on the group's gloo
``cpu`` group (no pickle, no socket of ours)::

    header [9]  op, tokens, chunks, table entries, sampled rows, pending rows, captured rows,
                whole-graph flag, gathered slots                    (op STOP: the rank exits)
    payload     input ids | chunk starts | chunk lengths | block-table lengths | block tables |
                sampled rows | pending rows | pending sources | gathered slots

Gathered slots (a prefill worker streaming KV): after each layer every rank sends its heads of
those KV slots to rank 0 on the ``device`` group, and rank 0 hands every head to the layer hook
(``GatheredLayerHook``), so a tensor-parallel worker streams layer by layer as one device does.

Positions follow from the chunks (each chunk's ``start`` onwards). A token still pending from the
step before (async scheduling) is not on the host yet: rank 0 broadcasts those token ids from
its device on the ``device`` group inside the step (ModelRunner).

Between steps rank 0 may read or write every KV head of some blocks (``KVBlocksOp``: P/D
transfer, migration and the KV tiers need the whole model's KV, each rank holds its heads)::

    header [9]  op (KV_READ or KV_WRITE), blocks, first layer, layer past the last, 0 ...
    payload     block ids

then the KV itself on the ``device`` group: a gather to rank 0 (read) or a scatter from it
(write), ModelRunner.read_kv_blocks / write_kv_blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from engine.attention import ChunkSpec
from engine.parallel import TPGroup

OP_STOP, OP_STEP, OP_KV_READ, OP_KV_WRITE = 0, 1, 2, 3
_HEADER = 9


@dataclass
class StepInputs:
    """What every rank runs for one step (rank 0 also samples the ``sample_rows``)."""

    specs: list[ChunkSpec]
    input_ids: list[int]  # a pending token's row holds 0 until filled on the device
    sample_rows: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    # each pending row's place in the sampled tokens of the step launched before
    pending_sources: list[int] = field(default_factory=list)
    # rank 0 only: rows whose hidden states are kept (prompts' last tokens); other ranks run
    # the same pieces without keeping them
    num_captured: int = 0
    whole_graph: bool = True  # no layer hook and no capture: a decode graph may run the step
    # KV slots whose every head rank 0's layer hook gets after each layer (GatheredLayerHook)
    gather_slots: list[int] = field(default_factory=list)

    @property
    def positions(self) -> list[int]:
        return [p for s in self.specs for p in range(s.start, s.start + s.num_tokens)]


def send_step(tp: TPGroup, inputs: StepInputs) -> None:
    """Rank 0: hand ``inputs`` to the other ranks (before running it itself)."""
    tables = [b for s in inputs.specs for b in s.block_table]
    header = [
        OP_STEP,
        len(inputs.input_ids),
        len(inputs.specs),
        len(tables),
        len(inputs.sample_rows),
        len(inputs.pending_rows),
        inputs.num_captured,
        int(inputs.whole_graph),
        len(inputs.gather_slots),
    ]
    tp.broadcast_cpu(torch.tensor(header, dtype=torch.int64))
    payload = [
        *inputs.input_ids,
        *(s.start for s in inputs.specs),
        *(s.num_tokens for s in inputs.specs),
        *(len(s.block_table) for s in inputs.specs),
        *tables,
        *inputs.sample_rows,
        *inputs.pending_rows,
        *inputs.pending_sources,
        *inputs.gather_slots,
    ]
    tp.broadcast_cpu(torch.tensor(payload, dtype=torch.int64))


@dataclass
class GatheredLayerHook:
    """A layer hook that wants every KV head of some slots after each layer (a prefill
    worker's streamer at any tensor-parallel size): ``on_layer(i, kv)`` once layer ``i`` has
    written its KV, ``kv`` ``[2, num_kv_heads, len(slots), head_dim]`` in the pool's dtype, its
    own tensor (queued on the current stream). One device gathers from its pool; under tensor
    parallelism every rank gathers its heads to rank 0 (``StepInputs.gather_slots``)."""

    slots: np.ndarray  # int64 KV slots, in the order of kv's columns
    on_layer: Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class KVBlocksOp:
    """Every rank reads (``write`` False: its part goes to rank 0) or writes (its part comes
    from rank 0) its KV heads of ``blocks``, layers ``layers``."""

    write: bool
    blocks: list[int]
    layers: range


def send_kv_op(tp: TPGroup, op: KVBlocksOp) -> None:
    """Rank 0: announce ``op`` to the other ranks (its KV follows on the device group)."""
    code = OP_KV_WRITE if op.write else OP_KV_READ
    header = [code, len(op.blocks), op.layers.start, op.layers.stop] + [0] * (_HEADER - 4)
    tp.broadcast_cpu(torch.tensor(header, dtype=torch.int64))
    tp.broadcast_cpu(torch.tensor(op.blocks, dtype=torch.int64))


def send_stop(tp: TPGroup) -> None:
    tp.broadcast_cpu(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))


def receive(tp: TPGroup) -> StepInputs | KVBlocksOp | None:
    """Another rank: what rank 0 sends next (waits for it without bound), None on stop."""
    header = tp.broadcast_cpu(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    op = header[0]
    if op == OP_STOP:
        return None
    if op in (OP_KV_READ, OP_KV_WRITE):
        _, n_blocks, first, stop = header[:4]
        blocks = tp.broadcast_cpu(torch.zeros(n_blocks, dtype=torch.int64)).tolist()
        return KVBlocksOp(op == OP_KV_WRITE, blocks, range(first, stop))
    if op != OP_STEP:
        raise RuntimeError(f"unknown op {op} from rank 0 (header {header})")
    _, n_ids, n_specs, n_table, n_sample, n_pending, n_captured, whole, n_gather = header
    sizes = [n_ids, n_specs, n_specs, n_specs, n_table, n_sample, n_pending, n_pending, n_gather]
    payload = tp.broadcast_cpu(torch.zeros(sum(sizes), dtype=torch.int64)).tolist()
    ends = list(accumulate(sizes))
    ids, starts, lens, table_lens, tables, sample, pending, sources, gather = (
        payload[end - size : end] for size, end in zip(sizes, ends, strict=True)
    )
    bounds = [0, *accumulate(table_lens)]
    specs = [
        ChunkSpec(start, n, tables[bounds[i] : bounds[i + 1]])
        for i, (start, n) in enumerate(zip(starts, lens, strict=True))
    ]
    return StepInputs(specs, ids, sample, pending, sources, n_captured, bool(whole), gather)
