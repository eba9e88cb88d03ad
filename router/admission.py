"""The router's admission queue: which request starts next when the decode pool is full.

A request holds a *slot* from admission to its end: one running sequence on a decode (or
colocated) worker. The pool has as many slots as its routable workers' engines run at once
(``max_num_seqs`` each, or ``QueueConfig.slots_per_worker``). While a slot is free and nobody
waits, a request starts at once; otherwise it waits here, in a bounded queue, and the policy
picks who starts when a slot frees::

    fcfs   arrival order
    sjf    the shortest predicted output first (the length predictor's median; without a
           prediction, max_tokens), with aging: each request gets a deadline when it queues,
           ``arrival + min(aging x its FCFS-projected wait, max_wait_s)``, and a request past
           its deadline starts before any other (the earliest deadline first), so no request
           waits much more than ``aging`` times what FCFS would have given it

Waiting in the router rather than in the workers' own queues is what lets the order matter:
the engines admit whatever reaches them in arrival order.

Projection: the queue knows each request's predicted length, what it has produced so far and
measured rates (decode tokens per second per sequence, and the time from a slot to the first
token, both moving averages over finished requests). A new request's *projected wait* is the
moment a slot frees for it when the requests ahead of it (by the policy) run: list scheduling
over the slots, each running request finishing after its predicted remaining tokens. Two
uses::

    the sjf deadline       from the FCFS projection at arrival
    early rejection        ``reject_wait_s`` > 0: a request whose projected wait exceeds it is
                           refused at once (429, Retry-After = the excess), rather than queued
                           to miss its deadline (Mooncake's prediction-based early rejection)

A full queue (``max_queue`` waiting) also answers 429 at once; when the pool has no slot left
at all (every worker dead or suspect) the waiting requests get 503, as a new one would. Until
a first request has finished there are no rates, hence no projection: nothing is rejected
early, and sjf requests queued meanwhile get their deadlines once there are (``max_wait_s``
until then).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.histogram import Buckets
from router.errors import CapacityError, no_live_workers
from router.predictor import QUANTILES, Prediction, kendall_tau

QUEUE_POLICIES = ("fcfs", "sjf")

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# |log2(actual / predicted median)|: 0.5 is within a factor of 1.41, 1 within 2x, ...
ERROR_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class QueueConfig:
    """The router's admission queue (``tandem serve --queue-policy ...``)."""

    policy: str = "fcfs"  # fcfs | sjf
    max_queue: int = 1024  # requests waiting in the router at most; more get 429 at once
    slots_per_worker: int = 0  # running sequences per decode worker; 0: its max_num_seqs
    aging: float = 2.0  # sjf: a request waits at most about this multiple of its FCFS wait
    max_wait_s: float = 120.0  # sjf: ... and never past this before it is served first
    reject_wait_s: float = 0.0  # > 0: refuse a request whose projected wait exceeds this

    def __post_init__(self) -> None:
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {self.policy!r}")
        if self.max_queue < 0 or self.slots_per_worker < 0:
            raise ValueError("max_queue and slots_per_worker must be >= 0")
        if self.aging < 1.0 or self.max_wait_s <= 0 or self.reject_wait_s < 0:
            raise ValueError("aging must be >= 1, max_wait_s > 0 and reject_wait_s >= 0")


@dataclass(eq=False)
class Ticket:
    """One request's place: queued, then holding a slot until ``Admission.release``."""

    request_id: str
    predicted: Prediction | None
    max_tokens: int | None
    arrival: float
    key: float  # sjf order: the predicted output tokens
    admitted_median: float | None = None  # the router's median at admission (quality metrics)
    deadline: float = math.inf  # sjf: past this it starts before anyone else
    projected: bool = False  # its deadline came from a projection (not the cap alone)
    granted_at: float | None = None
    first_token_at: float | None = None
    produced: int = 0  # output tokens so far
    worker: str = ""  # the decode worker it was placed on
    refined: tuple[float, float, float] | None = None  # the engine's probe (p50, p90, p99)
    _grant: asyncio.Future | None = field(default=None, repr=False)

    def remaining(self) -> float:
        """Predicted output tokens still to come, updated as tokens arrive: the median of the
        predicted length distribution given that the request has produced ``produced`` and
        goes on (a request past its median is likely a long one); past every quantile, half
        as many again as it has. At most max_tokens."""
        cap = float(self.max_tokens) if self.max_tokens else math.inf
        if self.predicted is None:
            total = cap if self.max_tokens else 2.0 * max(self.produced, 16)
        else:
            given = self.predicted.median_given(self.produced)
            total = given if given is not None else 1.5 * self.produced + 1
        return max(min(total, cap) - self.produced, 1.0)


class _Rates:
    """Moving averages over finished requests: decode tokens/s of one sequence, and the time
    from a slot to the first token (prefill, transfer, dispatch)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.tokens_per_s: float | None = None
        self.first_token_s: float | None = None

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def finished(self, t: Ticket, now: float) -> None:
        if t.granted_at is None or t.first_token_at is None:
            return
        self.first_token_s = self._avg(self.first_token_s, t.first_token_at - t.granted_at)
        decode_s = now - t.first_token_at
        if t.produced >= 2 and decode_s > 0:
            self.tokens_per_s = self._avg(self.tokens_per_s, (t.produced - 1) / decode_s)

    @property
    def known(self) -> bool:
        return self.tokens_per_s is not None and self.first_token_s is not None

    def service_s(self, tokens: float) -> float:
        return self.first_token_s + tokens / self.tokens_per_s


def _snapshot(h: Buckets) -> dict:
    return {"buckets": h.pairs(), "sum": h.total}


class PredictionQuality:
    """How the predictions at admission compare with the lengths requests really had: the
    error histogram and Kendall's tau over the last ``window`` finished requests."""

    def __init__(self, window: int = 500) -> None:
        self.pairs: deque[tuple[float, int]] = deque(maxlen=window)
        self.error = Buckets(ERROR_BUCKETS)

    def observe(self, predicted: float, actual: int) -> None:
        self.pairs.append((predicted, actual))
        self.error.observe(abs(math.log2(max(actual, 1) / max(predicted, 1.0))))

    def tau(self) -> float | None:
        if len(self.pairs) < 20:
            return None
        pred, actual = zip(*self.pairs, strict=True)
        return kendall_tau(pred, actual)


TAIL_TTL_S = 0.05  # sjf: how long a projection of the queue's tail is reused


@dataclass(eq=False)
class _Tail:
    """The seconds from ``at`` at which each slot frees once every queued request started."""

    heap: list[float]
    at: float
    version: tuple[int, int, int]  # (Admission._version, capacity, queued) it was made for


class Admission:
    """The queue and the slots. ``capacity()`` answers the pool's slots now (it follows the
    membership); every method runs on the router's event loop."""

    def __init__(
        self,
        cfg: QueueConfig,
        capacity: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.clock = clock
        self.rates = _Rates()
        self.running: set[Ticket] = set()
        self.queue: dict[Ticket, None] = {}  # arrival order
        # sjf: the slots' heap after the queue (_fcfs_start), and a count of the changes other
        # than arrivals that make it stale
        self._tail: _Tail | None = None
        self._version = 0
        self.admitted = 0
        self.queued_total = 0  # requests that had to wait
        self.rejected: dict[str, int] = {"queue_full": 0, "projected_wait": 0}
        self.aged = 0  # sjf: started because their deadline passed
        self.wait = Buckets(WAIT_BUCKETS)
        self.quality = PredictionQuality()  # the router's prediction at admission
        self.refined_quality = PredictionQuality()  # the engine's, after the prefill

    # -- the request's side --------------------------------------------------------------------

    async def acquire(
        self, request_id: str, predicted: Prediction | None, max_tokens: int | None
    ) -> Ticket:
        """A slot for the request: at once, after waiting its turn, or CapacityError (429 with a
        Retry-After) when the queue is full or the projected wait exceeds ``reject_wait_s``.
        Cancelled while waiting: it leaves the queue."""
        now = self.clock()
        key = predicted.median if predicted is not None else float(max_tokens or 1 << 20)
        t = Ticket(request_id, predicted, max_tokens, now, key)
        t.admitted_median = predicted.median if predicted is not None else None
        if self.cfg.reject_wait_s > 0:
            wait = self.projected_wait(t)
            if wait is not None and wait > self.cfg.reject_wait_s:
                self.rejected["projected_wait"] += 1
                raise CapacityError(
                    f"the projected wait for a slot is {wait:.1f} s, over this server's "
                    f"bound of {self.cfg.reject_wait_s:g} s",
                    retry_after_s=wait - self.cfg.reject_wait_s,
                    status=429,
                )
        if not self.queue and len(self.running) < self.capacity():
            self._start(t, now)
            return t
        if len(self.queue) >= self.cfg.max_queue:
            self.rejected["queue_full"] += 1
            wait = self.projected_wait(t)
            raise CapacityError(
                f"the router's queue is full ({self.cfg.max_queue} requests waiting)",
                retry_after_s=wait if wait is not None else 1.0,
                status=429,
            )
        if self.cfg.policy == "sjf":
            fcfs = self._fcfs_start(t)
            limit = self.cfg.max_wait_s if fcfs is None else self.cfg.aging * fcfs
            t.deadline = now + min(limit, self.cfg.max_wait_s)
            t.projected = fcfs is not None
        t._grant = asyncio.get_running_loop().create_future()
        self.queue[t] = None
        self.queued_total += 1
        self._pump()  # capacity may have grown since the last release
        try:
            await t._grant
        except BaseException:
            self._version += 1
            if self.queue.pop(t, None) is None and t in self.running:
                self.release(t)  # granted as it was cancelled: give the slot back
            raise
        return t

    def first_token(self, t: Ticket) -> None:
        if t.first_token_at is None:
            t.first_token_at = self.clock()

    def refine(self, t: Ticket, quantiles: tuple[float, float, float]) -> None:
        """The engine's estimate after the prefill (its length probe on the model's own hidden
        state) replaces the router's for the rest of the request (its remaining work)."""
        t.refined = tuple(float(q) for q in quantiles)
        t.predicted = Prediction(dict(zip(QUANTILES, t.refined, strict=True))).capped(t.max_tokens)

    def release(self, t: Ticket, actual: int | None = None) -> None:
        """The request ended (idempotent). ``actual``: its output length when it finished
        normally (recorded against its prediction)."""
        if t not in self.running:
            return
        self.running.discard(t)
        self._version += 1
        now = self.clock()
        self.rates.finished(t, now)
        if actual is not None and t.admitted_median is not None:
            self.quality.observe(t.admitted_median, actual)
        if actual is not None and t.refined is not None:
            self.refined_quality.observe(t.predicted.median, actual)
        self._pump()

    def kick(self) -> None:
        """The pool may have grown (a worker joined): start whoever fits now."""
        self._pump()

    # -- projection ----------------------------------------------------------------------------

    def ahead_of(self, t: Ticket) -> list[Ticket]:
        """The queued requests that start before ``t`` under the policy, in that order."""
        if self.cfg.policy == "fcfs":
            return list(self.queue)
        now = self.clock()
        due = sorted((q for q in self.queue if q.deadline <= now), key=lambda q: q.deadline)
        shorter = sorted(
            (
                q
                for q in self.queue
                if q.deadline > now and (q.key, q.arrival) <= (t.key, t.arrival)
            ),
            key=lambda q: (q.key, q.arrival),
        )
        return due + shorter

    def projected_wait(self, t: Ticket) -> float | None:
        """Seconds until a slot frees for ``t`` under the policy (None: no rates yet)."""
        return self._project(t, self.ahead_of(t))

    def _fcfs_start(self, t: Ticket) -> float | None:
        """``_project(t, queue)``, the FCFS projection of ``t`` joining the queue's tail, without
        walking every running and queued request for each arrival (a burst queued under sjf
        was quadratic): the slots' heap after the queue is kept while only arrivals change it
        (no start, no release, no leaving the queue, the same capacity, within
        ``TAIL_TTL_S``), and ``t`` is added to it here."""
        now, capacity = self.clock(), self.capacity()
        tail = self._tail
        if (
            tail is None
            or tail.version != (self._version, capacity, len(self.queue))
            or now - tail.at > TAIL_TTL_S
        ):
            if not self.queue and len(self.running) < capacity:
                self._tail = None
                return 0.0
            heap = self._heap_after(self.queue)
            if heap is None:
                self._tail = None
                return None
            tail = self._tail = _Tail(heap, now, (self._version, capacity, len(self.queue)))
        elapsed = now - tail.at
        start = max(tail.heap[0], elapsed)  # (a slot that freed meanwhile frees now)
        heapq.heapreplace(tail.heap, start + self.rates.service_s(t.remaining()))
        start -= elapsed
        tail.version = (self._version, capacity, len(self.queue) + 1)  # t joins the queue next
        return start

    def _project(self, t: Ticket, ahead: list[Ticket]) -> float | None:
        if not ahead and len(self.running) < self.capacity():
            return 0.0
        heap = self._heap_after(ahead)
        return None if heap is None else heap[0]

    def _heap_after(self, ahead: Iterable[Ticket]) -> list[float] | None:
        """List scheduling: the seconds from now at which each slot frees once ``ahead`` has
        started, in order, each in the first slot to free (None: no rates yet)."""
        heap = self._slots_free()
        if heap is None:
            return None
        for q in ahead:
            heapq.heapreplace(heap, heap[0] + self.rates.service_s(q.remaining()))
        return heap

    def _slots_free(self) -> list[float] | None:
        """A heap of the seconds from now at which each slot frees (None: no rates yet)."""
        slots, rates = self.capacity(), self.rates
        if not rates.known or slots < 1:
            return None
        now = self.clock()
        ends = []
        for r in self.running:
            left = r.remaining() / rates.tokens_per_s
            if r.first_token_at is None:  # still in prefill
                left += max(rates.first_token_s - (now - (r.granted_at or now)), 0.0)
            ends.append(left)
        ends.sort()
        # more running than slots (a worker left): the first few ends free nothing usable
        free = ends[len(ends) - slots :] if len(ends) >= slots else [0.0] * (slots - len(ends))
        heap = free if len(ends) >= slots else free + ends
        heapq.heapify(heap)
        return heap

    def _project_deadlines(self, now: float) -> None:
        """sjf: requests that queued before there were rates (a fresh router under a burst)
        got the cap as their deadline; once there are rates, each gets ``aging`` times what
        FCFS gives it (waited so far + its FCFS-projected start from now): one list-scheduling
        pass over the queue in arrival order."""
        if self.cfg.policy != "sjf" or all(q.projected for q in self.queue):
            return
        heap = self._slots_free()
        if heap is None:
            return
        for q in self.queue:
            start = heapq.heappop(heap)
            if not q.projected:
                fcfs = (now - q.arrival) + start
                q.deadline = q.arrival + min(self.cfg.aging * fcfs, self.cfg.max_wait_s)
                q.projected = True
            heapq.heappush(heap, start + self.rates.service_s(q.remaining()))

    # -- internals -----------------------------------------------------------------------------

    def _start(self, t: Ticket, now: float) -> None:
        t.granted_at = now
        self.running.add(t)
        self._version += 1
        self.admitted += 1
        self.wait.observe(now - t.arrival)

    def _next(self, now: float) -> Ticket:
        if self.cfg.policy == "fcfs":
            return next(iter(self.queue))
        due = [q for q in self.queue if q.deadline <= now]
        if due:
            self.aged += 1
            return min(due, key=lambda q: q.deadline)
        return min(self.queue, key=lambda q: (q.key, q.arrival))

    def _pump(self) -> None:
        now = self.clock()
        if self.queue and self.capacity() < 1:  # no worker left to wait for: as a new arrival
            self._version += 1
            for t in list(self.queue):
                del self.queue[t]
                if t._grant is not None and not t._grant.done():
                    t._grant.set_exception(no_live_workers())
            return
        self._project_deadlines(now)
        while self.queue and len(self.running) < self.capacity():
            t = self._next(now)
            del self.queue[t]
            self._start(t, now)
            if t._grant is not None and not t._grant.done():
                t._grant.set_result(None)

    def stats(self) -> dict:
        rates = self.rates
        return {
            "policy": self.cfg.policy,
            "capacity": self.capacity(),
            "running": len(self.running),
            "queued": len(self.queue),
            "admitted": self.admitted,
            "queued_total": self.queued_total,
            "aged": self.aged,
            "rejected": dict(self.rejected),
            "wait": _snapshot(self.wait),
            "tokens_per_s": rates.tokens_per_s,
            "first_token_s": rates.first_token_s,
            "prediction_error": _snapshot(self.quality.error),
            "prediction_tau": self.quality.tau(),
            "predictions_observed": len(self.quality.pairs),
            "refined_error": _snapshot(self.refined_quality.error),
            "refined_tau": self.refined_quality.tau(),
            "refined_observed": len(self.refined_quality.pairs),
        }
