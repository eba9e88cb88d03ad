"""The fp8 KV cache's number format, in plain torch (no Triton: the torch attention backend uses
it too): e4m3 (``torch.float8_e4m3fn``, largest finite value 448) with one scale per tensor::

    stored = fp8(clamp(value / scale, -448, 448))      (round to nearest, ties to even)
    value ~= stored * scale

The scales come from the checkpoint (``k_scale`` / ``v_scale`` per attention layer) or are 1.0.

``QuantizedRows`` is the other FP8 value that travels between modules: activations quantized per
row for an FP8 weight's product (engine/quant.py), here so that the engine can name it without
importing Triton.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as the fp8 cache stores it: ``x / scale`` in fp32, clamped to +-448, rounded to
    nearest even (``dequantize_fp8`` reads it back)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` computed in fp32, returned in ``dtype``. ``x``: fp8, or its bytes (uint8:
    gathers on fp8 tensors lack kernels in some torch builds, so callers gather bytes)."""
    if x.dtype == torch.uint8:
        x = x.view(FP8)
    return (x.float() * scale).to(dtype)


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    """The fp8 cache's dequantization scales: positive finite numbers (a host check)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        ok = isinstance(scale, int | float) and not isinstance(scale, bool)
        if not (ok and scale > 0 and math.isfinite(scale)):
            raise ValueError(f"{name} must be a positive finite number, got {scale!r}")


class QuantizedRows(NamedTuple):
    """Activations quantized per row for an FP8 projection by the kernel that computed them
    (kernels/fp8_quant.py ``rms_norm_quant``): ``q [R, K]`` e4m3 and ``scale [R, 1]`` float32 as
    ``quantize_per_token`` gives them, of which the first ``rows`` are the activations and the
    rest padding (rows of zeros) for the product's kernel. engine/quant.py ``Fp8Linear`` takes
    them in place of ``[rows, K]`` activations."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        """The activations' shape, ``(rows, K)``, as the tensor they stand for has it."""
        return self.rows, self.q.shape[1]
