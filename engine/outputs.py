"""What the engine hands back: one RequestOutput per request per step it progressed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class SampledToken:
    """One sampled token as the sampler hands it out (and a prefill worker to a decode one;
    the sampler fills the logprob fields after making it)."""

    token_id: int
    logprob: float | None  # log-prob of the sampled token; None unless params.logprobs set
    top_logprobs: list[tuple[int, float]] | None  # top-N (token, logprob), best first
    # A request's first token only, when the engine has a length probe: (p50, p90, p99) of the
    # whole output's length in tokens, estimated at the end of its prefill (not capped).
    predicted: tuple[float, float, float] | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request. ``text``, ``token_ids`` and ``logprobs`` are
    cumulative; ``delta_text`` / ``delta_token_ids`` are what this step added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Per generated token: {token_id: logprob} with the sampled token and the top-N alternatives.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # (p50, p90, p99) output tokens from the engine's length probe (EngineConfig.length_probe),
    # from the first output on; None without a probe. Not capped by max_tokens.
    predicted_tokens: tuple[float, float, float] | None = None
    # {layer: float32 [hidden]} at the last prompt token (EngineConfig.prompt_hidden_layers).
    prompt_hidden: dict[int, np.ndarray] | None = None
    # Why the request failed alone in the engine (its grammar failed, or a step it was in
    # faulted because of it); its sequences' finish_reason is then "error" or "abort".
    error: str | None = None
