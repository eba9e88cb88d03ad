"""benchmarks/gpu_kernels.py's arithmetic that runs without a GPU: the union of overlapping
kernel intervals (the GPU's busy time inside a step) and the step's byte and FLOP floors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.gpu_kernels import Step, busy_union, linear_floor


def test_busy_union_counts_overlap_once_and_gaps_not_at_all():
    assert busy_union([]) == 0.0
    assert busy_union([(0.0, 2.0), (1.0, 3.0)]) == 3.0  # overlapping
    assert busy_union([(5.0, 6.0), (5.2, 5.7), (0.0, 1.0)]) == 2.0  # nested, unsorted
    assert busy_union([(0.0, 1.0), (1.0, 2.0), (4.0, 4.5)]) == 2.5  # touching, then a gap


def test_an_fp8_linear_floor_counts_one_byte_inputs():
    m, k, n, bw = 256, 4096, 4096, 1e12
    slow_math = 1e30  # bytes bound
    bf16 = linear_floor(m, k, n, bw, slow_math)
    fp8 = linear_floor(m, k, n, bw, slow_math, in_bytes=1)
    assert bf16 == pytest.approx((2 * (k * n + m * k) + 2 * m * n) / bw)
    assert fp8 == pytest.approx(((k * n + m * k) + 2 * m * n) / bw)


def test_an_fp8_kv_cache_halves_the_decode_attention_floor():
    cfg = SimpleNamespace(
        num_kv_heads=8, head_dim=128, num_heads=32, num_layers=2, hidden_size=4096,
        intermediate_size=14336,
    )  # fmt: skip
    bf16 = Step(cfg, 10**9, decodes=4, context=100, chunk=0)
    fp8 = Step(cfg, 10**9, decodes=4, context=100, chunk=0, kv_bytes=1)
    assert fp8.decode_kv * 2 == bf16.decode_kv
    assert fp8.floor(1e12, 1e15) < bf16.floor(1e12, 1e15)


def test_the_quantizer_floor_counts_down_inputs_width_unless_fused():
    cfg = SimpleNamespace(
        num_kv_heads=8, head_dim=128, num_heads=32, num_layers=2, hidden_size=64,
        intermediate_size=224,
    )  # fmt: skip
    step, bw = Step(cfg, 10**9, decodes=4, context=100, chunk=0), 1e12
    apart, fused = step.floors(bw, 1e15)["fp8 quantize"], step.floors(bw, 1e15, True)
    # bf16 in, e4m3 out, a token's row of every quantized input, every layer
    assert apart == pytest.approx((3 * 64 + 224) * 3 * 4 * 2 / bw)
    assert fused["fp8 quantize"] == pytest.approx(3 * 64 * 3 * 4 * 2 / bw)
    assert fused["silu_mul_quant"] == pytest.approx(5 * 224 * 4 * 2 / bw)
