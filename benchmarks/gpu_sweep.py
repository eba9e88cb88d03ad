"""The engine's GPU defaults, chosen by measurement (issue 23, item 4): offline throughput of
1000 requests of ShareGPT lengths (benchmarks/data/sharegpt_llama3_lengths.json, 110 in / 275
out on average, all at once, greedy, ignore_eos) at the Llama-3-8B shape (dummy bf16 weights)
for a grid of ``max_num_seqs`` x ``max_num_batched_tokens``, everything else at the engine's
defaults (decode graphs up to ``max_num_seqs``, piecewise graphs up to 2048 tokens).

One engine per configuration in one process (each freed before the next); a short warm-up run
first compiles the Triton kernels, so no configuration pays for them. Every run draws fresh
prompt token ids (same lengths), so nothing is a prefix hit of an earlier run. Prints a table,
writes ``gpu_sweep.json`` and a plot of throughput against the token budget, one line per
``max_num_seqs``.

    PYTHONPATH=$PWD python benchmarks/gpu_sweep.py --out DIR [--seqs 256,512]
        [--budgets 2048,4096,8192] [--num-requests 1000]
        [--quantization fp8] [--kv-cache-dtype fp8]    # passed to every engine, the warm-up too
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import log, make_llm, throughput  # noqa: E402
from benchmarks.workloads import SHAREGPT_LENGTHS, read_workload  # noqa: E402


def prompts_for(lengths: list[tuple[int, int]], seed: int) -> list[list[int]]:
    """Fresh token ids at these lengths (nothing a prefix hit of another run)."""
    rng = random.Random(seed)
    return [[rng.randrange(128, 128000) for _ in range(p)] for p, _ in lengths]


def one(seqs: int, budget: int, lengths, seed: int, prompts=None) -> dict:
    """One configuration's run; its engine (weights, KV pool, graphs) is freed on return."""
    r = _run(seqs, budget, lengths, prompts or prompts_for(lengths, seed))
    check_freed()
    return r


def check_freed() -> None:
    """After an engine is dropped: its memory is back, or the next run would not compare."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    log(f"after freeing: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    if free < 0.8 * total:
        raise SystemExit("the last engine's memory was not freed: the next would not be comparable")


# --quantization / --kv-cache-dtype: passed to every engine of the run
ENGINE_ARGS: dict = {}


def _run(seqs: int, budget: int, lengths, prompts: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    if seqs == 0:  # the engine's own defaults for the device (EngineConfig.DEVICE_DEFAULTS)
        llm = make_llm(max_num_seqs=None, max_num_batched_tokens=None, cuda_graph_max_batch=None,
                       **ENGINE_ARGS)  # fmt: skip
    else:
        llm = make_llm(max_num_seqs=seqs, max_num_batched_tokens=budget, cuda_graph_max_batch=seqs,
                       **ENGINE_ARGS)  # fmt: skip
    start_s = time.perf_counter() - t0
    engine = llm.engine
    steps = [0]
    inner = engine.step

    def counted():
        steps[0] += 1
        return inner()

    engine.step = counted
    try:
        r = throughput(llm, prompts, [o for _, o in lengths])
    finally:
        del engine.step  # no engine -> closure -> engine cycle left behind
    return r | {
        "max_num_seqs": engine.cfg.max_num_seqs if seqs == 0 else seqs,
        "max_num_batched_tokens": engine.cfg.max_num_batched_tokens if seqs == 0 else budget,
        "engine_defaults": seqs == 0,
        "start_s": start_s,
        "steps": steps[0],
        "kv_blocks": engine.runner.num_kv_blocks,
        **ENGINE_ARGS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--seqs", default="256,512")
    ap.add_argument("--budgets", default="2048,4096,8192")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="a workloads.py file (e.g. benchmarks/data/vllm_sharegpt_llama3_1000.json): its "
        "prompts and output lengths instead of the ShareGPT-lengths file",
    )
    ap.add_argument("--defaults", action="store_true", help="also a run at the engine defaults")
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--kv-cache-dtype", default=None, choices=(None, "auto", "fp8"))
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up run (Triton's kernel cache is already warm on this machine)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for key in ("quantization", "kv_cache_dtype"):
        if getattr(args, key) is not None:
            ENGINE_ARGS[key] = getattr(args, key)
    source = args.workload or ROOT / "benchmarks" / SHAREGPT_LENGTHS
    if args.workload is not None:
        items = read_workload(args.workload)[: args.num_requests]
        lengths = [(len(i.prompt_token_ids), i.output_len) for i in items]
        prompts = [list(i.prompt_token_ids) for i in items]  # the file's own, every run
    else:
        lengths = json.loads(source.read_text())["lengths"][: args.num_requests]
        prompts = None  # fresh ids per run
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "workload": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source),
        "requests": len(lengths),
        **ENGINE_ARGS,
        "runs": [],
    }

    def save() -> None:
        (args.out / "gpu_sweep.json").write_text(json.dumps(result, indent=2))

    if not args.no_warmup:
        log(f"{result['gpu']}: warm-up (Triton compiles), 100 requests")
        one(256, 2048, lengths[:100], seed=1)
    seed = 10
    if args.defaults:
        log("the engine's defaults")
        result["runs"].append(one(0, 0, lengths, seed, prompts))
        save()
    for seqs in [int(s) for s in args.seqs.split(",")]:
        for budget in [int(b) for b in args.budgets.split(",")]:
            seed += 1
            log(f"max_num_seqs {seqs}, max_num_batched_tokens {budget}")
            result["runs"].append(one(seqs, budget, lengths, seed, prompts))
            save()
    print_table(result)
    plot(result, args.out / "gpu_sweep.png")


def print_table(r: dict) -> None:
    weights = "fp8 weights" if r.get("quantization") == "fp8" else "bf16"
    kv = ", fp8 KV" if r.get("kv_cache_dtype") == "fp8" else ""
    print(f"\n{r['gpu']}, {r['requests']} requests of {r['workload']}, Llama-3-8B shape, "
          f"{weights}{kv}")  # fmt: skip
    print(
        "| max_num_seqs | max_num_batched_tokens | req/s | out tok/s | steps | KV blocks | start s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for x in r["runs"]:
        print(
            f"| {x['max_num_seqs']} | {x['max_num_batched_tokens']} | {x['req_s']:.1f} | "
            f"{x['output_tok_s']:,.0f} | {x['steps']} | {x['kv_blocks']} | {x['start_s']:.0f} |"
        )


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for seqs in sorted({x["max_num_seqs"] for x in r["runs"]}):
        runs = sorted(
            (x for x in r["runs"] if x["max_num_seqs"] == seqs),
            key=lambda x: x["max_num_batched_tokens"],
        )
        ax.plot(
            [x["max_num_batched_tokens"] for x in runs],
            [x["output_tok_s"] for x in runs],
            marker="o",
            label=f"max_num_seqs {seqs}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_batched_tokens")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"tandem offline, {Path(r['workload']).stem}, Llama-3-8B shape\n{r['gpu']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
