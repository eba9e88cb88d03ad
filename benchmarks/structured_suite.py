"""The structured-output schema suite: 52 JSON schemas, seeded, varied the way applications'
schemas are (nested objects, arrays with bounds, enums, integers and numbers with ranges,
string lengths and patterns, nullable fields). tests/test_structured_outputs.py samples one
answer per schema at temperature 1 and checks every one (the engine, and through the openai
client against ``tandem serve``); benchmarks/gpu_structured.py constrains a batch with them
and times their compiles."""

from __future__ import annotations

import random

_NAMES = ["name", "city", "color", "size", "count", "score", "tags", "owner", "ok", "code"]
_PATTERNS = ["^[A-Z]{2}[0-9]{2}$", "^[a-z]{1,6}@[a-z]{1,6}\\.com$", "^[0-9]{3}-[0-9]{4}$"]


def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(
        ["string", "enum", "integer", "number", "boolean", "pattern", "array", "nullable"]
        + (["object"] if depth < 2 else [])
    )
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "n/a"], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.choice([-10.5, 0, 0.25, 3])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 7.5, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if kind == "array":
        low = rng.randint(0, 2)
        items = rng.choice(
            [
                {"type": "integer", "minimum": 0, "maximum": 99},
                {"type": "string", "maxLength": 6},
                {"enum": ["a", "b", "c"]},
            ]
        )
        return {
            "type": "array",
            "items": items,
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    return _object(rng, depth + 1, rng.randint(1, 2))


def _object(rng: random.Random, depth: int, size: int) -> dict:
    names = rng.sample(_NAMES, size)
    return {
        "type": "object",
        "properties": {n: _leaf(rng, depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def schemas(count: int = 52) -> list[dict]:
    rng = random.Random(27)
    out = [_object(rng, 0, rng.randint(1, 4)) for _ in range(count - 2)]
    out.append({"type": "array", "items": _object(rng, 1, 2), "minItems": 1, "maxItems": 2})
    out.append({"enum": ["yes", "no", "maybe"]})
    return out
