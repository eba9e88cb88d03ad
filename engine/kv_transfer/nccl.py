"""The NCCL backend of the KV transport (cupy's NCCL bindings; no NIXL).

Same pair channel as the TCP backend (engine/kv_transfer/transport.py): headers travel in order on the
TCP control socket, payloads over a 2-rank NCCL communicator made for that pair alone, so both
ends post matching send/recv calls in the same order. Per pair::

    1. hello carries a fresh ncclUniqueId (the decode worker's endpoint itself came through
       Ray); after "ready" both ends call ncclCommInitRank (sender rank 0, receiver rank 1)
    2. layer L: the prefill worker gathered L's token slots into one contiguous buffer on its
       compute stream (the pack: one index_select) and recorded an event. The pair's sender
       thread waits for that event, sends the header, and posts ncclSend on the pair's own
       CUDA stream; the compute stream is already on layer L + 1
    3. the receiver thread reads the header, posts ncclRecv into a staging buffer on its pair
       stream, and scatters it into the reserved blocks there (index_copy_: the unpack)
    4. done: the receiver waits for its pair stream (polling the event and ncclCommGetAsyncError,
       aborting the communicator after ``timeout_s``) before reporting the transfer complete
    5. a broken control socket or an NCCL error aborts the communicator, so a dead peer never
       leaves a stream waiting forever; transfers on the pair fail on both sides

Every send and receive is timed with CUDA events (``timings``): a send from its layer's pack to
its start and to its end, a receive from its start to its end. The benchmark divides bytes by
the receive times and compares them with a bare send/recv.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from itertools import pairwise

import torch

from engine.kv_transfer.transport import (
    TcpKVReceiver,
    TcpKVSender,
    TransferError,
    TransferEvent,
    TransferOutcome,
    read_header,
    write_frame,
)
from engine.tracing import trace

logger = logging.getLogger(__name__)

_POLL_S = 50e-6


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _use_device(device: torch.device) -> None:
    """cupy's current device is per thread: make it the tensors' device in this one."""
    import cupy

    cupy.cuda.Device(device.index or 0).use()


def _uint8() -> int:
    nccl = _nccl()
    return getattr(nccl, "NCCL_UINT8", nccl.NCCL_INT8)


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    """A pair's stream, at the highest priority: the block scheduler then gives the NCCL
    kernel SMs as soon as the prefill's GEMMs free any, instead of after every kernel queued
    before it (the compute thread runs layers ahead of the GPU, so that would defer each
    layer's send by about a layer's compute)."""
    return torch.cuda.Stream(device, priority=-100)  # clamped to the device's highest


def check_async_error(comm) -> None:
    """Raise TransferError (after aborting ``comm``) if NCCL reports an asynchronous error."""
    check = getattr(comm, "check_async_error", None)
    if check is None:
        return
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - cupy raises NcclError
        comm.abort()
        raise TransferError(f"NCCL error: {exc}") from None


def comm_id(uid: list[int]):
    """The unique id as this cupy wants it (bytes in cupy >= 13, a tuple of ints before)."""
    try:
        return bytes(b & 0xFF for b in uid)
    except TypeError:
        return tuple(uid)


def wait_stream(stream: torch.cuda.Stream, comm, timeout_s: float) -> None:
    """Block until ``stream`` has finished its queued work, checking the communicator for async
    errors; abort it (unsticking the stream) and raise TransferError after ``timeout_s``."""
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + timeout_s
    sleep = _POLL_S
    while not event.query():
        check_async_error(comm)
        if time.monotonic() > deadline:
            comm.abort()
            raise TransferError(f"NCCL transfer stuck for {timeout_s:.0f} s: communicator aborted")
        time.sleep(sleep)
        sleep = min(sleep * 2, 1e-3)


class _Timings:
    """(bytes, CUDA events...) per message; resolved lazily (no sync on the hot path) into
    (bytes, ms between the first two events, ms between the next two, ...)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit, self.items = limit, []

    def add(self, nbytes: int, *events: torch.cuda.Event) -> None:
        if len(self.items) < self.limit:
            self.items.append((nbytes, events))

    def drain(self) -> list[tuple[float, ...]]:
        """One tuple per finished message so far: (bytes, ms, ...)."""
        done, pending = [], []
        for n, events in self.items:
            if events[-1].query():
                done.append((n, *(a.elapsed_time(b) for a, b in pairwise(events))))
            else:
                pending.append((n, events))
        self.items = pending
        return done


class NcclKVSender(TcpKVSender):
    backend = "nccl"

    def __init__(self, *args, timeout_s: float = 60.0, **kwargs) -> None:
        self.timeout_s = timeout_s
        self.timings = _Timings()
        self._comm = None
        super().__init__(*args, **kwargs)

    def send_layer(self, layer, entries, kv) -> None:
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()  # on the caller's (compute) stream, right after the pack
        super().send_layer(layer, entries, (kv, ready))

    def _hello(self) -> dict:
        self._uid = _nccl().get_unique_id()
        return {**super()._hello(), "nccl_id": list(self._uid)}

    def _after_ready(self) -> None:
        """Join the communicator. ncclCommInitRank has no timeout and hangs if the receiver
        never joins, so it runs in a helper thread while this one watches the control socket
        (the receiver reports its own failure there) and a deadline."""
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = transfer_stream(self.device)
        result: dict = {}

        def init() -> None:
            try:
                _use_device(self.device)
                result["comm"] = _nccl().NcclCommunicator(2, self._uid, 0)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        joiner = threading.Thread(target=init, name="nccl-init", daemon=True)
        joiner.start()
        deadline = time.monotonic() + self.timeout_s
        while joiner.is_alive():
            joiner.join(0.01)
            readable, _, _ = select.select([self._sock], [], [], 0)
            if readable and joiner.is_alive():
                reply = read_header(self._sock)  # raises on EOF
                raise TransferError(f"receiver could not join NCCL: {reply.get('message')}")
            if time.monotonic() > deadline:
                raise TransferError(f"NCCL communicator not formed in {self.timeout_s:.0f} s")
        if "error" in result:
            raise TransferError(f"NCCL init failed: {result['error']}")
        self._comm = result["comm"]

    def _send(self, item) -> None:
        if item[0] != "layer":
            return super()._send(item)
        _, layer, entries, (kv, ready) = item
        ready.synchronize()  # the header goes out when the data is there: the recv is not early
        trace(entries[0][0], f"send.layer{layer}")
        nbytes = kv.numel() * kv.element_size()
        header = {"kind": "layer", "layer": layer, "entries": [list(e) for e in entries]}
        write_frame(self._sock, {**header, "nbytes": nbytes})
        trace(entries[0][0], f"send.header{layer}")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            self._comm.send(kv.data_ptr(), nbytes, _uint8(), 1, self._stream.cuda_stream)
            end.record()
        trace(entries[0][0], f"send.posted{layer}")
        kv.record_stream(self._stream)  # the allocator keeps it until the send has read it
        self.timings.add(nbytes, ready, start, end)  # (bytes, post lag ms, send ms)
        self.bytes_sent += nbytes
        check_async_error(self._comm)

    def _fail_items(self, items, reason: str) -> None:
        plain = []
        for item in items:
            if isinstance(item, tuple) and item[0] == "layer":
                item = item[:3] + (item[3][0],)  # (kv, ready event) -> kv
            plain.append(item)
        super()._fail_items(plain, reason)

    def _disconnect(self) -> None:
        super()._disconnect()
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                wait_stream(self._stream, comm, 5.0)
                comm.destroy()
            except TransferError:
                pass  # already aborted by wait_stream


class NcclKVReceiver(TcpKVReceiver):
    backend = "nccl"

    def __init__(self, *args, timeout_s: float = 60.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s
        self.timings = _Timings()
        self.device = self.kv_caches[0].device
        self._pairs: dict[int, tuple[object, torch.cuda.Stream]] = {}

    def _check_hello(self, hello: dict) -> None:
        super()._check_hello(hello)
        uid = hello.get("nccl_id")
        if not isinstance(uid, list) or not all(
            isinstance(b, int) and -128 <= b < 256 for b in uid
        ):
            raise TransferError("hello needs an nccl_id list of integers")

    def _after_ready(self, peer: int, hello: dict) -> None:
        try:
            _use_device(self.device)
            torch.cuda.set_device(self.device)
            comm = _nccl().NcclCommunicator(2, comm_id(hello["nccl_id"]), 1)
        except Exception as exc:  # noqa: BLE001 - reported to the sender, whose init would hang
            raise TransferError(f"NCCL init failed: {exc}") from None
        self._pairs[peer] = (comm, transfer_stream(self.device))

    def _read_payload(self, peer, conn, nbytes, entries, buf) -> torch.Tensor:
        comm, stream = self._pairs[peer]
        total = sum(n for _, _, n in entries)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            start.record()
            comm.recv(staging.data_ptr(), nbytes, _uint8(), 0, stream.cuda_stream)
            end.record()
        self.timings.add(nbytes, start, end)
        flat = staging.view(self.spec.torch_dtype)
        return flat.view(2, self.spec.num_kv_heads, total, self.spec.head_dim)

    def handle_layer(self, peer, layer, entries, kv) -> None:
        with torch.cuda.stream(self._pairs[peer][1]):
            super().handle_layer(peer, layer, entries, kv)  # the unpack, on the pair stream
        if layer in (0, 15, self.spec.num_layers - 1):
            trace(entries[0][0], f"recv.unpack_posted{layer}")

    def _before_done(self, peer: int) -> None:
        comm, stream = self._pairs[peer]
        trace("-", "recv.done_header")
        wait_stream(stream, comm, self.timeout_s)
        trace("-", "recv.stream_quiet")

    def _after_quiet(self, event: TransferEvent) -> None:
        """A cancelled or failed transfer's blocks are freed once every pair stream has no
        write still queued (a late unpack must never land in a reused block)."""
        if event.kind is TransferOutcome.COMPLETE:
            self.on_event(event)  # _before_done already waited for its pair
            return
        pairs = list(self._pairs.values())

        def wait_then_emit() -> None:
            for comm, stream in pairs:
                try:
                    wait_stream(stream, comm, self.timeout_s)
                except TransferError as exc:
                    logger.warning("while releasing %s: %s", event.transfer_id, exc)
            self.on_event(event)

        threading.Thread(target=wait_then_emit, name="kv-release", daemon=True).start()

    def _on_peer_closed(self, peer: int) -> None:
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            comm, stream = pair
            try:
                wait_stream(stream, comm, 1.0)  # a half-received message never completes
                comm.destroy()
            except TransferError:
                pass  # aborted: the stream is released
