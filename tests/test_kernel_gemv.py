"""kernels/gemv.py against its reference (CPU: Triton interpreter, small shapes)."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import gemv, gemv_ref

DTYPES = [torch.float32, torch.float16]


def error_bound(x, w, b, dtype) -> torch.Tensor:
    """Elementwise bound on |kernel - reference| from the arithmetic, not from one machine's
    rounding: both sum k products in fp32 in different orders, so each is within
    gamma_k = k * u32 of the exact dot, scaled by sum_i |x_i w_i| (+ |b|) (Higham, Accuracy and
    Stability of Numerical Algorithms, 3.1); rounding the result to ``dtype`` adds at most one
    unit in the last place of ``dtype`` on each side."""
    k = x.shape[-1]
    u32 = torch.finfo(torch.float32).eps / 2
    mag = x.float().abs() @ w.float().abs().T
    if b is not None:
        mag = mag + b.float().abs()
    out_ulp = (
        torch.finfo(dtype).eps * gemv_ref(x, w, b).float().abs() if dtype != torch.float32 else 0
    )
    return 2 * (k + 1) * u32 * mag + out_ulp + torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 64), (1, 37, 100), (3, 20, 513), (2, 5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv(x, w, b, block_n=4, block_k=64)
    err = (got.float() - gemv_ref(x, w, b).float()).abs()
    bound = error_bound(x, w, b, dtype)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the bound ({worst:.2f}x of it)"
    assert got.shape == (m, n) and got.dtype == dtype


def test_gemv_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="mismatch"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "inter", "k"), [(1, 8, 64), (1, 37, 100), (2, 20, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_gemv_is_the_projection_then_silu_and_mul(dtype, m, inter, k, bias):
    """The gate/up GEMV with the activation in its epilogue gives, bit for bit, what the
    projection's GEMV followed by kernels/activation.py gives (same tiles), for gate/up rows
    that straddle a program's block (37 rows of 4)."""
    from kernels.activation import silu_and_mul
    from kernels.gemv import gemv_silu_mul

    g = torch.Generator().manual_seed(inter * k + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    one = gemv_silu_mul(x, w, b, block_n=4, block_k=64)
    two = silu_and_mul(gemv(x, w, b, block_n=4, block_k=64))
    assert one.shape == (m, inter) and one.dtype == dtype
    assert torch.equal(one, two)
    with pytest.raises(ValueError, match="gemv_silu_mul"):
        gemv_silu_mul(x, w[:-1], b)


def test_triton_ops_fuse_the_activation_where_the_gemv_runs():
    """``TritonOps.gate_up_act``: one GEMV kernel for the rows the GEMV takes (batch 1), the
    projection and the activation for more rows, the same values either way."""
    from torch import nn

    from engine.ops import SkinnyLinear, TorchOps, TritonOps
    from kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(96, 2 * 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=g) / 10)
    skinny = SkinnyLinear(lin)
    ops = TritonOps()
    one_row = torch.randn(1, 96, generator=g)
    calls = []
    fused = skinny.silu_mul
    skinny.silu_mul = lambda x: calls.append(x.shape[0]) or fused(x)
    got = ops.gate_up_act(skinny, one_row)
    assert calls == [1]
    assert torch.equal(got, silu_and_mul(gemv(one_row, lin.weight)))
    rows = torch.randn(3, 96, generator=g)  # past the GEMV's rows: cuBLAS and the activation
    got = ops.gate_up_act(skinny, rows)
    assert calls == [1, 3]
    want = TorchOps().gate_up_act(lin, rows)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
