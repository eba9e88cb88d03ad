"""A model's chat format, once per gateway: how its template takes tools, how it writes tool
calls and thinking; and, per choice of a request, its answer read back in those terms.

::

    ChatFormat.of(tokenizer, tool_call_parser, reasoning_parser)     at the gateway's start
        .grammar(ToolRequest)   -> StructuredSpec (lark): the calls tool_choice asks for
        .reader(tools, thinking) -> ChoiceReader, one per choice
    ChoiceReader.feed(text, final) -> ChatDelta(reasoning, content, tool_calls)
        streamed: each step's text in, the delta's fields out;
        not streamed: the whole text once, ``final``

The text is split twice: thinking from the rest (router/reasoning.py), then tool calls from the
content (router/tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import StructuredSpec
from router.reasoning import PARSERS, ReasoningParser, parser_of_template
from router.tool_calls import (
    FORMATS,
    ToolFormat,
    ToolRequest,
    ToolStream,
    call_grammar,
    format_of_template,
)

TOOL_CALL_PARSERS = ("auto", *FORMATS)
"""Values of the ``tool_call_parser`` setting: ``auto`` reads the format off the template."""
REASONING_PARSERS = ("auto", "none", *PARSERS)
"""Values of the ``reasoning_parser`` setting: ``auto`` reads it off the template."""


@dataclass(frozen=True)
class ChatFormat:
    """``tools``: the tool-call format; ``template_tools``: the chat template renders tools
    itself (else tandem describes them in the system prompt); ``reasoning``: the reasoning
    parser, if any; ``tokens``: the format's markers that are one added token of the
    vocabulary (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``): grammars write them as
    that token, since llguidance reads every added token as a special one, never as text;
    ``special``: those of them the tokenizer calls special (kept in the answer's text, so they
    can be read)."""

    tools: ToolFormat
    template_tools: bool
    reasoning: ReasoningParser | None
    tokens: dict[str, int] = field(default_factory=dict)
    special: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, tokenizer: Any, tool_call_parser: str = "auto", reasoning_parser: str = "auto"
    ) -> ChatFormat:
        """The chat format of ``tokenizer``'s template, or the one the settings name."""
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, got "
                f"{tool_call_parser!r}"
            )
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got "
                f"{reasoning_parser!r}"
            )
        template = template_text(tokenizer)
        fmt, renders = format_of_template(template)
        if tool_call_parser != "auto":
            fmt = FORMATS[tool_call_parser]
            renders = renders and fmt.matches(template)
        if reasoning_parser == "auto":
            reasoning = parser_of_template(template)
        else:
            reasoning = PARSERS.get(reasoning_parser)
        tokens, special = _marker_tokens(tokenizer, fmt.markers)
        return cls(fmt, renders, reasoning, tokens, special)

    def grammar(self, req: ToolRequest) -> StructuredSpec:
        """The grammar of the calls ``req`` asks for (``required`` or a named function)."""
        return StructuredSpec.lark(call_grammar(self.tools, req, self._marker))

    def _marker(self, text: str) -> str:
        token = self.tokens.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether answers with tools must keep special tokens in their text (a marker is
        one: Mistral's ``[TOOL_CALLS]``)."""
        return bool(self.special)

    def thinking(self, tokenizer: Any, prompt_ids: list[int]) -> bool:
        """Whether the rendered prompt leaves the answer inside the model's thinking."""
        if self.reasoning is None or tokenizer is None or not prompt_ids:
            return False
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return self.reasoning.opens_thinking(tail)

    def reader(self, tools: ToolRequest | None, thinking: bool = False) -> ChoiceReader:
        return ChoiceReader(self, tools if tools is not None and tools.active else None, thinking)

    def reads_anything(self, tools: ToolRequest | None) -> bool:
        """Whether an answer needs reading at all (else its text is its content)."""
        return self.reasoning is not None or (tools is not None and tools.active)


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one text (a tokenizer may hold several by name)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return str(template)


def _marker_tokens(
    tokenizer: Any, markers: tuple[str, ...]
) -> tuple[dict[str, int], frozenset[str]]:
    """The markers that are one added token (by id), and those of them that are special."""
    if tokenizer is None:
        return {}, frozenset()
    added = {t.content: (i, t.special) for i, t in (tokenizer.added_tokens_decoder or {}).items()}
    named = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    tokens = {m: int(added[m][0]) for m in markers if m in added}
    special = frozenset(m for m in tokens if added[m][1] or m in named)
    return tokens, special


@dataclass
class ChatDelta:
    """What one step adds to a choice: thinking, content, and tool-call deltas (OpenAI's
    ``delta.tool_calls`` items)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChoiceReader:
    """One choice's answer, read as it comes (see the module docstring)."""

    def __init__(self, fmt: ChatFormat, tools: ToolRequest | None, thinking: bool) -> None:
        self._reasoning = fmt.reasoning
        self._thinking = thinking
        self._calls = ToolStream(fmt.tools, tools.names) if tools is not None else None
        self._text = ""
        self._reasoning_sent = 0
        self._content_read = 0

    @property
    def called(self) -> bool:
        """Whether a tool call has been read (its finish reason is then ``tool_calls``)."""
        return self._calls is not None and self._calls.called

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        self._text += text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.scan(self._text, final, self._thinking)
        else:
            reasoning, content = "", self._text
        out = ChatDelta(reasoning[self._reasoning_sent :])
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        new = content[self._content_read :]
        self._content_read = max(self._content_read, len(content))
        if self._calls is None:
            out.content = new
        else:
            out.content, out.tool_calls = self._calls.feed(new, final)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason


def message_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas (all of one answer) folded into ``message.tool_calls``."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(
            d["index"],
            {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
        )
        if "id" in d:
            call["id"] = d["id"]
        function = d.get("function", {})
        if "name" in function:
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]
