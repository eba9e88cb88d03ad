"""Skinny FP8 GEMM for decode at tiny batch: ``y[m] = sx[m] * sw * (Wq @ xq[m]) (+ b)``, the
product ``torch._scaled_mm`` computes for an ``Fp8Linear`` (engine/quant.py), for a handful of
rows ``m``.

At batch 1 a decode step streams every weight byte once; with e4m3 weights that is half of
bf16's bytes, and the step's floor halves with it only if the GEMV keeps streaming at HBM rate.
kernels/gemv.py's kernel with its ``SCALED`` switch on (the same tiles and grid,
benchmarks/gpu_gemv.py's sweep):

    grid (N / BLOCK_N, M): program (n, m) reads rows n*BLOCK_N.. of Wq in [BLOCK_N, BLOCK_K]
    e4m3 tiles along K, upcasts them and xq[m]'s slice to fp32 (exact), keeps a partial sum and
    reduces it once; the two scales multiply the sum at the end, then the bias, as
    ``Fp8Linear`` does after ``_scaled_mm``: the product rounded to the output dtype, the bias
    added in it.
"""

from __future__ import annotations

import torch

from kernels.gemv import launch_gemv


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
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    launch_gemv(xq, x_scale, weight, weight_scale, bias, y, True, config)
    return y


def fp8_gemv_quantizing(
    x: torch.Tensor,  # [M, K] in the model's dtype, K contiguous
    weight: torch.Tensor,  # [N, K] e4m3, K contiguous
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gated: bool = False,
    **config,
) -> torch.Tensor:
    """``fp8_gemv(*quantize_per_token(x), ...)`` in one kernel: each program quantizes ``x``'s
    row itself (the same e4m3 values and scale), so batch-1 decode runs one launch per
    projection instead of two. ``gated``: ``weight`` is the fused ``[2I, K]`` gate/up
    projection and the result ``silu(gate) * up`` ``[M, I]`` (kernels/gemv.py)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or (gated and n % 2):
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    y = torch.empty(m, n // 2 if gated else n, dtype=out_dtype, device=x.device)
    launch_gemv(x, None, weight, weight_scale, bias, y, True, config, quant_x=True, gated=gated)
    return y


def fp8_gemv_ref(xq, x_scale, weight, weight_scale, bias, out_dtype):
    y = (xq.float() @ weight.float().T) * x_scale * weight_scale.reshape(1, -1)
    y = y.to(out_dtype)
    return y if bias is None else y + bias
