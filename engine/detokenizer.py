"""Incremental detokenization and stop-string detection for one generated sequence.

The text of a growing token sequence is built by decoding only a small window of recent token
ids each step (the prefix/read-offset scheme of vLLM): ``ids[prefix:read]`` decodes to text
that was already emitted, ``ids[prefix:]`` to that text plus the new part. Decoding the window
rather than single tokens keeps tokenizer-specific context right (SentencePiece's leading space,
byte-level tokens that only form a character together), and the window is seeded with the last
few prompt tokens so the first generated token decodes as it would after the prompt.

Text is only committed once the decoded tail no longer ends in U+FFFD, so a character whose
UTF-8 bytes are spread over several tokens is never emitted half-done. Stop strings are searched
only where a new match can be, and streamed text holds back ``max(len(stop)) - 1`` characters so
a stop string spanning the next token is never shown to the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""How many trailing prompt tokens seed the decode window."""

_TRIM_THRESHOLD = 64
"""Drop already-consumed window ids once this many have accumulated."""

_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns the token ids of one sequence into text, step by step, watching for stop strings.

    Call :meth:`update` with each step's new token ids, then :meth:`get_next_output_text` to
    get what may be shown now. ``spaces_between_special_tokens`` is forwarded to tokenizers that
    still honour it (slow Python tokenizers of older ``transformers``); fast tokenizers ignore it,
    as they do in ``tokenizer.decode``. Tokenization-space clean-up is never applied (it is not
    local to a window; LLM tokenizers ship with it off).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = make_decode_fn(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        stops = [stop] if isinstance(stop, str) else (stop or ())
        self.stop: tuple[str, ...] = tuple(s for s in stops if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # Decode window: ids[prefix:read] is already reflected in the text, ids[read:] is not.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._emitted = 0  # chars of _text already returned by delta calls
        self._matched_stop: str | None = None
        self.num_output_tokens = 0

    @property
    def output_text(self) -> str:
        """The text decoded so far (truncated at a matched stop string)."""
        return self._text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended this sequence, if any."""
        return self._matched_stop

    def update(self, new_token_ids: Sequence[int], *, check_stop: bool = True) -> str | None:
        """Append ``new_token_ids``; return the stop string matched now, else ``None``.

        After a stop string matched the sequence is over and further calls are ignored.
        """
        if self._matched_stop is not None or not new_token_ids:
            return None
        self.num_output_tokens += len(new_token_ids)
        self._ids.extend(new_token_ids)
        prev_len = len(self._text)
        self._text += self._read_new_text()
        if check_stop and self.stop and len(self._text) > prev_len:
            return self._check_stop(prev_len)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: everything (``delta=False``) or what is new since the last delta.

        While not finished, the last ``max stop length - 1`` characters are held back; once
        finished, everything (including a trailing incomplete character) is released.
        """
        if finished:
            self._flush()
        end = len(self._text) if finished else max(len(self._text) - self._hold, 0)
        if not delta:
            return self._text[:end]
        start = self._emitted
        if end <= start:
            return ""
        self._emitted = end
        return self._text[start:end]

    def _read_new_text(self) -> str:
        """Decode the window; commit and return new text unless it ends mid-character."""
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        prefix_text = self._decode(ids[prefix:read])
        full_text = self._decode(ids[prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # incomplete UTF-8 sequence (or nothing visible yet): wait for more
        self._prefix_offset, self._read_offset = read, len(ids)
        self._trim()
        return full_text[len(prefix_text) :]

    def _flush(self) -> None:
        """Commit whatever is still pending (an incomplete character decodes to U+FFFD)."""
        if self._matched_stop is not None or self._read_offset >= len(self._ids):
            return
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        prefix_text = self._decode(ids[prefix:read])
        full_text = self._decode(ids[prefix:])
        self._text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(ids)

    def _trim(self) -> None:
        """Forget window ids that can no longer be part of a decode."""
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _check_stop(self, prev_len: int) -> str | None:
        """Find the earliest stop string that ends in text added after ``prev_len``; truncate."""
        match = find_stop(self._text, self.stop, prev_len)
        if match is None:
            return None
        index, stop_str = match
        keep = index + len(stop_str) if self.include_stop_str_in_output else index
        self._text = self._text[:keep]
        self._matched_stop = stop_str
        return stop_str


class SequenceText:
    """The text of one generated sequence as its tokens arrive, by the sampling parameters:
    incremental detokenization, stop strings (checked from ``min_tokens`` on), and the rule that
    a stop *token* (eos, ``stop_token_ids``) ends the sequence without being part of its text
    unless ``include_stop_str_in_output``. One implementation for the engine (offline) and the
    router (workers that stream token ids only)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self.params = params
        self.num_tokens = 0
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def add(
        self, token_id: int, *, stop_token: bool = False, stop_reason: int | str | None = None
    ) -> str | None:
        """Add one generated token; ``stop_token``: it ended the sequence at the token level
        (``stop_reason`` is the stop id, None for eos). Returns the stop string the text now
        ends with (the sequence ends at this token), else None."""
        self.num_tokens += 1
        if stop_token and not (self.params.include_stop_str_in_output and stop_reason is not None):
            return None  # eos / stop token: ends the text, is not part of it (as in vLLM)
        check = self.num_tokens >= self.params.min_tokens
        return self.detokenizer.update([token_id], check_stop=check)

    def next_text(self, finished: bool) -> str:
        """The text that may be shown now and was not before."""
        return self.detokenizer.get_next_output_text(finished, delta=True)


def find_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """Earliest ``(index, stop)`` among matches that end after ``text[:new_from]``.

    Each stop string is searched from ``new_from - len(stop) + 1``: the region that can contain a
    match not seen before. Ties on the start index go to the shorter stop string (it completed
    first).
    """
    best: tuple[int, int, str] | None = None
    for stop_str in stops:
        index = text.find(stop_str, max(new_from - len(stop_str) + 1, 0))
        if index >= 0 and (best is None or (index, len(stop_str)) < best[:2]):
            best = (index, len(stop_str), stop_str)
    return None if best is None else (best[0], best[2])


def make_decode_fn(
    tokenizer: PreTrainedTokenizerBase,
    *,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool = True,
) -> DecodeFn:
    """A ``ids -> str`` function equal to ``tokenizer.decode`` without space clean-up.

    Fast tokenizers whose ``_decode`` is the stock one are decoded by the Rust backend directly,
    skipping ``transformers``' per-call Python overhead.
    """
    backend = _stock_fast_backend(tokenizer)
    if backend is not None:

        def decode_fast(ids: Sequence[int]) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode_slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    return decode_slow


def _stock_fast_backend(tokenizer: PreTrainedTokenizerBase) -> object | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` if its decode is not customised."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return None
    stock = getattr(PreTrainedTokenizerFast, "_decode", None)
    return backend if getattr(type(tokenizer), "_decode", None) is stock else None
