"""The KV-transfer library: moving a prompt's KV from a prefill worker to a decode worker.

``transport``: the contract (KVSpec, KVSender / KVReceiver, TransferEvent and TransferOutcome,
the frame format, KVLimits: the caps and timeouts every channel keeps), the backend registry
(``RECEIVERS`` / ``SENDERS``, lazily imported) and the tcp / inproc backends; ``nccl``: the NCCL
backend (cupy: init deadline, per-pair watchdog); ``streamer``: the prefill side's layer
streamer (an engine step observer).
"""

from __future__ import annotations

from engine.kv_transfer.transport import (
    RECEIVERS,
    SENDERS,
    KVConnector,
    KVLimits,
    KVReceiver,
    KVSender,
    KVSpec,
    TransferError,
    TransferEvent,
    TransferOutcome,
    make_receiver,
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
    "make_receiver",
    "split_endpoint",
]
