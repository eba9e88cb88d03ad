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
