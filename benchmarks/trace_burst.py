"""Where a burst's first tokens wait: each request's milestones through the serving path
(``TANDEM_TRACE=1``), stage by stage, from the gateway's logs and the worker's (issue 23).

The milestones, in path order (a colocated worker; every process logs on one host's clock)::

    gw.received        the gateway has the HTTP request (router/gateway.py)
    gw.tokenized       body parsed, admitted by the gateway, prompt tokenized
    router.admitted    a slot from the router's admission (router/service.py)
    router.placed      a worker chosen
    worker.called      the worker's actor method runs (decode_worker/colocated.py)
    worker.added       the engine thread took it (engine/runtime.py ``register``)
    worker.first_token the engine thread emitted its first token
    gw.first_output    the gateway has it; the response (headers, first frame) goes out

    python benchmarks/trace_burst.py SERVER_LOG [--first 100] [--json OUT]

Prints, per stage, the median / p90 / max over every request and over the first N to arrive,
and when each milestone was reached by the first and the last request (seconds after the
first request arrived): the burst's shape.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict

STAGES = (
    "gw.received",
    "gw.tokenized",
    "router.admitted",
    "router.placed",
    "worker.called",
    "worker.added",
    "worker.first_token",
    "gw.first_output",
)
LINE = re.compile(r"TRACE (\S+) (\S+) (\d+\.\d+)")


def read(path: str) -> dict[str, dict[str, float]]:
    """Request id -> milestone -> wall-clock seconds (the first time it was logged)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m and m.group(2) in STAGES:
                out[m.group(1)].setdefault(m.group(2), float(m.group(3)))
    return {rid: ms for rid, ms in out.items() if "gw.received" in ms}


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {
        "n": len(values),
        "p50_ms": 1e3 * statistics.median(values),
        "p90_ms": 1e3 * values[int(0.9 * (len(values) - 1))],
        "max_ms": 1e3 * values[-1],
    }


def _cell(d: dict[str, float]) -> str:
    return "-" if not d else f"{d['p50_ms']:.1f} / {d['p90_ms']:.1f} / {d['max_ms']:.1f}"


def stages(requests: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        out[f"{a} -> {b}"] = _pcts(
            [ms[b] - ms[a] for ms in requests.values() if a in ms and b in ms]
        )
    out["total"] = _pcts(
        [ms[STAGES[-1]] - ms[STAGES[0]] for ms in requests.values() if STAGES[-1] in ms]
    )
    return out


def shape(requests: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per milestone: when the first and the last request reached it, after the first arrival."""
    t0 = min(ms["gw.received"] for ms in requests.values())
    out = {}
    for s in STAGES:
        times = [ms[s] - t0 for ms in requests.values() if s in ms]
        if times:
            out[s] = (min(times), max(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    reqs = read(args.log)
    by_arrival = sorted(reqs, key=lambda r: reqs[r]["gw.received"])
    first = {r: reqs[r] for r in by_arrival[: args.first]}
    result = {
        "requests": len(reqs),
        "all": stages(reqs),
        f"first_{args.first}": stages(first),
        "shape_s": shape(reqs),
    }
    print(f"{len(reqs)} requests traced\n")
    print(f"| stage | all: p50 / p90 / max ms | first {args.first}: p50 / p90 / max ms |")
    print("|---|---|---|")
    for k, v in result["all"].items():
        f = result[f"first_{args.first}"].get(k, {})
        print(f"| {k} | {_cell(v)} | {_cell(f)} |")
    print("\n| milestone | first request reached it (s) | last (s) |\n|---|---|---|")
    for s, (lo, hi) in result["shape_s"].items():
        print(f"| {s} | {lo:.3f} | {hi:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
