"""When each request of a burst got its first token, against the order it was sent, from
``serve.py --save-requests`` files (one line per file; gzipped files are fine).

    python benchmarks/plot_first_tokens.py A.json.gz:label B.json:label --out first_tokens.png

A client that keeps up shows first tokens rising with the send order from the engine's first
step; one that does not shows a late, flat start and early requests served last.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def first_tokens(path: Path) -> tuple[list[float], list[float]]:
    """(send times, first-token times), both from the burst's start, in send order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    run = next(iter(data["runs"].values()))
    records = sorted(run["results"][0]["requests"], key=lambda r: r["start"])
    ok = [r for r in records if r.get("ttft") is not None]
    return [r["start"] for r in ok], [r["start"] + r["ttft"] for r in ok]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="FILE[:label]")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in args.runs:
        name, _, label = spec.partition(":")
        sent, first = first_tokens(Path(name))
        ax.plot(range(len(first)), first, ".", ms=2, label=label or Path(name).stem)
        ax.plot(range(len(sent)), sent, "-", lw=0.8, color="grey")
    ax.set_xlabel("request, in the order it was sent")
    ax.set_ylabel("seconds from the burst's start")
    ax.set_title("First token of each request (grey: when it was sent)")
    ax.legend(markerscale=5)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
