"""asyncio helpers every tandem process uses (the router, the controller, the workers).

``within(awaitable, timeout_s)`` is ``asyncio.wait_for`` without its cancellation race
(``asyncio.timeout`` on 3.11+, ``asyncio.wait`` on 3.10). Before
Python 3.12, ``wait_for`` returns the inner call's result when the call completes in the same
loop turn as the caller is cancelled, and the cancellation is lost (CPython gh-86296). A task
cancelled at that instant then runs on: the router's reader of a worker's output stream,
cancelled as its connection opened, went on to read that stream forever, and ``asyncio.run``
(or a shutdown that cancels and awaits its tasks) waited for it without end. Found by a test
that hung in CI about one run in five (tests/test_aio.py reproduces the race).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``await awaitable``, or ``TimeoutError`` after ``timeout_s`` seconds (None: no bound),
    the awaitable cancelled. A cancellation of the caller always propagates, whatever the
    awaitable did in the same loop turn."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await _within_by_wait(awaitable, timeout_s)  # 3.10 has no asyncio.timeout


async def _within_by_wait(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``within`` from ``asyncio.wait``, which never answers a cancellation of its caller with
    a result: the awaitable runs as a task of its own, cancelled (and waited for) when the
    caller is cancelled or the time is up."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})  # its cleanup runs before the caller goes on, as wait_for's
        raise TimeoutError
    return task.result()
