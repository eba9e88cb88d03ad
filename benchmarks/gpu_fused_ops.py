"""The fused elementwise Triton kernels against their plain-torch references on one GPU.

Llama-3-8B sizes (hidden 4096, intermediate 14336, 32 / 8 heads of 128) and a small model's
(576, 1536, 9 / 3 heads of 64), bf16, at decode (T = 1, 64) and prefill (T = 4096) row counts.
Each op is timed inside a CUDA graph (as the engine's decode runs it: no Python launch cost)
over enough copies of its inputs that the working set exceeds twice the L2 cache where it can,
so prefill figures are HBM traffic; decode ones are launch-latency bound and mostly in L2.
Bytes are the op's compulsory traffic (each input read once, each output written once); the
figure of merit is achieved bytes/s over the HBM copy bandwidth measured in the same run. The
KV-write baseline is the torch backend's ``index_copy_`` (its reference masks padding rows with a
boolean index, a host sync that cannot be graphed).

    python benchmarks/gpu_fused_ops.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import hbm_copy_bandwidth, time_cuda  # noqa: E402
from kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from kernels.kv_cache_write import write_kv_cache  # noqa: E402
from kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from kernels.rotary import apply_rotary, apply_rotary_ref  # noqa: E402

MODELS = {  # hidden, intermediate, heads, kv_heads, head_dim
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "small": (576, 1536, 9, 3, 64),
}
ROWS = (1, 64, 4096)
BF16 = torch.bfloat16
EPS = 1e-5


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cases(model: tuple[int, ...], t: int):
    """(op, compulsory bytes, make_inputs, kernel(inputs), torch(inputs)) for one size."""
    hidden, inter, heads, kv_heads, d = model
    e = 2  # bytes of bf16
    slots_total = max(4 * t, 1024)

    def kv_inputs():
        k, v = (torch.randn(t, kv_heads, d, device="cuda", dtype=BF16) for _ in range(2))
        cache = torch.zeros(2, kv_heads, slots_total, d, device="cuda", dtype=BF16)
        slots = torch.randperm(slots_total, device="cuda")[:t]
        return k, v, cache[0], cache[1], slots

    def norm_inputs():
        x, r = (torch.randn(t, hidden, device="cuda", dtype=BF16) for _ in range(2))
        return x, r, torch.ones(hidden, device="cuda", dtype=BF16)

    def rope_inputs():
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device="cuda", dtype=BF16)
        q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        freqs = torch.rand(8192, d // 2, device="cuda") * 6.3
        emb = torch.cat((freqs, freqs), dim=-1)  # as RotaryEmbedding.build lays the tables out
        positions = torch.randint(0, 8192, (t,), device="cuda")
        return q.view(t, heads, d), k.view(t, kv_heads, d), positions, emb.cos(), emb.sin()

    def qk_norm_inputs():
        q, k = rope_inputs()[:2]
        return q, k, torch.ones(d, device="cuda", dtype=BF16)

    def act_inputs():
        return (torch.randn(t, 2 * inter, device="cuda", dtype=BF16),)

    def index_copy(k, v, k_cache, v_cache, slots):  # the torch backend's write
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))

    return [
        ("kv_cache_write", 4 * t * kv_heads * d * e, kv_inputs, write_kv_cache, index_copy),
        (
            "rms_norm",
            2 * t * hidden * e,
            norm_inputs,
            lambda x, r, w: rms_norm(x, w, EPS),
            lambda x, r, w: rms_norm_ref(x, w, EPS),
        ),
        (
            "fused_add_rms_norm",
            4 * t * hidden * e,
            norm_inputs,
            lambda x, r, w: fused_add_rms_norm(x, r, w, EPS),
            lambda x, r, w: fused_add_rms_norm_ref(x, r, w, EPS),
        ),
        (
            "qk_norm (per head)",
            2 * t * (heads + kv_heads) * d * e,
            qk_norm_inputs,
            lambda q, k, w: (rms_norm(q, w, EPS, out=q), rms_norm(k, w, EPS, out=k)),
            lambda q, k, w: (rms_norm_ref(q, w, EPS), rms_norm_ref(k, w, EPS)),
        ),
        (
            "rotary",
            2 * t * (heads + kv_heads) * d * e + t * d * 4,
            rope_inputs,
            apply_rotary,
            apply_rotary_ref,
        ),
        ("silu_and_mul", 3 * t * inter * e, act_inputs, silu_and_mul, silu_and_mul_ref),
    ]


def graphed_seconds(fn, input_sets: list[tuple], calls: int = 40) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph, cycling through ``input_sets``."""
    for inputs in input_sets:
        fn(*inputs)  # compile, allocate outside the capture
    torch.cuda.synchronize()
    reps = max(1, math.ceil(calls / len(input_sets)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for inputs in input_sets:
                fn(*inputs)
    seconds = time_cuda(graph.replay, reps=10, warmup=2)
    return seconds / (reps * len(input_sets))


def measure(model_name: str, bw: float, l2_bytes: int) -> list[dict]:
    rows = []
    for t in ROWS:
        for op, nbytes, make, kernel, reference in cases(MODELS[model_name], t):
            copies = max(1, min(16, math.ceil(2 * l2_bytes / nbytes)))
            input_sets = [make() for _ in range(copies)]
            k_s = graphed_seconds(kernel, input_sets)
            t_s = graphed_seconds(reference, input_sets)
            rows.append(
                {
                    "model": model_name,
                    "op": op,
                    "T": t,
                    "bytes": nbytes,
                    "copies": copies,
                    "triton_us": k_s * 1e6,
                    "torch_us": t_s * 1e6,
                    "speedup": t_s / k_s,
                    "triton_of_hbm": nbytes / k_s / bw,
                    "torch_of_hbm": nbytes / t_s / bw,
                }
            )
            log(f"{model_name} T={t} {op}: {k_s * 1e6:.1f} us vs torch {t_s * 1e6:.1f} us")
            del input_sets
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'model':<10}{'op':<20}{'T':>6}{'bytes':>11}{'triton us':>11}{'torch us':>10}"
    head += f"{'speedup':>9}{'triton/HBM':>12}{'torch/HBM':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<10}{r['op']:<20}{r['T']:>6}{r['bytes']:>11}{r['triton_us']:>11.2f}"
            f"{r['torch_us']:>10.2f}{r['speedup']:>8.1f}x{r['triton_of_hbm']:>12.2f}"
            f"{r['torch_of_hbm']:>11.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    log(f"{gpu}: measuring HBM copy bandwidth")
    bw = hbm_copy_bandwidth()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    log(f"HBM copy {bw / 1e12:.2f} TB/s, L2 {l2_bytes >> 20} MiB")
    rows = [r for name in args.models for r in measure(name, bw, l2_bytes)]
    print(f"\n{gpu}, HBM copy {bw / 1e12:.2f} TB/s, bf16, CUDA-graph timings\n")
    print(table(rows))
    result = {"gpu": gpu, "hbm_copy_bytes_per_s": bw, "l2_bytes": l2_bytes, "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_fused_ops.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
