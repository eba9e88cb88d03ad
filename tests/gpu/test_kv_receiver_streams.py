"""The KV receiver's scatter on its own stream while the caller's stream is busy.

A decode worker announces a transfer (``expect``) from its control thread while its engine keeps
the GPU a step or two ahead; the layers then land on a pair stream. The destination slots must
be on the device before the first scatter reads them, whatever is queued on the caller's stream
(found on 2 x H100, 2026-11-26: ``index_copy_(): index out of bounds`` in a decode worker under
async scheduling, the scatter reading slots whose upload still sat behind queued forwards).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16


def test_scatter_waits_for_slot_upload_not_for_callers_stream() -> None:
    from engine.kv_transfer.transport import KVReceiver, KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=BLOCK)
    num_blocks = 64
    shape = (2, spec.num_kv_heads, num_blocks * BLOCK, spec.head_dim)
    caches = [
        torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(spec.num_layers)
    ]
    rx = KVReceiver(spec, caches, BLOCK, lambda event: None)
    pair = torch.cuda.Stream()
    tokens = 40
    blocks = [63, 7, 30]  # not contiguous: every slot comes from the table
    for rep in range(20):
        torch.cuda._sleep(20_000_000)  # the caller's stream: ~10 ms of queued work
        tid = f"t{rep}"
        rx.expect(tid, blocks, tokens)
        with torch.cuda.stream(pair):  # the payload arrives on the pair stream (NCCL's recv)
            kv = torch.randn(
                2, spec.num_kv_heads, tokens, spec.head_dim, device="cuda", dtype=torch.bfloat16
            )
            rx.handle_layer(0, 0, [(tid, 0, tokens)], kv)
            rx.handle_layer(0, 1, [(tid, 0, tokens)], kv * 2)
        rx.cancel(tid)
        torch.cuda.synchronize()
        slots = torch.tensor(
            [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(tokens)], device="cuda"
        )
        assert torch.equal(caches[0].index_select(2, slots), kv), rep
        assert torch.equal(caches[1].index_select(2, slots), kv * 2), rep
        for c in caches:
            c.zero_()
