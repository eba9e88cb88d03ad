"""A worker's output stream on its own TCP socket: the frames, the hello, the router's reader.

A router reads each worker's deltas for its requests over one socket per (worker, router), not
through Ray: the engine thread writes a step's batch straight into the socket (engine/runtime.py),
and the router's event loop reads it. No serialization thread, object store or gRPC call sits
between a sampled token and the router, and no other thread of the worker wakes for it.

    router                                   worker
    ──────                                   ──────
    stream_endpoint(router's node ip) ─Ray─► (host, port, token): a listener on 127.0.0.1 when
                                             the router shares the worker's node, on the node's
                                             address otherwise; the token is the worker's own
    connect, hello {v, client, token} ─────► checked (hmac.compare_digest) within HELLO_TIMEOUT_S;
                                             anything else closes the connection
              ◄───── frames: one StreamBatch per engine step (merged while the socket is full),
                     an empty one (heartbeat, with the running step's age) after a quiet second

A frame is a 4-byte big-endian length and a msgpack body: nothing is unpickled, and every field
is checked before use (``decode_batch`` raises ``StreamError`` on anything else). A plain delta
(tokens only, the common case) is ``[request_id, index, start, token_ids]``; any other is a map
of the fields that differ from their defaults.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import MISSING, fields
from typing import Any

import msgpack

from engine.aio import within
from engine.messages import Delta, StreamBatch

logger = logging.getLogger(__name__)

VERSION = 1
MAX_FRAME = 64 << 20  # a batch is a step's deltas: KBs; this bounds a broken or hostile peer
MAX_HELLO = 4096
HELLO_TIMEOUT_S = 5.0
MAX_UNAUTHENTICATED = 16  # connections awaiting their hello at once; more are closed at once
_LEN = struct.Struct(">I")


class StreamError(Exception):
    """A frame or hello that breaks the protocol: the connection is closed."""


# -- frames ----------------------------------------------------------------------------------------


# every field but the id, with its default: a rich delta sends those that differ
_DEFAULTS = {
    f.name: f.default if f.default is not MISSING else f.default_factory()
    for f in fields(Delta)
    if f.name != "request_id"
}


def _delta_out(d: Delta) -> list | dict:
    if d.plain:
        return [d.request_id, d.index, d.start, d.token_ids]
    out: dict[str, Any] = {"request_id": d.request_id}
    for name, default in _DEFAULTS.items():
        value = getattr(d, name)
        if value != default:
            out[name] = list(value) if name == "predicted" else value
    return out


def encode_batch(batch: StreamBatch) -> bytes:
    """One frame: length and body."""
    body = msgpack.packb(
        [
            VERSION,
            batch.worker,
            batch.coalesced,
            float(batch.step_age_s),
            [_delta_out(d) for d in batch.deltas],
        ]
    )
    return _LEN.pack(len(body)) + body


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _tokens(v: Any) -> bool:
    """A list of ints (not bools): in C for the one-token lists of decode steps' deltas, which a
    gateway checks ~10,000 times a second (the generator over ``_int`` was 11 % of its time)."""
    return type(v) is list and (not v or set(map(type, v)) == _INT_TYPE)


_INT_TYPE = {int}


def _logprobs(v: Any) -> bool:
    if v is None:
        return True
    return isinstance(v, list) and all(
        isinstance(e, dict) and all(_int(k) and isinstance(p, float | int) for k, p in e.items())
        for e in v
    )


def _predicted(v: Any) -> bool:
    return v is None or (
        isinstance(v, list) and len(v) == 3 and all(isinstance(x, float | int) for x in v)
    )


_CHECKS = {
    "token_ids": _tokens,
    "logprobs": _logprobs,
    "text": lambda v: isinstance(v, str),
    "index": _int,
    "finish_reason": _opt_str,
    "stop_reason": lambda v: v is None or isinstance(v, str) or _int(v),
    "num_cached_tokens": _int,
    "error": _opt_str,
    "retryable": lambda v: isinstance(v, bool),
    "start": _int,
    "moved_to": _opt_str,
    "predicted": _predicted,
}


def _delta_in(raw: Any) -> Delta:
    if isinstance(raw, list):
        if len(raw) != 4 or not isinstance(raw[0], str) or not (_int(raw[1]) and _int(raw[2])):
            raise StreamError(f"bad plain delta {raw!r:.80}")
        if not _tokens(raw[3]):
            raise StreamError("a delta's token_ids must be a list of integers")
        return Delta(raw[0], raw[3], index=raw[1], start=raw[2])
    if not isinstance(raw, dict) or not isinstance(raw.get("request_id"), str):
        raise StreamError(f"bad delta {raw!r:.80}")
    fields = {}
    for name, value in raw.items():
        if name == "request_id":
            continue
        check = _CHECKS.get(name)
        if check is None:
            raise StreamError(f"unknown delta field {name!r:.40}")
        if not check(value):
            raise StreamError(f"bad delta field {name}: {value!r:.80}")
        fields[name] = tuple(value) if name == "predicted" else value
    return Delta(raw["request_id"], **fields)


def decode_batch(body: bytes) -> StreamBatch:
    """A frame's body (its length already read) as a StreamBatch; StreamError when it is not
    one this version writes."""
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack's errors are several types
        raise StreamError(f"frame is not msgpack: {exc}") from None
    if not (isinstance(raw, list) and len(raw) == 5 and raw[0] == VERSION):
        raise StreamError(f"frame is not a version-{VERSION} batch")
    _, worker, coalesced, step_age, deltas = raw
    if not (isinstance(worker, str) and _int(coalesced) and isinstance(step_age, float)):
        raise StreamError("bad batch header")
    if not isinstance(deltas, list):
        raise StreamError("a batch's deltas must be a list")
    return StreamBatch(worker, [_delta_in(d) for d in deltas], coalesced, step_age)


# -- the hello -------------------------------------------------------------------------------------


def encode_hello(client: str, token: str) -> bytes:
    body = msgpack.packb({"v": VERSION, "client": client, "token": token})
    return _LEN.pack(len(body)) + body


def decode_hello(data: bytes) -> tuple[str, str]:
    """A hello frame (length and body) -> (client, token)."""
    if len(data) < _LEN.size or _LEN.unpack_from(data)[0] != len(data) - _LEN.size:
        raise StreamError("bad hello length")
    try:
        raw = msgpack.unpackb(data[_LEN.size :], raw=False)
    except Exception as exc:  # noqa: BLE001
        raise StreamError(f"hello is not msgpack: {exc}") from None
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise StreamError(f"hello is not version {VERSION}")
    client, token = raw.get("client"), raw.get("token")
    if not (isinstance(client, str) and client and isinstance(token, str)):
        raise StreamError("hello needs a client and a token")
    return client, token


async def read_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[str, str]:
    """The worker's side: the hello on a freshly accepted (non-blocking) socket."""
    data = bytearray()
    need = _LEN.size
    while len(data) < need:
        chunk = await loop.sock_recv(sock, need - len(data))
        if not chunk:
            raise StreamError("connection closed before its hello")
        data += chunk
        if len(data) == _LEN.size:
            size = _LEN.unpack_from(data)[0]
            if size > MAX_HELLO:
                raise StreamError(f"hello of {size} bytes")
            need += size
    return decode_hello(bytes(data))


# -- sockets ---------------------------------------------------------------------------------------


def configure(sock: socket.socket, keepalive_s: float | None = 15) -> None:
    """No Nagle (a frame is small and wanted now); keepalive probes after ``keepalive_s`` idle
    (None: none) notice a dead host on a quiet connection (heartbeats notice a dead process).
    The KV channels' sockets are set up the same way (kv_transfer/transport.py)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive_s is None:
        return
    idle = int(keepalive_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3))):
        if hasattr(socket, name):  # Linux; other systems keep their own timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_KEEPCNT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


async def read_stream(
    host: str, port: int, token: str, client: str, connect_timeout_s: float = 10.0
) -> AsyncIterator[StreamBatch]:
    """The router's side: ``client``'s batches from the worker listening at ``host:port``,
    until the worker closes the stream (shutdown or death: the caller tells them apart)."""
    reader, writer = await within(asyncio.open_connection(host, port), connect_timeout_s)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            configure(sock)
        writer.write(encode_hello(client, token))
        await writer.drain()
        while True:
            try:
                head = await reader.readexactly(_LEN.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise StreamError("stream cut inside a frame") from None
                return
            (size,) = _LEN.unpack(head)
            if size > MAX_FRAME:
                raise StreamError(f"frame of {size} bytes exceeds {MAX_FRAME}")
            try:
                body = await reader.readexactly(size)
            except asyncio.IncompleteReadError:
                raise StreamError("stream cut inside a frame") from None
            yield decode_batch(body)
    finally:
        writer.close()


# -- the worker's side -----------------------------------------------------------------------------


class Channel:
    """What one client (a router) has not been sent yet, and how it reads: a socket, or
    in-process readers of ``OutputStreams.iterate``. Deltas are merged per sequence while they
    wait (a reader that falls behind gets fewer, larger batches; ``coalesced`` counts the merged
    steps), so what is held is bounded by the tokens its running requests produce."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the engine thread writes; the event loop too
        # per sequence, its deltas since the last take (merged once, at the take: linear)
        self.pending: dict[tuple[str, int], list[Delta]] = {}
        self.steps = 0  # puts since the last take
        self.coalesced = 0  # steps merged into an earlier batch, in total
        self.ready = asyncio.Event()  # (event loop only) pending has something: iterate()
        self.readers = 0  # sockets and iterate() loops reading (event loop only)
        self.sock: socket.socket | None = None
        self.backlog: memoryview | bytes = b""  # a frame's rest the socket did not take yet
        self.last_sent = 0.0

    def put(self, deltas: list[Delta]) -> None:
        """(lock held)"""
        pending = self.pending
        for d in deltas:
            key = (d.request_id, d.index)
            held = pending.get(key)
            if held is None:
                pending[key] = [d]
            else:
                held.append(d)
        self.steps += 1

    def take(self) -> tuple[list[Delta], int]:
        """(lock held)"""
        deltas = [ds[0] if len(ds) == 1 else Delta.merge_all(ds) for ds in self.pending.values()]
        merged = max(self.steps - 1, 0)
        self.pending, self.steps = {}, 0
        self.coalesced += merged
        return deltas, merged


def _send_some(sock: socket.socket, data: bytes | memoryview) -> int:
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0


class OutputStreams:
    """A worker's output streams: one ``Channel`` per client, its listeners and heartbeats.

    ``offer`` (the engine thread, once per step and client) merges the step's deltas into the
    client's channel and, when a socket reads it and holds no backlog, writes them at once as
    one frame, in that thread: the common case wakes nothing else. A socket that cannot take a
    whole frame keeps the rest as backlog; the event loop then writes it when the socket drains
    (``_settle``), and whatever the engine offers meanwhile waits merged in the channel. The
    event loop owns the rest: listeners, hellos, heartbeats (an empty batch, with
    ``step_age()``, after ``heartbeat_s`` without a frame), a reader's end, and the reaping of a
    client whose readers are gone for ``orphan_grace_s`` (``on_orphaned(client)``)."""

    heartbeat_s = 1.0
    orphan_grace_s = 5.0

    def __init__(
        self, name: str, step_age: Callable[[], float], on_orphaned: Callable[[str], None]
    ) -> None:
        self.name = name
        self.step_age = step_age
        self.on_orphaned = on_orphaned
        self.channels: dict[str, Channel] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.token = secrets.token_hex(16)
        self._listeners: dict[str, tuple[socket.socket, asyncio.Task]] = {}
        self._beat: asyncio.Task | None = None
        self._handshakes = 0
        self.closed = False

    def channel(self, client: str) -> Channel:
        ch = self.channels.get(client)
        if ch is None:
            ch = self.channels.setdefault(client, Channel())
        return ch

    # -- any thread (the engine thread's) ------------------------------------------------------

    def offer(self, client: str, deltas: list[Delta]) -> None:
        """Hand ``client`` these deltas: written now when its socket can take them."""
        ch = self.channel(client)
        with ch.lock:
            ch.put(deltas)
            sock = ch.sock
            if sock is None:
                sent: bool | None = True
                wake = ch.readers > 0  # in-process readers wait on ch.ready
            else:
                wake = False
                sent = True if ch.backlog else self._flush(ch)  # backlog: the loop's writer
        if self.loop is None:
            return
        if wake:
            self._call(ch.ready.set)
        elif sent is not True:
            self._call(self._settle, client, ch, sock, sent)

    def _flush(self, ch: Channel, heartbeat: bool = False) -> bool | None:
        """(lock held) Write ``ch``'s backlog, then its pending deltas as one frame (or, with
        ``heartbeat`` and none pending, an empty batch). True: all written; False: the socket
        is full (the rest is the backlog); None: the socket broke."""
        sock = ch.sock
        try:
            if ch.backlog:
                ch.backlog = ch.backlog[_send_some(sock, ch.backlog) :]
                if ch.backlog:
                    return False
            if ch.pending or heartbeat:
                if ch.pending:
                    deltas, merged = ch.take()
                    frame = encode_batch(StreamBatch(self.name, deltas, merged))
                else:
                    frame = encode_batch(StreamBatch(self.name, [], 0, self.step_age()))
                sent = _send_some(sock, frame)
                ch.last_sent = time.monotonic()
                if sent < len(frame):
                    ch.backlog = memoryview(frame)[sent:]
                    return False
            return True
        except OSError:
            return None

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (in-process use after asyncio.run)
            logger.debug("%s: event loop closed, output dropped", self.name)

    def close(self) -> None:
        """Stop: listeners and sockets closed (readers see the stream end), iterate() ends."""
        self.closed = True
        if self.loop is not None:
            self._call(self._close_all)

    # -- the event loop ------------------------------------------------------------------------

    async def endpoint(self, peer_ip: str, own_ip: str) -> tuple[str, int, str]:
        """(host, port, token) for a router on ``peer_ip`` to read its streams from: loopback
        when it runs on this node (``own_ip``), this node's address otherwise."""
        self.loop = asyncio.get_running_loop()
        host = "127.0.0.1" if peer_ip in ("", "127.0.0.1", "localhost", own_ip) else own_ip
        if host not in self._listeners:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            lsock = socket.socket(family, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, 0))
            lsock.listen(64)
            lsock.setblocking(False)
            self._listeners[host] = (lsock, self.loop.create_task(self._accept(lsock)))
        if self._beat is None:
            self._beat = self.loop.create_task(self._heartbeats())
        return host, self._listeners[host][0].getsockname()[1], self.token

    async def _accept(self, lsock: socket.socket) -> None:
        while not self.closed:
            try:
                sock, _ = await self.loop.sock_accept(lsock)
            except OSError:
                return  # the listener closed
            if self._handshakes >= MAX_UNAUTHENTICATED:
                sock.close()
                continue
            self.loop.create_task(self._handshake(sock))

    async def _handshake(self, sock: socket.socket) -> None:
        self._handshakes += 1
        try:
            sock.setblocking(False)
            client, token = await within(read_hello(self.loop, sock), HELLO_TIMEOUT_S)
            if not hmac.compare_digest(token.encode(), self.token.encode()):
                raise StreamError("wrong token")
        except (StreamError, OSError, TimeoutError) as exc:
            logger.warning("%s: output stream refused: %s", self.name, exc)
            sock.close()
            return
        finally:
            self._handshakes -= 1
        if self.closed:
            sock.close()
            return
        configure(sock)
        ch = self.channel(client)
        old = ch.sock
        if old is not None:  # the same router again (its old connection is stale): replace
            self._drop(client, ch, old)
        with ch.lock:
            ch.sock, ch.backlog = sock, b""
            ch.readers += 1
            sent = self._flush(ch, heartbeat=True)  # what waited, or an empty batch: "accepted"
        self.loop.add_reader(sock, self._on_readable, client, ch, sock)
        self._settle(client, ch, sock, sent)

    def _on_readable(self, client: str, ch: Channel, sock: socket.socket) -> None:
        """A router sends nothing after its hello: readable means closed (or a protocol
        breach, handled alike)."""
        try:
            data = sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            logger.warning("%s: client %s sent data on its output stream", self.name, client)
        self._drop(client, ch, sock)

    def _settle(self, client: str, ch: Channel, sock: socket.socket, sent: bool | None) -> None:
        """After a ``_flush``: a backlog left (False) is written when the socket drains; a broken
        socket (None) is dropped."""
        if sent is False and ch.sock is sock:
            self.loop.add_writer(sock, self._on_writable, client, ch, sock)
        elif sent is None:
            self._drop(client, ch, sock)

    def _on_writable(self, client: str, ch: Channel, sock: socket.socket) -> None:
        with ch.lock:
            sent = self._flush(ch) if ch.sock is sock else True
        if sent is True:
            self.loop.remove_writer(sock)
        else:
            self._settle(client, ch, sock, sent)

    def _drop(self, client: str, ch: Channel, sock: socket.socket) -> None:
        """A socket reader's end (closed by the router, broken, or replaced)."""
        with ch.lock:
            if ch.sock is not sock:
                return
            ch.sock, ch.backlog = None, b""
        self.loop.remove_reader(sock)
        self.loop.remove_writer(sock)
        sock.close()
        self._reader_left(client, ch)

    def _reader_left(self, client: str, ch: Channel) -> None:
        ch.readers -= 1
        if ch.readers == 0 and not self.closed:
            self.loop.call_later(self.orphan_grace_s, self._reap, client)

    def _reap(self, client: str) -> None:
        ch = self.channels.get(client)
        if ch is None or ch.readers > 0 or self.closed:
            return
        del self.channels[client]
        self.on_orphaned(client)

    async def _heartbeats(self) -> None:
        """An empty batch down each socket that has carried no frame for ``heartbeat_s``: the
        reader tells a live worker from a hung one by them (and a hung engine thread by the
        running step's age they carry)."""
        while not self.closed:
            await asyncio.sleep(self.heartbeat_s / 4)
            now = time.monotonic()
            for client, ch in list(self.channels.items()):
                sock = ch.sock
                if sock is None or ch.backlog or now - ch.last_sent < self.heartbeat_s:
                    continue
                with ch.lock:
                    sent = self._flush(ch, heartbeat=True) if ch.sock is sock else True
                self._settle(client, ch, sock, sent)

    async def iterate(self, client: str) -> AsyncIterator[StreamBatch]:
        """An in-process (or Ray generator) reader of ``client``'s stream: a StreamBatch per
        engine step (merged when the reader is behind), and an empty one after
        ``heartbeat_s`` without any; runs until ``close``."""
        self.loop = asyncio.get_running_loop()
        ch = self.channel(client)
        ch.readers += 1
        try:
            while not self.closed:
                with ch.lock:
                    deltas, merged = ch.take() if ch.pending else ([], 0)
                    if not deltas:
                        ch.ready.clear()
                if deltas:
                    yield StreamBatch(self.name, deltas, merged)
                    continue
                try:
                    await within(ch.ready.wait(), self.heartbeat_s)
                except TimeoutError:
                    yield StreamBatch(self.name, [], 0, self.step_age())
        finally:
            self._reader_left(client, ch)

    def _close_all(self) -> None:
        for lsock, task in self._listeners.values():
            task.cancel()
            lsock.close()
        self._listeners.clear()
        if self._beat is not None:
            self._beat.cancel()
        for client, ch in list(self.channels.items()):
            if ch.sock is not None:
                self._drop(client, ch, ch.sock)
            ch.ready.set()
