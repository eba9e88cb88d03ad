"""The OpenAI gateway (router/gateway.py) against an in-process fake backend.

The fake "generates" by cycling through the token ids of a fixed sentence (real SmolLM2
tokenizer, so prompts, chat templates and texts are the real ones), stops at max_tokens
("length"), fakes logprobs, records what it was asked and every aclose, and can be told to
refuse, fail mid-stream or go slowly. Clients: the official ``openai`` client and raw httpx,
both over ASGI transports; client disconnects are driven by a hand-written ASGI receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from functools import partial
from typing import Any

import httpx
import openai
import openai._base_client
import pytest

from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template, encode_prompt, load_tokenizer
from router.backend import Placement, RouterStats
from router.errors import CapacityError, ClusterError
from router.gateway import create_app
from router.outputs import ChoiceDelta, Step, TokenTexts, Usage

pytestmark = pytest.mark.anyio  # async tests run on anyio's pytest plugin, asyncio backend

# The openai client's own HTTP library: httpx2 from openai 2.x on, httpx before.
_hx = getattr(openai._base_client, "httpx2", None) or openai._base_client.httpx

MODEL = "smollm2"
KEY = "sk-test"
SENTENCE = " the quick brown fox jumps over the lazy dog and runs far away"
SAMPLED_LOGPROB = -0.25


@pytest.fixture()
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


class FakeGeneration:
    def __init__(self, backend: FakeBackend, request_id: str, ids: list[int], p: SamplingParams):
        self.backend, self.request_id, self.ids, self.params = backend, request_id, ids, p
        self.placement = Placement(
            prefill="prefill-0",
            decode="decode-1",
            reason="prefix_hit",
            predicted_tokens=backend.predicted_tokens,
        )

    async def outputs(self):
        b, p = self.backend, self.params
        limit = p.max_tokens or (b.max_model_len - len(self.ids))
        cycle = b.cycle
        texts = TokenTexts(b.tokenizer)
        tokens: list[list[int]] = [[] for _ in range(p.n)]
        offsets, sent = [0] * p.n, [0] * p.n  # text sent per choice (a split character waits)
        completion = 0
        for step in range(limit):
            await asyncio.sleep(b.delay)
            if b.fail_after is not None and step == b.fail_after:
                raise ClusterError("decode worker died")
            done = step == limit - 1
            choices = []
            for i, seq in enumerate(tokens):
                token = cycle[(i + step) % len(cycle)]
                seq.append(token)
                text = b.tokenizer.decode(seq)
                if text.endswith("\ufffd") and not done:
                    text = ""
                else:
                    text, sent[i] = text[sent[i] :], len(text)
                logprobs = [self._logprobs(token, p.logprobs)] if p.logprobs is not None else None
                reason = b.finish_reason if done else None
                choices.append(ChoiceDelta(i, text, [token], logprobs, reason, None, offsets[i]))
                if logprobs is not None:
                    offsets[i] += texts.length([token])
            completion += p.n
            usage = Usage(len(self.ids), completion, min(b.cached_tokens, len(self.ids)))
            yield Step(choices, usage, finished=done)

    def _logprobs(self, token: int, n: int) -> dict[int, float]:
        """The sampled token is the most likely; the next n-1 are fixed alternatives."""
        entry = {token: SAMPLED_LOGPROB}
        for j, alt in enumerate(self.backend.alternatives):
            if len(entry) >= max(n, 1):
                break
            entry.setdefault(alt, -1.0 - j)
        return entry

    async def aclose(self) -> None:
        await asyncio.sleep(0.001)  # an abort is a message to the workers: it takes a while
        self.backend.closed.append(self.request_id)


class FakeBackend:
    model_name = MODEL
    max_model_len = 256

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cycle = encode_prompt(tokenizer, SENTENCE)
        self.alternatives = encode_prompt(tokenizer, " cat mouse horse")
        self.opened: list[dict[str, Any]] = []
        self.closed: list[str] = []
        self.delay = 0.0
        self.fail_open: Exception | None = None
        self.fail_after: int | None = None
        self.finish_reason = "length"
        self.cached_tokens = 3
        self.is_healthy = True
        self.open_delay = 0.0
        self.cancelled_opens: list[str] = []
        self.predicted_tokens: int | None = None
        self.scheduling: dict = {}

    async def open(
        self,
        request_id,
        prompt_token_ids,
        params,
        *,
        prompt=None,
        priority=0,
        cache_salt=None,
        hints=None,
    ):
        if self.fail_open is not None:
            raise self.fail_open
        if self.open_delay:  # the prefill, before the first token
            try:
                await asyncio.sleep(self.open_delay)
            except asyncio.CancelledError:
                self.cancelled_opens.append(request_id)
                raise
        self.opened.append(
            dict(
                id=request_id,
                ids=prompt_token_ids,
                params=params,
                prompt=prompt,
                priority=priority,
                cache_salt=cache_salt,
                hints=hints,
            )
        )
        return FakeGeneration(self, request_id, prompt_token_ids, params)

    def expected_text(self, n_tokens: int, index: int = 0) -> str:
        c = self.cycle
        return self.tokenizer.decode([c[(index + k) % len(c)] for k in range(n_tokens)])

    async def healthy(self) -> bool:
        if isinstance(self.is_healthy, Exception):
            raise self.is_healthy
        return self.is_healthy

    async def worker_stats(self):
        return [
            dict(
                name="prefill-0",
                role="prefill",
                running=1,
                waiting=2,
                total_blocks=100,
                in_use_blocks=25,
                prefix_queries_tokens=640,
                prefix_hit_tokens=320,
                kv_bytes_sent=4096,
                kv_transfer_seconds=0.5,
            ),
            dict(
                name="decode-1",
                role="decode",
                running=3,
                waiting=0,
                total_blocks=200,
                in_use_blocks=50,
                kv_bytes_received=4096,
                kv_staged_bytes=1024,  # (a tensor-parallel decode worker's)
                kv_transfer_tail_seconds=0.25,
                kv_transfers_in=5,
            ),
        ]

    def router_stats(self) -> RouterStats:
        return RouterStats(
            decisions={"prefix_hit": 3, "least_loaded": 1},
            index_unavailable=2,
            resumes={"stalled": 1, "worker_died": 2},
            worker_states={"prefill-0": "active", "decode-1": "suspect"},
            missed_polls={"decode-1": 3},
            scheduling=self.scheduling,
        )


@pytest.fixture()
def backend(tokenizer):
    return FakeBackend(tokenizer)


@pytest.fixture()
def app(backend):
    return create_app(backend)


@contextlib.asynccontextmanager
async def http(app, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
        yield c


def oai(app, key: str = KEY) -> openai.AsyncOpenAI:
    client = _hx.AsyncClient(transport=_hx.ASGITransport(app=app))
    return openai.AsyncOpenAI(
        base_url="http://t/v1", api_key=key, http_client=client, max_retries=0
    )


def sse_events(body: str) -> list[Any]:
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]


# ----------------------------------------------------------------------------- completions


async def test_completion_shape_usage_headers_and_params(app, backend, tokenizer) -> None:
    prompt = "The capital of France is"
    raw = await oai(app).completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        stop=["xyz", "\n\n"],
        seed=7,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        user="u1",
    )
    assert raw.headers["x-tandem-prefill"] == "prefill-0"
    assert raw.headers["x-tandem-decode"] == "decode-1"
    out = raw.parse()
    assert raw.headers["x-request-id"] == out.id and out.id.startswith("cmpl-")
    assert out.object == "text_completion" and out.model == MODEL and out.created > 0
    assert len(out.choices) == 1
    assert out.choices[0].text == backend.expected_text(5)
    assert out.choices[0].finish_reason == "length" and out.choices[0].logprobs is None
    ids = encode_prompt(tokenizer, prompt)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == len(ids) + 5
    assert out.usage.prompt_tokens_details.cached_tokens == 3
    (opened,) = backend.opened
    assert opened["id"] == out.id and opened["ids"] == ids and opened["prompt"] == prompt
    p = opened["params"]
    assert (p.stop, p.seed, p.temperature, p.top_p, p.max_tokens) == (
        ["xyz", "\n\n"],
        7,
        0.5,
        0.9,
        5,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.n, p.logprobs) == (0.5, -0.5, 1, None)


async def test_completion_stream_equals_unstreamed_with_n2_and_usage(app, backend) -> None:
    client = oai(app)
    args = dict(model=MODEL, prompt=[[5, 6, 7]], max_tokens=6, n=2)
    whole = await client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[1].text == backend.expected_text(6, index=1) != whole.choices[0].text
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == 3
    assert backend.opened[0]["ids"] == [5, 6, 7] and backend.opened[0]["prompt"] is None
    stream = await client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens_details.cached_tokens == 3
    assert all(c.usage is None for c in body)
    for i in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole.choices[i].text
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]


async def test_return_token_ids_streamed_and_not(app, backend, tokenizer) -> None:
    """vLLM's ``return_token_ids``: each choice's ids (streamed: each chunk's new ones) and
    the prompt's ids (completions: on the choice, streamed on its first chunk; chat: on the
    response, streamed on the role frame). Absent unless asked."""
    client = oai(app)
    extra = {"return_token_ids": True}
    args = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=5, n=2, extra_body=extra)
    whole = await client.completions.create(**args)
    for c in whole.choices:
        assert c.prompt_token_ids == [5, 6, 7]
        assert tokenizer.decode(c.token_ids) == c.text and len(c.token_ids) == 5
    chunks = [c async for c in await client.completions.create(**args, stream=True)]
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert [t for c in mine for t in c.token_ids] == whole.choices[i].token_ids
        assert mine[0].prompt_token_ids == [5, 6, 7]
        assert all(getattr(c, "prompt_token_ids", None) is None for c in mine[1:])
    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=4, extra_body=extra
    )
    prompt = apply_chat_template(tokenizer, CHAT["messages"], add_generation_prompt=True)
    assert chat.prompt_token_ids == prompt and len(chat.choices[0].token_ids) == 4
    frames = [
        c
        async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=4, extra_body=extra, stream=True
        )
    ]
    assert frames[0].prompt_token_ids == prompt
    assert [t for f in frames[1:] for t in f.choices[0].token_ids] == chat.choices[0].token_ids
    plain = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_dump(exclude_unset=True)


async def test_streamed_completion_has_placement_headers_and_done(app) -> None:
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert (
        r.headers["x-tandem-prefill"] == "prefill-0" and r.headers["x-tandem-decode"] == "decode-1"
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[0]["id"] == r.headers["x-request-id"]
    assert "usage" not in events[0]


async def test_completion_logprobs(app, backend, tokenizer) -> None:
    client = oai(app)
    out = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    expected = [tokenizer.decode([t]) for t in backend.cycle[:4]]
    assert lp.tokens == expected and lp.token_logprobs == [SAMPLED_LOGPROB] * 4
    assert all(len(top) == 2 and max(top.values()) == SAMPLED_LOGPROB for top in lp.top_logprobs)
    assert lp.top_logprobs[0] == {expected[0]: SAMPLED_LOGPROB, " cat": -1.0}
    offsets = [sum(len(t) for t in expected[:k]) for k in range(4)]
    assert lp.text_offset == offsets
    assert backend.opened[0]["params"].logprobs == 2
    stream = await client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, logprobs=2, stream=True
    )
    pieces = [c.choices[0].logprobs async for c in stream]
    assert sum((p.tokens for p in pieces), []) == lp.tokens
    assert sum((p.text_offset for p in pieces), []) == offsets


# ---------------------------------------------------------------------------------------- chat


async def test_chat_stream_equals_unstreamed(app, backend, tokenizer) -> None:
    client = oai(app)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}],
        },
    ]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=3, max_completion_tokens=7
    )
    whole = raw.parse()
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert raw.headers["x-tandem-decode"] == "decode-1" and raw.headers["x-request-id"] == whole.id
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content == backend.expected_text(7)
    rendered = [messages[0], {"role": "user", "content": "Name a\ncolour."}]
    assert backend.opened[0]["ids"] == apply_chat_template(tokenizer, rendered)
    assert backend.opened[0]["params"].max_tokens == 7  # max_completion_tokens wins
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=7, n=2, stream=True
    )
    chunks = [c async for c in stream]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.content == "" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content for c in mine) == backend.expected_text(7, index=i)
        assert mine[-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in mine[:-1])


async def test_chat_without_generation_prompt(app, backend, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with http(app) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": messages, "add_generation_prompt": False, "max_tokens": 2},
        )
    assert r.status_code == 200, r.text
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert backend.opened[0]["ids"] == ids
    assert backend.opened[0]["params"].max_tokens == 2


async def test_length_prediction_hints_and_header(app, backend, tokenizer) -> None:
    """The predictor reads the last user turn, the turns, the previous answer's tokens,
    max_tokens and the benchmark's oracle header; the prediction comes back as a header."""
    backend.predicted_tokens = 42
    messages = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple, crisp and red."},
        {"role": "user", "content": "Write a poem about it."},
    ]
    async with http(app) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 3},
            headers={"x-tandem-oracle-tokens": "17"},
        )
        plain = await c.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 2})
    assert r.status_code == 200 and plain.status_code == 200, (r.text, plain.text)
    assert r.headers["x-tandem-predicted-tokens"] == "42"
    hints = backend.opened[0]["hints"]
    assert hints.text == "Write a poem about it." and hints.turns == 2
    assert hints.last_answer_len == len(encode_prompt(tokenizer, "An apple, crisp and red."))
    assert hints.prompt_len == len(backend.opened[0]["ids"]) and hints.max_tokens == 3
    assert hints.headers == {"x-tandem-oracle-tokens": "17"}
    assert hints.prev_answers == ("An apple, crisp and red.",)
    hints = backend.opened[1]["hints"]
    assert hints.text == "Once upon" and hints.turns == 1 and hints.last_answer_len is None
    assert hints.headers == {} and hints.max_tokens == 2


async def test_scheduling_metrics(app, backend) -> None:
    backend.scheduling = {
        "policy": "sjf",
        "capacity": 8,
        "running": 5,
        "queued": 3,
        "aged": 2,
        "rejected": {"queue_full": 1, "projected_wait": 4},
        "wait": {"buckets": [(0.1, 6), (1.0, 2), (float("inf"), 1)], "sum": 9.5},
        "predictor": "learned",
        "prediction_error": {"buckets": [(0.5, 3), (float("inf"), 1)], "sum": 2.0},
        "prediction_tau": 0.61,
    }
    async with http(app) as c:
        t = (await c.get("/metrics")).text
    m, pol = f'model_name="{MODEL}"', 'policy="sjf"'
    assert metric_value(t, f"tandem:queue_waiting{{{m},{pol}}}") == 3
    assert metric_value(t, f"tandem:queue_slots{{{m},{pol}}}") == 8
    assert metric_value(t, f'tandem:queue_wait_seconds_bucket{{le="1.0",{m},{pol}}}') == 8
    assert metric_value(t, f"tandem:queue_wait_seconds_count{{{m},{pol}}}") == 9
    assert metric_value(t, f'tandem:early_rejections_total{{{m},reason="projected_wait"}}') == 4
    assert metric_value(t, f"tandem:queue_aged_total{{{m}}}") == 2
    assert metric_value(t, f'tandem:length_prediction_tau{{{m},predictor="learned"}}') == 0.61
    err = f'tandem:length_prediction_error_count{{{m},predictor="learned"}}'
    assert metric_value(t, err) == 4


async def test_chat_logprobs(app, backend, tokenizer) -> None:
    client = oai(app)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    out = await client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and backend.opened[0]["params"].logprobs == 3
    for entry, tid in zip(content, backend.cycle, strict=False):
        assert entry.token == tokenizer.decode([tid]) and entry.logprob == SAMPLED_LOGPROB
        assert bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == [SAMPLED_LOGPROB, -1.0, -2.0]
        assert entry.top_logprobs[0].token == entry.token
    assert content[0].top_logprobs[1].token == " cat"
    plain = await client.chat.completions.create(**args, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    stream = await client.chat.completions.create(
        **args, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        e async for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


async def test_logprobs_bytes_of_a_split_character(app, backend, tokenizer) -> None:
    backend.cycle = encode_prompt(tokenizer, " 日本")  # bytes spread over several tokens
    out = await oai(app).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=len(backend.cycle),
        logprobs=True,
    )
    content = out.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == " 日本"
    assert out.choices[0].message.content == " 日本"


async def test_vllm_extras_reach_the_backend(app, backend) -> None:
    extra = dict(
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[2, 7],
        priority=-3,
        cache_salt="tenant-a",
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    await oai(app).completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    opened = backend.opened[0]
    p = opened["params"]
    assert (opened["priority"], opened["cache_salt"]) == (-3, "tenant-a")
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (5, 0.1, 1.2, 2)
    assert (p.ignore_eos, p.stop_token_ids) == (True, [2, 7])
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (False, True)


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "up"}},
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
            "top_logprobs",
        ),
    ],
)
async def test_invalid_parameters_are_400_naming_the_param(app, backend, path, body, param):
    async with http(app) as c:
        r = await c.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"] and r.json()["object"] == "error"
    assert r.headers["x-request-id"]
    assert backend.opened == []


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        # a typo of a real field: OpenAI's answer, never a run to the context length
        ("/v1/chat/completions", {**CHAT, "max_token": 8}, "max_token", "unrecognized_argument"),
        (
            "/v1/completions",
            {"prompt": "hi", "frobnicate": True},
            "frobnicate",
            "unrecognized_argument",
        ),
        ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate", "unrecognized_argument"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"include_usag": True}},
            "stream_options.include_usag",
            "unrecognized_argument",
        ),
        # documented (OpenAI or vLLM) but not implemented here: said so, by name
        ("/v1/chat/completions", {**CHAT, "store": True}, "store", "unsupported_parameter"),
        (
            "/v1/chat/completions",
            {**CHAT, "reasoning_effort": "low"},
            "reasoning_effort",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "functions": [{"name": "f"}]},  # the legacy form of tools
            "functions",
            "unsupported_parameter",
        ),
        ("/v1/chat/completions", {**CHAT, "best_of": True}, "best_of", "unsupported_parameter"),
        (
            "/v1/completions",
            {"prompt": "hi", "use_beam_search": True},
            "use_beam_search",
            "unsupported_parameter",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "guided_grammar": "root ::= 'a'"},
            "guided_grammar",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "structured_outputs": {"grammar": "root ::= 'a'"}},
            "structured_outputs.grammar",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "x": 1}},
            },
            "response_format.json_schema.x",
            "unrecognized_argument",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f"}}]},
            "messages.0.function_call",
            "unsupported_parameter",
        ),
    ],
)
async def test_unknown_and_unsupported_fields_are_400_naming_the_field(
    app, backend, path, body, param, code
):
    async with http(app) as c:
        r = await c.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert param.rsplit(".", 1)[-1] in err["message"]
    if code == "unrecognized_argument":
        assert err["message"] == f"Unrecognized request argument supplied: {param}"
    assert backend.opened == []


async def test_documented_fields_that_ask_for_nothing_are_accepted(app, backend) -> None:
    """Off values of unsupported fields, and hints that change nothing here, still serve."""
    extra = dict(
        store=False,
        parallel_tool_calls=True,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="u1",
        use_beam_search=False,
        logit_bias={},
        tool_choice=None,
        metadata={},
    )
    out = await oai(app).chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=3, extra_body=extra
    )
    assert out.choices[0].message.content is not None and len(backend.opened) == 1


def test_openai_clients_fields_are_all_known() -> None:
    """Every field the official client can send is declared, listed as unsupported or accepted
    as a hint: none would be called unrecognized (the client's own types are the list)."""
    from openai.types import completion_create_params as comp
    from openai.types.chat import completion_create_params as chat

    from router import protocol

    for kind, params in [
        (protocol.CompletionRequest, comp.CompletionCreateParamsBase),
        (protocol.ChatCompletionRequest, chat.CompletionCreateParamsBase),
    ]:
        known = set(kind.model_fields) | set(kind.unsupported) | protocol._ACCEPTED_HINTS
        assert set(params.__annotations__) - known == set(), kind.__name__


async def test_logit_bias_reaches_the_engine_with_token_id_keys(app, backend) -> None:
    """OpenAI's logit_bias (token ids as strings, as the official client sends them) reaches
    the engine as ints; an empty one asks for nothing."""
    out = await oai(app).chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=3, logit_bias={"5": 10, "17": -100}
    )
    assert out.choices[0].message.content is not None
    await oai(app).completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={})
    assert backend.opened[0]["params"].logit_bias == {5: 10.0, 17: -100.0}
    assert backend.opened[1]["params"].logit_bias is None


async def test_invalid_parameter_through_the_openai_client(app) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await oai(app).completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.message


def _count_tokenizer_hops(gateway) -> list:
    """The functions the gateway hands its tokenizer threads from now on, in a list that
    grows as it does."""
    submitted = []
    submit = gateway._tokenizer_pool.submit

    def counting(fn, *args, **kwargs):
        submitted.append(fn)
        return submit(fn, *args, **kwargs)

    gateway._tokenizer_pool.submit = counting
    return submitted


async def test_token_ids_and_short_texts_skip_the_tokenizer_threads(
    app, backend, tokenizer
) -> None:
    """A prompt of token ids is only checked, and a short text is encoded, on the event loop:
    nothing goes to the tokenizer threads (a hop whose answer would wait behind a burst). Ids
    outside the vocabulary, and an empty prompt, are still a 400 naming ``prompt``; a text is
    encoded as the threads encode it; a long text still goes to them."""
    from router.gateway import INLINE_PROMPT_CHARS

    gateway = app.state.gateway
    assert gateway.encoder is not None  # a fast tokenizer: the batched encoder
    vocab = len(gateway._prompt_tokenizer)
    submitted = _count_tokenizer_hops(gateway)
    short = "The capital of France is " * 3
    long = "=" * (INLINE_PROMPT_CHARS + 1)  # long, yet few tokens: the context is 256
    async with http(app) as c:
        for prompt in ([5, 6, vocab - 1], [[5, 6, 7]]):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert backend.opened[-1]["ids"] == [5, 6, 7] and submitted == []
        for prompt, what in (([5, -1], "[-1]"), ([vocab, 5], f"[{vocab}]"), ([], "is empty")):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert what in r.json()["error"]["message"]
        for prompt in (short, [short]):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert backend.opened[-1]["ids"] == encode_prompt(tokenizer, short)
        assert submitted == []
        r = await c.post("/v1/completions", json={"prompt": "", "max_tokens": 2})
        assert r.status_code == 400 and "is empty" in r.json()["error"]["message"]
        r = await c.post("/v1/completions", json={"prompt": long, "max_tokens": 2})
        assert r.status_code == 200 and len(submitted) == 1
        assert backend.opened[-1]["ids"] == encode_prompt(tokenizer, long)


async def test_short_chats_without_tools_skip_the_tokenizer_threads(
    app, backend, tokenizer
) -> None:
    """A chat whose text is short and that has no tools is rendered and encoded on the event
    loop, to the ids the template gives; a long one (by its characters, parts and past calls
    counted), or one with tools, goes to the tokenizer threads, with the same ids as before."""
    from router.gateway import INLINE_PROMPT_CHARS

    gateway = app.state.gateway
    submitted = _count_tokenizer_hops(gateway)
    short = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
    ]
    want = apply_chat_template(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
        ],
    )
    half = "=" * (INLINE_PROMPT_CHARS // 2 + 1)  # two such turns are long, yet few tokens
    long = [
        {"role": "user", "content": half},
        {"role": "user", "content": [{"type": "text", "text": half}]},
    ]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={"messages": short, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert backend.opened[-1]["ids"] == want and submitted == []
        r = await c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert submitted == []
        r = await c.post("/v1/chat/completions", json={"messages": long, "max_tokens": 2})
        assert r.status_code == 200 and len(submitted) == 1, r.text
        flat = [{"role": "user", "content": half}] * 2
        assert backend.opened[-1]["ids"] == apply_chat_template(tokenizer, flat)
        body = {"messages": short, "max_tokens": 2, "tools": [tool]}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and len(submitted) == 2, r.text
        many = [{"role": "user", "content": ""}] * (INLINE_PROMPT_CHARS // 16 + 1)
        r = await c.post("/v1/chat/completions", json={"messages": many, "max_tokens": 2})
        assert len(submitted) == 3, r.text  # many empty messages are long too


async def test_context_overflow_uses_vllm_wording(app, backend) -> None:
    prompt = list(range(100, 300))  # 200 tokens of a 256-token context
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 100})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "This model's maximum context length is 256 tokens. However, you requested 300 "
            "tokens (200 in the messages, 100 in the completion). Please reduce the length of "
            "the messages or completion."
        )
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 56})
        assert r.status_code == 200  # exactly fits
        r = await c.post("/v1/completions", json={"prompt": list(range(256)), "max_tokens": None})
        assert r.status_code == 400 and "you requested 256 tokens" in r.json()["error"]["message"]
        words = [{"role": "user", "content": "word " * 300}]
        r = await c.post("/v1/chat/completions", json={"messages": words})
        assert r.status_code == 400 and "maximum context length is 256" in r.text


async def test_api_keys(backend) -> None:
    app = create_app(backend, api_keys=["other", KEY])
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await c.get("/metrics", headers={"Authorization": f"Basic {KEY}"})
        assert r.status_code == 401
        assert (await c.get("/health")).status_code == 200  # no key needed
    async with http(app, KEY) as c:
        assert (await c.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
        text = (await c.get("/metrics")).text
    assert 'tandem:request_rejected_total{model_name="smollm2",reason="auth"} 3.0' in text
    with pytest.raises(openai.AuthenticationError):
        await oai(app, key="wrong").models.list()
    assert (await oai(app).models.list()).data[0].id == MODEL


async def test_unknown_model_is_404(app, backend) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        await oai(app).completions.create(model="gpt-9", prompt="hi")
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"
    async with http(app) as c:
        assert (await c.get("/v1/models/gpt-9")).status_code == 404
        assert (await c.get("/v1/nothing")).json()["error"]["type"] == "not_found_error"
    assert backend.opened == []


@pytest.mark.parametrize("status, retry, header", [(429, 2.2, "3"), (503, 0.1, "1")])
async def test_overloaded_sets_status_and_retry_after(app, backend, status, retry, header):
    backend.fail_open = CapacityError("queues full", retry_after_s=retry, status=status)
    async with http(app) as c:
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
    assert r.status_code == status and r.headers["retry-after"] == header
    assert r.json()["error"]["code"] == "overloaded"
    if status == 429:
        with pytest.raises(openai.RateLimitError):
            await oai(app).completions.create(model=MODEL, prompt="hi")


async def test_backend_error_is_500_and_closes(app, backend) -> None:
    backend.fail_open = ClusterError("no workers")
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        backend.fail_open, backend.fail_after = None, 2
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "decode worker died" in r.text
        backend.fail_after, backend.finish_reason = None, "abort"
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "aborted" in r.text
    assert backend.closed == [o["id"] for o in backend.opened]


async def test_body_limits(backend) -> None:
    app = create_app(backend, max_body_bytes=1000)
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunked():  # no Content-Length: the bytes read are counted
            for _ in range(20):
                yield b"x" * 100

        r = await c.post("/v1/completions", content=chunked())
        assert r.status_code == 413
        r = await c.post("/v1/completions", json={"prompt": "x" * 100})
        assert r.status_code == 200
        r = await c.post(
            "/v1/completions",
            content=b'{"prompt": "hi",',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await c.post("/v1/completions", content=b"[1, 2]")
        assert r.status_code == 400
        assert (
            'tandem:request_rejected_total{model_name="smollm2",reason="too_large"} 2.0'
            in (await c.get("/metrics")).text
        )
    assert len(backend.opened) == 1


async def test_error_mid_stream_goes_in_band(app, backend) -> None:
    backend.fail_after = 2
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == [backend.expected_text(1), " quick"]
    assert (
        events[2]["error"]["type"] == "server_error"
        and "decode worker died" in events[2]["error"]["message"]
    )
    assert events[3:] == ["[DONE]"]
    assert backend.closed == [backend.opened[0]["id"]]
    with pytest.raises(openai.APIError, match="decode worker died"):
        stream = await oai(app).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        )
        async for _ in stream:
            pass


# --------------------------------------------------------------------------------- concurrency


async def test_concurrency_bound_refuses_at_once_and_admitted_ones_finish(backend) -> None:
    app = create_app(backend, max_concurrent=2)
    backend.delay = 0.02
    body = {"prompt": "hi", "max_tokens": 10}
    async with http(app) as c:
        slow = [
            asyncio.create_task(c.post("/v1/completions", json=body)),
            asyncio.create_task(c.post("/v1/completions", json={**body, "stream": True})),
        ]
        while len(backend.opened) < 2:
            await asyncio.sleep(0.005)
        r = await asyncio.wait_for(c.post("/v1/completions", json=body), 1)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_requests"
        done = await asyncio.gather(*slow)
        assert [d.status_code for d in done] == [200, 200]
        assert done[0].json()["choices"][0]["finish_reason"] == "length"
        assert sse_events(done[1].text)[-1] == "[DONE]"
        backend.delay = 0
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    assert app.state.gateway.slots.in_use == 0
    assert len(backend.opened) == 3


# ---------------------------------------------------------------------------------- disconnect


def _scope(path: str, raw: bytes) -> dict:
    """An ASGI scope for a JSON POST of ``raw`` to ``path``."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("t", 80),
        "client": ("127.0.0.1", 9),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
    }


async def drive(
    app,
    path: str,
    body: dict,
    *,
    disconnect_after_body_frames: int | None = None,
    disconnect: asyncio.Event | None = None,
) -> list[dict]:
    """Run one request through the ASGI app with a receive that reports http.disconnect when
    ``disconnect`` is set or after that many non-empty body frames were sent."""
    raw = json.dumps(body).encode()
    gone = disconnect or asyncio.Event()
    sent: list[dict] = []
    scope = _scope(path, raw)
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        frames = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_body_frames is not None and len(frames) >= disconnect_after_body_frames:
            gone.set()

    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


async def test_streaming_client_disconnect_closes_the_generation(app, backend) -> None:
    backend.delay = 0.05  # 100 tokens: 5 s if nobody stopped it
    body = {"prompt": "hi", "max_tokens": 100, "stream": True}
    sent = await asyncio.wait_for(
        drive(app, "/v1/completions", body, disconnect_after_body_frames=2), 1.0
    )
    assert sent[0]["status"] == 200
    await asyncio.sleep(0.01)
    assert backend.closed == [backend.opened[0]["id"]]
    assert app.state.gateway.slots.in_use == 0


async def test_streaming_client_task_cancelled_closes_the_generation(app, backend) -> None:
    backend.delay = 0.05
    async with http(app) as c:
        task = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 100,
                    "stream": True,
                },
            )
        )
        while not backend.opened:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.06)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.sleep(0.01)
    assert backend.closed == [backend.opened[0]["id"]]
    assert app.state.gateway.slots.in_use == 0


async def test_non_streaming_client_disconnect_closes_the_generation(app, backend) -> None:
    backend.delay = 0.05
    gone = asyncio.Event()

    async def leave_once_started():
        while not backend.opened:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.06)
        gone.set()

    leaver = asyncio.create_task(leave_once_started())
    body = {"prompt": "hi", "max_tokens": 100}
    await asyncio.wait_for(drive(app, "/v1/completions", body, disconnect=gone), 1.0)
    await leaver
    await asyncio.sleep(0.01)
    assert backend.closed == [backend.opened[0]["id"]]
    assert app.state.gateway.slots.in_use == 0


async def test_non_streaming_client_task_cancelled_closes_the_generation(app, backend) -> None:
    backend.delay = 0.05
    async with http(app) as c:
        task = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 100})
        )
        while not backend.opened:
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.sleep(0.01)
    assert backend.closed == [backend.opened[0]["id"]]
    assert app.state.gateway.slots.in_use == 0


# -------------------------------------------------------------------------- the small routes


async def test_models_tokenize_detokenize(app, tokenizer) -> None:
    async with http(app) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 256
        assert (await c.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        text = "Hello, world! 日本語"
        tok = (await c.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
        assert tok["tokens"] == encode_prompt(tokenizer, text)
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
        back = (await c.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        assert back == {"prompt": text}
        messages = [{"role": "user", "content": "hi"}]
        chat = (await c.post("/tokenize", json={"messages": messages})).json()
        assert chat["tokens"] == apply_chat_template(tokenizer, messages)
        bare = (
            await c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
        ).json()
        assert chat["count"] > bare["count"]
        r = await c.post("/tokenize", json={"prompt": "a", "messages": messages})
        assert r.status_code == 400
        r = await c.post("/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert [m.id for m in (await oai(app).models.list()).data] == [MODEL]


async def test_health(app, backend) -> None:
    async with http(app) as c:
        r = await c.get("/health")
        assert r.status_code == 200
        assert r.json()["workers"] == {"prefill-0": "active", "decode-1": "suspect"}
        backend.is_healthy = False
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable_error"
        backend.is_healthy = RuntimeError("ray is gone")
        assert (await c.get("/health")).status_code == 503


def metric_value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in\n{text}")


async def test_metrics(app) -> None:
    client = oai(app)
    await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5, n=2)
    async with http(app) as c:
        await c.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    t = r.text
    m = f'model_name="{MODEL}"'  # vLLM's label, on every series
    assert metric_value(t, f'tandem:request_success_total{{finished_reason="length",{m}}}') == 2
    assert metric_value(t, f"tandem:prompt_tokens_total{{{m}}}") == 4
    assert metric_value(t, f"tandem:generation_tokens_total{{{m}}}") == 10
    assert metric_value(t, f"tandem:time_to_first_token_seconds_count{{{m}}}") == 1
    assert metric_value(t, f"tandem:inter_token_latency_seconds_count{{{m}}}") == 4
    assert metric_value(t, f"tandem:e2e_request_latency_seconds_count{{{m}}}") == 1
    assert metric_value(t, f'tandem:request_rejected_total{{{m},reason="invalid"}}') == 1
    assert metric_value(t, f"tandem:gateway_requests_in_flight{{{m}}}") == 0
    assert metric_value(t, f'tandem:routing_decisions_total{{{m},reason="prefix_hit"}}') == 3
    assert metric_value(t, f"tandem:prefix_index_unavailable_total{{{m}}}") == 2
    assert metric_value(t, f'tandem:request_resumes_total{{{m},reason="worker_died"}}') == 2
    state = 'tandem:worker_state{{{},state="{}",worker="decode-1"}}'
    assert metric_value(t, state.format(m, "suspect")) == 1
    assert metric_value(t, state.format(m, "active")) == 0
    assert metric_value(t, f'tandem:worker_missed_polls{{{m},worker="decode-1"}}') == 3
    assert metric_value(t, f'tandem:worker_missed_polls{{{m},worker="prefill-0"}}') == 0
    assert metric_value(t, f'tandem:num_requests_running{{{m},worker="decode-1"}}') == 3
    assert metric_value(t, f'tandem:num_requests_waiting{{{m},worker="prefill-0"}}') == 2
    assert metric_value(t, f'tandem:kv_cache_usage_perc{{{m},worker="prefill-0"}}') == 0.25
    assert metric_value(t, f'tandem:prefix_cache_queries_total{{{m},worker="prefill-0"}}') == 640
    assert metric_value(t, f'tandem:prefix_cache_hits_total{{{m},worker="prefill-0"}}') == 320
    sent = f'tandem:kv_transfer_bytes_total{{direction="sent",{m},worker="prefill-0"}}'
    assert metric_value(t, sent) == 4096
    received = f'tandem:kv_transfer_bytes_total{{direction="received",{m},worker="decode-1"}}'
    assert metric_value(t, received) == 4096
    assert metric_value(t, f'tandem:kv_transfer_seconds_total{{{m},worker="prefill-0"}}') == 0.5
    assert metric_value(t, f'tandem:kv_staged_bytes{{{m},worker="decode-1"}}') == 1024
    assert (
        metric_value(t, f'tandem:kv_transfer_tail_seconds_total{{{m},worker="decode-1"}}') == 0.25
    )
    assert metric_value(t, f'tandem:kv_transfers_in_total{{{m},worker="decode-1"}}') == 5
    assert 'kv_staged_bytes{worker="prefill-0"}' not in t
    assert 'prefix_cache_queries_total{worker="decode-1"}' not in t  # absent keys are skipped


# ------------------------------------------------------------------------------------- bounds


def _status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_a_slow_body_holds_no_slot_and_times_out(backend) -> None:
    """The body is read before admission, under body_timeout_s: a client that trickles (or
    stops) holds no slot while it sends, and gets a 408."""
    app = create_app(backend, max_concurrent=1, body_timeout_s=0.3)
    raw = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    stalled = asyncio.Event()
    sent: list[dict] = []

    async def receive():
        if not stalled.is_set():
            stalled.set()
            return {"type": "http.request", "body": raw[:5], "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    async def send(message):
        sent.append(message)

    slow = asyncio.create_task(app(_scope("/v1/completions", raw), receive, send))
    await stalled.wait()
    async with http(app) as c:  # the one slot is free for a client that sends its body
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    await asyncio.wait_for(slow, 2)
    assert _status(sent) == 408
    assert json.loads(_body(sent))["error"]["code"] == "request_timeout"
    assert app.state.gateway.slots.in_use == 0


async def test_n_counts_against_the_concurrency_bound(backend) -> None:
    app = create_app(backend, max_concurrent=3)
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # it never fits
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        backend.delay = 0.02
        held = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20, "n": 2})
        )
        while not backend.opened or backend.opened[-1]["params"].n != 2:
            await asyncio.sleep(0.005)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
        assert r.status_code == 429 and "needs 2" in r.json()["error"]["message"]  # 2 of 3 taken
        r = await c.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 200  # one slot is left
        assert (await held).status_code == 200
    assert app.state.gateway.slots.in_use == 0


async def test_a_client_that_stops_reading_ends_its_stream(backend) -> None:
    """A streamed frame the client does not take within write_timeout_s (the server's send
    blocks: its socket buffer is full) ends the stream and aborts the generation."""
    app = create_app(backend, write_timeout_s=0.2)
    backend.delay = 0.001
    raw = json.dumps({"prompt": "hi", "max_tokens": 200, "stream": True}).encode()
    delivered = False
    frames = 0

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # never disconnects either

    async def send(message):
        nonlocal frames
        if message["type"] == "http.response.body":
            frames += 1
            if frames > 3:
                await asyncio.Event().wait()  # the client stopped reading

    await asyncio.wait_for(app(_scope("/v1/completions", raw), receive, send), 3)
    await asyncio.sleep(0.01)
    assert backend.closed == [backend.opened[0]["id"]]
    assert app.state.gateway.slots.in_use == 0


async def test_headers_over_the_limit_are_431(backend) -> None:
    app = create_app(backend, max_header_bytes=1024)
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"x-big": "a" * 2000})
        assert r.status_code == 431
        assert r.json()["error"]["code"] == "request_header_fields_too_large"
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


async def test_drain_refuses_new_requests_and_ends_the_rest_in_band(backend) -> None:
    """Shutting down: new requests get 503 + Retry-After; one that finishes within the deadline
    completes; those still running at the deadline end with an error, in-band for a stream;
    every generation is closed and every slot given back."""
    app = create_app(backend)
    gateway = app.state.gateway
    backend.delay = 0.01
    async with http(app) as c:
        short = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        )
        long_body = {"prompt": "hi", "max_tokens": 250}  # 2.5 s: past the deadline
        stream = asyncio.create_task(c.post("/v1/completions", json={**long_body, "stream": True}))
        plain = asyncio.create_task(c.post("/v1/completions", json=long_body))
        while len(backend.opened) < 3:
            await asyncio.sleep(0.005)
        drained = asyncio.create_task(gateway.drain(0.5))
        await asyncio.sleep(0.05)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "shutting_down"
        assert (await c.get("/health")).status_code == 503
        assert (await short).status_code == 200  # finished within the deadline
        assert await asyncio.wait_for(drained, 3) == 2
        s = await stream
        events = sse_events(s.text)
        assert s.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "shutting_down"
        p = await plain
        assert p.status_code == 503 and p.json()["error"]["code"] == "shutting_down"
    assert sorted(backend.closed) == sorted(o["id"] for o in backend.opened)
    assert gateway.slots.in_use == 0 and not gateway.calls


class _Client:
    """An ASGI request's receive for ``_unless_gone``: the client disconnects when ``gone`` is
    set."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _balanced(task: asyncio.Task) -> bool:
    """No request to cancel ``task`` is left pending (Python 3.11+ counts them)."""
    return not hasattr(task, "cancelling") or task.cancelling() == 0


async def test_the_open_runs_in_the_request_task_before_anything_else_ready() -> None:
    """A request's open is awaited in its own task, at once: a task of its own would start
    only after every callback already ready, which in a burst is every other new request."""
    from router.gateway import _Call, _unless_gone

    order = []
    asyncio.get_running_loop().call_soon(order.append, "ready before")

    async def work():
        order.append(asyncio.current_task())
        return 7

    me = asyncio.current_task()
    assert await _unless_gone(_Client(), _Call(None, 1, set()), work()) == (True, 7)
    assert order == [me]  # ran in this task, before the callback that was ready first
    await asyncio.sleep(0)
    assert order == [me, "ready before"] and _balanced(me)


@pytest.mark.parametrize("how", ["client_gone", "call_stopped"])
async def test_the_open_is_cancelled_when_the_client_goes_or_the_call_stops(how) -> None:
    from router.gateway import APIError, _Call, _unless_gone

    client, call = _Client(), _Call(None, 1, set())
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    stop = APIError(503, "the server is shutting down")
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, client.gone.set if how == "client_gone" else partial(call.stop, stop))
    me = asyncio.current_task()
    if how == "client_gone":
        assert await _unless_gone(client, call, work()) == (False, None)
    else:
        with pytest.raises(APIError) as info:
            await _unless_gone(client, call, work())
        assert info.value is stop
    assert cancelled.is_set() and _balanced(me)
    await asyncio.sleep(0.01)  # this task goes on: no cancellation was left for it


async def test_a_request_task_cancelled_from_outside_stays_cancelled() -> None:
    from router.gateway import _Call, _unless_gone

    started = asyncio.Event()

    async def work():
        started.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(_unless_gone(_Client(), _Call(None, 1, set()), work()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_gone_before_the_first_token_ends_the_request(backend, stream) -> None:
    """The prefill is still running when the client disconnects: the open is cancelled (the
    request is aborted in the cluster) and its slot is free at once, not after the prefill."""
    app = create_app(backend, max_concurrent=1)
    backend.open_delay = 30.0
    body = {"prompt": "hi", "max_tokens": 5, "stream": stream}
    gone = asyncio.Event()
    task = asyncio.create_task(drive(app, "/v1/completions", body, disconnect=gone))
    await asyncio.sleep(0.1)
    assert app.state.gateway.slots.in_use == 1
    gone.set()
    sent = await asyncio.wait_for(task, 2)
    assert backend.cancelled_opens and _status(sent) == 499
    assert app.state.gateway.slots.in_use == 0


async def test_an_unexpected_error_is_a_500_with_the_request_id(app, backend) -> None:
    backend.fail_open = RuntimeError("a bug")
    async with http(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "a bug" not in r.text
        rid = r.headers["x-request-id"]
        assert rid in r.json()["error"]["message"]
        backend.fail_open = None  # the same connection serves the next request
        assert (await c.post("/v1/completions", json={"prompt": "hi"})).status_code == 200


# ----------------------------------------------------------------------------- structured outputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "path, extra, kind, value, strict",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            SCHEMA,
            True,
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            },
            "json_schema",
            SCHEMA,
            False,
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            "json_object",
            "",
            True,
        ),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "json_object", "", True),
        ("/v1/completions", {"guided_json": SCHEMA}, "json_schema", SCHEMA, True),
        ("/v1/chat/completions", {"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA, True),
        ("/v1/completions", {"guided_regex": "[a-z]{3}"}, "regex", "[a-z]{3}", True),
        ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]', True),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"json": SCHEMA}},
            "json_schema",
            SCHEMA,
            True,
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "x+"}}, "regex", "x+", True),
        ("/v1/completions", {"structured_outputs": {"choice": ["a"]}}, "choice", '["a"]', True),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"json_object": True}},
            "json_object",
            "",
            True,
        ),
    ],
)
async def test_structured_output_fields_reach_the_sampling_params(
    app, backend, path, extra, kind, value, strict
) -> None:
    body = {"model": MODEL, "max_tokens": 3, **extra}
    body.update({"messages": CHAT["messages"]} if "chat" in path else {"prompt": "hi"})
    async with http(app) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    spec = backend.opened[0]["params"].structured
    assert spec.kind == kind and spec.strict is strict
    assert (json.loads(spec.value) if kind == "json_schema" else spec.value) == value
    async with http(app) as c:  # counted by kind (a 400 is not)
        await c.post(path, json={**body, "guided_regex": "a("})
        text = (await c.get("/metrics")).text
    name = f'tandem:structured_output_requests_total{{kind="{kind}",model_name="{MODEL}"}}'
    assert metric_value(text, name) == 1


async def test_response_format_text_asks_for_nothing(app, backend) -> None:
    await oai(app).chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=2, response_format={"type": "text"}
    )
    assert backend.opened[0]["params"].structured is None


@pytest.mark.parametrize(
    "path, extra, param, words",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "frob"}, "strict": True},
                }
            },
            "response_format",
            "frob",
        ),
        (
            "/v1/completions",
            {"guided_json": {"type": "string", "pattern": "(a"}},
            "guided_json",
            "unclosed group",
        ),
        ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "regex"),
        ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", "non-empty"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format",
            "json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
            "give one",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "regex, choice",
        ),
    ],
)
async def test_a_bad_structured_output_is_400_naming_it(app, backend, path, extra, param, words):
    body = {"model": MODEL, **extra}
    body.update({"messages": CHAT["messages"]} if "chat" in path else {"prompt": "hi"})
    async with http(app) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert words in err["message"] and param in err["message"], err["message"]
    assert backend.opened == []


async def test_parse_with_a_pydantic_model_sends_a_strict_schema(app, backend) -> None:
    """The official client's ``parse`` sends response_format json_schema (strict) from a model."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    with pytest.raises(Exception):  # noqa: B017 - the fake backend's text is not a Person
        await oai(app).chat.completions.parse(
            model=MODEL, messages=CHAT["messages"], max_tokens=2, response_format=Person
        )
    spec = backend.opened[0]["params"].structured
    assert spec.kind == "json_schema" and spec.strict
    assert set(json.loads(spec.value)["properties"]) == {"name", "age"}
