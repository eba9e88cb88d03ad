"""kernels/fp8_quant.py and kernels/fp8_gemv.py (the CUDA path of ``Fp8Linear``) against their
references (CPU: Triton interpreter, small shapes). The interpreter's fp32 -> e4m3 rounding is
not the GPU's (tests/gpu/test_kv_fp8_gpu.py), so the quantizer's bytes are compared on inputs
whose quantized values are exact; tests/gpu/test_fp8_weights_gpu.py compares random ones."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
from kernels.fp8_quant import FP8, quantize_per_token, quantize_per_token_ref

# These run CPU tensors through Triton's interpreter (tests/conftest.py turns it on without a
# GPU); on a GPU machine tests/gpu/test_fp8_weights_gpu.py runs the kernels instead.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors through Triton's interpreter; on a GPU see tests/gpu/test_fp8_weights_gpu.py",
)


@pytest.mark.parametrize("block_k", [64, None])  # None: the whole row one tile, read once
def test_quantizer_matches_reference_on_exact_values(block_k):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7F, (5, 300), generator=g, dtype=torch.uint8).view(FP8).float()
    codes[:, 7] = 448.0  # every row's amax: the scale is exactly the row's factor
    signs = torch.randint(0, 2, codes.shape, generator=g) * 2 - 1
    factors = torch.tensor([1.0, 2.0**-5, 2.0**3, 0.5, 2.0**-12])[:, None]
    x = codes * signs * factors
    x[3] = 0.0  # an all-zero row: the smallest scale, zeros out
    q, scale = quantize_per_token(x[:, :], block_k=block_k)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("block_k", [32, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantizer_scales_on_random_rows(dtype, block_k):
    """The scales (amax / 448, read over several tiles of K) equal torch's; the bytes are
    checked on the GPU only (the interpreter rounds -31.05 to -16 in e4m3)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 130, generator=g) * torch.tensor([[1.0], [30.0], [1e-3], [5.0]])).to(dtype)
    _, scale = quantize_per_token(x, block_k=block_k)
    _, scale_ref = quantize_per_token_ref(x)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 64), (1, 37, 100), (3, 20, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_reference(out_dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(n * k + m)
    xq = torch.randn(m, k, generator=g).mul(50).clamp(-448, 448).to(FP8)
    wq = torch.randn(n, k, generator=g).mul(50).clamp(-448, 448).to(FP8)
    xs = torch.rand(m, 1, generator=g) * 0.01 + 1e-3
    ws = torch.rand(1, n, generator=g) * 0.01 + 1e-3
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    got = fp8_gemv(xq, xs, wq, ws, b, out_dtype, block_n=4, block_k=64)
    want = fp8_gemv_ref(xq, xs, wq, ws, b, out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    # fp32 sums of k exact products in another order, then the output's rounding (twice: bias)
    mag = (xq.float().abs() @ wq.float().abs().T) * xs * ws
    ulp = torch.finfo(out_dtype).eps
    bound = 2 * (k + 1) * 2**-24 * mag + 2 * ulp * (want.float().abs() + mag) + 1e-30
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 64), (1, 37, 100), (2, 20, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_quantizing_gemv_is_quantize_then_gemv(m, n, k, bias):
    """Batch-1 decode's one kernel (the input quantized inside the GEMV) gives exactly what
    the two kernels it replaces give: the same e4m3 input, scale and sums, bit for bit."""
    from kernels.fp8_gemv import fp8_gemv_quantizing
    from kernels.fp8_quant import quantize_per_token

    g = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k, generator=g).to(torch.float16) * 3
    x[0, k // 2] = 700.0  # one outlier sets the row's scale
    wq = torch.randn(n, k, generator=g).mul(50).clamp(-448, 448).to(FP8)
    ws = torch.rand(1, n, generator=g) * 0.01 + 1e-3
    b = torch.randn(n, generator=g).to(torch.float16) if bias else None
    xq, xs = quantize_per_token(x, block_k=64)
    two = fp8_gemv(xq, xs, wq, ws, b, torch.float16, block_n=4, block_k=64)
    one = fp8_gemv_quantizing(x, wq, ws, b, torch.float16, block_n=4, block_k=64)
    assert torch.equal(one, two)
    with pytest.raises(ValueError, match="mismatch"):
        fp8_gemv_quantizing(x, wq[:, :-1], ws, b, torch.float16)


@pytest.mark.parametrize(("m", "inter", "k"), [(1, 8, 64), (2, 21, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gated_fp8_gemv_is_the_projection_then_silu_and_mul(m, inter, k, bias):
    """The FP8 gate/up GEMV with the activation in its epilogue (batch-1 decode under FP8
    weights): bit for bit the quantizing GEMV followed by kernels/activation.py, each of gate
    and up scaled by its own rows' scales."""
    from kernels.activation import silu_and_mul
    from kernels.fp8_gemv import fp8_gemv_quantizing

    g = torch.Generator().manual_seed(inter * k + m)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    wq = torch.randn(2 * inter, k, generator=g).mul(50).clamp(-448, 448).to(FP8)
    ws = torch.rand(1, 2 * inter, generator=g) * 0.002 + 1e-4
    b = torch.randn(2 * inter, generator=g).to(torch.float16) if bias else None
    cfg = {"block_n": 4, "block_k": 64}
    one = fp8_gemv_quantizing(x, wq, ws, b, torch.float16, gated=True, **cfg)
    two = silu_and_mul(fp8_gemv_quantizing(x, wq, ws, b, torch.float16, **cfg))
    assert one.shape == (m, inter)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    ("m", "n", "k", "split"), [(1, 70, 200, 1), (1, 70, 200, 3), (3, 64, 96, 2)]
)
@pytest.mark.parametrize("gated", [False, True])
def test_the_split_k_tensor_core_gemv_matches_reference(m, n, k, split, gated):
    """``fp8_gemv_splitk`` (weights on the MMA's wide side, K split over programs, the last
    program of a row block adding the partials in split order): within fp32 summation error
    of the float32 product, the same bits on a second call (its counters reset themselves),
    and gated, ``silu(gate) * up`` of its two halves."""
    from kernels.activation import silu_and_mul
    from kernels.fp8_gemv import fp8_gemv_splitk

    g = torch.Generator().manual_seed(n * k + m + split)
    x = torch.randn(m, k, generator=g)
    xq, xs = quantize_per_token_ref(x)
    rows = 2 * n if gated else n
    wq = torch.randn(rows, k, generator=g).mul(50).clamp(-448, 448).to(FP8)
    ws = torch.rand(1, rows, generator=g) * 0.01 + 1e-3
    b = torch.randn(rows, generator=g).to(torch.float16)
    cfg = {"block_n": 32, "block_k": 32, "split_k": split}
    got = fp8_gemv_splitk(xq, xs, wq, ws, b, torch.float16, gated=gated, **cfg)
    again = fp8_gemv_splitk(xq, xs, wq, ws, b, torch.float16, gated=gated, **cfg)
    assert torch.equal(got, again)
    want = fp8_gemv_ref(xq, xs, wq, ws, b, torch.float16)
    tol = {"rtol": 2e-3, "atol": 1e-2}  # an fp16 rounding either side
    if gated:  # (silu_and_mul of the rounded halves: one more rounding)
        want, tol = silu_and_mul(want), {"rtol": 1e-2, "atol": 2e-2}
        assert got.shape == (m, n)
    assert torch.allclose(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t, inter", [(1, 40), (9, 300), (3, 512), (0, 64)])
def test_silu_mul_quant_is_silu_and_mul_then_the_quantizer(dtype, t, inter):
    """One kernel, the same bytes as the two it replaces (the activation rounded to x's dtype
    before its amax): scales and e4m3 codes equal, both under the interpreter's rounding."""
    from kernels.activation import silu_and_mul
    from kernels.fp8_quant import silu_mul_quant

    g = torch.Generator().manual_seed(t * 1000 + inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 3).to(dtype)
    q, scale = silu_mul_quant(x)
    q_two, scale_two = quantize_per_token(silu_and_mul(x))
    assert q.shape == (t, inter) and scale.shape == (t, 1)
    assert torch.equal(scale, scale_two)
    assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))


def test_silu_mul_quant_declines_a_row_past_one_tile(monkeypatch):
    from kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "ONE_PASS_MAX_K", 64)
    assert fp8_quant.silu_mul_quant(torch.randn(2, 2 * 100)) is None
    assert fp8_quant.silu_mul_quant(torch.randn(2, 2 * 64)) is not None
    with pytest.raises(ValueError, match="silu_mul_quant"):
        fp8_quant.silu_mul_quant(torch.randn(2, 7))  # not [T, 2I]


def test_the_gated_mlp_hands_down_its_input_quantized_past_the_gemv_rows(monkeypatch):
    """``TritonOps.gated_mlp``: past the FP8 GEMVs' rows the down projection gets the activation
    quantized by ``silu_mul_quant`` (the same bytes: the result equals the projection of
    ``quantize_per_token(silu_and_mul(.))``); at the GEMV's rows the path is as it was."""
    from torch import nn

    from engine.ops import TritonOps
    from engine.quant import Fp8Linear
    from kernels import fp8_quant
    from kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(3)
    gate_up = Fp8Linear.from_linear(nn.Linear(64, 2 * 96, bias=False))
    down = Fp8Linear.from_linear(nn.Linear(96, 64, bias=False))
    for layer in (gate_up, down):
        layer.weight_scale.data.uniform_(0.01, 0.02, generator=g)
    calls = []
    fused = fp8_quant.silu_mul_quant
    monkeypatch.setattr(
        fp8_quant,
        "silu_mul_quant",
        lambda h, rows=None: calls.append((len(h), rows)) or fused(h, rows=rows),
    )
    ops = TritonOps()
    gemv_rows = max(down.mma_max_rows, down.gemv_max_rows, down.splitk_max_rows)
    rows = torch.randn(gemv_rows + 1, 64, generator=g)
    assert down.takes_quantized(rows.shape[0]) and not down.takes_quantized(gemv_rows)
    got = ops.gated_mlp(gate_up, down, rows)
    padded = down.scaled_mm_rows(len(rows))  # (65 rows: _scaled_mm runs 128, zeros after 65)
    assert calls == [(len(rows), padded)] and padded > len(rows)
    want = down.forward_quantized(*quantize_per_token(silu_and_mul(gate_up(rows))))
    assert got.shape == want.shape and torch.equal(got, want)
    few = rows[:gemv_rows]
    want_few = down(ops.gate_up_act(gate_up, few))
    assert torch.equal(ops.gated_mlp(gate_up, down, few), want_few)
    assert len(calls) == 1  # the GEMV's rows: not handed over quantized


@pytest.mark.parametrize("block_k", [64, None])  # two passes over the row, and one
def test_the_quantizer_pads_with_rows_of_zeros(block_k):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 300, generator=g)
    q, scale = quantize_per_token(x, block_k=block_k)
    qp, scale_p = quantize_per_token(x, block_k=block_k, rows=8)
    assert qp.shape == (8, 300) and scale_p.shape == (8, 1)
    assert torch.equal(qp[:5].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale_p[:5], scale)
    zero_q, zero_scale = quantize_per_token_ref(torch.zeros(3, 300))
    assert torch.equal(qp[5:].view(torch.uint8), zero_q.view(torch.uint8))
    assert torch.equal(scale_p[5:], zero_scale)
    with pytest.raises(ValueError, match="rows"):
        quantize_per_token(x, rows=4)


def test_silu_mul_quant_pads_with_rows_of_zeros():
    from kernels.fp8_quant import silu_mul_quant

    h = torch.randn(3, 2 * 48, generator=torch.Generator().manual_seed(6))
    q, scale = silu_mul_quant(h)
    qp, scale_p = silu_mul_quant(h, rows=16)
    assert qp.shape == (16, 48)
    assert torch.equal(qp[:3].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale_p[:3], scale)
    assert not qp[3:].view(torch.uint8).any()  # e4m3 zeros
    assert torch.equal(scale_p[3:], quantize_per_token_ref(torch.zeros(13, 48))[1])


def test_scaled_mm_rows_pad_to_the_multiple_up_to_the_limit(monkeypatch):
    from engine.quant import Fp8Linear

    layer = Fp8Linear.from_linear(torch.nn.Linear(32, 16, bias=False))
    assert [layer.scaled_mm_rows(r) for r in (65, 128, 129, 257, 392, 512, 513, 2048)] == [
        128, 128, 256, 384, 512, 512, 513, 2048,
    ]  # fmt: skip
    monkeypatch.setattr(Fp8Linear, "scaled_mm_row_multiple", 0)
    assert layer.scaled_mm_rows(129) == 129


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n", "rows"), [(1, 64, None), (5, 96, 8), (3, 300, None)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_the_norm_then_the_quantizer(dtype, t, n, rows, with_residual):
    """``rms_norm_quant``: the bytes and scales of kernels/rmsnorm.py's norm (with the residual
    add: the same sum stored in place) then ``quantize_per_token``, padding rows of zeros; x is
    left as it was."""
    from kernels import rmsnorm
    from kernels.fp8_quant import rms_norm_quant

    g = torch.Generator().manual_seed(t * n)
    x = (torch.randn(t, n, generator=g) * 3).to(dtype)
    residual = torch.randn(t, n, generator=g).to(dtype) if with_residual else None
    weight = torch.rand(n, generator=g).to(dtype) + 0.5
    x_before = x.clone()
    if with_residual:
        normed, want_sum = rmsnorm.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    else:
        normed, want_sum = rmsnorm.rms_norm(x, weight, 1e-5), None
    want_q, want_s = quantize_per_token(normed, rows=rows)
    got = rms_norm_quant(x, residual, weight, 1e-5, rows=rows)
    assert got.rows == t and got.shape == (t, n) and got.q.shape == want_q.shape
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_s)
    assert torch.equal(x, x_before)
    if with_residual:
        assert torch.equal(residual, want_sum)
    with pytest.raises(ValueError, match="rms_norm_quant"):
        rms_norm_quant(x, residual, weight, 1e-5, rows=t - 1)


@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_a_norm_into_an_fp8_projection_hands_it_the_input_quantized(rows, monkeypatch):
    """``TritonOps``' norms with ``into`` an ``Fp8Linear``: one kernel returns ``QuantizedRows``
    (the quantizer's bytes of the norm), which
    the projection and the gated MLP take as they take the norm quantized by the quantizer (the
    interpreter's e4m3 rounding is not torch's, so the reference quantizes with the kernel too);
    into a bf16 layer, or with ``fuse_norm_quant`` off, the norm comes back as a tensor."""
    from torch import nn

    from engine.ops import TritonOps
    from engine.quant import Fp8Linear
    from kernels.fp8 import QuantizedRows
    from kernels.fp8_quant import silu_mul_quant

    g = torch.Generator().manual_seed(rows)
    qkv = Fp8Linear.from_linear(nn.Linear(64, 96, bias=False))
    gate_up = Fp8Linear.from_linear(nn.Linear(64, 2 * 48, bias=False))
    down = Fp8Linear.from_linear(nn.Linear(48, 64, bias=False))
    ops = TritonOps()
    x = torch.randn(rows, 64, generator=g)
    residual = torch.randn(rows, 64, generator=g)
    weight = torch.rand(64, generator=g) + 0.5
    padded = rows  # (on CPU: _scaled_mm's padding is for cuBLAS's kernels)
    assert qkv.quantized_input_rows(x) == padded

    normed, want_sum = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    got, got_sum = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, into=qkv)
    assert isinstance(got, QuantizedRows) and got.rows == rows and got.shape == (rows, 64)
    q_ref, s_ref = quantize_per_token(normed, rows=padded)
    assert torch.equal(got.q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(got.scale, s_ref) and torch.equal(got_sum, want_sum)
    assert torch.equal(qkv(got), qkv.forward_quantized(q_ref, s_ref, rows=rows))

    mlp_in = ops.rms_norm(x, weight, 1e-5, into=gate_up)
    assert isinstance(mlp_in, QuantizedRows)
    plain = ops.rms_norm(x, weight, 1e-5)
    h = gate_up.forward_quantized(*quantize_per_token(plain, rows=padded), rows=rows)
    if down.takes_quantized(rows):  # past the GEMMs' rows: the activation quantized too
        want = down.forward_quantized(*silu_mul_quant(h, rows=padded), rows=rows)
    else:
        want = down(ops.silu_and_mul(h))
    assert torch.equal(ops.gated_mlp(gate_up, down, mlp_in), want)

    assert not isinstance(ops.rms_norm(x, weight, 1e-5, into=nn.Linear(64, 8)), QuantizedRows)
    monkeypatch.setattr(Fp8Linear, "fuse_norm_quant", 0)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5, into=qkv), plain)
