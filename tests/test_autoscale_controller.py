"""The autoscaler inside the controller (cluster/control/autoscaling.py): the signals it measures from
its workers' stats and the routers' load reports, the decisions it logs and carries out through
``scale``, its policy as the operator changes it, and what a router hears back for /metrics.

The workers here are stand-ins answering ``stats()`` with set figures, and ``scale`` is
recorded rather than run (its real runs, spawning and draining actors: tests/test_operator.py
and benchmarks/autoscale.py)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.control.controller import Controller, Refused, WorkerSpec
from engine.messages import WorkerInfo, WorkerState

FAST = {"up_after_s": 0, "down_after_s": 0, "cooldown_s": 0, "max_replicas": 3}


class Method:
    """An actor method's stand-in: ``.options(...).remote()`` gives an awaitable."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        async def call():
            return self.fn(*args, **kwargs)

        return call()


class Worker:
    def __init__(self, **stats) -> None:
        self.figures = {"total_blocks": 100, "in_use_blocks": 0, "running": 0, "waiting": 0}
        self.figures.update(stats)
        self.stats = Method(lambda: dict(self.figures))


def recent(p90: float) -> dict:
    return {"p50": p90 / 2, "p90": p90, "p99": p90, "n": 10}


def make(workers: dict[str, Worker], **autoscale) -> tuple[Controller, list]:
    """A controller (built on a running loop) with these workers ACTIVE; its scale() calls
    are recorded in the returned list."""
    c = Controller(WorkerSpec(model_dir="m", cluster_id="t"), autoscale=autoscale)
    for name, w in workers.items():
        role = name.rpartition("-")[0]
        c.membership.workers[name] = WorkerInfo(name, role, w, WorkerState.ACTIVE, max_num_seqs=4)
        c.scaler.roles.add(role)
    calls = []

    async def scale(role, replicas, wait=True, force=False, reason="operator", **_):
        calls.append((role, replicas, reason))
        if replicas == 0:
            raise Refused("below one worker")
        return {}

    c.scaler.scale = scale  # autoscaling carries its decisions out through the scaler
    return c, calls


def events(c: Controller, type_: str) -> list[dict]:
    return [e for e in c.event_log if e["type"] == type_]


def run(coro):
    return asyncio.run(coro)


def test_router_demand_over_the_slots_grows_the_decode_pool() -> None:
    async def go():
        c, calls = make(
            {"prefill-0": Worker(), "decode-0": Worker(running=2)},
            decode={**FAST, "slo_s": None},
        )
        # the router holds 4 slots' worth and queues 3 more: (4 + 3) / 4 slots = 1.75
        answer = await c.report_load("r1", {"running": 4, "queued": 3})
        assert answer["counts"] == [] and answer["pools"] == {"decode": 1, "prefill": 1}
        taken = await c.autoscale_once()
        assert [(d["role"], d["direction"], d["target"], d["signal"]) for d in taken] == [
            ("decode", "out", 2, "slots")
        ]
        assert calls == [("decode", 2, "autoscaler: " + taken[0]["reason"])]
        assert taken[0]["reason"].startswith("slots 1.75 > 0.85")
        (event,) = events(c, "autoscale")
        assert event["inputs"]["pressures"]["slots"] == 1.75
        assert event["inputs"]["signals"]["kv_used"] == 0.0
        # a router hears the count back (what its /metrics exports)
        answer = await c.report_load("r1", {"running": 4, "queued": 0})
        assert answer["counts"] == [
            {"role": "decode", "direction": "out", "reason": "slots", "count": 1}
        ]
        assert answer["latest"]["decode"]["signal"] == "slots"

    run(go())


def test_without_fresh_router_reports_the_workers_queues_count(monkeypatch) -> None:
    import cluster.control.autoscaling as autoscaling

    async def go():
        c, _ = make({"decode-0": Worker(running=1, waiting=0)}, decode=FAST)
        await c.report_load("r1", {"running": 40, "queued": 40})
        monkeypatch.setattr(autoscaling, "ROUTER_LOAD_TTL_S", 0.0)  # the report is stale now
        signals = await c.pool_signals("decode")
        assert signals.slots_used == 0.25  # the worker's 1 running of its 4 slots
        assert await c.autoscale_once() == []

    run(go())


def test_prefill_backlog_and_recent_ttft_drive_the_prefill_pool() -> None:
    async def go():
        c, calls = make(
            {
                "prefill-0": Worker(waiting_prompt_tokens=9000),
                "prefill-1": Worker(
                    waiting_prompt_tokens=11000, latency_recent={"ttft_s": recent(3.0)}
                ),
                "decode-0": Worker(),
            },
            prefill={**FAST, "queue_tokens": 8000, "slo_s": 2.0},
        )
        signals = await c.pool_signals("prefill")
        assert signals.queued_tokens == 20000 and signals.ttft_p90_s == 3.0
        assert signals.slots_used is None and signals.kv_used is None  # not a prefill's
        (d,) = await c.autoscale_once()
        # queue 20000 / 2 workers / 8000 = 1.25 < ttft 3.0 / 2.0 = 1.5: ttft is the reason
        assert (d["role"], d["target"], d["signal"]) == ("prefill", 3, "ttft")
        assert calls[0][:2] == ("prefill", 3)

    run(go())


def test_a_quiet_pool_shrinks_by_one_and_a_refusal_is_survived() -> None:
    async def go():
        c, calls = make(
            {"decode-0": Worker(), "decode-1": Worker(), "prefill-0": Worker()},
            decode={**FAST, "min_replicas": 1, "slo_s": 0.5},
        )
        await c.report_load("r1", {"running": 1, "queued": 0})
        (d,) = await c.autoscale_once()  # 1 / 8 slots, as if 1 worker: 0.25 < 0.5
        assert (d["direction"], d["replicas"], d["target"]) == ("in", 2, 1)
        assert calls == [("decode", 1, "autoscaler: " + d["reason"])]
        # a draining worker is in the live pool: the target moves it by the same difference
        c.membership.workers["decode-1"] = WorkerInfo(
            "decode-1", "decode", Worker(), WorkerState.DRAINING, max_num_seqs=4
        )
        c.membership.workers["decode-2"] = WorkerInfo(
            "decode-2", "decode", Worker(), WorkerState.ACTIVE, max_num_seqs=4
        )
        calls.clear()
        (d,) = await c.autoscale_once()
        assert (d["replicas"], d["target"]) == (2, 1) and calls[0][:2] == ("decode", 2)
        # scale() refusing (below one worker, say) is an event of its own, not a crash
        c.membership.workers.pop("decode-2")
        c.membership.workers.pop("decode-1")
        c.autoscaler.config.decode.min_replicas = 1
        (d,) = await c.autoscale_once() or [None]
        assert d is None  # one worker, at min_replicas: nothing
        await c.autoscaling._carry_out(c.autoscaler._decide("decode", "in", 1, 0, "kv", "test", {}))
        assert calls[-1][:2] == ("decode", 0)

    run(go())


def test_a_pool_being_scaled_is_not_looked_at() -> None:
    async def go():
        c, calls = make({"decode-0": Worker(running=4, waiting=4)}, decode=FAST)
        c.scaler.running["decode"] = {"role": "decode", "replicas": 2, "started": 0.0}
        assert await c.autoscale_once() == [] and calls == []

    run(go())


def test_set_policy_turns_the_loop_on_and_off_and_checks_every_field() -> None:
    async def go():
        c, _ = make({"decode-0": Worker()})
        assert c.policy()["autoscale"]["enabled"] is False and c.autoscaling._loop is None
        policy = await c.set_policy(
            autoscale={"enabled": True, "interval_s": 60, "decode": {"max_replicas": 5}}
        )
        assert policy["autoscale"]["decode"]["max_replicas"] == 5
        assert policy["autoscale"]["decode"]["min_replicas"] == 1  # the rest kept
        assert c.autoscaling._loop is not None and not c.autoscaling._loop.done()
        with pytest.raises(ValueError, match="min"):
            await c.set_policy(
                health={"interval_s": 9.0}, autoscale={"decode": {"min_replicas": 9}}
            )
        with pytest.raises(ValueError, match="nonsense"):
            await c.set_policy(autoscale={"decode": {"nonsense": 1}})
        assert c.membership.health.interval_s != 9.0  # nothing of a refused change applies
        assert c.policy()["autoscale"]["decode"]["max_replicas"] == 5
        task = c.autoscaling._loop
        await c.set_policy(autoscale={"enabled": False})
        await asyncio.sleep(0)
        assert c.autoscaling._loop is None and task.cancelled()
        assert [e["policy"]["autoscale"]["enabled"] for e in events(c, "policy")] == [True, False]

    run(go())


def test_the_router_reports_its_admission_and_keeps_the_answer() -> None:
    from router.metrics import BackendCollector
    from router.service import ClusterBackend

    class Controller_:
        def __init__(self) -> None:
            self.reports = []
            self.report_load = Method(self.answer)

        def answer(self, router, load):
            self.reports.append((router, load))
            return {
                "counts": [{"role": "decode", "direction": "in", "reason": "slots", "count": 2}],
                "pools": {"decode": 1},
                "latest": {"decode": {"pressures": {"slots": 0.2, "kv": 0.1}}},
            }

    backend = ClusterBackend.__new__(ClusterBackend)  # only what _report_load reads
    backend.members = type("M", (), {"controller": Controller_()})()
    backend.admission = type("A", (), {"running": {1, 2}, "queue": {3: None}})()
    backend.router_id, backend.stats_timeout_s, backend.control = "gw-1", 1.0, {}
    asyncio.run(backend._report_load())
    assert backend.members.controller.reports == [("gw-1", {"running": 2, "queued": 1})]
    router = type("R", (), {"control": backend.control})()
    text = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in BackendCollector([], router, "smollm2")._control_metrics()
        for s in m.samples
    }
    labels = (
        ("direction", "in"),
        ("model_name", "smollm2"),
        ("reason", "slots"),
        ("role", "decode"),
    )
    assert text[("tandem:scaling_decisions_total", labels)] == 2
    assert text[("tandem:pool_replicas", (("model_name", "smollm2"), ("role", "decode")))] == 1
    key = (("model_name", "smollm2"), ("role", "decode"), ("signal", "kv"))
    assert text[("tandem:autoscaler_pressure", key)] == 0.1


def test_a_short_pool_takes_a_flex_worker_the_other_pool_can_spare() -> None:
    async def go():
        c, calls = make(
            {
                "flex-0": Worker(),
                "flex-1": Worker(),
                "flex-2": Worker(running=4, waiting=4),
            },
            decode={**FAST, "slo_s": None},
            prefill={**FAST, "min_replicas": 1},
        )
        c.spec.role_switching = True
        for name, role in (("flex-0", "prefill"), ("flex-1", "prefill"), ("flex-2", "decode")):
            c.membership.workers[name] = WorkerInfo(
                name, role, c.membership.workers[name].handle, WorkerState.ACTIVE, max_num_seqs=4
            )
        c.scaler.roles = {"prefill", "decode"}
        switched = []

        async def switch_role(worker, role, deadline_s=60.0, reason=""):
            switched.append((worker, role, reason))
            return {}

        c.scaler.switch_role = switch_role
        # prefill is quiet (and, looked at first, known to be), decode's 8 requests fill 4 slots
        taken = await c.autoscale_once()
        await asyncio.sleep(0)  # the switch runs as a task
        assert [(d["role"], d["direction"]) for d in taken] == [("decode", "out")]
        assert calls == []  # no new worker started
        assert switched and switched[0][:2] == ("flex-1", "decode")  # the newest spare one
        assert "prefill has one to spare" in switched[0][2]
        # without role switching the same decision starts a worker
        c.spec.role_switching = False
        switched.clear()
        c.autoscaler._pools["decode"].last_decision = -1e9
        await c.autoscale_once()
        await asyncio.sleep(0)
        assert switched == [] and [c[:2] for c in calls] == [("decode", 2), ("prefill", 1)]

    run(go())


def test_scale_refuses_a_pool_no_router_would_send_requests_to() -> None:
    """The controller's own checks (the real ``scale``, nothing spawned: each is refused
    before that): a decode pool without a prefill worker, a pool of a role the cluster was
    not started with; both logged as refused scale events naming what to run instead."""

    async def go():
        c = Controller(WorkerSpec(model_dir="m", cluster_id="t"))
        c.membership.workers["colocated-0"] = WorkerInfo(
            "colocated-0", "colocated", Worker(), WorkerState.ACTIVE
        )
        c.scaler.roles.add("colocated")
        with pytest.raises(Refused, match="started without decode workers") as e:
            await c.scale("decode", 2)
        assert "tandem scale --role colocated --replicas 2" in str(e.value)
        assert "without a prefill worker" in str(e.value)
        # a disaggregated cluster whose prefill pool went to 0 (forced): decode alone is refused
        c.scaler.roles = {"prefill", "decode"}
        del c.membership.workers["colocated-0"]
        with pytest.raises(Refused, match="no prefill worker") as e:
            await c.scale("decode", 1)
        assert "tandem scale --role prefill --replicas 1" in str(e.value)
        assert [x["phase"] for x in events(c, "scale")] == ["refused", "refused"]
        assert c.membership.workers == {} and c.scaler.running == {}

    run(go())
