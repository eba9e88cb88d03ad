"""One step's inputs as the model runner prepares them, and how rank 0 of a tensor-parallel
worker hands them to the other ranks.

Rank 0 owns the scheduler; the other ranks own only their model shard and KV pool, so each step
they receive exactly what the forward pass needs, as int64 host tensors on the group's gloo
``cpu`` group (no pickle, no socket of ours)::

    header [8]  op, tokens, chunks, table entries, sampled rows, pending rows, captured rows,
                whole-graph flag                                    (op STOP: the rank exits)
    payload     input ids | chunk starts | chunk lengths | block-table lengths | block tables |
                sampled rows | pending rows | pending sources

Positions follow from the chunks (each chunk's ``start`` onwards). A token still pending from the
step before (async scheduling) is not on the host yet: rank 0 broadcasts those token ids from
its device on the ``device`` group inside the step (ModelRunner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from engine.attention import ChunkSpec
from engine.parallel import TPGroup

OP_STOP, OP_STEP = 0, 1
_HEADER = 8


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
    ]
    tp.broadcast_cpu(torch.tensor(payload, dtype=torch.int64))


def send_stop(tp: TPGroup) -> None:
    tp.broadcast_cpu(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))


def receive_step(tp: TPGroup) -> StepInputs | None:
    """Another rank: the next step rank 0 sends (waits for it without bound), None on stop."""
    header = tp.broadcast_cpu(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    op, n_ids, n_specs, n_table, n_sample, n_pending, n_captured, whole = header
    if op == OP_STOP:
        return None
    sizes = [n_ids, n_specs, n_specs, n_specs, n_table, n_sample, n_pending, n_pending]
    payload = tp.broadcast_cpu(torch.zeros(sum(sizes), dtype=torch.int64)).tolist()
    ends = list(accumulate(sizes))
    ids, starts, lens, table_lens, tables, sample, pending, sources = (
        payload[end - size : end] for size, end in zip(sizes, ends, strict=True)
    )
    bounds = [0, *accumulate(table_lens)]
    specs = [
        ChunkSpec(start, n, tables[bounds[i] : bounds[i + 1]])
        for i, (start, n) in enumerate(zip(starts, lens, strict=True))
    ]
    return StepInputs(specs, ids, sample, pending, sources, n_captured, bool(whole))
