"""Disaggregated vs colocated on GPUs: the layer-wise KV stream's bandwidth and TTFT.

    python benchmarks/gpu_disagg.py                 # 2 GPUs: 1 prefill + 1 decode vs 1 colocated
    python benchmarks/gpu_disagg.py --pairs 2       # 4 GPUs: 2 + 2 vs 2 colocated

Llama-3-8B shape (benchmarks/configs/llama3-8b), dummy bf16 weights, one prompt at a time, each
prompt one prefill chunk (max_num_batched_tokens 8192). Three sections, in one run:

1. ``nccl_peak``: bare cupy NCCL send/recv between two Ray actors on GPU 0 -> GPU 1, for the
   stream's own message size (one layer of one prompt) and for large messages; each size is
   sent 32 times back to back (as the stream does) and timed by CUDA events on the receiver.
2. ``colocated``: TTFT of one colocated worker (time from the call to the first output at the
   caller, through Ray), then 16 greedy tokens.
3. ``disagg``: the same through prefill -> decode with the NCCL transport; the decode worker's
   per-message recv timings give the stream's bandwidth, the prefill worker's send timings its
   post lag (layer packed -> send started) and send time.

``--carveouts 0 8 16`` repeats section 3 with the prefill workers' cuBLAS matmuls leaving that many
SMs free (``sm_carveout``), so the NCCL send kernels need not wait for a layer's GEMMs to finish.

Figures: (a) stream GB/s over the peak for the same message size and over the best peak;
(b) disaggregated TTFT over colocated TTFT (medians); (c) greedy tokens identical.
Writes benchmarks/results/gpu_disagg.json (or --out).
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

CONFIG = ROOT / "benchmarks" / "configs" / "llama3-8b"
ENGINE = {
    "dtype": "bfloat16",
    "load_format": "dummy",
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 8,
    "cuda_graph_max_batch": 8,
    "gpu_memory_utilization": 0.85,
    "enforce_eager": True,  # TTFT involves no decode step; both sides run the same kernels
}
OUTPUT_TOKENS = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layer_message_bytes(tokens: int) -> int:
    cfg = json.loads((CONFIG / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * tokens * head_dim * 2  # K and V, bf16


# -- 1. bare NCCL ----------------------------------------------------------------------------------


def nccl_peak(sizes: list[int], repeat: int = 32) -> dict[int, float]:
    """GB/s of ``repeat`` back-to-back messages per size, GPU 0 -> GPU 1 (best of 5 rounds)."""
    import ray

    @ray.remote(num_gpus=1)
    class Peer:
        def uid(self):
            from cupy.cuda import nccl

            return nccl.get_unique_id()

        def init(self, uid, rank):
            from cupy.cuda import nccl

            self.comm = nccl.NcclCommunicator(2, uid, rank)

        def run(self, rank, nbytes, repeat, rounds=5):
            import torch
            from cupy.cuda import nccl

            buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            best = float("inf")
            for _ in range(rounds + 1):  # the first round warms up
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    for _ in range(repeat):
                        if rank == 0:
                            self.comm.send(
                                buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 1, stream.cuda_stream
                            )
                        else:
                            self.comm.recv(
                                buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 0, stream.cuda_stream
                            )
                    end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            return best

    a, b = Peer.remote(), Peer.remote()
    uid = ray.get(a.uid.remote())
    ray.get([a.init.remote(uid, 0), b.init.remote(uid, 1)])
    out = {}
    for size in sizes:
        _, ms = ray.get([a.run.remote(0, size, repeat), b.run.remote(1, size, repeat)])
        out[size] = size * repeat / (ms / 1e3) / 1e9
        log(f"nccl p2p {size / 2**20:.0f} MiB x{repeat}: {out[size]:.1f} GB/s")
    for actor in (a, b):
        ray.kill(actor)
    return out


# -- 2, 3. through the workers ---------------------------------------------------------------------


async def one_request(cluster, ids):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    ttft, last = None, None
    print(f"TRACE driver start {time.time():.6f}", file=sys.stderr)
    async for out in cluster.stream(ids, params):
        if ttft is None:
            ttft = time.perf_counter() - t0
            print(f"TRACE driver first {time.time():.6f}", file=sys.stderr)
        last = out
    return ttft, last.outputs[0].token_ids


def measure(cluster, prompts: dict[int, list[list[int]]], timings: bool, pairs: int) -> dict:
    """Per length: a warm-up, then each rep sends ``pairs`` prompts at once (one per pair or
    colocated worker: least-loaded placement spreads them); TTFT of every request."""
    import ray

    async def wave(batch):
        return await asyncio.gather(*(one_request(cluster, ids) for ids in batch))

    results = {}
    for length, reps in prompts.items():
        ttfts, tokens, streams = [], [], []
        asyncio.run(wave(reps[:pairs]))  # warm-up (first-use kernels, channel set-up)
        if timings:
            ray.get([w.handle.kv_timings.remote() for w in cluster.decode + cluster.prefill])
        for r in range(1, len(reps) // pairs):
            for ttft, toks in asyncio.run(wave(reps[r * pairs : (r + 1) * pairs])):
                ttfts.append(ttft)
                tokens.append(toks)
            if timings:
                msgs = sum(ray.get([d.handle.kv_timings.remote() for d in cluster.decode]), [])
                sends = sum(ray.get([p.handle.kv_timings.remote() for p in cluster.prefill]), [])
                nbytes = sum(n for n, _ in msgs)
                ms = sum(t for _, t in msgs)
                streams.append(
                    {
                        "messages": len(msgs),
                        "bytes": nbytes,
                        "ms": ms,
                        "gbps": nbytes / (ms / 1e3) / 1e9 if ms else None,
                        "recv_ms_median": statistics.median(t for _, t in msgs),
                        # sender side: pack done -> send started (host path), send start -> end
                        "post_lag_ms_median": statistics.median(lag for _, lag, _ in sends),
                        "send_ms_median": statistics.median(t for _, _, t in sends),
                    }
                )
        results[length] = {
            "ttft_s": ttfts,
            "ttft_median_s": statistics.median(ttfts),
            "tokens": tokens,
            "stream": streams,
        }
        log(
            f"{length} tokens: TTFT median {1e3 * results[length]['ttft_median_s']:.1f} ms"
            + (
                f", stream {statistics.median(s['gbps'] for s in streams):.1f} GB/s"
                f" (per message: recv {streams[-1]['recv_ms_median']:.2f} ms, send"
                f" {streams[-1]['send_ms_median']:.2f} ms after a post lag of"
                f" {streams[-1]['post_lag_ms_median']:.2f} ms)"
                if streams
                else ""
            )
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 2048, 8000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument(
        "--carveouts",
        type=int,
        nargs="+",
        default=[0],
        metavar="SMS",
        help="prefill workers' sm_carveout values; one disaggregated run each (default: 0)",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for every worker, e.g. NCCL_P2P_USE_CUDA_MEMCPY=1 (repeatable)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_disagg.json"))
    args = ap.parse_args()

    import ray
    import torch

    from cluster.launch.local import LocalCluster

    env = {
        "NCCL_NVLS_ENABLE": "0",
        **{k: v for k, v in os.environ.items() if k.startswith("TANDEM_")},
        **dict(kv.split("=", 1) for kv in args.env),
    }
    report_env = dict(env)
    ray.init(include_dashboard=False, runtime_env={"env_vars": env})
    gpu = torch.cuda.get_device_name(0)
    rng = random.Random(0)
    prompts = {
        n: [
            [rng.randrange(128, 128000) for _ in range(n)]
            for _ in range((args.reps + 1) * args.pairs)
        ]
        for n in args.lengths
    }
    report = {
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "pairs": args.pairs,
        "engine": ENGINE,
        "lengths": args.lengths,
        "reps": args.reps,
        "env": report_env,
    }

    sizes = sorted({layer_message_bytes(n) for n in args.lengths} | {256 << 20})
    report["nccl_peak_gbps"] = {str(k): v for k, v in nccl_peak(sizes).items()}

    def cluster(**kw):
        t0 = time.perf_counter()
        c = LocalCluster(model=str(CONFIG), device="cuda", engine=ENGINE, **kw)
        log(f"{kw} ready in {time.perf_counter() - t0:.0f} s")
        return c

    c = cluster(num_prefill=0, num_decode=0, num_colocated=args.pairs)
    report["colocated"] = measure(c, prompts, timings=False, pairs=args.pairs)
    c.shutdown()
    report["disagg"] = {}
    for carveout in args.carveouts:
        c = cluster(
            num_prefill=args.pairs,
            num_decode=args.pairs,
            transport="nccl",
            prefill_engine={"sm_carveout": carveout},
        )
        report["disagg"][carveout] = measure(c, prompts, timings=True, pairs=args.pairs)
        c.shutdown()

    peak_best = max(report["nccl_peak_gbps"].values())
    rows = []
    for carveout, n in ((c, n) for c in args.carveouts for n in args.lengths):
        co, di = report["colocated"][n], report["disagg"][carveout][n]
        gbps = statistics.median(s["gbps"] for s in di["stream"])
        same = report["nccl_peak_gbps"][str(layer_message_bytes(n))]
        rows.append(
            {
                "prefill_sm_carveout": carveout,
                "prompt_tokens": n,
                "layer_message_mib": layer_message_bytes(n) / 2**20,
                "stream_gbps": gbps,
                "peak_same_size_gbps": same,
                "stream_over_peak_same_size": gbps / same,
                "stream_over_peak_best": gbps / peak_best,
                "ttft_colocated_ms": 1e3 * co["ttft_median_s"],
                "ttft_disagg_ms": 1e3 * di["ttft_median_s"],
                "ttft_ratio": di["ttft_median_s"] / co["ttft_median_s"],
                "greedy_identical": co["tokens"] == di["tokens"],
            }
        )
    report["summary"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(
        f"\n{gpu} x{report['gpus']}, {args.pairs}P{args.pairs}D vs {args.pairs} colocated; "
        f"NCCL best peak {peak_best:.0f} GB/s"
    )
    print(
        "| carveout | prompt | layer msg | stream GB/s | / peak same size | / best peak | TTFT coloc ms "
        "| TTFT disagg ms | ratio | greedy same |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prefill_sm_carveout']} | {r['prompt_tokens']} | {r['layer_message_mib']:.0f} MiB | {r['stream_gbps']:.0f} | "
            f"{r['stream_over_peak_same_size']:.3f} | {r['stream_over_peak_best']:.3f} | "
            f"{r['ttft_colocated_ms']:.1f} | {r['ttft_disagg_ms']:.1f} | {r['ttft_ratio']:.3f} | "
            f"{r['greedy_identical']} |"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
