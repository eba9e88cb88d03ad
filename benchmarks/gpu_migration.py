"""Live migration downtime, throughput cost and exactness (GPU: 2 GPUs; CPU: a smoke run).

    python benchmarks/gpu_migration.py                       # 2 GPUs, contexts 1k 4k 16k 32k
    python benchmarks/gpu_migration.py --device cpu --contexts 128 512 --background 2

One cluster: 1 prefill + 2 decode workers, NCCL between GPUs. With two GPUs the prefill worker
shares one with a decode worker (NCCL cannot join two ranks on one GPU, so that pair is never
used): every request starts on the other decode worker ("home") and moves to the prefill's
neighbour ("peer") by migration; the background load of the peer gets there the same way.
Llama-3.1-8B shape (benchmarks/configs/llama3-8b with a 40k context), dummy bf16 weights.

Sections, in one run:

1. ``exact``: a greedy request alone, with and without a migration mid-stream: same tokens.
2. ``downtime``: for each context, a request of that prompt length decodes on home beside the
   background load (``--background`` requests on each worker); after ``--before`` tokens it is
   migrated to peer. Downtime = the largest gap between consecutive tokens after the migration
   starts minus the median gap of the same request's ``--before`` tokens before it (times taken
   by the router, where the client's stream comes from). Llumnix reports 20-30 ms, flat.
3. ``throughput``: background decode tokens/s over ``--window`` seconds with a 4k request
   migrated back and forth without pause, over the same window with it left alone.

Writes benchmarks/results/gpu_migration.json (or --out); prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "benchmarks" / "configs" / "llama3-8b"
GPU_ENGINE = {
    "dtype": "bfloat16",
    "load_format": "dummy",
    "max_model_len": 40960,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 32,
    "cuda_graph_max_batch": 32,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def long_context_model() -> str:
    """The 8B shape with a 40k context (Llama 3.1's shapes; its 128k context is not needed)."""
    path = Path(tempfile.mkdtemp(prefix="llama31-8b-"))
    for f in CONFIG.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 40960
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def gpu_of_pids() -> dict[int, str]:
    """pid -> GPU bus id of every process using a GPU (nvidia-smi)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        int(p): bus.strip() for p, bus in (line.split(",") for line in out.strip().splitlines())
    }


def home_and_peer(cluster, device: str) -> tuple[str, str]:
    """(the decode worker not sharing a GPU with the prefill worker, the one that does)."""
    names = [w.name for w in cluster.decode]
    if device != "cuda":
        return names[0], names[1]
    gpus = gpu_of_pids()
    pre = gpus.get(cluster.prefill[0].pid)
    if pre is None:  # nvidia-smi does not see the workers' pids (a container): Ray packs the
        log(f"nvidia-smi shows no worker pids ({gpus}); assuming spawn-order packing")
        return names[1], names[0]  # halves in spawn order: prefill and decode-0 share GPU 0
    shared = [w.name for w in cluster.decode if gpus.get(w.pid) == pre]
    alone = [n for n in names if n not in shared]
    log(f"GPUs: prefill {pre}; decode {[(w.name, gpus.get(w.pid)) for w in cluster.decode]}")
    if not alone or not shared:
        raise SystemExit("want the prefill worker beside exactly one decode worker")
    return alone[0], shared[0]


class Stream:
    """One request through the router: token arrival times (a batch of k tokens: the first
    at the arrival, the others 0 s after it)."""

    def __init__(self, cluster, rid: str, prompt: list[int], max_tokens: int, home: str):
        from engine import SamplingParams

        self.rid, self.times, self.tokens = rid, [], []
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self._gen = cluster.stream(prompt, params, request_id=rid, decode=home)
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for out in self._gen:
            now = time.perf_counter()
            ids = out.outputs[0].token_ids
            self.times += [now] * (len(ids) - len(self.tokens))
            self.tokens = list(ids)

    async def wait_tokens(self, n: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            if self.task.done():
                self.task.result()
                raise RuntimeError(f"{self.rid} ended at {len(self.tokens)} tokens")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.rid} stuck at {len(self.tokens)} tokens")
            await asyncio.sleep(0.001)

    async def cancel(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self._gen.aclose()


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]


def downtime(times: list[float], start: float, end: float, before: int) -> dict:
    """Largest gap of a token arriving after ``start`` (up to 8 tokens past ``end``) minus the
    median gap of the ``before`` tokens before ``start``."""
    i0 = next(i for i, t in enumerate(times) if t > start)
    i1 = next((i for i, t in enumerate(times) if t > end), len(times) - 1)
    g = gaps_ms(times)
    prior = g[max(0, i0 - 1 - before) : i0 - 1]
    after = g[i0 - 1 : min(len(g), i1 + 8)]
    median = statistics.median(prior)
    worst = max(after)
    return {"median_gap_ms": median, "max_gap_ms": worst, "downtime_ms": worst - median}


def chunk_breakdown(t: dict[str, list], chunk_bytes: int) -> dict[str, float | int]:
    """Medians over a context's copy chunks (messages of at least half a chunk): ms waiting for
    room on the channel, ms gathering and queuing on the host, ms of the gather on the copy
    stream, ms from the gather's end to the send's start, of the send, of the receive."""

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    big = chunk_bytes // 2
    chunks = t["chunks"]
    return {
        "snapshot_ms": med([s[0] for s in t["stages"]]),
        "stage_queue_ms": med([s[1] for s in t["stages"]]),
        "stage_drain_ms": med([s[2] for s in t["stages"]]),
        "chunks": len(chunks),
        "pace_ms": med([a for a, _ in chunks]),
        "queue_ms": med([b for _, b in chunks]),
        "gather_ms": med([ms for n, ms in t["gather"] if n >= big]),
        "post_lag_ms": med([x[1] for x in t["send"] if x[0] >= big]),
        "send_ms": med([x[2] for x in t["send"] if x[0] >= big]),
        "recv_ms": med([x[1] for x in t["recv"] if x[0] >= big]),
        "send_gb_s": med([x[0] / x[2] / 1e6 for x in t["send"] if x[0] >= big and x[2] > 0]),
    }


async def stream_moving(cluster, prompt, params, rid: str, home: str, moves: list[tuple[int, str]]):
    """``rid`` streamed from decode worker ``home`` and moved by the controller to each
    ``moves[i][1]`` once it has ``moves[i][0]`` tokens: its tokens and each move's result."""
    moves = list(moves)
    tokens, results = [], []
    async for out in cluster.stream(prompt, params, request_id=rid, decode=home):
        tokens = list(out.outputs[0].token_ids)
        if moves and len(tokens) >= moves[0][0]:
            _, to = moves.pop(0)
            results.append((await cluster.controller.migrate.remote(rid, to=to))[0])
    return tokens, results


async def form_pairs(cluster, prompt, params, home: str, peer: str, tries: int = 4) -> list:
    """Requests moved ``home`` -> ``peer`` -> ``home`` until both moves succeed (an NCCL pair
    channel's first init outlasts a tiny model's whole request; it also fills the prefix
    cache): the last try's move results."""
    for i in range(tries):
        _, warm = await stream_moving(
            cluster, prompt, params, f"warm{i}", home, [(8, peer), (16, home)]
        )
        if [r.outcome for r in warm] == ["migrated", "migrated"]:
            break
    return warm


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


async def main_async(cluster, args, home: str, peer: str, vocab: int) -> dict:
    ctrl = cluster.controller
    results: dict = {"home": home, "peer": peer}

    async def migrate(rid: str, to: str):
        r = (await ctrl.migrate.remote(rid, to=to))[0]
        if not r.ok:
            raise RuntimeError(f"migration of {rid} failed: {r}")
        return r

    # warm-up: both pair channels formed (an NCCL communicator takes a while, once)
    warm = Stream(cluster, "warm", random_prompt(256, vocab, 0), 100000, home)
    await warm.wait_tokens(4)
    t0 = time.perf_counter()
    await migrate("warm", peer)
    await migrate("warm", home)
    log(f"warm-up: two migrations (channels formed) in {time.perf_counter() - t0:.2f} s")
    await warm.cancel()

    # 1. exactness, alone. The first run fills the prefill worker's prefix cache; the next two
    # (unmigrated, migrated) both hit it, so their prompts' last chunks compute alike (a cache
    # hit runs other attention kernels than a whole-prompt prefill: bf16 need not agree)
    prompt = random_prompt(args.contexts[0], vocab, 1)
    runs = {}
    for name in ("fill", "ref", "mig"):
        s = Stream(cluster, f"exact-{name}", prompt, args.tokens, home)
        if name == "mig":
            await s.wait_tokens(args.before)
            await migrate(s.rid, peer)
        await s.task
        runs[name] = s.tokens
    results["exact"] = {
        "identical": runs["mig"] == runs["ref"],
        "tokens": len(runs["ref"]),
        "cache_hit_equals_first_run": runs["fill"] == runs["ref"],
    }
    log(f"exact: {results['exact']}")

    # background: N on each worker (the peer's arrive by migration)
    bg = []
    for i in range(2 * args.background):
        s = Stream(cluster, f"bg{i}", random_prompt(args.bg_context, vocab, 100 + i), 100000, home)
        bg.append(s)
    for s in bg:
        await s.wait_tokens(2)
    for s in bg[args.background :]:
        await migrate(s.rid, peer)
    log(f"background: {args.background} requests on each decode worker")

    # 2. downtime per context; where a copy stage's time goes (per chunk) at each context
    rows = []
    by_name = {w.name: w for w in cluster.decode}

    async def timings() -> dict[str, list]:
        got = await asyncio.gather(
            *(by_name[n].handle.migration_timings.remote() for n in (home, peer))
        )
        recv = await asyncio.gather(*(by_name[n].handle.kv_timings.remote() for n in (home, peer)))
        out = {k: got[0][k] + got[1][k] for k in got[0]}
        out["recv"] = recv[0] + recv[1]
        return out

    await timings()  # (drop the warm-up's and the background's)
    breakdown = {}
    for ctx in args.contexts:
        for rep in range(args.repeats):
            rid = f"ctx{ctx}-{rep}"
            s = Stream(cluster, rid, random_prompt(ctx, vocab, ctx + rep), args.tokens, home)
            await s.wait_tokens(args.before + 2)
            t0 = time.perf_counter()
            r = await migrate(rid, peer)
            t1 = time.perf_counter()
            await s.wait_tokens(min(args.tokens, len(s.tokens) + 16))
            row = {
                "context": ctx,
                "repeat": rep,
                "stages": r.stages,
                "copied_tokens": r.tokens,
                "copied_mb": round(r.bytes / 2**20, 1),
                "pause_ms": round(r.pause_s * 1e3, 2),
                "migration_ms": round((t1 - t0) * 1e3, 1),
                "copy_ms": round(r.copy_s * 1e3, 2),
                # the copy stages' rate (their bytes are all but the last stage's <= 16 blocks)
                "copy_gb_s": round(r.bytes / r.copy_s / 1e9, 1) if r.copy_s else None,
                **{k: round(v, 2) for k, v in downtime(s.times, t0, t1, args.before).items()},
            }
            rows.append(row)
            log(f"downtime {row}")
            await s.cancel()
        raw = await timings()
        breakdown[ctx] = chunk_breakdown(raw, args.chunk_bytes)
        breakdown[ctx]["raw"] = raw
        log(f"per chunk at {ctx}: { {k: v for k, v in breakdown[ctx].items() if k != 'raw'} }")
    results["downtime"] = rows
    results["chunks"] = breakdown

    # 3. background throughput during migrations (each alone, ``--gap`` s apart) against the
    # quiet stretches between them, and during back-to-back migrations (a stress figure)
    def bg_tokens(t_from: float, t_to: float) -> int:
        return sum(sum(t_from <= t < t_to for t in s.times) for s in bg)

    ctx = args.throughput_context
    target = Stream(cluster, "pingpong", random_prompt(ctx, vocab, 7), 100000, home)
    await target.wait_tokens(8)
    where, during, quiet = home, [0, 0.0], [0, 0.0]
    for _ in range(args.moves):
        q0 = time.perf_counter()
        await asyncio.sleep(args.gap)
        q1 = time.perf_counter()
        quiet[0] += bg_tokens(q0, q1)
        quiet[1] += q1 - q0
        where = peer if where == home else home
        await migrate("pingpong", where)
        t1 = time.perf_counter()
        await asyncio.sleep(0.05)  # tokens of the window still on their way
        during[0] += bg_tokens(q1, t1)
        during[1] += t1 - q1
    t0 = time.perf_counter()
    moves = 0
    while time.perf_counter() - t0 < args.window:
        where = peer if where == home else home
        await migrate("pingpong", where)
        moves += 1
    busy_s = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    t_q = time.perf_counter()
    await asyncio.sleep(args.window)
    quiet_rate = bg_tokens(t_q, time.perf_counter()) / args.window
    results["throughput"] = {
        "context": ctx,
        "background_tok_s_quiet": round(quiet[0] / quiet[1], 1),
        "background_tok_s_during": round(during[0] / during[1], 1),
        "ratio": round((during[0] / during[1]) / (quiet[0] / quiet[1]), 4),
        "migrations": args.moves,
        "seconds_migrating": round(during[1], 3),
        "back_to_back": {
            "migrations": moves,
            "window_s": round(busy_s, 2),
            "background_tok_s": round(bg_tokens(t0, t0 + busy_s) / busy_s, 1),
            "background_tok_s_quiet": round(quiet_rate, 1),
            "ratio": round(bg_tokens(t0, t0 + busy_s) / busy_s / quiet_rate, 4),
        },
    }
    log(f"throughput {results['throughput']}")
    await target.cancel()
    for s in bg:
        await s.cancel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160, help="output tokens of each request")
    ap.add_argument("--before", type=int, default=48, help="tokens before the migration")
    ap.add_argument("--background", type=int, default=8, help="requests on each decode worker")
    ap.add_argument("--bg-context", type=int, default=1024)
    ap.add_argument("--window", type=float, default=8.0, help="back-to-back stress window")
    ap.add_argument("--throughput-context", type=int, default=16384)
    ap.add_argument("--moves", type=int, default=12, help="spaced migrations, section 3")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between them")
    ap.add_argument("--kv-blocks", type=int, default=6144)
    ap.add_argument(
        "--chunk-bytes", type=int, default=4096 * 32 * 2 * 8 * 128 * 2, help="a copy chunk (8B)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_migration.json"))
    args = ap.parse_args()

    from cluster.launch.local import LocalCluster

    if args.device == "cuda":
        model, engine = long_context_model(), dict(GPU_ENGINE)
        engine["num_kv_blocks"] = args.kv_blocks
        gpus = {"prefill": 0.5, "decode": 0.5}
        vocab = 128256
    else:
        model, gpus, vocab = "smollm2", {}, 49152
        engine = {"max_num_batched_tokens": 512, "num_kv_blocks": 1024, "max_num_seqs": 32}
    log(f"starting 1 prefill + 2 decode ({args.device})")
    cluster = LocalCluster(
        model=model,
        num_prefill=1,
        num_decode=2,
        device=args.device,
        engine=engine,
        gpus=gpus,
        transfer_timeout_s=120,
    )
    try:
        home, peer = home_and_peer(cluster, args.device)
        results = asyncio.run(main_async(cluster, args, home, peer, vocab))
        results["stats"] = cluster.stats()
    finally:
        cluster.shutdown()
    results["config"] = {**vars(args), "engine": engine}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"\nexact: greedy tokens identical with and without migration: {results['exact']}")
    print(f"{'context':>8} {'stages':>6} {'copied MB':>9} {'copy ms':>8} {'copy GB/s':>9} "
          f"{'migration ms':>12} {'pause ms':>8} {'median ms':>9} {'max gap ms':>10} "
          f"{'downtime ms':>11}")  # fmt: skip
    for r in results["downtime"]:
        print(f"{r['context']:>8} {r['stages']:>6} {r['copied_mb']:>9} {r['copy_ms']:>8} "
              f"{r['copy_gb_s']!s:>9} {r['migration_ms']:>12} {r['pause_ms']:>8} "
              f"{r['median_gap_ms']:>9} {r['max_gap_ms']:>10} {r['downtime_ms']:>11}")  # fmt: skip
    for ctx, b in results["chunks"].items():
        print(f"per chunk at {ctx}: { {k: v for k, v in b.items() if k != 'raw'} }")
        print(
            f"  raw stages {b['raw']['stages']}; chunks {[tuple(round(x, 1) for x in c) for c in b['raw']['chunks']]}"
        )
    t = results["throughput"]
    b = t["back_to_back"]
    print(f"background decode tok/s while a {t['context']}-token request migrates: "
          f"{t['background_tok_s_during']} vs {t['background_tok_s_quiet']} between "
          f"migrations: ratio {t['ratio']} ({t['migrations']} migrations)")  # fmt: skip
    print(f"back to back ({b['migrations']} in {b['window_s']} s): {b['background_tok_s']} vs "
          f"{b['background_tok_s_quiet']} tok/s: ratio {b['ratio']}")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
