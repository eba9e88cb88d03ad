"""FP8 weights (``quantization="fp8"``) on a CUDA GPU of compute capability 8.9+ (run on the
GPU machine; skipped without one).

    python -m pytest -q tests/gpu/test_fp8_weights_gpu.py

- the per-token quantizer kernel rounds as torch, and the fused activation + quantizer
  (``silu_mul_quant``) gives its bytes; the FP8 GEMV (batch 1) and ``_scaled_mm`` agree;
- ``Fp8Linear`` (the tensor-core GEMV at 1-8 rows, the split-K GEMM to 64, ``_scaled_mm``
  above) against the float32
  product of the same quantized weight and input, at decode and prefill row counts and
  Llama-3-8B's shapes; the CUDA tensor-core GEMV (kernels/fp8_gemv_mma.py) builds here and is
  that product within one bf16 step, plain and gated;
- the layer captured in a CUDA graph replays a new input as eagerly (the per-token scales are
  computed on the device, nothing waits for the host);
- quantizing a model gives the device back half of its projections' bytes (what the KV pool is
  sized from: free memory after load);
- a tiny bf16 model with fp8 weights, decode graphs and piecewise graphs on: its logprobs close
  to the bf16 model's, and the same as its own eager run.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny
from torch import nn

from engine.quant import FP8, FP8_TARGETS, Fp8Linear, fp8_reference, quantize_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 matmuls (compute capability 8.9+)",
)


# GEMV, split-K GEMM, _scaled_mm (65-512 rows padded to a multiple of 128, past 512 as they are)
@pytest.mark.parametrize("rows", [1, 7, 9, 64, 65, 300, 392, 600])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096), (256, 1536)])
def test_fp8_linear_matches_float32_of_the_same_quantization(rows, k, n):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == FP8
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y, ref = layer(x), fp8_reference(layer, x)
    assert y.dtype == torch.bfloat16 and y.isfinite().all()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # bf16 output rounding (and the kernel's accumulation order)
    exact = linear.float()(x.float())
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.06


def test_quantizer_kernel_rounds_as_torch():
    from kernels.fp8_quant import quantize_per_token, quantize_per_token_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(333, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    x[5] = 0
    q, scale = quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    # Triton's fp32 division may differ from torch's in the last bit: a tie then rounds apart
    assert differ.float().mean() < 1e-4, differ.float().mean()
    steps = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    assert steps.max() <= 1


def test_the_quantizer_reads_a_row_once_or_in_tiles_to_the_same_bytes():
    from kernels.fp8_quant import quantize_per_token

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 28672, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    once, tiles = quantize_per_token(x), quantize_per_token(x, block_k=1024)
    assert torch.equal(once[1], tiles[1])
    assert torch.equal(once[0].view(torch.uint8), tiles[0].view(torch.uint8))


@pytest.mark.parametrize(("rows", "inter"), [(1, 28672), (9, 1000), (257, 14336)])
def test_silu_mul_quant_is_the_two_kernels_on_the_gpu(rows, inter):
    """The fused activation + quantizer: the same scales and e4m3 bytes as ``silu_and_mul`` then
    ``quantize_per_token``, on the GPU's rounding (bf16 random rows, Llama-3's widths)."""
    from kernels.activation import silu_and_mul
    from kernels.fp8_quant import quantize_per_token, silu_mul_quant

    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 4
    q, scale = silu_mul_quant(x)
    q_two, scale_two = quantize_per_token(silu_and_mul(x))
    assert torch.equal(scale, scale_two)
    assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))


def test_gemv_and_scaled_mm_agree_at_batch_1():
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(4096, 14336, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    gemv = layer(x)
    try:
        Fp8Linear.gemv_max_rows = Fp8Linear.mma_max_rows = 0
        cublas = layer(x)
    finally:
        Fp8Linear.gemv_max_rows, Fp8Linear.mma_max_rows = 1, 8
    assert ((gemv.float() - cublas.float()).norm() / cublas.float().norm()).item() < 1e-2


def test_the_quantizing_gemv_is_quantize_then_gemv_on_the_gpu():
    """Batch 1's one kernel against the two it replaces, at a real shape: bit for bit."""
    from kernels.fp8_gemv import fp8_gemv, fp8_gemv_quantizing
    from kernels.fp8_quant import quantize_per_token

    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(4096, 6144, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) * 4
    w, ws = layer.weight, layer.weight_scale
    two = fp8_gemv(*quantize_per_token(x), w, ws, layer.bias, torch.bfloat16)
    assert torch.equal(fp8_gemv_quantizing(x, w, ws, layer.bias, torch.bfloat16), two)


def _tensor_core_gemv():
    from kernels import fp8_gemv_mma

    assert fp8_gemv_mma.available() is None, fp8_gemv_mma.available()  # it builds here
    return fp8_gemv_mma.fp8_gemv_mma


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize(("k", "n", "bias"), [(4096, 6144, False), (14336, 4096, True)])
def test_the_tensor_core_gemv_is_the_quantized_product(rows, k, n, bias):
    """kernels/fp8_gemv_mma.py against the float32 product of the same e4m3 values and scales,
    rounded to bf16 as the Triton GEMV rounds it: within bf16's rounding of a sum added in
    another order; and the rows are independent (each row alone gives the same row)."""
    from kernels.fp8_gemv import fp8_gemv_ref
    from kernels.fp8_quant import quantize_per_token

    gemv = _tensor_core_gemv()
    torch.manual_seed(rows)
    layer = Fp8Linear.from_linear(nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3
    x[-1, :7] = 40  # an outlier sets the last row's scale
    w, ws, b = layer.weight, layer.weight_scale, layer.bias
    y = gemv(x, w, ws, b)
    ref = fp8_gemv_ref(*quantize_per_token(x), w, ws, b, torch.bfloat16).float()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    err = (y.float() - ref).abs()
    assert (err <= ref.abs() * 2**-7 + 1e-3).all(), err.max()  # one bf16 step, at most
    assert err.norm() / ref.norm() < 2e-3
    for r in range(rows):
        assert torch.equal(gemv(x[r : r + 1], w, ws, b), y[r : r + 1])


@pytest.mark.parametrize("rows", [1, 8])
def test_the_gated_tensor_core_gemv_is_silu_of_gate_times_up(rows):
    """The gate/up projection ending in ``silu(gate) * up``: against the exact product of the
    same e4m3 values, each half rounded to bf16 as the projection's output would be, and
    against the Triton GEMV's gated path (sums in another order: one bf16 step apart at most)."""
    from kernels.fp8_gemv import fp8_gemv_quantizing, fp8_gemv_ref
    from kernels.fp8_quant import quantize_per_token

    gemv = _tensor_core_gemv()
    torch.manual_seed(0)
    inter = 1024
    linear = nn.Linear(4096, 2 * inter, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w, ws = layer.weight, layer.weight_scale
    y = gemv(x, w, ws, None, gated=True)
    both = fp8_gemv_ref(*quantize_per_token(x), w, ws, None, torch.bfloat16).float()
    ref = torch.nn.functional.silu(both[:, :inter]) * both[:, inter:]
    assert y.shape == (rows, inter)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
    triton_y = fp8_gemv_quantizing(x, w, ws, None, torch.bfloat16, gated=True).float()
    assert ((y.float() - triton_y).abs() <= triton_y.abs() * 2**-6 + 1e-3).all()
    assert torch.equal(layer.silu_mul(x), y)  # what the MLP runs at these rows


# 4: the tensor-core GEMV, 16: the split-K GEMM (its counters reset in the graph), 96: _scaled_mm
@pytest.mark.parametrize("rows", [4, 16, 96])
def test_fp8_linear_replays_in_a_cuda_graph(rows):
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(512, 1024, device="cuda", dtype=torch.bfloat16))
    static = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static)  # warm-up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    fresh = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16) * 7
    static.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, layer(fresh), rtol=0, atol=0)
    graph.replay()  # again: the split-K counters were left at zero
    torch.testing.assert_close(out, layer(fresh), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [9, 33, 64])
def test_split_k_rows_take_the_split_k_gemm_gated_and_plain(rows):
    """Past the tensor-core GEMV's 8 rows and up to ``splitk_max_rows``, ``Fp8Linear`` quantizes
    the input and runs ``fp8_gemv_splitk`` (not ``_scaled_mm``): the same bits as that call, and
    within a bf16 step of the float32 product; gated, ``silu(gate) * up`` of it."""
    from kernels.fp8_gemv import fp8_gemv_ref, fp8_gemv_splitk
    from kernels.fp8_quant import quantize_per_token

    assert Fp8Linear.mma_max_rows < rows <= Fp8Linear.splitk_max_rows
    torch.manual_seed(rows)
    inter = 1024
    layer = Fp8Linear.from_linear(
        nn.Linear(4096, 2 * inter, bias=False, device="cuda", dtype=torch.bfloat16)
    )
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_per_token(x)
    w, ws = layer.weight, layer.weight_scale
    direct = fp8_gemv_splitk(xq, xs, w, ws, None, torch.bfloat16)
    assert torch.equal(layer(x), direct)
    both = fp8_gemv_ref(xq, xs, w, ws, None, torch.bfloat16).float()
    assert ((direct.float() - both).norm() / both.norm()).item() < 4e-3
    gated = layer.silu_mul(x)
    assert torch.equal(gated, fp8_gemv_splitk(xq, xs, w, ws, None, torch.bfloat16, gated=True))
    ref = torch.nn.functional.silu(both[:, :inter]) * both[:, inter:]
    assert ((gated.float() - ref).norm() / ref.norm()).item() < 4e-3


def test_quantizing_gives_the_device_back_half_the_projection_bytes():
    from engine.config import ModelConfig
    from engine.models import model_class

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 1024,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        }
    )
    torch.cuda.empty_cache()
    with torch.device("cuda"):
        model = model_class(cfg)(cfg, 64).to(torch.bfloat16)  # 1.74 GB of projections
    proj = sum(
        getattr(m, n).weight.numel() * 2
        for m in model.modules()
        for n in FP8_TARGETS
        if hasattr(m, n)
    )
    torch.cuda.empty_cache()  # the fp32 build's cached segments: not the weights' to save
    free_before, _ = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()
    assert quantize_model(model, torch.device("cuda")) == 16
    free_after, _ = torch.cuda.mem_get_info()
    # the tensors: one byte a weight, a float32 scale per output channel, nothing left behind
    rows = sum(
        getattr(m, n).weight.shape[0] for m in model.modules() for n in FP8_TARGETS if hasattr(m, n)
    )
    saved = allocated_before - torch.cuda.memory_allocated()
    assert abs(saved - (proj // 2 - 4 * rows)) <= 1 << 20, (saved, proj, rows)
    # the device: at least that much back (more where a freed bf16 weight shared a cached
    # segment of the fp32 build, which empty_cache could not release before)
    assert free_after - free_before >= 0.45 * proj, (free_after - free_before, proj)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-fp8w-gpu", **GPU_TINY, initializer_range=0.05)


def _run(path, prompts, **kwargs):
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(path, dtype="bfloat16", device="cuda", num_kv_blocks=128,
              max_num_batched_tokens=64, **kwargs)  # fmt: skip
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return llm, outs


def _logprob_diffs(a_outs, b_outs):
    """|logprob difference| of each token up to the first where the two runs part."""
    diffs, first = [], 0
    for a, b in zip(a_outs, b_outs, strict=True):
        first += a.token_ids[0] == b.token_ids[0]
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                break
            diffs.append(abs(a.logprobs[i][x] - b.logprobs[i][y]))
    return diffs, first


def test_fp8_model_close_to_bf16_with_graphs_on(tiny):
    rng = random.Random(3)
    prompts = [[rng.randrange(GPU_TINY["vocab_size"]) for _ in range(n)] for n in (1, 9, 40, 130)]
    _, bf16 = _run(tiny, prompts)
    llm, fp8 = _run(tiny, prompts, quantization="fp8")
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.piecewise is not None  # graphs on
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    diffs, first = _logprob_diffs(bf16, fp8)
    print(f"fp8 vs bf16: first tokens {first}/{len(prompts)} equal, mean |dlogprob| "
          f"{sum(diffs) / len(diffs):.4f} over {len(diffs)} tokens, max {max(diffs):.4f}")  # fmt: skip
    # The same comparison on CPU (bf16, torch's CPU _scaled_mm) measured first tokens 4/4,
    # mean 0.106, max 0.203 over 20 tokens: a random model's near-flat logits (about -4 for the
    # top token of 512) move more than a trained model's; twice that is the bound.
    assert first >= len(prompts) - 1
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 0.6, diffs
    # the graphs replay what the eager fp8 forward computes
    # (a graphed prefill pads its rows to the bucket: _scaled_mm may tile it differently)
    _, eager = _run(tiny, prompts, quantization="fp8", enforce_eager=True)
    diffs, first = _logprob_diffs(fp8, eager)
    assert first >= len(prompts) - 1
    assert len(diffs) >= 2 * len(prompts) and max(diffs) < 2e-2, diffs


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_the_norm_then_the_quantizer_on_the_gpu(rows, with_residual):
    """One kernel, the bytes of kernels/rmsnorm.py's norm then ``quantize_per_token`` (padded
    as ``_scaled_mm`` takes them), and the residual's sum, at Llama-3-8B's width."""
    from kernels import rmsnorm
    from kernels.fp8_quant import quantize_per_token, rms_norm_quant

    torch.manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 4
    residual = torch.randn_like(x) if with_residual else None
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    padded = -(-rows // 128) * 128
    if with_residual:
        normed, want_sum = rmsnorm.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    else:
        normed, want_sum = rmsnorm.rms_norm(x, weight, 1e-5), None
    want_q, want_s = quantize_per_token(normed, rows=padded)
    got = rms_norm_quant(x, residual, weight, 1e-5, rows=padded)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_s)
    if with_residual:
        assert torch.equal(residual, want_sum)


# 2, 8: the tensor-core GEMV; 9, 64: the split-K GEMM; 65, 300: _scaled_mm (padded rows)
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 64, 65, 300])
def test_an_fp8_projection_takes_its_input_quantized_by_the_norm(rows):
    """``TritonOps``' norm into an ``Fp8Linear``: past one row the norm hands the projection
    ``QuantizedRows`` and every product path (plain and gated) gives the bits it gives the
    norm as a tensor; at one row (the GEMV quantizes x itself) the norm stays a tensor."""
    from engine.ops import TritonOps
    from kernels.fp8 import QuantizedRows

    torch.manual_seed(rows)
    layer = Fp8Linear.from_linear(
        nn.Linear(4096, 2 * 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    )
    ops = TritonOps()
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    normed, _ = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    got, _ = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, into=layer)
    if rows == 1:
        assert not isinstance(got, QuantizedRows) and torch.equal(got, normed)
        return
    assert isinstance(got, QuantizedRows)
    assert got.q.shape[0] == (rows if rows <= 64 else -(-rows // 128) * 128)
    assert torch.equal(layer(got), layer(normed))
    fused = layer.silu_mul(got)
    if rows <= layer.splitk_max_rows:
        assert fused is not None and torch.equal(fused, layer.silu_mul(normed))
    else:
        assert fused is None and layer.silu_mul(normed) is None
