"""Reasoning output: the thinking a model writes before its answer, split from the answer into
``reasoning_content`` (vLLM's field name, in ``message`` and in each stream ``delta``).

As with tool calls (router/tool_calls.py), ``scan`` is a pure, prefix-consistent function of
the text so far: the streamed reasoning and content deltas add up to the unstreamed answer's,
however the text is split. Tool calls are read from the content only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from router.tool_calls import held_back


class ReasoningParser(ABC):
    """One model family's way of marking its thinking."""

    name: str = ""

    @abstractmethod
    def scan(self, text: str, final: bool, thinking: bool = False) -> tuple[str, str]:
        """(reasoning, content) of ``text``; ``final``: nothing more will come;
        ``thinking``: the prompt already opened the thinking (the answer starts inside it)."""

    @abstractmethod
    def matches(self, template: str) -> bool:
        """Whether a chat template is of a model that thinks this way."""

    @abstractmethod
    def opens_thinking(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves the answer inside the thinking."""


class ThinkTags(ReasoningParser):
    """``<think>...</think>`` at the start of the answer (Qwen3, QwQ, DeepSeek-R1 style).

    An answer that does not start with ``<think>`` is all content (Qwen3 with
    ``enable_thinking: false``: its template closes an empty thinking block in the prompt); one
    whose thinking never closes (cut by ``max_tokens``) is all reasoning. Newlines around the
    thinking and at the start of the content are dropped, as the templates write them."""

    name = "qwen3"
    start, end = "<think>", "</think>"

    def scan(self, text: str, final: bool, thinking: bool = False) -> tuple[str, str]:
        if thinking:
            body = 0
        else:
            k = len(text) - len(text.lstrip())
            if text.startswith(self.start, k):
                body = k + len(self.start)
            elif not final and self.start.startswith(text[k:]):
                return "", ""  # may still open the thinking
            else:
                return "", text
        close = text.find(self.end, body)
        if close < 0:
            reasoning = text[body:].lstrip("\n")
            if not final:
                reasoning = held_back(reasoning, self.end).rstrip("\n")
            return reasoning, ""
        reasoning = text[body:close].strip("\n")
        return reasoning, text[close + len(self.end) :].lstrip("\n")

    def matches(self, template: str) -> bool:
        return self.end in template

    def opens_thinking(self, prompt_tail: str) -> bool:
        return prompt_tail.rstrip().endswith(self.start)


PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (ThinkTags(),)}
"""Reasoning parsers by name (the ``reasoning_parser`` setting)."""


def parser_of_template(template: str | None) -> ReasoningParser | None:
    """The reasoning parser a chat template's model needs, or None."""
    for parser in PARSERS.values():
        if parser.matches(template or ""):
            return parser
    return None
