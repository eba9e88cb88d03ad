"""The KV transport's bounds (KVLimits), on real sockets on 127.0.0.1: a full sender queue fails
one transfer retryably while the channel goes on; a peer that stops reading, a sender stalled
mid-message and a receiver that never answers hello all break their channel instead of holding a
thread; the listener gives unauthenticated connections no thread, caps them and drops them after
a deadline; an NCCL init given up on leaves no thread behind (its logic, with a stand-in for
NCCL's bootstrap; the real thing is in tests/gpu/test_nccl_bounds.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch
from test_kv_transport import BLOCK, SPEC, Events, Failures, caches, source

from engine.kv_transfer import nccl
from engine.kv_transfer.backends import KVConnector
from engine.kv_transfer.transport import (
    InProcessKVReceiver,
    KVLimits,
    KVSpec,
    TcpKVReceiver,
    TransferError,
    read_header,
    write_frame,
)

HELLO = {"kind": "hello", "backend": "tcp", "spec": SPEC.as_dict(), "token": "secret"}
LAYER = SPEC.payload_bytes(4)  # one layer of a 4-token transfer


def new_threads(before: set[threading.Thread], prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith(prefix)]


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.split("://")[1].rsplit(":", 1)
    return host, int(port)


def is_closed(sock: socket.socket, wait: float) -> bool:
    """Whether the other end closed ``sock`` within ``wait`` seconds (it sends nothing)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def send_transfer(tx, tid: str, token_id: int = 1) -> None:
    for layer in range(SPEC.num_layers):
        tx.send_layer(layer, [(tid, 0, 4)], source(4, layer))
    tx.send_done(tid, 4, {"token_id": token_id})


# -- the sender's queue ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "inproc"])
def test_a_full_queue_fails_that_transfer_retryably_and_the_channel_goes_on(backend) -> None:
    events, failures, kv = Events(), Failures(), caches()
    cls = TcpKVReceiver if backend == "tcp" else InProcessKVReceiver
    rx = cls(SPEC, kv, BLOCK, events, token="secret")
    conn = KVConnector(SPEC, failures, token="secret", limits=KVLimits(max_pending_bytes=3 * LAYER))
    try:
        for tid, block in (("a", 1), ("b", 2), ("c", 3)):
            rx.expect(tid, [block], 4)
        tx = conn.sender(rx.endpoint)
        gate = threading.Event()
        tx.hold("a", gate, timeout_s=30)  # a slow receiver: nothing leaves the queue for now
        send_transfer(tx, "a")  # 3 layers: exactly the cap
        assert tx.pending_bytes == 3 * LAYER
        send_transfer(tx, "b")  # its first layer would pass the cap: b fails, here and now
        assert [tids for tids, _ in failures.calls] == [["b"]]
        assert "full" in failures.calls[0][1]
        assert tx.pending_bytes == 3 * LAYER  # nothing of b was queued
        gate.set()
        got = {e.transfer_id: e for e in (events.next(), events.next())}
        assert got["a"].kind == "complete"
        assert got["b"].kind == "failed" and "full" in got["b"].reason  # freed on the decode side
        send_transfer(tx, "c")  # the queue drained: the same channel takes the next transfer
        assert events.next().kind == "complete"
        assert tx.error is None and len(failures.calls) == 1
        tx.flush(5)
        assert wait_until(lambda: tx.pending_bytes == 0)
        assert torch.equal(kv[2][:, :, 12:16], source(4, 2))
        assert rx.pending() == []
    finally:
        conn.close()
        rx.close()


def test_one_layer_larger_than_the_cap_still_goes_alone() -> None:
    events, failures = Events(), Failures()
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, events, token="secret")
    conn = KVConnector(SPEC, failures, token="secret", limits=KVLimits(max_pending_bytes=1))
    try:
        rx.expect("a", [0], 4)
        tx = conn.sender(rx.endpoint)
        for layer in range(SPEC.num_layers):
            tx.send_layer(layer, [("a", 0, 4)], source(4, layer))
            tx.flush(5)  # the queue is empty again before the next one
        tx.send_done("a", 4, {"token_id": 1})
        assert events.next().kind == "complete" and failures.calls == []
    finally:
        conn.close()
        rx.close()


@pytest.fixture(scope="module")
def tiny_workers(tmp_path_factory, tiny_cfg):
    transformers = pytest.importorskip("transformers")
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bounds")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_cfg())).save_pretrained(path)
    cfg = {
        "model_dir": str(path),
        "max_num_batched_tokens": 24,
        "num_kv_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 4,
    }
    p = PrefillWorker(cfg, "p", kv_limits={"max_pending_bytes": 1})
    d = DecodeWorker(cfg, "d", transport="inproc")
    p.start(), d.start()
    yield p, d
    p.shutdown()
    d.shutdown()


def test_a_refused_transfer_reaches_the_caller_as_a_retryable_failure(tiny_workers) -> None:
    from engine.messages import PrefillFailed, Reserved
    from engine.sampling_params import SamplingParams

    p, d = tiny_workers

    async def scenario():
        prompt, params = list(range(1, 13)), SamplingParams(max_tokens=4)
        res = await d.reserve("r", prompt, params, "r")
        assert isinstance(res, Reserved)
        # Never released: layer 0 waits at the channel, layer 1 finds the queue full.
        pre = await p.prefill("r", prompt, params, res.endpoint, gated=True)
        deltas = []
        stream = d.outputs("r")
        async for batch in stream:
            deltas += batch.deltas
            if deltas and deltas[-1].finished:
                break
        await stream.aclose()
        return pre, deltas

    pre, deltas = asyncio.run(scenario())
    assert isinstance(pre, PrefillFailed) and "full" in pre.message
    assert deltas[-1].error is not None and deltas[-1].retryable and "full" in deltas[-1].error
    assert asyncio.run(d.check_idle()) is None
    assert asyncio.run(p.check_idle()) is None


# -- sockets that stop moving ----------------------------------------------------------------------


class FakeReceiver:
    """Accepts one channel, answers its hello with ``ready`` (or not at all), then never reads."""

    def __init__(self, reply: bool = True) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.reply = reply
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.server.accept()
        self.conns.append(conn)
        read_header(conn)
        if self.reply:
            write_frame(conn, {"kind": "ready"})

    def close(self) -> None:
        for s in [*self.conns, self.server]:
            s.close()


def test_a_peer_that_stops_reading_makes_the_send_time_out() -> None:
    big = KVSpec(1, 8, 1024, "float32", block_size=16)  # 64 KiB a token
    fake, failures = FakeReceiver(), Failures()
    conn = KVConnector(big, failures, token="secret", limits=KVLimits(io_timeout_s=0.5))
    try:
        tx = conn.sender(fake.endpoint)
        started = time.monotonic()
        tx.send_layer(0, [("a", 0, 256)], torch.zeros(2, 8, 256, 1024))  # 16 MiB: never fits
        assert failures.event.wait(10)
        assert time.monotonic() - started < 5
        tids, reason = failures.calls[0]
        assert tids == ["a"] and "stopped reading" in reason
        tx._thread.join(2)
        assert not tx._thread.is_alive()  # the sender thread ended: nothing blocks for good
    finally:
        conn.close()
        fake.close()


def test_a_receiver_that_never_answers_hello_fails_the_channel_in_time() -> None:
    fake, failures = FakeReceiver(reply=False), Failures()
    limits = KVLimits(handshake_timeout_s=0.3)
    conn = KVConnector(SPEC, failures, token="secret", limits=limits)
    try:
        tx = conn.sender(fake.endpoint)
        tx.send_layer(0, [("a", 0, 4)], source(4, 0))
        assert failures.event.wait(5)
        assert failures.calls[0][0] == ["a"] and "cannot open" in failures.calls[0][1]
        tx._thread.join(2)
        assert not tx._thread.is_alive()
    finally:
        conn.close()
        fake.close()


def handshake(endpoint: str) -> socket.socket:
    s = socket.create_connection(address(endpoint))
    write_frame(s, HELLO)
    assert read_header(s)["kind"] == "ready"
    return s


def test_a_sender_stalled_mid_message_breaks_the_pair_but_an_idle_one_does_not() -> None:
    events, kv = Events(), caches()
    rx = TcpKVReceiver(SPEC, kv, BLOCK, events, token="secret", limits=KVLimits(io_timeout_s=0.3))
    try:
        rx.expect("idle", [1], 4)
        with handshake(rx.endpoint) as s:
            time.sleep(0.8)  # idle between messages for longer than io_timeout_s: fine
            for layer in range(SPEC.num_layers):
                payload = memoryview(source(4, layer).numpy()).cast("B")
                header = {"kind": "layer", "layer": layer, "entries": [["idle", 0, 4]]}
                write_frame(s, {**header, "nbytes": LAYER}, payload)
            write_frame(s, {"kind": "done", "transfer_id": "idle", "num_tokens": 4, "token": {}})
            write_frame(s, {"kind": "done", "transfer_id": "idle", "num_tokens": 4, "token": {}})
            event = events.next()
        assert event.kind == "failed"  # (an empty token object: the header check says so)
        rx.expect("a", [2], 4)
        with handshake(rx.endpoint) as s:
            header = {"kind": "layer", "layer": 0, "entries": [["a", 0, 4]], "nbytes": LAYER}
            write_frame(s, header, memoryview(source(4, 0).numpy()).cast("B"))
            write_frame(s, {**header, "layer": 1}, memoryview(bytes(LAYER // 2)))  # then stalls
            started = time.monotonic()
            event = events.next(timeout=5)
            assert time.monotonic() - started < 3
            assert is_closed(s, 2)
        assert event.kind == "failed" and "sent nothing" in event.reason
        assert wait_until(lambda: rx.num_pairs == 0)
    finally:
        rx.close()


def test_both_ends_of_a_channel_keep_tcp_keepalive_on() -> None:
    events = Events()
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, events, token="secret")
    conn = KVConnector(SPEC, Failures(), token="secret", limits=KVLimits(keepalive_s=9))
    try:
        tx = conn.sender(rx.endpoint)
        tx.flush(5)
        assert wait_until(lambda: rx.num_pairs == 1)
        for sock in (tx._sock, *rx._conns.values()):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE") and sock is tx._sock:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 9
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
    finally:
        conn.close()
        rx.close()


# -- the listener ----------------------------------------------------------------------------------


def test_unauthenticated_connections_get_no_thread_are_capped_and_dropped() -> None:
    events = Events()
    limits = KVLimits(max_unauthenticated=2, handshake_timeout_s=0.6)
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, events, token="secret", limits=limits)
    before = set(threading.enumerate())
    silent = socket.create_connection(address(rx.endpoint))  # connects, sends nothing
    loris = socket.create_connection(address(rx.endpoint))
    loris.sendall(b"\x00\x00")  # half of a length prefix, then nothing
    time.sleep(0.1)
    extra = socket.create_connection(address(rx.endpoint))  # past the cap: closed at once
    try:
        assert is_closed(extra, 1.0)
        assert not is_closed(silent, 0.1) and not is_closed(loris, 0.1)
        assert new_threads(before, "kv-recv") == []  # nobody authenticated: no thread
        assert is_closed(silent, 2.0) and is_closed(loris, 2.0)  # dropped at the deadline
        assert rx.refused_connections == 3
        # The listener still serves a sender that says hello properly.
        rx.expect("a", [4], 4)
        conn = KVConnector(SPEC, Failures(), token="secret")
        send_transfer(conn.sender(rx.endpoint), "a")
        assert events.next().kind == "complete"
        conn.close()
    finally:
        for s in (silent, loris, extra):
            s.close()
        rx.close()


@pytest.mark.parametrize(
    "bad",
    [
        b"\x7f\xff\xff\xff",  # a 2 GiB hello
        b"\x00\x00\x00\x02{}",  # JSON without a kind
        b"\x00\x00\x00\x04null",
    ],
)
def test_a_malformed_hello_is_refused_without_a_thread(bad) -> None:
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, Events(), token="secret")
    before = set(threading.enumerate())
    try:
        with socket.create_connection(address(rx.endpoint)) as s:
            s.sendall(bad)
            s.settimeout(2)
            reply = read_header(s)
            assert reply["kind"] == "error"
            assert is_closed(s, 2)
        assert new_threads(before, "kv-recv") == []
    finally:
        rx.close()


def test_a_wrong_token_is_refused_before_any_thread_starts() -> None:
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, Events(), token="secret")
    before = set(threading.enumerate())
    try:
        with socket.create_connection(address(rx.endpoint)) as s:
            write_frame(s, {**HELLO, "token": "guess"})
            reply = read_header(s)
        assert reply["kind"] == "error" and "token" in reply["message"]
        assert new_threads(before, "kv-recv") == []
    finally:
        rx.close()


def test_pairs_past_max_pairs_are_refused() -> None:
    events = Events()
    rx = TcpKVReceiver(SPEC, caches(), BLOCK, events, token="secret", limits=KVLimits(max_pairs=1))
    first, second = Failures(), Failures()
    a, b = KVConnector(SPEC, first, token="secret"), KVConnector(SPEC, second, token="secret")
    try:
        a.sender(rx.endpoint).flush(5)
        assert wait_until(lambda: rx.num_pairs == 1)
        b.sender(rx.endpoint).send_layer(0, [("x", 0, 4)], source(4, 0))
        assert second.event.wait(5) and "pairs" in second.calls[0][1]
        rx.expect("a", [0], 4)  # the pair that got in works
        send_transfer(a.sender(rx.endpoint), "a")
        assert events.next().kind == "complete" and first.calls == []
    finally:
        a.close()
        b.close()
        rx.close()


def test_limits_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="max_pending_bytes"):
        KVLimits(max_pending_bytes=0)
    with pytest.raises(ValueError, match="keepalive_s"):
        KVLimits(keepalive_s=0.5)
    assert KVLimits(keepalive_s=None).keepalive_s is None


# -- NCCL communicator init: the deadline and the rescue (NCCL's bootstrap stood in for) -----------


class FakeComm:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class Rendezvous:
    """Like a 2-rank NCCL bootstrap: each init blocks, with no timeout, until both ranks are in."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.comms: list[FakeComm] = []

    def join(self, rank: int) -> FakeComm:
        self.barrier.wait()
        comm = FakeComm()
        self.comms.append(comm)
        return comm


def test_an_init_given_up_on_is_rescued_and_leaves_no_thread() -> None:
    before = set(threading.enumerate())
    rv = Rendezvous()
    started = time.monotonic()
    with pytest.raises(TransferError, match="not formed in 0.2 s"):
        nccl.form_communicator(rv.join, 0, timeout_s=0.2, rescue=True)
    assert time.monotonic() - started < 1
    # The root's side joins the missing rank itself: both inits return and are aborted.
    assert wait_until(lambda: new_threads(before, "nccl-") == [], 2)
    assert nccl.abandoned_inits() == 0
    assert len(rv.comms) == 2 and all(c.aborted for c in rv.comms)


def test_an_init_given_up_without_rescue_is_counted_capped_and_ends_with_its_peer() -> None:
    before = set(threading.enumerate())
    rv = Rendezvous()
    with pytest.raises(TransferError, match="not formed"):
        nccl.form_communicator(rv.join, 1, timeout_s=0.1, rescue=False)
    assert nccl.abandoned_inits() == 1
    with pytest.raises(TransferError, match="still unwinding"):
        nccl.refuse_if_unwinding(1)
    nccl.refuse_if_unwinding(2)  # under the cap: allowed
    late = rv.join(0)  # the peer finally joins: the given-up init returns and is aborted
    assert wait_until(lambda: new_threads(before, "nccl-") == [], 2)
    assert nccl.abandoned_inits() == 0
    assert not late.aborted and [c.aborted for c in rv.comms if c is not late] == [True]


def test_an_init_stops_waiting_when_the_peer_reports_failure() -> None:
    rv = Rendezvous()
    calls = []

    def interrupt() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise TransferError("receiver could not join NCCL: boom")

    started = time.monotonic()
    with pytest.raises(TransferError, match="boom"):
        nccl.form_communicator(rv.join, 0, timeout_s=30, rescue=True, interrupt=interrupt)
    assert time.monotonic() - started < 2
    assert wait_until(lambda: nccl.abandoned_inits() == 0, 2)


def test_an_init_that_formed_is_returned_and_one_that_failed_is_reported() -> None:
    rv = Rendezvous()
    peer = threading.Thread(target=rv.join, args=(1,))
    peer.start()
    comm = nccl.form_communicator(rv.join, 0, timeout_s=5, rescue=True)
    peer.join()
    assert isinstance(comm, FakeComm) and not comm.aborted

    def broken(rank: int):
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE")

    with pytest.raises(TransferError, match="init failed: NCCL_ERROR_INVALID_USAGE"):
        nccl.form_communicator(broken, 0, timeout_s=5, rescue=True)
    assert nccl.abandoned_inits() == 0


def test_unique_ids_travel_as_byte_lists_for_either_cupy() -> None:
    uid = [0, 1, 127, 128, 255] + [7] * 123
    assert nccl.comm_id(uid, cupy_major=14) == bytes(uid)
    assert nccl.comm_id(uid, cupy_major=13)[:5] == (0, 1, 127, -128, -1)  # signed chars
    signed = list(nccl.comm_id(uid, cupy_major=13))  # what a cupy 13 sender announces
    assert nccl.comm_id(signed, cupy_major=14) == bytes(uid)
    assert nccl.check_uid(uid) is uid
    for bad in (uid[:-1], [*uid[:-1], 256], [*uid[:-1], True], "x" * 128, None):
        with pytest.raises(TransferError):
            nccl.check_uid(bad)
