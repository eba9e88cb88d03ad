"""benchmarks/gpu_itl_batches.py's parts that run without a GPU: the settings it A/Bs switch
the engine's class-wide FP8 paths and switch them back; the floor counts the KV by its dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import gpu_itl_batches
from engine.quant import Fp8Linear


def test_each_setting_switches_its_path_and_default_switches_back():
    from kernels import fp8_gemv_mma

    try:
        gpu_itl_batches.apply("no-norm-quant")
        assert Fp8Linear.fuse_norm_quant == 0 and not fp8_gemv_mma.PDL_QUANTIZED_X
        gpu_itl_batches.apply("mma-pdl-quantized")
        assert Fp8Linear.fuse_norm_quant == 1 and fp8_gemv_mma.PDL_QUANTIZED_X
    finally:
        gpu_itl_batches.apply("default")
    assert Fp8Linear.fuse_norm_quant == 1 and not fp8_gemv_mma.PDL_QUANTIZED_X


@pytest.mark.parametrize(("kv_dtype", "elem"), [("auto", 2), ("fp8", 1)])
def test_the_floor_is_the_weights_read_and_the_batch_kv(kv_dtype, elem):
    import torch

    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 4)  # not read by a step (untied)
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    model.cfg = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=8)
    runner = SimpleNamespace(model=model, cfg=SimpleNamespace(kv_cache_dtype=kv_dtype))
    llm = SimpleNamespace(engine=SimpleNamespace(runner=runner))
    weights = 40 * 4  # the LM head's float32 weights
    kv = 3 * 100 * 2 * 2 * 3 * 8 * elem  # batch 3, 100 tokens, K and V of 2 layers
    assert gpu_itl_batches.floor_ms(llm, 3, 100, 1e6) == pytest.approx((weights + kv) / 1e3)
