"""Disaggregated vs colocated on CPU (TCP transport): TTFT and the transport's cost.

    python benchmarks/cpu_disagg.py [--lengths 16 256 1024] [--reps 3]

SmolLM2-135M fp32, one prefill + one decode + one colocated worker on a local Ray cluster (one
CPU each), one request at a time, 8 greedy tokens. TTFT is from the call to the first output at
the caller. Also measured in the same run: a bare loopback TCP stream between two threads (the
ceiling of the TCP backend). Writes benchmarks/results/cpu_disagg.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loopback_gbps(nbytes: int = 256 << 20, chunk: int = 8 << 20) -> float:
    a, b = socket.socketpair()
    payload = memoryview(bytearray(chunk))

    def reader() -> None:
        buf = bytearray(chunk)
        got = 0
        while got < nbytes:
            got += b.recv_into(buf)

    t = threading.Thread(target=reader)
    t0 = time.perf_counter()
    t.start()
    for _ in range(nbytes // chunk):
        a.sendall(payload)
    t.join()
    dt = time.perf_counter() - t0
    a.close()
    b.close()
    return nbytes / dt / 1e9


async def ttft(cluster, ids, mode):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    t0 = time.perf_counter()
    first, last = None, None
    async for out in cluster.stream(ids, params, mode=mode):
        first = first if first is not None else time.perf_counter() - t0
        last = out
    return first, last.outputs[0].token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_disagg.json"))
    args = ap.parse_args()

    from cluster.launch.local import LocalCluster

    report = {"loopback_tcp_gbps": loopback_gbps(), "rows": []}
    with LocalCluster(num_prefill=1, num_decode=1, num_colocated=1) as c:
        tok = c.tokenizer
        text = " ".join(f"Sentence {i} tells of a river and a mill." for i in range(400))
        base = tok(text)["input_ids"]
        for n in args.lengths:
            row = {"prompt_tokens": n}
            for mode in ("colocated", "disagg"):
                times, tokens = [], []
                for r in range(args.reps + 1):
                    ids = base[r : r + n]  # a different prompt each time: no prefix hits
                    t, toks = asyncio.run(ttft(c, ids, mode))
                    if r:  # the first is a warm-up
                        times.append(t)
                        tokens.append(toks)
                row[f"ttft_{mode}_ms"] = 1e3 * statistics.median(times)
                row[f"tokens_{mode}"] = tokens
            row["ttft_ratio"] = row["ttft_disagg_ms"] / row["ttft_colocated_ms"]
            row["greedy_identical"] = row["tokens_colocated"] == row["tokens_disagg"]
            report["rows"].append(row)
            print(
                f"{n} tokens: colocated {row['ttft_colocated_ms']:.1f} ms, disagg "
                f"{row['ttft_disagg_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        stats = {s["name"]: s for s in c.stats()}
        report["kv_bytes_sent"] = stats["prefill-0"]["kv_bytes_sent"]
        report["idle"] = c.check_idle()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nloopback TCP ceiling {report['loopback_tcp_gbps']:.1f} GB/s")
    print("| prompt | TTFT colocated ms | TTFT disagg ms | ratio | greedy same |")
    print("|---|---|---|---|---|")
    for r in report["rows"]:
        print(
            f"| {r['prompt_tokens']} | {r['ttft_colocated_ms']:.1f} | {r['ttft_disagg_ms']:.1f} "
            f"| {r['ttft_ratio']:.3f} | {r['greedy_identical']} |"
        )


if __name__ == "__main__":
    main()
