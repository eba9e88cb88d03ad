"""Output-length prediction at the router: how many tokens a request's answer will have.

A predictor sees the request alone (its prompt text or token ids, the chat's turn structure,
``max_tokens``) and returns a distribution, not a point: a median and upper quantiles, since
schedulers need the tail. Predictors are pluggable (``PREDICTORS``, ``make_predictor``)::

    none      no prediction (the policies fall back to max_tokens / FCFS)
    oracle    the true length from the request's ``x-tandem-oracle-tokens`` header (benchmarks
              that know it: the ceiling any predictor can reach)
    learned   the shipped artifact router/data/length_smollm2 (``NgramMLP``): hashed word uni-
              and bigrams with learned embeddings, pooled, plus prompt, turn and chat-history
              features, into a small MLP ensemble on log(1 + length); quantiles from
              held-out residuals; its output layer adapts online to the served model

The learned predictor's life in the router::

    admission   predict(x)  ── features ── hidden units ── head ──► p50 / p90 / p99
    finish      observe(x, actual tokens) ──► the window (hidden, log length), the rolling tau
    when due    refit_due() ──► maybe_refit() in a thread: ridge of the head on the window,
                toward the trained head ──► one swap; predict reads the head once
    metrics     stats(): observations, refits, rolling Kendall tau and MAE

Every prediction is capped by the request's ``max_tokens`` (and never below 1).
"""

from __future__ import annotations

import abc
import json
import math
import re
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)
ORACLE_HEADER = "x-tandem-oracle-tokens"
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "data" / "length_smollm2"


@dataclass(frozen=True)
class PredictInput:
    """What the router knows of a request when it predicts."""

    text: str | None = None  # chat: the last user turn's text; a completion: its prompt
    prompt_len: int = 0  # prompt tokens (the learned predictor reads them only without text)
    turns: int = 1  # user turns so far (a chat's structure)
    last_answer_len: int | None = None  # tokens of the previous assistant turn, when known
    max_tokens: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    prev_answers: tuple[str, ...] = ()  # a chat's earlier assistant turns' text, oldest first


@dataclass(frozen=True)
class Prediction:
    """Output tokens: ``quantiles[q]`` for q in QUANTILES (non-decreasing in q)."""

    quantiles: dict[float, float]

    @property
    def median(self) -> float:
        return self.quantiles[0.5]

    def median_given(self, produced: int) -> float | None:
        """The median total length of a request that has produced ``produced`` tokens and is
        still going: ``F^-1((1 + F(produced)) / 2)``, with F piecewise linear in log length
        through the quantiles, mirrored below the median (the lower half log-symmetric to the
        upper) and 0 at one token. None once it is past every quantile: the distribution
        then says nothing about how far it goes."""
        knots = sorted((q, max(v, 1.0)) for q, v in self.quantiles.items())
        if produced >= knots[-1][1]:
            return None
        points = [(0.0, 0.0)]  # (F, log length)
        if len(knots) > 1:
            (q0, v0), (q1, v1) = knots[0], knots[1]
            points.append((max(2 * q0 - q1, 0.0), math.log(max(v0 * v0 / v1, 1.0))))
        points += [(q, math.log(v)) for q, v in knots]
        points = [p for i, p in enumerate(points) if i == 0 or p[1] > points[i - 1][1]]
        x = math.log(max(produced, 1))
        f = max((_lerp(x, (a[1], a[0]), (b[1], b[0])) for a, b in _spans(points, x, 1)), default=0)
        target = f + (1.0 - f) / 2.0
        for a, b in _spans(points, target, 0):
            return max(math.exp(_lerp(target, a, b)), produced + 1.0)
        return max(knots[-1][1], produced + 1.0)

    def capped(self, max_tokens: int | None) -> Prediction:
        if max_tokens is None:
            return self
        return Prediction(
            {q: min(max(v, 1.0), float(max_tokens)) for q, v in self.quantiles.items()}
        )


class LengthPredictor(abc.ABC):
    name = "abstract"
    # Whether the engine's length probe (after the prefill) may replace this predictor's
    # estimate for a request's remaining work; an exact one (the oracle) is not refined.
    refinable = True

    @abc.abstractmethod
    def predict(self, x: PredictInput) -> Prediction | None:
        """The request's output-length distribution, or None when this predictor has none."""

    def observe(self, x: PredictInput, actual: int) -> None:  # noqa: B027 - optional hook
        """A finished request's true length (online adaptation; default: ignored)."""

    def refit_due(self) -> bool:
        """Enough observations since the last refit that ``maybe_refit`` would run one."""
        return False

    def maybe_refit(self) -> bool:
        """Refit on what was observed if due (blocking: callers run it off the event loop);
        whether it did."""
        return False

    def stats(self) -> dict[str, Any]:
        """Online-adaptation counters for metrics (none by default)."""
        return {}


class NoPredictor(LengthPredictor):
    name = "none"

    def predict(self, x: PredictInput) -> Prediction | None:
        return None


class OraclePredictor(LengthPredictor):
    """The true length, from a header the benchmark client sets (never from a real client)."""

    name = "oracle"
    refinable = False

    def predict(self, x: PredictInput) -> Prediction | None:
        raw = x.headers.get(ORACLE_HEADER)
        if raw is None or not raw.isdigit():
            return None
        n = float(raw)
        return Prediction(dict.fromkeys(QUANTILES, n)).capped(x.max_tokens)


# -- the learned predictor's features ---------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")
_HEAD, _TAIL = 192, 64  # words of a long prompt that count: its start and its end (the ask)
_EDGE = 12  # the first and last words once more, in namespaces of their own (where the ask is)
# words (_WORD's tokens) that mark code, and the units of an asked count ("in 300 words")
_CODE_WORDS = frozenset(
    re.findall(r"\S+", "` { } ; = def import return function class const var print")
)
_UNIT_WORDS = "word sentence paragraph question example item step line point idea tip name bullet"
_UNIT_WORDS += " page character tweet title option way reason"
_UNITS = frozenset(unit + plural for unit in _UNIT_WORDS.split() for plural in ("", "s"))
_LONG_ANSWER_LOG_CHARS = math.log1p(2000)  # an answer past 2000 characters is a long one

NUMERIC_NAMES = (
    "log_words",  # of the prompt (its prompt_len tokens when it has no text)
    "log_turns_before",
    "log_last_answer_tokens",
    "no_last_answer",
    "log_chars",
    "log_lines",
    "log_question_marks",
    "log_code_marks",  # of the words, those in _CODE_WORDS
    "non_ascii_share",  # the language, roughly: UTF-8 bytes past the first per character
    "log_asked_count",  # "in 300 words", "10 questions": the largest such number
    "asks_a_count",
    "ends_with_question_mark",
    "mean_log_answer_chars",  # the earlier assistant turns (prev_answers) from here on
    "max_log_answer_chars",
    "log_answers",
    "log_last_answer_chars",
    "log_last_answer_fences",
    "log_last_answer_lines",
    "long_answer_share",
)


def _words(text: str) -> list[str]:
    """The prompt's lowercased words and punctuation; a long prompt's first _HEAD and last
    _TAIL only (bounds the time per prediction; a pasted document's middle says little)."""
    if len(text) > 8 * (_HEAD + _TAIL):
        text = text[: 8 * _HEAD] + " " + text[-8 * _TAIL :]
    words = _WORD.findall(text.lower())
    return words if len(words) <= _HEAD + _TAIL else words[:_HEAD] + words[-_TAIL:]


class Features(NamedTuple):
    """A request as the learned predictor reads it."""

    keys: np.ndarray  # (n,) uint32: each distinct word, word bigram, first / last word (hashed)
    weights: np.ndarray  # (n,) float32: log(1 + count), L2-normalised
    numeric: np.ndarray  # (len(NUMERIC_NAMES),) float32


_MIX = np.uint64(0x9E3779B1)  # bigram key = crc(a) * _MIX + crc(b), and the namespaces' salt
_MASK = np.uint64(0xFFFFFFFF)


def gram_keys(words: list[str]) -> np.ndarray:
    """uint32 keys of the words, their bigrams, and (namespaced) the first and last _EDGE
    words: crc32 of each distinct word, mixed in numpy (deterministic: no vocabulary needed to
    hash; the model's vocabulary is the keys it has weights for)."""
    crc = {w: zlib.crc32(w.encode()) for w in set(words)}
    h = np.array([crc[w] for w in words], dtype=np.uint64)
    return np.concatenate(
        [
            h,
            (h[:-1] * _MIX + h[1:]) & _MASK,
            (h[:_EDGE] * _MIX + np.uint64(1)) & _MASK,
            (h[-_EDGE:] * _MIX + np.uint64(2)) & _MASK,
        ]
    ).astype(np.uint32)


def request_features(x: PredictInput) -> Features:
    """The request's hashed n-grams (``gram_keys``, log-count weights) and NUMERIC_NAMES."""
    words = _words(x.text or "")
    keys, counts = np.unique(gram_keys(words), return_counts=True)
    weights = np.log1p(counts.astype(np.float32))
    weights /= float(np.sqrt((weights * weights).sum())) or 1.0
    numeric = np.asarray(_prompt_numeric(x, words) + _history_numeric(x), dtype=np.float32)
    return Features(keys, weights, numeric)


def _prompt_numeric(x: PredictInput, words: list[str]) -> list[float]:
    """NUMERIC_NAMES of the prompt; a long one's counts are read off its first 8000 and last
    2000 characters, scaled to its length (bounded time)."""
    text = x.text or ""
    part = text if len(text) <= 10_000 else text[:8000] + text[-2000:]
    scale = len(text) / max(len(part), 1)
    head = part[:2000]
    asked = _asked_count(words)
    last = x.last_answer_len
    return [
        math.log1p(len(words) if text else x.prompt_len),
        math.log1p(max(x.turns - 1, 0)),
        math.log1p(last) if last is not None else 0.0,
        1.0 if last is None else 0.0,
        math.log1p(len(text)),
        math.log1p(part.count("\n") * scale),
        math.log1p(part.count("?") * scale),
        math.log1p(sum(w in _CODE_WORDS for w in words)),
        (len(head.encode("utf-8", "ignore")) - len(head)) / max(len(head), 1),
        math.log1p(asked),
        1.0 if asked else 0.0,
        1.0 if part[-100:].rstrip().endswith("?") else 0.0,
    ]


def _asked_count(words: list[str]) -> int:
    """The largest N of "N words", "N-step", "10 questions" ... in the words (0: none)."""
    best = 0
    for i in [i for i, w in enumerate(words) if w.isdigit() and len(w) <= 5]:
        after = words[i + 1 : i + 3]
        if after[:1] == ["-"]:
            after = after[1:]
        if after and after[0] in _UNITS:
            best = max(best, int(words[i]))
    return best


def _history_numeric(x: PredictInput) -> list[float]:
    answers = x.prev_answers
    if not answers:
        return [0.0] * 7
    chars = [math.log1p(len(a)) for a in answers]
    last = answers[-1]
    return [
        sum(chars) / len(chars),
        max(chars),
        math.log1p(len(answers)),
        chars[-1],
        math.log1p(last.count("```")),
        math.log1p(last.count("\n")),
        sum(c > _LONG_ANSWER_LOG_CHARS for c in chars) / len(chars),
    ]


# -- the learned predictor ------------------------------------------------------------------------


@dataclass(frozen=True)
class MLPWeights:
    """The trained part: K members (an ensemble) over one vocabulary of n-gram keys. Member k
    pools its D-wide embeddings of the request's known keys (by their weights), appends the
    standardised numeric features and applies one ReLU layer of H units. The embeddings stay
    int8 in memory (a row per cache line: the gather of a few hundred cold rows is most of a
    prediction's time)::

        keys ──searchsorted(vocab)──► rows ──(weights * scale[rows]) @ codes[rows]──► (K, D) ┐
        numeric ──(x - mean) / scale─────────────────────────────────────────────► (K, N) ┤
        (K, D+N) ◄────────────────────────────────────────────────────────────────────────┘
            ──@ w1 (K, D+N, H) + b1, ReLU──► hidden (K*H,) ──Head──► log(1 + tokens)
    """

    vocab: np.ndarray  # (V,) uint32, sorted
    codes: np.ndarray  # (V, K*D) int8 embeddings: member k's are columns k*D .. k*D+D-1
    scale: np.ndarray  # (V,) float32: embedding row = codes[row] * scale[row] (quantize_rows)
    num_mean: np.ndarray  # (N,) float32
    num_scale: np.ndarray  # (N,) float32
    w1: np.ndarray  # (K, D+N, H) float32
    b1: np.ndarray  # (K, H) float32
    w2: np.ndarray  # (K, H) float32: the trained output layer (the online head's prior)
    b2: np.ndarray  # (K,) float32

    def __post_init__(self) -> None:
        k, d_n, h = self.w1.shape
        v, kd = self.codes.shape
        n = len(self.num_mean)
        if kd % k or kd // k + n != d_n or {len(self.vocab), len(self.scale)} != {v}:
            raise ValueError(
                f"inconsistent weights: vocab {len(self.vocab)}, embeddings {self.codes.shape}"
                f", {n} numeric, w1 {self.w1.shape}, w2 {self.w2.shape}"
            )

    @property
    def members(self) -> int:
        return self.w1.shape[0]

    def hidden(self, f: Features) -> np.ndarray:
        """The members' hidden units, concatenated: (K*H,) float32."""
        pos = np.searchsorted(self.vocab, f.keys)
        pos[pos == len(self.vocab)] = 0
        known = self.vocab[pos] == f.keys
        rows = pos[known]
        pooled = (f.weights[known] * self.scale[rows]) @ self.codes[rows]
        k = self.members
        z = (f.numeric - self.num_mean) / self.num_scale
        inputs = np.concatenate([pooled.reshape(k, -1), np.broadcast_to(z, (k, len(z)))], axis=1)
        return np.maximum(np.matmul(inputs[:, None, :], self.w1)[:, 0] + self.b1, 0.0).ravel()

    def head(self, residual_quantiles: dict[float, float]) -> Head:
        """The trained output layer as one linear head over ``hidden``: the members' mean."""
        k = self.members
        return Head(
            (self.w2 / k).ravel().astype(np.float64), float(self.b2.mean()), residual_quantiles
        )


@dataclass(frozen=True)
class Head:
    """``log(1 + tokens) = hidden @ w + b``; quantile q adds ``residual_quantiles[q]``."""

    w: np.ndarray
    b: float
    residual_quantiles: dict[float, float]

    def predict(self, hidden: np.ndarray, max_tokens: int | None) -> Prediction:
        mu = float(hidden @ self.w) + self.b
        return Prediction(
            {q: max(1.0, math.expm1(min(mu + r, 20.0))) for q, r in self.residual_quantiles.items()}
        ).capped(max_tokens)


def refit_head(hidden: np.ndarray, y: np.ndarray, prior: Head, strength: float) -> Head:
    """The head that minimises ``||hidden @ w + b - y||^2 + strength * ||w - prior.w||^2`` (the
    bias is free: a served model that is merely longer or shorter moves it at once), and its
    residual quantiles: quantiles of leave-one-out residuals (on at most _LOO_ROWS rows),
    shrunk toward the prior's with the weight of _PRIOR_RESIDUALS observations (a 0.99 of a
    few hundred is noisy). One (K*H+1)-square solve: ~10 ms for a window of 4096 at K*H 192."""
    n, m = hidden.shape
    z = np.empty((n, m + 1))
    z[:, :m] = hidden
    z[:, m] = 1.0
    penalty = np.full(m + 1, float(strength))
    penalty[m] = 1e-6  # (the bias: free)
    a_inv = np.linalg.inv(z.T @ z + np.diag(penalty))
    w = a_inv @ (z.T @ y + penalty * np.append(prior.w, prior.b))
    sample = z[:: max(1, n // _LOO_ROWS)]
    leverage = np.einsum("ij,ij->i", sample @ a_inv, sample)
    loo = (y[:: max(1, n // _LOO_ROWS)] - sample @ w) / np.maximum(1.0 - leverage, 1e-3)
    share = n / (n + _PRIOR_RESIDUALS)
    quantiles = sorted(
        share * float(np.quantile(loo, q)) + (1 - share) * prior.residual_quantiles[q]
        for q in QUANTILES
    )
    return Head(w[:m], float(w[m]), dict(zip(QUANTILES, quantiles, strict=True)))


_LOO_ROWS = 1024
_PRIOR_RESIDUALS = 256


class OnlineHead:
    """The learned predictor's output layer, adapted online to the served model's lengths.

    Finished requests come in through ``observe`` (their hidden units and true length) into a
    ring of the last ``window``; every ``refit_every`` of them ``refit_due()`` turns true and
    ``maybe_refit()`` refits the head on the ring (``refit_head``, toward the trained head as
    its prior, never toward an earlier refit) and swaps it in with one assignment: ``head`` is
    read once per prediction, so a prediction uses the old head or the new, never a mix.
    ``observe`` is O(1) under a lock; ``maybe_refit`` takes ~10-50 ms (numpy, which releases
    the GIL in its BLAS calls) in whatever thread calls it, and refits never overlap."""

    def __init__(
        self,
        prior: Head,
        *,
        refit_every: int = 256,
        window: int = 4096,
        strength: float = 300.0,
        tau_window: int = 500,
    ) -> None:
        self.prior = prior
        self.head = prior
        self.refit_every = refit_every
        self.strength = strength
        self._hidden = np.zeros((window, len(prior.w)), dtype=np.float32)
        self._y = np.zeros(window)
        self._filled = self._next = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=tau_window)
        self._lock = threading.Lock()
        self._refit_lock = threading.Lock()
        self._observations = self._refits = self._since_refit = 0
        self._last_refit_ms = 0.0

    def observe(self, hidden: np.ndarray, actual: int, predicted: float) -> None:
        with self._lock:
            self._hidden[self._next] = hidden
            self._y[self._next] = math.log1p(actual)
            self._next = (self._next + 1) % len(self._y)
            self._filled = min(self._filled + 1, len(self._y))
            self._recent.append((predicted, actual))
            self._observations += 1
            self._since_refit += 1

    def refit_due(self) -> bool:
        return self._since_refit >= self.refit_every

    def maybe_refit(self) -> bool:
        """Refit if due (and no other refit is running); whether it did."""
        if not self._refit_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if not self.refit_due():
                    return False
                self._since_refit = 0
                hidden, y = self._hidden[: self._filled].copy(), self._y[: self._filled].copy()
            start = time.perf_counter()
            self.head = refit_head(hidden, y, self.prior, self.strength)  # the swap
            self._last_refit_ms = 1e3 * (time.perf_counter() - start)
            self._refits += 1
            return True
        finally:
            self._refit_lock.release()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: observations, refits, the window's fill, the last refit's
        time, and over the last ``tau_window`` observed requests the Kendall tau and MAE of the
        prediction made at observation (by the head of that time) against the true length."""
        with self._lock:
            recent = list(self._recent)
            out: dict[str, Any] = {
                "observations": self._observations,
                "refits": self._refits,
                "since_refit": self._since_refit,
                "window": self._filled,
                "last_refit_ms": round(self._last_refit_ms, 3),
            }
        pred = np.array([p for p, _ in recent])
        actual = np.array([a for _, a in recent], dtype=np.float64)
        out["rolling_n"] = len(recent)
        out["rolling_kendall_tau"] = (
            round(kendall_tau(pred, actual), 4) if len(recent) > 1 else None
        )
        out["rolling_mae_tokens"] = (
            round(float(np.abs(pred - actual).mean()), 2) if recent else None
        )
        return out


class NgramMLP(LengthPredictor):
    """The learned predictor: ``MLPWeights`` (trained offline, benchmarks/train_predictor.py)
    and an ``OnlineHead`` over them. predict costs one feature pass (~0.2 ms; long prompts are
    cut to their first and last words); observe reuses it (the hidden units of the last
    ``MEMO`` inputs predicted, by identity) or makes it again, on the caller's thread.

    The online contract (the router's): call ``observe(x, actual)`` for every request that
    finished (``x`` as it was predicted; ``actual`` its output tokens), then, when
    ``refit_due()``, run ``maybe_refit()`` off the event loop (a thread: it is numpy). ``stats()``
    gives the counters. The adapted head lives in memory only: ``save`` writes the trained one."""

    name = "learned"
    KIND = "ngram_mlp"
    MEMO = 4096  # inputs whose hidden units wait for their observe (requests running)

    def __init__(
        self,
        weights: MLPWeights,
        residual_quantiles: dict[float, float],
        meta: dict[str, Any] | None = None,
        **online: Any,
    ) -> None:
        self.weights = weights
        self.meta = meta or {}
        prior = weights.head({float(q): float(v) for q, v in residual_quantiles.items()})
        self.online = OnlineHead(prior, **online)
        self._memo: OrderedDict[int, tuple[PredictInput, np.ndarray]] = OrderedDict()
        self._memo_lock = threading.Lock()

    def _hidden(self, x: PredictInput, keep: bool) -> np.ndarray:
        """``x``'s hidden units: predicted once, they wait in the memo (by identity: ``x``
        itself is kept beside them) until its observe takes them."""
        with self._memo_lock:
            entry = self._memo.pop(id(x), None)
        if entry is not None and entry[0] is x:
            hidden = entry[1]
        else:
            hidden = self.weights.hidden(request_features(x))
        if keep:
            with self._memo_lock:
                self._memo[id(x)] = (x, hidden)
                while len(self._memo) > self.MEMO:
                    self._memo.popitem(last=False)
        return hidden

    def fresh(self, **online: Any) -> NgramMLP:
        """The same trained weights with a new online state (settings ``online``)."""
        return NgramMLP(self.weights, self.online.prior.residual_quantiles, self.meta, **online)

    def predict(self, x: PredictInput) -> Prediction | None:
        return self.online.head.predict(self._hidden(x, keep=True), x.max_tokens)

    def observe(self, x: PredictInput, actual: int) -> None:
        if actual < 0:
            with self._memo_lock:
                self._memo.pop(id(x), None)
            return
        hidden = self._hidden(x, keep=False)
        self.online.observe(hidden, actual, self.online.head.predict(hidden, x.max_tokens).median)

    def refit_due(self) -> bool:
        return self.online.refit_due()

    def maybe_refit(self) -> bool:
        return self.online.maybe_refit()

    def stats(self) -> dict[str, Any]:
        return self.online.stats()

    # -- the artifact --------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """``path``.npz (int8 embeddings with a float16 scale per row, float32 the rest) and
        ``path``.json (settings, trained residual quantiles, ``meta``)."""
        path, w = Path(path), self.weights
        np.savez_compressed(
            path.with_suffix(".npz"),
            vocab=w.vocab,
            codes=w.codes,
            scale=w.scale.astype(np.float16),
            **{k: getattr(w, k) for k in ("num_mean", "num_scale", "w1", "b1", "w2", "b2")},
        )
        meta = {
            "kind": self.KIND,
            "members": w.members,
            "embedding_dims": w.codes.shape[1] // w.members,
            "hidden": w.w1.shape[2],
            "vocab": len(w.vocab),
            "numeric": list(NUMERIC_NAMES),
            "residual_quantiles": {
                str(q): v for q, v in self.online.prior.residual_quantiles.items()
            },
            **self.meta,
        }
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path, **online: Any) -> NgramMLP:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.get("kind") != cls.KIND:
            raise ValueError(
                f"{path}.json is a {meta.get('kind')!r} artifact, not {cls.KIND!r}: retrain it "
                "with benchmarks/train_predictor.py"
            )
        if meta.get("numeric") != list(NUMERIC_NAMES):
            raise ValueError(f"{path}.json was trained on other numeric features: retrain it")
        with np.load(path.with_suffix(".npz")) as data:
            arrays = {k: data[k] for k in data.files}
        weights = MLPWeights(
            vocab=arrays.pop("vocab"),
            codes=arrays.pop("codes"),
            **{k: v.astype(np.float32) for k, v in arrays.items()},
        )
        quantiles = {float(q): v for q, v in meta["residual_quantiles"].items()}
        return cls(weights, quantiles, meta, **online)


def quantize_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes and a scale per row (symmetric: ``row ~ codes * scale``); the scale is
    float16-exact (the artifact stores it as float16), returned as float32."""
    scale = (np.abs(matrix).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)[:, None]
    codes = np.clip(np.rint(matrix / safe), -127, 127).astype(np.int8)
    return codes, scale


# -- evaluation ------------------------------------------------------------------------------------


def kendall_tau(a: Sequence[float], b: Sequence[float], *, sample: int = 200_000, seed: int = 0):
    """Kendall's tau-b of two sequences, estimated on ``sample`` random pairs (exact for small
    inputs): what Learning-to-Rank reports."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = len(a)
    rng = np.random.default_rng(seed)
    if n * (n - 1) // 2 <= sample:
        i, j = np.triu_indices(n, 1)
    else:
        i, j = rng.integers(0, n, sample), rng.integers(0, n, sample)
        keep = i != j
        i, j = i[keep], j[keep]
    da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    concordant = float((da * db).sum())
    ties_a, ties_b = float((da != 0).sum()), float((db != 0).sum())
    return concordant / math.sqrt(ties_a * ties_b) if ties_a and ties_b else 0.0


def evaluate(model: LengthPredictor, rows: Sequence[PredictInput], lengths: Sequence[int]) -> dict:
    """Held-out tau, MAE of the median, and each quantile's coverage (calibration)."""
    preds = [model.predict(x) for x in rows]
    med = [p.median for p in preds]
    y = np.asarray(lengths, dtype=np.float64)
    return {
        "n": len(rows),
        "kendall_tau": round(kendall_tau(med, y), 4),
        "mae_tokens": round(float(np.abs(np.asarray(med) - y).mean()), 2),
        "mae_constant_median": round(float(np.abs(np.median(y) - y).mean()), 2),
        "coverage": {
            str(q): round(
                float(np.mean([yi <= p.quantiles[q] for yi, p in zip(y, preds, strict=True)])), 4
            )
            for q in QUANTILES
        },
    }


def evaluate_adaptation(
    model: NgramMLP,
    adapt: tuple[Sequence[PredictInput], Sequence[int]],
    held_out: tuple[Sequence[PredictInput], Sequence[int]],
    **online: Any,
) -> dict:
    """Online adaptation toward another model's lengths: ``evaluate`` on ``held_out`` (rows,
    their lengths under the served model) before and after a fresh copy of ``model`` (settings
    ``online``; ``model`` itself is untouched) observed ``adapt``'s requests in order, refitting
    whenever due as the router does. The rows of the two must not overlap."""
    fresh = model.fresh(**online)
    before = evaluate(fresh, *held_out)
    for x, n in zip(*adapt, strict=True):
        fresh.observe(x, n)
        if fresh.refit_due():
            fresh.maybe_refit()
    return {
        "adapted_on": len(adapt[0]),
        "before": before,
        "after": evaluate(fresh, *held_out),
        "online": fresh.stats(),
    }


def _learned() -> LengthPredictor:
    return NgramMLP.load(DEFAULT_ARTIFACT)


PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {
    "none": NoPredictor,
    "oracle": OraclePredictor,
    "learned": _learned,  # router/data/length_smollm2 (benchmarks/train_predictor.py)
}


def make_predictor(spec: str) -> LengthPredictor:
    """A registered name (``none``, ``oracle``, ``learned``) or the path of an ``NgramMLP``
    artifact (its .json and .npz side by side, the suffix left off)."""
    if spec in PREDICTORS:
        return PREDICTORS[spec]()
    path = Path(spec)
    if path.with_suffix(".json").exists():
        return NgramMLP.load(path)
    raise ValueError(
        f"predictor must be one of {sorted(PREDICTORS)} or an artifact path, got {spec!r}"
    )


def _spans(points: list[tuple[float, float]], value: float, axis: int):
    """The segment of ``points`` (sorted on both axes) whose ``axis`` range holds ``value``."""
    for a, b in zip(points, points[1:], strict=False):
        if a[axis] <= value <= b[axis]:
            yield a, b
            return


def _lerp(value: float, a: tuple[float, float], b: tuple[float, float]) -> float:
    """Linear interpolation from a[0]..b[0] onto a[1]..b[1] at ``value``."""
    return a[1] if b[0] == a[0] else a[1] + (b[1] - a[1]) * (value - a[0]) / (b[0] - a[0])
