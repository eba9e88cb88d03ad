"""Global prefix index in Redis: which worker holds which KV block, and at which tier. Plain Python.

Key layout (``ns`` is the model's name; the tenant's ``cache_salt`` is already folded into the
chained block hashes of ``engine.block_manager.prefix_block_hashes``, so salts never collide)::

    tandem:{ns}:bt:{hex digest}  HASH worker id -> tier code of the workers holding that block
    tandem:{ns}:w:{worker}       liveness key, "1" with a TTL of heartbeat_ttl_s, set by heartbeat()

A worker's KV lives in tiers (engine.kv_tiers): the device pool's prefix cache, host memory and
disk, each keyed by the same hash. The index keeps, per block and worker, the best (cheapest) tier
that worker holds it at, as one character, ordered by cost::

    "0" device   free: the engine's prefix hit
    "1" host     loaded back from host memory
    "2" disk     read from a block file, then loaded

A worker counts only while its liveness key exists: once it expires (or ``remove_worker``
deletes it) the worker's hash fields are ignored at once and removed lazily by lookups.

Life of a block hash::

    worker process                                                         Redis
    engine thread: BlockManager.drain_events()        -> push(.., "device")
                   KVTiers.drain_events()["host"]     -> push(.., "host")
                   KVTiers.drain_events()["disk"]     -> push(.., "disk")
                   (at start: KVTiers.record_events(), the files found on disk, pushed first)
                   (applies the events to the local mirror, hash -> tiers held; marks a hash
                   dirty when its best tier changes; no I/O)
    publisher thread, every interval_s:   dirty hashes -> publish()    ->  HSET / HDEL
                     every heartbeat_s:   heartbeat()  -> False?       ->  re-publish the mirror
    router process:  lookup(prompt hashes) -> {worker: tier code per leading block}  (one EVALSHA)

A block that leaves the device pool but stays in host memory is lowered to "1" (host); one that
leaves its last tier (a host LRU eviction with no disk tier, a disk file evicted or rejected) is
removed. ``lookup`` walks the prompt's hashes in order, keeping the alive workers that hold every
block so far, at any tier: a worker's answer is one tier code per block of its leading run, e.g.
``"00011"`` (three blocks on device, two in host memory). A worker holding block 3 but not block
0 has no usable prefix and is absent from the result (absent means none).

The mirror (the tiers each hash is held at) is the truth. If Redis loses its data (restart) the
heartbeat finds its liveness key gone and the publisher re-publishes the mirror; after Redis was
unreachable it does so too, and removes the hashes evicted meanwhile (kept as dirty hashes,
bounded by ``max_pending``; past that, all of this worker's entries are purged by a SCAN first).

The lookup script touches liveness keys it does not declare in KEYS: single-node Redis only.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

# Tier codes, cheapest first: what a block's field holds, and the characters of a lookup's answer.
DEVICE, HOST, DISK = "0", "1", "2"
TIER_CODES = {"device": DEVICE, "host": HOST, "disk": DISK}

# KEYS: the prompt's block keys in order. ARGV[1]: liveness key prefix.
# Returns [w1, tiers1, w2, tiers2, ..]: each worker's tier code per block of its leading run.
_LOOKUP_LUA = """
local alive_prefix = ARGV[1]
local first = redis.call('HGETALL', KEYS[1])
local live, tiers = {}, {}
for j = 1, #first, 2 do
  local w = first[j]
  if redis.call('EXISTS', alive_prefix .. w) == 1 then
    live[#live + 1] = w
    tiers[w] = {first[j + 1]}
  else
    redis.call('HDEL', KEYS[1], w)
  end
end
local order = live
local i = 2
while #live > 0 and i <= #KEYS do
  local held = redis.call('HMGET', KEYS[i], unpack(live))
  local keep = {}
  for j, w in ipairs(live) do
    if held[j] then
      keep[#keep + 1] = w
      local t = tiers[w]
      t[#t + 1] = held[j]
    end
  end
  live = keep
  i = i + 1
end
local out = {}
for _, w in ipairs(order) do
  out[#out + 1] = w
  out[#out + 1] = table.concat(tiers[w])
end
return out
"""

_PIPELINE_CHUNK = 10_000  # commands per pipeline call in a full re-publish or a purge


class IndexUnavailable(Exception):
    """Redis could not be reached or refused a command; the index is a hint, callers go on
    without it."""


class PrefixIndex:
    """Client for the index of one namespace. Thread-safe (redis-py's connection pool).

    A refused connection is retried once at once (a pooled socket gone stale after a Redis
    restart); a timeout is not retried, so a call fails within about ``socket_timeout_s``.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        heartbeat_ttl_s: float = 10.0,
        socket_timeout_s: float = 0.5,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty (use the model's name)")
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {heartbeat_ttl_s}")
        self.namespace = namespace
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._block_prefix = f"tandem:{namespace}:bt:"
        self._alive_prefix = f"tandem:{namespace}:w:"
        self._r = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            decode_responses=True,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self._lookup = self._r.register_script(_LOOKUP_LUA)

    def block_key(self, block_hash: bytes) -> str:
        return self._block_prefix + block_hash.hex()

    def worker_key(self, worker: str) -> str:
        return self._alive_prefix + worker

    def publish(
        self,
        worker: str,
        stored: Iterable[bytes] | Mapping[bytes, str],
        evicted: Iterable[bytes],
        tier: str = "device",
    ) -> None:
        """Set ``worker``'s tier code in every stored block's hash (``stored`` maps hash -> tier
        code, or lists hashes all held at ``tier``: device, host or disk) and delete its field
        from every evicted one, in one pipeline (stored first: a hash in both ends up absent)."""
        if isinstance(stored, Mapping):
            items: Iterable[tuple[bytes, str]] = stored.items()
        else:
            items = ((h, TIER_CODES[tier]) for h in stored)
        pipe = self._r.pipeline(transaction=False)
        for h, code in items:
            pipe.hset(self.block_key(h), worker, code)
        for h in evicted:
            pipe.hdel(self.block_key(h), worker)
        if len(pipe) == 0:
            return
        try:
            pipe.execute()
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"publish for {worker!r}: {e}") from e

    def heartbeat(self, worker: str) -> bool:
        """Set the liveness key with a fresh TTL. True if it was there already; False if it was
        created (first beat, expired, or Redis lost its data): re-publish everything then."""
        try:
            old = self._r.set(
                self.worker_key(worker), 1, px=max(1, int(self.heartbeat_ttl_s * 1000)), get=True
            )
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"heartbeat for {worker!r}: {e}") from e
        return old is not None

    def remove_worker(self, worker: str) -> None:
        """Delete the liveness key: the worker stops counting at once (entries cleaned lazily)."""
        try:
            self._r.delete(self.worker_key(worker))
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"remove_worker {worker!r}: {e}") from e

    def purge_worker(self, worker: str) -> int:
        """Remove ``worker`` from every block hash of the namespace (a SCAN: O(keys), rare).
        Returns how many entries were removed."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._block_prefix) + "*"
        removed = 0
        try:
            keys: list[str] = []
            for key in self._r.scan_iter(match=pattern, count=1000):
                keys.append(key)
                if len(keys) >= _PIPELINE_CHUNK:
                    removed += self._hdel_all(keys, worker)
                    keys = []
            return removed + self._hdel_all(keys, worker)
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"purge_worker {worker!r}: {e}") from e

    def _hdel_all(self, keys: list[str], worker: str) -> int:
        if not keys:
            return 0
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hdel(key, worker)
        return sum(pipe.execute())

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, str]:
        """For every alive worker holding ``hashes[0]``: the tier code of each leading block of
        ``hashes`` it holds, at any tier (``len`` of it: the blocks of its cached prefix).
        Workers with no prefix are absent. One round trip; ``{}`` for no hashes."""
        if not hashes:
            return {}
        try:
            flat = self._run_lookup(hashes)
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"lookup of {len(hashes)} blocks: {e}") from e
        return _held(flat)

    def lookup_many(self, batch: Sequence[Sequence[bytes]]) -> list[dict[str, str]]:
        """``lookup`` of each prompt's hashes in ``batch``, all in one round trip (a pipeline of
        the same script): a router with many prompts at once pays one hop, not one each."""
        todo = [i for i, hashes in enumerate(batch) if hashes]
        out: list[dict[str, str]] = [{} for _ in batch]
        if not todo:
            return out
        pipe = self._r.pipeline(transaction=False)
        for i in todo:
            self._run_lookup(batch[i], client=pipe)
        try:
            results = pipe.execute()
        except (redis.RedisError, OSError) as e:
            raise IndexUnavailable(f"lookup of {len(todo)} prompts: {e}") from e
        for i, flat in zip(todo, results, strict=True):
            out[i] = _held(flat)
        return out

    def _run_lookup(self, hashes: Sequence[bytes], client: Any = None) -> Any:
        """The lookup script over ``hashes``' block keys (queued on ``client``, a pipeline)."""
        keys = [self.block_key(h) for h in hashes]
        return self._lookup(keys=keys, args=[self._alive_prefix], client=client)

    def close(self) -> None:
        self._r.close()


def _held(flat: list) -> dict[str, str]:
    """The lookup script's flat [worker, tiers, worker, tiers, ...] answer as a dict."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _best(tiers: int) -> str | None:
    """The cheapest tier code of a mirror entry (bit i set: held at tier code i), or None."""
    return str((tiers & -tiers).bit_length() - 1) if tiers else None


class IndexPublisher:
    """Publishes one worker's block events, per tier, from a daemon thread, started by the
    constructor. ``push`` is the only call the engine thread makes: no I/O, never raises.

    Counters (plain ints, written by the publisher thread only): ``published_events`` (HSET/HDEL
    commands acknowledged), ``failures`` (rounds that hit IndexUnavailable), ``republished``
    (full re-publishes of the mirror; the first heartbeat makes one).
    """

    def __init__(
        self,
        index: PrefixIndex,
        worker: str,
        *,
        interval_s: float = 0.05,
        heartbeat_s: float | None = None,
        max_pending: int = 100_000,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.index = index
        self.worker = worker
        self.interval_s = interval_s
        self.heartbeat_s = index.heartbeat_ttl_s / 3 if heartbeat_s is None else heartbeat_s
        if not 0 < self.heartbeat_s < index.heartbeat_ttl_s:
            raise ValueError(
                f"heartbeat_s must be in (0, heartbeat_ttl_s={index.heartbeat_ttl_s}), "
                f"got {self.heartbeat_s}: the liveness key would expire between beats"
            )
        self.max_pending = max_pending
        self.max_backoff_s = max_backoff_s
        self.published_events = 0
        self.failures = 0
        self.republished = 0
        self._lock = threading.Lock()
        # hash -> the tiers this worker holds it at, bit i for tier code i (the truth)
        self._mirror: dict[bytes, int] = {}
        self._dirty: set[bytes] = set()  # hashes whose best tier Redis may not have yet
        self._full = True  # next round re-publishes the whole mirror
        self._purge = False  # dirty overflowed: stale entries may be in Redis, purge them first
        self._down = False
        self._next_beat = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"prefix-index-{worker}", daemon=True
        )
        self._thread.start()

    @property
    def num_held(self) -> int:
        return len(self._mirror)

    def push(self, stored: Sequence[bytes], evicted: Sequence[bytes], tier: str = "device") -> None:
        """Apply one tier's ``drain_events()`` batch (``tier``: device, host or disk) to the
        mirror. Within one batch a hash's events alternate (stored, evicted, stored, ...), so it
        is held there iff held + #stored - #evicted > 0, whatever the interleaving the two lists
        lost. The tiers are independent: their batches may come in any order. A hash is dirty
        (published next round) when its best tier changed."""
        if not stored and not evicted:
            return
        try:
            bit = 1 << int(TIER_CODES[tier])
            delta = Counter(stored)
            delta.subtract(evicted)
            with self._lock:
                for h, d in delta.items():
                    old = self._mirror.get(h, 0)
                    new = old | bit if bool(old & bit) + d > 0 else old & ~bit
                    if new == old:
                        continue
                    if new:
                        self._mirror[h] = new
                    else:
                        del self._mirror[h]
                    if _best(new) != _best(old):
                        self._dirty.add(h)
                self._check_overflow()
        except Exception:  # never let the index hurt the engine
            logger.exception("prefix index push failed for worker %s", self.worker)

    def _check_overflow(self) -> None:
        """Caller holds the lock. Too many pending hashes (Redis down for long): drop them; a
        purge plus a full re-publish of the mirror replaces them."""
        if len(self._dirty) > self.max_pending:
            self._dirty.clear()
            self._purge = self._full = True

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            try:
                self._round()
            except Exception as e:
                self.failures += 1
                with self._lock:
                    self._full = True  # whatever was in flight: the mirror is re-sent
                if not isinstance(e, IndexUnavailable):
                    logger.exception("prefix index round failed for worker %s", self.worker)
                elif not self._down:
                    self._down = True
                    logger.warning(
                        "prefix index unreachable for worker %s (%s); keeping a local mirror "
                        "and retrying",
                        self.worker,
                        e,
                    )
                wait = min(max(wait * 2, self.interval_s), self.max_backoff_s)
                continue
            if self._down:
                self._down = False
                logger.info("prefix index reachable again for worker %s", self.worker)
            wait = self.interval_s

    def _round(self) -> None:
        """One publish round: heartbeat when due (or before a full re-publish), then send."""
        now = time.monotonic()
        with self._lock:
            full = self._full
        if full or now >= self._next_beat:
            if not self.index.heartbeat(self.worker):
                full = True
            self._next_beat = now + self.heartbeat_s
        with self._lock:
            purge, self._purge = self._purge, False
        if purge:
            try:
                self.index.purge_worker(self.worker)
            except IndexUnavailable:
                with self._lock:
                    self._purge = True
                raise
        with self._lock:
            full = full or self._full
            self._full = False
            dirty, self._dirty = self._dirty, set()
            todo = self._mirror if full else dirty
            held = [(h, _best(self._mirror[h])) for h in todo if h in self._mirror]
            gone = [h for h in dirty if h not in self._mirror]
        try:
            for i in range(0, max(len(held), 1), _PIPELINE_CHUNK):
                self.index.publish(
                    self.worker, dict(held[i : i + _PIPELINE_CHUNK]), gone if i == 0 else ()
                )
        except Exception:
            with self._lock:
                self._dirty |= dirty
                self._full = self._full or full
                self._check_overflow()
            raise
        self.published_events += len(held) + len(gone)
        if full:
            self.republished += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, then delete the liveness key (best effort; never raises)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        try:
            self.index.remove_worker(self.worker)
        except Exception as e:
            logger.debug("remove_worker %s on close failed: %s", self.worker, e)
