"""One engine step at a time on one GPU, Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy
bf16 weights): each kind of step against its floor, eager and under CUDA graphs (issue 23).

Steps are built by hand (requests with disjoint block tables; the KV cache holds zeros, which
costs the same to read) and run through ``ModelRunner.execute``, whose sampler reads the
tokens back, so one call's wall time is the step as the engine thread sees it:

(a) pure decode, batch 256, 512 tokens of context each (decode graphs), against the bytes it
    must read (weights + KV) over the HBM copy rate measured in this run;
(b) mixed: the same 256 decodes + one 2048-token prefill chunk, eager and with piecewise graphs,
    against (a) + the chunk's matmul FLOPs at the bf16 rate measured in this run;
(c) prefill only, 512 and 2048 tokens (and a sweep of other sizes), eager and piecewise;
then the graphs' capture time and memory, and (unless --no-sharegpt) the offline throughput of
benchmarks/gpu_engine.py's ShareGPT-lengths workload with the piecewise graphs off and on.

    PYTHONPATH=$PWD python benchmarks/gpu_step.py --out DIR [--no-sharegpt] [--num-requests 1000]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import bf16_matmul_flops, hbm_copy_bandwidth  # noqa: E402
from benchmarks.gpu_engine import log, make_llm, throughput  # noqa: E402
from benchmarks.workloads import SHAREGPT_LENGTHS  # noqa: E402

BATCH, CONTEXT, CHUNK = 256, 512, 2048
MIXED_CHUNKS = (128, 512, 1024, 2048)
PREFILLS = (128, 512, 1024, 2048, 4096, 8192)
MAX_TOKENS = 8192  # largest piecewise bucket here: covers every step above


class StepFactory:
    """Scheduler outputs made by hand: each request gets blocks of its own."""

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size, self.num_blocks, self.next_block, self.n = block_size, num_blocks, 0, 0

    def chunk(self, context: int, num_tokens: int):
        """A request with ``context`` tokens cached and ``num_tokens`` new ones, all sampled."""
        from engine.request import Request
        from engine.sampling_params import SamplingParams
        from engine.scheduler import ScheduledRequest

        total = context + num_tokens
        blocks = -(-total // self.block_size)
        if self.next_block + blocks > self.num_blocks:
            raise RuntimeError(f"KV pool of {self.num_blocks} blocks too small for this step")
        table = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        rng = random.Random(self.n)
        self.n += 1
        ids = [rng.randrange(128, 128000) for _ in range(total)]
        request = Request(f"r{self.n}", ids, SamplingParams(temperature=0.0, max_tokens=16))
        return ScheduledRequest(request, context, num_tokens, table)


def time_step(runner, out, reps: int) -> float:
    """Median wall seconds of ``runner.execute(out)`` (it ends in the sampler's read-back)."""
    for _ in range(3):
        runner.execute(out)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_step_pipelined(runner, out, reps: int) -> float:
    """Wall seconds per step of ``reps`` steps run as the engine runs them under async
    scheduling: step N+1 launched (its inputs prepared, its kernels queued) before step N's
    tokens are read back, so the host's share hides behind the device's."""
    for _ in range(3):
        runner.execute(out)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_pipelined(runner, out, reps)
    return (time.perf_counter() - t0) / reps


def run_pipelined(runner, out, n: int) -> None:
    """``n`` steps of ``out`` as async scheduling runs them: each launched before the one
    before it is collected."""
    launched = runner.launch(out)
    for _ in range(n - 1):
        following = runner.launch(out)
        runner.collect(launched)
        launched = following
    runner.collect(launched)


def eager_and_piecewise(runner, out, reps: int, into: dict) -> None:
    """Eager and piecewise medians, measured twice alternately (the host's launch rate drifts
    between runs); keeps both rounds and the better median of each mode."""
    rounds = {"eager": [], "piecewise": []}
    for _ in range(2):
        for mode, piecewise in (("eager", False), ("piecewise", True)):
            with with_graphs(runner, True, piecewise):
                rounds[mode].append(time_step(runner, out, reps))
    for mode, times in rounds.items():
        into[f"{mode}_s"], into[f"{mode}_rounds_s"] = min(times), times


def with_graphs(runner, decode: bool, piecewise: bool):
    """Context: the runner with its decode / piecewise graphs switched on or off."""

    class _Switch:
        def __enter__(self):
            self.saved = runner.graphs, runner.piecewise
            runner.graphs = self.saved[0] if decode else None
            runner.piecewise = self.saved[1] if piecewise else None

        def __exit__(self, *exc):
            runner.graphs, runner.piecewise = self.saved

    return _Switch()


def linear_flops(model_cfg, tokens: int) -> float:
    """Matmul FLOPs of the decoder layers' linears for ``tokens`` rows (no LM head)."""
    c = model_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    return 2.0 * tokens * per_layer * c.num_layers


def attention_flops(model_cfg, tokens: int) -> float:
    """Causal attention FLOPs of a fresh ``tokens``-token prompt (QK^T and PV, half the square)."""
    c = model_cfg
    return 2.0 * 2 * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2 * c.num_layers


def step_section(llm, bandwidth: float, flops: float, reps: int) -> dict:
    runner = llm.engine.runner
    from engine.scheduler import SchedulerOutput

    factory = StepFactory(runner.cfg.block_size, runner.num_kv_blocks)
    decodes = [factory.chunk(CONTEXT, 1) for _ in range(BATCH)]
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = runner.model_cfg.kv_bytes_per_token * 2 * BATCH * (CONTEXT + 1)
    r: dict = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
    decode_out = SchedulerOutput(scheduled=decodes)
    r["decode_floor_s"] = (weight_bytes + kv_bytes) / bandwidth
    log("(a) decode step, batch 256")
    with with_graphs(runner, True, False):
        r["decode_graph_s"] = time_step(runner, decode_out, reps)
    with with_graphs(runner, False, True):
        r["decode_piecewise_s"] = time_step(runner, decode_out, reps)
    with with_graphs(runner, False, False):
        r["decode_eager_s"] = time_step(runner, decode_out, reps)
    r["mixed"], r["prefill"] = {}, {}
    for n in MIXED_CHUNKS:
        log(f"(b) mixed step, 256 decodes + {n}-token chunk")
        out = SchedulerOutput(scheduled=decodes + [factory.chunk(0, n)])
        m = {"tokens": BATCH + n, "chunk_linear_flops": linear_flops(runner.model_cfg, n)}
        m["chunk_attention_flops"] = attention_flops(runner.model_cfg, n)
        m["floor_s"] = r["decode_graph_s"] + m["chunk_linear_flops"] / flops
        eager_and_piecewise(runner, out, reps, m)
        r["mixed"][n] = m
    for n in PREFILLS:
        log(f"(c) prefill step, {n} tokens")
        out = SchedulerOutput(scheduled=[factory.chunk(0, n)])
        p = {"linear_flops": linear_flops(runner.model_cfg, n)}
        p["attention_flops"] = attention_flops(runner.model_cfg, n)
        p["floor_s"] = (p["linear_flops"] + p["attention_flops"]) / flops
        eager_and_piecewise(runner, out, reps, p)
        r["prefill"][n] = p
    return r


def graphs_section(llm, start_s: float) -> dict:
    runner = llm.engine.runner
    g, pw = runner.graphs, runner.piecewise
    return {
        "engine_start_s": start_s,
        "decode_graphs": len(g.sizes),
        "decode_capture_s": g.capture_s,
        "decode_memory_bytes": g.memory_bytes,
        "piecewise_buckets": len(pw.sizes),
        "piecewise_graphs": len(pw.sizes) * (runner.model_cfg.num_layers + 1),
        "piecewise_capture_s": pw.capture_s,
        "piecewise_memory_bytes": pw.memory_bytes,
        "kv_blocks": runner.num_kv_blocks,
        "memory_report": runner.memory_report,
    }


def sharegpt_section(llm, n: int) -> dict:
    """The ShareGPT-lengths workload with piecewise graphs off (decode graphs only, as before
    issue 23) and on; per-step wall times split by kind."""
    import json as _json

    lengths = _json.loads((ROOT / "benchmarks" / SHAREGPT_LENGTHS).read_text())["lengths"][:n]
    runner = llm.engine.runner
    results = {}
    pw = runner.piecewise
    variants = (
        ("decode_graphs_only", 0),
        ("piecewise_2048", 2048),
        ("piecewise_8192", pw.sizes[-1]),
        ("decode_graphs_only_again", 0),
    )
    for seed, (name, max_tokens) in enumerate(variants, start=4):
        # Fresh token ids per run (same lengths): one run's prompts left in the prefix cache
        # must not turn the next run's prefills into prefix hits.
        rng = random.Random(seed)
        prompts = [[rng.randrange(128, 128000) for _ in range(p)] for p, _ in lengths]
        log(f"ShareGPT lengths, {len(prompts)} requests, {name}")
        pw.max_tokens = max_tokens  # steps above it run eagerly (the default caps it at 2048)
        piecewise = max_tokens > 0
        steps: dict[str, list[float]] = {"decode": [], "mixed": []}
        inner = runner.execute

        def timed(out, hook=None, inner=inner, steps=steps):
            t0 = time.perf_counter()
            result = inner(out, hook)
            kind = "decode" if all(c.num_tokens == 1 for c in out.scheduled) else "mixed"
            steps[kind].append(time.perf_counter() - t0)
            return result

        runner.execute = timed
        with with_graphs(runner, True, piecewise):
            r = throughput(llm, prompts, [o for _, o in lengths])
        del runner.execute
        for kind, times in steps.items():
            r[f"{kind}_steps"] = len(times)
            r[f"{kind}_step_mean_s"] = statistics.fmean(times) if times else None
            r[f"{kind}_time_s"] = sum(times)
        results[name] = r
    pw.max_tokens = pw.sizes[-1]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--no-sharegpt", action="store_true")
    ap.add_argument("--no-steps", action="store_true", help="skip (a)-(c)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name()}

    def save() -> None:
        (args.out / "gpu_step.json").write_text(json.dumps(result, indent=2, default=str))

    log(f"{result['gpu']}: HBM copy bandwidth and bf16 matmul rate")
    bandwidth = result["hbm_copy_bytes_per_s"] = hbm_copy_bandwidth()
    flops = result["bf16_matmul_flops"] = bf16_matmul_flops()
    log("loading tandem (Llama-3-8B shape, dummy bf16), capturing decode + piecewise graphs")
    t0 = time.perf_counter()
    llm = make_llm(cuda_graph_max_tokens=MAX_TOKENS)
    result["graphs"] = graphs_section(llm, time.perf_counter() - t0)
    save()
    if not args.no_steps:
        result["steps"] = step_section(llm, bandwidth, flops, args.reps)
        save()
    if not args.no_sharegpt:
        result["sharegpt"] = sharegpt_section(llm, args.num_requests)
        save()
    print_table(result)


def print_table(r: dict) -> None:
    ms, mib = 1e3, 2**20
    g = r["graphs"]
    rows = [
        ("GPU", r["gpu"]),
        ("HBM copy", f"{r['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s"),
        ("bf16 matmul", f"{r['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"),
        ("decode graphs", f"{g['decode_graphs']} in {g['decode_capture_s']:.1f} s, "
                          f"{g['decode_memory_bytes'] / mib:.0f} MiB"),
        ("piecewise graphs", f"{g['piecewise_graphs']} ({g['piecewise_buckets']} buckets) in "
                             f"{g['piecewise_capture_s']:.1f} s, "
                             f"{g['piecewise_memory_bytes'] / mib:.0f} MiB"),
    ]  # fmt: skip
    if "steps" in r:
        rows += step_rows(r["steps"])
    for name, t in r.get("sharegpt", {}).items():
        rows.append((f"ShareGPT {name}", f"{t['req_s']:.1f} req/s, {t['output_tok_s']:.0f} out "
                     f"tok/s; mixed steps {t['mixed_steps']} x {t['mixed_step_mean_s'] * ms:.1f} "
                     f"ms, decode {t['decode_steps']} x {t['decode_step_mean_s'] * ms:.1f} ms"))  # fmt: skip
    print()
    for name, value in rows:
        print(f"{name:<34}{value}")


def step_rows(s: dict) -> list[tuple[str, str]]:
    ms = 1e3
    floor = s["decode_floor_s"]
    rows = [
        ("(a) decode floor", f"{floor * ms:.2f} ms (weights + KV over HBM copy)"),
        ("(a) decode graph", f"{s['decode_graph_s'] * ms:.2f} ms = "
                             f"{s['decode_graph_s'] / floor:.3f}x floor"),
        ("(a) piecewise / eager", f"{s['decode_piecewise_s'] * ms:.2f} / "
                                  f"{s['decode_eager_s'] * ms:.2f} ms"),
    ]  # fmt: skip
    for label, section in (("(b) 256 dec +", s["mixed"]), ("(c) prefill", s["prefill"])):
        for n, m in section.items():
            e, p, f = m["eager_s"], m["piecewise_s"], m["floor_s"]
            rows.append((f"{label} {n}", f"eager {e * ms:.2f}, piecewise {p * ms:.2f} ms; "
                         f"floor {f * ms:.2f} ms -> {e / f:.2f}x / {p / f:.2f}x"))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
