"""Compare engine runs step by step from their ``TANDEM_STEP_LOG`` files (engine/tracing.py).

    TANDEM_STEP_LOG=/tmp/offline.csv python ...            # an offline LLM.generate run
    TANDEM_STEP_LOG=/tmp/served-{pid}.csv tandem serve ...  # each worker process its own file
    python benchmarks/step_log.py /tmp/offline.csv /tmp/served-*.csv [--json F]

Per file: the steps, the time inside ``step`` calls and between them (the engine loop's own
work outside a step: handing outputs on, waiting for requests), and the mean step by kind and
batch size (decode-only steps in batch buckets; steps that carry prompt tokens). Two runs of
the same requests that differ in wall time show here whether their steps were slower, more
numerous, or further apart.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

BUCKETS = (1, 8, 16, 32, 64, 96, 128, 256, 1 << 30)


def load(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def bucket(n: float) -> str:
    if n <= 0:
        return "0"
    lo = 0
    for hi in BUCKETS:
        if n <= hi:
            return f"{lo + 1}-{hi}" if hi < 1 << 30 else f">{lo}"
        lo = hi
    raise AssertionError(n)


def summarize(rows: list[dict[str, float]]) -> dict:
    """Totals, gaps and per-kind means of one run's steps (rows in start order)."""
    if not rows:
        return {"steps": 0}
    rows = sorted(rows, key=lambda r: r["start"])
    inside = sum(r["ms"] for r in rows) / 1e3
    span = rows[-1]["start"] + rows[-1]["ms"] / 1e3 - rows[0]["start"]
    gaps = [b["start"] - (a["start"] + a["ms"] / 1e3) for a, b in itertools.pairwise(rows)]
    kinds: dict[str, list[float]] = {}
    for r in rows:
        kind = f"prefill+{bucket(r['decodes'])}" if r["prefill_tokens"] else bucket(r["decodes"])
        kinds.setdefault(kind, []).append(r["ms"])
    return {
        "steps": len(rows),
        "span_s": span,
        "inside_s": inside,
        "between_s": span - inside,
        "gap_p50_ms": 1e3 * sorted(gaps)[len(gaps) // 2] if gaps else 0.0,
        "gaps_over_5ms": sum(g > 5e-3 for g in gaps),
        "tokens": sum(r["tokens"] for r in rows),
        "prefill_tokens": sum(r["prefill_tokens"] for r in rows),
        "decodes": sum(r["decodes"] for r in rows),
        "preempted": sum(r["preempted"] for r in rows),
        "kinds": {
            k: {"steps": len(v), "mean_ms": sum(v) / len(v), "total_s": sum(v) / 1e3}
            for k, v in sorted(kinds.items())
        },  # fmt: skip
    }


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key in ("steps", "span_s", "inside_s", "between_s", "gap_p50_ms", "gaps_over_5ms",
                "tokens", "prefill_tokens", "decodes", "preempted"):  # fmt: skip
        cells = [results[n].get(key, 0) for n in names]
        print(f"| {key} | " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c)
                                         for c in cells) + " |")  # fmt: skip
    kinds = sorted({k for n in names for k in results[n].get("kinds", {})})
    for k in kinds:
        cells = []
        for n in names:
            e = results[n].get("kinds", {}).get(k)
            cells.append(
                f"{e['steps']} x {e['mean_ms']:.1f} ms = {e['total_s']:.1f} s" if e else "-"
            )
        print(f"| {k} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {f.stem: summarize(load(f)) for f in args.files}
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
