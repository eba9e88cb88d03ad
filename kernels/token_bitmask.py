"""Grammar masks on the logits (structured outputs): tokens a row's bitmask forbids get -inf,
in place (Triton), and the plain-torch reference (the CPU path).

The bitmask is what the grammar engine fills on the host (engine/grammar.py): one int32 word
per 32 tokens, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed. Mask row
``k`` applies to logits row ``rows[k]`` (only the constrained rows of a batch have one)::

    bitmask[k] | w0: tokens 0..31 | w1: 32..63 | ...        ->  logits[rows[k], t] = -inf
                  bit t % 32 of word t // 32 == 0                 where the bit is 0

Grid ``(K, cdiv(V, BLOCK))``: program ``(k, j)`` reads the ``BLOCK / 32`` words of its column
block and writes -inf only where a bit is 0 (no read of the logits). The only integer that
changes from step to step is ``K``, a grid dimension; the rest is fixed per model, so one
variant serves (``warm_up`` launches it at start).

The reference needs no Triton (a CPU install has none): the sampler's CPU path imports it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the reference only
    triton = None

_BLOCK = 1024

if triton is not None:

    @triton.jit(do_not_specialize=["vocab", "logits_stride", "mask_stride"])
    def _apply_token_bitmask_kernel(
        logits_ptr,
        mask_ptr,
        rows_ptr,
        vocab,
        logits_stride,
        mask_stride,
        BLOCK: tl.constexpr,
    ):
        k = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        words = tl.load(mask_ptr + k * mask_stride + cols // 32, mask=inside, other=-1)
        forbidden = ((words >> (cols % 32)) & 1) == 0
        row = tl.load(rows_ptr + k).to(tl.int64)
        neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + cols, neg_inf, mask=inside & forbidden)


def apply_token_bitmask_(
    logits: torch.Tensor,  # [R, V] float, last dim contiguous; written in place
    bitmask: torch.Tensor,  # [K, W] int32 on the same device, W >= cdiv(V, 32)
    rows: torch.Tensor,  # [K] integer: the logits row of each mask row
) -> torch.Tensor:
    """Set ``logits[rows[k], t]`` to -inf where bit ``t`` of ``bitmask[k]`` is 0; returns
    ``logits``."""
    _check(logits, bitmask, rows)
    k, vocab = bitmask.shape[0], logits.shape[1]
    if k == 0 or vocab == 0:
        return logits
    grid = (k, -(-vocab // _BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK
    )
    return logits


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Plain torch, in place, any device: unpack the words' bits (LSB first) into a bool mask
    of the constrained rows and fill -inf where it is 0."""
    _check(logits, bitmask, rows)
    vocab = logits.shape[1]
    if bitmask.shape[0] == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [K, W, 32]
    forbidden = bits.view(bitmask.shape[0], -1)[:, :vocab] == 0
    index = rows.to(torch.long)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits


def warm_up(vocab: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """Launch the kernel once (CUDA), so no variant compiles while serving."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32, device=device)
    apply_token_bitmask_(logits, bitmask, torch.ones(1, dtype=torch.long, device=device))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be [R, V] floating point with a contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    words = (logits.shape[1] + 31) // 32
    if (
        bitmask.dim() != 2
        or bitmask.dtype != torch.int32
        or bitmask.stride(1) != 1
        or bitmask.shape[1] < words
    ):
        raise ValueError(
            f"bitmask must be [K, >= {words}] int32 with a contiguous last dim, got "
            f"{tuple(bitmask.shape)} {bitmask.dtype}"
        )
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0] or rows.is_floating_point():
        raise ValueError(
            f"rows must be [K={bitmask.shape[0]}] integer, got {tuple(rows.shape)} {rows.dtype}"
        )
    if not (logits.device == bitmask.device == rows.device):
        raise ValueError(
            f"logits, bitmask and rows must be on one device, got {logits.device}, "
            f"{bitmask.device}, {rows.device}"
        )
