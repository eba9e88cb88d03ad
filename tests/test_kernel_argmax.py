"""kernels/argmax.py against ``torch.max(dim).indices`` (CPU: Triton interpreter, small shapes)."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab", "block"), [(1, 1000, 64), (3, 257, 32), (2, 64, 64)])
def test_argmax_rows_picks_torch_s_token(dtype, rows, vocab, block):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab + 5, generator=g).to(dtype)[:, :vocab]  # strided rows
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.max(dim=-1).indices)


def test_ties_go_to_the_lowest_column_across_blocks_and_within_one():
    x = torch.zeros(4, 300)
    x[0, [7, 100, 299]] = 5.0  # in three blocks of 64: the first block's
    x[1, [70, 71, 250]] = 5.0  # two in one block, one later
    x[2, :] = float("-inf")  # nothing but -inf: column 0, as torch
    x[3, [299]] = 1.0  # the last, partial block
    got = argmax_rows(x, block=64)
    assert got.tolist() == [7, 70, 0, 299] == x.max(dim=-1).indices.tolist()


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_rows(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="floats"):
        argmax_rows(torch.zeros(2, 6, dtype=torch.long))
