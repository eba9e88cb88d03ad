"""ClusterBackend's routing state and the controller's membership against a real Redis index
and stand-in workers (no Ray actors: each worker answers ``stats`` / ``ready`` or is dead). The
end-to-end path is tests/test_serve.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine.block_manager import prefix_block_hashes
from engine.messages import Membership, WorkerInfo, WorkerState
from engine.sampling_params import SamplingParams
from router.membership import MembershipView

ray_exceptions = pytest.importorskip("ray.exceptions")

BS = 4


class Method:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):  # a concurrency group: one loop here
        return self

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        try:
            result = self.fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting router
            fut.set_exception(exc)
            return fut
        if asyncio.iscoroutine(result):  # a call that has not answered yet
            return result
        fut.set_result(result)
        return fut


class Handle:
    def __init__(self, name: str) -> None:
        self.dead = False
        self.hung = False  # the process: nothing answers
        self.step_age_s = 0.0  # the engine thread: a step running this long
        self.stats = Method(self._stats)
        self.health = Method(self._health)
        self.ready = Method(self._ready)
        self.name = name
        self.extra_stats: dict = {}

    def _answer(self, value):
        if self.dead:
            raise ray_exceptions.RayActorError()
        if self.hung:
            return asyncio.Event().wait()  # an awaitable that never completes
        return value

    def _stats(self):
        if self.step_age_s > 0:  # stats wait for the engine thread
            return self._answer(asyncio.Event().wait())
        stats = {"name": self.name, "free_blocks": 100, "cached_blocks": 0, "running": 0}
        return self._answer({**stats, **self.extra_stats})

    def _health(self):
        return self._answer({"name": self.name, "steps": 1, "step_age_s": self.step_age_s})

    def _ready(self):
        return self._answer({"name": self.name})


class Controller:
    """Stands in for the controller actor: reports reach a real Controller."""

    def __init__(self, real) -> None:
        self.real = real
        self.report_dead = Method(lambda name, why: asyncio.ensure_future(real.report_dead(name)))
        self.report_unresponsive = Method(
            lambda name, why: asyncio.ensure_future(real.report_unresponsive(name, why))
        )


def table(tmp_path) -> Membership:
    workers = [
        WorkerInfo(f"prefill-{i}", "prefill", Handle(f"prefill-{i}"), index_id=f"c/prefill-{i}")
        for i in range(2)
    ]
    workers.append(WorkerInfo("decode-0", "decode", Handle("decode-0")))
    return Membership(1, workers, model_dir=str(tmp_path), block_size=BS, max_model_len=64)


@pytest.fixture(scope="module")
def redis():
    from router.redis_server import RedisServer

    with RedisServer() as server:
        yield server


def test_a_dead_worker_stops_counting_at_once(redis, tmp_path) -> None:
    from cluster.control.controller import Controller as RealController
    from cluster.control.controller import WorkerSpec
    from engine.prefix_index import PrefixIndex
    from router.errors import CapacityError
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "dead-worker-test")
    members = table(tmp_path)
    spec = WorkerSpec(str(tmp_path), index_url=redis.url, index_namespace="dead-worker-test")
    controller = RealController(spec)
    controller.membership.workers = {w.name: w for w in members.workers}
    view = MembershipView(members, Controller(controller))
    backend = ClusterBackend(view, index=index)
    ids = list(range(3 * BS + 1))
    hashes = prefix_block_hashes(ids, BS)
    for w in view.prefill:
        index.heartbeat(w.index_id)
        index.publish(w.index_id, hashes[:2], [])

    async def scenario():
        req = await backend._route_request(ids, None)
        assert req.cached_blocks == {"prefill-0": 2, "prefill-1": 2}
        view.prefill[0].handle.dead = True
        assert await backend._poll() == ["prefill-0"]
        assert [w.name for w in view.prefill] == ["prefill-1"]  # this router: at once
        # The controller confirms, marks it dead, then clears its index entries (in a thread:
        # the state changes before the index does, so wait for both).
        deadline = asyncio.get_running_loop().time() + 10
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
            dead = controller.membership.workers["prefill-0"].state == WorkerState.DEAD
            if dead and index.lookup(hashes) == {"c/prefill-1": "00"}:
                break
        assert controller.membership.workers["prefill-0"].state == WorkerState.DEAD
        assert controller.membership.version == 1  # a new table for every router
        assert index.lookup(hashes) == {"c/prefill-1": "00"}  # for every router, not only this one
        req = await backend._route_request(ids, None)
        assert req.cached_blocks == {"prefill-1": 2}
        assert await backend.healthy()  # a prefill and a decode worker are left
        assert backend.router_stats().worker_states == {
            "prefill-0": "dead",
            "prefill-1": "active",
            "decode-0": "active",
        }
        view.prefill[0].handle.dead = True
        await backend._poll()
        assert not await backend.healthy()  # no prefill worker: nothing can be placed
        with pytest.raises(CapacityError, match="no live workers"):
            await backend.open("r", ids, SamplingParams())
        await backend.aclose()

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_hung_worker_misses_polls_without_blinding_the_router(tmp_path) -> None:
    """Each worker's polls have their own deadline: the others stay current. A worker that
    misses ``suspect_after_polls`` in a row gets nothing new until it answers again."""
    from cluster.control.controller import Controller as RealController
    from cluster.control.controller import HealthConfig, WorkerSpec
    from router.service import ClusterBackend

    members = table(tmp_path)
    controller = RealController(WorkerSpec(str(tmp_path)), HealthConfig(timeout_s=0.05))
    controller.membership.workers = {w.name: w for w in members.workers}
    view = MembershipView(members, Controller(controller))
    backend = ClusterBackend(view, tokenizer=object(), stats_timeout_s=0.1)
    hung = view.prefill[0]
    hung.handle.hung = True

    async def scenario():
        for i in range(3):
            assert await backend._poll() == [hung.name]
            assert (hung.name in {w.name for w in view.prefill}) == (i < 2)
        assert backend.missed_polls == {hung.name: 3}
        assert {"prefill-1", "decode-0"} <= set(backend._polled)
        assert backend.router_stats().worker_states[hung.name] == "suspect"
        assert await backend.healthy()  # prefill-1 and decode-0 still take requests
        for _ in range(100):  # the controller checked it too and published SUSPECT
            await asyncio.sleep(0.01)
            if controller.membership.workers[hung.name].state == WorkerState.SUSPECT:
                break
        assert controller.membership.workers[hung.name].state == WorkerState.SUSPECT
        hung.handle.hung = False
        assert await backend._poll() == [] and not backend.missed_polls
        assert hung.name in {w.name for w in view.prefill}  # this router sends to it again
        await backend.aclose()

    asyncio.run(scenario())


def test_a_loading_worker_is_starting_not_suspect(tmp_path, caplog) -> None:
    """A worker the controller has just started answers nothing while it loads its model: the
    router does not poll it (no missed polls, no "suspect" warning, no report to the
    controller) and shows it as starting; once the table says ACTIVE it is polled and routed.
    A draining worker that stops (scaled in) is logged as stopped, not as dead."""
    import logging
    from dataclasses import replace

    from router.service import ClusterBackend

    members = table(tmp_path)
    loading = WorkerInfo("decode-1", "decode", Handle("decode-1"), WorkerState.STARTING)
    loading.handle.hung = True
    members = replace(members, workers=[*members.workers, loading])
    view = MembershipView(members)
    backend = ClusterBackend(view, tokenizer=object(), stats_timeout_s=0.05)

    async def scenario():
        with caplog.at_level(logging.INFO, logger="router.membership"):
            for _ in range(4):
                assert await backend._poll() == []
            assert not backend.missed_polls
            assert backend.router_stats().worker_states["decode-1"] == "starting"
            assert "suspect" not in caplog.text
            loading.handle.hung = False  # up: the controller publishes it ACTIVE
            view.apply(
                replace(
                    members,
                    version=2,
                    workers=[*members.workers[:-1], replace(loading, state=WorkerState.ACTIVE)],
                )
            )
            assert await backend._poll() == []
            assert "decode-1" in backend._polled and len(view.decode) == 2
            # scaled in: DRAINING, then its actor stops before this router sees the new table
            view.apply(
                replace(
                    members,
                    version=3,
                    workers=[*members.workers[:-1], replace(loading, state=WorkerState.DRAINING)],
                )
            )
            loading.handle.dead = True
            assert await backend._poll() == ["decode-1"]
        assert "decode-1 (draining) has stopped" in caplog.text
        assert "is dead" not in caplog.text
        await backend.aclose()

    asyncio.run(scenario())


def test_a_long_step_is_not_a_miss_but_a_hung_engine_thread_is(tmp_path) -> None:
    """Stats wait for the engine thread; liveness does not: a step longer than the stats
    deadline keeps the worker's last view without counting against it, a step older than
    the hang deadline makes it suspect although its process answers."""
    from router.service import ClusterBackend

    view = MembershipView(table(tmp_path))
    backend = ClusterBackend(view, tokenizer=object(), stats_timeout_s=0.1, hang_timeout_s=5.0)
    busy = view.decode[0]

    async def scenario():
        assert await backend._poll() == []
        busy.handle.step_age_s = 1.0  # a long step: stats time out, health answers
        for _ in range(4):
            assert await backend._poll() == []
        assert backend._polled[busy.name]["free_blocks"] == 100  # the last view is kept
        assert view.decode == [busy]
        busy.handle.step_age_s = 6.0  # the engine thread is stuck
        for _ in range(3):
            assert await backend._poll() == [busy.name]
        assert view.decode == [] and not await backend.healthy()
        from router.errors import CapacityError
        from router.policy import RouteRequest

        with pytest.raises(CapacityError, match="no live workers"):  # a retry's placement: 503
            backend._place(RouteRequest(8, BS), True, set())
        busy.handle.step_age_s = 0.0
        await backend._poll()
        assert view.decode == [busy] and await backend.healthy()
        await backend.aclose()

    asyncio.run(scenario())


def test_the_controller_moves_a_worker_through_suspect_to_dead(tmp_path, monkeypatch) -> None:
    """ACTIVE -> SUSPECT after missed checks or a hung step, back to ACTIVE when it answers,
    DEAD (and killed) when it stays silent past dead_after_s; each change is a new table."""
    import ray

    from cluster.control.controller import Controller as RealController
    from cluster.control.controller import HealthConfig, WorkerSpec

    killed = []  # the stand-in handles are not actors (a real ray.kill would start Ray here)
    monkeypatch.setattr(ray, "kill", lambda handle, **_: killed.append(handle.name))

    members = table(tmp_path)
    health = HealthConfig(timeout_s=0.05, suspect_after=2, hang_after_s=1.0, dead_after_s=0.3)
    controller = RealController(WorkerSpec(str(tmp_path)), health)
    controller.membership.workers = {w.name: w for w in members.workers}
    w = members.workers[0]
    states = lambda: controller.membership.workers[w.name].state  # noqa: E731

    async def check():
        await controller.membership.check_one(controller.membership.workers[w.name])

    async def scenario():
        w.handle.hung = True
        await check()
        assert states() == WorkerState.ACTIVE  # one miss is not enough
        await check()
        assert states() == WorkerState.SUSPECT and controller.membership.version == 1
        w.handle.hung = False
        await check()
        assert states() == WorkerState.ACTIVE and controller.membership.version == 2
        w.handle.step_age_s = 2.0  # answers, but its engine thread is stuck
        await check()
        assert states() == WorkerState.SUSPECT
        await asyncio.sleep(0.35)
        await check()
        assert states() == WorkerState.DEAD  # suspect past dead_after_s
        assert killed == [w.name]
        assert [t[2] for t in controller.membership.transitions] == [
            "SUSPECT",
            "ACTIVE",
            "SUSPECT",
            "DEAD",
        ]
        other = members.workers[1]
        other.handle.dead = True
        await controller.membership.check_one(controller.membership.workers[other.name])
        assert controller.membership.workers[other.name].state == WorkerState.DEAD  # at once

    asyncio.run(scenario())


def test_a_new_prefix_in_flight_follows_its_first_request(redis, tmp_path) -> None:
    from engine.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "recent-test")
    backend = ClusterBackend(MembershipView(table(tmp_path)), index=index)
    ids = list(range(100, 100 + 4 * BS))
    hashes = prefix_block_hashes(ids, BS)

    async def scenario():
        assert (await backend._route_request(ids, None)).cached_blocks == {}
        backend._remember(hashes, "prefill-1")  # what open() does once it placed a request
        req = await backend._route_request(ids[: 2 * BS] + [7] * (2 * BS), None)
        assert req.cached_blocks == {"prefill-1": 2}  # the shared two blocks, nothing after
        backend.recent_ttl_s = 0.0
        backend._remember(hashes, "prefill-1")
        assert (await backend._route_request(ids, None)).cached_blocks == {}  # expired

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_host_hit_is_priced_by_the_holders_measured_tier_costs(redis, tmp_path) -> None:
    """The index says prefill-0 holds the prompt's blocks in host memory: once its stats report
    its tier costs (``kv_tiers.costs``) the hit is priced at the load, and it wins the prompt;
    without them a lower tier is priced as a recompute (both equal: no hit to prefer)."""
    from engine.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "tier-cost-test")
    members = table(tmp_path)
    backend = ClusterBackend(MembershipView(members), index=index)
    ids = list(range(200, 200 + 3 * BS + 1))
    hashes = prefix_block_hashes(ids, BS)
    holder = members.workers[0]
    index.heartbeat(holder.index_id)
    index.publish(holder.index_id, hashes, [], tier="host")

    async def scenario():
        await backend._poll()
        req = await backend._route_request(ids, None)
        assert req.cached_tiers == {"prefill-0": "111"}
        assert backend._place(req, True, set())[2] == "load"
        costs = {"host_load_s": 1e-4, "disk_load_s": float("inf"), "recompute_s": 1e-3}
        holder.handle.extra_stats = {"kv_tiers": {"costs": costs}}
        await backend._poll()
        for _ in range(10):
            assert backend._place(req, True, set()) == ("prefill-0", "decode-0", "prefix_hit_host")
        assert req.prefill_tokens("prefill-0", backend._tier_load("prefill-0")) == pytest.approx(
            1 + 3 * BS * 0.1
        )

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_next_turn_is_prefilled_where_its_history_is(redis, tmp_path) -> None:
    """``local_prefill_tokens``: a prompt the decode worker holds all of but a short suffix
    (published by it, or the router's memory of a finished answer) goes to that decode worker
    whole, no prefill worker; a longer suffix, the setting at 0, the worker to avoid or a full
    one keep the disaggregated placement. A retry of a local turn is placed disaggregated
    again."""
    from engine.prefix_index import PrefixIndex
    from router.routed import RoutedRequest
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "local-prefill-test")
    members = table(tmp_path)
    decode = members.workers[2] = replace(members.workers[2], index_id="c/decode-0")
    view = MembershipView(members)
    backend = ClusterBackend(view, index=index, local_prefill_tokens=2 * BS)
    history = list(range(300, 300 + 6 * BS))  # turn 1's prompt and answer: 6 blocks
    index.heartbeat(decode.index_id)
    index.publish(decode.index_id, prefix_block_hashes(history, BS), [])

    async def scenario():
        short = await backend._route_request(history + [9] * (BS + 1), None)  # 1 block more
        assert short.cached_tiers == {"decode-0": "000000"}
        assert backend._place(short, True, set()) == (None, "decode-0", "local_prefill")
        long = await backend._route_request(history + [9] * (3 * BS), None)
        assert backend._place(long, True, set())[0] in ("prefill-0", "prefill-1")
        assert backend._place(short, True, {"decode-0"})[0] in ("prefill-0", "prefill-1")
        routed = RoutedRequest("r", history + [9] * (BS + 1), SamplingParams(), None, "decode-0")
        routed.route, routed.avoid = short, {"decode-0"}
        assert backend.place_again(routed)[0] in ("prefill-0", "prefill-1")
        backend.local_prefill_tokens = 0
        assert backend._place(short, True, set())[0] in ("prefill-0", "prefill-1")
        backend.local_prefill_tokens = 2 * BS
        decode.handle.extra_stats = {"free_blocks": 0, "cached_blocks": 0}  # full
        await backend._poll()
        assert backend._place(short, True, set())[0] in ("prefill-0", "prefill-1")
        decode.handle.extra_stats = {}
        await backend._poll()
        assert backend._place(short, True, set())[0] is None

        # A finished disaggregated answer: the router remembers it on its decode worker.
        backend.local_prefill_tokens = 2 * BS
        prompt, answer = list(range(900, 900 + 3 * BS)), list(range(50, 50 + 2 * BS))
        done = RoutedRequest("t1", prompt, SamplingParams(), "prefill-0", "decode-0")
        backend._remember_answer(done, answer)
        turn2 = await backend._route_request(prompt + answer + [5] * 3, None)
        assert turn2.cached_blocks == {"decode-0": 4}  # the last answer token has no KV yet
        assert backend._place(turn2, True, set()) == (None, "decode-0", "local_prefill")

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_burst_is_placed_in_linear_time_and_stays_balanced(tmp_path, monkeypatch) -> None:
    """With a length predictor the cache-aware policy balances decode workers by their
    requests' predicted output still to come. Summing it over every running request for each placement made a burst of N requests
    quadratic (1000 at once kept the gateway from streaming any token for seconds); the sum is
    now kept ``work_ttl_s`` and each placement adds its own request, so a burst still
    alternates between equal workers and calls ``remaining()`` about once per request."""
    from router.admission import Ticket
    from router.policy import RouteRequest
    from router.predictor import ORACLE_HEADER, OraclePredictor, PredictInput
    from router.service import ClusterBackend

    workers = [WorkerInfo(f"c-{i}", "decode", Handle(f"c-{i}")) for i in range(2)]
    workers.append(WorkerInfo("p-0", "prefill", Handle("p-0")))
    members = Membership(1, workers, model_dir=str(tmp_path), block_size=BS, max_model_len=64)
    backend = ClusterBackend(MembershipView(members), predictor=OraclePredictor())
    backend.work_ttl_s = 3600.0  # the whole burst within one sum
    calls = [0]
    remaining = Ticket.remaining

    def counted(ticket):
        calls[0] += 1
        return remaining(ticket)

    monkeypatch.setattr(Ticket, "remaining", counted)
    predictor = OraclePredictor()

    async def burst() -> list[str]:
        placed = []
        for i in range(40):
            hints = PredictInput(prompt_len=8, max_tokens=100, headers={ORACLE_HEADER: "50"})
            ticket = await backend.admission.acquire(f"r{i}", predictor.predict(hints), 100)
            _, d, _ = backend._place_ticket(RouteRequest(8, BS), True, ticket)
            placed.append(d)
        return placed

    placed = asyncio.run(burst())
    for n in range(1, len(placed) + 1):  # every prefix of the burst is balanced
        assert abs(placed[:n].count("c-0") - placed[:n].count("c-1")) <= 1, placed
    assert calls[0] <= 2 * len(placed), f"{calls[0]} remaining() calls for {len(placed)} requests"


def test_one_colocated_worker_is_placed_without_asking_the_index(tmp_path) -> None:
    """With one colocated worker there is nothing to choose: the request goes there without a
    prefix-index lookup (a round trip that a burst's requests would each wait on) and counts as
    ``only_worker``; with two the index is asked and the policy chooses."""
    from router.admission import Ticket
    from router.policy import RouteRequest
    from router.service import ClusterBackend

    class Index:
        def __init__(self) -> None:
            self.lookups = 0

        def lookup_many(self, many):
            self.lookups += len(many)
            return [{} for _ in many]

    def backend_of(n: int) -> tuple[ClusterBackend, Index]:
        workers = [
            WorkerInfo(f"worker-{i}", "colocated", Handle(f"worker-{i}"), index_id=f"c/w{i}")
            for i in range(n)
        ]
        members = Membership(1, workers, model_dir=str(tmp_path), block_size=BS, max_model_len=64)
        index = Index()
        return ClusterBackend(MembershipView(members), index=index), index

    class Started(Exception):
        pass

    async def placed(backend: ClusterBackend) -> tuple:
        def place(req, disagg, ticket):  # where the request would go; stop before dispatching
            raise Started(backend._place(req, disagg, set()))

        backend._place_ticket = place
        ticket = Ticket("r", None, None, 0.0, 1.0)
        with pytest.raises(Started) as info:
            await backend._start(
                "r", list(range(3 * BS)), SamplingParams(), 0, None, False, None, ticket
            )
        return info.value.args[0]

    one, one_index = backend_of(1)
    two, two_index = backend_of(2)
    assert asyncio.run(placed(one)) == (None, "worker-0", "only_worker")
    assert one_index.lookups == 0
    assert one._place(RouteRequest(5, BS), False, {"worker-0"}) == (None, "worker-0", "only_worker")
    _, name, reason = asyncio.run(placed(two))
    assert two_index.lookups == 1 and reason == "load" and name in ("worker-0", "worker-1")
