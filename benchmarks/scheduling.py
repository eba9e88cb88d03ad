"""The router's queue policy under load, through the gateway: fcfs against sjf driven by the
learned length predictor, and sjf driven by the oracle (the true length: the ceiling).

    python benchmarks/scheduling.py                       # SmolLM2 fp32 on CPU, ShareGPT chats
    python benchmarks/scheduling.py --replot benchmarks/results/scheduling_cpu.json

One colocated worker running ``--slots`` sequences at once (its max_num_seqs; the router holds
the rest in its queue), real ShareGPT first-turn prompts through /v1/chat/completions, greedy,
``max_tokens`` ``--max-output``. Each configuration gets its own gateway (its own router) over
the same worker. The answers' lengths (``--workload``)::

    sharegpt   (default) each answer as long as its ShareGPT answer (capped at --max-output):
               the client stops reading there and the server aborts the rest, so the server
               is never told the length (only the oracle's header carries it); the learned
               predictor's tau is taken against these lengths. SmolLM2-135M's own answers run
               to the cap for most prompts (see ``text``), which leaves no order to choose.
    text       the served model's own answers: a calibration pass first (every prompt once,
               ``--slots`` at a time) measures each one's length (sent afterwards as the
               oracle's x-tandem-oracle-tokens header) and the learned predictor's tau and MAE
               against them (its x-tandem-predicted-tokens)

Then::

    1. the same requests at each offered rate (multiples of the capacity, Poisson, seeded;
       ``inf``: one burst, run first; it gives the capacity when there was no calibration),
       once per configuration: mean / p99 end-to-end latency, mean TTFT, throughput
    2. early rejection: Poisson at ``--overload`` x the measured capacity, fcfs without and with
       ``--reject-wait``: the share of admitted requests that meet the TTFT SLO (``--slo-ttft``),
       goodput, and whether every refusal carried a Retry-After

On a GPU (``--device cuda``) two more workloads::

    --model smollm2 --dtype bfloat16     the same real-text comparison, faster
    --workload lengths                   the Llama-3.1-8B shape with dummy weights
                                         (benchmarks/configs/llama3-8b): prompts of ShareGPT
                                         lengths, each answer exactly its ShareGPT length
                                         (max_tokens, ignore_eos); dummy weights give no real
                                         lengths to learn from, so besides the oracle it runs a
                                         *noisy oracle* (sjf-noisy): the true length times
                                         log-normal noise, its spread set so that Kendall's tau
                                         of what the router sees (capped by max_tokens) matches
                                         ``--noisy-tau`` (the learned predictor's held-out tau)

    python benchmarks/scheduling.py --device cuda --model smollm2 --dtype bfloat16 --slots 32 \
        --num-prompts 400 --max-output 512 --out benchmarks/results/scheduling_gpu_smollm2.json
    python benchmarks/scheduling.py --device cuda --workload lengths \
        --model benchmarks/configs/llama3-8b --slots 64 --num-prompts 600 --max-output 1024 \
        --lengths-file benchmarks/data/sharegpt_llama3_lengths.json \
        --out benchmarks/results/scheduling_gpu_8b.json

Writes ``--out`` (JSON) and a plot beside it (latency against offered rate for the three).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import GatewayThread  # noqa: E402
from benchmarks.serve import (  # noqa: E402
    Request,
    Target,
    compute_metrics,
    make_client,
    run_rate,
    stream_client,
)
from benchmarks.workloads import sharegpt_prompts  # noqa: E402

LEARNED = str(ROOT / "router" / "data" / "length_smollm2")
ORACLE = "x-tandem-oracle-tokens"
CONFIGS = {  # workload -> name -> (queue policy, predictor, what the oracle header carries)
    "text": {
        "fcfs": ("fcfs", "none", "true"),
        "sjf-learned": ("sjf", LEARNED, "true"),
        "sjf-oracle": ("sjf", "oracle", "true"),
    },
    "sharegpt": {
        "fcfs": ("fcfs", "none", "true"),
        "sjf-learned": ("sjf", LEARNED, "true"),
        "sjf-oracle": ("sjf", "oracle", "true"),
    },
    "lengths": {
        "fcfs": ("fcfs", "none", "true"),
        "sjf-noisy": ("sjf", "oracle", "noisy"),
        "sjf-oracle": ("sjf", "oracle", "true"),
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


MAX_WAIT_S = 600.0  # sjf's absolute cap: a CPU burst lasts minutes (the default is 120 s)


def through_gateway(
    cluster, target: Target, requests: list[Request], rate: float, seed: int, policy: str,
    predictor: str, *, reject_wait_s: float = 0.0, limit: int | None = None,
) -> tuple[list, float, dict[str, Any]]:  # fmt: skip
    """``requests`` sent at ``rate`` through a gateway of its own (its own router: queue
    ``policy``, ``predictor``) over ``cluster``: (records, seconds, its scheduling stats)."""
    from router.admission import QueueConfig

    cfg = SimpleNamespace(
        max_resumes=2, stall_timeout_s=60.0, max_concurrent=8192, max_body_bytes=8 << 20
    )
    queue = QueueConfig(policy, max_queue=8192, max_wait_s=MAX_WAIT_S, reject_wait_s=reject_wait_s)
    gw = GatewayThread(cluster, None, cfg, "smollm2", queue=queue, predictor=predictor).start()

    async def send():
        async with make_client(1800.0) as client:
            t0 = time.perf_counter()
            tgt = replace(target, base_url=gw.url)
            streams = stream_client("raw", 1800.0, tgt.url, client)  # (httpx paced bursts)
            records = await run_rate(streams, tgt, requests, rate, seed, max_concurrency=limit)
            return records, time.perf_counter() - t0

    try:
        records, seconds = asyncio.run(send())
        return records, seconds, gw.backend.router_stats().scheduling
    finally:
        gw.stop()


def kendall(a, b) -> float:
    from router.predictor import kendall_tau

    return round(kendall_tau(a, b), 4)


def noisy(lengths: list[int], tau: float, seed: int) -> tuple[list[int], float]:
    """Each length times exp(sigma * z) (z standard normal, seeded), capped by the length
    itself as the router caps by max_tokens; sigma bisected so Kendall's tau of the result
    against the lengths is ``tau``. Returns (the values, sigma)."""
    import numpy as np

    z = np.random.default_rng(seed).standard_normal(len(lengths))
    true = np.asarray(lengths, dtype=np.float64)

    def values(sigma: float) -> list[int]:
        return [max(1, round(v)) for v in np.minimum(true * np.exp(sigma * z), true)]

    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kendall(values(mid), lengths) > tau else (lo, mid)
    return values(hi), hi


def summary(records) -> dict[str, Any]:
    m = compute_metrics(records)
    keys = ("completed", "failed", "duration", "request_throughput", "mean_e2el_ms",
            "median_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")  # fmt: skip
    return {k: m.get(k) for k in keys}


def engine_counts(cluster, before: dict | None = None, seconds: float = 0.0) -> dict:
    """The worker's step and preemption counters (summed over workers); with ``before``, what
    one run added, and its mean step time (why a policy's run takes longer)."""
    stats = cluster.stats()
    now = {k: sum(s[k] for s in stats) for k in ("steps", "preemptions")}
    if before is None:
        return now
    out = {k: now[k] - before[k] for k in now}
    out["mean_step_ms"] = round(1e3 * seconds / out["steps"], 3) if out["steps"] else None
    return out


def start_cluster(args):
    from cluster.launch.local import LocalCluster

    engine: dict[str, Any] = {"max_num_seqs": args.slots, "max_num_batched_tokens": 1024}
    if args.device == "cuda":
        engine |= {"dtype": args.dtype, "max_num_batched_tokens": 4096,
                   "cuda_graph_max_batch": args.slots}  # fmt: skip
        if args.workload == "lengths":
            engine |= {"load_format": "dummy", "max_model_len": 4096}
    return LocalCluster(
        model=args.model,
        num_prefill=0,
        num_decode=0,
        num_colocated=1,
        device=args.device,
        engine=engine,
    )


def text_requests(args, tok) -> list[Request]:
    prompts = sharegpt_prompts(tok, args.num_prompts, max_prompt=args.max_prompt, seed=args.seed)
    return [Request(text, p, args.max_output) for text, p, _ in prompts]


def length_requests(args) -> list[Request]:
    """Token-id prompts of ShareGPT lengths (distinct: no prefix hits), each answer its
    ShareGPT length (capped)."""
    import random

    from benchmarks.workloads import read_lengths

    pairs = read_lengths(args.lengths_file)
    random.Random(args.seed).shuffle(pairs)
    pairs = [(p, min(o, args.max_output)) for p, o in pairs if p <= args.max_prompt]
    return [
        Request([1000 + (7 * i + j) % 30000 for j in range(p)], p, o)
        for i, (p, o) in enumerate(pairs[: args.num_prompts])
    ]


def with_header(requests: list[Request], values: list[int]) -> list[Request]:
    return [replace(r, headers=((ORACLE, str(v)),)) for r, v in zip(requests, values, strict=True)]


def emulated_requests(args, tok) -> list[Request]:
    """Real ShareGPT prompts whose answers are their ShareGPT answers' lengths (capped): the
    client stops reading there (the server aborts the rest), max_tokens is the cap, and the
    server is never told the length (only the oracle's header carries it)."""
    prompts = sharegpt_prompts(tok, args.num_prompts, max_prompt=args.max_prompt, seed=args.seed)
    return [
        Request(text, p, args.max_output, stop_after=min(o, args.max_output))
        for text, p, o in prompts
    ]


def calibrate(args, cluster, target: Target, base: list[Request], cal: dict) -> list[int]:
    """Every prompt once, ``--slots`` at a time, through an fcfs gateway with the learned
    predictor: the served model's own answer lengths, the predictor's tau against them, and
    the capacity."""
    recs, seconds, _ = through_gateway(
        cluster, target, base, math.inf, args.seed, "fcfs", LEARNED, limit=args.slots
    )
    bad = [r.error for r in recs if not r.success]
    if bad:
        raise RuntimeError(f"calibration failed: {bad[:3]}")
    actual = [r.output_tokens for r in recs]
    cal |= {"seconds": round(seconds, 1), "capacity_req_s": round(len(recs) / seconds, 4)}
    if args.workload == "text":
        cal |= quality([float(r.predicted_tokens or 0) for r in recs], actual)
    return actual


def quality(predicted: list[float], actual: list[int]) -> dict[str, float]:
    mae = sum(abs(p - a) for p, a in zip(predicted, actual, strict=True)) / len(actual)
    return {"learned_tau": kendall(predicted, actual), "learned_mae": round(mae, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.tokenizer import load_tokenizer

    configs = CONFIGS[args.workload]
    chat = args.workload in ("text", "sharegpt")
    target = Target("", "smollm2", endpoint="chat" if chat else "completions",
                    ignore_eos=not chat, temperature=0.0 if chat else 1.0)  # fmt: skip
    cluster = start_cluster(args)
    results: dict[str, Any] = {"config": vars(args), "rates": {}, "rejection": {}}
    cal = results["calibration"] = {}
    try:
        if args.workload == "lengths":
            base = length_requests(args)
            log(f"{len(base)} requests of ShareGPT lengths; calibrating (capacity)")
            actual = calibrate(args, cluster, target, base, cal)
        elif args.workload == "text":
            base = text_requests(args, load_tokenizer(cluster.model_dir))
            log(f"{len(base)} ShareGPT prompts; calibrating (the served model's own lengths)")
            actual = calibrate(args, cluster, target, base, cal)
        else:  # the capacity comes from the first fcfs burst
            base = emulated_requests(args, load_tokenizer(cluster.model_dir))
            actual = [r.stop_after for r in base]
            log(f"{len(base)} ShareGPT prompts, answers of their ShareGPT lengths; warming up")
            # the first requests of a fresh worker are slow: not in any measured run
            warm = [replace(r, stop_after=8) for r in base[: args.slots]]
            through_gateway(cluster, target, warm, math.inf, 0, "fcfs", "none")
        cal["output_tokens"] = {"mean": sum(actual) / len(actual), "max": max(actual)}
        cal["capped"] = sum(a >= args.max_output for a in actual)
        headers = {"true": actual}
        if args.workload == "lengths":
            headers["noisy"], cal["noisy_sigma"] = noisy(actual, args.noisy_tau, args.seed)
            cal["noisy_tau"] = kendall(headers["noisy"], actual)
        log(f"calibration: {cal}")
        order = sorted(args.rates, key=lambda x: x != "inf")  # the burst first
        for x in order:
            rate = math.inf if x == "inf" else float(x) * cal["capacity_req_s"]
            key = "inf" if rate == math.inf else f"{rate:.3f}"
            results["rates"][key] = {}
            for name, (policy, predictor, header) in configs.items():
                if args.configs and name not in args.configs:
                    continue
                requests = with_header(base, headers[header])
                before = engine_counts(cluster)
                recs, seconds, scheduling = through_gateway(
                    cluster, target, requests, rate, args.seed, policy, predictor
                )
                got = [r.output_tokens for r in recs]
                entry = summary(recs)
                entry["engine"] = engine_counts(cluster, before, seconds)
                entry["same_lengths"] = sum(g == a for g, a in zip(got, actual, strict=True))
                entry["scheduling"] = scheduling
                results["rates"][key][name] = entry
                if "capacity_req_s" not in cal and name == "fcfs":
                    cal["capacity_req_s"] = round(entry["request_throughput"], 4)
                if args.workload == "sharegpt" and predictor == LEARNED and rate == math.inf:
                    cal |= quality([float(r.predicted_tokens or 0) for r in recs], actual)
                log(f"rate {key} {name}: mean e2e {entry['mean_e2el_ms']:.0f} ms, p99 "
                    f"{entry['p99_e2el_ms']:.0f} ms, mean ttft {entry['mean_ttft_ms']:.0f} ms, "
                    f"{entry['request_throughput']:.3f} req/s")  # fmt: skip
        if args.overload > 0:
            requests = with_header(base, actual)
            results["rejection"] = rejection(args, cluster, target, requests, cal["capacity_req_s"])
    finally:
        cluster.shutdown()
    return results


def rejection(args, cluster, target: Target, requests: list[Request], capacity: float) -> dict:
    """fcfs at ``--overload`` x capacity, without and with early rejection: the share of the
    admitted requests that meet the TTFT SLO, goodput, and the refusals' Retry-After."""
    out = {}
    rate = args.overload * capacity
    for label, wait in (("off", 0.0), ("on", args.reject_wait)):
        recs, _, _ = through_gateway(
            cluster, target, requests, rate, args.seed + 1, "fcfs", LEARNED, reject_wait_s=wait
        )
        done = [r for r in recs if r.success]
        refused = [r for r in recs if r.status in (429, 503)]
        met = [r for r in done if r.ttft <= args.slo_ttft]
        m = compute_metrics(recs)
        out[label] = {
            "offered_req_s": round(rate, 3),
            "sent": len(recs),
            "completed": len(done),
            "refused": len(refused),
            "refused_with_retry_after": sum(r.retry_after is not None for r in refused),
            "slo_met": len(met),
            "slo_attainment_of_admitted": round(len(met) / len(done), 4) if done else None,
            "goodput_req_s": round(len(met) / m["duration"], 4) if m["duration"] else None,
            "mean_ttft_ms": m.get("mean_ttft_ms"),
            "p99_ttft_ms": m.get("p99_ttft_ms"),
        }
        log(f"early rejection {label}: {out[label]}")
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        "| offered | policy | mean E2E s | p99 E2E s | mean TTFT s | req/s | vs fcfs mean E2E |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rate, runs in results["rates"].items():
        base = runs["fcfs"]["mean_e2el_ms"]
        for name, r in runs.items():
            lines.append(
                f"| {rate} | {name} | {r['mean_e2el_ms'] / 1e3:.2f} | {r['p99_e2el_ms'] / 1e3:.2f}"
                f" | {r['mean_ttft_ms'] / 1e3:.2f} | {r['request_throughput']:.3f}"
                f" | {base / r['mean_e2el_ms']:.2f}x |"
            )
    rej = results.get("rejection") or {}
    if rej:
        lines += ["", "| early rejection | sent | completed | refused (with Retry-After) | "
                  "SLO met of admitted | goodput req/s |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for label, r in rej.items():
            lines.append(
                f"| {label} | {r['sent']} | {r['completed']} | {r['refused']} "
                f"({r['refused_with_retry_after']}) | {r['slo_attainment_of_admitted']} | "
                f"{r['goodput_req_s']} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted(float(r) for r in results["rates"] if r != "inf")
    rates = [f"{r:.3f}" for r in finite] + (["inf"] if "inf" in results["rates"] else [])
    burst_x = (max(finite) * 1.4) if finite else 1.0
    xs = [burst_x if r == "inf" else float(r) for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("mean_e2el_ms", "mean end-to-end latency (s)"),
              ("p99_e2el_ms", "p99 end-to-end latency (s)"), ("mean_ttft_ms", "mean TTFT (s)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        for name in results["rates"][rates[0]]:
            ys = [results["rates"][r][name][key] / 1e3 for r in rates]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel("offered load (req/s; rightmost: one burst)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    cal = results.get("calibration", {})
    cfg = results.get("config", {})
    model = Path(str(cfg.get("model", "smollm2"))).name
    tau = cal.get("learned_tau", cal.get("noisy_tau"))
    fig.suptitle(
        f"{model} on {cfg.get('device', 'cpu')} through the gateway, {cfg.get('workload', 'text')} "
        f"workload: queue policy (predictor tau {tau} against the served lengths)"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    log(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", help="cuda only (CPU: float32)")
    ap.add_argument("--workload", default="sharegpt", choices=list(CONFIGS))
    ap.add_argument("--lengths-file", default=str(ROOT / "benchmarks" / "data" /
                    "sharegpt_llama3_lengths.json"))  # fmt: skip
    ap.add_argument(
        "--noisy-tau", type=float, default=0.4, help="lengths workload: sjf-noisy's tau"
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--slots", type=int, default=8, help="the worker's max_num_seqs")
    ap.add_argument(
        "--rates", nargs="+", default=["0.7", "1.0", "inf"],
        help="offered loads as multiples of the measured capacity, or inf (one burst)",
    )  # fmt: skip
    ap.add_argument(
        "--configs", nargs="+", default=None, help="only these of the workload's configurations"
    )
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="seconds")
    ap.add_argument("--reject-wait", type=float, default=6.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scheduling_cpu.json"))
    ap.add_argument("--replot", default=None, metavar="JSON")
    args = ap.parse_args()
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
    else:
        results = run(args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {out}")
    print(table(results))
    plot(results, Path(args.replot or args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
