"""Batch-1 decode GEMVs at the Llama-3-8B shapes: cuBLAS (``F.linear``) against kernels/gemv.py
over a sweep of tiles, each timed as 20 calls replayed from one CUDA graph (no launch overhead;
the GEMVs launched as the engine launches them, with kernels/pdl.py where the GPU has it), as
achieved weight bytes/s over the HBM copy bandwidth measured in the same run.

``--cold`` (the default): the 20 calls go round enough copies of the weight (at least 160 MB of
them) that none is still in L2 when it is read again, as in a decode step, where the 50 MB L2
never holds the next layer's weights. Warm (``--warm``), the small shapes read partly from L2
and come out above the copy rate (o_proj 1.66x in the first sweep). ``--wide`` sweeps more tiles
(1-2 rows a program, 2048-column runs, 2 stages).

``--fp8`` times the FP8 GEMV with its input as each mode of ``--fp8-input`` gives it, one result
file each: ``quantizing`` (x in bf16, quantized inside the GEMV: batch-1 decode's path) and
``e4m3`` (x already quantized, one byte an element: what the GEMV would cost if the kernel that
writes x quantized it) and ``splitk`` (x already quantized, through ``fp8_gemv_splitk``: the
weights on tensor cores, K split over programs; its own sweep) and ``mma`` (x in bf16, the CUDA
tensor-core GEMV of kernels/fp8_gemv_mma.py, the engine's path for 1-8 rows; its own sweep). ``--no-sweep`` times the default tiles alone.

    python benchmarks/gpu_gemv.py [--rows 1] [--out DIR] [--warm] [--wide] [--fp8]
        [--fp8-input quantizing,e4m3,splitk,mma] [--no-sweep]
    python benchmarks/gpu_gemv.py --replot RESULT.json     # its plot again, no GPU needed

Writes JSON and a plot beside it: each shape's fraction of the copy rate for cuBLAS, the
default tiles and the best of the sweep, and every tile of the sweep as a dot.
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
    # Llama-3-70B's (``--shapes qkv_70b,o_proj_70b,gate_up_70b,down_70b``)
    "qkv_70b": (10240, 8192),
    "o_proj_70b": (8192, 8192),
    "gate_up_70b": (57344, 8192),
    "down_70b": (8192, 28672),
}
SWEEP = {
    "block_n": (4, 8, 16),
    "block_k": (256, 512, 1024),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}


WIDE = {
    "block_n": (1, 2, 4, 8),
    "block_k": (512, 1024, 2048, 4096),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}
MMA = {  # --fp8-input mma: kernels/fp8_gemv_mma.py's CUDA tensor-core GEMV
    "warps": (4, 8, 16),
    "unroll": (1, 2, 4, 8),
    "rt": (1, 2),
}
SPLITK = {  # --fp8-input splitk: kernels/fp8_gemv.py's tensor-core GEMV
    "block_n": (64, 128),
    "block_k": (128, 256, 512),
    "split_k": (1, 2, 4, 8),
    "num_warps": (4,),
    "num_stages": (3, 5),
}
COLD_BYTES = 160 * 2**20  # weights the calls go round: over 3x an H100's or H200's L2


def graph_time(fn, weights: list, calls: int = 20) -> float:
    """Seconds per call of ``fn(w)`` replayed from a graph of ``calls`` calls over
    ``weights`` in turn."""
    fn(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    return time_cuda(graph.replay, reps=10) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--warm", action="store_true", help="one weight copy: L2 may hold it")
    ap.add_argument("--wide", action="store_true", help="the wider tile sweep")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights (kernels/fp8_gemv.py)")
    ap.add_argument("--fp8-input", default="quantizing", help="quantizing,e4m3,splitk,mma (--fp8)")
    ap.add_argument("--no-sweep", action="store_true", help="the default tiles only")
    ap.add_argument("--replot", type=Path, help="draw a saved result's plot and stop")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    sweep = {} if args.no_sweep else WIDE if args.wide else SWEEP
    gpu = torch.cuda.get_device_name()
    bw = hbm_copy_bandwidth()
    print(f"[{time.strftime('%H:%M:%S')}] {gpu}: copy {bw / 1e12:.2f} TB/s", file=sys.stderr)
    for mode in args.fp8_input.split(",") if args.fp8 else [None]:
        own = {"splitk": SPLITK, "mma": MMA}.get(mode)
        run_one(args, own if own and sweep else sweep, gpu, bw, mode)


def fp8_runner(mode: str, x: torch.Tensor, scale: torch.Tensor):
    """``run(x, w, **cfg)``: the FP8 GEMV fed as ``mode`` gives it (module docstring)."""
    from kernels.fp8_gemv import fp8_gemv, fp8_gemv_quantizing, fp8_gemv_splitk
    from kernels.fp8_quant import quantize_per_token

    if mode == "splitk":
        xq, xs = quantize_per_token(x)
        return lambda x, w, **cfg: fp8_gemv_splitk(xq, xs, w, scale, None, torch.bfloat16, **cfg)
    if mode == "mma":
        from kernels.fp8_gemv_mma import fp8_gemv_mma

        return lambda x, w, **cfg: fp8_gemv_mma(x, w, scale, None, **cfg)
    if mode == "e4m3":
        xq, xs = quantize_per_token(x)
        return lambda x, w, **cfg: fp8_gemv(xq, xs, w, scale, None, torch.bfloat16, **cfg)
    if mode != "quantizing":
        raise SystemExit(f"--fp8-input: unknown mode {mode!r}")
    return lambda x, w, **cfg: fp8_gemv_quantizing(x, w, scale, None, torch.bfloat16, **cfg)


def run_one(args, sweep: dict, gpu: str, bw: float, mode: str | None) -> None:
    """Every shape of ``--shapes``: cuBLAS (bf16), the default tiles, the sweep; one file."""
    results = {
        "gpu": gpu,
        "hbm_copy_bytes_per_s": bw,
        "rows": args.rows,
        "cold": not args.warm,
        "fp8": args.fp8,
        "fp8_input": mode,
        "sweep": sweep,
        "shapes": {},
    }
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
        run, ref = gemv, w
        if mode:  # e4m3 rows and their scales; x as the mode gives it
            from kernels.fp8_quant import FP8

            scale = (w.float().abs().amax(dim=1) / 448).reshape(1, -1).contiguous()
            w = (w.float() / scale.reshape(-1, 1)).to(FP8)
            ref = w.float() * scale.reshape(-1, 1)
            run = fp8_runner(mode, x, scale)

        nbytes = w.numel() * w.element_size()
        copies = 1 if args.warm else max(2, -(-COLD_BYTES // nbytes))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        err = (run(x, w).float() - gemv_ref(x.float(), ref.float())).abs().max().item()
        cublas = graph_time(lambda w, x=x: F.linear(x, w), ws) if not args.fp8 else float("nan")
        default = graph_time(lambda w, x=x, run=run: run(x, w), ws)
        from kernels import pdl

        pdl_on = pdl.enabled(w.device)
        best = (default, default_config(n, k, w.element_size(), pdl_on))
        if mode == "splitk":
            from kernels.fp8_gemv import splitk_config

            best = (default, splitk_config(args.rows, n, k))
        if mode == "mma":
            from kernels.fp8_gemv_mma import default_config as mma_config

            best = (default, mma_config(n, k, gated=False))
        every = []
        for values in itertools.product(*sweep.values()) if sweep else ():
            cfg = dict(zip(sweep, values, strict=True))
            try:
                t = graph_time(lambda w, x=x, cfg=cfg, run=run: run(x, w, **cfg), ws)
            except Exception as exc:  # a tile that does not fit (registers / shared memory)
                print(f"  {name} {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            every.append({**cfg, "s": t})
            if t < best[0]:
                best = (t, cfg)
        results["shapes"][name] = {
            "n": n,
            "k": k,
            "weight_copies": copies,
            "max_abs_err": err,
            "cublas_s": cublas,
            "gemv_default_s": default,
            "gemv_best_s": best[0],
            "best_config": best[1],
            "cublas_over_copy": nbytes / cublas / bw,
            "default_over_copy": nbytes / default / bw,
            "best_over_copy": nbytes / best[0] / bw,
            "every": every,
        }
        print(f"[{time.strftime('%H:%M:%S')}] {name} done", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    fp8 = f"_fp8{'' if mode == 'quantizing' else '_' + mode}" if mode else ""
    name = f"gpu_gemv{fp8}{'' if args.warm else '_cold'}.json"
    (args.out / name).write_text(json.dumps(results, indent=2))
    plot(results, (args.out / name).with_suffix(".png"))
    dtype = f"fp8 weights, x {mode}" if mode else "bf16"
    print(f"\n{gpu}, M={args.rows}, {dtype}; fraction of HBM copy bandwidth {bw / 1e12:.2f} TB/s")
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
    per_step = {"lm_head": 1}  # every other shape: once a layer, 32 layers
    saved = sum(
        (r["gemv_default_s"] - r["gemv_best_s"]) * per_step.get(name, 32)
        for name, r in results["shapes"].items()
    )
    print(f"a batch-1 step of 32 layers with the best tiles: {saved * 1e6:.0f} us less")


def plot(results: dict, path: Path) -> None:
    """Per shape: cuBLAS, the default tiles and the sweep's best as bars (fraction of the HBM
    copy rate), every swept tile as a grey dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw, shapes = results["hbm_copy_bytes_per_s"], results["shapes"]
    names = list(shapes)
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
    width = 0.26
    for j, (key, label, color) in enumerate(
        (
            ("cublas_over_copy", "cuBLAS", "tab:gray"),
            ("default_over_copy", "default tiles", "tab:blue"),
            ("best_over_copy", "best swept", "tab:green"),
        )
    ):
        ax.bar([i + (j - 1) * width for i in range(len(names))],
               [shapes[n].get(key) or 0.0 for n in names], width, label=label, color=color)  # fmt: skip
    for i, n in enumerate(names):
        r = shapes[n]
        fp8 = results.get("fp8", "fp8" in path.name)  # (results before the key: by name)
        nbytes = r["n"] * r["k"] * (1 if fp8 else 2)
        ys = [nbytes / e["s"] / bw for e in r.get("every", [])]
        ax.scatter([i + width] * len(ys), ys, s=4, color="k", alpha=0.25, zorder=3)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), [f"{n}\n{shapes[n]['n']}x{shapes[n]['k']}" for n in names])
    ax.set_ylabel("weight bytes/s / HBM copy rate")
    cold = "weights cold in L2" if results.get("cold") else "one weight (L2 may hold it)"
    x_in = f", fp8 x {results['fp8_input']}" if results.get("fp8_input") else ""
    ax.set_title(f"Batch-{results['rows']} GEMV, {results['gpu']}, {cold}{x_in}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
