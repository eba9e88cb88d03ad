"""Disaggregated serving on a real local Ray cluster (CPU, TCP transport, SmolLM2 fp32).

One cluster for the module: 2 prefill, 2 decode and 1 colocated worker, with a small chunk
budget so long prompts take several prefill steps (and several layer-wise sends). Greedy
tokens through a prefill/decode pair must equal the colocated worker's and transformers';
block accounting must be exact on every worker after completions, aborts and killed actors.
The tests that kill actors run last (file order).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time

import pytest
import torch
from cluster_checks import assert_idle
from hf_oracle import hf_greedy_ids

from engine import SamplingParams
from router.outputs import Answer

ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CHUNK = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LONG = " ".join(f"Fact {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
VERY_LONG = " ".join(f"Line {i}: a slow river bends around the old stone mill." for i in range(90))


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    from cluster.launch.local import LocalCluster

    c = LocalCluster(
        model=str(smollm2_dir),
        num_prefill=2,
        num_decode=2,
        num_colocated=1,
        # blocks of 16 (CPU defaults to 128): the prefix tests share 3 whole blocks
        engine={
            "max_num_batched_tokens": CHUNK,
            "num_kv_blocks": 256,
            "block_size": 16,
            "max_num_seqs": 16,
        },
        transfer_timeout_s=30,
    )
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(cluster):
    tok = cluster.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    texts = [chat, "Hello", "The first law of thermodynamics states that", LONG + " Summary:"]
    return [tok(t)["input_ids"] for t in texts]


def run(coro):
    return asyncio.run(coro)


async def _answer(rid, ids, gen, n=1):
    """A ClusterBackend generation's steps folded into its final cumulative output."""
    answer = Answer(rid, ids, n, logprobs=False)
    async for step in gen.outputs():
        answer.add(step)
    return answer.output


async def collect(cluster, prompt, params=GREEDY, **kw):
    """A copy of every output as it was streamed (the router builds one output in place)."""
    return [copy.deepcopy(out) async for out in cluster.stream(prompt, params, **kw)]


async def wait_until(predicate, timeout=60.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition not reached in time")


def worker(cluster, name):
    return next(w for w in cluster.workers if w.name == name)


def test_control_calls_are_not_starved_by_streams(cluster, smollm2_dir) -> None:
    """Health, stats and aborts run in the worker's control group: with every slot of the
    default group taken (here 2, by two output streams), they still answer, while a request
    call waits."""
    from decode_worker.colocated import ColocatedWorker
    from engine.messages import CONTROL_GROUP, control

    actor = ray.remote(concurrency_groups={CONTROL_GROUP: 4})(ColocatedWorker)
    handle = actor.options(max_concurrency=2, num_cpus=0).remote(
        {"model_dir": str(smollm2_dir), "num_kv_blocks": 32, "block_size": 16}, "starved"
    )
    try:
        ray.get(control(handle.ready).remote(), timeout=120)
        streams = [
            handle.outputs.options(num_returns="streaming").remote(f"client-{i}") for i in range(2)
        ]
        for s in streams:  # both streams run: their first heartbeat arrived
            ray.get(next(s), timeout=30)
        assert ray.get(control(handle.health).remote(), timeout=10)["name"] == "starved"
        assert ray.get(control(handle.stats).remote(), timeout=10)["running"] == 0
        ray.get(control(handle.abort).remote("nothing-to-abort"), timeout=10)
        waiting = handle.ready.remote()  # the default group has no free slot
        ready, _ = ray.wait([waiting], timeout=2)
        assert not ready
    finally:
        ray.kill(handle)


async def stats(cluster, name):
    return await worker(cluster, name).handle.stats.remote()


def test_kv_channels_are_formed_when_the_cluster_starts(cluster) -> None:
    """Before any request, every prefill worker has its channel to every decode worker up
    (the controller's connect_kv at start), so no first request waits for one to form."""

    async def check():
        prefill = [w.name for w in cluster.workers if w.role == "prefill"]
        assert len(prefill) == 2
        for name in prefill:
            s = await stats(cluster, name)
            assert s["kv_bytes_sent"] == 0  # nothing was sent: no request formed them
            assert s["kv_channels"] == 2, s

    run(check())


def test_worker_processes_freeze_their_start_up_heap(cluster) -> None:
    """Each worker actor froze its start-up heap before its engine loop began, so the
    collector's full collections stop scanning the model, torch and Ray
    (engine/runtime.py freeze_startup_heap); the driver, which builds and drops engines, did
    not freeze its own."""
    import gc

    async def check():
        for w in cluster.workers:
            s = await stats(cluster, w.name)
            assert s["gc_frozen_objects"] > 10_000, (w.name, s["gc_frozen_objects"])
            assert s["gc_full_collections"] >= 1  # freeze_startup_heap's own gc.collect()

    run(check())
    assert gc.get_freeze_count() == 0


def test_greedy_matches_colocated_and_transformers(cluster, prompts, hf) -> None:
    assert max(len(p) for p in prompts) > 2 * CHUNK  # several prefill chunks
    expected = [hf_greedy_ids(hf, p, MAX_TOKENS, stop_at_eos=True) for p in prompts]

    async def both():
        disagg = [collect(cluster, p, prefill="prefill-0", decode="decode-0") for p in prompts]
        coloc = [collect(cluster, p, mode="colocated") for p in prompts]
        return await asyncio.gather(asyncio.gather(*disagg), asyncio.gather(*coloc))

    disagg, coloc = run(both())  # all eight requests concurrently
    for p, d, c, e in zip(prompts, disagg, coloc, expected, strict=True):
        assert d[-1].outputs[0].token_ids == e, f"disaggregated differs from HF on {len(p)} tokens"
        assert c[-1].outputs[0].token_ids == e
        assert d[-1].outputs[0].text == c[-1].outputs[0].text
        # Streamed deltas add up to the final output, one token at a time after the first.
        assert sum((o.outputs[0].delta_token_ids for o in d), []) == e
        assert d[-1].finished and d[-1].prompt_token_ids == p
        # The shipped length probe (prefill and colocated workers load it by default) refines
        # each estimate after prefill; it reaches the client on both paths, and they agree.
        dp, cp = d[-1].predicted_tokens, c[-1].predicted_tokens
        assert dp is not None and cp is not None and dp[0] <= dp[1] <= dp[2]
        assert dp == pytest.approx(cp, rel=1e-2)
    assert_idle(cluster)


def test_prefill_prefix_hit_is_still_sent(cluster, prompts, hf) -> None:
    base = prompts[-1]  # > 2 chunks
    variant = base[: 3 * 16 + 5] + cluster.tokenizer(" In short, the fox")["input_ids"]
    before = run(stats(cluster, "prefill-1"))["prefix_hit_tokens"]
    run(collect(cluster, base, prefill="prefill-1", decode="decode-1"))
    out = run(collect(cluster, variant, prefill="prefill-1", decode="decode-1"))
    hit = run(stats(cluster, "prefill-1"))["prefix_hit_tokens"] - before
    assert hit >= 3 * 16  # the shared whole blocks were not recomputed on the prefill worker...
    expect = hf_greedy_ids(hf, variant, MAX_TOKENS, stop_at_eos=True)
    assert out[-1].outputs[0].token_ids == expect  # ...yet the decode worker had their KV
    assert out[-1].num_cached_tokens == hit  # reported to the client as cached
    assert_idle(cluster)


def test_invalid_request_costs_nothing(cluster) -> None:
    from cluster.launch.local import RequestError

    too_long = [1] * 9000  # SmolLM2's context is 8192
    with pytest.raises(RequestError, match="maximum context length"):
        run(collect(cluster, too_long))
    with pytest.raises(RequestError, match="maximum context length"):
        run(collect(cluster, too_long, mode="colocated"))
    assert_idle(cluster)


def test_concurrent_requests_spread_over_the_pairs(cluster, prompts) -> None:
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    key = {"prefill": "kv_bytes_sent", "decode": "kv_bytes_received"}

    def moved():
        return {n: run(stats(cluster, n))[key[n.split("-")[0]]] for n in names}

    before = moved()
    tails = {n: run(stats(cluster, n)) for n in names[2:]}

    async def both():
        return await asyncio.gather(*(collect(cluster, p) for p in prompts[:2]))

    started = time.time()
    run(both())
    took = time.time() - started
    after = moved()
    assert all(after[n] > before[n] for n in names), (before, after)
    for n in names[2:]:  # each decode worker took one transfer, and timed its exposed tail
        s = run(stats(cluster, n))
        assert s["kv_transfers_in"] == tails[n]["kv_transfers_in"] + 1
        assert s["kv_transfer_seconds"] > tails[n]["kv_transfer_seconds"]
        # The tail runs from the first token's sampling on the prefill worker to the last
        # layer's arrival: inside the requests' own time. (Not inside the transfer's own time,
        # reservation to arrival: the router reserves and prefills at once, so a one-token
        # prompt can be sampled before its reservation lands.)
        tail = s["kv_transfer_tail_seconds"] - tails[n]["kv_transfer_tail_seconds"]
        assert 0 <= tail <= took
    assert_idle(cluster)


def test_sjf_queue_starts_the_shortest_predicted_first(cluster, prompts) -> None:
    """The full router (router/service.py) with one slot per decode worker and the oracle
    predictor: requests waiting for a slot start shortest-predicted first (not in arrival
    order), each carries its prediction, they produce exactly their tokens, and every slot
    and block comes back."""
    from router.admission import QueueConfig
    from router.predictor import ORACLE_HEADER, PredictInput
    from router.service import ClusterBackend

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def hints(n: int) -> PredictInput:
        return PredictInput(max_tokens=n, headers={ORACLE_HEADER: str(n)})

    async def main():
        backend = ClusterBackend(
            cluster.members,
            tokenizer=cluster.tokenizer,
            queue=QueueConfig("sjf", slots_per_worker=1),
            predictor="oracle",
        )
        started: list[str] = []

        async def one(rid: str, n: int, ids: list[int]) -> int:
            gen = await backend.open(rid, ids, params(n), hints=hints(n))
            started.append(rid)
            assert gen.placement.predicted_tokens == n
            try:
                last = await _answer(rid, ids, gen)
            finally:
                await gen.aclose()
            return len(last.outputs[0].token_ids)

        try:
            # two slots (two decode workers): one frees after 20 tokens, one holds for 100
            busy = [asyncio.ensure_future(one(f"busy-{n}", n, prompts[2])) for n in (20, 100)]
            await wait_until(lambda: _running(backend, 2))
            waiting = [("long", 30), ("short", 3), ("medium", 12)]  # arrival order
            tasks = [asyncio.ensure_future(one(r, n, prompts[1])) for r, n in waiting]
            await wait_until(lambda: _queued(backend, 3))
            counts = await asyncio.gather(*busy, *tasks)
            stats = backend.router_stats().scheduling
        finally:
            await backend.aclose()
        assert started[2:] == ["short", "medium", "long"], started
        assert counts == [20, 100, 30, 3, 12]
        assert stats["running"] == 0 and stats["queued"] == 0 and stats["queued_total"] == 3
        assert stats["predictions_observed"] == 5

    run(main())
    assert_idle(cluster)


def test_the_probe_s_estimate_replaces_the_router_s_but_not_the_oracle_s(cluster, prompts):
    """After the prefill, the shipped length probe's estimate (capped by max_tokens) replaces
    the learned predictor's for the request's remaining work and its header; an exact
    predictor (the oracle) keeps its own."""
    from router.admission import QueueConfig
    from router.predictor import ORACLE_HEADER, PredictInput
    from router.service import ClusterBackend

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def one(predictor: str, headers: dict) -> tuple:
        backend = ClusterBackend(
            cluster.members,
            tokenizer=cluster.tokenizer,
            queue=QueueConfig("fcfs"),
            predictor=predictor,
        )
        try:
            hints = PredictInput(text="Hello", max_tokens=16, headers=headers)
            gen = await backend.open(f"probe-{predictor}", prompts[0], params, hints=hints)
            try:
                last = await _answer(f"probe-{predictor}", prompts[0], gen)
            finally:
                await gen.aclose()
            return gen.placement, last, backend.admission
        finally:
            await backend.aclose()

    placement, last, admission = run(one("learned", {}))
    probe = last.predicted_tokens
    assert probe is not None and len(last.outputs[0].token_ids) == 16
    assert placement.predicted_tokens == round(min(probe[0], 16))
    assert list(admission.refined_quality.pairs) == [(min(probe[0], 16), 16)]
    placement, last, admission = run(one("oracle", {ORACLE_HEADER: "7"}))
    assert last.predicted_tokens is not None  # the probe ran, and was not used
    assert placement.predicted_tokens == 7 and not admission.refined_quality.pairs
    assert_idle(cluster)


async def _running(backend, n: int) -> bool:
    return len(backend.admission.running) >= n


async def _queued(backend, n: int) -> bool:
    return len(backend.admission.queue) >= n


def test_full_decode_worker_is_skipped(cluster, prompts) -> None:
    """The speculative first choice is full: its prefill is dropped, the other one serves."""
    d0 = worker(cluster, "decode-0").handle
    hog = ray.get(d0.reserve.remote("hog", [1] * 3990, GREEDY))  # 250 of its 256 blocks
    assert type(hog).__name__ == "Reserved"
    try:
        out = run(collect(cluster, prompts[-1], prefill="prefill-0", decode="decode-0"))
        coloc = run(collect(cluster, prompts[-1], mode="colocated"))
        assert out[-1].outputs[0].token_ids == coloc[-1].outputs[0].token_ids
    finally:
        ray.get(d0.abort.remote("hog"))
    assert_idle(cluster)


async def start_long_request(cluster, prefill, decode, rid):
    """Start a many-chunk request and return (task, generator) once its KV is mid-transfer."""
    ids = cluster.tokenizer(VERY_LONG)["input_ids"]
    assert len(ids) > 10 * CHUNK
    agen = cluster.stream(ids, GREEDY, request_id=rid, prefill=prefill, decode=decode)
    task = asyncio.ensure_future(agen.__anext__())

    async def mid_transfer():
        s = await stats(cluster, decode)
        return s["transfers_pending"] == 1 and s["kv_bytes_received"] > 0

    base = (await stats(cluster, decode))["kv_bytes_received"]

    async def started():
        s = await stats(cluster, decode)
        return s["transfers_pending"] == 1 and s["kv_bytes_received"] > base

    await wait_until(started)
    assert not task.done()  # no token before every layer has arrived
    return ids, agen, task


def test_abort_mid_transfer_frees_both_sides(cluster) -> None:
    async def scenario():
        _, agen, task = await start_long_request(cluster, "prefill-0", "decode-0", "abort-me")
        task.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        await agen.aclose()

    run(scenario())
    assert_idle(cluster)
    # The pair still works afterwards.
    out = run(collect(cluster, "Hello", prefill="prefill-0", decode="decode-0"))
    assert out[-1].finished


def test_an_unpinned_request_takes_the_gateways_path(cluster) -> None:
    """LocalCluster's requests go through the gateway's own router (admission, the placement
    policy, dispatch) unless pinned to named workers: the policy counts a decision for each
    unpinned one and none for a pinned one, and both answer the same greedy tokens."""

    async def scenario():
        router = cluster.router()
        before = sum(router.router_stats().decisions.values())
        free = await collect(cluster, "The lighthouse keeper")
        between = sum(router.router_stats().decisions.values())
        pinned = await collect(cluster, "The lighthouse keeper", prefill="prefill-0")
        after = sum(router.router_stats().decisions.values())
        return free, pinned, (between - before, after - between)

    free, pinned, decisions = run(scenario())
    assert decisions == (1, 0)
    assert free[-1].finished and pinned[-1].finished
    assert free[-1].outputs[0].token_ids == pinned[-1].outputs[0].token_ids


def test_a_hung_prefill_worker_fails_over_before_the_transfer_timeout(cluster) -> None:
    """SIGSTOP the prefill worker mid-transfer: the controller finds it unresponsive (SUSPECT)
    within seconds and the request is placed again on the other prefill worker, long before
    the 30 s transfer timeout; continued, the stopped worker frees what it held."""
    pid = worker(cluster, "prefill-1").pid

    async def scenario():
        ids, agen, task = await start_long_request(cluster, "prefill-1", "decode-0", "hang-p")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            first = copy.deepcopy(await task)
            took = time.monotonic() - t0
            rest = [copy.deepcopy(out) async for out in agen]
        finally:
            os.kill(pid, signal.SIGCONT)
        return ids, [first, *rest], took

    ids, outs, took = run(scenario())
    assert took < 28, took  # the transfer timeout is 30 s (without the failover: 41.6 s)
    coloc = run(collect(cluster, ids, mode="colocated"))
    assert outs[-1].outputs[0].token_ids == coloc[-1].outputs[0].token_ids
    assert_idle(cluster, timeout=30.0)


def test_decode_killed_mid_transfer_retries_on_the_other_pair(cluster) -> None:
    async def scenario():
        ids, agen, task = await start_long_request(cluster, "prefill-1", "decode-1", "kill-d")
        cluster.kill("decode-1")
        first = copy.deepcopy(await task)  # retried on decode-0 (with prefill-0): it goes on
        rest = [copy.deepcopy(out) async for out in agen]
        return ids, [first, *rest]

    ids, outs = run(scenario())
    coloc = run(collect(cluster, ids, mode="colocated"))
    assert outs[-1].finished and outs[-1].request_id == "kill-d"
    assert outs[-1].outputs[0].token_ids == coloc[-1].outputs[0].token_ids
    assert_idle(cluster)  # prefill-1 freed its side when the channel broke


def test_prefill_killed_mid_transfer_retries_on_the_other_prefill(cluster) -> None:
    async def scenario():
        ids, agen, task = await start_long_request(cluster, "prefill-1", "decode-0", "kill-p")
        cluster.kill("prefill-1")
        first = copy.deepcopy(await task)
        rest = [copy.deepcopy(out) async for out in agen]
        return ids, [first, *rest]

    ids, outs = run(scenario())
    coloc = run(collect(cluster, ids, mode="colocated"))
    assert outs[-1].outputs[0].token_ids == coloc[-1].outputs[0].token_ids
    assert_idle(cluster)  # decode-0 freed the dead transfer's blocks
