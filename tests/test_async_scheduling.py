"""Async scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before
step N's tokens are read, the tokens still pending reach N+1's inputs on the device. On CPU the
forward runs at launch, but the pipeline is the same one the GPU runs: these tests check that it
really runs ahead, and that everything it can change comes out as a step-by-step engine's."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import hf_greedy_ids, tiny_config

from engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_config())).eval()
    path = tmp_path_factory.mktemp("tiny-async")
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (2, 7, 19, 33, 50)]


def engine_pair(path, **kwargs):
    return (
        LLM(path, block_size=4, async_scheduling=False, **kwargs),
        LLM(path, block_size=4, async_scheduling=True, **kwargs),
    )


def outputs(llm, prompts, params):
    outs = llm.generate(prompts, params)
    llm.engine.block_manager.check_invariant(expect_idle=True)
    assert llm.engine.drain() == [] and not llm.engine.has_work()
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def trace_runner(engine) -> list[str]:
    """Record the runner's launches and collects, in order ("L" / "C")."""
    runner, events = engine.runner, []
    launch, collect = runner.launch, runner.collect

    def traced_launch(*args, **kwargs):
        events.append("L")
        return launch(*args, **kwargs)

    def traced_collect(*args, **kwargs):
        events.append("C")
        return collect(*args, **kwargs)

    runner.launch, runner.collect = traced_launch, traced_collect
    return events


def test_the_next_step_is_launched_before_the_last_one_is_read(tiny, prompts):
    model, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    events = trace_runner(llm.engine)
    engine = llm.engine
    engine.add_request("r", prompts[2], SamplingParams(temperature=0.0, max_tokens=6))
    assert engine.step() == [], "the first step is only launched"
    assert engine.has_work() and engine._inflight is not None
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.outputs[0].token_ids
    assert got == hf_greedy_ids(model, prompts[2], 6)
    # Every step but the first is launched before the one before it is read.
    assert "".join(events) == "L" + "LC" * 5 + "C"


def test_a_request_that_surely_ends_is_not_scheduled_again(tiny, prompts):
    """max_tokens is known ahead: no step is launched for a token that would be thrown away."""
    _, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    events = trace_runner(llm.engine)
    llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=4))
    assert events.count("L") == 4  # the prompt, then 3 decodes


def test_greedy_matches_transformers_with_stops_it_cannot_foresee(tiny, prompts):
    """A stop token found only when the pending token is read: the step already launched for
    that request drops its token; every sequence still matches the oracle's prefix."""
    model, path = tiny
    expected = [hf_greedy_ids(model, p, 12) for p in prompts]
    # Stop at each prompt's 5th greedy token (after min_tokens=2 the first such is the stop).
    sync, fast = engine_pair(path)
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[expected[i][4]])
        want = outputs(sync, [p], params)
        assert outputs(fast, [p], params) == want
        ids, _, reason, _ = want[0][0]
        stop = ids.index(expected[i][4])
        assert ids == expected[i][: stop + 1] and reason == "stop"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=3),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=4, logprobs=3),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=10, seed=5, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=10, seed=6, n=3),
        # Penalties need every token id on the host: those steps are waited for.
        SamplingParams(temperature=0.9, max_tokens=10, seed=7, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=0.5),
    ],
    ids=["top_p", "top_k+logprobs", "min_p+min_tokens", "greedy+logprobs", "n3", "rep", "freq"],
)
def test_sampling_is_the_same_as_step_by_step(tiny, prompts, params):
    """Seeded draws, logprobs, min_tokens and penalties depend on how many tokens came before
    (pending ones included): the pipelined engine gives exactly the step-by-step engine's."""
    _, path = tiny
    sync, fast = engine_pair(path, max_num_batched_tokens=16)  # chunked, mixed steps
    assert outputs(fast, prompts, params) == outputs(sync, prompts, params)


def test_penalties_wait_for_their_step(tiny, prompts):
    _, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    events = trace_runner(llm.engine)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=1))
    assert "".join(events) == "LC" * 4


def test_stop_strings_and_text_match(smollm2_dir):
    prompts = ["The capital of France is", "Count: one, two,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[" three", "."])
    sync = LLM(str(smollm2_dir), async_scheduling=False)
    fast = LLM(str(smollm2_dir), async_scheduling=True)
    want = outputs(sync, prompts, params)
    assert outputs(fast, prompts, params) == want
    assert any(seq[0][2] == "stop" for seq in want)


def test_abort_while_a_step_runs_frees_everything(tiny, prompts):
    _, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    engine = llm.engine
    engine.output_kind = "delta"
    params = SamplingParams(temperature=0.0, max_tokens=20)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    seen: dict[str, int] = {}
    for _ in range(2):
        for d in engine.step():
            seen[d.request_id] = seen.get(d.request_id, 0) + len(d.token_ids)
    assert engine._inflight is not None
    engine.abort_request(["r1", "r3"])
    while engine.has_unfinished_requests():
        for d in engine.step():
            seen[d.request_id] = seen.get(d.request_id, 0) + len(d.token_ids)
    assert seen.keys() >= {"r0", "r2", "r4"} and all(seen[f"r{i}"] == 20 for i in (0, 2, 4))
    engine.block_manager.check_invariant(expect_idle=True)


def test_pause_waits_for_the_running_step(tiny, prompts):
    """A migration pauses a request mid-pipeline: its pending token is read first, so the
    paused request's tokens and progress are complete (decoding: computed = tokens - 1)."""
    model, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    engine = llm.engine
    engine.output_kind = "delta"
    params = SamplingParams(temperature=0.0, max_tokens=10)
    engine.add_request("m", prompts[3], params)
    engine.add_request("o", prompts[4], params)
    streamed: dict[str, list[int]] = {"m": [], "o": []}
    for _ in range(4):
        for d in engine.step():
            streamed[d.request_id] += d.token_ids
    request = engine.single_request("m")
    assert request.num_pending == 1
    for d in engine.drain():
        streamed[d.request_id] += d.token_ids
    paused = engine.pause("m")
    assert paused.num_pending == 0 and paused.num_computed_tokens == paused.num_tokens - 1
    assert streamed["m"] == paused.output_token_ids
    engine.resume_paused("m")
    while engine.has_unfinished_requests():
        for d in engine.step():
            streamed[d.request_id] += d.token_ids
    assert streamed["m"] == hf_greedy_ids(model, prompts[3], 10)
    assert streamed["o"] == hf_greedy_ids(model, prompts[4], 10)
    engine.block_manager.check_invariant(expect_idle=True)


def test_reserved_and_paused_requests_have_their_own_status_and_abort_frees_them(tiny, prompts):
    """A reservation waiting for remote KV and a request paused for migration each read their
    own status (not WAITING / RUNNING), are counted as such, and abort frees their blocks."""
    from engine.request import RequestStatus

    _, path = tiny
    engine = LLM(path, block_size=4, async_scheduling=True).engine
    engine.output_kind = "delta"
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert engine.reserve_remote("r", prompts[0], params) is not None
    reserved = engine._seq_owner["r"][1].request
    assert reserved.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert engine.num_remote_pending() == 1 and engine.not_decoding("r") is not None
    engine.add_request("m", prompts[3], params)
    while engine.single_request("m").num_output_tokens < 3:
        engine.step()
    engine.drain()
    paused = engine.pause("m")
    assert paused.status == RequestStatus.PAUSED and engine.paused_request("m") is paused
    with pytest.raises(KeyError):
        engine.grow_remote("m", 64)  # paused, not waiting for KV
    engine.abort_request(["r", "m"])
    assert reserved.status == paused.status == RequestStatus.FINISHED_ABORTED
    assert engine.num_remote_pending() == 0 and not engine.has_request("m")
    engine.block_manager.check_invariant(expect_idle=True)


def test_a_step_whose_read_fails_is_not_read_again(tiny, prompts):
    """The device faults under a running step: reading its tokens raises, from ``step``, once.
    The worker then ends every request (EngineWorker._fail_everything); the engine goes on with
    new ones instead of re-reading the broken step on every later call."""
    model, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("a", prompts[1], params)
    engine.add_request("b", prompts[2], params)
    engine.step()
    runner, collect, broken = engine.runner, engine.runner.collect, []

    def faulty(step):
        if not broken or step is broken[0]:
            broken[:1] = [step]
            raise RuntimeError("device fault")
        return collect(step)

    runner.collect = faulty
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    engine.abort_request(["a", "b"])
    engine.add_request("c", prompts[3], params)
    got = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        got += [o.outputs[0].token_ids for o in engine.step() if o.request_id == "c"]
    assert not engine.has_unfinished_requests()
    assert got[-1] == hf_greedy_ids(model, prompts[3], 8)
    engine.block_manager.check_invariant(expect_idle=True)


def test_an_observer_attached_mid_pipeline_ends_only_steps_it_began(tiny, prompts):
    """A worker that takes up prefill attaches its KV streamer (the step observer) between two
    steps while one runs: the observer is told the end only of steps it saw begin, and every
    step from then on waits for the one before."""
    model, path = tiny
    llm = LLM(path, block_size=4, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", prompts[2], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    engine.step()
    assert engine._inflight is not None

    class Observer:
        def __init__(self):
            self.begun, self.ended = [], []

        def begin_step(self, out):
            self.begun.append(out)

        def end_step(self, out, sampled):
            self.ended.append(out)

    observer = engine.step_observer = Observer()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert engine._inflight is None  # observed steps are waited for
    assert observer.ended == observer.begun and observer.begun
    assert outs[-1].outputs[0].token_ids == hf_greedy_ids(model, prompts[2], 6)
