"""Sampling parameters of one request, validated at construction.

Plain Python (no torch): the gateway builds these from HTTP bodies and the scheduler reads them.
Every invalid value raises ``ValueError`` naming the parameter and the allowed range, so the
gateway can turn it into an OpenAI-style 400 without guessing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
"""What a structured-output spec constrains the answer to: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar in llguidance's Lark syntax (the
gateway writes these itself: tool calls in the model's own format, router/tool_calls.py)."""


@dataclass(frozen=True)
class StructuredSpec:
    """A request's structured-output constraint: ``kind`` (one of ``STRUCTURED_KINDS``) and its
    ``value`` as text, so the spec is hashable (the compiled-grammar cache's key) and travels
    between processes as plain strings:

    * ``json_schema``: the schema as canonical JSON (``json_schema(...)`` writes it);
      ``strict``: no properties beyond the schema's (``additionalProperties`` defaults to false)
    * ``json_object``: ``value`` is empty; any JSON object
    * ``regex``: the pattern (the whole answer matches it)
    * ``choice``: a JSON list of the allowed strings (``choice(...)`` writes it)
    * ``lark``: a grammar in llguidance's Lark syntax (``%json`` rules inside)

    Built by the classmethods; the grammar itself is compiled by ``engine.grammar``.
    """

    kind: str
    value: str = ""
    strict: bool = True

    MAX_VALUE_LEN = 1 << 20  # characters of a schema, pattern or choice list

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured output kind must be one of {list(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}."
            )
        if not isinstance(self.value, str) or len(self.value) > self.MAX_VALUE_LEN:
            raise ValueError(
                f"structured output {self.kind} must be text of at most "
                f"{self.MAX_VALUE_LEN} characters."
            )
        if self.kind in ("regex", "json_schema", "lark") and not self.value:
            raise ValueError(f"structured output {self.kind} must not be empty.")
        if not isinstance(self.strict, bool):
            raise ValueError(
                f"structured output strict must be true or false, got {self.strict!r}."
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, strict: bool = True) -> StructuredSpec:
        """``schema``: a dict, or its JSON text (a ValueError when it is not a JSON object)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"the JSON schema must be a JSON object, got {type(schema).__name__}.")
        return cls("json_schema", _canonical(schema), strict)

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        if not isinstance(pattern, str):
            raise ValueError(f"the regex must be a string, got {type(pattern).__name__}.")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredSpec:
        if isinstance(choices, str) or not choices:
            raise ValueError("the choice list must be a non-empty list of strings.")
        if any(not isinstance(c, str) for c in choices):
            raise ValueError("the choice list must hold strings only.")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def lark(cls, grammar: str) -> StructuredSpec:
        if not isinstance(grammar, str):
            raise ValueError(f"the grammar must be a string, got {type(grammar).__name__}.")
        return cls("lark", grammar)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []

    @property
    def schema(self) -> dict[str, Any] | None:
        return json.loads(self.value) if self.kind == "json_schema" else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _brief(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _canonical(obj: Any) -> str:
    """One text per JSON value (keys sorted, no spaces): equal schemas share a cache entry."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. ``top_k`` of 0 or -1 disables top-k. Penalties follow the
    OpenAI API (presence/frequency, on generated tokens) and HF (repetition, on prompt and
    generated tokens). ``logprobs`` asks for the sampled token's log-probability plus the top-N
    alternatives; ``logprobs=0`` returns only the sampled token's. ``structured`` constrains
    every token to a grammar (``StructuredSpec``); the grammar then decides where the answer
    ends (``min_tokens`` does not apply to it). ``logit_bias`` adds a value in [-100, 100] to
    the logits of the token ids it names before any other processing (the OpenAI API's
    parameter: -100 bans a token in practice, 100 all but forces it); logprobs stay those of the
    model's own distribution, as vLLM reports them by default.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: every token is masked by this grammar (engine/grammar.py).
    structured: StructuredSpec | None = None
    logit_bias: dict[int, float] | None = None
    # Filled by the engine from the tokenizer/generation config; not a user knob.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    MAX_LOGPROBS = 20
    MAX_SEED = 2**63 - 1  # seeds of the n samples are seed .. seed + n - 1, all below 2^63
    MAX_TOP_K = 2**31 - 1  # (the engine also bounds it by the vocabulary)
    MAX_STOP = 32  # stop strings per request, and their length in characters
    MAX_STOP_LEN = 512
    MAX_STOP_TOKEN_IDS = 256
    MAX_LOGIT_BIAS = 1024  # token ids one request may bias (each costs the sampler a write)
    LOGIT_BIAS_LIMIT = 100.0  # the OpenAI API's range, either way

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})  # a copy: the caller's dict may change
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        # values as floats (checked in range first: a huge int does not convert); {}: nothing
        self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.temperature < _GREEDY_EPS:
            # Greedy: sampling knobs are irrelevant; normalise so the sampler can batch.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    _FLOATS = (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )

    def _check_types(self) -> None:
        for name in self._FLOATS:
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}.")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in ("max_tokens", "logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}.")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}."
            )
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_is_int(k) and _is_number(v) for k, v in bias.items())
        ):
            raise ValueError(
                f"logit_bias must be a map of token ids to numbers, got {_brief(bias)}."
            )
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise ValueError(
                f"structured must be a StructuredSpec or None, got {type(self.structured)!r}."
            )

    def _validate(self) -> None:
        """Ranges and contents; ``_check_types`` has already checked every field's type."""

        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if self.n < 1:
            raise bad("n", "an integer >= 1")
        if not 0.0 <= self.temperature <= 2.0 * 1e3:
            raise bad("temperature", "in [0, 2000] (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not 0 <= self.top_k <= self.MAX_TOP_K:
            raise bad("top_k", f"0 or -1 (disabled) or an integer in [1, {self.MAX_TOP_K}]")
        if self.seed is not None and not 0 <= self.seed <= self.MAX_SEED + 1 - self.n:
            raise bad("seed", "an integer in [0, 2^63 - n] or None")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0 * 1e3:
            raise bad("repetition_penalty", "> 0 (1 disables it)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1 or None (up to the context length)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}."
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"an integer in [0, {self.MAX_LOGPROBS}] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if len(self.stop) > self.MAX_STOP or any(len(s) > self.MAX_STOP_LEN for s in self.stop):
            raise bad("stop", f"at most {self.MAX_STOP} strings of {self.MAX_STOP_LEN} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"a list of at most {self.MAX_STOP_TOKEN_IDS} token ids")
        bias, limit = self.logit_bias, self.LOGIT_BIAS_LIMIT
        if len(bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias must be a map of at most {self.MAX_LOGIT_BIAS} token ids, got "
                f"{len(bias)}."
            )
        if any(t < 0 for t in bias):
            raise ValueError(f"logit_bias must be a map of token ids >= 0, got {min(bias)}.")
        outside = [b for b in bias.values() if not -limit <= b <= limit]  # (NaN fails both)
        if outside:
            raise ValueError(
                f"logit_bias must be a map to values in [{-limit:g}, {limit:g}], got "
                f"{_brief(outside[0])}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` parallel samples (n=1, seed offset)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    def with_eos(self, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        return replace(self, _eos_token_ids=tuple(eos_token_ids))
