"""Load imbalance between decode workers, rebalance off vs on, through the gateway.

    python benchmarks/rebalance.py                     # CPU: SmolLM2, 1 prefill + 2 decode
    python benchmarks/rebalance.py --requests 60 --rate 2

A skewed load: ShareGPT lengths (prompt and answer token counts of real first turns, the
answers clipped to ``--max-output``) sent open-loop through the OpenAI gateway with round-robin
decode placement, ordered so that every long answer lands on one decode worker (long and short
answers alternate; round robin alternates the workers). That worker's KV fills, it preempts
(recomputing the victims later), its streams slow; the other worker idles. The same requests
run twice on one cluster: rebalance off, then on (the controller's loop moves requests from a
worker whose projected KV use, blocks in use plus what its requests will still need, is over
the high mark to one under the low mark, by live migration).

Reported per run: completed requests per second, TTFT and TPOT percentiles, preemptions, the
migrations made and the preemptions they avoided, and each decode worker's KV use over time.
Writes benchmarks/results/rebalance.json and rebalance.png (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
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
from benchmarks.workloads import read_lengths, sharegpt_lengths  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def skewed_requests(
    tokenizer, n: int, max_output: int, seed: int, run: int, lengths_file: str | None = None
) -> list[Request]:
    """ShareGPT lengths, heavy and light requests alternating by the KV they need (prompt +
    answer), so round robin sends every heavy one to the same decode worker. Prompts are token
    ids of the real length, distinct per ``run`` (no prefix-cache hit from an earlier run)."""
    if lengths_file is not None:  # (no ShareGPT text where the run is: its lengths, measured)
        raw = read_lengths(lengths_file)
        random.Random(seed).shuffle(raw)
    else:
        raw = sharegpt_lengths(tokenizer, 4 * n, seed)
    pairs = [(p, min(o, max_output)) for p, o in raw]
    pairs = [(p, o) for p, o in pairs if p <= 1024][:n]
    by_size = sorted(pairs, key=lambda x: x[0] + x[1])
    light, heavy = by_size[: n // 2], by_size[n // 2 :][::-1]
    ordered = [x for pair in zip(heavy, light, strict=False) for x in pair]
    lo = 1000 + 5000 * run
    return [
        Request(prompt=[lo + (7 * i + j) % 4000 for j in range(p)], prompt_len=p, output_len=o)
        for i, (p, o) in enumerate(ordered)
    ]


class Sampler:
    """Each decode worker's KV use (in use / total) and projected use, every ``every_s``."""

    def __init__(self, cluster, every_s: float = 0.25) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import ray

        from engine.messages import control

        while not self._stop.wait(self.every_s):
            refs = [control(w.handle.stats).remote() for w in self.cluster.decode]
            try:
                stats = ray.get(refs, timeout=5)
            except Exception:  # noqa: BLE001 - a slow poll: skip it
                continue
            t = time.perf_counter() - self.t0
            for s in stats:
                self.samples.append(
                    {
                        "t": round(t, 3),
                        "worker": s["name"],
                        "use": s["in_use_blocks"] / s["total_blocks"],
                        "projected": s["projected_blocks"] / s["total_blocks"],
                        "running": s["running"],
                        "waiting": s["waiting"],
                    }
                )


def decode_counters(cluster) -> dict[str, int]:
    stats = [s for s in cluster.stats() if s["role"] == "decode"]
    return {
        "preemptions": sum(s.get("preemptions", 0) for s in stats),
        "migrations": sum(
            sum(s["migrations"]["out"].get(k, 0) for k in ["migrated"]) for s in stats
        ),
    }


async def one_run(gateway, requests, args) -> tuple[list, float, dict]:
    """The run's records, seconds, and the gateway's token-timed latency histograms over it."""
    target = Target(gateway.url, "tandem", ignore_eos=True, temperature=args.temperature)
    async with make_client(600.0) as client:
        before = await gateway_histograms(client, gateway.url)
        t0 = time.perf_counter()
        streams = stream_client("raw", 600.0, target.url, client)  # (httpx paced bursts)
        records = await run_rate(streams, target, requests, args.rate, seed=args.seed)
        seconds = time.perf_counter() - t0
        after = await gateway_histograms(client, gateway.url)
    hist = {}
    for name, buckets in after.items():
        old = before.get(name, {})
        hist[name] = {le: n - old.get(le, 0.0) for le, n in buckets.items()}
    return records, seconds, hist


HISTOGRAMS = ("tandem:inter_token_latency_seconds", "tandem:time_to_first_token_seconds")


async def gateway_histograms(client, url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the gateway's ITL and TTFT histograms (timed by tokens at
    the gateway: right whatever the text looks like, dummy weights included)."""
    text = (await client.get(f"{url}/metrics")).text
    out: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        for name in HISTOGRAMS:
            if line.startswith(f"{name}_bucket{{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                out.setdefault(name, {})[bound] = float(line.rsplit(" ", 1)[1])
    return out


def hist_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket)."""
    items = sorted(buckets.items())
    total = items[-1][1] if items else 0.0
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in items:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 1)
        prev_bound, prev_count = bound, count
    return prev_bound


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.launch.local import LocalCluster
    from engine.tokenizer import load_tokenizer

    engine: dict[str, Any] = {"max_num_batched_tokens": 512, "max_num_seqs": 32}
    extra: dict[str, Any] = {}
    if args.device == "cuda":  # the 8B shape, dummy weights; TCP KV (see --transport)
        engine = {
            "dtype": "bfloat16",
            "load_format": "dummy",
            "max_model_len": 4096,
            "max_num_batched_tokens": 4096,
            "max_num_seqs": 128,
            "cuda_graph_max_batch": 128,
        }
        extra = {"gpus": {"prefill": 0.5, "decode": 0.5}, "transport": args.transport}
    cluster = LocalCluster(
        model=args.model,
        num_prefill=1,
        num_decode=2,
        device=args.device,
        engine={**engine, "block_size": 16},  # --kv-blocks counts blocks of 16 on any device
        decode_engine={"num_kv_blocks": args.kv_blocks},
        prefill_engine={"num_kv_blocks": max(1024, 2 * args.kv_blocks)},
        **extra,
    )
    results: dict[str, Any] = {"config": vars(args), "runs": {}}
    cfg = SimpleNamespace(
        max_resumes=2, stall_timeout_s=30.0, max_concurrent=512, max_body_bytes=8 << 20
    )
    gateway = GatewayThread(cluster, None, cfg, "tandem", policy="round_robin").start()
    try:
        tokenizer = load_tokenizer(cluster.model_dir)
        for run_index, mode in enumerate(args.modes):
            requests = skewed_requests(
                tokenizer, args.requests, args.max_output, args.seed, run_index, args.lengths_file
            )
            log(f"{len(requests)} requests; answers {sum(r.output_len for r in requests)} tokens")
            ray.get(cluster.controller.rebalance.remote(mode=mode, high=args.high, low=args.low,
                                                        interval_s=args.interval))  # fmt: skip
            before = decode_counters(cluster)
            rb0 = ray.get(cluster.controller.migration_stats.remote())["rebalance"]
            with Sampler(cluster) as sampler:
                records, seconds, hist = asyncio.run(one_run(gateway, requests, args))
            ray.get(cluster.controller.rebalance.remote(mode="off"))
            after = decode_counters(cluster)
            rb1 = ray.get(cluster.controller.migration_stats.remote())["rebalance"]
            metrics = compute_metrics(records)
            ok = sum(r.success for r in records)
            entry = {
                "completed": ok,
                "failed": len(records) - ok,
                "seconds": round(seconds, 2),
                "completed_per_s": round(metrics["request_throughput"], 3),
                "metrics": metrics,
                "preemptions": after["preemptions"] - before["preemptions"],
                "migrations": after["migrations"] - before["migrations"],
                "preemptions_avoided": rb1["preemptions_avoided"] - rb0["preemptions_avoided"],
                "gateway_itl_s": {
                    f"p{q}": hist_quantile(hist.get(HISTOGRAMS[0], {}), q / 100)
                    for q in (50, 90, 99)
                },
                "gateway_ttft_s": {
                    f"p{q}": hist_quantile(hist.get(HISTOGRAMS[1], {}), q / 100) for q in (50, 99)
                },
                "samples": sampler.samples,
            }
            results["runs"][mode] = entry
            log(f"rebalance {mode}: {ok}/{len(records)} in {seconds:.1f} s, "
                f"preemptions {entry['preemptions']}, migrations {entry['migrations']}")  # fmt: skip
            time.sleep(1.0)
    finally:
        gateway.stop()
        cluster.shutdown()
    return results


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["runs"])
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5 * (len(modes) + 1), 3.8))
    for ax, mode in zip(axes, modes, strict=False):
        samples = results["runs"][mode]["samples"]
        for worker in sorted({s["worker"] for s in samples}):
            pts = [s for s in samples if s["worker"] == worker]
            ax.plot([s["t"] for s in pts], [s["use"] for s in pts], label=f"{worker} in use")
            ax.plot(
                [s["t"] for s in pts],
                [s["projected"] for s in pts],
                "--",
                label=f"{worker} projected",
            )
        ax.set_title(f"rebalance {mode}: decode KV use")
        ax.set_xlabel("s")
        ax.set_ylim(0, 1.6)
        ax.legend(fontsize=7)
    ax = axes[-1]
    keys = [
        ("completed_per_s", "req/s"),
        ("itl_p99", "p99 ITL (10 ms)"),
        ("ttft_p99", "p99 TTFT (s)"),
        ("preemptions", "preemptions/100"),
    ]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        r = results["runs"][mode]
        vals = [
            r["completed_per_s"],
            100 * (r["gateway_itl_s"]["p99"] or 0),
            r["gateway_ttft_s"]["p99"] or 0,
            r["preemptions"] / 100,
        ]
        ax.bar([k + i * width for k in range(len(keys))], vals, width, label=f"rebalance {mode}")
    ax.set_xticks(
        [k + width * (len(modes) - 1) / 2 for k in range(len(keys))], [k[1] for k in keys]
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _metric(run: dict[str, Any], name: str, stat: str) -> float:
    """A latency statistic in seconds (serve.py keeps them in ms under vLLM's names)."""
    stat = {"p50": "median"}.get(stat, stat)
    return (run["metrics"].get(f"{stat}_{name}_ms") or 0.0) / 1000.0


def table(results: dict[str, Any]) -> str:
    """TTFT and ITL as the gateway timed them (by tokens); TPOT as the client timed it (by text
    chunks: 0 when the text comes at the end, as dummy weights' often does)."""
    lines = [
        f"{'rebalance':>9} {'done':>5} {'req/s':>6} {'TTFT p50':>8} {'TTFT p99':>8} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT p99':>8} {'preempt':>7} {'migrated':>8} "
        f"{'avoided':>7}"
    ]
    for mode, r in results["runs"].items():
        itl, ttft = r["gateway_itl_s"], r["gateway_ttft_s"]
        lines.append(
            f"{mode:>9} {r['completed']:>5} {r['completed_per_s']:>6.3f} "
            f"{ttft['p50'] or 0:>8.3f} {ttft['p99'] or 0:>8.3f} "
            f"{itl['p50'] or 0:>8.4f} {itl['p99'] or 0:>8.4f} {_metric(r, 'tpot', 'p99'):>8.3f} "
            f"{r['preemptions']:>7} {r['migrations']:>8} {r['preemptions_avoided']:>7}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="cuda: benchmarks/configs/llama3-8b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--lengths-file",
        default=None,
        help="(prompt, output) lengths JSON instead of the ShareGPT text "
        "(benchmarks/data/sharegpt_llama3_lengths.json: Llama-3 tokens)",
    )
    ap.add_argument(
        "--transport",
        default="tcp",
        help="cuda: tcp (two GPUs for three workers: a prefill worker beside a decode worker "
        "cannot join an NCCL pair on one GPU, and round robin uses every pair)",
    )
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--kv-blocks", type=int, default=160, help="per decode worker")
    ap.add_argument("--high", type=float, default=0.85)
    ap.add_argument("--low", type=float, default=0.6)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--modes", nargs="+", default=["off", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replot", default=None, help="only redraw the plot of this results JSON")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="1.0 with dummy weights (printable text)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/rebalance.json"))
    args = ap.parse_args()
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        plot(results, Path(args.replot).with_suffix(".png"))
        print(table(results))
        return
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
