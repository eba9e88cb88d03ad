"""Engine throughput on CPU: tandem vs transformers ``generate`` (and vLLM's CPU build), one run.

Workloads (SmolLM2-135M-Instruct, fp32, greedy, outputs forced to length with ignore_eos):
  same16 / same64  16 or 64 prompts of 128 real-text tokens, 64 new tokens each
  mixed            64 ShareGPT first turns, prompts clipped to 512 and outputs to 128 tokens;
                   HF runs static left-padded batches of 16, each to its longest output

Usage:
  python benchmarks/engine_cpu.py [--vllm-python /path/to/venv/bin/python] [--workloads ...]

Prints a table, writes benchmarks/results/engine_cpu.json and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import Item, fixed_shape, sharegpt_mixed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HF_BATCH = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_workloads(tokenizer, names: list[str]) -> dict[str, list[Item]]:
    makers = {
        "same16": lambda: fixed_shape(tokenizer, 16, 128, 64),
        "same64": lambda: fixed_shape(tokenizer, 64, 128, 64),
        "mixed": lambda: sharegpt_mixed(tokenizer, 64, max_prompt=512, max_output=128),
    }
    return {n: makers[n]() for n in names}


def run_tandem(model_dir: str, workloads: dict[str, list[Item]]) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    out = {}
    for name, items in workloads.items():
        params = [
            SamplingParams(temperature=0.0, max_tokens=i.output_len, ignore_eos=True) for i in items
        ]
        t = time.perf_counter()
        res = llm.generate([i.prompt_token_ids for i in items], params)
        dt = time.perf_counter() - t
        tokens = sum(len(r.outputs[0].token_ids) for r in res)
        out[name] = {
            "seconds": dt,
            "output_tokens": tokens,
            "token_ids": [r.outputs[0].token_ids for r in res],
        }
        log(f"tandem {name}: {tokens / dt:.1f} tok/s")
    return out


def run_hf(model_dir: str, workloads: dict[str, list[Item]], pad_id: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = {}
    for name, items in workloads.items():
        batch = len(items) if name.startswith("same") else HF_BATCH
        t = time.perf_counter()
        token_ids = []
        for start in range(0, len(items), batch):
            token_ids += _hf_batch(model, items[start : start + batch], pad_id)
        dt = time.perf_counter() - t
        useful = sum(i.output_len for i in items)
        out[name] = {"seconds": dt, "output_tokens": useful, "token_ids": token_ids}
        log(f"hf {name}: {useful / dt:.1f} useful tok/s")
    return out


def _hf_batch(model, items: list[Item], pad_id: int) -> list[list[int]]:
    """One static batch, left-padded, run until its longest output (shorter ones are wasted)."""
    width = max(len(i.prompt_token_ids) for i in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, item in enumerate(items):
        n = len(item.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(item.prompt_token_ids)
        mask[row, width - n :] = 1
    steps = max(i.output_len for i in items)
    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return [gen[r, width : width + i.output_len].tolist() for r, i in enumerate(items)]


def run_vllm(python: str, model_dir: str, workloads: dict[str, list[Item]], max_len: int) -> dict:
    spec = {
        "model": model_dir,
        "max_model_len": max_len,
        "workloads": {
            n: [{"prompt": i.prompt_token_ids, "output_len": i.output_len} for i in items]
            for n, items in workloads.items()
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(
            os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CACHE_ROOT=str(Path(tmp, "c"))
        )
        script = Path(__file__).resolve().parent / "peer_vllm.py"
        subprocess.run([python, str(script), str(spec_path), str(result_path)], env=env, check=True)
        return json.loads(result_path.read_text())


def cold_start_tandem() -> float:
    """Wall time of a fresh process: import, load SmolLM2, one generated token."""
    code = (
        "from engine import LLM, SamplingParams;"
        "LLM('smollm2').generate('Hello', SamplingParams(max_tokens=1))"
    )
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1]
    )
    return time.perf_counter() - t


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def summarise(workloads, systems: dict[str, dict]) -> dict:
    table = {}
    for name in workloads:
        row = {}
        hf = systems["hf"][name]
        hf_rate = hf["output_tokens"] / hf["seconds"]
        for sys_name, res in systems.items():
            r = res[name]
            rate = r["output_tokens"] / r["seconds"]
            row[sys_name] = {
                "tok_per_s": round(rate, 2),
                "seconds": round(r["seconds"], 2),
                "vs_hf": round(rate / hf_rate, 3),
                "greedy_agreement_with_hf": agreement(r["token_ids"], hf["token_ids"]),
                # HF's left-padded batches change fp32 rounding, so long greedy runs can part
                # from the unpadded ones; tandem and vLLM both run unpadded.
                "greedy_agreement_with_tandem": agreement(
                    r["token_ids"], systems["tandem"][name]["token_ids"]
                )
                if "tandem" in systems
                else None,
            }
        table[name] = row
    return table


def print_table(table: dict, cold: dict) -> None:
    systems = list(next(iter(table.values())))
    print(f"\n{'workload':<10}" + "".join(f"{s + ' tok/s':>16}{s + '/hf':>10}" for s in systems))
    for name, row in table.items():
        cells = "".join(f"{row[s]['tok_per_s']:>16.1f}{row[s]['vs_hf']:>10.2f}" for s in systems)
        print(f"{name:<10}{cells}")
    print("cold start to first token: " + ", ".join(f"{k} {v:.1f} s" for k, v in cold.items()))


def plot(table: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    names = list(table)
    systems = list(table[names[0]])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(systems)
    for k, s in enumerate(systems):
        xs = [i + k * width for i in range(len(names))]
        ax.bar(xs, [table[n][s]["tok_per_s"] for n in names], width, label=s)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("output tokens/s (useful)")
    ax.set_title("SmolLM2-135M fp32, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workloads", nargs="+", default=["same16", "same64", "mixed"])
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu (optional)")
    ap.add_argument(
        "--systems",
        nargs="+",
        default=["tandem", "hf", "vllm"],
        help="which to run (vllm only with --vllm-python); ratios need hf",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.model_hub import resolve_model
    from engine.tokenizer import load_tokenizer

    model_dir = str(resolve_model(args.model))
    tokenizer = load_tokenizer(model_dir)
    log("building workloads from ShareGPT")
    workloads = build_workloads(tokenizer, args.workloads)
    systems, cold = {}, {}
    if "tandem" in args.systems:
        cold["tandem"] = cold_start_tandem()
        log(f"tandem cold start {cold['tandem']:.1f} s")
        systems["tandem"] = run_tandem(model_dir, workloads)
    if "hf" in args.systems:
        systems["hf"] = run_hf(model_dir, workloads, tokenizer.pad_token_id or 0)
    if args.vllm_python and "vllm" in args.systems:
        log("starting vLLM (CPU build); it compiles on start, 2-3 minutes")
        peer = run_vllm(args.vllm_python, model_dir, workloads, max_len=1024)
        systems["vllm"] = peer["workloads"]
        cold["vllm"] = peer["cold_start_s"]
    if "hf" not in systems:
        for name, res in systems.items():
            for w, r in res.items():
                print(f"{name} {w}: {r['output_tokens'] / r['seconds']:.1f} tok/s")
        return
    table = summarise(workloads, systems)
    print_table(table, cold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": args.model,
        "dtype": "float32",
        "threads": args.threads,
        "cpu": _cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "workload_sizes": {n: len(w) for n, w in workloads.items()},
    }
    args.out.write_text(
        json.dumps({"meta": meta, "cold_start_s": cold, "results": table}, indent=2)
    )
    plot(table, args.out.with_suffix(".png"))
    log(f"wrote {args.out}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
