"""Model registry: HF architecture name -> module class. Everything in the Llama family shares
one decoder (engine/models/llama.py) whose differences are config flags."""

from __future__ import annotations

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig


def model_class(cfg: ModelConfig):
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
        )
    from engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
