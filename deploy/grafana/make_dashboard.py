"""Write deploy/grafana/tandem.json, the Grafana dashboard over the gateway's ``/metrics``.

    python deploy/grafana/make_dashboard.py          # rewrite tandem.json from this file
    python deploy/grafana/make_dashboard.py --check  # exit 1 if tandem.json differs

This file is the dashboard's source: edit the panels here, run it, commit both. Every series a
query names is one tandem exports (router/metrics.py), which tests/test_deploy.py checks. The
controller's series (scaling decisions, pool sizes, autoscaler pressures) reach /metrics through
every gateway alike: the panels take ``max`` over gateways, never ``sum``.

Variables: ``datasource`` (a Prometheus), ``model_name`` (every tandem series carries it) and
``worker`` (per-worker panels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("tandem.json")
M = 'model_name="$model_name"'
MW = f'{M}, worker=~"$worker"'
RATE = "[$__rate_interval]"
SCALING_METRIC = "tandem:scaling_decisions_total"  # the controller's autoscaler


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list:
    """histogram_quantile targets of a histogram, one per quantile (``by``: extra labels)."""
    group = f"le, {by}" if by else "le"
    suffix = " {{" + by + "}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{M}}}{RATE})))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in qs
    ]


def panel(title: str, targets: list, unit: str = "short", desc: str = "", kind: str = "timeseries"):
    return {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


ROWS: list[tuple[str, list[dict]]] = [
    (
        "Latency",
        [
            panel(
                "Time to first token",
                quantiles("tandem:time_to_first_token_seconds"),
                "s",
                "Arrival at the gateway to the first generated token (tokenization, queueing, "
                "routing and prefill included).",
            ),
            panel(
                "Inter-token latency",
                quantiles("tandem:inter_token_latency_seconds"),
                "s",
                "Time between generated tokens of a sequence.",
            ),
            panel(
                "TPOT (mean time per output token)",
                [
                    (
                        f"sum(rate(tandem:inter_token_latency_seconds_sum{{{M}}}{RATE})) / "
                        f"sum(rate(tandem:inter_token_latency_seconds_count{{{M}}}{RATE}))",
                        "TPOT",
                    )
                ],
                "s",
                "Mean inter-token latency: the time per output token after the first.",
            ),
            panel(
                "End-to-end latency",
                quantiles("tandem:e2e_request_latency_seconds"),
                "s",
                "Arrival to the last token, finished requests.",
            ),
        ],
    ),
    (
        "Throughput",
        [
            panel(
                "Tokens per second",
                [
                    (f"sum(rate(tandem:generation_tokens_total{{{M}}}{RATE}))", "output"),
                    (f"sum(rate(tandem:prompt_tokens_total{{{M}}}{RATE}))", "prompt"),
                ],
                "short",
            ),
            panel(
                "Finished sequences per second",
                [
                    (
                        f"sum by (finished_reason) (rate(tandem:request_success_total{{{M}}}"
                        f"{RATE}))",
                        "{{finished_reason}}",
                    )
                ],
                "reqps",
            ),
            panel(
                "Requests in flight (gateway)",
                [(f"sum(tandem:gateway_requests_in_flight{{{M}}})", "in flight")],
            ),
            panel(
                "Workers by state",
                [
                    (
                        f"count by (state) (tandem:worker_state{{{M}}} == 1)",
                        "{{state}}",
                    )
                ],
                desc="Workers in each state as the router acts on them (active, suspect, "
                "draining, dead, starting).",
            ),
        ],
    ),
    (
        "Workers and KV cache",
        [
            panel(
                "KV cache use per worker",
                [(f"tandem:kv_cache_usage_perc{{{MW}}}", "{{worker}}")],
                "percentunit",
                "KV blocks in use over the pool, per worker.",
            ),
            panel(
                "Running and waiting per worker",
                [
                    (f"tandem:num_requests_running{{{MW}}}", "{{worker}} running"),
                    (f"tandem:num_requests_waiting{{{MW}}}", "{{worker}} waiting"),
                ],
            ),
            panel(
                "Prefix cache hit rate",
                [
                    (
                        f"sum by (worker) (rate(tandem:prefix_cache_hits_total{{{MW}}}{RATE})) / "
                        f"sum by (worker) (rate(tandem:prefix_cache_queries_total{{{MW}}}{RATE}))",
                        "{{worker}}",
                    ),
                    (
                        f"sum(rate(tandem:prefix_cache_hits_total{{{M}}}{RATE})) / "
                        f"sum(rate(tandem:prefix_cache_queries_total{{{M}}}{RATE}))",
                        "all workers",
                    ),
                ],
                "percentunit",
                "Prompt tokens served from the prefix cache over prompt tokens looked up.",
            ),
            panel(
                "KV transfer",
                [
                    (
                        f"sum by (worker, direction) (rate(tandem:kv_transfer_bytes_total{{{MW}}}"
                        f"{RATE}))",
                        "{{worker}} {{direction}}",
                    )
                ],
                "Bps",
                "KV bytes moved between prefill and decode workers.",
            ),
            panel(
                "Time moving KV",
                [
                    (
                        f"sum by (worker) (rate(tandem:kv_transfer_seconds_total{{{MW}}}{RATE}))",
                        "{{worker}}",
                    )
                ],
                "percentunit",
                "Seconds spent in KV transfers per second (reservation to every layer in).",
            ),
            panel(
                "Routing decisions",
                [
                    (
                        f"sum by (reason) (rate(tandem:routing_decisions_total{{{M}}}{RATE}))",
                        "{{reason}}",
                    ),
                    (
                        f"sum(rate(tandem:prefix_index_unavailable_total{{{M}}}{RATE}))",
                        "index unavailable",
                    ),
                ],
                "ops",
                "Placements by reason; lookups that fell back to load-only routing (Redis down).",
            ),
        ],
    ),
    (
        "Queue and admission",
        [
            panel(
                "Router queue",
                [
                    (f"sum(tandem:queue_waiting{{{M}}})", "waiting"),
                    (f"sum(tandem:queue_running{{{M}}})", "running"),
                    (f"sum(tandem:queue_slots{{{M}}})", "slots"),
                ],
                desc="Requests waiting for a slot, holding one, and the decode pool's slots.",
            ),
            panel(
                "Queue wait",
                quantiles("tandem:queue_wait_seconds", qs=(0.5, 0.99)),
                "s",
                "Arrival at the router to a slot.",
            ),
            panel(
                "Rejections",
                [
                    (
                        f"sum by (reason) (rate(tandem:request_rejected_total{{{M}}}{RATE}))",
                        "gateway {{reason}}",
                    ),
                    (
                        f"sum by (reason) (rate(tandem:early_rejections_total{{{M}}}{RATE}))",
                        "router {{reason}}",
                    ),
                    (f"sum(rate(tandem:queue_aged_total{{{M}}}{RATE}))", "sjf aged"),
                ],
                "reqps",
                "Refused requests by reason (gateway: invalid, auth, too large, overloaded...; "
                "router: queue full, projected wait), and sjf requests started by their deadline.",
            ),
            panel(
                "Resumes",
                [
                    (
                        f"sum by (reason) (rate(tandem:request_resumes_total{{{M}}}{RATE}))",
                        "{{reason}}",
                    )
                ],
                "reqps",
                "Requests continued on another worker after theirs died or hung.",
            ),
        ],
    ),
    (
        "Length prediction",
        [
            panel(
                "Length prediction error",
                quantiles("tandem:length_prediction_error", by="predictor", qs=(0.5, 0.9)),
                "short",
                "|log2(actual / predicted median)| of finished requests: 1 is off by 2x.",
            ),
            panel(
                "Kendall's tau, predicted vs actual",
                [(f"tandem:length_prediction_tau{{{M}}}", "{{predictor}}")],
                "short",
                "Rank agreement over the last finished requests (1: perfect order).",
            ),
        ],
    ),
    (
        "Migration",
        [
            panel(
                "Live migrations",
                [
                    (
                        f"sum by (direction, outcome) (rate(tandem:migrations_total{{{MW}}}"
                        f"{RATE}))",
                        "{{direction}} {{outcome}}",
                    ),
                    (
                        f"sum by (reason) (rate(tandem:migrations_by_reason_total{{{MW}}}{RATE}))",
                        "by {{reason}}",
                    ),
                ],
                "ops",
            ),
            panel(
                "Migration downtime",
                [
                    (
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f"tandem:migration_downtime_seconds_bucket{{{MW}}}{RATE})))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ],
                "s",
                "Time a migrating request was out of every running batch.",
            ),
            panel(
                "Migrated KV",
                [
                    (
                        f"sum by (worker) (rate(tandem:migration_kv_bytes_total{{{MW}}}{RATE}))",
                        "{{worker}}",
                    )
                ],
                "Bps",
            ),
            panel(
                "Projected KV blocks",
                [(f"tandem:kv_projected_blocks{{{MW}}}", "{{worker}}")],
                "short",
                "KV blocks each decode worker's requests will hold when they finish "
                "(what the rebalancer compares with its marks).",
            ),
        ],
    ),
    (
        "Scaling",
        [
            panel(
                "Scaling decisions",
                [
                    (
                        f"max by (role, direction, reason) "
                        f"(increase({SCALING_METRIC}{{{M}}}{RATE}))",
                        "{{role}} {{direction}} ({{reason}})",
                    )
                ],
                "short",
                f"The autoscaler's decisions by role, direction and the signal that drove "
                f"them ({SCALING_METRIC}; every gateway exports the controller's count: max).",
            ),
            panel(
                "Pool replicas",
                [(f"max by (role) (tandem:pool_replicas{{{M}}})", "{{role}}")],
                "short",
                "Live workers of each pool (starting and draining ones included).",
            ),
            panel(
                "Autoscaler pressure",
                [
                    (
                        f"max by (role, signal) (tandem:autoscaler_pressure{{{M}}})",
                        "{{role}} {{signal}}",
                    )
                ],
                "short",
                "Each pool's signals at the autoscaler's latest look, 1.0 at target: above the "
                "pool's high mark it grows, below its low mark (with a worker fewer) it shrinks.",
            ),
            panel(
                "Active workers",
                [(f'count(tandem:worker_state{{{M}, state="active"}} == 1)', "active")],
            ),
        ],
    ),
]


def variables() -> list[dict]:
    def query(name: str, expr: str, multi: bool) -> dict:
        return {
            "type": "query",
            "name": name,
            "label": name,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": expr, "refId": f"{name}-values"},
            "definition": expr,
            "refresh": 2,
            "multi": multi,
            "includeAll": multi,
            "allValue": ".*" if multi else None,
            "current": {},
            "sort": 1,
        }

    return [
        {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"},
        query(
            "model_name",
            "label_values(tandem:time_to_first_token_seconds_count, model_name)",
            False,
        ),
        query("worker", f"label_values(tandem:num_requests_running{{{M}}}, worker)", True),
    ]


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        for i, p in enumerate(row):
            p = {**p, "id": next_id, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y}}
            panels.append(p)
            next_id += 1
            if i % 2 == 1 or i == len(row) - 1:
                y += 8
    return {
        "title": "tandem",
        "uid": "tandem-serving",
        "description": "tandem: disaggregated LLM serving (the gateway's /metrics). Source: "
        "deploy/grafana/make_dashboard.py.",
        "tags": ["tandem", "llm", "serving"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if tandem.json is stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
