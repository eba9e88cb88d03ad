"""RMSNorm, alone and with the residual add folded in (Triton), and the plain-torch references.

Math, in the order of ``RMSNorm`` in engine/models/llama.py (HF Llama's)::

    s   = x + residual                          (fused variant only; rounded to the dtype)
    y   = round(s_fp32 * rsqrt(mean(s_fp32**2) + eps))      normalised in fp32, rounded
    out = round(y_fp32 * weight_fp32)                        one multiply, rounded once

Each rounding is one the plain model makes too (``x + residual`` in the dtype, ``.to(dtype)``,
``weight * x`` in the dtype: torch computes a bf16/fp16 product in fp32 and rounds once), so the
only differences left are the order of the sum of squares and the GPU's approximate ``rsqrt``
(about 1 ulp of fp32): after rounding to bf16 an element differs by at most 1 ulp of bf16, and
rarely. The output has the dtype of ``x``, also when ``weight`` has another.

Rows: ``x`` is ``[..., N]``, normalised over the last dimension. The leading dimensions are seen
as ``[A, B]`` (``[T, 1]`` for ``[T, N]``, ``[T, heads]`` for Qwen3's per-head q/k norm of
``[T, heads, D]``), so strided views such as q of a fused qkv output need no copy::

    row r = a * B + b   ->   x + a * stride(-3) + b * stride(-2) + [0, N)

A program normalises ``ROWS`` rows at once (one row of ``BLOCK_N = next_pow2(N)`` when N is
large, up to 8 when N is a head dimension), each row wholly in registers, read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import start as pdl_start

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements a program holds when rows are short: ROWS = _TILE // BLOCK_N


@triton.jit(do_not_specialize=["num_rows"])  # varies per step: one variant for every count
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    inner,  # B: rows r -> (r // B, r % B)
    x_s0,
    x_s1,
    r_s0,
    r_s1,
    o_s0,
    o_s1,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    a, b = rows // inner, rows % inner
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x_offs = (a * x_s0 + b * x_s1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = add_residual(x, res_ptr + (a * r_s0 + b * r_s1)[:, None] + cols[None, :], mask)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    o_offs = (a * o_s0 + b * o_s1)[:, None] + cols[None, :]
    tl.store(out_ptr + o_offs, normalize_rows(x, w, eps, N, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_residual(x, res_at, mask):
    """``x`` (fp32) plus the residual at the pointers ``res_at``, rounded to the residual's
    dtype as the model rounds the sum, stored back there (vLLM's in-place convention); returns
    the sum in fp32 (also kernels/fp8_quant.py's norm that quantizes its output)."""
    r = tl.load(res_at, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(res_at.dtype.element_ty)
    tl.store(res_at, s, mask=mask)
    return s.to(tl.float32)


@triton.jit
def normalize_rows(x, w, eps, N: tl.constexpr, dtype: tl.constexpr):
    """Rows of ``x`` (fp32 ``[ROWS, BLOCK_N]``, zeros past ``N``) normalised and scaled by ``w``
    (fp32 ``[BLOCK_N]``) in ``dtype``, rounded where the module docstring says: the one
    definition of the arithmetic (also kernels/fp8_quant.py's norm that quantizes its output)."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = (x * rstd[:, None]).to(dtype).to(tl.float32)
    return (y * w[None, :]).to(dtype)


def rms_norm(
    x: torch.Tensor,  # [..., N], last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    out: torch.Tensor | None = None,  # like x (any strides, last dim contiguous); may be x
) -> torch.Tensor:
    """RMSNorm over the last dimension into ``out`` (a new contiguous tensor when None)."""
    _check(x, weight, "x")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _check_like(out, x, "out")
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., N]
    residual: torch.Tensor,  # like x
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, both IN PLACE (vLLM's convention): ``residual``
    becomes the sum (rounded to the dtype) and ``x`` its normed value; returns ``(x, residual)``.
    ``x`` and ``residual`` must not overlap."""
    _check(x, weight, "x")
    _check_like(residual, x, "residual")
    _launch(x, residual, weight, x, eps)
    return x, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, the structure of engine/models/llama.py's ``RMSNorm``, output in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)).to(dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, new tensors (nothing in place): ``(rms_norm_ref(x + residual), x + residual)``."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def _launch(x, residual, weight, out, eps) -> None:
    n = x.shape[-1]
    if x.numel() == 0:
        return
    x3, o3 = _rows(x), _rows(out)
    r3 = x3 if residual is None else _rows(residual)
    num_rows, inner = x3.shape[0] * x3.shape[1], x3.shape[1]
    block_n = triton.next_power_of_2(n)
    rows, num_warps = tile_config(block_n, x.element_size())
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x3,
        r3,
        weight,
        o3,
        num_rows,
        inner,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        o3.stride(0),
        o3.stride(1),
        eps,
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
        **pdl.launch_options(x.device),
    )


def tile_config(block_n: int, elem_size: int) -> tuple[int, int]:
    """Rows a program (a tile of about ``_TILE`` elements when rows are short, at most 8 rows)
    and warps (one per KiB of the tile, 2 to 16). Swept on an H100 (1-64 rows, 1-16 warps; T =
    1, 64, 4096; N = 4096, 576, 128, 64): within 5% of the best everywhere."""
    rows = max(1, min(8, _TILE // block_n))
    return rows, max(2, min(16, rows * block_n * elem_size // 1024))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[A, B, N]`` view of ``[..., N]`` (never a copy: the kernel may write through it)."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError as exc:
        raise ValueError(
            f"the leading dims of {tuple(x.shape)} (strides {x.stride()}) beyond the last two "
            "cannot be merged without a copy; pass a [T, N] or [T, heads, N] view"
        ) from exc


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(
            f"{name} and weight must be one of {_DTYPES}, got {x.dtype}, {weight.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(f"{name} needs a contiguous last dimension and weight a contiguous [N]")


def _check_like(t: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if t.shape != x.shape or t.dtype != x.dtype:
        raise ValueError(
            f"{name} must match x: {tuple(x.shape)} {x.dtype}, got {tuple(t.shape)} {t.dtype}"
        )
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
