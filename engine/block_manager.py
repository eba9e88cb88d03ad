"""Paged KV blocks: ref counts, chained sha256 prefix hashes, LRU eviction. Plain Python.

Every block is in exactly one of three states::

    free    ref_cnt == 0, no hash           in the free queue (handed out first)
    cached  ref_cnt == 0, holds a hash      in the free queue, still findable by its hash
    in use  ref_cnt >= 1                    owned by one or more requests

so ``free + cached + in_use == num_blocks`` at all times (``check_invariant``). The free queue is
an LRU: blocks are taken from its front; a freed request's blocks go to its back in reverse
order, so a prompt's tail is evicted before its head (heads are shared more often).

A full block's hash chains its parent's: ``h_i = sha256(h_{i-1} || token ids of block i)`` with
``h_{-1} = sha256("tandem" || salt)``, so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from engine.request import Request


def root_hash(salt: str | None) -> bytes:
    return hashlib.sha256(b"tandem-kv-root:" + (salt or "").encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, start: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``, extending ``start`` (already known)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._req_num_hashed: dict[str, int] = {}
        self.record_events = False  # keep stored / evicted hashes for drain_events
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        self.record_full = False  # keep (block id, hash) of newly full blocks for drain_full
        self._full: list[tuple[int, bytes]] = []
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def counts(self) -> dict[str, int]:
        """Blocks free (no hash), cached (free but findable) and in use; they sum to the total."""
        cached = sum(1 for i in self._free if self.blocks[i].block_hash is not None)
        return {
            "free": len(self._free) - cached,
            "cached": cached,
            "in_use": self.num_blocks - len(self._free),
        }

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def update_hashes(self, request: Request) -> None:
        if self.enable_prefix_caching:
            request.block_hashes = prefix_block_hashes(
                request.all_token_ids, self.block_size, request.cache_salt, request.block_hashes
            )

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest cached prefix of ``request`` in whole blocks (at least one token is left
        to compute, so the request still gets logits to sample from)."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in request.block_hashes[:limit]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its computed tokens
        and ``computed_blocks``, the prefix hits found at admission). Returns the newly allocated
        block ids, or ``None`` (and changes nothing) when they do not fit."""
        owned = self._req_blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens += num_new_tokens
        num_new = self.blocks_needed(num_tokens) - len(owned) - len(computed_blocks)
        hits_in_free = 0
        if computed_blocks:  # (a running request's next chunk, the common case, has none)
            hits_in_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_new > len(self._free) - hits_in_free:
            if not owned:
                del self._req_blocks[request.request_id]
            return None
        if computed_blocks:
            for block_id in computed_blocks:
                self._touch(block_id)
            owned.extend(computed_blocks)
        new_blocks = [self._pop_free() for _ in range(num_new)] if num_new > 0 else []
        owned.extend(new_blocks)
        self._cache_full_blocks(request, num_tokens)
        return new_blocks

    def allocate_for_load(
        self, request: Request, computed_blocks: Sequence[int], num_blocks: int
    ) -> list[int] | None:
        """The prefix hits ``computed_blocks`` plus ``num_blocks`` fresh blocks that a lower KV
        tier fills (the request waits while it does). Their hashes are registered when the
        request next computes (``allocate_slots``), once their contents are in, as ``reserve``
        does. Returns the fresh block ids, or ``None`` (nothing changed) when they do not fit."""
        if request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        hits_in_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_blocks > len(self._free) - hits_in_free:
            return None
        for block_id in computed_blocks:
            self._touch(block_id)
        new_blocks = [self._pop_free() for _ in range(num_blocks)]
        self._req_blocks[request.request_id] = [*computed_blocks, *new_blocks]
        self._req_num_hashed[request.request_id] = len(computed_blocks)
        return new_blocks

    def reserve(self, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks for the first ``num_tokens`` tokens of a request whose KV will be written by
        someone else (a remote prefill worker). Their hashes are registered only once the request
        computes on this side (its first ``allocate_slots``), so no other request can hit a
        block whose contents have not arrived yet. ``None`` (nothing changed) when they do not fit."""
        if request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            return None
        blocks = [self._pop_free() for _ in range(needed)]
        self._req_blocks[request.request_id] = blocks
        return list(blocks)

    def extend_reservation(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow a reservation to hold ``num_tokens`` tokens; its whole block table, or ``None``
        (nothing changed) when the blocks do not fit."""
        owned = self._req_blocks[request_id]
        more = self.blocks_needed(num_tokens) - len(owned)
        if more > len(self._free):
            return None
        owned.extend(self._pop_free() for _ in range(max(more, 0)))
        return list(owned)

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks; hashed ones stay findable until evicted."""
        owned = self._req_blocks.pop(request.request_id, [])
        self._req_num_hashed.pop(request.request_id, None)
        for block_id in reversed(owned):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # holds nothing: reuse first

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when nothing is running)."""
        if len(self._free) != self.num_blocks:
            return False
        for h, block_id in self._cached.items():
            self.blocks[block_id].block_hash = None
            if self.record_events:
                self._evicted.append(h)
        self._cached.clear()
        return True

    def drain_full(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of every block registered full since the last call (recorded only
        while ``record_full`` is set): what the lower KV tiers copy down."""
        full, self._full = self._full, []
        return full

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes stored and evicted since the last call (for the global prefix index; recorded
        only while ``record_events`` is set)."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    # -- internals -----------------------------------------------------------------------------

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.record_events:
                    self._evicted.append(block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of the request's blocks that are full once ``num_tokens`` tokens
        are computed. The KV is written this step, before any later step can read it; a request
        admitted later in the same step reads it after the write, layer by layer."""
        if not self.enable_prefix_caching:
            return
        start = self._req_num_hashed.get(request.request_id, 0)
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self.update_hashes(request)
        owned = self._req_blocks[request.request_id]
        for i in range(start, end):
            block = self.blocks[owned[i]]
            h = request.block_hashes[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
                if self.record_events:
                    self._stored.append(h)
                if self.record_full:
                    self._full.append((block.block_id, h))
        self._req_num_hashed[request.request_id] = end

    def check_invariant(self, expect_idle: bool = False) -> None:
        """free + cached + in use == total, and the indexes agree with the blocks."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for i in self._free if self.blocks[i].block_hash is not None)
        free = len(self._free) - cached
        msg = f"free={free} cached={cached} in_use={in_use} total={self.num_blocks}"
        if free + cached + in_use != self.num_blocks:
            raise AssertionError(f"block accounting broken: {msg}")
        if any(self.blocks[i].ref_cnt != 0 for i in self._free):
            raise AssertionError(f"a block in the free queue has references: {msg}")
        owners = sum(len(v) for v in self._req_blocks.values())
        if owners != sum(b.ref_cnt for b in self.blocks):
            raise AssertionError(f"ref counts ({owners} owned) disagree with blocks: {msg}")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"prefix index points at a block with another hash: {msg}")
        if expect_idle and in_use:
            raise AssertionError(f"blocks leaked while idle: {msg}")
