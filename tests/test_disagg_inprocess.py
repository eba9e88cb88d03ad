"""Prefill and decode workers in one process (in-process KV transport, no Ray): the engine-level
contract of disaggregation on a random tiny Llama, fast enough for every edit.

The same request run colocated and disaggregated must give the same tokens, greedy and seeded
random sampling alike (the decode worker skips the draw the prefill worker made for the first
token); reservations fail as values; blocks are exact on both sides afterwards. Outputs are
read as the router reads them: the decode worker's per-client stream of delta batches."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.messages import Delta, Full, PrefillDone, Rejected, Reserved
from prefill_worker.worker import PrefillWorker

transformers = pytest.importorskip("transformers")

ENGINE = {"max_num_batched_tokens": 24, "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_cfg):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-disagg")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_cfg())).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def workers(tiny):
    cfg = {"model_dir": tiny, **ENGINE}
    p = PrefillWorker(cfg, "p")
    d = DecodeWorker(cfg, "d", transport="inproc")
    yield p, d
    p.shutdown()
    d.shutdown()


async def read(worker, client: str) -> list[Delta]:
    """Every delta of ``client``'s one request, up to the one that finishes it."""
    deltas: list[Delta] = []
    stream = worker.outputs(client)
    try:
        async for batch in stream:
            assert batch.worker == worker.name
            deltas += batch.deltas
            if deltas[-1].finished:
                return deltas
    finally:
        await stream.aclose()
    return deltas


async def disagg(p, d, rid, prompt, params):
    res = await d.reserve(rid, prompt, params, rid)  # one client per request here
    if not isinstance(res, Reserved):
        return res
    pre = asyncio.ensure_future(p.prefill(rid, prompt, params, res.endpoint))
    deltas = await read(d, rid)
    assert isinstance(await pre, PrefillDone)
    return deltas


def prompts():
    rng = random.Random(5)
    return [[rng.randrange(320) for _ in range(n)] for n in (1, 5, 23, 60)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=10, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
def test_disaggregated_equals_colocated(tiny, workers, params) -> None:
    p, d = workers
    llm = LLM(tiny, **ENGINE)
    expected = llm.generate(prompts(), params)

    async def run_all():
        return await asyncio.gather(
            *(disagg(p, d, f"r{i}-{params.seed}", x, params) for i, x in enumerate(prompts()))
        )

    for deltas, exp in zip(asyncio.run(run_all()), expected, strict=True):
        assert [t for x in deltas for t in x.token_ids] == exp.outputs[0].token_ids
        assert deltas[-1].finish_reason == exp.outputs[0].finish_reason
        assert all(len(x.token_ids) <= 1 for x in deltas)  # a delta per step, never cumulative
        if params.logprobs:
            got = [lp for x in deltas for lp in x.logprobs]
            assert [sorted(x) for x in got] == [sorted(x) for x in exp.outputs[0].logprobs]
    assert asyncio.run(p.check_idle()) is None
    assert asyncio.run(d.check_idle()) is None


def test_reservation_failures_are_values(workers) -> None:
    p, d = workers
    full = asyncio.run(d.reserve("big", [1] * 300, SamplingParams(max_tokens=1)))
    assert isinstance(full, Full)  # 76 blocks needed, the pool has 64
    bad = asyncio.run(d.reserve("n2", [1, 2], SamplingParams(n=2)))
    assert isinstance(bad, Rejected) and "n > 1" in bad.message
    long = asyncio.run(d.reserve("long", [1] * 600, SamplingParams()))
    assert isinstance(long, Rejected) and "maximum context length" in long.message
    assert asyncio.run(d.check_idle()) is None


def test_prefill_abort_before_done_fails_the_stream_retryably(workers) -> None:
    p, d = workers

    async def scenario():
        params = SamplingParams(max_tokens=4)
        res = await d.reserve("ab", list(range(60)), params, "ab")
        # The prefill side gives up on a request it never ran: the decode side is told.
        await d.fail_transfer("ab", "prefill worker gone")
        return await read(d, "ab"), res

    deltas, res = asyncio.run(scenario())
    assert isinstance(res, Reserved)
    assert deltas[-1].error is not None and deltas[-1].retryable
    assert "prefill worker gone" in deltas[-1].error
    assert asyncio.run(d.check_idle()) is None
