"""Live migration between decode workers of different tensor-parallel sizes over NCCL (a
machine with 4 GPUs; skipped with fewer):

    python -m pytest -q tests/gpu/test_tensor_parallel_migration_gpu.py

One prefill worker (TP 1), a decode worker at TP 2 (`LocalCluster`'s `decode_engine`) and one
at TP 1 added beside it by a scale with its own engine settings (`tandem scale --engine
tensor_parallel_size=1`): four GPUs, one per rank. A random tiny Llama (8 heads, 2 KV heads)
in fp32. A greedy request starts on the TP-2 worker, moves to the TP-1 worker and back mid-
stream (the TP-2 worker's ranks gather its KV; the TP-1 worker's pool goes to the TP-2 worker's
staging buffer and its ranks); its tokens equal transformers', every worker ends idle.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch
from hf_oracle import TP_GPU_TINY, save_tiny_model

ray = pytest.importorskip("ray")
pytest.importorskip("cupy")
transformers = pytest.importorskip("transformers")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA GPUs, {GPUS} here")

ENGINE = {
    "dtype": "float32",
    "max_num_batched_tokens": 64,
    "num_kv_blocks": 512,
    "max_num_seqs": 8,
    "cuda_graph_max_batch": 8,
}
MAX_TOKENS = 1200  # (a tiny model decodes ~1 token a ms: long enough for two moves)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_greedy):
    model, path = save_tiny_model(
        tmp_path_factory, "tp-migrate-gpu", **TP_GPU_TINY, max_position_embeddings=2048
    )
    prompt = [random.Random(6).randrange(511) for _ in range(40)]
    model = model.to(device="cuda", dtype=torch.float32)
    return path, prompt, hf_greedy(model, prompt, MAX_TOKENS)


def test_migration_between_decode_workers_of_tp2_and_tp1_over_nccl(tiny):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpu_migration import form_pairs, stream_moving
    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    path, prompt, expected = tiny
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LocalCluster(
        model=path,
        device="cuda",
        num_prefill=1,
        num_decode=1,
        transport="nccl",
        engine=ENGINE,
        decode_engine={"tensor_parallel_size": 2},
    ) as c:
        scaled = ray.get(
            c.controller.scale.remote("decode", 2, wait=True, engine={"tensor_parallel_size": 1})
        )
        assert scaled["added"] == ["decode-1"] and not scaled["failed"], scaled
        c.refresh()
        tp2, tp1 = "decode-0", "decode-1"

        async def main():
            await form_pairs(c, prompt, params, tp2, tp1)
            return await stream_moving(c, prompt, params, "mig", tp2, [(100, tp1), (400, tp2)])

        got, results = asyncio.run(main())
        status = {w["name"]: w for w in ray.get(c.controller.status.remote())["workers"]}
        idle = c.check_idle()
    assert [len(status[n]["ranks"]) for n in (tp2, tp1)] == [2, 1], status
    assert [r.outcome for r in results] == ["migrated", "migrated"], results
    assert got == expected
    assert all(v is None for v in idle.values()), idle
