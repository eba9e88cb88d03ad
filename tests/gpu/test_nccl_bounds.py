"""The NCCL backend's bounds on real GPUs (run on the GPU machine; skipped otherwise)::

    python -m pytest -q tests/gpu/test_nccl_bounds.py     # 1 GPU: the init deadlines; 2 GPUs: all

- the sender's init deadline: a receiver that answers hello but never joins NCCL fails the
  transfer within ``nccl_init_timeout_s``, and the given-up init is rescued (the sender joins
  the missing rank itself): no nccl-init or nccl-rescue thread is left, none counted
- the receiver's init deadline: a sender that announces an id but never joins gets the failure
  on the channel and the pair's thread ends; the given-up init returns once a rank 0 joins
- (2 GPUs) a pair moves KV exactly, and the sender's pending bytes fall to 0 once its sends
  are done on the GPU
- (2 GPUs) the watchdog: a send nobody receives aborts the sender's communicator after
  ``nccl_watchdog_s`` and fails its transfer; a recv whose send never comes makes the receiver
  drop the pair and fail its transfer
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch
from test_kv_transport import Events, Failures

from engine.kv_transfer import nccl as kv_nccl
from engine.kv_transfer.backends import KVConnector
from engine.kv_transfer.transport import KVLimits, KVSpec, read_header, write_frame

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
cupy = pytest.importorskip("cupy")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

BLOCK = 4
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=BLOCK)
BIG = KVSpec(1, 8, 1024, "float32", block_size=BLOCK)  # 64 KiB a token
TOKEN = "secret"


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def init_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("nccl-init", "nccl-rescue")]


def caches(spec: KVSpec, device: str, slots: int = 64) -> list[torch.Tensor]:
    shape = (2, spec.num_kv_heads, slots, spec.head_dim)
    return [torch.zeros(shape, device=device) for _ in range(spec.num_layers)]


def source(n: int, layer: int) -> torch.Tensor:
    x = torch.arange(2 * SPEC.num_kv_heads * n * SPEC.head_dim, dtype=torch.float32)
    return x.view(2, SPEC.num_kv_heads, n, SPEC.head_dim) + 1000 * layer


def hello(spec: KVSpec) -> dict:
    return {"kind": "hello", "backend": "nccl", "spec": spec.as_dict(), "token": TOKEN}


def fake_receiver(spec: KVSpec, join_on: str | None):
    """A receiver that answers hello and reads the id, then joins NCCL as rank 1 on ``join_on``
    and reads headers without ever posting a recv (or, with None, never joins)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list = [server]

    def run() -> None:
        conn, _ = server.accept()
        held.append(conn)
        read_header(conn)
        write_frame(conn, {"kind": "ready"})
        uid = read_header(conn)["nccl_id"]
        if join_on is None:
            return
        held.append(kv_nccl.join_nccl(uid, 1, torch.device(join_on), 60))
        while True:
            try:
                read_header(conn, idle_ok=True)
            except Exception:  # noqa: BLE001 - the sender went away
                return

    threading.Thread(target=run, daemon=True).start()
    return f"nccl://127.0.0.1:{server.getsockname()[1]}", held


def close_all(held: list) -> None:
    for x in held:
        if isinstance(x, socket.socket):
            x.close()
        else:
            x.abort()


@pytest.fixture(autouse=True)
def no_init_left_behind():
    yield
    assert wait_until(lambda: not init_threads() and kv_nccl.abandoned_inits() == 0, 120)


def test_the_sender_gives_up_an_init_nobody_joins_and_leaves_no_thread() -> None:
    endpoint, held = fake_receiver(SPEC, join_on=None)
    failures = Failures()
    conn = KVConnector(SPEC, failures, token=TOKEN, limits=KVLimits(nccl_init_timeout_s=2))
    try:
        started = time.monotonic()
        conn.sender(endpoint).send_layer(0, [("a", 0, 4)], source(4, 0).cuda())
        assert failures.event.wait(60)
        tids, reason = failures.calls[0]
        assert tids == ["a"] and "not formed in 2 s" in reason
        assert time.monotonic() - started < 30
        # The given-up init is rescued: the fixture checks that no init thread is left.
    finally:
        conn.close()
        close_all(held)


def test_the_receiver_gives_up_an_init_the_sender_never_joins() -> None:
    from engine.kv_transfer.nccl import NcclKVReceiver

    rx = NcclKVReceiver(
        SPEC, caches(SPEC, "cuda:0"), BLOCK, Events(timeout_s=60.0), token=TOKEN,
        limits=KVLimits(nccl_init_timeout_s=2),
    )  # fmt: skip
    try:
        host, port = rx.endpoint.split("://")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            write_frame(s, hello(SPEC))
            assert read_header(s)["kind"] == "ready"
            uid = list(cupy.cuda.nccl.get_unique_id())  # the bootstrap root: this process
            write_frame(s, {"kind": "nccl", "nccl_id": uid})
            s.settimeout(60)
            reply = read_header(s)
            assert reply["kind"] == "error" and "not formed in 2 s" in reply["message"]
            assert s.recv(1) == b""  # the receiver dropped the pair
        assert wait_until(lambda: rx.num_pairs == 0, 5)
        assert kv_nccl.abandoned_inits() == 1  # its init still waits for a rank 0

        def late_rank0() -> None:
            with contextlib.suppress(Exception):  # two ranks on one GPU: an NCCL error
                kv_nccl.join_nccl(uid, 0, torch.device("cuda", 0), 30).abort()

        threading.Thread(target=late_rank0, daemon=True).start()
        # ... and the fixture checks that it returned.
    finally:
        rx.close()


@two_gpus
def test_a_pair_moves_kv_and_its_pending_bytes_drain() -> None:
    from engine.kv_transfer.nccl import NcclKVReceiver

    events, failures, kv = Events(timeout_s=60.0), Failures(), caches(SPEC, "cuda:1")
    rx = NcclKVReceiver(SPEC, kv, BLOCK, events, token=TOKEN)
    conn = KVConnector(SPEC, failures, token=TOKEN)
    try:
        table = [3, 1]
        rx.expect("a", table, 8)
        tx = conn.sender(rx.endpoint)
        for layer in range(SPEC.num_layers):
            tx.send_layer(layer, [("a", 0, 8)], source(8, layer).to("cuda:0"))
        tx.send_done("a", 8, {"token_id": 5})
        event = events.next()
        assert event.kind == "complete" and event.token["token_id"] == 5
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(8)]
        for layer in range(SPEC.num_layers):
            assert torch.equal(kv[layer][:, :, slots].cpu(), source(8, layer))
        assert wait_until(lambda: tx.pending_bytes == 0, 10)
        assert failures.calls == []
    finally:
        conn.close()
        rx.close()


@two_gpus
def test_the_watchdog_aborts_a_send_nobody_receives() -> None:
    endpoint, held = fake_receiver(BIG, join_on="cuda:1")
    failures = Failures()
    conn = KVConnector(BIG, failures, token=TOKEN, limits=KVLimits(nccl_watchdog_s=1))
    try:
        tx = conn.sender(endpoint)
        # 1 GiB: past what NCCL's p2p buffers take in without a recv (64 MiB fit on 2 H200s)
        kv = torch.zeros(2, 8, 16384, 1024, device="cuda:0")
        tx.send_layer(0, [("a", 0, 16384)], kv)
        assert failures.event.wait(120)
        tids, reason = failures.calls[0]
        assert tids == ["a"] and "not progressed" in reason and "aborted" in reason
        tx._thread.join(30)
        assert not tx._thread.is_alive() and tx.pending_bytes == 0
    finally:
        conn.close()
        close_all(held)


@two_gpus
def test_the_receiver_drops_a_pair_whose_send_never_comes() -> None:
    from engine.kv_transfer.nccl import NcclKVReceiver

    events = Events(timeout_s=60.0)
    rx = NcclKVReceiver(
        SPEC, caches(SPEC, "cuda:1"), BLOCK, events, token=TOKEN,
        limits=KVLimits(nccl_watchdog_s=1),
    )  # fmt: skip
    comm = None
    try:
        rx.expect("a", [0, 1], 8)
        host, port = rx.endpoint.split("://")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            write_frame(s, hello(SPEC))
            assert read_header(s)["kind"] == "ready"
            uid = list(cupy.cuda.nccl.get_unique_id())
            write_frame(s, {"kind": "nccl", "nccl_id": uid})
            comm = kv_nccl.join_nccl(uid, 0, torch.device("cuda", 0), 60)
            layer = {"kind": "layer", "layer": 0, "entries": [["a", 0, 8]]}
            write_frame(s, {**layer, "nbytes": SPEC.payload_bytes(8)})  # and no send follows
            event = events.next()
            assert event.kind == "failed" and "not progressed" in event.reason
            s.settimeout(10)
            assert s.recv(1) == b""
        assert wait_until(lambda: rx.num_pairs == 0, 5)
    finally:
        if comm is not None:
            comm.abort()
        rx.close()
