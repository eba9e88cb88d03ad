"""How much can any length predictor buy over FCFS? The ceiling of shortest-job-first with a
perfect predictor, on ShareGPT's answer lengths, in an exact model of the router's queue.

    python benchmarks/sjf_ceiling.py        # -> benchmarks/results/sjf_ceiling.{json,png}

The model is the router's admission queue with nothing else in it: ``slots`` sequences run at
once, each request holds one slot for ``overhead`` + its output tokens (in token times: one
sequence's decode step each), and when a slot frees the queue's policy picks who starts: FCFS
in arrival order, SJF the shortest true length (the oracle). Requests arrive as one burst, or
Poisson at a multiple of the capacity (slots / mean service), ``--requests`` of them; their
answers are ShareGPT first turns' lengths (``benchmarks/data/sharegpt_llama3_lengths.json``,
Llama 3 tokens) capped at each ``--caps``. It prints, per cap, burst size and offered rate,
the ratio of FCFS's mean end-to-end latency to SJF's (the most a predictor can cut it) and
SJF's p99 over FCFS's, averaged over ``--trials`` seeded draws.

Why: the scheduling benchmark's oracle row is this ceiling measured through the gateway; where
the ceiling itself is under a target, no predictor reaches that target on that workload.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import read_lengths  # noqa: E402


def simulate(
    lengths: list[int], arrivals: list[float], slots: int, overhead: float, sjf: bool
) -> list[float]:
    """Each request's end-to-end latency (token times) under list scheduling over ``slots``."""
    n, order = len(lengths), sorted(range(len(lengths)), key=lambda i: arrivals[i])
    free = [0.0] * slots
    waiting: list[tuple[float, int]] = []  # (key, index): the policy's order
    latency = [0.0] * n
    nxt = 0
    for _ in range(n):
        t = heapq.heappop(free)
        if not waiting and nxt < n:
            t = max(t, arrivals[order[nxt]])
        while nxt < n and arrivals[order[nxt]] <= t:
            i = order[nxt]
            heapq.heappush(waiting, ((lengths[i] if sjf else arrivals[i]), i))
            nxt += 1
        _, i = heapq.heappop(waiting)
        end = t + overhead + lengths[i]
        latency[i] = end - arrivals[i]
        heapq.heappush(free, end)
    return latency


def ceiling(
    pairs: list[tuple[int, int]],
    cap: int,
    requests: int,
    slots: int,
    rate: float,
    overhead: float,
    trials: int,
) -> dict[str, float]:
    ratios, p99s = [], []
    for seed in range(trials):
        rng = random.Random(seed)
        draw = rng.sample(pairs, requests)
        lengths = [min(o, cap) for _, o in draw]
        if rate == float("inf"):
            arrivals = [0.0] * requests
        else:
            lam = rate * slots / (statistics.fmean(lengths) + overhead)
            t, arrivals = 0.0, []
            for _ in range(requests):
                t += rng.expovariate(lam)
                arrivals.append(t)
        fcfs = simulate(lengths, arrivals, slots, overhead, sjf=False)
        sjf = simulate(lengths, arrivals, slots, overhead, sjf=True)
        ratios.append(statistics.fmean(fcfs) / statistics.fmean(sjf))
        k = max(int(0.99 * requests) - 1, 0)
        p99s.append(sorted(sjf)[k] / sorted(fcfs)[k])
    return {
        "mean_e2e_fcfs_over_sjf": round(statistics.fmean(ratios), 3),
        "min_over_trials": round(min(ratios), 3),
        "p99_sjf_over_fcfs": round(statistics.fmean(p99s), 3),
    }


def plot(rows: list[dict], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for cap in sorted({r["cap"] for r in rows}):
        pts = [r for r in rows if r["cap"] == cap and r["rate"] != "inf"]
        burst = max((r["requests"] for r in pts), default=0)
        pts = sorted((r for r in pts if r["requests"] == burst), key=lambda r: float(r["rate"]))
        ax.plot(
            [float(r["rate"]) for r in pts],
            [r["mean_e2e_fcfs_over_sjf"] for r in pts],
            marker="o",
            label=f"cap {cap} ({burst} requests)",
        )
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("offered rate (x capacity, Poisson)")
    ax.set_ylabel("mean E2E, FCFS / SJF-oracle")
    ax.set_title("SJF's ceiling on ShareGPT answer lengths (list-scheduling model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--lengths-file", default=str(ROOT / "benchmarks/data/sharegpt_llama3_lengths.json")
    )
    ap.add_argument("--caps", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--requests", type=int, nargs="+", default=[28, 128])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rates", nargs="+", default=["0.9", "1.0", "1.5", "2.0", "inf"])
    ap.add_argument(
        "--overhead", type=float, default=5.0, help="token times a request costs besides decode"
    )
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sjf_ceiling.json")
    args = ap.parse_args()
    pairs = read_lengths(args.lengths_file)
    rows = []
    print(f"{'cap':>5} {'reqs':>5} {'rate':>5}  {'FCFS/SJF mean E2E':>17}  {'SJF/FCFS p99':>12}")
    for cap in args.caps:
        for n in args.requests:
            for rate in args.rates:
                r = ceiling(pairs, cap, n, args.slots, float(rate), args.overhead, args.trials)
                rows.append({"cap": cap, "requests": n, "rate": rate, **r})
                print(
                    f"{cap:>5} {n:>5} {rate:>5}  {r['mean_e2e_fcfs_over_sjf']:>17.2f}  "
                    f"{r['p99_sjf_over_fcfs']:>12.2f}"
                )
    capped = {str(cap): round(sum(o >= cap for _, o in pairs) / len(pairs), 3) for cap in args.caps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(
        json.dumps({"config": config, "share_at_cap": capped, "rows": rows}, indent=1) + "\n"
    )
    plot(rows, args.out.with_suffix(".png"))
    print(f"share of answers at each cap: {capped}; wrote {args.out}")


if __name__ == "__main__":
    main()
