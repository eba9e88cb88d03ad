"""The KV transport's pair-channel semantics, on the TCP backend (real sockets on 127.0.0.1) and
the in-process one: layers land in the reserved slots, every transfer ends in exactly one event,
bad peers are refused, and a broken channel fails its transfers on both ends."""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading

import pytest
import torch

from engine.kv_transfer.backends import KVConnector
from engine.kv_transfer.transport import (
    InProcessKVReceiver,
    KVSpec,
    TcpKVReceiver,
    read_header,
    write_frame,
)

BLOCK = 4
SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", block_size=BLOCK)
SLOTS = 64


class Events:
    """A receiver's ``on_event``: the events in order (``timeout_s``: how long ``next`` waits)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.q: queue.Queue = queue.Queue()
        self.timeout_s = timeout_s

    def __call__(self, event) -> None:
        self.q.put(event)

    def next(self, timeout: float | None = None):
        return self.q.get(timeout=self.timeout_s if timeout is None else timeout)

    def empty_after(self, seconds: float) -> bool:
        try:
            self.q.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


class Failures:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.event = threading.Event()

    def __call__(self, tids, reason) -> None:
        self.calls.append((tids, reason))
        self.event.set()


def caches(dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(2, SPEC.num_kv_heads, SLOTS, SPEC.head_dim, dtype=dtype) for _ in range(3)]


def source(n: int, layer: int, dtype=torch.float32) -> torch.Tensor:
    """Distinct values per (layer, k/v, head, token, dim)."""
    x = torch.arange(2 * SPEC.num_kv_heads * n * SPEC.head_dim, dtype=torch.float32)
    return (x.view(2, SPEC.num_kv_heads, n, SPEC.head_dim) + 1000 * layer).to(dtype)


def slots_of(table, start, n):
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]


@pytest.fixture(params=["tcp", "inproc"])
def pair(request):
    events, failures, kv = Events(), Failures(), caches()
    cls = TcpKVReceiver if request.param == "tcp" else InProcessKVReceiver
    rx = cls(SPEC, kv, BLOCK, events, token="secret")
    conn = KVConnector(SPEC, failures, token="secret")
    yield rx, conn, events, failures, kv
    conn.close()
    rx.close()


def test_layers_land_in_reserved_slots_then_complete(pair) -> None:
    rx, conn, events, _, kv = pair
    table_a, table_b = [5, 2, 9], [7, 1]
    rx.expect("a", table_a, 10)
    rx.expect("b", table_b, 6)
    tx = conn.sender(rx.endpoint)
    # Two steps: a's first chunk (0..6) alone, then a's rest (6..10) together with all of b.
    for layer in range(3):
        tx.send_layer(layer, [("a", 0, 6)], source(6, layer))
    for layer in range(3):
        both = torch.cat([source(4, layer) + 100, source(6, layer) + 200], dim=2)
        tx.send_layer(layer, [("a", 6, 4), ("b", 0, 6)], both)
    tx.send_done("a", 10, {"token_id": 42, "logprob": None, "top_logprobs": []})
    tx.send_done("b", 6, {"token_id": 7, "logprob": None, "top_logprobs": []})
    got = {e.transfer_id: e for e in (events.next(), events.next())}
    assert got["a"].kind == got["b"].kind == "complete"
    assert got["a"].token["token_id"] == 42
    for layer in range(3):
        a = kv[layer][:, :, slots_of(table_a, 0, 10)]
        expect_a = torch.cat([source(6, layer), source(4, layer) + 100], dim=2)
        torch.testing.assert_close(a, expect_a, rtol=0, atol=0)
        b = kv[layer][:, :, slots_of(table_b, 0, 6)]
        torch.testing.assert_close(b, source(6, layer) + 200, rtol=0, atol=0)
    # Nothing else was written: every other slot is still zero.
    used = set(slots_of(table_a, 0, 10)) | set(slots_of(table_b, 0, 6))
    others = [s for s in range(SLOTS) if s not in used]
    assert all(float(kv[i][:, :, others].abs().sum()) == 0 for i in range(3))
    assert rx.pending() == []


def test_done_before_every_layer_fails_the_transfer(pair) -> None:
    rx, conn, events, _, _ = pair
    rx.expect("a", [0, 1], 8)
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 8)], source(8, 0))  # layers 1 and 2 never sent
    tx.send_done("a", 8, {"token_id": 1})
    event = events.next()
    assert event.kind == "failed" and "incomplete" in event.reason


def test_cancel_stops_writes_and_releases_once(pair) -> None:
    rx, conn, events, _, kv = pair
    rx.expect("a", [3], 4)
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 4)], source(4, 0))
    tx.flush()
    rx.cancel("a")
    assert events.next().kind == "released"
    before = [c.clone() for c in kv]
    tx.send_layer(1, [("a", 0, 4)], source(4, 1))  # arrives after the cancel: dropped
    tx.send_done("a", 4, {"token_id": 1})
    tx.flush()
    assert events.empty_after(0.3)  # no second event for a released transfer
    assert all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))
    rx.cancel("a")  # a second cancel is a no-op
    assert events.empty_after(0.1)


def test_prefill_abort_fails_the_transfer(pair) -> None:
    rx, conn, events, _, _ = pair
    rx.expect("a", [0], 4)
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 4)], source(4, 0))
    tx.send_abort("a", "client went away")
    event = events.next()
    assert event.kind == "failed" and "client went away" in event.reason


def test_bfloat16_payload_round_trips(pair) -> None:
    rx, conn, events, _, _ = pair
    spec = KVSpec(3, 2, 4, "bfloat16", BLOCK)
    kv = caches(torch.bfloat16)
    rx2 = type(rx)(spec, kv, BLOCK, events, token="secret")
    conn2 = KVConnector(spec, Failures(), token="secret")
    try:
        rx2.expect("a", [1, 0], 5)
        tx = conn2.sender(rx2.endpoint)
        for layer in range(3):
            tx.send_layer(layer, [("a", 0, 5)], source(5, layer, torch.bfloat16))
        tx.send_done("a", 5, {"token_id": 3})
        assert events.next().kind == "complete"
        got = kv[2][:, :, slots_of([1, 0], 0, 5)]
        assert torch.equal(got, source(5, 2, torch.bfloat16))
    finally:
        conn2.close()
        rx2.close()


def test_fp8_payload_round_trips_byte_for_byte(pair) -> None:
    """An fp8 KV cache (kv_cache_dtype="fp8") travels as its bytes, also when one of a
    layer's transfers was cancelled and only the rest of the payload is written."""
    rx, _, events, _, _ = pair
    spec = dataclasses.replace(SPEC, dtype="float8_e4m3fn")
    kv = caches(torch.float8_e4m3fn)
    rx2 = type(rx)(spec, kv, BLOCK, events, token="secret")
    conn2 = KVConnector(spec, Failures(), token="secret")
    try:
        rx2.expect("a", [1, 0], 5)
        rx2.expect("b", [3], 2)
        rx2.cancel("b")
        assert events.next().kind == "released"
        tx = conn2.sender(rx2.endpoint)
        payloads = []
        for layer in range(3):
            both = (source(7, layer) / 100).to(torch.float8_e4m3fn)  # b's 2, then a's 5
            payloads.append(both)
            tx.send_layer(layer, [("b", 0, 2), ("a", 0, 5)], both)
        tx.send_done("a", 5, {"token_id": 3})
        assert events.next().kind == "complete"
        for layer in range(3):
            got = kv[layer][:, :, slots_of([1, 0], 0, 5)]
            assert torch.equal(got.view(torch.uint8), payloads[layer][:, :, 2:].view(torch.uint8))
        assert not kv[0][:, :, slots_of([3], 0, 2)].float().any()  # b's slots: untouched
    finally:
        conn2.close()
        rx2.close()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("dtype", "float8_e4m3fn", "KV cache dtype: sender 'float8_e4m3fn', receiver 'float32'"),
        ("block_size", 16, "block size: sender 16, receiver 4"),
    ],
)
def test_handshake_refuses_another_kv_dtype_or_block_size(pair, field, value, named) -> None:
    """A prefill worker with fp8 KV cannot stream to a decode worker with the model's dtype
    (the bytes would be read as other numbers), nor one with other blocks: refused before any
    layer moves, the error naming both sides' values and the settings to align."""
    rx, _, _, _, _ = pair
    failures = Failures()
    spec = dataclasses.replace(SPEC, **{field: value})
    conn = KVConnector(spec, failures, token="secret")
    try:
        tx = conn.sender(rx.endpoint)
        tx.send_layer(0, [("a", 0, 1)], torch.zeros(2, 2, 1, 4).to(spec.torch_dtype))
        assert failures.event.wait(10)
        tids, reason = failures.calls[0]
        assert tids == ["a"] and "refused" in reason, reason
        assert named in reason and "kv_cache_dtype and block_size" in reason, reason
        assert rx.pending() == []
    finally:
        conn.close()


def test_spec_mismatch_names_every_difference() -> None:
    theirs = {**SPEC.as_dict(), "head_dim": 8, "dtype": "bfloat16", "extra": 1}
    problem = SPEC.mismatch(theirs)
    assert "head dim: sender 8, receiver 4" in problem
    assert "KV cache dtype: sender 'bfloat16', receiver 'float32'" in problem
    assert "unknown field 'extra'" in problem
    assert SPEC.mismatch(SPEC.as_dict()) is None
    assert "no KV spec" in SPEC.mismatch(None)
    with pytest.raises(ValueError, match="block size 4, the cache 16"):
        TcpKVReceiver(SPEC, caches(), 16, Events(), token="secret")


# -- TCP only: what a hostile or dying peer can do -------------------------------------------------


@pytest.fixture
def tcp():
    events, kv = Events(), caches()
    rx = TcpKVReceiver(SPEC, kv, BLOCK, events, token="secret")
    yield rx, events, kv
    rx.close()


def test_receiver_listens_on_loopback_only(tcp) -> None:
    rx, _, _ = tcp
    assert rx.endpoint.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize(
    "change", [{"token": "wrong"}, {"spec": {**SPEC.as_dict(), "head_dim": 8}}, {"backend": "nccl"}]
)
def test_handshake_refuses_wrong_token_layout_or_backend(tcp, change) -> None:
    rx, _, _ = tcp
    failures = Failures()
    spec = KVSpec(3, 2, 8, "float32", BLOCK) if "spec" in change else SPEC
    token = change.get("token", "secret")
    conn = KVConnector(spec, failures, token=token)
    if "backend" in change:  # hand-made hello: our senders always announce their own backend
        host, port = rx.endpoint[len("tcp://") :].split(":")
        with socket.create_connection((host, int(port))) as s:
            write_frame(
                s, {"kind": "hello", "backend": "nccl", "spec": SPEC.as_dict(), "token": "secret"}
            )
            reply = read_header(s)
        assert reply["kind"] == "error" and "backend" in reply["message"]
        return
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 1)], torch.zeros(2, 2, 1, spec.head_dim))
    assert failures.event.wait(10)
    tids, reason = failures.calls[0]
    assert tids == ["a"] and "refused" in reason
    assert tx.error is not None
    # The connector drops a broken channel: the next request opens a new one.
    assert conn.sender(rx.endpoint) is not tx
    conn.close()


def test_payload_size_mismatch_drops_channel_and_fails_its_transfers(tcp) -> None:
    rx, events, kv = tcp
    rx.expect("a", [0, 1], 8)
    host, port = rx.endpoint[len("tcp://") :].split(":")
    with socket.create_connection((host, int(port))) as s:
        write_frame(
            s, {"kind": "hello", "backend": "tcp", "spec": SPEC.as_dict(), "token": "secret"}
        )
        assert read_header(s)["kind"] == "ready"
        good = source(4, 0)
        write_frame(
            s,
            {"kind": "layer", "layer": 0, "entries": [["a", 0, 4]], "nbytes": 4 * good.numel()},
            memoryview(good.numpy()).cast("B"),
        )
        # Lies about its size: 4 tokens announced, 2 tokens' bytes.
        write_frame(s, {"kind": "layer", "layer": 1, "entries": [["a", 0, 4]], "nbytes": 64})
        event = events.next()
    assert event.kind == "failed" and "peer lost" in event.reason
    assert rx.pending() == []


def test_sender_dying_mid_transfer_fails_it_on_the_receiver(tcp) -> None:
    rx, events, _ = tcp
    rx.expect("a", [0, 1], 8)
    rx.expect("b", [2], 4)  # not started on that channel: untouched by its loss
    conn = KVConnector(SPEC, Failures(), token="secret")
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 8)], source(8, 0))
    tx.flush()
    tx.close()  # the prefill process goes away before layers 1, 2 and done
    event = events.next()
    assert (event.kind, event.transfer_id) == ("failed", "a")
    assert rx.pending() == ["b"]


def test_receiver_dying_mid_transfer_fails_it_on_the_sender(tcp) -> None:
    rx, _, _ = tcp
    rx.expect("a", [0, 1], 8)
    failures = Failures()
    conn = KVConnector(SPEC, failures, token="secret")
    tx = conn.sender(rx.endpoint)
    tx.send_layer(0, [("a", 0, 8)], source(8, 0))
    tx.flush()
    rx.close()  # the decode process goes away
    for layer in (1, 2, 0, 1, 2) * 200:  # keep sending until the broken pipe shows
        if failures.event.is_set():
            break
        tx.send_layer(layer, [("a", 0, 8)], source(8, layer))
        tx.flush(5)
    assert failures.event.wait(10)
    assert failures.calls[0][0] == ["a"]
    conn.close()


def test_connector_keeps_at_most_max_channels_idle(tcp) -> None:
    rx, events, _ = tcp
    others = [TcpKVReceiver(SPEC, caches(), BLOCK, events, token="secret") for _ in range(2)]
    conn = KVConnector(SPEC, Failures(), token="secret", max_channels=2)
    try:
        for r in [rx, *others]:
            conn.sender(r.endpoint).flush(5)
        assert conn.num_channels == 2
    finally:
        conn.close()
        for r in others:
            r.close()


def test_connect_forms_channels_before_any_layer(tcp) -> None:
    rx, _, _ = tcp
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    conn = KVConnector(SPEC, Failures(), token="secret", max_channels=2)
    try:
        up, down = conn.connect([rx.endpoint, dead, rx.endpoint])  # the repeat is one channel
        assert up.formed.wait(10) and up.error is None
        assert down.formed.wait(10) and "cannot open KV channel" in down.error
        assert conn.sender(rx.endpoint) is up  # the first request finds it open
    finally:
        conn.close()


def test_held_transfer_waits_for_its_gate_and_keeps_order(pair) -> None:
    rx, conn, events, _, kv = pair
    gate = threading.Event()
    tx = conn.sender(rx.endpoint)
    tx.hold("a", gate, timeout_s=30)
    for layer in range(3):  # "a" computes while its decode worker is still reserving
        tx.send_layer(layer, [("a", 0, 4)], source(4, layer))
    tx.send_done("a", 4, {"token_id": 9})
    rx.expect("b", [5], 4)
    for layer in range(3):  # queued behind "a": must not overtake it
        tx.send_layer(layer, [("b", 0, 4)], source(4, layer))
    tx.send_done("b", 4, {"token_id": 8})
    assert events.empty_after(0.3)  # nothing left the channel
    rx.expect("a", [2], 4)  # the reservation lands, then the gate opens
    gate.set()
    order = [events.next().transfer_id, events.next().transfer_id]
    assert order == ["a", "b"]
    torch.testing.assert_close(kv[1][:, :, 8:12], source(4, 1), rtol=0, atol=0)


def test_gate_timeout_fails_only_that_transfer(pair) -> None:
    rx, conn, events, failures, _ = pair
    tx = conn.sender(rx.endpoint)
    tx.hold("a", threading.Event(), timeout_s=0.2)  # never released
    tx.send_layer(0, [("a", 0, 4)], source(4, 0))
    rx.expect("b", [1], 4)
    for layer in range(3):
        tx.send_layer(layer, [("b", 0, 4)], source(4, layer))
    tx.send_done("b", 4, {"token_id": 1})
    assert events.next().kind == "complete"  # b went through after a's gate timed out
    assert failures.event.wait(5) and failures.calls[0][0] == ["a"]
    assert tx.error is None


def test_stacked_layers_and_an_inexact_transfer_grown_midway(pair) -> None:
    """A migration's copy: several layers in one message, a transfer whose length comes with
    ``done`` (at most what it expects), its room extended between chunks."""
    rx, conn, events, _, kv = pair
    rx.expect("m", [3, 8], 8, exact=False)
    tx = conn.sender(rx.endpoint)
    tx.send_layers(0, [("m", 0, 6)], torch.stack([source(6, layer) for layer in range(3)]))
    assert rx.extend("m", [3, 8, 11], 12)
    tx.send_layers(1, [("m", 6, 4)], torch.stack([source(4, layer) + 50 for layer in (1, 2)]))
    tx.send_layer(0, [("m", 6, 4)], source(4, 0) + 50)
    tx.send_done("m", 10, {"token_id": 3, "output_token_ids": [3], "num_computed": 10})
    event = events.next()
    assert event.kind == "complete" and event.token["num_computed"] == 10
    for layer in range(3):
        got = kv[layer][:, :, slots_of([3, 8, 11], 0, 10)]
        want = torch.cat([source(6, layer), source(4, layer) + 50], dim=2)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rx.expect("short", [0], 4, exact=False)
    tx.send_layer(0, [("short", 0, 2)], source(2, 0))
    tx.send_done("short", 2, {"token_id": 1})  # layers 1 and 2 never came
    event = events.next()
    assert event.kind == "failed" and "short" in event.reason
    assert not rx.extend("gone", [0], 4) and not rx.extend("m", [3, 8, 11], 12)


def test_a_transfer_into_its_own_buffer_leaves_the_pool_alone(pair) -> None:
    """A tensor-parallel decode worker's: position i lands in ``into[..., i, :]`` (every
    head), mixed in one message with a transfer into the pool; grown midway into a larger
    buffer that keeps what arrived; a buffer of the wrong shape is refused."""
    rx, conn, events, _, kv = pair
    buf = torch.zeros(3, 2, SPEC.num_kv_heads, 2 * BLOCK, SPEC.head_dim)
    rx.expect("t", [6, 1], 8, exact=False, into=buf)
    rx.expect("p", [9], 3)
    tx = conn.sender(rx.endpoint)
    for layer in range(3):  # t's first 5 positions beside all of p's
        tx.send_layer(layer, [("t", 0, 5), ("p", 0, 3)], source(8, layer))
    bigger = torch.zeros(3, 2, SPEC.num_kv_heads, 3 * BLOCK, SPEC.head_dim)
    assert rx.extend("t", [6, 1, 4], 12, into=bigger)
    assert not rx.extend("t", [6, 1, 4], 12)  # (into a buffer, or into the pool: not both)
    tx.send_layers(0, [("t", 5, 5)], torch.stack([source(5, layer) + 50 for layer in range(3)]))
    tx.send_done("p", 3, {"token_id": 2})
    tx.send_done("t", 10, {"token_id": 3, "output_token_ids": [3], "num_computed": 10})
    got = {e.transfer_id: e for e in (events.next(), events.next())}
    assert got["t"].kind == got["p"].kind == "complete"
    for layer in range(3):
        want = torch.cat([source(8, layer)[:, :, :5], source(5, layer) + 50], dim=2)
        torch.testing.assert_close(bigger[layer][:, :, :10], want, rtol=0, atol=0)
        assert float(bigger[layer][:, :, 10:].abs().sum()) == 0
        pool_p = kv[layer][:, :, slots_of([9], 0, 3)]
        torch.testing.assert_close(pool_p, source(8, layer)[:, :, 5:], rtol=0, atol=0)
    others = [s for s in range(SLOTS) if s not in slots_of([9], 0, 3)]
    assert all(float(kv[i][:, :, others].abs().sum()) == 0 for i in range(3))
    with pytest.raises(ValueError, match="into must be"):
        rx.expect("bad", [0, 2], 8, into=torch.zeros(3, 2, SPEC.num_kv_heads, BLOCK, 4))
    assert rx.pending() == []


def test_a_stacked_message_that_lies_about_its_layers_breaks_the_channel() -> None:
    events, kv = Events(), caches()
    rx = TcpKVReceiver(SPEC, kv, BLOCK, events, token="secret")
    rx.expect("a", [0, 1], 4)
    try:
        s = socket.create_connection(("127.0.0.1", int(rx.endpoint.rsplit(":", 1)[1])))
        write_frame(
            s, {"kind": "hello", "backend": "tcp", "spec": SPEC.as_dict(), "token": "secret"}
        )
        assert read_header(s)["kind"] == "ready"
        nbytes = 3 * SPEC.payload_bytes(4)
        write_frame(
            s, {"kind": "layer", "layer": 1, "count": 3, "entries": [["a", 0, 4]], "nbytes": nbytes}
        )
        s.settimeout(10)
        assert s.recv(1) == b""  # refused before any byte of payload: the channel is closed
        s.close()
        assert rx.pending() == ["a"]  # nothing of it landed: it still waits for a sound peer
    finally:
        rx.close()
