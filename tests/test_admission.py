"""The router's admission queue (router/admission.py): slots, fcfs and sjf order, aging,
the bounded queue, early rejection by projected wait, and the projection itself."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.admission import Admission, PredictionQuality, QueueConfig, Ticket
from router.errors import CapacityError
from router.predictor import Prediction


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pred(n: float, tail: float = 2.0) -> Prediction:
    return Prediction({0.5: n, 0.9: n * tail, 0.99: n * tail * 2})


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def with_rates(adm: Admission, tokens_per_s: float = 10.0, first_token_s: float = 0.0) -> None:
    adm.rates.tokens_per_s, adm.rates.first_token_s = tokens_per_s, first_token_s


def test_fcfs_waits_for_a_slot_in_arrival_order() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs"), lambda: 2)
        a = await adm.acquire("a", pred(10), 100)
        b = await adm.acquire("b", pred(10), 100)
        waiting = [
            asyncio.ensure_future(adm.acquire(r, pred(n), 100)) for r, n in (("c", 50), ("d", 5))
        ]
        await settle()
        assert not any(w.done() for w in waiting)
        assert adm.stats()["queued"] == 2
        adm.release(a)
        await settle()
        assert waiting[0].done() and not waiting[1].done()  # c came first, though longer
        adm.release(b)
        await settle()
        assert waiting[1].done()
        assert adm.stats()["running"] == 2 and adm.stats()["queued"] == 0

    run(main())


def test_sjf_starts_the_shortest_prediction_first() -> None:
    async def main():
        adm = Admission(QueueConfig("sjf"), lambda: 1)
        first = await adm.acquire("first", pred(10), 1000)
        order: list[str] = []

        async def wait(rid, n):
            t = await adm.acquire(rid, pred(n) if n else None, 1000 if n else 300)
            order.append(rid)
            return t

        tasks = [
            asyncio.ensure_future(wait(r, n))
            for r, n in (("long", 500), ("short", 10), ("none", 0), ("medium", 100))
        ]
        await settle()
        held = first
        for _ in tasks:
            adm.release(held)
            await settle()
            held = next(
                t.result() for t in tasks if t.done() and t.result().request_id == order[-1]
            )
        # no prediction: ordered by its max_tokens (300)
        assert order == ["short", "medium", "none", "long"]

    run(main())


def test_sjf_aging_serves_a_request_past_its_deadline_first() -> None:
    async def main():
        clock = Clock()
        adm = Admission(QueueConfig("sjf", aging=2.0, max_wait_s=1000), lambda: 1, clock)
        with_rates(adm, tokens_per_s=10.0)
        running = await adm.acquire("running", pred(10), 100)  # 1 s of work left
        long = asyncio.ensure_future(adm.acquire("long", pred(400), 1000))
        await settle()
        (t_long,) = adm.queue
        # FCFS would start it when "running" ends: 1 s; aging 2: its deadline is 2 s out
        assert t_long.deadline == pytest.approx(clock.t + 2.0)
        clock.t += 2.5
        short = asyncio.ensure_future(adm.acquire("short", pred(5), 100))
        await settle()
        adm.release(running)
        await settle()
        assert long.done() and not short.done()
        assert adm.stats()["aged"] == 1

    run(main())


def test_a_full_queue_answers_429_with_retry_after() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs", max_queue=1), lambda: 1)
        await adm.acquire("a", pred(10), 100)
        queued = asyncio.ensure_future(adm.acquire("b", pred(10), 100))
        await settle()
        with pytest.raises(CapacityError) as err:
            await adm.acquire("c", pred(10), 100)
        assert err.value.status == 429 and err.value.retry_after_s > 0
        assert adm.stats()["rejected"]["queue_full"] == 1
        queued.cancel()

    run(main())


def test_early_rejection_by_projected_wait() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs", reject_wait_s=5.0), lambda: 1)
        # no rates yet: nothing to project, so nothing is refused
        held = await adm.acquire("a", pred(100), 200)
        queued = asyncio.ensure_future(adm.acquire("b", pred(100), 200))
        await settle()
        assert not queued.done()
        with_rates(adm, tokens_per_s=10.0)
        # a: 10 s left; b: 10 s more; c would start at 20 s, 15 s past the bound
        with pytest.raises(CapacityError) as err:
            await adm.acquire("c", pred(5), 200)
        assert err.value.retry_after_s == pytest.approx(15.0)
        assert adm.stats()["rejected"]["projected_wait"] == 1
        # a has produced 60 and goes on: its median given that (> 100) is what is left of it
        for produced in (60, 150):
            held.produced = produced
            left = (held.predicted.median_given(produced) - produced) / 10.0
            wait = adm.projected_wait(Ticket("x", pred(5), 100, 0.0, 5.0))
            assert wait == pytest.approx(left + 10.0)
        assert held.predicted.median_given(60) > 100
        queued.cancel()

    run(main())


def test_sjf_projection_counts_only_the_shorter_ones_ahead() -> None:
    async def main():
        adm = Admission(QueueConfig("sjf", reject_wait_s=5.0), lambda: 1)
        with_rates(adm, tokens_per_s=10.0)
        await adm.acquire("a", pred(20), 200)  # 2 s left
        long = asyncio.ensure_future(adm.acquire("long", pred(1000), 2000))
        await settle()
        # a short request goes ahead of the long one: 2 s, under the bound
        short = asyncio.ensure_future(adm.acquire("short", pred(10), 100))
        await settle()
        assert not short.done() and adm.stats()["queued"] == 2
        # under fcfs the same short request would have waited behind it (102 s): refused
        fcfs = Admission(QueueConfig("fcfs", reject_wait_s=5.0), lambda: 1)
        with_rates(fcfs, tokens_per_s=10.0)
        await fcfs.acquire("a", pred(20), 200)
        queued = asyncio.ensure_future(fcfs.acquire("long", pred(1000), 2000))
        await settle()
        with pytest.raises(CapacityError):
            await fcfs.acquire("short", pred(10), 100)
        for t in (long, short, queued):
            t.cancel()

    run(main())


def test_projection_is_list_scheduling_over_slots() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs"), lambda: 4)
        with_rates(adm, tokens_per_s=10.0, first_token_s=0.5)
        for rid, n in (("l", 1000), ("s1", 10), ("s2", 20), ("s3", 30)):
            t = await adm.acquire(rid, Prediction(dict.fromkeys((0.5, 0.9, 0.99), n)), n)
            adm.first_token(t)
        one = Ticket("x", pred(5), 10, 0.0, 5.0)
        # a slot frees when the shortest ends (1 s), not after the pool's average work
        assert adm.projected_wait(one) == pytest.approx(1.0)
        queued = [asyncio.ensure_future(adm.acquire(f"q{i}", pred(10), 10)) for i in range(2)]
        await settle()
        # q0 takes s1's slot at 1 s, q1 s2's at 2 s; the next free slot is q0's end or s3's (3 s)
        assert adm.projected_wait(one) == pytest.approx(2.5)  # q0: 1 + 0.5 + 10/10
        for q in queued:
            q.cancel()

    run(main())


def test_cancelled_waiter_leaves_the_queue_and_a_granted_one_gives_back_its_slot() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs"), lambda: 1)
        a = await adm.acquire("a", pred(10), 100)
        b = asyncio.ensure_future(adm.acquire("b", pred(10), 100))
        c = asyncio.ensure_future(adm.acquire("c", pred(10), 100))
        await settle()
        b.cancel()
        await settle()
        assert adm.stats()["queued"] == 1
        adm.release(a)
        c.cancel()  # granted and cancelled in the same turn: the slot must come back
        await settle()
        assert adm.stats()["running"] == 0 and adm.stats()["queued"] == 0
        adm.release(a)  # idempotent
        assert adm.stats()["running"] == 0

    run(main())


def test_remaining_follows_the_quantiles_as_tokens_arrive() -> None:
    pred_ = Prediction({0.5: 100.0, 0.9: 300.0, 0.99: 800.0})
    t = Ticket("r", pred_, 1000, 0.0, 100.0)
    assert t.remaining() == pytest.approx(100)
    # Past the median, F(150) = 0.5 + 0.4 * log(1.5) / log(3); the conditional median is
    # F^-1((1 + F) / 2), interpolated in log length between the 50th and 90th percentiles.
    f = 0.5 + 0.4 * math.log(1.5) / math.log(3)
    expected = 100 * 3 ** (((1 + f) / 2 - 0.5) / 0.4)
    t.produced = 150
    assert t.remaining() == pytest.approx(expected - 150)
    # The longer it has run, the longer it is expected to run in all, never less than one more.
    totals = [pred_.median_given(k) for k in range(0, 800, 7)]
    assert all(b >= a for a, b in zip(totals, totals[1:], strict=False))
    assert all(tot > k for k, tot in zip(range(0, 800, 7), totals, strict=True))
    t.produced = 900
    assert t.remaining() == 100  # past them all: half again, capped by max_tokens
    no = Ticket("r", None, 64, 0.0, 64.0)
    no.produced = 10
    assert no.remaining() == 54


def test_rates_and_prediction_quality_from_finished_requests() -> None:
    async def main():
        clock = Clock()
        adm = Admission(QueueConfig("fcfs"), lambda: 4, clock)
        t = await adm.acquire("a", pred(10), 100)
        clock.t += 0.5
        adm.first_token(t)
        t.produced = 21
        clock.t += 2.0
        adm.release(t, actual=21)
        assert adm.rates.first_token_s == pytest.approx(0.5)
        assert adm.rates.tokens_per_s == pytest.approx(10.0)
        assert adm.quality.pairs[-1] == (10, 21)

    run(main())
    q = PredictionQuality()
    for i in range(30):
        q.observe(float(i), i + 1)
    assert q.tau() == pytest.approx(1.0)
    q2 = PredictionQuality()
    for i in range(30):
        q2.observe(float(i), 100 - i)
    assert q2.tau() == pytest.approx(-1.0)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        QueueConfig("lifo")
    with pytest.raises(ValueError):
        QueueConfig("sjf", aging=0.5)


def test_the_engine_s_refined_estimate_replaces_the_router_s() -> None:
    async def main():
        adm = Admission(QueueConfig("fcfs"), lambda: 2)
        t = await adm.acquire("a", pred(10), 100)
        adm.first_token(t)
        adm.refine(t, (40.0, 80.0, 400.0))  # the p99 is over max_tokens: capped
        assert t.predicted.quantiles == {0.5: 40.0, 0.9: 80.0, 0.99: 100.0}
        t.produced = 50
        # past the refined median: the median given 50, between its p50 and p90 (in log)
        assert 80 - 50 > t.remaining() > 0
        assert t.remaining() == pytest.approx(t.predicted.median_given(50) - 50)
        adm.release(t, actual=60)
        return adm

    adm = run(main())
    assert adm.quality.pairs[-1] == (10, 60)  # the router's, at admission
    assert adm.refined_quality.pairs[-1] == (40, 60)


def test_waiters_get_503_when_the_pool_has_no_slot_left() -> None:
    async def main():
        slots = [1]
        adm = Admission(QueueConfig("sjf"), lambda: slots[0])
        held = await adm.acquire("a", pred(10), 100)
        waiting = asyncio.ensure_future(adm.acquire("b", pred(10), 100))
        await settle()
        slots[0] = 0  # the worker died
        adm.kick()
        with pytest.raises(CapacityError) as err:
            await waiting
        assert err.value.status == 503 and adm.stats()["queued"] == 0
        adm.release(held)
        assert adm.stats()["running"] == 0

    run(main())


def test_sjf_deadlines_of_a_burst_queued_before_there_were_rates() -> None:
    """A fresh router under a burst: no rates, so the cap is every deadline at first; once
    rates are known each gets aging x what FCFS gives it (one pass in arrival order)."""

    async def main():
        clock = Clock()
        adm = Admission(QueueConfig("sjf", aging=2.0, max_wait_s=1000), lambda: 1, clock)
        held = await adm.acquire("held", pred(10), 100)
        tasks = [
            asyncio.ensure_future(adm.acquire(r, pred(n), 1000))
            for r, n in (("long", 400), ("short", 5), ("medium", 50))
        ]
        await settle()
        assert [q.deadline - clock.t for q in adm.queue] == [1000.0] * 3
        with_rates(adm, tokens_per_s=10.0)
        adm.kick()
        # FCFS would start long at 1 s (held's 10 tokens), short at 41 s, medium at 41.5 s
        assert [q.deadline - clock.t for q in adm.queue] == pytest.approx([2.0, 82.0, 83.0])
        clock.t += 2.5
        adm.release(held)
        await settle()
        assert [t.done() for t in tasks] == [True, False, False]  # long: past its deadline
        assert adm.stats()["aged"] == 1
        for t in tasks:
            t.cancel()

    run(main())


def test_buckets_count_at_inclusive_upper_edges() -> None:
    from engine.histogram import Buckets

    h = Buckets((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.pairs() == [(0.1, 2), (1.0, 2), (float("inf"), 1)]
    assert h.total == pytest.approx(8.65)


def test_sjf_deadlines_of_a_burst_are_the_fcfs_projection_in_linear_time(monkeypatch) -> None:
    """Each request queued under sjf gets ``aging`` x its FCFS-projected start as deadline.
    Projecting it over every running and queued request per arrival made a burst quadratic;
    the slots' heap after the queue is now kept between arrivals: the deadlines are exactly
    the full projection's, for about one ``remaining()`` per request."""
    calls = [0]
    remaining = Ticket.remaining

    def counted(ticket):
        calls[0] += 1
        return remaining(ticket)

    async def main():
        clock = Clock()
        adm = Admission(QueueConfig("sjf", aging=2.0, max_wait_s=1e6), lambda: 3, clock)
        with_rates(adm, tokens_per_s=10.0, first_token_s=0.5)
        for i, n in enumerate((40, 70, 100)):
            adm.first_token(await adm.acquire(f"r{i}", pred(n), 10 * n))
        monkeypatch.setattr(Ticket, "remaining", counted)
        waiting = [
            asyncio.ensure_future(adm.acquire(f"q{i}", pred(5 + (37 * i) % 90), 400))
            for i in range(60)
        ]
        await settle()
        burst_calls = calls[0]
        queued = list(adm.queue)
        assert len(queued) == 60
        for i, q in enumerate(queued):  # the full projection, request by request
            fcfs = adm._project(q, queued[:i])
            assert q.deadline == pytest.approx(clock.t + 2.0 * fcfs), i
        for w in waiting:
            w.cancel()
        return burst_calls

    burst_calls = run(main())
    assert burst_calls <= 2 * 60 + 3, f"{burst_calls} remaining() calls for a burst of 60"
