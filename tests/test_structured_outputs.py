"""Structured outputs in the engine, SmolLM2 fp32 on CPU: every answer sampled at temperature 1
under one of 50+ varied JSON schemas parses and validates; the mask composes with top-k/top-p,
penalties, logprobs, n and seeds; a request continued from its output tokens rebuilds its
grammar state from them and goes on token for token; async scheduling waits for a constrained
request's token before masking its next step."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredSpec
from engine.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.structured_suite import schemas  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", device="cpu", max_num_seqs=64)


def chat(llm, text: str) -> list[int]:
    return apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}])


# ----------------------------------------------------------------------------- the schemas


def test_the_suite_is_varied():
    text = json.dumps(schemas())
    for keyword in ("minItems", "maxItems", "enum", "minimum", "maximum", "pattern", "maxLength"):
        assert text.count(keyword) >= 5, keyword
    nested = [s for s in schemas() if '"type": "object"' in json.dumps(s.get("properties", {}))]
    assert len(nested) >= 5


# ----------------------------------------------------------------------------- validity


def test_every_sampled_answer_is_valid(llm):
    """temperature 1, one request per schema, all in one batch: 100 % parse and validate."""
    suite = schemas()
    prompts, params = [], []
    for i, schema in enumerate(suite):
        prompts.append(chat(llm, f"Answer with JSON following this schema: {json.dumps(schema)}"))
        params.append(
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=MAX_TOKENS,
                structured=StructuredSpec.json_schema(schema),
            )
        )
    outputs = llm.generate(prompts, params)
    bad = []
    for schema, out in zip(suite, outputs, strict=True):
        o = out.outputs[0]
        try:
            jsonschema.validate(json.loads(o.text), schema)
            assert o.finish_reason == "stop", o.finish_reason
        except Exception as exc:  # noqa: BLE001 - collected, reported together
            bad.append((o.text, o.finish_reason, str(exc)[:120]))
    assert not bad, f"{len(bad)}/{len(suite)} invalid: {bad[:3]}"


def test_regex_choice_json_object_and_sampling_knobs(llm):
    """The mask composes with top-k/top-p/min-p, penalties, logprobs, n and seeds."""
    prompt = chat(llm, "Give me a JSON object describing a cat.")
    base = dict(temperature=1.0, max_tokens=MAX_TOKENS)
    cases = [
        (StructuredSpec.json_object(), dict(top_k=20, top_p=0.9, seed=1)),
        (StructuredSpec.regex(r"[0-9]{3}-[a-z]{2,5}"), dict(presence_penalty=1.5, seed=2)),
        (StructuredSpec.choice(["alpha", "beta", "gamma delta"]), dict(logprobs=3, n=4, seed=3)),
        (
            StructuredSpec.json_schema({"type": "integer", "minimum": 0, "maximum": 999}),
            dict(repetition_penalty=1.3, min_p=0.1),
        ),
        (StructuredSpec.choice(["yes", "no"]), dict(temperature=0.0, min_tokens=5)),
    ]
    outputs = llm.generate(
        [prompt] * len(cases), [SamplingParams(structured=s, **{**base, **k}) for s, k in cases]
    )
    obj, regex, choice, integer, yes_no = outputs
    assert isinstance(json.loads(obj.outputs[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", regex.outputs[0].text)
    assert len(choice.outputs) == 4
    for o in choice.outputs:
        assert o.text in ("alpha", "beta", "gamma delta")
        assert len(o.logprobs) == len(o.token_ids) and all(len(e) >= 1 for e in o.logprobs)
    int(integer.outputs[0].text)
    assert yes_no.outputs[0].text in ("yes", "no")  # the grammar ends it before min_tokens
    for out in outputs:
        assert all(o.finish_reason == "stop" for o in out.outputs)


def test_seeded_constrained_sampling_repeats(llm):
    prompt = chat(llm, "A JSON object with a name and an age.")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    p = SamplingParams(
        temperature=1.0, seed=7, max_tokens=64, structured=StructuredSpec.json_schema(schema)
    )
    first, second = llm.generate([prompt, prompt], [p, p])
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


# ----------------------------------------------------------------------------- state from tokens


def test_continuing_from_output_tokens_rebuilds_the_grammar(llm):
    """Greedy: a request continued from the first k tokens of a constrained answer (a resume,
    a migration, a decode worker after a prefill worker) goes on with the same tokens."""
    engine = llm.engine
    prompt = chat(llm, "Describe a book as JSON.")
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            "genres": {
                "type": "array",
                "items": {"enum": ["sf", "crime", "poetry"]},
                "maxItems": 2,
            },
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured=StructuredSpec.json_schema(schema)
    )
    fresh = llm.generate(prompt, params)[0].outputs[0]
    assert fresh.finish_reason == "stop"
    jsonschema.validate(json.loads(fresh.text), schema)
    for k in (1, len(fresh.token_ids) // 2, len(fresh.token_ids) - 1):
        rid = engine.add_request(None, prompt, params, output_token_ids=fresh.token_ids[:k])
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
        assert fresh.token_ids[:k] + final.outputs[0].token_ids == fresh.token_ids, k


def run_all(engine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_a_grammar_that_fails_ends_its_request_alone(llm):
    """In one batch: a spec that does not compile (the engine compiles off its thread: the
    request ends with the compile's error), carried output that breaks its grammar, and a
    matcher that errs mid-answer each end their own request with finish_reason "error" and
    the reason; the free request beside them keeps its greedy tokens."""
    engine = llm.engine
    prompt = chat(llm, "Name a color.")
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(prompt, free)[0].outputs[0].token_ids
    choice = SamplingParams(max_tokens=8, structured=StructuredSpec.choice(["yes", "no"]))
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 6, "maxItems": 6}
    array = SamplingParams(
        temperature=0.0, max_tokens=40, structured=StructuredSpec.json_schema(schema)
    )
    bad = llm.tokenizer.encode("maybe", add_special_tokens=False)
    ids = {
        "regex": engine.add_request(
            None, prompt, SamplingParams(structured=StructuredSpec.regex("a("))
        ),
        "carried": engine.add_request(None, prompt, choice, output_token_ids=bad),
        "free": engine.add_request(None, prompt, free),
        "array": engine.add_request(None, prompt, array),
    }
    final, errs = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
        request = engine.single_request(ids["array"])
        if request is not None and request.num_output_tokens == 3 and errs is None:
            errs = request.grammar.accept(bad[0])  # a refused token puts the matcher in error
    out = {name: final[rid] for name, rid in ids.items()}
    assert errs is False
    assert (
        "invalid regex" in out["regex"].error and out["regex"].outputs[0].finish_reason == "error"
    )
    assert "does not follow" in out["carried"].error
    assert "is not allowed here" in out["array"].error
    assert out["array"].outputs[0].finish_reason == "error" and out["array"].finished
    assert len(out["array"].outputs[0].token_ids) == 3  # the token drawn after is not sent
    assert out["free"].error is None and out["free"].outputs[0].token_ids == alone
    stats = engine.grammar_stats()
    assert stats["errors"] >= 3
    assert sum(n for _, n in stats["compile_buckets"]) == engine.structured_outputs().compiles
    assert sum(n for _, n in stats["mask_buckets"]) >= 3 and stats["mask_sum"] > 0
    engine.block_manager.check_invariant(expect_idle=True)
    with pytest.raises(ValueError, match="invalid regex"):  # offline: before anything runs
        llm.generate(prompt, SamplingParams(structured=StructuredSpec.regex("a(")))


def test_a_grammar_failure_is_an_error_delta_for_a_worker(smollm2_dir):
    """The workers' output form: the failed request's stream ends with an error delta (its
    client gets an OpenAI error), the other request's deltas go on to its end."""
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", async_scheduling=True)
    engine = llm.engine
    engine.output_kind = "delta"
    prompt = chat(llm, "Name a color.")
    spec = StructuredSpec.json_schema({"enum": ["red", "green", "blue"]})
    engine.add_request("bad", prompt, SamplingParams(structured=StructuredSpec.regex("[")))
    engine.add_request("good", prompt, SamplingParams(max_tokens=10, structured=spec))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    bad = [d for d in deltas if d.request_id == "bad"]
    good = [d for d in deltas if d.request_id == "good"]
    assert len(bad) == 1 and "regex" in bad[0].error and not bad[0].retryable
    assert good[-1].finish_reason == "stop" and all(d.error is None for d in good)
    text = llm.tokenizer.decode([t for d in good for t in d.token_ids], skip_special_tokens=True)
    assert json.loads(text) in ("red", "green", "blue")


def test_a_slow_compile_never_stalls_the_batch(smollm2_dir, monkeypatch):
    """A compile that takes long runs off the engine thread: the request waits
    (WAITING_FOR_GRAMMAR) while the free request decodes; it runs once its grammar lands."""
    import threading

    from engine.grammar import Grammars
    from engine.request import RequestStatus

    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu")
    engine = llm.engine
    release = threading.Event()
    compile_once = Grammars.compile

    def slow(self, spec):
        release.wait(60)
        return compile_once(self, spec)

    monkeypatch.setattr(Grammars, "compile", slow)
    prompt = chat(llm, "Name a color.")
    spec = StructuredSpec.choice(["red", "green"])
    slow_id = engine.add_request(None, prompt, SamplingParams(max_tokens=5, structured=spec))
    free_id = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=6))
    waiting = engine.single_request(slow_id)
    final = {}
    while free_id not in final:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR
    release.set()
    final.update(run_all(engine))
    assert final[slow_id].outputs[0].text in ("red", "green")
    assert len(final[free_id].outputs[0].token_ids) == 6


def test_async_scheduling_with_constrained_and_free_requests(smollm2_dir):
    """Async scheduling: constrained requests wait for their token before their next step;
    the free ones in the same batch keep their greedy tokens."""
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", async_scheduling=True)
    free = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = chat(llm, "Name three colors.")
    alone = llm.generate(prompt, free)[0].outputs[0].token_ids
    spec = StructuredSpec.json_schema(
        {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 3, "maxItems": 3}
    )
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured=spec)
    outs = llm.generate([prompt, prompt, prompt], [free, constrained, free])
    assert outs[0].outputs[0].token_ids == alone == outs[2].outputs[0].token_ids
    value = json.loads(outs[1].outputs[0].text)
    assert len(value) == 3 and set(value) <= {"red", "green", "blue"}
