"""No request lost when a worker dies or hangs mid-stream (real Ray actors, real processes).

8 requests stream through the cluster; once each has produced a few tokens, one worker that
serves some of them is killed (SIGKILL of its process) or stopped (SIGSTOP: hung, not dead).
Its requests continue on another worker from their snapshots (prompt + the tokens produced so
far, carried as output), and every request must finish with exactly the tokens it would have
had uninterrupted: transformers' greedy tokens, or, for seeded sampling, the tokens of an
uninterrupted run with the same seeds. Afterwards every live worker is idle with exact block
accounting (a stopped worker, once continued, frees what it held).

Two clusters: 1 prefill + 3 decode workers (disaggregated, TCP KV), and 3 colocated workers;
the greedy and seeded kills each take one worker out (a constrained kill scales its pool
back), so each cluster keeps two for its later tests.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time

import pytest
from cluster_checks import assert_idle
from hf_oracle import hf_greedy_ids_batch

from engine import SamplingParams
from router.outputs import Answer

ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(8)
]
TOPICS = ["rivers", "mountains", "bread", "copper", "lanterns", "harbors", "gardens", "owls"]
STALL_S = 3.0


def _cluster(smollm2_dir, **kw):
    from cluster.launch.local import LocalCluster

    return LocalCluster(
        model=str(smollm2_dir),
        engine={
            "max_num_batched_tokens": 256,
            "num_kv_blocks": 256,
            "block_size": 16,
            "max_num_seqs": 16,
        },
        transfer_timeout_s=30,
        stall_timeout_s=STALL_S,
        max_resumes=2,
        **kw,
    )


@pytest.fixture(scope="module", params=["disagg", "colocated"])
def setup(request, smollm2_dir):
    """(cluster, mode, the pool a fault picks from); one cluster at a time (they share Ray)."""
    if request.param == "disagg":
        c = _cluster(smollm2_dir, num_prefill=1, num_decode=3, num_colocated=0)
        pool = lambda: [w.name for w in c.decode]  # noqa: E731
    else:
        c = _cluster(smollm2_dir, num_prefill=0, num_decode=0, num_colocated=3)
        pool = lambda: [w.name for w in c.colocated]  # noqa: E731
    yield c, request.param, pool
    c.shutdown()


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok(f"A short note about {t}:")["input_ids"] for t in TOPICS]


@pytest.fixture(scope="module")
def expected_greedy(smollm2_dir, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return hf_greedy_ids_batch(model.eval(), prompts, MAX_TOKENS)


def _pid(cluster, name: str) -> int:
    return next(w.pid for w in cluster.workers if w.name == name)


def _live(cluster, role: str, active_only: bool = False) -> list[str]:
    """The workers of ``role`` the controller's table has alive now (as its scaler counts
    them: a worker just continued from SIGSTOP may still be SUSPECT), or only the ACTIVE."""
    from engine.messages import WorkerState

    table = ray.get(cluster.controller.members.remote())
    ok = (WorkerState.ACTIVE,) if active_only else tuple(s for s in WorkerState if s.name != "DEAD")
    return [w.name for w in table.workers if w.role == role and w.state in ok]


def _busiest(cluster, names: list[str]) -> str:
    """The worker among ``names`` that this process has the most requests running on."""
    refs = [w for w in cluster.workers if w.name in names]
    return max(refs, key=lambda w: w.outstanding).name


async def _stream_with_fault(cluster, prompts, params, fault, mode):
    """Run every prompt; once each has 3 tokens, apply ``fault``. Returns every final output,
    the seconds from the fault to the last finish, and the resumes by reason."""
    progress = [0] * len(prompts)

    async def one(i):
        last = None
        async for out in cluster.stream(prompts[i], params[i], mode=mode):
            progress[i] = len(out.outputs[0].token_ids)
            last = copy.deepcopy(out)
        return last

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    deadline = time.monotonic() + 120
    while min(progress) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert min(progress) >= 3, progress
    started = time.monotonic()
    _stream_with_fault.dispatcher = cluster.dispatcher()  # (needs the running loop)
    _stream_with_fault.log0 = len(_stream_with_fault.dispatcher.resume_log)
    _stream_with_fault.fault_wall = time.time()
    undo = fault()
    outs = await asyncio.gather(*tasks)
    took = time.monotonic() - started
    if undo is not None:
        undo()
    return outs, took, dict(cluster.dispatcher().resumes)


def _check_timelines(mode, how) -> None:
    """Each resume of the last run left a timeline whose instants come in order: the fault,
    the router giving up (a hang: after the stall timeout), new workers placed, (disaggregated:
    the reservation, the prefill worker's answer with its own split), the first tokens."""
    log = list(_stream_with_fault.dispatcher.resume_log)[_stream_with_fault.log0 :]
    assert log, "no resume timeline"
    fault = _stream_with_fault.fault_wall
    for t in log:
        assert fault <= t["failed"] <= t["placed"] <= t["first"], t
        if "second" in t:
            assert t["first"] <= t["second"], t
        if how == "stop":
            assert t["failed"] - fault >= 0.5 * STALL_S, t
        if mode == "disagg":
            assert t["placed"] <= t["reserved"] and t["placed"] <= t["prefilled"], t
            to_engine, queued, compute = t["prefill_phases"]
            assert to_engine >= 0 and queued >= 0 and compute > 0, t
            assert to_engine + queued + compute <= t["prefilled"] - t["placed"], t
        assert t["tokens"] > 3, t  # prompt + the output carried


def _kill(cluster, pool):
    name = _busiest(cluster, pool)
    pid = _pid(cluster, name)

    def fault():
        os.kill(pid, signal.SIGKILL)

    return name, fault


def _stop(cluster, pool):
    name = _busiest(cluster, pool)
    pid = _pid(cluster, name)

    def fault():
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGCONT)

    return name, fault


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_worker_loses_no_greedy_request(setup, prompts, expected_greedy, how):
    cluster, mode, pool = setup
    victim, fault = (_kill if how == "kill" else _stop)(cluster, pool())
    outs, took, resumes = asyncio.run(
        _stream_with_fault(cluster, prompts, [GREEDY] * len(prompts), fault, mode)
    )
    for out, exp in zip(outs, expected_greedy, strict=True):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == exp
    assert resumes.get("worker_died" if how == "kill" else "stalled", 0) >= 1, resumes
    assert took < 60  # a hang is noticed after STALL_S, not after a transfer timeout
    _check_timelines(mode, how)
    cluster.refresh()
    assert (victim in {w.name for w in cluster.workers}) == (how == "stop")
    assert_idle(cluster, timeout=30.0)  # a stopped worker, continued, aborted what moved away


def test_n_samples_through_the_router_resume_when_their_worker_hangs(
    setup, prompts, expected_greedy
) -> None:
    """n = 2 through the router's backend runs as two requests: the worker of sample 0 is
    stopped (SIGSTOP) mid-stream, that sample (and its sibling, if they shared the worker)
    resumes elsewhere from its snapshot, and both choices are transformers' greedy tokens."""
    from router.membership import MembershipView
    from router.service import ClusterBackend

    cluster, _, _ = setup
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)

    async def main():
        # a router of its own, as a gateway has: the controller's table, not what this
        # process's other dispatcher suspected during the earlier faults
        view = MembershipView(await cluster.controller.members.remote(), cluster.controller)
        backend = ClusterBackend(view, tokenizer=cluster.tokenizer, stall_timeout_s=STALL_S)
        gen = await backend.open("fan-resume", prompts[0], params)
        victim = gen.children[0].placement.decode
        pid, stopped, last = _pid(cluster, victim), False, None
        answer = Answer("fan-resume", prompts[0], params.n, logprobs=False)
        try:
            async for step in gen.outputs():
                last = out = answer.add(step)
                if not stopped and min(len(o.token_ids) for o in out.outputs) >= 3:
                    os.kill(pid, signal.SIGSTOP)
                    stopped = True
        finally:
            if stopped:
                os.kill(pid, signal.SIGCONT)
            await gen.aclose()
            resumes = dict(backend.dispatcher.resumes)
            await backend.aclose()
        return last, stopped, resumes

    last, stopped, resumes = asyncio.run(main())
    assert stopped and resumes.get("stalled", 0) >= 1, resumes
    assert last.finished and [list(o.token_ids) for o in last.outputs] == [expected_greedy[0]] * 2
    assert_idle(cluster, timeout=30.0)  # the stopped worker, continued, aborted what moved away


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_constrained_request_resumes_valid_and_exact(setup, prompts, how) -> None:
    """A schema-constrained greedy request whose decode worker hangs (SIGSTOP: the router
    gives up on it after the stall timeout) or dies (SIGKILL) mid-answer resumes elsewhere from
    its snapshot: the new worker rebuilds the grammar from the tokens carried, and the answer
    is the uninterrupted one, token for token, and valid. After a kill the pool is scaled back
    to its size (a real new worker), so the later tests keep theirs."""
    import json

    from engine.sampling_params import StructuredSpec
    from router.membership import MembershipView
    from router.service import ClusterBackend

    cluster, mode, pool = setup
    role = "decode" if mode == "disagg" else "colocated"
    size = len(_live(cluster, role))  # the controller's count, as its scaler's
    words = ["alpha", "beta", "gamma"]
    schema = {"type": "array", "items": {"enum": words}, "minItems": 8, "maxItems": 8}
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured=StructuredSpec.json_schema(schema)
    )
    sig = signal.SIGSTOP if how == "stop" else signal.SIGKILL

    async def run(rid: str, fault: bool):
        view = MembershipView(await cluster.controller.members.remote(), cluster.controller)
        backend = ClusterBackend(view, tokenizer=cluster.tokenizer, stall_timeout_s=STALL_S)
        gen = await backend.open(rid, prompts[1], params)
        victim = gen.placement.decode
        pid, hit, last = _pid(cluster, victim), False, None
        answer = Answer(rid, prompts[1], 1, logprobs=False)
        try:
            async for step in gen.outputs():
                last = answer.add(step)
                if fault and not hit and len(last.outputs[0].token_ids) >= 3:
                    os.kill(pid, sig)
                    hit = True
        finally:
            if hit and how == "stop":
                os.kill(pid, signal.SIGCONT)
            await gen.aclose()
            resumes = dict(backend.dispatcher.resumes)
            await backend.aclose()
        return last, hit, resumes, victim

    whole, _, _, _ = asyncio.run(run(f"constrained-whole-{how}", False))
    last, hit, resumes, victim = asyncio.run(run(f"constrained-resumed-{how}", True))
    assert hit and resumes.get("stalled" if how == "stop" else "worker_died", 0) >= 1, resumes
    assert whole.outputs[0].finish_reason == "stop" and last.outputs[0].finish_reason == "stop"
    assert list(last.outputs[0].token_ids) == list(whole.outputs[0].token_ids)
    value = json.loads(
        cluster.tokenizer.decode(last.outputs[0].token_ids, skip_special_tokens=True)
    )
    assert len(value) == 8 and set(value) <= set(words)
    if how == "kill":
        deadline = time.monotonic() + 30
        while victim in _live(cluster, role) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim not in _live(cluster, role)
        ray.get(cluster.controller.scale.remote(role, size), timeout=180)
        # every worker of the pool ACTIVE again before the next test (one stopped and
        # continued by an earlier test may still be SUSPECT a while)
        deadline = time.monotonic() + 60
        while len(_live(cluster, role, active_only=True)) < size and time.monotonic() < deadline:
            time.sleep(0.2)
        live = _live(cluster, role, active_only=True)
        assert len(live) == size and victim not in live, live
        cluster.refresh()
    assert_idle(cluster, timeout=30.0)


def test_seeded_sampling_continues_exactly_after_a_kill(setup, prompts) -> None:
    cluster, mode, pool = setup

    async def uninterrupted():
        async def one(p, sp):
            last = None
            async for out in cluster.stream(p, sp, mode=mode):
                last = out
            return list(last.outputs[0].token_ids)

        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, SEEDED, strict=True)))

    reference = asyncio.run(uninterrupted())
    assert len({tuple(r) for r in reference}) == len(reference)
    _, fault = _kill(cluster, pool())
    outs, _, resumes = asyncio.run(_stream_with_fault(cluster, prompts, SEEDED, fault, mode))
    assert resumes.get("worker_died", 0) >= 1, resumes
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert_idle(cluster, timeout=30.0)
