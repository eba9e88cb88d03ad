"""KV tiers below the device pool: host memory, then disk. One block is one contiguous transfer.

::

    device pool (BlockManager)   paged blocks, prefix cache keyed by chained sha256 hashes, LRU
        |  write-through: a block is copied down once it is full, right after the step that
        |  fills it is queued (a gather on the compute stream, then a copy on the offload stream)
        v
    host tier (HostTier)         slots of one block each, pinned on CUDA, LRU, one slot per hash
        |  an I/O thread writes each landed block to disk, unless a file is there already
        v
    disk tier (DiskTier)         one checked file per block, shared by the workers of a node,
                                 kept across restarts, LRU by bytes

A block is written once per tier; since every full block is already below, leaving the device
pool costs nothing (vLLM's offloading connector and SGLang's HiCache write through the same way:
an eviction never waits for a copy, and the copy never races the write that reuses the block).

Admission (engine.scheduler): after the device's prefix hits, ``plan`` counts the leading blocks
found below that are cheaper to load than to recompute (costs measured at start-up); the request
gets fresh blocks and waits in ``LOADING`` while ``start_load`` fills them: disk reads on an I/O
thread into host slots, then one host-to-device copy per block and a scatter into the pool on the
load stream. The batch never waits; ``landed`` hands back the requests whose blocks are in.

A block's layout below is ``[layers, 2, kv_heads, block_size, head_dim]`` in the KV dtype (moved
as raw bits: an integer view of the same width, so FP8 travels unchanged). On CPU every copy is
a memory copy and the device pool is memory too: the host tier is a second pool there, and the
disk tier is what outlives the process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.attention import host_to_device

logger = logging.getLogger(__name__)

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element width -> raw view dtype
_SAVE_CHUNK = 64  # blocks gathered into one device staging buffer at a time
STAGING_BLOCKS = 256  # host slots that stage disk writes and reads when the host tier is off


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block below the device pool, and the gather / scatter between the pool's
    per-layer ``[2, kv_heads, num_blocks * block_size, head_dim]`` tensors and it."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def raw_dtype(self) -> torch.dtype:
        return _RAW[torch.empty((), dtype=self.dtype).element_size()]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def _pool_view(self, cache: torch.Tensor) -> torch.Tensor:
        """A layer's cache as ``[2, kv_heads, num_blocks, block_size, head_dim]`` raw bits."""
        num_blocks = cache.shape[2] // self.block_size
        return cache.view(self.raw_dtype).view(
            2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim
        )

    def stacked(self, caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Every layer's cache as one ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]``
        raw view, when the layers are consecutive slices of one allocation (the model runner
        allocates them so): a gather or scatter is then one kernel for all layers. None
        otherwise."""
        first = caches[0]
        step = first.numel()
        for i, cache in enumerate(caches):
            if (
                not cache.is_contiguous()
                or cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or cache.storage_offset() != first.storage_offset() + i * step
            ):
                return None
        pool = self._pool_view(first)
        return pool.as_strided((len(caches), *pool.shape), (step, *pool.stride()))

    def gather(
        self,
        caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        stacked: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[n, numel]`` raw bits of blocks ``block_ids``, each block's layers contiguous."""
        n = block_ids.numel()
        if stacked is not None:  # one pass: the output of index_select is contiguous
            by_block = stacked.permute(3, 0, 1, 2, 4, 5)  # [num_blocks, L, 2, H, bs, D] view
            return by_block.index_select(0, block_ids).view(n, self.numel)
        out = torch.empty((n, *self.shape), dtype=self.raw_dtype, device=caches[0].device)
        for layer, cache in enumerate(caches):
            out[:, layer] = self._pool_view(cache).index_select(2, block_ids).permute(2, 0, 1, 3, 4)
        return out.view(n, self.numel)

    def scatter(
        self,
        caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        src: torch.Tensor,
        stacked: torch.Tensor | None = None,
    ) -> None:
        """Write ``src`` (``[n, numel]`` raw bits, on the pool's device) into blocks ``block_ids``."""
        blocks = src.view(-1, *self.shape)
        if stacked is not None:
            stacked.permute(3, 0, 1, 2, 4, 5).index_copy_(0, block_ids, blocks)
            return
        for layer, cache in enumerate(caches):
            self._pool_view(cache).index_copy_(
                2, block_ids, blocks[:, layer].permute(1, 2, 0, 3, 4)
            )


def kv_identity(model_config, engine_config, layout: BlockLayout) -> str:
    """What a block's bits depend on besides its tokens: the model (its config and weights
    files, or the dummy weights' seed), the dtypes and the layout. Files of another identity
    are never loaded."""
    model_dir = Path(engine_config.model_dir)
    if engine_config.load_format == "dummy":
        weights: object = f"dummy:{engine_config.seed}"
    else:
        weights = sorted(
            (p.name, p.stat().st_size)
            for p in model_dir.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt")
        )
    doc = {
        "version": 1,
        "config": model_config.raw,
        "weights": weights,
        "dtype": str(layout.dtype),
        "shape": list(layout.shape),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: ``(index of the run's first, first slot, length)``,
    so each run is one copy (slots handed out from a fresh tier are consecutive)."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            first, start, count = out[-1]
            out[-1] = (first, start, count + 1)
        else:
            out.append((i, slot, 1))
    return out


# -- the host tier ---------------------------------------------------------------------------------


class HostTier:
    """Slots of one block each. A slot is free, being written (its copy not landed: not
    findable), or holding a block (findable, in LRU order). A held slot is pinned while a copy
    reads it (a load to the device, a disk write) and is then never evicted."""

    def __init__(self, layout: BlockLayout, num_slots: int, pin: bool) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.data = torch.empty((num_slots, layout.numel), dtype=layout.raw_dtype, pin_memory=pin)
        self._held: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()  # I/O threads unpin
        self.evictions = 0
        self.record_events = False  # keep stored / evicted hashes for KVTiers.drain_events
        self.stored_hashes: list[bytes] = []
        self.evicted_hashes: list[bytes] = []

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def slot(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._held.get(block_hash)
        if slot is not None:
            self._held.move_to_end(block_hash)
        return slot

    def take(self) -> int | None:
        """A slot to write a block into: a free one, else the least recently used unpinned one
        (its block is forgotten). None when every slot is pinned or being written."""
        if self._free:
            return self._free.pop()
        with self._lock:
            for h, slot in self._held.items():
                if not self._pins.get(slot):
                    del self._held[h]
                    self.evictions += 1
                    if self.record_events:
                        self.evicted_hashes.append(h)
                    return slot
        return None

    def hold(self, block_hash: bytes, slot: int) -> bool:
        """``slot``'s copy of ``block_hash`` landed: findable from now on. False (and the slot
        stays the caller's) when another slot holds that block already."""
        if block_hash in self._held:
            return False
        self._held[block_hash] = slot
        if self.record_events:
            self.stored_hashes.append(block_hash)
        return True

    def give_back(self, slot: int) -> None:
        """A slot taken for a copy that did not happen (a failed disk read)."""
        self._free.append(slot)

    def pin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        with self._lock:
            left = self._pins[slot] - 1
            if left:
                self._pins[slot] = left
            else:
                del self._pins[slot]

    def raw(self, slot: int) -> np.ndarray:
        """The slot's bytes as a writable uint8 array (no copy)."""
        return self.data[slot].numpy().view(np.uint8)


# -- the disk tier ---------------------------------------------------------------------------------

_MAGIC = b"TNDMKV\x00\x01"
_HEAD = struct.Struct("<8sI")  # magic, header length; then a JSON header, then the block's bytes


class DiskTier:
    """One file per block under ``root/<identity prefix>/<2 hex>/<hash>.kv``, written to a
    temporary name and renamed, so a crash leaves no half-written ``.kv`` file. Each file
    carries the identity, the block hash, dtype, shape, byte count and a sha256 of its bytes;
    a file that disagrees with any of them is removed, never loaded. Workers of one node may
    share the folder: lookups ask the file system, so a block one worker wrote is found by
    another. The size bound is kept by each writer over the files it knows (scanned at start,
    written, or read), oldest use first."""

    def __init__(
        self, root: str | Path, identity: str, capacity_bytes: int, layout: BlockLayout
    ) -> None:
        self.identity, self.layout, self.capacity_bytes = identity, layout, capacity_bytes
        self.dir = Path(root) / identity[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._known: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._lock = threading.Lock()
        self.stored = self.evictions = self.rejected = 0
        self.record_events = False  # keep stored / evicted hashes for KVTiers.drain_events
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        self._scan()

    def _scan(self) -> None:
        files = []
        for path in self.dir.glob("*/*"):
            if path.suffix == ".tmp":
                with _quiet():
                    if time.time() - path.stat().st_mtime > 600:  # a writer died mid-file
                        path.unlink()
                continue
            if path.suffix == ".kv":
                with _quiet():
                    st = path.stat()
                    files.append((st.st_mtime, path.name, st.st_size))
        for _, name, size in sorted(files):
            self._known[name] = size
        self._evict_over()

    @property
    def used_bytes(self) -> int:
        with self._lock:  # the I/O threads add and drop files
            return sum(self._known.values())

    def path(self, block_hash: bytes) -> Path:
        hexed = block_hash.hex()
        return self.dir / hexed[:2] / f"{hexed}.kv"

    def __contains__(self, block_hash: bytes) -> bool:
        return self.path(block_hash).is_file()

    def _header(self, block_hash: bytes, payload: np.ndarray) -> bytes:
        doc = {
            "identity": self.identity,
            "block": block_hash.hex(),
            "dtype": str(self.layout.dtype),
            "shape": list(self.layout.shape),
            "nbytes": int(payload.nbytes),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        text = json.dumps(doc, sort_keys=True).encode()
        return _HEAD.pack(_MAGIC, len(text)) + text

    def write(self, block_hash: bytes, payload: np.ndarray, count: bool = True) -> bool:
        """Store a block's bytes (I/O thread). False when a file is there already. ``count``
        False: the start-up timing's probe, kept out of the counters, the events and the size
        bound (it must not push a block file found at start out)."""
        path = self.path(block_hash)
        if path.is_file():
            return False
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(self._header(block_hash, payload))
            f.write(memoryview(payload))
        os.replace(tmp, path)
        if not count:
            return True
        with self._lock:
            self._known[path.name] = path.stat().st_size
            self._known.move_to_end(path.name)
            self.stored += 1
            if self.record_events:
                self._stored.append(block_hash)
            self._evict_over()
        return True

    def remove(self, block_hash: bytes) -> None:
        path = self.path(block_hash)
        with self._lock:
            self._known.pop(path.name, None)
        with _quiet():
            path.unlink()

    def _forget(self, name: str) -> None:
        """Caller holds the lock: a file of ours is gone (evicted, or rejected)."""
        if self._known.pop(name, None) is not None and self.record_events:
            self._evicted.append(bytes.fromhex(name.removesuffix(".kv")))

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes this worker stored on disk and those of its files gone since the last call."""
        with self._lock:
            stored, evicted = self._stored, self._evicted
            self._stored, self._evicted = [], []
        return stored, evicted

    def known(self) -> list[bytes]:
        """Hashes of the files this worker knows (found at start, written, or read)."""
        with self._lock:
            return [bytes.fromhex(n.removesuffix(".kv")) for n in self._known]

    def read_into(self, block_hash: bytes, out: np.ndarray) -> bool:
        """Read a block into ``out`` (uint8, the block's size) after checking its header and
        checksum (I/O thread). A file that fails a check is removed; False when there is no
        usable file."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                magic, length = _HEAD.unpack(f.read(_HEAD.size))
                if magic != _MAGIC or length > 1 << 16:
                    return self._reject(path, "not a tandem KV file")
                doc = json.loads(f.read(length))
                why = self._mismatch(doc, block_hash, out.nbytes)
                if why is not None:
                    return self._reject(path, why)
                if f.readinto(memoryview(out)) != out.nbytes or f.read(1):
                    return self._reject(path, "its size is wrong (a torn write?)")
            if hashlib.sha256(out).hexdigest() != doc["sha256"]:
                return self._reject(path, "its checksum does not match its bytes")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, struct.error) as exc:
            return self._reject(path, f"unreadable ({exc})")
        with _quiet():
            os.utime(path)  # most recently used, for every writer sharing the folder
        with self._lock:
            if path.name in self._known:
                self._known.move_to_end(path.name)
        return True

    def _mismatch(self, doc: dict, block_hash: bytes, nbytes: int) -> str | None:
        expected = {
            "identity": self.identity,
            "block": block_hash.hex(),
            "dtype": str(self.layout.dtype),
            "shape": list(self.layout.shape),
            "nbytes": nbytes,
        }
        for key, value in expected.items():
            if doc.get(key) != value:
                return f"its {key} is {doc.get(key)!r}, expected {value!r}"
        return None

    def _reject(self, path: Path, why: str) -> bool:
        logger.warning("KV disk tier: ignoring %s: %s", path, why)
        with self._lock:
            self.rejected += 1
            self._forget(path.name)
        with _quiet():
            path.unlink()
        return False

    def _evict_over(self) -> None:
        total = sum(self._known.values())
        while total > self.capacity_bytes and self._known:
            name = next(iter(self._known))
            total -= self._known[name]
            self._forget(name)
            with _quiet():
                (self.dir / name[:2] / name).unlink()
            self.evictions += 1


class _quiet:
    """Suppress OSError: a file another worker removed or replaced meanwhile is not a fault."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


# -- the tiers together ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TierCosts:
    """Seconds per block, measured at start-up: loading one block from each tier into the
    device pool, and recomputing one block's tokens (a prefill chunk's time per token times the
    block size). A tier is used for a prefix when its load is cheaper than the recompute."""

    host_load_s: float
    disk_load_s: float
    recompute_s: float

    def worth(self, tier: str) -> bool:
        return (self.host_load_s if tier == "host" else self.disk_load_s) < self.recompute_s

    def as_dict(self) -> dict[str, float]:
        return {
            "host_load_s": self.host_load_s,
            "disk_load_s": self.disk_load_s,
            "recompute_s": self.recompute_s,
        }


@dataclass
class _Block:
    """One block of a load: its hash, the host slot it comes through, whether it is read from
    disk first, and whether that slot stays in the host tier afterwards."""

    block_hash: bytes
    slot: int
    from_disk: bool
    kept: bool = True


@dataclass
class _Load:
    """One request's blocks coming up, in order, into device blocks ``block_ids``."""

    request_id: str
    blocks: list[_Block]
    block_ids: list[int]
    started: float
    reads: Future | None = None  # disk reads on the I/O pool: how many leading blocks arrived
    num_ok: int = -1  # leading blocks whose bytes are in host slots (known once reads are done)
    event: torch.cuda.Event | None = None  # the copy to the device, queued
    copied: bool = False


@dataclass
class TierStats:
    host_hits: int = 0  # blocks loaded from the host tier
    disk_hits: int = 0  # blocks loaded from disk (through a host slot)
    host_stored: int = 0
    saves_dropped: int = 0  # full blocks not written down: every host slot busy
    disk_writes_dropped: int = 0  # the disk writer's queue was full
    loads: int = 0
    load_time_s: float = 0.0
    load_time_max_s: float = 0.0
    bytes_down: int = 0  # device -> host
    bytes_up: int = 0  # host -> device
    disk_bytes_read: int = 0
    preempt_swapped: int = 0
    preempt_recomputed: int = 0


class KVTiers:
    """The host and disk tiers of one engine (engine thread, except the I/O threads it owns).
    The scheduler sees ``plan`` / ``start_load`` / ``landed`` / ``on_preempt`` / ``wait``."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        layout: BlockLayout,
        host_slots: int,
        disk: DiskTier | None,
        *,
        host_is_staging: bool = False,
        disk_queue: int = 4096,
    ) -> None:
        self.caches, self.layout, self.disk = caches, layout, disk
        self.stacked = layout.stacked(caches)  # one kernel per gather / scatter, when possible
        self.device = caches[0].device
        self.cuda = self.device.type == "cuda"
        self.host = HostTier(layout, host_slots, pin=self.cuda)
        # With no host tier configured the host slots only stage disk I/O (STAGING_BLOCKS of
        # them); a block still in one is loaded from there all the same.
        self.host_is_staging = host_is_staging
        self.stats = TierStats()
        self.costs = TierCosts(0.0, 0.0, float("inf"))
        self._saving: list[tuple[torch.cuda.Event, list[tuple[bytes, int]]]] = []  # CUDA
        self._loads: dict[str, _Load] = {}
        self._landed: dict[str, int] = {}
        if self.cuda:
            self._offload_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="kv-disk-read") if disk else None
        self._writes: queue.Queue | None = None
        if disk is not None:
            self._writes = queue.Queue(maxsize=disk_queue)
            threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True).start()
        self._closed = False

    # -- down: write-through of full blocks -------------------------------------------------------

    def save(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Copy newly full device blocks ``(block id, hash)`` down, each once per tier. Call it
        right after queuing the step that writes them: the gather is queued behind that step on
        the same stream, and before any later step that reuses the blocks."""
        self._land_saves()
        todo = [(b, h) for b, h in blocks if h not in self.host and not self._on_disk_only(h)]
        for i in range(0, len(todo), _SAVE_CHUNK):
            self._save_chunk(todo[i : i + _SAVE_CHUNK])

    def _on_disk_only(self, block_hash: bytes) -> bool:
        """With the host slots only staging, a block already on disk needs no copy."""
        return self.host_is_staging and self.disk is not None and block_hash in self.disk

    def _save_chunk(self, chunk: list[tuple[int, bytes]]) -> None:
        slots = []
        for _, _h in chunk:
            slot = self.host.take()
            if slot is None:
                break
            slots.append(slot)
        self.stats.saves_dropped += len(chunk) - len(slots)
        chunk = chunk[: len(slots)]
        if not chunk:
            return
        # pinned and queued, never pageable: that copy would wait for the step in flight
        ids = host_to_device(np.array([b for b, _ in chunk], dtype=np.int64), self.device)
        staged = self.layout.gather(self.caches, ids, self.stacked)
        hashes = [(h, s) for (_, h), s in zip(chunk, slots, strict=True)]
        self.stats.bytes_down += len(chunk) * self.layout.nbytes
        if not self.cuda:
            self.host.data[slots] = staged
            self._saved(hashes)
            return
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._offload_stream):
            self._offload_stream.wait_event(ready)
            for first, slot, count in runs(slots):  # consecutive slots: one copy
                self.host.data[slot : slot + count].copy_(
                    staged[first : first + count], non_blocking=True
                )
            staged.record_stream(self._offload_stream)
            done = torch.cuda.Event()
            done.record()
        self._saving.append((done, hashes))

    def _land_saves(self) -> None:
        while self._saving and self._saving[0][0].query():
            self._saved(self._saving.pop(0)[1])

    def _saved(self, hashes: list[tuple[bytes, int]]) -> None:
        for h, slot in hashes:
            if not self.host.hold(h, slot):  # written twice meanwhile: keep one
                self.host.give_back(slot)
                continue
            self.stats.host_stored += 1
            if self._writes is not None:
                self.host.pin(slot)
                try:
                    self._writes.put_nowait((h, slot))
                except queue.Full:
                    self.host.unpin(slot)
                    self.stats.disk_writes_dropped += 1

    def _write_loop(self) -> None:
        while True:
            h, slot = self._writes.get()
            try:
                self.disk.write(h, self.host.raw(slot))
            except OSError as exc:
                logger.warning("KV disk tier: writing a block failed: %s", exc)
            finally:
                self.host.unpin(slot)
                self._writes.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued copy down (and disk write) landed (tests, a clean stop)."""
        deadline = time.monotonic() + timeout_s
        if self._saving:
            self._saving[-1][0].synchronize()  # copies land in order: the last one ends them
        self._land_saves()
        while self._writes is not None and self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return not self._saving

    @property
    def writes_pending(self) -> int:
        """Disk writes queued or running: their stored / evicted events are still to come."""
        return self._writes.unfinished_tasks if self._writes is not None else 0

    # -- up: loading a prefix back ----------------------------------------------------------------

    def where(self, block_hash: bytes) -> str | None:
        """``host``, ``disk`` or None: the cheapest tier below that holds a block."""
        if block_hash in self.host:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def plan(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` (the blocks after the device's prefix hits) to
        load: found below, each in a tier whose load is cheaper than recomputing it."""
        self._land_saves()
        n = 0
        for h in hashes:
            tier = self.where(h)
            if tier is None or not self.costs.worth(tier):
                break
            n += 1
        return n

    def start_load(
        self, request_id: str, hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> None:
        """Fill device blocks ``block_ids`` with the blocks ``hashes`` (as ``plan`` found them).
        ``landed`` reports the request once they are in; a block that went missing meanwhile
        ends the prefix there (the rest is recomputed)."""
        blocks: list[_Block] = []
        for h in hashes:
            slot = self.host.slot(h)
            from_disk = slot is None
            if from_disk:
                slot = self.host.take() if self.disk is not None else None
                if slot is None:
                    break
            self.host.pin(slot)
            blocks.append(_Block(h, slot, from_disk))
        load = _Load(request_id, blocks, list(block_ids[: len(blocks)]), time.monotonic())
        from_disk = [b for b in blocks if b.from_disk]
        if from_disk:
            load.reads = self._reader.submit(self._read_all, from_disk)
        else:
            load.num_ok = len(blocks)
        self._loads[request_id] = load
        self._advance(load)

    def _read_all(self, blocks: list[_Block]) -> int:
        """I/O thread: read blocks from disk into their host slots, in order; how many of
        them arrived before the first that could not be read."""
        for i, b in enumerate(blocks):
            if not self.disk.read_into(b.block_hash, self.host.raw(b.slot)):
                return i
        return len(blocks)

    def _advance(self, load: _Load) -> bool:
        """Move a load on as far as it goes now; True once its blocks are in the device pool."""
        if load.num_ok < 0:
            if not load.reads.done():
                return False
            load.num_ok = self._settle_reads(load, load.reads.result())
        if not load.copied:
            self._copy_up([b.slot for b in load.blocks[: load.num_ok]], load)
            load.copied = True
        if load.event is not None and not load.event.query():
            return False
        self._finish_load(load)
        return True

    def _settle_reads(self, load: _Load, num_read: int) -> int:
        """The disk reads are done, ``num_read`` of them whole: the leading blocks usable are
        those before the first failed read. A slot read from disk becomes a host block (a block
        written once per tier); the slots after the usable prefix go back."""
        ok, seen = len(load.blocks), 0
        for i, b in enumerate(load.blocks):
            if b.from_disk:
                if seen == num_read:
                    ok = i
                    break
                seen += 1
        for i, b in enumerate(load.blocks):
            if i >= ok:
                self.host.unpin(b.slot)
                if b.from_disk:
                    self.host.give_back(b.slot)
            elif b.from_disk:
                self.stats.disk_bytes_read += self.layout.nbytes
                b.kept = self.host.hold(b.block_hash, b.slot)
        return ok

    def _copy_up(self, slots: list[int], load: _Load | None = None) -> None:
        """Host slots ``slots`` into the device blocks of ``load`` (queued on the load stream
        on CUDA: ``load.event`` marks the end), or into blocks 0.. when timing (no ``load``)."""
        if not slots:
            return
        n = len(slots)
        block_ids = np.array(load.block_ids[:n] if load is not None else range(n), dtype=np.int64)
        if not self.cuda:
            ids = torch.from_numpy(block_ids)
            self.layout.scatter(self.caches, ids, self.host.data[slots], self.stacked)
            return
        # After everything queued so far on the compute stream: a block handed to this request
        # may still be read there by a step of the request that held it before.
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._load_stream):
            ids = host_to_device(block_ids, self.device)
            staged = torch.empty(
                (n, self.layout.numel), dtype=self.layout.raw_dtype, device=self.device
            )
            for first, slot, count in runs(slots):
                staged[first : first + count].copy_(
                    self.host.data[slot : slot + count], non_blocking=True
                )
            ids.record_stream(self._load_stream)
            self.layout.scatter(self.caches, ids, staged, self.stacked)
            event = torch.cuda.Event()
            event.record()
        if load is not None:
            load.event = event
        else:
            event.synchronize()

    def _finish_load(self, load: _Load) -> None:
        del self._loads[load.request_id]
        for b in load.blocks[: load.num_ok]:
            self.host.unpin(b.slot)
            if not b.kept:
                self.host.give_back(b.slot)
            if b.from_disk:
                self.stats.disk_hits += 1
            else:
                self.stats.host_hits += 1
        elapsed = time.monotonic() - load.started
        self.stats.loads += 1
        self.stats.load_time_s += elapsed
        self.stats.load_time_max_s = max(self.stats.load_time_max_s, elapsed)
        self.stats.bytes_up += load.num_ok * self.layout.nbytes
        self._landed[load.request_id] = load.num_ok

    def landed(self) -> dict[str, int]:
        """Request id -> blocks now in its device blocks, for every load finished since the
        last call (aborted requests' loads included: their blocks may be freed now)."""
        for load in list(self._loads.values()):
            self._advance(load)
        landed, self._landed = self._landed, {}
        return landed

    def wait(self, timeout_s: float) -> None:
        """Block the engine thread briefly while loads are all it has (no busy spin)."""
        deadline = time.monotonic() + timeout_s
        while self._loads and not self._landed and time.monotonic() < deadline:
            for load in list(self._loads.values()):
                if self._advance(load):
                    return
            time.sleep(0.0005)

    def on_preempt(self, num_full_blocks: int) -> str:
        """The scheduler preempts a request with ``num_full_blocks`` full blocks: ``swap`` when
        loading them back from below is cheaper than recomputing them (write-through copied them
        there as they filled: nothing is left to write now), else ``recompute``. Counted."""
        tier = "disk" if self.host_is_staging else "host"
        if num_full_blocks and self.costs.worth(tier):
            self.stats.preempt_swapped += 1
            return "swap"
        self.stats.preempt_recomputed += 1
        return "recompute"

    # -- what the global prefix index learns -----------------------------------------------------

    def record_events(self) -> list[tuple[str, bytes]]:
        """Start keeping per-tier events for ``drain_events``; returns what the tiers hold now
        (``(tier, hash)``: the disk files found at start), to publish first."""
        self.host.record_events = True
        held = [("host", h) for h in self.host._held]
        if self.disk is not None:
            self.disk.record_events = True
            held += [("disk", h) for h in self.disk.known()]
        return held

    def drain_events(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        """Per tier (``host``, ``disk``): hashes stored and evicted since the last call."""
        host = (self.host.stored_hashes, self.host.evicted_hashes)
        self.host.stored_hashes, self.host.evicted_hashes = [], []
        events = {"host": host}
        if self.disk is not None:
            events["disk"] = self.disk.drain_events()
        return events

    # -- start-up costs and stats -----------------------------------------------------------------

    def measure(self, recompute_s_per_token: float, blocks: int = 32) -> TierCosts:
        """Time loading ``blocks`` blocks from the host tier, and from disk, into the device
        pool, the way a load does (block 0..n of the empty pool are overwritten: call it before
        serving). The recompute cost comes from the caller (a timed prefill)."""
        pool_blocks = self.caches[0].shape[2] // self.layout.block_size
        blocks = max(1, min(blocks, self.host.num_slots, pool_blocks))
        slots = list(range(blocks))
        self._copy_up(slots)  # warm: first-use costs (streams, allocator) are not a load's
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            self._copy_up(slots)
            runs.append(time.perf_counter() - t0)
        host_s = min(runs) / blocks
        disk_s = float("inf")
        if self.disk is not None:
            disk_s = host_s + self._time_disk_read(blocks)
        self.costs = TierCosts(host_s, disk_s, recompute_s_per_token * self.layout.block_size)
        logger.info(
            "KV tiers: per block, host load %.3f ms, disk load %.3f ms, recompute %.3f ms",
            host_s * 1e3,
            disk_s * 1e3,
            self.costs.recompute_s * 1e3,
        )
        return self.costs

    def _time_disk_read(self, blocks: int) -> float:
        """Seconds per block to read and check a block file (written here, then read back)."""
        payload = np.random.default_rng(0).integers(0, 255, self.layout.nbytes, dtype=np.uint8)
        out = np.empty_like(payload)
        probes = [
            hashlib.sha256(f"tandem-probe-{os.getpid()}-{i}".encode()).digest()
            for i in range(blocks)
        ]
        for h in probes:
            self.disk.write(h, payload, count=False)
        t0 = time.perf_counter()
        for h in probes:
            self.disk.read_into(h, out)
        elapsed = (time.perf_counter() - t0) / blocks
        for h in probes:
            self.disk.remove(h)
        return elapsed

    def snapshot(self) -> dict:
        """Per tier use and counters (the worker's stats, ``tandem status``)."""
        s = self.stats
        out = {
            "host": {
                "enabled": not self.host_is_staging,
                "blocks": len(self.host),
                "capacity_blocks": self.host.num_slots,
                "used_bytes": len(self.host) * self.layout.nbytes,
                "capacity_bytes": self.host.num_slots * self.layout.nbytes,
                "hits": s.host_hits,
                "stored": s.host_stored,
                "evictions": self.host.evictions,
                "bytes_in": s.bytes_down,
                "bytes_out": s.bytes_up,
                "saves_dropped": s.saves_dropped,
            },
            "loads": s.loads,
            "load_time_s": s.load_time_s,
            "load_time_max_s": s.load_time_max_s,
            "preempt_swapped": s.preempt_swapped,
            "preempt_recomputed": s.preempt_recomputed,
            "costs": self.costs.as_dict(),
            "block_bytes": self.layout.nbytes,
        }
        if self.disk is not None:
            out["disk"] = {
                "dir": str(self.disk.dir),
                "used_bytes": self.disk.used_bytes,
                "capacity_bytes": self.disk.capacity_bytes,
                "hits": s.disk_hits,
                "stored": self.disk.stored,
                "evictions": self.disk.evictions,
                "rejected": self.disk.rejected,
                "bytes_read": s.disk_bytes_read,
                "writes_dropped": s.disk_writes_dropped,
            }
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: blocks queued for disk are written first (up to ``timeout_s``). Callable from
        another thread than the engine's (it touches only the writer's queue)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        while self._writes is not None and self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                logger.warning("KV disk tier: %d blocks not written at close", self._writes.qsize())
                break
            time.sleep(0.002)
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
