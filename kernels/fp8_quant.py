"""Per-token (per-row) dynamic FP8 quantization of activations, one kernel: the input of every
``Fp8Linear`` (engine/quant.py) at every call on CUDA.

    x [M, K] -> xq [M, K] e4m3, scale [M, 1] float32:  scale[m] = max(|x[m, :]|, 1e-12) / 448,
                                                       xq[m, k] = fp8(clamp(x[m, k] / scale[m], +-448))

In plain torch that is six kernels (upcast, abs, amax, divide, clamp, cast) and as many
intermediate tensors; a decode step runs it four times per layer, so under a CUDA graph the
launches alone cost more than the quantization. Here one program per row reads the row (once
when it fits one tile, else twice: amax, then quantize, the second read hitting L2) and writes
the e4m3 row and its scale.

``silu_mul_quant`` is the gated MLP's activation and the down projection's quantization in one
kernel: the same bytes as ``silu_and_mul`` then ``quantize_per_token``, without the bf16
activation written and read back between them (at a 2304-token step of Llama-3-8B, 66 MB each
way a layer). ``rms_norm_quant`` does the same for the RMSNorm (with the residual add folded in)
in front of the q/k/v and gate/up projections: the same bytes as kernels/rmsnorm.py's kernel
then ``quantize_per_token``, one launch instead of two. Their result travels to the projection
as ``QuantizedRows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_mul_f32
from kernels.fp8 import QuantizedRows
from kernels.pdl import start as pdl_start
from kernels.rmsnorm import add_residual, normalize_rows, tile_config

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def row_scale(row_ptr, K, MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr, BLOCK_K: tl.constexpr):
    """The e4m3 scale of the ``K`` values at ``row_ptr``: ``max(amax, MIN_AMAX) / 448`` (also
    kernels/gemv.py's, which quantizes its input itself: one definition, the same scale)."""
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(row_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.maximum(tl.max(amax, axis=0), MIN_AMAX_) / FP8_MAX_


@triton.jit
def _store_e4m3_row(x, q_row, s_at, cols, mask, MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr):
    """A row held whole in registers (fp32 ``x`` at ``cols``) as its scale at ``s_at`` and its
    e4m3 values at ``q_row``: the one-pass arithmetic of both kernels below, so a row quantized
    by either has the same bytes."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_) / FP8_MAX_
    tl.store(s_at, scale)
    q = tl.clamp(x / scale, -FP8_MAX_, FP8_MAX_)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # (the rows vary per step: one variant for all)
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    MIN_AMAX_: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``m``: row ``m``'s scale, then the row in e4m3. ``ONE_PASS`` (the row fits one
    ``BLOCK_K`` tile): the row is read once and kept in registers; else read twice, tile by
    tile (the second read hits L2). The same scale and bytes either way. Programs past the
    ``M`` rows of x (padding) write a row of zeros, as a row of zeros quantizes."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    valid = m < M
    if ONE_PASS:
        mask = rk < K
        x = tl.load(x_ptr + m * stride_xm + rk, mask=mask & valid, other=0.0).to(tl.float32)
        _store_e4m3_row(x, q_ptr + m * stride_qm, s_ptr + m, rk, mask, MIN_AMAX_, FP8_MAX_)
    else:
        scale = row_scale(x_ptr + m * stride_xm, tl.where(valid, K, 0), MIN_AMAX_, FP8_MAX_,
                          BLOCK_K)  # fmt: skip
        tl.store(s_ptr + m, scale)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + m * stride_xm + kk, mask=(kk < K) & valid, other=0.0)
            q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX_, FP8_MAX_)
            tl.store(q_ptr + m * stride_qm + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)


ONE_PASS_MAX_K = 32768  # rows up to this long are read once (16 warps: 64 values a thread)


def _one_pass_warps(block: int) -> int:
    """Warps for a row of ``block`` values held in registers: 4, up to 16 past 2048."""
    return 4 if block <= 2048 else min(16, block // 512)


def quantize_per_token(
    x: torch.Tensor, block_k: int | None = None, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (rows may be strided, K contiguous) as ``(xq [M, K] e4m3, scale [M, 1]
    float32)``; what ``quantize_per_token_ref`` computes. A row up to ``ONE_PASS_MAX_K`` long is
    one tile read once (a decode batch's few rows: one memory round trip, not two a tile; on an
    H200 a Llama-3-70B row of 28,672 took ~56 round trips in 1024-wide tiles); ``block_k``
    forces tiles of that width. ``rows`` (>= M): the outputs padded to that many rows, the
    padding quantized as rows of zeros (e4m3 zeros, scale ``MIN_AMAX / 448``)."""
    m, k = x.shape
    rows = m if rows is None else rows
    if x.stride(1) != 1 or rows < m:
        raise ValueError(f"quantize_per_token: x {tuple(x.shape)} must be contiguous along K "
                         f"and rows ({rows}) at least its own")  # fmt: skip
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if block_k is None:
        block_k = triton.next_power_of_2(k) if k <= ONE_PASS_MAX_K else 1024
    one_pass = block_k >= k
    warps = _one_pass_warps(block_k) if one_pass else 4
    if rows:
        _quant_rows_kernel[(rows,)](
            x,
            q,
            scale,
            m,
            k,
            x.stride(0),
            q.stride(0),
            MIN_AMAX,
            FP8_MAX,
            BLOCK_K=block_k,
            ONE_PASS=one_pass,
            num_warps=warps,
            **pdl.launch_options(x.device),
        )
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _silu_mul_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    inter,
    stride_xm,
    stride_qm,
    MIN_AMAX_: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``m``: row ``m`` of ``silu(gate) * up`` rounded to x's dtype (as
    ``silu_and_mul`` stores it), then its scale and e4m3 values (as ``_quant_rows_kernel``'s
    one pass computes them from that stored row). Programs past the ``M`` rows of x (padding)
    write a row of zeros."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + m * stride_xm
    valid = m < M
    gate = tl.load(row + cols, mask=mask & valid, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
    y = silu_mul_f32(gate, up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_e4m3_row(y, q_ptr + m * stride_qm, s_ptr + m, cols, mask, MIN_AMAX_, FP8_MAX_)


def silu_mul_quant(
    x: torch.Tensor, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_per_token(silu_and_mul(x))`` for ``x [T, 2I]`` (fp32, fp16 or bf16, last dim
    contiguous) in one kernel, bit for bit; None where a row of ``I`` does not fit one tile
    (``ONE_PASS_MAX_K``), for the two kernels to run instead. ``rows``: as
    ``quantize_per_token``'s."""
    t, width = x.shape
    inter = width // 2
    rows = t if rows is None else rows
    if width % 2 or x.stride(1) != 1 or x.dtype not in _ACT_DTYPES or rows < t:
        raise ValueError(f"silu_mul_quant: x {tuple(x.shape)} {x.dtype} strides {x.stride()}, "
                         f"rows {rows}")  # fmt: skip
    if inter > ONE_PASS_MAX_K:
        return None
    q = torch.empty(rows, inter, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(inter)
    if rows:
        _silu_mul_quant_kernel[(rows,)](
            x,
            q,
            scale,
            t,
            inter,
            x.stride(0),
            q.stride(0),
            MIN_AMAX,
            FP8_MAX,
            BLOCK=block,
            num_warps=_one_pass_warps(block),
            **pdl.launch_options(x.device),
        )
    return q, scale


@triton.jit(do_not_specialize=["M", "R"])
def _rms_norm_quant_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    M,
    R,
    stride_xm,
    stride_rm,
    stride_qm,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MIN_AMAX_: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    PDL: tl.constexpr,
):
    """``ROWS`` rows a program, as kernels/rmsnorm.py's kernel tiles them (the same sum of
    squares): the residual add (stored), the norm rounded to x's dtype as that kernel stores it,
    then each row's scale and e4m3 values as ``_store_e4m3_row`` computes them. Rows from ``M``
    to ``R`` (padding) get a row of zeros."""
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    in_cols = (cols < N)[None, :]
    mask = (rows < M)[:, None] & in_cols
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        x = add_residual(x, res_ptr + rows[:, None] * stride_rm + cols[None, :], mask)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = normalize_rows(x, w, eps, N, x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), MIN_AMAX_) / FP8_MAX_
    out = rows < R
    tl.store(s_ptr + rows, scale, mask=out)
    q = tl.clamp(y / scale[:, None], -FP8_MAX_, FP8_MAX_)
    q_offs = rows[:, None] * stride_qm + cols[None, :]
    tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty), mask=out[:, None] & in_cols)


def rms_norm_quant(
    x: torch.Tensor,  # [M, N], N contiguous
    residual: torch.Tensor | None,  # like x, or None (the norm alone)
    weight: torch.Tensor,  # [N]
    eps: float,
    rows: int | None = None,
) -> QuantizedRows:
    """``quantize_per_token(norm)`` where ``norm`` is kernels/rmsnorm.py's ``rms_norm(x)`` or,
    with ``residual``, ``fused_add_rms_norm(x, residual)``'s normed value, in one kernel and bit
    for bit (the norm is not stored). ``residual`` becomes ``x + residual`` IN PLACE, as there;
    ``x`` is left as it is. ``rows``: as ``quantize_per_token``'s."""
    m, n = x.shape
    rows = m if rows is None else rows
    if (
        x.stride(1) != 1
        or x.dtype not in _ACT_DTYPES
        or weight.shape != (n,)
        or not weight.is_contiguous()
        or rows < m
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                      or residual.stride(1) != 1))
    ):  # fmt: skip
        raise ValueError(f"rms_norm_quant: x {tuple(x.shape)} {x.dtype} strides {x.stride()}, "
                         f"weight {tuple(weight.shape)}, rows {rows}")  # fmt: skip
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    per_program, warps = tile_config(block_n, x.element_size())
    if rows:
        res = x if residual is None else residual
        _rms_norm_quant_kernel[(triton.cdiv(rows, per_program),)](
            x,
            res,
            weight,
            q,
            scale,
            m,
            rows,
            x.stride(0),
            res.stride(0),
            q.stride(0),
            eps,
            N=n,
            BLOCK_N=block_n,
            ROWS=per_program,
            HAS_RESIDUAL=residual is not None,
            MIN_AMAX_=MIN_AMAX,
            FP8_MAX_=FP8_MAX,
            num_warps=warps,
            **pdl.launch_options(x.device),
        )
    return QuantizedRows(q, scale, m)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
