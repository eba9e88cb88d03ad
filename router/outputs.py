"""A request's output in the router: what each step added, from the engine's delta to the frame.

::

    engine Delta (per sequence, per engine step, never cumulative; engine/messages.py)
      --Assembler (router/dispatch.py): detokenize, stop strings, positions--> ChoiceDelta
      --one Step per batch the request took--> Generation.outputs() (router/backend.py)
      --streamed: the gateway formats each ChoiceDelta as one SSE frame (router/protocol.py)
      --not streamed: an Answer folds the steps into the cumulative view, one response body

Only an ``Answer`` holds text, token ids and logprobs from the start; the streamed path keeps
counts (``Usage``) for its last frame, never copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained in one step (token ids and logprobs align): its new text after
    detokenization and stop strings (a stop string may hold text back until it is decided),
    the tokens it came from, and, once, its finish."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # None: the request asked for none
    finish_reason: str | None = None  # stop | length | abort, in the step that finished it
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions' text offset of its first token (with logprobs)

    def then(self, later: ChoiceDelta) -> ChoiceDelta:
        """This delta followed by ``later`` of the same choice, as one."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or []) + later.logprobs
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            finish_reason=self.finish_reason or later.finish_reason,
            stop_reason=self.stop_reason if self.finish_reason else later.stop_reason,
            text_offset=self.text_offset,
        )


@dataclass(frozen=True)
class Usage:
    """OpenAI usage counts as of a step (completion tokens summed over the choices)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Step:
    """What one request gained since its last step: a ChoiceDelta per choice that changed
    (by index; none at all is a step too, e.g. a first batch with no token yet)."""

    choices: list[ChoiceDelta]
    usage: Usage
    finished: bool = False  # every choice has finished
    # (p50, p90, p99) output tokens from the engine's length probe, from the first step that
    # has it on (None without a probe)
    predicted_tokens: tuple[float, float, float] | None = None


def merge_choices(choices: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One ChoiceDelta per index, in index order, each a choice's deltas in turn."""
    by_index: dict[int, ChoiceDelta] = {}
    for c in choices:
        seen = by_index.get(c.index)
        by_index[c.index] = c if seen is None else seen.then(c)
    return [by_index[i] for i in sorted(by_index)]


class Answer:
    """The cumulative view of a request, folded from its steps: for a non-streamed answer
    (and scripts and tests that read whole outputs). ``output`` is an engine
    ``RequestOutput`` built in place; each choice's ``delta_text`` / ``delta_token_ids`` are
    what the last step added."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        n: int,
        logprobs: bool,
        prompt: str | None = None,
    ) -> None:
        self.output = RequestOutput(
            request_id, prompt, prompt_token_ids, 0, [], False, arrival_time=time.time()
        )
        self.output.outputs = [
            CompletionOutput(i, logprobs=[] if logprobs else None) for i in range(n)
        ]
        self.usage = Usage(len(prompt_token_ids))

    def add(self, step: Step) -> RequestOutput:
        out = self.output
        for o in out.outputs:
            o.delta_text, o.delta_token_ids = "", []
        for c in step.choices:
            o = out.outputs[c.index]
            o.text += c.text
            o.token_ids.extend(c.token_ids)
            o.delta_text, o.delta_token_ids = c.text, list(c.token_ids)
            if o.logprobs is not None and c.logprobs is not None:
                o.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                o.finish_reason, o.stop_reason = c.finish_reason, c.stop_reason
        if out.first_token_time is None and any(o.token_ids for o in out.outputs):
            out.first_token_time = time.time()
        if step.predicted_tokens is not None:
            out.predicted_tokens = step.predicted_tokens
        out.num_cached_tokens = step.usage.cached_tokens
        out.finished = step.finished
        self.usage = step.usage
        return out


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached. Byte-level BPE tokens give their
    exact bytes (a character split over tokens decodes to U+FFFD, its bytes do not)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def length(self, token_ids: list[int]) -> int:
        """Characters of the tokens' texts, one by one (completions' ``text_offset`` steps)."""
        return sum(len(self.get(t)[0]) for t in token_ids)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self._tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in _BYTE_DECODER for c in piece):
                return text, [_BYTE_DECODER[c] for c in piece]
        return text, list(text.encode("utf-8", errors="replace"))


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_DECODER = _bytes_to_unicode()
