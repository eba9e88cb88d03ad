"""Checks through the official openai client that the server tests share (tests/test_serve.py
on a disaggregated cluster, tests/test_serve_gateways.py on a colocated one)."""

from __future__ import annotations

from collections import defaultdict

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name three colors."}]


def _streamed(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    """Per choice index: the text the frames add up to, and its finish reason."""
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                assert c.index not in finish, f"choice {c.index} finished twice"
                finish[c.index] = c.finish_reason
    return dict(texts), finish


def check_n_samples(client, model: str) -> None:
    """``n`` = 2 and 3, streamed and not, with logprobs, on /v1/completions and
    /v1/chat/completions: every choice is there once, greedy choices are the n = 1 answer,
    seeded samples are the same streamed or not, usage counts every choice's tokens."""
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    greedy = one.choices[0].text
    assert greedy
    for n in (2, 3):
        args = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, n=n, logprobs=2)
        out = client.completions.create(**args)
        assert sorted(c.index for c in out.choices) == list(range(n))
        assert [c.text for c in out.choices] == [greedy] * n
        assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in out.choices)
        assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
        texts, finish = _streamed(client.completions.create(**args, stream=True), chat=False)
        assert texts == dict.fromkeys(range(n), greedy) and sorted(finish) == list(range(n))

        chat = dict(
            model=model,
            messages=QUESTION,
            max_tokens=8,
            temperature=1.0,
            seed=11,
            n=n,
            logprobs=True,
            top_logprobs=2,
        )
        out = client.chat.completions.create(**chat)
        assert sorted(c.index for c in out.choices) == list(range(n))
        contents = {c.index: c.message.content for c in out.choices}
        assert all(contents.values())
        assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
        texts, finish = _streamed(client.chat.completions.create(**chat, stream=True), chat=True)
        assert texts == contents and sorted(finish) == list(range(n))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris and what time is it in Tokyo?"}]


def _valid_call(call) -> dict:
    """The call's arguments, checked against its function's parameter schema."""
    import json

    import jsonschema

    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema[call.function.name])
    return arguments


def _streamed_calls(chunks) -> tuple[list[dict], str | None, int]:
    """Tool calls folded from ``delta.tool_calls``; the finish reason; how many deltas
    carried arguments (they stream as they are written)."""
    calls: dict[int, dict] = {}
    finish, argument_deltas = None, 0
    for chunk in chunks:
        for c in chunk.choices:
            assert not (c.delta.content or "").strip(), "a forced call has no content"
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
                argument_deltas += bool(d.function.arguments)
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, argument_deltas


def check_tool_calls(client, model: str, everything: bool = True) -> None:
    """A named call (valid by grammar), ``required`` streamed (the deltas reassemble to a valid
    call, its arguments in several deltas, the same call as unstreamed); with ``everything``
    also parallel calls (two where parallel_tool_calls is on) and a tool result sent back and
    answered."""
    import json

    named = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=1.0,
        seed=3,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_time" and set(_valid_call(call)) == {"city"}

    for parallel, count in ((False, 1), (True, 2))[: 2 if everything else 1]:
        chunks = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=120,
            temperature=0,
            stream=True,
        )
        calls, finish, argument_deltas = _streamed_calls(chunks)
        assert finish == "tool_calls" and len(calls) == count, calls
        assert argument_deltas > len(calls)  # the arguments came as they were written
        whole = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=120,
            temperature=0,
        )
        got = whole.choices[0].message.tool_calls
        assert [(c.function.name, _valid_call(c)) for c in got] == [
            (c["name"], json.loads(c["arguments"])) for c in calls
        ]
    if not everything:
        return
    assert {c["name"] for c in calls} == {"get_weather", "get_time"}

    first = whole.choices[0].message.tool_calls[0]
    answered = client.chat.completions.create(
        model=model,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
            {"role": "tool", "tool_call_id": first.id, "content": '{"temperature": 21}'},
        ],
        tools=TOOLS,
        max_tokens=24,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = answered.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    import httpx

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    prompt = httpx.post(
        root + "/detokenize",
        json={"tokens": answered.model_extra["prompt_token_ids"]},
        headers={"Authorization": f"Bearer {client.api_key}"},
        timeout=60,
    ).json()["prompt"]
    assert '"temperature": 21' in prompt and first.function.name in prompt
