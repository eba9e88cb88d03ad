"""A burst's prefix-index lookups share round trips (router/lookups.py): requests that arrive
while one lookup is in flight go together in the next, each gets its own answer, and a failure
reaches every request of its batch. A stand-in index (the real one's ``lookup_many`` is checked
against Redis in tests/test_prefix_index.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.prefix_index import IndexUnavailable
from router.lookups import PrefixLookups


class SlowIndex:
    """``lookup_many`` answers each prompt with its own first hash (every block on device); the
    first call waits for ``release`` (so requests pile up behind it), ``fail`` makes the next
    call raise."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # prompts per round trip
        self.release = threading.Event()
        self.fail = False

    def lookup_many(self, batch):
        self.calls.append(len(batch))
        if len(self.calls) == 1:
            self.release.wait(5)
        if self.fail:
            raise IndexUnavailable("redis is down")
        return [{f"w-{hashes[0].hex()}": "0" * len(hashes)} for hashes in batch]


def _prompt(i: int) -> list[bytes]:
    return [bytes([i]) * 4] * (1 + i % 3)


def test_a_burst_shares_round_trips_and_each_gets_its_answer() -> None:
    index = SlowIndex()
    lookups = PrefixLookups(index)

    async def scenario():
        first = asyncio.ensure_future(lookups.lookup(_prompt(0)))
        await asyncio.sleep(0.05)  # in flight, holding the index
        rest = [asyncio.ensure_future(lookups.lookup(_prompt(i))) for i in range(1, 50)]
        await asyncio.sleep(0.05)
        index.release.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(scenario())
    assert index.calls == [1, 49]  # 50 requests, two round trips
    answers = [first, *rest]
    assert answers == [{f"w-{_prompt(i)[0].hex()}": "0" * len(_prompt(i))} for i in range(50)]
    assert lookups.batches == 2 and lookups.looked_up == 50


def test_a_steady_rate_is_one_lookup_per_request() -> None:
    index = SlowIndex()
    index.release.set()
    lookups = PrefixLookups(index)

    async def scenario():
        return [await lookups.lookup(_prompt(i)) for i in range(5)]

    assert len(asyncio.run(scenario())) == 5 and index.calls == [1] * 5


def test_a_failure_reaches_every_request_of_its_batch_and_the_next_batch_works() -> None:
    index = SlowIndex()
    lookups = PrefixLookups(index, max_batch=8)

    async def scenario():
        index.fail = True
        first = asyncio.ensure_future(lookups.lookup(_prompt(0)))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(lookups.lookup(_prompt(i))) for i in range(1, 4)]
        index.release.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        index.fail = False
        return results, await lookups.lookup(_prompt(5))

    results, after = asyncio.run(scenario())
    assert all(isinstance(r, IndexUnavailable) for r in results)
    assert after == {f"w-{_prompt(5)[0].hex()}": "0" * len(_prompt(5))}


@pytest.mark.parametrize("max_batch", [1, 16])
def test_batches_are_bounded(max_batch: int) -> None:
    index = SlowIndex()
    lookups = PrefixLookups(index, max_batch=max_batch)

    async def scenario():
        first = asyncio.ensure_future(lookups.lookup(_prompt(0)))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(lookups.lookup(_prompt(i))) for i in range(1, 40)]
        index.release.set()
        await asyncio.gather(first, *rest)

    asyncio.run(scenario())
    assert max(index.calls) <= max_batch and sum(index.calls) == 40
