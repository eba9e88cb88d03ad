"""Tensor parallelism over NCCL (run on a machine with 2 GPUs; skipped with fewer).

    python -m pytest -q tests/gpu/test_tensor_parallel_gpu.py

A random tiny Llama (8 heads, 2 KV heads: one per rank) split over 2 GPUs, fp32: greedy tokens
equal transformers' on one GPU, with the CUDA graphs on (whole decode steps and the piecewise
graphs around attention capture the all-reduces and the logits' all-gather) and off, and with
async scheduling (a pending token's id broadcast from rank 0 inside the step).
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import TP_GPU_TINY, save_tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, path = save_tiny_model(tmp_path_factory, "tp-gpu", **TP_GPU_TINY)
    rng = random.Random(1)
    prompts = [[rng.randrange(511) for _ in range(n)] for n in (1, 7, 33, 100, 257)]
    return model, path, prompts


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_fp32_greedy_equals_transformers(tiny, hf_greedy, eager):
    from engine import LLM, SamplingParams

    model, path, prompts = tiny
    hf = model.to(device="cuda", dtype=torch.float32)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    with LLM(
        str(path),
        dtype="float32",
        device="cuda",
        tensor_parallel_size=2,
        enforce_eager=eager,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
    ) as llm:
        assert llm.engine.cfg.async_scheduling
        assert (llm.engine.runner.graphs is None) == eager
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.runner.kv_caches[0].shape[1] == 1  # rank 0's one KV head
