"""The decode step's GEMMs at batch 256 (Llama-3-8B shapes, bf16): cuBLAS (``F.linear``) against
a Triton GEMM with K split over programs, each against its floor (max of FLOPs at the measured
bf16 rate and bytes at the HBM copy rate), weights cold in L2 as in a decode step.

At M = 256 the narrow products (o_proj, down: N = 4096) give cuBLAS 64 output tiles of 128 x 128
for 132 SMs (benchmarks/NOTES.md: down and o_proj at 1.44x their floor on an H100); splitting K
multiplies the programs. An experiment: the split sums are added with fp32 atomics (order not
fixed), which the engine would not take as is.

    PYTHONPATH=$PWD python benchmarks/gpu_gemm_m256.py [--m 256] [--out DIR]
    PYTHONPATH=$PWD python benchmarks/gpu_gemm_m256.py --fp8 [--m 256] [--out DIR]

``--fp8`` (issue 26): e4m3 weights and inputs with row-wise scales, ``torch._scaled_mm`` (what
``Fp8Linear`` runs past 8 rows) against kernels/fp8_gemv.py's ``fp8_gemv_splitk`` (all rows in
one tile, K split with a fixed-order sum), floor = max(FLOPs at ``_scaled_mm``'s measured rate,
1-byte weights and inputs at the copy rate); the input's quantization is not timed.

Both also time the library's GEMM **swapped**: ``out.T = W @ x.T``, so the weight's N rows are
the product's M side and the 256 tokens its narrow N side (cuBLAS then tiles 4096 x 256, not
256 x 4096), the result read through a transposed view, and with the copy that makes it
contiguous again (``swapped+copy``). ``--no-splitk`` skips the Triton sweep.

``--bmm-split S`` (bf16) also times the library's GEMM with K cut into S slices run as one
batched GEMM over strided views (``torch.bmm``, fp32 partial products where torch offers
``out_dtype``, else bf16), then summed over the slices and rounded: S times the output tiles
for the narrow shapes, at the cost of the partials' traffic and the sum's kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import (  # noqa: E402
    bf16_matmul_flops,
    fp8_matmul_flops,
    hbm_copy_bandwidth,
)
from benchmarks.gpu_gemv import COLD_BYTES, SHAPES, graph_time  # noqa: E402


@triton.jit
def _splitk_kernel(a_ptr, w_ptr, c_ptr, M, N, K, K_PER, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = s * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        acc = tl.dot(a, tl.trans(w), acc)
    ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT == 1:
        tl.store(ptrs, acc)
    else:
        tl.atomic_add(ptrs, acc, sem="relaxed")


def splitk_gemm(a, w, c, bm, bn, bk, split, warps, stages):
    m, k = a.shape
    n = w.shape[0]
    k_per = k // split
    _splitk_kernel[(m // bm, n // bn, split)](
        a, w, c, m, n, k, k_per, BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


SWEEP = {
    "bm": (64, 128),
    "bn": (64, 128),
    "bk": (64,),
    "split": (1, 2, 4),
    "warps": (4,),
    "stages": (3, 4),
}


# fp8_gemv_splitk's tiles (--fp8): (block_n, warps), block_k, split, stages
FP8_SWEEP = {
    "tile": ((64, 4), (64, 8), (128, 8)),
    "block_k": (128, 256),
    "split_k": (1, 2, 4),
    "num_stages": (3, 4),
}


def best_config(name: str, configs, run, right, weights: list) -> tuple[float, dict | None]:
    """The fastest of ``configs`` by ``graph_time`` of ``run(w, cfg)`` over ``weights``, each
    first checked with ``right(cfg)`` on the first weight; a tile that is wrong or does not
    build is said on stderr and skipped."""
    best = (float("inf"), None)
    for cfg in configs:
        try:
            if not right(cfg):
                print(f"  {name} {cfg}: wrong", file=sys.stderr)
                continue
            t = graph_time(partial(run, cfg=cfg), weights)
        except Exception as exc:  # a tile that does not fit
            print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
            continue
        print(f"  {name} {cfg}: {t * 1e6:.1f} us", file=sys.stderr)
        if t < best[0]:
            best = (t, cfg)
    return best


def bf16_configs(m: int, n: int, k: int):
    """``SWEEP``'s tiles that divide the shape."""
    for vals in itertools.product(*SWEEP.values()):
        cfg = dict(zip(SWEEP, vals, strict=True))
        if not (k % (cfg["split"] * cfg["bk"]) or m % cfg["bm"] or n % cfg["bn"]):
            yield cfg


def table_header(library: str) -> str:
    """The table's head: each shape against the library's product (``library``)."""
    return (f"| shape | floor us | {library} us | / floor | split-K best us | / floor | config | "
            "swapped us | / floor | swapped+copy us |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def cold_copies(w0: torch.Tensor) -> list[torch.Tensor]:
    """``w0`` and enough copies of it that, timed in turn, each is read from HBM, not L2."""
    return [w0] + [w0.clone() for _ in range(max(1, -(-COLD_BYTES // w0.nbytes)) - 1)]


def table_row(
    name: str, floor: float, base: float, best: tuple[float, dict | None], swap: dict
) -> str:
    """One shape: its floor, the library's time, the best split-K tile's (us, / floor), the
    library's swapped product (us, / floor) and with the copy back to row-major."""
    return (f"| {name} | {floor * 1e6:.1f} | {base * 1e6:.1f} | {base / floor:.2f} | "
            f"{best[0] * 1e6:.1f} | {best[0] / floor:.2f} | {best[1]} | "
            f"{swap['swapped_s'] * 1e6:.1f} | {swap['swapped_s'] / floor:.2f} | "
            f"{swap['swapped_copy_s'] * 1e6:.1f} |")  # fmt: skip


def swapped_times(plain, swapped, w0, weights: list) -> dict:
    """``swapped(w)`` (``[n, m]``, the product transposed) checked against ``plain(w)`` on
    ``w0``, then timed as it is and with ``.t().contiguous()`` after it."""
    want, got = plain(w0).float(), swapped(w0).t().float()
    if not torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()):
        raise AssertionError("the swapped product differs from the plain one")
    return {
        "swapped_s": graph_time(swapped, weights),
        "swapped_copy_s": graph_time(lambda w: swapped(w).t().contiguous(), weights),
    }


def fp8_configs():
    for vals in itertools.product(*FP8_SWEEP.values()):
        cfg = dict(zip(FP8_SWEEP, vals, strict=True))
        block_n, warps = cfg.pop("tile")
        yield {**cfg, "block_n": block_n, "num_warps": warps}


def fp8_main(args) -> None:
    from kernels.fp8_gemv import fp8_gemv_splitk
    from kernels.fp8_quant import quantize_per_token

    bw, flops = hbm_copy_bandwidth(), fp8_matmul_flops()
    gpu = torch.cuda.get_device_name()
    res = {"gpu": gpu, "m": args.m, "hbm": bw, "fp8_flops": flops, "shapes": {}}
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s, fp8 {flops / 1e12:.0f} TFLOP/s, M={args.m}")
    print(table_header("_scaled_mm"))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        xq, xs = quantize_per_token(torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16))
        w0 = (torch.randn(n, k, device="cuda") * 8).to(torch.float8_e4m3fn)
        wsc = torch.rand(1, n, device="cuda") * 1e-3 + 1e-3
        ws = cold_copies(w0)
        floor = max(2 * args.m * n * k / flops, (w0.nbytes + xq.nbytes + args.m * n * 2) / bw)

        def scaled(w, xq=xq, xs=xs, wsc=wsc):
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=wsc, out_dtype=torch.bfloat16)

        xs_t, wsc_t = xs.flatten().unsqueeze(0), wsc.flatten().unsqueeze(1)  # [1, m], [n, 1]

        def swapped(w, xq=xq, xs_t=xs_t, wsc_t=wsc_t):  # [n, m], read through .t()
            return torch._scaled_mm(
                w, xq.t(), scale_a=wsc_t, scale_b=xs_t, out_dtype=torch.bfloat16
            )

        def splitk(w, cfg, xq=xq, xs=xs, wsc=wsc):
            return fp8_gemv_splitk(xq, xs, w, wsc, None, torch.bfloat16, **cfg)

        def right(cfg, w0=w0, splitk=splitk, ref=scaled(w0).float()):
            got = splitk(w0, cfg).float()
            return torch.allclose(got, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())

        cublas = graph_time(scaled, ws)
        try:
            swap = swapped_times(scaled, swapped, w0, ws)
        except RuntimeError:  # _scaled_mm wants the swapped product's M (here N) % 16 == 0
            swap = {"swapped_s": float("nan"), "swapped_copy_s": float("nan")}
        best, default = (float("nan"), None), float("nan")
        if not args.no_splitk:
            default = best_config(name, [{}], splitk, right, ws)[0]  # splitk_config's tiles
            sweep = [{}] if args.splitk_default else fp8_configs()
            best = best_config(name, sweep, splitk, right, ws)
        res["shapes"][name] = {"floor_s": floor, "scaled_mm_s": cublas, "splitk_s": best[0],
                               "config": best[1], "splitk_default_s": default, **swap}  # fmt: skip
        print(table_row(name, floor, cublas, best, swap))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_gemm_m{args.m}_fp8.json").write_text(json.dumps(res, indent=1))


def bmm_split_times(a, w0, ws, split: int, floor: float) -> dict:
    """``a @ w.T`` with K in ``split`` slices as one ``torch.bmm`` (fp32 partials where
    ``out_dtype`` is offered), the slices summed and rounded to bf16; checked against
    ``F.linear`` on ``w0``, timed cold; printed against the plain product."""
    m, k = a.shape
    a_s = a.view(m, split, k // split).transpose(0, 1)  # [S, M, K/S], no copy

    def product(w, out_dtype):
        w_s = w.view(w.shape[0], split, k // split).permute(1, 2, 0)  # [S, K/S, N], no copy
        if out_dtype is None:
            return torch.bmm(a_s, w_s).float().sum(0).to(a.dtype)
        return torch.bmm(a_s, w_s, out_dtype=out_dtype).sum(0).to(a.dtype)

    try:
        product(w0, torch.float32)
        out_dtype = torch.float32
    except (TypeError, RuntimeError):  # a torch without bmm's out_dtype: bf16 partials
        out_dtype = None
    want = F.linear(a, w0).float()
    got = product(w0, out_dtype).float()
    if not torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()):
        raise AssertionError("the sliced product differs from the plain one")
    t = graph_time(lambda w: product(w, out_dtype), ws)
    print(f"  K in {split} slices by bmm ({'fp32' if out_dtype else 'bf16'} partials): "
          f"{t * 1e6:.1f} us, {t / floor:.2f}x the floor")  # fmt: skip
    return {"bmm_split": split, "bmm_split_s": t, "bmm_fp32_partials": out_dtype is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--fp8", action="store_true", help="_scaled_mm against fp8_gemv_splitk")
    ap.add_argument("--no-splitk", action="store_true", help="the library's GEMMs only")
    ap.add_argument("--bmm-split", type=int, default=0, help="also K in S slices by torch.bmm")
    ap.add_argument(
        "--splitk-default",
        action="store_true",
        help="--fp8: the split-K kernel's default tiles only",
    )
    ap.add_argument(
        "--blas",
        choices=("default", "cublas", "cublaslt"),
        default="default",
        help="torch.backends.cuda.preferred_blas_library for the bf16 GEMMs",
    )
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.fp8:
        fp8_main(args)
        return
    bw, flops = hbm_copy_bandwidth(), bf16_matmul_flops()
    gpu = torch.cuda.get_device_name()
    res = {"gpu": gpu, "m": args.m, "hbm": bw, "flops": flops, "blas": args.blas, "shapes": {}}
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s, bf16 {flops / 1e12:.0f} TFLOP/s, M={args.m}, "
          f"BLAS {args.blas}")  # fmt: skip
    print(table_header("cuBLAS"))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        a = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ws = cold_copies(w0)
        floor = max(2 * args.m * n * k / flops, (w0.nbytes + a.nbytes + args.m * n * 2) / bw)
        cublas = graph_time(lambda w, a=a: F.linear(a, w), ws)
        swap = swapped_times(lambda w, a=a: F.linear(a, w), lambda w, a=a: w @ a.t(), w0, ws)
        c = torch.zeros(args.m, n, device="cuda", dtype=torch.float32)

        def run(w, cfg, a=a, c=c):
            splitk_gemm(a, w, c, **cfg)

        def right(cfg, a=a, c=c, w0=w0, ref=a.float() @ w0.float().T):
            c.zero_()
            splitk_gemm(a, w0, c, **cfg)
            return torch.allclose(c, ref, rtol=2e-2, atol=2e-1)

        best = (float("nan"), None)
        if not args.no_splitk:
            best = best_config(name, bf16_configs(args.m, n, k), run, right, ws)
        res["shapes"][name] = {"floor_s": floor, "cublas_s": cublas, "splitk_s": best[0],
                               "config": best[1], **swap}  # fmt: skip
        print(table_row(name, floor, cublas, best, swap))
        if args.bmm_split:
            res["shapes"][name].update(bmm_split_times(a, w0, ws, args.bmm_split, floor))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_gemm_m{args.m}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
