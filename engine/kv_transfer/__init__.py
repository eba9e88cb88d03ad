"""The KV-transfer library: moving a prompt's KV from a prefill worker to a decode worker.

``transport``: the contract (KVSpec, KVSender / KVReceiver, TransferEvent and TransferOutcome,
the frame format, KVLimits: the caps and timeouts every channel keeps) and the tcp / inproc
backends; ``nccl``: the NCCL backend (cupy: init deadline, per-pair watchdog); ``backends``: the
registry by name (``RECEIVERS`` / ``SENDERS``, NCCL imported lazily), ``make_receiver`` and the
sender pool ``KVConnector``; ``streamer``: the prefill side's layer streamer (an engine step
observer). Imports point one way: backends and streamer > nccl > transport.
"""

from __future__ import annotations

from engine.kv_transfer.backends import RECEIVERS, SENDERS, KVConnector, make_receiver
from engine.kv_transfer.transport import (
    KVLimits,
    KVReceiver,
    KVSender,
    KVSpec,
    TransferError,
    TransferEvent,
    TransferOutcome,
    byte_view,
    split_endpoint,
)

__all__ = [
    "RECEIVERS",
    "SENDERS",
    "KVConnector",
    "KVLimits",
    "KVReceiver",
    "KVSender",
    "KVSpec",
    "TransferError",
    "TransferEvent",
    "TransferOutcome",
    "byte_view",
    "make_receiver",
    "split_endpoint",
]
