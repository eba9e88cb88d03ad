"""The fp8 KV cache (``kv_cache_dtype="fp8"``) on a CUDA GPU (run on the GPU machine; skipped
without CUDA).

    python -m pytest -q tests/gpu/test_kv_fp8_gpu.py

- the KV write rounds like torch: random inputs, scales that are not powers of two, every byte
  equal to ``quantize_fp8`` (the CPU tests can only feed exact values: the interpreter's
  fp32 -> fp8 rounding is wrong, kernels/kv_cache_write.py);
- decode and extend attention over fp8 caches, q in bf16 at serving shapes, against the
  reference over the same caches dequantized, within bf16's own tolerance;
- caches of q's dtype (bf16) give the same bits with and without scales passed (the fp8 branch
  is a compile-time constant);
- the receiver scatters fp8 layers on CUDA byte for byte;
- the engine on the Triton path (decode graphs) against the plain-torch backend, both fp8 over
  an fp32 model: the same definition by two implementations, so their logprobs agree closely.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.extend_attention import extend_attention, extend_attention_ref
from kernels.fp8 import FP8, quantize_fp8
from kernels.kv_cache_write import write_kv_cache
from kernels.paged_decode_attention import (
    _launch,
    paged_decode_attention,
    paged_decode_attention_ref,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REL, ATOL = 1e-2, 3e-2  # bf16: relative error of the whole output, and the worst element


def assert_close_bf16(got, ref):
    assert got.isfinite().all()
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < REL, f"relative error {rel:.2e}"
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.037, 1.3)])
def test_write_rounds_as_torch(dtype, k_scale, v_scale):
    g = torch.Generator(device="cuda").manual_seed(0)
    t, kv_heads, head_dim, slots = 333, 8, 128, 512
    k = (torch.randn(t, kv_heads, head_dim, device="cuda", generator=g) * 40).to(dtype)
    v = (torch.randn(t, kv_heads, head_dim, device="cuda", generator=g) * 3).to(dtype)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, 0.0], device="cuda").to(dtype)  # clamp, tiny
    slot_mapping = torch.randperm(slots, device="cuda", generator=g)[:t]
    slot_mapping[::5] = -1
    cache = torch.zeros(2, kv_heads, slots, head_dim, device="cuda", dtype=FP8)
    write_kv_cache(k, v, cache[0], cache[1], slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    for new, c, scale in ((k, cache[0], k_scale), (v, cache[1], v_scale)):
        want = quantize_fp8(new[keep].transpose(0, 1), scale)
        got = c.view(torch.uint8)[:, slot_mapping[keep]]  # bytes: indexing fp8 may lack kernels
        assert torch.equal(got, want.view(torch.uint8))
    skipped = torch.ones(slots, dtype=torch.bool, device="cuda")
    skipped[slot_mapping[keep]] = False
    assert not cache.view(torch.uint8)[:, :, skipped].any()


def fp8_paged(batch, max_ctx, kv_heads, head_dim, block_size, k_scale, v_scale, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    lens[0] = max_ctx
    width = -(-max_ctx // block_size)
    num_blocks = batch * width + 3
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[: batch * width]
    raw = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g, device="cuda")
    return fp8_cache(raw, k_scale, v_scale), tables.view(batch, width).to(torch.int32), lens


def fp8_cache(raw, k_scale, v_scale):
    """``[2, KVH, slots, D]`` as the engine stores it: K and V quantized with their scales."""
    parts = [quantize_fp8(raw[0], k_scale), quantize_fp8(raw[1], v_scale)]
    return torch.stack([p.view(torch.uint8) for p in parts]).view(FP8)


@pytest.mark.parametrize(
    ("batch", "max_ctx", "heads", "kv_heads", "head_dim", "block_size", "splits"),
    [
        (64, 2048, 32, 8, 128, 16, None),  # Llama-3-8B's heads, the default split count
        (4, 4096, 32, 8, 128, 16, 16),
        (7, 333, 16, 1, 64, 32, 3),  # MQA
    ],
)
@pytest.mark.parametrize("f16_dot", [False, True], ids=["bf16-dot", "f16-dot"])
def test_decode_over_fp8_cache(
    batch, max_ctx, heads, kv_heads, head_dim, block_size, splits, f16_dot
):
    """bf16 q over an fp8 cache, the products in bf16 or (``f16_dot``) in fp16: both within
    bf16's tolerance of the dequantized reference."""
    k_scale, v_scale = 0.02, 0.01
    cache, tables, lens = fp8_paged(batch, max_ctx, kv_heads, head_dim, block_size, k_scale,
                                    v_scale, seed=batch)  # fmt: skip
    q = torch.randn(batch, heads, head_dim, device="cuda").to(torch.bfloat16)
    got = _launch(q, cache[0], cache[1], tables, lens, block_size, head_dim**-0.5, None, splits,
                  k_scale=k_scale, v_scale=v_scale, f16_dot=f16_dot)  # fmt: skip
    assert got.dtype == torch.bfloat16
    ref = paged_decode_attention_ref(
        q, cache[0], cache[1], tables, lens, block_size, head_dim**-0.5, k_scale, v_scale
    )
    assert_close_bf16(got, ref)


def test_extend_over_fp8_prefix():
    bs, heads, kv_heads, head_dim = 16, 32, 8, 128
    lens, prefixes = [1024, 17, 300], [1024, 100, 0]
    k_scale, v_scale = 0.05, 0.02
    g = torch.Generator(device="cuda").manual_seed(1)
    total = sum(lens)
    width = max(-(-(p + n) // bs) for p, n in zip(prefixes, lens, strict=True))
    tables = torch.randperm(3 * width, device="cuda", generator=g).view(3, width).to(torch.int32)
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, device="cuda", generator=g)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    raw = torch.randn(2, kv_heads, 3 * width * bs, head_dim, device="cuda", generator=g)
    cache = fp8_cache(raw, k_scale, v_scale)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    pre = torch.tensor(prefixes, dtype=torch.int32, device="cuda")
    args = (q, k, v, cache[0], cache[1], tables, cu, pre)
    got = extend_attention(*args, max(lens), bs, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    ref = extend_attention_ref(*args, bs, head_dim**-0.5, k_scale, v_scale)
    assert_close_bf16(got, ref)


def test_bf16_caches_ignore_the_scales():
    cache, tables, lens = fp8_paged(16, 1000, 8, 128, 16, 1.0, 1.0, seed=3)
    bf16 = cache.to(torch.bfloat16)
    q = torch.randn(16, 32, 128, device="cuda").to(torch.bfloat16)
    plain = paged_decode_attention(q, bf16[0], bf16[1], tables, lens, 16, 0.088)
    scaled = paged_decode_attention(
        q, bf16[0], bf16[1], tables, lens, 16, 0.088, k_scale=0.3, v_scale=4.0
    )
    assert torch.equal(plain, scaled)
    ref = paged_decode_attention_ref(q, bf16[0], bf16[1], tables, lens, 16, 0.088)
    assert_close_bf16(plain, ref)
    tables1 = tables[:1]
    k = torch.randn(40, 8, 128, device="cuda").to(torch.bfloat16)
    q1 = torch.randn(40, 32, 128, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    pre = torch.tensor([500], dtype=torch.int32, device="cuda")
    args = (q1, k, k, bf16[0], bf16[1], tables1, cu, pre, 40, 16, 0.088)
    assert torch.equal(extend_attention(*args), extend_attention(*args, k_scale=0.3, v_scale=4.0))


def test_receiver_scatters_fp8_layers_on_cuda():
    from engine.kv_transfer.transport import KVReceiver, KVSpec

    spec = KVSpec(2, 2, 64, "float8_e4m3fn", block_size=16)
    caches = [torch.zeros(2, 2, 64 * 16, 64, device="cuda", dtype=FP8) for _ in range(2)]
    rx = KVReceiver(spec, caches, 16, lambda event: None)
    rx.expect("a", [9, 3, 40], 40)
    rx.expect("b", [7], 5)
    rx.cancel("b")  # its part of the payload is dropped: the rest is cut out (a cat of bytes)
    kv = (torch.randn(2, 2, 45, 64, device="cuda") * 10).to(FP8)
    rx.handle_layer(0, 0, [("b", 0, 5), ("a", 0, 40)], kv)
    torch.cuda.synchronize()
    slots = torch.tensor([[9, 3, 40][p // 16] * 16 + p % 16 for p in range(40)], device="cuda")
    got = caches[0].view(torch.uint8).index_select(2, slots)
    assert torch.equal(got, kv[:, :, 5:].view(torch.uint8))


def test_engine_triton_fp8_agrees_with_torch_fp8(tmp_path_factory, tiny_cfg, monkeypatch):
    """The Triton path (decode graphs, fp32 model) and the plain-torch backend implement one
    definition of the fp8 cache: first tokens equal, and the logprobs of the tokens both pick
    agree closely while their contexts do (rare differences: a k rounded to the other fp8
    neighbour after the two paths' own fp32 rounding)."""
    import transformers

    from engine import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = tiny_cfg(vocab_size=512, hidden_size=256, intermediate_size=512,
                   num_attention_heads=8, num_hidden_layers=4, num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-fp8-gpu")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(path)
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", backend)
        llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_dtype="fp8",
                  num_kv_blocks=128, max_num_batched_tokens=64,
                  enable_prefix_caching=False)  # fmt: skip
        assert llm.engine.runner.kv_caches[0].dtype == FP8
        assert (llm.engine.runner.graphs is not None) == (backend == "triton")
        outs[backend] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.engine.block_manager.check_invariant(expect_idle=True)
    diffs = []
    for a, b in zip(outs["triton"], outs["torch"], strict=True):
        assert a.token_ids[0] == b.token_ids[0]
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                break
            diffs.append(abs(a.logprobs[i][x] - b.logprobs[i][y]))
    assert len(diffs) >= 2 * len(prompts)
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.2, diffs
