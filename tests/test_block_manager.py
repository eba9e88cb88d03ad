"""Tests of engine.block_manager on hand-built requests: chained prefix hashes, prefix hits,
shared blocks and ref counts, LRU eviction order, stored/evicted events, failed allocations that
change nothing, reset_prefix_cache, prefix caching off, and check_invariant itself."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from engine.block_manager import BlockManager, hash_block, prefix_block_hashes, root_hash
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4  # block size of every test below


def make_request(rid: str, tokens: Sequence[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, request: Request) -> list[int]:
    """What the scheduler does on admission: prefix hits, then the rest of the prompt at once."""
    hits = bm.get_computed_blocks(request)
    num_hit_tokens = len(hits) * bm.block_size
    new = bm.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None, f"{request.request_id} does not fit"
    request.num_computed_tokens = request.num_tokens
    return hits


def cached_hashes(bm: BlockManager) -> set[bytes]:
    return set(bm._cached)


def snapshot(bm: BlockManager) -> tuple:
    """Everything allocate_slots may touch, to check that a failed call changed nothing."""
    return (
        list(bm._free),
        dict(bm._cached),
        {rid: list(blocks) for rid, blocks in bm._req_blocks.items()},
        dict(bm._req_num_hashed),
        [(b.ref_cnt, b.block_hash) for b in bm.blocks],
        list(bm._stored),
        list(bm._evicted),
    )


# ------------------------------------------------------------------------------------- hashes


def test_equal_prefixes_give_equal_hashes() -> None:
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS)
    b = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], BS)
    assert len(a) == len(b) == 3
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_a_different_token_in_block_0_changes_every_later_hash() -> None:
    tokens = list(range(16))
    changed = [99] + tokens[1:]
    a, b = prefix_block_hashes(tokens, BS), prefix_block_hashes(changed, BS)
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_hashes_chain_their_parent() -> None:
    tokens = list(range(8))
    h = prefix_block_hashes(tokens, BS)
    assert h[0] == hash_block(root_hash(None), tokens[:4])
    assert h[1] == hash_block(h[0], tokens[4:])
    # The same block contents under another parent hash differently.
    assert hash_block(h[0], tokens[:4]) != h[0]


def test_salt_changes_every_hash() -> None:
    tokens = list(range(12))
    plain = prefix_block_hashes(tokens, BS)
    salted = prefix_block_hashes(tokens, BS, salt="tenant-a")
    other = prefix_block_hashes(tokens, BS, salt="tenant-b")
    assert all(len({p, s, o}) == 3 for p, s, o in zip(plain, salted, other, strict=True))
    assert prefix_block_hashes(tokens, BS, salt="tenant-a") == salted


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (3, 0), (4, 1), (11, 2), (12, 3)])
def test_partial_blocks_are_not_hashed(num_tokens: int, num_hashes: int) -> None:
    assert len(prefix_block_hashes(list(range(num_tokens)), BS)) == num_hashes


def test_hashes_extend_from_known_ones() -> None:
    tokens = list(range(20))
    known = prefix_block_hashes(tokens[:9], BS)
    assert prefix_block_hashes(tokens, BS, start=known) == prefix_block_hashes(tokens, BS)


def test_token_ids_are_not_confused_by_concatenation() -> None:
    # [1, 23] vs [12, 3] style collisions are impossible: ids are packed as fixed-width ints.
    assert hash_block(b"", [1, 23, 4, 5]) != hash_block(b"", [12, 3, 4, 5])
    assert hash_block(b"", [256, 0, 0, 0]) != hash_block(b"", [0, 1, 0, 0])


# ---------------------------------------------------------------------------------- prefix hits


def test_hits_only_for_full_cached_blocks() -> None:
    bm = BlockManager(16, BS)
    admit(bm, make_request("a", range(14)))  # blocks 0-2 full and hashed, block 3 partial
    assert len(cached_hashes(bm)) == 3
    assert len(bm.get_computed_blocks(make_request("b", range(6)))) == 1
    assert len(bm.get_computed_blocks(make_request("c", range(10)))) == 2
    # a's tokens 12-13 sat in a partial block, which was never made findable.
    assert len(bm.get_computed_blocks(make_request("d", range(17)))) == 3
    bm.check_invariant()


def test_hit_on_the_whole_prompt_leaves_one_token_to_compute() -> None:
    bm = BlockManager(16, BS)
    admit(bm, make_request("a", range(12)))
    assert len(bm.get_computed_blocks(make_request("same", range(12)))) == 2
    assert len(bm.get_computed_blocks(make_request("longer", range(13)))) == 3
    assert bm.get_computed_blocks(make_request("one-block", range(4))) == []
    bm.check_invariant()


def test_hits_stop_at_the_first_different_block() -> None:
    bm = BlockManager(16, BS)
    assert admit(bm, make_request("a", range(16))) == []
    tokens = list(range(16))
    tokens[5] = 99  # block 1 differs, so blocks 2 and 3 cannot match either
    assert len(bm.get_computed_blocks(make_request("b", tokens + [0]))) == 1
    bm.check_invariant()


def test_salt_isolates_prefix_hits() -> None:
    bm = BlockManager(16, BS)
    admit(bm, make_request("a", range(9), salt="s1"))
    assert bm.get_computed_blocks(make_request("b", range(9))) == []
    assert bm.get_computed_blocks(make_request("c", range(9), salt="s2")) == []
    assert len(bm.get_computed_blocks(make_request("d", range(9), salt="s1"))) == 2
    bm.check_invariant()


def test_prefix_hit_statistics() -> None:
    bm = BlockManager(16, BS)
    admit(bm, make_request("a", range(9)))
    bm.get_computed_blocks(make_request("b", range(10)))
    assert (bm.prefix_queries, bm.prefix_hits) == (9 + 10, 8)
    bm.check_invariant()


def test_shared_blocks_are_ref_counted() -> None:
    bm = BlockManager(8, BS)
    a, b = make_request("a", range(10)), make_request("b", range(10))
    admit(bm, a)
    assert bm.num_free_blocks == 5
    hits = admit(bm, b)
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert hits == table_a[:2] == table_b[:2]
    assert table_a[2] != table_b[2]  # the partial last block is private
    assert [bm.blocks[i].ref_cnt for i in table_a] == [2, 2, 1]
    assert bm.num_free_blocks == 4
    bm.check_invariant()

    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in table_b] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    assert bm.block_table("a") == []
    bm.check_invariant()

    bm.free(b)
    assert bm.num_free_blocks == 8
    assert len(cached_hashes(bm)) == 2  # freed but still findable
    bm.check_invariant(expect_idle=True)


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    bm = BlockManager(4, BS)
    a = make_request("a", range(9))
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_request("b", range(9))
    hits = admit(bm, b)
    assert len(hits) == 2
    assert bm.num_free_blocks == 1  # 2 hits + 1 new block
    assert all(bm.blocks[i].ref_cnt == 1 for i in bm.block_table("b"))
    bm.check_invariant()


def test_full_blocks_are_hashed_as_decoding_fills_them() -> None:
    bm = BlockManager(8, BS)
    bm.record_events = True
    request = make_request("a", range(6))
    admit(bm, request)
    assert bm.drain_events()[0] == prefix_block_hashes(range(6), BS)  # one full block

    def decode(token: int) -> list[int]:
        # The sampled token is appended; its KV is computed by the next step's 1-token chunk.
        request.append_output_token(token)
        new = bm.allocate_slots(request, 1)
        assert new is not None
        request.num_computed_tokens += 1
        return new

    assert decode(50) == []
    assert bm.drain_events()[0] == [], "block 1 holds only 4, 5, 50 so far"
    assert decode(51) == []
    assert bm.drain_events()[0] == [prefix_block_hashes([0, 1, 2, 3, 4, 5, 50, 51], BS)[1]]
    assert len(decode(52)) == 1  # position 8 opens block 2
    assert bm.drain_events()[0] == []
    assert request.block_hashes == prefix_block_hashes(request.all_token_ids, BS)
    bm.check_invariant()


def test_chunked_prefill_hashes_only_computed_blocks() -> None:
    bm = BlockManager(8, BS)
    bm.record_events = True
    request = make_request("a", range(13))
    assert len(bm.allocate_slots(request, 6)) == 2
    assert len(bm.drain_events()[0]) == 1
    request.num_computed_tokens = 6
    assert len(bm.allocate_slots(request, 6)) == 1
    assert len(bm.drain_events()[0]) == 2
    assert bm.get_computed_blocks(make_request("b", range(13))) == bm.block_table("a")[:3]
    bm.check_invariant()


# ---------------------------------------------------------------------------- free and eviction


def test_free_puts_the_tail_before_the_head_in_the_lru() -> None:
    bm = BlockManager(4, BS)
    bm.record_events = True
    a = make_request("a", range(9))  # blocks: [full, full, partial]
    admit(bm, a)
    head, tail, partial = bm.block_table("a")
    spare = next(i for i in range(4) if i not in (head, tail, partial))
    bm.drain_events()
    bm.free(a)
    # Empty blocks are handed out first, then the cached tail, the cached head last.
    assert list(bm._free) == [partial, spare, tail, head]

    b = make_request("b", range(100, 111))  # 3 blocks, no hits: evicts a's tail only
    admit(bm, b)
    assert bm.block_table("b") == [partial, spare, tail]
    stored, evicted = bm.drain_events()
    assert evicted == [prefix_block_hashes(range(8), BS)[1]]
    assert len(stored) == 2
    assert len(bm.get_computed_blocks(make_request("c", range(9)))) == 1  # the head survived
    assert prefix_block_hashes(range(8), BS)[1] not in bm._cached
    bm.check_invariant()


def test_reused_block_is_most_recently_used() -> None:
    bm = BlockManager(4, BS)
    bm.record_events = True
    x, y = make_request("x", range(5)), make_request("y", range(50, 55))
    admit(bm, x)
    admit(bm, y)
    bm.free(x)
    bm.free(y)
    # Touch x's cached block again: it moves behind y's in the LRU.
    x2 = make_request("x2", range(5))
    assert len(admit(bm, x2)) == 1
    bm.free(x2)
    admit(bm, make_request("z", range(200, 209)))  # 3 blocks: the 2 empty ones, then y's
    _, evicted = bm.drain_events()
    assert evicted == [prefix_block_hashes(range(50, 55), BS)[0]]
    assert len(bm.get_computed_blocks(make_request("x3", range(5)))) == 1
    bm.check_invariant()


def test_eviction_reports_every_evicted_hash() -> None:
    bm = BlockManager(3, BS)
    bm.record_events = True
    a = make_request("a", range(12))
    admit(bm, a)
    stored, evicted = bm.drain_events()
    assert stored == prefix_block_hashes(range(12), BS) and evicted == []
    bm.free(a)
    admit(bm, make_request("b", range(100, 112)))
    stored, evicted = bm.drain_events()
    assert sorted(evicted) == sorted(prefix_block_hashes(range(12), BS))
    assert stored == prefix_block_hashes(range(100, 112), BS)
    assert cached_hashes(bm) == set(stored)
    assert bm.drain_events() == ([], [])
    bm.check_invariant()


# ------------------------------------------------------------------------- failed allocations


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(2, BS)
    before = snapshot(bm)
    assert bm.allocate_slots(make_request("big", range(9)), 9) is None
    assert snapshot(bm) == before
    assert bm.block_table("big") == []
    bm.check_invariant(expect_idle=True)


def test_growth_that_does_not_fit_returns_none_and_keeps_the_blocks() -> None:
    bm = BlockManager(2, BS)
    request = make_request("a", range(8))
    admit(bm, request)
    request.append_output_token(1)
    before = snapshot(bm)
    assert bm.allocate_slots(request, 1) is None
    assert snapshot(bm) == before
    assert len(bm.block_table("a")) == 2
    bm.check_invariant()


def test_hits_in_the_free_queue_do_not_count_as_free_space() -> None:
    bm = BlockManager(3, BS)
    a = make_request("a", range(8))
    admit(bm, a)
    bm.free(a)  # 3 free blocks, 2 of them cached hits for b
    b = make_request("b", list(range(8)) + [70, 71, 72, 73, 74])  # 13 tokens: 2 hits + 2 new
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    before = snapshot(bm)
    assert bm.allocate_slots(b, b.num_tokens - 8, hits) is None
    assert snapshot(bm) == before
    assert bm.block_table("b") == []
    bm.check_invariant(expect_idle=True)
    # One token fewer fits exactly: 2 hits + 1 new block.
    c = make_request("c", list(range(8)) + [70, 71, 72, 73])
    hits = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, 4, hits) is not None
    assert bm.num_free_blocks == 0
    bm.check_invariant()


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(4, 0)


# ---------------------------------------------------------------------- reset and caching off


def test_reset_prefix_cache_only_when_idle() -> None:
    bm = BlockManager(8, BS)
    bm.record_events = True
    a = make_request("a", range(9))
    admit(bm, a)
    bm.drain_events()
    assert bm.reset_prefix_cache() is False
    assert len(cached_hashes(bm)) == 2
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert cached_hashes(bm) == set()
    assert all(b.block_hash is None for b in bm.blocks)
    _, evicted = bm.drain_events()
    assert sorted(evicted) == sorted(prefix_block_hashes(range(9), BS))
    assert bm.get_computed_blocks(make_request("b", range(9))) == []
    bm.check_invariant(expect_idle=True)


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_request("a", range(12))
    admit(bm, a)
    assert a.block_hashes == []
    bm.free(a)
    b = make_request("b", range(12))
    assert bm.get_computed_blocks(b) == []
    admit(bm, b)
    assert bm.drain_events() == ([], [])
    assert cached_hashes(bm) == set()
    assert bm.prefix_hits == 0
    bm.free(b)
    bm.check_invariant(expect_idle=True)


# ----------------------------------------------------------------------------- check_invariant


def corrupt_ref_in_free_queue(bm: BlockManager) -> None:
    bm.blocks[3].ref_cnt = 1


def corrupt_lost_free_block(bm: BlockManager) -> None:
    del bm._free[3]


def corrupt_extra_reference(bm: BlockManager) -> None:
    bm.blocks[bm.block_table("a")[0]].ref_cnt += 1


def corrupt_prefix_index(bm: BlockManager) -> None:
    h = next(iter(bm._cached))
    bm._cached[h] = bm.block_table("a")[2]  # the partial block, which holds no hash


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        (corrupt_ref_in_free_queue, "block accounting broken: free=5 cached=0 in_use=4 total=8"),
        (corrupt_lost_free_block, "block accounting broken: free=4 cached=0 in_use=3 total=8"),
        (corrupt_extra_reference, "ref counts (3 owned) disagree with blocks: free=5 cached=0"),
        (corrupt_prefix_index, "prefix index points at a block with another hash: free=5"),
    ],
)
def test_check_invariant_catches_corruption(corrupt, expected: str) -> None:
    bm = BlockManager(8, BS)
    admit(bm, make_request("a", range(9)))
    assert bm.block_table("a") == [0, 1, 2]
    bm.check_invariant()
    corrupt(bm)
    with pytest.raises(AssertionError, match=re.escape(expected)):
        bm.check_invariant()


def test_check_invariant_expect_idle_reports_leaks() -> None:
    bm = BlockManager(8, BS)
    admit(bm, make_request("a", range(5)))
    bm.check_invariant()
    with pytest.raises(
        AssertionError,
        match=re.escape("blocks leaked while idle: free=6 cached=0 in_use=2 total=8"),
    ):
        bm.check_invariant(expect_idle=True)


def test_reserved_blocks_publish_no_hash_until_computed_here() -> None:
    """A remote prefill's blocks are held without hashes (their KV has not arrived), so another
    request cannot hit them; the first local step publishes them."""
    bm = BlockManager(num_blocks=8, block_size=4)
    remote = make_request("remote", list(range(10)))
    table = bm.reserve(remote, remote.num_tokens + 1)
    assert table is not None and len(table) == 3
    assert bm.counts() == {"free": 5, "cached": 0, "in_use": 3}
    twin = make_request("twin", list(range(10)))
    assert bm.get_computed_blocks(twin) == []  # nothing findable yet
    remote.num_computed_tokens = remote.num_tokens  # the KV arrived; the first decode step:
    assert bm.allocate_slots(remote, 1) == []  # fits in the reserved blocks
    assert len(bm.get_computed_blocks(twin)) == 2  # its two full blocks are published now
    bm.free(remote)
    assert bm.counts() == {"free": 6, "cached": 2, "in_use": 0}
    bm.check_invariant(expect_idle=True)


def test_reserve_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.reserve(make_request("big", list(range(12))), 13) is None
    assert bm.counts() == {"free": 2, "cached": 0, "in_use": 0}
    bm.check_invariant(expect_idle=True)


def test_events_are_recorded_only_when_asked() -> None:
    """An engine nobody drains (the offline LLM) must not grow event lists forever."""
    bm = BlockManager(8, BS)
    admit(bm, make_request("a", range(2 * BS + 1)))
    assert bm.drain_events() == ([], [])
    bm.record_events = True
    admit(bm, make_request("b", range(100, 100 + 2 * BS + 1)))
    assert len(bm.drain_events()[0]) == 2
