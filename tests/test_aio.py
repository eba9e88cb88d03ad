"""engine/aio.py: a bounded await whose caller's cancellation is never lost.

The race: the awaited call completes, and in the same loop turn its caller is cancelled (the
router's stream reader, cancelled by a shutdown just as its connection opened). Before Python
3.12 ``asyncio.wait_for`` returned the call's result there and dropped the cancellation; the
reader then read its stream forever and the shutdown never ended."""

from __future__ import annotations

import asyncio
import sys

import pytest

from engine.aio import _within_by_wait, within
from engine.output_stream import read_stream


async def _cancelled_as_the_call_completes(bounded) -> str:
    """Cancel a task waiting in ``bounded(call, 10)`` in the loop turn its call completes;
    what the task did: "cancelled" or "returned"."""
    call = asyncio.get_running_loop().create_future()

    async def caller():
        return await bounded(call, 10.0)

    task = asyncio.ensure_future(caller())
    for _ in range(3):  # the task is waiting now
        await asyncio.sleep(0)
    call.set_result("done")  # the call's answer and the cancellation, in one turn
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "returned"


BOUNDED = [within, _within_by_wait]  # (the second is 3.10's; it runs on any version)


@pytest.mark.parametrize("bounded", BOUNDED, ids=["within", "by_wait"])
def test_a_cancellation_that_meets_the_answer_is_not_lost(bounded) -> None:
    assert asyncio.run(_cancelled_as_the_call_completes(bounded)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in asyncio.wait_for from 3.12")
def test_wait_for_loses_it_here() -> None:
    """The race is real on this Python: wait_for drops the cancellation (CPython gh-86296)."""
    assert asyncio.run(_cancelled_as_the_call_completes(asyncio.wait_for)) == "returned"


@pytest.mark.parametrize("bounded", BOUNDED, ids=["within", "by_wait"])
def test_within_bounds_and_passes_results(bounded) -> None:
    async def main():
        assert await bounded(asyncio.sleep(0, "x"), 5.0) == "x"
        assert await bounded(asyncio.sleep(0, "y"), None) == "y"
        cleaned = []

        async def slow():
            try:
                await asyncio.sleep(10)
            finally:
                cleaned.append(True)

        with pytest.raises(TimeoutError):
            await bounded(slow(), 0.01)
        assert cleaned == [True]  # the awaitable was cancelled and its cleanup ran first
        with pytest.raises(ValueError, match="boom"):
            await bounded(_raise(ValueError("boom")), 5.0)

    asyncio.run(main())


async def _raise(exc: Exception):
    raise exc


def test_a_stream_reader_cancelled_as_it_connects_ends() -> None:
    """The router's reader (engine/output_stream.py ``read_stream``) cancelled at every loop
    turn of its connection's opening: it always ends, cancelled. (With wait_for on 3.11 the
    cancellations a few turns in were lost and the reader read on.)"""

    async def main():
        async def serve(reader, writer):
            await reader.read()  # keep it open: a stream with nothing to say yet
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        read_on = []
        for turns in range(30):
            task = asyncio.ensure_future(_read_all(read_stream("127.0.0.1", port, "t", "c")))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await within(asyncio.shield(task), 2.0)
            except asyncio.CancelledError:
                continue
            except TimeoutError:
                task.cancel()  # a second cancellation ends it (its read is not shielded)
            read_on.append(turns)
        server.close()
        await server.wait_closed()
        return read_on

    assert asyncio.run(main()) == []


async def _read_all(stream) -> list:
    return [batch async for batch in stream]
