"""Prefill (extend) attention on one GPU: the Triton kernel against the bf16 matmul ceiling.

Llama-3-8B attention shape (H32/KVH8/D128), bf16, block size 16. Measures in one run: the bf16
matmul rate (cuBLAS), then for a fresh causal prompt of 2k and 8k tokens and for 2k new tokens
over a 6k cached prefix: kernels/extend_attention.py at its default tiles and over a sweep of
(BLOCK_M, BLOCK_N, num_warps, num_stages), and torch's SDPA (flash backend, contiguous K/V, no
paging) on the same problem as a reference point.

FLOPs count only useful work: ``4 * D * H`` per visible (query, key) pair, i.e. two matmuls
(QK^T and PV) of 2 FLOPs per multiply-add; a chunk of n new tokens over p cached ones has
``n * p + n * (n + 1) / 2`` visible pairs. The figure of merit is TFLOP/s over the matmul rate.

    python benchmarks/gpu_prefill_attention.py [--out DIR] [--tma-only] [--cases ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import bf16_matmul_flops, time_cuda  # noqa: E402
from kernels.extend_attention import (  # noqa: E402
    KernelConfig,
    _launch,
    _tma_ok,
    attention_flops,
    default_config,
    extend_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CASES = {"fresh_2k": (2048, 0), "fresh_8k": (8192, 0), "prefix_6k_new_2k": (2048, 6144)}
SWEEP = [
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 8, 4),
    KernelConfig(128, 128, 8, 2),
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 32, 8, 3),
    KernelConfig(64, 64, 4, 2),
    KernelConfig(64, 64, 4, 3),
    KernelConfig(64, 32, 4, 3),
    KernelConfig(64, 32, 4, 4),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_case(new: int, prefix: int) -> dict:
    """One chunk: q/k/v views of a fused qkv output, the prefix (and the new tokens, as the
    engine writes them) in a paged cache through a shuffled block table."""
    dtype, dev = torch.bfloat16, "cuda"
    total = prefix + new
    num_blocks = -(-total // BLOCK_SIZE)
    table = torch.randperm(num_blocks, device=dev)
    qkv = torch.randn(new, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(new, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(new, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(new, KV_HEADS, HEAD_DIM)
    k_all = torch.randn(KV_HEADS, total, HEAD_DIM, device=dev, dtype=dtype)
    v_all = torch.randn(KV_HEADS, total, HEAD_DIM, device=dev, dtype=dtype)
    k_all[:, prefix:] = k.transpose(0, 1)
    v_all[:, prefix:] = v.transpose(0, 1)
    cache = torch.empty(2, KV_HEADS, num_blocks * BLOCK_SIZE, HEAD_DIM, device=dev, dtype=dtype)
    pos = torch.arange(total, device=dev)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    cache[0][:, slots], cache[1][:, slots] = k_all, v_all
    return {
        "args": (
            q,
            k,
            v,
            cache[0],
            cache[1],
            table.view(1, -1).to(torch.int32),
            torch.tensor([0, new], dtype=torch.int32, device=dev),
            torch.tensor([prefix], dtype=torch.int32, device=dev),
        ),
        "new": new,
        "k_all": k_all,
        "v_all": v_all,
        "flops": attention_flops([0, new], [prefix], HEADS, HEAD_DIM),
    }


def sdpa_flash(case: dict):
    """torch SDPA, flash backend, on contiguous [1, H, L, D] tensors (K/V heads repeated)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = case["args"][0].transpose(0, 1)[None].contiguous()
    k = case["k_all"].repeat_interleave(HEADS // KV_HEADS, 0)[None]
    v = case["v_all"].repeat_interleave(HEADS // KV_HEADS, 0)[None]
    fresh = k.shape[2] == q.shape[2]
    mask = None if fresh else causal_lower_right(q.shape[2], k.shape[2])

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=fresh, scale=HEAD_DIM**-0.5
            )

    return run, lambda o: o[0].transpose(0, 1)


def gpu_seconds(fn, reps: int) -> float:
    """Mean GPU seconds per call, host overhead excluded: the GPU first sleeps while the host
    queues every call, then runs them back to back between two events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s at Hopper clocks, longer than queueing the calls
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def measure(case: dict, cfg: KernelConfig, tma: bool, want: torch.Tensor) -> dict:
    """One (config, load path) on one case: relative error against SDPA, then the timing."""
    tiles = {name: getattr(cfg, name) for name in ("block_m", "block_n", "num_warps", "num_stages")}
    row = {"config": cfg.__dict__, "tma": tma}

    def run():
        return _launch(*case["args"], case["new"], BLOCK_SIZE, HEAD_DIM**-0.5, **tiles, use_tma=tma)

    try:
        got = run()
        torch.cuda.synchronize()
    except Exception as exc:  # a config that does not compile here (shared memory, registers)
        return row | {"error": f"{type(exc).__name__}: {exc}"[:200]}
    seconds = gpu_seconds(run, reps=30 if case["new"] > 4096 else 100)
    return row | {
        "seconds": seconds,
        "flops_per_s": case["flops"] / seconds,
        "rel_err_vs_sdpa": float((got.float() - want.float()).norm() / want.float().norm()),
    }


def measure_default(case: dict, want: torch.Tensor) -> dict:
    """``extend_attention`` as the engine calls it: GPU time, and wall time per call when
    called back to back (host overhead included, ``time_cuda``)."""
    q = case["args"][0]
    cfg = default_config(HEAD_DIM, q.dtype, case["new"])
    tma = cfg.tma and _tma_ok(*case["args"][:3])
    row = measure(case, cfg, tma, want)
    args = (*case["args"], case["new"], BLOCK_SIZE, HEAD_DIM**-0.5)
    reps = 30 if case["new"] > 4096 else 100
    row["wall_seconds_per_call"] = time_cuda(lambda: extend_attention(*args), reps=reps)
    return row


def host_overhead(reps: int = 300) -> dict:
    """Host seconds per call on a 16-token step, where the GPU finishes each launch before the
    next is issued: the whole call, and the kernel launch alone with and without TMA."""
    case = make_case(16, 0)
    cfg = default_config(HEAD_DIM, torch.bfloat16, 16)
    tiles = {name: getattr(cfg, name) for name in ("block_m", "block_n", "num_warps", "num_stages")}
    calls = {
        "extend_attention": lambda: extend_attention(*case["args"], 16, BLOCK_SIZE, 0.1),
        "_launch_pointer_loads": lambda: _launch(*case["args"], 16, BLOCK_SIZE, 0.1, **tiles,
                                                 use_tma=False),
        "_launch_tma": lambda: _launch(*case["args"], 16, BLOCK_SIZE, 0.1, **tiles, use_tma=True),
    }  # fmt: skip
    result = {}
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - t) / reps
    return result


def sweep_case(name: str, new: int, prefix: int, loads=(False, True)) -> dict:
    torch.manual_seed(0)
    case = make_case(new, prefix)
    flash, unpack = sdpa_flash(case)
    want = unpack(flash())
    t_flash = gpu_seconds(flash, reps=30 if new > 4096 else 100)
    rows = [measure_default(case, want)]
    for cfg in SWEEP:
        for tma in loads:
            rows.append(measure(case, cfg, tma, want))
            r = rows[-1]
            log(
                f"{name} {cfg} tma={tma}: "
                + (f"{r['flops_per_s'] / 1e12:.0f} TFLOP/s, rel err {r['rel_err_vs_sdpa']:.1e}"
                   if "seconds" in r else r["error"])
            )  # fmt: skip
    ok = [r for r in rows if "seconds" in r and r["rel_err_vs_sdpa"] < 2e-2]
    return {
        "new_tokens": new,
        "prefix_tokens": prefix,
        "flops": case["flops"],
        "default": rows[0],
        "best": max(ok, key=lambda r: r["flops_per_s"]) if ok else None,
        "sweep": rows[1:],
        "sdpa_flash": {"seconds": t_flash, "flops_per_s": case["flops"] / t_flash},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--tma-only",
        action="store_true",
        help="sweep only TMA loads of q and the new k, v (the faster path on Hopper)",
    )
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    log(f"{gpu}: measuring the bf16 matmul rate")
    matmul = bf16_matmul_flops()
    log(f"bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    results = {}
    loads = (True,) if args.tma_only else (False, True)
    for name in args.cases:
        new, prefix = CASES[name]
        results[name] = sweep_case(name, new, prefix, loads)
        torch.cuda.empty_cache()
    host = host_overhead()
    report = {
        "gpu": gpu,
        "bf16_matmul_flops_per_s": matmul,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
        "host_seconds_per_call": host,
        "cases": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_prefill_attention.json").write_text(json.dumps(report, indent=2))
    print_table(gpu, matmul, results, host)


def print_table(gpu: str, matmul: float, results: dict, host: dict) -> None:
    def cell(row):
        if row is None or "seconds" not in row:
            return "-"
        c, tf = row["config"], row["flops_per_s"]
        shape = f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
        return f"{tf / 1e12:4.0f} ({tf / matmul:.2f}) {shape}{' tma' if row['tma'] else ''}"

    print(
        f"\nGPU {gpu}, bf16 matmul {matmul / 1e12:.0f} TFLOP/s; H{HEADS}/KVH{KV_HEADS}/"
        f"D{HEAD_DIM} bf16, block size {BLOCK_SIZE}; TFLOP/s (fraction of matmul); "
        "GPU time; host time per call (us): "
        + ", ".join(f"{name} {sec * 1e6:.0f}" for name, sec in host.items())
    )
    print(f"{'case':<18}{'default':<34}{'best of sweep':<34}{'SDPA flash':<14}default wall")
    for name, r in results.items():
        tf = r["sdpa_flash"]["flops_per_s"]
        wall = r["default"].get("wall_seconds_per_call", float("nan"))
        print(
            f"{name:<18}{cell(r['default']):<34}{cell(r['best']):<34}"
            f"{tf / 1e12:4.0f} ({tf / matmul:.2f})   {r['flops'] / wall / 1e12:4.0f}"
        )


if __name__ == "__main__":
    main()
