"""Every KV head of given blocks on rank 0 of a TP 2 engine over NCCL (run on a machine with 2
GPUs; skipped with fewer):

    python -m pytest -q tests/gpu/test_tensor_parallel_kv_gpu.py

A random tiny Llama (8 heads, 2 KV heads: one per rank), fp32, CUDA graphs on: a running
request's KV read to rank 0 (a gather on NCCL), zeroed and written back (a scatter) decodes
transformers' greedy tokens, so the writes reach the pools the captured graphs read; an fp8 pool
moves bit for bit (NCCL moves its bytes).
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import TP_GPU_TINY, save_tiny_model
from test_tensor_parallel_kv import _finish, _prefill

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

transformers = pytest.importorskip("transformers")
BS = 8  # _prefill's block size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "tp-kv-gpu", **TP_GPU_TINY)


def _llm(path, **kw):
    from engine import LLM

    return LLM(
        path,
        dtype="float32",
        device="cuda",
        tensor_parallel_size=2,
        block_size=BS,
        num_kv_blocks=64,
        max_num_seqs=8,
        async_scheduling=False,
        **kw,
    )


def test_tp2_kv_read_zero_restore_decodes_like_transformers(tiny, hf_greedy):
    model, path = tiny
    prompt = [random.Random(2).randrange(511) for _ in range(45)]
    expected = hf_greedy(model.to(device="cuda", dtype=torch.float32), prompt, 12)
    with _llm(path) as llm:
        runner = llm.engine.runner
        assert runner.graphs is not None
        rid, table = _prefill(llm, prompt, max_tokens=12)
        kv = runner.read_kv_blocks(table)
        assert kv.device == runner.device and kv.shape == (2, 2, 2, len(table) * BS, 16)
        slots = torch.tensor([b * BS + i for b in table for i in range(BS)], device="cuda")
        torch.testing.assert_close(kv[1, :, :1], runner.kv_caches[1][:, :, slots], rtol=0, atol=0)
        runner.write_kv_blocks(table, torch.zeros_like(kv))
        assert not runner.read_kv_blocks(table).any()
        runner.write_kv_blocks(table, kv.cpu())  # from the host: moved to rank 0's GPU first
        assert _finish(llm, rid) == expected


def test_tp2_fp8_pool_round_trip_over_nccl(tiny):
    _, path = tiny
    with _llm(path, kv_cache_dtype="fp8") as llm:
        runner = llm.engine.runner
        gen = torch.Generator().manual_seed(3)
        data = torch.randn((2, 2, 2, 3 * BS, 16), generator=gen).to(torch.float8_e4m3fn)
        runner.write_kv_blocks([40, 3, 17], data)
        got = runner.read_kv_blocks([40, 3, 17])
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.cpu().view(torch.uint8), data.view(torch.uint8))
