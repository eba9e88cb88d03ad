"""The Triton paged decode attention kernel against its plain-torch reference, on CPU in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU): tiny odd shapes, shuffled
block tables, every split path, fp8 caches with their scales. bf16 is covered by tests/gpu only:
the interpreter's ``tl.dot`` returns garbage for bf16 operands (Triton 3.6)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import quantize_fp8
from kernels.paged_decode_attention import (
    FP8_CONFIG,
    FP8_LARGE_GRID_CONFIG,
    FP8_SMALL_GRID_CONFIG,
    _launch,
    default_num_splits,
    launch_config,
    paged_decode_attention,
    paged_decode_attention_ref,
)

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float16: {"rtol": 5e-3, "atol": 2e-3}}


def make_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed, spare_blocks=3):
    """Random q and a paged cache: K/V are views ``cache[0]``, ``cache[1]`` of one
    ``[2, KVH, slots, D]`` tensor, each sequence's blocks drawn from a shuffled pool, table rows
    padded with other valid block ids. Slots no sequence uses hold NaN: reading one shows."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    need = [(int(n) + block_size - 1) // block_size for n in lens]
    width = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    cache = torch.full((2, kv_heads, num_blocks * block_size, head_dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.empty(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[used : used + n]
        tables[i, n:] = order[torch.randint(num_blocks, (width - n,), generator=g)]
        pos = torch.arange(int(lens[i]))
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        cache[:, :, slots] = torch.randn(2, kv_heads, len(slots), head_dim, generator=g).to(dtype)
        used += n
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, cache[0], cache[1], tables, lens


def dense_attention(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Independent of the reference: gather the padded context per sequence with an explicit
    slot list, mask the tail, GQA by reshaping q to [KVH, G, D], plain softmax in float64."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        slots = [int(blk) * block_size + o for blk in tables[b] for o in range(block_size)]
        k = k_cache[:, slots].double()  # [KVH, W * bs, D]
        v = torch.nan_to_num(v_cache[:, slots].double())
        qg = q[b].double().view(kv_heads, heads // kv_heads, head_dim)
        scores = qg @ k.transpose(1, 2) * scale  # [KVH, G, W * bs]
        scores[..., int(lens[b]) :] = float("-inf")
        out[b] = (torch.softmax(scores, -1) @ v).reshape(heads, head_dim)
    return out


def test_reference_matches_dense_softmax():
    q, k, v, tables, lens = make_case([1, 5, 17, 40], 8, 2, 16, 4, torch.float32, seed=1)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, 4, 0.3)
    dense = dense_attention(q, k, v, tables, lens, 4, 0.3)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-5, atol=1e-6)


CASES = [
    # dtype, heads, kv_heads, head_dim, block_size, lens, num_splits, block_n
    (torch.float32, 2, 2, 64, 1, [1, 3, 17, 45], 1, 16),  # MHA, one slot per block
    (torch.float32, 2, 2, 64, 1, [1, 3, 17, 45], 3, 16),
    (torch.float32, 8, 2, 128, 16, [1, 17, 45, 130], 2, 32),  # GQA 4
    (torch.float32, 4, 1, 16, 4, [3, 45, 130], 7, 16),  # MQA, more splits than tiles of len 3
    (torch.float32, 4, 1, 16, 32, [1, 31, 33, 64], 3, 16),  # block larger than the tile
    (torch.float32, 6, 2, 16, 16, [16, 32, 48, 96], 2, 16),  # lengths = whole blocks / tiles
    (torch.float16, 8, 2, 64, 4, [1, 17, 45], 3, 16),
    (torch.float16, 8, 2, 16, 16, [2, 45, 130], 1, 64),
    (torch.float16, 4, 4, 128, 32, [7, 70], 7, 32),
]


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size", "lens", "num_splits", "block_n"),
    CASES,
)
def test_matches_reference(dtype, heads, kv_heads, head_dim, block_size, lens, num_splits, block_n):
    seed = heads * 1000 + head_dim * 10 + block_size + num_splits
    q, k, v, tables, lens = make_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    got = _launch(q, k, v, tables, lens, block_size, scale, num_splits=num_splits, block_n=block_n)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, block_size, scale)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, ref, **TOL[dtype])


# fp8 caches: q dtype, heads, kv heads, head dim, block size, lens, splits, tile, k / v scales
FP8_CASES = [
    (torch.float32, 8, 2, 64, 16, [1, 17, 45], 1, 32, 0.01, 0.02),  # direct, GQA 4
    (torch.float32, 4, 1, 16, 4, [3, 45, 130], 3, 16, 0.05, 1.0),  # splits, MQA
    (torch.float16, 8, 2, 64, 4, [1, 17, 45], 2, 16, 0.02, 0.01),
    (torch.float16, 4, 4, 32, 32, [7, 70], 1, 16, 1.0, 1.0),  # MHA, the default scales
]


def fp8_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed, k_scale, v_scale):
    """``make_case`` with its cache quantized as the engine stores it (value / scale in e4m3):
    q, the fp8 K and V caches, the unquantized caches (fp32), tables, lens."""
    q, k, v, tables, lens = make_case(
        lens, heads, kv_heads, head_dim, block_size, torch.float32, seed
    )
    k8, v8 = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)  # unused slots stay NaN
    return q.to(dtype), k8, v8, k, v, tables, lens


@pytest.mark.parametrize(
    (
        "dtype",
        "heads",
        "kv_heads",
        "head_dim",
        "block_size",
        "lens",
        "splits",
        "block_n",
        "ks",
        "vs",
    ),
    FP8_CASES,
)
def test_fp8_cache_matches_dequantized_reference(
    dtype, heads, kv_heads, head_dim, block_size, lens, splits, block_n, ks, vs
):
    """Against the reference over the same fp8 cache dequantized (``fp8 * scale`` in fp32): the
    kernel's upcast is exact, so only the dtype's own rounding differs (the non-fp8 tolerance).
    Against attention over the unquantized cache: e4m3 keeps 3 mantissa bits (relative error up
    to 1/16 per element), so outputs of unit-scale attention agree to about 0.1."""
    seed = heads + head_dim + block_size + splits
    args = (lens, heads, kv_heads, head_dim, block_size, dtype, seed, ks, vs)
    q, k8, v8, k, v, tables, lens = fp8_case(*args)
    scale = head_dim**-0.5
    got = _launch(
        q, k8, v8, tables, lens, block_size, scale, num_splits=splits, block_n=block_n,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    ref = paged_decode_attention_ref(q, k8, v8, tables, lens, block_size, scale, ks, vs)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, ref, **TOL[dtype])
    unquantized = paged_decode_attention_ref(q.float(), k, v, tables, lens, block_size, scale)
    torch.testing.assert_close(got.float(), unquantized, rtol=0, atol=0.25)
    assert (got.float() - unquantized).abs().mean() < 0.03


def test_fp8_scales_are_applied_not_ignored():
    """The same values stored at two scales read back the same; read with the wrong scale
    they do not (each of K and V)."""
    q, _, _, k, v, tables, lens = fp8_case([9, 40], 4, 2, 16, 8, torch.float32, 5, 1.0, 1.0)
    k, v = k.nan_to_num() * 8, v.nan_to_num() * 8  # larger than 1: scale 1/8 would clamp at 448
    out = {}
    for ks, vs in ((0.25, 0.5), (0.125, 0.0625)):
        k8, v8 = quantize_fp8(k, ks), quantize_fp8(v, vs)
        out[ks, vs] = paged_decode_attention(
            q, k8, v8, tables, lens, 8, 0.25, k_scale=ks, v_scale=vs
        )
        wrong_k = paged_decode_attention(
            q, k8, v8, tables, lens, 8, 0.25, k_scale=ks * 2, v_scale=vs
        )
        wrong_v = paged_decode_attention(
            q, k8, v8, tables, lens, 8, 0.25, k_scale=ks, v_scale=vs * 2
        )
        assert not torch.allclose(wrong_k, out[ks, vs], atol=0.05)
        torch.testing.assert_close(wrong_v, out[ks, vs] * 2)
    # power-of-two scales: the fp8 values differ by an exponent only, the dequantized are equal
    torch.testing.assert_close(out[0.25, 0.5], out[0.125, 0.0625], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_caches_of_q_dtype_ignore_the_scales(dtype, num_splits):
    """The fp8 branch is a constexpr: a cache in q's dtype compiles the kernel it always did,
    and scales passed with it change no bit of the output (bf16: tests/gpu)."""
    q, k, v, tables, lens = make_case([5, 33, 70], 8, 2, 32, 16, dtype, seed=4)
    plain = _launch(q, k, v, tables, lens, 16, 0.2, num_splits=num_splits, block_n=16)
    scaled = _launch(
        q, k, v, tables, lens, 16, 0.2, num_splits=num_splits, block_n=16, k_scale=3.0, v_scale=0.5
    )
    assert torch.equal(plain, scaled)


@pytest.mark.parametrize("num_splits", [None, 1, 2])
def test_strided_q_and_out(num_splits):
    """q a slice of a fused qkv row, out a slice of a wider buffer, the public entry point."""
    heads, kv_heads, head_dim, bs = 4, 2, 16, 8
    _, k, v, tables, lens = make_case([5, 19, 40], heads, kv_heads, head_dim, bs, torch.float32, 7)
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim)
    q = qkv[:, :heads]
    out_buf = torch.full((3, heads + 1, head_dim), 7.0)
    out = out_buf[:, 1:]
    got = paged_decode_attention(q, k, v, tables, lens, bs, 0.25, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    ref = paged_decode_attention_ref(q, k, v, tables, lens, bs, 0.25)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert (out_buf[:, 0] == 7.0).all()  # nothing written outside out


def test_context_beyond_the_table_is_clamped():
    q, k, v, tables, lens = make_case([9, 20], 2, 1, 16, 4, torch.float32, seed=3)
    capacity = tables.shape[1] * 4
    k.nan_to_num_(), v.nan_to_num_()
    got = paged_decode_attention(q, k, v, tables, lens + 1000, 4, 0.5, num_splits=2)
    full = torch.full_like(lens, capacity)
    ref = paged_decode_attention_ref(q, k, v, tables, full, 4, 0.5)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_default_num_splits_fills_the_gpu_from_shapes():
    assert default_num_splits(64, 8, 64, "cpu") == 1  # 512 programs already
    assert default_num_splits(1, 8, 512, "cpu") == 33  # 2 programs per SM of 132
    assert default_num_splits(1, 8, 4, "cpu") == 4  # at most one split per block
    assert default_num_splits(1, 1, 4096, "cpu") == 64  # capped


def test_fp8_tiles_follow_the_grid():
    """An fp8 cache's tiles by batch x kv heads, on the interpreter's 132 SMs: 64-token tiles
    below the SM count and from 12 programs an SM, 128-token tiles between; other caches keep
    one tile whatever the grid. A config is a fresh dict (callers may change it)."""
    fp8 = torch.float8_e4m3fn
    for programs, want in (
        (1 * 8, FP8_SMALL_GRID_CONFIG),
        (131, FP8_SMALL_GRID_CONFIG),
        (132, FP8_CONFIG),
        (128 * 8, FP8_CONFIG),  # 7.8 programs an SM: 128-token tiles measured faster
        (1583, FP8_CONFIG),
        (1584, FP8_LARGE_GRID_CONFIG),  # 12 an SM
        (256 * 8, FP8_LARGE_GRID_CONFIG),
        (None, FP8_CONFIG),
    ):
        got = launch_config(128, torch.bfloat16, fp8, programs, "cpu")
        assert got == want and got is not want, programs
    assert FP8_LARGE_GRID_CONFIG["block_n"] < FP8_CONFIG["block_n"]
    bf16 = {launch_config(128, torch.bfloat16, None, p, "cpu")["block_n"] for p in (8, 2048)}
    assert bf16 == {64}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q": torch.zeros(1, 4, 24)}, "head_dim"),
        ({"q": torch.zeros(1, 3, 16)}, "multiple of kv heads"),
        ({"q": torch.zeros(1, 4, 16, dtype=torch.float16)}, "k_cache, v_cache q's dtype"),
        ({"k": torch.zeros(2, 64, 16, dtype=torch.float8_e4m3fn)}, "or both"),  # v not fp8
        (
            {
                "k": torch.zeros(2, 64, 16).to(torch.float8_e4m3fn),
                "v": torch.zeros(2, 64, 16).to(torch.float8_e4m3fn),
                "k_scale": 0.0,
            },
            "k_scale",
        ),
        ({"tables": torch.zeros(1, 2)}, "int32"),
        ({"block_size": 12}, "power of two"),
        ({"q": torch.zeros(1, 16, 4).transpose(1, 2)}, "contiguous last dim"),
        ({"out": torch.zeros(1, 4, 8)}, "out must be"),
    ],
)
def test_rejects_bad_inputs(change, match):
    args = {
        "q": torch.zeros(1, 4, 16),
        "k": torch.zeros(2, 64, 16),
        "v": torch.zeros(2, 64, 16),
        "tables": torch.zeros(1, 2, dtype=torch.int32),
        "lens": torch.ones(1, dtype=torch.int32),
        "block_size": 16,
        "scale": 1.0,
        "out": None,
    } | change
    with pytest.raises(ValueError, match=match):
        scales = {n: args.pop(n) for n in ("k_scale", "v_scale") if n in args}
        paged_decode_attention(*args.values(), **scales)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    ("lens", "num_splits", "block_n"),
    [([1, 5, 16], 1, 16), ([37, 3], 4, 16), ([70, 64, 2], 3, 32), ([9], 8, 16)],
)
def test_the_first_tile_read_before_the_wait_changes_nothing(fp8, lens, num_splits, block_n):
    """``prefetch`` (the first tile's older tokens read before the PDL wait, its newest token
    after) gives the same output bit for bit as reading it all after: contexts whose newest
    token lies in the first tile or a later one, one-token contexts, empty splits (9 tokens in 8
    splits of 16) and an fp8 cache. On the CPU there is no wait; the order of reads and the
    merge of the newest row is what is checked here (tests/gpu: under PDL)."""
    q, k, v, tables, lens_t = make_case(lens, 8, 2, 32, 4, torch.float32, seed=len(lens))
    if fp8:
        k, v = quantize_fp8(k, 0.5), quantize_fp8(v, 0.25)
    args = (q, k, v, tables, lens_t, 4, 0.3)
    kw = {"num_splits": num_splits, "block_n": block_n}
    if fp8:
        kw.update(k_scale=0.5, v_scale=0.25)
    after = _launch(*args, **kw, prefetch=False)
    before = _launch(*args, **kw, prefetch=True)
    assert not before.isnan().any()
    assert torch.equal(before, after)
