"""The step's launches and small kernels, on one GPU, each generation of them on and off
(issue 23, item 3; issue 26's FP8 ITL).

Llama-3-8B shape, dummy weights, engine defaults (bf16, or ``--quantization fp8``). The steps
of benchmarks/gpu_kernels.py, built by hand (disjoint block tables, 512 tokens of context):

    decode-1     one decode (the ITL case: the floor is the weights over the HBM copy rate)
    decode-256   256 decodes (weights + KV over the copy rate)
    mixed        the 256 decodes + one 2048-token prefill chunk (piecewise graphs; + the
                 chunk's matmul FLOPs over the measured bf16 rate)

The bf16 rate is measured twice: in a burst (``bf16_matmul_flops``, ~30 ms of work at the boost
clock) and sustained (``bf16_matmul_flops_sustained``: seconds of it, at the clock the board's
power limit holds), and each step gets a floor at each (decode floors count bytes only and are
the same). The steps are timed back to back for seconds, so the sustained floor is the like for
like one; the burst floor is the figure earlier stops reported. The mixed step also gets the
issue's words read literally: the measured decode-256 step (same variant and mode) plus the
chunk's matmul FLOPs, at either rate.

For each variant the graphs the step uses are captured again (the launch attribute and the
model's pieces are fixed at capture), then the step is timed under them two ways, in rounds that
alternate the variants (the host's pace drifts between runs):

    serial     median of ``--reps`` runs of ``ModelRunner.execute`` (inputs, forward, the
               sampler's read-back; nothing overlaps)
    pipelined  ``--reps`` steps as the engine runs them (async scheduling: step N+1 launched
               before N's tokens are read), wall time per step: the step's period in serving

Variants, each adding to the one before:

    base     every kernel launched after the last one drained, rotary and KV write apart,
             float32 logits, torch's argmax, SiLU-and-mul a kernel of its own
    pdl      kernels/pdl.py (each Triton kernel launched while the one before it ends) and
             rotary fused into the KV write (kernels/rotary.py): the last stop's default
    small    logits left in bf16 (no float32 copy), greedy's argmax in kernels/argmax.py, the
             batch-1 gate/up GEMV with SiLU-and-mul in its epilogue: the engine's default

    PYTHONPATH=$PWD python benchmarks/gpu_launch.py --out DIR/gpu_launch.json [--quantization fp8]

Prints a table (ms per step, against the floor and against base), writes JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import (  # noqa: E402
    bf16_matmul_flops,
    bf16_matmul_flops_sustained,
    hbm_copy_bandwidth,
)
from benchmarks.gpu_engine import log, make_llm  # noqa: E402
from benchmarks.gpu_kernels import BATCH, CHUNK, CONTEXT, Step  # noqa: E402
from benchmarks.gpu_step import (  # noqa: E402
    StepFactory,
    linear_flops,
    time_step,
    time_step_pipelined,
)

VARIANTS = {  # name: (PDL and the fused rotary, the small-kernel changes)
    "base": (False, False),
    "pdl": (True, False),
    "small": (True, True),
}
MODES = ("serial", "pipelined")
ISSUE_BARS = {"decode-1": 1.10, "decode-256": 1.15, "mixed": 1.15}  # issue 23's, drawn dashed


def set_variant(runner, name: str, steps: list[tuple]) -> float:
    """Switch ``runner`` to variant ``name`` and capture the graphs the steps use again;
    returns the capture's seconds."""
    from engine import sampler
    from engine.models.llama import LlamaForCausalLM
    from engine.ops import SkinnyLinear
    from engine.quant import Fp8Linear
    from kernels import pdl

    launch, small = VARIANTS[name]
    pdl.force(launch)
    runner.model.rope_in_attention = launch
    LlamaForCausalLM.float_logits = not small
    sampler.GREEDY_KERNEL = small
    SkinnyLinear.fuse_activation = Fp8Linear.fuse_activation = small
    t0 = time.perf_counter()
    sizes = sorted({len(s) for _, s, _ in steps if all(c.num_tokens == 1 for c in s)})
    runner.graphs.capture(sizes)
    pw = runner.piecewise
    for _, scheduled, _ in steps:
        n = sum(c.num_tokens for c in scheduled)
        if pw is not None and any(c.num_tokens > 1 for c in scheduled) and pw.fits(n):
            pw.capture([next(s for s in pw.sizes if s >= n)])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_launch.json"))
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--reps", type=int, default=30, help="timed runs of a step per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the variants")
    ap.add_argument("--steps", default="decode-1,decode-256,mixed")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS)
    )
    args = ap.parse_args()
    from engine.scheduler import SchedulerOutput

    bw, flops = hbm_copy_bandwidth(), bf16_matmul_flops()
    sustained = bf16_matmul_flops_sustained()
    log(f"HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s (burst), "
        f"{sustained / 1e12:.0f} sustained")  # fmt: skip
    llm = make_llm(
        max_num_seqs=BATCH,
        max_num_batched_tokens=CHUNK + BATCH,
        cuda_graph_max_tokens=CHUNK + BATCH,
        quantization=args.quantization,
    )
    runner = llm.engine.runner
    cfg = runner.model_cfg
    factory = StepFactory(runner.cfg.block_size, runner.num_kv_blocks)
    decodes = [factory.chunk(CONTEXT, 1) for _ in range(BATCH)]
    weight_bytes = sum(
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if "embed_tokens" not in name or cfg.tie_word_embeddings
    )
    every = {
        "decode-1": (decodes[:1], Step(cfg, weight_bytes, 1, CONTEXT, 0)),
        "decode-256": (decodes, Step(cfg, weight_bytes, BATCH, CONTEXT, 0)),
        "mixed": (
            decodes + [factory.chunk(0, CHUNK)],
            Step(cfg, weight_bytes, BATCH, CONTEXT, CHUNK),
        ),
    }
    steps = [(name, *every[name]) for name in args.steps.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    times = {(s[0], m): {v: [] for v in variants} for s in steps for m in MODES}
    capture_s: dict[str, float] = {}
    for r in range(args.rounds):
        for variant in variants:
            capture_s[variant] = set_variant(runner, variant, steps)
            for name, scheduled, _ in steps:
                out = SchedulerOutput(scheduled=scheduled)
                times[name, "serial"][variant].append(time_step(runner, out, args.reps))
                times[name, "pipelined"][variant].append(
                    time_step_pipelined(runner, out, args.reps)
                )
            log(
                f"round {r + 1}/{args.rounds} {variant}: "
                + ", ".join(
                    f"{n} {times[n, 'serial'][variant][-1] * 1e3:.3f} / "
                    f"{times[n, 'pipelined'][variant][-1] * 1e3:.3f} ms"
                    for n, *_ in steps
                )
            )
    set_variant(runner, "small", [])  # (the defaults back)
    rows = []
    for name, _, arith in steps:
        floor, floor_sustained = arith.floor(bw, flops), arith.floor(bw, sustained)
        for mode in MODES:
            base = min(times[name, mode][variants[0]])
            for variant in variants:
                best = min(times[name, mode][variant])
                row = {
                    "step": name,
                    "mode": mode,
                    "variant": variant,
                    "ms": best * 1e3,
                    "rounds_ms": [t * 1e3 for t in times[name, mode][variant]],
                    "floor_ms": floor * 1e3,
                    "over_floor": best / floor,
                    "floor_sustained_ms": floor_sustained * 1e3,
                    "over_floor_sustained": best / floor_sustained,
                    "vs_first": best / base,
                }
                if arith.chunk and ("decode-256", mode) in times:
                    # the issue's words: the decode step (measured) + the chunk's matmul FLOPs
                    decode = min(times["decode-256", mode][variant])
                    chunk_flops = linear_flops(arith.cfg, arith.chunk)
                    chunk, chunk_sustained = chunk_flops / flops, chunk_flops / sustained
                    row["decode_plus_chunk_ms"] = (decode + chunk) * 1e3
                    row["over_decode_plus_chunk"] = best / (decode + chunk)
                    row["over_decode_plus_chunk_sustained"] = best / (decode + chunk_sustained)
                rows.append(row)
    print(f"\n{torch.cuda.get_device_name()}, Llama-3-8B shape, {args.quantization or 'bf16'}")
    print("| step | timed | variant | ms (best round) | rounds | floor ms (burst, sustained) | "
          "/ floor (burst, sustained) | / first |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for row in rows:
        rounds = " ".join(f"{t:.3f}" for t in row["rounds_ms"])
        print(
            f"| {row['step']} | {row['mode']} | {row['variant']} | {row['ms']:.3f} | {rounds} | "
            f"{row['floor_ms']:.2f}, {row['floor_sustained_ms']:.2f} | "
            f"{row['over_floor']:.3f}x, {row['over_floor_sustained']:.3f}x | {row['vs_first']:.3f} |"
        )
    for row in rows:
        if "decode_plus_chunk_ms" in row:
            print(f"{row['step']} {row['mode']} {row['variant']}: / (decode-256 as measured + the "
                  f"chunk's matmul FLOPs) {row['over_decode_plus_chunk']:.3f}x at the burst rate, "
                  f"{row['over_decode_plus_chunk_sustained']:.3f}x sustained")  # fmt: skip
    result = {
        "benchmark": "gpu_launch",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(),
        "quantization": args.quantization,
        "hbm_copy_bytes_per_s": bw,
        "bf16_flops": flops,
        "bf16_flops_sustained": sustained,
        "weight_bytes_read": weight_bytes,
        "capture_s": capture_s,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    log(f"wrote {out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(dict.fromkeys(r["step"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(steps), figsize=(4.5 * len(steps), 3.4), squeeze=False)
    for ax, step in zip(axes[0], steps, strict=True):
        rows = [r for r in result["rows"] if r["step"] == step]
        colors = ["tab:gray" if r["mode"] == "serial" else "tab:blue" for r in rows]
        labels = [f"{r['variant']}\n{r['mode'][:4]}" for r in rows]
        ax.bar(labels, [r["over_floor"] for r in rows], color=colors)
        sustained = [r.get("over_floor_sustained", r["over_floor"]) for r in rows]
        if sustained != [r["over_floor"] for r in rows]:  # the chunk's FLOPs at either rate
            ax.plot(labels, sustained, "k_", ms=18, mew=2, label="at the sustained rate")
            ax.legend(fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        if step in ISSUE_BARS:
            ax.axhline(ISSUE_BARS[step], color="tab:red", ls="--", lw=0.8)
        ax.set_title(f"{step} ({rows[0]['floor_ms']:.2f} ms floor)")
        ax.set_ylabel("step / floor")
        ax.set_ylim(0.9, max(r["over_floor"] for r in rows) * 1.05)
        for i, r in enumerate(rows):
            ax.text(i, r["over_floor"], f"{r['ms']:.2f}", ha="center", va="bottom", fontsize=8)
    q = result["quantization"] or "bf16"
    fig.suptitle(f"Launch modes, Llama-3-8B shape {q}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
