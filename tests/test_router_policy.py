"""Placement policies on hand-made load views (no Ray, no Redis)."""

from __future__ import annotations

import collections

import pytest

from engine.prefix_index import DEVICE, DISK, HOST
from router.policy import RouteRequest, WorkerView, load_fractions, make_policy


def views(*specs: dict) -> list[WorkerView]:
    return [WorkerView(f"p{i}", "prefill", **spec) for i, spec in enumerate(specs)]


def test_cache_aware_prefers_the_worker_holding_the_prefix() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=1000, block_size=16, cached_tiers={"p1": DEVICE * 60})
    for _ in range(20):
        assert policy.choose_prefill(req, views({}, {}, {})) == ("p1", "prefix_hit")


def test_cache_aware_leaves_a_holder_whose_queue_outweighs_the_hit() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(
        prompt_len=1000, block_size=16, cached_tiers={"p0": DEVICE * 60}
    )  # 960 tokens
    # p0 would compute 40 new tokens but has 5000 queued; p1 computes 1000 with nothing queued.
    name, reason = policy.choose_prefill(req, views({"queued_prefill_tokens": 5000}, {}))
    assert (name, reason) == ("p1", "prefix_overloaded")
    name, reason = policy.choose_prefill(req, views({"queued_prefill_tokens": 500}, {}))
    assert (name, reason) == ("p0", "prefix_hit")


# Measured costs of a worker: a block loads from host memory in a tenth of its recompute time,
# from disk in 0.4 of it (router.policy.load_fractions of its TierCosts).
TIERED = {"tier_load": {HOST: 0.1, DISK: 0.4}}


def test_a_device_hit_beats_a_host_hit_beats_a_disk_hit_beats_a_miss() -> None:
    policy = make_policy("cache_aware", seed=0)
    held = {"p0": DEVICE * 60, "p1": HOST * 60, "p2": DISK * 60}  # 960 of 1000 tokens each
    req = RouteRequest(prompt_len=1000, block_size=16, cached_tiers=held)
    device, host, disk, miss = views(TIERED, TIERED, TIERED, TIERED)  # equal loads
    for _ in range(20):  # the cheapest tier wins, never a random pick among the holders
        assert policy.choose_prefill(req, [device, host, disk, miss]) == ("p0", "prefix_hit")
        assert policy.choose_prefill(req, [host, disk, miss]) == ("p1", "prefix_hit_host")
        assert policy.choose_prefill(req, [disk, miss]) == ("p2", "prefix_hit_disk")
        assert policy.choose_prefill(req, [miss, host]) == ("p1", "prefix_hit_host")


def test_a_lower_tier_hit_is_priced_at_its_load_cost() -> None:
    def cost(tiers: str, prompt_len: int = 1000, **tier_load: float) -> float:
        req = RouteRequest(prompt_len=prompt_len, block_size=16, cached_tiers={"w": tiers})
        return req.prefill_tokens("w", {HOST: 0.1, DISK: 0.4, **tier_load})

    assert cost("") == 1000  # a miss: every token
    assert cost(DEVICE * 60) == 40  # free
    assert cost(DEVICE * 30 + HOST * 30) == pytest.approx(40 + 30 * 16 * 0.1)
    assert cost(DEVICE * 30 + DISK * 30) == pytest.approx(40 + 30 * 16 * 0.4)
    # after the first block below, the engine loads the rest from below: a device block there
    # is priced as a host one
    assert cost(DEVICE * 10 + HOST + DEVICE * 49) == pytest.approx(40 + 50 * 16 * 0.1)
    # a tier whose costs are unknown (no stats yet) is priced as a recompute
    req = RouteRequest(prompt_len=1000, block_size=16, cached_tiers={"w": DEVICE * 30 + HOST * 30})
    assert req.prefill_tokens("w", {}) == 1000 - 30 * 16
    # the last prompt token is always computed: a 32-token prompt uses 31 cached tokens
    assert cost(HOST * 2, prompt_len=32, **{HOST: 0.5}) == pytest.approx(1 + 31 * 0.5)


def test_a_worker_whose_queue_outweighs_its_tier_hit_is_left() -> None:
    policy = make_policy("cache_aware", seed=0)
    req = RouteRequest(prompt_len=1000, block_size=16, cached_tiers={"p0": HOST * 60})
    # p0: 40 tokens to compute + 60 blocks from host (96) = 136, plus its queue; p1: 1000
    heavy = views({**TIERED, "queued_prefill_tokens": 900}, TIERED)
    assert policy.choose_prefill(req, heavy) == ("p1", "prefix_overloaded")
    light = views({**TIERED, "queued_prefill_tokens": 800}, TIERED)
    assert policy.choose_prefill(req, light) == ("p0", "prefix_hit_host")
    # a device holder with a queue against a host holder without one: 40 + 100 > 136
    req.cached_tiers["p1"] = DEVICE * 60
    pair = views(TIERED, {**TIERED, "queued_prefill_tokens": 100})
    assert policy.choose_prefill(req, pair) == ("p0", "prefix_overloaded")
    pair = views(TIERED, {**TIERED, "queued_prefill_tokens": 90})
    assert policy.choose_prefill(req, pair) == ("p1", "prefix_hit")


def test_load_fractions_come_from_the_measured_tier_costs() -> None:
    costs = {"host_load_s": 1e-4, "disk_load_s": 4e-4, "recompute_s": 1e-3}
    assert load_fractions(costs) == pytest.approx({HOST: 0.1, DISK: 0.4})
    # no disk tier (its load is inf), a disk slower than recomputing: not loaded, not priced
    for disk_s in (float("inf"), 2e-3):
        assert load_fractions({**costs, "disk_load_s": disk_s}) == pytest.approx({HOST: 0.1})
    assert load_fractions({**costs, "recompute_s": float("inf")}) == {}  # not measured
    assert load_fractions(None) == {} and load_fractions({}) == {}


def test_cached_tokens_leave_the_last_prompt_token_to_compute() -> None:
    req = RouteRequest(prompt_len=32, block_size=16, cached_tiers={"p0": DEVICE * 2})
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
    req = RouteRequest(prompt_len=10, block_size=16, cached_tiers={"p1": DEVICE})
    assert [rr.choose_prefill(req, views({}, {}))[0] for _ in range(4)] == ["p0", "p1", "p0", "p1"]
    ll = make_policy("least_loaded", seed=0)
    assert ll.choose_prefill(req, views({"queued_prefill_tokens": 9}, {}))[0] == "p1"


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
