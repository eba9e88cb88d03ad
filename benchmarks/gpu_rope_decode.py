"""A decode step's rotary + KV write and its attention: kernels/rotary.py's
``apply_rotary_write_kv`` then the attention (two launches a layer), against the attention with
``rope`` (one launch), as a chain of 32 layers captured in one CUDA graph (PDL where the GPU has
it), Llama-3-8B's attention shape, bf16, block size 16, each layer its own cache (the working
set past L2 as in a step). Prints us a layer for each, writes JSON, and the compiled variants'
registers and spills (``--ir DIR``: their TTGIR and PTX, to read the layouts).

    python benchmarks/gpu_rope_decode.py --cases 1x512,8x512,256x512 [--ir DIR] --out F
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import paged_decode_attention as pda  # noqa: E402
from kernels.rotary import apply_rotary_write_kv  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BS, LAYERS = 32, 8, 128, 16, 32


def layer_inputs(batch: int, context: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // BS)
    blocks = batch * width + 1
    cache = torch.randn(2, KV_HEADS, blocks * BS, HEAD_DIM, generator=g, device="cuda")
    cache = cache.to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g, device="cuda")[: batch * width]
    tables = tables.view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g, device="cuda")
    qkv = qkv.to(torch.bfloat16)
    last = (lens - 1).long()
    slots = tables[torch.arange(batch, device="cuda"), last // BS].long() * BS + last % BS
    return {"cache": cache, "tables": tables, "lens": lens, "qkv": qkv, "pos": last, "slots": slots}


def step(layers, cos, sin, fused: bool) -> None:
    for x in layers:
        qkv = x["qkv"]
        q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
        kc, vc = x["cache"][0], x["cache"][1]
        args = (kc, vc, x["tables"], x["lens"], BS, HEAD_DIM**-0.5)
        if fused:
            pda.paged_decode_attention(q, *args, rope=(k, v, x["pos"], cos, sin, x["slots"]))
        else:
            apply_rotary_write_kv(q, k, v, x["pos"], cos, sin, kc, vc, x["slots"])
            pda.paged_decode_attention(q, *args)


def time_graph(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e-3)
    return sorted(times)[len(times) // 2]


def variants() -> list[dict]:
    """Every compiled ``_split_kernel`` variant: registers, spills, warps and its IR's size."""
    out = []
    for cache in pda._split_kernel.device_caches.values():
        for kernel in cache[0].values():
            ttgir = kernel.asm.get("ttgir", "")
            out.append({
                "n_regs": kernel.n_regs,
                "n_spills": kernel.n_spills,
                "num_warps": kernel.metadata.num_warps,
                "rope": "cos" in ttgir or ttgir.count("tt.store") > 3,
                "converts": ttgir.count("convert_layout"),
                "kernel": kernel,
            })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x512,8x512,256x512")
    ap.add_argument("--ir", type=Path, default=None)
    ap.add_argument("--rope-programs-per-sm", type=int, default=10_000,
                    help="ROPE_PROGRAMS_PER_SM (default: the rotary in the kernel at any grid)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_rope_decode.json")
    args = ap.parse_args()
    pda.ROPE_PROGRAMS_PER_SM = args.rope_programs_per_sm
    freqs = torch.rand(8192, HEAD_DIM // 2, device="cuda") * 6
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    results = {"device": torch.cuda.get_device_name(), "cases": []}
    print(f"{results['device']}: us a layer (32 layers in one graph)")
    print("| batch x context | rotary kernel + attention | attention with rope | fused / two |")
    print("|---|---|---|---|")
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        layers = [layer_inputs(batch, context, seed=i) for i in range(LAYERS)]
        two = time_graph(lambda layers=layers: step(layers, cos, sin, False)) / LAYERS
        one = time_graph(lambda layers=layers: step(layers, cos, sin, True)) / LAYERS
        results["cases"].append({"batch": batch, "context": context, "two_s": two, "fused_s": one})
        print(f"| {batch} x {context} | {two * 1e6:.2f} | {one * 1e6:.2f} | {one / two:.3f} |")
        del layers
        torch.cuda.empty_cache()
    found = variants()
    results["variants"] = [{k: v for k, v in f.items() if k != "kernel"} for f in found]
    for i, f in enumerate(found):
        print(f"variant {i}: regs {f['n_regs']} spills {f['n_spills']} warps {f['num_warps']} "
              f"convert_layout x{f['converts']}")  # fmt: skip
        if args.ir is not None:
            args.ir.mkdir(parents=True, exist_ok=True)
            for kind in ("ttgir", "ptx"):
                text = f["kernel"].asm.get(kind)
                if text:
                    (args.ir / f"variant{i}.{kind}").write_text(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
