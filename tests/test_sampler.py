"""Tests of engine.sampler on hand-built logits: greedy, penalties, min_tokens, truncation,
seeded reproducibility, sampling frequencies and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from engine.grammar import GrammarMatcher
from engine.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    _top_k_top_p_thresholds,
    seeded_uniform,
)
from engine.sampling_params import SamplingParams

EOS = 2


def make_row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (EOS,),
    **kwargs: object,
) -> SamplingRow:
    params = SamplingParams(**kwargs).with_eos(eos)  # type: ignore[arg-type]
    return SamplingRow(params, list(prompt), list(output))


def sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def token_ids(results: list[SampledToken]) -> list[int]:
    return [r.token_id for r in results]


# --------------------------------------------------------------------------- references


def reference_penalised(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> torch.Tensor:
    """Penalties token by token: HF repetition over prompt+output, then OpenAI on output."""
    out = logits.clone().double()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / repetition if value > 0 else value * repetition
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out.float()


def reference_distribution(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Truncated sampling distribution of one row, in float64, the slow obvious way."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in kept)
    nucleus, cumulative = [], 0.0
    for t in kept:
        nucleus.append(t)
        cumulative += probs[t].item() / mass
        if cumulative >= top_p:
            break
    best = probs[order[0]].item()
    final = [t for t in nucleus if probs[t].item() >= min_p * best]
    out = torch.zeros_like(probs)
    out[final] = probs[final]
    return out / out.sum()


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the tokens with nonzero expected probability, and its dof."""
    n = counts.sum().item()
    support = expected_probs > 0
    expected = expected_probs[support] * n
    observed = counts[support].double()
    return ((observed - expected) ** 2 / expected).sum().item(), int(support.sum()) - 1


# Upper 0.1% points of chi-square with 1..10 degrees of freedom.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59]


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    logits[4, [7, 123, 299]] = 50.0  # three-way tie
    logits[5, :] = 0.0  # all tied
    results = sampler()(logits, [make_row(temperature=0.0) for _ in range(6)])
    assert token_ids(results) == logits.argmax(dim=-1).tolist()
    assert token_ids(results)[4:] == [7, 0]
    assert all(r.logprob is None and r.top_logprobs is None for r in results)


def test_empty_batch_and_shape_check() -> None:
    assert sampler()(torch.empty(0, 10), []) == []
    with pytest.raises(ValueError, match="logits must be"):
        sampler()(torch.zeros(2, 10), [make_row(temperature=0.0)])


def test_seeded_uniform_is_a_function_of_seed_and_position() -> None:
    draws = [seeded_uniform(7, p) for p in range(4000)]
    assert draws == [seeded_uniform(7, p) for p in range(4000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert draws[:50] != [seeded_uniform(8, p) for p in range(50)]
    assert seeded_uniform(2**63, 0) != seeded_uniform(0, 0)  # the whole 64-bit seed counts
    # uniform: mean 1/2, variance 1/12, and no correlation between neighbouring positions
    t = torch.tensor(draws, dtype=torch.float64)
    assert abs(t.mean().item() - 0.5) < 0.02 and abs(t.var().item() - 1 / 12) < 0.01
    assert abs(torch.corrcoef(torch.stack([t[:-1], t[1:]]))[0, 1].item()) < 0.05
    # across seeds at one position too (n > 1 children are seeds seed + i)
    across = torch.tensor([seeded_uniform(s, 0) for s in range(4000)], dtype=torch.float64)
    assert abs(across.mean().item() - 0.5) < 0.02


# --------------------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, -1.5), (1.2, -0.4, 0.8)],
)
def test_penalties_match_per_token_reference(
    repetition: float, frequency: float, presence: float
) -> None:
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 4
    original = logits.clone()
    prompt, output = [1, 5, 5, 9, 40], [5, 9, 9, 9, 33, 63]
    rows = [
        make_row(
            prompt,
            output,
            temperature=0.0,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
        ),
        make_row(prompt, output, temperature=0.0),  # no penalties: untouched
        make_row(prompt, [], temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
    ]
    processed = sampler().process_logits(logits, rows)

    assert torch.equal(logits, original), "the caller's logits must not change"
    expected = reference_penalised(logits[0], prompt, output, repetition, frequency, presence)
    torch.testing.assert_close(processed[0], expected, rtol=1e-6, atol=1e-6)
    touched = set(prompt) | set(output) if repetition != 1.0 else set(output)
    untouched = [t for t in range(vocab) if t not in touched]
    assert torch.equal(processed[0, untouched], logits[0, untouched])
    assert torch.equal(processed[1], logits[1])
    assert torch.equal(processed[2], logits[2]), "frequency/presence only see output tokens"


def test_penalties_steer_greedy() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    row = make_row(prompt=[3], output=[1], temperature=0.0, presence_penalty=0.5)
    assert token_ids(sampler()(logits, [row])) == [2]
    row = make_row(prompt=[1], output=[], temperature=0.0, repetition_penalty=1.1)
    assert token_ids(sampler()(logits, [row])) == [2]


# --------------------------------------------------------------------------- logit_bias


def test_logit_bias_is_added_first_and_only_to_its_rows() -> None:
    """Each row's bias is added to its own logits before the penalties (OpenAI's order); rows
    without one, and the caller's logits, are left alone; a token a bias names twice over the
    batch gets each row's value, not the sum."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    original = logits.clone()
    rows = [
        make_row(temperature=0.0, logit_bias={1: -2.0, 3: 0.5}),
        make_row(temperature=0.0, logit_bias={1: -0.5}, repetition_penalty=2.0, prompt=[1]),
        make_row(temperature=0.0),
    ]
    processed = sampler().process_logits(logits, rows)
    assert torch.equal(logits, original)
    assert processed[0].tolist() == [0.0, 3.0, 4.0, 1.5]
    assert processed[1].tolist() == [0.0, 2.25, 4.0, 1.0]  # (5 - 0.5) / 2: the bias came first
    assert processed[2].tolist() == logits[2].tolist()


def test_logit_bias_steers_greedy_and_random_rows_but_not_logprobs() -> None:
    logits = flat_logits(4, vocab=64) * 2
    best = int(logits[0].argmax())
    second = int(logits[0].topk(2).indices[1])
    rows = [
        make_row(temperature=0.0, logit_bias={best: -100}, logprobs=1),
        make_row(temperature=0.0, logit_bias={7: 100}),
        make_row(temperature=1.0, logit_bias={9: 100}, seed=1),
        make_row(temperature=0.8, top_p=0.5, logit_bias={t: -100 for t in range(63)}),
    ]
    results = sampler()(logits[[0, 1, 2, 3]], rows)
    assert token_ids(results) == [second, 7, 9, 63]
    reference = torch.log_softmax(logits[0].float(), dim=-1)  # the model's own distribution
    assert results[0].logprob == pytest.approx(reference[second].item(), abs=1e-5)
    assert results[0].top_logprobs[0][0] == best


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab, stop = 10, [7, 8]
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).repeat(4, 1)  # token 0 best
    logits[:, EOS] = 100.0
    logits[:, 7] = 90.0
    rows = [
        make_row(output=[4, 4], temperature=0.0, min_tokens=3, stop_token_ids=stop),
        make_row(output=[4, 4, 4], temperature=0.0, min_tokens=3, stop_token_ids=stop),
        make_row(output=[4], temperature=0.0, min_tokens=3, stop_token_ids=stop, ignore_eos=True),
        make_row(output=[], temperature=0.0, min_tokens=2, eos=(EOS, 99)),  # 99 out of vocab
    ]
    processed = sampler().process_logits(logits, rows)

    assert torch.isinf(processed[0, [EOS, 7, 8]]).all()
    assert torch.equal(processed[0, [0, 1, 3, 4, 5, 6, 9]], logits[0, [0, 1, 3, 4, 5, 6, 9]])
    assert torch.equal(processed[1], logits[1]), "min_tokens reached: nothing masked"
    assert processed[2, EOS] == 100.0 and torch.isinf(processed[2, [7, 8]]).all()
    assert torch.isinf(processed[3, EOS]) and not torch.isinf(processed[3, 7])
    assert token_ids(sampler()(logits, rows)) == [0, EOS, EOS, 7]


def test_min_tokens_holds_for_random_rows() -> None:
    logits = torch.zeros(200, 5)
    logits[:, EOS] = 10.0
    rows = [make_row(output=[], temperature=1.0, min_tokens=1) for _ in range(200)]
    assert EOS not in token_ids(sampler()(logits, rows))


# --------------------------------------------------------------------------- truncation == greedy


@pytest.mark.parametrize(
    "knobs",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"min_p": 0.999},
        {"top_k": 5, "top_p": 1e-6, "min_p": 0.5},
    ],
)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_degenerate_truncation_is_greedy(knobs: dict[str, float], temperature: float) -> None:
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(3)) * 3
    rows = [make_row(temperature=temperature, **knobs) for _ in range(32)]
    for step in range(3):
        assert token_ids(sampler(step)(logits, rows)) == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- top-k/top-p thresholds


def reference_thresholds(
    weights: torch.Tensor, top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """Full-sort reference of the per-row smallest kept weight (0 keeps all)."""
    row_totals = weights.sum(dim=-1)
    out = torch.zeros(weights.shape[0])
    for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        best = weights[i].sort(descending=True).values
        keep = k if k > 0 else best.numel()
        if p < 1.0:
            cumulative = torch.where(torch.arange(best.numel()) < keep, best, 0.0).cumsum(0)
            total = cumulative[keep - 1] if k > 0 else row_totals[i]
            keep = min(keep, 1 + int((cumulative[:-1] < p * total).sum()))
        out[i] = best[keep - 1] if (k > 0 or p < 1.0) else 0.0
    return out


def test_top_k_top_p_thresholds_match_full_sort() -> None:
    vocab = 6000
    gen = torch.Generator().manual_seed(4)
    # Flat rows need nuclei wider than 256 and 4096 candidates; peaked ones fit in 256.
    scales = [0.05, 0.05, 0.3, 1.0, 3.0, 8.0, 0.05, 3.0, 1.0, 0.01]
    logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # relative: best is 1
    top_k = [0, 0, 0, 0, 0, 50, 1000, 1, 300, 5000]
    top_p = [0.9, 0.5, 0.95, 0.8, 0.99, 1.0, 0.9, 0.3, 0.7, 0.99]

    def thresholds(w: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
        flags = (
            max(ks),
            any(p < 1.0 for p in ps),
            any(p < 1.0 and k == 0 for k, p in zip(ks, ps, strict=True)),
        )
        return _top_k_top_p_thresholds(w, torch.tensor(ks), torch.tensor(ps), *flags)

    got = thresholds(weights, top_k, top_p)
    assert torch.equal(got, reference_thresholds(weights, top_k, top_p))
    # Fewer rows at a time give the same thresholds (no dependence on the batch); pairs 5-6
    # and 7-8 all have top-k, so they take the one-pass path (no top-p-only row).
    for i in range(0, len(scales), 2):
        part = slice(i, i + 2)
        alone = thresholds(weights[part], top_k[part], top_p[part])
        assert torch.equal(alone, got[part])


def test_wide_nucleus_samples_stay_inside_it() -> None:
    vocab, n = 5000, 16
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.1).repeat(n, 1)
    expected = reference_distribution(logits[0], 1.0, top_p=0.9)
    assert int((expected > 0).sum()) > 4096, "the nucleus must need the full-sort fallback"
    rows = [make_row(temperature=1.0, top_p=0.9) for _ in range(n)]
    for step in range(5):
        picked = torch.tensor(token_ids(sampler(step)(logits, rows)))
        assert (expected[picked] > 0).all()


# --------------------------------------------------------------------------- seeds


def flat_logits(n: int, vocab: int = 1000, seed: int = 6) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


RowsFactory = Callable[[], list[SamplingRow]]


def run_steps(
    logits_per_step: list[torch.Tensor], rows_factory: RowsFactory, position: int, default_seed: int
) -> list[int]:
    """Token picked for the row at ``position`` over several steps (fresh rows each run; each
    row's picks are appended to its output, as the engine does)."""
    rows = rows_factory()
    s = sampler(default_seed)
    picked = []
    for logits in logits_per_step:
        tokens = token_ids(s(logits, rows))
        for row, token in zip(rows, tokens, strict=True):
            row.output_token_ids.append(token)
        picked.append(tokens[position])
    return picked


SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    steps = [flat_logits(1, seed=s)[0] for s in range(20)]

    def alone() -> list[SamplingRow]:
        return [make_row(**SEEDED)]

    def crowded() -> list[SamplingRow]:
        return [
            make_row(temperature=0.0),
            make_row(temperature=0.7, top_k=500),  # widens every top-k candidate set
            make_row(temperature=1.3, seed=99),
            make_row(**SEEDED),
            make_row(temperature=1.0, min_p=0.05, logprobs=3),
        ]

    def reordered() -> list[SamplingRow]:
        rows = crowded()
        return [rows[3], rows[4], rows[0], rows[2], rows[1]]

    reference = run_steps([x[None] for x in steps], alone, 0, default_seed=0)
    assert reference == run_steps([x[None] for x in steps], alone, 0, default_seed=1)
    crowded_steps, reordered_steps = [], []
    for step, x in enumerate(steps):
        other = flat_logits(5, seed=100 + step)
        crowded_steps.append(torch.cat([other[:3], x[None], other[4:]]))
        reordered_steps.append(torch.cat([x[None], other[4:], other[:1], other[2:3], other[1:2]]))
    assert reference == run_steps(crowded_steps, crowded, 3, default_seed=2)
    assert reference == run_steps(reordered_steps, reordered, 0, default_seed=3)
    assert len(set(reference)) > 5, "the row must actually be sampling"


def test_different_seeds_differ_and_unseeded_rows_use_the_default_generator() -> None:
    logits = flat_logits(1)
    steps = [logits] * 20

    def seeded(seed: int) -> RowsFactory:
        return lambda: [make_row(temperature=1.0, seed=seed)]

    def unseeded() -> list[SamplingRow]:
        return [make_row(temperature=1.0)]

    assert run_steps(steps, seeded(1), 0, 0) != run_steps(steps, seeded(2), 0, 0)
    assert run_steps(steps, unseeded, 0, 5) == run_steps(steps, unseeded, 0, 5)
    assert run_steps(steps, unseeded, 0, 5) != run_steps(steps, unseeded, 0, 6)


# --------------------------------------------------------------------------- frequencies

TOY_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0])


@pytest.mark.parametrize(
    "knobs",
    [
        {"temperature": 1.0},
        {"temperature": 0.5, "top_k": 3},
        {"temperature": 1.3, "top_p": 0.7},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.8, "top_k": 5, "top_p": 0.8, "min_p": 0.1},
        {"temperature": 2.0, "top_k": 6, "top_p": 0.95},
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_sample_frequencies_match_truncated_distribution(
    knobs: dict[str, float], seeded: bool
) -> None:
    n = 5000 if seeded else 20000
    logits = TOY_LOGITS.repeat(n, 1)
    seeds = range(n) if seeded else [None] * n
    rows = [make_row(seed=seed, **knobs) for seed in seeds]
    picked = torch.tensor(token_ids(sampler(7)(logits, rows)))
    counts = torch.bincount(picked, minlength=TOY_LOGITS.numel())
    expected = reference_distribution(TOY_LOGITS, **knobs)  # type: ignore[arg-type]
    assert counts[expected == 0].sum() == 0, "sampled a truncated token"
    statistic, dof = chi_square(counts, expected)
    if dof == 0:
        return
    assert statistic < CHI2_999[dof - 1], (statistic, counts.tolist(), expected.tolist())


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_sorted_top_list(dtype: torch.dtype) -> None:
    logits = (flat_logits(5, vocab=100) * 3).to(dtype)
    original = logits.clone()
    rows = [
        make_row(temperature=0.0, logprobs=5),
        make_row(temperature=0.5, top_k=10, logprobs=0, repetition_penalty=1.5, prompt=[1, 2]),
        make_row(temperature=1.0),
        make_row(temperature=1.2, top_p=0.8, logprobs=20, seed=3, presence_penalty=1.0, output=[4]),
        make_row(temperature=0.0, logprobs=1, min_tokens=1, output=[]),
    ]
    results = sampler()(logits, rows)
    assert torch.equal(logits, original)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, (row, result) in enumerate(zip(rows, results, strict=True)):
        if row.params.logprobs is None:
            assert result.logprob is None and result.top_logprobs is None
            continue
        assert result.logprob == pytest.approx(reference[i, result.token_id].item(), abs=1e-5)
        top = result.top_logprobs
        assert top is not None and len(top) == row.params.logprobs
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        best = reference[i].topk(len(top))
        assert [t for t, _ in top] == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=1e-5)
        assert all(v == pytest.approx(reference[i, t].item(), abs=1e-5) for t, v in top)


def test_mixed_batch_of_greedy_random_and_logprob_rows() -> None:
    n = 12
    logits = flat_logits(n, vocab=500) * 2
    logits[1::3, 17] = 40.0  # random rows whose distribution is a near point mass
    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append(make_row(temperature=0.0, logprobs=2 if i % 2 else None))
        elif i % 3 == 1:
            rows.append(make_row(temperature=0.9, top_p=0.95, logprobs=4, seed=i))
        else:
            rows.append(make_row(temperature=1.0, min_p=0.02, seed=i if i % 2 else None))
    results = sampler()(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i, result in enumerate(results):
        if i % 3 == 0:
            assert result.token_id == int(logits[i].argmax())
        if i % 3 == 1:
            assert result.token_id == 17
            assert result.logprob == pytest.approx(reference[i, 17].item(), abs=1e-5)
            assert result.top_logprobs is not None and result.top_logprobs[0][0] == 17
        if rows[i].params.logprobs is None:
            assert result.logprob is None
        assert math.isfinite(logits[i, result.token_id].item())
    # The seeded min_p rows pick what they pick alone.
    for i in (5, 11):
        alone = sampler(99)(logits[i : i + 1], [make_row(temperature=1.0, min_p=0.02, seed=i)])
        assert alone[0].token_id == results[i].token_id


def test_one_sampler_across_changing_batch_sizes() -> None:
    """Scratch buffers are reused between calls; results must not leak across them."""
    s = sampler()
    for step, n in enumerate([8, 3, 16, 1, 16]):
        logits = flat_logits(n, vocab=300, seed=step) * 3
        output = [int(logits[0].argmax())]  # penalised below, so greedy must move off it
        rows = [
            make_row(output=output, temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
            if i % 2 == 0
            else make_row(temperature=0.0)
            for i in range(n)
        ]
        expected = s.process_logits(logits, rows).argmax(dim=-1).tolist()
        assert token_ids(s(logits, rows)) == expected
        reference = reference_penalised(logits[0], [], output, 1.0, 2.0, 2.0)
        assert expected[0] == int(reference.argmax())


# --------------------------------------------------------------------------- grammar masks


class AllowOnly(GrammarMatcher):
    """A fake grammar: only ``allowed`` token ids, ever."""

    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = list(allowed)

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def is_terminated(self) -> bool:
        return False


def grammar_row(allowed: Sequence[int], **kwargs: object) -> SamplingRow:
    row = make_row(**kwargs)
    row.grammar = AllowOnly(allowed)
    return row


def test_grammar_mask_composes_with_greedy_random_penalties_and_logprobs() -> None:
    vocab = 100
    logits = flat_logits(6, vocab)
    allowed = [3, 31, 32, 63, 64, 99]  # word edges and the top bit of a word
    rows = [
        grammar_row(allowed, temperature=0.0),
        grammar_row(allowed, temperature=1.0, seed=1, top_k=3),
        grammar_row(allowed, temperature=1.0, top_p=0.5, presence_penalty=2.0, output=[3, 3]),
        grammar_row(allowed, temperature=1.0, seed=4, logprobs=2, min_tokens=9),
        make_row(temperature=0.0),  # a free row in the same batch
        grammar_row([EOS], temperature=1.0, min_tokens=5),  # the grammar only lets it end
    ]
    s = sampler()
    for _ in range(20):
        out = s(logits, rows)
        assert all(r.token_id in allowed for r in out[:4]), token_ids(out)
        assert out[4].token_id == int(logits[4].argmax()) and out[5].token_id == EOS
    masked = logits[0].clone()
    masked[[t for t in range(vocab) if t not in allowed]] = float("-inf")
    assert out[0].token_id == int(masked.argmax())
    raw = torch.log_softmax(logits[3], -1)  # logprobs stay those of the unmasked distribution
    assert out[3].logprob == pytest.approx(float(raw[out[3].token_id]), abs=1e-5)


def test_grammar_rows_refuse_pending_tokens_and_fail_alone() -> None:
    """A grammar that allows nothing, or is in error, fails its row alone: the row is left
    unmasked (its draw is thrown away), its matcher keeps the reason; the other rows of the
    batch stay masked."""
    logits = flat_logits(3, 64)
    row = grammar_row([5], temperature=0.0)
    row.num_pending = 1
    with pytest.raises(ValueError, match="pending"):
        sampler()(logits[:1], [row])
    rows = [grammar_row([], temperature=0.0), grammar_row([7], temperature=0.0)]
    rows.append(grammar_row([9], temperature=0.0))
    rows[2].grammar.fail("broken")
    out = sampler()(logits, rows)
    assert rows[0].grammar.error and "allows no token" in rows[0].grammar.error
    assert rows[1].grammar.error is None and out[1].token_id == 7
    assert rows[2].grammar.error == "broken"
    assert out[0].token_id == int(logits[0].argmax()) and out[2].token_id == int(logits[2].argmax())
