"""FP8 weights (``quantization="fp8"``) against bf16 weights on one GPU (issue 26, item 3).

Each figure is measured in this run, every engine in a child process of its own (a fresh CUDA
context, so one engine's memory cannot shrink the next one's budget):

1. decode ITL at batch 1 (512-token context, engine steps, graphs on) over each one's weights
   floor: the bytes a decode step reads of the weights (every parameter but the input embedding,
   of which a step reads one row) over the HBM copy rate measured in this run (aim: fp8 at most
   1.15x its floor), the batch-1 decode graph's replay alone, and ITL at batch 8; ``--gemv-off``
   adds fp8 with its small-batch products through ``torch._scaled_mm`` instead of the GEMVs,
   ``--mma-off`` with batch 1 through the Triton GEMV of kernels/fp8_gemv.py (2-8 through
   ``_scaled_mm``) instead of the CUDA tensor-core GEMV of kernels/fp8_gemv_mma.py,
   ``--splitk`` through the Triton tensor-core GEMV behind a quantizing kernel,
   ``--l2-prefetch MB`` with each batch-1 GEMV prefetching up to MB of its weights into L2
   before its PDL wait (an experiment: kernels/fp8_gemv_mma.py ``L2_PREFETCH_BYTES``);
2. offline throughput on vLLM's ShareGPT sample (benchmarks/data/vllm_sharegpt_llama3_1000.json
   and its .npz of token ids), all requests at once, engine defaults, ignore_eos (aim: fp8 at
   least 1.4x bf16), and each engine's KV pool (``--repeats N``: N runs in the same engine,
   the prefix cache reset before each, the median reported with the spread; identical single
   runs in fresh processes differed by up to 11 % on an H200); ``--kv8`` adds fp8 weights with
   fp8 KV
   (``kv_cache_dtype="fp8"``): at batch ~256 a step reads as much KV as weights;
   both on the Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy weights);
3. ``--big``: a model that does not serve from one H100 in bf16, served in fp8: Llama-3-70B's
   layer shapes (hidden 8192, 64 heads, 8 KV heads, intermediate 28672) at ``--big-layers``
   layers (default 40: 36.3 B parameters, 68 GiB in bf16, so at utilization 0.9 bf16 leaves
   no room for the KV pool; 80 layers is Llama-3-70B itself, for an H200), its ITL against its
   floor. The weights load in bf16 and are quantized a projection at a time (engine/quant.py),
   so the bf16 weights must fit the GPU while loading;
4. ``--ppl-model DIR``: perplexity of held-out ShareGPT answers with real weights (SmolLM2:
   ``tandem`` fetches it), fp8 weights against the model's dtype, teacher-forced exactly as
   benchmarks/gpu_kv_fp8.py scores them (same samples, same code). ``--device cpu`` runs this
   part alone on the CPU (fp32 model; torch's CPU ``_scaled_mm`` is the same kernel call).

    PYTHONPATH=$PWD python benchmarks/gpu_fp8_weights.py --out benchmarks/results/gpu_fp8_weights.json \\
        [--num-requests 1000] [--repeats N] [--kv8] [--gemv-off] [--mma-off] [--splitk]
        [--l2-prefetch MB]
        [--big [--big-layers 40]] [--ppl-model DIR]
    PYTHONPATH=$PWD python benchmarks/gpu_fp8_weights.py --device cpu --ppl-model \\
        ~/.cache/tandem/models/smollm2 --ppl-samples 16 --ppl-max-prompt 256 --ppl-max-answer 64 \\
        --out benchmarks/results/fp8_weights_ppl_cpu.json      # 5 min on 2 cores

Prints a table, writes JSON and a plot beside it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG_8B = ROOT / "benchmarks" / "configs" / "llama3-8b"
VLLM_SAMPLE = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
CONTEXT, ITL_STEPS = 512, 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def big_config(layers: int) -> dict:
    """Llama-3-70B's config at ``layers`` layers."""
    cfg = json.loads((CONFIG_8B / "config.json").read_text())
    cfg.update(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=layers,
    )
    return cfg


# -- one engine, in a child process ----------------------------------------------------------------


def weights_read_per_step(model) -> tuple[int, int]:
    """(bytes of every parameter, bytes a decode step reads: all but the input embedding
    unless it is tied to the LM head, which reads all of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed if hasattr(model.lm_head, "weight") else False
    return total, total - (0 if tied else embed.numel() * embed.element_size())


# the runs that send small batches another way: Fp8Linear's class-wide row limits
FP8_PATHS = {
    "fp8_cublas": {"gemv_max_rows": 0, "mma_max_rows": 0},  # batch 1-8 through _scaled_mm
    "fp8_triton": {"mma_max_rows": 0},  # batch 1 through the Triton GEMV, 2-8 _scaled_mm
    # batch 1: a quantizing kernel, then the Triton tensor-core GEMV
    "fp8_splitk": {"splitk_max_rows": 1, "mma_max_rows": 0, "gemv_max_rows": 0},
}


def engine_run(args: argparse.Namespace) -> dict:
    """One engine (``args.one``: ``bf16``, ``fp8`` or ``big``): its weights, ITL at batch 1
    against its floor, and (not ``big``) offline throughput on the vLLM ShareGPT sample."""
    from benchmarks.gpu_engine import decode_itl, graph_replay_s, throughput
    from benchmarks.workloads import read_workload
    from engine import LLM

    name = args.one
    model_dir = CONFIG_8B
    if name in FP8_PATHS:
        from engine.quant import Fp8Linear

        for attr, value in FP8_PATHS[name].items():
            setattr(Fp8Linear, attr, value)
    if name == "fp8_l2":  # the batch-1 GEMV prefetching weights into L2 before its PDL wait
        from kernels import fp8_gemv_mma

        fp8_gemv_mma.L2_PREFETCH_BYTES = int(args.l2_prefetch * 2**20)
    if name == "big":
        model_dir = Path(tempfile.mkdtemp(prefix="fp8-big-"))
        (model_dir / "config.json").write_text(json.dumps(big_config(args.big_layers)))
    t0 = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        quantization=None if name == "bf16" else "fp8",
        kv_cache_dtype="fp8" if name == "fp8_kv8" else "auto",
        gpu_memory_utilization=0.9,
    )
    runner = llm.engine.runner
    total, read = weights_read_per_step(runner.model)
    out = {
        "run": name,
        "model": "llama3-8b" if name != "big" else f"llama3-70b shape, {args.big_layers} layers",
        "quantization": runner.cfg.quantization,
        "kv_cache_dtype": runner.cfg.kv_cache_dtype,
        "start_s": time.perf_counter() - t0,
        "weight_bytes": total,
        "weight_bytes_read_per_step": read,
        "num_kv_blocks": runner.num_kv_blocks,
        "kv_budget_bytes": runner.memory_report.get("kv_budget"),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
    }
    log(f"{name}: engine up in {out['start_s']:.0f} s, weights {total / 2**30:.2f} GiB")
    times = decode_itl(llm, context=CONTEXT, steps=ITL_STEPS)
    out["itl_s"] = statistics.median(times)
    out["graph_replay_s"] = graph_replay_s(llm)
    out["itl_b8_s"] = statistics.median(decode_itl(llm, context=CONTEXT, steps=ITL_STEPS, batch=8))
    if name in ("bf16", "fp8", "fp8_kv8") and args.num_requests:
        items = read_workload(VLLM_SAMPLE)[: args.num_requests]
        prompts = [list(i.prompt_token_ids) for i in items]
        outputs = [i.output_len for i in items]
        log(f"{name}: warm-up, 100 of the requests (kernels compile outside the timed runs)")
        throughput(llm, prompts[:100], outputs[:100])
        runs = []
        for k in range(args.repeats):
            log(f"{name}: throughput {k + 1}/{args.repeats}, {len(prompts)} vLLM ShareGPT requests")
            # each run prefills its prompts: without this, a repeat hits the last run's prefixes
            if not llm.reset_prefix_cache():
                raise RuntimeError("prefix cache not reset: requests still unfinished")
            runs.append(throughput(llm, prompts, outputs))
        out["throughput"] = median_run(runs)
        if len(runs) > 1:
            out["throughput_runs"] = runs
    return out


def median_run(runs: list[dict]) -> dict:
    """The run of median output tokens per second (the lower middle one of an even count):
    one real run, not an average of several."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def spread(run: dict) -> str:
    """``median (min-max)`` output tok/s over a run's repeats, or the one figure."""
    tput = run.get("throughput", {}).get("output_tok_s")
    if tput is None:
        return "-"
    repeats = [r["output_tok_s"] for r in run.get("throughput_runs", [])]
    if len(repeats) < 2:
        return f"{tput:.0f}"
    return f"{tput:.0f} ({min(repeats):.0f}-{max(repeats):.0f})"


# -- perplexity with real weights --------------------------------------------------------------------


def perplexity(args: argparse.Namespace, quantization: str | None) -> dict:
    """Perplexity of the held-out answers with the weights as loaded or in fp8, scored by
    benchmarks/gpu_kv_fp8.py's teacher-forced path (KV in the model's dtype)."""
    from benchmarks.gpu_kv_fp8 import perplexity as score
    from benchmarks.gpu_kv_fp8 import sharegpt_samples
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.ppl_model)
    samples = sharegpt_samples(
        tokenizer, args.ppl_data, args.ppl_samples, args.ppl_max_prompt, args.ppl_max_answer
    )
    return score(
        args.ppl_model,
        args.device,
        samples,
        args.ppl_batch,
        dtype=args.ppl_dtype,
        quantization=quantization,
    )


# -- the parent: children, table, JSON, plot -------------------------------------------------------


def in_child(args: argparse.Namespace, one: str) -> dict:
    from benchmarks.gpu_engine import run_part

    extra = ["--num-requests", str(args.num_requests), "--big-layers", str(args.big_layers)]
    extra += ["--l2-prefetch", str(args.l2_prefetch), "--repeats", str(args.repeats)]
    return run_part(__file__, ["--one", one, *extra])


def with_floors(runs: dict[str, dict], hbm: float) -> None:
    for r in runs.values():
        r["floor_s"] = r["weight_bytes_read_per_step"] / hbm
        r["itl_over_floor"] = r["itl_s"] / r["floor_s"]
        if r.get("graph_replay_s"):
            r["graph_replay_over_floor"] = r["graph_replay_s"] / r["floor_s"]


def summary(result: dict) -> dict:
    runs, out = result.get("runs", {}), {}
    if "bf16" in runs and "fp8" in runs:
        b, f = runs["bf16"], runs["fp8"]
        out["weight_bytes_ratio"] = f["weight_bytes"] / b["weight_bytes"]
        out["itl_ratio"] = f["itl_s"] / b["itl_s"]
        out["kv_blocks_ratio"] = f["num_kv_blocks"] / b["num_kv_blocks"]
        if "throughput" in b and "throughput" in f:
            out["throughput_ratio"] = f["throughput"]["output_tok_s"] / b["throughput"]["output_tok_s"]  # fmt: skip
        kv8 = runs.get("fp8_kv8", {})
        if "throughput" in b and "throughput" in kv8:
            out["throughput_ratio_kv8"] = kv8["throughput"]["output_tok_s"] / b["throughput"]["output_tok_s"]  # fmt: skip
    ppl = result.get("ppl")
    if ppl:
        out["ppl_ratio"] = ppl["fp8"]["ppl"] / ppl["model_dtype"]["ppl"]
    return out


def print_table(result: dict) -> None:
    from benchmarks.gpu_engine import print_markdown

    hbm = result.get("hbm_copy_bytes_per_s")
    print(f"\n{result['device']}" + (f", HBM copy {hbm / 1e12:.2f} TB/s" if hbm else ""))
    rows = [("run", "weights GiB", "floor ms", "ITL ms", "ITL / floor", "graph / floor",
             "ITL b8 ms", "KV blocks", "out tok/s")]  # fmt: skip
    for r in result.get("runs", {}).values():
        replay, b8 = r.get("graph_replay_over_floor"), r.get("itl_b8_s")
        rows.append((f"{r['run']} ({r['model']})", f"{r['weight_bytes'] / 2**30:.2f}",
                     f"{r['floor_s'] * 1e3:.2f}", f"{r['itl_s'] * 1e3:.2f}",
                     f"{r['itl_over_floor']:.3f}x", f"{replay:.3f}x" if replay else "-",
                     f"{b8 * 1e3:.2f}" if b8 else "-", r["num_kv_blocks"], spread(r)))  # fmt: skip
    for name, p in (result.get("ppl") or {}).items():
        rows.append((f"perplexity {name} ({p['dtype']}, {p['tokens']} tokens)", "-", "-", "-",
                     f"{p['ppl']:.4f}", "-", "-", "-", "-"))  # fmt: skip
    print_markdown(rows)
    for key, value in result["fp8_over_bf16"].items():
        print(f"{key}: {value:.4f}")


def plot(result: dict, path: Path) -> None:
    """ITL and its floor per run; output tokens per second bf16 and fp8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(result.get("runs", {}).values())
    if not runs:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["run"] for r in runs]
    x = range(len(runs))
    ax1.bar([i - 0.2 for i in x], [r["itl_s"] * 1e3 for r in runs], 0.4, label="ITL (median)")
    ax1.bar([i + 0.2 for i in x], [r["floor_s"] * 1e3 for r in runs], 0.4, label="weights floor")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("ms per token, batch 1")
    ax1.legend()
    tput = [r for r in runs if "throughput" in r]
    ax2.bar([r["run"] for r in tput], [r["throughput"]["output_tok_s"] for r in tput])
    ax2.set_ylabel("output tok/s, vLLM ShareGPT sample")
    fig.suptitle(f"FP8 weights, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_fp8_weights.json"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--num-requests", type=int, default=1000, help="0: no throughput run")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="throughput runs per engine: the median is reported, with the spread",
    )
    ap.add_argument("--skip-speed", action="store_true", help="perplexity only")
    ap.add_argument("--big", action="store_true", help="also the model bf16 cannot serve")
    ap.add_argument("--big-layers", type=int, default=40, help="layers of the --big model")
    ap.add_argument("--ppl-model", default=None, metavar="DIR", help="a real HF model folder")
    ap.add_argument("--ppl-data", default=None, metavar="FILE", help="ShareGPT-style JSON")
    ap.add_argument("--ppl-samples", type=int, default=64, help="answers scored")
    ap.add_argument("--ppl-batch", type=int, default=16, help="answers scored at once")
    ap.add_argument("--ppl-max-prompt", type=int, default=1024, help="longer prompts skipped")
    ap.add_argument("--ppl-max-answer", type=int, default=256, help="answer tokens scored")
    ap.add_argument(
        "--ppl-dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="the model's dtype, fp8 projections' output too (default: bf16 on CUDA, fp32 on CPU)",
    )
    ap.add_argument("--gemv-off", action="store_true", help="also fp8 with batch 1 on cuBLAS")
    ap.add_argument("--kv8", action="store_true", help="also fp8 weights with fp8 KV")
    ap.add_argument(
        "--mma-off", action="store_true", help="also fp8 without the CUDA tensor-core GEMV"
    )
    ap.add_argument(
        "--splitk", action="store_true", help="also fp8 with batch 1 on fp8_gemv_splitk"
    )
    ap.add_argument(
        "--l2-prefetch",
        type=float,
        default=0.0,
        metavar="MB",
        help="also fp8 with each batch-1 GEMV prefetching MB of its weights into L2 (experiment)",
    )
    ap.add_argument(
        "--one",
        choices=(
            "bf16",
            "fp8",
            "fp8_kv8",
            "fp8_cublas",
            "fp8_triton",
            "fp8_splitk",
            "fp8_l2",
            "big",
        ),
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--part", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        Path(args.part).write_text(json.dumps(engine_run(args)))
        return
    if args.device == "cpu" and not args.ppl_model:
        raise SystemExit("--device cpu measures perplexity only: give --ppl-model DIR")
    result: dict = {
        "benchmark": "gpu_fp8_weights",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    if args.device == "cuda" and not args.skip_speed:
        from benchmarks.gpu_ceilings import hbm_copy_bandwidth

        hbm = hbm_copy_bandwidth()
        log(f"HBM copy {hbm / 1e12:.2f} TB/s")
        result["hbm_copy_bytes_per_s"] = hbm
        names = ["bf16", "fp8"] + ["fp8_kv8"] * args.kv8 + ["fp8_cublas"] * args.gemv_off
        names += ["fp8_triton"] * args.mma_off + ["fp8_splitk"] * args.splitk
        names += ["fp8_l2"] * (args.l2_prefetch > 0)
        names += ["big"] * args.big
        result["runs"] = {n: in_child(args, n) for n in names}
        with_floors(result["runs"], hbm)
    if args.ppl_model:
        result["ppl"] = {}
        for name, quantization in (("model_dtype", None), ("fp8", "fp8")):
            log(f"perplexity, weights {name}")
            result["ppl"][name] = perplexity(args, quantization)
    result["fp8_over_bf16"] = summary(result)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if result.get("runs"):
        plot(result, out.with_suffix(".png"))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
