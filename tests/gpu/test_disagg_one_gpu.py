"""Prefill and decode workers sharing one GPU (TCP KV): the prefill worker's prompt chunks
replay the piecewise CUDA graphs with its per-layer KV sends called between the pieces, and
greedy tokens equal a colocated worker's (bf16: one request at a time, so both paths run the
same batch shapes)."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ray = pytest.importorskip("ray")

ENGINE = {"dtype": "bfloat16", "max_num_batched_tokens": 64, "num_kv_blocks": 512}


def run(path, prompts, **cluster):
    from cluster.launch.local import LocalCluster
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LocalCluster(model=str(path), device="cuda", engine=ENGINE, **cluster) as c:
        outs = [c.generate([p], params)[0] for p in prompts]
        return [o.outputs[0].token_ids for o in outs], c.stats(), c.check_idle()


def test_disaggregated_on_one_gpu_matches_colocated(tmp_path_factory) -> None:
    path = save_tiny(tmp_path_factory, "tiny-one-gpu", **GPU_TINY)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 17, 130, 300)]
    coloc, _, _ = run(path, prompts, num_prefill=0, num_decode=0, num_colocated=1)
    half = {"prefill": 0.5, "decode": 0.5}
    disagg, stats, idle = run(
        path, prompts, num_prefill=1, num_decode=1, transport="tcp", gpus=half
    )
    assert all(v is None for v in idle.values()), idle
    assert disagg == coloc
    by_role = {s["role"]: s for s in stats}
    assert by_role["decode"]["kv_bytes_received"] == by_role["prefill"]["kv_bytes_sent"] > 0
