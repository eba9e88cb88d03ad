"""asyncio helpers every tandem process uses (the router, the controller, the workers).

``within(awaitable, timeout_s)`` is ``asyncio.wait_for`` without its cancellation race. Before
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
    # 3.10 has no asyncio.timeout: wait_for, with the race above (rare, and fixed upstream)
    return await asyncio.wait_for(awaitable, timeout_s)
