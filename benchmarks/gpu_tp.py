"""Tensor-parallel scaling on one node's GPUs (issue 26's benchmark, run by issue 29 where
several GPUs are lent): the Llama-3-8B shape (dummy weights, bf16 or ``--quantization fp8``) at
each ``--tp`` size, every engine in a child process of its own (a fresh CUDA context; its TP
ranks are that child's spawned processes, one GPU each):

1. decode ITL at batch 1 (512-token context, engine steps, graphs on) against its floor: the
   weights one rank reads per step (rank 0's shard: every rank holds as much, less the
   replicated norms) over the HBM copy rate measured in this run, plus the step's all-reduces
   (two a layer and the embedding's, at batch 1 latency-bound) at the latency measured here on
   the same GPUs for a ``[1, hidden]`` bf16 tensor; the formula's NVLink-rate term
   (bytes over ``--nvlink-gbps``) is reported beside it;
2. offline throughput on vLLM's ShareGPT sample (benchmarks/data/vllm_sharegpt_llama3_1000.json
   and its .npz of token ids), all requests at once, engine defaults, ``ignore_eos``; and each
   engine's KV pool (per rank: the ranks hold as many blocks, each of its own heads).

    PYTHONPATH=$PWD python benchmarks/gpu_tp.py --tp 1 2 4 --out DIR/gpu_tp.json \\
        [--num-requests 1000] [--quantization fp8]

Prefill and decode at different TP over NCCL, and a 70B-class shape disaggregated against
colocated: benchmarks/gpu_serve.py's ``pd-p<P>d<D>`` and ``two-tp<T>`` topologies. Prints a
table, writes JSON and a plot beside it (``.png``). ``--device cpu --tp 1 2`` is a dry run of
the driver on a tiny model (gloo, no floors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import log, print_markdown, run_part  # noqa: E402

CONFIG_8B = ROOT / "benchmarks" / "configs" / "llama3-8b"
VLLM_SAMPLE = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
CONTEXT, ITL_STEPS = 512, 64
ALL_REDUCE_REPS = 200


def tiny_config() -> dict:
    """The CPU dry run's model: the 8B config at toy sizes (8 heads and KV heads divide 1-8;
    the vocabulary kept, for the workloads' token ids)."""
    cfg = json.loads((CONFIG_8B / "config.json").read_text())
    cfg.update(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=2,
    )
    return cfg


# -- one engine, in a child process ----------------------------------------------------------------


def engine_run(args: argparse.Namespace) -> dict:
    """One engine at TP ``args.one``: rank 0's weights, ITL at batch 1 and offline throughput."""
    from benchmarks.gpu_engine import decode_itl, throughput
    from benchmarks.gpu_fp8_weights import weights_read_per_step
    from benchmarks.workloads import read_workload
    from engine import LLM

    tp = int(args.one)
    model_dir = CONFIG_8B
    if args.device == "cpu":
        model_dir = Path(tempfile.mkdtemp(prefix="tp-tiny-"))
        (model_dir / "config.json").write_text(json.dumps(tiny_config()))
    t0 = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        load_format="dummy",
        quantization=args.quantization,
        tensor_parallel_size=tp,
        **({"gpu_memory_utilization": 0.9} if args.device == "cuda" else {"num_kv_blocks": 256}),
    )
    try:
        runner = llm.engine.runner
        total, read = weights_read_per_step(runner.model)
        out = {
            "tp": tp,
            "quantization": args.quantization,
            "start_s": time.perf_counter() - t0,
            "rank_weight_bytes": total,
            "rank_weight_bytes_read_per_step": read,
            "num_kv_blocks": runner.num_kv_blocks,
            "hidden_size": runner.model_cfg.hidden_size,
            "num_layers": runner.model_cfg.num_layers,
        }
        log(f"TP {tp}: engine up in {out['start_s']:.0f} s, rank 0 holds {total / 2**30:.2f} GiB")
        context = CONTEXT if args.device == "cuda" else 32
        out["itl_s"] = statistics.median(decode_itl(llm, context=context, steps=ITL_STEPS))
        if args.num_requests:
            items = read_workload(VLLM_SAMPLE)[: args.num_requests]
            prompts = [list(i.prompt_token_ids) for i in items]
            lens = [i.output_len for i in items]
            if args.device == "cpu":  # a dry run: short
                prompts, lens = [p[:32] for p in prompts], [min(n, 8) for n in lens]
            log(f"TP {tp}: throughput, {len(prompts)} vLLM ShareGPT requests")
            out["throughput"] = throughput(llm, prompts, lens)
        return out
    finally:
        llm.close()


def in_child(args: argparse.Namespace, tp: int) -> dict:
    extra = ["--num-requests", str(args.num_requests), "--device", args.device]
    if args.quantization:
        extra += ["--quantization", args.quantization]
    return run_part(__file__, ["--one", str(tp), *extra])


# -- the all-reduce's latency on these GPUs --------------------------------------------------------


def _all_reduce_rank(rank: int, size: int, path: str, hidden: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=size)
    x = torch.ones(1, hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # the engine's decode steps replay theirs in graphs too
    with torch.cuda.graph(graph):
        for _ in range(ALL_REDUCE_REPS):
            dist.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    if rank == 0:
        Path(out).write_text(str(start.elapsed_time(stop) / 1e3 / ALL_REDUCE_REPS))
    del graph
    dist.destroy_process_group()


def all_reduce_latency(size: int, hidden: int) -> float:
    """Seconds of one all-reduce of ``[1, hidden]`` bf16 over ``size`` GPUs (NCCL, replayed in
    a CUDA graph: no launch gaps)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency"
        mp.spawn(
            _all_reduce_rank,
            args=(size, str(Path(tmp) / "rdv"), hidden, str(out)),
            nprocs=size,
            join=True,
        )
        return float(out.read_text())


# -- floors, table, plot ------------------------------------------------------------------------------


def with_floors(runs: dict[str, dict], hbm: float, latencies: dict[int, float], nvlink: float):
    """Each run's floor: rank 0's weight bytes over the HBM rate plus its all-reduces, at the
    measured latency (``allreduce_s``) and at NVLink's rate (``allreduce_rate_s``)."""
    for r in runs.values():
        tp, hidden = r["tp"], r["hidden_size"]
        count = 2 * r["num_layers"] + 1  # o_proj and down_proj a layer, the embedding's
        ring = 2 * (tp - 1) / tp * hidden * 2  # bytes each GPU sends for one all-reduce
        r["weights_floor_s"] = r["rank_weight_bytes_read_per_step"] / hbm
        r["allreduce_s"] = count * latencies.get(tp, 0.0)
        r["allreduce_rate_s"] = count * ring / nvlink if tp > 1 else 0.0
        r["floor_s"] = r["weights_floor_s"] + r["allreduce_s"]
        r["itl_over_floor"] = r["itl_s"] / r["floor_s"]


def print_table(result: dict) -> None:
    hbm = result.get("hbm_copy_bytes_per_s")
    print(f"\n{result['device']}" + (f", HBM copy {hbm / 1e12:.2f} TB/s" if hbm else ""))
    rows = [("TP", "rank weights GiB", "weights floor ms", "all-reduces ms", "floor ms", "ITL ms",
             "ITL / floor", "KV blocks", "out tok/s")]  # fmt: skip
    for r in result["runs"].values():
        tput = r.get("throughput", {}).get("output_tok_s")
        floors = [r.get(k) for k in ("weights_floor_s", "allreduce_s", "floor_s")]
        over = r.get("itl_over_floor")
        rows.append((r["tp"], f"{r['rank_weight_bytes'] / 2**30:.2f}",
                     *(f"{f * 1e3:.2f}" if f is not None else "-" for f in floors),
                     f"{r['itl_s'] * 1e3:.2f}", f"{over:.3f}x" if over else "-",
                     r["num_kv_blocks"], f"{tput:.0f}" if tput else "-"))  # fmt: skip
    print_markdown(rows)


def plot(result: dict, path: Path) -> None:
    """ITL against its floor, and throughput, per TP size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(result["runs"].values())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [str(r["tp"]) for r in runs]
    ax1.plot(x, [r["itl_s"] * 1e3 for r in runs], "o-", label="ITL (median)")
    if all("floor_s" in r for r in runs):
        ax1.plot(x, [r["floor_s"] * 1e3 for r in runs], "s--", label="floor")
    ax1.set_xlabel("tensor-parallel size")
    ax1.set_ylabel("ms per token, batch 1")
    ax1.legend()
    tput = [r for r in runs if "throughput" in r]
    ax2.plot([str(r["tp"]) for r in tput], [r["throughput"]["output_tok_s"] for r in tput], "o-")
    ax2.set_xlabel("tensor-parallel size")
    ax2.set_ylabel("output tok/s, vLLM ShareGPT sample")
    fig.suptitle(f"Tensor parallelism, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_tp.json"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--num-requests", type=int, default=1000, help="0: no throughput run")
    ap.add_argument("--quantization", choices=("fp8",), default=None)
    ap.add_argument(
        "--nvlink-gbps", type=float, default=450.0, help="one direction, per GPU (H100 SXM)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        Path(args.part).write_text(json.dumps(engine_run(args)))
        return
    cuda = args.device == "cuda"
    if cuda and max(args.tp) > torch.cuda.device_count():
        raise SystemExit(
            f"--tp {max(args.tp)} needs as many GPUs, {torch.cuda.device_count()} here"
        )
    result: dict = {
        "benchmark": "gpu_tp",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        if cuda
        else "cpu",
    }
    result["runs"] = {str(tp): in_child(args, tp) for tp in args.tp}
    if cuda:
        from benchmarks.gpu_ceilings import hbm_copy_bandwidth

        hbm = hbm_copy_bandwidth()
        log(f"HBM copy {hbm / 1e12:.2f} TB/s")
        hidden = next(iter(result["runs"].values()))["hidden_size"]
        latencies = {tp: all_reduce_latency(tp, hidden) for tp in args.tp if tp > 1}
        for tp, s in latencies.items():
            log(f"all-reduce of [1, {hidden}] bf16 over {tp} GPUs: {s * 1e6:.1f} us")
        result["hbm_copy_bytes_per_s"] = hbm
        result["allreduce_latency_s"] = {str(k): v for k, v in latencies.items()}
        with_floors(result["runs"], hbm, latencies, args.nvlink_gbps * 1e9)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
