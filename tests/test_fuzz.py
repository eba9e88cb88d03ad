"""Property-based fuzz of the gateway's HTTP API against a live server (hypothesis).

A real gateway (router.gateway over router.service.ClusterBackend, uvicorn on 127.0.0.1) in
front of one prefill and one decode worker (SmolLM2 on CPU, Ray actors), a redis-server for
the prefix index: benchmarks/chaos.py's harness. Requests go over a real socket (httpx).

What is generated, from the server's own OpenAPI document (``GET /openapi.json``: its paths and
methods) and, for the request bodies it does not describe (the routes read raw bodies), from the
pydantic models the gateway validates with (router/protocol.py, ``model_json_schema()``):

* ``schema``: bodies that follow the schema, the costly fields kept small so most are served;
* ``mutated``: a served body with one or two fields set to an edge value: huge and negative
  numbers, 1e400, NaN/Infinity tokens, wrong types, nulls, unicode and control characters,
  long strings, nested containers;
* ``raw``: bodies that are not a JSON object: broken JSON, invalid UTF-8, lone surrogate
  escapes, arrays and scalars, deep nesting, a prompt just under the body limit and one over;
* every GET route of the document (path parameters fuzzed), unknown paths and wrong methods.

The property, for every response: no 5xx; a 4xx is OpenAI error JSON, ``{"error": {"message":
str, "type": str, "param": str | null, "code": str | null}}``; a 200 is JSON (or SSE frames of
JSON ending in ``[DONE]``, with no in-band error). Streams are read for at most 8 frames.

    python -m pytest -q tests/test_fuzz.py                       # bounded (CI): about a minute
    TANDEM_FUZZ_EXAMPLES=2000 TANDEM_FUZZ_RANDOM=1 python -m pytest -q tests/test_fuzz.py -s
"""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from router import admin, protocol  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "40"))  # per property
RANDOM = os.environ.get("TANDEM_FUZZ_RANDOM", "") not in ("", "0")
MAX_BODY = 1 << 20  # the gateway's --max-body-bytes in this test
MAX_FRAMES = 8
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BODY_MODELS = {
    "/v1/completions": protocol.CompletionRequest,
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    "/tokenize": protocol.TokenizeRequest,
    "/detokenize": protocol.DetokenizeRequest,
}
# The operator's routes (open to this loopback client: the fuzz gateway has no keys). Random
# worker names and settings are refused (400); a valid one changes nothing harmful here.
ADMIN_MODELS = {
    "/admin/migrate": admin.MigrateBody,
    "/admin/drain": admin.DrainBody,
    "/admin/undrain": admin.UndrainBody,
    "/admin/rebalance": admin.RebalanceBody,
}
SEEN: Counter[str] = Counter()  # status codes by route, printed at the end


# ---------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from benchmarks import chaos

    cfg = chaos.ChaosConfig(
        model=str(smollm2_dir),
        num_prefill=1,
        num_decode=1,
        scenarios=[],
        max_concurrent=64,
        kv_blocks=512,
        stall_timeout_s=10.0,
        max_body_bytes=MAX_BODY,
    )
    harness = chaos.Harness(cfg)
    try:
        harness.start()
        gw = harness.gateway
        with httpx.Client(base_url=gw.url, timeout=120.0, trust_env=False) as client:
            doc = client.get("/openapi.json").json()
            yield {"client": client, "doc": doc}
    finally:
        harness.close()
        print("\nfuzz responses by route and status:", dict(sorted(SEEN.items())))


# ---------------------------------------------------------------------------------- the oracle


def check(route: str, resp: Any, frames: list[str] | None = None) -> None:
    """The property every response must have."""
    key = "/v1/models/{model}" if route.startswith("/v1/models/") else route
    SEEN[f"{key} {resp.status_code}"] += 1
    assert resp.status_code < 500, f"{route}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict), f"{route}: {resp.status_code} not OpenAI JSON: {body}"
        assert isinstance(err.get("message"), str) and isinstance(err.get("type"), str), body
        assert isinstance(err.get("param"), (str, type(None))), body
        assert isinstance(err.get("code"), (str, type(None))), body
        assert "Traceback" not in err["message"], body
        return
    if frames is None:
        if "json" in resp.headers.get("content-type", ""):
            resp.json()
        return
    for frame in frames:
        if frame == "[DONE]":
            continue
        data = json.loads(frame)
        assert "error" not in data, f"{route}: in-band error {data}"


def send(client, method: str, route: str, body: bytes | None = None, headers=None) -> None:
    """One request; a stream is read for at most MAX_FRAMES frames, then dropped."""
    headers = {"content-type": "application/json", **(headers or {})}
    with client.stream(method, route, content=body, headers=headers) as resp:
        if "text/event-stream" not in resp.headers.get("content-type", ""):
            resp.read()
            check(route, resp)
            return
        frames = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if frames[-1] == "[DONE]" or len(frames) >= MAX_FRAMES:
                    break
        check(route, resp, frames)


# ---------------------------------------------------------------------------------- strategies

EDGE_INTS = [0, -1, 1, 2**31, 2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30]
EDGE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "\x00", "\u2028", "\ufeff", "<|im_end|>", "{{ 7*7 }}", "{% raw %}", "\U0001f600"]
    ),
    st.builds(
        lambda c, n: c * n,
        st.sampled_from(["a", "\u00e9", "\U0001f600 "]),
        st.integers(1000, 20000),
    ),
)
EDGE_NUMBERS = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-0.0, 1e-320, 1e308, 0.5, 2.5]),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), EDGE_NUMBERS, EDGE_TEXT)
EDGE_VALUES = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
# Schema-made bodies take these fields from these ranges, so most of them are served (the
# mutated and raw bodies go outside them): the costly ones (max_tokens, n, prompt length) small,
# the others within what the API accepts, or absent.
SERVED = {
    "model": st.sampled_from([None, "chaos"]),
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "n": st.integers(1, 2),
    "best_of": st.none(),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5),
    "min_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.floats(0, 0.5)),
    "seed": st.integers(0, 2**63 - 4),
    "stop": st.one_of(
        st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)
    ),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "priority": st.integers(-10, 10),
    "cache_salt": st.text(min_size=1, max_size=8),
    "echo": st.just(False),
    "suffix": st.none(),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3)
    ),
    "tools": st.none(),
    "response_format": st.just({"type": "text"}),
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "type": st.just("text"),
    "prompt": st.one_of(
        st.text(min_size=1, max_size=60),
        st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    ),
    "messages": None,  # from the schema, at least one
    "tokens": st.lists(st.integers(0, 49151), max_size=40),
}


def from_schema(schema: dict[str, Any], defs: dict[str, Any], name: str = "") -> Any:
    """A strategy for JSON values that follow ``schema`` (the subset pydantic emits)."""
    if SERVED.get(name) is not None:
        return SERVED[name]
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, name) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        props = {k: from_schema(v, defs, k) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    simple = {
        "null": st.none(),
        "boolean": st.booleans(),
        "integer": st.integers(-5, 100),
        "number": st.floats(-3, 3, allow_nan=False),
        "string": st.text(max_size=30),
        "object": st.dictionaries(st.text(max_size=8), JSON_LEAF, max_size=3),
    }
    if kind == "array":
        least = 1 if name == "messages" else 0
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=least, max_size=3)
    return simple.get(kind, JSON_LEAF)


def schema_body(route: str) -> Any:
    model = BODY_MODELS.get(route) or ADMIN_MODELS.get(route)
    if model is None:  # a route without a body (/admin/rebalance/once)
        return st.one_of(st.just({}), st.just(None))
    schema = model.model_json_schema()
    return from_schema(schema, schema.get("$defs", {}))


def affordable(route: str, body: Any) -> Any:
    """A body that could be served for a long time goes out as a stream (read for a few
    frames, then dropped): a chat request without a small max_tokens, large ones, large n."""
    if not isinstance(body, dict) or route not in ("/v1/completions", "/v1/chat/completions"):
        return body
    limits = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    small = [v for v in limits if isinstance(v, int) and not isinstance(v, bool) and v <= 16]
    n = body.get("n", 1)
    costly = not small or (isinstance(n, int) and not isinstance(n, bool) and n > 4)
    if (costly or "stream_options" in body) and body.get("stream") is not True:
        body = {**body, "stream": True}
    return body


GENERATE_ROUTES = st.sampled_from(sorted(BODY_MODELS))


@st.composite
def schema_requests(draw) -> tuple[str, Any]:
    route = draw(GENERATE_ROUTES)
    return route, affordable(route, draw(schema_body(route)))


BASES = {
    "/v1/completions": {"prompt": "Say hi", "max_tokens": 4},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_completion_tokens": 4,
    },
    "/tokenize": {"prompt": "Say hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = sorted(
    {k for m in BODY_MODELS.values() for k in m.model_json_schema()["properties"]}
    | {"unknown_field", "messages.0.content", "messages.0.role", "messages.0.name"}
)


def put(body: dict[str, Any], path: str, value: Any) -> None:
    """Set the field at ``a.0.b`` of ``body``, if its parent is there."""
    *head, last = path.split(".")
    node: Any = body
    for part in head:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return
    if isinstance(node, dict):
        node[last] = value


@st.composite
def mutated_requests(draw) -> tuple[str, Any]:
    route = draw(GENERATE_ROUTES)
    body = json.loads(json.dumps(BASES[route]))
    for _ in range(draw(st.integers(1, 2))):
        field = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            put(body, field, draw(EDGE_VALUES))
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    return route, affordable(route, body)


RAW_BODIES = st.one_of(
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b"42",
            b'"prompt"',
            b"\xff\xfe\xfa",
            b'{"prompt": "\\ud800"}',
            b'{"prompt": "a\\u0000b", "max_tokens": 2}',
            b'{"prompt": "hi", "temperature": NaN}',
            b'{"prompt": "hi", "top_p": Infinity}',
            b'{"prompt": "hi", "temperature": 1e400}',
            b'{"prompt": "hi", "max_tokens": 1e3}',
            b'{"prompt": "hi", "max_tokens": 3.0}',
            b'{"prompt": "hi", "max_tokens": "4"}',
            b'{"prompt": "hi", "prompt": [1, 2]}',
            b'{"messages": [{"role": "user", "content": null}], "max_tokens": 2}',
            b'{"messages": [{"role": "tool", "content": "x"}]}',
            b'{"messages": [], "max_tokens": 2}',
            b"[" * 10000 + b"]" * 10000,
            b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        ]
    ),
    st.binary(max_size=200),
    st.builds(
        lambda n: json.dumps({"prompt": "word " * n, "max_tokens": 1}).encode(),
        st.sampled_from([1000, 9000, MAX_BODY // 5 - 100, 2 * MAX_BODY]),
    ),
)


# ---------------------------------------------------------------------------------- properties


@FUZZ
@given(req=schema_requests())
def test_bodies_from_the_schema(server, req) -> None:
    route, body = req
    send(server["client"], "POST", route, json.dumps(body).encode())


@FUZZ
@given(req=mutated_requests())
def test_bodies_with_edge_values(server, req) -> None:
    route, body = req
    send(server["client"], "POST", route, json.dumps(body).encode())


@FUZZ
@given(route=GENERATE_ROUTES, body=RAW_BODIES, ctype=st.sampled_from([None, "text/plain", ""]))
def test_bodies_that_are_not_objects(server, route, body, ctype) -> None:
    headers = {} if ctype is None else {"content-type": ctype}
    send(server["client"], "POST", route, body, headers)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(data=st.data())
def test_every_route_of_the_openapi_document(server, data) -> None:
    doc = server["doc"]
    path = data.draw(st.sampled_from(sorted(doc["paths"])))
    method = data.draw(st.sampled_from(sorted(doc["paths"][path])))
    route = path
    for param in doc["paths"][path][method].get("parameters", []):
        value = data.draw(st.one_of(st.text(min_size=1, max_size=40), st.just("chaos")))
        route = route.replace("{" + param["name"] + "}", urllib.parse.quote(value, safe=""))
    body = None
    if method.upper() == "POST":
        body = json.dumps(affordable(path, data.draw(schema_body(path)))).encode()
    send(server["client"], method.upper(), route, body)


# Bodies the strategies reach only by luck, each sent every run. The first was a 500 (the
# penalty overflowed the sampler's logits; router/protocol.py now refuses it).
EDGE_BODIES = [
    {"temperature": 1.0, "repetition_penalty": 1e-300},
    {"temperature": 1.0, "repetition_penalty": 0.01},
    {"temperature": 1e-300},
    {"temperature": 5e-324},
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1.0, "min_p": 1e-300},
    {"temperature": 2000.0},
    {"priority": 10**30},
    {"stop_token_ids": [2**64]},
    {"seed": 2**63 - 2, "n": 2},
    {"top_k": 2**31 - 1},
    {"logprobs": 20, "n": 2},
    {"cache_salt": "x" * 100_000},
    {"user": "x" * 100_000},
    {"prompt": [0]},
    {"prompt": [49151]},
    {"n": 65},  # more sequences than the gateway's bound: 429, never served
    # structured outputs: a character SmolLM2's tokenizer cannot write (no token holds 0xF1) was
    # a 500 (llguidance allowed a token it then refused); now a 400 naming the character
    {"guided_regex": "0\U00040000"},
    {"guided_choice": ["a", "\U00040000"]},
    {"response_format": {"type": "json_object"}, "temperature": 2000.0, "top_k": 1},
    {"structured_outputs": {"json": {"const": "\U00040000"}}},
]


@pytest.mark.parametrize("extra", EDGE_BODIES, ids=lambda e: ",".join(e))
def test_edge_bodies(server, extra) -> None:
    body = {"prompt": "Count: one, two,", "max_tokens": 4, **extra}
    send(server["client"], "POST", "/v1/completions", json.dumps(body).encode())


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(
    path=st.sampled_from(["/", "/v1", "/v1/completion", "/v2/models", "/docs/../metrics"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
)
def test_unknown_routes_and_methods(server, path, method) -> None:
    send(server["client"], method, path, b"{}")
