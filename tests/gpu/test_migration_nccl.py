"""Live migration over NCCL between two decode workers on two GPUs (run on the GPU machine;
skipped otherwise).

    python -m pytest -q tests/gpu/test_migration_nccl.py      # needs 2 GPUs, Ray, cupy

A random tiny Llama (bf16). Three workers on two GPUs: the prefill worker shares one with a
decode worker ("peer"; NCCL cannot join two ranks on one GPU, so that pair is never used) and
every request starts on the other ("home"). A greedy request migrated home -> peer -> home
mid-stream must give the tokens of the same request unmigrated (each alone, both after the
prompt is in the prefill worker's prefix cache, so both see the same kernels); every worker ends
idle with exact block accounting, and the copies went over NCCL.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

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
MIGRATION = {"last_stage_blocks": 4}  # (a tiny model decodes ~1 token a ms: few stages)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(
        tmp_path_factory, "tiny-migrate-nccl", **GPU_TINY, max_position_embeddings=2048
    )


def test_nccl_migration_there_and_back_is_exact(tiny) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpu_migration import form_pairs, home_and_peer, stream_moving
    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    prompt = [random.Random(5).randrange(512) for _ in range(200)]
    # long enough to outlast two migrations at this model's ~1 ms per step
    params = SamplingParams(temperature=0.0, max_tokens=1200, ignore_eos=True)
    with LocalCluster(
        model=str(tiny),
        num_prefill=1,
        num_decode=2,
        device="cuda",
        engine=ENGINE,
        gpus={"prefill": 0.5, "decode": 0.5},
        migration=MIGRATION,
    ) as c:
        home, peer = home_and_peer(c, "cuda")

        async def main():
            warm = await form_pairs(c, prompt, params, home, peer)  # (and the prefix cache)
            assert [r.outcome for r in warm] == ["migrated", "migrated"], warm
            ref, _ = await stream_moving(c, prompt, params, "ref", home, [])
            got, results = await stream_moving(
                c, prompt, params, "mig", home, [(100, peer), (400, home)]
            )
            return ref, got, results

        ref, got, results = asyncio.run(main())
        stats = {s["name"]: s for s in c.stats()}
        idle = c.check_idle()
    assert [r.outcome for r in results] == ["migrated", "migrated"], results
    assert got == ref and len(got) == 1200
    assert all(v is None for v in idle.values()), idle
    assert stats[home]["migrations"]["out"]["migrated"] >= 2
    assert stats[peer]["migrations"]["in"]["admitted"] >= 2
    assert stats[home]["kv_bytes_sent"] > 0  # the copy left home over its NCCL pair channel
