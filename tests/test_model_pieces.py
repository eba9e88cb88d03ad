"""The forward cut at attention (what engine/cuda_graphs.py's piecewise graphs replay) equals the
plain forward, on CPU: the same hidden states and the same KV writes, bit for bit, also with
padded rows beyond the step's real tokens (which attention never sees). With the torch ops and,
under Triton's interpreter, with the fused in-place ops the GPU graphs capture."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import tiny_config

transformers = pytest.importorskip("transformers")

from engine import LLM  # noqa: E402
from engine.attention import ChunkSpec  # noqa: E402
from engine.cuda_graphs import piecewise_sizes  # noqa: E402
from engine.models.llama import StepContext  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(**tiny_config(num_hidden_layers=3))
    path = tmp_path_factory.mktemp("pieces")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def pieces_forward(model, backend, kv_caches, meta, ids, positions, num_real, hook):
    """The piecewise graphs' sequence, run eagerly: pieces over all rows (real + padding),
    attention over the real rows only, into one output buffer."""
    fused = model.rope_in_attention  # the Triton backend rotates q, k as it writes the KV
    dense = StepContext(model.ops, None, None, None, fused)
    rope = (
        model.ops.rope_state(model.rotary, positions[:num_real], torch.float32) if fused else None
    )
    attn = StepContext(model.ops, rope, meta, backend, fused)
    cfg = model.cfg
    o = torch.zeros(ids.shape[0], cfg.num_heads * cfg.head_dim, dtype=torch.float32)
    n = num_real
    q, k, v, residual = model.first_piece(dense, ids, positions)
    for i, layer in enumerate(model.layers):
        layer.self_attn.attend(attn, q[:n], k[:n], v[:n], kv_caches[i], out=o[:n])
        hook(i)
        if i + 1 < len(model.layers):
            q, k, v, residual = model.middle_piece(dense, i + 1, o, residual)
    return model.last_piece(dense, o, residual)[:n]


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("padding", [0, 13])
def test_pieces_equal_the_forward(tiny_dir, backend_name, padding, monkeypatch):
    if backend_name == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", backend_name)
    llm = LLM(tiny_dir, dtype="float32", device="cpu", num_kv_blocks=32, block_size=BLOCK)
    runner = llm.engine.runner
    model, backend = runner.model, runner.backend
    assert model.ops.name == ("triton" if backend_name == "triton" else "torch")
    assert model.rope_in_attention == (backend_name == "triton")  # one kernel: rotary + KV write
    rng = random.Random(0)
    # Step 1 fills a 20-token prefix of request A; step 2 mixes a decode of B (context 5),
    # A's next chunk of 9 tokens over its cached prefix and a fresh 7-token prompt C.
    table_a, table_b, table_c = [0, 1, 2], [3], [4]
    steps = [
        [ChunkSpec(0, 20, table_a), ChunkSpec(0, 5, table_b)],
        [ChunkSpec(5, 1, table_b), ChunkSpec(20, 9, table_a), ChunkSpec(0, 7, table_c)],
    ]
    caches = {"eager": runner.kv_caches, "pieces": [c.clone() for c in runner.kv_caches]}
    with torch.inference_mode():
        for specs in steps:
            n = sum(c.num_tokens for c in specs)
            ids = torch.tensor([rng.randrange(320) for _ in range(n)])
            positions = torch.tensor(
                [p for c in specs for p in range(c.start, c.start + c.num_tokens)]
            )
            meta = backend.build(specs, BLOCK, torch.device("cpu"))
            eager_hooks, piece_hooks = [], []
            expected = model(ids, positions, caches["eager"], meta, backend, eager_hooks.append)
            pad = torch.zeros(padding, dtype=torch.long)
            got = pieces_forward(
                model,
                backend,
                caches["pieces"],
                meta,
                torch.cat([ids, pad]),
                torch.cat([positions, pad]),
                n,
                piece_hooks.append,
            )
            assert torch.equal(got, expected)
            assert piece_hooks == eager_hooks == list(range(len(model.layers)))
            for a, b in zip(caches["eager"], caches["pieces"], strict=True):
                assert torch.equal(a, b)


def test_piecewise_sizes_bound_the_padding():
    sizes = piecewise_sizes(8192)
    assert sizes[:3] == [16, 32, 64] and sizes[-1] == 8192
    assert sizes == sorted(set(sizes))
    for small, big in zip(sizes, sizes[1:], strict=False):
        if small >= 512:
            assert (big - small) / (small + 1) <= 1 / 8  # a step just past a bucket pads < 1/8
    assert piecewise_sizes(100) == [16, 32, 64, 100]
    assert piecewise_sizes(16) == [16] and piecewise_sizes(5) == [5]
