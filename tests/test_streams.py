"""The batched delta stream: what a worker sends its router, and what the router builds of it.

* a channel merges the steps a slow reader missed into one delta per sequence (bounded by the
  tokens produced, never a growing queue of messages), and counts the merged steps;
* the router's ``Assembler`` builds each step's choice deltas from token deltas with the
  engine's own rules (stop strings, a stop token's text left out) and tells when a stop string
  ended a sequence;
* a worker whose reader went away aborts that reader's requests after the grace period;
* a batch crosses processes columnar (Ray pickles it) and arrives equal, in order.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.messages import Delta, StreamBatch
from engine.output_stream import Channel
from engine.sampling_params import SamplingParams
from router.dispatch import Assembler

transformers = pytest.importorskip("transformers")


def test_channel_merges_what_a_slow_reader_missed() -> None:
    ch = Channel()
    ch.put([Delta("a", [1], [{1: -0.1}]), Delta("b", [7])])
    ch.put([Delta("a", [2], [{2: -0.2}])])
    ch.put([Delta("a", [3], [{3: -0.3}], finish_reason="length")])
    deltas, merged = ch.take()
    assert merged == 2 and ch.coalesced == 2 and not ch.pending
    by_id = {d.request_id: d for d in deltas}
    assert by_id["a"].token_ids == [1, 2, 3] and by_id["a"].finish_reason == "length"
    assert by_id["a"].logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert by_id["b"].token_ids == [7] and not by_id["b"].finished


def _merge_pair(a: Delta, b: Delta) -> Delta:
    """The one-step-at-a-time merge (what ``Delta.merge`` did before ``merge_all``)."""
    from dataclasses import replace

    logprobs = a.logprobs
    if b.logprobs is not None:
        logprobs = (logprobs or []) + b.logprobs
    return replace(
        b,
        token_ids=a.token_ids + b.token_ids,
        logprobs=logprobs,
        text=a.text + b.text,
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        start=a.start if a.start >= 0 else b.start,
        moved_to=b.moved_to or a.moved_to,
        predicted=a.predicted or b.predicted,
    )


def test_merging_once_at_the_take_equals_merging_step_by_step() -> None:
    """A channel merges a sequence's deltas once, when its reader takes them (linear in the
    tokens); the result is the step-by-step merge's, field by field, over random runs of
    deltas (logprobs on some steps only, unpositioned ones, texts, a move, a prediction)."""
    import functools
    import random

    rng = random.Random(4)
    for trial in range(200):
        n = rng.randrange(1, 7)
        deltas = []
        for i in range(n):
            deltas.append(
                Delta(
                    "r",
                    [rng.randrange(100) for _ in range(rng.randrange(0, 3))],
                    [{1: -0.5}] if rng.random() < 0.4 else None,
                    text=rng.choice(["", "a", "bc"]),
                    num_cached_tokens=rng.randrange(3),
                    start=rng.choice([-1, 4 + i]),
                    moved_to=rng.choice([None, None, "d1", "d2"]),
                    predicted=rng.choice([None, None, (1.0, 2.0, float(i))]),
                    finish_reason="stop" if i == n - 1 and trial % 3 == 0 else None,
                )
            )
        ch = Channel()
        for d in deltas:
            ch.put([d])
        (got,), merged = ch.take()
        assert got == functools.reduce(_merge_pair, deltas) == Delta.merge_all(deltas)
        assert merged == n - 1


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_a_batch_pickles_columnar_and_arrives_equal_in_order() -> None:
    import pickle

    plain = [Delta(f"r{i}", [100 + i] * (1 + i % 3), index=i % 2, start=7 * i) for i in range(40)]
    rich = [
        Delta("r5", [9], [{9: -0.5, 3: -1.0}], start=12),  # logprobs
        Delta("r6", [4], finish_reason="stop", stop_reason=4, start=3),
        Delta("r7", error="worker died", retryable=True),
        Delta("r8", moved_to="decode-1", start=2),
        Delta("r9", [1], text="hi", num_cached_tokens=16, predicted=(1.0, 2.0, 3.0), start=0),
        Delta("r10", [], start=-1),  # no token, not positioned
    ]
    deltas = plain[:10] + rich[:3] + plain[10:30] + rich[3:] + plain[30:]
    batch = StreamBatch("decode-0", deltas, coalesced=2, step_age_s=0.25)
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch and [d.request_id for d in back.deltas] == [d.request_id for d in deltas]
    assert pickle.loads(pickle.dumps(StreamBatch("w", [], 0, 1.5))) == StreamBatch("w", [], 0, 1.5)
    # the common case is no list of dataclasses on the wire: a few arrays and the ids
    assert b"Delta" not in pickle.dumps(StreamBatch("w", plain))


def test_assembler_applies_stop_strings_and_stop_tokens(tokenizer) -> None:
    ids = tokenizer("The capital of France is Paris. It is big.")["input_ids"]
    params = SamplingParams(stop=["."], max_tokens=50)
    asm = Assembler("r", [1, 2], params, tokenizer)
    stopped, steps = [], []
    for t in ids:
        stopped.append(asm.apply(Delta("r", [t])))
        steps.append(asm.step())
    choices = [c for s in steps for c in s.choices]
    assert "".join(c.text for c in choices) == "The capital of France is Paris"  # no stop string
    assert [(c.finish_reason, c.stop_reason) for c in choices if c.finish_reason] == [("stop", ".")]
    assert stopped.count(True) == 1  # the worker is told once; later deltas change nothing
    assert sum((c.token_ids for c in choices), []) == ids[: stopped.index(True) + 1]
    assert steps[stopped.index(True)].finished and not steps[-1].choices
    assert steps[-1].usage.completion_tokens == stopped.index(True) + 1
    # A stop token (eos) ends the text without being part of it.
    eos = tokenizer.eos_token_id
    asm = Assembler("e", [1, 2], SamplingParams(), tokenizer)
    asm.apply(Delta("e", ids[:3]))
    asm.apply(Delta("e", [eos], finish_reason="stop"))
    step = asm.step()  # one batch: the two deltas as one choice delta
    assert step.finished and len(step.choices) == 1
    assert step.choices[0].text == tokenizer.decode(ids[:3])
    assert step.choices[0].token_ids == [*ids[:3], eos]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def tiny_worker(tmp_path, tiny_cfg, request):
    """A colocated worker on a random tiny Llama, in this process (async scheduling off, as on
    CPU by default, and on, as on CUDA)."""
    from decode_worker.colocated import ColocatedWorker

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_cfg())).save_pretrained(tmp_path)
    cfg = {"model_dir": str(tmp_path), "num_kv_blocks": 32, "block_size": 4}
    w = ColocatedWorker({**cfg, "async_scheduling": request.param}, "c")
    w.start()  # as ready() does
    return w


def test_a_readers_requests_are_aborted_when_it_goes_away(tiny_worker) -> None:
    w = tiny_worker
    w.streams.orphan_grace_s = 0.2

    async def scenario():
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        await w.generate("long", [1, 2, 3], params, "router-a")
        stream = w.outputs("router-a")
        batch = await stream.__anext__()
        while not batch.deltas:  # heartbeats
            batch = await stream.__anext__()
        assert batch.deltas[0].request_id == "long" and batch.deltas[0].token_ids
        await stream.aclose()  # the router is gone
        for _ in range(200):
            await asyncio.sleep(0.05)
            if not w.engine.has_unfinished_requests():
                break
        return await w.check_idle()

    try:
        assert asyncio.run(scenario()) is None
    finally:
        w.shutdown()


def test_every_sequence_of_n_ends_on_the_stream_when_they_end_in_one_step(tiny_worker) -> None:
    """n = 3 greedy samples end in the same step: each sequence's last delta reaches the
    reader (the request was forgotten after the first sequence's end, and the rest dropped:
    an n > 1 request through the gateway then never finished)."""
    w = tiny_worker

    async def scenario():
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=3)
        stream = w.outputs("router-n")
        await w.generate("n3", [1, 2, 3], params, "router-n")
        tokens: dict[int, list[int]] = {}
        ended: set[int] = set()
        deadline = time.monotonic() + 30  # heartbeats keep coming: bound the whole wait
        while len(ended) < 3:
            assert time.monotonic() < deadline, f"sequences {sorted(ended)} of 0-2 ended"
            batch = await asyncio.wait_for(stream.__anext__(), 30)
            for d in batch.deltas:
                tokens.setdefault(d.index, []).extend(d.token_ids)
                if d.finish_reason is not None:
                    ended.add(d.index)
        await stream.aclose()
        return tokens

    try:
        tokens = asyncio.run(scenario())
    finally:
        w.shutdown()
    assert sorted(tokens) == [0, 1, 2]
    assert all(len(t) == 4 for t in tokens.values()) and tokens[0] == tokens[1] == tokens[2]


def test_sse_frames_stay_one_line_under_any_line_splitter() -> None:
    """Token text may decode to U+2028, U+0085 or U+001C..1E: JSON leaves them raw, and
    splitlines()-based readers (httpx's iter_lines) would cut the frame there."""
    import json

    from router.protocol import sse

    obj = {"choices": [{"text": "a\u2028b\x85c\x1cd\u2029e \u00e9\u4e2d\n"}]}
    frame = sse(obj).decode()
    assert frame.endswith("\n\n") and frame.startswith("data: ")
    lines = frame.splitlines()
    assert lines[1:] == [""], lines  # one data line, then the blank line that ends the event
    assert json.loads(lines[0][len("data: ") :]) == obj
    assert "\u00e9\u4e2d" in frame  # other non-ASCII text stays raw UTF-8 (not \\u-escaped)


def test_an_idle_stream_sends_heartbeats(tiny_worker) -> None:
    """A reader tells a live worker from a hung one by the empty batches an idle stream sends."""
    w = tiny_worker
    w.streams.heartbeat_s = 0.05

    async def scenario():
        stream = w.outputs("router-h")
        t0 = time.monotonic()
        beats = [await stream.__anext__() for _ in range(3)]
        took = time.monotonic() - t0
        await w.generate("one", [1, 2, 3], SamplingParams(max_tokens=2), "router-h")
        batch = await stream.__anext__()
        while not batch.deltas:
            batch = await stream.__anext__()
        await stream.aclose()
        return beats, took, batch

    try:
        beats, took, batch = asyncio.run(scenario())
    finally:
        w.shutdown()
    assert all(b.deltas == [] and b.worker == "c" for b in beats)
    assert 0.1 <= took < 2.0
    assert batch.deltas[0].request_id == "one"


def test_the_engine_thread_starts_with_ready_not_in_the_constructor(tmp_path, tiny_cfg) -> None:
    """Roles set their state after the base constructor without racing the engine thread:
    its loop starts on ``ready()`` (the controller's first call), once. (The thread itself
    exists from the constructor: the engine is built on it.)"""
    from decode_worker.colocated import ColocatedWorker

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_cfg())).save_pretrained(tmp_path)
    w = ColocatedWorker({"model_dir": str(tmp_path), "num_kv_blocks": 16, "block_size": 4}, "c")
    try:
        assert not w._started and w._thread.is_alive() and w.steps == 0
        info = asyncio.run(w.ready())
        assert info["name"] == "c" and w._started and w._thread.is_alive()
        w.start()  # again: nothing happens
        assert w._thread.is_alive()
    finally:
        w.shutdown()
