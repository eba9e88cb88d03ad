"""Greedy sampling's argmax over the vocabulary (Triton), in two launches::

    blocks kernel, grid (R, C)                        rows kernel, grid (R,)
    program (r, c): columns [c*BLOCK, (c+1)*BLOCK)    the C partial maxima of row r: the first
    of row r -> its max and its first column there     block holding the row's max gives its column

Ties go to the lowest column, as ``torch.max(dim).indices`` documents, so the two pick the same
token. Logits of any float dtype are compared as they are (bf16 logits need no fp32 copy: the
conversion is exact and keeps their order).

Why not ``torch.max``: for one row of 128k logits (batch-1 decode) its reduction ran 28 us on an
H100, against the ~2 us the bytes take (benchmarks/NOTES.md, "Every kernel against its floor");
a row is one reduction there, here it is spread over C programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import start as pdl_start

BLOCK = 4096  # columns a program: 32 programs a row for a 128k vocabulary


# Widths and strides vary with the vocabulary and the tensor parallel padding, row counts per step:
# none is specialised, so warm_up's launches are every variant (one per dtype).
@triton.jit(do_not_specialize=["n_cols", "stride_x"])
def _blocks_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_start(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = r * tl.num_programs(1) + c
    tl.store(val_ptr + out, best)
    tl.store(idx_ptr + out, c * BLOCK + at)


@triton.jit(do_not_specialize=["num_blocks"])
def _rows_kernel(val_ptr, idx_ptr, out_ptr, num_blocks, C_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    r = tl.program_id(0)
    c = tl.arange(0, C_PAD)
    ok = c < num_blocks
    vals = tl.load(val_ptr + r * num_blocks + c, mask=ok, other=float("-inf"))
    _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + r, tl.load(idx_ptr + r * num_blocks + first).to(tl.int64))


def argmax_rows(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` for ``logits`` ``[R, V]`` (last dim contiguous): int64
    ``[R]``, no host sync. A row of nothing but -inf gets column 0, as in torch."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(
            f"argmax_rows wants [R, V] floats with a contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows, n_cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_blocks = -(-n_cols // block)
    vals = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, num_blocks, dtype=torch.int32, device=logits.device)
    opts = pdl.launch_options(logits.device)
    _blocks_kernel[(rows, num_blocks)](
        logits, vals, idx, n_cols, logits.stride(0), BLOCK=block, num_warps=8, **opts
    )
    c_pad = max(2, triton.next_power_of_2(num_blocks))
    _rows_kernel[(rows,)](vals, idx, out, num_blocks, C_PAD=c_pad, num_warps=1, **opts)
    return out


def warm_up(vocab: int, device: torch.device, dtypes=(torch.float32,)) -> None:
    """Launch both kernels once per logits dtype (CUDA), so none compiles while serving: the
    model's dtype (greedy rows read the logits as the LM head leaves them) and float32 (rows
    the sampler copied to change them: penalties, grammars)."""
    for dtype in dict.fromkeys(dtypes):
        argmax_rows(torch.zeros(2, vocab, dtype=dtype, device=device))
