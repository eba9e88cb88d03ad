"""Batch-1 decode GEMVs at the Llama-3-8B shapes: cuBLAS (``F.linear``) against kernels/gemv.py
over a sweep of tiles, each timed as 20 calls replayed from one CUDA graph (no launch overhead),
as achieved weight bytes/s over the HBM copy bandwidth measured in the same run.

    python benchmarks/gpu_gemv.py [--rows 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import hbm_copy_bandwidth, time_cuda  # noqa: E402
from kernels.gemv import default_config, gemv, gemv_ref  # noqa: E402

SHAPES = {  # (N, K) of each decode GEMM in one Llama-3-8B layer, and the LM head
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SWEEP = {
    "block_n": (4, 8, 16),
    "block_k": (256, 512, 1024),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}


def graph_time(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_cuda(graph.replay, reps=10) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = hbm_copy_bandwidth()
    print(f"[{time.strftime('%H:%M:%S')}] {gpu}: copy {bw / 1e12:.2f} TB/s", file=sys.stderr)
    results = {"gpu": gpu, "hbm_copy_bytes_per_s": bw, "rows": args.rows, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
        err = (gemv(x, w).float() - gemv_ref(x, w).float()).abs().max().item()
        nbytes = w.numel() * w.element_size()
        cublas = graph_time(lambda x=x, w=w: F.linear(x, w))
        default = graph_time(lambda x=x, w=w: gemv(x, w))
        best = (default, default_config(n, k))
        for values in itertools.product(*SWEEP.values()):
            cfg = dict(zip(SWEEP, values, strict=True))
            try:
                t = graph_time(lambda x=x, w=w, cfg=cfg: gemv(x, w, **cfg))
            except Exception as exc:  # a tile that does not fit (registers / shared memory)
                print(f"  {name} {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            if t < best[0]:
                best = (t, cfg)
        results["shapes"][name] = {
            "n": n,
            "k": k,
            "max_abs_err": err,
            "cublas_s": cublas,
            "gemv_default_s": default,
            "gemv_best_s": best[0],
            "best_config": best[1],
            "cublas_over_copy": nbytes / cublas / bw,
            "default_over_copy": nbytes / default / bw,
            "best_over_copy": nbytes / best[0] / bw,
        }
        print(f"[{time.strftime('%H:%M:%S')}] {name} done", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_gemv.json").write_text(json.dumps(results, indent=2))
    print(f"\n{gpu}, M={args.rows}, bf16; fraction of HBM copy bandwidth {bw / 1e12:.2f} TB/s")
    print(
        f"{'shape':<9}{'cuBLAS us':>10}{'/copy':>7}{'gemv us':>9}{'/copy':>7}{'best us':>9}"
        f"{'/copy':>7}  best config"
    )
    for name, r in results["shapes"].items():
        print(
            f"{name:<9}{r['cublas_s'] * 1e6:>10.1f}{r['cublas_over_copy']:>7.2f}"
            f"{r['gemv_default_s'] * 1e6:>9.1f}{r['default_over_copy']:>7.2f}"
            f"{r['gemv_best_s'] * 1e6:>9.1f}{r['best_over_copy']:>7.2f}  {r['best_config']}"
        )


if __name__ == "__main__":
    main()
