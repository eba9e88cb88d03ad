"""Train the engine's length probe on the served model's own answers; compare it with the router.

    python benchmarks/train_probe.py            # benchmarks/data/served_lengths_smollm2.npz ->
                                                # engine/data/probe_smollm2.{npz,json},
                                                # benchmarks/results/probe_smollm2.json

Data: benchmarks/gen_served_lengths.py (per ShareGPT first turn: the hidden states at the last
prompt token, the greedy answer's length and several sampled answers' lengths). Split by
conversation exactly as the router's predictor was (a crc32 of the conversation index, 1 in 5
held out), so the router is scored on conversations it never saw.

Label (ProD): the median of the prompt's sampled lengths (the greedy one included); a probe
trained on the greedy length alone is reported too. Layers and the ridge strength are chosen by
5-fold cross-validation on the training side; the quantiles come from out-of-fold residuals.

Scored on the held-out prompts, against the served model's real lengths (a single sampled
answer: what one served request does; the median of its samples; the greedy answer):

    router     router.predictor.make_predictor(router/data/length_smollm2): text features only
    probe      engine/length_probe.py on the hidden state after prefill (+ log prompt length)
    combined   the probe's features plus the router's log median, one ridge (not shipped)

Kendall's tau of the median estimate, its MAE in tokens, and each quantile's coverage; every
estimate capped at the generation's max_tokens. A paired bootstrap gives the tau gain's 90% CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_predictor import conversations, log  # noqa: E402
from engine.length_probe import (  # noqa: E402
    QUANTILES,
    LengthProbe,
    evaluate,
    features,
    kendall_tau,
    model_shape,
)

ALPHAS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def load(path: Path) -> dict:
    with np.load(path.with_suffix(".npz")) as data:
        d = {k: data[k] for k in data.files}
    d["meta"] = json.loads(path.with_suffix(".json").read_text())
    d["hidden"] = d["hidden"].astype(np.float64)
    d["all_lens"] = np.concatenate([d["greedy_len"][:, None], d["sample_lens"]], axis=1)
    return d


def router_inputs(d: dict) -> list:
    """Each prompt as the router sees it (a PredictInput)."""
    from engine.model_hub import resolve_model
    from engine.tokenizer import load_tokenizer
    from router.predictor import PredictInput

    tokenizer = load_tokenizer(str(resolve_model(d["meta"]["model"])))
    convs = conversations()
    max_tokens = int(d["meta"]["settings"]["max_tokens"])
    inputs = []
    for ci in d["conv_index"]:
        text = convs[int(ci)][0]["value"]
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        inputs.append(PredictInput(text=text, prompt_len=n, turns=1, max_tokens=max_tokens))
    return inputs


def router_estimates(inputs: list, spec: str) -> np.ndarray:
    """[N, 3] the router's quantiles for each prompt."""
    from router.predictor import make_predictor

    predictor = make_predictor(spec)
    out = np.zeros((len(inputs), 3))
    for k, x in enumerate(inputs):
        p = predictor.predict(x)
        out[k] = [p.quantiles[q] for q in QUANTILES]
    return out


def router_adaptation(d: dict, inputs: list, spec: str, train, test) -> dict:
    """The router's online adaptation to the served model's own lengths: it observes every
    answer to the training prompts (greedy and samples, in a shuffled order, as finished
    requests arrive), refitting when due as the router does; tau / MAE on the held-out
    prompts (median label) before and after."""
    from router.predictor import evaluate_adaptation, make_predictor

    rows = [(int(k), int(n)) for k in train for n in d["all_lens"][k]]
    order = np.random.default_rng(0).permutation(len(rows))
    adapt = ([inputs[rows[i][0]] for i in order], [rows[i][1] for i in order])
    held = ([inputs[k] for k in test], [float(np.median(d["all_lens"][k])) for k in test])
    return evaluate_adaptation(make_predictor(spec), adapt, held)


# -- ridge with cross-validation -------------------------------------------------------------------


def folds(n: int, k: int = 5, seed: int = 0) -> list[np.ndarray]:
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


def ridge_path(x: np.ndarray, y: np.ndarray, alphas=ALPHAS) -> list:
    """A predict function per alpha: ridge on standardized ``x`` (``alpha`` per row, as
    LengthProbe.fit), all from one eigendecomposition of the smaller Gram matrix."""
    mean, scale = x.mean(0), x.std(0)
    scale[scale < 1e-8] = 1.0
    z, y0 = (x - mean) / scale, y.mean()
    n, d = z.shape
    if n <= d:
        s, u = np.linalg.eigh(z @ z.T)
        uty = u.T @ (y - y0)
        ws = [z.T @ (u @ (uty / (s + a * n))) for a in alphas]
    else:
        s, v = np.linalg.eigh(z.T @ z)
        vty = v.T @ (z.T @ (y - y0))
        ws = [v @ (vty / (s + a * n)) for a in alphas]
    return [lambda xs, w=w: ((xs - mean) / scale) @ w + y0 for w in ws]


def cross_validate(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, float]:
    """(best alpha, its out-of-fold predictions, their log-MSE) over ALPHAS."""
    oof = np.zeros((len(ALPHAS), len(y)))
    for idx in folds(len(y)):
        train = np.setdiff1d(np.arange(len(y)), idx)
        for k, predict in enumerate(ridge_path(x[train], y[train])):
            oof[k, idx] = predict(x[idx])
    mse = ((oof - y[None, :]) ** 2).mean(1)
    best = int(np.argmin(mse))
    return ALPHAS[best], oof[best], float(mse[best])


def quantiles_from(mu: np.ndarray, offsets: np.ndarray, cap: int) -> np.ndarray:
    return np.clip(np.expm1(mu[:, None] + offsets[None, :]), 1.0, cap)


def bootstrap_gain(a: np.ndarray, b: np.ndarray, y: np.ndarray, reps: int = 300) -> list[float]:
    """90% CI of tau(b, y) - tau(a, y) over resampled prompts."""
    rng = np.random.default_rng(0)
    gains = []
    for _ in range(reps):
        i = rng.integers(0, len(y), len(y))
        gains.append(
            kendall_tau(b[i], y[i], pairs=200_000) - kendall_tau(a[i], y[i], pairs=200_000)
        )
    return [round(float(np.quantile(gains, 0.05)), 4), round(float(np.quantile(gains, 0.95)), 4)]


# -- the run ---------------------------------------------------------------------------------------


def score(d: dict, rows: np.ndarray, estimates: dict, constant: float) -> dict:
    """Each estimate [len(rows), 3] against each target at ``rows``; a constant's MAE; the 90%
    CI of the probe's tau gain over the router."""
    targets = {
        "one_sample": d["all_lens"][rows, -1],  # the last sampled answer (greedy if none)
        "median_of_samples": np.median(d["all_lens"][rows], axis=1),
        "greedy": d["greedy_len"][rows],
    }
    table = {}
    for t, y in targets.items():
        table[t] = {name: evaluate(est, y) for name, est in estimates.items()}
        table[t]["constant_median_mae"] = round(float(np.abs(constant - y).mean()), 2)
        table[t]["probe_minus_router_tau_ci90"] = bootstrap_gain(
            estimates["router"][:, 0], estimates["probe"][:, 0], y
        )
    return table


def choose_layers(d: dict, train: np.ndarray, y: np.ndarray) -> tuple[list[dict], tuple]:
    """Cross-validated log-MSE of the probe on each captured layer alone and on all of them."""
    layers = [int(i) for i in d["layers"]]
    options = [(i,) for i in layers] + ([tuple(layers)] if len(layers) > 1 else [])
    rows = []
    for option in options:
        pick = [layers.index(i) for i in option]
        x = features(d["hidden"][train][:, pick], d["prompt_tokens"][train])
        alpha, oof, mse = cross_validate(x, y)
        rows.append(
            {
                "layers": list(option),
                "alpha": alpha,
                "cv_log_mse": round(mse, 4),
                "cv_tau": round(kendall_tau(oof, y), 4),
            }
        )
        log(f"layers {option}: alpha {alpha}, cv log-MSE {mse:.4f}, cv tau {rows[-1]['cv_tau']}")
    best = min(rows, key=lambda r: r["cv_log_mse"])
    return rows, tuple(best["layers"])


def fit_probe(d, train, y, layers) -> tuple[LengthProbe, float]:
    """The probe on ``layers`` refit on the whole training side, out-of-fold quantiles."""
    pick = [list(map(int, d["layers"])).index(i) for i in layers]
    hidden, plen = d["hidden"][train][:, pick], d["prompt_tokens"][train]
    alpha, oof, _ = cross_validate(features(hidden, plen), y)
    probe = LengthProbe.fit(layers, hidden, plen, np.expm1(y), alpha=alpha)
    probe.offsets = np.maximum.accumulate(np.quantile(y - oof, QUANTILES))
    return probe, alpha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "benchmarks" / "data" / "served_lengths_smollm2"))
    ap.add_argument("--router", default=str(ROOT / "router" / "data" / "length_smollm2"))
    ap.add_argument("--out", default=str(ROOT / "engine" / "data" / "probe_smollm2"))
    ap.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results" / "probe_smollm2.json")
    )
    args = ap.parse_args()

    d = load(Path(args.data))
    cap = int(d["meta"]["settings"]["max_tokens"])
    held = np.array([zlib.crc32(str(int(ci)).encode()) % 5 == 0 for ci in d["conv_index"]])
    train, test = np.flatnonzero(~held), np.flatnonzero(held)
    log(f"{len(d['conv_index'])} prompts: {len(train)} train, {len(test)} held out; max {cap}")
    median_label = np.log1p(np.median(d["all_lens"], axis=1))
    greedy_label = np.log1p(d["greedy_len"].astype(np.float64))

    layer_rows, layers = choose_layers(d, train, median_label[train])
    probe, alpha = fit_probe(d, train, median_label[train], layers)
    greedy_probe, _ = fit_probe(d, train, greedy_label[train], layers)
    pick = [list(map(int, d["layers"])).index(i) for i in layers]
    h_test, p_test = d["hidden"][test][:, pick], d["prompt_tokens"][test]

    log("router estimates")
    inputs = router_inputs(d)
    router = router_estimates(inputs, args.router)
    log("router adaptation to the served lengths")
    adaptation = router_adaptation(d, inputs, args.router, train, test)
    # combined: the probe's features and the router's log median, one ridge
    x_all = np.concatenate(
        [features(d["hidden"][:, pick], d["prompt_tokens"]), np.log1p(router[:, :1])], axis=1
    )
    c_alpha, c_oof, _ = cross_validate(x_all[train], median_label[train])
    c_mu = ridge_path(x_all[train], median_label[train], [c_alpha])[0](x_all[test])
    c_off = np.maximum.accumulate(np.quantile(median_label[train] - c_oof, QUANTILES))

    estimates = {
        "router": router[test],
        "probe": np.minimum(probe.quantiles(h_test, p_test), cap),
        "probe_greedy_label": np.minimum(greedy_probe.quantiles(h_test, p_test), cap),
        "combined": quantiles_from(c_mu, c_off, cap),
    }
    table = score(d, test, estimates, np.median(np.median(d["all_lens"][train], 1)))
    # Every prompt, the probe out-of-fold (5 folds, its layers): 5x the prompts, but the
    # router's training side included 4 in 5 of these conversations (optimistic for it).
    x_probe = features(d["hidden"][:, pick], d["prompt_tokens"])
    _, oof, _ = cross_validate(x_probe, median_label)
    offsets = np.maximum.accumulate(np.quantile(median_label - oof, QUANTILES))
    table_all = score(
        d,
        np.arange(len(median_label)),
        {"router": router, "probe": quantiles_from(oof, offsets, cap)},
        np.median(np.median(d["all_lens"], 1)),
    )

    t0 = time.perf_counter()
    one = {i: d["hidden"][test[0], k] for k, i in zip(pick, layers, strict=True)}
    for _ in range(1000):
        probe.predict(one, int(p_test[0]))
    predict_us = (time.perf_counter() - t0) * 1e3

    data_meta = d["meta"]
    report = {
        "data": {
            "prompts": len(d["conv_index"]),
            "train": len(train),
            "held_out": len(test),
            "samples_per_prompt": int(d["sample_lens"].shape[1]),
            "plus_greedy": True,
            "settings": data_meta["settings"],
            "generated_in_s": data_meta.get("seconds"),
            "length_capped_fraction": round(float((d["sample_finish"] == 1).mean()), 4)
            if d["sample_finish"].size
            else None,
            "greedy_capped_fraction": round(float((d["greedy_finish"] == 1).mean()), 4),
            "mean_sampled_tokens": round(float(d["sample_lens"].mean()), 1)
            if d["sample_lens"].size
            else None,
            "mean_greedy_tokens": round(float(d["greedy_len"].mean()), 1),
        },
        "router": {
            "artifact": str(Path(args.router).relative_to(ROOT))
            if Path(args.router).is_relative_to(ROOT)
            else args.router,
            "kind": json.loads(Path(args.router).with_suffix(".json").read_text()).get("kind"),
        },
        "router_adaptation_to_served_lengths": adaptation,
        "layer_selection": layer_rows,
        "probe": {"layers": list(layers), "alpha": alpha, "label": "median of greedy + samples"},
        "combined_alpha": c_alpha,
        "held_out": table,
        "all_prompts_probe_out_of_fold": table_all,
        "predict_us": round(predict_us, 2),
    }
    from engine.config import ModelConfig
    from engine.model_hub import resolve_model

    mc = ModelConfig.from_dir(str(resolve_model(data_meta["model"])))
    probe.meta = {
        "model": data_meta["model"],
        "model_shape": model_shape(mc.vocab_size, mc.hidden_size, mc.num_layers),
        "trained_on": "benchmarks/gen_served_lengths.py: the served model's own answers to "
        "ShareGPT first turns; label: median length of greedy + sampled answers (ProD)",
        "max_tokens_of_labels": cap,
        "alpha": alpha,
        "trained_prompts": len(train),
        "evaluation": {
            "held_out_prompts": len(test),
            "probe": {t: rows["probe"] for t, rows in table.items()},
            "router_on_the_same_prompts": {t: rows["router"] for t, rows in table.items()},
        },
    }
    probe.save(args.out)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    log(f"wrote {args.out}.npz/.json and {results}")


def print_table(report: dict) -> None:
    data = report["data"]
    print(
        f"\n{data['prompts']} prompts, greedy + {data['samples_per_prompt']} samples at "
        f"T={data['settings']['temperature']}, max_tokens {data['settings']['max_tokens']}; "
        f"probe layers {report['probe']['layers']}"
    )
    for title, key in (
        (f"{data['held_out']} held out (conversations the router never saw)", "held_out"),
        (
            "every prompt, probe out-of-fold (router trained on 4/5)",
            "all_prompts_probe_out_of_fold",
        ),
    ):
        print(f"\n{title}")
        print_rows(report[key])
    a = report["router_adaptation_to_served_lengths"]
    print(f"\nthe router adapting online to the served lengths ({a['adapted_on']} answers)")
    print_rows({"median_of_samples": {"router_before": a["before"], "router_after": a["after"]}})


def print_rows(table: dict) -> None:
    head = ("target", "estimate", "tau", "MAE", "cov50", "cov90", "cov99")
    print("{:<18} {:<20} {:>7} {:>8} {:>6} {:>6} {:>6}".format(*head))
    for target, rows in table.items():
        for name, r in rows.items():
            if not isinstance(r, dict):
                continue
            c = r["coverage"]
            print(
                f"{target:<18} {name:<20} {r['kendall_tau']:>7.3f} {r['mae_tokens']:>8.1f} "
                f"{c['0.5']:>6.2f} {c['0.9']:>6.2f} {c['0.99']:>6.2f}"
            )
        if "constant_median_mae" in rows:
            print(
                f"{target:<18} {'constant median':<20} {'':>7} {rows['constant_median_mae']:>8.1f}"
                f"   probe - router tau, 90% CI {rows['probe_minus_router_tau_ci90']}"
            )


if __name__ == "__main__":
    main()
