"""Runs the same workloads through vLLM's CPU build (the peer), in its own virtualenv.

Called by engine_cpu.py as ``VLLM_PYTHON benchmarks/peer_vllm.py WORKLOADS.json RESULT.json``;
it imports nothing from tandem. The recipe for the virtualenv is in ../shared/ANCHORS.md.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    workloads_path, result_path = sys.argv[1], sys.argv[2]
    with open(workloads_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        seed=0,
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        # On CPU this is the fraction of RAM vLLM reserves (weights + KV); its 0.92 default
        # does not fit beside the other processes of the run.
        gpu_memory_utilization=float(os.environ.get("PEER_MEMORY_FRACTION", "0.3")),
    )
    # Cold start to first token, as a user sees it (imports, engine start, one token).
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1))
    cold_start = time.perf_counter() - t0
    results = {"cold_start_s": cold_start, "workloads": {}}
    for name, items in spec["workloads"].items():
        prompts = [TokensPrompt(prompt_token_ids=i["prompt"]) for i in items]
        params = [
            SamplingParams(temperature=0.0, max_tokens=i["output_len"], ignore_eos=True)
            for i in items
        ]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results["workloads"][name] = {
            "seconds": dt,
            "output_tokens": tokens,
            "token_ids": [o.outputs[0].token_ids for o in outs],
        }
        print(f"vllm {name}: {tokens / dt:.1f} tok/s", file=sys.stderr, flush=True)
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    main()
