"""Placement policies on hand-made load views (no Ray, no Redis)."""

from __future__ import annotations

import collections

import pytest

from router.policy import RouteRequest, WorkerView, make_policy


def views(*specs: dict) -> list[WorkerView]:
    return [WorkerView(f"p{i}", "prefill", **spec) for i, spec in enumerate(specs)]


def test_cache_aware_prefers_the_worker_holding_the_prefix() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=1000, block_size=16, cached_blocks={"p1": 60})
    for _ in range(20):
        assert policy.choose_prefill(req, views({}, {}, {})) == ("p1", "prefix_hit")


def test_cache_aware_leaves_a_holder_whose_queue_outweighs_the_hit() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=1000, block_size=16, cached_blocks={"p0": 60})  # 960 tokens
    # p0 would compute 40 new tokens but has 5000 queued; p1 computes 1000 with nothing queued.
    name, reason = policy.choose_prefill(req, views({"queued_prefill_tokens": 5000}, {}))
    assert (name, reason) == ("p1", "prefix_overloaded")
    name, reason = policy.choose_prefill(req, views({"queued_prefill_tokens": 500}, {}))
    assert (name, reason) == ("p0", "prefix_hit")


def test_cached_tokens_leave_the_last_prompt_token_to_compute() -> None:
    req = RouteRequest(prompt_len=32, block_size=16, cached_blocks={"p0": 2})
    assert req.cached_tokens("p0") == 31
    assert req.cached_tokens("p1") == 0


def test_ties_are_spread_not_herded() -> None:
    policy = make_policy("cache_aware", seed=1)
    req = RouteRequest(prompt_len=100, block_size=16)
    picks = collections.Counter(
        policy.choose_prefill(req, views({}, {}, {}))[0] for _ in range(300)
    )
    assert set(picks) == {"p0", "p1", "p2"} and min(picks.values()) > 60, picks


def test_no_index_routes_by_load_and_says_so() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=100, block_size=16, index_available=False)
    name, reason = policy.choose_prefill(req, views({"queued_prefill_tokens": 50}, {}))
    assert (name, reason) == ("p1", "load_no_index")


def test_decode_choice_needs_room_then_least_work() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=100, block_size=16)  # 7 blocks
    d = [
        WorkerView("d0", "decode", free_blocks=5, running=0),  # no room
        WorkerView("d1", "decode", free_blocks=50, running=3),
        WorkerView("d2", "decode", free_blocks=8, running=1),
    ]
    assert policy.choose_decode(req, d) == ("d2", "decode_load")
    req.predicted_output_tokens = 64  # a predictor's estimate grows the need to 11 blocks
    assert policy.choose_decode(req, d) == ("d1", "decode_load")
    full = [WorkerView("d0", "decode", free_blocks=2), WorkerView("d1", "decode", free_blocks=4)]
    assert policy.choose_decode(req, full) == ("d1", "full")


def test_round_robin_cycles_and_least_loaded_follows_queues() -> None:
    rr = make_policy("round_robin")
    req = RouteRequest(prompt_len=10, block_size=16, cached_blocks={"p1": 1})
    assert [rr.choose_prefill(req, views({}, {}))[0] for _ in range(4)] == ["p0", "p1", "p0", "p1"]
    ll = make_policy("least_loaded", seed=0)
    assert ll.choose_prefill(req, views({"queued_prefill_tokens": 9}, {}))[0] == "p1"


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
