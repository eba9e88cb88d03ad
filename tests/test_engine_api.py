"""The engine's public surface on a random tiny Llama: loading (sharded, dummy, errors), input
validation, the step API (streaming deltas, aborts) and block accounting after each of them."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from hf_oracle import tiny_config

from engine import LLM, SamplingParams
from engine.request import RequestStatus

transformers = pytest.importorskip("transformers")

CONFIG = tiny_config(vocab_size=256, max_position_embeddings=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in (3, 9, 21)]


def greedy_ids(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_sharded_checkpoint_loads_the_same_weights(tiny_dir, tmp_path, llm, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = LLM(str(tmp_path), block_size=4, num_kv_blocks=64)
    assert greedy_ids(sharded, prompts) == greedy_ids(llm, prompts)


def test_missing_shard_is_a_clear_error(tiny_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    next(iter(sorted(tmp_path.glob("*.safetensors")))).unlink()
    with pytest.raises(ValueError, match="missing shards"):
        LLM(str(tmp_path))


def test_dummy_weights_need_only_config(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*GPT2LMHeadModel"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "unsupported rope_scaling type 'yarn'",
        ),
    ],
)
def test_unsupported_config_names_what_and_what_is_supported(tiny_dir, tmp_path, patch, message):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(ValueError, match=message) as err:
        LLM(str(tmp_path), load_format="dummy")
    assert "LlamaForCausalLM" in str(err.value) or "supported" in str(err.value)


def test_bfloat16_on_cpu_runs(tiny_dir, prompts):
    llm = LLM(str(tiny_dir), dtype="bfloat16", num_kv_blocks=32)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt is empty"),
        ([1, 256], GREEDY, r"token ids must be integers in \[0, 256\)"),
        ([-1], GREEDY, "token ids must be integers"),
        (list(range(128)), GREEDY, "maximum context length is 128 tokens"),
        ("text", GREEDY, "no tokenizer"),
    ],
)
def test_bad_input_raises_and_leaks_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(None, prompt, params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_invariant(expect_idle=True)


def test_prompt_larger_than_the_pool_is_refused(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(20))], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_streaming_deltas_add_up_to_the_final_output(llm, prompts):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, n=2, logprobs=2)
    engine.add_request("s", prompts[1], params)
    deltas: dict[int, list[int]] = {0: [], 1: []}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                deltas[c.index] += c.delta_token_ids
            final = out
    assert final.finished
    for c in final.outputs:
        assert deltas[c.index] == c.token_ids and len(c.token_ids) == 8
        assert len(c.logprobs) == 8
    engine.block_manager.check_invariant(expect_idle=True)


def test_final_outputs_are_the_cumulative_ones_of_finished_requests(llm, prompts):
    """Output kind "final" (what ``LLM.generate`` steps with) hands out a request's output once,
    when it finishes: the same tokens, logprobs and finish reason as the last cumulative
    output; nothing for a request still running. ``generate`` leaves the kind as it was."""
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=m, n=2, logprobs=2) for m in (3, 8, 5)]

    def run(kind: str) -> dict[str, list]:
        assert llm.reset_prefix_cache()  # both runs compute the same way: logprobs to the bit
        engine.output_kind = kind
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{kind}-{i}", p, sp)
        seen: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.setdefault(out.request_id.split("-")[1], []).append(out)
        return seen

    cumulative, final = run("cumulative"), run("final")
    engine.output_kind = "cumulative"
    assert sorted(final) == sorted(cumulative) == ["0", "1", "2"]
    for i, outs in final.items():
        assert len(outs) == 1 and outs[0].finished  # once, at the end
        last = cumulative[i][-1]
        assert len(cumulative[i]) > 1 and last.finished
        for got, want in zip(outs[0].outputs, last.outputs, strict=True):
            assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
            assert got.finish_reason == want.finish_reason == "length"
    assert llm.generate(prompts[0], GREEDY)[0].finished
    assert engine.output_kind == "cumulative"
    engine.block_manager.check_invariant(expect_idle=True)


def test_abort_at_every_stage_frees_everything(tiny_dir, prompts):
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30)
    engine.add_request("waiting-then-aborted", prompts[0], params, priority=5)
    engine.add_request("mid-prefill", prompts[2], params)
    engine.add_request("decoding", prompts[0], params)
    engine.add_request("survivor", prompts[1], params)
    seen: dict[str, object] = {}
    for _ in range(2):  # budget 8: the 21-token prompt is two chunks in
        for out in engine.step():
            seen[out.request_id] = out
    requests = engine.scheduler.requests
    assert 0 < requests["mid-prefill"].num_computed_tokens < len(prompts[2])
    assert requests["waiting-then-aborted"].status == RequestStatus.WAITING
    engine.abort_request(["mid-prefill", "waiting-then-aborted"])
    for _ in range(4):
        engine.step()
    assert requests["decoding"].num_output_tokens > 0
    engine.abort_request("decoding")
    assert engine.scheduler.requests.keys() == {"survivor"}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
    assert seen["survivor"].outputs[0].finish_reason == "length"
    assert len(seen["survivor"].outputs[0].token_ids) == 30
    engine.block_manager.check_invariant(expect_idle=True)


def _poison(engine, monkeypatch, bad: list[int] | None) -> None:
    """The sampler raises whenever the row of prompt ``bad`` is in the batch (None: always)."""
    real = engine.runner.sampler

    class Poisoned:
        def sample(self, logits, rows):
            if bad is None or any(list(r.prompt_token_ids) == bad for r in rows):
                raise RuntimeError("poisoned row")
            return real.sample(logits, rows)

    monkeypatch.setattr(engine.runner, "sampler", Poisoned())


def test_a_request_that_breaks_the_step_fails_alone(tiny_dir, prompts, monkeypatch):
    """A fault one request causes ends that request alone, with an error that names an error id
    (no traceback) and its blocks freed; the requests batched with it get exactly their
    uninterrupted tokens."""
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    engine.output_kind = "delta"
    bad = [*prompts[1], 7]
    _poison(engine, monkeypatch, bad)
    for i, p in enumerate(prompts):
        engine.add_request(f"good-{i}", p, params)
    engine.add_request("bad", bad, params)
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.error is not None:
                errors[d.request_id] = d.error
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert list(errors) == ["bad"] and tokens["bad"] == []
    assert "RuntimeError" in errors["bad"] and "error id" in errors["bad"]
    assert "Traceback" not in errors["bad"] and "poisoned" not in errors["bad"]
    assert [tokens[f"good-{i}"] for i in range(len(prompts))] == expected
    engine.block_manager.check_invariant(expect_idle=True)


def test_a_fault_of_every_batch_is_the_engines(tiny_dir, prompts, monkeypatch):
    """When both halves of a failing batch fail, no one request is to blame: it is raised
    (the worker then ends every request), not pinned on one of them."""
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=64)
    engine = llm.engine
    engine.output_kind = "delta"
    _poison(engine, monkeypatch, None)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    with pytest.raises(RuntimeError, match="poisoned"):
        engine.step()
    assert engine.num_unfinished_requests == len(prompts)  # nothing was blamed


def test_a_resumed_request_goes_ahead_of_new_ones(tiny_dir, prompts):
    """A request that continues output produced elsewhere (its stream is mid-way) is admitted
    before new requests of its priority that arrived earlier."""
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("new", prompts[0], GREEDY)
    engine.add_request("later-new", prompts[2], GREEDY)
    engine.add_request("resumed", prompts[1], GREEDY, output_token_ids=[5, 6])
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["resumed"]
    engine.abort_request(["new", "later-new", "resumed"])
    engine.block_manager.check_invariant(expect_idle=True)


def test_progress_into_a_log_is_a_line_now_and_then(llm, prompts, capsys, monkeypatch):
    """``use_tqdm`` into a file or a pipe (stderr is not a terminal here): a whole line at most
    every PROGRESS_EVERY_S and one at the end, never a carriage-return line per request."""
    import engine.llm

    params = SamplingParams(temperature=0.0, max_tokens=2)
    monkeypatch.setattr(engine.llm, "PROGRESS_EVERY_S", 3600.0)
    llm.generate(prompts, params, use_tqdm=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith(f"{len(prompts)}/{len(prompts)} requests")
    monkeypatch.setattr(engine.llm, "PROGRESS_EVERY_S", 0.0)
    llm.generate(prompts, params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "\r" not in err and len(err.splitlines()) == len(prompts)
