"""The engine's host work per token, on CPU, with a model too small to matter (issue 23, item 2).

On a GPU the host schedules step N+1, prepares its inputs and takes in step N's tokens while
the device runs N (async scheduling). That hides the host only while its work per step is
shorter than the device's. At ~500 running requests an FP8 decode step of the Llama-3-8B shape
takes ~13 ms on an H200, and a host that spends ~30 us per request per step already takes 15:
the device then waits (benchmarks/NOTES.md, "FP8 at 9-64 rows ...").

This measures that host work where nothing else competes with it: vLLM's ShareGPT sample (1000
requests, 231 in / 189 out on average; ids folded into the model's vocabulary) through
``LLM.generate`` on CPU, at the CUDA defaults (512 sequences, 2048 tokens a step, blocks of 16),
async scheduling on, with a random one-layer Llama of hidden size 64 and a 512-token
vocabulary, whose forward pass is a small part of each step. Two runs of the same requests:

* timed: wall seconds and microseconds per generated token;
* under cProfile: the time of the engine's phases (inclusive, profiler overhead included, so
  read them as shares): scheduling, the runner's input preparation, the forward pass (with
  its attention metadata), sampling, and taking the tokens in (stop checks, outputs).

    python benchmarks/host_overhead.py [--requests 1000] [--out benchmarks/results/host_overhead.json]
    python benchmarks/host_overhead.py --worker [--out F]

``--worker``: as a serving worker steps its engine (engine/runtime.py): output kind "delta", a
delta for every request that progressed each step, each step's deltas encoded as the frame the
output stream writes to the router (engine/output_stream.py ``encode_batch``), instead of
``LLM.generate``'s outputs for finished requests only. The phases add "emit".

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import read_workload  # noqa: E402
from engine.messages import StreamBatch  # noqa: E402
from engine.output_stream import encode_batch  # noqa: E402

SAMPLE = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
VOCAB = 512
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
# (phase, the functions whose inclusive time it is: "file:function")
PHASES = (
    ("schedule", ("scheduler.py:schedule",)),
    ("prepare inputs", ("model_runner.py:_prepare",)),
    ("forward (device work on a GPU)", ("model_runner.py:_run_everywhere",)),
    ("sampling (device work on a GPU)", ("model_runner.py:sample",)),
    ("take tokens in, outputs", ("llm_engine.py:_finish",)),
    ("emit (--worker: the stream's frames)", ("host_overhead.py:_emit",)),
)


def make_model(folder: Path) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).save_pretrained(folder)
    return str(folder)


def workload(n: int):
    from engine import SamplingParams

    items = read_workload(SAMPLE)[:n]
    prompts = [[t % VOCAB for t in i.prompt_token_ids] for i in items]
    params = [
        SamplingParams(temperature=0.0, max_tokens=i.output_len, ignore_eos=True) for i in items
    ]
    return prompts, params


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    """Inclusive seconds of each phase from the profile (a function counted once per call
    chain: the outermost frame's time)."""
    by_name: dict[str, float] = {}
    for (file, _, fn), (_, _, _, cumtime, _) in stats.stats.items():
        key = f"{Path(file).name}:{fn}"
        by_name[key] = by_name.get(key, 0.0) + cumtime
    return {phase: sum(by_name.get(f, 0.0) for f in funcs) for phase, funcs in PHASES}


def _emit(deltas: list) -> int:
    """The frame a worker writes for one step's deltas (one router): its size in bytes."""
    return len(encode_batch(StreamBatch("w", deltas))) if deltas else 0


def run_worker(llm, prompts, params) -> None:
    """Every request added, then the engine stepped with delta outputs, each step's deltas
    encoded (``--worker``)."""
    engine = llm.engine
    kind, engine.output_kind = engine.output_kind, "delta"
    try:
        for prompt, p in zip(prompts, params, strict=True):
            engine.add_request(None, prompt, p)
        while engine.has_unfinished_requests():
            _emit(engine.step())
    finally:
        engine.output_kind = kind


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/host_overhead.json")
    ap.add_argument("--worker", action="store_true", help="delta outputs and stream frames")
    args = ap.parse_args(argv)
    import torch

    from engine import LLM

    torch.set_num_threads(1)  # the host path is one thread; the tiny forward needs no team
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(make_model(Path(tmp)), device="cpu", dtype="float32", max_num_seqs=512,
                  max_num_batched_tokens=2048, block_size=16, async_scheduling=True)  # fmt: skip
        prompts, params = workload(args.requests)
        tokens = sum(p.max_tokens for p in params)
        llm.generate(prompts[:50], params[:50])  # warm-up
        runs = {}
        for name in ("timed", "profiled"):
            assert llm.reset_prefix_cache()
            prof = cProfile.Profile() if name == "profiled" else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            if args.worker:
                run_worker(llm, prompts, params)
            else:
                llm.generate(prompts, params)
            if prof is not None:
                prof.disable()
            wall = time.perf_counter() - t0
            runs[name] = {"seconds": wall, "us_per_token": 1e6 * wall / tokens}
            if prof is not None:
                phases = phase_seconds(pstats.Stats(prof))
                runs[name]["phases_s"] = phases
                runs[name]["phases_us_per_token"] = {k: 1e6 * v / tokens for k, v in phases.items()}
            print(
                f"{name}: {wall:.2f} s, {runs[name]['us_per_token']:.1f} us a token",
                file=sys.stderr,
            )
    result = {
        "benchmark": "host_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "requests": len(prompts),
        "mode": "worker" if args.worker else "generate",
        "output_tokens": tokens,
        "model": MODEL,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{len(prompts)} requests, {tokens} output tokens, CPU, engine at the CUDA defaults")
    print(
        f"timed: {runs['timed']['seconds']:.2f} s = **{runs['timed']['us_per_token']:.1f} us a token**"
    )
    print("\n| phase (under cProfile) | s | us a token |\n|---|---|---|")
    for phase, sec in runs["profiled"]["phases_s"].items():
        print(f"| {phase} | {sec:.2f} | {1e6 * sec / tokens:.1f} |")
    print(
        f"| the run, profiled | {runs['profiled']['seconds']:.2f} | {runs['profiled']['us_per_token']:.1f} |"
    )
    return result


if __name__ == "__main__":
    main()
