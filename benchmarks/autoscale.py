"""The autoscaler under a load step up and back down, through the gateway.

    python benchmarks/autoscale.py                          # CPU: SmolLM2, 1 prefill + 1 decode
    python benchmarks/autoscale.py --phases 30:0.3 90:2.5 150:0.3 --max-decode 3
    python benchmarks/autoscale.py --replot benchmarks/results/autoscale_cpu.json
    python benchmarks/autoscale.py --role-switching --prefill 2 \\
        --out benchmarks/results/autoscale_cpu_flex.json   # flex workers: switch before spawn

A real cluster (Ray actors, the controller, TCP KV) starts with one prefill and one decode
worker (``--prefill`` / ``--decode``) and the controller's autoscaler on; with ``--role-
switching`` they are flex workers, and a pool that grows takes a spare worker of the other pool
(switched in about a second, no model load) before it starts a new one. Open-loop Poisson
arrivals go through the OpenAI gateway in phases (``seconds:rate``): quiet, a step up past what one decode worker's slots hold,
quiet again. Each request has a prompt of 64 to 192 token ids and streams ``--output`` tokens
(``ignore_eos``), so every answer's length is known: a request is whole when it got all of them.

Recorded: every request's outcome; twice a second the pools' active workers and the pressures
the autoscaler saw; the controller's events (each decision with its reason and inputs, and the
scales they started, with what their drains migrated or aborted). Printed: the decisions as a
table (when, pool, direction, from -> to, the reason, when the scale had taken effect), and
the requests: sent, whole, failed, aborted by scale-in. Writes benchmarks/results/
autoscale_cpu.json and .png (or --out): offered and served load, pool sizes and pressures over
time, decisions marked.

On this 2-core machine more workers add slots, not compute (every worker shares the same two
cores): the run shows the decisions, their timing and the drains, not a throughput gain. The
decode pool's ITL target is off by default here for that reason (--decode-slo-s sets one).
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
    Progress,
    Request,
    Target,
    make_client,
    send_request,
    stream_client,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_phase(text: str) -> tuple[float, float]:
    seconds, _, rate = text.partition(":")
    try:
        out = (float(seconds), float(rate))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a phase is SECONDS:RATE, got {text!r}") from None
    if out[0] <= 0 or out[1] < 0:
        raise argparse.ArgumentTypeError(f"a phase needs seconds > 0 and rate >= 0: {text!r}")
    return out


def arrivals(phases: list[tuple[float, float]], seed: int) -> list[tuple[float, int]]:
    """Poisson arrival offsets (seconds from the start) with the phase each falls in."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for i, (seconds, rate) in enumerate(phases):
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                break
            out.append((t, i))
        start += seconds
    return out


def make_requests(n: int, output: int, seed: int) -> list[Request]:
    """Prompts of 64 to 192 distinct token ids (no prefix shared between requests)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = rng.randint(64, 192)
        lo = 1000 + (i * 211) % 20000
        reqs.append(
            Request(prompt=[lo + j for j in range(length)], prompt_len=length, output_len=output)
        )
    return reqs


class Sampler:
    """Every ``every_s``: each pool's workers by state and the autoscaler's latest look."""

    def __init__(self, cluster, t0: float, every_s: float = 0.5) -> None:
        self.cluster, self.t0, self.every_s = cluster, t0, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import ray

        controller = self.cluster.controller
        while not self._stop.wait(self.every_s):
            try:
                table, stats = ray.get(
                    [controller.members.remote(), controller.autoscale_stats.remote()], timeout=5
                )
            except Exception:  # noqa: BLE001 - a slow answer: skip this sample
                continue
            pools: dict[str, dict[str, int]] = {}
            for w in table.workers:
                state = w.state.name.lower()
                if state != "dead":
                    pools.setdefault(w.role, {}).setdefault(state, 0)
                    pools[w.role][state] += 1
            self.samples.append(
                {
                    "t": round(time.perf_counter() - self.t0, 2),
                    "pools": pools,
                    "pressures": {r: look["pressures"] for r, look in stats["latest"].items()},
                }
            )


async def drive(gateway, requests, offsets, t0: float) -> list:
    target = Target(gateway.url, "tandem", ignore_eos=True)
    progress = Progress(len(requests), "load step")
    async with make_client(600.0) as client:
        streams = stream_client("raw", 600.0, target.url, client)  # (httpx paced bursts)

        async def one(req, offset):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = await send_request(streams, target, req, t0)
            progress.update(rec)
            return rec

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    progress.close()
    return list(records)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.launch.local import LocalCluster

    pool = {
        "up_after_s": args.up_after,
        "down_after_s": args.down_after,
        "cooldown_s": args.cooldown,
    }
    autoscale = {
        "enabled": True,
        "interval_s": args.interval,
        "decode": {
            **pool,
            "min_replicas": 1,
            "max_replicas": args.max_decode,
            "slo_s": args.decode_slo_s,
        },
        "prefill": {
            **pool,
            "min_replicas": 1,
            "max_replicas": args.max_prefill,
            "slo_s": args.prefill_slo_s,
            "queue_tokens": args.queue_tokens,
        },
    }
    cluster = LocalCluster(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        engine={
            "max_num_batched_tokens": 512,
            "max_num_seqs": args.slots,
            "num_kv_blocks": 256,
            "block_size": 16,
        },
        migration={"timeout_s": 30},
        autoscale=autoscale,
        role_switching=args.role_switching,
    )
    cfg = SimpleNamespace(
        max_resumes=2, stall_timeout_s=30.0, max_concurrent=512, max_body_bytes=8 << 20
    )
    gateway = GatewayThread(cluster, None, cfg, "tandem", policy="least_loaded").start()
    plan = arrivals(args.phases, args.seed)
    requests = make_requests(len(plan), args.output, args.seed)
    log(
        f"{len(requests)} requests over {sum(s for s, _ in args.phases):.0f} s in phases "
        + ", ".join(f"{s:g} s at {r:g}/s" for s, r in args.phases)
    )
    try:
        first = ray.get(cluster.controller.events.remote(None, 0.0))["last_seq"]
        t0, wall0 = time.perf_counter(), time.time()
        with Sampler(cluster, t0) as sampler:
            records = asyncio.run(drive(gateway, requests, [o for o, _ in plan], t0))
            settle_end = time.monotonic() + args.settle
            log(f"load done; watching the pools for {args.settle:g} s more")
            while time.monotonic() < settle_end:
                time.sleep(0.5)
        events = ray.get(cluster.controller.events.remote(first, 0.0))["events"]
        final = ray.get(cluster.controller.autoscale_stats.remote())
    finally:
        gateway.stop()
        cluster.shutdown()
    return summarize(args, plan, records, sampler.samples, events, wall0, final)


def summarize(args, plan, records, samples, events, wall0: float, final) -> dict[str, Any]:
    def at(e) -> float:
        return round(e["time"] - wall0, 2)

    decisions = []
    # how each decision ended: its scale (done or refused), or the switch of a flex worker
    ends = [
        e
        for e in events
        if (e["type"] == "scale" and e["phase"] in ("done", "refused"))
        or (e["type"] == "worker" and e["kind"] in ("switched", "switch_failed"))
    ]
    for e in events:
        if e["type"] != "autoscale":
            continue
        done = next(
            (
                s
                for s in ends
                if s["role"] == e["role"]
                and s["time"] >= e["time"]
                and "autoscaler:" in s["reason"]
            ),
            None,
        )
        decisions.append(
            {
                "t": at(e),
                "role": e["role"],
                "direction": e["direction"],
                "from": e["from_replicas"],
                "to": e["to_replicas"],
                "signal": e["signal"],
                "reason": e["reason"],
                "inputs": e["inputs"],
                "effective_t": at(done) if done else None,
                "outcome": (done.get("phase") or done["kind"]) if done else "running",
                "switched": done["worker"] if done and done.get("kind") == "switched" else None,
                "migrated": (done or {}).get("migrated_requests", 0),
                "aborted": (done or {}).get("aborted_requests", 0),
                "failed": (done or {}).get("failed", {}),
            }
        )
    whole = [r for r in records if r.success and r.output_tokens == r.output_len]
    per_phase = []
    for i, (seconds, rate) in enumerate(args.phases):
        mine = [r for r, (_, p) in zip(records, plan, strict=True) if p == i]
        ttfts = sorted(r.ttft for r in mine if r.success)
        per_phase.append(
            {
                "phase": i,
                "seconds": seconds,
                "rate": rate,
                "sent": len(mine),
                "whole": sum(r.success and r.output_tokens == r.output_len for r in mine),
                "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
                "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            }
        )
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("replot", "out")},
        "requests": {
            "sent": len(records),
            "whole": len(whole),
            "failed": sum(not r.success for r in records),
            "short": sum(r.success and r.output_tokens != r.output_len for r in records),
            "errors": sorted({r.error[:120] for r in records if r.error})[:5],
        },
        "aborted_by_scale_in": sum(d["aborted"] for d in decisions if d["direction"] == "in"),
        "migrated_by_scale_in": sum(d["migrated"] for d in decisions if d["direction"] == "in"),
        "phases": per_phase,
        "decisions": decisions,
        "decision_counts": final["counts"],
        "samples": samples,
        "completions": [round(r.end, 2) for r in whole],
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'t (s)':>7}  {'pool':<8} {'dir':<4} {'from->to':<8} {'in effect':>9}  "
        f"{'migrated':>8} {'aborted':>7}  reason"
    ]
    for d in results["decisions"]:
        eff = f"{d['effective_t']:.1f}" if d["effective_t"] is not None else "-"
        lines.append(
            f"{d['t']:>7.1f}  {d['role']:<8} {d['direction']:<4} {d['from']}->{d['to']:<5} "
            f"{eff:>9}  {d['migrated']:>8} {d['aborted']:>7}  {d['reason']}"
            + (f" [{d['outcome']}]" if d["outcome"] != "done" else "")
        )
    req = results["requests"]
    lines.append("")
    lines.append(
        f"{'phase':>5} {'s':>5} {'rate':>5} {'sent':>5} {'whole':>5} {'TTFT p50':>9} {'p90':>7}"
    )
    for p in results["phases"]:

        def s(v):
            return f"{v:.2f}" if v is not None else "-"

        lines.append(
            f"{p['phase']:>5} {p['seconds']:>5.0f} {p['rate']:>5.2f} {p['sent']:>5} {p['whole']:>5} "
            f"{s(p['ttft_p50_s']):>9} {s(p['ttft_p90_s']):>7}"
        )
    lines.append("")
    lines.append(
        f"requests: {req['sent']} sent, {req['whole']} whole, {req['failed']} failed, "
        f"{req['short']} short; scale-in: {results['migrated_by_scale_in']} migrated, "
        f"{results['aborted_by_scale_in']} aborted"
    )
    return "\n".join(lines)


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = results["samples"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax = axes[0]
    edges, t = [], 0.0
    for p in results["phases"]:
        edges.append((t, t + p["seconds"], p["rate"]))
        t += p["seconds"]
    ax.step(
        [e[0] for e in edges] + [edges[-1][1]],
        [e[2] for e in edges] + [edges[-1][2]],
        where="post",
        label="offered (req/s)",
        color="black",
    )
    done = sorted(results["completions"])
    if done:
        width = 10.0
        bins = [i * width for i in range(int(max(done) // width) + 2)]
        counts = [sum(b <= x < b + width for x in done) / width for b in bins]
        ax.plot(
            [b + width / 2 for b in bins],
            counts,
            "o-",
            label=f"whole answers (req/s, {width:g} s bins)",
        )
    ax.set_ylabel("requests / s")
    ax.legend(loc="upper right")
    ax.set_title("Autoscaler under a load step (CPU, SmolLM2, through the gateway)")

    ax = axes[1]
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ts = [s["t"] for s in samples]
        active = [s["pools"].get(role, {}).get("active", 0) for s in samples]
        live = [sum(s["pools"].get(role, {}).values()) for s in samples]
        ax.step(ts, active, where="post", color=color, label=f"{role} active")
        ax.step(
            ts,
            live,
            where="post",
            color=color,
            linestyle=":",
            label=f"{role} live (starting, draining)",
        )
    for d in results["decisions"]:
        ax.axvline(d["t"], color="tab:red" if d["direction"] == "out" else "tab:green", alpha=0.4)
        ax.annotate(
            f"{d['role']} {d['direction']}: {d['signal']}",
            (d["t"], 0.2),
            rotation=90,
            fontsize=7,
            va="bottom",
        )
    ax.set_ylabel("workers")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    series: dict[tuple[str, str], tuple[list, list]] = {}
    for s in samples:
        for role, pressures in s["pressures"].items():
            for signal, value in pressures.items():
                xs, ys = series.setdefault((role, signal), ([], []))
                xs.append(s["t"])
                ys.append(value)
    for (role, signal), (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, label=f"{role} {signal}", linewidth=1)
    cfg = results["config"]
    ax.axhline(0.85, color="grey", linestyle="--", linewidth=0.8, label="high 0.85")
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=0.8, label="low 0.5 (x n/(n-1))")
    ax.set_ylabel("pressure (1.0 = target)")
    ax.set_xlabel(f"seconds (autoscaler: every {cfg['interval']:g} s, up after {cfg['up_after']:g} s, "
                  f"down after {cfg['down_after']:g} s, cool-down {cfg['cooldown']:g} s)")  # fmt: skip
    ax.set_ylim(0, max(2.0, min(4.0, max((max(ys) for _, ys in series.values()), default=1.0))))
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--phases",
        nargs="+",
        type=parse_phase,
        default=[(30.0, 0.2), (90.0, 0.7), (150.0, 0.2)],
        help="SECONDS:RATE of each phase, in order (default: 30:0.2 90:0.7 150:0.2)",
    )
    ap.add_argument("--output", type=int, default=32, help="tokens each answer streams")
    ap.add_argument("--slots", type=int, default=2, help="max_num_seqs of each worker")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers at the start")
    ap.add_argument("--decode", type=int, default=1, help="decode workers at the start")
    ap.add_argument("--max-decode", type=int, default=3)
    ap.add_argument("--max-prefill", type=int, default=2)
    ap.add_argument("--interval", type=float, default=1.0, help="between the autoscaler's looks")
    ap.add_argument("--up-after", type=float, default=5.0)
    ap.add_argument("--down-after", type=float, default=20.0)
    ap.add_argument("--cooldown", type=float, default=15.0)
    ap.add_argument(
        "--decode-slo-s", type=float, default=None, help="ITL p90 target (default: none)"
    )
    ap.add_argument("--prefill-slo-s", type=float, default=5.0, help="TTFT p90 target")
    ap.add_argument("--queue-tokens", type=float, default=2048.0, help="prefill backlog at 1.0")
    ap.add_argument("--settle", type=float, default=90.0, help="seconds watched after the load")
    ap.add_argument(
        "--role-switching",
        action="store_true",
        help="flex workers: a pool that grows takes the other pool's spare worker first",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replot", default=None, help="only redraw the plot of this results JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/autoscale_cpu.json"))
    args = ap.parse_args()
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        plot(results, Path(args.replot).with_suffix(".png"))
        print(table(results))
        return
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
