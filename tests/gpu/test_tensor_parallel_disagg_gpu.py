"""Prefill and decode workers of different tensor-parallel sizes over NCCL (run on a machine
with 3 or 4 GPUs; each layout is skipped when the GPUs are fewer than its ranks):

    python -m pytest -q tests/gpu/test_tensor_parallel_disagg_gpu.py

A random tiny Llama (8 heads, 2 KV heads: one per rank at TP 2), fp32 on the GPUs, through
`LocalCluster` (Ray placement groups, NCCL between ranks and between the workers): greedy tokens
equal transformers', for prompts shorter and longer than the chunk budget and a prefix hit on
the prefill side; every worker ends idle with exact block accounting, and the KV bytes the
decode worker received are the ones the prefill worker sent.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import TP_GPU_TINY, save_tiny_model

ray = pytest.importorskip("ray")
pytest.importorskip("cupy")
transformers = pytest.importorskip("transformers")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ENGINE = {
    "dtype": "float32",
    "max_num_batched_tokens": 64,
    "num_kv_blocks": 256,
    "max_num_seqs": 8,
    "cuda_graph_max_batch": 8,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_greedy):
    model, path = save_tiny_model(tmp_path_factory, "tp-pd-gpu", **TP_GPU_TINY)
    rng = random.Random(4)
    prompts = [[rng.randrange(511) for _ in range(n)] for n in (3, 40, 150)]
    prompts.append(prompts[-1][:128] + [9, 8, 7])  # whole blocks cached on the prefill side
    model = model.to(device="cuda", dtype=torch.float32)
    return path, prompts, [hf_greedy(model, p, 16) for p in prompts]


@pytest.mark.parametrize("ptp, dtp", [(2, 1), (1, 2), (2, 2)], ids=["p2-d1", "p1-d2", "p2-d2"])
def test_prefill_and_decode_at_different_tp_over_nccl(tiny, ptp, dtp):
    if ptp + dtp > GPUS:
        pytest.skip(f"needs {ptp + dtp} GPUs, {GPUS} here")
    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    path, prompts, expected = tiny
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LocalCluster(
        model=path,
        device="cuda",
        num_prefill=1,
        num_decode=1,
        transport="nccl",
        engine=ENGINE,
        prefill_engine={"tensor_parallel_size": ptp},
        decode_engine={"tensor_parallel_size": dtp},
    ) as c:
        got = [c.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        stats = {s["role"]: s for s in c.stats()}
        idle = c.check_idle()
    assert all(v is None for v in idle.values()), idle
    assert got == expected
    assert stats["decode"]["kv_bytes_received"] == stats["prefill"]["kv_bytes_sent"] > 0
    assert stats["prefill"]["prefix_hit_tokens"] >= 128
