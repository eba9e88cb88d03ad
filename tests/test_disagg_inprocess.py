"""Prefill and decode workers in one process (in-process KV transport, no Ray): the engine-level
contract of disaggregation on a random tiny Llama, fast enough for every edit.

The same request run colocated and disaggregated must give the same tokens, greedy and seeded
random sampling alike (the decode worker skips the draw the prefill worker made for the first
token); reservations fail as values; blocks are exact on both sides afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cluster.worker import StreamError
from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
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


async def disagg(p, d, rid, prompt, params):
    res = await d.reserve(rid, prompt, params)
    if not res["ok"]:
        return res
    pre = asyncio.ensure_future(p.prefill(rid, prompt, params, res["endpoint"]))
    outs = [o async for o in d.stream(rid)]
    assert (await pre)["ok"]
    return outs


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

    for outs, exp in zip(asyncio.run(run_all()), expected, strict=True):
        final = outs[-1].outputs[0]
        assert final.token_ids == exp.outputs[0].token_ids
        if params.logprobs:
            assert [sorted(x) for x in final.logprobs] == [
                sorted(x) for x in exp.outputs[0].logprobs
            ]
    assert asyncio.run(p.check_idle()) is None
    assert asyncio.run(d.check_idle()) is None


def test_reservation_failures_are_values(workers) -> None:
    p, d = workers
    full = asyncio.run(d.reserve("big", [1] * 300, SamplingParams(max_tokens=1)))
    assert full == {"ok": False, "full": True}  # 76 blocks needed, the pool has 64
    bad = asyncio.run(d.reserve("n2", [1, 2], SamplingParams(n=2)))
    assert not bad["ok"] and "n > 1" in bad["error"]
    long = asyncio.run(d.reserve("long", [1] * 600, SamplingParams()))
    assert not long["ok"] and "maximum context length" in long["error"]
    assert asyncio.run(d.check_idle()) is None


def test_prefill_abort_before_done_fails_the_stream_retryably(workers) -> None:
    p, d = workers

    async def scenario():
        params = SamplingParams(max_tokens=4)
        res = await d.reserve("ab", list(range(60)), params)
        # The prefill side gives up on a request it never ran: the decode side is told.
        await d.fail_transfer("ab", "prefill worker gone")
        return [o async for o in d.stream("ab")], res

    outs, res = asyncio.run(scenario())
    assert res["ok"]
    assert isinstance(outs[-1], StreamError) and outs[-1].retryable
    assert asyncio.run(d.check_idle()) is None
