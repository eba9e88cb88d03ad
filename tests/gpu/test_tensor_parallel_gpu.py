"""Tensor parallelism over NCCL (run on a machine with 2 GPUs; skipped with fewer).

    python -m pytest -q tests/gpu/test_tensor_parallel_gpu.py

A random tiny Llama (8 heads, 2 KV heads: one per rank) split over 2 GPUs, fp32: greedy tokens
equal transformers' on one GPU, with the CUDA graphs on (whole decode steps and the piecewise
graphs around attention capture the all-reduces and the logits' all-gather) and off, and with
async scheduling (a pending token's id broadcast from rank 0 inside the step). In bf16 at TP 2
and 4 (4 GPUs), greedy answers stay as close to the exact (fp32) ones as TP 1's bf16 answers do.
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


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each answer's tokens before the first that differs."""
    shares = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        shares.append(n / len(x))
    return sum(shares) / len(shares)


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_greedy_under_tp_is_as_close_to_exact_as_tp1(tmp_path_factory, tp):
    """bf16 under TP: greedy as close to TP 1 as bf16's own rounding allows (issue 29). The
    exact answer is TP 1 in fp32 on the same GPU; bf16 at TP 1 already leaves it at near-ties
    (the floor: the share of each answer before its first differing token). TP ``tp`` rounds
    differently again (each rank's partial sums in bf16, then the all-reduce) and must stay
    about as close: on CPU the same model gives 0.73 at TP 1 and 0.71 at TP 2, where TP 2
    against TP 1 is 0.78; on 4 x H100, 0.602 at TP 1, 0.601 at TP 2, 0.598 at TP 4. Larger initial weights than the fp32 tests' keep the logits apart."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    from engine import LLM, SamplingParams

    _, path = save_tiny_model(
        tmp_path_factory, f"tp-bf16-{tp}", **TP_GPU_TINY, initializer_range=0.1
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(511) for _ in range(rng.randrange(4, 200))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def run(size: int, dtype: str) -> list[list[int]]:
        with LLM(
            str(path),
            dtype=dtype,
            device="cuda",
            tensor_parallel_size=size,
            max_num_seqs=32,
            gpu_memory_utilization=0.3,
        ) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    exact = run(1, "float32")
    tp1 = run(1, "bfloat16")
    tpn = run(tp, "bfloat16")
    floor, got = _agreement(tp1, exact), _agreement(tpn, exact)
    print(f"\nbf16 against fp32: TP 1 {floor:.3f}, TP {tp} {got:.3f} (TP {tp} against TP 1:"
          f" {_agreement(tpn, tp1):.3f})")  # fmt: skip
    assert floor > 0.3, floor  # not all ties: the comparison means something
    assert got >= floor - 0.1, (got, floor)
