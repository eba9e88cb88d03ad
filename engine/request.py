"""A request as the scheduler sees it: tokens, progress, status. Plain Python, no torch.

Progress is one number. ``num_computed_tokens`` (tokens whose KV is in the cache) catches up
with ``num_tokens`` (prompt + generated). There are no prefill and decode phases::

    prompt                          output
    |p0 p1 p2 ... p9 |o0 o1 o2|
    |<- computed ->|               num_computed_tokens = 7: a chunked prefill is mid-way
    |<------ computed ------>|    num_computed_tokens = num_tokens - 1: decoding

Chunked prefill, prefix hits, recompute after preemption and (later) KV that arrives from a
remote prefill worker are all the same thing: ``num_computed_tokens`` moving forward.

``num_computed_tokens`` moves when a step is scheduled (its KV is written by that step, before
any later step reads it). With async scheduling the next step is scheduled while one runs: a
token that running step samples is *pending* (``num_pending``), its position already known, its
id not, so a decoding request has ``num_computed_tokens == num_tokens_with_pending - 1``.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Where a request is. Ordered: every status after ``PREEMPTED`` is a finished one.

    ``WAITING`` / ``RUNNING`` / ``PREEMPTED``: in the scheduler's queue or batch.
    ``WAITING_FOR_GRAMMAR``: in the queue, its grammar compiling off the engine thread
    (``grammar_pending``); passed over by admission until it lands.
    ``WAITING_FOR_REMOTE_KV``: blocks reserved on a decode worker, its KV still coming (a
    prefill worker streams it, or a migration copies it); not in the scheduler until admitted.
    ``LOADING``: admitted with blocks whose KV a lower tier (host memory, disk) is filling; in
    the scheduler, out of the batch until the load lands.
    ``PAUSED``: taken out of the batch with its blocks held (a migration's last stage); put
    back, or released when it continues elsewhere.
    ``FINISHED_ERROR``: ended by its own failure (its grammar refused a token or did not
    compile); the rest of the batch goes on. Its client gets the error."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    LOADING = enum.auto()
    RUNNING = enum.auto()
    PAUSED = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by steps still running on the device (async scheduling): their positions
    # are scheduled (counted in ``num_computed_tokens`` once their KV is queued), their ids not
    # known yet. Each is appended when its step's results are read.
    num_pending: int = 0
    # Prompt tokens found in the prefix cache at first admission (reported to the client).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Chained block hashes of every full block of ``all_token_ids`` (grown by the block manager).
    block_hashes: list[bytes] = field(default_factory=list)
    # Structured outputs: where the output is in its grammar; it accepts every appended token
    # (made from the output so far, so a request continued elsewhere rebuilds it from tokens).
    grammar: GrammarMatcher | None = None
    # The matcher while it is made off the engine thread (its compile, its catch-up over the
    # output the request had then): (the future, how many output tokens it was made from);
    # ``land_grammar`` takes it in.
    grammar_pending: tuple[Future, int] | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def grammar_error(self) -> str | None:
        """Why its grammar can go no further (the request ends with it), or None."""
        return self.grammar.error if self.grammar is not None else None

    def append_output_token(self, token_id: int) -> None:
        """Append a token; its grammar, if landed, accepts it (a refusal stays in
        ``grammar_error``: the scheduler ends the request, its batch goes on)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def land_grammar(self, wait: bool = False) -> bool:
        """Whether its grammar is here (or it has none): takes in a matcher made off the
        engine thread once it is done (``wait``: waits for it), and has it accept the tokens
        appended since it was asked for."""
        if self.grammar_pending is None:
            return True
        pending, seen = self.grammar_pending
        if not wait and not pending.done():
            return False
        matcher = pending.result()
        self.grammar, self.grammar_pending = matcher, None
        for token in self.output_token_ids[seen:]:
            if not matcher.accept(token):
                break
        return True

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first and is preempted last: (priority, arrival)."""
        return (self.priority, self.arrival_time)
