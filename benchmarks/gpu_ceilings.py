"""The denominators of every GPU figure, measured in the same run as the figure itself.

from benchmarks.gpu_ceilings import hbm_copy_bandwidth, bf16_matmul_flops, time_cuda
"""

from __future__ import annotations

import torch


def time_cuda(fn, reps: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` on the current stream (CUDA events, after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def hbm_copy_bandwidth(gib: int = 4, reps: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of ``gib`` GiB."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), reps)
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / seconds


def bf16_matmul_flops(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of a bf16 ``n x n x n`` matmul (cuBLAS), the compute ceiling of this GPU."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = time_cuda(lambda: a @ b, reps)
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def fp8_matmul_flops(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an e4m3 ``n x n x n`` ``torch._scaled_mm`` with row-wise scales and bf16 output
    (what ``quantization="fp8"`` runs), the FP8 compute ceiling of this GPU."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    seconds = time_cuda(
        lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), reps
    )
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def bf16_matmul_flops_sustained(seconds: float = 3.0, n: int = 8192) -> float:
    """FLOP/s of the same matmul run back to back for ``seconds``, over the last third of them.

    ``bf16_matmul_flops`` times ~30 ms of work, which a GPU runs at its boost clock. Work that
    runs for seconds, as serving does, meets the board's power limit, and the clock drops: an
    H200 (700 W) goes from 1,980 to ~1,450 MHz and from ~790 to ~660 TFLOP/s within half a
    second (benchmarks/gpu_clocks.py). A floor for a step timed back to back divides by this."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    per_call = time_cuda(lambda: a @ b, 5)
    calls = max(int(seconds / 3 / per_call), 1)
    for _ in range(2 * calls):  # two thirds: down to the clock the power limit holds
        a @ b
    seconds_last = time_cuda(lambda: a @ b, calls, warmup=0)
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds_last
