"""Tests of engine.scheduler with hand-built requests and a simulated model: continuous batching,
chunked prefill, max_num_seqs, preemption, priorities, aborts, stop conditions, admission errors,
prefix hits, and a randomized stress test that checks the paged KV reads against the writes."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4
EOS = 99
TOKEN = 7  # what the simulated model samples unless a test says otherwise
_fresh_prompts = itertools.count(1000, 1000)  # int prompts never share a prefix


def make_request(
    rid: str,
    prompt: int | Sequence[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival: float = 0.0,
    eos: tuple[int, ...] = (EOS,),
    **params: object,
) -> Request:
    if isinstance(prompt, int):
        base = next(_fresh_prompts)
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, **params).with_eos(eos)  # type: ignore[arg-type]
    return Request(rid, tokens, sp, priority=priority, arrival_time=arrival)


def make_scheduler(
    num_blocks: int = 64,
    *,
    block_size: int = BS,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 1024,
    prefix_caching: bool = True,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm)


def add(sched: Scheduler, *requests: Request) -> None:
    for request in requests:
        sched.add_request(request)


Chunk = tuple[str, int, int, bool]  # (request id, start, num tokens, samples)


@dataclass
class Step:
    out: SchedulerOutput
    chunks: list[Chunk]
    progressed: list[Request]
    finished: list[Request]

    @property
    def preempted(self) -> list[str]:
        return [r.request_id for r in self.out.preempted]


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every schedule() output must satisfy."""
    cfg, bm = sched.config, sched.block_manager
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [c.request.request_id for c in out.scheduled]
    assert len(ids) == len(set(ids))
    for c in out.scheduled:
        assert c.num_tokens >= 1
        assert c.request.status == RequestStatus.RUNNING
        assert len(c.block_table) == bm.blocks_needed(c.start + c.num_tokens)
    assert not {id(r) for r in sched.running} & {id(r) for r in sched.waiting}
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)


def step(sched: Scheduler, token: int | Callable[[Request], int] = TOKEN) -> Step:
    """One schedule / execute / update round; the 'model' samples ``token`` (or token(request))."""
    out = sched.schedule()
    check_step(sched, out)
    chunks = [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.scheduled]
    pick = token if callable(token) else (lambda _r: token)
    sampled = {c.request.request_id: pick(c.request) for c in out.scheduled if c.samples}
    progressed, finished = sched.update_from_output(out, sampled)
    sched.block_manager.check_invariant()
    return Step(out, chunks, progressed, finished)


def run_until_idle(sched: Scheduler, token: int = TOKEN, max_steps: int = 500) -> list[Step]:
    steps = []
    while sched.has_unfinished_requests():
        assert len(steps) < max_steps, "the scheduler stalled"
        steps.append(step(sched, token))
    sched.block_manager.check_invariant(expect_idle=True)
    return steps


def scripted(tokens: dict[str, list[int]]) -> Callable[[Request], int]:
    """The model samples each request's script in order."""
    return lambda r: tokens[r.request_id][r.num_output_tokens]


# ------------------------------------------------------------------------------- basic flow


def test_config_validation_names_the_field() -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        kwargs = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1, name: 0}
        with pytest.raises(ValueError, match=f"^{name} must be >= 1, got 0"):
            SchedulerConfig(**kwargs)


def test_nothing_to_do_gives_an_empty_step() -> None:
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_tokens == 0 and out.preempted == []
    assert sched.update_from_output(out, {}) == ([], [])


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    sched = make_scheduler()
    a = make_request("a", 10, max_tokens=3)
    add(sched, a)
    s1, s2, s3 = (step(sched, token=t) for t in (1, 2, 3))
    assert s1.chunks == [("a", 0, 10, True)]
    assert s2.chunks == [("a", 10, 1, True)]
    assert s3.chunks == [("a", 11, 1, True)]
    assert [s.progressed for s in (s1, s2, s3)] == [[a], [a], [a]]
    assert s3.finished == [a]
    assert a.output_token_ids == [1, 2, 3]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.num_computed_tokens == 12  # the last sampled token never gets KV
    assert a.num_cached_tokens == 0
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty
    sched.block_manager.check_invariant(expect_idle=True)


def test_request_added_later_joins_the_running_batch() -> None:
    sched = make_scheduler()
    a = make_request("a", 6, max_tokens=5)
    add(sched, a)
    step(sched)
    step(sched)
    b = make_request("b", 5, max_tokens=2, arrival=1.0)
    add(sched, b)
    s = step(sched)
    assert s.chunks == [("a", 7, 1, True), ("b", 0, 5, True)]
    assert s.progressed == [a, b]
    s = step(sched)
    assert s.chunks == [("a", 8, 1, True), ("b", 5, 1, True)]
    assert s.finished == [b]
    run_until_idle(sched)
    assert (a.num_output_tokens, b.num_output_tokens) == (5, 2)


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    sched = make_scheduler(budget=8)
    a = make_request("a", 3, max_tokens=10)
    add(sched, a)
    assert step(sched).chunks == [("a", 0, 3, True)]
    b = make_request("b", 20, max_tokens=1, arrival=1.0)
    add(sched, b)
    s = step(sched)
    assert s.chunks == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert s.progressed == [a] and b.output_token_ids == [] and b.num_computed_tokens == 7
    s = step(sched)
    assert s.chunks == [("a", 4, 1, True), ("b", 7, 7, False)]
    s = step(sched)
    assert s.chunks == [("a", 5, 1, True), ("b", 14, 6, True)]
    assert s.progressed == [a, b] and s.finished == [b]
    assert b.num_computed_tokens == 20 and b.output_token_ids == [TOKEN]
    run_until_idle(sched)
    assert a.num_output_tokens == 10


def test_long_prompt_is_split_by_the_budget() -> None:
    sched = make_scheduler(budget=8)
    add(sched, make_request("a", 20, max_tokens=2))
    chunks = [c for s in run_until_idle(sched) for c in s.chunks]
    assert chunks == [
        ("a", 0, 8, False),
        ("a", 8, 8, False),
        ("a", 16, 4, True),
        ("a", 20, 1, True),
    ]


def test_waiting_requests_get_only_the_budget_left_by_running_ones() -> None:
    sched = make_scheduler(budget=4)
    add(sched, make_request("a", 10, max_tokens=1))
    assert step(sched).chunks == [("a", 0, 4, False)]
    add(sched, make_request("b", 3, max_tokens=1, arrival=1.0))
    assert step(sched).chunks == [("a", 4, 4, False)]  # no budget left for b
    assert step(sched).chunks == [("a", 8, 2, True), ("b", 0, 2, False)]
    assert step(sched).chunks == [("b", 2, 1, True)]
    sched.block_manager.check_invariant(expect_idle=True)


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(rid, 4, max_tokens=2, arrival=i) for i, rid in enumerate("abc")]
    add(sched, *reqs)
    s = step(sched)
    assert [c[0] for c in s.chunks] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    s = step(sched)
    assert [c[0] for c in s.chunks] == ["a", "b"] and len(s.finished) == 2
    s = step(sched)
    assert s.chunks == [("c", 0, 4, True)]
    run_until_idle(sched)
    assert [r.num_output_tokens for r in reqs] == [2, 2, 2]


# ----------------------------------------------------------------------------------- preemption


def two_requests_on_a_full_pool(
    a_priority: int = 0, b_priority: int = 0
) -> tuple[Scheduler, Request, Request]:
    """4 blocks of 4: a and b (7-token prompts) take 2 blocks each; both outgrow them in step 3."""
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", range(0, 7), max_tokens=6, priority=a_priority, arrival=0.0)
    b = make_request("b", range(50, 57), max_tokens=6, priority=b_priority, arrival=1.0)
    add(sched, a, b)
    assert sorted(step(sched).chunks) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert sorted(step(sched).chunks) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert sched.block_manager.num_free_blocks == 0
    return sched, a, b


def test_preemption_evicts_the_latest_request_and_recomputes_it_later() -> None:
    sched, a, b = two_requests_on_a_full_pool()
    bm = sched.block_manager
    s = step(sched)
    assert s.preempted == ["b"]
    assert s.chunks == [("a", 8, 1, True)]  # no admission in a step that preempts
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [TOKEN, TOKEN]  # generated tokens are kept and recomputed
    assert sched.waiting == [b] and sched.running == [a]
    assert bm.block_table("b") == []
    # b still does not fit while a holds 3 of the 4 blocks.
    while a.status == RequestStatus.RUNNING:
        assert [c[0] for c in step(sched).chunks] == ["a"]
    assert a.num_output_tokens == 6
    s = step(sched)
    # b's head block survived in the prefix cache (its tail was evicted first): start at 4.
    assert s.chunks == [("b", 4, 5, True)]
    assert b.num_cached_tokens == 0  # set at first admission only
    run_until_idle(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.num_output_tokens == 6 and b.num_tokens == 13


def test_preemption_evicts_the_lowest_priority_request_first() -> None:
    sched, a, b = two_requests_on_a_full_pool(a_priority=1, b_priority=0)
    s = step(sched)
    assert s.preempted == ["a"]  # a arrived first but has the lower priority
    assert s.chunks == [("b", 8, 1, True)]
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert sched.waiting == [a]
    run_until_idle(sched)
    assert (a.num_output_tokens, b.num_output_tokens) == (6, 6)


def test_request_that_cannot_grow_preempts_itself_when_it_is_last() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", 5, max_tokens=6)
    b = make_request("b", 7, max_tokens=6, arrival=1.0)
    add(sched, a, b)
    step(sched)
    step(sched)
    s = step(sched)  # a (7 tokens) still fits its 2 blocks; b (9 tokens) needs a third
    assert s.chunks == [("a", 6, 1, True)]
    assert s.preempted == ["b"]
    assert sched.waiting == [b] and b.num_computed_tokens == 0
    run_until_idle(sched)
    assert (a.num_output_tokens, b.num_output_tokens) == (6, 6)


def test_preempted_requests_go_to_the_front_of_waiting_best_first() -> None:
    sched = make_scheduler(num_blocks=6, max_num_seqs=3)
    a = make_request("a", range(0, 15), max_tokens=4, arrival=0.0)  # 4 blocks
    b = make_request("b", range(20, 23), max_tokens=4, arrival=1.0)  # 1 block
    c = make_request("c", range(30, 33), max_tokens=4, arrival=2.0)  # 1 block
    d = make_request("d", range(40, 43), max_tokens=4, arrival=3.0)  # waits: max_num_seqs
    add(sched, a, b, c, d)
    step(sched)
    step(sched)
    s = step(sched)  # a needs a 5th block: c goes; then b needs a 2nd block: b goes
    assert s.chunks == [("a", 16, 1, True)]
    assert s.preempted == ["c", "b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    run_until_idle(sched)
    assert [r.num_output_tokens for r in (a, b, c, d)] == [4, 4, 4, 4]
    assert (b.num_preemptions, c.num_preemptions) == (1, 1)


def test_preempted_request_stays_behind_higher_priority_waiting_ones() -> None:
    sched = make_scheduler(num_blocks=6, max_num_seqs=2)
    a = make_request("a", range(0, 15), max_tokens=4, arrival=0.0)  # 4 blocks
    b = make_request("b", range(20, 23), max_tokens=8, arrival=1.0, priority=1)  # 1 block
    urgent = make_request("urgent", range(40, 43), max_tokens=2, arrival=2.0, priority=0)
    add(sched, a, b)
    step(sched)
    add(sched, urgent)  # waits: max_num_seqs
    step(sched)
    s = step(sched)  # a needs a 5th block: b (lowest priority) goes
    assert s.preempted == ["b"]
    assert [r.request_id for r in sched.waiting] == ["urgent", "b"]
    run_until_idle(sched)
    assert [r.num_output_tokens for r in (a, b, urgent)] == [4, 8, 2]


def test_preempted_mid_prefill_request_restarts_from_its_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=5, budget=8)
    a = make_request("a", range(0, 5), max_tokens=12, arrival=0.0)  # grows to 4 blocks
    b = make_request("b", range(50, 66), max_tokens=1, arrival=1.0)  # 16-token prompt
    add(sched, a, b)
    steps = run_until_idle(sched)
    assert steps[0].chunks == [("a", 0, 5, True), ("b", 0, 3, False)]
    assert steps[1].chunks == [("a", 5, 1, True), ("b", 3, 7, False)]
    # b (10 of 16 computed) needs a 4th block for its last chunk: it is last, so it goes.
    assert steps[2].chunks == [("a", 6, 1, True)] and steps[2].preempted == ["b"]
    # a's growth evicts b's cached block 1 (tail first) but not block 0: b restarts at 4.
    b_chunks = [c for s in steps[3:] for c in s.chunks if c[0] == "b"]
    assert b_chunks == [("b", 4, 8, False), ("b", 12, 4, True)]
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0
    assert (a.num_output_tokens, b.num_output_tokens) == (12, 1)


# ------------------------------------------------------------------------------------ priority


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    specs = [("p2", 2), ("p0a", 0), ("p1", 1), ("p0b", 0), ("neg", -1), ("p0c", 0)]
    reqs = [
        make_request(rid, 3, max_tokens=1, priority=p, arrival=i)
        for i, (rid, p) in enumerate(specs)
    ]
    add(sched, *reqs)
    expected = ["neg", "p0a", "p0b", "p0c", "p1", "p2"]
    assert [r.request_id for r in sched.waiting] == expected
    order = [s.chunks[0][0] for s in run_until_idle(sched)]
    assert order == expected


def test_equal_priority_and_arrival_keeps_insertion_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    add(sched, *(make_request(rid, 2, arrival=5.0) for rid in "xyz"))
    assert [r.request_id for r in sched.waiting] == ["x", "y", "z"]


def test_running_requests_are_served_in_priority_order() -> None:
    sched = make_scheduler(budget=3)
    low = make_request("low", 2, max_tokens=5, priority=5, arrival=0.0)
    add(sched, low)
    step(sched)
    high = make_request("high", 4, max_tokens=5, priority=0, arrival=1.0)
    add(sched, high)
    assert step(sched).chunks == [("low", 2, 1, True), ("high", 0, 2, False)]
    # Now both run: high goes first and takes what it needs before low.
    assert step(sched).chunks == [("high", 2, 2, True), ("low", 3, 1, True)]


# --------------------------------------------------------------------------------------- abort


def abort_while_waiting() -> tuple[Scheduler, Request, Request]:
    sched = make_scheduler(max_num_seqs=1)
    add(sched, make_request("other", 4, max_tokens=3), make_request("v", 4, arrival=1.0))
    step(sched)
    v = sched.requests["v"]
    assert v.status == RequestStatus.WAITING and sched.waiting == [v]
    return sched, v, sched.requests["other"]


def abort_mid_prefill() -> tuple[Scheduler, Request, Request]:
    sched = make_scheduler(budget=4)
    add(sched, make_request("v", 10), make_request("other", 4, max_tokens=3, arrival=1.0))
    step(sched)
    v = sched.requests["v"]
    assert v.status == RequestStatus.RUNNING and v.num_computed_tokens == 4
    return sched, v, sched.requests["other"]


def abort_while_decoding() -> tuple[Scheduler, Request, Request]:
    sched = make_scheduler()
    add(sched, make_request("v", 6), make_request("other", 4, max_tokens=3, arrival=1.0))
    step(sched)
    step(sched)
    v = sched.requests["v"]
    assert v.num_output_tokens == 2
    return sched, v, sched.requests["other"]


def abort_while_preempted() -> tuple[Scheduler, Request, Request]:
    sched = make_scheduler(num_blocks=4)
    add(sched, make_request("other", 7, max_tokens=6), make_request("v", 7, arrival=1.0))
    step(sched)
    step(sched)
    assert step(sched).preempted == ["v"]
    v = sched.requests["v"]
    assert v.status == RequestStatus.PREEMPTED and v in sched.waiting
    return sched, v, sched.requests["other"]


@pytest.mark.parametrize(
    "stage", [abort_while_waiting, abort_mid_prefill, abort_while_decoding, abort_while_preempted]
)
def test_abort_at_any_moment_frees_everything(
    stage: Callable[[], tuple[Scheduler, Request, Request]],
) -> None:
    sched, v, other = stage()
    outputs_before = list(v.output_token_ids)
    assert sched.finish_requests(["v"], RequestStatus.FINISHED_ABORTED) == [v]
    assert v.status == RequestStatus.FINISHED_ABORTED and v.status.finish_reason == "abort"
    assert v not in sched.waiting and v not in sched.running and "v" not in sched.requests
    assert sched.block_manager.block_table("v") == []
    sched.block_manager.check_invariant()
    assert sched.finish_requests(["v"], RequestStatus.FINISHED_ABORTED) == []
    run_until_idle(sched)
    assert v.output_token_ids == outputs_before
    assert other.num_output_tokens == other.params.max_tokens


def test_abort_between_schedule_and_update_is_skipped() -> None:
    sched = make_scheduler()
    v, other = make_request("v", 5), make_request("other", 3, max_tokens=2, arrival=1.0)
    add(sched, v, other)
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["v", "other"]
    sched.finish_requests(["v"], RequestStatus.FINISHED_ABORTED)
    progressed, finished = sched.update_from_output(out, {"v": 1, "other": 2})
    assert progressed == [other] and finished == []
    assert v.output_token_ids == [] and other.output_token_ids == [2]
    assert other.num_pending == 0 and other.num_computed_tokens == 3
    sched.block_manager.check_invariant()
    run_until_idle(sched)


def test_abort_of_unknown_ids_is_a_no_op() -> None:
    sched = make_scheduler()
    assert sched.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED) == []


def test_finished_request_id_can_be_reused() -> None:
    sched = make_scheduler()
    add(sched, make_request("a", 3, max_tokens=1))
    run_until_idle(sched)
    again = make_request("a", 3, max_tokens=1)
    add(sched, again)
    run_until_idle(sched)
    assert again.num_output_tokens == 1


# -------------------------------------------------------------------------------- stop conditions


@dataclass
class StopCase:
    name: str
    script: list[int]
    kwargs: dict[str, object]
    status: RequestStatus
    outputs: int
    stop_reason: int | None = None
    prompt: int = 5
    max_model_len: int = 1024


STOP_CASES = [
    StopCase("eos", [5, 6, EOS, 7], {}, RequestStatus.FINISHED_STOPPED, 3),
    StopCase(
        "ignore_eos",
        [EOS] * 4,
        {"ignore_eos": True, "max_tokens": 3},
        RequestStatus.FINISHED_LENGTH_CAPPED,
        3,
    ),
    StopCase(
        "stop_token_id", [5, 42, 6], {"stop_token_ids": [42]}, RequestStatus.FINISHED_STOPPED, 2, 42
    ),
    StopCase(
        "stop_token_id_despite_ignore_eos",
        [5, 42],
        {"stop_token_ids": [42], "ignore_eos": True},
        RequestStatus.FINISHED_STOPPED,
        2,
        42,
    ),
    StopCase(
        "min_tokens_holds_eos",
        [EOS, EOS, EOS, 5],
        {"min_tokens": 3},
        RequestStatus.FINISHED_STOPPED,
        3,
    ),
    StopCase(
        "min_tokens_holds_stop_ids",
        [42, 42, 5, 42, 6],
        {"min_tokens": 3, "stop_token_ids": [42]},
        RequestStatus.FINISHED_STOPPED,
        4,
        42,
    ),
    StopCase(
        "max_tokens", list(range(1, 10)), {"max_tokens": 4}, RequestStatus.FINISHED_LENGTH_CAPPED, 4
    ),
    StopCase(
        "eos_on_the_last_allowed_token",
        [5, EOS],
        {"max_tokens": 2},
        RequestStatus.FINISHED_STOPPED,
        2,
    ),
    StopCase(
        "max_model_len",
        list(range(1, 20)),
        {"max_tokens": None},
        RequestStatus.FINISHED_LENGTH_CAPPED,
        3,
        max_model_len=8,
    ),
]


def run_script(case: StopCase) -> tuple[Request, list[Step]]:
    sched = make_scheduler(max_model_len=case.max_model_len)
    kwargs = {"max_tokens": 16, **case.kwargs}
    request = make_request("r", case.prompt, **kwargs)  # type: ignore[arg-type]
    add(sched, request)
    steps = []
    while sched.has_unfinished_requests():
        assert len(steps) < len(case.script), "did not stop within the script"
        steps.append(step(sched, scripted({"r": case.script})))
    sched.block_manager.check_invariant(expect_idle=True)
    return request, steps


@pytest.mark.parametrize("case", STOP_CASES, ids=[c.name for c in STOP_CASES])
def test_stop_conditions(case: StopCase) -> None:
    request, steps = run_script(case)
    assert request.status == case.status
    assert request.output_token_ids == case.script[: case.outputs]
    assert request.stop_reason == case.stop_reason
    assert steps[-1].finished == [request]
    assert all(s.finished == [] for s in steps[:-1])
    assert request.status.finish_reason == (
        "stop" if case.status.name.endswith("STOPPED") else "length"
    )


def test_max_model_len_bounds_prompt_plus_output() -> None:
    request, _ = run_script(next(c for c in STOP_CASES if c.name == "max_model_len"))
    assert request.num_tokens == 8


# ---------------------------------------------------------------------------------- admission


def test_prompt_that_can_never_fit_the_pool_is_rejected() -> None:
    sched = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="prompt of 8 tokens needs 3 KV blocks but the pool has 2"):
        sched.add_request(make_request("big", 8))
    assert sched.requests == {} and sched.waiting == []
    fits = make_request("fits", 7, max_tokens=2)  # 7 prompt tokens + 1 = 2 blocks
    add(sched, fits)
    run_until_idle(sched)
    assert fits.num_output_tokens == 2


def test_duplicate_request_id_is_rejected() -> None:
    sched = make_scheduler()
    first = make_request("a", 3)
    add(sched, first)
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        sched.add_request(make_request("a", 5))
    assert sched.requests == {"a": first} and sched.waiting == [first]
    step(sched)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5))  # also while running


# -------------------------------------------------------------------------------- prefix hits


def test_prefix_hit_skips_cached_tokens() -> None:
    sched = make_scheduler()
    add(sched, make_request("a", range(10), max_tokens=1))
    run_until_idle(sched)
    b = make_request("b", list(range(10)) + [77], max_tokens=1)
    add(sched, b)
    assert step(sched).chunks == [("b", 8, 3, True)]
    assert b.num_cached_tokens == 8
    whole = make_request("c", range(8), max_tokens=1)  # a full-prompt hit still computes 1 token
    add(sched, whole)
    assert step(sched).chunks == [("c", 4, 4, True)]


def test_request_admitted_in_the_same_step_shares_fresh_blocks() -> None:
    sched = make_scheduler()
    a = make_request("a", range(10), max_tokens=2)
    b = make_request("b", range(10), max_tokens=2, arrival=1.0)
    add(sched, a, b)
    out = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.scheduled] == [
        ("a", 0, 10),
        ("b", 8, 2),
    ]
    bm = sched.block_manager
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    assert bm.block_table("a")[2] != bm.block_table("b")[2]
    sched.update_from_output(out, {"a": 1, "b": 2})
    run_until_idle(sched)


def test_prefix_caching_off_recomputes_everything() -> None:
    sched = make_scheduler(prefix_caching=False)
    add(sched, make_request("a", range(10), max_tokens=1))
    run_until_idle(sched)
    b = make_request("b", range(10), max_tokens=1)
    add(sched, b)
    assert step(sched).chunks == [("b", 0, 10, True)]
    assert b.num_cached_tokens == 0


# ------------------------------------------------------------------ fixed bug (regression)


def test_request_that_outgrows_the_pool_ends_instead_of_stalling_the_queue() -> None:
    sched = make_scheduler(num_blocks=2, max_model_len=64)  # the pool holds 8 tokens
    stuck = make_request("stuck", 6, max_tokens=10)
    behind = make_request("behind", 3, max_tokens=1, arrival=1.0)
    add(sched, stuck, behind)
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert stuck.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert stuck.num_tokens <= 2 * BS + 1
    assert behind.num_output_tokens == 1
    sched.block_manager.check_invariant(expect_idle=True)


# ------------------------------------------------------------------------------- stress test


class PagedKV:
    """Stands in for the paged KV cache: each slot remembers the whole prefix its KV was
    computed from, so a prefix hit, a shared block or a reused block that holds the wrong
    content shows up as a mismatch when a later chunk attends to it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def _slot(self, table: list[int], pos: int) -> tuple[int, int]:
        return table[pos // self.block_size], pos % self.block_size

    def execute(self, out: SchedulerOutput) -> None:
        # Layer by layer, every chunk's KV is written before any chunk attends.
        written: set[tuple[int, int]] = set()
        for c in out.scheduled:
            tokens = c.request.all_token_ids
            for pos in range(c.start, c.start + c.num_tokens):
                slot = self._slot(c.block_table, pos)
                assert slot not in written, f"two chunks write slot {slot} in one step"
                written.add(slot)
                self.slots[slot] = tuple(tokens[: pos + 1])
        for c in out.scheduled:
            tokens = c.request.all_token_ids
            for pos in range(c.start):
                slot = self._slot(c.block_table, pos)
                assert self.slots.get(slot) == tuple(tokens[: pos + 1]), (
                    f"{c.request.request_id} reads stale KV at position {pos} (slot {slot})"
                )


def check_preemption_order(out: SchedulerOutput, running_before: set[str]) -> None:
    if not out.preempted:
        return
    scheduled = [c.request for c in out.scheduled]
    # No admission in a step that preempts, and every victim ranks below every survivor.
    assert all(r.request_id in running_before for r in scheduled)
    worst_kept = max((r.sort_key() for r in scheduled), default=None)
    for victim in out.preempted:
        assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert worst_kept is None or victim.sort_key() >= worst_kept


def stress(seed: int, num_steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(5, 10)
    capacity = num_blocks * block_size
    sched = make_scheduler(
        num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(2, 4),
        budget=rng.randint(3, 10),
        prefix_caching=rng.random() < 0.8,
    )
    bm = sched.block_manager
    kv = PagedKV(block_size)
    prefixes = [[rng.randrange(1, 40) for _ in range(3 * block_size)] for _ in range(3)]
    everyone: list[Request] = []
    aborted: dict[str, tuple[list[int], int]] = {}  # id -> (outputs, computed) at the abort
    stats = {"preemptions": 0, "aborts": 0, "steps": 0, "prefix_hits": 0}

    def add_random(i: int) -> None:
        max_tokens = rng.randint(1, 8)
        # Keep prompt + max_tokens within the pool: beyond it a request ends with "length".
        length = rng.randint(1, min(capacity - max_tokens, 20))
        head = rng.choice(prefixes) if rng.random() < 0.6 else []
        tail = [rng.randrange(0, 40) for _ in range(length)]
        params = {"ignore_eos": True, "eos": (0,)}
        request = make_request(
            f"r{i}",
            (head + tail)[:length],
            max_tokens=max_tokens,
            priority=rng.randint(0, 2),
            arrival=float(i),
            **params,  # type: ignore[arg-type]
        )
        sched.add_request(request)
        everyone.append(request)

    def abort_random(candidates: list[str]) -> None:
        rid = rng.choice(candidates)
        (request,) = sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert bm.block_table(rid) == []
        aborted[rid] = (list(request.output_token_ids), request.num_computed_tokens)
        stats["aborts"] += 1

    for i in itertools.count():
        adding = i < num_steps
        if not adding and not sched.has_unfinished_requests():
            break
        assert i < num_steps + 2000, "the scheduler stalled"
        if adding and rng.random() < 0.4:
            add_random(i)
        if adding and rng.random() < 0.02:
            with pytest.raises(ValueError, match="KV blocks"):
                sched.add_request(make_request(f"huge{i}", capacity))
        if adding and sched.requests and rng.random() < 0.04:
            abort_random(sorted(sched.requests))

        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        check_step(sched, out)
        check_preemption_order(out, running_before)
        if sched.has_unfinished_requests():
            assert out.scheduled or out.preempted, "nothing scheduled although work is left"
        kv.execute(out)
        sampled = {c.request.request_id: rng.randrange(0, 40) for c in out.scheduled if c.samples}
        if adding and out.scheduled and rng.random() < 0.03:  # abort after the forward pass
            abort_random(sorted({c.request.request_id for c in out.scheduled}))
        sched.update_from_output(out, sampled)
        bm.check_invariant()
        for r in sched.running:
            assert len(bm.block_table(r.request_id)) == bm.blocks_needed(r.num_computed_tokens)
        for r in sched.waiting:
            assert bm.block_table(r.request_id) == [] and r.num_computed_tokens == 0
        stats["preemptions"] += len(out.preempted)
        stats["steps"] += 1

    bm.check_invariant(expect_idle=True)
    assert bm.num_free_blocks == num_blocks
    stats["prefix_hits"] = bm.prefix_hits
    for request in everyone:
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            # Nothing moves after an abort, even with a chunk of it still in flight.
            assert (request.output_token_ids, request.num_computed_tokens) == aborted[
                request.request_id
            ]
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, request
            assert request.num_output_tokens == request.params.max_tokens, request
    return stats


SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_randomized_stress(seed: int) -> None:
    start = time.perf_counter()
    stats = stress(seed, num_steps=300)
    assert stats["steps"] >= 300
    assert time.perf_counter() - start < 3.0


def test_randomized_stress_exercises_preemption_aborts_and_prefix_hits() -> None:
    totals = [stress(seed, num_steps=300) for seed in SEEDS[:4]]
    for key in ("preemptions", "aborts", "prefix_hits"):
        assert sum(t[key] for t in totals) > 0, key


# ----------------------------------------------------------------------------- grammars


def test_a_request_waits_for_its_grammar_and_a_failed_one_ends_alone() -> None:
    """A request whose grammar compiles is passed over (the ones behind it run), admitted once
    it lands; one whose compile failed ends FINISHED_ERROR holding no block; a token its
    matcher refuses ends that request at the step that drew it."""
    from concurrent.futures import Future

    from engine.grammar import FailedMatcher, GrammarMatcher

    class Only(GrammarMatcher):
        def __init__(self, allowed: int) -> None:
            self.allowed = allowed

        def accept(self, token_id: int) -> bool:
            if token_id != self.allowed:
                self.fail(f"token {token_id} refused")
            return self.error is None

        def fill_bitmask(self, bitmask, row: int) -> None:
            raise AssertionError("no sampler here")

        def is_terminated(self) -> bool:
            return False

    sched = make_scheduler()
    slow, failed, free = (make_request(n, 5, arrival=i) for i, n in enumerate("sfx"))
    compiling, broken = Future(), Future()
    slow.grammar_pending, failed.grammar_pending = (compiling, 0), (broken, 0)
    add(sched, slow, failed, free)
    assert sched.land_grammars() == []
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["x"]
    assert slow.status == failed.status == RequestStatus.WAITING_FOR_GRAMMAR
    broken.set_result(FailedMatcher("invalid regex: unclosed group"))
    compiling.set_result(Only(TOKEN))
    assert sched.land_grammars() == [failed]
    assert failed.status == RequestStatus.FINISHED_ERROR and "unclosed" in failed.grammar_error
    assert sched.block_manager.block_table("f") == []
    assert slow.status == RequestStatus.WAITING
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["x", "s"]
    progressed, finished = sched.update_from_output(out, {"x": TOKEN, "s": TOKEN + 1})
    assert {r.request_id for r in progressed} == {"x", "s"}
    assert finished == [slow] and slow.status == RequestStatus.FINISHED_ERROR
    assert "refused" in slow.grammar_error and free.status == RequestStatus.RUNNING
