"""The KV transport's backends by name, and the prefill side's channel pool.

``RECEIVERS`` / ``SENDERS`` map a backend name (``tcp``, ``nccl``, ``inproc``: the first part of
an endpoint) to its classes; the NCCL ones are imported only when asked for (they need cupy and a
GPU). ``make_receiver`` builds a decode worker's receiver; ``KVConnector`` keeps a prefill (or
migrating decode) worker's senders, one per endpoint. This module sits above both
``transport`` (the contract and the tcp / inproc backends) and ``nccl``, so neither imports the
other's way back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.kv_transfer.transport import (
    InProcessKVReceiver,
    KVLimits,
    KVReceiver,
    KVSender,
    KVSpec,
    TcpKVReceiver,
    TcpKVSender,
    TransferEvent,
    split_endpoint,
)


def _nccl_receiver() -> type[KVReceiver]:
    from engine.kv_transfer.nccl import NcclKVReceiver

    return NcclKVReceiver


def _nccl_sender() -> type[KVSender]:
    from engine.kv_transfer.nccl import NcclKVSender

    return NcclKVSender


# The backends by name: creators import lazily (the NCCL one needs cupy and a GPU).
RECEIVERS: dict[str, Callable[[], type[KVReceiver]]] = {
    "tcp": lambda: TcpKVReceiver,
    "nccl": _nccl_receiver,
    "inproc": lambda: InProcessKVReceiver,
}
SENDERS: dict[str, Callable[[], type[KVSender]]] = {
    "tcp": lambda: TcpKVSender,
    "nccl": _nccl_sender,
    "inproc": lambda: KVSender,
}


def make_receiver(
    backend: str,
    spec: KVSpec,
    kv_caches: Sequence[torch.Tensor],
    block_size: int,
    on_event: Callable[[TransferEvent], None],
    *,
    token: str = "",
    host: str = "127.0.0.1",
    limits: KVLimits | None = None,
) -> KVReceiver:
    if backend not in RECEIVERS:
        raise ValueError(f"kv transport must be one of {sorted(RECEIVERS)}, got {backend!r}")
    kwargs: dict[str, Any] = {"token": token, "limits": limits}
    if backend != "inproc":
        kwargs["host"] = host
    return RECEIVERS[backend]()(spec, kv_caches, block_size, on_event, **kwargs)


class KVConnector:
    """The prefill worker's senders, one per decode endpoint, made lazily. At most
    ``max_channels`` stay open (each NCCL one holds GPU memory): past that the least recently
    used idle channel is closed. A broken channel is dropped so the next request reopens it.
    Each sender is bounded by ``limits`` (its queue by ``max_pending_bytes``)."""

    def __init__(
        self,
        spec: KVSpec,
        on_failure: Callable[[list[str], str], None],
        *,
        token: str = "",
        max_channels: int = 8,
        limits: KVLimits | None = None,
    ) -> None:
        self.spec, self.on_failure, self.token = spec, on_failure, token
        self.max_channels = max_channels
        self.limits = limits or KVLimits()
        self._senders: OrderedDict[str, KVSender] = OrderedDict()

    def sender(self, endpoint: str) -> KVSender:
        sender = self._senders.get(endpoint)
        if sender is not None and sender.error is None:
            self._senders.move_to_end(endpoint)
            return sender
        backend, _, _ = split_endpoint(endpoint)
        sender = SENDERS[backend]()(
            endpoint, self.spec, self.on_failure, self.token, limits=self.limits
        )
        self._senders[endpoint] = sender
        self._evict()
        return sender

    def connect(self, endpoints: list[str]) -> list[KVSender]:
        """Open channels to these endpoints now (each forms in its own thread), up to
        ``max_channels``, so no request waits for one to form; ``formed`` is set on each when it
        is up or has failed. Channels already open are kept."""
        return [self.sender(ep) for ep in list(dict.fromkeys(endpoints))[: self.max_channels]]

    def drain_timings(self) -> list[tuple[float, ...]]:
        """Per layer message sent since the last call, over every channel that times its sends
        (NCCL: (bytes, ms from the layer's pack to the send's start, ms of the send))."""
        return [
            t for s in self._senders.values() if hasattr(s, "timings") for t in s.timings.drain()
        ]

    def _evict(self) -> None:
        for endpoint in list(self._senders):
            if len(self._senders) <= self.max_channels:
                return
            old = self._senders[endpoint]
            if old.num_open == 0:
                del self._senders[endpoint]
                old.close()

    @property
    def num_channels(self) -> int:
        return len(self._senders)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self._senders.values())

    @property
    def pending_bytes(self) -> int:
        return sum(s.pending_bytes for s in self._senders.values())

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
