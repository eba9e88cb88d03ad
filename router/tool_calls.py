"""Tool calling: the tools a chat request offers, how a model's chat format writes a call, and
how calls are read back out of its answer, whole or delta by delta.

::

    request   tools, tool_choice, parallel_tool_calls --parse_tools--> ToolRequest (ToolError:
              a 400 naming the param)
    prompt    the model's own chat template renders tools= and the history's calls and results;
              a template without tools (SmolLM2's ChatML) gets them from tandem instead:
              ``fallback_messages`` describes the tools in the system prompt in the format's
              syntax and writes past calls and results as text
    decoding  auto: free, then parsed; required / a named function: ``call_grammar`` (the
              format's syntax around each function's parameter schema, llguidance Lark) masks
              every token, so even a tiny model writes a call that parses and validates
    answer    ToolFormat.scan(text, final) -> Scan(content, calls)

``scan`` is a pure function of the text so far and prefix-consistent: as the text grows, the
content and each call's arguments only grow (text that may still turn out to be a marker is
held back until it is decided). ``ToolStream`` sends the difference between two scans, so the
streamed deltas add up to exactly what the unstreamed answer holds, however the text is split.

A call's name is sent once it is complete and one of the request's tools; its arguments as the
model writes them (the raw JSON text of the arguments object). Text in a call's place that
does not parse, or names no tool of the request, stays content.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function name."""

MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be used; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------ the request


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tool calling. ``choice``: ``auto`` (the model decides,
    the answer is parsed), ``required`` (at least one call, by grammar), ``named`` (one call
    of ``named``, by grammar) or ``none`` (no tools in the prompt, nothing parsed)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def parse_tools(
    tools: Sequence[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> ToolRequest | None:
    """The request's tool calling (None: no tools and tool_choice none or absent).

    ``tools`` and ``tool_choice`` are the body's JSON values (already type-checked).

    Raises:
        ToolError: a malformed tool, two tools of one name, a tool_choice that is unknown,
            names a function not in ``tools``, or asks for a call with no tools.
    """
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
    if len(parsed) > MAX_TOOLS:
        raise ToolError(f"tools: at most {MAX_TOOLS} tools, got {len(parsed)}", "tools")
    seen: set[str] = set()
    for i, t in enumerate(parsed):
        if t.name in seen:
            raise ToolError(f"tools.{i}.function.name: {t.name!r} is given twice", "tools")
        seen.add(t.name)
    choice, named = _choice(tool_choice, seen)
    if not parsed:
        if choice != "none" and tool_choice is not None:
            raise ToolError(
                f"tool_choice {_shown(tool_choice)} needs tools: give `tools`, or leave "
                "tool_choice out",
                "tool_choice",
            )
        return None
    return ToolRequest(parsed, choice, named, True if parallel is None else parallel)


def _tool(tool: dict[str, Any], i: int) -> Tool:
    where = f"tools.{i}"
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type must be 'function', got {tool.get('type')!r}", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object with a name", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ToolError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError(
            f"{where}.function.parameters must describe an object (type 'object'), got "
            f"type {kind!r}",
            "tools",
        )
    description = function.get("description")
    return Tool(name, description, parameters, bool(function.get("strict")))


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ToolError(
                f"tool_choice must be one of {list(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}',
                "tool_choice",
            )
        return value, None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(value.get("function"), dict)
        or not isinstance(value["function"].get("name"), str)
    ):
        raise ToolError(
            'tool_choice must name a function as {"type": "function", "function": {"name": '
            f"...}}}}, got {_shown(value)}",
            "tool_choice",
        )
    name = value["function"]["name"]
    if names and name not in names:
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(sorted(names))})",
            "tool_choice",
        )
    return "named", name


def _shown(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)[:200]


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


_ALNUM = string.ascii_letters + string.digits


def _mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _mistral_template_id(call_id: str) -> str:
    """``call_id`` if it is nine letters and digits, else nine derived from its sha256 (the
    same for a call and its result, different for different ids)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(n // 62**k) % 62] for k in range(9))


# ----------------------------------------------------------------------------- JSON scanning


class _Broken(Exception):
    """The text at ``pos`` is not JSON (found while scanning, not at the end of the text)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos


_WS = " \t\r\n"
_SCALAR = re.compile(r"[-+0-9.eEa-z]+")  # a number or true / false / null, checked when whole


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string that opens at ``text[i]`` (a quote); None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value that starts at ``text[i]``; None if the text ends first.
    Raises _Broken where it cannot be JSON (brackets are balanced, not fully validated)."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        raise _Broken(i)
    if m.end() == len(text):
        return None  # a number or a literal may go on
    try:
        json.loads(m.group())
    except json.JSONDecodeError:
        raise _Broken(i) from None
    return m.end()


@dataclass
class ParsedCall:
    """One call as scanned so far. ``arguments``: the text that may be sent (a prefix of the
    final arguments; None: nothing yet); ``complete``: the call's object is closed."""

    name: str | None = None
    arguments: str | None = None
    complete: bool = False

    def final_arguments(self) -> str:
        return self.arguments if self.arguments is not None else "{}"


def _scan_call(text: str, pos: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall, int | None]:
    """The call object ``{"name": ..., "<args key>": {...}}`` starting at ``text[pos]``, and the
    index after it (None: unfinished). Raises _Broken where it is not such an object: the
    caller decides whether what came before is still a call."""
    call = ParsedCall()
    if text[pos] != "{":
        raise _Broken(pos)
    i = pos + 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return call, None
        if text[i] == "}":
            call.complete = True
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise _Broken(i)
        key_end = _string_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i == len(text):
            return call, None
        if text[i] != ":":
            raise _Broken(i)
        i = _skip_ws(text, i + 1)
        if i == len(text):
            return call, None
        end = _value_end(text, i)
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise _Broken(i)
            call.name = name
        elif key in args_keys:
            if text[i] == "{":  # streamable: every prefix of the object is a prefix of it
                call.arguments = text[i:end] if end is not None else text[i:]
            elif end is not None:  # a string holding JSON, or anything else: whole
                value = json.loads(text[i:end])
                call.arguments = value if isinstance(value, str) else json.dumps(value)
        if end is None:
            return call, None
        i = end


def held_back(text: str, marker: str) -> str:
    """``text`` without a tail that could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


# ----------------------------------------------------------------------------- the formats


@dataclass
class Scan:
    """What an answer holds so far: its content and its calls, in order."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolFormat(ABC):
    """One model family's way of writing tool calls.

    ``scan`` reads calls out of an answer (see the module docstring for its contract);
    ``call_grammar`` writes the Lark grammar of "calls of these functions" in this syntax;
    ``describe`` / ``write_call`` put tools and past calls into a prompt whose template has no
    tool support of its own; ``matches`` recognises the format in a chat template.
    """

    name: str = ""
    args_key: str = "arguments"
    markers: tuple[str, ...] = ()  # texts that may be one special token of the vocabulary

    @abstractmethod
    def scan(self, text: str, final: bool, names: frozenset[str]) -> Scan:
        """Content and calls of ``text``; ``final``: nothing more will come (hold nothing)."""

    @abstractmethod
    def calls_rule(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        """The Lark body of ``start``: one call (rule ``call``) or several."""

    def write_call(self, name: str, arguments: str) -> str:
        """A past call as the model would have written it (for prompts by ``fallback``): the
        arguments between ``call_text``'s head and tail."""
        head, tail = self.call_text(name)
        return head + arguments + tail

    @abstractmethod
    def matches(self, template: str) -> bool:
        """Whether a chat template writes calls in this format."""

    def call_text(self, name: str) -> tuple[str, str]:
        """The literal text around one call's arguments object."""
        head = json.dumps(name, ensure_ascii=False)
        return f'{{"name": {head}, "{self.args_key}": ', "}"

    def describe(self, tools: Sequence[Tool]) -> str:
        """The system prompt's part on tools, for a template that has no tool support."""
        lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        example = self.write_call("<function-name>", "<arguments-json-object>")
        return (
            "# Tools\n\nYou may call one or more functions to help with the user's request. "
            f"The functions you can call, one JSON signature per line:\n<tools>\n{lines}\n"
            f"</tools>\n\nTo call a function, answer with:\n{example}"
        )

    def _args_keys(self) -> tuple[str, ...]:
        return ("arguments", "parameters")

    def new_call_id(self) -> str:
        """A new id for a call read out of an answer (clients send it back in tool results)."""
        return new_call_id()

    def template_id(self, call_id: str) -> str:
        """A call id of the history as this format's chat template takes it."""
        return call_id


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, text
    before and between allowed: Hermes, Qwen2.5, Qwen3 (and tandem's fallback)."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end)

    def scan(self, text: str, final: bool, names: frozenset[str]) -> Scan:
        out = Scan()
        parts: list[str] = []
        i = 0
        while True:
            j = text.find(self.start, i)
            part = text[i:] if j < 0 else text[i:j]
            if j < 0 and not final:
                part = held_back(part, self.start)
            if out.calls:  # whitespace around and between calls is not content
                part = part.lstrip()
                if j < 0 and not final:
                    part = part.rstrip()  # (it may be followed by another call)
            parts.append(part)
            if j < 0:
                break
            after = self._block(text, j, final, names, out.calls)
            if after is None:  # undecided or unfinished: nothing after it counts yet
                break
            if after < 0:  # not a call: the block stays content
                close = text.find(self.end, j)
                if close < 0:
                    if final:
                        parts.append(text[j:])
                    break
                after = close + len(self.end)
                parts.append(text[j:after])
            i = after
        out.content = "".join(parts)
        return out

    def _block(
        self, text: str, j: int, final: bool, names: frozenset[str], calls: list[ParsedCall]
    ) -> int | None:
        """Scan the block at ``j``: the index after it, -1 when it is not a call, None when it
        is not finished (a call found so far is appended to ``calls``)."""
        k = _skip_ws(text, j + len(self.start))
        if k == len(text):
            return -1 if final else None
        try:
            call, end = _scan_call(text, k, self._args_keys())
        except _Broken as broken:
            call, end = _partial_before(text, k, broken.pos, self._args_keys())
            if call is None or call.name not in names:
                return -1
            call.complete = True
            calls.append(call)
            close = text.find(self.end, broken.pos)
            return close + len(self.end) if close >= 0 else (len(text) if final else None)
        if call.name is not None and call.name not in names:
            return -1
        if call.name is None and (end is not None or final):
            return -1
        if call.name is not None:
            calls.append(call)
        if end is None:
            return None
        k = _skip_ws(text, end)
        if text.startswith(self.end, k):
            return k + len(self.end)
        if not final and self.end.startswith(text[k:]):
            return None
        return k  # no closing tag: what follows is read on

    def calls_rule(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        return f'{call} ("\\n" {call})*' if parallel else call

    def call_text(self, name: str) -> tuple[str, str]:
        head, tail = super().call_text(name)
        return f"{self.start}\n{head}", f"{tail}\n{self.end}"

    def matches(self, template: str) -> bool:
        return self.start in template


def _partial_before(
    text: str, k: int, stop: int, keys: tuple[str, ...]
) -> tuple[ParsedCall | None, int | None]:
    """The call as scanned from ``k`` up to the broken position ``stop``."""
    if stop <= k:
        return None, None
    try:
        call, _ = _scan_call(text[:stop], k, keys)
    except _Broken:
        return None, None
    return call, stop


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3 JSON calls: the whole answer is ``{"name": ..., "parameters":
    {...}}`` (optionally after ``<|python_tag|>``); several are separated by ``;``."""

    name = "llama3_json"
    args_key = "parameters"
    tag = "<|python_tag|>"
    markers = (tag,)

    def scan(self, text: str, final: bool, names: frozenset[str]) -> Scan:
        k = _skip_ws(text, 0)
        if text.startswith(self.tag, k):
            k = _skip_ws(text, k + len(self.tag))
        elif not final and self.tag.startswith(text[k:]) and k < len(text):
            return Scan()
        if k == len(text):
            return Scan(text if final else "")
        if text[k] != "{":
            return Scan(text)
        calls: list[ParsedCall] = []
        i = k
        while True:
            try:
                call, end = _scan_call(text, i, self._args_keys())
            except _Broken as broken:
                call, end = _partial_before(text, i, broken.pos, self._args_keys())
                if call is None or call.name not in names:
                    return Scan(text) if not calls else Scan("", calls)
                call.complete = True
                calls.append(call)
                return Scan("", calls)
            if call.name is not None and call.name not in names:
                return Scan(text) if not calls else Scan("", calls)
            if call.name is None:
                if end is not None or final:
                    return Scan(text) if not calls else Scan("", calls)
                return Scan("", calls)
            calls.append(call)
            if end is None:
                return Scan("", calls)
            i = _skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
            if i == len(text) or text[i] != "{":
                return Scan("", calls)

    def calls_rule(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        return f'{call} ("; " {call})*' if parallel else call

    def matches(self, template: str) -> bool:
        return self.tag in template or (
            "<|start_header_id|>" in template and '"parameters"' in template
        )


class _MistralIds:
    """Call ids as Mistral's templates take them (both Mistral formats)."""

    def new_call_id(self) -> str:
        return _mistral_call_id()

    def template_id(self, call_id: str) -> str:
        return _mistral_template_id(call_id)


class MistralFormat(_MistralIds, ToolFormat):
    """Mistral: ``[TOOL_CALLS]`` (a control token) then a JSON list of ``{"name": ...,
    "arguments": {...}}`` objects; text before it is content."""

    name = "mistral"
    mark = "[TOOL_CALLS]"
    markers = (mark,)

    def scan(self, text: str, final: bool, names: frozenset[str]) -> Scan:
        j = text.find(self.mark)
        if j < 0:
            return Scan(text if final else held_back(text, self.mark))
        content = text[:j]
        i = _skip_ws(text, j + len(self.mark))
        if i == len(text):
            return Scan(content if not final else text)
        if text[i] != "[":
            return Scan(text)
        calls: list[ParsedCall] = []
        i += 1
        while True:
            i = _skip_ws(text, i)
            if i == len(text) or text[i] == "]":
                return Scan(content, calls)
            if text[i] == ",":
                i += 1
                continue
            try:
                call, end = _scan_call(text, i, self._args_keys())
            except _Broken as broken:
                call, end = _partial_before(text, i, broken.pos, self._args_keys())
                if call is None or call.name not in names:
                    return Scan(text) if not calls else Scan(content, calls)
                call.complete = True
                calls.append(call)
                return Scan(content, calls)
            if call.name is not None and call.name not in names:
                return Scan(text) if not calls else Scan(content, calls)
            if call.name is None:
                if end is not None or final:
                    return Scan(text) if not calls else Scan(content, calls)
                return Scan(content, calls)
            calls.append(call)
            if end is None:
                return Scan(content, calls)
            i = end

    def calls_rule(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        calls = f'{call} (", " {call})*' if parallel else call
        return f'{marker(self.mark)} " "? "[" {calls} "]"'

    def write_call(self, name: str, arguments: str) -> str:
        head, tail = self.call_text(name)
        return f"{self.mark} [{head}{arguments}{tail}]"

    def matches(self, template: str) -> bool:
        return self.mark in template


class MistralArgsFormat(_MistralIds, ToolFormat):
    """Mistral's newer syntax (tokenizer v11 and later: Mistral Small 3.x, Devstral,
    Magistral): each call is ``[TOOL_CALLS]name[ARGS]{...}``, one after another; v11 may put
    ``[CALL_ID]id`` between the name and ``[ARGS]`` (read and dropped). Text before the first
    call is content; after the last, nothing is."""

    name = "mistral_v11"
    mark, args, call_id = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (mark, args)

    def scan(self, text: str, final: bool, names: frozenset[str]) -> Scan:
        j = text.find(self.mark)
        if j < 0:
            return Scan(text if final else held_back(text, self.mark))
        content, calls = text[:j], []

        def not_a_call() -> Scan:
            return Scan(content, calls) if calls else Scan(text)

        i = j
        while True:  # text[i:] starts with the mark
            k = i + len(self.mark)
            a = text.find(self.args, k)
            name, has_id, _ = (text[k:] if a < 0 else text[k:a]).partition(self.call_id)
            name = name.strip()
            if a < 0:
                if final:  # cut before its arguments: the call, if it is one
                    if name in names:
                        calls.append(ParsedCall(name, None, True))
                        return Scan(content, calls)
                    return not_a_call()
                if has_id:
                    return Scan(content, calls) if name in names else not_a_call()
                begun = held_back(held_back(name, self.args), self.call_id)
                if any(n.startswith(begun) for n in names):
                    return Scan(content, calls)  # the name is still being written
                return not_a_call()
            if name not in names:
                return not_a_call()
            call = ParsedCall(name)
            calls.append(call)
            v = _skip_ws(text, a + len(self.args))
            if v == len(text):
                return Scan(content, calls)
            if text[v] != "{":  # not an object: the call, with no arguments
                call.complete = True
                return Scan(content, calls)
            end = _value_end(text, v)
            call.arguments = text[v:] if end is None else text[v:end]
            if end is None:
                return Scan(content, calls)
            call.complete = True
            i = _skip_ws(text, end)
            if not text.startswith(self.mark, i):
                return Scan(content, calls)

    def calls_rule(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        return f"{call}+" if parallel else call

    def call_text(self, name: str) -> tuple[str, str]:
        return f"{self.mark}{name}{self.args}", ""

    def matches(self, template: str) -> bool:
        return self.args in template


FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), MistralArgsFormat())
}
"""Tool-call formats by name (the ``tool_call_parser`` setting)."""

FALLBACK = "hermes"
"""The format of a model whose chat template has no tool support (SmolLM2's ChatML)."""


def format_of_template(template: str | None) -> tuple[ToolFormat, bool]:
    """The format a chat template writes calls in, and whether it renders tools itself
    (otherwise ``fallback_messages`` does, in the fallback format)."""
    template = template or ""
    order = ("mistral_v11", "mistral", "hermes", "llama3_json")  # (v11 templates hold both marks)
    for fmt in (FORMATS[name] for name in order):
        if fmt.matches(template):
            return fmt, "tools" in template
    return FORMATS[FALLBACK], False


# ------------------------------------------------------------------------------ the grammar


def call_grammar(fmt: ToolFormat, req: ToolRequest, marker: Callable[[str], str]) -> str:
    """The Lark grammar (llguidance) of the calls ``req`` allows, in ``fmt``'s syntax: one call
    of the named function, or one or more (one when ``parallel`` is off) of any of the tools.
    Each call's arguments follow its function's parameter schema, separators as the chat
    templates write JSON (``", "`` and ``": "``). ``marker(text)``: a marker as Lark (a special
    token's id, or the quoted text)."""
    tools = [t for t in req.tools if req.choice != "named" or t.name == req.named]
    one = req.choice == "named" or not req.parallel
    rules = []
    for i, tool in enumerate(tools):
        head, tail = fmt.call_text(tool.name)
        head, tail = _lark_seq(head, fmt.markers, marker), _lark_seq(tail, fmt.markers, marker)
        rules.append(f"call_{i}: {head} args_{i} {tail}")
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        schema = {**tool.parameters, "x-guidance": {**options, "lenient": not tool.strict}}
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    rules.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    return f"start: {fmt.calls_rule('call', not one, marker)}\n" + "\n".join(rules) + "\n"


def _lark_seq(text: str, markers: Sequence[str], marker: Callable[[str], str]) -> str:
    """``text`` as a Lark sequence, each of ``markers`` in it written by ``marker`` (a token)."""
    if not markers:
        return json.dumps(text, ensure_ascii=False)
    pieces = re.split("(" + "|".join(re.escape(m) for m in markers) + ")", text)
    return " ".join(
        marker(p) if p in markers else json.dumps(p, ensure_ascii=False) for p in pieces if p
    )


# ------------------------------------------------------------------------------- the prompt


def template_messages(
    messages: list[dict[str, Any]], fmt: ToolFormat | None = None
) -> list[dict[str, Any]]:
    """Messages as chat templates take them: a call's arguments as an object (Llama's and
    Mistral's templates write them with ``tojson``; Qwen's take either), and call ids as
    ``fmt``'s template accepts them (``ToolFormat.template_id``: Mistral's raise on any id
    but nine letters and digits, and clients send back ids of other servers)."""
    ident = fmt.template_id if fmt is not None else (lambda i: i)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _as_object(c)}}
                for c in m["tool_calls"]
            ]
            calls = [{**c, "id": ident(c["id"])} if c.get("id") else c for c in calls]
            m = {**m, "tool_calls": calls}
        if m.get("role") == "tool" and m.get("tool_call_id"):
            m = {**m, "tool_call_id": ident(m["tool_call_id"])}
        out.append(m)
    return out


def _as_object(call: dict[str, Any]) -> Any:
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def fallback_messages(
    messages: list[dict[str, Any]], tools: Sequence[Tool], fmt: ToolFormat
) -> list[dict[str, Any]]:
    """The conversation in plain system / user / assistant turns for a template that knows no
    tools: the tools described in the system prompt (``fmt.describe``), each past call written
    in ``fmt``'s syntax after its turn's text, tool results as a user turn of
    ``<tool_response>`` blocks (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    if tools:
        described = fmt.describe(tools)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"]
            out.append({"role": "system", "content": f"{system}\n\n{described}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": described})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                fmt.write_call(c["function"]["name"], _as_text(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
            continue
        out.append({"role": m["role"], "content": m.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def _as_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


# ------------------------------------------------------------------------------ streaming


class ToolStream:
    """One choice's answer read as it streams: ``feed`` each new piece of text, get the
    content to send and the tool-call deltas (OpenAI's ``delta.tool_calls`` items).

    Each call's first delta carries its ``id``, ``type`` and name; its arguments follow as
    they are written. ``final``: the answer is complete (held-back text is released)."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        scan = self.fmt.scan(self.text, final, self.names)
        content = scan.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(scan.content))
        deltas = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            arguments = call.arguments
            if arguments is None and (call.complete or final):
                arguments = "{}"
            delta: dict[str, Any] = {"index": index}
            function: dict[str, Any] = {}
            if index == len(self._ids):
                self._ids.append(self.fmt.new_call_id())
                self._args_sent.append(0)
                delta.update(id=self._ids[index], type="function")
                function["name"] = call.name
            new = (arguments or "")[self._args_sent[index] :]
            if new or "name" in function:
                function["arguments"] = new
                self._args_sent[index] += len(new)
                deltas.append({**delta, "function": function})
        return content, deltas
