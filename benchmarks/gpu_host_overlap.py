"""Is the host's share of a step hidden behind the GPU? (issue 23, item 2), one GPU.

The engine runs steps pipelined (async scheduling): step N+1 is launched, its inputs prepared
and its kernels queued, before step N's tokens are read back. Then a step's period should be
its GPU time, and the GPU should never wait. This script checks that for the steps of
benchmarks/gpu_kernels.py (Llama-3-8B shape, dummy weights, engine defaults): 256 decodes at 512
tokens of context, and the same 256 with a 2048-token prefill chunk (piecewise graphs).

For each step, ``--reps`` steps run pipelined as ``gpu_step.time_step_pipelined`` runs them,
and the script reports:

* the period (wall per step), the host time inside ``launch`` and inside ``collect``; where
  ``launch`` takes about a GPU step and ``collect`` nothing, something in ``launch`` waits for
  the GPU;
* under torch.profiler (CPU and CUDA), the GPU's idle gaps between the first and the last
  kernel of the middle steps, the largest of them with the kernels on each side, and the CUDA
  runtime calls by total host time (a synchronizing call shows up as a long one);
* cProfile over the same steps: the host functions by their own time.

``--breakdown``: the host time inside ``launch`` split by part, timed with ``perf_counter``
around each (no profiler, so the shares are the host's own): input preparation, the attention
metadata, each piecewise graph replay, and the attention's kernels by launcher (rotary with
the KV write, decode, extend), per call and per step.

    PYTHONPATH=$PWD python benchmarks/gpu_host_overlap.py --out F [--quantization fp8] [--breakdown]

Prints the tables and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import log, make_llm  # noqa: E402
from benchmarks.gpu_kernels import busy_union  # noqa: E402
from benchmarks.gpu_step import StepFactory, run_pipelined, with_graphs  # noqa: E402

CONTEXT, CHUNK, BATCH = 512, 2048, 256
GAP_S = 10e-6  # gaps shorter than this are a kernel's launch latency, not a wait


def pipelined(runner, out, reps: int) -> dict:
    """Period, and host seconds inside launch / collect per step (medians)."""
    for _ in range(3):
        runner.execute(out)
    torch.cuda.synchronize()
    launches, collects = [], []
    t0 = time.perf_counter()
    a = time.perf_counter()
    launched = runner.launch(out)
    launches.append(time.perf_counter() - a)
    for _ in range(reps - 1):
        a = time.perf_counter()
        following = runner.launch(out)
        b = time.perf_counter()
        runner.collect(launched)
        c = time.perf_counter()
        launches.append(b - a)
        collects.append(c - b)
        launched = following
    runner.collect(launched)
    period = (time.perf_counter() - t0) / reps
    return {
        "period_s": period,
        "launch_s": statistics.median(launches),
        "collect_s": statistics.median(collects),
    }


class _Timed:
    """A callable that adds its wall seconds to ``totals[name]`` (seconds, calls)."""

    def __init__(self, fn, name: str, totals: dict):
        self.fn, self.name, self.totals = fn, name, totals

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            row = self.totals.setdefault(self.name, [0.0, 0])
            row[0] += time.perf_counter() - t0
            row[1] += 1


def breakdown(runner, out, reps: int) -> list[dict]:
    """Host seconds per step inside ``launch`` by part, over ``reps`` pipelined steps (the
    parts are timed where they are called; ``launch`` is the whole)."""
    totals: dict[str, list] = {}
    backend = runner.backend
    patched = [(runner, "launch"), (runner, "_prepare"), (backend, "build")]
    patched += [(backend, n) for n in ("_rotary_write", "_decode_kernel", "_extend", "_write")
                if hasattr(backend, n)]  # fmt: skip
    if runner.piecewise is not None:
        patched.append((runner.piecewise, "forward"))
    saved_replay = torch.cuda.CUDAGraph.replay
    own = [(obj, name, obj.__dict__.get(name)) for obj, name in patched]  # instance attributes
    for obj, name in patched:
        setattr(obj, name, _Timed(getattr(obj, name), name, totals))
    timed_replay = _Timed(saved_replay, "CUDAGraph.replay", totals)
    torch.cuda.CUDAGraph.replay = lambda graph: timed_replay(graph)  # (a function: a method)
    try:
        run_pipelined(runner, out, 3)
        torch.cuda.synchronize()
        totals.clear()
        run_pipelined(runner, out, reps)
    finally:
        torch.cuda.CUDAGraph.replay = saved_replay
        for obj, name, value in own:
            if value is None:
                delattr(obj, name)  # the class's method again
            else:
                setattr(obj, name, value)
    return sorted(
        ({"part": k, "calls_per_step": c / reps, "ms_per_step": 1e3 * s / reps,
          "us_per_call": 1e6 * s / c} for k, (s, c) in totals.items()),
        key=lambda r: -r["ms_per_step"],
    )  # fmt: skip


def traced(runner, out, reps: int, top: int) -> dict:
    """GPU gaps and CUDA runtime calls over ``reps`` pipelined steps."""
    from torch.profiler import ProfilerActivity, profile

    run_pipelined(runner, out, 3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_pipelined(runner, out, reps)
        torch.cuda.synchronize()
    gpu, runtime = [], {}
    for e in prof.events():
        start, end = e.time_range.start, e.time_range.end
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if end > 0:
                gpu.append((start, end, e.name))
        elif e.name.startswith("cuda"):
            row = runtime.setdefault(e.name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += (end - start) / 1e6
            row[2] = max(row[2], (end - start) / 1e6)
    return gpu_summary(gpu, reps, top) | {
        "runtime_calls": sorted(
            (
                {"name": k, "calls_per_step": c / reps, "s_per_step": s / reps, "max_s": m}
                for k, (c, s, m) in runtime.items()
            ),
            key=lambda r: -r["s_per_step"],
        )[:top],
    }


def gpu_summary(gpu: list[tuple[float, float, str]], reps: int, top: int) -> dict:
    """GPU activity ``(start us, end us, name)`` of ``reps`` pipelined steps: in the middle
    three fifths of its span (no start-up, no drain), the idle share, the gaps longer than
    ``GAP_S`` with the activity on each side, and each kernel's time per step (all of it)."""
    if not gpu:
        return {}
    gpu = sorted(gpu)
    by_name: dict[str, float] = {}
    for start, end, name in gpu:
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + (end - start) / 1e6
    # the middle steps only: drop the first and last fifth of the span (start-up, drain)
    lo, hi = gpu[0][0], max(e for _, e, _ in gpu)
    cut_lo, cut_hi = lo + (hi - lo) / 5, hi - (hi - lo) / 5
    mid = [g for g in gpu if cut_lo <= g[0] <= cut_hi]
    gaps, reach, before = [], None, None
    for start, end, name in mid:
        if reach is not None and start - reach > GAP_S * 1e6:
            gaps.append(((start - reach) / 1e6, before, name))
        if reach is None or end > reach:
            reach, before = end, name
    span = (max(e for _, e, _ in mid) - mid[0][0]) / 1e6
    busy = busy_union([(s, e) for s, e, _ in mid]) / 1e6
    by_after: dict[str, list] = {}
    for sec, _, after in gaps:
        row = by_after.setdefault(after[:70], [0, 0.0])
        row[0] += 1
        row[1] += sec
    steps_in_mid = reps * 3 / 5
    return {
        "window_s": span,
        "busy_s": busy,
        "idle_share": 1 - busy / span if span else 0.0,
        "gaps_per_step": len(gaps) / steps_in_mid,
        "gap_s_per_step": sum(g[0] for g in gaps) / steps_in_mid,
        "largest_gaps": [
            {"s": s, "before": b[:70], "after": a[:70]}
            for s, b, a in sorted(gaps, reverse=True)[:top]
        ],
        "gaps_by_next_kernel": sorted(
            ({"next": k, "count": c, "s": s} for k, (c, s) in by_after.items()),
            key=lambda r: -r["s"],
        )[:top],
        "kernels": sorted(
            ({"name": k, "s_per_step": s / reps} for k, s in by_name.items()),
            key=lambda r: -r["s_per_step"],
        )[: top + 8],
    }


def host_profile(runner, out, reps: int, top: int) -> list[dict]:
    """cProfile of ``reps`` pipelined steps: functions by own time per step."""
    run_pipelined(runner, out, 3)
    prof = cProfile.Profile()
    prof.enable()
    run_pipelined(runner, out, reps)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(file).name}:{line}({fn})"
        rows.append(
            {
                "function": where,
                "calls_per_step": calls / reps,
                "own_s_per_step": tottime / reps,
                "cum_s_per_step": cumtime / reps,
            }
        )
    rows.sort(key=lambda r: -r["own_s_per_step"])
    return rows[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_host_overlap.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--steps", default="decode-256,mixed", help="decode-256, decode-1, mixed")
    ap.add_argument("--modes", default="graphs", help="graphs and/or eager (no CUDA graphs)")
    ap.add_argument("--breakdown", action="store_true", help="launch's host time by part only")
    args = ap.parse_args(argv)
    from engine.scheduler import SchedulerOutput

    llm = make_llm(
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=BATCH,
        max_num_batched_tokens=CHUNK + BATCH,
        cuda_graph_max_tokens=CHUNK + BATCH,
    )
    runner = llm.engine.runner
    factory = StepFactory(runner.cfg.block_size, runner.num_kv_blocks)
    decodes = [factory.chunk(CONTEXT, 1) for _ in range(BATCH)]
    made = {
        "decode-256": decodes,
        "decode-1": decodes[:1],
        "mixed": decodes + [factory.chunk(0, CHUNK)],
    }
    result = {"benchmark": "gpu_host_overlap", "device": torch.cuda.get_device_name(), "steps": {}}
    for name, mode in itertools.product(args.steps.split(","), args.modes.split(",")):
        out = SchedulerOutput(scheduled=made[name])
        log(f"{name}, {mode}: pipelined, then traced, then cProfile")
        graphs = mode == "graphs"
        with with_graphs(runner, graphs, graphs):
            row = pipelined(runner, out, args.reps)
            if args.breakdown:
                row["breakdown"] = breakdown(runner, out, args.reps)
                result["steps"][f"{name} {mode}"] = row
                print(f"\n### {name}, {mode}: period {row['period_s'] * 1e3:.2f} ms, host in "
                      f"launch {row['launch_s'] * 1e3:.2f} ms, in collect "
                      f"{row['collect_s'] * 1e3:.2f} ms\n\n| part | calls / step | ms / step | "
                      "us / call |\n|---|---|---|---|")  # fmt: skip
                for r in row["breakdown"]:
                    print(f"| {r['part']} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.3f} | "
                          f"{r['us_per_call']:.1f} |")  # fmt: skip
                continue
            row["trace"] = traced(runner, out, max(args.reps // 2, 5), args.top)
            row["host"] = host_profile(runner, out, max(args.reps // 2, 5), args.top)
        result["steps"][f"{name} {mode}"] = row
        t = row["trace"]
        print(f"\n### {name}, {mode}: period {row['period_s'] * 1e3:.2f} ms, host in launch "
              f"{row['launch_s'] * 1e3:.2f} ms, in collect {row['collect_s'] * 1e3:.2f} ms")  # fmt: skip
        print(f"GPU (middle steps, profiled): idle {t['idle_share']:.1%}, "
              f"{t['gaps_per_step']:.1f} gaps > {GAP_S * 1e6:.0f} us a step, "
              f"{t['gap_s_per_step'] * 1e3:.2f} ms of them a step")  # fmt: skip
        print("\n| largest gap us | kernel before | kernel after |\n|---|---|---|")
        for g in t["largest_gaps"]:
            print(f"| {g['s'] * 1e6:.0f} | {g['before']} | {g['after']} |")
        print("\n| gaps before kernel | count | ms |\n|---|---|---|")
        for g in t["gaps_by_next_kernel"]:
            print(f"| {g['next']} | {g['count']} | {g['s'] * 1e3:.2f} |")
        print("\n| kernel | ms / step |\n|---|---|")
        for r in t["kernels"]:
            print(f"| {r['name']} | {r['s_per_step'] * 1e3:.3f} |")
        print("\n| CUDA runtime call | calls / step | ms / step | longest ms |\n|---|---|---|---|")
        for r in t["runtime_calls"]:
            print(f"| {r['name']} | {r['calls_per_step']:.0f} | {r['s_per_step'] * 1e3:.3f} | "
                  f"{r['max_s'] * 1e3:.3f} |")  # fmt: skip
        print(
            "\n| host function | calls / step | own ms / step | cum ms / step |\n|---|---|---|---|"
        )
        for r in row["host"]:
            print(f"| {r['function']} | {r['calls_per_step']:.0f} | "
                  f"{r['own_s_per_step'] * 1e3:.3f} | {r['cum_s_per_step'] * 1e3:.3f} |")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
