"""The autoscaler's decisions (cluster/control/autoscaler.py) on a driven clock: sustained pressure
over the high mark grows a pool, sustained slack (counted as if it had a worker fewer) shrinks
it, never past min / max, never within the cool-down, and each decision names its signal."""

from __future__ import annotations

import pytest

from cluster.control.autoscaler import Autoscaler, AutoscalerConfig, PoolSignals


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scaler(**decode) -> tuple[Autoscaler, Clock]:
    policy = {"up_after_s": 10, "down_after_s": 30, "cooldown_s": 20, "slo_s": 0.1, **decode}
    clock = Clock()
    return Autoscaler(AutoscalerConfig(enabled=True, decode=policy), clock), clock


def looks(a: Autoscaler, clock: Clock, signals: PoolSignals, seconds: float, every: float = 1):
    """Observe ``signals`` every ``every`` s for ``seconds``; the decisions taken."""
    out = []
    end = clock.t + seconds
    while clock.t < end:
        d = a.observe(signals)
        if d is not None:
            out.append((clock.t, d))
        clock.t += every
    return out


def test_sustained_pressure_grows_the_pool_once_per_cooldown() -> None:
    a, clock = scaler(max_replicas=3)
    hot = PoolSignals("decode", 1, kv_used=0.95, kv_demand=0.7, itl_p90_s=0.05)
    taken = looks(a, clock, hot, 9)
    assert taken == []  # over the mark, but not for up_after_s yet
    taken = looks(a, clock, hot, 2)
    assert len(taken) == 1
    t, d = taken[0]
    assert (d.direction, d.replicas, d.target, d.signal) == ("out", 1, 2, "kv")
    assert "kv 0.95 > 0.85" in d.reason and d.inputs["pressures"]["kv"] == 0.95
    # The pool is at 2 now; still hot: nothing within the cool-down, then the next step.
    hot2 = PoolSignals("decode", 2, kv_used=0.9, itl_p90_s=0.3)
    taken = looks(a, clock, hot2, 19)
    assert taken == []
    taken = looks(a, clock, hot2, 15)
    assert [(d.target, d.signal) for _, d in taken] == [(3, "itl")]  # 0.3 / 0.1 = 3.0
    # At max_replicas: no more, however hot.
    assert looks(a, clock, PoolSignals("decode", 3, kv_used=1.0), 120) == []


def test_a_blip_over_the_mark_grows_nothing() -> None:
    a, clock = scaler()
    for _ in range(5):
        assert looks(a, clock, PoolSignals("decode", 1, kv_used=0.95), 8) == []
        assert looks(a, clock, PoolSignals("decode", 1, kv_used=0.2), 2) == []


def test_slack_shrinks_only_when_a_worker_fewer_stays_under_the_low_mark() -> None:
    a, clock = scaler(min_replicas=1)
    # 2 workers at 0.3: with one fewer 0.6, over low (0.5): keep both, however long
    assert looks(a, clock, PoolSignals("decode", 2, kv_used=0.3, kv_demand=0.2), 120) == []
    # at 0.2: one fewer is 0.4 < 0.5, for down_after_s: shrink by one, the signal named
    taken = looks(a, clock, PoolSignals("decode", 2, kv_used=0.1, kv_demand=0.2), 40)
    assert len(taken) == 1
    t, d = taken[0]
    assert (d.direction, d.replicas, d.target, d.signal) == ("in", 2, 1, "demand")
    assert t >= 30 and "x2/1 = 0.40" in d.reason
    # at min_replicas: never below it
    assert looks(a, clock, PoolSignals("decode", 1, kv_used=0.0), 300) == []


def test_out_of_bounds_pools_are_brought_back_and_marks_are_checked() -> None:
    a, clock = scaler(min_replicas=2, max_replicas=3)
    d = a.observe(PoolSignals("decode", 1))
    assert (d.direction, d.target, d.signal) == ("out", 2, "min_replicas")
    clock.t += 100
    d = a.observe(PoolSignals("decode", 5, kv_used=0.99))
    assert (d.direction, d.target, d.signal) == ("in", 3, "max_replicas")
    with pytest.raises(ValueError, match="low"):
        AutoscalerConfig(decode={"high": 0.5, "low": 0.6})
    with pytest.raises(ValueError, match="min"):
        AutoscalerConfig(prefill={"min_replicas": 3, "max_replicas": 2})


def test_each_role_reads_its_own_signals() -> None:
    a, clock = scaler()
    policy = a.config.prefill
    # prefill: the queue of uncached prompt tokens per worker and TTFT; KV is not its concern
    p = PoolSignals("prefill", 2, queued_tokens=4 * policy.queue_tokens, ttft_p90_s=1.0, kv_used=1)
    assert p.pressures(policy) == {"queue": 2.0, "ttft": 0.5}
    d = PoolSignals("decode", 1, queued_tokens=1e9, kv_used=0.5, itl_p90_s=0.05)
    assert d.pressures(a.config.decode) == {"kv": 0.5, "itl": 0.5}
    taken = looks(a, clock, p, 11)
    assert [(x.role, x.signal, x.target) for _, x in taken] == [("prefill", "queue", 3)]
    assert a.stats()["counts"] == [
        {"role": "prefill", "direction": "out", "reason": "queue", "count": 1}
    ]
