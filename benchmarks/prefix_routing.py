"""Cache-aware placement against round-robin on a shared-prefix workload (CPU is fine).

    python benchmarks/prefix_routing.py                   # SmolLM2 fp32, 2 prefill + 1 decode

8 system prompts of 1-2k tokens; 200 chat requests, each one of them (uniformly at random) plus
a short question, sent by 4 concurrent clients. Each prefill worker's KV pool holds about five
of the eight prefixes (``--kv-blocks``), so a policy that spreads a prefix over both workers
makes them evict each other's prefixes, while one that keeps each prefix on one worker keeps
them all cached. Every policy runs on a fresh cluster (empty caches) with the same requests,
through the router (``router.service.ClusterBackend``: index lookup, placement, the request)
without HTTP. Reported per policy: prefix hit rate (prompt tokens served from a prefill worker's
cache / prompt tokens) and TTFT (the router's call to the first output) mean and p50 / p90.
Writes JSON (--out) and a bar plot beside it when matplotlib is there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORDS = [
    "river",
    "stone",
    "mill",
    "bread",
    "orange",
    "violet",
    "copper",
    "garden",
    "lantern",
    "harbor",
    "meadow",
    "signal",
    "window",
    "silver",
    "thunder",
    "basket",
    "candle",
    "forest",
    "marble",
    "pepper",
    "saddle",
    "tunnel",
    "velvet",
    "walnut",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(tokenizer, args) -> list[list[int]]:
    from engine.tokenizer import apply_chat_template

    rng = random.Random(args.seed)
    systems = []
    for i in range(args.prefixes):
        n = rng.randrange(args.min_words, args.max_words)
        systems.append(f"System prompt {i}. " + " ".join(rng.choice(WORDS) for _ in range(n)))
    prompts = []
    for r in range(args.requests):
        system = rng.choice(systems)
        question = f"Question {r}: which word comes {rng.randrange(1, 50)}th?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompts.append(apply_chat_template(tokenizer, messages, add_generation_prompt=True))
    return prompts


async def run_policy(backend, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    queue = list(enumerate(prompts))
    rows: list[dict] = []

    async def client() -> None:
        while queue:
            i, ids = queue.pop(0)
            t0 = time.perf_counter()
            gen = await backend.open(f"bench-{i}", ids, params)
            ttft = time.perf_counter() - t0
            last = None
            async for step in gen.outputs():
                last = step
            rows.append(
                {
                    "request": i,
                    "prompt_tokens": len(ids),
                    "cached_tokens": last.usage.cached_tokens,
                    "ttft_s": ttft,
                    "prefill": gen.placement.prefill,
                    "reason": gen.placement.reason,
                }
            )
            if len(rows) % 25 == 0:
                log(f"  {len(rows)}/{len(prompts)} requests")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in rows)
    return {
        "requests": len(rows),
        "wall_s": wall,
        "hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
        "per_worker": {
            w: sum(1 for r in rows if r["prefill"] == w)
            for w in sorted({r["prefill"] for r in rows})
        },
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--min-words", type=int, default=900)  # ~1-2k tokens with the chat template
    ap.add_argument("--max-words", type=int, default=1800)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=480, help="per worker (16-token blocks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_routing.json"))
    args = ap.parse_args()
    os.environ.setdefault("TANDEM_TORCH_THREADS", "1")

    from cluster.launch.local import LocalCluster
    from engine.prefix_index import PrefixIndex
    from router.redis_server import RedisServer
    from router.service import ClusterBackend

    report: dict = {"args": vars(args), "policies": {}}
    with RedisServer() as redis:
        for policy in args.policies:
            log(f"{policy}: starting 2 prefill + 1 decode workers")
            cluster = LocalCluster(
                model=args.model,
                num_prefill=2,
                num_decode=1,
                engine={
                    "num_kv_blocks": args.kv_blocks,
                    "block_size": 16,  # --kv-blocks counts blocks of 16
                    "max_num_batched_tokens": 2048,
                },
                index_url=redis.url,
            )
            try:
                prompts = workload(cluster.tokenizer, args)
                lens = [len(p) for p in prompts]
                report["prompt_tokens"] = {"min": min(lens), "max": max(lens), "total": sum(lens)}
                index = PrefixIndex(redis.url, cluster.index_namespace)
                backend = ClusterBackend(
                    cluster.members, tokenizer=cluster.tokenizer, index=index, policy=policy
                )
                result = asyncio.run(run_policy(backend, prompts, args.clients, args.max_tokens))
                result["decisions"] = backend.router_stats().decisions
                report["policies"][policy] = result
                log(
                    f"{policy}: hit rate {result['hit_rate']:.3f}, TTFT mean "
                    f"{1e3 * result['ttft_mean_s']:.0f} ms, wall {result['wall_s']:.0f} s"
                )
                index.close()
            finally:
                cluster.shutdown()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(
        f"\n{args.requests} requests over {args.prefixes} shared prefixes "
        f"({report['prompt_tokens']['min']}-{report['prompt_tokens']['max']} prompt tokens), "
        f"{args.clients} clients, 2 prefill + 1 decode workers, {args.kv_blocks} KV blocks each"
    )
    print(
        "| policy | prefix hit rate | TTFT mean ms | p50 ms | p90 ms | requests per prefill worker |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in report["policies"].items():
        print(
            f"| {name} | {r['hit_rate']:.3f} | {1e3 * r['ttft_mean_s']:.0f} | "
            f"{1e3 * r['ttft_p50_s']:.0f} | {1e3 * r['ttft_p90_s']:.0f} | {r['per_worker']} |"
        )
    if "cache_aware" in report["policies"] and "round_robin" in report["policies"]:
        ca, rr = report["policies"]["cache_aware"], report["policies"]["round_robin"]
        print(
            f"\ncache_aware / round_robin mean TTFT: {ca['ttft_mean_s'] / rr['ttft_mean_s']:.2f} "
            f"(aim <= 0.5); cache_aware hit rate {ca['hit_rate']:.3f} (aim >= 0.9)"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(report["policies"])
        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
        a.bar(names, [report["policies"][n]["hit_rate"] for n in names])
        a.set_title("prefix hit rate")
        b.bar(names, [1e3 * report["policies"][n]["ttft_mean_s"] for n in names])
        b.set_title("mean TTFT (ms)")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
