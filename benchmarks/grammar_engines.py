"""Grammar engines side by side on CPU (issue 27): xgrammar and llguidance, SmolLM2's tokenizer.

For each of ten JSON schemas (nested objects, arrays with min/max items, enums, number ranges,
string patterns), per engine:

  compile      schema -> compiled grammar (xgrammar: ``compile_json_schema``; llguidance:
               ``grammar_from_json_schema`` + ``LLMatcher``), cold
  first mask   compile + the first token mask (llguidance builds its lexer lazily, so its
               first mask carries part of the compile)
  mask         per-token mask fill over constrained random walks (mean and p99, ms)
  valid        walks that ended (EOS allowed and taken) and whose text parses and validates
               against the schema with ``jsonschema``; ``ended`` counts the walks that ended
               within the token budget (the others are cut, not judged)
  accepts      every hand-written valid instance is accepted token by token and may end there;
               ``rejects``: the invalid ones are refused somewhere along the way

A walk samples, at each step, uniformly among the allowed tokens with probability 1/2, else the
allowed token with the lowest id (short structural tokens: it steers walks to an end), and takes
EOS as soon as it is allowed.

Usage:  python benchmarks/grammar_engines.py [--walks 8] [--budget 160]
Prints a table, writes benchmarks/results/grammar_engines.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "int_range": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 17}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "num_range": {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.25}},
        "required": ["x"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    "string_len": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"type": "string", "enum": ["a", "b"]},
                "v": {"type": "integer", "minimum": -5, "maximum": 5},
            },
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 2,
        "maxItems": 4,
    },
    "optional_and_null": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 8},
            "score": {"type": ["number", "null"]},
            "done": {"type": "boolean"},
        },
        "required": ["done"],
        "additionalProperties": False,
    },
}

VALID: dict[str, list[str]] = {
    "flat": ['{"name": "Ann", "age": 41}'],
    "enum": ['{"color": "green", "ok": false}'],
    "int_range": ['{"n": 3}', '{"n": 17}'],
    "num_range": ['{"x": -1.5}', '{"x": 2.25}', '{"x": 0.5}'],
    "array_bounds": ['{"tags": ["a"]}', '{"tags": ["a", "b", "c"]}'],
    "pattern": ['{"zip": "12345"}'],
    "string_len": ['{"code": "ab"}', '{"code": "abcd"}'],
    "nested": ['{"user": {"id": 7, "address": {"city": "Oslo"}}}'],
    "array_of_objects": ['[{"k": "a", "v": -5}, {"k": "b", "v": 5}]'],
    "optional_and_null": ['{"done": true}', '{"title": "x", "score": null, "done": false}'],
}
INVALID: dict[str, list[str]] = {
    "flat": ['{"name": "Ann"}', '{"name": "Ann", "age": 41, "x": 1}'],
    "enum": ['{"color": "pink", "ok": true}'],
    "int_range": ['{"n": 2}', '{"n": 18}'],
    "num_range": ['{"x": 3}', '{"x": -2}'],
    "array_bounds": ['{"tags": []}', '{"tags": ["a", "b", "c", "d"]}'],
    "pattern": ['{"zip": "1234"}', '{"zip": "abcde"}'],
    "string_len": ['{"code": "a"}', '{"code": "abcde"}'],
    "nested": ['{"user": {"id": -1, "address": {"city": "Oslo"}}}'],
    "array_of_objects": ['[{"k": "a", "v": 1}]'],
    "optional_and_null": ['{"title": "x"}'],
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return _XMatcher(self.xgr.GrammarMatcher(compiled))


class _XMatcher:
    def __init__(self, m):
        self.m = m

    def fill(self, bitmask: np.ndarray) -> None:
        self.m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def terminated(self) -> bool:
        return self.m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.setup_s = time.perf_counter() - t

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True}
        )
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled):
        grammar, _ = compiled
        return _LMatcher(self.llg.LLMatcher(self.tok, grammar, log_level=0))


class _LMatcher:
    def __init__(self, m):
        self.m = m

    def fill(self, bitmask: np.ndarray) -> None:
        v = bitmask[0]
        self.m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def terminated(self) -> bool:
        return self.m.is_stopped()


def allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(engine, compiled, eos: int, vocab: int, budget: int, rng: random.Random, times: list):
    """One constrained random walk: (tokens, ended)."""
    m = engine.matcher(compiled)
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    tokens: list[int] = []
    for _ in range(budget):
        t = time.perf_counter()
        m.fill(bitmask)
        times.append(time.perf_counter() - t)
        ids = allowed(bitmask, vocab)
        if eos in ids:
            return tokens, True
        if len(ids) == 0:
            return tokens, False
        token = int(rng.choice(ids)) if rng.random() < 0.5 else int(ids[0])
        if not m.accept(token):
            raise RuntimeError(f"{engine.name} refused a token its own mask allowed: {token}")
        tokens.append(token)
    return tokens, False


def accepts(engine, compiled, tokenizer, text: str, eos: int, vocab: int) -> bool:
    """Whether ``text``'s tokens are accepted one by one and EOS is allowed after them."""
    m = engine.matcher(compiled)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not m.accept(token):
            return False
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    m.fill(bitmask)
    return eos in allowed(bitmask, vocab)


def run_engine(engine, tokenizer, vocab: int, eos: int, walks: int, budget: int) -> dict:
    import jsonschema

    rows = {}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        try:
            compiled = engine.compile(schema)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        compile_s = time.perf_counter() - t
        first = engine.matcher(compiled)
        bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
        t = time.perf_counter()
        first.fill(bitmask)
        first_mask_s = time.perf_counter() - t
        rng, times = random.Random(0), []
        ended = valid = 0
        bad: list[str] = []
        for _ in range(walks):
            tokens, done = walk(engine, compiled, eos, vocab, budget, rng, times)
            if not done:
                continue
            ended += 1
            text = tokenizer.decode(tokens)
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except Exception:  # noqa: BLE001 - counted
                bad.append(text[:120])
        ok = [accepts(engine, compiled, tokenizer, s, eos, vocab) for s in VALID[name]]
        no = [not accepts(engine, compiled, tokenizer, s, eos, vocab) for s in INVALID[name]]
        rows[name] = {
            "compile_ms": compile_s * 1e3,
            "first_mask_ms": (compile_s + first_mask_s) * 1e3,
            "mask_mean_ms": statistics.fmean(times) * 1e3,
            "mask_p99_ms": float(np.percentile(times, 99)) * 1e3,
            "ended": ended,
            "valid": valid,
            "invalid_examples": bad[:3],
            "accepts": f"{sum(ok)}/{len(ok)}",
            "rejects": f"{sum(no)}/{len(no)}",
        }
    return {"setup_s": engine.setup_s, "schemas": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walks", type=int, default=8)
    ap.add_argument("--budget", type=int, default=160, help="tokens per walk")
    ap.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"])
    args = ap.parse_args()

    from engine.config import ModelConfig
    from engine.model_hub import resolve_model
    from engine.tokenizer import eos_token_ids, load_tokenizer

    model_dir = str(resolve_model("smollm2"))
    tokenizer = load_tokenizer(model_dir)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    eos = list(eos_token_ids(model_dir, tokenizer))
    makers = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    results = {"vocab_size": vocab, "eos": eos, "walks": args.walks, "budget": args.budget}
    for name in args.engines:
        engine = makers[name](tokenizer, vocab, eos)
        results[name] = run_engine(engine, tokenizer, vocab, eos[0], args.walks, args.budget)

    head = f"{'schema':18} {'engine':10} {'compile':>8} {'1st mask':>8} {'mask':>7} {'p99':>7}"
    print(head + f" {'ended':>5} {'valid':>5} {'accepts':>7} {'rejects':>7}")
    for schema in SCHEMAS:
        for name in args.engines:
            r = results[name]["schemas"][schema]
            if "error" in r:
                print(f"{schema:18} {name:10} {r['error']}")
                continue
            print(
                f"{schema:18} {name:10} {r['compile_ms']:8.2f} {r['first_mask_ms']:8.2f} "
                f"{r['mask_mean_ms']:7.3f} {r['mask_p99_ms']:7.3f} {r['ended']:5d} "
                f"{r['valid']:5d} {r['accepts']:>7} {r['rejects']:>7}"
            )
    for name in args.engines:
        rows = [r for r in results[name]["schemas"].values() if "error" not in r]
        print(
            f"{name}: tokenizer setup {results[name]['setup_s']:.2f} s; compile total "
            f"{sum(r['compile_ms'] for r in rows):.1f} ms; mask mean "
            f"{statistics.fmean(r['mask_mean_ms'] for r in rows):.3f} ms; "
            f"valid {sum(r['valid'] for r in rows)}/{sum(r['ended'] for r in rows)} ended walks"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_engines.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
