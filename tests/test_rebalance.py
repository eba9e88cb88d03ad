"""The rebalancer's decisions (cluster/control/migrations.py) over fake decode workers: which request
moves where, the marks' hysteresis, dry-run moving nothing, preemptions avoided counted. The
moves themselves are the real protocol's (tests/test_migration_*.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from cluster.control.events import EventLog
from cluster.control.migrations import Migrator, RebalanceSettings
from engine.messages import MigrationResult, WorkerInfo, WorkerState


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_) -> _Method:
        return self

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@dataclass
class FakeDecode:
    name: str
    total: int
    in_use: int
    cands: list[dict] = field(default_factory=list)
    moves: list[tuple[str, str]] = field(default_factory=list)

    def projected(self) -> int:
        return self.in_use + sum(c["remaining"] // 16 for c in self.cands)

    def __getattr__(self, name):
        if name == "stats":

            async def stats():
                return {
                    "total_blocks": self.total,
                    "projected_blocks": self.projected(),
                    "free_blocks": self.total - self.in_use,
                }

            return _Method(stats)
        if name == "migration_candidates":

            async def cands():
                return list(self.cands)

            return _Method(cands)
        if name == "migrate_out":

            async def move(rid, dest, dest_name, reason):
                self.moves.append((rid, dest_name))
                return MigrationResult(rid, "migrated", self.name, dest_name)

            return _Method(move)
        raise AttributeError(name)


class FakeMembership:
    def __init__(self, *workers: FakeDecode) -> None:
        self.workers = {
            w.name: WorkerInfo(w.name, "decode", w, WorkerState.ACTIVE) for w in workers
        }


def cand(rid: str, tokens: int, remaining: int) -> dict:
    return {
        "request_id": rid,
        "num_tokens": tokens,
        "remaining": remaining,
        "decoding": True,
        "migrating": False,
        "block_size": 16,
    }


def run(m: Migrator, **settings):
    m.rebalance_state.settings = RebalanceSettings(**{"mode": "on", **settings})
    return asyncio.run(m.rebalance_once())


def test_moves_the_request_that_brings_the_source_under_the_high_mark():
    # A: 60 in use + 3 requests still needing 20, 6 and 2 blocks: projected 88 of 100
    a = FakeDecode(
        "a", 100, 60, [cand("big", 320, 320), cand("mid", 160, 96), cand("small", 64, 32)]
    )
    b = FakeDecode("b", 100, 10)
    actions = run(Migrator(FakeMembership(a, b), EventLog()), high=0.85, low=0.6)
    # 3 blocks over the mark: "small" (6 blocks with its remaining) is the least that suffices
    assert [x["request_id"] for x in actions] == ["small"]
    assert a.moves == [("small", "b")]
    assert actions[0]["outcome"] == "migrated" and not actions[0]["avoids_preemption"]


def test_dry_run_plans_and_moves_nothing():
    a = FakeDecode("a", 100, 95, [cand("r1", 320, 320)])
    b = FakeDecode("b", 100, 0)
    m = Migrator(FakeMembership(a, b), EventLog())
    actions = run(m, mode="dry-run")
    assert [x["outcome"] for x in actions] == ["planned"] and a.moves == []
    assert m.rebalance_state.as_dict()["recent"][-1]["request_id"] == "r1"


def test_hysteresis_and_no_room():
    # between the marks: nothing moves
    a = FakeDecode("a", 100, 80, [cand("r1", 32, 0)])
    b = FakeDecode("b", 100, 10)
    assert run(Migrator(FakeMembership(a, b), EventLog())) == [] and a.moves == []
    # above high, but the only destination is above low: nothing moves
    a = FakeDecode("a", 100, 95, [cand("r1", 32, 0)])
    b = FakeDecode("b", 100, 70)
    assert run(Migrator(FakeMembership(a, b), EventLog())) == []
    # above high, the request is bigger than the room below low on the destination: no move
    a = FakeDecode("a", 100, 95, [cand("huge", 1600, 0)])
    b = FakeDecode("b", 100, 10)
    assert run(Migrator(FakeMembership(a, b), EventLog())) == []


def test_a_source_past_its_whole_pool_counts_a_preemption_avoided():
    a = FakeDecode("a", 100, 90, [cand("r1", 160, 320), cand("r2", 160, 320)])  # projected 130
    b = FakeDecode("b", 100, 0)
    m = Migrator(FakeMembership(a, b), EventLog())
    actions = run(m, max_moves=2)
    # the first move takes it back to its pool's size (100 of 100): the second no longer avoids
    assert [x["avoids_preemption"] for x in actions] == [True, False]
    assert m.rebalance_state.preemptions_avoided == 1
    assert m.rebalance_state.moves["migrated"] == 2


def test_settings_are_checked():
    m = Migrator(FakeMembership(), EventLog())
    with pytest.raises(ValueError):
        m.configure(mode="sometimes")
    with pytest.raises(ValueError):
        m.configure(low=0.9, high=0.5)
