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
def tiny(tmp_path_factory, tiny_cfg):
    torch.manual_seed(0)
    cfg = tiny_cfg(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_hidden_layers=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("tiny-nccl")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 17, 130, 300)]
    prompts.append(prompts[-1][:200] + [5, 6, 7])  # shares whole blocks with the one before
    return path, prompts


def run(path, prompts, **cluster):
    from cluster.local import LocalCluster
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
