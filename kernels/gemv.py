"""Skinny GEMM for decode at tiny batch: ``y[m] = W @ x[m] (+ b)`` with ``W`` ``[N, K]`` as
``nn.Linear`` stores it, for a handful of rows ``m``.

At batch 1 every weight byte is read once per token, so a decode step is a stream of GEMVs and
its floor is weight bytes / HBM bandwidth. cuBLAS's kernels for M = 1 leave part of that on the
table (benchmarks/NOTES.md has the measurement); this one is built for the stream alone:

    grid (N / BLOCK_N, M): program (n, m) reads rows n*BLOCK_N.. of W in [BLOCK_N, BLOCK_K] tiles
    along K, multiplies by x[m]'s slice in fp32 and keeps a [BLOCK_N, BLOCK_K] partial sum, reduced
    once at the end; so loads are long contiguous runs of K and nothing is written until the end.

Rows ``m`` > 0 re-read W, which then mostly hits L2: worth it only for M of 1 to a few, which is
where the engine uses it (``GEMV_MAX_ROWS``); larger batches go to cuBLAS.

``gated``: the gated MLP's gate/up projection with its activation in the epilogue. W is the
fused ``[gate I | up I]`` weight (``[2I, K]``) and the output ``silu(gate) * up`` ``[M, I]``:
program ``n`` streams gate rows ``n*BLOCK_N..`` and the up rows ``I`` further on, rounds both
sums to the output dtype as the projection's output would be rounded, then applies
kernels/activation.py's arithmetic: the projection followed by ``silu_and_mul``, one launch
fewer (at batch 1 that kernel cost ~1.6 us a layer); bit for bit with the same tiles (the GPU's
sum order within a row follows the tile's shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_quant, pdl
from kernels.activation import silu_mul_f32
from kernels.fp8_quant import row_scale
from kernels.pdl import gdc_launch_dependents, gdc_wait

GEMV_MAX_ROWS = 1
# e4m3's largest value and the smallest amax a row is scaled by (kernels/fp8_quant.py's)
FP8_MAX: tl.constexpr = tl.constexpr(fp8_quant.FP8_MAX)
MIN_AMAX: tl.constexpr = tl.constexpr(fp8_quant.MIN_AMAX)


@triton.jit
def _x_tile(x_row, kk, k_mask, x_scale, QUANT_X: tl.constexpr, W_DTYPE: tl.constexpr):
    """x's values at ``kk`` in fp32; with ``QUANT_X`` the e4m3 values they quantize to."""
    x = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
    if QUANT_X:
        x = tl.clamp(x / x_scale, -FP8_MAX, FP8_MAX).to(W_DTYPE).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
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
    SCALED: tl.constexpr,
    QUANT_X: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """``SCALED``: x and W are e4m3 with a scale per row of x (``xs``) and per row of W
    (``ws``): the sum is scaled and rounded to the output dtype, then the bias added in it
    (kernels/fp8_gemv.py, as ``Fp8Linear`` does after ``_scaled_mm``). Otherwise the bias is
    added to the fp32 sum. ``QUANT_X`` (with ``SCALED``): x comes unquantized and each program
    quantizes it as kernels/fp8_quant.py does (the row's amax first, then each tile), the
    same e4m3 values and scale, with no kernel of its own.

    ``PDL`` (kernels/pdl.py): the first tile of W is read before waiting for the kernel that
    writes x, so the weight stream starts while that kernel ends."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N * stride_wn  # GATED: the up rows (N = I, the output's width)
    if PDL:
        gdc_launch_dependents()
        first_mask = n_mask[:, None] & (rk < K)[None, :]
        w_first = tl.load(w_rows + rk[None, :], mask=first_mask, other=0.0)
        if GATED:
            u_first = tl.load(u_rows + rk[None, :], mask=first_mask, other=0.0)
        gdc_wait()
    if QUANT_X:  # noqa: SIM108 (a constexpr branch: Triton compiles only the one taken)
        x_scale = row_scale(x_ptr + m * stride_xm, K, MIN_AMAX, FP8_MAX, BLOCK_K)
    else:
        x_scale = 1.0
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # GATED only (else dead)
    k_start = 0
    if PDL:
        x = _x_tile(x_ptr + m * stride_xm, rk, rk < K, x_scale, QUANT_X, w_ptr.dtype.element_ty)
        acc += w_first.to(tl.float32) * x[None, :]
        if GATED:
            acc_u += u_first.to(tl.float32) * x[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = _x_tile(x_ptr + m * stride_xm, kk, k_mask, x_scale, QUANT_X, w_ptr.dtype.element_ty)
        tile_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=tile_mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            u = tl.load(u_rows + kk[None, :], mask=tile_mask, other=0.0)
            acc_u += u.to(tl.float32) * x[None, :]
    y = _epilogue(acc, rn, n_mask, m, x_scale, xs_ptr, ws_ptr, b_ptr, y_ptr, SCALED, QUANT_X,
                  HAS_BIAS)  # fmt: skip
    if GATED:  # round gate and up as the projection's output, then kernels/activation.py's math
        up = _epilogue(acc_u, rn + N, n_mask, m, x_scale, xs_ptr, ws_ptr, b_ptr, y_ptr, SCALED,
                       QUANT_X, HAS_BIAS)  # fmt: skip
        y = silu_mul_rounded(y, up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def silu_mul_rounded(gate, up, OUT: tl.constexpr):
    """``silu(gate) * up`` in fp32 of the two projections' fp32 outputs, each first rounded to
    ``OUT`` as the projection's output would be (kernels/activation.py's arithmetic); also
    kernels/fp8_gemv.py's gated epilogue."""
    gate = gate.to(OUT).to(tl.float32)
    up = up.to(OUT).to(tl.float32)
    return silu_mul_f32(gate, up)


@triton.jit
def _epilogue(acc, rn, n_mask, m, x_scale, xs_ptr, ws_ptr, b_ptr, y_ptr, SCALED: tl.constexpr,
              QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Rows ``rn`` of the product from their partial sums: scaled and rounded (``SCALED``),
    the bias added; fp32, not yet rounded to the output dtype."""
    y = tl.sum(acc, axis=1)
    if SCALED:
        if QUANT_X:
            scale = x_scale * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
        else:
            scale = tl.load(xs_ptr + m) * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
        y = (y * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    return y


def launch_gemv(
    x,
    x_scale,
    weight,
    weight_scale,
    bias,
    y,
    scaled: bool,
    config: dict,
    quant_x: bool = False,
    gated: bool = False,
) -> None:
    """Run ``_gemv_kernel`` over ``y [M, N]`` (the checks are the callers'); ``gated``: ``y``
    is ``[M, N / 2]`` (``silu(gate) * up`` of the ``[2I, K]`` weight)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    # Gated programs stream gate and up rows: half the rows each, the same bytes per program.
    launch = pdl.launch_options(x.device)
    cfg = default_config(2 * n if gated else n, k, weight.element_size(), launch["PDL"])
    if gated:
        cfg["block_n"] = max(1, cfg["block_n"] // 2)
    cfg.update(config)
    grid = (-(-n // cfg["block_n"]), m)
    _gemv_kernel[grid](
        x,
        x_scale if scaled and not quant_x else x,
        weight,
        weight_scale if scaled else weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        SCALED=scaled,
        QUANT_X=quant_x,
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch,
    )


def default_config(n: int, k: int, weight_bytes: int = 2, pdl_on: bool = True) -> dict:
    """Tiles from the H100 sweeps of benchmarks/gpu_gemv.py.

    Launched with PDL (``pdl_on``: Hopper and later, kernels/pdl.py), from the sweep with the
    weights cold in L2, as a decode step reads them (``--wide``, 2026-11-28; ``weight_bytes``
    of an element):

    - bf16 / fp16: 4 rows a program in runs of 2048 columns, 4 warps: the best or within 1 %
      of it for every Llama-3-8B shape, at 0.98-1.06 of the HBM copy rate;
    - e4m3 (``--fp8``, the input quantized in the kernel): 8 rows in runs of 1024, 4 warps,
      3 % less time over a layer's four shapes than the bf16 tiles, at 0.72-0.89 of copy.

    Without PDL these tiles lose: a batch-1 step with PDL off took 7.02 ms with them against
    6.20 with the first sweep's (benchmarks/NOTES.md), which a GPU without PDL keeps: long K
    runs (1024), few rows per program (4) and 8 warps for wide outputs. A K shorter than a
    run takes one run of its own length."""
    if not pdl_on:
        if n >= 16384:
            cfg = {"block_n": 4, "block_k": 1024, "num_warps": 8, "num_stages": 3}
        elif k > 8192:
            cfg = {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 4}
        else:
            cfg = {"block_n": 8, "block_k": 1024, "num_warps": 8, "num_stages": 3}
    else:
        rows, run = (8, 1024) if weight_bytes == 1 else (4, 2048)
        cfg = {"block_n": rows, "block_k": run, "num_warps": 4, "num_stages": 3}
    cfg["block_k"] = min(cfg["block_k"], triton.next_power_of_2(k))
    return cfg


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **config):
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` (rows may be strided), ``weight`` ``[N, K]``
    contiguous along K; output ``[M, N]`` in x's dtype, fp32 accumulation."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch_gemv(x, None, weight, None, bias, y, False, config)
    return y


def gemv_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **config
) -> torch.Tensor:
    """``silu_and_mul(gemv(x, weight, bias))`` in one kernel, ``weight`` ``[2I, K]`` the fused
    gate/up projection: ``[M, I]``, the same arithmetic (module docstring)."""
    m, k = x.shape
    n2 = weight.shape[0]
    if n2 % 2 or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv_silu_mul: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    y = torch.empty(m, n2 // 2, dtype=x.dtype, device=x.device)
    launch_gemv(x, None, weight, None, bias, y, False, config, gated=True)
    return y


def gemv_ref(x, weight, bias=None):
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
