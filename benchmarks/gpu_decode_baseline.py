"""Baseline before the CUDA work of issue 3: the plain-torch engine path on one GPU.

Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy weights), bf16. Measures in one run:
HBM copy bandwidth, then decode inter-token latency at batch 1 with a 512-token context, and
reports it over the weights-read floor (weight bytes / measured bandwidth).

    python benchmarks/gpu_decode_baseline.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import hbm_copy_bandwidth  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decode_itl(llm, context: int, steps: int) -> list[float]:
    from engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        "itl",
        list(range(1000, 1000 + context)),
        SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True),
    )
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from engine import LLM

    gpu = torch.cuda.get_device_name()
    log(f"{gpu}: measuring HBM copy bandwidth")
    bw = hbm_copy_bandwidth()
    log(f"HBM copy {bw / 1e12:.2f} TB/s; loading Llama-3-8B shape with dummy weights")
    llm = LLM(
        str(ROOT / "benchmarks/configs/llama3-8b"),
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_num_seqs=8,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    floor = weight_bytes / bw  # reading every weight once per token at copy bandwidth
    times = decode_itl(llm, context=512, steps=64)[8:]  # drop warm-up steps
    itl = statistics.median(times)
    result = {
        "gpu": gpu,
        "hbm_copy_bytes_per_s": bw,
        "weight_bytes": weight_bytes,
        "weights_read_floor_s": floor,
        "decode_itl_batch1_ctx512_s": itl,
        "itl_over_floor": itl / floor,
        "backend": llm.engine.runner.backend.name,
        "kv_blocks": llm.engine.runner.num_kv_blocks,
    }
    print(
        f"\n{'GPU':<14}{gpu}\n{'HBM copy':<14}{bw / 1e12:.2f} TB/s\n{'weights':<14}"
        f"{weight_bytes / 1e9:.2f} GB\n{'floor':<14}{floor * 1e3:.2f} ms\n{'ITL (median)':<14}"
        f"{itl * 1e3:.2f} ms\n{'ITL / floor':<14}{itl / floor:.2f}x  (aim of issue 3: <= 1.15x)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode_baseline.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
