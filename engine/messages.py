"""The typed messages every tandem process exchanges (router <-> workers, worker <-> worker).

Each is a frozen dataclass but ``Delta``, a slotted one: a worker makes one a token and the
router decodes it again, and a frozen dataclass's constructor sets each field through
``object.__setattr__`` (1.7 us for its 13 fields, against 0.45 us). Nothing changes a delta
once made. Ray carries them between actors. Failure is a value on the hot path (``Full``,
``Rejected``, ``PrefillFailed``, a ``Delta`` with ``error``); exceptions are for faults (a dead
actor, a bug).

A request's messages, disaggregated::

    router ── reserve(rid, prompt, params, client) ──► decode    -> Reserved | Full | Rejected
    router ── prefill(rid, prompt, params, endpoint) ► prefill   -> PrefillDone | PrefillFailed
    router ◄── outputs(client): one StreamBatch per engine step ── decode (every request of
               that client that progressed in the step: a Delta each, never cumulative)

Colocated: ``generate(rid, prompt, params, client)`` then the same ``StreamBatch`` stream.

A live migration, decode A -> decode B (decode_worker/migration.py)::

    controller ── migrate_out(rid, B) ──► A              -> MigrationResult (failure a value)
    A ── migrate_in(rid, prompt, params, client, output so far) ──► B   -> Reserved | Full
    A ══ KV copy stages, then the paused last stage + done(snapshot) ══► B (the KV channel)
    A ── migrate_wait(rid) ──► B -> "admitted"; A ── Delta(moved_to=B) ──► the router
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

from engine.outputs import SampledToken
from engine.sampling_params import SamplingParams

CONTROL_GROUP = "control"
"""The worker actors' concurrency group for the calls that watch and steer them (``ready``,
``health``, ``stats``, ``check_idle``, ``abort``, ``migration_candidates``): its own event loop
and slots, apart from the request calls and streams of the default group. Callers use
``control(handle.method)``."""

CONTROL_CONCURRENCY = 32


def brief(exc: BaseException) -> str:
    """An exception as another process or a client may see it: its type and first line (a Ray
    error's text goes on with the remote traceback; that stays in the logs)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def control(method: Any) -> Any:
    """An actor method sent to the control group (``.remote(...)`` on the result)."""
    return method.options(concurrency_group=CONTROL_GROUP)


class WorkerState(enum.IntEnum):
    """A worker's life in the controller's membership table::

        STARTING -> ACTIVE <-> SUSPECT -> DEAD        (DRAINING -> DEAD: the operator's)

    SUSPECT: it missed health checks or its engine step runs too long; no new requests go to
    it, what it runs may still finish; it is ACTIVE again when it answers, DEAD (and killed)
    when it stays silent past the controller's ``dead_after_s``."""

    STARTING = 0
    ACTIVE = 1
    SUSPECT = 2
    DRAINING = 3
    DEAD = 4


# -- reservation (decode worker) ------------------------------------------------------------------


@dataclass(frozen=True)
class Reserved:
    """Blocks are held for the prompt; its KV goes to ``endpoint``."""

    endpoint: str


@dataclass(frozen=True)
class Full:
    """No room now (blocks or running batch): another decode worker may have some."""

    reason: str = "full"


@dataclass(frozen=True)
class Rejected:
    """The request itself is invalid: retrying elsewhere will not help."""

    message: str


ReserveResult = Reserved | Full | Rejected


# -- prefill (prefill worker) ---------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillDone:
    """The prompt's KV is sent; ``token`` is the first token, sampled on the prefill worker."""

    token: SampledToken
    num_cached_tokens: int = 0  # prompt tokens its prefix cache served
    # Seconds on the prefill worker: the call to its engine thread, queued there, computing
    # (first chunk scheduled to the token sampled); for a resume's breakdown.
    phases: tuple[float, float, float] | None = None


@dataclass(frozen=True)
class PrefillFailed:
    message: str


PrefillResult = PrefillDone | PrefillFailed


# -- the stream of outputs (decode / colocated worker -> router) ----------------------------------


@dataclass(slots=True)
class Delta:
    """What one sequence of one request added since the last delta: never cumulative.

    ``text`` is empty when the worker does not detokenize (the router does, off the engine
    thread). The last delta of a sequence has ``finish_reason``; one with ``error`` ends the
    request in failure (``retryable``: it produced no token, so it may run elsewhere)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: sampled + top-N
    text: str = ""
    index: int = 0  # which of the request's n sequences
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    retryable: bool = False
    start: int = -1  # output position of its first token (-1: not positioned)
    moved_to: str | None = None  # the request now runs on this worker (a live migration)
    # The first delta of a request, when its prefill ran with a length probe: (p50, p90, p99)
    # of its whole output's length in tokens, refined on the model's own hidden state (not
    # capped by max_tokens; the reader caps).
    predicted: tuple[float, float, float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def plain(self) -> bool:
        """Tokens and their position only (most deltas): the streams send these compactly."""
        return (
            self.logprobs is None
            and not self.text
            and self.finish_reason is None
            and self.stop_reason is None
            and not self.num_cached_tokens
            and self.error is None
            and not self.retryable
            and self.moved_to is None
            and self.predicted is None
        )

    def merge(self, later: Delta) -> Delta:
        """This delta followed by ``later`` of the same sequence, as one delta (a reader that
        fell behind gets one per sequence, however many steps it missed)."""
        return Delta.merge_all([self, later])

    @staticmethod
    def merge_all(deltas: list[Delta]) -> Delta:
        """``deltas[0].merge(deltas[1]).merge(...)`` in one pass: linear in the tokens, where
        merging one step at a time copies the tokens so far at every step (quadratic in the
        steps a reader missed)."""
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        logprobs = None
        if any(d.logprobs is not None for d in deltas):
            logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
        start = next((d.start for d in deltas if d.start >= 0), last.start)
        return replace(
            last,
            token_ids=[t for d in deltas for t in d.token_ids],
            logprobs=logprobs,
            text="".join(d.text for d in deltas),
            num_cached_tokens=max(d.num_cached_tokens for d in deltas),
            start=start,
            moved_to=next((d.moved_to for d in reversed(deltas) if d.moved_to), last.moved_to),
            predicted=next((d.predicted for d in deltas if d.predicted), last.predicted),
        )


@dataclass(frozen=True)
class StreamBatch:
    """One message per engine step per client: every delta of that client's requests.
    ``coalesced`` counts the steps merged in because the reader was behind. An empty one is a
    heartbeat; its ``step_age_s`` says how long the engine step running now has been running
    (a live process with a hung engine thread still sends heartbeats, with a growing age)."""

    worker: str
    deltas: list[Delta]
    coalesced: int = 0
    step_age_s: float = 0.0

    def __reduce__(self):
        """Pickled columnar: a step's deltas are mostly a request id, a position and a token
        or two, and a list of hundreds of dataclasses costs the worker's GIL several times
        what these few arrays do (every step, for every client). Order is kept; a delta with
        anything more (text, logprobs, an end, an error, a move, a prediction) goes whole."""
        return _unpack_stream_batch, (
            self.worker,
            _pack(self.deltas),
            self.coalesced,
            self.step_age_s,
        )


def _pack(deltas: list[Delta]) -> tuple:
    ids, rest = [], {}
    index, start, count, tokens = array("q"), array("q"), array("q"), array("q")
    for i, d in enumerate(deltas):
        if not d.plain:
            rest[i] = d
            continue
        ids.append(d.request_id)
        index.append(d.index)
        start.append(d.start)
        count.append(len(d.token_ids))
        tokens.extend(d.token_ids)
    cols = b"".join(a.tobytes() for a in (index, start, count))
    return len(deltas), ids, cols, tokens.tobytes(), rest


def _unpack(packed: tuple) -> list[Delta]:
    n, ids, cols, token_bytes, rest = packed
    m = len(ids)
    flat = array("q")
    flat.frombytes(cols)
    index, start, count = flat[:m], flat[m : 2 * m], flat[2 * m :]
    tokens = array("q")
    tokens.frombytes(token_bytes)
    tokens = tokens.tolist()
    out, j, at = [], 0, 0
    for i in range(n):
        d = rest.get(i)
        if d is None:
            c = count[j]
            d = Delta(ids[j], tokens[at : at + c], index=index[j], start=start[j])
            at += c
            j += 1
        out.append(d)
    return out


def _unpack_stream_batch(worker: str, packed: tuple, coalesced: int, step_age_s: float):
    return StreamBatch(worker, _unpack(packed), coalesced, step_age_s)


def aborted(request_id: str) -> Delta:
    return Delta(request_id, finish_reason="abort")


# -- continuing a request elsewhere ---------------------------------------------------------------


@dataclass(frozen=True)
class RequestSnapshot:
    """Everything needed to continue a request on another worker: the prompt, the tokens
    produced so far (recomputed there as if they were prompt), the sampling parameters and the
    position of the sampler's seeded stream."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    client: str = ""  # the router stream its tokens go to (a live migration keeps it)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# -- live migration (decode worker -> decode worker) ----------------------------------------------


MIGRATION_OUTCOMES = (
    "migrated",  # the request runs on the destination now
    "dest_full",  # the destination had no room (or its one migration slot was taken)
    "dest_failed",  # the destination died, timed out or refused mid-way: the source kept it
    "finished",  # the request finished or was aborted during the migration
    "not_migratable",  # not found, not decoding (waiting, preempted, mid-transfer) or n > 1
    "busy",  # the source sends, or the destination receives, its allowed number already
    "preempted",  # the source preempted it mid-migration (its KV is gone there)
)


@dataclass(frozen=True)
class MigrationResult:
    """How one live migration ended (failure is a value; the request itself never fails
    because a migration did)."""

    request_id: str
    outcome: str  # one of MIGRATION_OUTCOMES
    source: str
    dest: str
    reason: str = ""
    stages: int = 0  # KV copy rounds, the last (paused) one included
    tokens: int = 0  # KV positions copied
    bytes: int = 0  # KV payload bytes copied
    pause_s: float = 0.0  # the request out of every running batch (the last stage)
    seconds: float = 0.0  # the whole migration
    copy_s: float = 0.0  # the copy stages before the last, while it decodes (first to drained)

    @property
    def ok(self) -> bool:
        return self.outcome == "migrated"


# -- membership (controller -> routers) -----------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the controller's membership table has it."""

    name: str  # "prefill-0", "decode-1", "colocated-0"
    role: str  # prefill | decode | colocated
    handle: Any  # its Ray actor handle
    state: WorkerState = WorkerState.ACTIVE
    endpoint: str = ""  # decode: where prefill workers send KV
    index_id: str = ""  # its name in the global prefix index ("" when it publishes nothing)
    pid: int = 0
    max_num_seqs: int = 0  # sequences its engine runs at once (0: not known yet)


@dataclass(frozen=True)
class Membership:
    """A version of the membership table; routers long-poll the controller for newer ones."""

    version: int
    workers: list[WorkerInfo]
    model_dir: str = ""
    block_size: int = 16
    max_model_len: int = 0
    index_url: str | None = None  # the prefix index's Redis (secret inside: never logged)
    index_namespace: str = ""
