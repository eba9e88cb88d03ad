"""The KV tiers below the device pool (engine.kv_tiers) on CPU: the disk tier's files and their
checks, and the engine serving prefixes pushed out of a small device pool from host memory and
from disk (after a restart too), exact against transformers; preemption swaps; aborts mid-load."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hf_oracle import hf_greedy_ids, tiny_config

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.kv_tiers import BlockLayout, DiskTier, KVTiers, TierCosts
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig

transformers = pytest.importorskip("transformers")

CONFIG = tiny_config(vocab_size=256, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LAYOUT = BlockLayout(2, 2, 4, 16, torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(60)] for _ in range(4)]


# The tiny model recomputes a block in tens of microseconds, about what reading a block file
# takes: the measured costs would make these tests depend on the machine's timing. They pin the
# costs so that every tier is worth loading (test_load_or_recompute_by_cost checks the policy).
CHEAP_LOADS = TierCosts(host_load_s=1e-6, disk_load_s=1e-5, recompute_s=1.0)


def engine(path, measured_costs: bool = False, **kw) -> LLM:
    # 24 blocks of 4 tokens: two 60-token prompts do not fit, so each pushes the others out
    llm = LLM(path, block_size=4, num_kv_blocks=24, **kw)
    if llm.engine.tiers is not None and not measured_costs:
        llm.engine.tiers.costs = CHEAP_LOADS
    return llm


def run(llm: LLM, prompt, params=GREEDY):
    out = llm.generate([prompt], params)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


# -- the disk tier's files -------------------------------------------------------------------------


def payload(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, LAYOUT.nbytes, dtype=np.uint8)


def test_disk_round_trip_and_every_check(tmp_path):
    disk = DiskTier(tmp_path, "a" * 64, 1 << 20, LAYOUT)
    h = bytes(range(32))
    assert disk.write(h, payload()) and h in disk
    assert not disk.write(h, payload(1)), "a block is written once"
    out = np.empty(LAYOUT.nbytes, dtype=np.uint8)
    assert disk.read_into(h, out) and np.array_equal(out, payload())

    path = disk.path(h)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the block's bytes
    path.write_bytes(bytes(raw))
    assert not disk.read_into(h, out) and not path.exists() and disk.rejected == 1

    foreign = DiskTier(tmp_path / "other", "b" * 64, 1 << 20, LAYOUT)
    foreign.write(h, payload())  # another model's file, copied where ours would be
    path.write_bytes(foreign.path(h).read_bytes())
    assert not disk.read_into(h, out) and disk.rejected == 2

    disk.write(h, payload())
    path.write_bytes(path.read_bytes()[:-100])  # torn by a crash
    assert not disk.read_into(h, out) and disk.rejected == 3

    other = DiskTier(tmp_path, "a" * 64, 1 << 20, BlockLayout(2, 2, 8, 16, torch.float32))
    disk.write(h, payload())
    wide = np.empty(other.layout.nbytes, dtype=np.uint8)
    assert not other.read_into(h, wide), "a file of another block size is refused"


def test_disk_bound_evicts_the_least_recently_used(tmp_path):
    one = DiskTier(tmp_path, "a" * 64, 1 << 20, LAYOUT)
    one.write(b"\x01" * 32, payload())
    size = one.path(b"\x01" * 32).stat().st_size
    disk = DiskTier(tmp_path, "a" * 64, 3 * size, LAYOUT)  # the file above is found at start
    assert disk.used_bytes == size
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    disk.write(hashes[1], payload())
    disk.write(hashes[2], payload())
    disk.read_into(hashes[0], np.empty(LAYOUT.nbytes, dtype=np.uint8))  # now the newest
    disk.write(hashes[3], payload())
    assert [h in disk for h in hashes] == [True, False, True, True]
    assert disk.evictions == 1 and disk.used_bytes == 3 * size


def test_a_leftover_temporary_file_is_never_a_block(tmp_path):
    disk = DiskTier(tmp_path, "a" * 64, 1 << 20, LAYOUT)
    h = b"\x07" * 32
    path = disk.path(h)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / f".{path.name}.123.1.tmp").write_bytes(b"half a block")
    assert h not in disk and DiskTier(tmp_path, "a" * 64, 1 << 20, LAYOUT).used_bytes == 0


def test_gather_and_scatter_move_whole_blocks_bit_exact():
    caches = [torch.randn(2, 2, 8 * 4, 16) for _ in range(2)]
    ids = torch.tensor([5, 1, 6])
    blocks = LAYOUT.gather(caches, ids)
    assert blocks.shape == (3, LAYOUT.numel)
    blocks = blocks.view(3, *LAYOUT.shape)
    assert torch.equal(blocks[0, 1].view(torch.float32), caches[1][:, :, 20:24])
    fresh = [torch.zeros_like(c) for c in caches]
    LAYOUT.scatter(fresh, torch.tensor([0, 2, 3]), blocks.view(3, -1))
    assert torch.equal(fresh[1][:, :, 8:12], caches[1][:, :, 4:8])


# -- the engine --------------------------------------------------------------------------------------


def test_a_prefix_pushed_out_comes_back_from_the_host_tier(tiny, prompts):
    path, model = tiny
    llm = engine(path, kv_offload_cpu_gb=0.001)
    for p in prompts:
        assert run(llm, p) == (0, hf_greedy_ids(model, p, 8))
    cached, tokens = run(llm, prompts[0])
    assert cached == 56, "14 of the 60-token prompt's 15 blocks (one token is always computed)"
    assert tokens == hf_greedy_ids(model, prompts[0], 8)
    stats = llm.engine.tiers.snapshot()
    assert stats["host"]["hits"] == 14 and stats["loads"] == 1
    llm.engine.block_manager.check_invariant(expect_idle=True)


def test_the_disk_tier_outlives_the_engine_and_skips_a_bad_file(tiny, prompts, tmp_path):
    path, model = tiny
    llm = engine(path, kv_offload_disk_dir=str(tmp_path))
    for p in prompts:
        run(llm, p)
    llm.engine.tiers.flush()
    assert run(llm, prompts[0])[0] == 56, "through the disk tier's staging slots"
    del llm

    again = engine(path, kv_offload_disk_dir=str(tmp_path))  # a restart: same folder
    assert run(again, prompts[1]) == (56, hf_greedy_ids(model, prompts[1], 8))

    tiers = again.engine.tiers
    hashes = again.engine.block_manager  # the block hashes of prompt 2
    req = Request("x", prompts[2], GREEDY)
    hashes.update_hashes(req)
    victim = tiers.disk.path(req.block_hashes[5])
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 1
    victim.write_bytes(bytes(raw))
    for p in (prompts[3], prompts[0]):  # push prompt 2's blocks out of the device pool
        run(again, p)
    cached, tokens = run(again, prompts[2])
    assert cached == 5 * 4, "blocks before the corrupted one load; it and the rest recompute"
    assert tokens == hf_greedy_ids(model, prompts[2], 8)
    assert tiers.snapshot()["disk"]["rejected"] == 1
    again.engine.block_manager.check_invariant(expect_idle=True)


def test_a_file_of_another_model_is_not_loaded(tiny, prompts, tmp_path):
    path, model = tiny
    llm = engine(path, kv_offload_disk_dir=str(tmp_path))
    run(llm, prompts[0])
    llm.engine.tiers.flush()
    dummy = engine(path, kv_offload_disk_dir=str(tmp_path), load_format="dummy")
    assert dummy.engine.tiers.disk.dir != llm.engine.tiers.disk.dir
    assert run(dummy, prompts[0])[0] == 0, "other weights: another identity, nothing found"


def test_preemption_swaps_and_stays_exact(tiny):
    path, model = tiny
    rng = random.Random(1)
    long = [[rng.randrange(256) for _ in range(30)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 3 x 70 tokens need 54 blocks of 4: 24 force preemptions while they decode side by side
    llm = engine(path, kv_offload_cpu_gb=0.001)
    outs = llm.generate(long, params)
    for p, o in zip(long, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy_ids(model, p, 40)
    stats = llm.engine.tiers.snapshot()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats["preempt_swapped"] == llm.engine.scheduler.num_preemptions
    assert stats["host"]["hits"] > 0, "a preempted request's blocks came back from the host"
    llm.engine.block_manager.check_invariant(expect_idle=True)


def test_n_siblings_and_a_salt_with_tiers(tiny, prompts):
    path, model = tiny
    llm = engine(path, kv_offload_cpu_gb=0.001)
    sample = SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=3)
    first = llm.generate([prompts[0]], sample)[0]
    for p in prompts[1:]:
        run(llm, p)
    second = llm.generate([prompts[0]], sample)[0]
    assert second.num_cached_tokens == 56
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    salted = llm.engine.add_request("s", prompts[0], GREEDY, cache_salt="tenant-b")
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == salted and out.finished:
                assert out.num_cached_tokens == 0, "another tenant's salt finds nothing below"


# -- the scheduler's loading state, with a tier whose loads land when told --------------------------


class SlowTiers:
    def __init__(self) -> None:
        self.started: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def plan(self, hashes):
        return len(hashes)

    def start_load(self, request_id, hashes, block_ids):
        self.started[request_id] = list(block_ids)

    def landed(self):
        done, self.done = self.done, {}
        return done

    def on_preempt(self, num_full_blocks):
        return "recompute"


def test_a_loading_request_waits_out_of_the_batch_and_an_abort_frees_after_landing():
    bm = BlockManager(32, 4)
    tiers = SlowTiers()
    sched = Scheduler(SchedulerConfig(4, 64, 256), bm, tiers)
    a, b = Request("a", list(range(21)), GREEDY), Request("b", list(range(100, 110)), GREEDY)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert a.status == RequestStatus.LOADING and b.status == RequestStatus.LOADING
    assert out.is_empty and len(tiers.started["a"]) == 5, "5 of 21 tokens' blocks load"
    tiers.done["a"] = 3  # the fourth block could not be read: it is recomputed
    out = sched.schedule()
    (chunk,) = out.scheduled
    assert chunk.request is a and chunk.start == 12 and a.num_cached_tokens == 12
    in_use = bm.counts()["in_use"]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert bm.counts()["in_use"] == in_use, "b's blocks wait for its load to land"
    assert sched.has_unfinished_requests()
    tiers.done["b"] = 2
    sched.schedule()
    assert bm.counts()["in_use"] == in_use - len(tiers.started["b"])
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    bm.check_invariant(expect_idle=True)


def test_tier_settings_are_checked(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine(path, kv_offload_cpu_gb=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_cpu_gb"):
        engine(path, kv_offload_cpu_gb=-1.0)
    with pytest.raises(ValueError, match="holds no block"):
        engine(path, kv_offload_cpu_gb=1e-9)


def test_tiers_report_costs_measured_at_start(tiny, tmp_path):
    path, _ = tiny
    tiers: KVTiers = engine(
        path, kv_offload_cpu_gb=0.001, kv_offload_disk_dir=str(tmp_path)
    ).engine.tiers
    costs = tiers.costs
    assert 0 < costs.host_load_s <= costs.disk_load_s and costs.recompute_s > 0
    assert not list(tiers.disk.dir.glob("*/*")), "the disk probe's files are gone"


def test_one_allocation_gathers_like_separate_layers():
    pool = torch.randn(2, 2, 2, 8 * 4, 16)
    caches = list(pool.unbind(0))
    stacked = LAYOUT.stacked(caches)
    assert stacked is not None and LAYOUT.stacked([c.clone() for c in caches]) is None
    ids = torch.tensor([5, 1, 6])
    assert torch.equal(LAYOUT.gather(caches, ids, stacked), LAYOUT.gather(caches, ids))
    src = torch.randn(3, LAYOUT.numel).view(torch.int32)
    fresh, loop = [torch.zeros_like(pool).unbind(0) for _ in range(2)]
    LAYOUT.scatter(fresh, ids, src, LAYOUT.stacked(fresh))
    LAYOUT.scatter(loop, ids, src)
    assert all(torch.equal(a, b) for a, b in zip(fresh, loop, strict=True))


def test_consecutive_slots_copy_as_one_run():
    from engine.kv_tiers import runs

    assert runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([]) == [] and runs([7]) == [(0, 7, 1)]


def test_status_and_metrics_read_the_tiers_snapshot(tiny, prompts, tmp_path):
    from cluster.control.controller import tier_use
    from router.metrics import BackendCollector

    path, _ = tiny
    llm = engine(path, kv_offload_cpu_gb=0.001, kv_offload_disk_dir=str(tmp_path))
    for p in prompts:
        run(llm, p)
    run(llm, prompts[0])
    llm.engine.tiers.flush()
    snap = llm.engine.tiers.snapshot()
    use = tier_use(snap)
    block = LAYOUT.nbytes
    assert use["kv_host"] == {
        "used_bytes": snap["host"]["blocks"] * block,
        "capacity_bytes": snap["host"]["capacity_blocks"] * block,
        "hits": 14,
    }
    assert use["kv_disk"]["used_bytes"] == llm.engine.tiers.disk.used_bytes > 0
    assert tier_use(None) == {}
    series = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in BackendCollector([{"name": "w0", "kv_tiers": snap}], None, "m")._tier_metrics()
        for s in m.samples
    }
    labels = (("model_name", "m"), ("tier", "host"), ("worker", "w0"))
    assert series[("tandem:kv_tier_used_bytes", labels)] == use["kv_host"]["used_bytes"]
    assert series[("tandem:kv_tier_hits_total", labels)] == 14
