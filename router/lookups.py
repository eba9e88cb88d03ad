"""Prefix-index lookups of a burst in few round trips.

Every request's placement asks the global prefix index (engine/prefix_index.py, Redis) which
workers hold its prompt's leading blocks. One thread hop and one round trip per request is fine
at a steady rate, but a burst of a thousand requests makes a thousand of each, and the threads
that carry them fight the gateway's event loop for the GIL (measured on one H100, 1000
requests at once: the first hundred waited ~1 s between admission and placement).

``PrefixLookups.lookup`` queues a request's hashes and returns its answer. One lookup at a time
is in flight; every request that arrives while it runs joins the next one, sent as one pipeline
(``PrefixIndex.lookup_many``) from one thread. At a steady rate a batch is one request (the same
round trip as before); in a burst, the batch grows with the wait, so the number of round trips
stays about the burst's duration over one round trip. A failure (``IndexUnavailable``) reaches
every request of its batch, as it would have reached each alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


class PrefixLookups:
    def __init__(self, index: Any, max_batch: int = 256) -> None:
        self.index = index
        self.max_batch = max_batch
        self._queue: list[tuple[Sequence[bytes], asyncio.Future]] = []
        self._running = False
        self.batches = 0  # round trips made (for tests and stats)
        self.looked_up = 0  # prompts looked up

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, str]:
        """Which workers hold which leading blocks of ``hashes``, at which tier
        (``PrefixIndex.lookup``)."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((hashes, fut))
        if not self._running:
            self._running = True
            asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                self.batches += 1
                self.looked_up += len(batch)
                try:
                    answers = await asyncio.to_thread(
                        self.index.lookup_many, [hashes for hashes, _ in batch]
                    )
                except Exception as exc:  # noqa: BLE001 - every waiter of the batch gets it
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), answer in zip(batch, answers, strict=True):
                    if not fut.done():  # (its request may have been cancelled meanwhile)
                        fut.set_result(answer)
        finally:
            self._running = False
