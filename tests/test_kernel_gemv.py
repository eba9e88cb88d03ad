"""kernels/gemv.py against its reference (CPU: Triton interpreter, small shapes)."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import gemv, gemv_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 64), (1, 37, 100), (3, 20, 513), (2, 5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv(x, w, b, block_n=4, block_k=64)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, gemv_ref(x, w, b), atol=atol, rtol=rtol)
    assert got.shape == (m, n) and got.dtype == dtype


def test_gemv_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="mismatch"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))
