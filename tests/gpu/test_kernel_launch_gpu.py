"""kernels/launch.py on a CUDA GPU: a kernel launched straight through its compiled form (the
second call of a key) computes what Triton's own dispatch computes, a call that Triton would
specialise otherwise compiles its own variant, and the direct launch records into a CUDA graph.

    python -m pytest -q tests/gpu/test_kernel_launch_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kernels import launch as launch_mod
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.rotary import apply_rotary_write_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16


def _case(batch, ctx, seed, offset=0):
    """q (a view ``offset`` elements into its buffer), K/V caches, tables, lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv_heads, dim = 32, 8, 128
    width = -(-ctx // BLOCK)
    blocks = batch * width + 3
    cache = torch.randn(2, kv_heads, blocks * BLOCK, dim, generator=g, device="cuda")
    raw = torch.randn(batch * heads * dim + offset, generator=g, device="cuda")
    q = raw.to(torch.bfloat16)[offset:].view(batch, heads, dim)
    tables = torch.randperm(blocks, generator=g, device="cuda")[: batch * width]
    lens = torch.randint(1, ctx + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    return q, *cache.to(torch.bfloat16).unbind(0), tables.view(batch, width).int(), lens


def _counted(monkeypatch):
    """Counts the launches that went through Triton's dispatch (the rest went direct)."""
    from triton.runtime.jit import JITFunction

    calls = {"jit": 0}

    original = JITFunction.__getitem__

    def getitem(self, grid):
        calls["jit"] += 1
        return original(self, grid)

    monkeypatch.setattr(JITFunction, "__getitem__", getitem)
    return calls


def test_the_direct_launch_computes_what_the_dispatch_computes(monkeypatch):
    launch_mod.clear()
    calls = _counted(monkeypatch)
    first = _case(64, 700, seed=1)
    paged_decode_attention(*first, BLOCK, 0.088)  # compiles or finds: through the dispatch
    assert calls["jit"] >= 1
    for seed in (2, 3):  # same shapes, new tensors: direct
        q, k, v, tables, lens = _case(64, 700, seed=seed)
        before = calls["jit"]
        got = paged_decode_attention(q, k, v, tables, lens, BLOCK, 0.088)
        assert calls["jit"] == before  # no launch went through the dispatch
        monkeypatch.setattr(launch_mod, "ENABLED", False)
        want = paged_decode_attention(q, k, v, tables, lens, BLOCK, 0.088)
        monkeypatch.setattr(launch_mod, "ENABLED", True)
        assert calls["jit"] > before
        assert torch.equal(got, want)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, BLOCK, 0.088)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_a_misaligned_tensor_gets_its_own_variant_and_the_right_answer(monkeypatch):
    launch_mod.clear()
    calls = _counted(monkeypatch)
    paged_decode_attention(*_case(8, 300, seed=4), BLOCK, 0.088)
    paged_decode_attention(*_case(8, 300, seed=5), BLOCK, 0.088)
    before = calls["jit"]
    q, k, v, tables, lens = _case(8, 300, seed=6, offset=1)  # q 2 bytes off 16
    assert q.data_ptr() % 16
    got = paged_decode_attention(q, k, v, tables, lens, BLOCK, 0.088)
    assert calls["jit"] > before  # not the aligned kernel: Triton's dispatch again
    ref = paged_decode_attention_ref(q, k, v, tables, lens, BLOCK, 0.088)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_direct_launches_record_into_a_cuda_graph():
    launch_mod.clear()
    t, heads, kv_heads, dim = 24, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(t, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(t, kv_heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(t, kv_heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    positions = torch.arange(t, device="cuda")
    inv = 1.0 / 500000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    freqs = torch.outer(torch.arange(64, device="cuda").float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    caches = torch.zeros(2, kv_heads, 64, dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64, device="cuda")[:t]

    def step(qq, kk):
        apply_rotary_write_kv(qq, kk, v, positions, cos, sin, caches[0], caches[1], slots)

    eager_q, eager_k = q.clone(), k.clone()
    step(eager_q, eager_k)  # through the dispatch
    eager_cache = caches.clone()
    caches.zero_()
    q2, k2 = q.clone(), k.clone()
    step(q2, k2)  # direct (same key), eager
    assert torch.equal(q2, eager_q) and torch.equal(caches, eager_cache)
    caches.zero_()
    static_q, static_k = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        step(static_q, static_k)  # direct, on the capture stream
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    static_q.copy_(q)
    static_k.copy_(k)
    caches.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_q, eager_q) and torch.equal(caches, eager_cache)
