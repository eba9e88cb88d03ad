"""tandem's single-replica engine: paged KV, prefix cache, continuous batching, sampling."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredSpec

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredSpec",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name: str):
    # Lazy: `from engine import SamplingParams` must not import torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
