"""Async scheduling on one GPU (issue 23, item 2): the same offline run with the host's work
between forwards (``async_scheduling=False``) and beside them (``True``), at the engine's
defaults, Llama-3-8B shape (dummy bf16 weights), greedy, ignore_eos, all requests at once.

For each run: requests and output tokens per second, steps, and where the wall time went:
the device's busy time (first to last event of each step's work) and the time it sat waiting
for the host between one step's end and the next one's start (``ModelRunner.timeline``), as a
share of the wall time (the issue's bar: at most 5 %).

Workloads: vLLM's ShareGPT sample (benchmarks/data/vllm_sharegpt_llama3_1000.json, 231 in / 189
out) and the ShareGPT-lengths file (110 in / 275 out, fresh token ids). The two settings
alternate (off, on, off, on with ``--repeats 2``) so a drift of the machine hits both.

Each run also breaks its steps down by shape (decode-only or carrying prompt tokens, by the
number of sequences): the device's time on each step and its wait for the host before the
next, so a kind of step the host cannot keep up with shows as a wait there.

    PYTHONPATH=$PWD python benchmarks/gpu_async.py --out DIR [--repeats 1] [--num-requests 1000]
        [--settings on] [--quantization fp8] [--kv-cache-dtype fp8] [--gc-freeze off,on]
    python benchmarks/gpu_async.py --replot benchmarks/results/gpu_async.json   # no GPU needed
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import log, make_llm, throughput  # noqa: E402
from benchmarks.gpu_sweep import check_freed, prompts_for  # noqa: E402
from benchmarks.workloads import SHAREGPT_LENGTHS, read_workload  # noqa: E402
from engine.runtime import freeze_startup_heap  # noqa: E402

VLLM_SAMPLE = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"


def step_times(timeline) -> list[tuple[float, float]]:
    """Per step: (ms the device worked on it, ms it then waited for the host before the next
    step began)."""
    times = []
    for i, (start, end) in enumerate(timeline):
        wait = max(end.elapsed_time(timeline[i + 1][0]), 0.0) if i + 1 < len(timeline) else 0.0
        times.append((start.elapsed_time(end), wait))
    return times


def device_time(timeline) -> tuple[float, float]:
    """(seconds the device worked on steps, seconds it waited for the host between them)."""
    times = step_times(timeline)
    return sum(t for t, _ in times) / 1e3, sum(w for _, w in times) / 1e3


SEQ_BUCKETS = (8, 64, 128, 256, 384, 448, 1 << 30)


def shape_key(seqs: int, prompt_tokens: int) -> str:
    """``decode`` or ``mixed`` (the step carries prompt tokens), and its sequences' bucket."""
    lo = 0
    for hi in SEQ_BUCKETS:
        if seqs <= hi:
            break
        lo = hi
    span = f"{lo + 1}-{hi}" if hi < 1 << 30 else f">{lo}"
    return f"{'mixed' if prompt_tokens else 'decode'} {span}"


def by_shape(timeline, shapes: list[tuple[int, int, int]]) -> dict[str, dict]:
    """Per kind of step (``shape_key``): steps, mean tokens, mean device ms a step and mean ms
    the device then waited for the host before the next step began."""
    rows: dict[str, list] = {}
    for (busy, wait), (seqs, tokens, prompt) in zip(step_times(timeline), shapes, strict=True):
        row = rows.setdefault(shape_key(seqs, prompt), [0, 0, 0.0, 0.0])
        row[0] += 1
        row[1] += tokens
        row[2] += busy
        row[3] += wait
    return {
        k: {"steps": n, "tokens": t / n, "device_ms": d / n, "waits_ms": w / n}
        for k, (n, t, d, w) in sorted(rows.items())
    }


class GcPauses:
    """``gc.callbacks`` hook: the garbage collector's pauses by generation while installed."""

    def __init__(self):
        self.started = 0.0
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self.longest = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        pause = time.perf_counter() - self.started
        self.seconds[info["generation"]] += pause
        self.count[info["generation"]] += 1
        self.longest = max(self.longest, pause)

    def summary(self) -> dict:
        return {"seconds": sum(self.seconds), "by_generation_s": self.seconds,
                "collections": self.count, "longest_s": self.longest}  # fmt: skip


class ShapeRecorder:
    """Wraps ``ModelRunner.launch``: each launched step's (sequences, tokens, prompt tokens)."""

    def __init__(self, launch):
        self.launch = launch
        self.shapes: list[tuple[int, int, int]] = []

    def __call__(self, out, *args, **kwargs):
        prompt = sum(c.num_tokens for c in out.scheduled if c.start < c.request.num_prompt_tokens)
        self.shapes.append((len(out.scheduled), out.num_tokens, prompt))
        return self.launch(out, *args, **kwargs)


def run(
    async_scheduling: bool,
    prompts: list[list[int]],
    outputs: list[int],
    gc_freeze: bool = False,
    **engine_args,
) -> dict:
    t0 = time.perf_counter()
    llm = make_llm(
        max_num_seqs=None,
        max_num_batched_tokens=None,
        cuda_graph_max_batch=None,
        async_scheduling=async_scheduling,
        **engine_args,
    )
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    runner.timeline = []
    recorder = ShapeRecorder(runner.launch)
    runner.launch = recorder
    if gc_freeze:  # as a worker actor does when its loop starts
        freeze_startup_heap()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        r = throughput(llm, prompts, outputs)
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()
    torch.cuda.synchronize()
    busy, idle = device_time(runner.timeline)
    shapes = recorder.shapes
    steps = by_shape(runner.timeline, shapes) if len(shapes) == len(runner.timeline) else {}
    r |= {
        "async_scheduling": async_scheduling,
        "max_num_seqs": llm.engine.cfg.max_num_seqs,
        "max_num_batched_tokens": llm.engine.cfg.max_num_batched_tokens,
        "start_s": start_s,
        "steps": len(runner.timeline),
        "device_busy_s": busy,
        "device_waits_for_host_s": idle,
        "host_exposed_share": idle / r["seconds"],
        "ms_per_step": 1e3 * r["seconds"] / len(runner.timeline),
        "by_shape": steps,
        "gc": pauses.summary(),
        "gc_freeze": gc_freeze,
        **{k: v for k, v in engine_args.items() if v is not None},
    }
    runner.timeline = None
    del runner.launch  # the class's method again
    recorder.launch = None  # it held the runner
    del llm, runner
    check_freed()
    log(
        f"async={async_scheduling}: {r['req_s']:.1f} req/s, {r['output_tok_s']:.0f} out tok/s, "
        f"{r['steps']} steps, device waited {idle:.2f} of {r['seconds']:.1f} s; gc paused "
        f"{r['gc']['seconds']:.2f} s over {sum(r['gc']['collections'])} collections "
        f"(longest {r['gc']['longest_s'] * 1e3:.0f} ms, gc.freeze {gc_freeze})"
    )
    return r


def workloads(n: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    items = read_workload(VLLM_SAMPLE)[:n]
    lengths = json.loads((ROOT / "benchmarks" / SHAREGPT_LENGTHS).read_text())["lengths"][:n]
    return {
        "vllm_sharegpt": ([list(i.prompt_token_ids) for i in items], [i.output_len for i in items]),
        "sharegpt_lengths": (prompts_for(lengths, 21), [o for _, o in lengths]),
    }


def print_table(result: dict) -> None:
    print(f"\n{result['gpu']}, engine defaults, {result['requests']} requests at once")
    head = (
        "| workload | async | req/s | out tok/s | steps | ms/step | device busy | waits for host |"
    )
    print(head)
    print("|" + " --- |" * 8)
    for r in result["runs"]:
        print(
            f"| {r['workload']} | {'on' if r['async_scheduling'] else 'off'} | {r['req_s']:.1f} | "
            f"{r['output_tok_s']:,.0f} | {r['steps']} | {r['ms_per_step']:.2f} | "
            f"{r['device_busy_s']:.1f} s | {r['device_waits_for_host_s']:.2f} s "
            f"({100 * r['host_exposed_share']:.1f} %) |"
        )
    for r in result["runs"]:
        if not r.get("by_shape"):
            continue
        print(
            f"\n{r['workload']}, async {'on' if r['async_scheduling'] else 'off'}: "
            "steps by kind and sequences"
        )
        print(
            "| step | steps | tokens | device ms | device waits for host, ms |\n|---|---|---|---|---|"
        )
        for k, v in r["by_shape"].items():
            print(
                f"| {k} | {v['steps']} | {v['tokens']:.0f} | {v['device_ms']:.2f} | "
                f"{v['waits_ms']:.2f} |"
            )


def plot(result: dict, path: Path) -> None:
    """Requests per second with async scheduling off and on, per workload, and where each
    run's wall time went (the device busy, the device waiting for the host)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['workload']}\nasync {'on' if r['async_scheduling'] else 'off'}" for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["#1f77b4" if r["async_scheduling"] else "#bbbbbb" for r in runs]
    left.bar(labels, [r["req_s"] for r in runs], color=colors)
    left.set_ylabel("requests / s (offline, all at once)")
    busy = [r["device_busy_s"] for r in runs]
    waits = [r["device_waits_for_host_s"] for r in runs]
    right.bar(labels, busy, color="#2ca02c", label="device busy")
    right.bar(labels, waits, bottom=busy, color="#d62728", label="device waits for the host")
    right.set_ylabel("seconds")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Async scheduling, {result['gpu']}, Llama-3-8B shape, engine defaults")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workloads", default="vllm_sharegpt,sharegpt_lengths")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--settings", default="off,on", help="async scheduling: off and/or on")
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--kv-cache-dtype", default=None, choices=(None, "auto", "fp8"))
    ap.add_argument("--gc-freeze", default="off", help="gc.freeze() after start-up: off and/or on")
    ap.add_argument("--replot", type=Path, default=None, help="table and plot of a saved JSON")
    args = ap.parse_args()
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        print_table(result)
        plot(result, args.replot.with_suffix(".png"))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    loads = workloads(args.num_requests)
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "requests": args.num_requests,
        "runs": [],
    }
    engine_args = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    engine_args = {k: v for k, v in engine_args.items() if v is not None}
    settings = [{"off": False, "on": True}[s] for s in args.settings.split(",")]
    if not args.no_warmup:
        log(f"{result['gpu']}: warm-up (Triton compiles), 100 requests")
        prompts, outputs = loads["vllm_sharegpt"]
        run(True, prompts[:100], outputs[:100], **engine_args)
    for name in args.workloads.split(","):
        prompts, outputs = loads[name]
        for _ in range(args.repeats):
            for on in settings:
                for freeze in [{"off": False, "on": True}[f] for f in args.gc_freeze.split(",")]:
                    log(f"{name}, async_scheduling={on}, gc.freeze {freeze}")
                    r = run(on, prompts, outputs, freeze, **engine_args)
                    result["runs"].append(r | {"workload": name})
                    (args.out / "gpu_async.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    plot(result, args.out / "gpu_async.png")


if __name__ == "__main__":
    main()
