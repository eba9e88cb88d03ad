"""kernels/token_bitmask.py against its reference and against the bits themselves (CPU: Triton
interpreter, small odd shapes; tests/gpu runs the engine's CUDA path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref


def random_bitmask(k: int, vocab: int, density: float, seed: int) -> tuple[torch.Tensor, list]:
    """A [k, words] int32 bitmask and, per row, the allowed token ids it encodes."""
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    allowed = [np.flatnonzero(rng.random(vocab) < density) for _ in range(k)]
    bits = np.zeros((k, words * 32), dtype=np.uint8)
    for j, ids in enumerate(allowed):
        bits[j, ids] = 1
    bits[:, vocab:] = rng.integers(0, 2, (k, words * 32 - vocab))  # bits past the vocabulary
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy()), allowed


@pytest.mark.parametrize(
    ("n_rows", "vocab", "rows", "density"),
    [(1, 32, [0], 0.5), (5, 1000, [4, 0, 2], 0.1), (3, 2049, [1, 2], 0.9), (4, 37, [3], 0.0)],
)
def test_kernel_matches_the_reference_and_the_bits(n_rows, vocab, rows, density):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n_rows, vocab + 5, generator=g)[:, 5:]  # strided rows
    bitmask, allowed = random_bitmask(len(rows), vocab, density, seed=vocab)
    index = torch.tensor(rows)
    got = apply_token_bitmask_(logits.clone(), bitmask, index)
    ref = apply_token_bitmask_ref(logits.clone(), bitmask, index)
    assert torch.equal(got, ref)
    for k, r in enumerate(rows):
        kept = torch.isfinite(got[r]).nonzero().flatten().numpy()
        assert np.array_equal(kept, allowed[k])
        assert torch.equal(got[r, kept], logits[r, kept])  # the allowed logits are untouched
    for r in set(range(n_rows)) - set(rows):
        assert torch.equal(got[r], logits[r])  # rows without a mask are untouched


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask_(
            torch.zeros(2, 64),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask_(
            torch.zeros(2, 64),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.long),
        )
