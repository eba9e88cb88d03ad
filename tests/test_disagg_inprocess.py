"""Prefill and decode workers in one process (in-process KV transport, no Ray): the engine-level
contract of disaggregation on a random tiny Llama, fast enough for every edit.

The same request run colocated and disaggregated must give the same tokens, greedy and seeded
random sampling alike (a seeded draw is a function of the seed and the output position, so the
decode worker continues where the prefill worker's draw left off); a request resumed from the
tokens it had produced (on a fresh pair, or colocated) continues exactly as if uninterrupted;
reservations fail as values; blocks are exact on both sides afterwards. Outputs are read as the
router reads them: the decode worker's per-client stream of delta batches."""

from __future__ import annotations

import asyncio
import random

import pytest
from hf_oracle import save_tiny

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.messages import Delta, Full, PrefillDone, Rejected, Reserved
from prefill_worker.worker import PrefillWorker

transformers = pytest.importorskip("transformers")

ENGINE = {"max_num_batched_tokens": 24, "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-disagg")


# Decode workers with async scheduling too (on by default on CUDA): requests admitted from a
# remote prefill join a pipeline with a step running.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def workers(tiny, request):
    cfg = {"model_dir": tiny, **ENGINE, "async_scheduling": request.param}
    p = PrefillWorker(cfg, "p")
    d = DecodeWorker(cfg, "d", transport="inproc")
    p.start(), d.start()
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
            deltas += batch.deltas  # (an empty batch is a heartbeat)
            if deltas and deltas[-1].finished:
                return deltas
    finally:
        await stream.aclose()
    return deltas


async def disagg(p, d, rid, prompt, params, **kwargs):
    res = await d.reserve(rid, prompt, params, rid, **kwargs)  # one client per request here
    if not isinstance(res, Reserved):
        return res
    pre = asyncio.ensure_future(p.prefill(rid, prompt, params, res.endpoint, **kwargs))
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
        # (never cumulative: the concatenation above is exact; a reader that fell behind may
        # get several steps merged into one delta, so no per-delta length is asserted)
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


def test_reservations_in_one_call_answer_each_request_and_serve_it(tiny, workers) -> None:
    """``reserve_many`` (the router's batched reservations): each request its own answer in
    order, an invalid one Rejected, one whose reservation raises Full with the error, one too
    big Full; the reserved ones run to the colocated tokens once their gated prefills are
    released by ``release_many``, and nothing is left held."""
    p, d = workers
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ok = prompts()[1:3]
    expected = LLM(tiny, **ENGINE).generate(ok, params)
    items = [
        ("m0", ok[0], params, {"predicted_tokens": 5}),
        ("m1", [1, 2], SamplingParams(n=2), {}),  # invalid here
        ("m2", [1] * 300, params, {}),  # more blocks than the pool
        ("m3", [1, 2, 3], params, {"no_such_option": 1}),  # the reservation raises
        ("m4", ok[1], params, {}),
    ]

    async def run():
        answers = await d.reserve_many(items, "batch")
        served = []
        for rid, prompt in (("m0", ok[0]), ("m4", ok[1])):
            endpoint = answers[int(rid[1])].endpoint
            pre = asyncio.ensure_future(p.prefill(rid, prompt, params, endpoint, gated=True))
            await asyncio.sleep(0)
            assert await p.release_many([rid]) == [None]
            served.append(pre)
        deltas = await read_all(d, "batch", {"m0", "m4"})
        for pre in served:
            assert isinstance(await pre, PrefillDone)
        return answers, deltas

    answers, deltas = asyncio.run(run())
    assert [type(a).__name__ for a in answers] == [
        "Reserved",
        "Rejected",
        "Full",
        "Full",
        "Reserved",
    ]
    assert "n > 1" in answers[1].message and "reserve failed" in answers[3].reason
    for rid, exp in (("m0", expected[0]), ("m4", expected[1])):
        assert [t for x in deltas[rid] for t in x.token_ids] == exp.outputs[0].token_ids
    assert asyncio.run(p.check_idle()) is None
    assert asyncio.run(d.check_idle()) is None


async def read_all(worker, client: str, rids: set[str]) -> dict[str, list[Delta]]:
    """Every delta of ``client``'s requests ``rids``, up to each one's finish."""
    out: dict[str, list[Delta]] = {rid: [] for rid in rids}
    left = set(rids)
    stream = worker.outputs(client)
    try:
        async for batch in stream:
            for delta in batch.deltas:
                out[delta.request_id].append(delta)
                if delta.finished:
                    left.discard(delta.request_id)
            if not left:
                return out
    finally:
        await stream.aclose()
    return out


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


@pytest.mark.parametrize("turns", [1, 40])
def test_a_cancelled_prefill_call_leaves_nothing_behind(workers, turns) -> None:
    """The caller of ``prefill`` goes away (its task cancelled) ``turns`` loop turns in, before
    or after its request reached the engine: the cancellation propagates, the request is
    aborted there and its decode worker told at once (no layer had left: gated), so the decode
    side's stream ends retryably with the prefill's abort, and both workers end idle."""
    p, d = workers

    async def scenario():
        params = SamplingParams(max_tokens=4)
        prompt = list(range(60))
        rid = f"cancelled-{turns}"
        res = await d.reserve(rid, prompt, params, rid)
        pre = asyncio.ensure_future(p.prefill(rid, prompt, params, res.endpoint, gated=True))
        for _ in range(turns):
            await asyncio.sleep(0)
        pre.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pre
        return await read(d, rid), res

    deltas, res = asyncio.run(scenario())
    assert isinstance(res, Reserved)
    assert deltas[-1].error is not None and deltas[-1].retryable
    assert "prefill aborted the transfer" in deltas[-1].error, deltas[-1].error
    assert asyncio.run(p.check_idle()) is None
    assert asyncio.run(p.call(p.prefill_role.holds)) == {"prefills": 0, "KV bytes out": 0}
    assert asyncio.run(d.check_idle()) is None


RESUMED = [
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=1),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12),
    # penalties and min_tokens read the output: carried output must count as output
    SamplingParams(temperature=0.8, seed=3, max_tokens=12, frequency_penalty=1.5, min_tokens=9),
]


@pytest.mark.parametrize("params", RESUMED, ids=["greedy", "seeded", "penalised"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_request_resumed_from_its_output_continues_exactly(tiny, workers, params, cut) -> None:
    """Cut an uninterrupted run after ``cut`` tokens; continuing from those tokens (prompt +
    output recomputed, colocated or on a prefill/decode pair) gives exactly the rest."""
    p, d = workers
    llm = LLM(tiny, **ENGINE)
    prompt = prompts()[2]
    whole = llm.generate([prompt], params)[0].outputs[0]
    assert len(whole.token_ids) == 12
    head, tail = whole.token_ids[:cut], whole.token_ids[cut:]

    engine = llm.engine
    rid = engine.add_request(None, prompt, params, output_token_ids=head)
    colocated = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            colocated += out.outputs[0].delta_token_ids
            last = out.outputs[0]
    assert colocated == tail and last.finish_reason == "length"
    assert rid not in engine._groups

    rid = f"resume-{cut}-{params.seed}-{params.frequency_penalty}"
    deltas = asyncio.run(disagg(p, d, rid, prompt, params, output_token_ids=head))
    assert [t for x in deltas for t in x.token_ids] == tail
    assert deltas[-1].finish_reason == "length"
    if params.logprobs is not None:
        got = [lp for x in deltas for lp in x.logprobs]
        assert [sorted(x) for x in got] == [sorted(x) for x in whole.logprobs[cut:]]
    assert asyncio.run(p.check_idle()) is None
    assert asyncio.run(d.check_idle()) is None


def test_a_continuation_that_cannot_fit_is_rejected(workers) -> None:
    p, d = workers
    full = SamplingParams(max_tokens=3)
    res = asyncio.run(d.reserve("c1", [1, 2], full, "c1", output_token_ids=[5, 6, 7]))
    assert isinstance(res, Rejected) and "max_tokens" in res.message
    res = asyncio.run(d.reserve("c2", [1, 2], SamplingParams(), "c2", output_token_ids=[10**6]))
    assert isinstance(res, Rejected) and "vocabulary" in res.message
    assert asyncio.run(d.check_idle()) is None
