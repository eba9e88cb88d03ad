"""Tool calling and reasoning, the reading and writing layer (router/tool_calls.py,
router/reasoning.py, router/chat_output.py): calls read out of answers rendered by each model
family's own chat template (Llama 3.1, Qwen2.5, Qwen3 in tests/data/chat_templates; Mistral by
mistral-common, tests/data/tool_formats), whole and streamed split at every character; the
grammars of ``required`` and named calls accept the templates' own calls and refuse others;
bad tool specs are 400s naming the param, and cost nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.chat_output import ChatFormat, message_tool_calls
from router.reasoning import PARSERS, parser_of_template
from router.tool_calls import (
    FORMATS,
    ToolError,
    format_of_template,
    parse_tools,
    template_messages,
)

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "chat_templates"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
NAMES = frozenset({"get_weather", "get_time"})
CALLS = [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {"city": "Tokyo"})]
QUESTION = [{"role": "user", "content": "Weather in Zürich and time in Tokyo?"}]
END_OF_TURN = {"qwen2.5": "<|im_end|>\n", "qwen3": "<|im_end|>\n", "llama3.1": "<|eot_id|>"}


def render(template: str, messages: list[dict], add_generation_prompt: bool = False, **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[template_messages(messages)],
        tools=TOOLS,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>",
        **kw,
    )
    return rendered[0]


def assistant(calls, content: str = "", reasoning: str | None = None) -> dict:
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate((n, json.dumps(a, ensure_ascii=False)) for n, a in calls)
        ],
    }
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def rendered_answer(name: str, turn: dict) -> str:
    """What the model writes for ``turn``, as its own chat template renders that turn: the
    conversation with the turn less the prompt before it, less the end-of-turn token."""
    template = (TEMPLATES / f"{name}.jinja").read_text()
    prompt = render(template, QUESTION, add_generation_prompt=True)
    full = render(template, [*QUESTION, turn])
    assert full.startswith(prompt)
    assert full.endswith(END_OF_TURN[name])
    return full[len(prompt) : -len(END_OF_TURN[name])]


def fmt_of(name: str) -> ChatFormat:
    template = (TEMPLATES / f"{name}.jinja").read_text()
    fmt, renders = format_of_template(template)
    return ChatFormat(fmt, renders, parser_of_template(template))


def tools_of(choice="auto", parallel=True):
    return parse_tools(TOOLS, choice, parallel)


def read(fmt: ChatFormat, pieces: list[str], thinking: bool = False) -> dict:
    """Feed ``pieces`` as a stream; the deltas folded, and how many deltas each call's
    arguments came in."""
    reader = fmt.reader(tools_of(), thinking)
    reasoning, content, deltas = "", "", []
    for i, piece in enumerate(pieces):
        d = reader.feed(piece, final=i == len(pieces) - 1)
        reasoning += d.reasoning
        content += d.content
        deltas += d.tool_calls
    for d in deltas:  # the first delta of a call has its id and name, the others neither
        first = not any(e["index"] == d["index"] for e in deltas[: deltas.index(d)])
        assert ("id" in d) == first and ("name" in d["function"]) == first, deltas
    calls = message_tool_calls(deltas)
    parts = [
        sum(1 for d in deltas if d["index"] == i and d["function"]["arguments"])
        for i in range(len(calls))
    ]
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
        "ids": [c["id"] for c in calls],
        "argument_deltas": parts,
        "called": reader.called,
    }


def check_every_split(fmt: ChatFormat, answer: str, thinking: bool = False) -> dict:
    whole = read(fmt, [answer], thinking)
    if fmt.tools.name.startswith("mistral"):  # nine letters and digits, as its templates want
        assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in whole["ids"])
    else:
        assert all(i.startswith("call_") and len(i) == 29 for i in whole["ids"])
    fields = ("reasoning", "content", "calls")
    for k in range(len(answer) + 1):
        split = read(fmt, [answer[:k], answer[k:]], thinking)
        assert {f: split[f] for f in fields} == {f: whole[f] for f in fields}, k
    by_char = read(fmt, [*answer, ""], thinking)
    assert {f: by_char[f] for f in fields} == {f: whole[f] for f in fields}
    # the arguments stream as they are written, not all at the end
    assert all(n > 1 for n in by_char["argument_deltas"]), by_char["argument_deltas"]
    return whole


# ------------------------------------------------------------------------- the templates


def test_each_template_is_recognised():
    for name, expected in (("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.1", "llama3_json")):
        fmt = fmt_of(name)
        assert (fmt.tools.name, fmt.template_tools) == (expected, True), name
    assert fmt_of("qwen3").reasoning is PARSERS["qwen3"]
    assert fmt_of("qwen2.5").reasoning is None and fmt_of("llama3.1").reasoning is None
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
    assert format_of_template(chatml) == (FORMATS["hermes"], False)  # tandem's fallback


@pytest.mark.parametrize(
    "name, calls",
    [("qwen2.5", CALLS[:1]), ("qwen2.5", CALLS), ("llama3.1", CALLS[:1]), ("qwen3", CALLS)],
)
def test_calls_rendered_by_the_template_are_read_back(name, calls):
    answer = rendered_answer(name, assistant(calls))
    got = check_every_split(fmt_of(name), answer)
    assert got["calls"] == calls and got["called"]
    assert got["content"] == ""


def test_qwen3_thinking_then_calls_and_text_before_them():
    turn = assistant(CALLS, content="Let me look both up.", reasoning="Two tools.\nBoth needed.")
    answer = rendered_answer("qwen3", turn)
    assert answer.startswith("<think>\nTwo tools.")
    got = check_every_split(fmt_of("qwen3"), answer)
    assert got["reasoning"] == "Two tools.\nBoth needed."
    assert got["content"] == "Let me look both up.\n"
    assert got["calls"] == CALLS


def test_qwen3_reasoning_without_tools_and_enable_thinking_off():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    turn = {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital."}
    answer = rendered_answer("qwen3", turn)
    fmt = fmt_of("qwen3")
    got = check_every_split(fmt, answer)
    assert (got["reasoning"], got["content"], got["calls"]) == ("The capital.", "Paris.", [])
    # enable_thinking false: the template closes an empty thinking block in the prompt, and
    # the answer is all content
    off = render(template, QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not fmt.reasoning.opens_thinking(off)
    assert read(fmt, ["Paris, as it ", "happens."])["content"] == "Paris, as it happens."
    # a prompt that opens the thinking: the answer starts inside it
    assert fmt.reasoning.opens_thinking("<|im_start|>assistant\n<think>\n")
    got = check_every_split(fmt, "It is Paris.\n</think>\n\nParis.", thinking=True)
    assert (got["reasoning"], got["content"]) == ("It is Paris.", "Paris.")
    cut = read(fmt, ["<think>\nStill thin", "king"])  # cut by max_tokens: all reasoning
    assert (cut["reasoning"], cut["content"]) == ("Still thinking", "")


def test_mistral_calls_rendered_by_mistral_common():
    data = json.loads((DATA / "tool_formats" / "mistral_v3.json").read_text())
    fmt = ChatFormat(FORMATS["mistral"], True, None)
    assert "[AVAILABLE_TOOLS]" in data["cases"][0]["prompt"]
    for case in data["cases"]:
        answer = case["answer"].replace("\u2581", " ")  # as a decoder writes SentencePiece
        assert answer.startswith("[TOOL_CALLS] [")
        got = check_every_split(fmt, answer)
        assert got["calls"] == [(c["name"], json.loads(c["arguments"])) for c in case["calls"]]
        assert got["content"] == ""
        after_text = check_every_split(fmt, "Sure. " + answer)
        assert after_text["content"] == "Sure. " and after_text["calls"] == got["calls"]


@pytest.mark.parametrize("version", ["v11", "v13"])
def test_mistral_args_calls_rendered_by_mistral_common(version):
    """Mistral's newer syntax, ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11: with
    ``[CALL_ID]id`` before ``[ARGS]``), as mistral-common's own v11 / v13 encoders write it."""
    data = json.loads((DATA / "tool_formats" / "mistral_v11.json").read_text())
    fmt = ChatFormat(FORMATS["mistral_v11"], True, None)
    for case in data["versions"][version]:
        answer = case["answer"]
        assert answer.startswith("[TOOL_CALLS]get_weather")
        assert ("[CALL_ID]" in answer) == (version == "v11")
        got = check_every_split(fmt, answer)
        assert got["calls"] == [(c["name"], json.loads(c["arguments"])) for c in case["calls"]]
        assert got["content"] == ""
        after_text = check_every_split(fmt, "Sure. " + answer)
        assert after_text["content"] == "Sure. " and after_text["calls"] == got["calls"]
    # the format is told by its template; v3 templates keep the older parser
    v11 = "{{ '[TOOL_CALLS]' + call.function.name + '[ARGS]' + call.function.arguments|tojson }}"
    assert format_of_template(v11)[0].name == "mistral_v11"
    assert format_of_template("{{ '[TOOL_CALLS] [' }}")[0].name == "mistral"


def test_mistral_args_text_that_is_not_a_call_stays_content():
    fmt = ChatFormat(FORMATS["mistral_v11"], True, None)
    for text in ("[TOOL_CALLS]rm_rf[ARGS]{}", "[TOOL_CALLS]get_weather not a call", "[TOOLS] x"):
        assert check_every_split(fmt, text)["content"] == text
    reader = fmt.reader(tools_of())  # a call cut by max_tokens keeps what was written
    d = reader.feed('[TOOL_CALLS]get_time[ARGS]{"city": "Os', final=True)
    assert d.content == "" and message_tool_calls(d.tool_calls)[0]["function"] == {
        "name": "get_time",
        "arguments": '{"city": "Os',
    }


def test_mistral_call_ids_reach_its_template_as_it_takes_them():
    """Mistral's templates raise on call ids other than nine letters and digits; ids sent
    back from other servers (``call_...``) are mapped to nine, the same for a call and its
    result; other formats keep them as sent."""
    history = [
        *QUESTION,
        assistant(CALLS),
        {"role": "tool", "tool_call_id": "call_0", "content": "12 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "09:00"},
    ]
    for name in ("mistral", "mistral_v11"):
        out = template_messages(history, FORMATS[name])
        ids = [c["id"] for c in out[1]["tool_calls"]]
        assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
        assert [out[2]["tool_call_id"], out[3]["tool_call_id"]] == ids
        kept = template_messages([{**history[2], "tool_call_id": "abcDEF123"}], FORMATS[name])
        assert kept[0]["tool_call_id"] == "abcDEF123"
    assert template_messages(history, FORMATS["hermes"])[2]["tool_call_id"] == "call_0"


# ----------------------------------------------------------------------- what is not a call


def test_text_that_is_not_a_call_stays_content():
    hermes = ChatFormat(FORMATS["hermes"], True, None)
    llama = ChatFormat(FORMATS["llama3_json"], True, None)
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert check_every_split(hermes, unknown)["content"] == unknown
    broken = "<tool_call>\nnot json\n</tool_call> then text"
    assert check_every_split(hermes, broken)["content"] == broken
    assert (
        read(hermes, ["a < b and <tool", "ing> is fine"])["content"]
        == "a < b and <tooling> is fine"
    )
    plain = "The weather is fine."
    assert check_every_split(llama, plain) == {**read(llama, [plain]), "content": plain}
    answer_json = '{"name": "Alice", "age": 3}'  # JSON that names no tool is an answer
    assert check_every_split(llama, answer_json)["content"] == answer_json
    after = (
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n\nDone.'
    )
    got = check_every_split(hermes, after)
    assert got["calls"] == [("get_time", {"city": "Oslo"})] and got["content"] == "Done."


def test_a_call_cut_by_max_tokens_keeps_what_was_written():
    hermes = ChatFormat(FORMATS["hermes"], True, None)
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Os'
    reader = hermes.reader(tools_of())
    d = reader.feed(cut, final=True)
    assert message_tool_calls(d.tool_calls)[0]["function"] == {
        "name": "get_time",
        "arguments": '{"city": "Os',
    }
    assert reader.finish_reason("length") == "length"
    assert reader.finish_reason("stop") == "tool_calls"


# ------------------------------------------------------------------------------ the grammar


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    pytest.importorskip("llguidance")
    from engine.grammar import Grammars, make_backend

    return Grammars(make_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id]))


def accepts(grammars, tokenizer, spec, text: str) -> bool:
    matcher = grammars.matcher(spec)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept(token):
            return False
    return matcher.accept(tokenizer.eos_token_id)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_the_grammar_is_the_templates_own_call_syntax(name, grammars, tokenizer):
    fmt = fmt_of(name)
    one = rendered_answer(name, assistant(CALLS[:1]))
    required = fmt.grammar(tools_of("required", parallel=False))
    assert accepts(grammars, tokenizer, required, one)
    assert not accepts(grammars, tokenizer, required, one.replace("celsius", "kelvin"))
    assert not accepts(grammars, tokenizer, required, "The weather is fine.")
    named = fmt.grammar(tools_of({"type": "function", "function": {"name": "get_time"}}))
    assert not accepts(grammars, tokenizer, named, one)
    if name == "qwen2.5":  # (Llama 3.1's template renders one call per turn)
        two = rendered_answer(name, assistant(CALLS))
        assert accepts(grammars, tokenizer, fmt.grammar(tools_of("required")), two)
        assert not accepts(grammars, tokenizer, required, two)  # parallel_tool_calls false


def test_the_grammar_of_mistral_args_calls(grammars, tokenizer):
    """``required`` in the v11 syntax accepts mistral-common's own v13 answers (markers as
    text here: SmolLM2 has no such tokens) and refuses others; a special-token marker is
    written as that token."""
    data = json.loads((DATA / "tool_formats" / "mistral_v11.json").read_text())
    one, two = (c["answer"] for c in data["versions"]["v13"])
    fmt = ChatFormat(FORMATS["mistral_v11"], True, None)
    assert accepts(grammars, tokenizer, fmt.grammar(tools_of("required", parallel=False)), one)
    assert accepts(grammars, tokenizer, fmt.grammar(tools_of("required")), two)
    assert not accepts(grammars, tokenizer, fmt.grammar(tools_of("required", False)), two)
    refused = one.replace("celsius", "kelvin")
    assert not accepts(grammars, tokenizer, fmt.grammar(tools_of("required")), refused)
    named = fmt.grammar(tools_of({"type": "function", "function": {"name": "get_time"}}))
    assert not accepts(grammars, tokenizer, named, one)
    special = {"[TOOL_CALLS]": 5, "[ARGS]": 6}
    tokens = ChatFormat(FORMATS["mistral_v11"], True, None, special, frozenset(special))
    grammar = tokens.grammar(tools_of("required")).value
    assert grammar.startswith("start: call+") and 'call_0: <[5]> "get_weather" <[6]>' in grammar


def test_a_special_token_marker_is_written_as_that_token():
    fmt = ChatFormat(
        FORMATS["mistral"], True, None, {"[TOOL_CALLS]": 5}, frozenset({"[TOOL_CALLS]"})
    )
    grammar = fmt.grammar(tools_of("required")).value
    assert grammar.startswith('start: <[5]> " "? "["') and fmt.keeps_special_tokens
    # Qwen's <tool_call> is an added token the tokenizer does not call special
    qwen = ChatFormat(FORMATS["hermes"], True, None, {"<tool_call>": 7, "</tool_call>": 8})
    grammar = qwen.grammar(tools_of({"type": "function", "function": {"name": "get_time"}}))
    assert 'call_0: <[7]> "\\n{\\"name\\": ' in grammar.value and not qwen.keeps_special_tokens
    assert '"}\\n" <[8]>' in grammar.value


# ------------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize(
    "tools, choice, param, words",
    [
        ([{"type": "retrieval"}], None, "tools", "type must be 'function'"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "letters"),
        ([TOOLS[0], TOOLS[0]], None, "tools", "given twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools",
            "describe an object",
        ),
        (TOOLS, "sometimes", "tool_choice", "must be one of"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
        (TOOLS, {"type": "function"}, "tool_choice", "must name a function"),
        (None, "required", "tool_choice", "needs tools"),
        ([], {"type": "function", "function": {"name": "f"}}, "tool_choice", "needs tools"),
    ],
)
def test_bad_tool_specs_are_errors_naming_the_param(tools, choice, param, words):
    with pytest.raises(ToolError) as bad:
        parse_tools(tools, choice, None)
    assert bad.value.param == param and words in str(bad.value)


def test_no_tools_and_none_ask_for_nothing():
    assert parse_tools(None, None, None) is None
    assert parse_tools([], "none", False) is None
    req = parse_tools(TOOLS, "none", None)
    assert not req.active and req.parallel


# ------------------------------------------------------------------- through the gateway's HTTP


def gateway_post(app, body: dict, stream: bool = False):
    """POST /v1/chat/completions to the app in process; the response (and its SSE events)."""
    import asyncio

    import httpx

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/chat/completions", json={**body, "stream": stream})
            return r, [
                json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
            ]

    return asyncio.run(go())


def fake_app(tokenizer):
    """The gateway's app over test_gateway's backend that replays fixed tokens."""
    from test_gateway import FakeBackend

    from router.gateway import create_app

    backend = FakeBackend(tokenizer)
    backend.max_model_len = 4096
    return create_app(backend), backend


@pytest.fixture()
def fake(tokenizer):
    return fake_app(tokenizer)


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(["}}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "20 C"}]}, "messages"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    },
                ]
            },
            "messages",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": "{}"}, "extra": 1}
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.extra",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_param(fake, body, param):
    app, backend = fake
    r, _ = gateway_post(app, {"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert backend.opened == []  # nothing ran


def test_tools_reach_the_prompt_and_calls_come_back_whole_and_streamed(fake, tokenizer):
    """SmolLM2's ChatML has no tools: tandem's fallback describes them in the system prompt,
    writes past calls and results as text; an answer holding a call comes back as
    ``message.tool_calls`` and as ``delta.tool_calls`` (the backend here replays fixed tokens)."""
    app, backend = fake
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    backend.cycle = tokenizer.encode(call, add_special_tokens=False)
    backend.finish_reason = "stop"
    history = [
        *MESSAGES,
        assistant([("get_weather", {"city": "Oslo", "unit": "celsius"})]),
        {"role": "tool", "tool_call_id": "call_0", "content": "4 C"},
    ]
    body = {"messages": history, "tools": TOOLS, "max_tokens": len(backend.cycle)}
    r, _ = gateway_post(app, body)
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(backend.opened[-1]["ids"])
    assert "<tools>" in prompt and '"name": "get_time"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in prompt
    assert "<tool_response>\n4 C\n</tool_response>" in prompt
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (got,) = choice["message"]["tool_calls"]
    assert got["type"] == "function" and got["id"].startswith("call_")
    assert got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}

    r, events = gateway_post(app, body, stream=True)
    deltas = [e["choices"][0]["delta"].get("tool_calls") for e in events if e["choices"]]
    deltas = [d for ds in deltas if ds for d in ds]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert sum(1 for d in deltas if d["function"].get("arguments")) > 1
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in events if e["choices"])

    # tool_choice none: no tools in the prompt, the answer is not read for calls
    r, _ = gateway_post(app, {**body, "tool_choice": "none"})
    assert "<tools>" not in tokenizer.decode(backend.opened[-1]["ids"])
    message = r.json()["choices"][0]["message"]
    assert message["content"] == call and "tool_calls" not in message
