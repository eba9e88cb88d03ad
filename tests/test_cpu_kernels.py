"""The native CPU decode kernel against its plain-torch reference, on random odd sizes."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.paged_decode import load_kernel, paged_decode_attention, paged_decode_attention_ref

pytestmark = pytest.mark.skipif(
    load_kernel() is None, reason="no C++ toolchain to build the kernel"
)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # head_dim 64 with up to 4 query heads a kv head takes the AVX-512 one-pass path (16
    # positions at a time, never across a block: blocks of 8 and 32 cut those runs short)
    [(9, 3, 64, 16), (4, 2, 64, 8), (12, 3, 64, 32), (4, 4, 128, 8), (8, 1, 64, 1), (6, 2, 32, 32)],
)
def test_matches_reference(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    num_blocks = 64
    k = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g)
    v = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 77])
    lens = lens.clamp(max=num_blocks * block_size // len(lens))
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k, v, tables, lens, block_size, scale)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, block_size, scale)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_long_context_split_over_threads_matches_reference(batch):
    """With fewer (sequence, kv head) pairs than twice the threads (batch 1 on two cores)
    each context is cut in parts computed apart and merged (flash-
    decoding's rescaling); one far larger score makes the parts' maxima differ by a lot."""
    g = torch.Generator().manual_seed(batch)
    block_size, num_blocks = 16, 160
    k = torch.randn(3, num_blocks * block_size, 64, generator=g)
    v = torch.randn(3, num_blocks * block_size, 64, generator=g)
    q = torch.randn(batch, 9, 64, generator=g)
    lens = torch.tensor([1200, 999][:batch])
    tables = torch.randperm(num_blocks, generator=g)[: batch * 75].view(batch, 75)
    # position 3 of sequence 0, in the first part: a key its first query heads favour by far
    k[0, tables[0, 0] * block_size + 3] = q[0, 0] * 4
    got = paged_decode_attention(q, k, v, tables, lens, block_size, 0.125)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, block_size, 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_context_longer_than_table_is_an_error():
    k = torch.zeros(1, 32, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        paged_decode_attention(q, k, k, torch.tensor([[0]]), torch.tensor([17]), 16, 1.0)


def test_rejects_non_fp32():
    k = torch.zeros(1, 32, 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp32 only"):
        paged_decode_attention(q, k, k, torch.tensor([[0]]), torch.tensor([1]), 16, 1.0)


@pytest.mark.parametrize("onednn", [True, False])
def test_cpu_linears_match_f_linear(onednn) -> None:
    """The CPU layouts (oneDNN-prepacked, else MKL-packed / transposed) compute F.linear: every
    row count (decode to prefill), with and without bias, 2-D and 3-D inputs; the LM head too."""
    from torch import nn

    from engine.cpu_layout import OneDNNLinear, onednn_available, use_cpu_linears

    if onednn and not onednn_available():
        pytest.skip("torch without oneDNN")
    torch.manual_seed(0)
    model = nn.Module()
    model.proj = nn.Linear(96, 160, bias=True)
    model.lm_head = nn.Linear(96, 500, bias=False)
    ref = {name: (m.weight.detach().clone(), m.bias) for name, m in model.named_children()}
    assert use_cpu_linears(model, onednn=onednn) == 2
    assert isinstance(model.proj, OneDNNLinear) == onednn
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96)
        for name, (w, b) in ref.items():
            want = torch.nn.functional.linear(x, w, b)
            got = getattr(model, name)(x)
            # fp32 sums of 96 products of N(0,1)-scaled terms: a few ulps of the largest partial
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 5, 96)
    torch.testing.assert_close(
        model.proj(x3), torch.nn.functional.linear(x3, *ref["proj"]), rtol=1e-5, atol=1e-4
    )


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    """torch's build lock (a file in the build folder, taken even to load a finished build)
    outlives a process killed while building; the next worker must load the kernel anyway."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    build = Path(_get_build_directory("tandem_paged_decode_cpu", verbose=False))
    (build / "lock").touch()  # what a builder killed mid-build leaves
    root = Path(__file__).resolve().parents[1]
    code = "from kernels.cpu.paged_decode import load_kernel; assert load_kernel() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=240, check=True)
    assert not (build / "lock").exists()
