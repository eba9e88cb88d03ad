"""Every kernel of an engine step against its own floor, on one GPU (issue 23, item 3).

Llama-3-8B shape, dummy bf16 weights (or FP8 with ``--quantization fp8``, and an FP8 KV cache
with ``--kv-cache-dtype fp8``: issue 26), the engine defaults. Three steps built by hand as in
benchmarks/gpu_step.py (disjoint block tables, zeros in the KV cache, which cost the same to
read):

    decode-256   256 decodes, 512 tokens of context each
    decode-1     one decode, 512 tokens of context (the ITL case)
    mixed        the 256 decodes + one 2048-token prefill chunk
    decode-N     with ``--decode-batches N,...``: N decodes (N <= 256), 512 tokens of context

For each step: its wall time under the engine's graphs (``ModelRunner.execute``, decode graphs
or piecewise), then one eager run under torch.profiler, whose kernels are the same kernels the
graphs replay (a graph removes launch gaps, not kernel time). Kernels are summed per step by
what they compute:

* each linear layer by shape (``aten::linear`` with its input shapes, the cuBLAS kernel under
  it; in FP8 ``aten::_scaled_mm``): floor = max(bytes of weight + activations over the HBM
  copy rate, FLOPs over the bf16 (FP8: ``_scaled_mm``'s) matmul rate), both measured in this
  run; FP8's quantizing kernels and tensor-core GEMV by name;
* the Triton kernels by name: decode attention (split + reduce: the KV of every decode row),
  extend attention (causal FLOPs of the chunk over its prefix), the KV write, rms_norm,
  silu_and_mul, rotary: floor = their bytes (or FLOPs) by arithmetic over the same rates;
* the rest (embedding, sampling, copies) by kernel name, without a floor.

Then the same step under its graphs once more, profiled alone a few times: from its first GPU
activity to its last, the share of that span no kernel or copy runs (``idle_in_step``): the
time the GPU waits for the host inside a step (piecewise graphs launch attention eagerly
between the pieces), which the per-kernel table cannot show.

    PYTHONPATH=$PWD python benchmarks/gpu_kernels.py --out results/gpu_kernels.json
    PYTHONPATH=$PWD python benchmarks/gpu_kernels.py --quantization fp8 [--kv-cache-dtype fp8]

Prints one table per step (time per step, share, floor, time / floor) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import (  # noqa: E402
    bf16_matmul_flops,
    fp8_matmul_flops,
    hbm_copy_bandwidth,
)
from benchmarks.gpu_engine import log, make_llm  # noqa: E402
from benchmarks.gpu_step import (  # noqa: E402
    StepFactory,
    attention_flops,
    linear_flops,
    time_step,
    with_graphs,
)

CONTEXT, CHUNK, BATCH = 512, 2048, 256


def _kernel_kind(name: str) -> str:
    """What a CUDA kernel computes, from its name (Triton kernels keep their function's)."""
    for key, kind in (
        ("_split_kernel", "decode attention (split)"),
        ("_reduce_kernel", "decode attention (reduce)"),
        ("_extend_attention", "extend attention"),
        ("_write_kv_cache", "KV write"),
        ("_rms_norm", "rms_norm"),
        ("_silu_and_mul", "silu_and_mul"),
        ("_rotary", "rotary"),
        ("_quant_rows", "fp8 quantize"),
        ("_silu_mul_quant", "silu_mul_quant"),
        ("_gemv", "gemv"),
        ("fp8_gemv_mma", "gemv"),
    ):
        if key in name:
            return kind
    if any(k in name for k in ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas")):
        return "GEMM"
    return "other: " + name[:60]


class Step:
    """The byte and FLOP arithmetic of one step: ``decodes`` rows at ``context`` tokens of
    context plus one prefill chunk of ``chunk`` tokens (0: none), over a model whose linear
    layers and LM head hold ``weight_bytes``."""

    def __init__(
        self, cfg, weight_bytes: int, decodes: int, context: int, chunk: int, kv_bytes: int = 2
    ) -> None:
        self.cfg, self.weight_bytes = cfg, weight_bytes
        self.decodes, self.context, self.chunk = decodes, context, chunk
        self.tokens, self.kv_bytes = decodes + chunk, kv_bytes
        # the decode rows' K and V in every layer (``kv_bytes`` a value)
        self.decode_kv = 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes * decodes * (context + 1)
        self.decode_kv *= cfg.num_layers

    def floor(self, bw: float, flops: float) -> float:
        """The whole step: weights and KV read once, plus the chunk's linear FLOPs."""
        chunk = linear_flops(self.cfg, self.chunk) / flops if self.chunk else 0.0
        return (self.weight_bytes + self.decode_kv) / bw + chunk

    def floors(self, bw: float, flops: float, fused_down: bool = False) -> dict[str, float]:
        """Each kernel kind's floor; ``fused_down``: FP8's down projection gets its input from
        ``silu_mul_quant``, not from a quantizer of its own."""
        c, t, e = self.cfg, self.tokens, 2  # bf16
        kv_row = c.num_kv_heads * c.head_dim * self.kv_bytes  # one token's K (or V), one layer
        q_row = c.num_heads * c.head_dim * e
        extend_flops = attention_flops(c, self.chunk) if self.chunk else 0.0
        extend_bytes = (2 * kv_row + 2 * q_row) * self.chunk * c.num_layers
        inter = c.intermediate_size
        quantized = 3 * c.hidden_size + (0 if fused_down else inter)  # a token's, a layer
        return {
            # decode at batch 1: every linear layer and the LM head as Triton GEMVs
            "gemv": (self.weight_bytes + 2 * c.hidden_size * t * c.num_layers) / bw,
            "decode attention (split)": (self.decode_kv + q_row * self.decodes * c.num_layers) / bw,
            "extend attention": max(extend_flops / flops, extend_bytes / bw),
            # k and v of each new token read and written once
            "KV write": 2 * 2 * kv_row * t * c.num_layers / bw,
            # in, residual in, out, residual out: 2 norms a layer and the final one
            "rms_norm": 4 * c.hidden_size * e * t * (2 * c.num_layers + 1) / bw,
            # FP8: bf16 in, e4m3 out, in front of qkv, o, gate_up (2-8 rows, cuBLAS's) and down
            # (its input I wide) unless silu_mul_quant writes that one
            "fp8 quantize": quantized * (e + 1) * t * c.num_layers / bw,
            # gate and up in, e4m3 out
            "silu_mul_quant": (2 * e + 1) * inter * t * c.num_layers / bw,
            "silu_and_mul": 3 * inter * e * t * c.num_layers / bw,
            # q and k rotated in place: read and written
            "rotary": 2 * (q_row + kv_row) * t * c.num_layers / bw,
        }


def linear_floor(m: int, k: int, n: int, bw: float, flops: float, in_bytes: int = 2) -> float:
    """Weight and input of ``in_bytes`` a value (FP8: 1), the output in bf16."""
    return max((in_bytes * (k * n + m * k) + 2 * m * n) / bw, 2.0 * m * k * n / flops)


def profile_step(runner, out, reps: int) -> tuple[dict, dict]:
    """One eager run profiled ``reps`` times: (linear ``(m, k, n, fp8)`` -> (seconds per step,
    calls per step)), (kernel kind -> (seconds per step, launches per step))."""
    from torch.profiler import ProfilerActivity, profile

    with with_graphs(runner, False, False):
        for _ in range(2):
            runner.execute(out)
        torch.cuda.synchronize()
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
        ) as prof:
            for _ in range(reps):
                runner.execute(out)
            torch.cuda.synchronize()
    linears: dict = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key == "aten::linear" and evt.input_shapes:
            (m, k), (n, _) = evt.input_shapes[0][-2:], evt.input_shapes[1]
        elif evt.key == "aten::_scaled_mm" and evt.input_shapes:  # x [m, k] @ w.t() [k, n]
            (m, k), (_, n) = evt.input_shapes[0][-2:], evt.input_shapes[1]
        else:
            continue
        row = linears[(m, k, n, evt.key == "aten::_scaled_mm")]
        row[0] += evt.device_time_total / 1e6 / reps
        row[1] += evt.count / reps
    kernels: dict = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.self_device_time_total > 0:
            row = kernels[_kernel_kind(evt.key)]
            row[0] += evt.self_device_time_total / 1e6 / reps
            row[1] += evt.count / reps
    return dict(linears), dict(kernels)


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (kernels that overlap count once)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def idle_in_step(runner, out, reps: int) -> dict:
    """The step as the engine runs it (its graphs), each of ``reps`` runs profiled alone: span
    from its first GPU activity (kernel, copy, memset) to its last, the union of that activity,
    and the idle share between (medians over the runs)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        runner.execute(out)
    torch.cuda.synchronize()
    spans, busies = [], []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(out)
            torch.cuda.synchronize()
        acts = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ]
        if not acts:
            continue
        spans.append((max(b for _, b in acts) - min(a for a, _ in acts)) / 1e6)
        busies.append(busy_union(acts) / 1e6)
    if not spans:
        return {}
    span, busy = statistics.median(spans), statistics.median(busies)
    return {"span_s": span, "busy_s": busy, "idle_share": 1.0 - busy / span if span else 0.0}


def step_table(
    name: str, wall_s: float, linears: dict, kernels: dict, floors: dict, bw, flops, fp8_flops=None
):
    """Rows: each linear shape, then each kernel kind that is not a GEMM."""
    rows = []
    for (m, k, n, fp8), (sec, calls) in sorted(linears.items(), key=lambda kv: -kv[1][0]):
        if fp8:  # _scaled_mm: e4m3 in, bf16 out
            floor = linear_floor(m, k, n, bw, fp8_flops, in_bytes=1) * calls
        else:
            floor = linear_floor(m, k, n, bw, flops) * calls
        label = f"{'fp8 ' if fp8 else ''}linear {m}x{k} @ {k}x{n}"
        rows.append({"kernel": label, "calls": calls, "s": sec, "floor_s": floor})
    gemm_in_linears = sum(sec for sec, _ in linears.values())
    for kind, (sec, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        if kind == "GEMM":
            continue  # counted by shape above (cuBLAS under aten::linear)
        floor = floors.get(kind)
        if kind == "decode attention (reduce)":
            floor = None  # the split's floor holds the KV bytes; the reduce is overhead
        rows.append({"kernel": kind, "calls": calls, "s": sec, "floor_s": floor})
    gemm = sum(sec for kind, (sec, _) in kernels.items() if kind in ("GEMM", "gemv"))
    busy = sum(sec for sec, _ in kernels.values())
    return {
        "step": name,
        "wall_s": wall_s,
        "gpu_busy_s": busy,
        "gemm_s": gemm,
        "gemm_attributed_s": gemm_in_linears,
        "rows": rows,
        "floor_s": sum(r["floor_s"] or 0.0 for r in rows),
    }


def print_table(t: dict) -> None:
    ms = 1e3
    print(f"\n### {t['step']}: wall {t['wall_s'] * ms:.2f} ms under graphs, kernels "
          f"{t['gpu_busy_s'] * ms:.2f} ms (eager run), sum of floors {t['floor_s'] * ms:.2f} ms")  # fmt: skip
    print("\n| kernel | calls | ms / step | share | floor ms | / floor |")
    print("|---|---|---|---|---|---|")
    for r in t["rows"]:
        f = r["floor_s"]
        share = r["s"] / t["gpu_busy_s"] if t["gpu_busy_s"] else 0.0
        ratio = f"{r['s'] / f:.2f}x" if f else "-"
        floor = f"{f * ms:.3f}" if f else "-"
        print(f"| {r['kernel']} | {r['calls']:.0f} | {r['s'] * ms:.3f} | {share:.1%} | {floor} | {ratio} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_kernels.json"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument(
        "--decode-batches",
        default="",
        help="more decode steps to profile, e.g. 8,32,64 (decode-N: N decodes at 512 context)",
    )
    ap.add_argument("--only-extra", action="store_true", help="skip the three standard steps")
    args = ap.parse_args()
    from engine.scheduler import SchedulerOutput

    bw, flops = hbm_copy_bandwidth(), bf16_matmul_flops()
    fp8_flops = fp8_matmul_flops() if args.quantization == "fp8" else None
    log(f"HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s"
        + (f", fp8 {fp8_flops / 1e12:.0f} TFLOP/s" if fp8_flops else ""))  # fmt: skip
    t0 = time.perf_counter()
    llm = make_llm(
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=BATCH,
        max_num_batched_tokens=CHUNK + BATCH,
        cuda_graph_max_tokens=CHUNK + BATCH,  # the mixed step runs under piecewise graphs
    )
    log(f"engine up in {time.perf_counter() - t0:.1f} s")
    runner = llm.engine.runner
    cfg = runner.model_cfg
    factory = StepFactory(runner.cfg.block_size, runner.num_kv_blocks)
    decodes = [factory.chunk(CONTEXT, 1) for _ in range(BATCH)]
    kv_bytes = 1 if args.kv_cache_dtype == "fp8" else 2
    weight_bytes = sum(  # what a step reads: the embedding only if it is the LM head too
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if "embed_tokens" not in name or cfg.tie_word_embeddings
    )
    steps = (
        ("decode-256", decodes, Step(cfg, weight_bytes, BATCH, CONTEXT, 0, kv_bytes)),
        ("decode-1", decodes[:1], Step(cfg, weight_bytes, 1, CONTEXT, 0, kv_bytes)),
        (
            "mixed 256 + 2048",
            decodes + [factory.chunk(0, CHUNK)],
            Step(cfg, weight_bytes, BATCH, CONTEXT, CHUNK, kv_bytes),
        ),
    )
    extra = tuple(
        (f"decode-{n}", decodes[:n], Step(cfg, weight_bytes, n, CONTEXT, 0, kv_bytes))
        for n in (int(b) for b in args.decode_batches.split(",") if b)
    )
    steps = extra if args.only_extra else steps + extra
    tables = []
    for name, scheduled, arith in steps:
        log(f"{name}: timing under graphs, then profiling eagerly")
        out = SchedulerOutput(scheduled=scheduled)
        wall = time_step(runner, out, 20)
        linears, kernels = profile_step(runner, out, args.reps)
        floors = arith.floors(bw, flops, fused_down="silu_mul_quant" in kernels)
        t = step_table(name, wall, linears, kernels, floors, bw, flops, fp8_flops)
        t["step_floor_s"] = arith.floor(bw, flops)
        t["graphs"] = idle_in_step(runner, out, args.reps)
        tables.append(t)
        print_table(t)
        if t["graphs"]:
            g = t["graphs"]
            print(f"\nunder graphs: GPU span {g['span_s'] * 1e3:.2f} ms, busy {g['busy_s'] * 1e3:.2f}"
                  f" ms, idle {g['idle_share']:.1%} of the span")  # fmt: skip
        kv = arith.decode_kv
        print(f"\nstep floor (weights {weight_bytes / 1e9:.1f} GB + KV {kv / 1e9:.2f} GB over HBM"
              f"{' + the chunk FLOPs' if arith.chunk else ''}): {t['step_floor_s'] * 1e3:.2f} ms;"
              f" wall / floor {wall / t['step_floor_s']:.3f}x")  # fmt: skip
    result = {
        "benchmark": "gpu_kernels",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(),
        "hbm_copy_bytes_per_s": bw,
        "bf16_flops": flops,
        "fp8_flops": fp8_flops,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "weight_bytes_read": weight_bytes,
        "steps": tables,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
