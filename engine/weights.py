"""Weights from a local Hugging Face folder (single or sharded safetensors) or random ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(
            f"{model_dir}: no loadable *.safetensors weights"
            + (f" (missing shards: {[m.name for m in missing]})" if missing else "")
            + "; pass load_format='dummy' for random weights at this config"
        )
    return files


class TensorSlice(NamedTuple):
    """``length`` entries of dimension ``dim`` from ``start``: a tensor-parallel rank's part
    of a checkpoint tensor."""

    dim: int
    start: int
    length: int


def iterate_weights(
    model_dir: str | Path, slice_of: Callable[[str], TensorSlice | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor by name; with ``slice_of`` (a tensor-parallel rank's), only the
    part it names of each tensor is read from the file (None: the whole tensor)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = slice_of(name) if slice_of is not None else None
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                index = [slice(None)] * part.dim + [slice(part.start, part.start + part.length)]
                yield name, f.get_slice(name)[tuple(index)]


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights at the real shapes: speed does not depend on the values. On a GPU they
    are drawn there, in place (an 8B model's fp32 draws on the host took about a minute); the
    same seed on the same kind of device gives the same weights in every process."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        dev = param.device
        gen = gens.get(dev) or gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed))
        if dev.type == "cpu":
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.data.copy_(values)
        else:
            param.data.normal_(0.0, std, generator=gen)
