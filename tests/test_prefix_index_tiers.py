"""A worker publishes the tier of every block it holds (engine/runtime.py wiring the block manager
and the KV tiers to the prefix index's publisher), against a real redis-server, on a random tiny
Llama on CPU: blocks pushed out of the device pool show as host, blocks gone from their last tier
leave the index, the disk files found at start are published again after a restart, and the
worker's stats carry the tier costs the router prices hits by. The engine thread is not started:
the test steps the engine and publishes as that thread does."""

from __future__ import annotations

import itertools
import random
import time
import uuid

import pytest
import torch
from hf_oracle import tiny_config

from engine.block_manager import prefix_block_hashes
from engine.kv_tiers import TierCosts
from engine.prefix_index import DEVICE, DISK, HOST, PrefixIndex
from engine.sampling_params import SamplingParams
from router.policy import load_fractions
from router.redis_server import RedisServer

transformers = pytest.importorskip("transformers")

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Pinned so every tier is worth loading, whatever this machine's timings (as tests/test_kv_tiers.py)
CHEAP_LOADS = TierCosts(host_load_s=1e-6, disk_load_s=1e-5, recompute_s=1e-3)
_ids = itertools.count()


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=256, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(path)
    return str(path)


@pytest.fixture
def index(server):
    idx = PrefixIndex(server.url, f"tiers-{uuid.uuid4().hex[:8]}")
    idx.url = server.url
    yield idx
    idx.close()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(60)] for _ in range(4)]  # 15 blocks each


def worker(path: str, index: PrefixIndex, worker_id: str = "c/0", **engine):
    """A colocated worker publishing to ``index`` as ``worker_id``, on ``index.url``."""
    from decode_worker.colocated import ColocatedWorker

    # 24 device blocks of 4 tokens: two 60-token prompts do not fit, each pushes others out
    cfg = {"model_dir": path, "block_size": BS, "num_kv_blocks": 24, **engine}
    spec = {"url": index.url, "namespace": index.namespace, "worker": worker_id}
    w = ColocatedWorker(cfg, "c", index=spec)
    w.engine.tiers.costs = CHEAP_LOADS
    return w


def run(w, prompt) -> None:
    """One request through the engine, publishing after each step (the engine thread's loop)."""
    w.engine.add_request(f"r{next(_ids)}", prompt, GREEDY)
    while w.engine.has_work():
        w.engine.step()
        w._publish_blocks()


def truth(w, hashes: list[bytes]) -> str:
    """The tier codes of the leading blocks ``w`` holds, from its engine's own state."""
    cached, tiers = w.engine.block_manager._cached, w.engine.tiers
    on_disk = set(tiers.disk.known()) if tiers.disk is not None else set()
    out = ""
    for h in hashes:
        if h in cached:
            out += DEVICE
        elif h in tiers.host:
            out += HOST
        elif h in on_disk:
            out += DISK
        else:
            break
    return out


def published(index, w, hashes, expected: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    want = {w._publisher.worker: expected} if expected else {}
    while index.lookup(hashes) != want:
        assert time.monotonic() < deadline, (index.lookup(hashes), want)
        time.sleep(0.01)


def test_blocks_out_of_the_device_pool_show_as_host_then_leave(tiny, index, prompts):
    # A host tier of ~41 blocks and no disk: host memory is the last tier.
    w = worker(tiny, index, kv_offload_cpu_gb=8e-5)
    try:
        first = prefix_block_hashes(prompts[0], BS)
        run(w, prompts[0])
        assert truth(w, first) == DEVICE * 15
        published(index, w, first, DEVICE * 15)

        run(w, prompts[1])  # pushes some of prompt 0's blocks out of the device pool
        now = truth(w, first)
        assert len(now) == 15 and HOST in now, now
        published(index, w, first, now)

        for p in prompts[2:]:  # and out of host memory (its LRU), with nothing below
            run(w, p)
        now = truth(w, first)
        assert len(now) < 15, now
        published(index, w, first, now)
        assert w._stats()["kv_tiers"]["host"]["evictions"] > 0
    finally:
        w.shutdown()


def test_disk_files_are_published_again_after_a_restart(tiny, index, prompts, tmp_path):
    # ~41 blocks in host memory and about as many files of 2 KiB (and a header) on disk: the
    # four prompts' 68 blocks push the oldest out of both
    disk = {"kv_offload_disk_dir": str(tmp_path), "kv_offload_disk_gb": 40 * 2048 / (1 << 30)}
    w = worker(tiny, index, kv_offload_cpu_gb=8e-5, **disk)
    first, last = (prefix_block_hashes(p, BS) for p in (prompts[0], prompts[3]))
    try:
        for p in prompts:
            run(w, p)
            # Each prompt's writes land before the next runs: with a slow disk, host slots
            # pinned by queued writes would drop some saves (they stay on the device only, and
            # a restart could not find them). That pressure is not what this test is about.
            assert w.engine.tiers.flush()
        w._publish_blocks()  # what the idle engine thread does once the disk writes are done
        stats = w._stats()["kv_tiers"]
        assert stats["host"]["saves_dropped"] == stats["disk"]["writes_dropped"] == 0, stats
        assert stats["disk"]["evictions"] > 0
        assert truth(w, first) == "", "prompt 0's first block left host memory, then disk"
        published(index, w, first, "")
        published(index, w, last, truth(w, last))
    finally:
        w.shutdown()
    assert index.lookup(last) == {}  # its entries stop counting once it is gone

    again = worker(tiny, index, worker_id="c/1", kv_offload_cpu_gb=8e-5, **disk)  # a restart
    try:
        # the newest files, prompt 3's blocks, are all found at start (none run here)
        assert truth(again, last) == DISK * 15
        published(index, again, last, DISK * 15)
    finally:
        again.shutdown()


def test_stats_carry_the_tier_costs_and_idle_wakes_publish_disk_writes(
    tiny, index, tmp_path, monkeypatch
):
    from engine.kv_tiers import KVTiers
    from engine.runtime import TIER_EVENTS_S

    w = worker(tiny, index, kv_offload_cpu_gb=0.001, kv_offload_disk_dir=str(tmp_path))
    try:
        costs = w._stats()["kv_tiers"]["costs"]
        assert costs == CHEAP_LOADS.as_dict()
        assert load_fractions(costs) == pytest.approx({HOST: 1e-3, DISK: 1e-2})
        assert w._wait_timeout() is None  # idle, nothing in flight: block until work comes
        monkeypatch.setattr(KVTiers, "writes_pending", property(lambda self: 1))
        assert w._wait_timeout() == TIER_EVENTS_S
    finally:
        w.shutdown()
