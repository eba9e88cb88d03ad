"""Paged decode attention kernel (kernels/paged_decode_attention.py) on one GPU, against the
HBM copy bandwidth measured in the same run.

Llama-3-8B attention shape (32 query / 8 KV heads, head_dim 128), bf16, block size 16, random
shuffled block tables. Each case sweeps tile configs (BLOCK_N, num_warps, num_stages) at the
default split count, then split counts at the best tile config, and reports the default and the
best. Achieved bandwidth = bytes the kernel must move (each sequence's K and V once, q and out)
over the time of one call, timed as CUDA-graph replays (no launch gaps) that rotate over enough
block-table sets to keep the working set well past L2 (so small cases do not time the cache).

    python benchmarks/gpu_decode_attention.py [--out DIR] [--quick] [--kv-dtype fp8]

``--kv-dtype fp8``: the cache in e4m3 (q stays bf16; the bytes counted are the fp8 cache's),
the tile sweep run with the products in bf16 and in fp16 (``f16_dot``); written to
gpu_decode_attention_fp8.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import hbm_copy_bandwidth, time_cuda  # noqa: E402
from kernels.paged_decode_attention import (  # noqa: E402
    _launch,
    launch_config,
    paged_decode_attention,
    paged_decode_attention_ref,
    pick_num_splits,
)

BLOCK_SIZE = 16
HEAD_DIM = 128
DTYPE = torch.bfloat16
KV_DTYPE = DTYPE  # the cache's (--kv-dtype)
CASES = [  # name, batch, context, heads, kv heads
    ("b256_ctx512", 256, 512, 32, 8),  # the engine's decode step at batch 256
    ("b64_ctx1k", 64, 1024, 32, 8),
    ("b64_ctx4k", 64, 4096, 32, 8),
    ("b1_ctx512", 1, 512, 32, 8),
    ("b8_ctx8k", 8, 8192, 32, 8),
    ("b64_ctx1k_mha", 64, 1024, 32, 32),  # G = 1: the padded tl.dot path at one head per row
    # ShareGPT-like decode batches (contexts of a few hundred tokens, hundreds of sequences)
    ("b128_ctx512", 128, 512, 32, 8),
    ("b256_ctx256", 256, 256, 32, 8),
    ("b256_ctx1k", 256, 1024, 32, 8),
    ("b512_ctx256", 512, 256, 32, 8),
    ("b512_ctx512", 512, 512, 32, 8),
]
TILES = list(itertools.product([32, 64, 128], [4, 8], [2, 3, 4]))  # block_n, warps, stages
SPLITS = [1, 2, 4, 8, 16, 32, 64]
L2_SWEEP_BYTES = 256 << 20  # rotate over at least this much K/V (L2 is 50-60 MB)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Case:
    """One shape: a KV pool, ``num_sets`` block-table sets over distinct random blocks of it."""

    def __init__(self, name, batch, context, heads, kv_heads):
        self.name, self.batch, self.context = name, batch, context
        self.heads, self.kv_heads = heads, kv_heads
        width = context // BLOCK_SIZE
        elem, kv_elem = torch.finfo(DTYPE).bits // 8, torch.finfo(KV_DTYPE).bits // 8
        self.kv_bytes = batch * context * kv_heads * HEAD_DIM * 2 * kv_elem
        self.bytes = self.kv_bytes + 2 * batch * heads * HEAD_DIM * elem  # + q and out
        self.num_sets = max(1, min(256, math.ceil(L2_SWEEP_BYTES / self.kv_bytes)))
        pool_blocks = max(2 * batch * width, min(self.num_sets * batch * width, 1 << 16))
        cache = torch.randn(2, kv_heads, pool_blocks * BLOCK_SIZE, HEAD_DIM, device="cuda")
        self.k, self.v = cache.to(KV_DTYPE).unbind(0)
        del cache
        self.tables = [
            torch.randperm(pool_blocks, device="cuda")[: batch * width].view(batch, width).int()
            for _ in range(self.num_sets)
        ]
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.scale = HEAD_DIM**-0.5

    def call(self, i, **config):
        _launch(self.q, self.k, self.v, self.tables[i], self.lens, BLOCK_SIZE, self.scale,
                self.out, **config)  # fmt: skip

    def graph_seconds(self, **config) -> float:
        """Seconds per call: one CUDA graph of a call on every table set, replayed."""
        self.call(0, **config)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.num_sets):
                self.call(i, **config)
        reps = max(3, math.ceil(2e-2 / (self.bytes * self.num_sets / 3e12)))  # ~20 ms
        seconds = time_cuda(graph.replay, reps=min(reps, 200)) / self.num_sets
        del graph
        return seconds

    def eager_seconds(self) -> float:
        """Seconds per call of the public entry point from Python (launch overhead included)."""
        sets = itertools.cycle(range(self.num_sets))
        return time_cuda(
            lambda: paged_decode_attention(self.q, self.k, self.v, self.tables[next(sets)],
                                           self.lens, BLOCK_SIZE, self.scale, out=self.out),
            reps=100,
        )  # fmt: skip

    def check(self, **config) -> float:
        """Relative error of a launch (default: the public entry point's) against the
        reference (set 0)."""
        if config:
            got = _launch(self.q, self.k, self.v, self.tables[0], self.lens, BLOCK_SIZE,
                          self.scale, **config)  # fmt: skip
        else:
            got = paged_decode_attention(self.q, self.k, self.v, self.tables[0], self.lens,
                                         BLOCK_SIZE, self.scale)  # fmt: skip
        ref = paged_decode_attention_ref(self.q, self.k, self.v, self.tables[0], self.lens,
                                         BLOCK_SIZE, self.scale)  # fmt: skip
        return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def entry(case: Case, seconds: float, bw: float, **config) -> dict:
    rate = case.bytes / seconds
    return {**config, "seconds": seconds, "bytes_per_s": rate, "over_hbm_copy": rate / bw}


def run_case(case: Case, bw: float, tiles, splits) -> dict:
    default_tile = launch_config(HEAD_DIM, DTYPE, KV_DTYPE, case.batch * case.kv_heads)
    default_splits = pick_num_splits(case.batch, case.kv_heads, case.context // BLOCK_SIZE,
                                     BLOCK_SIZE, default_tile["block_n"], "cuda")  # fmt: skip
    default = {**default_tile, "num_splits": default_splits}
    rel = case.check()
    rel16 = case.check(f16_dot=True) if KV_DTYPE != DTYPE else None
    log(f"{case.name}: {case.bytes / 1e6:.1f} MB per call, {case.num_sets} table sets, "
        f"rel. error vs reference {rel:.1e}"
        + (f" (f16_dot {rel16:.1e})" if rel16 is not None else ""))  # fmt: skip
    case.graph_seconds(**default)  # warm-up: the first graph timed after the reference is slow
    sweep = [entry(case, case.graph_seconds(**default), bw, **default)]
    dots = [False, True] if KV_DTYPE != DTYPE else [None]
    for (block_n, num_warps, num_stages), f16 in itertools.product(tiles, dots):
        tile = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
        if f16 is not None:
            tile["f16_dot"] = f16
        s = pick_num_splits(case.batch, case.kv_heads, case.context // BLOCK_SIZE, BLOCK_SIZE,
                            block_n, "cuda")  # fmt: skip
        sweep.append(entry(case, case.graph_seconds(**tile, num_splits=s), bw, **tile,
                           num_splits=s))  # fmt: skip
    fastest = min(sweep, key=lambda e: e["seconds"])
    best_tile = {k: fastest[k] for k in ("block_n", "num_warps", "num_stages", "f16_dot")
                 if k in fastest}  # fmt: skip
    for s in splits:
        sweep.append(entry(case, case.graph_seconds(**best_tile, num_splits=s), bw, **best_tile,
                           num_splits=s))  # fmt: skip
    best = min(sweep, key=lambda e: e["seconds"])
    eager = case.eager_seconds()
    log(f"{case.name}: default {sweep[0]['seconds'] * 1e6:.1f} us "
        f"({sweep[0]['over_hbm_copy']:.2f} of copy), best {best['seconds'] * 1e6:.1f} us "
        f"({best['over_hbm_copy']:.2f}), eager default {eager * 1e6:.1f} us")  # fmt: skip
    return {
        "batch": case.batch, "context": case.context, "heads": case.heads,
        "kv_heads": case.kv_heads, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
        "dtype": str(DTYPE), "kv_dtype": str(KV_DTYPE), "bytes": case.bytes, "rel_error": rel,
        "rel_error_f16_dot": rel16,
        "default": sweep[0], "best": best, "eager_default_seconds": eager, "sweep": sweep,
    }  # fmt: skip


def table(gpu: str, bw: float, results: dict) -> str:
    fmt = "{:<15}{:>9}{:>24}{:>10}{:>8}{:>24}{:>10}{:>8}{:>10}"
    lines = [
        f"{gpu}, HBM copy {bw / 1e12:.2f} TB/s (read + write); times per call, CUDA graph",
        fmt.format("case", "MB", "default (bn,w,st,S)", "us", "/copy", "best (bn,w,st,S)", "us",
                   "/copy", "eager us"),
    ]  # fmt: skip
    for name, r in results.items():
        d, b = r["default"], r["best"]
        cfg = [f"{e['block_n']},{e['num_warps']},{e['num_stages']},{e['num_splits']}"
               + ("f16" if e.get("f16_dot") else "") for e in (d, b)]  # fmt: skip
        lines.append(fmt.format(
            name, f"{r['bytes'] / 1e6:.1f}", cfg[0], f"{d['seconds'] * 1e6:.1f}",
            f"{d['over_hbm_copy']:.2f}", cfg[1], f"{b['seconds'] * 1e6:.1f}",
            f"{b['over_hbm_copy']:.2f}", f"{r['eager_default_seconds'] * 1e6:.1f}",
        ))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="default config and split sweep only")
    ap.add_argument("--cases", nargs="*", default=[c[0] for c in CASES])
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--tiles", nargs="*", metavar="BN,W,ST", help="tiles swept (default: all)")
    args = ap.parse_args()
    global KV_DTYPE
    KV_DTYPE = torch.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE
    gpu = torch.cuda.get_device_name()
    log(f"{gpu}: measuring HBM copy bandwidth")
    bw = hbm_copy_bandwidth()
    log(f"HBM copy {bw / 1e12:.2f} TB/s")
    tiles = [] if args.quick else TILES
    if args.tiles:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles]
    results = {}
    for spec in CASES:
        if spec[0] in args.cases:
            case = Case(*spec)
            results[spec[0]] = run_case(case, bw, tiles, SPLITS)
            del case
            torch.cuda.empty_cache()
    print(table(gpu, bw, results))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"gpu": gpu, "hbm_copy_bytes_per_s": bw, "cases": results}
    name = "gpu_decode_attention" + ("_fp8" if KV_DTYPE != DTYPE else "")
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
