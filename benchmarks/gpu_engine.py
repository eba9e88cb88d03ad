"""The CUDA engine on one GPU, Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy bf16 weights).

Every figure is a ratio to a denominator measured in the same run (issue 3):

1. decode inter-token latency, batch 1, 512-token context, over the weights-read floor
   (weight bytes / HBM copy bandwidth), with CUDA graphs and without;
2. KV capacity at ``gpu_memory_utilization`` 0.9 against what the free memory allows;
3. offline throughput, 1000 requests each: 512 in / 128 out (against transformers' ``generate``
   at batch 128 on the same GPU), 1024/128, 128/1024 and ShareGPT lengths
   (benchmarks/data/sharegpt_llama3_lengths.json, from ``python benchmarks/workloads.py``), with
   ``ignore_eos`` so every request produces its dataset length.

    python benchmarks/gpu_engine.py [--only itl,kv,throughput,hf] [--num-requests 1000] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import bf16_matmul_flops, hbm_copy_bandwidth, time_cuda  # noqa: E402
from benchmarks.workloads import SHAREGPT_LENGTHS  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "llama3-8b"
SECTIONS = ("itl", "kv", "throughput", "hf")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_part(script: str, args: list[str]) -> dict:
    """``script`` run again in a child process of its own (a fresh CUDA context: one engine's
    memory cannot shrink the next one's budget) with ``args`` and ``--part FILE``: the JSON it
    wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        subprocess.run([sys.executable, script, *args, "--part", str(part)], check=True)
        return json.loads(part.read_text())


def print_markdown(rows: list[tuple]) -> None:
    """``rows``, the header first, as a Markdown table."""
    for i, row in enumerate(rows):
        print("| " + " | ".join(str(c) for c in row) + " |")
        if i == 0:
            print("|" + "---|" * len(row))


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128, 128000) for _ in range(length)] for _ in range(n)]


# -- transformers ---------------------------------------------------------------------------------


def hf_generate_tok_s(batch: int, prompt_len: int, output_len: int) -> dict:
    """transformers' ``generate`` on the same GPU: random weights at the same config, greedy,
    one batch of ``batch`` prompts, exactly ``output_len`` new tokens each."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(CONFIG)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build straight in bf16 (no fp32 copy on the GPU)
    try:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    ids = torch.tensor(random_prompts(batch, prompt_len, seed=1), device="cuda")
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    model.generate(ids[:, :16], max_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new_tokens = (out.shape[1] - prompt_len) * batch
    del model, out
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": batch, "seconds": seconds, "output_tok_s": new_tokens / seconds}


# -- tandem ---------------------------------------------------------------------------------------


def make_llm(**overrides):
    from engine import LLM

    kwargs = dict(
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
    )
    kwargs.update(overrides)
    model = kwargs.pop("model", str(CONFIG))  # a model folder of its own (another shape)
    return LLM(model, **kwargs)


def decode_itl(llm, context: int, steps: int, batch: int = 1) -> list[float]:
    """Wall time of each engine step (schedule, inputs, forward, sample, outputs) of ``batch``
    requests decoding together after ``context``-token prompts."""
    from engine import SamplingParams

    engine = llm.engine
    for i, prompt in enumerate(random_prompts(batch, context, seed=2)):
        engine.add_request(
            f"itl-{i}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True),
        )
    engine.step()  # prefill (a chunked prefill's later steps fall among the warm-up steps)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[4:]  # drop warm-up steps


def graph_replay_s(llm) -> float | None:
    """GPU time of one batch-1 decode graph replay alone (no host work around it)."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    return time_cuda(graphs._graphs[1].replay, reps=50)


def itl_section(llm, bandwidth: float) -> dict:
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    floor = weight_bytes / bandwidth
    graphed = statistics.median(decode_itl(llm, 512, 64))
    replay = graph_replay_s(llm)
    # The same graph with cuBLAS for the batch-1 GEMMs instead of kernels/gemv.py.
    from engine.ops import SkinnyLinear

    rows, SkinnyLinear.max_rows = SkinnyLinear.max_rows, 0
    runner.graphs.capture([1])
    replay_cublas = graph_replay_s(llm)
    itl_cublas = statistics.median(decode_itl(llm, 512, 32))
    SkinnyLinear.max_rows = rows
    runner.graphs.capture([1])
    graphs, runner.graphs = runner.graphs, None  # the same engine, kernel by kernel
    eager = statistics.median(decode_itl(llm, 512, 32))
    runner.graphs = graphs
    return {
        "weight_bytes": weight_bytes,
        "weights_read_floor_s": floor,
        "itl_graphs_s": graphed,
        "itl_eager_s": eager,
        "graph_replay_gpu_s": replay,
        "graph_replay_cublas_gpu_s": replay_cublas,
        "itl_graphs_cublas_s": itl_cublas,
        "itl_over_floor": graphed / floor,
        "eager_over_floor": eager / floor,
        "replay_over_floor": replay / floor if replay else None,
    }


def kv_section(llm) -> dict:
    runner = llm.engine.runner
    mem = runner.memory_report
    per_token = runner.model_cfg.kv_bytes_per_token * 2  # bf16
    capacity = runner.num_kv_blocks * runner.cfg.block_size
    # What the free memory allows: utilization x total, minus what the weights and the CUDA
    # context held before the KV pool (no activation reserve), over bytes per token.
    allows = (mem["utilization"] * mem["total"] - mem["in_use"]) / per_token
    return {
        **mem,
        "kv_bytes_per_token": per_token,
        "capacity_tokens": capacity,
        "free_memory_allows_tokens": allows,
        "capacity_over_allowed": capacity / allows,
    }


def throughput(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    assert out_tokens == sum(output_lens), "ignore_eos requests must produce max_tokens each"
    return {
        "requests": len(prompts),
        "seconds": seconds,
        "req_s": len(prompts) / seconds,
        "output_tok_s": out_tokens / seconds,
        "total_tok_s": (in_tokens + out_tokens) / seconds,
    }


def throughput_section(llm, n: int, save) -> dict:
    """Each workload's figures are saved as soon as it finishes (a long run may be cut off)."""
    results = {}
    shapes = {"512/128": (512, 128), "1024/128": (1024, 128), "128/1024": (128, 1024)}
    for name, (p, o) in shapes.items():
        log(f"throughput {name}, {n} requests")
        results[name] = throughput(llm, random_prompts(n, p, seed=3), [o] * n)
        save(results)
    lengths = json.loads((ROOT / "benchmarks" / SHAREGPT_LENGTHS).read_text())["lengths"][:n]
    rng = random.Random(4)
    prompts = [[rng.randrange(128, 128000) for _ in range(p)] for p, _ in lengths]
    log(f"throughput ShareGPT, {len(prompts)} requests")
    results["sharegpt"] = throughput(llm, prompts, [o for _, o in lengths])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    sections = set(args.only.split(","))
    gpu = torch.cuda.get_device_name()
    result: dict = {"gpu": gpu}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(partial: dict | None = None) -> None:
        if partial is not None:
            result["throughput"] = partial
        (args.out / "gpu_engine.json").write_text(json.dumps(result, indent=2))

    log(f"{gpu}: measuring HBM copy bandwidth and the bf16 matmul rate")
    bandwidth = result["hbm_copy_bytes_per_s"] = hbm_copy_bandwidth()
    result["bf16_matmul_flops"] = bf16_matmul_flops()
    if "hf" in sections:
        log("transformers generate, batch 128, 512 in / 128 out")
        result["hf_512_128"] = hf_generate_tok_s(128, 512, 128)
        save()
    log("loading tandem (Llama-3-8B shape, dummy bf16 weights), capturing decode graphs")
    t0 = time.perf_counter()
    llm = make_llm()
    result["engine_start_s"] = time.perf_counter() - t0
    if "kv" in sections:
        result["kv"] = kv_section(llm)
    if "itl" in sections:
        log("decode ITL, batch 1, 512-token context")
        result["itl"] = itl_section(llm, bandwidth)
    if "throughput" in sections:
        result["throughput"] = throughput_section(llm, args.num_requests, save)
        if "hf_512_128" in result:
            ours = result["throughput"]["512/128"]["output_tok_s"]
            result["throughput_512_128_over_hf"] = ours / result["hf_512_128"]["output_tok_s"]
    save()
    print_table(result)


def print_table(r: dict) -> None:
    rows = [("GPU", r["gpu"]), ("HBM copy", f"{r['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")]
    rows.append(("bf16 matmul", f"{r['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"))
    if "itl" in r:
        i = r["itl"]
        rows += [
            ("weights floor", f"{i['weights_read_floor_s'] * 1e3:.2f} ms"),
            ("ITL graphs", f"{i['itl_graphs_s'] * 1e3:.2f} ms = {i['itl_over_floor']:.3f}x floor"),
            ("ITL eager", f"{i['itl_eager_s'] * 1e3:.2f} ms = {i['eager_over_floor']:.2f}x floor"),
        ]
        if i["graph_replay_gpu_s"]:
            rows.append(("replay (GPU)", f"{i['graph_replay_gpu_s'] * 1e3:.2f} ms"))
            rows.append(("replay, cuBLAS", f"{i['graph_replay_cublas_gpu_s'] * 1e3:.2f} ms"))
            rows.append(("ITL, cuBLAS", f"{i['itl_graphs_cublas_s'] * 1e3:.2f} ms"))
    if "kv" in r:
        k = r["kv"]
        rows.append(
            (
                "KV capacity",
                f"{k['capacity_tokens']:,} tokens = {k['capacity_over_allowed']:.3f}"
                f" of {k['free_memory_allows_tokens']:,.0f} the free memory allows",
            )
        )
    if "hf_512_128" in r:
        rows.append(("HF bs128 512/128", f"{r['hf_512_128']['output_tok_s']:.0f} out tok/s"))
    for name, t in r.get("throughput", {}).items():
        rows.append(
            (f"tandem {name}", f"{t['output_tok_s']:.0f} out tok/s, {t['req_s']:.1f} req/s")
        )
    if "throughput_512_128_over_hf" in r:
        rows.append(("512/128 vs HF", f"{r['throughput_512_128_over_hf']:.1f}x"))
    print()
    for name, value in rows:
        print(f"{name:<20}{value}")


if __name__ == "__main__":
    main()
