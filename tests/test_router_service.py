"""ClusterBackend's routing state and the controller's membership against a real Redis index
and stand-in workers (no Ray actors: each worker answers ``stats`` / ``ready`` or is dead). The
end-to-end path is tests/test_serve.py."""

from __future__ import annotations

import asyncio

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
        self.stats = Method(self._stats)
        self.ready = Method(self._ready)
        self.name = name

    hung = False

    def _stats(self):
        if self.dead:
            raise ray_exceptions.RayActorError()
        if self.hung:
            return asyncio.Event().wait()  # an awaitable that never completes
        return {"name": self.name, "free_blocks": 100, "cached_blocks": 0, "running": 0}

    def _ready(self):
        return {"name": self._stats()["name"]}


class Controller:
    """Stands in for the controller actor: ``report_dead`` reaches a real Controller."""

    def __init__(self, real) -> None:
        self.real = real
        self.report_dead = Method(lambda name, why: asyncio.ensure_future(real.report_dead(name)))


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
    from cluster.controller import Controller as RealController
    from cluster.controller import WorkerSpec
    from engine.prefix_index import PrefixIndex
    from router.backend import Overloaded
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "dead-worker-test")
    members = table(tmp_path)
    spec = WorkerSpec(str(tmp_path), index_url=redis.url, index_namespace="dead-worker-test")
    controller = RealController(spec)
    controller._workers = {w.name: w for w in members.workers}
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
        assert not await backend.healthy()  # a worker did not answer
        assert [w.name for w in view.prefill] == ["prefill-1"]  # this router: at once
        for _ in range(100):  # the controller confirms, marks it dead, clears its index entries
            await asyncio.sleep(0.01)
            if controller._workers["prefill-0"].state == WorkerState.DEAD:
                break
        assert controller._workers["prefill-0"].state == WorkerState.DEAD
        assert controller.version == 1  # a new table for every router
        assert index.lookup(hashes) == {"c/prefill-1": 2}  # for every router, not only this one
        req = await backend._route_request(ids, None)
        assert req.cached_blocks == {"prefill-1": 2}
        assert await backend.healthy()  # what is left answers
        view.prefill[0].handle.dead = True
        assert not await backend.healthy()
        with pytest.raises(Overloaded, match="no live workers"):
            await backend.open("r", ids, SamplingParams())
        await backend.aclose()

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_hung_worker_misses_polls_without_blinding_the_router(tmp_path) -> None:
    """Each worker's stats poll has its own deadline: the others stay current."""
    from router.service import ClusterBackend

    view = MembershipView(table(tmp_path))
    backend = ClusterBackend(view, tokenizer=object(), stats_timeout_s=0.1)
    hung = view.prefill[0]
    hung.handle.hung = True

    async def scenario():
        for _ in range(3):
            assert not await backend.healthy()
        assert backend.missed_polls == {hung.name: 3}
        assert {"prefill-1", "decode-0"} <= set(backend._polled)
        hung.handle.hung = False
        assert await backend.healthy() and not backend.missed_polls
        await backend.aclose()

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
