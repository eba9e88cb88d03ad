"""Structured outputs, the grammar layer (engine/grammar.py) and its spec (StructuredSpec):
compile, cache, mask, accept, termination, errors. SmolLM2's tokenizer, no model."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from engine.grammar import (
    BACKENDS,
    Grammars,
    allocate_bitmask,
    allowed_tokens,
    make_backend,
)
from engine.sampling_params import SamplingParams, StructuredSpec

pytest.importorskip("llguidance")

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def grammars(tokenizer, eos):
    return Grammars(make_backend("llguidance", tokenizer, VOCAB, [eos]), capacity=4)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def may_end(matcher, eos):
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return eos in allowed_tokens(bitmask[0], VOCAB)


def follows(grammars, spec, tokenizer, text):
    try:
        grammars.matcher(spec, encode(tokenizer, text))
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------- the spec


def test_spec_is_canonical_hashable_and_pickles():
    a = StructuredSpec.json_schema({"b": 1, "a": {"type": "object"}})
    b = StructuredSpec.json_schema('{"a": {"type": "object"}, "b": 1}')
    assert a == b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a
    params = SamplingParams(structured=StructuredSpec.choice(["yes", "no"]))
    assert pickle.loads(pickle.dumps(params)).structured.choices == ["yes", "no"]
    assert params.for_child(1).structured == params.structured


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: StructuredSpec("yaml", "x"), "kind must be one of"),
        (lambda: StructuredSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredSpec.json_schema("[1, 2]"), "must be a JSON object"),
        (lambda: StructuredSpec.choice([]), "non-empty list"),
        (lambda: StructuredSpec.choice(["a", 1]), "strings only"),
        (lambda: StructuredSpec.regex(""), "must not be empty"),
        (lambda: SamplingParams(structured={"kind": "regex"}), "structured must be"),
    ],
)
def test_spec_errors_name_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- compile / cache


def test_registry_and_unknown_backend(tokenizer):
    assert "llguidance" in BACKENDS
    with pytest.raises(ValueError, match="grammar backend must be one of"):
        make_backend("nope", tokenizer, VOCAB, [0])


def test_compile_is_cached_per_spec_with_a_bound(grammars):
    before = grammars.compiles
    specs = [StructuredSpec.regex(f"a{i}") for i in range(6)]
    for spec in specs:
        grammars.compile(spec)
    grammars.compile(specs[-1])
    assert grammars.compiles == before + 6
    assert len(grammars) == 4  # bounded: the oldest went
    grammars.compile(specs[0])
    assert grammars.compiles == before + 7


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "frob"}}}),
            "frob",
        ),
        (StructuredSpec.json_schema({"type": "string", "pattern": "(a"}), "unclosed group"),
        (StructuredSpec.regex("a(b"), "regex"),
        (StructuredSpec.json_schema({"$ref": "#/definitions/missing"}), "missing"),
    ],
)
def test_a_bad_spec_is_a_value_error_naming_it(grammars, spec, words):
    with pytest.raises(ValueError) as info:
        grammars.compile(spec)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec.regex("0\U00040000"),  # tests/test_fuzz.py's: a 4-byte lead byte 0xF1
        StructuredSpec.choice(["ok", "a\x04"]),
        StructuredSpec.json_schema({"enum": ["x", "\U00080000"]}),
        StructuredSpec.json_schema({"type": "object", "properties": {"\x1d": {"type": "string"}}}),
    ],
)
def test_a_character_the_tokenizer_cannot_write_is_refused(grammars, spec):
    with pytest.raises(ValueError, match=r"character U\+[0-9A-F]+ cannot be written .* byte 0x"):
        grammars.compile(spec)


def test_strict_refuses_an_unsupported_keyword_lenient_ignores_it(grammars):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedItems": 3}
    with pytest.raises(ValueError, match="unevaluatedItems"):
        grammars.compile(StructuredSpec.json_schema(schema, strict=True))
    grammars.compile(StructuredSpec.json_schema(schema, strict=False))


# ----------------------------------------------------------------------------- mask / accept


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "blue"]},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["color", "n", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"color": "red", "n": 3, "tags": ["a"]}', True),
        ('{"color":"blue","n":9,"tags":[]}', True),
        ('{"color": "green", "n": 3, "tags": []}', False),
        ('{"color": "red", "n": 10, "tags": []}', False),
        ('{"color": "red", "n": 3, "tags": ["a", "b", "c"]}', False),
        ('{"color": "red", "n": 3, "tags": [], "x": 1}', False),
    ],
)
def test_json_schema_accepts_valid_and_refuses_invalid(grammars, tokenizer, eos, text, ok):
    spec = StructuredSpec.json_schema(SCHEMA)
    assert follows(grammars, spec, tokenizer, text) is ok
    if ok:
        matcher = grammars.matcher(spec, encode(tokenizer, text))
        assert may_end(matcher, eos) and matcher.is_terminated()


def test_mask_allows_only_what_the_grammar_allows(grammars, tokenizer, eos):
    matcher = grammars.matcher(StructuredSpec.json_schema(SCHEMA), encode(tokenizer, '{"color": "'))
    bitmask = allocate_bitmask(2, VOCAB)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all()  # the other row untouched
    allowed = set(allowed_tokens(bitmask[1], VOCAB).tolist())
    assert allowed and eos not in allowed
    texts = {tokenizer.decode([t]) for t in allowed}
    assert all("red".startswith(t) or "blue".startswith(t) for t in texts), sorted(texts)[:10]
    token = encode(tokenizer, "red")[0]
    assert token in allowed and matcher.accept(token)
    assert not matcher.accept(encode(tokenizer, "}")[0])  # a refused token is refused


def test_json_object_regex_and_choice(grammars, tokenizer, eos):
    obj = StructuredSpec.json_object()
    assert follows(grammars, obj, tokenizer, '{"any": [1, {"thing": null}]}')
    assert not follows(grammars, obj, tokenizer, "[1, 2]")
    regex = StructuredSpec.regex(r"[0-9]{3}-[a-z]+")
    assert follows(grammars, regex, tokenizer, "123-abc")
    assert not follows(grammars, regex, tokenizer, "12-abc")
    choice = StructuredSpec.choice(["yes", "no", "a.b (c)"])
    for text in ("yes", "no", "a.b (c)"):
        matcher = grammars.matcher(choice, encode(tokenizer, text))
        assert may_end(matcher, eos)
    assert not follows(grammars, choice, tokenizer, "maybe")
    assert not follows(grammars, choice, tokenizer, "aXb (c)")  # "." is literal


def test_text_that_spells_an_added_token_is_written_in_ordinary_tokens(grammars, tokenizer, eos):
    """A regex whose text is an added token's (``<|im_start|>``: the HF tokenizer would match the
    added token in it, which llguidance's parser refuses as special) is written with ordinary
    tokens: every step's mask holds a token the matcher takes, and the answer ends as written."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    matcher = grammars.matcher(StructuredSpec.regex(r"<\|im_start\|>[a-z]{2}"))
    bitmask = allocate_bitmask(1, VOCAB)
    written = []
    while not matcher.is_terminated():
        matcher.fill_bitmask(bitmask, 0)
        allowed = [t for t in allowed_tokens(bitmask[0], VOCAB).tolist() if t != eos]
        assert allowed and special not in allowed, allowed[:5]
        assert matcher.accept(allowed[0]), matcher.error
        written.append(allowed[0])
        assert len(written) < 32
        if may_end(matcher, eos):
            break
    assert tokenizer.decode(written).startswith("<|im_start|>") and len(written) > 1


def test_terminated_only_when_complete(grammars, tokenizer, eos):
    spec = StructuredSpec.choice(["yes"])
    matcher = grammars.matcher(spec)
    assert not matcher.is_terminated() and not may_end(matcher, eos)
    for token in encode(tokenizer, "yes"):
        assert matcher.accept(token)
    assert matcher.is_terminated()


def test_a_token_that_breaks_the_grammar_is_a_value_error(grammars, tokenizer):
    with pytest.raises(ValueError, match=r"output token 0 \(id \d+\) does not follow"):
        grammars.matcher(StructuredSpec.json_schema(SCHEMA), encode(tokenizer, "hello"))


def test_matchers_are_independent(grammars, tokenizer):
    spec = StructuredSpec.json_schema(SCHEMA)
    a = grammars.matcher(spec, encode(tokenizer, '{"color": "red"'))
    b = grammars.matcher(spec)
    ma, mb = allocate_bitmask(1, VOCAB), allocate_bitmask(1, VOCAB)
    a.fill_bitmask(ma, 0)
    b.fill_bitmask(mb, 0)
    assert not np.array_equal(ma, mb)
    assert json.loads(spec.value) == SCHEMA


def test_the_grammar_layer_and_the_scheduler_core_import_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, engine.grammar, engine.request, engine.scheduler, engine.sampling_params; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
