"""The engine-side length refinement: the hidden state captured at each prompt's last token
(equal to transformers' own, through chunked prefill and prefix hits), the probe's fit / save /
load, and the estimate's path to the client: RequestOutput, the first Delta, the prefill
worker's first-token dict over the KV channel to the decode worker's first Delta. With or
without a probe, greedy tokens are the same."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from hf_oracle import hf_greedy_ids, save_tiny

from engine import LLM, SamplingParams
from engine.kv_transfer.streamer import token_from_dict, token_to_dict
from engine.length_probe import (
    QUANTILES,
    LengthProbe,
    evaluate,
    kendall_tau,
    model_shape,
    shipped_for,
)
from engine.messages import Delta, PrefillDone, Reserved
from engine.outputs import SampledToken

transformers = pytest.importorskip("transformers")

LAYERS = 3
ENGINE = {"block_size": 4, "num_kv_blocks": 96, "max_num_batched_tokens": 8, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-probe", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(320) for _ in range(n)] for n in (1, 6, 24, 37)]


@pytest.fixture(scope="module")
def probe_path(tmp_path_factory):
    """A probe with random weights on layers (-1, 1) of the tiny model (hidden 64)."""
    rng = np.random.default_rng(0)
    width = 2 * 64 + 1
    probe = LengthProbe(
        (-1, 1),
        rng.normal(size=width) * 0.3,
        3.0,
        np.zeros(width),
        np.ones(width),
        {0.5: 0.0, 0.9: 0.7, 0.99: 1.5},
    )
    path = tmp_path_factory.mktemp("probe") / "probe"
    probe.save(path)
    return str(path)


def hf_hidden(model_dir: str, prompt: list[int]) -> list[np.ndarray]:
    """transformers' hidden states at the last token: [embeddings, layer 0 out, ..., normed]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return [h[0, -1].numpy() for h in out.hidden_states]


def test_captured_hidden_state_equals_transformers(tiny, prompts) -> None:
    llm = LLM(tiny, prompt_hidden_layers=(-1, 0, 1), **ENGINE)  # 8-token chunks: 24, 37 split
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # prefix hits: only the prompt's tail computes
    assert again[3].num_cached_tokens >= 32 and again[2].num_cached_tokens >= 20
    for prompt, a, b in zip(prompts, first, again, strict=True):
        hf = hf_hidden(tiny, prompt)
        for out in (a, b):
            assert sorted(out.prompt_hidden) == [-1, 0, 1]
            np.testing.assert_allclose(out.prompt_hidden[-1], hf[LAYERS], atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(out.prompt_hidden[0], hf[1], atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(out.prompt_hidden[1], hf[2], atol=1e-4, rtol=1e-4)
    llm.engine.block_manager.check_invariant(expect_idle=True)


def test_no_capture_by_default(tiny, prompts) -> None:
    llm = LLM(tiny, **ENGINE)
    assert llm.engine.runner.capture_layers == ()
    out = llm.generate(prompts[:2], GREEDY)
    assert all(o.prompt_hidden is None and o.predicted_tokens is None for o in out)


def test_bad_capture_layer_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match="out of range"):
        LLM(tiny, prompt_hidden_layers=(LAYERS,), **ENGINE)


# -- the probe ------------------------------------------------------------------------------------


def synthetic(n: int, seed: int):
    """Hidden states [n, 2, 16] whose log length is linear in them, plus noise."""
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(99).normal(size=32) * 0.2
    hidden = rng.normal(size=(n, 2, 16))
    prompt_lens = rng.integers(1, 500, n)
    log_len = 4.0 + hidden.reshape(n, -1) @ w + 0.2 * np.log1p(prompt_lens)
    lengths = np.round(np.expm1(log_len + rng.normal(size=n) * 0.3))
    return hidden, prompt_lens, np.maximum(lengths, 1)


def test_probe_fit_save_load_round_trip(tmp_path) -> None:
    train, test = synthetic(2000, 0), synthetic(500, 1)
    probe = LengthProbe.fit((-1, 7), *train, alpha=1e-3, holdout=test)
    pred = probe.quantiles(*test[:2])
    assert pred.shape == (500, 3) and np.all(np.diff(pred, axis=1) >= 0)
    report = evaluate(pred, test[2])
    assert report["kendall_tau"] > 0.6
    for q in QUANTILES:  # residual quantiles from that held-out set: calibrated on it
        assert abs(report["coverage"][str(q)] - q) < 0.02
    probe.meta = {"evaluation": report}
    probe.save(tmp_path / "p")
    loaded = LengthProbe.load(tmp_path / "p")
    assert loaded.layers == (-1, 7) and loaded.meta == {"evaluation": report}
    np.testing.assert_allclose(loaded.quantiles(*test[:2]), pred, rtol=1e-4)
    one = loaded.predict({-1: test[0][0, 0], 7: test[0][0, 1]}, int(test[1][0]))
    np.testing.assert_allclose(one, pred[0], rtol=1e-4)
    assert one[0] <= one[1] <= one[2]


def test_probe_artifact_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected"):
        LengthProbe.load(tmp_path / "missing")
    probe = LengthProbe.fit((-1,), *synthetic(100, 0))  # 2 layers of 16 read as one of 32
    with pytest.raises(ValueError, match="hidden size 32"):
        probe.check(64, 3)


def test_kendall_tau() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


# -- the estimate's path --------------------------------------------------------------------------


def test_engine_with_probe_attaches_the_estimate_and_keeps_tokens(tiny, prompts, probe_path):
    plain = LLM(tiny, **ENGINE).generate(prompts, GREEDY)
    llm = LLM(tiny, length_probe=probe_path, prompt_hidden_layers=(-1, 1), **ENGINE)
    probed = llm.generate(prompts, GREEDY)
    probe = LengthProbe.load(probe_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    for prompt, a, b in zip(prompts, plain, probed, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].token_ids == hf_greedy_ids(model, prompt, GREEDY.max_tokens)
        assert a.predicted_tokens is None
        expected = probe.predict(b.prompt_hidden, len(prompt))
        assert b.predicted_tokens == pytest.approx(expected)
        assert b.predicted_tokens[0] <= b.predicted_tokens[1] <= b.predicted_tokens[2]
    assert len({b.predicted_tokens for b in probed}) == len(prompts)  # per prompt

    # Streaming (what workers send): the first delta of each request carries it, no other.
    llm.engine.output_kind = "delta"
    llm.engine.add_request("s", prompts[2], GREEDY)
    deltas = []
    while llm.engine.has_unfinished_requests():
        deltas += llm.engine.step()
    assert deltas[0].predicted == pytest.approx(probed[2].predicted_tokens)
    assert all(d.predicted is None for d in deltas[1:])
    assert [t for d in deltas for t in d.token_ids] == probed[2].outputs[0].token_ids


def test_first_token_dict_carries_the_estimate() -> None:
    token = SampledToken(5, -0.5, [(5, -0.5)], (10.0, 40.0, 90.0))
    back = token_from_dict(token_to_dict(token))
    assert back == token
    assert "predicted" not in token_to_dict(SampledToken(5, None, None))
    bad = {**token_to_dict(token), "predicted": [1.0, "x", 3.0]}
    assert token_from_dict(bad).predicted is None  # advisory: dropped, the token still counts
    merged = Delta("r", [1], predicted=(1.0, 2.0, 3.0)).merge(Delta("r", [2]))
    assert merged.predicted == (1.0, 2.0, 3.0) and merged.token_ids == [1, 2]


def test_disaggregated_first_delta_carries_the_prefill_estimate(tiny, prompts, probe_path):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    expected = LLM(tiny, length_probe=probe_path, **ENGINE).generate(prompts, GREEDY)
    cfg = {"model_dir": tiny, **ENGINE}
    p = PrefillWorker({**cfg, "length_probe": probe_path}, "p")
    d = DecodeWorker(cfg, "d", transport="inproc")  # the decode side has no probe
    p.start(), d.start()

    async def one(rid: str, prompt: list[int]):
        res = await d.reserve(rid, prompt, GREEDY, rid)
        assert isinstance(res, Reserved)
        pre = asyncio.ensure_future(p.prefill(rid, prompt, GREEDY, res.endpoint))
        deltas: list[Delta] = []
        stream = d.outputs(rid)
        async for batch in stream:
            deltas += batch.deltas
            if deltas and deltas[-1].finished:
                break
        await stream.aclose()
        return await pre, deltas

    async def run_all():
        return await asyncio.gather(*(one(f"r{i}", x) for i, x in enumerate(prompts)))

    try:
        for (done, deltas), exp in zip(asyncio.run(run_all()), expected, strict=True):
            assert isinstance(done, PrefillDone)
            # (the same hidden state up to float rounding: other requests share its batches)
            assert done.token.predicted == pytest.approx(exp.predicted_tokens, rel=1e-4)
            assert deltas[0].predicted == done.token.predicted
            assert all(x.predicted is None for x in deltas[1:])
            assert [t for x in deltas for t in x.token_ids] == exp.outputs[0].token_ids
    finally:
        p.shutdown()
        d.shutdown()


def test_colocated_first_delta_carries_the_estimate(tiny, prompts, probe_path):
    from decode_worker.colocated import ColocatedWorker

    expected = LLM(tiny, length_probe=probe_path, **ENGINE).generate(prompts[2:], GREEDY)[0]
    w = ColocatedWorker({"model_dir": tiny, "length_probe": probe_path, **ENGINE}, "c")
    w.start()

    async def scenario() -> list[Delta]:
        await w.generate("c0", prompts[2], GREEDY, "router")
        deltas: list[Delta] = []
        stream = w.outputs("router")
        async for batch in stream:
            deltas += batch.deltas
            if deltas and deltas[-1].finished:
                break
        await stream.aclose()
        return deltas

    try:
        deltas = asyncio.run(scenario())
    finally:
        w.shutdown()
    assert deltas[0].predicted == pytest.approx(expected.predicted_tokens, rel=1e-4)
    assert all(d.predicted is None for d in deltas[1:])
    assert [t for d in deltas for t in d.token_ids] == expected.outputs[0].token_ids


def test_auto_loads_the_shipped_probe_of_the_model_s_shape(tiny, prompts) -> None:
    """``length_probe="auto"`` finds the shipped probe by the model's shape: SmolLM2's for
    SmolLM2's shape, none for the tiny model (which then runs without one, same tokens)."""
    found = shipped_for(model_shape(49152, 576, 30))
    assert found is not None and found.name == "probe_smollm2"
    probe = LengthProbe.load(found)
    probe.check(576, 30)
    assert probe.meta["model_shape"] == model_shape(49152, 576, 30)
    assert shipped_for(model_shape(49152, 576, 29)) is None
    llm = LLM(model=tiny, **ENGINE, length_probe="auto")
    assert llm.engine.length_probe is None and llm.engine.runner.capture_layers == ()
    out = llm.generate([prompts[1]], GREEDY)[0]
    assert out.predicted_tokens is None and len(out.outputs[0].token_ids) == 6
