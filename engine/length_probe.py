"""Output-length refinement in the engine: a probe on the served model's own hidden state.

The router guesses a request's output length from its text alone, before any model has seen
it. After prefill the engine knows more: the model's hidden state at the last prompt token
already leans towards the answer it is about to write (TRAIL probes such embeddings). A
``LengthProbe`` is a ridge regression on that state (one or more layers, standardized) plus the
log prompt length, predicting ``log(1 + output tokens)``; its quantiles add the held-out
residuals' quantiles to the predicted log length (the convention of the router's predictor:
p50 / p90 / p99, non-decreasing)::

    prefill's last chunk ──► hidden state at the last prompt token (ModelRunner capture)
                         ──► LengthProbe.predict ──► (p50, p90, p99) on the first token
                         ──► RequestOutput.predicted_tokens / the first Delta's ``predicted``

Labels come from the served model's own answers (benchmarks/gen_served_lengths.py), the
median of several sampled lengths per prompt: one sample's length is heavy-tailed noise around
what the prompt asks for (ProD). numpy only: a prediction is one dot product, microseconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)
KIND = "length_probe"
SHIPPED = Path(__file__).parent / "data"  # the probes that come with the package


def model_shape(vocab_size: int, hidden_size: int, num_layers: int) -> dict[str, int]:
    """What a probe's ``model_shape`` must equal for ``auto`` to pick it for a model."""
    return {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers}


def shipped_for(shape: Mapping[str, int]) -> Path | None:
    """The shipped probe (``SHIPPED/probe_*``, the path without suffix) trained on a model of
    this shape, or None: ``EngineConfig.length_probe = "auto"`` resolves through it."""
    for meta in sorted(SHIPPED.glob("probe_*.json")):
        if json.loads(meta.read_text()).get("model_shape") == dict(shape):
            return meta.with_suffix("")
    return None


class LengthProbe:
    """``mu = ((x - mean) / scale) @ weights + bias`` with ``x`` = the hidden states of
    ``layers`` (concatenated) and ``log(1 + prompt tokens)``; estimate ``q`` is
    ``expm1(mu + residual_quantiles[q])``. Layer ``i`` >= 0 is decoder layer i's output, -1 the
    state after the final norm (what feeds the LM head)."""

    def __init__(
        self,
        layers: Sequence[int],
        weights: np.ndarray,
        bias: float,
        mean: np.ndarray,
        scale: np.ndarray,
        residual_quantiles: Mapping[float, float],
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.layers = tuple(int(i) for i in layers)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.bias = float(bias)
        self.mean = np.asarray(mean, dtype=np.float64)
        self.scale = np.asarray(scale, dtype=np.float64)
        if not self.layers or not (len(self.weights) == len(self.mean) == len(self.scale)):
            raise ValueError(
                f"a probe needs layers and equal lengths of weights ({len(self.weights)}), "
                f"mean ({len(self.mean)}) and scale ({len(self.scale)})"
            )
        if (len(self.weights) - 1) % len(self.layers):
            raise ValueError(f"{len(self.weights)} weights do not split over layers {self.layers}")
        self.hidden_size = (len(self.weights) - 1) // len(self.layers)
        qs = sorted((float(q), float(v)) for q, v in residual_quantiles.items())
        if [q for q, _ in qs] != list(QUANTILES):
            raise ValueError(f"residual quantiles must be given for {QUANTILES}, got {qs}")
        # Quantiles are non-decreasing by construction (a residual quantile never falls).
        self.offsets = np.maximum.accumulate(np.array([v for _, v in qs]))
        self.meta = meta or {}

    # -- prediction ------------------------------------------------------------------------------

    def check(self, hidden_size: int, num_layers: int) -> None:
        """Raise ValueError unless this probe reads a model of this shape."""
        if hidden_size != self.hidden_size or any(not -1 <= i < num_layers for i in self.layers):
            raise ValueError(
                f"length probe for hidden size {self.hidden_size}, layers {self.layers}: the "
                f"model has hidden size {hidden_size} and {num_layers} layers; train a probe "
                "on this model (benchmarks/train_probe.py)"
            )

    def predict(
        self, hidden: Mapping[int, np.ndarray], prompt_len: int
    ) -> tuple[float, float, float]:
        """(p50, p90, p99) output tokens of one request from ``{layer: [hidden]}``."""
        x = np.concatenate([*(hidden[i] for i in self.layers), [math.log1p(prompt_len)]])
        mu = float(((x - self.mean) / self.scale) @ self.weights) + self.bias
        p50, p90, p99 = (max(math.expm1(mu + r), 1.0) for r in self.offsets)
        return (p50, p90, p99)

    def log_mean(self, hidden: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """Predicted log(1 + tokens) of a batch: ``hidden`` [N, len(layers), H] in layer order."""
        x = features(hidden, prompt_lens)
        return ((x - self.mean) / self.scale) @ self.weights + self.bias

    def quantiles(self, hidden: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """[N, 3] tokens at QUANTILES."""
        mu = self.log_mean(hidden, prompt_lens)
        return np.maximum(np.expm1(mu[:, None] + self.offsets[None, :]), 1.0)

    # -- training --------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        layers: Sequence[int],
        hidden: np.ndarray,
        prompt_lens: np.ndarray,
        lengths: np.ndarray,
        *,
        alpha: float = 1.0,
        holdout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> LengthProbe:
        """Closed-form ridge on standardized features, ``alpha`` per training row (so one
        value suits any data size); the residual quantiles come from ``holdout`` (hidden,
        prompt_lens, lengths), or from the training rows when None."""
        x = features(hidden, prompt_lens)
        y = np.log1p(np.asarray(lengths, dtype=np.float64))
        mean, scale = x.mean(0), x.std(0)
        scale[scale < 1e-8] = 1.0
        z, yc = (x - mean) / scale, y - y.mean()
        if len(z) < z.shape[1]:  # fewer rows than features: the dual form, w = Z'(ZZ' + aI)^-1 y
            gram = z @ z.T
            gram[np.diag_indices_from(gram)] += alpha * len(z)
            weights = z.T @ np.linalg.solve(gram, yc)
        else:
            gram = z.T @ z
            gram[np.diag_indices_from(gram)] += alpha * len(z)
            weights = np.linalg.solve(gram, z.T @ yc)
        probe = cls(layers, weights, y.mean(), mean, scale, dict.fromkeys(QUANTILES, 0.0))
        eval_h, eval_p, eval_y = holdout if holdout is not None else (hidden, prompt_lens, lengths)
        resid = np.log1p(np.asarray(eval_y, dtype=np.float64)) - probe.log_mean(eval_h, eval_p)
        probe.offsets = np.maximum.accumulate(np.quantile(resid, QUANTILES))
        return probe

    # -- the artifact ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """``PATH.npz`` (weights, mean, scale) and ``PATH.json`` (layers, quantiles, meta)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path.with_suffix(".npz"),
            weights=self.weights.astype(np.float32),
            mean=self.mean.astype(np.float32),
            scale=self.scale.astype(np.float32),
        )
        meta = {
            "kind": KIND,
            "layers": list(self.layers),
            "hidden_size": self.hidden_size,
            "bias": self.bias,
            "residual_quantiles": {
                str(q): float(v) for q, v in zip(QUANTILES, self.offsets, strict=True)
            },
            **self.meta,
        }
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LengthProbe:
        path = Path(path)
        if not path.with_suffix(".json").is_file() or not path.with_suffix(".npz").is_file():
            raise ValueError(f"length probe {path}: expected {path}.json and {path}.npz")
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.get("kind") != KIND:
            raise ValueError(f"{path}.json is not a length probe (kind {meta.get('kind')!r})")
        with np.load(path.with_suffix(".npz")) as data:
            arrays = {k: data[k].astype(np.float64) for k in ("weights", "mean", "scale")}
        quantiles = {float(q): v for q, v in meta.pop("residual_quantiles").items()}
        layers, bias = meta.pop("layers"), meta.pop("bias")
        meta.pop("kind"), meta.pop("hidden_size", None)
        return cls(
            layers, arrays["weights"], bias, arrays["mean"], arrays["scale"], quantiles, meta
        )


def features(hidden: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
    """[N, L * H + 1]: the layers' states side by side, then log(1 + prompt tokens)."""
    hidden = np.asarray(hidden, dtype=np.float64)
    logp = np.log1p(np.asarray(prompt_lens, dtype=np.float64))[:, None]
    return np.concatenate([hidden.reshape(len(hidden), -1), logp], axis=1)


# -- evaluation ------------------------------------------------------------------------------------


def kendall_tau(a: Sequence[float], b: Sequence[float], *, pairs: int = 2_000_000) -> float:
    """Kendall's tau-b, over every pair when there are at most ``pairs`` of them, else over
    that many random pairs (seeded)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = len(a)
    if n * (n - 1) // 2 <= pairs:
        i, j = np.triu_indices(n, 1)
    else:
        rng = np.random.default_rng(0)
        i, j = rng.integers(0, n, pairs), rng.integers(0, n, pairs)
        i, j = i[i != j], j[i != j]
    sa, sb = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    untied = math.sqrt(float(np.count_nonzero(sa)) * float(np.count_nonzero(sb)))
    return float((sa * sb).sum()) / untied if untied else 0.0


def evaluate(predicted: np.ndarray, actual: Sequence[float]) -> dict[str, Any]:
    """``predicted`` [N, 3] tokens at QUANTILES against true lengths: Kendall's tau of the
    median, its mean absolute error, and how often each quantile covers the truth."""
    predicted = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(actual, dtype=np.float64)
    return {
        "n": len(y),
        "kendall_tau": round(kendall_tau(predicted[:, 0], y), 4),
        "mae_tokens": round(float(np.abs(predicted[:, 0] - y).mean()), 2),
        "coverage": {
            str(q): round(float((y <= predicted[:, k]).mean()), 4) for k, q in enumerate(QUANTILES)
        },
    }
