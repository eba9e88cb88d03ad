"""The OpenAI wire format of the gateway: request bodies in, response bodies and SSE frames out.

Pure functions and pydantic models, no FastAPI: the gateway (``router/gateway.py``) reads the
body, calls these, and owns everything asynchronous. A request through this module::

    body bytes --parse_body--> CompletionRequest | ChatCompletionRequest (400 on any bad field)
               --completion_prompt / chat_prompt--> (prompt text, prompt token ids)
               --sampling_params--> SamplingParams (its ValueError -> 400 naming the param)
               --check_context--> 400 with vLLM's wording when prompt + max_tokens > context
    Answer     --completion_response / chat_response--> one JSON body, or
    Step       --its ChoiceDeltas, each --completion_chunk / chat_chunk--> one SSE frame
               (router/outputs.py: a request's output as steps, folded into an Answer only
               when it is not streamed)

Every failure is an :class:`APIError` carrying the HTTP status and the OpenAI error fields.

Where the OpenAI API leaves room, this module decides:

* ``prompt`` is one prompt: a string, a list of token ids, or a list holding one of those; a list
  of several prompts is a 400 (send one request per prompt; the gateway streams each on its own).
* A field is one of three kinds (``check_fields``): supported; documented by OpenAI or as a vLLM
  extra but not supported here, a 400 saying so unless its value asks for nothing (null,
  ``false``, an empty list, its default); or unknown, a 400 "Unrecognized request argument
  supplied: NAME" as OpenAI answers (a typo such as ``max_token`` must not run to the context).
  ``echo``, ``suffix``, ``best_of`` other than ``n``, the legacy ``functions`` and
  ``guided_grammar`` are such unsupported fields, never silently ignored.
* Structured outputs (``structured_spec``): one of ``response_format`` (``json_schema``,
  ``json_object``; ``text`` asks for nothing), ``guided_json``, ``guided_regex``,
  ``guided_choice`` or ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``json_object``), on both endpoints; two of them at once is a 400. The gateway compiles the
  spec before anything runs: a schema that does not compile is a 400 naming the problem.
* Tool calling (``chat_tools``, router/tool_calls.py): ``tools``, ``tool_choice`` (``none``,
  ``auto``, ``required``, a named function), ``parallel_tool_calls``; ``role: tool`` messages and
  assistant messages with ``tool_calls`` go to the chat template. ``required`` and a named
  function are a grammar over the model's own call syntax, so they cannot be combined with
  another structured output (a 400). ``none`` leaves the tools out of the prompt.
  ``chat_template_kwargs`` go to the template (``enable_thinking``), but for the names the
  gateway sets itself.
* ``top_logprobs`` lists the N most likely alternatives (descending), whether or not the sampled
  token is among them; completions' ``text_offset`` counts from the start of the completion.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import SamplingParams, StructuredSpec
from engine.tokenizer import apply_chat_template, encode_prompt
from router.chat_output import ChatFormat, ChoiceReader, message_tool_calls
from router.outputs import Answer, ChoiceDelta, TokenTexts, Usage
from router.predictor import PredictInput
from router.tool_calls import ToolError, ToolRequest, fallback_messages, parse_tools
from router.tool_calls import template_messages as tool_template_messages

MAX_N = 128
"""Largest ``n`` the gateway forwards (each sample is a sequence on a worker)."""

MIN_REPETITION_PENALTY = 0.01
"""Smallest ``repetition_penalty`` accepted. Positive logits are divided by it: far below this
it means nothing useful, and near 1e-37 and below the logits overflow float32 to inf and the
draw fails (found by tests/test_fuzz.py: ``1e-300`` was a 500)."""

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
"""Accepted message roles and what the chat template sees (OpenAI's ``developer`` is ``system``)."""


class APIError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` plus the ``error`` object's fields.

    ``reason`` labels ``tandem:request_rejected_total`` (None: not a rejection, e.g. a 500).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = "invalid",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.reason = reason

    def body(self) -> dict[str, Any]:
        """``{"object": "error", "error": {message, type, param, code}}`` (vLLM's and OpenAI's)."""
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"object": "error", "error": {**error, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


# ----------------------------------------------------------------------------- request bodies


# Fields that OpenAI documents, or vLLM documents as extras, which tandem does not implement:
# name -> the values that ask for nothing (accepted as if absent; null always is). Any other
# value is a 400 saying the field is not supported. Fields that are neither declared by the
# request's model nor listed here are unknown: 400 "Unrecognized request argument supplied".
_UNSUPPORTED_SHARED: dict[str, tuple[Any, ...]] = {
    # vLLM's sampling extras
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "add_special_tokens": (),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "kv_transfer_params": ({},),
    "vllm_xargs": ({},),
    "request_id": (),
    "prompt_embeds": (),
    # vLLM's structured outputs (guided decoding) beyond json / regex / choice
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {**_UNSUPPORTED_SHARED}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_SHARED,
    # OpenAI's
    "audio": (),
    "modalities": (["text"],),
    "functions": ([],),
    "function_call": ("none",),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": ({},),  # only kept with store
    "service_tier": ("auto", "default"),
    "moderation": (),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    # vLLM's chat extras
    "best_of": (1,),
    "echo": (False,),
    "continue_final_message": (False,),
    "documents": ([],),
    "chat_template": (),
    "mm_processor_kwargs": ({},),
}
_ACCEPTED_HINTS = frozenset({"prompt_cache_key", "safety_identifier"})
"""OpenAI fields that ask for nothing tandem would do differently: a prompt-cache routing key
(tandem caches and routes by prefix on every request) and an end-user id (like ``user``)."""
_UNSUPPORTED_MESSAGE: dict[str, tuple[Any, ...]] = {
    "function_call": (),
    "audio": (),
    "refusal": (),
}
_UNSUPPORTED_STREAM_OPTIONS: dict[str, tuple[Any, ...]] = {
    "include_obfuscation": (False,),
    "continuous_usage_stats": (False,),
}
_UNSUPPORTED_TOKENIZE: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (),
    "return_token_strs": (False,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "tools": ([],),
    "mm_processor_kwargs": ({},),
}


class _Body(BaseModel):
    """Strict JSON types (``"16"`` is not a number). Fields a model does not declare are kept
    aside (``model_extra``) for ``check_fields`` to judge: never silently dropped."""

    model_config = ConfigDict(strict=True, extra="allow")
    # documented fields this body does not implement: name -> the values that ask for nothing
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` object (one constraint of json, regex, choice, json_object)."""

    unsupported = {
        "grammar": (),
        "structural_tag": (),
        "whitespace_pattern": (),
        "disable_any_whitespace": (False,),
        "disable_additional_properties": (False,),
        "disable_fallback": (False, True),  # one engine here: there is nothing to fall back to
        "backend": (),
    }
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class StreamOptions(_Body):
    unsupported = _UNSUPPORTED_STREAM_OPTIONS
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    """A call in an assistant message of the history (OpenAI's shape)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    unsupported = _UNSUPPORTED_MESSAGE
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (templates that show past thinking)


class _GenerationBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI, then vLLM extras)."""

    model: str | None = None  # None: the served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extra: each choice carries its token ids (streamed: each chunk's new ones), and the
    # prompt's token ids come back too (completions: on each choice; chat: on the response)
    return_token_ids: bool = False
    # structured outputs: OpenAI's response_format, vLLM's older guided_* and newer
    # structured_outputs (at most one of them asks for a constraint: ``structured_spec``)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationBody):
    unsupported = _UNSUPPORTED_COMPLETION
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_GenerationBody):
    unsupported = _UNSUPPORTED_CHAT
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # tool calling (router/tool_calls.py checks them: a 400 naming the param)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    unsupported = _UNSUPPORTED_TOKENIZE
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    unsupported = _UNSUPPORTED_TOKENIZE
    model: str | None = None
    tokens: list[int]


def check_fields(req: _Body) -> None:
    """400 for a field of ``req`` (a parsed request body) that tandem would otherwise ignore:
    a documented one it does not support (its model's ``unsupported`` table), or an unknown one
    (see the module docstring); also in its ``stream_options`` and ``messages``."""
    _check_extra(req, "")
    for name in ("stream_options", "response_format", "structured_outputs"):
        nested = getattr(req, name, None)
        if nested is not None:
            _check_extra(nested, f"{name}.")
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.json_schema is not None:
        _check_extra(response_format.json_schema, "response_format.json_schema.")
    for i, m in enumerate(getattr(req, "messages", None) or ()):
        _check_extra(m, f"messages.{i}.")
        for j, call in enumerate(getattr(m, "tool_calls", None) or ()):
            _check_extra(call, f"messages.{i}.tool_calls.{j}.")
            _check_extra(call.function, f"messages.{i}.tool_calls.{j}.function.")


def _check_extra(body: _Body, where: str) -> None:
    unsupported = type(body).unsupported
    for name, value in (body.model_extra or {}).items():
        if name in _ACCEPTED_HINTS and not where:
            continue
        if name in unsupported:
            if value is None or any(_same(value, ok) for ok in unsupported[name]):
                continue
            raise bad_request(
                f"{where}{name} is not supported by this server"
                + (f" (accepted only as {_shown(unsupported[name])})" if unsupported[name] else ""),
                param=f"{where}{name}",
                code="unsupported_parameter",
            )
        raise bad_request(
            f"Unrecognized request argument supplied: {where}{name}",
            param=f"{where}{name}",
            code="unrecognized_argument",
        )


def _same(value: Any, ok: Any) -> bool:
    """JSON equality without Python's ``True == 1`` (``best_of: true`` is not ``1``)."""
    if isinstance(value, bool) or isinstance(ok, bool):
        return type(value) is type(ok) and value == ok
    return value == ok


def _shown(values: tuple[Any, ...]) -> str:
    return " or ".join(["null", *(json.dumps(v) for v in values)])


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body into ``model``; malformed JSON, any bad field and any field tandem
    would not act on (``check_fields``) is a 400."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
    if isinstance(req, _Body):  # (router/admin.py's bodies refuse any extra field themselves)
        check_fields(req)
    return req


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 from pydantic's (or FastAPI's) error list; ``param`` is the top-level field."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return bad_request(f"the body is not valid JSON: {detail}", code="invalid_json")
    loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    if not loc:
        return bad_request(f"the body must be a JSON object: {first.get('msg', '')}")
    param = str(loc[0])
    same = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    details = "; ".join(f"{_loc_str(e['loc'])}: {e['msg']}" for e in same[:3])
    return bad_request(f"invalid value for '{param}': {details}", param=param)


def _loc_str(loc: tuple[Any, ...]) -> str:
    """``messages.0.content`` without pydantic's union member tags (``str``, ``list[int]``)."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts)


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "none") or part[:1].isupper()
    )


# ------------------------------------------------------------------------------------ prompts


def one_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(
                f"prompt: one prompt per request is supported, got {len(prompt)}; send one "
                "request per prompt",
                param="prompt",
            )
        prompt = prompt[0]
    return prompt


def completion_prompt(req: CompletionRequest, tokenizer: Any) -> tuple[str | None, list[int]]:
    """The one prompt of a completion request as (text or None, token ids); a text prompt
    encoded by ``tokenizer``, with its special tokens."""
    prompt = one_prompt(req)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad_request("prompt: this model has no tokenizer; send token ids", param="prompt")
        ids = encode_prompt(tokenizer, prompt) if prompt else []
        text: str | None = prompt
    else:
        ids, text = list(prompt), None
    check_token_ids(ids, tokenizer, "prompt")
    return text, ids


def check_token_ids(ids: list[int], tokenizer: Any, param: str) -> None:
    if not ids:
        raise bad_request(f"{param} is empty: it must contain at least one token", param=param)
    vocab = len(tokenizer) if tokenizer is not None else None
    if min(ids) >= 0 and (vocab is None or max(ids) < vocab):  # the usual case, in C
        return
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise bad_request(f"{param}: token ids must be in {limit}, got {bad[:5]}", param=param)


_MESSAGE_CHARS = 16  # a message's own share of its rendering (its role's header), in characters


def chat_chars(messages: list[ChatMessage]) -> int:
    """The characters of a conversation's text: contents, text parts, past reasoning, and the
    names and arguments of past tool calls, and ``_MESSAGE_CHARS`` a message (what its
    rendering and encoding cost grows with: many empty messages cost too)."""
    total = _MESSAGE_CHARS * len(messages)
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(part.text or "") for part in m.content)
        total += len(m.reasoning_content or "")
        for call in m.tool_calls or ():
            total += len(call.function.name) + len(call.function.arguments)
    return total


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: known roles, content as one string (text parts
    joined with newlines, as vLLM does); an assistant's ``tool_calls`` and a tool result's
    ``tool_call_id`` kept."""
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"messages.{i}.role: {m.role!r} is not supported; use one of {sorted(CHAT_ROLES)}",
                param="messages",
            )
        message: dict[str, Any] = {"role": role, "content": _content_text(m.content, i)}
        if m.tool_calls and role != "assistant":
            raise bad_request(f"messages.{i}: only assistant messages have tool_calls", "messages")
        if m.tool_calls:
            message["tool_calls"] = [_history_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    f"messages.{i}.tool_call_id: a tool message answers a call: give the id of "
                    "the call it answers",
                    param="messages",
                )
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and role == "tool":
            message["name"] = m.name
        if m.reasoning_content is not None and role == "assistant":
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def _history_call(call: ToolCall, i: int, j: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(
            f"messages.{i}.tool_calls.{j}.function.arguments must be a JSON object as text, "
            f"got {call.function.arguments[:80]!r}",
            param="messages",
        )
    out: dict[str, Any] = {"type": "function"}
    if call.id is not None:
        out["id"] = call.id
    out["function"] = {"name": call.function.name, "arguments": call.function.arguments}
    return out


def _content_text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages.{i}.content.{j}: only text parts ({{'type': 'text', 'text': ...}}) "
                f"are supported, got type {part.type!r}",
                param="messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


# Template variables the gateway sets itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        *("messages", "conversation", "tools", "documents", "add_generation_prompt"),
        *("continue_final_message", "tokenize", "chat_template", "return_dict", "padding"),
        *("truncation", "max_length", "return_tensors", "return_assistant_tokens_mask"),
        *("tokenizer_kwargs", "return_attention_mask"),
    }
)


@dataclass(frozen=True)
class ChatRender:
    """How one chat request's prompt is rendered beyond its messages: the model's chat format,
    the request's tools (None: none, or tool_choice none) and extra template variables."""

    fmt: ChatFormat | None = None
    tools: ToolRequest | None = None
    template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """400 for template variables the gateway sets itself."""
        bad = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(self.template_kwargs or {}))
        if bad:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(bad)} (the request's own fields do)",
                param="chat_template_kwargs",
            )

    def messages_and_kwargs(
        self, rendered: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The template's messages and keyword arguments: the tools through the template
        when it renders them, else through tandem's fallback (router/tool_calls.py)."""
        kwargs = dict(self.template_kwargs or {})
        active = self.tools is not None and self.tools.active
        in_template = self.fmt is not None and self.fmt.template_tools
        history = any(m["role"] == "tool" or m.get("tool_calls") for m in rendered)
        if in_template or not (active or history) or self.fmt is None:
            if active and in_template:
                kwargs["tools"] = [t.openai() for t in self.tools.tools]  # type: ignore[union-attr]
            fmt = self.fmt.tools if self.fmt is not None else None
            return tool_template_messages(rendered, fmt), kwargs
        tools = self.tools.tools if active else ()  # type: ignore[union-attr]
        return fallback_messages(rendered, tools, self.fmt.tools), kwargs


def chat_prompt(
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tokenizer: Any,
    render: ChatRender | None = None,
) -> list[int]:
    """Token ids of the rendered conversation (the engine's own template call)."""
    rendered = _chat_messages_for(messages, tokenizer)
    return _render_chat(rendered, add_generation_prompt, tokenizer, render or ChatRender())


def chat_prompt_and_hints(
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tokenizer: Any,
    render: ChatRender | None = None,
) -> tuple[list[int], PredictInput]:
    """Token ids of the rendered conversation, and what the length predictor reads of it: the
    last user turn's text, the number of user turns, the previous answer's tokens and the
    earlier answers' text."""
    rendered = _chat_messages_for(messages, tokenizer)
    users = [m["content"] for m in rendered if m["role"] == "user"]
    answers = [m["content"] for m in rendered if m["role"] == "assistant"]
    last_answer = len(encode_prompt(tokenizer, answers[-1])) if answers and answers[-1] else None
    hints = PredictInput(
        text=users[-1] if users else rendered[-1]["content"],
        turns=max(len(users), 1),
        last_answer_len=last_answer,
        prev_answers=tuple(a for a in answers if a),
    )
    ids = _render_chat(rendered, add_generation_prompt, tokenizer, render or ChatRender())
    return ids, hints


def _chat_messages_for(messages: list[ChatMessage], tokenizer: Any) -> list[dict[str, Any]]:
    if tokenizer is None:
        raise bad_request("messages: this model has no tokenizer or chat template", "messages")
    return chat_messages(messages)


def _render_chat(
    rendered: list[dict[str, Any]], add_generation_prompt: bool, tokenizer: Any, render: ChatRender
) -> list[int]:
    messages, kwargs = render.messages_and_kwargs(rendered)
    try:
        ids = apply_chat_template(
            tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # the template is Jinja over user content: its errors are 400s
        raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
    check_token_ids(ids, tokenizer, "messages")
    return ids


# ----------------------------------------------------------------------------- sampling params


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    return _sampling_params(req, req.max_tokens, req.logprobs, {})


def chat_tools(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tool calling, checked (400 naming ``tools`` or ``tool_choice``)."""
    try:
        return parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def chat_sampling_params(
    req: ChatCompletionRequest, fmt: ChatFormat | None = None, tools: ToolRequest | None = None
) -> SamplingParams:
    """``tools``: the request's (``chat_tools``); ``required`` or a named function constrain
    the answer to calls in ``fmt``'s syntax."""
    tool_spec = None
    if tools is not None and tools.active:
        if fmt is None:
            raise bad_request("tools need the model's tokenizer; this model has none", "tools")
        if tools.constrained:
            other = structured_spec(req)
            if other is not None:
                raise bad_request(
                    f"tool_choice {tools.choice if tools.named is None else repr(tools.named)} "
                    f"and {other[1]} each constrain the answer; give one",
                    param="tool_choice",
                )
            tool_spec = fmt.grammar(tools)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {"logprobs": "top_logprobs"}
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    params = _sampling_params(req, max_tokens, logprobs, names, tool_spec)
    if tools is not None and tools.active and fmt is not None and fmt.keeps_special_tokens:
        params.skip_special_tokens = False  # the call marker is one: the text must keep it
    return params


def _sampling_params(
    req: _GenerationBody,
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
    spec: StructuredSpec | None = None,
) -> SamplingParams:
    """SamplingParams from the body; its ValueError (which starts with the field's name) becomes
    a 400 naming the API parameter (``names`` maps engine names to API names)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    logit_bias = _logit_bias(req.logit_bias)
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}", param="n")
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string", param="cache_salt")
    penalty = req.repetition_penalty
    if penalty is not None and 0 < penalty < MIN_REPETITION_PENALTY:
        raise bad_request(
            f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} (1 disables it), got "
            f"{penalty!r}",
            param="repetition_penalty",
        )
    given = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    if spec is None:
        structured = structured_spec(req)
        spec = structured[0] if structured is not None else None
    try:
        return SamplingParams(
            structured=spec,
            n=req.n,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logit_bias=logit_bias,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        message = str(exc)
        name = param_named(message)
        param = names.get(name, name) if name is not None else None
        if param is not None and param != name:
            message = param + message[len(name) :]
        raise bad_request(message, param=param) from None


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as the JSON object's keys) with int keys; a key that
    is not a token id is a 400 (the values' range is SamplingParams' to check)."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        text = key.strip()
        if not text.isascii() or not text.isdigit():
            raise bad_request(
                f"logit_bias keys must be token ids (non-negative integers), got {key[:40]!r}",
                param="logit_bias",
            )
        bias[int(text)] = value
    return bias


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_spec(req: _GenerationBody) -> tuple[StructuredSpec, str] | None:
    """The body's structured-output constraint and the field that asked for it, or None.
    400 when the field is malformed or two fields ask for one each. The spec is not compiled
    here (the gateway compiles it: a schema that does not compile is a 400 there)."""
    asked: list[tuple[str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        asked.append(("response_format", fmt))
    for name in ("guided_json", "guided_regex", "guided_choice"):
        if getattr(req, name) is not None:
            asked.append((name, getattr(req, name)))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice") if getattr(so, k) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) > 1:
            names = ", ".join(k.rstrip("_") for k in given)
            raise bad_request(
                f"structured_outputs: give one of json, regex, choice, json_object, got {names}",
                param="structured_outputs",
            )
        if given:
            asked.append(("structured_outputs", so))
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(
            f"{asked[0][0]} and {asked[1][0]} each ask for a structured output; give one",
            param=asked[1][0],
        )
    name, value = asked[0]
    try:
        return _spec_of(name, value), name
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from None


def _spec_of(name: str, value: Any) -> StructuredSpec:
    if name == "response_format":
        if value.type not in _RESPONSE_FORMATS:
            raise ValueError(f"type must be one of {list(_RESPONSE_FORMATS)}, got {value.type!r}")
        if value.type == "json_object":
            return StructuredSpec.json_object()
        if value.json_schema is None or value.json_schema.schema_ is None:
            raise ValueError("type json_schema needs json_schema.schema (a JSON schema object)")
        return StructuredSpec.json_schema(
            value.json_schema.schema_, strict=bool(value.json_schema.strict)
        )
    if name == "guided_json":
        return StructuredSpec.json_schema(value)
    if name == "guided_regex":
        return StructuredSpec.regex(value)
    if name == "guided_choice":
        return StructuredSpec.choice(value)
    if value.json_ is not None:
        return StructuredSpec.json_schema(value.json_)
    if value.regex is not None:
        return StructuredSpec.regex(value.regex)
    if value.choice is not None:
        return StructuredSpec.choice(value.choice)
    return StructuredSpec.json_object()


def param_named(message: str) -> str | None:
    """The sampling parameter a "NAME must be ..." error names, if any: SamplingParams' own
    checks, and the engine's that need the model (top_k against the vocabulary)."""
    name = message.split(" ", 1)[0]
    if name in SamplingParams.__dataclass_fields__ and message.startswith(f"{name} must be"):
        return name
    return None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str):
    """vLLM's context-length check and wording (prompt + max_tokens must fit the context)."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len} tokens in the messages. Please reduce the length of "
                "the messages.",
                param=param,
                code="context_length_exceeded",
            )
    elif prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param=param,
            code="context_length_exceeded",
        )


# ---------------------------------------------------------------------------------- responses


# Characters JSON leaves raw that line splitters built on str.splitlines() (httpx's iter_lines,
# many hand-written SSE readers) take for line ends: a token decoding to one of them would cut a
# frame in two there. They are written as \uXXXX escapes instead (still the same JSON string).
_LINE_BREAKS = re.compile("[\x1c\x1d\x1e\x85\u2028\u2029]")


def _escape_line_break(m: re.Match) -> str:
    return f"\\u{ord(m.group()):04x}"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event frame (one line of JSON under any line splitter)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + _LINE_BREAKS.sub(_escape_line_break, text).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely alternatives of one position (``entry`` holds top-N + sampled)."""
    return [(t, _finite(lp)) for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:n]]


def _finite(logprob: float | None) -> float:
    """JSON has no -inf: floor at -9999 as vLLM does (also for a missing or NaN value)."""
    if logprob is None or math.isnan(logprob):
        return -9999.0
    return max(logprob, -9999.0)


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    n_top: int,
    offset: int = 0,
) -> dict[str, Any]:
    """Legacy completions logprobs; ``offset`` is the text offset of the first token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text = texts.get(tid)[0]
        tokens.append(text)
        token_logprobs.append(_finite(entry.get(tid)))
        top.append({texts.get(t)[0]: lp for t, lp in _top(entry, n_top)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], n_top: int
) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text, raw = texts.get(tid)
        alternatives = []
        for t, lp in _top(entry, n_top):
            alt_text, alt_raw = texts.get(t)
            alternatives.append({"token": alt_text, "logprob": lp, "bytes": alt_raw})
        lp = _finite(entry.get(tid))
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


@dataclass(frozen=True)
class Shape:
    """What every body of one response shares."""

    request_id: str
    created: int
    model: str
    logprobs: int | None  # top alternatives per token; None: no logprobs
    texts: TokenTexts
    stream_usage: bool = False  # include_usage: every chunk carries "usage" (null but the last)
    # return_token_ids: the prompt's ids (None: not asked), sent on the first frame of a stream
    prompt_token_ids: list[int] | None = None
    # chat: a new reader of one choice's answer (thinking, content, tool calls); None: the
    # text is the content (router/chat_output.py)
    read: Callable[[], ChoiceReader] | None = None
    reasoning: bool = False  # messages and deltas carry reasoning_content

    @property
    def token_ids(self) -> bool:
        return self.prompt_token_ids is not None


def completion_response(shape: Shape, answer: Answer) -> dict[str, Any]:
    choices = []
    for o in answer.output.outputs:
        lp = None
        if shape.logprobs is not None and o.logprobs is not None:
            lp = completion_logprobs(shape.texts, o.token_ids, o.logprobs, shape.logprobs)
        choice = {
            "index": o.index,
            "text": o.text,
            "logprobs": lp,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        if shape.token_ids:
            choice.update(prompt_token_ids=shape.prompt_token_ids, token_ids=list(o.token_ids))
        choices.append(choice)
    return _body(shape, "text_completion", choices, usage=answer.usage.body())


def chat_response(shape: Shape, answer: Answer) -> dict[str, Any]:
    choices = []
    for o in answer.output.outputs:
        lp = None
        if shape.logprobs is not None and o.logprobs is not None:
            lp = chat_logprobs(shape.texts, o.token_ids, o.logprobs, shape.logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        finish = o.finish_reason
        if shape.read is not None:
            reader = shape.read()
            read = reader.feed(o.text, final=True)
            message["content"] = read.content
            if shape.reasoning:
                message["reasoning_content"] = read.reasoning or None
            if read.tool_calls:
                message["tool_calls"] = message_tool_calls(read.tool_calls)
                if not read.content.strip():
                    message["content"] = None
            finish = reader.finish_reason(finish)
        choice = {
            "index": o.index,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": o.stop_reason,
        }
        if shape.token_ids:
            choice["token_ids"] = list(o.token_ids)
        choices.append(choice)
    extra = {"prompt_token_ids": shape.prompt_token_ids} if shape.token_ids else {}
    return _body(shape, "chat.completion", choices, usage=answer.usage.body(), **extra)


def _body(shape: Shape, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"id": shape.request_id, "object": obj, "created": shape.created, "model": shape.model}
    return {**body, "choices": choices, **extra}


# ---------------------------------------------------------------------------------- streaming


def completion_chunk(shape: Shape, d: ChoiceDelta, first: bool = False) -> dict[str, Any]:
    """One choice's step; ``first``: its first frame (the prompt's ids go on it, when asked)."""
    lp = None
    if shape.logprobs is not None and d.logprobs is not None:
        lp = completion_logprobs(
            shape.texts, d.token_ids, d.logprobs, shape.logprobs, d.text_offset
        )
    choice = {
        "index": d.index,
        "text": d.text,
        "logprobs": lp,
        "finish_reason": d.finish_reason,
        "stop_reason": d.stop_reason,
    }
    if shape.token_ids:
        choice["token_ids"] = list(d.token_ids)
        if first:
            choice["prompt_token_ids"] = shape.prompt_token_ids
    return _chunk(shape, "text_completion", choice)


def chat_role_chunk(shape: Shape, index: int) -> dict[str, Any]:
    """The first frame of each choice: the assistant role and empty content."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    extra = {"prompt_token_ids": shape.prompt_token_ids} if shape.token_ids else {}
    return {**_chunk(shape, "chat.completion.chunk", choice), **extra}


def chat_chunk(
    shape: Shape, d: ChoiceDelta, reader: ChoiceReader | None = None
) -> dict[str, Any] | None:
    """One choice's step; with a ``reader`` (``shape.read``) its text is split into thinking,
    content and tool-call deltas, and a step that adds nothing to send is None (its text held
    back until it is decided)."""
    lp = None
    if shape.logprobs is not None and d.logprobs is not None:
        lp = chat_logprobs(shape.texts, d.token_ids, d.logprobs, shape.logprobs)
    delta: dict[str, Any] = {"content": d.text}
    finish = d.finish_reason
    if reader is not None:
        read = reader.feed(d.text, final=finish is not None)
        delta = {}
        if read.reasoning:
            delta["reasoning_content"] = read.reasoning
        if read.content:
            delta["content"] = read.content
        if read.tool_calls:
            delta["tool_calls"] = read.tool_calls
        finish = reader.finish_reason(finish)
        if not delta and finish is None and lp is None and not shape.token_ids:
            return None
    choice = {
        "index": d.index,
        "delta": delta,
        "logprobs": lp,
        "finish_reason": finish,
        "stop_reason": d.stop_reason,
    }
    if shape.token_ids:
        choice["token_ids"] = list(d.token_ids)
    return _chunk(shape, "chat.completion.chunk", choice)


def _chunk(shape: Shape, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    extra = {"usage": None} if shape.stream_usage else {}
    return _body(shape, obj, [choice], **extra)


def usage_chunk(shape: Shape, obj: str, usage: Usage) -> dict[str, Any]:
    """The last frame with ``stream_options.include_usage``: no choices, the usage."""
    return _body(shape, obj, [], usage=usage.body())
