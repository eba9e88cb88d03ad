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

    from kernels.cpu.native import _NAME

    build = Path(_get_build_directory(_NAME, verbose=False))
    (build / "lock").touch()  # what a builder killed mid-build leaves
    root = Path(__file__).resolve().parents[1]
    code = "from kernels.cpu.paged_decode import load_kernel; assert load_kernel() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=240, check=True)
    assert not (build / "lock").exists()


def _ops():
    from engine.ops import CpuOps, TorchOps

    return CpuOps(load_kernel()), TorchOps()


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: rows spread over the OpenMP threads
def test_fused_norms_match_torch_ops(rows):
    """RMSNorm and the add folded into it, against TorchOps: the sum of squares is summed in
    another order (in double), so a few ulps apart; the residual becomes ``x + residual``
    exactly, in place; odd widths take the scalar tail."""
    cpu, ref = _ops()
    g = torch.Generator().manual_seed(rows)
    for width in (576, 100):
        x = torch.randn(rows, width, generator=g) * 3
        residual = torch.randn(rows, width, generator=g)
        w = torch.randn(width, generator=g)
        torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
        want, want_sum = ref.add_rms_norm(x, residual, w, 1e-5)
        before = residual.clone()
        got, got_sum = cpu.add_rms_norm(x, residual, w, 1e-5)
        assert got_sum is residual and torch.equal(residual, x + before)
        torch.testing.assert_close(got, want)


def test_fused_rotary_is_bit_identical_to_torch_ops():
    """q and k as the attention projects them (views of one fused qkv row), rotated in place by
    position: the very bits TorchOps' ``q * cos + rotate_half(q) * sin`` gives."""
    from engine.config import RopeConfig
    from engine.models.llama import RotaryEmbedding

    cpu, ref = _ops()
    rotary = RotaryEmbedding(64, 4096, RopeConfig(theta=10000.0))
    rotary.build(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in (1, 37):
        qkv = torch.randn(t, (9 + 2 * 3) * 64, generator=g)
        positions = torch.randint(0, 4096, (t,), generator=g)
        q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        q, k = q.view(t, 9, 64), k.view(t, 3, 64)
        want_q, want_k = ref.apply_rotary(q, k, ref.rope_state(rotary, positions, torch.float32))
        got_q, got_k = cpu.apply_rotary(q, k, cpu.rope_state(rotary, positions, torch.float32))
        assert got_q.data_ptr() == qkv.data_ptr()  # in place
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_fused_rotary_refuses_a_position_past_its_table():
    kernel = load_kernel()
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    cos = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="position out of range"):
        kernel.rotary(q, k, torch.tensor([4]), cos, cos)


@pytest.mark.parametrize("rows", [1, 33])
def test_fused_silu_and_mul_matches_torch_ops(rows):
    """silu(gate) * up with a polynomial e^x: within a few ulps of torch's, over gates from
    deep negative (e^-g overflows to inf: silu -> -0) to large."""
    cpu, ref = _ops()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 1536 + 2 * 7, generator=g) * 8  # 1543 wide: a scalar tail
    x[0, :4] = torch.tensor([-200.0, -88.0, 90.0, 0.0])
    torch.testing.assert_close(cpu.silu_and_mul(x), ref.silu_and_mul(x), rtol=2e-6, atol=1e-6)


def test_cpu_ops_leave_what_they_do_not_cover_to_torch():
    """Per-head norms (Qwen3's q_norm: 3-D, strided) and bf16 go through TorchOps unchanged."""
    cpu, ref = _ops()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4 * 32 + 64, generator=g)[:, :128].view(3, 4, 32)
    w = torch.randn(32, generator=g)
    assert torch.equal(cpu.rms_norm(q, w, 1e-6), ref.rms_norm(q, w, 1e-6))
    x = torch.randn(2, 64, generator=g).bfloat16()
    assert torch.equal(cpu.silu_and_mul(x), ref.silu_and_mul(x))


# -- causal prefill attention (kernels/cpu/prefill_attention.cpp) -----------------------------


def _prefill_ref(q, k, v, start, scale):
    """Causal attention in float64 through torch's SDPA with an explicit mask."""
    n = q.shape[0]
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(),
        k[None, :, : start + n].double(),
        v[None, :, : start + n].double(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[1],
    )
    return o[0].transpose(0, 1).float()


def _native_prefill(head_dim: int):
    kernel = load_kernel()
    if not kernel.prefill_attention_supported(head_dim):
        pytest.skip("this build has no native prefill attention for this head size (AVX-512)")
    return kernel


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # 4 query heads a task at most: 7 over 1 runs as 4 + 3, 12 over 1 as 4 + 4 + 4
    [(4, 2, 16), (9, 3, 64), (8, 8, 32), (7, 1, 128), (12, 1, 64)],
)
@pytest.mark.parametrize(("n", "start"), [(1, 0), (15, 0), (17, 0), (130, 0), (33, 64), (70, 91)])
def test_prefill_attention_matches_reference(heads, kv_heads, head_dim, n, start):
    """Strided as the engine passes them: q a slice of the packed qkv rows, k and v the chunk's
    rows transposed to [KVH, L, D] (with keys past start + n that no query may see), out rows of
    a wider buffer."""
    kernel = _native_prefill(head_dim)
    g = torch.Generator().manual_seed(n * 131 + start + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(start + n + 5, width, generator=g)
    q = qkv[start : start + n, : heads * head_dim].view(n, heads, head_dim)
    kv = qkv[:, heads * head_dim :].view(-1, 2 * kv_heads, head_dim).transpose(0, 1)
    k, v = kv[:kv_heads], kv[kv_heads:]
    out = torch.full((n + 2, heads * head_dim), float("nan"))
    rows = out[1 : n + 1]
    kernel.prefill_attention(q, k, v, start, head_dim**-0.5, rows.view(n, heads, head_dim))
    torch.testing.assert_close(
        rows.view(n, heads, head_dim), _prefill_ref(q, k, v, start, head_dim**-0.5),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    assert out[0].isnan().all() and out[-1].isnan().all(), "wrote outside its rows"


def test_prefill_attention_rescales_when_a_later_block_holds_the_maximum():
    """Keys come in blocks of 64 with an online softmax: a far larger score in the third block
    (and a smaller peak in the first) makes every earlier partial sum be rescaled."""
    kernel = _native_prefill(64)
    g = torch.Generator().manual_seed(7)
    n = 200
    q = torch.randn(n, 9, 64, generator=g)
    k, v = torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)
    k[0, 150] = q[180, 0] * 3  # query 180 of head 0 favours key 150 by far
    k[1, 10] = q[199, 4] * 2
    out = torch.empty(n, 9, 64)
    kernel.prefill_attention(q, k, v, 0, 0.125, out)
    torch.testing.assert_close(out, _prefill_ref(q, k, v, 0, 0.125), rtol=1e-5, atol=1e-5)


def test_prefill_attention_rejects_bad_input():
    kernel = load_kernel()
    q = torch.zeros(4, 2, 16)
    with pytest.raises(RuntimeError, match="bad shapes"):  # 4 queries from 3 over 5 keys
        kernel.prefill_attention(q, torch.zeros(1, 5, 16), torch.zeros(1, 5, 16), 3, 1.0, q)
    with pytest.raises(RuntimeError, match="fp32 only"):
        kv = torch.zeros(1, 4, 16, dtype=torch.float64)
        kernel.prefill_attention(q, kv, kv, 0, 1.0, q)
    if kernel.prefill_attention_supported(16):
        assert not kernel.prefill_attention_supported(24)
        with pytest.raises(RuntimeError, match="unsupported head_dim"):
            q24 = torch.zeros(4, 2, 24)
            kernel.prefill_attention(q24, torch.zeros(1, 4, 24), torch.zeros(1, 4, 24), 0, 1.0, q24)
