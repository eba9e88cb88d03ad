"""The decoder's elementwise layers in three implementations with one interface.

``TorchOps`` is plain PyTorch: the numerical reference. ``CpuOps`` runs the native CPU kernels
(kernels/cpu/fused_ops.cpp, fp32 rows; the rest falls back to TorchOps). ``TritonOps`` calls the
fused kernels of kernels/ (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests). The fused
ones fold the residual add into RMSNorm, apply the rotary embedding in place from the position
ids, and fuse SiLU-and-multiply. All follow one residual convention (vLLM's): a layer takes ``(x, residual)``
and hands on ``(x, residual)``; ``add_rms_norm`` returns ``(norm(x + residual), x + residual)``
with the sum rounded to the model dtype, as ``x + residual`` in the plain model rounds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, round to the input dtype, scale by the weight (HF Llama's order)."""
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def apply_rotary(q, k, cos, sin):  # q [T, H, D]; k [T, KVH, D]; cos, sin [T, 1, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    name = "torch"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, into=None
    ) -> torch.Tensor:
        """``into``: the layer the result feeds (TritonOps may quantize for it; ignored here)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x, residual, weight, eps, into=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    def rope_state(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        """What every layer's rotary needs this step: cos, sin ``[T, 1, D]``, looked up once."""
        cos, sin = rotary.cos[positions].to(dtype), rotary.sin[positions].to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def apply_rotary(self, q, k, state) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, *state)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gate_up_act(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP's first half: ``silu_and_mul(gate_up(x))``."""
        return self.silu_and_mul(gate_up(x))

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP on this rank: ``down(silu_and_mul(gate_up(x)))``."""
        return down(self.gate_up_act(gate_up, x))


class TritonOps:
    """The fused kernels; one launch per op, no host work, so a decode step can be graphed."""

    name = "triton"

    def __init__(self) -> None:
        from kernels import activation, rmsnorm, rotary

        self._rmsnorm, self._rotary, self._activation = rmsnorm, rotary, activation

    def rms_norm(self, x, weight, eps, into=None):
        rows = self._quantized_rows(x, into)
        if rows is not None:
            from kernels.fp8_quant import rms_norm_quant

            return rms_norm_quant(x, None, weight, eps, rows=rows)
        return self._rmsnorm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps, into=None):
        """As TorchOps', and where ``into`` (the layer the norm feeds) takes its input quantized
        (an FP8 projection whose product would quantize it in a kernel of its own) the norm is
        returned quantized for it (``QuantizedRows``: one kernel, the same bytes)."""
        rows = self._quantized_rows(x, into)
        if rows is not None:
            from kernels.fp8_quant import rms_norm_quant

            return rms_norm_quant(x, residual, weight, eps, rows=rows), residual
        return self._rmsnorm.fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def _quantized_rows(x, into) -> int | None:
        """The rows ``into`` wants its input quantized to (engine/quant.py
        ``Fp8Linear.quantized_input_rows``), or None: not quantized here."""
        wants = getattr(into, "quantized_input_rows", None)
        if wants is None or x.dim() != 2 or x.stride(-1) != 1:
            return None
        return wants(x)

    def rope_state(self, rotary, positions, dtype):
        return positions, rotary.cos, rotary.sin

    def apply_rotary(self, q, k, state):
        self._rotary.apply_rotary(q, k, *state)  # in place
        return q, k

    def silu_and_mul(self, x):
        return self._activation.silu_and_mul(x)

    def gate_up_act(self, gate_up, x):
        """One kernel where the projection has a fused form for these rows (the batch-1 GEMVs'
        ``silu_mul``: the same arithmetic), else the projection and ``silu_and_mul``."""
        fused = getattr(gate_up, "silu_mul", None)
        y = fused(x) if fused is not None else None
        return y if y is not None else self.silu_and_mul(gate_up(x))

    def gated_mlp(self, gate_up, down, x):
        """As TorchOps', but where ``down`` takes its input quantized for these rows (an FP8
        projection past its GEMV's rows) the activation is quantized in the kernel that computes
        it (kernels/fp8_quant.py ``silu_mul_quant``: the same bytes as the two kernels)."""
        takes = getattr(down, "takes_quantized", None)
        if takes is not None and len(x.shape) == 2 and takes(x.shape[0]):
            from kernels.fp8_quant import silu_mul_quant

            h = gate_up(x)
            rows = x.shape[0]
            quantized = silu_mul_quant(h, rows=down.scaled_mm_rows(rows))
            if quantized is not None:
                return down.forward_quantized(*quantized, rows=rows)
            return down(self.silu_and_mul(h))
        return down(self.gate_up_act(gate_up, x))


class CpuOps(TorchOps):
    """The native CPU kernels (kernels/cpu/fused_ops.cpp) for fp32 rows: one pass per layer
    where TorchOps runs four to six ops and their temporaries. ``add_rms_norm`` updates the
    residual in place (as TritonOps does); the rotary rotates q and k in place, bit for bit
    TorchOps' result. Anything else (3-D per-head norms of Qwen3, other dtypes) goes to
    TorchOps."""

    name = "cpu"

    def __init__(self, kernel) -> None:
        self._k = kernel

    @staticmethod
    def _rows(*xs: torch.Tensor) -> bool:
        return all(x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 for x in xs)

    def rms_norm(self, x, weight, eps, into=None):
        if self._rows(x):
            return self._k.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps, into=None):
        if self._rows(x, residual):
            return self._k.add_rms_norm(x, residual, weight, eps), residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rope_state(self, rotary, positions, dtype):
        if dtype != torch.float32:
            return super().rope_state(rotary, positions, dtype)
        return positions, rotary.cos, rotary.sin

    def apply_rotary(self, q, k, state):
        if len(state) == 2:  # TorchOps' state (another dtype)
            return super().apply_rotary(q, k, state)
        if q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2]:  # (not views of one qkv)
            positions, cos, sin = state
            return apply_rotary(q, k, cos[positions][:, None, :], sin[positions][:, None, :])
        self._k.rotary(q, k, *state)
        return q, k

    def silu_and_mul(self, x):
        if self._rows(x):
            return self._k.silu_and_mul(x)
        return super().silu_and_mul(x)


class SkinnyLinear(nn.Module):
    """``nn.Linear`` whose tiny batches (decode at batch 1) go to the Triton GEMV of
    kernels/gemv.py, which streams the weight closer to HBM bandwidth than cuBLAS does there
    (benchmarks/NOTES.md); larger batches stay on cuBLAS. Shares the original parameters, so
    tied embeddings stay tied."""

    max_rows = 1  # class-wide: benchmarks set 0 to compare against cuBLAS alone
    fuse_activation = True  # class-wide: benchmarks set False to time silu_and_mul apart

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from kernels.gemv import gemv

        self._gemv = gemv
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return self._gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul(self(x))`` in one GEMV for a fused gate/up weight ``[2I, K]`` when
        the GEMV takes these rows (the same arithmetic: kernels/gemv.py ``gemv_silu_mul``);
        None when it does not."""
        if self.fuse_activation and x.dim() == 2 and x.shape[0] <= self.max_rows:
            from kernels.gemv import gemv_silu_mul

            return gemv_silu_mul(x, self.weight, self.bias)
        return None


def use_skinny_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` below ``model`` for a ``SkinnyLinear``; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, SkinnyLinear(child))
                swapped += 1
    return swapped
