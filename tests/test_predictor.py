"""The router's output-length predictors (router/predictor.py): the registry, the oracle, the
learned n-gram MLP (fit, quantiles, artifact round trip, the shipped artifact), its online
adaptation (toward a shifted length rule, while predictions go on in another thread) and the
tau estimate, on synthetic data whose lengths the words decide."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.train_predictor import TrainConfig, fit
from router.predictor import (
    DEFAULT_ARTIFACT,
    ORACLE_HEADER,
    QUANTILES,
    NgramMLP,
    PredictInput,
    evaluate,
    evaluate_adaptation,
    gram_keys,
    kendall_tau,
    make_predictor,
    request_features,
)

KINDS = [("write a long essay about", 400), ("summarize briefly", 60), ("answer yes or no:", 4)]


def synthetic(
    n: int, seed: int, base: dict[str, int] | None = None
) -> tuple[list[PredictInput], list[int]]:
    """Prompts asking for an essay are long, for a yes/no short (or ``base``'s lengths for
    each ask); noise on top."""
    rng = random.Random(seed)
    rows, lengths = [], []
    for _ in range(n):
        ask, length = rng.choice(KINDS)
        topic = " ".join(
            rng.choice(["rivers", "tax law", "owls", "bread", "python"]) for _ in range(3)
        )
        rows.append(PredictInput(text=f"{ask} {topic}", prompt_len=8))
        length = (base or {}).get(ask, length)
        lengths.append(max(1, int(length * rng.lognormvariate(0, 0.3))))
    return rows, lengths


SMALL = TrainConfig(members=2, dims=8, hidden=16, min_count=2, epochs=12, batch=64)


@pytest.fixture(scope="module")
def model() -> NgramMLP:
    rows, lengths = synthetic(1500, 1)
    return fit(rows, lengths, calib=synthetic(500, 2), cfg=SMALL)


def test_registry_none_and_oracle():
    assert make_predictor("none").predict(PredictInput(text="hi")) is None
    oracle = make_predictor("oracle")
    assert oracle.predict(PredictInput(text="hi")) is None  # no header: no prediction
    p = oracle.predict(PredictInput(headers={ORACLE_HEADER: "300"}, max_tokens=200))
    assert p.median == 200 and p.quantiles[0.99] == 200  # capped by max_tokens
    with pytest.raises(ValueError, match="predictor must be"):
        make_predictor("no-such-predictor")


def test_features_are_deterministic_and_bounded():
    # crc32, not Python's per-process hash: the artifact's keys mean the same everywhere
    assert gram_keys(["hello"]).tolist()[0] == 907060870
    a = request_features(PredictInput(text="Write 300 words on owls?", last_answer_len=50))
    b = request_features(PredictInput(text="Write 300 words on owls?", last_answer_len=50))
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.numeric, b.numeric)
    assert np.all(np.diff(a.keys.astype(np.int64)) > 0)  # distinct, sorted
    assert abs(float(np.linalg.norm(a.weights)) - 1.0) < 1e-5
    huge = request_features(PredictInput(text="word " * 200_000))
    assert len(huge.keys) < 10 and np.isfinite(huge.numeric).all()  # one word repeated
    empty = request_features(PredictInput(text=None, prompt_len=30))
    assert len(empty.keys) == 0 and empty.numeric[0] == pytest.approx(np.log1p(30))


def test_learned_ranks_and_calibrates_on_synthetic_data(model, tmp_path):
    held_rows, held_lengths = synthetic(1000, 3)
    report = evaluate(model, held_rows, held_lengths)
    assert report["kendall_tau"] > 0.6, report
    assert report["mae_tokens"] < report["mae_constant_median"], report
    for q, covered in report["coverage"].items():  # quantiles from other held-out rows
        assert abs(covered - float(q)) < 0.08, report
    p = model.predict(PredictInput(text="write a long essay about owls", prompt_len=8))
    assert p.quantiles[0.5] <= p.quantiles[0.9] <= p.quantiles[0.99]
    assert 200 < p.median < 800
    model.save(tmp_path / "m")
    again = make_predictor(str(tmp_path / "m"))
    q = again.predict(PredictInput(text="answer yes or no: owls", prompt_len=8, max_tokens=3))
    assert q.median <= 3  # max_tokens caps it
    x = PredictInput(text="summarize briefly rivers", prompt_len=8)
    assert again.predict(x).median == pytest.approx(model.predict(x).median, rel=1e-4)


def test_an_artifact_of_another_kind_is_refused(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"kind": "learned", "dims": 4096}))
    with pytest.raises(ValueError, match="retrain"):
        make_predictor(str(tmp_path / "old"))


def test_kendall_tau_matches_the_definition():
    a = [1, 2, 3, 4, 5]
    assert kendall_tau(a, a) == 1.0
    assert kendall_tau(a, a[::-1]) == -1.0
    rng = np.random.default_rng(0)
    x = rng.normal(size=3000)
    assert abs(kendall_tau(x, rng.normal(size=3000))) < 0.05  # sampled pairs: near 0


def test_the_shipped_artifact_loads_and_ranks():
    """router/data/length_smollm2 (benchmarks/train_predictor.py) is the registry's
    ``learned``: it carries its held-out evaluation, predicts ordered quantiles within
    max_tokens for any input, and ranks an essay request above a one-number answer."""
    model = make_predictor("learned")
    assert isinstance(model, NgramMLP)
    assert Path(DEFAULT_ARTIFACT).with_suffix(".npz").stat().st_size < 8 << 20
    evaluation = model.meta["evaluation"]
    assert evaluation["all_turns"]["kendall_tau"] > 0.45, evaluation["all_turns"]
    assert evaluation["all_turns"]["n"] > 10_000
    assert evaluation["first_turns"]["kendall_tau"] > 0.38, evaluation["first_turns"]
    for q in QUANTILES:  # held out: calibrated
        assert abs(evaluation["all_turns"]["coverage"][str(q)] - q) < 0.03, evaluation
    inputs = [
        PredictInput(text="Write a detailed essay on the history of Rome", max_tokens=2048),
        PredictInput(text="What is 2+2? Answer with a number.", max_tokens=16),
        PredictInput(text=None, prompt_len=100, max_tokens=64),
        PredictInput(text="", max_tokens=1),
        PredictInput(text="continue", turns=3, last_answer_len=700, prev_answers=("a " * 900,)),
        PredictInput(text="x" * 100_000 + " ?", max_tokens=512),
    ]
    for x in inputs:
        p = model.predict(x)
        assert 1 <= p.quantiles[0.5] <= p.quantiles[0.9] <= p.quantiles[0.99], (x.text, p)
        assert x.max_tokens is None or p.quantiles[0.99] <= x.max_tokens
    essay, short = (model.predict(x) for x in inputs[:2])
    assert essay.median > 4 * short.median


def test_online_adaptation_moves_toward_a_shifted_rule(model):
    """A served model that answers the essays in a few words and the yes/no questions at
    length: after observing its lengths (refitting as due), the predictor ranks and sizes
    them as it does."""
    shifted = {"write a long essay about": 4, "answer yes or no:": 400}
    adapt = synthetic(600, 4, shifted)
    held = synthetic(600, 5, shifted)
    report = evaluate_adaptation(model, adapt, held, refit_every=128)
    before, after = report["before"], report["after"]
    assert before["kendall_tau"] < 0, before  # the trained rule ranks these backwards
    assert after["kendall_tau"] > 0.5, report
    assert after["mae_tokens"] < 0.5 * before["mae_tokens"], report
    assert report["online"]["refits"] == 600 // 128 and report["online"]["observations"] == 600
    assert model.online.head is model.online.prior  # the model itself stays as trained
    for q, covered in after["coverage"].items():
        assert abs(covered - float(q)) < 0.1, after


def test_observe_counts_and_refit_only_when_due(model):
    adapting = model.fresh(refit_every=50, window=64, tau_window=40)
    rows, lengths = synthetic(120, 6)
    assert not adapting.refit_due() and not adapting.maybe_refit()
    for x, n in zip(rows[:49], lengths[:49], strict=True):
        adapting.observe(x, n)
    assert not adapting.refit_due()
    adapting.observe(rows[49], lengths[49])
    assert adapting.refit_due() and adapting.maybe_refit() and not adapting.refit_due()
    for x, n in zip(rows[50:], lengths[50:], strict=True):
        adapting.observe(x, n)
    stats = adapting.stats()
    assert stats["observations"] == 120 and stats["refits"] == 1 and stats["since_refit"] == 70
    assert stats["window"] == 64 and stats["rolling_n"] == 40  # bounded
    assert stats["rolling_kendall_tau"] > 0.5, stats  # the synthetic rule is the trained one


def test_observe_reuses_what_predict_computed(model, monkeypatch):
    """A request predicted at admission and observed at its end costs one feature pass: the
    hidden units wait in a bounded memo by identity. The online state is the one a fresh
    computation gives; an input predicted long ago (evicted) or never is computed again."""
    from router import predictor as mod

    rows, lengths = synthetic(40, 8)
    memo, plain = model.fresh(refit_every=16), model.fresh(refit_every=16)
    memo.MEMO = 8
    passes = [0]
    real = mod.request_features

    def counted(x):
        passes[0] += 1
        return real(x)

    monkeypatch.setattr(mod, "request_features", counted)
    for x in rows[:20]:  # the first 12 are evicted (MEMO 8) before their observe
        memo.predict(x)
    assert passes[0] == 20
    for x, n in zip(rows[:20], lengths[:20], strict=True):
        memo.observe(x, n)
    assert passes[0] == 20 + 12 and not memo._memo
    for x, n in zip(rows[:20], lengths[:20], strict=True):
        plain.observe(x, n)
    assert memo.maybe_refit() and plain.maybe_refit()
    assert np.array_equal(memo.online._hidden, plain.online._hidden)
    assert memo.predict(rows[30]).quantiles == plain.predict(rows[30]).quantiles
    memo.predict(rows[31])
    memo.observe(rows[31], -1)  # an unknown length: nothing learned, its memo entry gone
    assert id(rows[31]) not in memo._memo and memo.stats()["observations"] == 20


def test_predict_stays_usable_while_refits_run(model):
    """A thread predicts without pause while the main thread observes and starts refits in
    threads of their own: every prediction is a whole one (ordered quantiles), refits never
    overlap, and none blocks a prediction for long."""
    adapting = model.fresh(refit_every=32, window=256)
    rows, lengths = synthetic(400, 7, {"answer yes or no:": 200})
    stop, errors, worst = threading.Event(), [], [0.0]

    def predict_loop():
        x = PredictInput(text="answer yes or no: owls", prompt_len=8)
        while not stop.is_set():
            start = time.perf_counter()
            try:
                p = adapting.predict(x)
                assert p.quantiles[0.5] <= p.quantiles[0.9] <= p.quantiles[0.99]
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            worst[0] = max(worst[0], time.perf_counter() - start)

    predictor = threading.Thread(target=predict_loop)
    predictor.start()
    refits = []
    try:
        for x, n in zip(rows, lengths, strict=True):
            adapting.observe(x, n)
            if adapting.refit_due():
                refits.append(threading.Thread(target=adapting.maybe_refit))
                refits[-1].start()
        for t in refits:
            t.join()
    finally:
        stop.set()
        predictor.join()
    assert not errors, errors
    assert adapting.stats()["refits"] >= 5
    assert worst[0] < 0.5, worst  # generous (a loaded CI machine), but never a long block
    adapting.maybe_refit()  # (if the last one was due while another ran)
    adapted = adapting.predict(PredictInput(text="answer yes or no: rivers", prompt_len=8))
    assert adapted.median > 50  # the refits took: yes/no answers are long now
