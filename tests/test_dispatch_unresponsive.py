"""A call into a worker the router has given up on must not hold a request: a reservation on
a hung decode worker moves to another as soon as the router suspects it, a colocated start on
a hung worker fails retryably, and a prefill on a hung prefill worker fails. Stand-in handles
(no Ray): a hung worker's calls never answer, as a SIGSTOPped process's do not. The
end-to-end run with a SIGSTOPped process is benchmarks/chaos.py's hang-decode scenario and
tests/test_disagg_cluster.py's hung prefill worker."""

from __future__ import annotations

import asyncio

import pytest

from engine.messages import Full, Membership, Rejected, Reserved, WorkerInfo
from engine.sampling_params import SamplingParams
from router.dispatch import Dispatcher, _Retry
from router.membership import MembershipView


class Method:
    def __init__(self, owner: Handle, name: str, answer) -> None:
        self.owner, self.name, self.answer = owner, name, answer

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        self.owner.calls.append((self.name, args))
        answer = asyncio.get_running_loop().create_future()
        if not self.owner.hung:  # a hung worker's never answers
            value = self.answer(*args, **kwargs)
            asyncio.get_running_loop().call_later(self.owner.delay_s, answer.set_result, value)
        return answer


class _Silent:
    """An output stream that delivers nothing (the tests end before it would matter)."""

    def options(self, **_):
        return self

    def remote(self, *_):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()


class Handle:
    def __init__(self, name: str, hung: bool = False) -> None:
        self.name, self.hung = name, hung
        self.delay_s = 0.0  # how long each call takes to answer
        self.calls: list[tuple[str, tuple]] = []
        self.reserve_many = Method(self, "reserve_many", self._reserve_all)
        self.generate_many = Method(self, "generate_many", self._start_all)
        self.prefill = Method(self, "prefill", lambda *a, **k: "prefilled")
        self.release_many = Method(self, "release_many", lambda ids: [None] * len(ids))
        self.abort = Method(self, "abort", lambda *a: None)
        self.fail_transfer = Method(self, "fail_transfer", lambda *a: None)
        self.outputs = _Silent()

    def _start_all(self, items, client):
        """Bad input (an empty prompt) is refused; everything else queued."""
        return [("invalid", "prompt is empty") if not ids else None for _, ids, *_ in items]

    def _reserve_all(self, items, client):
        """Room for everything but an empty prompt (Rejected) and one of ``full`` (Full)."""
        out = []
        for rid, ids, *_ in items:
            if not ids:
                out.append(Rejected("prompt is empty"))
            else:
                out.append(Full() if rid in self.full else Reserved(f"ep-{self.name}"))
        return out

    full: set = frozenset()

    def called(self, method: str) -> list:
        """The request id of each call of ``method`` (its first argument), a batched call's
        (``reserve_many``...) each of its items' (``called("reserve")`` names those)."""
        batched = {"reserve": "reserve_many", "release": "release_many"}
        if method in batched:
            ids = []
            for m, args in self.calls:
                if m == batched[method]:
                    ids += [item[0] if isinstance(item, tuple) else item for item in args[0]]
            return ids
        return [args[0] for m, args in self.calls if m == method]


def _view(*infos: tuple[str, str, bool]) -> MembershipView:
    workers = [
        WorkerInfo(name, role, Handle(name, hung), endpoint=f"ep-{name}")
        for name, role, hung in infos
    ]
    return MembershipView(Membership(1, workers, model_dir="", block_size=4, max_model_len=64))


def _dispatcher(view: MembershipView) -> Dispatcher:
    return Dispatcher(view, tokenizer=None, client_id="test", stall_timeout_s=0.4)


def _suspect_soon(view: MembershipView, name: str, after_s: float = 0.05) -> None:
    """What the health poller or the stream watchdog does when a worker goes silent."""
    asyncio.get_running_loop().call_later(after_s, view.suspect, name, "stats", "test")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_reservation_on_a_hung_decode_worker_moves_on_when_it_is_suspected() -> None:
    view = _view(
        ("prefill-0", "prefill", False), ("decode-0", "decode", True), ("decode-1", "decode", False)
    )
    p, d0, d1 = view.get("prefill-0"), view.get("decode-0"), view.get("decode-1")
    dispatcher = _dispatcher(view)

    async def scenario():
        _suspect_soon(view, "decode-0")
        params = SamplingParams(max_tokens=4)
        _, placed, irid = await dispatcher._start_disagg("r", [1, 2, 3], params, {}, p, d0, None)
        await asyncio.sleep(0)  # the prefill watcher's first look
        await dispatcher.aclose()
        return placed, irid

    placed, irid = _run(scenario())
    assert placed is d1 and irid == "r~r"
    assert d0.handle.called("abort") == ["r"]  # in case it wakes up holding blocks
    assert p.handle.called("abort") == ["r"]  # the gated prefill for decode-0 dropped
    assert d1.handle.called("reserve") == ["r~r"] and p.handle.called("prefill") == ["r", "r~r"]


def test_a_reservation_waits_for_a_slow_worker_the_router_still_trusts() -> None:
    """The other side: no suspicion, no giving up (a slow answer is still an answer)."""
    view = _view(("prefill-0", "prefill", False), ("decode-0", "decode", False))
    p, d0 = view.get("prefill-0"), view.get("decode-0")
    d0.handle.delay_s = 0.3  # several of the dispatcher's watch intervals (0.1 s here)
    dispatcher = _dispatcher(view)

    async def scenario():
        params = SamplingParams()
        _, placed, irid = await dispatcher._start_disagg("r", [1, 2], params, {}, p, d0, None)
        await asyncio.sleep(0.01)  # the release goes on the next loop turn (batched)
        await dispatcher.aclose()
        return placed, irid

    placed, irid = _run(scenario())
    assert placed is d0 and irid == "r"
    assert d0.handle.called("abort") == [] and p.handle.called("release") == ["r"]


def test_a_colocated_start_on_a_hung_worker_fails_retryably() -> None:
    view = _view(("worker-0", "colocated", True))
    w = view.get("worker-0")
    dispatcher = _dispatcher(view)

    async def scenario():
        _suspect_soon(view, "worker-0")
        try:
            with pytest.raises(_Retry) as info:
                await dispatcher._start_colocated("r", [1, 2], SamplingParams(), {}, w)
        finally:
            await dispatcher.aclose()
        return info.value

    retry = _run(scenario())
    assert retry.reason == "stalled" and "unresponsive" in str(retry)


def test_a_prefill_on_a_hung_prefill_worker_fails_the_transfer() -> None:
    view = _view(("prefill-0", "prefill", True), ("decode-0", "decode", False))
    p, d = view.get("prefill-0"), view.get("decode-0")
    dispatcher = _dispatcher(view)
    timeline: dict = {}

    async def scenario():
        _suspect_soon(view, "prefill-0")
        pref = p.handle.prefill.remote("r", [1], SamplingParams(), d.endpoint)
        await dispatcher._watch_prefill(pref, p, d, "r", timeline)

    _run(scenario())
    assert p.handle.called("abort") == ["r"]
    ((_, args),) = [c for c in d.handle.calls if c[0] == "fail_transfer"]
    assert args == ("r", "prefill worker prefill-0 is unresponsive")
    assert "prefilled" in timeline


def test_colocated_starts_of_a_burst_share_actor_calls() -> None:
    """40 starts at once on one worker make one call the first loop turn and batch the rest,
    each start answered on its own: a bad prompt is a RequestError for that request alone."""
    from router.errors import RequestError

    view = _view(("worker-0", "colocated", False))
    w = view.get("worker-0")
    w.handle.delay_s = 0.02
    dispatcher = _dispatcher(view)

    async def one(i: int):
        ids = [] if i == 7 else [1, 2, i]
        try:
            await dispatcher._start_colocated(f"r{i}", ids, SamplingParams(), {}, w)
        except RequestError as exc:
            return str(exc)
        return None

    async def scenario():
        first = await asyncio.gather(*(one(i) for i in range(30)))
        more = [asyncio.ensure_future(one(i)) for i in range(30, 40)]
        answers = first + list(await asyncio.gather(*more))
        await dispatcher.aclose()
        return answers

    answers = _run(scenario())
    assert answers[7] == "prompt is empty" and answers.count(None) == 39
    calls = [args for name, args in w.handle.calls if name == "generate_many"]
    assert len(calls) == 2  # 30 together, then 10 together
    assert [len(items) for items, _ in calls] == [30, 10]
    assert [rid for items, _ in calls for rid, *_ in items] == [f"r{i}" for i in range(40)]


def test_a_burst_sends_each_full_batch_at_once_not_on_the_next_loop_turn() -> None:
    """The ``FLUSH``-th start queued for a worker is submitted inside ``add``: a burst's first
    requests reach the worker while the event loop is still taking in the rest (each of which
    runs before the next loop turn). What is left goes on the next turn; each start gets its
    own answer, in order."""
    from router.dispatch import _Batch

    view = _view(("worker-0", "colocated", False))
    w = view.get("worker-0")
    dispatcher = _dispatcher(view)
    n = 2 * _Batch.FLUSH + 6

    async def scenario():
        batch = dispatcher._batch(w, "generate_many", "test")
        futures, submitted = [], []
        for i in range(n):  # one loop turn: no await between the adds
            futures.append(batch.add((f"r{i}", [] if i == 3 else [1, i], SamplingParams(), {})))
            submitted.append(len(w.handle.calls))
        answers = await asyncio.gather(*futures)
        await dispatcher.aclose()
        return submitted, answers

    submitted, answers = _run(scenario())
    flush = _Batch.FLUSH
    assert submitted[flush - 2] == 0 and submitted[flush - 1] == 1  # sent by the FLUSH-th add
    assert submitted[2 * flush - 1] == 2 and submitted[-1] == 2  # the last 6: the next turn
    calls = [args for name, args in w.handle.calls if name == "generate_many"]
    assert [len(items) for items, _ in calls] == [flush, flush, 6]
    assert [rid for items, _ in calls for rid, *_ in items] == [f"r{i}" for i in range(n)]
    assert answers[3] == ("invalid", "prompt is empty") and answers.count(None) == n - 1


def test_a_batch_sent_at_once_to_a_dead_worker_fails_each_of_its_starts() -> None:
    from router.dispatch import _Batch

    view = _view(("worker-0", "colocated", False))
    w = view.get("worker-0")

    class Gone:
        def remote(self, *args):
            raise RuntimeError("actor died")

    w.handle.generate_many = Gone()
    dispatcher = _dispatcher(view)

    async def scenario():
        batch = dispatcher._batch(w, "generate_many", "test")
        futures = [batch.add((f"r{i}", [1], SamplingParams(), {})) for i in range(_Batch.FLUSH)]
        answers = await asyncio.gather(*futures, return_exceptions=True)
        await dispatcher.aclose()
        return answers

    answers = _run(scenario())
    assert [str(a) for a in answers] == ["actor died"] * _Batch.FLUSH


def test_a_batched_start_on_a_worker_that_dies_fails_each_retryably() -> None:
    view = _view(("worker-0", "colocated", False))
    w = view.get("worker-0")

    def dead(items, client):
        raise RuntimeError("actor died")

    w.handle.generate_many = Method(w.handle, "generate_many", dead)
    dispatcher = _dispatcher(view)

    async def one(i: int):
        with pytest.raises(_Retry) as info:
            await dispatcher._start_colocated(f"r{i}", [1], SamplingParams(), {}, w)
        return info.value.reason

    async def scenario():
        reasons = await asyncio.gather(*(one(i) for i in range(5)))
        await dispatcher.aclose()
        return reasons

    assert _run(scenario()) == ["worker_died"] * 5
    assert len([c for c in w.handle.calls if c[0] == "generate_many"]) == 1


def test_reservations_and_releases_of_a_burst_share_actor_calls() -> None:
    """20 disaggregated starts at once: their reservations go to the decode worker in one
    call and the prefills' releases in one, each request answered on its own: an empty prompt
    is a RequestError for it alone, a Full one moves to the other decode worker, and only the
    gated prefills of reserved requests are released."""
    from router.errors import RequestError

    view = _view(
        ("prefill-0", "prefill", False),
        ("decode-0", "decode", False),
        ("decode-1", "decode", False),
    )
    p, d0, d1 = view.get("prefill-0"), view.get("decode-0"), view.get("decode-1")
    d0.handle.full = {"r3"}
    d0.handle.delay_s = p.handle.delay_s = 0.01
    dispatcher = _dispatcher(view)

    async def one(i: int):
        ids = [] if i == 5 else [1, 2, i]
        try:
            _, placed, irid = await dispatcher._start_disagg(
                f"r{i}", ids, SamplingParams(), {"predicted_tokens": 9}, p, d0, None
            )
        except RequestError as exc:
            return str(exc)
        return placed.name, irid

    async def scenario():
        answers = await asyncio.gather(*(one(i) for i in range(20)))
        await asyncio.sleep(0.05)  # the releases' call
        await dispatcher.aclose()
        return answers

    answers = _run(scenario())
    assert answers[5] == "prompt is empty"
    assert answers[3] == ("decode-1", "r3~r")
    assert all(answers[i] == ("decode-0", f"r{i}") for i in range(20) if i not in (3, 5))
    (first,) = [args for m, args in d0.handle.calls if m == "reserve_many"]
    items, client = first
    assert [rid for rid, *_ in items] == [f"r{i}" for i in range(20)] and client == "test"
    assert all(kw == {"predicted_tokens": 9} for *_, kw in items)
    assert d1.handle.called("reserve") == ["r3~r"]
    # released: the gated prefills whose reservation held (r3's second prefill, for decode-1,
    # was sent ungated once decode-1 had reserved)
    released = p.handle.called("release")
    assert sorted(released) == sorted(f"r{i}" for i in range(20) if i not in (3, 5))
    assert len([c for c in p.handle.calls if c[0] == "release_many"]) == 1


def test_given_up_completes_when_the_router_stops_trusting_a_worker() -> None:
    """``MembershipView.given_up``: pending while the worker is trusted; done at once on this
    router's suspicion, on ``forget`` and on a table that marks it SUSPECT, DEAD or drops it;
    a worker heard from again gets a fresh, pending future."""
    from dataclasses import replace

    from engine.messages import WorkerState

    view = _view(("a", "decode", False), ("b", "decode", False), ("c", "decode", False))

    def table(version: int, **states) -> Membership:
        workers = [
            replace(w, state=states.get(w.name, w.state))
            for w in view.table.workers
            if states.get(w.name) != "gone"
        ]
        return Membership(version, workers, model_dir="", block_size=4, max_model_len=64)

    async def scenario():
        a, b, c = view.given_up("a"), view.given_up("b"), view.given_up("c")
        await asyncio.sleep(0)
        assert not any(f.done() for f in (a, b, c))
        assert view.given_up("a") is a  # one future per worker, shared
        view.suspect("a", "stream")
        assert a.done() and not b.done()
        view.clear("a", "stream")
        fresh = view.given_up("a")
        assert fresh is not a and not fresh.done()
        view.apply(table(2, b=WorkerState.SUSPECT))
        assert b.done() and not c.done() and not fresh.done()
        view.apply(table(3, c="gone"))
        assert c.done()
        view.forget("a", "actor died")
        assert fresh.done() and view.given_up("a").done()

    _run(scenario())
