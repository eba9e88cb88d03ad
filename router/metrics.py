"""Prometheus metrics of one gateway: vLLM's names with a ``tandem:`` prefix.

Two sources, one scrape::

    GatewayMetrics.registry     the gateway's own series, updated as requests run:
                                latency histograms (TTFT, inter-token, end to end), token and
                                request counters, rejections by reason, requests in flight
    scrape-time snapshot        read from the backend when /metrics is asked: the router's
                                counters (``router_stats()``) and per-worker gauges and counters
                                (``await worker_stats()``), rendered from a collector built for
                                that one scrape (the backend owns those counts)

Each app has its own ``CollectorRegistry``, so many apps (tests) never clash on names.
Latencies are measured at the gateway: TTFT from the request's arrival (body read, template,
tokenization and routing included) to the first generated token; inter-token latency is each
gap between outputs divided over the tokens it brought (per sequence, the longest across ``n``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from engine.aio import within
from router.outputs import Step

logger = logging.getLogger("tandem.gateway")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

WORKER_STATS_TIMEOUT_S = 5.0
"""A scrape renders without worker series rather than hang on a stuck backend."""


class GatewayMetrics:
    """The gateway's series in a registry of its own; ``render`` adds the backend's. Every series
    carries vLLM's ``model_name`` label (dashboards built for vLLM select on it)."""

    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Arrival at the gateway to the first generated token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between generated tokens of a sequence.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Arrival at the gateway to the last token, for requests that finished.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._success = Counter(
            "tandem:request_success_total",
            "Finished sequences (one per choice) by finish reason.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens_total", "Prompt tokens of started requests.", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "tandem:generation_tokens_total", "Generated tokens, all choices.", m, registry=r
        ).labels(model_name)
        self._rejected = Counter(
            "tandem:request_rejected_total",
            "Requests refused before generating (invalid, auth, too_large, model_not_found, "
            "overloaded, concurrency_limit).",
            [*m, "reason"],
            registry=r,
        )
        self._structured = Counter(
            "tandem:structured_output_requests_total",
            "Requests with a structured-output constraint, by kind (json_schema, "
            "json_object, regex, choice).",
            [*m, "kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tandem:gateway_requests_in_flight",
            "Completion requests admitted by the gateway and not yet answered.",
            m,
            registry=r,
        ).labels(model_name)

    def reject(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def structured(self, kind: str) -> None:
        self._structured.labels(self.model_name, kind).inc()

    def finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason).inc()

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    async def render(self, backend: Any) -> bytes:
        """Prometheus text of the gateway's series plus a snapshot of the backend's."""
        try:
            workers = await within(backend.worker_stats(), WORKER_STATS_TIMEOUT_S)
        except Exception:
            logger.warning("worker_stats failed; scraping without worker series", exc_info=True)
            workers = []
        try:
            router = backend.router_stats()
        except Exception:
            logger.warning("router_stats failed; scraping without router series", exc_info=True)
            router = None
        snapshot = CollectorRegistry(auto_describe=False)
        snapshot.register(BackendCollector(workers, router, self.model_name))
        return generate_latest(self.registry) + generate_latest(snapshot)


class RequestTimer:
    """Feeds one request's steps into the latency and token series."""

    def __init__(self, metrics: GatewayMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last: float | None = None  # time of the last step that brought tokens
        self._reasons: dict[int, str] = {}  # how each choice finished
        self._started = False
        self.finished = False

    def observe(self, step: Step) -> None:
        now = time.monotonic()
        if not self._started:
            self._started = True
            self._m.prompt_tokens.inc(step.usage.prompt_tokens)
        new = {}
        for c in step.choices:
            if c.token_ids:
                new[c.index] = len(c.token_ids)
            if c.finish_reason is not None:
                self._reasons[c.index] = c.finish_reason
        if not new:
            return
        self._m.generation_tokens.inc(sum(new.values()))
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
        else:
            steps = max(new.values())
            for _ in range(steps):
                self._m.itl.observe((now - self._last) / steps)
        self._last = now

    def finish(self) -> None:
        """A request that ended with every choice ``stop`` or ``length``."""
        if self.finished:
            return
        self.finished = True
        self._m.e2e.observe(time.monotonic() - self._arrival)
        for i in sorted(self._reasons):
            self._m.finished(self._reasons[i])


WORKER_STATES = ("starting", "active", "suspect", "draining", "dead")


class BackendCollector:
    """One scrape's view of the backend: router counters and per-worker series."""

    def __init__(self, workers: list[dict[str, Any]], router: Any, model_name: str = "") -> None:
        self._workers = workers
        self._router = router
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        yield from self._router_metrics()
        yield from self._scheduling_metrics()
        yield from self._control_metrics()
        yield from self._worker_metrics()

    def _control_metrics(self) -> Iterator[Metric]:
        """The controller's autoscaler, as this router last heard of it (``control``). Every
        gateway exports the same cluster-wide counts: aggregate across gateways with max, not
        sum."""
        c = getattr(self._router, "control", None) or {}
        decisions = CounterMetricFamily(
            "tandem:scaling_decisions",
            "The autoscaler's decisions, by pool, direction (out, in) and the signal that "
            "drove it (queue, ttft, slots, kv, demand, itl, min_replicas, max_replicas).",
            labels=["model_name", "role", "direction", "reason"],
        )
        replicas = GaugeMetricFamily(
            "tandem:pool_replicas",
            "Live workers (starting, active, suspect, draining) of each pool.",
            labels=["model_name", "role"],
        )
        pressure = GaugeMetricFamily(
            "tandem:autoscaler_pressure",
            "Each pool's pressures at the autoscaler's latest look (1.0: at its target; above "
            "the high mark it grows, below the low mark with a worker fewer it shrinks).",
            labels=["model_name", "role", "signal"],
        )
        for row in c.get("counts", []):
            decisions.add_metric(
                [self._model, row["role"], row["direction"], row["reason"]], row["count"]
            )
        for role, n in sorted(c.get("pools", {}).items()):
            replicas.add_metric([self._model, role], n)
        for role, look in sorted(c.get("latest", {}).items()):
            for signal, value in sorted(look.get("pressures", {}).items()):
                pressure.add_metric([self._model, role, signal], value)
        yield from (decisions, replicas, pressure)

    def _scheduling_metrics(self) -> Iterator[Metric]:
        """The admission queue and the length predictor (router/admission.py ``stats()``)."""
        s = getattr(self._router, "scheduling", None)
        if not s:
            return
        m, pol = [self._model], [self._model, s["policy"]]
        gauges = (
            ("tandem:queue_waiting", "Requests waiting in the router for a slot.", "queued"),
            ("tandem:queue_running", "Requests holding a slot (placed, not finished).", "running"),
            (
                "tandem:queue_slots",
                "Slots of the decode pool (running sequences at once).",
                "capacity",
            ),
        )
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name", "policy"])
            g.add_metric(pol, float(s[key]))
            yield g
        wait = HistogramMetricFamily(
            "tandem:queue_wait_seconds",
            "Arrival at the router to a slot, by queue policy (0 when one was free).",
            labels=["model_name", "policy"],
        )
        wait.add_metric(pol, _cumulative(s["wait"]["buckets"]), s["wait"]["sum"])
        rejected = CounterMetricFamily(
            "tandem:early_rejections",
            "Requests refused at admission: the queue full, or a projected wait over the bound.",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(s["rejected"].items()):
            rejected.add_metric([self._model, reason], count)
        aged = CounterMetricFamily(
            "tandem:queue_aged",
            "sjf: requests started ahead of shorter ones because their deadline passed.",
            labels=["model_name"],
        )
        aged.add_metric(m, s["aged"])
        error = HistogramMetricFamily(
            "tandem:length_prediction_error",
            "|log2(actual / predicted median)| of finished requests' output lengths.",
            labels=["model_name", "predictor"],
        )
        tau = GaugeMetricFamily(
            "tandem:length_prediction_tau",
            "Kendall's tau of predicted vs actual output lengths, last finished requests.",
            labels=["model_name", "predictor"],
        )
        # the router's prediction at admission, and the engine probe's after the prefill
        for label, prefix in ((s["predictor"], "prediction"), ("engine_probe", "refined")):
            e = s.get(f"{prefix}_error")
            if e is None or (prefix == "refined" and not s.get("refined_observed")):
                continue
            error.add_metric([self._model, label], _cumulative(e["buckets"]), e["sum"])
            if s.get(f"{prefix}_tau") is not None:
                tau.add_metric([self._model, label], s[f"{prefix}_tau"])
        yield from (wait, rejected, aged, error, tau)

    def _router_metrics(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "tandem:routing_decisions",
            "Placements by routing reason.",
            labels=["model_name", "reason"],
        )
        unavailable = CounterMetricFamily(
            "tandem:prefix_index_unavailable",
            "Prefix-index lookups that fell back to load-only routing.",
            labels=["model_name"],
        )
        resumes = CounterMetricFamily(
            "tandem:request_resumes",
            "Requests continued on another worker after theirs failed mid-stream, by reason.",
            labels=["model_name", "reason"],
        )
        state = GaugeMetricFamily(
            "tandem:worker_state",
            "1 for each worker's current state as this router acts on it.",
            labels=["model_name", "worker", "state"],
        )
        missed = GaugeMetricFamily(
            "tandem:worker_missed_polls",
            "Consecutive health polls a worker did not answer in time.",
            labels=["model_name", "worker"],
        )
        migrations = CounterMetricFamily(
            "tandem:request_migrations",
            "Requests of this router moved live to another decode worker.",
            labels=["model_name"],
        )
        router = self._router
        if router is not None:
            for reason, count in sorted(router.decisions.items()):
                decisions.add_metric([self._model, reason], count)
            unavailable.add_metric([self._model], router.index_unavailable)
            for reason, count in sorted(router.resumes.items()):
                resumes.add_metric([self._model, reason], count)
            for worker, st in sorted(router.worker_states.items()):
                for s in WORKER_STATES:
                    state.add_metric([self._model, worker, s], float(s == st))
                missed.add_metric([self._model, worker], router.missed_polls.get(worker, 0))
            _add(migrations, [self._model], getattr(router, "migrations", None))
        yield from (decisions, unavailable, resumes, state, missed, migrations)

    def _worker_metrics(self) -> Iterator[Metric]:
        w = ["model_name", "worker"]
        running = GaugeMetricFamily("tandem:num_requests_running", "Requests running.", labels=w)
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting.", labels=w)
        usage = GaugeMetricFamily(
            "tandem:kv_cache_usage_perc", "KV blocks in use / total (0 to 1).", labels=w
        )
        queries = CounterMetricFamily(
            "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=w
        )
        hits = CounterMetricFamily(
            "tandem:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels=w
        )
        kv_bytes = CounterMetricFamily(
            "tandem:kv_transfer_bytes",
            "KV bytes moved between workers.",
            labels=[*w, "direction"],
        )
        kv_seconds = CounterMetricFamily(
            "tandem:kv_transfer_seconds", "Time spent moving KV.", labels=w
        )
        tail = CounterMetricFamily(
            "tandem:kv_transfer_tail_seconds",
            "A decode worker's prefill transfers: from the prefill's first token to every KV "
            "layer in, the stream's share of TTFT (summed; tandem:kv_transfers_in counts them).",
            labels=w,
        )
        transfers = CounterMetricFamily(
            "tandem:kv_transfers_in", "Prefill KV transfers a decode worker completed.", labels=w
        )
        staged = GaugeMetricFamily(
            "tandem:kv_staged_bytes",
            "KV a tensor-parallel decode worker's rank 0 holds for transfers still arriving "
            "(every head, outside the pool; bounded by KVLimits.max_staged_bytes).",
            labels=w,
        )
        for i, s in enumerate(self._workers):
            name = [self._model, str(s.get("name", f"worker-{i}"))]
            _add(running, name, s.get("running"))
            _add(waiting, name, s.get("waiting"))
            total, in_use = s.get("total_blocks"), s.get("in_use_blocks")
            if total and in_use is not None:
                usage.add_metric(name, in_use / total)
            _add(queries, name, s.get("prefix_queries_tokens"))
            _add(hits, name, s.get("prefix_hit_tokens"))
            _add(kv_bytes, [*name, "sent"], s.get("kv_bytes_sent"))
            _add(kv_bytes, [*name, "received"], s.get("kv_bytes_received"))
            _add(kv_seconds, name, s.get("kv_transfer_seconds"))
            _add(staged, name, s.get("kv_staged_bytes"))
            _add(tail, name, s.get("kv_transfer_tail_seconds"))
            _add(transfers, name, s.get("kv_transfers_in"))
        yield from (running, waiting, usage, queries, hits, kv_bytes, kv_seconds, staged)
        yield from (tail, transfers)
        yield from self._migration_metrics()
        yield from self._tier_metrics()
        yield from self._grammar_metrics()

    def _grammar_metrics(self) -> Iterator[Metric]:
        """Structured outputs on each worker, from ``stats()["grammar"]``
        (``LLMEngine.grammar_stats``); a worker that has had no constrained request adds no
        series."""
        w = ["model_name", "worker"]
        compile_time = HistogramMetricFamily(
            "tandem:grammar_compile_seconds",
            "Grammar compiles on the worker (cache misses), off its engine thread.",
            labels=w,
        )
        mask_time = HistogramMetricFamily(
            "tandem:grammar_mask_seconds",
            "Per engine step with constrained rows: filling their token bitmasks on the host "
            "and queuing the mask on the logits.",
            labels=w,
        )
        errors = CounterMetricFamily(
            "tandem:grammar_errors",
            "Requests ended by their grammar's failure (a spec that did not compile on the "
            "worker, a refused token, a matcher in error); each failed alone.",
            labels=w,
        )
        for i, s in enumerate(self._workers):
            g = s.get("grammar")
            if not isinstance(g, dict):
                continue
            name = [self._model, str(s.get("name", f"worker-{i}"))]
            compile_time.add_metric(name, _cumulative(g["compile_buckets"]), g["compile_sum"])
            mask_time.add_metric(name, _cumulative(g["mask_buckets"]), g["mask_sum"])
            _add(errors, name, g["errors"])
        yield from (compile_time, mask_time, errors)

    def _tier_metrics(self) -> Iterator[Metric]:
        """The KV tiers below each worker's pool, from ``stats()["kv_tiers"]`` (engine.kv_tiers
        ``KVTiers.snapshot``); a worker without tiers adds no series."""
        w = ["model_name", "worker", "tier"]
        used = GaugeMetricFamily(
            "tandem:kv_tier_used_bytes", "Bytes a KV tier below the pool holds.", labels=w
        )
        hits = CounterMetricFamily(
            "tandem:kv_tier_hits", "KV blocks loaded from a lower tier into the pool.", labels=w
        )
        stored = CounterMetricFamily(
            "tandem:kv_tier_stored", "KV blocks written into a lower tier.", labels=w
        )
        evicted = CounterMetricFamily(
            "tandem:kv_tier_evictions", "KV blocks a lower tier dropped (LRU).", labels=w
        )
        moved = CounterMetricFamily(
            "tandem:kv_tier_bytes",
            "KV bytes moved between the pool and the tiers below it (down: pool to host; up: "
            "host to pool; disk_read: read from disk files).",
            labels=["model_name", "worker", "direction"],
        )
        loads = CounterMetricFamily(
            "tandem:kv_tier_loads", "Prefix loads from the tiers below the pool.", labels=w[:2]
        )
        load_time = CounterMetricFamily(
            "tandem:kv_tier_load_seconds",
            "Time requests waited in LOADING for their prefix to come up.",
            labels=w[:2],
        )
        preempt = CounterMetricFamily(
            "tandem:kv_preemptions",
            "Preemptions by how the victim's KV comes back: swap (loaded from a tier below, "
            "cheaper than recompute) or recompute.",
            labels=["model_name", "worker", "mode"],
        )
        for i, s in enumerate(self._workers):
            t = s.get("kv_tiers")
            if not isinstance(t, dict):
                continue
            name = [self._model, str(s.get("name", f"worker-{i}"))]
            host, disk = t["host"], t.get("disk")
            _add(used, [*name, "host"], host["used_bytes"])
            for tier, d in (("host", host), ("disk", disk)):
                if d is None:
                    continue
                _add(hits, [*name, tier], d["hits"])
                _add(stored, [*name, tier], d["stored"])
                _add(evicted, [*name, tier], d["evictions"])
            if disk is not None:
                _add(used, [*name, "disk"], disk["used_bytes"])
                _add(moved, [*name, "disk_read"], disk["bytes_read"])
            _add(moved, [*name, "down"], host["bytes_in"])
            _add(moved, [*name, "up"], host["bytes_out"])
            _add(loads, name, t["loads"])
            _add(load_time, name, t["load_time_s"])
            _add(preempt, [*name, "swap"], t["preempt_swapped"])
            _add(preempt, [*name, "recompute"], t["preempt_recomputed"])
        yield from (used, hits, stored, evicted, moved, loads, load_time, preempt)

    def _migration_metrics(self) -> Iterator[Metric]:
        """Live migration, from each decode worker's ``stats()["migrations"]`` (a worker
        without it, or without a key of it, adds no series)."""
        w = ["model_name", "worker"]
        moves = CounterMetricFamily(
            "tandem:migrations",
            "Live migrations by direction (out: this worker the source, in: the destination) "
            "and outcome.",
            labels=[*w, "direction", "outcome"],
        )
        kv_bytes = CounterMetricFamily(
            "tandem:migration_kv_bytes", "KV bytes copied out by live migrations.", labels=w
        )
        kv_blocks = CounterMetricFamily(
            "tandem:migration_kv_blocks", "KV blocks copied out by live migrations.", labels=w
        )
        stages = CounterMetricFamily(
            "tandem:migration_stages",
            "KV copy rounds of live migrations (the last, paused one included).",
            labels=w,
        )
        downtime = HistogramMetricFamily(
            "tandem:migration_downtime_seconds",
            "Time a migrating request was out of every running batch (its last copy round).",
            labels=w,
        )
        reasons = CounterMetricFamily(
            "tandem:migrations_by_reason",
            "Completed live migrations out of the worker by who asked: admin, drain, rebalance, "
            "preemption (a rebalance move from a worker projected past its whole KV pool).",
            labels=[*w, "reason"],
        )
        avoided = CounterMetricFamily(
            "tandem:migration_preemptions_avoided",
            "Rebalance moves away from a worker projected past its whole KV pool.",
            labels=w,
        )
        projected = GaugeMetricFamily(
            "tandem:kv_projected_blocks",
            "KV blocks the worker's requests will hold when they finish (what rebalance uses).",
            labels=w,
        )
        for i, s in enumerate(self._workers):
            name = [self._model, str(s.get("name", f"worker-{i}"))]
            _add(projected, name, s.get("projected_blocks"))
            m = s.get("migrations")
            if not isinstance(m, dict):
                continue
            for direction in ("out", "in"):
                for outcome, count in sorted((m.get(direction) or {}).items()):
                    moves.add_metric([*name, direction, str(outcome)], float(count))
            for reason, count in sorted((m.get("reasons") or {}).items()):
                reasons.add_metric([*name, str(reason)], float(count))
            if m.get("reasons") is not None:
                avoided.add_metric(name, float(m["reasons"].get("preemption", 0)))
            _add(kv_bytes, name, m.get("bytes"))
            _add(kv_blocks, name, m.get("blocks"))
            _add(stages, name, m.get("stages"))
            if m.get("pause_buckets"):
                buckets = _cumulative(m["pause_buckets"])
                total = m.get("pause_sum")
                downtime.add_metric(name, buckets, None if total is None else float(total))
        yield from (moves, reasons, avoided, kv_bytes, kv_blocks, stages, downtime, projected)


def _add(family: Metric, labels: list[str], value: Any) -> None:
    if value is not None:
        family.add_metric(labels, float(value))


def _cumulative(counts: list[tuple[float, int]]) -> list[tuple[str, float]]:
    """Prometheus buckets from per-bucket counts ``[(upper bound, count), ...]``: each ``le``
    counts everything at or below it, and the last is ``+Inf`` (the total)."""
    buckets, total = [], 0.0
    for bound, count in sorted(counts, key=lambda bc: float(bc[0])):
        total += float(count)
        if not math.isinf(float(bound)):
            buckets.append((floatToGoString(float(bound)), total))
    buckets.append(("+Inf", total))
    return buckets
