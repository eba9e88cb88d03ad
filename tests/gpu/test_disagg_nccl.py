"""Disaggregated serving over NCCL on two GPUs (run on the GPU machine; skipped otherwise).

    python -m pytest -q tests/gpu/test_disagg_nccl.py      # needs 2 GPUs, Ray, cupy

A random tiny Llama (transformers-built, bf16 on GPU): greedy tokens through 1 prefill + 1 decode
worker, with the KV streamed layer by layer over a cupy NCCL communicator, must equal one colocated
worker's on the same GPU kind, for prompts shorter and longer than the chunk budget, with prefix
hits on the prefill side (each request alone, so both paths see the same batch shapes); every worker ends idle with exact block accounting.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

ray = pytest.importorskip("ray")
pytest.importorskip("cupy")
transformers = pytest.importorskip("transformers")

ENGINE = {
    "dtype": "bfloat16",
    "max_num_batched_tokens": 128,
    "num_kv_blocks": 512,
    "max_num_seqs": 16,
    "cuda_graph_max_batch": 8,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory, "tiny-nccl", **GPU_TINY)
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 17, 130, 300)]
    prompts.append(prompts[-1][:200] + [5, 6, 7])  # shares whole blocks with the one before
    return path, prompts


def run(path, prompts, **cluster):
    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LocalCluster(model=str(path), device="cuda", engine=ENGINE, **cluster) as c:
        # One at a time: the same batch shapes on both paths, so bf16 results are bitwise equal
        # (the last prompt runs after its prefix is cached).
        outs = [c.generate([p], params)[0] for p in prompts]
        stats = c.stats()
        idle = c.check_idle()
    return [o.outputs[0].token_ids for o in outs], stats, idle


def test_nccl_disaggregated_matches_colocated(tiny) -> None:
    path, prompts = tiny
    coloc, _, idle = run(path, prompts, num_prefill=0, num_decode=0, num_colocated=1)
    assert all(v is None for v in idle.values()), idle
    disagg, stats, idle = run(path, prompts, num_prefill=1, num_decode=1, transport="nccl")
    assert all(v is None for v in idle.values()), idle
    assert disagg == coloc
    by_role = {s["role"]: s for s in stats}
    assert by_role["decode"]["kv_bytes_received"] == by_role["prefill"]["kv_bytes_sent"] > 0
    assert by_role["prefill"]["prefix_hit_tokens"] >= 192


def test_nccl_abort_mid_transfer_frees_both_sides(tmp_path_factory) -> None:
    """A long prompt in small chunks keeps its transfer open for many steps; aborting it there
    must release the receiver's side only after its queued NCCL writes (no late write into a
    reused block) and leave both workers idle with exact accounting; the pair works after."""
    import asyncio
    import time

    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    path = save_tiny(tmp_path_factory, "tiny-nccl-abort", **GPU_TINY, max_position_embeddings=8192)
    engine = {**ENGINE, "max_num_batched_tokens": 32, "num_kv_blocks": 1024}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LocalCluster(
        model=str(path), device="cuda", engine=engine, num_prefill=1, num_decode=1, transport="nccl"
    ) as c:
        d = c.decode[0].handle

        async def scenario():
            agen = c.stream(list(range(1, 500)) * 8, params, request_id="long")
            task = asyncio.ensure_future(agen.__anext__())
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                s = await d.stats.remote()
                if s["transfers_pending"] == 1 and s["kv_bytes_received"] > 0:
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("never saw the transfer in flight")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await agen.aclose()

        asyncio.run(scenario())
        deadline = time.monotonic() + 30
        while any(v is not None for v in c.check_idle().values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(v is None for v in c.check_idle().values()), c.check_idle()
        out = c.generate([[1, 2, 3] * 50], params)[0]
        assert len(out.outputs[0].token_ids) == 8
