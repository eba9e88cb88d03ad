"""Structured outputs on one GPU (issue 27): what a grammar costs a decode batch, and what the
schema suite costs to compile, Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy bf16
weights) with the Llama 3 tokenizer (128k tokens: the mask's width).

1. ITL at batch 64: 64 requests (random 128-token prompts) decode together, every one
   constrained by a schema of the suite (benchmarks/structured_suite.py, each wrapped as an
   array of at least 64 items, so no answer ends inside the window), against the same batch
   with no constraint (aim: at most 1.10x). After every request has left its prefill, the
   wall time of ``--steps`` engine steps over the steps is the inter-token latency; the
   engine runs at its defaults (async scheduling: each step's masks are filled on the host
   while its forward pass runs). Also: the host's mask time per step (fill + queue,
   ``Sampler.mask_seconds``), the device's idle share (``ModelRunner.timeline``), and that no
   grammar failed.
2. Compile time of each schema of the suite on a cold cache (``Grammars.compile``), and with
   the first mask filled (llguidance builds its lexer lazily: the first mask pays for it).

    PYTHONPATH=$PWD python benchmarks/gpu_structured.py --out DIR \\
        [--tokenizer /tmp/llama3-8b/tokenizer.json] [--batch 64] [--steps 128]
    python benchmarks/gpu_structured.py --device cpu --model DIR --batch 4 --steps 4   # smoke

Prints a table, writes ``DIR/gpu_structured.json`` and a plot ``DIR/gpu_structured.png``.
``--device cpu`` runs the same on a small model folder that has a tokenizer (``--model``), fp32.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.structured_suite import schemas  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "llama3-8b"
TOKENIZER = Path("/tmp/llama3-8b/tokenizer.json")
PROMPT_LEN = 128
MIN_ITEMS = 64  # each schema wrapped as an array of at least this many: answers outlast the window


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_folder(tokenizer: Path, into: Path) -> Path:
    """The Llama-3-8B config beside the tokenizer (and its tokenizer_config.json, when there
    is one): a folder the engine loads with dummy weights."""
    if not tokenizer.is_file():
        raise SystemExit(
            f"no tokenizer at {tokenizer}: pass --tokenizer (benchmarks/fetch_llama3_tokenizer.sh "
            "fetches one)"
        )
    shutil.copy(CONFIG / "config.json", into / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = tokenizer.parent / name
        if source.is_file():
            shutil.copy(source, into / name)
    shutil.copy(tokenizer, into / "tokenizer.json")
    return into


def make_llm(model: Path, device: str, batch: int):
    from engine import LLM

    if device == "cpu":
        return LLM(str(model), dtype="float32", device="cpu", max_num_seqs=batch)
    return LLM(
        str(model),
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_num_seqs=batch,
        gpu_memory_utilization=0.9,
    )


def long_answer(schema: dict) -> dict:
    return {"type": "array", "items": schema, "minItems": MIN_ITEMS}


def decode_itl(llm, batch: int, steps: int, constrained: bool) -> dict:
    """Seconds per engine step over ``steps`` steps of ``batch`` requests decoding together
    (every one constrained, or none), and the host's mask time and the device's idle time in
    that window."""
    from benchmarks.gpu_async import device_time
    from engine import SamplingParams
    from engine.sampling_params import StructuredSpec

    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    suite = schemas()
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(256, vocab - 256) for _ in range(PROMPT_LEN)]
        spec = StructuredSpec.json_schema(long_answer(suite[i % len(suite)]))
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=steps + 64,
            ignore_eos=not constrained,
            structured=spec if constrained else None,
        )
        ids.append(engine.add_request(f"{'c' if constrained else 'f'}{i}", prompt, params))
    for _ in range(10_000):  # grammars land, prompts prefill, the first decode steps
        requests = [engine.single_request(rid) for rid in ids]
        if all(r is None or r.num_output_tokens >= 2 for r in requests):
            break  # (None: ended already, a grammar error: counted below)
        engine.step()
    masks = runner.sampler.mask_seconds
    mask_n, mask_s = sum(masks.counts), masks.total
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
        runner.timeline = []
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    busy = idle = None
    if runner.timeline is not None:
        busy, idle = device_time(runner.timeline)
        runner.timeline = None
    running = len(engine.scheduler.running)
    engine.abort_request(ids)
    engine.drain()
    stats = engine.grammar_stats() or {}
    n = sum(masks.counts) - mask_n
    return {
        "constrained": constrained,
        "batch": batch,
        "steps": steps,
        "running_at_end": running,
        "itl_s": seconds / steps,
        "mask_s_per_step": (masks.total - mask_s) / n if n else 0.0,
        "device_busy_s": busy,
        "device_idle_s": idle,
        "grammar_errors": stats.get("errors", 0),
    }


def compile_times(llm) -> list[dict]:
    """Each suite schema compiled on a cold cache, then its first mask filled."""
    import numpy as np

    from engine.grammar import Grammars, allocate_bitmask, make_backend
    from engine.sampling_params import StructuredSpec

    engine = llm.engine
    backend = make_backend(
        "llguidance", engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids
    )
    grammars = Grammars(backend, capacity=1024)
    bitmask = allocate_bitmask(1, engine.model_config.vocab_size)
    out = []
    for i, schema in enumerate(schemas()):
        spec = StructuredSpec.json_schema(schema)
        t0 = time.perf_counter()
        grammars.compile(spec)
        t1 = time.perf_counter()
        grammars.matcher(spec).fill_bitmask(bitmask, 0)
        t2 = time.perf_counter()
        allowed = int(np.unpackbits(bitmask[0].view(np.uint8)).sum())
        out.append({"schema": i, "compile_s": t1 - t0, "first_mask_s": t2 - t1, "allowed": allowed})
    return out


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


def print_table(result: dict) -> None:
    free, constrained = result["free"], result["constrained"]
    print(f"\n{result['device']}, {result['model']}, batch {free['batch']}, {free['steps']} steps")
    print("| batch | ITL ms | host mask ms/step | device idle | grammar errors |")
    print("| --- | --- | --- | --- | --- |")
    for r in (free, constrained):
        idle = "-" if r["device_idle_s"] is None else f"{r['device_idle_s']:.3f} s"
        print(
            f"| {'constrained' if r['constrained'] else 'free'} | {1e3 * r['itl_s']:.2f} | "
            f"{1e3 * r['mask_s_per_step']:.2f} | {idle} | {r['grammar_errors']} |"
        )
    print(f"\nconstrained / free ITL: {result['itl_ratio']:.3f}x (aim <= 1.10x)")
    c, m = result["compile"]["compile_s"], result["compile"]["first_mask_s"]
    print(f"\ncompile of {len(result['compiles'])} schemas (cold cache), ms:")
    print("| | median | p90 | max |")
    print("| --- | --- | --- | --- |")
    print(f"| compile | {1e3 * c['median']:.2f} | {1e3 * c['p90']:.2f} | {1e3 * c['max']:.2f} |")
    print(f"| first mask | {1e3 * m['median']:.2f} | {1e3 * m['p90']:.2f} | {1e3 * m['max']:.2f} |")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = (result["free"], result["constrained"])
    left.bar(["free", "constrained"], [1e3 * r["itl_s"] for r in runs], color=["#bbb", "#1f77b4"])
    left.bar(
        ["free", "constrained"],
        [1e3 * r["mask_s_per_step"] for r in runs],
        color="#d62728",
        label="host mask time (overlaps the forward)",
    )
    left.set_ylabel(f"ms per step, batch {result['free']['batch']}")
    left.set_title(f"ITL: constrained / free = {result['itl_ratio']:.3f}x")
    left.legend()
    compiles = result["compiles"]
    right.bar(
        range(len(compiles)), [1e3 * c["compile_s"] for c in compiles], label="compile", width=0.8
    )
    right.bar(
        range(len(compiles)),
        [1e3 * c["first_mask_s"] for c in compiles],
        bottom=[1e3 * c["compile_s"] for c in compiles],
        label="first mask",
        width=0.8,
    )
    right.set_xlabel("schema of the suite")
    right.set_ylabel("ms (cold cache)")
    right.legend()
    fig.suptitle(f"Structured outputs, {result['device']}, {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="Llama 3 tokenizer.json")
    ap.add_argument("--model", type=Path, default=None, help="a model folder (cpu smoke mode)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model = args.model
        elif args.device == "cpu":
            raise SystemExit("--device cpu needs --model DIR (a small model with a tokenizer)")
        else:
            model = model_folder(args.tokenizer, Path(tmp))
        t0 = time.perf_counter()
        llm = make_llm(model, args.device, args.batch)
        log(f"engine up in {time.perf_counter() - t0:.0f} s")
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        compiles = compile_times(llm)
        log(f"compiled {len(compiles)} schemas")
        for constrained in (False, True):  # warm-up of both paths: kernels, first masks
            decode_itl(llm, args.batch, min(args.steps, 8), constrained)
        # alternating, each variant first in turn: what one order leaves warm (or not) is shared
        repeats: dict[bool, list[dict]] = {False: [], True: []}
        for rep in range(args.repeats):
            for constrained in (False, True) if rep % 2 == 0 else (True, False):
                r = decode_itl(llm, args.batch, args.steps, constrained)
                repeats[constrained].append(r)
                log(f"constrained={constrained}: {1e3 * r['itl_s']:.2f} ms/step")
        runs = {
            c: sorted(rs, key=lambda r: r["itl_s"])[len(rs) // 2] for c, rs in repeats.items()
        }  # the median run of each
    result = {
        "device": device,
        "model": "Llama-3-8B shape" if args.model is None else str(args.model),
        "free": runs[False],
        "constrained": runs[True],
        "itl_ratio": runs[True]["itl_s"] / runs[False]["itl_s"],
        "repeats": {"free": repeats[False], "constrained": repeats[True]},
        "compiles": compiles,
        "compile": {
            "compile_s": summary([c["compile_s"] for c in compiles]),
            "first_mask_s": summary([c["first_mask_s"] for c in compiles]),
        },
    }
    (args.out / "gpu_structured.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    plot(result, args.out / "gpu_structured.png")


if __name__ == "__main__":
    main()
