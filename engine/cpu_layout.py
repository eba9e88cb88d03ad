"""CPU-only weight layouts, applied from outside the model after its weights are loaded.

``F.linear(x, W)`` with ``W`` stored ``[out, in]`` makes MKL run a transposed GEMM. Measured on
the 2-core dev machine (fp32, SmolLM2 shapes, ms per call; see benchmarks/NOTES.md):

    shape (out x in), rows M     F.linear   x @ W_t   MKL packed
    3072 x 576, M = 16            0.83       0.46      0.39
    3072 x 576, M = 64            1.73       1.63      1.17
    576 x 1536, M = 64            0.79       0.77      0.60

so decode-sized inputs (few rows) use MKL's packed GEMM (``cblas_sgemm_pack`` through torch's
``mkl::_mkl_linear``) and prefill-sized inputs use ``x @ W_t``, where packing no longer helps.
Results are identical to ``F.linear`` up to float rounding (bit-identical for M > 1 on the shapes
above). The LM head keeps its ``[vocab, hidden]`` weight (shared with the embedding when tied)
and adds a packed copy for small batches only.

Where torch has oneDNN (``torch.ops.mkldnn._linear_pointwise``, x86 builds), every linear uses a
oneDNN-prepacked weight instead, at every row count: MKL picks slow kernels on AMD CPUs. Measured
on the AMD EPYC CI machine (2 cores, AVX2, fp32, ms per call, weight packed with a 64-row hint):

    shape (out x in), rows M     x @ W_t   MKL packed   oneDNN packed
    3072 x 576, M = 8             1.43       1.36          0.50
    3072 x 576, M = 300           17.3       -             15.2
    49152 x 576, M = 8            42.9       33.5          10.5
    49152 x 576, M = 300          324        -             247
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_MAX_ROWS = 256  # above this, x @ W_t is as fast and packing costs a little
_PACK_HINT = 64


def mkl_packed_available() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN with the weight prepacked once (any row count)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)
        self.bias = bias
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]).contiguous(), self.packed, self.bias, "none", [], ""
        )
        return y.reshape(*shape[:-1], self.out_features)


class CpuLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W^T`` stored ``[in, out]`` and, with MKL, a packed copy."""

    def __init__(self, linear: nn.Linear, pack: bool):
        super().__init__()
        weight = linear.weight.detach()
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.packed = None
        if pack and weight.dtype == torch.float32:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), _PACK_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
            rows = x.shape[0]
            return torch.ops.mkl._mkl_linear(
                x.contiguous(), self.packed, self.weight_t.t(), self.bias, rows
            )
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class CpuLMHead(nn.Module):
    """The LM head: its (often tied) weight stays as it is for ``F.linear``; with MKL a packed
    copy serves small batches, where it measured 10 ms against 16 ms (M = 16, 49152 x 576)
    and lost at M = 64 (40 ms against 33 ms)."""

    PACKED_MAX_ROWS = 32

    def __init__(self, linear: nn.Linear, pack: bool):
        super().__init__()
        self.weight = linear.weight  # shared with the embedding when tied
        self.packed = None
        if pack and self.weight.dtype == torch.float32:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= self.PACKED_MAX_ROWS:
            return torch.ops.mkl._mkl_linear(
                x.contiguous(), self.packed, self.weight, None, x.shape[0]
            )
        return torch.nn.functional.linear(x, self.weight)


def use_cpu_linears(model: nn.Module, head: str = "lm_head", onednn: bool | None = None) -> int:
    """Swap every ``nn.Linear`` below ``model`` for a ``OneDNNLinear`` where oneDNN is there (fp32
    weights), else a ``CpuLinear`` (``head`` for a ``CpuLMHead``). The LM head's own weight stays
    (tied with the embedding)."""
    pack = mkl_packed_available()
    onednn = onednn_available() if onednn is None else onednn
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if onednn and child.weight.dtype == torch.float32:
                    layer = OneDNNLinear(child.weight, child.bias)
                elif name == head:
                    layer = CpuLMHead(child, pack)
                else:
                    layer = CpuLinear(child, pack)
                setattr(parent, name, layer)
                swapped += 1
    return swapped
