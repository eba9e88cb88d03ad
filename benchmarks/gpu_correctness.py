"""bf16 correctness of the CUDA path against transformers, on the real SmolLM2-135M-Instruct.

1. Greedy: 64 chat prompts, 32 new tokens each (``ignore_eos``), tandem bf16 against transformers
   bf16 ``generate`` (one prompt at a time, so no padding). Reports the exact-match fraction and,
   for each mismatch, the first divergent position and transformers' top-2 logit gap there (a
   near-tie that bf16's summation order can flip).
2. Teacher-forced log-probs: on tandem's own sequences, the log-prob tandem reported for each
   chosen token and for its top-5 alternatives, against transformers' log-softmax at the same
   positions in bf16 and in fp32. transformers bf16 against transformers fp32 is the bf16 noise
   floor the first comparison is judged by.

    python benchmarks/gpu_correctness.py [--model smollm2] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASKS = (
    "Explain in two sentences what {} is.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "What is the history of {}?",
    "How would you explain {} to a child?",
    "List the pros and cons of {}.",
    "Write a haiku about {}.",
    "Describe {} in one paragraph.",
)
TOPICS = (
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "the Python programming language",
    "coffee",
    "the Moon",
    "volcanoes",
    "the Internet",
)
NEW_TOKENS = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quantiles(values: torch.Tensor) -> dict:
    q = torch.tensor([0.5, 0.9, 0.99], dtype=values.dtype)
    p50, p90, p99 = torch.quantile(values, q).tolist()
    return {
        "mean": values.mean().item(),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": values.max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    import transformers

    from engine import LLM, SamplingParams
    from engine.model_hub import resolve_model

    path = resolve_model(args.model)
    gpu = torch.cuda.get_device_name()
    llm = LLM(str(path), dtype="bfloat16", device="cuda")
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": task.format(topic)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for task, topic in itertools.product(TASKS, TOPICS)
    ]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    log(f"{gpu}: tandem bf16, {len(prompts)} prompts x {NEW_TOKENS} tokens")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompt_ids, params)
    ours = [o.outputs[0] for o in outs]
    del llm
    torch.cuda.empty_cache()

    hf = {
        dt: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt).to("cuda").eval()
        for dt in (torch.bfloat16, torch.float32)
    }
    log("transformers bf16 generate, one prompt at a time")
    mismatches, exact, hf_self_exact = [], 0, 0
    chosen_bf16, chosen_fp32, top_bf16, hf_noise = [], [], [], []
    for i, (ids, out) in enumerate(zip(prompt_ids, ours, strict=True)):
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            ref = (
                hf[torch.bfloat16]
                .generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )[0, len(ids) :]
                .tolist()
            )
            # transformers against itself: its generate (KV cache, one row per matmul) against
            # the argmax of its own full-sequence forward (all rows at once) on that sequence.
            own = torch.tensor([ids + ref], device="cuda")
            own_argmax = hf[torch.bfloat16](own).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
            hf_self_exact += own_argmax == ref
            seq = torch.tensor([ids + list(out.token_ids)], device="cuda")
            lp = {
                dt: torch.log_softmax(m(seq).logits[0, len(ids) - 1 : -1].float(), -1)
                for dt, m in hf.items()
            }
        if ref == list(out.token_ids):
            exact += 1
        else:
            pos = next(j for j, (a, b) in enumerate(zip(ref, out.token_ids, strict=True)) if a != b)
            logits_at = lp[torch.bfloat16][pos]
            top2 = logits_at.topk(2).values
            mismatches.append(
                {
                    "prompt": i,
                    "first_divergent_position": pos,
                    "hf_top2_logprob_gap": (top2[0] - top2[1]).item(),
                }
            )
        tokens = torch.tensor(out.token_ids, device="cuda")
        chosen = [step[t] for step, t in zip(out.logprobs, out.token_ids, strict=True)]
        ours_lp = torch.tensor(chosen, device="cuda")
        for dt, bucket in ((torch.bfloat16, chosen_bf16), (torch.float32, chosen_fp32)):
            bucket.append((ours_lp - lp[dt].gather(1, tokens[:, None])[:, 0]).abs().cpu())
        for j, step in enumerate(out.logprobs):
            for t, v in step.items():
                top_bf16.append(abs(v - lp[torch.float32][j, t].item()))
        hf_noise.append(
            (lp[torch.bfloat16] - lp[torch.float32]).gather(1, tokens[:, None])[:, 0].abs().cpu()
        )

    result = {
        "gpu": gpu,
        "model": str(path),
        "prompts": len(prompts),
        "new_tokens": NEW_TOKENS,
        "greedy_exact_match": exact / len(prompts),
        "hf_generate_vs_hf_forward_exact_match": hf_self_exact / len(prompts),
        "mismatches": mismatches,
        "chosen_logprob_abs_diff_vs_hf_bf16": quantiles(torch.cat(chosen_bf16)),
        "chosen_logprob_abs_diff_vs_hf_fp32": quantiles(torch.cat(chosen_fp32)),
        "top5_logprob_abs_diff_vs_hf_fp32": quantiles(torch.tensor(top_bf16)),
        "hf_bf16_vs_hf_fp32_chosen_abs_diff": quantiles(torch.cat(hf_noise)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_correctness.json").write_text(json.dumps(result, indent=2))
    print(f"\nGPU {gpu}, SmolLM2 bf16, {len(prompts)} prompts x {NEW_TOKENS} tokens")
    print(
        f"greedy exact match      {exact}/{len(prompts)} = {exact / len(prompts):.3f}  (aim >= 0.9)"
    )
    print(f"transformers vs itself  {hf_self_exact}/{len(prompts)} (generate vs full forward)")
    for m in mismatches:
        print(
            f"  prompt {m['prompt']:>2}: first divergence at token {m['first_divergent_position']},"
            f" HF top-2 gap {m['hf_top2_logprob_gap']:.4f}"
        )
    for key in (
        "chosen_logprob_abs_diff_vs_hf_bf16",
        "chosen_logprob_abs_diff_vs_hf_fp32",
        "top5_logprob_abs_diff_vs_hf_fp32",
        "hf_bf16_vs_hf_fp32_chosen_abs_diff",
    ):
        q = result[key]
        print(
            f"{key:<40} mean {q['mean']:.4f} p50 {q['p50']:.4f} p90 {q['p90']:.4f} "
            f"p99 {q['p99']:.4f} max {q['max']:.4f}"
        )


if __name__ == "__main__":
    main()
