"""The native CPU kernels on this machine (issue 23, item 6): a table and a JSON file.

    python benchmarks/cpu_kernels.py [--model DIR] [--rounds 3] [--out results/cpu_kernels.json]

1. Paged decode attention (kernels/cpu/paged_decode_attention.cpp), SmolLM2's heads (9 query
   heads over 3 KV heads of 64), fp32: milliseconds per call and the KV bytes read per second,
   with each sequence's blocks in order ("contiguous") and scattered over the pool ("scattered",
   as a long-running engine's tables are). Thirty layers' caches are cycled, so each call reads
   from memory, not from the last call's cache lines.
2. The decoder's elementwise layers: the same engine with ``TorchOps`` and with ``CpuOps``
   (engine/ops.py) swapped in, alternating, on a 2,048-token prefill step (8 x 256) and decode
   steps at batch 1 (1,500 tokens of context) and 64 (400 tokens). Best of ``--rounds``.
3. Causal prefill attention (kernels/cpu/prefill_attention.cpp) against torch's SDPA (its CPU
   flash kernel, as ``TorchAttentionBackend`` calls it), one sequence of n tokens, SmolLM2's
   heads: milliseconds per call and GFLOP/s (4 n^2 / 2 x head_dim x heads, the causal half).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.ops import CpuOps, TorchOps  # noqa: E402
from kernels.cpu.native import load_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
ATTENTION_CASES = [(1, 1500), (2, 700), (4, 1200), (16, 900), (64, 400), (96, 600)]
PREFILL_LENGTHS = [16, 64, 256, 843, 2048]


def prefill_attention(kernel, rounds: int) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    for n in PREFILL_LENGTHS:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
        k = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)
        v = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)
        out = torch.empty_like(q)
        qt, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]
        scale = HEAD_DIM**-0.5
        calls = {
            "sdpa": functools.partial(
                F.scaled_dot_product_attention,
                qt,
                k4,
                v4,
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            ),
            "native": functools.partial(kernel.prefill_attention, q, k, v, 0, scale, out),
        }
        flops = 4 * n * n / 2 * HEAD_DIM * HEADS
        row: dict = {"tokens": n}
        for name, fn in calls.items():
            fn()  # warm
            best = float("inf")
            for _ in range(max(rounds, 5)):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            row[f"{name}_ms"], row[f"{name}_gflop_s"] = best * 1e3, flops / best / 1e9
        rows.append(row)
        print(
            f"| {n} | {row['sdpa_ms']:.3f} ({row['sdpa_gflop_s']:.0f} GFLOP/s) | "
            f"{row['native_ms']:.3f} ({row['native_gflop_s']:.0f} GFLOP/s) | "
            f"{row['sdpa_ms'] / row['native_ms']:.2f}x |",
            flush=True,
        )
    return rows


def attention(kernel, rounds: int) -> list[dict]:
    rows = []
    for batch, ctx in ATTENTION_CASES:
        width = (ctx + BLOCK - 1) // BLOCK
        slots = (batch * width + 64) * BLOCK
        g = torch.Generator().manual_seed(batch)
        shape = (KV_HEADS, slots, HEAD_DIM)
        caches = [
            (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in range(LAYERS)
        ]
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
        lens = torch.full((batch,), ctx, dtype=torch.int64)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 4
        row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes}
        for order in ("contiguous", "scattered"):
            if order == "contiguous":
                tables = torch.arange(batch * width).view(batch, width)
            else:
                tables = torch.randperm(slots // BLOCK, generator=g)[: batch * width]
                tables = tables.view(batch, width)
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                for k, v in caches:
                    kernel.paged_decode_attention(q, k, v, tables, lens, BLOCK, HEAD_DIM**-0.5)
                best = min(best, (time.perf_counter() - t0) / LAYERS)
            row[f"{order}_ms"] = best * 1e3
            row[f"{order}_gb_s"] = kv_bytes / best / 1e9
        rows.append(row)
        print(
            f"| attention | {batch} | {ctx} | {row['contiguous_ms']:.3f} "
            f"({row['contiguous_gb_s']:.1f} GB/s) | {row['scattered_ms']:.3f} "
            f"({row['scattered_gb_s']:.1f} GB/s) |",
            flush=True,
        )
    return rows


def engine_steps(model_dir: str, rounds: int) -> list[dict]:
    llm = LLM(model_dir, max_model_len=4096, enable_prefix_caching=False)
    eng = llm.engine
    model = eng.runner.model
    fused = model.ops
    if not isinstance(fused, CpuOps):
        raise SystemExit("the engine did not pick CpuOps: no native kernels here?")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def prefill() -> float:
        t0 = time.perf_counter()
        llm.generate([prompt(256) for _ in range(8)], SamplingParams(temperature=0.0, max_tokens=1))
        return time.perf_counter() - t0

    def decode(batch: int, ctx: int, steps: int = 15) -> float:
        for i in range(batch):
            params = SamplingParams(temperature=0.0, max_tokens=steps + 5, ignore_eos=True)
            eng.add_request(f"d{i}-{rng.random()}", prompt(ctx), params)
        running = eng.scheduler.running
        while len(running) < batch or not all(r.output_token_ids for r in running):
            eng.step()
        eng.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        took = (time.perf_counter() - t0) / steps
        while eng.has_unfinished_requests():
            eng.step()
        return took

    cases = {
        "prefill step, 2,048 tokens": prefill,
        "decode step, batch 1, context 1,500": lambda: decode(1, 1500),
        "decode step, batch 64, context 400": lambda: decode(64, 400),
    }
    best: dict[str, dict[str, float]] = {c: {} for c in cases}
    for _ in range(rounds):
        for name, ops in (("torch", TorchOps()), ("cpu", fused)):
            model.ops = ops
            for case, fn in cases.items():
                ms = fn() * 1e3
                best[case][name] = min(best[case].get(name, float("inf")), ms)
    rows = []
    for case, b in best.items():
        rows.append({"case": case, "torch_ops_ms": b["torch"], "cpu_ops_ms": b["cpu"]})
        print(f"| {case} | {b['torch']:.1f} | {b['cpu']:.1f} | {b['torch'] / b['cpu']:.2f}x |")
    llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2 from the hub)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu_kernels.json")
    args = ap.parse_args()
    kernel = load_kernel()
    if kernel is None:
        raise SystemExit("the native CPU kernels are not available here")
    if args.model is None:
        from engine.model_hub import resolve_model

        args.model = resolve_model("smollm2")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| kernel | batch | context | contiguous ms | scattered ms |\n|---|---|---|---|---|")
    att = attention(kernel, args.rounds)
    print("\n| step | TorchOps ms | CpuOps ms | speed-up |\n|---|---|---|---|")
    steps = engine_steps(args.model, args.rounds)
    print("\n| prefill tokens | SDPA ms | native ms | speed-up |\n|---|---|---|---|")
    prefill = prefill_attention(kernel, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "threads": torch.get_num_threads(),
        "attention": att,
        "engine_steps": steps,
        "prefill_attention": prefill,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
