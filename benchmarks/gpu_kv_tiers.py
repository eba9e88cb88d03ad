"""The KV tiers on one GPU (issue 25): a block's copy rate between the pool and pinned host
memory, and multi-turn conversations through `tandem serve` with the host tier and without.

    python benchmarks/gpu_kv_tiers.py copy --out DIR                      # copy rates
    python benchmarks/gpu_kv_tiers.py serve --model DIR --out DIR \\
        [--variants off,host] [--pool-blocks 2048] [--users 128] [--miss-conversations 300]
    python benchmarks/gpu_kv_tiers.py report DIR [--plot PNG]

``copy``: blocks of the Llama-3-8B shape (32 layers x K,V x 8 KV heads x 16 tokens x 128, bf16:
2 MiB each) through engine.kv_tiers.KVTiers: down (a gather on the compute stream, then one
copy per block into pinned host slots on the offload stream) and up (one copy per block onto
the device, then a scatter into the pool, on the load stream); beside them a plain pinned
``copy_`` of the same bytes, the ceiling. The issue's bar: 40 GB/s one way.

``serve``: one colocated worker, dummy weights, its device pool cut to ``--pool-blocks`` blocks
(so that the users' conversations outgrow it several times: the working set's peak is printed),
driven by benchmarks/multiturn.py. Variants: ``off`` (no tier), ``host`` (``--host-gb`` of
pinned host memory). After its multi-turn run each server takes the first turns of
``--miss-conversations`` other conversations (``off-miss``, ``host-miss``): nothing is reused,
what the tier costs when it never hits. Each run's JSON goes under ``--out``; ``report`` prints
the table and plots TTFT and throughput per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import multiturn  # noqa: E402

SHAPE = dict(num_layers=32, num_kv_heads=8, block_size=16, head_dim=128)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- copy rates ----------------------------------------------------------------------------------


def copy_rates(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.kv_tiers import BlockLayout, KVTiers

    dev = torch.device("cuda")
    layout = BlockLayout(**SHAPE, dtype=torch.bfloat16)
    pool_blocks = args.pool_blocks_copy
    # one allocation, its layers slices of it, as the model runner allocates the pool: the
    # gather and scatter are then one kernel for every layer (BlockLayout.stacked)
    pool = torch.randn(
        layout.num_layers, 2, layout.num_kv_heads, pool_blocks * 16, layout.head_dim, device=dev
    ).to(torch.bfloat16)
    caches = list(pool.unbind(0))
    tiers = KVTiers(caches, layout, args.host_slots, None)
    nbytes = layout.nbytes
    rows = []
    for n in args.batches:
        ids = list(range(n))
        # down: the engine's save path (gather, then per-block copies to pinned slots)
        blocks = [(b, f"blk-{n}-{b}-{time.time_ns()}".encode().ljust(32, b"\0")) for b in ids]
        tiers.save(blocks[:1])
        tiers.flush()
        torch.cuda.synchronize()
        # each save lands before the next: a slot still being written cannot be taken again, so
        # back-to-back saves beyond the free slots would be dropped (and counted as copied)
        dropped = tiers.stats.saves_dropped
        t0 = time.perf_counter()
        for rep in range(args.reps):
            tiers.save([(b, h[:-2] + bytes([rep, 1])) for b, h in blocks])
            tiers.flush()
        torch.cuda.synchronize()
        down = (time.perf_counter() - t0) / args.reps
        if tiers.stats.saves_dropped != dropped:
            raise RuntimeError(f"{n} blocks: saves dropped; --host-slots must be at least {n}")
        # up: the load path (per-block copies onto the device, a scatter into the pool)
        slots = list(range(min(n, args.host_slots)))
        tiers._copy_up(slots)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            tiers._copy_up(slots)
        up = (time.perf_counter() - t0) / args.reps
        # the ceiling: the same bytes as one pinned copy each way
        host = torch.empty(n * nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
        devbuf = torch.empty_like(host, device=dev)
        devbuf.copy_(host)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            host.copy_(devbuf, non_blocking=True)
        torch.cuda.synchronize()
        raw_down = (time.perf_counter() - t0) / args.reps
        t0 = time.perf_counter()
        for _ in range(args.reps):
            devbuf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        raw_up = (time.perf_counter() - t0) / args.reps
        gb = n * nbytes / 1e9
        rows.append(
            {
                "blocks": n,
                "block_bytes": nbytes,
                "down_GBps": gb / down,
                "up_GBps": gb / up,
                "pinned_copy_down_GBps": gb / raw_down,
                "pinned_copy_up_GBps": gb / raw_up,
                "down_ms_per_block": down / n * 1e3,
                "up_ms_per_block": up / n * 1e3,
            }
        )
        r = rows[-1]
        log(
            f"{n:>4} blocks: down {r['down_GBps']:.1f} GB/s (pinned copy {r['pinned_copy_down_GBps']:.1f}), "
            f"up {r['up_GBps']:.1f} GB/s (pinned copy {r['pinned_copy_up_GBps']:.1f})"
        )
    tiers.close()
    return {
        "device": torch.cuda.get_device_name(),
        "stacked": tiers.stacked is not None,
        "rows": rows,
    }


# -- multi-turn serving --------------------------------------------------------------------------


def serve_variant(args: argparse.Namespace, variant: str) -> list[dict[str, Any]]:
    """One server of ``variant``: ``off`` (no tier), ``host`` (the host tier), ``disk`` (a
    disk tier the workers share: under ``--topology pd`` the decode worker writes each answer
    back there for the next turn's prefill worker) or ``local`` (``disk``, and a next turn the
    decode worker lacks at most ``--local-prefill-tokens`` of is prefilled on it). The
    multi-turn run, then (with ``--miss-conversations``) the first turns of as many other
    conversations, which find nothing cached: what the tier costs when it never hits."""
    import tempfile

    from benchmarks.gpu_serve import Server

    engine = [
        "load_format=dummy",
        f"max_model_len={args.max_context + args.max_output + 64}",
        f"num_kv_blocks={args.pool_blocks}",
        *args.engine,
    ]
    if variant == "host":
        engine.append(f"kv_offload_cpu_gb={args.host_gb}")
    serve_flags = []
    if variant in ("disk", "local"):  # a fresh folder: nothing from an earlier run is found
        engine.append(f"kv_offload_disk_dir={tempfile.mkdtemp(prefix='kv-disk-')}")
    if variant == "local":
        serve_flags = ["--local-prefill-tokens", str(args.local_prefill_tokens)]
    elif variant not in ("off", "host", "disk"):
        raise SystemExit(f"unknown variant {variant!r}: off, host, disk, local")
    out = Path(args.out) / variant
    out.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(
        gpus=None,
        device=args.device,
        model=args.model,
        out=str(out),
        max_concurrent=max(args.users * 2, 256),
        engine=engine,
        predictor=args.predictor,
        serve_flags=serve_flags,
    )
    server = Server(ns, args.topology)
    results = []
    try:
        server.wait(600)
        runs = [(variant, False, args.offset, args.conversations, args.users)]
        if args.miss_conversations:
            runs.append(
                (
                    f"{variant}-miss",
                    True,
                    args.offset + args.conversations,
                    args.miss_conversations,
                    args.miss_users or args.users,
                )
            )
        for name, first_turns, offset, count, users in runs:
            mt = argparse.Namespace(
                url=server.url,
                data=str(multiturn.DATA),
                users=users,
                conversations=count,
                offset=offset,
                think_s=args.think_s,
                max_output=args.max_output,
                max_context=args.max_context,
                first_turns=first_turns,
                seed=0,
                timeout_s=600.0,
            )
            with MetricsSampler(server.url) as sampler:
                result = asyncio.run(multiturn.run(mt))
            result["server_metrics"] = sampler.summary()
            result.update(
                variant=name,
                engine=engine,
                working_set_peak_tokens=working_set_peak(result["turns"]),
                pool_tokens=args.pool_blocks * 16,
            )
            print(multiturn.table(name, result["summary"]), flush=True)
            results.append(result)
    finally:
        server.stop()
    return results


class MetricsSampler:
    """Polls the gateway's /metrics while a run goes: how many requests ran and waited, the
    pool's use, and the preemptions, to tell a pool-bound run from a compute-bound one."""

    GAUGES = (
        "tandem:num_requests_running",
        "tandem:num_requests_waiting",
        "tandem:kv_cache_usage_perc",
        "tandem:queue_waiting",
    )

    def __init__(self, url: str, every_s: float = 2.0) -> None:
        self.url, self.every_s = url, every_s
        self.samples: list[dict[str, float]] = []
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.last = self._scrape()

    def _scrape(self) -> dict[str, float]:
        from benchmarks.gpu_serve import scrape_metrics

        return scrape_metrics(self.url)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            m = self._scrape()
            if m:
                self.samples.append({g: m.get(g, 0.0) for g in self.GAUGES})

    def summary(self) -> dict[str, Any]:
        busy = [s for s in self.samples if s["tandem:num_requests_running"] > 0]
        mean = {
            g.split(":", 1)[1] + "_mean": (sum(s[g] for s in busy) / len(busy) if busy else 0.0)
            for g in self.GAUGES
        }
        kept = ("preemption", "kv_tier_hits", "routing_decisions")
        final = {k: v for k, v in self.last.items() if any(w in k for w in kept)}
        return {**mean, "samples": len(self.samples), "final": final}


def working_set_peak(turns: list[dict]) -> int:
    """The most KV the live conversations held at once: each user's latest context (prompt +
    answer) from its first turn until its conversation's last, summed over users."""
    events = []
    by_conv: dict[int, list[dict]] = {}
    for t in turns:
        by_conv.setdefault(t["conversation"], []).append(t)
    for ts in by_conv.values():
        ts.sort(key=lambda t: t["turn"])
        prev = 0
        for t in ts:
            size = t["prompt_tokens"] + t["output_tokens"]
            events.append((t["sent"], size - prev))
            prev = size
        events.append((ts[-1]["sent"] + ts[-1]["latency"], -prev))
    live = peak = 0
    for _, d in sorted(events):
        live += d
        peak = max(peak, live)
    return peak


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What the multi-turn run will hold before it runs (the issue's aim wants a working set of
    at least 4x the pool): each conversation's final context (its turns' prompts and answers,
    answers cut at ``--max-output``, the conversation at ``--max-context``), and the peak
    estimated as ``users`` conversations live at once, each halfway on average (``mid``;
    ``high``: each at its end). The 320-user run of 2026-11-27 measured 3.3x where ``mid``
    says 2.7x: read it as a lower estimate."""
    doc = json.loads(Path(multiturn.DATA).read_text())
    convs = doc["conversations"][args.offset : args.offset + args.conversations]
    finals = []
    for c in convs:
        total = 0
        for prompt, answer in c["turns"]:
            size = prompt + min(answer, args.max_output)
            if total + size > args.max_context:
                break
            total += size
        finals.append(total)
    mean = sum(finals) / max(len(finals), 1)
    live = min(args.users, len(finals))
    pool = args.pool_blocks * 16
    out = {
        "conversations": len(finals),
        "mean_final_context": mean,
        "mid_tokens": live * mean / 2,
        "high_tokens": live * mean,
        "pool_tokens": pool,
        "mid_over_pool": live * mean / 2 / pool,
        "high_over_pool": live * mean / pool,
    }
    log(
        f"plan: {len(finals)} conversations of {mean:.0f} tokens at their end, {live} users: "
        f"working set ~{out['mid_over_pool']:.2f}x (up to {out['high_over_pool']:.2f}x) the "
        f"pool of {pool} tokens"
    )
    return out


def serve(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    planned = plan(args)
    (out / "plan.json").write_text(json.dumps(planned))
    if getattr(args, "plan_only", False):
        return
    if planned["mid_over_pool"] < args.min_working_set:
        raise SystemExit(
            f"the working set would be ~{planned['mid_over_pool']:.2f}x the pool, under "
            f"--min-working-set {args.min_working_set:g}: more --users or fewer --pool-blocks"
        )
    for variant in args.variants.split(","):
        log(f"variant {variant}")
        for result in serve_variant(args, variant):
            (out / f"multiturn-{result['variant']}.json").write_text(json.dumps(result))


# -- report --------------------------------------------------------------------------------------


def report(args: argparse.Namespace) -> None:
    runs = {}
    for d in args.dirs:
        for f in sorted(Path(d).glob("multiturn-*.json")):
            r = json.loads(f.read_text())
            runs[r["variant"]] = r
        copy = Path(d) / "copy.json"
        if copy.is_file():
            c = json.loads(copy.read_text())
            print(f"copy rates on {c['device']} (GB/s one way)")
            print("| blocks | down (tiers) | up (tiers) | pinned copy down | pinned copy up |")
            print("| --- | --- | --- | --- | --- |")
            for r in c["rows"]:
                print(
                    f"| {r['blocks']} | {r['down_GBps']:.1f} | {r['up_GBps']:.1f} | "
                    f"{r['pinned_copy_down_GBps']:.1f} | {r['pinned_copy_up_GBps']:.1f} |"
                )
    if not runs:
        return
    print(
        "| variant | turns | turns/s | out tok/s | steady out tok/s | TTFT p50 | TTFT p90 | turns 2+ p50 | p90 | cached | working set / pool |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        s = r["summary"]

        def ms(v):
            return "-" if v is None else f"{v * 1e3:.0f} ms"

        print(
            f"| {name} | {s['turns']} | {s['turns_per_s']:.2f} | {s['output_tok_per_s']:.0f} | "
            f"{s.get('steady_output_tok_per_s', 0):.0f} | "
            f"{ms(s['ttft_p50_s'])} | {ms(s['ttft_p90_s'])} | {ms(s['ttft_later_p50_s'])} | "
            f"{ms(s['ttft_later_p90_s'])} | {s['cached_share']:.0%} | "
            f"{r['working_set_peak_tokens'] / r['pool_tokens']:.1f}x |"
        )
    if "off" in runs and "host" in runs:
        a, b = runs["off"]["summary"], runs["host"]["summary"]
        print(
            f"host vs off: TTFT p50 {a['ttft_p50_s'] / b['ttft_p50_s']:.2f}x lower, p90 "
            f"{a['ttft_p90_s'] / b['ttft_p90_s']:.2f}x lower, throughput "
            f"{b['output_tok_per_s'] / a['output_tok_per_s']:.2f}x, steady throughput "
            f"{b['steady_output_tok_per_s'] / a['steady_output_tok_per_s']:.2f}x"
        )
    if "off-miss" in runs and "host-miss" in runs:
        a, b = runs["off-miss"]["summary"], runs["host-miss"]["summary"]
        print(
            f"miss cost: TTFT p50 {b['ttft_p50_s'] / a['ttft_p50_s'] - 1:+.1%}, p90 "
            f"{b['ttft_p90_s'] / a['ttft_p90_s'] - 1:+.1%}"
        )
    if args.plot:
        plot(runs, Path(args.plot))


def plot(runs: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    p50 = [runs[n]["summary"]["ttft_p50_s"] * 1e3 for n in names]
    p90 = [runs[n]["summary"]["ttft_p90_s"] * 1e3 for n in names]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    a.bar([i + 0.2 for i in x], p90, 0.4, label="p90")
    a.set_xticks(list(x), names)
    a.set_ylabel("TTFT (ms)")
    a.legend()
    b.bar(list(x), [runs[n]["summary"]["output_tok_per_s"] for n in names])
    b.set_xticks(list(x), names)
    b.set_ylabel("output tokens / s")
    fig.suptitle(f"multi-turn ShareGPT through tandem serve: {', '.join(names)}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("copy")
    c.add_argument("--out", required=True)
    c.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    c.add_argument("--reps", type=int, default=10)
    c.add_argument("--host-slots", type=int, default=128)
    c.add_argument("--pool-blocks-copy", type=int, default=256)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--variants", default="off,host", help="off, host, disk, local")
    s.add_argument("--topology", default="one", help="one (a colocated worker) or pd (1P1D)")
    s.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="the `local` variant's setting (tandem serve --local-prefill-tokens)",
    )
    s.add_argument("--miss-conversations", type=int, default=300)
    s.add_argument(
        "--miss-users",
        type=int,
        default=0,
        help="users of the miss run (0: --users); fewer than saturate the server keep its "
        "TTFT a prefill's, not a queue's",
    )
    s.add_argument("--pool-blocks", type=int, default=2048)
    s.add_argument("--host-gb", type=float, default=48.0)
    s.add_argument("--users", type=int, default=128)
    s.add_argument("--conversations", type=int, default=600)
    s.add_argument("--offset", type=int, default=0, help="skip this many conversations")
    s.add_argument(
        "--min-working-set",
        type=float,
        default=0.0,
        help="refuse to start below this estimated working set / pool (plan's mid estimate)",
    )
    s.add_argument("--plan-only", action="store_true", help="print the plan (no GPU), then stop")
    s.add_argument("--think-s", type=float, default=1.0)
    s.add_argument("--max-output", type=int, default=512)
    s.add_argument("--max-context", type=int, default=7500)
    s.add_argument("--engine", action="append", default=[])
    s.add_argument("--predictor", default=None, help="the gateway's (default: its own default)")
    s.add_argument("--device", default="cuda", help="cpu: a dry run of the driver (small model)")
    r = sub.add_parser("report")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--plot")
    args = ap.parse_args()
    if args.cmd == "copy":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "copy.json").write_text(json.dumps(copy_rates(args)))
    elif args.cmd == "serve":
        serve(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
