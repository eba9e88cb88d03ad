"""The router's output-length predictors (router/predictor.py): the registry, the oracle, the
learned hashed ridge (fit, quantiles, artifact round trip) and the tau estimate, on synthetic
data whose lengths the words decide."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.predictor import (
    ORACLE_HEADER,
    HashedFeatures,
    HashedRidge,
    PredictInput,
    evaluate,
    kendall_tau,
    make_predictor,
)


def synthetic(n: int, seed: int) -> tuple[list[PredictInput], list[int]]:
    """Prompts asking for an essay are long, for a yes/no short; noise on top."""
    rng = random.Random(seed)
    kinds = [("write a long essay about", 400), ("summarize briefly", 60), ("answer yes or no:", 4)]
    rows, lengths = [], []
    for _ in range(n):
        ask, base = rng.choice(kinds)
        topic = " ".join(
            rng.choice(["rivers", "tax law", "owls", "bread", "python"]) for _ in range(3)
        )
        rows.append(PredictInput(text=f"{ask} {topic}", prompt_len=8))
        lengths.append(max(1, int(base * rng.lognormvariate(0, 0.3))))
    return rows, lengths


def test_registry_none_and_oracle():
    assert make_predictor("none").predict(PredictInput(text="hi")) is None
    oracle = make_predictor("oracle")
    assert oracle.predict(PredictInput(text="hi")) is None  # no header: no prediction
    p = oracle.predict(PredictInput(headers={ORACLE_HEADER: "300"}, max_tokens=200))
    assert p.median == 200 and p.quantiles[0.99] == 200  # capped by max_tokens
    with pytest.raises(ValueError, match="predictor must be"):
        make_predictor("no-such-predictor")


def test_learned_ranks_and_calibrates_on_synthetic_data(tmp_path):
    rows, lengths = synthetic(1500, 1)
    held_rows, held_lengths = synthetic(500, 2)
    model = HashedRidge.fit(
        rows, lengths, holdout=(held_rows, held_lengths), features=HashedFeatures(256)
    )
    report = evaluate(model, held_rows, held_lengths)
    assert report["kendall_tau"] > 0.6, report
    assert report["mae_tokens"] < report["mae_constant_median"], report
    for q, covered in report["coverage"].items():  # quantiles fit on this holdout: near nominal
        assert abs(covered - float(q)) < 0.05, report
    p = model.predict(PredictInput(text="write a long essay about owls", prompt_len=8))
    assert p.quantiles[0.5] <= p.quantiles[0.9] <= p.quantiles[0.99]
    assert 200 < p.median < 800
    model.save(tmp_path / "m")
    again = make_predictor(str(tmp_path / "m"))
    q = again.predict(PredictInput(text="answer yes or no: owls", prompt_len=8, max_tokens=3))
    assert q.median <= 3  # max_tokens caps it
    x = PredictInput(text="summarize briefly rivers", prompt_len=8)
    assert again.predict(x).median == pytest.approx(model.predict(x).median, rel=1e-3)


def test_kendall_tau_matches_the_definition():
    a = [1, 2, 3, 4, 5]
    assert kendall_tau(a, a) == 1.0
    assert kendall_tau(a, a[::-1]) == -1.0
    rng = np.random.default_rng(0)
    x = rng.normal(size=3000)
    assert abs(kendall_tau(x, rng.normal(size=3000))) < 0.05  # sampled pairs: near 0


def test_the_shipped_artifact_loads_and_ranks():
    """router/data/length_smollm2 (benchmarks/train_predictor.py): loads by path, carries its
    held-out evaluation, and ranks an essay request above a one-number answer."""
    from pathlib import Path

    import router

    path = Path(router.__file__).parent / "data" / "length_smollm2"
    model = make_predictor(str(path))
    evaluation = model.meta["evaluation"]["all_turns"]
    assert evaluation["kendall_tau"] > 0.35 and evaluation["n"] > 10_000, evaluation
    essay = model.predict(PredictInput(text="Write a detailed essay on the history of Rome"))
    short = model.predict(PredictInput(text="What is 2+2? Answer with a number."))
    assert essay.median > short.median
