"""Skinny FP8 GEMM for decode at tiny batch: ``y[m] = sx[m] * sw * (Wq @ xq[m]) (+ b)``, the
product ``torch._scaled_mm`` computes for an ``Fp8Linear`` (engine/quant.py), for a handful of
rows ``m``.

At batch 1 a decode step streams every weight byte once; with e4m3 weights that is half of
bf16's bytes, and the step's floor halves with it only if the GEMV keeps streaming at HBM rate.
Built as kernels/gemv.py is (the same tiles and grid, benchmarks/gpu_gemv.py's sweep):

    grid (N / BLOCK_N, M): program (n, m) reads rows n*BLOCK_N.. of Wq in [BLOCK_N, BLOCK_K]
    e4m3 tiles along K, upcasts them and xq[m]'s slice to fp32 (exact), keeps a partial sum and
    reduces it once; the two scales multiply the sum at the end, then the bias, as
    ``Fp8Linear`` does after ``_scaled_mm``: the product rounded to the output dtype, the bias
    added in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import default_config


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_ptr + m * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    scale = tl.load(xs_ptr + m) * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    y = (tl.sum(acc, axis=1) * scale).to(y_ptr.dtype.element_ty)
    if HAS_BIAS:
        b = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + b).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + rn, y, mask=n_mask)


def fp8_gemv(
    xq: torch.Tensor,  # [M, K] e4m3, K contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3, K contiguous
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    **config,
) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale).T`` in fp32, rounded to ``out_dtype``, then
    ``+ bias`` in ``out_dtype``: ``[M, N]``."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or xq.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(xq.shape)} and weight {tuple(weight.shape)} mismatch")
    cfg = {**default_config(n, k), **config}
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (-(-n // cfg["block_n"]), m)
    _fp8_gemv_kernel[grid](
        xq,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        y,
        n,
        k,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def fp8_gemv_ref(xq, x_scale, weight, weight_scale, bias, out_dtype):
    y = (xq.float() @ weight.float().T) * x_scale * weight_scale.reshape(1, -1)
    y = y.to(out_dtype)
    return y if bias is None else y + bias
