"""Does a SIGKILLed CUDA process stall the other processes on a GPU it shared an NCCL pair with?

    python benchmarks/gpu_kill_stall.py --out DIR      # 2 GPUs

Issue 28's chaos runs on 2 GPUs saw both prefill workers on GPU 0 take no request into their
engines for 0.1-1.3 s after a decode worker on GPU 1 was SIGKILLed, while the surviving decode
worker on GPU 1 kept its pace. The lead: the driver tearing down the killed process's context
(its ~70 GB of KV cache and its NCCL peer mappings of GPU 0 memory) holds a lock that other
processes' CUDA calls wait on. This measures it without the engine, Ray or the router.

Per scenario, fresh processes: a victim on GPU 1 allocates ``--victim-gb`` (``big``) or 1 GiB
(``small``), optionally forms an NCCL pair with observer A on GPU 0 and exchanges a few messages
both ways (``nccl``: NCCL's peer-to-peer buffers are mapped into each other's contexts), and
optionally leaves a recv posted that A never sends (``inflight``, as a decode worker's recv for
a layer in flight). Observer A (paired) and observer B (no pair) on GPU 0 loop over four CUDA
calls and time each: a small kernel and a synchronize, a 64 MiB cudaMalloc + cudaFree, a 1 MiB
pinned host alloc + free, an event create + destroy. The victim is SIGKILLed 1.5 s into the
loops; each observer reports every call's median before the kill, the longest after it (and
when, from the kill), and how long its loop went without finishing an iteration. At the end
half a second after the kill A aborts its communicator with the dead peer (``destroy``:
destroys it) in a thread beside its loop, as a worker's watchdog does, and times that and the
loop's calls meanwhile.
``spin``: A has a 64 MiB send posted to the victim that it never receives (its kernel spins on
GPU 0 until the abort, as a prefill worker's send to a decode worker that died mid-transfer). The
loops run on their own streams; ``gemm`` is a 4096^3 fp16 matmul and a sync (~0.2 ms).
``start``: nothing is killed; at the mark a replacement starts on GPU 1 (a context, then
``--victim-gb`` zeroed in 32 tensors as the engine's KV cache; ``start+nccl``: then an NCCL pair
with A, whose init runs in a thread of A beside its loop, as a prefill worker's does). Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("kernel", "gemm", "malloc", "host_alloc", "event")
MESSAGE = 64 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _use_gpu(index: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)


def _paired(uid, rank: int):
    """Join the 2-rank communicator as ``rank`` and exchange a few messages both ways (rank 1
    sends first), so NCCL's peer buffers are mapped in both processes: (comm, buf, stream)."""
    import cupy as cp
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(2, uid, rank)
    buf = cp.ones(MESSAGE, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    peer = 1 - rank
    for _ in range(3):
        for op in (comm.send, comm.recv) if rank == 1 else (comm.recv, comm.send):
            op(buf.data.ptr, MESSAGE, nccl.NCCL_UINT8, peer, stream.ptr)
    stream.synchronize()
    return comm, buf, stream


def victim(uid, big_gb: float, pair: bool, inflight: bool, ready) -> None:
    _use_gpu(1)
    import cupy as cp
    from cupy.cuda import nccl

    held = [cp.empty(1 << 30, dtype=cp.uint8) for _ in range(max(1, int(big_gb)))]
    held[-1].fill(1)
    if pair:
        comm, buf, stream = _paired(uid, 1)
        if inflight:  # a recv that A never matches: its kernel spins on GPU 1 until the kill
            comm.recv(buf.data.ptr, MESSAGE, nccl.NCCL_UINT8, 0, stream.ptr)
    ready.put(("victim", len(held)))
    x = cp.ones(1 << 20, dtype=cp.float32)
    while True:  # keep the context busy until the kill
        x += 1
        cp.cuda.Device().synchronize()
        time.sleep(0.001)


def starter(uid, gb: float, ready) -> None:
    """A replacement worker's start on GPU 1: a context, ``gb`` GiB zeroed in 32 tensors (one
    per layer, as the engine's KV cache), then (with ``uid``) an NCCL pair with observer A."""
    t0 = time.time()
    _use_gpu(1)
    import cupy as cp
    from cupy.cuda import nccl

    cp.cuda.Device().synchronize()
    t_context = time.time()
    held = [cp.zeros(int(gb * (1 << 30)) // 32, dtype=cp.uint8) for _ in range(32)]
    cp.cuda.Device().synchronize()
    t_alloc = time.time()
    if uid is not None:
        comm = nccl.NcclCommunicator(2, uid, 1)
        byte = cp.zeros(1, dtype=cp.uint8)
        comm.recv(byte.data.ptr, 1, nccl.NCCL_UINT8, 0, cp.cuda.Stream.null.ptr)
        cp.cuda.Device().synchronize()
    ready.put(("starter", (t_context - t0, t_alloc - t_context, time.time() - t_alloc, len(held))))
    time.sleep(3600)


def _join_later(uid_queue, out: dict) -> None:
    """Observer A's pair with the starter, formed in a thread beside A's loop (as a prefill
    worker's communicator init runs beside its engine thread)."""
    import cupy as cp
    from cupy.cuda import nccl

    uid = uid_queue.get()
    out["init_start"] = time.time()
    comm = nccl.NcclCommunicator(2, uid, 0)
    byte = cp.zeros(1, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    comm.send(byte.data.ptr, 1, nccl.NCCL_UINT8, 1, stream.ptr)
    stream.synchronize()
    out["init_done"] = time.time()
    out["comm"] = comm


def observer(
    name: str, uid, pair: bool, ready, stop, results, finish="abort", join=None, spin=False
):
    _use_gpu(0)
    import threading

    import cupy as cp
    from cupy.cuda import nccl, runtime

    comm = None
    joined: dict = {}
    if join is not None:
        threading.Thread(target=_join_later, args=(join, joined), daemon=True).start()
    if pair:
        comm, buf, stream = _paired(uid, 0)
    if spin:  # a send the victim never receives: its kernel spins on GPU 0 until the abort
        comm.send(buf.data.ptr, MESSAGE, nccl.NCCL_UINT8, 1, stream.ptr)
    work = cp.cuda.Stream(non_blocking=True)  # the loop's own stream: never waits for the pair's
    with work:
        x = cp.ones(1 << 20, dtype=cp.float32)
        a = cp.ones((4096, 4096), dtype=cp.float16)
        x += 1
        a @ a
    work.synchronize()
    ready.put((name, 0))
    samples: list[tuple[float, str, float]] = []

    def timed(op, fn):
        t0 = time.time()
        fn()
        samples.append((t0, op, time.time() - t0))

    def kernel():
        with work:
            x.__iadd__(1)
        work.synchronize()

    def gemm():  # ~0.2 ms of tensor-core work: does it get the SMs?
        with work:
            a @ a
        work.synchronize()

    def malloc():
        runtime.free(runtime.malloc(64 << 20))

    def host_alloc():
        runtime.freeHost(runtime.hostAlloc(1 << 20, 0))

    def event():
        runtime.eventDestroy(runtime.eventCreate())

    calls = dict(zip(OPS, (kernel, gemm, malloc, host_alloc, event), strict=True))
    teardown: dict = {}

    def tear_down():  # as a worker's watchdog thread does, beside its engine thread
        teardown["start"] = time.time()
        comm.destroy() if finish == "destroy" else comm.abort()
        teardown["end"] = time.time()

    done = threading.Event()
    kill_at: list[float] = []

    def listen():  # a thread: the loop may be stuck in a call (a free behind a spinning kernel)
        while True:
            what, t = stop.get()
            kill_at.append(t)
            if what == "stop":
                done.set()
                return
            threading.Thread(target=tear_down, daemon=True).start()  # "teardown"

    threading.Thread(target=listen, daemon=True).start()
    while not done.is_set():
        for op, fn in calls.items():
            timed(op, fn)
    t_kill = kill_at[-1]
    abort_s = None
    if "end" in teardown:
        abort_s = teardown["end"] - teardown["start"]
        window = [(t, o, d) for t, o, d in samples if teardown["start"] <= t <= teardown["end"]]
        teardown["max_ms"] = {
            op: max((d for _, o, d in window if o == op), default=0) * 1e3 for op in OPS
        }
    summary = summarize(samples, t_kill)
    if "init_done" in joined:
        summary["pair_init"] = {
            "start_ms": (joined["init_start"] - t_kill) * 1e3,
            "took_ms": (joined["init_done"] - joined["init_start"]) * 1e3,
        }
    if "max_ms" in teardown:
        summary["teardown_max_ms"] = teardown["max_ms"]
    results.put((name, summary, abort_s))


def summarize(samples, t_kill: float) -> dict:
    out: dict = {}
    for op in OPS:
        before = [d for t, o, d in samples if o == op and t < t_kill]
        after = [(d, t - t_kill) for t, o, d in samples if o == op and t >= t_kill]
        if not before or not after:
            continue
        worst, when = max(after)
        med = statistics.median(before)
        out[op] = {
            "median_before_ms": med * 1e3,
            "max_after_ms": worst * 1e3,
            "max_after_at_ms": when * 1e3,
            "slow_after": sum(1 for d, _ in after if d > 10 * med + 1e-3),
        }
    starts = sorted(t for t, o, _ in samples if o == OPS[0])
    gaps = [(b - a, a - t_kill) for a, b in zip(starts, starts[1:], strict=False) if b >= t_kill]
    if gaps:
        gap, at = max(gaps)
        out["loop_gap_ms"] = gap * 1e3
        out["loop_gap_at_ms"] = at * 1e3
    return out


def run(scenario: str, victim_gb: float, after_s: float) -> dict:
    """``start``: no kill; a replacement starts on GPU 1 at the mark (``start+nccl``: and
    pairs with A). Otherwise a victim is SIGKILLed at the mark."""
    from cupy.cuda import nccl

    ctx = mp.get_context("spawn")
    starting = scenario.startswith("start")
    pair = "nccl" in scenario and not starting
    uid = nccl.get_unique_id() if "nccl" in scenario else None
    ready, stop_a, stop_b, results = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    join = ctx.Queue() if starting and uid is not None else None
    gb = victim_gb if scenario.startswith(("big", "start")) else 1
    finish = "destroy" if "destroy" in scenario else "abort"
    procs = {
        "A": ctx.Process(
            target=observer,
            args=("A", uid if pair else None, pair, ready, stop_a, results),
            kwargs={"finish": finish, "join": join, "spin": "spin" in scenario},
        ),
        "B": ctx.Process(target=observer, args=("B", None, False, ready, stop_b, results)),
    }
    if not starting:
        procs["victim"] = ctx.Process(
            target=victim, args=(uid, gb, pair, "inflight" in scenario, ready)
        )
    for p in procs.values():
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    time.sleep(1.5)
    t_kill = time.time()
    start = None
    if starting:
        if join is not None:
            join.put(uid)
        proc = ctx.Process(target=starter, args=(uid, gb, ready))
        proc.start()
        _, phases = ready.get(timeout=120)
        reaped_ms = (time.time() - t_kill) * 1e3
        start = {"context_s": phases[0], "alloc_s": phases[1], "pair_s": phases[2]}
        proc.kill()
    else:
        os.kill(procs["victim"].pid, signal.SIGKILL)
        procs["victim"].join()
        reaped_ms = (time.time() - t_kill) * 1e3
    if pair:
        time.sleep(0.5)  # the kill's own stall is over: A tears its pair down beside its loop
        stop_a.put(("teardown", t_kill))
    time.sleep(after_s)
    stop_a.put(("stop", t_kill))
    stop_b.put(("stop", t_kill))
    got = {}
    for _ in range(2):
        name, summary, abort_s = results.get(timeout=120)
        got[name] = {"ops": summary, "abort_ms": None if abort_s is None else abort_s * 1e3}
    for name in ("A", "B"):
        procs[name].join(timeout=30)
    return {
        "scenario": scenario,
        "victim_gb": gb,
        "reaped_ms": reaped_ms,
        "observers": got,
        "start": start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--scenarios",
        nargs="+",
        default=[
            "big",
            "big+nccl",
            "small+nccl",
            "big+nccl+inflight",
            "big+nccl+destroy",
            "big+nccl+spin",
            "start",
            "start+nccl",
        ],
    )
    ap.add_argument("--victim-gb", type=float, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--after-s", type=float, default=4.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_kill_stall.json"))
    args = ap.parse_args()
    rows = []
    for rep in range(args.repeats):
        for scenario in args.scenarios:
            log(f"{scenario}, round {rep + 1}")
            rows.append(run(scenario, args.victim_gb, args.after_s))
    head = (
        "| scenario | observer | reaped ms | loop gap ms (at) | "
        + " | ".join(f"{op} med / max ms (at)" for op in OPS)
        + " | abort ms |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        for name in ("A", "B"):
            ob = row["observers"][name]
            ops = ob["ops"]
            cells = [
                f"{ops[op]['median_before_ms']:.3f} / {ops[op]['max_after_ms']:.1f} "
                f"({ops[op]['max_after_at_ms']:.0f})"
                if op in ops
                else "-"
                for op in OPS
            ]
            gap = (
                f"{ops['loop_gap_ms']:.1f} ({ops['loop_gap_at_ms']:.0f})"
                if "loop_gap_ms" in ops
                else "-"
            )
            abort = "-" if ob["abort_ms"] is None else f"{ob['abort_ms']:.1f}"
            if "teardown_max_ms" in ops:
                abort += (
                    " (beside it: "
                    + ", ".join(f"{op} {ms:.1f}" for op, ms in ops["teardown_max_ms"].items())
                    + ")"
                )
            if "pair_init" in ops:
                abort += " (pair init at {start_ms:.0f} ms took {took_ms:.0f})".format(
                    **ops["pair_init"]
                )
            print(
                f"| {row['scenario']} (x{row['victim_gb']:.0f} GiB) | {name} | "
                f"{row['reaped_ms']:.0f} | {gap} | " + " | ".join(cells) + f" | {abort} |"
            )
    for row in rows:
        if row["start"]:
            print(
                f"{row['scenario']}: the starter's context {row['start']['context_s']:.2f} s, "
                f"allocation {row['start']['alloc_s']:.2f} s, pair {row['start']['pair_s']:.2f} s"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
