"""ClusterBackend's routing state against a real Redis index and stand-in workers (no Ray
actors: each worker answers ``stats`` or is dead). The end-to-end path is tests/test_serve.py."""

from __future__ import annotations

import asyncio

import pytest

from cluster.local import WorkerRef
from engine.block_manager import prefix_block_hashes
from engine.sampling_params import SamplingParams

ray_exceptions = pytest.importorskip("ray.exceptions")

BS = 4


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self.fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting router
            fut.set_exception(exc)
        return fut


class Handle:
    def __init__(self, name: str) -> None:
        self.dead = False
        self.stats = Method(self._stats)
        self.name = name

    def _stats(self):
        if self.dead:
            raise ray_exceptions.RayActorError()
        return {"name": self.name, "free_blocks": 100, "cached_blocks": 0, "running": 0}


class Cluster:
    """What ClusterBackend reads of a LocalCluster."""

    def __init__(self) -> None:
        self.prefill = [
            WorkerRef(f"prefill-{i}", "prefill", Handle(f"prefill-{i}"), index_id=f"c/prefill-{i}")
            for i in range(2)
        ]
        self.decode = [WorkerRef("decode-0", "decode", Handle("decode-0"))]
        self.colocated: list[WorkerRef] = []
        self.model_dir, self.tokenizer, self.max_model_len, self.block_size = "m", None, 64, BS

    @property
    def workers(self):
        return self.prefill + self.decode + self.colocated

    def forget(self, name: str) -> None:
        for pool in (self.prefill, self.decode, self.colocated):
            pool[:] = [w for w in pool if w.name != name]


@pytest.fixture(scope="module")
def redis():
    from router.redis_server import RedisServer

    with RedisServer() as server:
        yield server


def test_a_dead_worker_stops_counting_at_once(redis) -> None:
    from router.backend import Overloaded
    from router.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "dead-worker-test")
    cluster = Cluster()
    backend = ClusterBackend(cluster, index=index)
    ids = list(range(3 * BS + 1))
    hashes = prefix_block_hashes(ids, BS)
    for w in cluster.prefill:
        index.heartbeat(w.index_id)
        index.publish(w.index_id, hashes[:2], [])

    async def scenario():
        req = await backend._route_request(ids, None)
        assert req.cached_blocks == {"prefill-0": 2, "prefill-1": 2}
        cluster.prefill[0].handle.dead = True
        assert not await backend.healthy()  # a worker did not answer
        assert [w.name for w in cluster.prefill] == ["prefill-1"]
        assert index.lookup(hashes) == {"c/prefill-1": 2}  # for every router, not only this one
        req = await backend._route_request(ids, None)
        assert req.cached_blocks == {"prefill-1": 2}
        assert await backend.healthy()  # what is left answers
        cluster.prefill[0].handle.dead = True
        assert not await backend.healthy()
        with pytest.raises(Overloaded, match="no live workers"):
            await backend.open("r", ids, SamplingParams())
        await backend.aclose()

    try:
        asyncio.run(scenario())
    finally:
        index.close()


def test_a_new_prefix_in_flight_follows_its_first_request(redis) -> None:
    from router.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    index = PrefixIndex(redis.url, "recent-test")
    backend = ClusterBackend(Cluster(), index=index)
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
