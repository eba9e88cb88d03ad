"""FP8 weights (``quantization="fp8"``), applied from outside the model after its weights load.

As vLLM's ``--quantization fp8`` does for a bf16 checkpoint: each decoder layer's four
projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``; under tensor
parallelism the rank's shard) become an ``Fp8Linear``:

    weight  W [N, K] -> Wq = W / sw  in e4m3 (float8_e4m3fn, max 448),  sw [N] = amax(|W[n, :]|) / 448
    input   x [M, K] -> xq = x / sx  in e4m3, computed at each call,     sx [M] = amax(|x[m, :]|) / 448
    output  y = torch._scaled_mm(xq, Wq^T, scale_a=sx [M, 1], scale_b=sw [1, N]) + bias

so a decode step reads one byte per weight instead of two. The LM head, the embedding and the
norms stay in the model's dtype. On CUDA the input's quantization is one Triton kernel
(kernels/fp8_quant.py), or the RMSNorm's own kernel in front of q/k/v and gate/up
(``QuantizedRows``), and batch 1 takes an FP8 GEMV that quantizes its input itself: the same
numbers. The activation scales are computed on the device (no host sync), so the CUDA graphs
capture the quantized forward as they capture the unquantized one.

Where it runs: wherever ``torch._scaled_mm`` takes e4m3 with row-wise scales. On CUDA that is
compute capability 8.9 and up (Ada, Hopper); torch's CPU build (2.13) has the same kernel, so
CPU tests run the real path, not an emulation. ``fp8_problem`` checks the device at start (a
capability test on CUDA and a one-off call of the kernel anywhere); the engine refuses to start
with its message rather than fail on the first request.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8 import QuantizedRows

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The projections that become Fp8Linear, by their names in engine/models/llama.py.
FP8_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_MIN_AMAX = 1e-12  # an all-zero row gets this amax: its scale stays finite and nonzero
_MIN_CAPABILITY = (8, 9)
_CHUNK_ROWS = 4096


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` as e4m3 with one float32 scale per row (``amax / 448``): ``(xq [R, K],
    scale [R, 1])``, ``xq * scale ~ x``. On the device, no host sync (graph-capturable)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(_MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in e4m3 and a float32 scale per output channel; the
    input is quantized per row (token) at each call and the product runs through
    ``torch._scaled_mm``, its output in ``out_dtype`` (the model's), the bias added after.
    On CUDA one kernel quantizes the input, and up to ``mma_max_rows`` rows (decode at small
    batches) take the CUDA tensor-core GEMV (kernels/fp8_gemv_mma.py), which streams the
    weight where cuBLAS's small-M kernels do not; without it, ``gemv_max_rows`` rows take the
    Triton FP8 GEMV (as ``SkinnyLinear`` does for bf16). Past those and up to
    ``splitk_max_rows`` rows, the input is quantized and the split-K tensor-core GEMM
    (kernels/fp8_gemv.py) streams the weight; more rows go to ``_scaled_mm``."""

    gemv_max_rows = 1  # class-wide: benchmarks set 0 to compare against _scaled_mm alone
    # class-wide: up to this many rows (bf16 in and out) take the CUDA tensor-core GEMV
    # (kernels/fp8_gemv_mma.py) where it builds and the shape fits; 0: never (benchmarks)
    mma_max_rows = 8
    # class-wide: past mma_max_rows, up to this many rows go to the split-K tensor-core GEMM
    # behind the quantizing kernel (kernels/fp8_gemv.py fp8_gemv_splitk; 0: never).
    # _scaled_mm's small-M kernels run at 2.2-3.7x their floor at 16-64 rows on an H200,
    # split-K at 1.15-2.35x: 64-80 us a layer against 110-116 (benchmarks/NOTES.md)
    splitk_max_rows = 64
    # class-wide: on CUDA, _scaled_mm's rows are padded up to a multiple of this (zero rows,
    # their products dropped) up to scaled_mm_pad_max_rows rows (0: never). cuBLAS's e4m3
    # kernels at rows between multiples of 128 ran slower than at the next multiple on an
    # H200: a layer's four products 169 us at 136 rows against 121 at 256, 202 at 264 against
    # 160 at 384, 250 at 392 against 182 at 512 (benchmarks/NOTES.md); past 512 not measured
    scaled_mm_row_multiple = 128
    scaled_mm_pad_max_rows = 512
    fuse_activation = True  # class-wide: benchmarks set False to time silu_and_mul apart
    # class-wide: the RMSNorm in front of the layer quantizes its output for it where the layer
    # would quantize its input in a kernel of its own (engine/ops.py TritonOps, 2+ rows on CUDA);
    # benchmarks set 0 to time the two kernels
    fuse_norm_quant = 1

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K] float8_e4m3fn
        weight_scale: torch.Tensor,  # [N, 1] float32
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        # [1, N], as _scaled_mm's scale_b wants it (one per column of W^T)
        self.weight_scale = nn.Parameter(weight_scale.reshape(1, -1).contiguous(), False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_dtype = out_dtype
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize ``linear``'s weight (per output channel), ``_CHUNK_ROWS`` rows at a time so
        the float32 temporaries stay small beside a model that fills the GPU; its bias is kept
        as it is."""
        w = linear.weight.detach()
        weight = torch.empty(w.shape, dtype=FP8, device=w.device)
        scale = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
        for start in range(0, w.shape[0], _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            weight[rows], scale[rows] = quantize_rows(w[rows])
        return cls(weight, scale, linear.bias, w.dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self._product(x, gated=False)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.is_cuda:  # the same numbers in fewer launches: kernels/fp8_quant.py, fp8_gemv.py
            path = self._gemv_path(x, gated=False)
            if self._quantizes_itself(x, path):
                y = self._quantizing_gemv(x, path, gated=False)
            else:
                y = self._product(self._quantize(x, path), gated=False)
        else:
            xq, x_scale = quantize_rows(x)
            y = self.forward_quantized(xq, x_scale)
        return y.reshape(*shape[:-1], self.out_features)

    def quantized_input_rows(self, x: torch.Tensor) -> int | None:
        """For a producer that can quantize this layer's input ``x [M, K]`` in the kernel that
        computes it (engine/ops.py ``TritonOps``' norms): the rows of the ``QuantizedRows`` to
        hand over (M, or padded for ``_scaled_mm``), or None where the layer's own product
        quantizes x without a kernel of its own (the one-row GEMVs), or ``fuse_norm_quant`` is
        off. ``forward`` and ``silu_mul`` take either."""
        if not self.fuse_norm_quant or x.dim() != 2:
            return None
        if not x.is_cuda:
            return x.shape[0]
        path = self._gemv_path(x, gated=False)
        if self._quantizes_itself(x, path):
            return None
        return self._quantized_rows(x.shape[0], path)

    def _quantized_rows(self, m: int, path: str | None) -> int:
        """The rows a CUDA call on ``m`` rows taking ``path`` quantizes its input to: ``m`` for
        the GEMVs, padded for ``_scaled_mm``."""
        if path == "mma" or m <= self.splitk_max_rows:
            return m
        return self.scaled_mm_rows(m)

    def _quantize(self, x: torch.Tensor, path: str | None) -> QuantizedRows:
        """x quantized by its own kernel (kernels/fp8_quant.py), for ``_product``."""
        from kernels.fp8_quant import quantize_per_token

        m = x.shape[0]
        return QuantizedRows(*quantize_per_token(x, rows=self._quantized_rows(m, path)), m)

    def _gemv_path(self, x: torch.Tensor, gated: bool) -> str | None:
        """The GEMV a CUDA call on ``x`` takes: "mma" (the tensor-core GEMV, at most
        ``mma_max_rows`` rows), "gemv" (the Triton GEMV, at most ``gemv_max_rows`` rows where
        the tensor-core one does not run), or None (the split-K GEMM or ``_scaled_mm``)."""
        if self._takes_mma(x, gated):
            return "mma"
        return "gemv" if x.shape[0] <= self.gemv_max_rows else None

    @staticmethod
    def _quantizes_itself(x: torch.Tensor, path: str | None) -> bool:
        """Whether ``path``'s kernel quantizes x itself: the Triton GEMV, and the tensor-core
        GEMV at one row (more rows are quantized first)."""
        return path == "gemv" or (path == "mma" and x.shape[0] == 1)

    def _quantizing_gemv(self, x: torch.Tensor, path: str, gated: bool) -> torch.Tensor:
        """The product (``gated``: ``silu_mul``'s) in one kernel that quantizes x itself."""
        w, ws = self.weight, self.weight_scale
        if path == "mma":
            from kernels import fp8_gemv_mma

            return fp8_gemv_mma.launch(x, w, ws, self.bias, gated)
        from kernels.fp8_gemv import fp8_gemv_quantizing

        return fp8_gemv_quantizing(x, w, ws, self.bias, self.out_dtype, gated=gated)

    def _product(self, x: QuantizedRows, gated: bool) -> torch.Tensor | None:
        """``forward`` (``gated``: ``silu_mul``) of an input quantized by its producer: the
        tensor-core GEMV, the split-K GEMM or ``_scaled_mm`` by its rows, as for a bf16 input;
        gated, None past the GEMMs' rows (the caller runs ``forward`` and the activation)."""
        m, q, scale = x.rows, x.q, x.scale
        if q.is_cuda and m <= max(self.mma_max_rows, self.splitk_max_rows):
            w, ws = self.weight, self.weight_scale
            if self._takes_mma(q[:m], gated):
                from kernels import fp8_gemv_mma

                return fp8_gemv_mma.launch(q[:m], w, ws, self.bias, gated, x_scale=scale[:m])
            if m <= self.splitk_max_rows:
                from kernels.fp8_gemv import fp8_gemv_splitk

                return fp8_gemv_splitk(q[:m], scale[:m], w, ws, self.bias, self.out_dtype, gated)
        if gated:
            return None
        return self.forward_quantized(q, scale, rows=m)

    def scaled_mm_rows(self, rows: int) -> int:
        """The rows ``_scaled_mm`` runs for a CUDA call on ``rows`` rows: padded up to a
        multiple of ``scaled_mm_row_multiple`` while at most ``scaled_mm_pad_max_rows``."""
        step = self.scaled_mm_row_multiple
        if not step or rows > self.scaled_mm_pad_max_rows:
            return rows
        return -(-rows // step) * step

    def takes_quantized(self, rows: int) -> bool:
        """Whether a CUDA call on ``rows`` rows quantizes its input and runs ``_scaled_mm``
        (past every GEMV's rows), so a caller may hand it the input quantized instead
        (``forward_quantized``; engine/ops.py ``TritonOps.gated_mlp``)."""
        return rows > max(self.mma_max_rows, self.gemv_max_rows, self.splitk_max_rows)

    def forward_quantized(
        self, xq: torch.Tensor, x_scale: torch.Tensor, rows: int | None = None
    ) -> torch.Tensor:
        """``forward``'s product from its input already quantized per row: ``xq [M, K]`` e4m3
        and ``x_scale [M, 1]`` float32, as ``quantize_per_token`` gives them. ``rows``: the
        input's own rows, the rest padding (``scaled_mm_rows``), whose products are dropped."""
        y = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale,
            out_dtype=self.out_dtype,
        )
        if rows is not None:
            y = y[:rows]
        if self.bias is not None:
            y = y + self.bias
        return y

    def silu_mul(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | None:
        """``silu_and_mul(self(x))`` for a fused gate/up projection in one kernel where an FP8
        GEMV runs (CUDA, 2-D input of at most ``mma_max_rows`` rows, or ``gemv_max_rows``
        without the tensor-core GEMV, or ``splitk_max_rows`` behind the quantizer); None
        elsewhere."""
        if not self.fuse_activation:
            return None
        if isinstance(x, QuantizedRows):
            return self._product(x, gated=True)
        if not (x.is_cuda and x.dim() == 2):
            return None
        if x.stride(-1) != 1:
            x = x.contiguous()
        path = self._gemv_path(x, gated=True)
        if self._quantizes_itself(x, path):
            return self._quantizing_gemv(x, path, gated=True)
        if path is None and x.shape[0] > self.splitk_max_rows:  # (cuBLAS's rows)
            return None
        return self._product(self._quantize(x, path), gated=True)

    def _takes_mma(self, x: torch.Tensor, gated: bool) -> bool:
        """Whether the CUDA tensor-core GEMV runs this call: at most ``mma_max_rows`` rows, bf16
        in and out, a shape on its tiles, and the kernel built on this machine (else the
        Triton GEMV or ``_scaled_mm``; kernels/fp8_gemv_mma.py says why, once)."""
        if x.shape[0] > self.mma_max_rows or self.out_dtype != torch.bfloat16:
            return False
        from kernels import fp8_gemv_mma

        if fp8_gemv_mma.problem(x, self.weight, self.bias, gated, self.weight_scale) is not None:
            return False
        return fp8_gemv_mma.available() is None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def fp8_reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` computes, in float32 from the same quantized weight and input (tests
    and the benchmark's numerics check)."""
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    w = layer.weight.float() * layer.weight_scale.reshape(-1, 1)
    y = (xq.float() * x_scale) @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*x.shape[:-1], layer.out_features)


def fp8_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``quantization="fp8"`` cannot run on ``device`` with the model in ``dtype`` (None
    when it can): a CUDA device below compute capability 8.9, or a torch build whose
    ``_scaled_mm`` refuses e4m3 with row-wise scales there (tried on a 16 x 32 product)."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < _MIN_CAPABILITY:
            return capability_problem(torch.cuda.get_device_name(device), cap)
    try:
        layer = Fp8Linear.from_linear(nn.Linear(32, 16, bias=False).to(device, dtype))
        layer(torch.ones(16, 32, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"quantization='fp8' needs FP8 matmuls (torch._scaled_mm with float8_e4m3fn and "
            f"row-wise scales, output {str(dtype).removeprefix('torch.')}), which torch "
            f"{torch.__version__} cannot run on {device}: {first}. Serve without quantization"
            + (
                " or use dtype bfloat16"
                if device.type == "cuda" and dtype != torch.bfloat16
                else ""
            )
        )
    return None


def capability_problem(name: str, capability: tuple[int, int]) -> str | None:
    """The refusal for a CUDA device of ``capability`` (None from 8.9 up)."""
    if tuple(capability) >= _MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"quantization='fp8' needs FP8 matmuls, which {name} (compute capability "
        f"{major}.{minor}) does not have: they need compute capability 8.9 or higher (Ada, "
        "Hopper and later). Serve this model without quantization"
    )


def quantize_model(model: nn.Module, device: torch.device) -> int:
    """Swap every ``FP8_TARGETS`` linear below ``model`` for an ``Fp8Linear``, one at a time,
    so the unquantized weight of each is freed before the next is quantized: the peak is the
    unquantized model plus one projection's temporaries. Check ``fp8_problem`` first (before
    loading). Returns how many were swapped.

    On CUDA the e4m3 weights wait on the host until every unquantized weight is freed and the
    allocator's cache is emptied, then come back: placed among the freed weights' segments they
    would keep them half used, unreleasable, and the KV pool, sized from the device's free
    memory after load, would not get the bytes quantization saved."""
    cuda = torch.device(device).type == "cuda"
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if name in FP8_TARGETS and isinstance(child, nn.Linear)
    ]
    if cuda:  # cuBLASLt's fp8 products want both dimensions in multiples of 16
        for parent, name in targets:
            n, k = getattr(parent, name).weight.shape
            if n % 16 or k % 16:
                raise ValueError(
                    f"quantization='fp8' on CUDA needs projection sizes divisible by 16; "
                    f"{name} is {n} x {k} here (after any tensor-parallel split)"
                )
    swapped: list[Fp8Linear] = []
    for parent, name in targets:  # no other reference to the old linear: freed on setattr
        layer = Fp8Linear.from_linear(getattr(parent, name))
        if cuda:
            layer.weight.data = layer.weight.data.cpu()
        setattr(parent, name, layer)
        swapped.append(layer)
    if cuda:
        torch.cuda.empty_cache()
        for layer in swapped:
            layer.weight.data = layer.weight.data.to(device)
    return len(swapped)
