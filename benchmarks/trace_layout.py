"""Lay out requests' milestones across processes from a log of a ``TANDEM_TRACE=1`` run.

    python benchmarks/trace_layout.py LOG [--match '~'] [--limit 8]

Every process writes ``TRACE <request id> <milestone> <wall-clock s>`` (engine/tracing.py; Ray
forwards workers' lines to the driver's log with a ``(Worker pid=N)`` prefix). For each request
whose id contains ``--match`` (default ``~``: a resumed or retried attempt), this prints its
milestones in time order, in ms from its first, with the process each came from; milestones
logged without a request id (``-``) that fall inside the request's span (or up to ``--before``
seconds ahead of it: a pair torn down by a peer's death) are listed too, marked.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

LINE = re.compile(r"TRACE (?P<rid>\S+) (?P<event>\S+) (?P<t>\d+\.\d+)")
WHO = re.compile(r"\((\w+ pid=\d+)")  # Ray's prefix (colour codes around it)


def parse(path: str) -> list[tuple[float, str, str, str]]:
    """(time, request id, milestone, process) of every TRACE line."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                w = WHO.search(line[: m.start()])
                who = w.group(1) if w else "driver"
                out.append((float(m["t"]), m["rid"], m["event"], who))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--match", default="~")
    ap.add_argument("--limit", type=int, default=8, help="requests shown at most")
    ap.add_argument(
        "--before",
        type=float,
        default=1.0,
        help="s before a request's first milestone from which id-less ones are listed too",
    )
    args = ap.parse_args()
    events = parse(args.log)
    by_rid: dict[str, list] = defaultdict(list)
    for e in events:
        by_rid[e[1]].append(e)
    chosen = [r for r in by_rid if args.match in r][: args.limit]
    for rid in chosen:
        mine = by_rid[rid]
        t0, t1 = mine[0][0], mine[-1][0]
        shared = [e for e in by_rid.get("-", []) if t0 - args.before <= e[0] <= t1]
        print(f"\n{rid}: {len(mine)} milestones over {(t1 - t0) * 1e3:.1f} ms")
        for t, r, event, who in sorted(mine + shared):
            mark = "  (no id)" if r == "-" else ""
            print(f"  {(t - t0) * 1e3:9.1f} ms  {event:<28} {who}{mark}")
    if not chosen:
        print(f"no request id containing {args.match!r} among {len(by_rid)} traced")


if __name__ == "__main__":
    main()
