"""Moving a prompt's KV from a prefill worker to a decode worker, layer by layer.

One interface, three backends::

    backend   control channel          payload                      where
    tcp       TCP socket (frames)      same socket, after header     CPU (CI, laptops), any host
    nccl      TCP socket (frames)      cupy NCCL send/recv on its    GPUs (engine/kv_transfer/nccl.py)
                                       own CUDA stream
    inproc    direct calls             tensor clone                  unit tests only

A *pair channel* joins one prefill worker (``KVSender``) to one decode worker (``KVReceiver``).
Everything on it is ordered, so both ends agree on what comes next (NCCL point-to-point needs
both sides to post matching calls in the same order: each payload is announced by its header on
the control channel first). The messages, in order::

    hello  {kind, backend, spec, token}               -> reply {kind: "ready"} | {kind: "error"}
                                                      spec: layers, kv heads, head dim, the KV
                                                      dtype and the block size; any difference
                                                      is refused, naming both sides' values
    nccl   {kind, nccl_id}                            NCCL backend only, right after "ready"
    layer  {kind, layer, entries, nbytes}  + payload  one layer of one step, for every transfer
                                                      of that step that goes to this decode
                                                      worker; entries = [[transfer_id, start, n]]
                                                      and the payload is [2, kv_heads, sum n,
                                                      head_dim] in entry order. With ``count``
                                                      (> 1): layers [layer, layer + count) of
                                                      the same entries in one payload, [count,
                                                      2, kv_heads, sum n, head_dim] (a
                                                      migration's copy: one message per chunk)
    done   {kind, transfer_id, num_tokens, token}     the prompt is complete; ``token`` is the
                                                      first sampled token (id, logprob, top-N)
    abort  {kind, transfer_id, reason}                the prefill side gave up on it

A frame is a 4-byte big-endian header length, the header as UTF-8 JSON, then ``nbytes`` raw bytes
of payload (TCP backend). Nothing is unpickled; every header field is checked before use, and a
payload's size must match what its entries say.

A *transfer* is one request's prompt KV. The decode side registers it first (``expect``: where
each token position goes), the prefill side then streams it; its life on the receiver ends in
exactly one event: ``complete`` (every layer of every token arrived, then ``done``), ``failed``
(abort, a broken pair, an incomplete ``done``) or ``released`` (after ``cancel``). After any of
the three the receiver never writes into that transfer's blocks again, so the caller may free
or admit them.

Everything is bounded (``KVLimits``; defaults in brackets)::

    sender queue      layer bytes queued or in flight per channel [4 GiB]; a layer that would
                      pass the cap is refused: its transfers fail (on_failure, retryable) and an
                      abort follows them on the channel, the channel and its other transfers go on
    socket writes     no progress for io_timeout_s [30 s] (a peer that stopped reading) breaks
                      the channel; so does a read stalled inside a message; TCP keepalive
                      [15 s idle, 3 probes] notices a dead host on an idle channel
    handshake         the sender gives connect + the reply to hello handshake_timeout_s [10 s]
    listener          one thread accepts and authenticates (no thread per connection): at most
                      max_unauthenticated [16] connections await their hello, each for at most
                      handshake_timeout_s, more are closed at once; only a connection whose
                      hello passed gets a thread, up to max_pairs [64] pair channels
    NCCL              init deadline, watchdog per pair, no thread blocked for good (nccl.py)
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from queue import SimpleQueue
from typing import Any

import numpy as np
import torch

from engine.attention import host_to_device, slot_array
from engine.output_stream import configure
from engine.threads import torch_single_threaded
from engine.tracing import trace

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # kv_cache_dtype="fp8"
}
_MAX_HEADER = 1 << 20
_MAX_HELLO = 64 << 10  # what an unauthenticated connection may make the listener hold
_LEN = struct.Struct(">I")
_REFUSED_MEMORY = 4096  # transfers refused for a full queue that a sender remembers


@dataclass(frozen=True)
class KVLimits:
    """How much a pair channel may hold and how long anything on it may wait: every thread of
    the transport makes progress, ends, or is given up on within these."""

    max_pending_bytes: int = 4 << 30
    """Sender: layer payload bytes queued or in flight on one channel (NCCL: until the send has
    completed on the GPU). A layer that would pass it is refused and its transfers fail,
    retryably; a layer alone on an empty queue is always taken. 4 GiB: 512 MiB (the first
    default) failed 10% of the transfers of 16 ShareGPT streams of the 8B shape on 2 x H200
    (its KV is 128 KiB a token: 2k-token prompts are 256 MiB each)."""
    io_timeout_s: float = 30.0
    """A socket write, or a read inside a message, that makes no progress for this long breaks
    the channel (a peer that stopped reading, a sender stalled mid-message)."""
    keepalive_s: float | None = 15.0
    """TCP keepalive on both ends: idle seconds before the first probe, then one probe every
    third of that; 3 unanswered probes drop the connection. None: off."""
    handshake_timeout_s: float = 10.0
    """Sender: connect plus the reply to hello. Receiver: how long an accepted connection has
    to deliver a valid hello (and, NCCL, the unique id after it)."""
    max_unauthenticated: int = 16
    """Receiver: accepted connections whose hello has not been checked yet (none holds a
    thread); more are closed at once."""
    max_pairs: int = 64
    """Receiver: authenticated pair channels, one thread each; more are refused."""
    max_staged_bytes: int = 4 << 30
    """Receiver of a tensor-parallel decode worker: KV held at once in the per-request buffers
    its rank 0 receives into (every head, outside the pool) until each is scattered to the
    ranks; a reservation that would pass it is answered Full (one alone always fits)."""
    nccl_init_timeout_s: float = 30.0
    """NCCL: deadline for forming a pair's communicator, on each side."""
    nccl_watchdog_s: float = 30.0
    """NCCL: posted sends or recvs that make no progress (none completes) for this long abort
    the pair's communicator (both ends watch their own)."""
    max_abandoned_inits: int = 4
    """NCCL, per process: communicator inits given up on whose thread has not returned yet;
    while this many exist new NCCL pairs are refused at once."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "keepalive_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"KVLimits.{f.name} must be a positive number, got {value!r}")
        if self.keepalive_s is not None and self.keepalive_s < 1:
            raise ValueError(f"KVLimits.keepalive_s must be >= 1 s or None, got {self.keepalive_s}")


@dataclass(frozen=True)
class KVSpec:
    """What both ends of a pair must agree on: the per-layer KV shape, the dtype the KV cache
    holds (torch's name: ``bfloat16``, ``float8_e4m3fn`` for ``kv_cache_dtype="fp8"``, ...)
    and the block size (the router's prefix hashes and reservations count blocks of it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def payload_bytes(self, num_tokens: int) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_kv_heads * num_tokens * self.head_dim * elem

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
        }

    def mismatch(self, theirs: Any) -> str | None:
        """What differs between a peer's ``as_dict()`` and this spec, both values named (None:
        they agree)."""
        if not isinstance(theirs, dict):
            return f"the peer's hello carries no KV spec (got {theirs!r})"
        ours = self.as_dict()
        diffs = [
            f"{_SPEC_FIELDS[name]}: sender {theirs.get(name)!r}, receiver {value!r}"
            for name, value in ours.items()
            if theirs.get(name) != value
        ]
        diffs += [f"unknown field {name!r} from the sender" for name in theirs if name not in ours]
        if not diffs:
            return None
        return (
            "the two workers' KV caches differ ("
            + "; ".join(diffs)
            + "): prefill and decode workers need the same model, dtype, kv_cache_dtype and "
            "block_size"
        )


# How a refused handshake names each field of the spec.
_SPEC_FIELDS = {
    "num_layers": "layers",
    "num_kv_heads": "KV heads",
    "head_dim": "head dim",
    "dtype": "KV cache dtype",
    "block_size": "block size",
}


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes, the same shape), other tensors as they are:
    moving KV is copying bytes, and torch lacks some fp8 kernels (``index_copy_`` on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class TransferOutcome(str, enum.Enum):
    """How a transfer ended on the receiver (exactly one per transfer)."""

    COMPLETE = "complete"  # every layer of every token arrived, then done
    FAILED = "failed"  # abort, a broken pair, an incomplete done
    RELEASED = "released"  # after cancel: the receiver no longer writes its blocks


@dataclass(frozen=True)
class TransferEvent:
    """What the receiver reports about one transfer."""

    kind: TransferOutcome
    transfer_id: str
    token: dict | None = None  # complete: the first token sampled by the prefill worker
    reason: str | None = None  # failed


class TransferError(RuntimeError):
    """A pair channel broke or a peer sent something it should not have."""


# -- frames --------------------------------------------------------------------------------------


def send_all(sock: socket.socket, data) -> None:
    """Write ``data`` whole. Each wait for room in the socket's buffer is bounded by its
    timeout: a peer that stops reading breaks the channel, one that reads slowly does not."""
    view = memoryview(data).cast("B")
    while view:
        try:
            sent = sock.send(view)
        except TimeoutError:
            raise TransferError(
                f"peer stopped reading: no progress for {sock.gettimeout():g} s"
            ) from None
        view = view[sent:]


def write_frame(sock: socket.socket, header: dict, payload: memoryview | None = None) -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    send_all(sock, _LEN.pack(len(data)) + data)
    if payload is not None and len(payload):
        send_all(sock, payload)


def read_exact(sock: socket.socket, view: memoryview, *, idle_ok: bool = False) -> None:
    """Fill ``view``. A timeout before the first byte is waited through when ``idle_ok`` (an
    idle channel between messages); anywhere else it breaks the channel."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if idle_ok and got == 0:
                continue
            raise TransferError(f"peer sent nothing for {sock.gettimeout():g} s") from None
        if n == 0:
            raise TransferError("peer closed the connection")
        got += n


def parse_header(data: bytes | bytearray) -> dict:
    try:
        header = json.loads(data)
    except ValueError as exc:
        raise TransferError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise TransferError("header must be a JSON object with a string 'kind'")
    return header


def read_header(sock: socket.socket, *, idle_ok: bool = False) -> dict:
    raw = bytearray(_LEN.size)
    read_exact(sock, memoryview(raw), idle_ok=idle_ok)
    (size,) = _LEN.unpack(raw)
    if size > _MAX_HEADER:
        raise TransferError(f"header of {size} bytes exceeds the {_MAX_HEADER}-byte limit")
    data = bytearray(size)
    read_exact(sock, memoryview(data))
    return parse_header(data)


def configure_socket(sock: socket.socket, limits: KVLimits) -> None:
    """No Nagle, keepalive probes on an idle channel, and ``io_timeout_s`` on every call."""
    configure(sock, limits.keepalive_s)
    sock.settimeout(limits.io_timeout_s)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included), without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def parse_entries(header: dict, spec: KVSpec) -> tuple[int, int, list[tuple[str, int, int]]]:
    """Validate a ``layer`` header; returns (first layer, layer count, entries)."""
    layer, entries = header.get("layer"), header.get("entries")
    count = header.get("count", 1)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise TransferError(f"layer must be an integer in [0, {spec.num_layers}), got {layer!r}")
    if (
        not isinstance(count, int)
        or isinstance(count, bool)
        or not 0 < count <= spec.num_layers - layer
    ):
        raise TransferError(
            f"count must be an integer in [1, {spec.num_layers - layer}], got {count!r}"
        )
    if not isinstance(entries, list) or not entries:
        raise TransferError("entries must be a non-empty list of [transfer_id, start, n]")
    out = []
    for e in entries:
        ok = isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
        if not (ok and all(isinstance(v, int) and v >= 0 for v in e[1:]) and e[2] > 0):
            raise TransferError(f"bad entry {e!r}: want [transfer_id, start >= 0, n > 0]")
        out.append((e[0], e[1], e[2]))
    total = sum(n for _, _, n in out)
    if header.get("nbytes") != count * spec.payload_bytes(total):
        raise TransferError(
            f"payload of {header.get('nbytes')!r} bytes does not match {total} tokens of "
            f"{count} layers ({count * spec.payload_bytes(total)} bytes)"
        )
    return layer, count, out


def check_hello(header: dict, spec: KVSpec, backend: str, token: str) -> None:
    if header.get("kind") != "hello":
        raise TransferError(f"expected hello, got {header.get('kind')!r}")
    if not secrets.compare_digest(str(header.get("token", "")), token):
        raise TransferError("hello carries a wrong cluster token")
    if header.get("backend") != backend:
        raise TransferError(f"backend {header.get('backend')!r} but this receiver is {backend!r}")
    if problem := spec.mismatch(header.get("spec")):
        raise TransferError(problem)


def split_endpoint(endpoint: str) -> tuple[str, str, int]:
    """``tcp://host:port`` -> (scheme, host, port)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme not in ("tcp", "nccl", "inproc") or not host or not port.isdigit():
        raise ValueError(f"bad KV endpoint {endpoint!r}: want <backend>://host:port")
    return scheme, host, int(port)


# -- receiver (decode side) ----------------------------------------------------------------------


@dataclass
class _Incoming:
    slots: torch.Tensor  # destination slot of every token position, on the KV's device
    ready: torch.cuda.Event | None  # recorded after the slots' upload (None off CUDA)
    num_tokens: int
    received: list[int]  # tokens received per layer
    peer: int | None = None  # connection the first layer came on
    exact: bool = True  # done must announce num_tokens (False: at most num_tokens, a migration)
    into: torch.Tensor | None = None  # [layers, 2, H, capacity, D]: written here, not the pool


class KVReceiver:
    """The decode worker's end: accepts pair channels and writes arriving layers into its KV.

    ``kv_caches`` is the engine's per-layer ``[2, kv_heads, slots, head_dim]`` list. ``on_event``
    is called (from a receiver thread) with one ``TransferEvent`` per transfer; it must not block.
    """

    backend = "inproc"

    def __init__(
        self,
        spec: KVSpec,
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
        on_event: Callable[[TransferEvent], None],
        token: str = "",
        limits: KVLimits | None = None,
    ) -> None:
        if spec.block_size != block_size:
            raise ValueError(
                f"the KV spec says block size {spec.block_size}, the cache {block_size}"
            )
        self.spec, self.kv_caches, self.block_size = spec, list(kv_caches), block_size
        self.on_event, self.token = on_event, token
        self.limits = limits or KVLimits()
        self._lock = threading.Lock()
        self._transfers: dict[str, _Incoming] = {}
        device = self.kv_caches[0].device
        self._upload = (
            torch.cuda.Stream(device) if device.type == "cuda" else None
        )  # slots' uploads
        self.bytes_received = 0
        self.endpoint = ""

    # -- the decode worker's calls ---------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        block_table: list[int],
        num_tokens: int,
        *,
        exact: bool = True,
        into: torch.Tensor | None = None,
    ) -> None:
        """Token positions ``[0, num_tokens)`` of ``transfer_id`` go to ``block_table``.
        ``exact``: its ``done`` announces exactly ``num_tokens``; otherwise (a migration, whose
        request grows while its KV is copied) any count up to it, every layer covering it.
        ``into``: position ``i`` goes to ``into[:, :, :, i]`` (``[layers, 2, kv heads,
        len(block_table) * block_size, head dim]`` in the KV dtype, on the KV's device)
        instead of the pool: a tensor-parallel worker's ranks each hold a slice of the heads,
        and its engine thread writes them into ``block_table`` once the transfer is complete."""
        slots_dev, ready = self._slots(block_table, num_tokens, into)
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            incoming = _Incoming(
                slots_dev, ready, num_tokens, [0] * self.spec.num_layers, exact=exact, into=into
            )
            self._transfers[transfer_id] = incoming

    def extend(
        self,
        transfer_id: str,
        block_table: list[int],
        num_tokens: int,
        into: torch.Tensor | None = None,
    ) -> bool:
        """Room for more positions in an inexact transfer still arriving (``block_table``
        extends the one it had; a transfer expected ``into`` a buffer needs a new, larger one,
        into which what arrived so far is copied); False when it is no longer expected."""
        slots_dev, ready = self._slots(block_table, num_tokens, into)
        with self._lock:
            t = self._transfers.get(transfer_id)
            if (
                t is None
                or t.exact
                or num_tokens < t.num_tokens
                or (t.into is None) != (into is None)
            ):
                return False
            if into is not None:
                if into.device.type == "cuda":  # the old buffer's queued writes land first
                    torch.cuda.synchronize(into.device)
                into[:, :, :, : t.into.shape[3]].copy_(t.into)
                t.into = into
            t.slots, t.ready, t.num_tokens = slots_dev, ready, num_tokens
            return True

    def _slots(
        self, block_table: list[int], num_tokens: int, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The transfer's destination slots on the KV's device, and (on CUDA) the event after
        which they are there. The upload runs on the receiver's own stream: the caller's
        stream may be the engine's, queued a step or two ahead, and the scatter (on another
        stream) waits for this event, never for those steps."""
        capacity = len(block_table) * self.block_size
        if capacity < num_tokens:
            raise ValueError(f"{len(block_table)} blocks cannot hold {num_tokens} tokens")
        if into is None:
            slots = slot_array(block_table, 0, num_tokens, self.block_size)
        else:
            spec = self.spec
            want = (spec.num_layers, 2, spec.num_kv_heads, capacity, spec.head_dim)
            if tuple(into.shape) != want or into.dtype != spec.torch_dtype:
                raise ValueError(
                    f"into must be a {spec.torch_dtype} tensor of shape {list(want)}, got "
                    f"{into.dtype} {list(into.shape)}"
                )
            slots = np.arange(num_tokens, dtype=np.int64)
        device = self.kv_caches[0].device
        if self._upload is None:
            return host_to_device(slots, device), None
        with torch.cuda.stream(self._upload):
            slots_dev = host_to_device(slots, device)
            ready = torch.cuda.Event()
            ready.record()
        return slots_dev, ready

    def cancel(self, transfer_id: str) -> None:
        """Stop writing into the transfer's blocks; ``released`` follows once that holds."""
        with self._lock:
            known = self._transfers.pop(transfer_id, None) is not None
        if known:
            self._after_quiet(TransferEvent(TransferOutcome.RELEASED, transfer_id))

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._transfers)

    def close(self) -> None:
        pass

    # -- message handling (any backend) ----------------------------------------------------------

    def _after_quiet(self, event: TransferEvent) -> None:
        """Emit ``event`` once no earlier write into device memory is still pending."""
        self.on_event(event)

    def handle_layer(
        self, peer: int, layer: int, entries: list[tuple[str, int, int]], kv: torch.Tensor
    ) -> None:
        """Scatter one layer's payload ``kv`` [2, H, sum n, D] into the reserved slots. Entries of
        transfers no longer expected (cancelled, unknown) are dropped. Destination slots are
        slices of each transfer's slot tensor, made once at ``expect``: no host allocation and
        no host-to-device copy per message."""
        # per destination (the pool, or a transfer's own buffer): slots and payload columns
        dst: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, int]]]] = {}
        ready = []
        col = 0
        with self._lock:
            for tid, start, n in entries:
                t = self._transfers.get(tid)
                if t is not None and t.peer in (None, peer) and start + n <= t.num_tokens:
                    t.peer = peer
                    cache = self.kv_caches[layer] if t.into is None else t.into[layer]
                    _, slots, cols = dst.setdefault(id(cache), (cache, [], []))
                    slots.append(t.slots[start : start + n])
                    cols.append((col, n))
                    if t.ready is not None:
                        ready.append(t.ready)
                    t.received[layer] = max(t.received[layer], start + n)
                col += n
            if dst:
                kv = byte_view(kv)
                if ready:  # the slots' upload, on the receiver's stream, comes first
                    stream = torch.cuda.current_stream(next(iter(dst.values()))[0].device)
                    for event in ready:
                        stream.wait_event(event)
                for cache, slots, cols in dst.values():
                    cache = byte_view(cache)
                    part = kv
                    if sum(n for _, n in cols) < kv.shape[2]:  # only these entries' columns
                        part = torch.cat([kv[:, :, c : c + n] for c, n in cols], dim=2)
                    if ready:
                        for d in slots:  # freed at the transfer's end: not reused before this
                            d.record_stream(stream)
                    index = slots[0] if len(slots) == 1 else torch.cat(slots)
                    cache.index_copy_(2, index, part.to(cache.device))
        self.bytes_received += kv.numel() * kv.element_size()

    def handle_done(self, peer: int, header: dict) -> None:
        tid, num_tokens, token = (
            header.get("transfer_id"),
            header.get("num_tokens"),
            header.get("token"),
        )
        if not isinstance(tid, str) or not isinstance(token, dict):
            raise TransferError("done needs a string transfer_id and a token object")
        ints = [token.get("token_id"), token.get("num_cached_tokens", 0)]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise TransferError("done's token needs a token_id (and num_cached_tokens) >= 0")
        with self._lock:
            t = self._transfers.get(tid)
            if t is None or t.peer not in (None, peer):
                return  # cancelled meanwhile (or not ours): nothing to report
            del self._transfers[tid]
        if t.exact:
            ok = num_tokens == t.num_tokens
        else:
            ok = isinstance(num_tokens, int) and 0 < num_tokens <= t.num_tokens
        want = num_tokens if ok else t.num_tokens
        short = [i for i, got in enumerate(t.received) if got < want]
        if not ok or short:
            reason = (
                f"transfer {tid} incomplete: {num_tokens!r} tokens announced, {t.num_tokens} "
                f"expected, layers {short[:4]} short"
            )
            self._after_quiet(TransferEvent(TransferOutcome.FAILED, tid, reason=reason))
        else:
            self._after_quiet(TransferEvent(TransferOutcome.COMPLETE, tid, token=token))

    def handle_abort(self, peer: int, header: dict) -> None:
        tid = header.get("transfer_id")
        with self._lock:
            t = self._transfers.get(tid) if isinstance(tid, str) else None
            if t is None or t.peer not in (None, peer):
                return
            del self._transfers[tid]
        reason = f"prefill aborted the transfer: {header.get('reason', '')}"
        self._after_quiet(TransferEvent(TransferOutcome.FAILED, tid, reason=reason))

    def peer_lost(self, peer: int, reason: str) -> None:
        """A pair channel broke: every transfer that was arriving on it fails."""
        with self._lock:
            lost = [tid for tid, t in self._transfers.items() if t.peer == peer]
            for tid in lost:
                del self._transfers[tid]
        for tid in lost:
            self._after_quiet(
                TransferEvent(TransferOutcome.FAILED, tid, reason=f"prefill peer lost: {reason}")
            )


@dataclass
class _Unauthenticated:
    deadline: float  # monotonic: dropped if its hello is not in by then
    data: bytearray = field(default_factory=bytearray)


class TcpKVReceiver(KVReceiver):
    """Listens on ``host`` (127.0.0.1 unless told otherwise).

    One thread (``kv-accept``) accepts and authenticates: it reads each new connection's hello
    without blocking, at most ``max_unauthenticated`` at a time and each for at most
    ``handshake_timeout_s``, and closes the others at once. Only a connection whose hello
    passed (token, backend, KV layout) gets a thread of its own (``kv-recv-N``), up to
    ``max_pairs``."""

    backend = "tcp"

    def __init__(self, *args, host: str = "127.0.0.1", port: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        self.endpoint = f"{self.backend}://{host}:{self._server.getsockname()[1]}"
        self._conns: dict[int, socket.socket] = {}
        self._breaks: dict[int, str] = {}  # why a pair was broken from outside its thread
        self._ids = itertools.count()
        self._closed = False
        self.refused_connections = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._acceptor.start()

    @property
    def num_pairs(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._acceptor.join(5.0)  # it closes the listening socket: the port is free after this
        for conn in list(self._conns.values()):
            _close_quietly(conn)

    def break_pair(self, peer: int, reason: str) -> None:
        """From any thread: end pair ``peer`` (its thread fails its transfers with ``reason``)."""
        conn = self._conns.get(peer)
        if conn is not None:
            self._breaks[peer] = reason
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # -- the listener ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        waiting: dict[socket.socket, _Unauthenticated] = {}
        try:
            while not self._closed:
                soonest = min((w.deadline for w in waiting.values()), default=None)
                timeout = None if soonest is None else max(0.0, soonest - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._server:
                        self._accept_one(sel, waiting)
                    elif key.fileobj is not self._wake_r:
                        self._read_hello(sel, waiting, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, w in waiting.items() if w.deadline <= now]:
                    self._drop_unauthenticated(sel, waiting, conn)
        except Exception:  # noqa: BLE001 - the listener must not die silently
            logger.exception("KV listener %s stopped", self.endpoint)
        finally:
            for conn in waiting:
                _close_quietly(conn)
            sel.close()
            for s in (self._server, self._wake_r, self._wake_w):
                s.close()

    def _accept_one(self, sel, waiting: dict) -> None:
        try:
            conn, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(waiting) >= self.limits.max_unauthenticated:
            self.refused_connections += 1
            _close_quietly(conn)
            return
        conn.setblocking(False)
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        waiting[conn] = _Unauthenticated(deadline)
        sel.register(conn, selectors.EVENT_READ)

    def _drop_unauthenticated(self, sel, waiting: dict, conn, message: str | None = None) -> None:
        sel.unregister(conn)
        del waiting[conn]
        self.refused_connections += 1
        if message is not None:  # best effort: a short reply fits the empty send buffer
            data = json.dumps({"kind": "error", "message": message}).encode()
            with contextlib.suppress(OSError):
                conn.send(_LEN.pack(len(data)) + data)
        _close_quietly(conn)

    def _read_hello(self, sel, waiting: dict, conn: socket.socket) -> None:
        pending = waiting[conn]
        try:
            chunk = conn.recv(_MAX_HELLO)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_unauthenticated(sel, waiting, conn)
            return
        pending.data += chunk
        if len(pending.data) < _LEN.size:
            return
        (size,) = _LEN.unpack_from(pending.data)
        try:
            if size > _MAX_HELLO:
                raise TransferError(f"hello of {size} bytes exceeds the {_MAX_HELLO}-byte limit")
            if len(pending.data) < _LEN.size + size:
                return
            if len(pending.data) > _LEN.size + size:
                raise TransferError("the sender must wait for the reply to its hello")
            self._check_hello(parse_header(pending.data[_LEN.size :]))
            if len(self._conns) >= self.limits.max_pairs:
                raise TransferError(f"this receiver already has {self.limits.max_pairs} pairs")
        except TransferError as exc:
            self._drop_unauthenticated(sel, waiting, conn, str(exc))
            return
        sel.unregister(conn)
        del waiting[conn]
        peer = next(self._ids)
        self._conns[peer] = conn
        threading.Thread(
            target=self._serve, args=(peer, conn), name=f"kv-recv-{peer}", daemon=True
        ).start()

    # -- one authenticated pair channel (its own thread) -----------------------------------------

    def _serve(self, peer: int, conn: socket.socket) -> None:
        reason = "connection closed"
        torch_single_threaded()  # its copies into the pool must not start a second team
        try:
            conn.setblocking(True)
            configure_socket(conn, self.limits)
            self._handshake(peer, conn)
            buf = [bytearray()]  # reused between layers, replaced when too small
            while True:
                header = read_header(conn, idle_ok=True)  # idle between messages: no limit
                kind = header["kind"]
                if kind == "layer":
                    layer, count, entries = parse_entries(header, self.spec)
                    kv = self._read_payload(peer, conn, header["nbytes"], entries, buf)
                    kv = kv.view(count, 2, *kv.shape[1:]) if count > 1 else kv
                    for i in range(count):
                        self.handle_layer(peer, layer + i, entries, kv[i] if count > 1 else kv)
                elif kind == "done":
                    self._before_done(peer)
                    self.handle_done(peer, header)
                elif kind == "abort":
                    self.handle_abort(peer, header)
                else:
                    raise TransferError(f"unknown message kind {kind!r}")
        except Exception as exc:  # noqa: BLE001 - whatever breaks, the pair's transfers fail
            reason = self._breaks.pop(peer, None) or str(exc)
            if not self._closed and "closed the connection" not in reason:
                logger.warning("KV pair channel %d dropped: %s", peer, reason)
        finally:
            self._conns.pop(peer, None)
            self._breaks.pop(peer, None)
            _close_quietly(conn)
            self._on_peer_closed(peer)
            self.peer_lost(peer, reason)

    def _handshake(self, peer: int, conn: socket.socket) -> None:
        try:
            write_frame(conn, {"kind": "ready"})
            self._after_ready(peer, conn)
        except TransferError as exc:  # the sender waits for this before giving up on the pair
            with contextlib.suppress(OSError, TransferError):
                write_frame(conn, {"kind": "error", "message": str(exc)})
            raise

    def _check_hello(self, hello: dict) -> None:
        check_hello(hello, self.spec, self.backend, self.token)

    def _after_ready(self, peer: int, conn: socket.socket) -> None:
        """Hook: finish setting up the pair (the NCCL backend joins its communicator here)."""

    def _read_payload(self, peer, conn, nbytes: int, entries, buf: list) -> torch.Tensor:
        if len(buf[0]) < nbytes:
            buf[0] = bytearray(nbytes)
        view = memoryview(buf[0])[:nbytes]
        read_exact(conn, view)
        total = sum(n for _, _, n in entries)
        flat = torch.frombuffer(view, dtype=torch.uint8).view(self.spec.torch_dtype)
        return flat.view(-1, self.spec.num_kv_heads, total, self.spec.head_dim)

    def _before_done(self, peer: int) -> None:
        """Hook: wait until every write of this pair so far has landed (NCCL backend)."""

    def _on_peer_closed(self, peer: int) -> None:
        """Hook: release per-pair resources (NCCL backend)."""


# -- sender (prefill side) -----------------------------------------------------------------------


class KVSender:
    """The prefill worker's end of one pair channel: an ordered queue drained by one thread, so
    ``send_*`` never blocks the forward pass. ``on_failure(transfer_ids, reason)`` names every
    transfer that was open when the channel broke (from the sender thread), or the transfers of
    a layer refused because the queue was full (from the caller's thread); it must not block.

    The queue holds at most ``limits.max_pending_bytes`` of layer payloads (see KVLimits): a
    refused transfer is remembered, so its later layers and ``done`` are dropped, and an
    ``abort`` for it goes down the channel behind what was already queued."""

    backend = "inproc"

    def __init__(
        self,
        endpoint: str,
        spec: KVSpec,
        on_failure: Callable[[list[str], str], None],
        token: str = "",
        limits: KVLimits | None = None,
    ) -> None:
        self.endpoint, self.spec, self.on_failure, self.token = endpoint, spec, on_failure, token
        self.limits = limits or KVLimits()
        self.error: str | None = None
        self.bytes_sent = 0
        self._open: set[str] = set()  # transfers with layers sent and no done/abort yet
        self._refused: OrderedDict[str, None] = OrderedDict()  # failed for a full queue
        self._pending = 0  # layer bytes queued or in flight
        self._fault: str | None = None  # set from another thread: break at the next message
        self._gates: dict[str, tuple[threading.Event, float]] = {}
        self._lock = threading.Lock()
        self._queue: SimpleQueue = SimpleQueue()
        self.formed = threading.Event()  # the channel is up, or failed to come up (``error``)
        self._thread = threading.Thread(target=self._run, name="kv-send", daemon=True)
        self._thread.start()

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    def hold(self, transfer_id: str, gate: threading.Event, timeout_s: float) -> None:
        """Send nothing of ``transfer_id`` before ``gate`` is set (its decode worker is still
        reserving the blocks it goes to); what is queued behind it waits too, so the channel
        keeps its order. Past ``timeout_s`` the transfer is reported failed and its messages go
        out anyway (a receiver that does not expect it drops them)."""
        with self._lock:
            self._gates[transfer_id] = (gate, timeout_s)

    def send_layer(self, layer: int, entries: list[tuple[str, int, int]], kv) -> None:
        """Queue one layer (``kv`` is [2, H, sum n, D], owned by the sender from now on), or
        refuse it if its bytes would take the queue past ``limits.max_pending_bytes``: then its
        transfers fail here, retryably, and the channel goes on with the others."""
        nbytes = self._nbytes(kv)
        cap = self.limits.max_pending_bytes
        with self._lock:
            live = [tid for tid in dict.fromkeys(e[0] for e in entries) if tid not in self._refused]
            if not live:
                return  # every transfer in it already failed here
            if self._pending == 0 or self._pending + nbytes <= cap:
                self._pending += nbytes
                self._open.update(live)
                refused = None
            else:
                refused = (
                    f"KV send queue to {self.endpoint} is full: {self._pending} bytes pending, "
                    f"a {nbytes}-byte layer would pass the {cap}-byte cap"
                )
                for tid in live:
                    self._refused[tid] = None
                    self._open.discard(tid)
                while len(self._refused) > _REFUSED_MEMORY:
                    self._refused.popitem(last=False)
        if refused is None:
            self._put(("layer", layer, entries, kv, nbytes))
            return
        for tid in live:  # behind its layers already queued: the receiver frees it at once
            self._put(("abort", tid, refused))
        trace(live[0], "send.refused")
        self.on_failure(live, refused)

    def send_layers(self, first: int, entries: list[tuple[str, int, int]], kv) -> None:
        """Queue layers ``[first, first + len(kv))`` of the same entries as one message (``kv``
        is [count, 2, H, sum n, D]); bounded and refused as ``send_layer``."""
        self.send_layer(first, entries, kv)

    def send_done(self, transfer_id: str, num_tokens: int, token: dict) -> bool:
        """Queue ``done``; False (nothing queued) if the transfer was refused here."""
        if self._was_refused(transfer_id):
            return False
        self._put(("done", transfer_id, num_tokens, token))
        return True

    def send_abort(self, transfer_id: str, reason: str) -> None:
        if not self._was_refused(transfer_id):  # (its abort is on its way)
            self._put(("abort", transfer_id, reason))

    def fault(self, reason: str) -> None:
        """From another thread (the NCCL watchdog): break the channel at its next message,
        failing every transfer open on it."""
        self._fault = reason
        self._queue.put(("fault",))

    def close(self) -> None:
        self._queue.put(None)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything queued so far has been handed to the channel."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _was_refused(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._refused

    def _nbytes(self, kv) -> int:
        return kv.numel() * kv.element_size()

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending = max(0, self._pending - nbytes)

    def _put(self, item) -> None:
        with self._lock:  # (_broken drains the queue under it: nothing slips in behind)
            if self.error is None:
                self._queue.put(item)
                return
        self._fail_items([item], self.error)

    # -- the sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        torch_single_threaded()  # (its reads of the pool: the engine thread's team is enough)
        try:
            self._connect()
        except Exception as exc:  # noqa: BLE001 - every failure becomes the channel's error
            self._broken(f"cannot open KV channel to {self.endpoint}: {exc}")
            return
        finally:
            self.formed.set()
        while True:
            item = self._queue.get()
            if item is None:
                self._disconnect()
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._fault is not None:
                self._broken(f"KV channel to {self.endpoint} broke: {self._fault}", first=item)
                return
            if item[0] == "fault":
                continue
            self._wait_gates(item)
            try:
                self._send(item)
            except Exception as exc:  # noqa: BLE001
                self._broken(f"KV channel to {self.endpoint} broke: {exc}", first=item)
                return
            if item[0] == "layer":
                self._sent(item)
            else:
                with self._lock:
                    self._open.discard(item[1])
                    self._gates.pop(item[1], None)

    def _sent(self, item) -> None:
        """Hook: a layer left the queue (NCCL: its bytes stay pending until the send is done)."""
        self._release(item[4])

    def _wait_gates(self, item) -> None:
        tids = [e[0] for e in item[2]] if item[0] == "layer" else [item[1]]
        for tid in tids:
            with self._lock:
                held = self._gates.get(tid)
            if held is None or held[0].is_set():
                continue
            if not held[0].wait(held[1]):
                held[0].set()  # once: later messages of it go out without waiting
                self.on_failure([tid], f"no decode reservation confirmed in {held[1]:.0f} s")
            trace(tid, "send.gate_opened")

    def _broken(self, reason: str, first=None) -> None:
        logger.warning("%s", reason)
        pending = [first] if first is not None else []
        with self._lock:
            self.error = reason
            while not self._queue.empty():
                pending.append(self._queue.get())
        self._fail_items(pending, reason)
        self._disconnect()
        with self._lock:
            self._pending = 0

    def _fail_items(self, items, reason: str) -> None:
        failed: set[str] = set()
        for item in items:
            if isinstance(item, threading.Event):
                item.set()
            elif item is None or item[0] == "fault":
                continue
            elif item[0] == "layer":
                failed.update(e[0] for e in item[2])
                self._release(item[4])
            else:
                failed.add(item[1])
        with self._lock:
            failed |= self._open
            self._open.clear()
            failed -= self._refused.keys()  # reported when refused
        if failed:
            self.on_failure(sorted(failed), reason)

    def _hello(self) -> dict:
        return {
            "kind": "hello",
            "backend": self.backend,
            "spec": self.spec.as_dict(),
            "token": self.token,
        }

    def _connect(self) -> None:
        receiver = _INPROC[self.endpoint]
        try:
            check_hello(self._hello(), receiver.spec, receiver.backend, receiver.token)
        except TransferError as exc:
            raise TransferError(f"receiver refused the channel: {exc}") from None
        self._receiver = receiver

    def _disconnect(self) -> None:
        rx = getattr(self, "_receiver", None)
        if rx is not None:
            rx.peer_lost(id(self), "sender closed")

    def _send(self, item) -> None:
        rx, peer = self._receiver, id(self)
        if item[0] == "layer":
            _, layer, entries, kv, nbytes = item
            for i, one in enumerate(kv if kv.dim() == 5 else [kv]):
                rx.handle_layer(peer, layer + i, entries, one)
            self.bytes_sent += nbytes
        elif item[0] == "done":
            rx.handle_done(peer, {"transfer_id": item[1], "num_tokens": item[2], "token": item[3]})
        else:
            rx.handle_abort(peer, {"transfer_id": item[1], "reason": item[2]})


class TcpKVSender(KVSender):
    backend = "tcp"

    def _connect(self) -> None:
        _, host, port = split_endpoint(self.endpoint)
        limits = self.limits
        self._sock = socket.create_connection((host, port), timeout=limits.handshake_timeout_s)
        configure_socket(self._sock, limits)
        self._sock.settimeout(limits.handshake_timeout_s)  # for the reply to hello
        write_frame(self._sock, self._hello())
        reply = read_header(self._sock)
        if reply["kind"] != "ready":
            raise TransferError(f"receiver refused the channel: {reply.get('message')}")
        self._sock.settimeout(limits.io_timeout_s)
        self._after_ready()

    def _after_ready(self) -> None:
        """Hook: finish setting up the pair (the NCCL backend makes its communicator here)."""

    def _disconnect(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            _close_quietly(sock)

    def _send(self, item) -> None:
        if item[0] == "layer":
            _, layer, entries, kv, nbytes = item
            header = layer_header(layer, entries, kv, nbytes)
            self._send_payload(header, kv)
            self.bytes_sent += nbytes
        elif item[0] == "done":
            msg = {"kind": "done", "transfer_id": item[1], "num_tokens": item[2], "token": item[3]}
            write_frame(self._sock, msg)
        else:
            write_frame(self._sock, {"kind": "abort", "transfer_id": item[1], "reason": item[2]})

    def _send_payload(self, header: dict, kv: torch.Tensor) -> None:
        write_frame(self._sock, header, tensor_bytes(kv.cpu().contiguous()))


def layer_header(layer: int, entries, kv: torch.Tensor, nbytes: int) -> dict:
    """The ``layer`` message announcing ``kv`` (one layer, or [count, ...] stacked layers)."""
    header = {"kind": "layer", "layer": layer, "entries": [list(e) for e in entries]}
    if kv.dim() == 5:
        header["count"] = kv.shape[0]
    return {**header, "nbytes": nbytes}


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# -- backends ------------------------------------------------------------------------------------

_INPROC: dict[str, KVReceiver] = {}
_inproc_ids = itertools.count()


class InProcessKVReceiver(KVReceiver):
    """Unit tests only: senders in the same process call straight into it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.endpoint = f"inproc://local:{next(_inproc_ids)}"
        _INPROC[self.endpoint] = self

    def close(self) -> None:
        _INPROC.pop(self.endpoint, None)
