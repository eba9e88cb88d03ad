"""Tests of engine.sampling_params: validation (ValueError naming the parameter), defaults and
normalisation (stop lists, top_k=-1, greedy), derived properties, for_child and with_eos."""

from __future__ import annotations

import math
import re

import pytest

from engine.sampling_params import SamplingParams

# (parameter, invalid value): each must raise ValueError "<parameter> must be ..., got <value>".
INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", 2000.5),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 2000.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("logprobs", -1),
    ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
    ("seed", 1.5),
    ("seed", "1"),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 2**70),
    ("top_k", 2**63),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", ["3"]),
]


def raises_naming(name: str, **kwargs: object) -> ValueError:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"{name} must be"), message
    return info.value


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_parameter(name: str, value: object) -> None:
    error = raises_naming(name, **{name: value})
    if name not in ("stop", "stop_token_ids"):  # those two echo the normalised list
        assert str(error).endswith(f"got {value!r}."), str(error)


def test_seeds_of_every_sample_stay_below_2_to_the_63() -> None:
    raises_naming("seed", seed=2**63 - 3, n=4)  # the last sample's seed would be 2^63


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("stop", {"stop": ["a"] * 33}),
        ("stop", {"stop": "x" * 513}),
        ("stop_token_ids", {"stop_token_ids": [1] * 257}),
    ],
)
def test_stop_lists_are_bounded(name: str, kwargs: dict[str, object]) -> None:
    raises_naming(name, **kwargs)


def test_min_tokens_above_max_tokens_names_both() -> None:
    with pytest.raises(ValueError, match=re.escape("min_tokens=5 and max_tokens=4")) as info:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert str(info.value).startswith("min_tokens must be <= max_tokens")


def test_min_tokens_is_unbounded_without_max_tokens() -> None:
    assert SamplingParams(min_tokens=1000, max_tokens=None).min_tokens == 1000


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2000.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 2000.0},
        {"max_tokens": None},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": 0},
        {"logprobs": SamplingParams.MAX_LOGPROBS},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"seed": 2**63 - 4, "n": 4},
        {"top_k": 2**31 - 1},
        {"stop": ["x" * 512] * 32, "stop_token_ids": list(range(256))},
        {"stop_token_ids": [0]},
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_defaults() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.max_tokens, params.min_tokens) == (16, 0)
    assert params.stop == [] and params.stop_token_ids == []
    assert params._eos_token_ids == ()
    assert not params.greedy and not params.uses_penalties and params.max_stop_len == 0


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("END", ["END"]), (("a", "bcd"), ["a", "bcd"]), (["x"], ["x"])],
)
def test_stop_is_normalised_to_a_list(stop: object, expected: list[str]) -> None:
    params = SamplingParams(stop=stop)  # type: ignore[arg-type]
    assert params.stop == expected
    assert params.max_stop_len == max((len(s) for s in expected), default=0)


def test_stop_lists_are_copied() -> None:
    stop, stop_ids = ["a"], [3]
    params = SamplingParams(stop=stop, stop_token_ids=stop_ids)
    stop.append("b")
    stop_ids.append(4)
    assert params.stop == ["a"] and params.stop_token_ids == [3]


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 9.9e-6])
def test_greedy_normalisation(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=7, min_p=0.3)
    assert params.greedy
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.0)


def test_small_positive_temperature_is_not_greedy() -> None:
    params = SamplingParams(temperature=1e-5, top_p=0.5, top_k=7, min_p=0.3)
    assert not params.greedy
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1e-5, 0.5, 7, 0.3)


def test_greedy_still_validates_the_ignored_knobs() -> None:
    raises_naming("top_p", temperature=0.0, top_p=0.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}],
)
def test_uses_penalties(kwargs: dict[str, float]) -> None:
    assert SamplingParams(**kwargs).uses_penalties  # type: ignore[arg-type]


def test_for_child_offsets_the_seed_and_keeps_everything_else() -> None:
    parent = SamplingParams(
        n=3, seed=7, temperature=0.8, top_k=5, max_tokens=9, stop=["x"], stop_token_ids=[4]
    ).with_eos((2,))
    children = [parent.for_child(i) for i in range(parent.n)]
    assert [c.seed for c in children] == [7, 8, 9]
    for child in children:
        assert child.n == 1
        assert (child.temperature, child.top_k, child.max_tokens) == (0.8, 5, 9)
        assert child.stop == ["x"] and child.stop_token_ids == [4]
        assert child._eos_token_ids == (2,)
    assert parent.n == 3 and parent.seed == 7
    children[0].stop.append("y")
    assert parent.stop == ["x"]


def test_for_child_without_seed_stays_unseeded() -> None:
    parent = SamplingParams(n=2)
    assert [parent.for_child(i).seed for i in range(2)] == [None, None]


def test_with_eos_returns_a_copy() -> None:
    params = SamplingParams(max_tokens=3)
    with_eos = params.with_eos([5, 6])  # type: ignore[arg-type]
    assert with_eos._eos_token_ids == (5, 6)
    assert params._eos_token_ids == ()
    assert with_eos.max_tokens == 3
    assert "_eos_token_ids" not in repr(with_eos)


# ------------------------------------------------------------------ fixed bugs (regressions)


def test_non_integer_logprobs_is_rejected() -> None:
    raises_naming("logprobs", logprobs=2.5)


WRONG_TYPES = [
    ("temperature", "0.7"),
    ("top_p", None),
    ("min_p", "0"),
    ("presence_penalty", "0"),
    ("logprobs", "5"),
    ("stop", 5),
    ("stop_token_ids", 5),
]


@pytest.mark.parametrize(("name", "value"), WRONG_TYPES, ids=[f"{n}={v!r}" for n, v in WRONG_TYPES])
def test_wrong_type_raises_value_error_naming_the_parameter(name: str, value: object) -> None:
    raises_naming(name, **{name: value})


@pytest.mark.parametrize(
    "bias",
    [
        {1: 100.5},
        {1: -101},
        {1: float("nan")},
        {1: 10**400},
        {-1: 1.0},
        {"1": 1.0},
        {True: 1.0},
        {1: "1"},
        {1: None},
        [1, 2],
        {i: 1.0 for i in range(SamplingParams.MAX_LOGIT_BIAS + 1)},
    ],
    ids=lambda b: repr(b)[:24],
)
def test_logit_bias_out_of_range_or_of_wrong_type_is_refused(bias: object) -> None:
    error = raises_naming("logit_bias", logit_bias=bias)
    assert len(str(error)) < 160, "a long bias is not echoed whole"


def test_logit_bias_is_a_float_copy_and_empty_asks_for_nothing() -> None:
    given = {3: 100, 5: -100, 7: 0.25}
    params = SamplingParams(logit_bias=given)
    given[3] = 0
    assert params.logit_bias == {3: 100.0, 5: -100.0, 7: 0.25}
    assert all(isinstance(v, float) for v in params.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams().logit_bias is None
    child = SamplingParams(n=2, seed=1, logit_bias={3: 1}).for_child(1)
    assert child.logit_bias == {3: 1.0} and child.seed == 2
