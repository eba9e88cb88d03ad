"""Skinny FP8 GEMM for decode at tiny batch: ``y[m] = sx[m] * sw * (Wq @ xq[m]) (+ b)``, the
product ``torch._scaled_mm`` computes for an ``Fp8Linear`` (engine/quant.py), for a handful of
rows ``m``.

At batch 1 a decode step streams every weight byte once; with e4m3 weights that is half of
bf16's bytes, and the step's floor halves with it only if the GEMV keeps streaming at HBM rate.
kernels/gemv.py's kernel with its ``SCALED`` switch on (the same tiles and grid,
benchmarks/gpu_gemv.py's sweep):

    grid (N / BLOCK_N, M): program (n, m) reads rows n*BLOCK_N.. of Wq in [BLOCK_N, BLOCK_K]
    e4m3 tiles along K, upcasts them and xq[m]'s slice to fp32 (exact), keeps a partial sum and
    reduces it once; the two scales multiply the sum at the end, then the bias, as
    ``Fp8Linear`` does after ``_scaled_mm``: the product rounded to the output dtype, the bias
    added in it.

``fp8_gemv_splitk`` is the same product on tensor cores (the weights as the MMA's 64-row side, K
split over programs, the partials added in a fixed order): on an H200 it streams 0.59-0.86 of
the copy rate against this kernel's 0.55-0.75, but wants x already in e4m3, and a kernel
quantizing x in front of each product costs what it gains on the small shapes, so the engine
does not use it yet (benchmarks/NOTES.md, "On one H200 ... the FP8 GEMV's limit").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemv import launch_gemv, silu_mul_rounded
from kernels.pdl import start as pdl_start


def fp8_gemv(
    xq: torch.Tensor,  # [M, K] e4m3, K contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3, K contiguous
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    **config,
) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale).T`` in fp32, rounded to ``out_dtype``, then
    ``+ bias`` in ``out_dtype``: ``[M, N]``."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or xq.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(xq.shape)} and weight {tuple(weight.shape)} mismatch")
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    launch_gemv(xq, x_scale, weight, weight_scale, bias, y, True, config)
    return y


def fp8_gemv_quantizing(
    x: torch.Tensor,  # [M, K] in the model's dtype, K contiguous
    weight: torch.Tensor,  # [N, K] e4m3, K contiguous
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gated: bool = False,
    **config,
) -> torch.Tensor:
    """``fp8_gemv(*quantize_per_token(x), ...)`` in one kernel: each program quantizes ``x``'s
    row itself (the same e4m3 values and scale), so batch-1 decode runs one launch per
    projection instead of two. ``gated``: ``weight`` is the fused ``[2I, K]`` gate/up
    projection and the result ``silu(gate) * up`` ``[M, I]`` (kernels/gemv.py)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or (gated and n % 2):
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    y = torch.empty(m, n // 2 if gated else n, dtype=out_dtype, device=x.device)
    launch_gemv(x, None, weight, weight_scale, bias, y, True, config, quant_x=True, gated=gated)
    return y


def fp8_gemv_ref(xq, x_scale, weight, weight_scale, bias, out_dtype):
    y = (xq.float() @ weight.float().T) * x_scale * weight_scale.reshape(1, -1)
    y = y.to(out_dtype)
    return y if bias is None else y + bias


# -- the tensor-core GEMV (experimental: benchmarks/gpu_gemv.py --fp8-input splitk) -----------


@triton.jit
def _fp8_splitk_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_PER,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (n, s): rows ``n*BLOCK_N..`` of ``Wq`` over K's ``s``-th run of ``K_PER``
    columns, ``[BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]`` tensor-core products of e4m3 (the
    weights as the MMA's 64-row side, x's rows padded to ``BLOCK_M`` as its narrow side: on
    Hopper ``wgmma`` on e4m3 straight from shared memory, no conversion), float32 sums. Each
    program writes its partial sums; the last of a row block's ``SPLIT_K`` programs to arrive
    (a counter, reset by it) adds them in split order, so the sum does not depend on who came
    last, then scales, rounds and adds the bias as ``fp8_gemv`` does (``GATED``: gate and up
    rows, then ``silu(gate) * up``)."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    ks = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N * stride_wn  # GATED: the up rows (N = I, the output's width)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # GATED only (else dead)
    k_lo = ks * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if GATED:
            u = tl.load(u_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_u = tl.dot(u, tl.trans(x), acc_u)
    # partial sums: part[s, half, n, m] (half 1: the up rows)
    slab = rn[:, None] * BLOCK_M + rm[None, :]
    keep = n_mask[:, None] & m_mask[None, :]
    halves = 2 if GATED else 1
    tl.store(part_ptr + (ks * halves) * N * BLOCK_M + slab, acc, mask=keep)
    if GATED:
        tl.store(part_ptr + (ks * halves + 1) * N * BLOCK_M + slab, acc_u, mask=keep)
    arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: the partials above are visible
    if arrived == SPLIT_K - 1:  # the last: every split's partials are in
        tl.store(count_ptr + pid_n, 0)
        x_scale = tl.load(xs_ptr + rm, mask=m_mask, other=1.0)
        out = y_ptr.dtype.element_ty
        tot = _split_sum(part_ptr, 0, halves, N, BLOCK_M, slab, keep, SPLIT_K, BLOCK_N)
        y = _scaled_rows(tot, rn, n_mask, x_scale, ws_ptr, b_ptr, HAS_BIAS, out)
        if GATED:
            tot_u = _split_sum(part_ptr, 1, halves, N, BLOCK_M, slab, keep, SPLIT_K, BLOCK_N)
            up = _scaled_rows(tot_u, rn + N, n_mask, x_scale, ws_ptr, b_ptr, HAS_BIAS, out)
            y = silu_mul_rounded(y, up, out)
        y_offs = rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
        tl.store(y_ptr + y_offs, y.to(out), mask=keep)


@triton.jit
def _split_sum(part_ptr, half, halves, N, BLOCK_M: tl.constexpr, slab, keep,
               SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_M]`` partial sums of every split of ``half`` (1: the up rows),
    added in split order; read past L1 (other SMs wrote them)."""
    tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for s in range(SPLIT_K):
        tot += tl.load(part_ptr + (s * halves + half) * N * BLOCK_M + slab, mask=keep, other=0.0,
                       cache_modifier=".cg")  # fmt: skip
    return tot


@triton.jit
def _scaled_rows(tot, rn, n_mask, x_scale, ws_ptr, b_ptr, HAS_BIAS: tl.constexpr,
                 OUT: tl.constexpr):  # fmt: skip
    """Rows ``rn`` of the product from their sums ``[BLOCK_N, BLOCK_M]``: scaled by x's and
    W's scales and rounded to ``OUT``, the bias added (fp32, not yet rounded again), as
    kernels/gemv.py's ``_epilogue``."""
    scale = x_scale[None, :] * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[:, None]
    y = (tot * scale).to(OUT).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return y


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one a row block, kept per device (the kernel resets each one it
    used, so a CUDA graph replays with them zero)."""
    key = (str(device), n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


SMEM_BYTES = 200 * 1024  # what the pipeline's stages may take of an SM's shared memory


def splitk_config(m: int, n: int, k: int, gated: bool = False) -> dict:
    """Tiles of ``fp8_gemv_splitk`` from its one sweep (H200, benchmarks/NOTES.md): 64-row
    blocks; a grid of 200 row blocks or more (gate/up) unsplit in 128-column runs; narrow ones
    split, in 512-column runs over 2 splits when K or N is the model's width (o_proj, down), in
    256-column runs over 4 otherwise (qkv); as many stages as ``SMEM_BYTES`` holds (a gated
    stage holds two weight tiles)."""
    block_m, block_n, tiles = max(16, triton.next_power_of_2(m)), 64, triton.cdiv(n, 64)
    if tiles >= 200:
        block_k, split, stages = 128, 1, 3
    elif k >= 8192 or n <= 4096:
        block_k, split, stages = 512, 2, 5
    else:
        block_k, split, stages = 256, 4, 3
    stage = (block_n * (2 if gated else 1) + block_m) * block_k
    stages = max(2, min(stages, SMEM_BYTES // stage))
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "split_k": split,
            "num_warps": 4, "num_stages": stages}  # fmt: skip


def fp8_gemv_splitk(
    xq: torch.Tensor,  # [M, K] e4m3, K contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3 ([2I, K] gated)
    weight_scale: torch.Tensor,  # [1, N] or [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gated: bool = False,
    **config,
) -> torch.Tensor:
    """``fp8_gemv``'s product (``gated``: ``silu(gate) * up``) on tensor cores, K split over
    programs: the sums in another order than ``fp8_gemv``'s, the same for every call."""
    m, k = xq.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight.shape[1] != k or xq.stride(1) != 1 or weight.stride(1) != 1 or (gated and
                                                                              weight.shape[0] % 2):  # fmt: skip
        raise ValueError(f"fp8_gemv: x {tuple(xq.shape)} and weight {tuple(weight.shape)} mismatch")
    cfg = splitk_config(m, n, k, gated)
    cfg.update(config)
    if m > cfg["block_m"]:
        raise ValueError(f"fp8_gemv_splitk: {m} rows, at most {cfg['block_m']}")
    tiles = triton.cdiv(n, cfg["block_n"])
    k_per = triton.cdiv(triton.cdiv(k, cfg["split_k"]), cfg["block_k"]) * cfg["block_k"]
    split = triton.cdiv(k, k_per)  # (rounding K's runs up to whole tiles may need fewer)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    part = torch.empty(split * (2 if gated else 1) * n * cfg["block_m"], dtype=torch.float32,
                       device=xq.device)  # fmt: skip
    ws = weight_scale.reshape(-1)
    _fp8_splitk_kernel[(tiles, split)](
        xq,
        x_scale.reshape(-1),
        weight,
        ws,
        bias if bias is not None else ws,
        y,
        part,
        _counters(xq.device, tiles),
        m,
        n,
        k,
        k_per,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        SPLIT_K=split,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl.launch_options(xq.device),
    )
    return y
