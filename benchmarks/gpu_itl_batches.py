"""Decode ITL by batch size, Llama-3-8B shape (dummy weights), one engine a setting: the engine
step's wall time (``gpu_engine.decode_itl``: schedule, inputs, forward, sample) at each batch,
median of the steps after warm-up, against the weights + KV floor at the HBM copy rate measured
in the same run. For A/Bs of the small-batch FP8 paths (issue 26)::

    PYTHONPATH=$PWD python benchmarks/gpu_itl_batches.py --quantization fp8 --kv-cache-dtype fp8 \\
        --batches 1,2,4,8,16,32 --settings default,mma-pdl-quantized,no-norm-quant --out F

Settings: ``default``; ``mma-pdl-quantized`` (kernels/fp8_gemv_mma.py ``PDL_QUANTIZED_X``: the
2-8-row tensor-core GEMV launched with PDL); ``no-norm-quant`` (``Fp8Linear.fuse_norm_quant``
off: the norm and the quantizer as two kernels). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import hbm_copy_bandwidth  # noqa: E402
from benchmarks.gpu_engine import decode_itl, log, make_llm  # noqa: E402
from benchmarks.gpu_fp8_weights import big_config, weights_read_per_step  # noqa: E402

SETTINGS = ("default", "mma-pdl-quantized", "no-norm-quant")


def apply(setting: str) -> None:
    from engine.quant import Fp8Linear
    from kernels import fp8_gemv_mma

    fp8_gemv_mma.PDL_QUANTIZED_X = setting == "mma-pdl-quantized"
    Fp8Linear.fuse_norm_quant = 0 if setting == "no-norm-quant" else 1


def floor_ms(llm, batch: int, context: int, bandwidth: float) -> float:
    """The weights a step reads (``gpu_fp8_weights.weights_read_per_step``) plus the batch's KV
    bytes, over the copy rate."""
    runner = llm.engine.runner
    _, weights = weights_read_per_step(runner.model)
    cfg = runner.model.cfg
    kv_elem = 1 if runner.cfg.kv_cache_dtype == "fp8" else 2
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem
    return (weights + kv) / bandwidth * 1e3


def plot(results: dict, path: Path) -> None:
    """ITL against batch, a line a setting, and the floor (matplotlib where it is installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    settings = dict.fromkeys(r["setting"] for r in results["runs"])
    for setting in settings:
        runs = [r for r in results["runs"] if r["setting"] == setting]
        ax.plot([r["batch"] for r in runs], [r["itl_ms"] for r in runs], "o-", label=setting)
    first = [r for r in results["runs"] if r["setting"] == next(iter(settings))]
    ax.plot([r["batch"] for r in first], [r["floor_ms"] for r in first], "k--", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoding")
    ax.set_ylabel("ITL, ms")
    ax.set_title(results["device"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_itl_batches.json"))
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--settings", default="default")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--big-layers", type=int, default=0, help="Llama-3-70B's shape, N layers")
    args = ap.parse_args()
    settings = args.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        raise SystemExit(f"unknown settings {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = hbm_copy_bandwidth()
    log(f"HBM copy {bandwidth / 1e12:.2f} TB/s")
    results = {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "runs": []}
    for setting in settings:
        apply(setting)
        model = {}
        if args.big_layers:
            folder = Path(tempfile.mkdtemp(prefix="itl-big-"))
            (folder / "config.json").write_text(json.dumps(big_config(args.big_layers)))
            model = {"model": str(folder)}
        llm = make_llm(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, **model)
        for batch in batches:
            times = decode_itl(llm, args.context, args.steps, batch)
            itl = statistics.median(times) * 1e3
            floor = floor_ms(llm, batch, args.context, bandwidth)
            results["runs"].append(
                {"setting": setting, "batch": batch, "itl_ms": itl, "floor_ms": floor}
            )
            log(f"{setting} batch {batch}: {itl:.3f} ms ({itl / floor:.3f}x floor {floor:.3f})")
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    apply("default")
    shape = f"Llama-3-70B shape x {args.big_layers} layers" if args.big_layers else "Llama-3-8B"
    print(f"\n{results['device']}, {shape}, {args.quantization or 'bf16'} weights, KV {args.kv_cache_dtype}, "
          f"{args.context} tokens of context; ITL ms (x floor)")  # fmt: skip
    print("| batch | " + " | ".join(settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for batch in batches:
        cells = []
        for setting in settings:
            r = next(r for r in results["runs"] if r["setting"] == setting and r["batch"] == batch)
            cells.append(f"{r['itl_ms']:.3f} ({r['itl_ms'] / r['floor_ms']:.2f}x)")
        print(f"| {batch} | " + " | ".join(cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.out).with_suffix(".png"))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
