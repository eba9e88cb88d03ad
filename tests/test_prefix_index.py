"""Global prefix index against a real redis-server (router.redis_server): lookups, liveness,
the worker-side publisher across Redis outages and restarts, and the server process itself."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.block_manager import prefix_block_hashes
from engine.prefix_index import DISK, HOST, IndexPublisher, IndexUnavailable, PrefixIndex
from router.redis_server import RedisServer

BS = 4


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return prefix_block_hashes(tokens, BS, salt)


def wait_for(pred, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def index(server):
    idx = PrefixIndex(server.url, f"test-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=5.0)
    yield idx
    idx.close()


@pytest.fixture
def own_server():
    """A server this test may stop and restart."""
    srv = RedisServer().start()
    yield srv
    srv.stop()


class FlakyIndex(PrefixIndex):
    """Redis keeps its data but this client cannot reach it while ``down`` (a network partition)."""

    down = False

    def _check(self):
        if self.down:
            raise IndexUnavailable("partitioned (test)")

    def publish(self, worker, stored, evicted):
        self._check()
        super().publish(worker, stored, evicted)

    def heartbeat(self, worker):
        self._check()
        return super().heartbeat(worker)

    def purge_worker(self, worker):
        self._check()
        return super().purge_worker(worker)


# -- PrefixIndex ---------------------------------------------------------------------------------


def test_lookup_longest_prefix_per_worker(index):
    h = hashes(list(range(32)))  # 8 full blocks
    assert len(h) == 8
    held = {
        "w-all": h,
        "w-3": h[:3],
        "w-1": h[:1],
        "w-gap": [h[0], h[1], h[3], h[4]],  # block 2 missing: prefix is 2
        "w-late": h[1:],  # no block 0: no usable prefix, absent from the result
    }
    for w, hs in held.items():
        index.publish(w, hs, [])
        assert index.heartbeat(w) is False  # first beat creates the key
    assert index.lookup(h) == {"w-all": "00000000", "w-3": "000", "w-1": "0", "w-gap": "00"}
    # A prompt sharing the first 2 blocks then diverging.
    other = hashes(list(range(8)) + [99] * 24)
    assert other[:2] == h[:2] and other[2] != h[2]
    assert index.lookup(other) == {"w-all": "00", "w-3": "00", "w-1": "0", "w-gap": "00"}
    assert index.lookup(h[:1]) == {"w-all": "0", "w-3": "0", "w-1": "0", "w-gap": "0"}
    assert index.lookup(hashes(list(range(100, 132)))) == {}
    assert index.lookup([]) == {}
    # many prompts in one round trip: the same answers, in order, an empty one included
    prompts = [h, other, [], h[:1], hashes(list(range(100, 132)))]
    assert index.lookup_many(prompts) == [index.lookup(p) for p in prompts]
    assert index.lookup_many([]) == [] and index.lookup_many([[]]) == [{}]


def test_lookup_answers_the_tier_of_each_leading_block(index):
    """One tier code per block of a worker's leading run, at any tier: 0 device, 1 host, 2 disk."""
    h = hashes(list(range(24)))
    index.publish("w0", h[:2], [])  # device by default
    index.publish("w0", h[2:4], [], tier="host")
    index.publish("w0", {h[4]: DISK, h[5]: DISK}, [])  # hash -> tier code, the publisher's form
    index.publish("w1", h[:3], [], tier="disk")
    index.publish("w1", h[4:], [], tier="host")  # block 3 missing: its run ends at block 2
    for w in ("w0", "w1"):
        index.heartbeat(w)
    assert index.lookup(h) == {"w0": "001122", "w1": "222"}
    assert index.lookup_many([h, h[:1], h[2:]]) == [
        {"w0": "001122", "w1": "222"},
        {"w0": "0", "w1": "2"},
        {"w0": "1122", "w1": "2"},
    ]
    index.publish("w0", {h[0]: HOST}, [])  # a new tier replaces the old one
    index.publish("w1", [], [h[1]])
    assert index.lookup(h) == {"w0": "101122", "w1": "2"}


def test_eviction_shortens_prefix_and_salts_are_disjoint(index):
    tokens = list(range(24))
    h = hashes(tokens)
    index.publish("w0", h, [])
    index.heartbeat("w0")
    assert index.lookup(h) == {"w0": "000000"}
    index.publish("w0", [], [h[4]])
    assert index.lookup(h) == {"w0": "0000"}
    index.publish("w0", [], [h[0]])
    assert index.lookup(h) == {}
    # A hash in both lists of one publish ends up absent (stored first, then evicted).
    index.publish("w0", [h[0]], [h[0]])
    assert index.lookup(h) == {}

    salted = hashes(tokens, salt="tenant-a")
    assert not set(salted) & set(h) and not set(salted) & set(hashes(tokens, salt="tenant-b"))
    index.publish("w0", [h[0]], [])
    assert index.lookup(h) == {"w0": "0000"}
    assert index.lookup(salted) == {}
    index.publish("w1", salted, [])
    index.heartbeat("w1")
    assert index.lookup(salted) == {"w1": "000000"}
    assert index.lookup(h) == {"w0": "0000"}


def test_namespaces_are_separate(server, index):
    h = hashes(list(range(8)))
    other = PrefixIndex(server.url, index.namespace + "-other")
    try:
        index.publish("w0", h, [])
        index.heartbeat("w0")
        other.heartbeat("w0")
        assert index.lookup(h) == {"w0": "00"}
        assert other.lookup(h) == {}
    finally:
        other.close()


def test_dead_workers_stop_counting(server):
    index = PrefixIndex(server.url, f"test-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=0.3)
    raw = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        h = hashes(list(range(16)))
        for w in ("w0", "w1", "w2"):
            index.publish(w, h, [])
            assert index.heartbeat(w) is False
        assert index.heartbeat("w0") is True  # key already there
        assert index.lookup(h) == {"w0": "0000", "w1": "0000", "w2": "0000"}
        index.remove_worker("w1")
        assert index.lookup(h) == {"w0": "0000", "w2": "0000"}  # at once
        assert raw.hgetall(index.block_key(h[0])) == {"w0": "0", "w2": "0"}  # lazily cleaned
        index.heartbeat("w2")
        # w0 stops beating: its key expires after 0.3 s; w2 keeps beating.
        deadline = time.monotonic() + 3.0
        while "w0" in index.lookup(h):
            assert time.monotonic() < deadline, "w0's liveness key never expired"
            index.heartbeat("w2")
            time.sleep(0.05)
        assert index.lookup(h) == {"w2": "0000"}
        assert index.heartbeat("w0") is False  # expired: the caller must re-publish
        assert index.lookup(h) == {"w2": "0000"}  # its entries were cleaned while it was dead
        assert index.purge_worker("w2") == 4
        assert index.lookup(h) == {}
    finally:
        raw.close()
        index.close()


def test_lookup_fails_fast_when_redis_is_down(own_server):
    index = PrefixIndex(own_server.url, "m")
    h = hashes(list(range(8)))
    index.publish("w0", h, [])
    index.heartbeat("w0")
    assert index.lookup(h) == {"w0": "00"}
    own_server.stop()
    for call in (
        lambda: index.lookup(h),
        lambda: index.lookup_many([h, h]),
        lambda: index.publish("w0", h, []),
        lambda: index.heartbeat("w0"),
        lambda: index.remove_worker("w0"),
    ):
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailable):
            call()
        assert time.monotonic() - t0 < 1.0
    index.close()


def test_lookup_times_out_when_redis_hangs():
    """A peer that accepts connections but never answers: one socket timeout, no retries."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        index = PrefixIndex(f"redis://:pw@127.0.0.1:{port}/0", "m", socket_timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailable):
            index.lookup(hashes(list(range(8))))
        assert time.monotonic() - t0 < 1.0
        index.close()


# -- IndexPublisher ------------------------------------------------------------------------------


def test_publisher_pushes_and_rebuilds_after_restart(own_server):
    index = PrefixIndex(own_server.url, "m", heartbeat_ttl_s=2.0)
    pub = IndexPublisher(index, "w0", interval_s=0.02, heartbeat_s=0.1)
    try:
        h = hashes(list(range(24)))
        pub.push(h[:2], [])
        pub.push(h[2:], [])
        wait_for(lambda: index.lookup(h) == {"w0": "000000"}, what="pushed blocks in lookup")
        assert pub.published_events >= 6 and pub.republished >= 1

        # Redis restarts with no data: the heartbeat notices, the mirror is re-published.
        republished = pub.republished
        own_server.restart()
        wait_for(lambda: pub.republished > republished, what="a full re-publish")
        wait_for(lambda: index.lookup(h) == {"w0": "000000"}, what="blocks back after restart")

        # Redis goes away; meanwhile block 3 is evicted and another prompt is cached.
        failures = pub.failures
        own_server.stop()
        other = hashes(list(range(50, 66)))
        pub.push(other, [h[3]])  # never raises, never blocks
        wait_for(lambda: pub.failures > failures, what="the publisher to see the outage")
        pub.push([], [])
        own_server.start()  # same port and password, empty
        wait_for(lambda: index.lookup(other) == {"w0": "0000"}, what="blocks pushed while down")
        assert index.lookup(h) == {"w0": "000"}  # the eviction was not undone
        assert pub.num_held == 5 + 4
    finally:
        pub.close()
    assert index.lookup(h) == {}  # close() removed the worker
    index.close()


def test_push_never_raises_while_down(own_server):
    own_server.stop()
    index = PrefixIndex(own_server.url, "m")
    pub = IndexPublisher(index, "w0", interval_s=0.01)
    try:
        t0 = time.monotonic()
        for i in range(200):
            pub.push(hashes(list(range(i, i + 8))), [])
        assert time.monotonic() - t0 < 0.5
        wait_for(lambda: pub.failures > 0, what="a failed round")
        assert pub.published_events == 0
    finally:
        t0 = time.monotonic()
        pub.close()  # best effort, never raises
        assert time.monotonic() - t0 < 2.0
        index.close()


@pytest.mark.parametrize("max_pending", [100_000, 3])
def test_eviction_during_partition_is_not_resurrected(server, max_pending):
    """Redis keeps its data while the worker cannot reach it: the hashes evicted meanwhile are
    removed on reconnect, also when they overflow max_pending (then a purge runs first)."""
    index = FlakyIndex(server.url, f"test-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=5.0)
    pub = IndexPublisher(index, "w0", interval_s=0.01, heartbeat_s=0.1, max_pending=max_pending)
    try:
        h = hashes(list(range(32)))
        pub.push(h, [])
        wait_for(lambda: index.lookup(h) == {"w0": "00000000"}, what="initial publish")
        index.down = True
        failures = pub.failures
        pub.push([], h[5:])  # evicted while partitioned
        pub.push([], [h[1]])
        pub.push([h[1]], [])  # stored again
        pub.push([], [h[2]])
        wait_for(lambda: pub.failures > failures, what="a failed round")
        assert index.lookup(h) == {"w0": "00000000"}  # Redis still has the old state
        index.down = False
        wait_for(lambda: index.lookup(h) == {"w0": "00"}, what="evictions applied")
        assert index.lookup(h[3:]) == {"w0": "00"}  # h[3], h[4] still held; h[5:] gone
    finally:
        pub.close()
        index.close()


def test_push_interleaved_events_in_one_batch(server, index):
    """drain_events() loses the order between stored and evicted: held + #stored - #evicted."""
    pub = IndexPublisher(index, "w0", interval_s=0.01)
    try:
        h = hashes(list(range(12)))
        pub.push([h[0], h[1]], [])
        pub.push([h[0], h[2]], [h[0], h[2]])  # h0: evicted then stored; h2: stored then evicted
        pub.push([h[1]], [h[1], h[1]])  # inconsistent input: stays within {held, not held}
        # h2 never changed what Redis must hold: only h0 (stored) and h1 (gone) are sent
        wait_for(lambda: pub.published_events >= 2, what="publish")
        wait_for(lambda: index.lookup(h) == {"w0": "0"}, what="h0 held, h1 and h2 not")
        assert pub.num_held == 1
    finally:
        pub.close()


def test_publisher_keeps_each_block_at_its_best_tier(server, index):
    """A block moves down as it leaves the tiers above (device -> host -> disk) and leaves the
    index when it leaves its last tier; the tiers' batches may come in any order."""
    pub = IndexPublisher(index, "w0", interval_s=0.01)
    try:
        h = hashes(list(range(24)))  # 6 blocks
        pub.push([], [], "disk")
        pub.push(h[:3], [], "disk")  # written through, disk before host in this batch order
        pub.push(h, [], "host")
        pub.push(h, [])
        wait_for(lambda: index.lookup(h) == {"w0": "000000"}, what="held on device")
        pub.push([], h)  # out of the device pool, still in host memory
        wait_for(lambda: index.lookup(h) == {"w0": "111111"}, what="lowered to host")
        pub.push([], h[:2] + h[4:], "host")  # host LRU: h0, h1 stay on disk, h4, h5 are gone
        wait_for(lambda: index.lookup(h) == {"w0": "2211"}, what="lowered to disk, or gone")
        assert pub.num_held == 4
        pub.push([], [h[0]], "disk")  # evicted from its last tier: no entry left
        wait_for(lambda: index.lookup(h) == {}, what="block 0 gone")
        assert index.lookup(h[1:]) == {"w0": "211"}
        pub.push([h[1]], [])  # back on device (a load): the best tier again
        wait_for(lambda: index.lookup(h[1:]) == {"w0": "011"}, what="back on device")
    finally:
        pub.close()


def test_tiers_survive_a_redis_restart(own_server):
    index = PrefixIndex(own_server.url, "m", heartbeat_ttl_s=2.0)
    pub = IndexPublisher(index, "w0", interval_s=0.02, heartbeat_s=0.1)
    try:
        h = hashes(list(range(16)))
        pub.push(h[2:], [], "disk")  # what a worker found on disk at start
        pub.push(h[:3], [], "host")
        pub.push(h[:1], [])
        wait_for(lambda: index.lookup(h) == {"w0": "0112"}, what="published tiers")
        republished = pub.republished
        own_server.restart()  # empty
        wait_for(lambda: pub.republished > republished, what="a full re-publish")
        wait_for(lambda: index.lookup(h) == {"w0": "0112"}, what="tiers back after restart")
    finally:
        pub.close()
        index.close()


def test_publisher_rejects_heartbeat_slower_than_ttl(index):
    with pytest.raises(ValueError, match="heartbeat_s"):
        IndexPublisher(index, "w0", heartbeat_s=index.heartbeat_ttl_s)


# -- RedisServer ---------------------------------------------------------------------------------


def test_password_is_enforced(server):
    for password in (None, "wrong"):
        client = redis.Redis(
            host=server.host, port=server.port, password=password, retry=Retry(NoBackoff(), 0)
        )
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            client.ping()
        client.close()
    assert redis.Redis.from_url(server.url).ping()


def test_stop_leaves_no_process_and_restart_keeps_url():
    srv = RedisServer()
    with srv:
        url, pid, tmp = srv.url, srv.pid, srv._dir
        assert os.path.isdir(tmp)
        srv.restart()
        assert srv.url == url and srv.pid != pid
        assert redis.Redis.from_url(srv.url).ping()
        pid = srv.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not os.path.exists(tmp) and not srv.running
    srv.stop()  # idempotent


def test_start_failure_says_why(server):
    with pytest.raises(RuntimeError, match="exited"):
        RedisServer(port=server.port, startup_timeout_s=5.0).start()
