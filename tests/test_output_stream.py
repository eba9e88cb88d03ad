"""A worker's output stream on its own socket (engine/output_stream.py), with real sockets:

* a batch crosses as msgpack and arrives equal, in order, plain and rich deltas alike; a frame
  that breaks the protocol is refused (StreamError), never half-read;
* only a router with the worker's token is served; a wrong token or a silent connection is
  closed without a frame;
* a reader that stops reading never blocks the writer (the engine thread): what it misses is
  merged and arrives, in order and whole, when it reads again;
* a router's socket that closes gets its requests aborted after the grace period; an idle
  socket carries heartbeats.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import msgpack
import pytest

from engine.messages import Delta, StreamBatch
from engine.output_stream import (
    OutputStreams,
    StreamError,
    decode_batch,
    encode_batch,
    encode_hello,
    read_stream,
)

RICH = [
    Delta("r5", [9], [{9: -0.5, 3: -1.0}], start=12),  # logprobs
    Delta("r6", [4], finish_reason="stop", stop_reason=4, start=3),
    Delta("r6b", [4], finish_reason="stop", stop_reason="\n\n", start=3),
    Delta("r7", error="worker died", retryable=True),
    Delta("r8", moved_to="decode-1", start=2),
    Delta("r9", [1], text="hi", num_cached_tokens=16, predicted=(1.0, 2.5, 3.0), start=0),
]


def test_a_batch_crosses_as_msgpack_and_arrives_equal_in_order() -> None:
    plain = [Delta(f"r{i}", [100 + i] * (1 + i % 3), index=i % 2, start=7 * i) for i in range(40)]
    deltas = plain[:5] + RICH + plain[5:]
    frame = encode_batch(StreamBatch("decode-0", deltas, coalesced=3, step_age_s=0.0))
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4
    back = decode_batch(frame[4:])
    assert back == StreamBatch("decode-0", deltas, 3, 0.0)
    assert back.deltas[-1 - 35].predicted == (1.0, 2.5, 3.0)  # a tuple again, as sent


def _body(*batch) -> bytes:
    return msgpack.packb(list(batch))


@pytest.mark.parametrize(
    "body, why",
    [
        (b"\xc1", "not msgpack"),
        (_body(2, "w", 0, 0.0, []), "version"),
        (_body(1, "w", 0, 0, []), "header"),  # step age must be a float
        (_body(1, "w", 0, 0.0, [["r", 0, 0, [1, "x"]]]), "integers"),
        (_body(1, "w", 0, 0.0, [["r", 0, 0, [True]]]), "integers"),  # a bool is no token id
        (_body(1, "w", 0, 0.0, [["r", 0, 0, [2.0]]]), "integers"),
        (_body(1, "w", 0, 0.0, [["r", 0, 0, {1: 2}]]), "integers"),
        (_body(1, "w", 0, 0.0, [{"request_id": "r", "token_ids": [3, False]}]), "token_ids"),
        (_body(1, "w", 0, 0.0, [["r", 0, [1]]]), "plain delta"),
        (_body(1, "w", 0, 0.0, [{"request_id": "r", "evil": 1}]), "unknown"),
        (_body(1, "w", 0, 0.0, [{"request_id": "r", "retryable": 1}]), "retryable"),
        (_body(1, "w", 0, 0.0, [{"request_id": "r", "logprobs": [{"1": 0.5}]}]), "logprobs"),
        (_body(1, "w", 0, 0.0, [{"request_id": "r", "predicted": [1, 2]}]), "predicted"),
        (_body(1, "w", 0, 0.0, [{"token_ids": [1]}]), "bad delta"),
    ],
)
def test_a_frame_that_breaks_the_protocol_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(StreamError, match=why):
        decode_batch(body)


@pytest.fixture
def streams():
    """An OutputStreams on an event loop of its own thread, as in a worker actor."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    orphaned: list[str] = []
    s = OutputStreams("w", lambda: 0.0, orphaned.append)
    s.heartbeat_s = 0.2
    s.orphaned = orphaned
    s.run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(10)
    yield s
    s.close()
    time.sleep(0.05)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _frames(sock: socket.socket, until: float, tokens: int = -1) -> list[StreamBatch]:
    """Every frame ``sock`` delivers before it closes, ``until`` (monotonic) passes or the
    frames hold ``tokens`` tokens."""
    sock.settimeout(0.05)
    buf, out, got = b"", [], 0
    while time.monotonic() < until and got != tokens:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            size = struct.unpack(">I", buf[:4])[0]
            out.append(decode_batch(buf[4 : 4 + size]))
            got += sum(len(d.token_ids) for d in out[-1].deltas)
            buf = buf[4 + size :]
    return out


def test_only_a_router_with_the_token_is_served(streams) -> None:
    host, port, token = streams.run(streams.endpoint("", "10.0.0.9"))
    assert host == "127.0.0.1"  # a router on this node: loopback only
    streams.offer("router-x", [Delta("a", [1], start=0)])
    with socket.create_connection((host, port)) as bad:
        bad.sendall(encode_hello("router-x", token[:-1] + ("0" if token[-1] != "0" else "1")))
        assert _frames(bad, time.monotonic() + 5) == []  # closed without a frame
    with socket.create_connection((host, port)) as junk:
        junk.sendall(struct.pack(">I", 1 << 20))  # a hello far over its size limit
        assert _frames(junk, time.monotonic() + 5) == []
    with socket.create_connection((host, port)) as good:
        good.sendall(encode_hello("router-x", token))
        got = _frames(good, time.monotonic() + 1)
    # what waited for the router arrives first; then heartbeats (empty batches)
    assert got[0].deltas == [Delta("a", [1], start=0)]
    assert len(got) >= 3 and all(b.deltas == [] for b in got[1:])


def test_a_reader_that_stops_reading_never_blocks_the_writer(streams) -> None:
    """The engine thread offers 400 steps of 2,000 tokens each to a router that reads none:
    every offer returns at once (the socket's full buffer leaves a backlog that the event loop
    writes later), and when the router reads again it gets every token, in order, the steps it
    missed merged into fewer batches."""
    host, port, token = streams.run(streams.endpoint("127.0.0.1", "127.0.0.1"))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    sock.sendall(encode_hello("slow", token))
    time.sleep(0.2)  # (the hello is taken; nothing is read from here on until the offers end)
    slowest, sent = 0.0, []
    for step in range(400):
        tokens = list(range(70_000 + step * 2000, 70_000 + (step + 1) * 2000))  # 5 bytes each
        sent += tokens
        t0 = time.monotonic()
        streams.offer("slow", [Delta("a", tokens, start=step * 2000)])
        slowest = max(slowest, time.monotonic() - t0)
    ch = streams.channels["slow"]
    assert ch.backlog and ch.pending  # the socket is full: the rest waits, merged
    got = _frames(sock, time.monotonic() + 20, len(sent))
    sock.close()
    tokens = [t for b in got for d in b.deltas for t in d.token_ids]
    assert tokens == sent
    assert sum(b.coalesced for b in got) > 0 and len([b for b in got if b.deltas]) < 400
    assert slowest < 0.5, slowest  # (a blocking send would wait for the reader: forever)


def test_a_router_that_goes_away_has_its_requests_reaped(streams) -> None:
    streams.orphan_grace_s = 0.1
    host, port, token = streams.run(streams.endpoint("", ""))

    async def read_a_bit():
        stream = read_stream(host, port, token, "router-gone")
        first = await stream.__anext__()  # "accepted": an empty batch
        await stream.aclose()  # the router closes its socket
        return first

    assert streams.run(read_a_bit()).deltas == []
    deadline = time.monotonic() + 5
    while not streams.orphaned and time.monotonic() < deadline:
        time.sleep(0.02)
    assert streams.orphaned == ["router-gone"] and "router-gone" not in streams.channels


def test_read_stream_ends_at_the_workers_close_and_raises_on_a_cut_frame(streams) -> None:
    host, port, token = streams.run(streams.endpoint("", ""))

    got: list[StreamBatch] = []

    def reader():  # a router's loop of its own, as in the gateway
        async def go():
            async for b in read_stream(host, port, token, "r"):
                got.append(b)

        asyncio.run(go())

    t = threading.Thread(target=reader)
    t.start()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    streams.offer("r", [Delta("z", [5], start=0)])
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    streams.close()  # the worker shuts down: the stream ends cleanly
    t.join(5)
    assert not t.is_alive()
    assert [d for b in got for d in b.deltas] == [Delta("z", [5], start=0)]

    # a peer that cuts a frame in the middle: StreamError, not a silent end
    server = socket.create_server(("127.0.0.1", 0))
    port2 = server.getsockname()[1]

    def cut():
        conn, _ = server.accept()
        conn.recv(4096)
        frame = encode_batch(StreamBatch("w", [Delta("a", [1])]))
        conn.sendall(frame[:-3])
        conn.close()

    threading.Thread(target=cut, daemon=True).start()

    async def read_cut():
        return [b async for b in read_stream("127.0.0.1", port2, "t", "c")]

    with pytest.raises(StreamError, match="cut inside a frame"):
        asyncio.run(read_cut())
    server.close()
