"""The FP8 GEMV of decode at batch 1-8 on tensor cores: ``fp8_gemv_quantizing``'s product
(``gated``: ``silu(gate) * up``) as a CUDA kernel, ``kernels/cuda/fp8_gemv_mma.cu``, built once
per variant by NVRTC through cupy. One row is quantized inside the kernel; 2-8 rows by
``quantize_per_token`` first.

Why CUDA: the FMA GEMV of kernels/gemv.py spends ~6 instructions a weight byte converting e4m3
and multiplying (Nsight Compute on an H200, benchmarks/NOTES.md). Here one lane's 16-byte load
is an MMA's A fragment as it lies in the row-major weight (the k order inside the MMA is the
lane's bytes' order, and x's fragment follows it): about one instruction a weight byte, and the
batch's rows (up to 8) ride in the MMA's narrow side. Triton places no fragment per lane.
Measured (H200): level with the Triton GEMV on the 8B's small shapes, where a fixed cost per
launch rules, ahead on large ones (0.88-0.98 of the copy rate) and at 2-8 rows, where
``_scaled_mm`` ran before.

Launched with ``cuLaunchKernelEx`` (ctypes) on torch's current stream; at one row with the PDL
attribute where kernels/pdl.py has it on (the kernel reads its first weight tiles before
``griddepcontrol.wait``, as the Triton GEMV does), behind the quantizer (2-8 rows) without it. CUDA graphs capture it as any launch; a
variant is built and loaded on its first call, which the engine makes in its graphs' warm-ups.

Where it cannot run (no cupy or NVRTC, a GPU before compute capability 8.9, a dtype other than
bf16, a shape off its tiles) ``problem`` or ``available`` says why and ``Fp8Linear`` uses the
Triton GEMV (one row) or ``_scaled_mm``.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

from kernels import pdl

SOURCE = Path(__file__).parent / "cuda" / "fp8_gemv_mma.cu"
MAX_ROWS = 8  # the MMA's narrow side (the kernel's MAX_M)
_TILE_K = 128  # columns a warp's loads cover a row tile
# An experiment (benchmarks/gpu_fp8_weights.py --l2-prefetch): bytes of one call's weights that
# its blocks prefetch into L2 before the PDL wait, spread over the row tiles; 0 (the default):
# none. 24 MB made batch-1 ITL worse on an H200, 3.04 -> 3.16 ms (benchmarks/NOTES.md).
L2_PREFETCH_BYTES = 0
# An experiment (benchmarks/gpu_itl_batches.py --mma-pdl-quantized): launch the 2-8-row
# variant, whose x comes quantized, with PDL too (the default launches it without)
PDL_QUANTIZED_X = False


def default_config(n: int, k: int, gated: bool) -> dict:
    """Warps a block (K split between them), 128-column tiles in flight a warp, row tiles of 16
    a block; one config a shape, whatever the batch (the variants are two a shape, 1 row and
    2-8 rows, both built in the graphs' warm-ups: none first met while serving)."""
    # from benchmarks/gpu_gemv.py --fp8 --fp8-input mma at 1 and 8 rows on an H200: one tile in
    # flight a warp (more warps instead), 16 warps on the model's width (o_proj, down), else 8
    return {"warps": 16 if n <= 4096 else 8, "unroll": 1, "rt": 2 if gated else 1}


def _shape(x: torch.Tensor, weight: torch.Tensor, gated: bool, config: dict):
    """``(m, k, n, cfg)`` of a call: its rows, K, output width and tiles."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return m, k, n, {**default_config(n, k, gated), **config}


def problem(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    weight_scale: torch.Tensor | None = None,
    **config,
) -> str | None:
    """Why ``fp8_gemv_mma`` cannot take this call (None when it can)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or x.dim() != 2:
        return "a 2-D bf16 (or e4m3, quantized) CUDA input"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "compute capability 8.9 or higher"
    m, k, n, cfg = _shape(x, weight, gated, config)
    if not 1 <= m <= MAX_ROWS:
        return f"1 to {MAX_ROWS} rows"
    if weight.shape[1] != k or k % _TILE_K or n % (16 * (1 if gated else cfg["rt"])):
        return f"K a multiple of {_TILE_K}, N of 16 x the row tiles"
    if gated and (weight.shape[0] % 2 or cfg["rt"] != 2):
        return "a gated weight of 2 x 16-row tiles"
    if x.stride(1) != 1 or x.stride(0) * x.element_size() % 16 or x.data_ptr() % 16:
        return "x rows 16-byte aligned"
    if weight.stride(1) != 1 or weight.stride(0) % 16 or weight.data_ptr() % 16:
        return "weight rows 16-byte aligned"
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return "a contiguous bf16 bias"
    if weight_scale is not None and (
        weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
    ):
        return "contiguous float32 weight scales"
    return None


def fp8_gemv_mma(
    x: torch.Tensor,  # [M, K] bf16, K contiguous, M <= 8
    weight: torch.Tensor,  # [N, K] e4m3 ([2I, K] gated)
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    gated: bool = False,
    **config,
) -> torch.Tensor:
    """``fp8_gemv_quantizing(x, weight, weight_scale, bias, torch.bfloat16, gated)`` on tensor
    cores: the same e4m3 x and scale (up to the division's last bit), sums in another order.
    One row is quantized inside the kernel; 2-8 rows by ``quantize_per_token`` first (a block
    would otherwise quantize every row of x itself)."""
    why = problem(x, weight, bias, gated, weight_scale, **config)
    if why is not None:
        raise ValueError(f"fp8_gemv_mma: needs {why}")
    return launch(x, weight, weight_scale, bias, gated, **config)


def launch(
    x, weight, weight_scale, bias, gated: bool = False, x_scale=None, **config
) -> torch.Tensor:
    """``fp8_gemv_mma`` without its checks, for a caller that has had ``problem`` say None for
    these arguments (``Fp8Linear``, which asks before it chooses this path). ``x_scale``
    (``[M, 1]`` float32): x is already quantized (e4m3, as ``quantize_per_token`` gives it)."""
    m, k, n, cfg = _shape(x, weight, gated, config)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    ws = weight_scale.reshape(-1)
    warps, rt, quant_x = cfg["warps"], cfg["rt"], m == 1 and x_scale is None
    smem = 4 * (warps * rt * 128 + MAX_ROWS * warps + MAX_ROWS) + (k + 16 if quant_x else 0)
    kernel = _kernel(x.device.index or 0, warps, cfg["unroll"], rt, gated, quant_x)
    kernel.reserve(smem)
    blocks = n // 16 if gated else n // (16 * rt)
    if not quant_x and x_scale is None:
        from kernels.fp8_quant import quantize_per_token

        x, x_scale = quantize_per_token(x)
    args = (
        ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(ws.data_ptr()),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(x_scale.data_ptr() if x_scale is not None else 0),
        ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int(m),
        ctypes.c_int(n),
        ctypes.c_int(k),
        ctypes.c_longlong(x.stride(0)),
        ctypes.c_longlong(weight.stride(0)),
        ctypes.c_longlong(y.stride(0)),
    )
    # (only where PDL launches the call early: the one-row variant)
    prefetch = _prefetch_bytes(blocks * rt, k, weight.stride(0))
    args += (ctypes.c_longlong(prefetch if quant_x and pdl.enabled(x.device) else 0),)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    # PDL at one row only: behind the quantizer (2-8 rows) it measured a third slower on an H200
    # (Llama-3-70B, batch 8: 32.2 ms a step with it, 21.5 without; benchmarks/NOTES.md)
    use_pdl = (quant_x or PDL_QUANTIZED_X) and pdl.enabled(x.device)
    kernel.launch(blocks, warps * 32, smem, stream, args, use_pdl)
    return y


def _prefetch_bytes(row_tiles: int, k: int, stride_wn: int) -> int:
    """A row tile's share of ``L2_PREFETCH_BYTES``, whole 128-byte lines, within its 16 rows."""
    per_tile = min(L2_PREFETCH_BYTES // max(1, row_tiles), 15 * stride_wn + k)
    return per_tile // 128 * 128


# -- building and launching ------------------------------------------------------------------


class _Kernel:
    """One built variant on one device: its ``CUfunction`` and the dynamic shared memory it may
    take (raised, never lowered, as calls need more)."""

    def __init__(self, raw, device_index: int):
        self._raw = raw  # keeps the module loaded
        self.function = ctypes.c_void_p(raw.kernel.ptr)
        self.device_index = device_index
        self.smem_allowed = 48 * 1024

    def reserve(self, smem: int) -> None:
        if smem > self.smem_allowed:
            _check(
                _driver().cuFuncSetAttribute(
                    self.function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
                ),
                "cuFuncSetAttribute",
            )
            self.smem_allowed = smem

    def launch(self, blocks: int, threads: int, smem: int, stream: int, args, use_pdl: bool):
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        attrs = (_LaunchAttribute * 1)()
        attrs[0].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[0].value.as_int = 1
        config = _LaunchConfig(
            blocks, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), attrs, int(use_pdl)
        )
        _check(
            _driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None),
            "cuLaunchKernelEx",
        )


@functools.cache
def _kernel(
    device_index: int, warps: int, unroll: int, rt: int, gated: bool, quant_x: bool
) -> _Kernel:
    import cupy

    options = (
        "-std=c++17",
        f"-DWARPS={warps}",
        f"-DUNROLL={unroll}",
        f"-DRT={rt}",
        f"-DGATED={int(gated)}",
        f"-DQUANT_X={int(quant_x)}",
    )
    with cupy.cuda.Device(device_index):
        raw = cupy.RawKernel(SOURCE.read_text(), "fp8_gemv_mma", options=options)
        kernel = _Kernel(raw, device_index)  # (raw.kernel builds and loads it now)
    print(
        f"tandem: built the FP8 tensor-core GEMV (warps {warps}, unroll {unroll}, row tiles "
        f"{rt}, gated {gated}, quantizing x {quant_x})",
        file=sys.stderr,
    )
    return kernel


@functools.cache
def available() -> str | None:
    """Why the CUDA GEMV cannot be built here (None when it can): cupy missing or unable to
    build for this GPU. Tried once a process, on the current device."""
    try:
        _kernel(torch.cuda.current_device(), 8, 1, 1, False, True)
    except Exception as exc:  # cupy missing, NVRTC missing, an unsupported GPU
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        print(f"tandem: the FP8 tensor-core GEMV is unavailable ({why})", file=sys.stderr)
        return why
    return None


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("as_int", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [
        ctypes.POINTER(_LaunchConfig),
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({code})")
