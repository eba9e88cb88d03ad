"""Output-length prediction at the router: how many tokens a request's answer will have.

A predictor sees the request alone (its prompt text or token ids, the chat's turn structure,
``max_tokens``) and returns a distribution, not a point: a median and upper quantiles, since
schedulers need the tail. Predictors are pluggable (``PREDICTORS``, ``make_predictor``)::

    none      no prediction (the policies fall back to max_tokens / FCFS)
    oracle    the true length from the request's ``x-tandem-oracle-tokens`` header (benchmarks
              that know it: the ceiling any predictor can reach)
    learned   hashed word uni- and bigrams plus length and turn features, a ridge regression on
              log(1 + length), quantiles from its held-out residuals (``HashedRidge``)

Every prediction is capped by the request's ``max_tokens`` (and never below 1).
"""

from __future__ import annotations

import abc
import json
import math
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)
ORACLE_HEADER = "x-tandem-oracle-tokens"


@dataclass(frozen=True)
class PredictInput:
    """What the router knows of a request when it predicts."""

    text: str | None = None  # the rendered prompt (chat: the last user turn is what counts most)
    prompt_len: int = 0  # prompt tokens
    turns: int = 1  # user turns so far (a chat's structure)
    last_answer_len: int | None = None  # tokens of the previous assistant turn, when known
    max_tokens: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    """Output tokens: ``quantiles[q]`` for q in QUANTILES (non-decreasing in q)."""

    quantiles: dict[float, float]

    @property
    def median(self) -> float:
        return self.quantiles[0.5]

    def capped(self, max_tokens: int | None) -> Prediction:
        if max_tokens is None:
            return self
        return Prediction(
            {q: min(max(v, 1.0), float(max_tokens)) for q, v in self.quantiles.items()}
        )


class LengthPredictor(abc.ABC):
    name = "abstract"

    @abc.abstractmethod
    def predict(self, x: PredictInput) -> Prediction | None:
        """The request's output-length distribution, or None when this predictor has none."""

    def observe(self, x: PredictInput, actual: int) -> None:  # noqa: B027 - optional hook
        """A finished request's true length (online adaptation; default: ignored)."""


class NoPredictor(LengthPredictor):
    name = "none"

    def predict(self, x: PredictInput) -> Prediction | None:
        return None


class OraclePredictor(LengthPredictor):
    """The true length, from a header the benchmark client sets (never from a real client)."""

    name = "oracle"

    def predict(self, x: PredictInput) -> Prediction | None:
        raw = x.headers.get(ORACLE_HEADER)
        if raw is None or not raw.isdigit():
            return None
        n = float(raw)
        return Prediction(dict.fromkeys(QUANTILES, n)).capped(x.max_tokens)


# -- the learned predictor -------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


_HEAD, _TAIL = 192, 64  # words of a long prompt that count: its start and its end (the ask)


def _words(text: str) -> list[str]:
    """The prompt's lowercased words and punctuation; a long prompt's first _HEAD and last
    _TAIL only (bounds the time per prediction; a pasted document's middle says little)."""
    if len(text) > 8 * (_HEAD + _TAIL):
        text = text[: 8 * _HEAD] + " " + text[-8 * _TAIL :]
    words = _WORD.findall(text.lower())
    return words if len(words) <= _HEAD + _TAIL else words[:_HEAD] + words[-_TAIL:]


def _bucket(token: str, dims: int) -> int:
    return zlib.crc32(token.encode()) % dims


class HashedFeatures:
    """A request as a sparse vector: hashed word unigrams and bigrams (count-damped) of its
    first and last words, plus dense numeric features (log prompt length, turns, log previous
    answer length). Deterministic (crc32), no vocabulary to ship."""

    NUMERIC = 5

    def __init__(self, dims: int = 1 << 12) -> None:
        self.dims = dims

    @property
    def width(self) -> int:
        return self.dims + self.NUMERIC

    def sparse(self, x: PredictInput) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) of the nonzero features."""
        words = _words(x.text or "")
        counts: dict[int, float] = {}
        for w in words:
            counts[_bucket(w, self.dims)] = counts.get(_bucket(w, self.dims), 0.0) + 1.0
        for a, b in zip(words, words[1:], strict=False):
            k = _bucket(a + " " + b, self.dims)
            counts[k] = counts.get(k, 0.0) + 1.0
        idx = np.fromiter(counts, dtype=np.int64, count=len(counts))
        val = np.log1p(np.fromiter(counts.values(), dtype=np.float64, count=len(counts)))
        norm = math.sqrt(float((val * val).sum())) or 1.0
        prev = x.last_answer_len
        numeric = [
            1.0,  # bias
            math.log1p(x.prompt_len or len(words)),
            math.log1p(max(x.turns - 1, 0)),
            math.log1p(prev) if prev is not None else 0.0,
            1.0 if prev is None else 0.0,
        ]
        idx = np.concatenate([idx, np.arange(self.dims, self.width)])
        val = np.concatenate([val / norm, np.asarray(numeric)])
        return idx, val

    def dense(self, rows: Sequence[PredictInput]) -> np.ndarray:
        out = np.zeros((len(rows), self.width), dtype=np.float64)
        for i, x in enumerate(rows):
            idx, val = self.sparse(x)
            np.add.at(out[i], idx, val)
        return out


class HashedRidge(LengthPredictor):
    """Ridge regression on log(1 + output tokens) over ``HashedFeatures``; the quantiles add
    the held-out residuals' quantiles to the predicted log length."""

    name = "learned"

    def __init__(
        self,
        weights: np.ndarray,
        residual_quantiles: dict[float, float],
        features: HashedFeatures | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.features = features or HashedFeatures(len(weights) - HashedFeatures.NUMERIC)
        if len(weights) != self.features.width:
            raise ValueError(f"{len(weights)} weights for {self.features.width} features")
        self.weights = np.asarray(weights, dtype=np.float64)
        self.residual_quantiles = {float(q): float(v) for q, v in residual_quantiles.items()}
        self.meta = meta or {}

    @classmethod
    def fit(
        cls,
        rows: Sequence[PredictInput],
        lengths: Sequence[int],
        *,
        alpha: float = 1.0,
        holdout: tuple[Sequence[PredictInput], Sequence[int]] | None = None,
        features: HashedFeatures | None = None,
        chunk: int = 2048,
    ) -> HashedRidge:
        """Closed-form ridge (X'X + alpha I) w = X'y, accumulated in dense chunks; residual
        quantiles from ``holdout`` (the training rows when None)."""
        feats = features or HashedFeatures()
        y = np.log1p(np.asarray(lengths, dtype=np.float64))
        xtx = np.zeros((feats.width, feats.width))
        xty = np.zeros(feats.width)
        for start in range(0, len(rows), chunk):
            block = feats.dense(rows[start : start + chunk])
            xtx += block.T @ block
            xty += block.T @ y[start : start + chunk]
        xtx[np.diag_indices_from(xtx)] += alpha
        model = cls(np.linalg.solve(xtx, xty), {}, feats)
        eval_rows, eval_y = holdout if holdout is not None else (rows, lengths)
        resid = np.log1p(np.asarray(eval_y, dtype=np.float64)) - model._mu(eval_rows)
        model.residual_quantiles = {q: float(np.quantile(resid, q)) for q in QUANTILES}
        return model

    def _mu(self, rows: Sequence[PredictInput]) -> np.ndarray:
        return np.array([self._mu_one(x) for x in rows])

    def _mu_one(self, x: PredictInput) -> float:
        idx, val = self.features.sparse(x)
        return float(self.weights[idx] @ val)

    def predict(self, x: PredictInput) -> Prediction | None:
        mu = self._mu_one(x)
        qs = {q: math.expm1(mu + r) for q, r in self.residual_quantiles.items()}
        return Prediction(qs).capped(x.max_tokens)

    # -- the artifact --------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        path = Path(path)
        np.savez_compressed(path.with_suffix(".npz"), weights=self.weights.astype(np.float32))
        meta = {
            "kind": self.name,
            "dims": self.features.dims,
            "residual_quantiles": {str(q): v for q, v in self.residual_quantiles.items()},
            **self.meta,
        }
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> HashedRidge:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.get("kind") != cls.name:
            raise ValueError(f"{path} is not a {cls.name} predictor artifact")
        with np.load(path.with_suffix(".npz")) as data:
            weights = data["weights"].astype(np.float64)
        quantiles = {float(q): v for q, v in meta["residual_quantiles"].items()}
        return cls(weights, quantiles, HashedFeatures(int(meta["dims"])), meta)


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


PREDICTORS: dict[str, Callable[..., LengthPredictor]] = {
    "none": NoPredictor,
    "oracle": OraclePredictor,
}


def make_predictor(spec: str) -> LengthPredictor:
    """A registered name (``none``, ``oracle``) or the path of a ``learned`` artifact (its .json
    and .npz side by side)."""
    if spec in PREDICTORS:
        return PREDICTORS[spec]()
    path = Path(spec)
    if path.with_suffix(".json").exists():
        return HashedRidge.load(path)
    raise ValueError(
        f"predictor must be one of {sorted(PREDICTORS)} or an artifact path, got {spec!r}"
    )
