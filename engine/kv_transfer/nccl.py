"""The NCCL backend of the KV transport (cupy's NCCL bindings; no NIXL).

Same pair channel as the TCP backend (engine/kv_transfer/transport.py): headers travel in order on the
TCP control socket, payloads over a 2-rank NCCL communicator made for that pair alone, so both
ends post matching send/recv calls in the same order. Per pair::

    1. after "ready" the sender makes a fresh ncclUniqueId (its process hosts the bootstrap
       root), starts joining as rank 0 and announces the id (``nccl`` message); the receiver
       joins as rank 1; then one byte goes from rank 0 to rank 1, which connects the pair (so
       no later send or recv waits for the peer in the host). Each side gives up after
       ``nccl_init_timeout_s`` (below)
    2. layer L: the prefill worker gathered L's token slots into one contiguous buffer on its
       compute stream (the pack: one index_select) and recorded an event. The pair's sender
       thread waits for that event, sends the header, and posts ncclSend on the pair's own
       CUDA stream; the compute stream is already on layer L + 1
    3. the receiver thread reads the header, posts ncclRecv into a staging buffer on its pair
       stream, and scatters it into the reserved blocks on the pair's unpack stream, behind
       that recv's end (index_copy_: the unpack); the next recv does not wait for it
    4. done: the receiver waits for both streams before reporting the transfer complete
    5. a broken control socket or an NCCL error aborts the communicator, so a dead peer never
       leaves a stream waiting forever; transfers on the pair fail on both sides

Bounds (``KVLimits``):

- Watchdog, one thread per pair end: every posted send/recv is tracked from before the call
  until its end event; an async NCCL error, or posted work that makes no progress (nothing of
  it completes) for ``nccl_watchdog_s``, aborts the communicator (ncclCommAbort: its kernels stop, the stream runs out) and breaks the channel,
  failing its transfers on both sides. On the sender, a send's bytes count against
  ``max_pending_bytes`` until it is done.
- Init deadline. cupy (13 and 14) makes communicators with a blocking ncclCommInitRank (14's
  NcclConfig carries split_share alone, not ncclConfig_t.blocking), so a non-blocking init
  that ncclCommAbort could stop is not available, and aborting a blocking init from another
  thread would free the communicator under it. Each init therefore runs in its own thread;
  the caller waits up to the deadline, watching the control socket, then gives the thread up:
  it aborts whatever its init returns. To make it return, the sender, whose process hosts
  the bootstrap root, joins as the missing rank 1 itself (``nccl-rescue``): the root then
  completes, and both inits end (two ranks on one GPU is an NCCL error; if a site allows it,
  the communicator formed is aborted). The receiver never does this (a second rank 0 could
  make the root quit before the real one is served); its given-up init returns once the
  sender joins or rescues, or (if it had not checked in yet) once the sender's process is
  gone (NCCL then stops retrying the root, in about a minute). Still unbounded, because cupy
  offers no abort for them: an init whose peer is alive but stopped (SIGSTOP), until the peer
  runs again; one whose peer's process died between their two bootstrap check-ins (the
  receiver's then waits for a root that no longer answers); a hang inside NCCL's own setup.
  Such threads are counted (``abandoned_inits``); while ``max_abandoned_inits`` exist this
  process refuses new NCCL pairs at once (a retryable failure).

Every send and receive is timed with CUDA events (``timings``): a send from its layer's pack to
its start and to its end, a receive from its start to its end. The benchmark divides bytes by
the receive times and compares them with a bare send/recv.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch

from engine.kv_transfer.transport import (
    TcpKVReceiver,
    TcpKVSender,
    TransferError,
    TransferEvent,
    TransferOutcome,
    layer_header,
    read_header,
    write_frame,
)
from engine.tracing import trace

logger = logging.getLogger(__name__)

_POLL_S = 50e-6
_WATCH_S = 0.001  # the watchdog's poll while work is posted (it releases the bytes sent)
_IDLE_S = 0.1  # and while none is (async errors only; a post wakes it at once)
_DRAIN_S = 5.0  # after an abort, how long a stream may take to run out
_ABORT_WAIT_S = 1.0  # how long an abort waits for a post in progress
_UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_UNPACKS_AHEAD = 2  # a receiver's unpacks queued and not done before its next recv waits
# When a layer's send is posted (an experiment, chosen by measurement: benchmarks/NOTES.md, "On
# 2 x H100"). "ready": once the layer's pack has run (the sender thread waits for its event), so
# the receiver's recv never waits for data; the send then reaches a GPU busy with the next
# layer's GEMMs and waits for one. "early": at once, with the pair stream waiting for the pack
# on the GPU, so the send starts at the layer's end; the receiver's recv is posted up to a
# layer early and occupies a few of its SMs until the data comes.
_POST = os.environ.get("TANDEM_KV_POST", "ready")
if _POST not in ("ready", "early"):
    raise ValueError(f"TANDEM_KV_POST must be 'ready' or 'early', got {_POST!r}")


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


def comm_id(uid: list[int], cupy_major: int | None = None):
    """The unique id as this cupy wants it: bytes from cupy 14, a tuple of signed chars
    before (what its get_unique_id returned)."""
    raw = bytes(b & 0xFF for b in uid)
    if cupy_major is None:
        import cupy

        cupy_major = int(cupy.__version__.split(".")[0])
    return raw if cupy_major >= 14 else tuple(b - 256 if b > 127 else b for b in raw)


def check_uid(uid) -> list[int]:
    if not (
        isinstance(uid, list)
        and len(uid) == _UID_BYTES
        and all(isinstance(b, int) and not isinstance(b, bool) and -128 <= b < 256 for b in uid)
    ):
        raise TransferError(f"nccl_id must be a list of {_UID_BYTES} byte values")
    return uid


def _abort_quietly(comm) -> None:
    with contextlib.suppress(Exception):
        comm.abort()


def join_nccl(uid: list[int], rank: int, device: torch.device, timeout_s: float):
    """ncclCommInitRank as ``rank`` of the pair on ``device`` (blocks until both ranks are
    in), then one byte from rank 0 to rank 1: a pair's first send/recv also connects it, a host
    call that waits for the peer, so it happens here, under the init deadline, and never in
    a channel's send. A failed init is aborted here: it holds its resources until
    ncclCommAbort."""
    nccl = _nccl()
    _use_device(device)
    comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
    try:
        comm.__init__(2, comm_id(uid), rank)
        _connect(comm, rank, device, timeout_s)
    except BaseException:
        _abort_quietly(comm)
        raise
    return comm


def _connect(comm, rank: int, device: torch.device, timeout_s: float) -> None:
    stream = torch.cuda.Stream(device)
    byte = torch.zeros(1, dtype=torch.uint8, device=device)
    with torch.cuda.stream(stream):
        if rank == 0:
            comm.send(byte.data_ptr(), 1, _uint8(), 1, stream.cuda_stream)
        else:
            comm.recv(byte.data_ptr(), 1, _uint8(), 0, stream.cuda_stream)
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise TransferError(f"NCCL pair not connected in {timeout_s:g} s")
        time.sleep(1e-3)


# -- communicator init with a deadline -------------------------------------------------------------


class _Joiner:
    """One blocking communicator init in its own thread, which can be given up on."""

    _lock = threading.Lock()
    _abandoned = 0  # joiners given up on whose init has not returned yet (this process)

    def __init__(self, join: Callable[[], Any], name: str) -> None:
        self._join = join
        self._done = threading.Event()
        self._given_up = False
        self.comm: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        comm = error = None
        try:
            comm = self._join()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            error = exc
        with _Joiner._lock:
            self.comm, self.error = comm, error
            self._done.set()
            given_up = self._given_up
            if given_up:
                _Joiner._abandoned -= 1
        if given_up and comm is not None:
            _abort_quietly(comm)

    def wait(self, timeout_s: float, interrupt: Callable[[], None]) -> Any:
        """The communicator, or TransferError past ``timeout_s`` or when ``interrupt`` (polled
        every 10 ms) raises it."""
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(0.01):
            interrupt()
            if time.monotonic() > deadline:
                raise TransferError(f"NCCL communicator not formed in {timeout_s:g} s")
        if self.error is not None:
            raise TransferError(f"NCCL init failed: {self.error}")
        return self.comm

    def give_up(self) -> bool:
        """Abort the communicator now if the init returned one, else when it does. True if the
        init is still running."""
        with _Joiner._lock:
            running = not self._done.is_set()
            if running:
                self._given_up = True
                _Joiner._abandoned += 1
            comm, self.comm = (None, None) if running else (self.comm, None)
        if comm is not None:
            _abort_quietly(comm)
        return running


def abandoned_inits() -> int:
    """Communicator inits given up on in this process whose thread has not returned yet."""
    with _Joiner._lock:
        return _Joiner._abandoned


def refuse_if_unwinding(max_abandoned: int) -> None:
    n = abandoned_inits()
    if n >= max_abandoned:
        raise TransferError(
            f"{n} NCCL inits given up on are still unwinding in this process; no new NCCL pair "
            "until one returns"
        )


def form_communicator(
    join: Callable[[int], Any],
    rank: int,
    *,
    timeout_s: float,
    rescue: bool,
    interrupt: Callable[[], None] = lambda: None,
    announce: Callable[[], None] = lambda: None,
) -> Any:
    """Join the pair's communicator as ``rank`` (``join(rank)`` blocks until both ranks are
    in) within ``timeout_s``; ``announce`` runs once the init has started, ``interrupt`` is
    polled and raises TransferError to give up sooner. On failure the init's thread is given
    up on; with ``rescue`` (only the side whose process hosts the bootstrap root) a second init
    joins as the other rank, so the root completes and the given-up init returns instead of
    waiting for a peer that will not come."""
    joiner = _Joiner(lambda: join(rank), "nccl-init")
    try:
        announce()
        return joiner.wait(timeout_s, interrupt)
    except BaseException:
        if joiner.give_up() and rescue:
            _Joiner(lambda: join(1 - rank), "nccl-rescue").give_up()
        raise


# -- one end of a pair: communicator, stream, watchdog ---------------------------------------------


class _Pair:
    """One end's communicator, its CUDA stream and its watchdog thread. The watchdog releases
    finished work (``on_complete(nbytes)``), and aborts the communicator once, reporting
    ``on_fault(reason)``, when NCCL reports an async error or posted sends/recvs make no
    progress for ``timeout_s`` (the oldest is not done that long after it was posted or after
    the one before it finished, whichever came later)."""

    def __init__(
        self,
        comm,
        stream: torch.cuda.Stream,
        timeout_s: float,
        on_fault: Callable[[str], None],
        on_complete: Callable[[int], None] = lambda nbytes: None,
        name: str = "nccl-watchdog",
        unpack: torch.cuda.Stream | None = None,
    ) -> None:
        self.comm, self.stream, self.timeout_s = comm, stream, timeout_s
        self.unpack = unpack  # the receiver's scatters, beside the recvs
        self.fault: str | None = None
        self._on_fault, self._on_complete = on_fault, on_complete
        self._work: deque[list] = deque()  # [posted at, end event or None, nbytes], oldest first
        self._progress = 0.0  # monotonic time work last completed
        self._lock = threading.Lock()  # _work and fault
        self._comm_lock = threading.Lock()  # every call on the communicator
        self._stop = threading.Event()
        self._posted = threading.Event()  # wakes an idle watchdog
        self.name = name
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    @property
    def posted(self) -> int:
        with self._lock:
            return len(self._work)

    def post(self, nbytes: int, post: Callable[[], torch.cuda.Event]) -> None:
        """Run ``post`` (it posts a send or recv on the stream and returns an event recorded
        after it), watched from before the call. Posting does not wait for the peer (the pair
        connected at init), so it holds the communicator's lock: an abort never frees the
        communicator under it."""
        entry: list = [time.monotonic(), None, nbytes]
        with self._comm_lock:
            with self._lock:
                if self.fault is not None:
                    raise TransferError(self.fault)
                self._work.append(entry)
            entry[1] = post()
        self._posted.set()

    def _watch(self) -> None:
        """Reap finished work every _WATCH_S while any is posted; idle, sleep until a post (or
        _IDLE_S, for async errors). An idle watchdog that slept its whole _IDLE_S after a post
        held that send's bytes as pending for up to 100 ms: a migration, which queues its next
        chunk once the channel has room, moved 4 GB at 9 GB/s instead of the link's rate."""
        while not self._stop.is_set():
            if self._work:
                self._stop.wait(_WATCH_S)
            else:
                self._posted.wait(_IDLE_S)
                self._posted.clear()
            if self._stop.is_set():
                return
            self._reap()
            reason = self._check()
            if reason is not None:
                self.abort(reason)
                return

    def _reap(self) -> None:
        freed = 0
        with self._lock:
            while self._work and self._work[0][1] is not None and self._work[0][1].query():
                freed += self._work.popleft()[2]
                self._progress = time.monotonic()
        if freed:
            self._on_complete(freed)

    def _check(self) -> str | None:
        with self._comm_lock:
            if self.fault is not None:
                return None
            try:
                self.comm.check_async_error()
            except Exception as exc:  # noqa: BLE001 - cupy raises NcclError
                return f"NCCL error: {exc}"
        with self._lock:
            since = max(self._work[0][0], self._progress) if self._work else None
        if since is not None and time.monotonic() - since > self.timeout_s:
            return f"posted NCCL work has not progressed for {self.timeout_s:g} s"
        return None

    def abort(self, reason: str) -> None:
        """Abort the communicator (its kernels stop, its calls fail) and report, once."""
        with self._lock:
            if self.fault is not None:
                return
            self.fault = f"{reason}: communicator aborted"
        self._stop.set()
        self._posted.set()
        trace("-", f"pair.abort.start:{self.name}")
        locked = self._comm_lock.acquire(timeout=_ABORT_WAIT_S)  # else a post is stuck in NCCL:
        try:  # aborting is then the only way to free it
            _abort_quietly(self.comm)
        finally:
            if locked:
                self._comm_lock.release()
        trace("-", f"pair.abort.done:{self.name}")
        logger.warning("NCCL pair: %s", self.fault)
        self._on_fault(self.fault)

    def quiesce(self, timeout_s: float) -> None:
        """Block until what is queued on the stream (and the unpack stream) so far has finished
        (the unpacks behind an aborted recv too: none may land after this returns); past
        ``timeout_s`` abort. TransferError if the communicator is (or gets) aborted."""
        event = torch.cuda.Event()
        if self.unpack is not None:  # after the unpacks queued so far and the recvs before them
            self.unpack.wait_stream(self.stream)
            event.record(self.unpack)
        else:
            event.record(self.stream)
        deadline = time.monotonic() + timeout_s
        drained_by = None
        sleep = _POLL_S
        while not event.query():
            now = time.monotonic()
            if self.fault is None and now > deadline:
                self.abort(f"NCCL transfer stuck for {timeout_s:g} s")
            if self.fault is not None:
                drained_by = drained_by or now + _DRAIN_S
                if now > drained_by:
                    raise TransferError(f"{self.fault} (its stream still busy {_DRAIN_S:g} s on)")
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)
        if self.fault is not None:
            raise TransferError(self.fault)

    def close(self, timeout_s: float) -> None:
        """Let queued work finish (up to ``timeout_s``, else abort), then destroy."""
        trace("-", f"pair.close.start:{self.name}")
        with contextlib.suppress(TransferError):
            self.quiesce(timeout_s)
        trace("-", f"pair.close.quiet:{self.name}")
        self._stop.set()
        self._posted.set()
        with self._lock:
            aborted, self.fault = self.fault is not None, self.fault or "pair closed"
        if not aborted:
            with self._comm_lock, contextlib.suppress(Exception):
                self.comm.destroy()
        trace("-", f"pair.close.done:{self.name}")


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

    def __init__(self, *args, **kwargs) -> None:
        self.timings = _Timings()
        self._pair: _Pair | None = None
        super().__init__(*args, **kwargs)

    def send_layer(self, layer, entries, kv) -> None:
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()  # on the caller's (compute) stream, right after the pack
        super().send_layer(layer, entries, (kv, ready))

    def _nbytes(self, kv) -> int:
        return super()._nbytes(kv[0])

    def _after_ready(self) -> None:
        """Make the communicator (rank 0) and announce its id; see the module docstring for
        the deadline and the rescue of a given-up init."""
        limits = self.limits
        refuse_if_unwinding(limits.max_abandoned_inits)  # before the id makes a bootstrap root
        device = self.device = torch.device("cuda", torch.cuda.current_device())
        stream = transfer_stream(device)
        uid = list(_nccl().get_unique_id())
        comm = form_communicator(
            lambda rank: join_nccl(uid, rank, device, limits.nccl_init_timeout_s),
            0,
            timeout_s=limits.nccl_init_timeout_s,
            rescue=True,
            announce=lambda: write_frame(self._sock, {"kind": "nccl", "nccl_id": uid}),
            interrupt=self._receiver_gave_up,
        )
        self._pair = _Pair(
            comm, stream, limits.nccl_watchdog_s, self.fault, self._release, "nccl-watch-send"
        )

    def _receiver_gave_up(self) -> None:
        """During init: the receiver writes nothing but its own failure (or closes)."""
        readable, _, _ = select.select([self._sock], [], [], 0)
        if readable:
            reply = read_header(self._sock)  # raises on EOF
            raise TransferError(f"receiver could not join NCCL: {reply.get('message')}")

    def _send(self, item) -> None:
        if item[0] != "layer":
            return super()._send(item)
        _, layer, entries, (kv, ready), nbytes = item
        early = _POST == "early"
        if not early:
            ready.synchronize()  # the header goes out when the data is there: the recv is not early
        trace(entries[0][0], f"send.layer{layer}")
        write_frame(self._sock, layer_header(layer, entries, kv, nbytes))
        trace(entries[0][0], f"send.header{layer}")
        pair = self._pair
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def post() -> torch.cuda.Event:
            with torch.cuda.stream(pair.stream):
                if early:
                    pair.stream.wait_event(ready)  # the pack, on the GPU: no host wait
                start.record()
                pair.comm.send(kv.data_ptr(), nbytes, _uint8(), 1, pair.stream.cuda_stream)
                end.record()
            return end

        pair.post(nbytes, post)
        trace(entries[0][0], f"send.posted{layer}")
        kv.record_stream(pair.stream)  # the allocator keeps it until the send has read it
        self.timings.add(nbytes, ready, start, end)  # (bytes, post lag ms, send ms)
        self.bytes_sent += nbytes

    def _sent(self, item) -> None:
        """The watchdog releases the layer's bytes once its send has completed."""

    def _broken(self, reason: str, first=None) -> None:
        """The channel failed (most often: the decode worker died mid-transfer). A send posted
        to a peer that is gone never completes and its kernel spins on this GPU: abort at once,
        not after the close's wait (5 s on 2 x H100 froze this worker's engine that long, and
        the GPU's other processes ran at a fraction; benchmarks/NOTES.md, the resume stall)."""
        pair = self._pair
        if pair is not None and pair.posted:
            pair.abort(reason)
        super()._broken(reason, first)

    def _disconnect(self) -> None:
        super()._disconnect()
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.close(min(5.0, self.limits.nccl_watchdog_s))


class NcclKVReceiver(TcpKVReceiver):
    backend = "nccl"

    def __init__(self, *args, **kwargs) -> None:
        self.timings = _Timings()
        self._pairs: dict[int, _Pair] = {}
        self._recv_end: dict[int, torch.cuda.Event] = {}  # per peer: its last recv's end
        self._unpacks: dict[int, deque] = {}  # per peer: [its recv's end, end of its unpacks]
        super().__init__(*args, **kwargs)
        self.device = self.kv_caches[0].device

    def _after_ready(self, peer: int, conn: socket.socket) -> None:
        """Join the communicator whose id the sender announces next, as rank 1, within the
        init deadline (failures go back to the sender, which is waiting for them)."""
        limits = self.limits
        conn.settimeout(limits.handshake_timeout_s)
        msg = read_header(conn)
        conn.settimeout(limits.io_timeout_s)
        if msg["kind"] != "nccl":
            raise TransferError(f"expected the NCCL unique id, got {msg['kind']!r}")
        uid = check_uid(msg.get("nccl_id"))
        refuse_if_unwinding(limits.max_abandoned_inits)
        device = self.device
        torch.cuda.set_device(device)
        comm = form_communicator(
            lambda rank: join_nccl(uid, rank, device, limits.nccl_init_timeout_s),
            1,
            timeout_s=limits.nccl_init_timeout_s,
            rescue=False,
            interrupt=lambda: _closed_by_peer(conn),
        )
        self._pairs[peer] = _Pair(
            comm,
            transfer_stream(device),
            limits.nccl_watchdog_s,
            lambda reason: self.break_pair(peer, reason),
            name=f"nccl-watch-recv-{peer}",
            unpack=transfer_stream(device),
        )

    def _read_payload(self, peer, conn, nbytes, entries, buf) -> torch.Tensor:
        pair = self._pairs[peer]
        self._bound_unpacks(peer)
        total = sum(n for _, _, n in entries)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(pair.stream):
            staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

        def post() -> torch.cuda.Event:
            with torch.cuda.stream(pair.stream):
                start.record()
                pair.comm.recv(staging.data_ptr(), nbytes, _uint8(), 0, pair.stream.cuda_stream)
                end.record()
            return end

        pair.post(nbytes, post)
        self._recv_end[peer] = end
        self.timings.add(nbytes, start, end)
        flat = staging.view(self.spec.torch_dtype)
        return flat.view(-1, self.spec.num_kv_heads, total, self.spec.head_dim)

    def handle_layer(self, peer, layer, entries, kv) -> None:
        """The unpack goes on the pair's unpack stream behind its recv's end, so the next recv
        is posted at once instead of queueing behind this scatter on the pair stream, where a
        sender's next message waited for the receiver's scatter (benchmarks/NOTES.md, live
        migration's copy on 2 x H100)."""
        stream = self._pairs[peer].unpack
        with torch.cuda.stream(stream):
            stream.wait_event(self._recv_end[peer])
            kv.record_stream(stream)  # the staging block is not reused before the scatter reads it
            super().handle_layer(peer, layer, entries, kv)
            done = torch.cuda.Event()
            done.record(stream)
        q = self._unpacks.setdefault(peer, deque())
        recv = self._recv_end[peer]
        if q and q[-1][0] is recv:  # another layer of the same message
            q[-1][1] = done
        else:
            q.append([recv, done])
        if layer in (0, 15, self.spec.num_layers - 1):
            trace(entries[0][0], f"recv.unpack_posted{layer}")

    def _bound_unpacks(self, peer: int) -> None:
        """Before a recv: wait while _UNPACKS_AHEAD messages' unpacks are still queued, so
        staging buffers (a message's bytes each) stay bounded when scatters run slower than
        recvs. An unpack waits only for its recv, which the watchdog bounds (aborted, the stream
        runs out)."""
        q = self._unpacks.setdefault(peer, deque())
        while q and q[0][1].query():
            q.popleft()
        while len(q) >= _UNPACKS_AHEAD:
            sleep = _POLL_S
            while not q[0][1].query():
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)
            q.popleft()

    def _before_done(self, peer: int) -> None:
        trace("-", "recv.done_header")
        self._pairs[peer].quiesce(self.limits.nccl_watchdog_s)
        trace("-", "recv.stream_quiet")

    def _after_quiet(self, event: TransferEvent) -> None:
        """A cancelled or failed transfer's blocks are freed once every pair stream has no
        write still queued (a late unpack must never land in a reused block)."""
        if event.kind is TransferOutcome.COMPLETE:
            self.on_event(event)  # _before_done already waited for its pair
            return
        pairs = list(self._pairs.values())

        def wait_then_emit() -> None:
            for pair in pairs:
                try:
                    pair.quiesce(self.limits.nccl_watchdog_s)
                except TransferError as exc:
                    logger.warning("while releasing %s: %s", event.transfer_id, exc)
            self.on_event(event)

        threading.Thread(target=wait_then_emit, name="kv-release", daemon=True).start()

    def _on_peer_closed(self, peer: int) -> None:
        self._recv_end.pop(peer, None)
        self._unpacks.pop(peer, None)
        pair = self._pairs.pop(peer, None)
        if pair is not None:  # a sender quiesces before it closes: what is still posted after
            pair.close(0.1)  # this long is a half-received message that never completes


def _closed_by_peer(conn: socket.socket) -> None:
    readable, _, _ = select.select([conn], [], [], 0)
    if readable and conn.recv(1, socket.MSG_PEEK) == b"":
        raise TransferError("the sender closed the channel during NCCL init")
