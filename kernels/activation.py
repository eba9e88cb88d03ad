"""SiLU-and-multiply, the gated MLP's activation (Triton), and the plain-torch reference.

``x`` is the fused gate/up projection, ``[T, 2I]``: gate = ``x[:, :I]``, up = ``x[:, I:]``;
``out[t, i] = silu(gate[t, i]) * up[t, i]``, computed in fp32 and rounded once (the plain model
rounds ``silu(gate)`` to the dtype before the multiply, so in bf16 the two differ by about 1 ulp
on some elements). Grid ``(T, cdiv(I, BLOCK))``: program ``(t, j)`` owns columns
``[j * BLOCK, (j + 1) * BLOCK)`` of row ``t``::

    x[t]   | gate: j*BLOCK ... | ... | up: I + j*BLOCK ... |     ->   out[t, j*BLOCK ...]

``BLOCK`` follows the shape: small for decode (a 1-row input still spreads over many SMs), up
to 1024 for prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import start as pdl_start

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def silu_mul_f32(gate, up):
    """``silu(gate) * up`` of fp32 values, the one expression of every kernel that computes the
    activation (here, kernels/gemv.py's gated epilogues, kernels/fp8_quant.py's
    ``silu_mul_quant``), so all of them round the same value."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * x_stride
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_f32(gate, up)
    tl.store(out_ptr + t * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I], last dim contiguous
    out: torch.Tensor | None = None,  # [T, I], last dim contiguous; new contiguous when None
) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` into ``out`` (returned)."""
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in _DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [T, 2I] of one of {_DTYPES} with a contiguous last dim, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    elif out.shape != (t, inter) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{t}, {inter}] {x.dtype} with a contiguous last dim, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if out.numel() == 0:
        return out
    block, num_warps = _config(t, inter)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        num_warps=num_warps,
        **pdl.launch_options(x.device),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: fp32 math, one rounding to the dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _config(num_tokens: int, inter: int) -> tuple[int, int]:
    """Columns a program, about ``T * I / 512`` clamped to [128, 1024] (a 1-row input with
    I = 14336 gets 112 programs of 128 columns; from 64 rows on, programs of 1024 columns), and
    one warp per 128 columns (at most 8). Swept on an H100 (128-2048 columns, 1-8 warps): within
    7% of the best at T = 1, 64, 4096."""
    want = triton.next_power_of_2(max(1, num_tokens * inter // 512))
    block = max(128, min(1024, want, triton.next_power_of_2(inter)))
    return block, max(1, min(8, block // 128))
