"""The controller's event log: a bounded ring of events with sequence numbers, long-polled.

Every worker state change, removal, scale (started, done, refused), autoscaler decision,
migration and policy change is one event; the operator's Watch and ``tandem events`` read it::

    add(type, **fields)      seq + 1 -> {"seq", "time", "type", **fields} appended (past
                             EVENTS_KEPT the oldest is dropped) -> every waiting poll wakes
    poll(since, timeout_s)   the kept events with seq > since, once there is one (or after
                             timeout_s, none); since None: none, only where the log is
                             (last_seq); missed: events after since the ring no longer keeps
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from engine.aio import within

EVENTS_KEPT = 4096  # the event log's length (older events are dropped; Watch says how many)


class EventLog:
    """The ring of events and its long poll (one asyncio loop: the controller actor's)."""

    def __init__(self, kept: int = EVENTS_KEPT) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=kept)
        self.last_seq = 0
        self._added = asyncio.Event()

    def add(self, type_: str, **fields: Any) -> None:
        """Append one event and wake the ``poll`` calls waiting for one."""
        self.last_seq += 1
        self._events.append({"seq": self.last_seq, "time": time.time(), "type": type_, **fields})
        self._added.set()
        self._added = asyncio.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The kept events, oldest first."""
        return iter(self._events)

    async def poll(self, since: int | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """The kept events with ``seq`` > ``since``, once there is one (or after
        ``timeout_s``, none); ``since`` None: none, only where the log is (``last_seq``).
        ``missed``: events after ``since`` that the log no longer keeps."""
        if since is None:
            return {"events": [], "last_seq": self.last_seq, "missed": 0}
        if self.last_seq <= since and timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._added.wait(), timeout_s)
        events = [e for e in self._events if e["seq"] > since]
        first = events[0]["seq"] if events else self.last_seq + 1
        return {"events": events, "last_seq": self.last_seq, "missed": max(0, first - since - 1)}
