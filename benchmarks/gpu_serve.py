"""Serving through the gateway against the engine's own speed, and the topologies side by side.

One driver for the issue-12 GPU figures. Each phase starts ``tandem serve`` (a fresh Ray cluster, a
local redis-server, the OpenAI gateway) with one topology, drives it with
``benchmarks/serve.py`` (open loop, streamed ``/v1/completions``, ``ignore_eos``), stops it, and
keeps every run's JSON (per-request records included) under ``--out``:

* ``offline``: ``LLM.generate`` on the same requests in one process (no gateway, no Ray), the
  denominator of "the gateway at the engine's own speed";
* ``one``: one colocated worker on GPU 0, all requests at once;
* ``two``: two colocated workers (GPU 0 and 1);
* ``pd``: one prefill + one decode worker, KV streamed over NCCL.

``two`` and ``pd`` run ShareGPT at ``inf`` (a burst: its request rate, and the rate it sustains,
``steady_capacity``: the burst's output tokens per second in its middle half over the mean output
of a request) and then at fractions of a reference rate (``--fracs`` of ``--ref-rate``, default:
of this phase's own capacity), one client run per rate sized to last ``--rate-seconds``; the
long-prompt workload likewise. ``report`` gives each topology's SLO attainment per rate and its
goodput as DistServe defines it (the highest rate at which 90 % of requests meet both the TTFT
and the TPOT SLO), per workload and SLO pair, with a plot. The burst must keep every decode
batch full for its capacity to mean anything (requests >= 2 x max_num_seqs per decode worker);
otherwise pass the reference rates. Requests: ``sharegpt-ids`` (random ids of ShareGPT first-turn Llama-3 lengths from
benchmarks/data/sharegpt_llama3_lengths.json; the GPU machine has no dataset) and ``long``.

    python benchmarks/gpu_serve.py run --model DIR --phases offline,one --out $OUT
    python benchmarks/gpu_serve.py run --model DIR --phases pd --out $OUT
    python benchmarks/gpu_serve.py run --model DIR --phases two --ref-rate 12.5 --out $OUT
    python benchmarks/gpu_serve.py report DIR... [--json F] [--plot PNG]   # tables, goodput, plot

``--device cpu`` runs the same on CPU (a dry run of the driver with the small model).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import serve as bench  # noqa: E402

LENGTHS = ROOT / "benchmarks" / "data" / "sharegpt_llama3_lengths.json"
TOPOLOGIES = {
    "one": (["--colocated", "1"], "0"),
    "two": (["--colocated", "2"], "0,1"),
    "pd": (["--prefill", "1", "--decode", "1"], "0,1"),
}
# Tensor-parallel topologies by name (issue 29): ``pd-p<P>d<D>`` one prefill worker at TP P and
# one decode worker at TP D (P + D GPUs), ``two-tp<T>`` two colocated workers at TP T (2T GPUs),
# ``one-tp<T>`` one colocated worker at TP T.
_TP_TOPOLOGY = re.compile(r"^(?:pd-p(\d)d(\d)|(one|two)-tp(\d))$")
# Worker counts at TP 1: ``<N>p<M>d`` N prefill and M decode workers (N + M GPUs; a P:D ratio
# other than 1:1, e.g. 2p1d for prompts 20x longer than their answers), ``<N>col`` N colocated.
_COUNT_TOPOLOGY = re.compile(r"^(?:(\d)p(\d)d|(\d)col)$")


def topology(name: str) -> tuple[list[str], str]:
    """The ``tandem serve`` flags of a topology and the GPUs it takes (CUDA_VISIBLE_DEVICES)."""
    if name in TOPOLOGIES:
        return TOPOLOGIES[name]
    c = _COUNT_TOPOLOGY.match(name)
    if c is not None:
        if c.group(3):
            n = int(c.group(3))
            return ["--colocated", str(n)], ",".join(map(str, range(n)))
        p, d = int(c.group(1)), int(c.group(2))
        return ["--prefill", str(p), "--decode", str(d)], ",".join(map(str, range(p + d)))
    m = _TP_TOPOLOGY.match(name)
    if m is None:
        raise SystemExit(
            f"unknown topology {name!r}: {sorted(TOPOLOGIES)}, pd-p2d1, two-tp2, 2p1d, 3col, ..."
        )
    if m.group(1):
        p, d = int(m.group(1)), int(m.group(2))
        flags = ["--prefill", "1", "--decode", "1"]
        flags += ["--prefill-tensor-parallel-size", str(p), "--decode-tensor-parallel-size", str(d)]
        return flags, ",".join(map(str, range(p + d)))
    workers, tp = (1 if m.group(3) == "one" else 2), int(m.group(4))
    flags = ["--colocated", str(workers), "--tensor-parallel-size", str(tp)]
    return flags, ",".join(map(str, range(workers * tp)))


def topology_label(topo: str) -> str:
    """A topology's name in the tables: ``2 colocated``, ``1P1D``, ``1P(TP 2) + 1D(TP 1)``..."""
    c = _COUNT_TOPOLOGY.match(topo)
    if c is not None:
        return f"{c.group(3)} colocated" if c.group(3) else f"{c.group(1)}P{c.group(2)}D"
    m = _TP_TOPOLOGY.match(topo)
    if topo in ("two", "pd") or m is None:
        return {"two": "2 colocated", "pd": "1P1D", "one": "1 colocated"}.get(topo, topo)
    if m.group(1):
        return f"1P(TP {m.group(1)}) + 1D(TP {m.group(2)})"
    return f"{1 if m.group(3) == 'one' else 2} colocated at TP {m.group(4)}"


def topology_gpus(topo: str) -> int:
    return len(topology(topo)[1].split(","))


def scrape_metrics(url: str) -> dict[str, float]:
    """The gateway's ``tandem:`` series from /metrics, each by its full name (labels
    included) and, for a labelled one, its family's total under the bare name too; {} when
    the gateway does not answer."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("tandem:"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[series] = v
        name = series.split("{", 1)[0]
        if name != series:  # a labelled series: its family's total too
            out[name] = out.get(name, 0.0) + v
    return out


def kv_tail(url: str) -> tuple[float, float]:
    """The decode workers' summed ``tandem:kv_transfer_tail_seconds`` and
    ``tandem:kv_transfers_in`` from /metrics (0, 0 where there are none: colocated)."""
    m = scrape_metrics(url)
    names = ("tandem:kv_transfer_tail_seconds_total", "tandem:kv_transfers_in_total")
    return m.get(names[0], 0.0), m.get(names[1], 0.0)


# ``topo@variant`` phases: the same topology with other gateway flags (the gateway's own cost).
VARIANTS = {
    "": [],
    "asyncio": ["--loop", "asyncio", "--http", "h11"],
    # two gateway processes sharing the port (SO_REUSEPORT): the gateway's CPU per streamed
    # token split across two cores (issue 23's served gap)
    "gw2": ["--gateways", "2", "--reuse-port"],
}
# Goodput SLO pairs (ms). The first is the interactive-chat pair. The second is a
# document-reading pair for long prompts: a reader accepts a couple of seconds before the answer
# starts on an 8k-token document, then wants it faster than reading speed (100 ms/token is about
# 7 words/s against ~4-5 read); DistServe's summarization class is set the same way (TTFT in
# seconds, TPOT interactive).
SLOS = {"chat": {"ttft": 500.0, "tpot": 40.0}, "doc": {"ttft": 2000.0, "tpot": 100.0}}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the requests


def workload_args(
    args: argparse.Namespace, workload: str, num: int, text: bool = False
) -> list[str]:
    clip = ["--max-output", str(args.max_output)] if args.max_output else []
    if workload == "sharegpt" and args.requests_file is not None:
        files = ["--workload", "file", "--workload-file", str(args.requests_file)]
        if text:  # served phases with --text-prompts (the offline engine takes the ids)
            files += ["--text-prompts", "--tokenizer", str(args.model)]
            if args.chat:  # each prompt as the one user message of a chat
                files += ["--endpoint", "chat"]
        return [*files, "--num-prompts", str(num), *clip]
    if workload == "sharegpt":
        return [
            "--workload",
            "sharegpt-ids",
            "--lengths-file",
            str(LENGTHS),
            "--num-prompts",
            str(num),
            *clip,
        ]
    return [
        "--workload",
        "long",
        "--num-prompts",
        str(num),
        "--long-input",
        *map(str, args.long_input),
        "--long-output",
        *map(str, args.long_output),
    ]


# --------------------------------------------------------------------------- offline engine


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM.generate`` on the ShareGPT requests ``serve.py`` sends (same ids, same lengths)."""
    import torch

    from cluster.launch.serve import _engine_overrides  # what `tandem serve --engine` gives workers
    from engine import LLM, SamplingParams

    requests = bench.build_requests(
        bench.parse_args(workload_args(args, "sharegpt", args.num_prompts))
    )
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=dtype, **_engine_overrides(args.engine))
    init_s = time.perf_counter() - t0
    log(f"offline engine ready in {init_s:.0f} s; {len(requests)} requests")
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    if args.device == "cuda":
        # Untimed: the first 100 requests once, so Triton compiles its kernels (about 10 s on a
        # cold cache) here, not in the measured run; the served phases after this one find them
        # cached. (The CPU path compiles nothing.)
        llm.generate([r.prompt for r in requests[:100]], params[:100])
        torch.cuda.synchronize()
        # ... and forgets their prompts: the measured run prefills all of them, as the served
        # phases' fresh servers do (runs before 2026-11-28, night, found these 100 cached)
        if not llm.reset_prefix_cache():
            raise RuntimeError("the warm-up left requests unfinished")
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(r.output_len for r in requests)
    return {
        "requests": len(requests),
        "seconds": seconds,
        "request_throughput": len(requests) / seconds,
        "output_throughput": out_tokens / seconds,
        "init_s": init_s,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
    }


# --------------------------------------------------------------------------- a server


class Server:
    """``tandem serve`` in a child process; its output goes to a log (and is watched)."""

    def __init__(self, args: argparse.Namespace, spec: str) -> None:
        topo, _, variant = spec.partition("@")
        flags, gpus = topology(topo)
        if args.gpus:  # other cards of the machine (two topologies measured side by side)
            if len(args.gpus.split(",")) != len(gpus.split(",")):
                raise SystemExit(f"--gpus {args.gpus}: {topo} takes {len(gpus.split(','))}")
            gpus = args.gpus
        flags = flags + VARIANTS[variant]
        self.disaggregated = "--prefill" in flags
        self.rounds = 0  # prompt rounds sent to it so far (drive)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", args.model]
        cmd += ["--device", args.device, *flags, "--port", str(self.port)]
        cmd += ["--served-model-name", "bench", "--max-concurrent", str(args.max_concurrent)]
        for pair in args.engine:
            cmd += ["--engine", pair]
        if getattr(args, "predictor", None):  # (the learned one's artifact may be left home)
            cmd += ["--predictor", args.predictor]
        cmd += getattr(args, "serve_flags", None) or []  # a caller's own (gpu_kv_tiers.py)
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.log_path = Path(args.out) / f"server-{spec.replace('@', '-')}.log"
        self.log = self.log_path.open("w")
        self.serving = threading.Event()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if re.match(r"^serving http://", line):
                self.serving.set()

    def wait(self, timeout: float) -> None:
        t0 = time.monotonic()
        while not self.serving.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                tail = self.log_path.read_text().splitlines()[-30:]
                raise RuntimeError("server did not start:\n" + "\n".join(tail))
        log(f"serving at {self.url} after {time.monotonic() - t0:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]


class Profile:
    """Where the host's CPU goes during one benchmark run: CPU seconds of every process over the
    run (top ones kept, with their command lines), and, when ``py-spy`` is on PATH, 10 s of
    sampled Python stacks of the gateway, the client and the busiest Ray workers (collapsed
    stacks, one file each, for a flame graph)."""

    def __init__(self, args: argparse.Namespace, name: str, gateway: int, client: int) -> None:
        self.path = Path(args.out) / f"{name}-cpu.json"
        self.name, self.out = name, Path(args.out)
        self.pids = {"gateway": gateway, "client": client}
        self.t0, self.start = time.monotonic(), self._sample()
        self.spies: list[subprocess.Popen] = []
        self.timer = threading.Timer(args.profile_delay, self._spy)
        self.timer.start()

    def _sample(self) -> dict[int, float]:
        out = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    out[int(d.name)] = _cpu_seconds(int(d.name))
        return out

    def _spy(self) -> None:
        import shutil

        if not shutil.which("py-spy"):
            return
        now = self._sample()
        busy = sorted(now, key=lambda p: self.start.get(p, 0.0) - now[p])
        workers = [p for p in busy if "ray::" in self._name(p)][:2]
        targets = dict(self.pids) | {f"worker{i}": p for i, p in enumerate(workers)}
        for role, pid in targets.items():
            f = self.out / f"{self.name}-{role}.pyspy.txt"
            cmd = ["py-spy", "record", "--pid", str(pid), "--duration", "10", "--rate", "200"]
            cmd += ["--format", "raw", "--nonblocking", "--output", str(f)]
            self.spies.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )

    @staticmethod
    def _name(pid: int) -> str:
        try:
            return _cmdline(pid) or Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    def stop(self) -> None:
        self.timer.cancel()
        end, wall = self._sample(), time.monotonic() - self.t0
        used = {p: end[p] - self.start.get(p, 0.0) for p in end}
        top = sorted(used, key=used.get, reverse=True)[:12]
        rows = [{"pid": p, "cpu_pct": 100 * used[p] / wall, "cmd": self._name(p)} for p in top]
        self.path.write_text(json.dumps({"wall_s": wall, "top": rows}, indent=1))
        for row in rows[:6]:
            log(f"  cpu {row['cpu_pct']:6.1f}%  {row['cmd'][:90]}")
        for spy in self.spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()


def drive(
    args: argparse.Namespace,
    server: Server,
    name: str,
    workload: str,
    num: int,
    rates: list,
    label: str | None = None,
) -> list[dict[str, Any]]:
    """``serve.py`` against ``server``; its JSON is kept gzipped as ``name.json.gz``, its runs
    under ``label`` (default ``name``: runs of one label from several files are merged)."""
    path = Path(args.out) / f"{name}.json"
    label = label or name
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--base-url", server.url]
    cmd += ["--ignore-eos", "--save-requests", "--label", label, "--out", str(path)]
    cmd += ["--client", args.client]
    cmd += ["--goodput", *(f"{k}:{v:g}" for k, v in SLOS["chat"].items())]
    cmd += ["--rates", *(bench.format_rate(r) for r in rates)]
    # each run against this server takes rounds of prompts no earlier run took (serve.py's
    # fresh_round: a repeated prompt would be a prefix hit and flatter every later rate)
    cmd += ["--prompt-round", str(server.rounds)]
    server.rounds += len(rates)
    cmd += workload_args(args, workload, num, text=args.text_prompts or args.chat)
    log(f"{name}: {num} {workload} requests at {[bench.format_rate(r) for r in rates]}")
    tail0 = kv_tail(server.url)
    client = subprocess.Popen(cmd, cwd=ROOT)
    profile = Profile(args, name, server.proc.pid, client.pid) if args.profile else None
    try:
        if client.wait(timeout=args.bench_timeout):
            raise RuntimeError(f"serve.py exited {client.returncode}")
    finally:
        if client.poll() is None:
            client.kill()
        if profile:
            profile.stop()
    data = json.loads(path.read_text())
    results = data["runs"][label]["results"]
    if tail0[1] or server.disaggregated:  # P/D: the stream's exposed tail, mean per transfer
        done = sum(r["completed"] for r in results if "completed" in r) or num
        deadline = time.monotonic() + 10  # the router polls the workers' counters
        while True:
            tail = kv_tail(server.url)
            if tail[1] - tail0[1] >= done or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        n = tail[1] - tail0[1]
        for r in results:  # (one rate per run here; a multi-rate run shares the mean)
            r["kv_tail_ms_mean"] = 1e3 * (tail[0] - tail0[0]) / n if n else None
            r["kv_transfers"] = n
    with gzip.open(f"{path}.gz", "wt") as f:
        json.dump(data, f)
    path.unlink()
    return results


def steady_capacity(result: dict[str, Any]) -> float | None:
    """Requests per second a topology sustains, from a burst (every request at once): output
    tokens produced per second in the middle half of the run (each request's tokens spread
    evenly from its first token to its end), over the mean output tokens of a request. A
    burst's own requests/s is lower (its tail drains a shrinking batch) and its middle
    completions/s higher (short requests finish first); the token rate in the middle is the
    batch's full rate. None without per-request records."""
    recs = [r for r in result.get("requests") or [] if r["success"] and r["output_tokens"]]
    if not recs:
        return None
    t0 = min(r["start"] for r in recs)
    span = max(r["end"] for r in recs) - t0
    lo, hi = t0 + 0.25 * span, t0 + 0.75 * span
    tokens = 0.0
    for r in recs:
        a, b = r["start"] + r["ttft"], r["end"]
        if b <= a:
            tokens += r["output_tokens"] if lo <= b < hi else 0.0
        else:
            tokens += r["output_tokens"] * max(0.0, min(b, hi) - max(a, lo)) / (b - a)
    mean_out = sum(r["output_tokens"] for r in recs) / len(recs)
    return tokens / (hi - lo) / mean_out


def phase(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    server = Server(args, spec)
    topo = spec.replace("@", "-")
    out: dict[str, Any] = {}
    try:
        server.wait(args.start_timeout)
        if args.warmup:  # untimed: Triton compiles its kernels here, not in the saturation run
            drive(args, server, f"{topo}-warmup", "sharegpt", args.warmup, [1e999])
        workloads = args.workloads.split(",")
        only_inf = topo.startswith("one") or args.inf_only
        if only_inf or "sharegpt" in workloads:
            sat = drive(args, server, f"{topo}-sharegpt-inf", "sharegpt", args.num_prompts, [1e999])
            out["saturation"] = sat[0]["request_throughput"]
            out["capacity"] = steady_capacity(sat[0])
        if only_inf:
            return out
        for workload, num, inf_num, ref in (
            ("sharegpt", args.rate_prompts, None, args.ref_rate),
            ("long", args.long_rate_prompts, args.long_prompts, args.long_ref_rate),
        ):
            if workload not in workloads:
                continue
            if inf_num is not None:
                burst = drive(args, server, f"{topo}-{workload}-inf", workload, inf_num, [1e999])
                out[f"{workload}_saturation"] = burst[0]["request_throughput"]
                out[f"{workload}_capacity"] = steady_capacity(burst[0])
            key = "capacity" if workload == "sharegpt" else f"{workload}_capacity"
            ref = ref or out[key] or out.get(f"{workload}_saturation") or out.get("saturation")
            fracs = list(args.fracs)
            step = fracs[-1] - fracs[-2] if len(fracs) > 1 else 0.1
            extra = 0
            while fracs:  # one client run per rate, sized to last --rate-seconds
                frac = round(fracs.pop(0), 3)
                rate = round(frac * ref, 2)
                n = max(num, math.ceil(rate * args.rate_seconds))
                res = drive(args, server, f"{topo}-{workload}-r{frac:g}", workload, n, [rate],
                            label=f"{topo}-{workload}-rates")  # fmt: skip
                met = max(attainment(res[0], slos) for slos in SLOS.values())
                if not fracs and met >= ATTAINMENT and extra < args.extend:
                    # the last rate still met an SLO pair: the reference was low; go on up
                    # until the frontier is bracketed (at most --extend more rates)
                    fracs.append(frac + step)
                    extra += 1
                    log(f"{topo} {workload}: attainment {met:.2f} at {rate} req/s: one more rate")
            out[f"{workload}_extra_rates"] = extra
    finally:
        server.stop()
    return out


def run(args: argparse.Namespace) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary_path = Path(args.out) / "summary.json"
    summary: dict[str, Any] = {"model": args.model, "engine": args.engine, "phases": {}}
    for name in args.phases.split(","):
        t0 = time.monotonic()
        try:
            if name == "offline":  # in a child: its GPU memory is gone when it exits
                child = Path(args.out) / "offline.json"
                argv = [sys.executable, __file__, "offline-child", *sys.argv[2:], "--child-out"]
                subprocess.run([*argv, str(child)], check=True, timeout=args.start_timeout)
                summary["phases"][name] = json.loads(child.read_text())
            else:
                summary["phases"][name] = phase(args, name)
        except Exception as exc:  # keep what the other phases measure
            log(f"phase {name} failed: {exc!r}")
            summary["phases"][name] = {"error": repr(exc)[:2000]}
        summary["phases"][name]["wall_s"] = time.monotonic() - t0
        summary_path.write_text(json.dumps(summary, indent=1))
        log(f"phase {name}: {summary['phases'][name]}")


# --------------------------------------------------------------------------- report


def load_runs(dirs: list[Path]) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    runs: dict[str, list[dict]] = {}
    phases: dict[str, Any] = {}
    for d in dirs:
        for f in sorted(d.glob("*.json.gz")):
            with gzip.open(f, "rt") as fh:
                data = json.load(fh)
            for label, entry in data["runs"].items():
                runs.setdefault(label, []).extend(entry["results"])
        if (d / "summary.json").exists():  # one topology's sweeps may come from several runs
            for name, phase_out in json.loads((d / "summary.json").read_text())["phases"].items():
                phases[name] = phases.get(name, {}) | phase_out
    return runs, phases


def goodput(result: dict[str, Any], slos: dict[str, float]) -> float:
    recs = result.get("requests")
    if not recs:
        return float("nan")
    return bench.compute_metrics(recs, slos)["request_goodput"]


ATTAINMENT = 0.9  # DistServe: goodput is the highest rate at which 90 % of requests meet both SLOs


# Attainment counts the requests that arrived after this share of a rate run's arrival window:
# the first arrivals meet an empty server (a short run's optimistic start). 0: every request.
STEADY_FROM = 0.0


def attainment(
    result: dict[str, Any], slos: dict[str, float], steady_from: float | None = None
) -> float:
    """The share of a run's requests that completed within both SLOs (failures miss), of
    those sent after ``steady_from`` (default ``STEADY_FROM``, ``--steady-from``) of the
    run's sending window."""
    recs = result.get("requests")
    if not recs:
        return float("nan")
    skip = STEADY_FROM if steady_from is None else steady_from
    if skip > 0:
        last = max(r["start"] for r in recs)
        recs = [r for r in recs if r["start"] >= skip * last] or recs
    met = sum(1 for r in recs if r["success"] and bench.meets_slos(bench.Record(**r), slos))
    return met / len(recs)


def frontier(points: list[tuple[float, float]], target: float = ATTAINMENT) -> dict[str, Any]:
    """DistServe's goodput from (offered rate, attainment) points of one topology: the highest
    rate measured before the first that misses ``target`` (``measured``), and the rate where
    attainment crosses ``target`` between those two, linearly (``interpolated``). ``below``:
    the lowest rate already missed; ``above``: none missed."""
    pts = sorted((r, a) for r, a in points if r != float("inf"))
    last = None
    for rate, att in pts:
        if att < target:
            if last is None:
                return {"measured": 0.0, "interpolated": 0.0, "bound": "below", "first_miss": rate}
            (r0, a0), (r1, a1) = last, (rate, att)
            cross = r0 + (r1 - r0) * (a0 - target) / (a0 - a1) if a0 != a1 else r0
            return {"measured": r0, "interpolated": cross, "bound": "", "first_miss": rate}
        last = (rate, att)
    top = last[0] if last else float("nan")
    return {"measured": top, "interpolated": top, "bound": "above", "first_miss": None}


def topologies(runs: dict[str, list[dict]], workload: str) -> list[str]:
    """The topologies with a rate sweep of ``workload`` in ``runs`` (colocated ones first)."""
    suffix = f"-{workload}-rates"
    found = {k[: -len(suffix)] for k in runs if k.endswith(suffix)}
    return sorted(found, key=lambda t: (not t.startswith(("two", "one")), t))


def goodput_tables(runs: dict[str, list[dict]]) -> tuple[list[str], dict[str, Any]]:
    """Per workload and SLO pair: each topology's capacity, its attainment at every offered
    rate, and its goodput (``frontier``), as markdown lines and as JSON."""
    lines, out = [], {}
    for workload in ("sharegpt", "long"):
        for slo_name, slos in SLOS.items():
            rows = {}
            for topo in topologies(runs, workload):
                label = topology_label(topo)
                rates = runs.get(f"{topo}-{workload}-rates", [])
                inf = runs.get(f"{topo}-{workload}-inf", [])
                if not rates:
                    continue
                sat = (
                    (steady_capacity(inf[0]) or inf[0]["request_throughput"])
                    if inf
                    else float("nan")
                )
                pts = sorted((r["offered_rate"], attainment(r, slos)) for r in rates)
                rows[label] = {"capacity": sat, "points": pts, "goodput": frontier(pts)}
                rows[label]["gpus"] = topology_gpus(topo)
                tails = [(r["kv_tail_ms_mean"], r["mean_ttft_ms"]) for r in rates + inf
                         if r.get("kv_tail_ms_mean") is not None]  # fmt: skip
                if tails:  # the layer-wise stream's exposed tail against TTFT, per run
                    rows[label]["kv_tail_share"] = [t / ttft for t, ttft in tails if ttft]
                    rows[label]["kv_tail_ms"] = [t for t, _ in tails]
            if not rows:
                continue
            key = f"{workload}/{slo_name}"
            out[key] = rows
            slo = f"TTFT {slos['ttft']:g} ms, TPOT {slos['tpot']:g} ms"
            lines += ["", f"{workload}, SLO {slo_name} ({slo}): attainment per offered rate"]
            lines += ["| topology | GPUs | capacity req/s | rate: attainment | goodput req/s "
                      "(measured / interpolated) | per GPU | / capacity | KV tail ms (share of "
                      "mean TTFT) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for label, row in rows.items():
                g = row["goodput"]
                cells = ", ".join(f"{r:g}: {a:.2f}" for r, a in row["points"])
                bound = {"below": " (missed at every rate)", "above": " (met at every rate)"}
                tail = "-"
                if row.get("kv_tail_ms"):
                    lo, hi = min(row["kv_tail_ms"]), max(row["kv_tail_ms"])
                    share = row["kv_tail_share"] or [float("nan")]
                    tail = f"{lo:.1f}-{hi:.1f} ({min(share):.1%}-{max(share):.1%})"
                lines.append(
                    f"| {label} | {row['gpus']} | {row['capacity']:.2f} | {cells} | "
                    f"{g['measured']:.2f} / {g['interpolated']:.2f}{bound.get(g['bound'], '')} | "
                    f"{g['interpolated'] / row['gpus']:.2f} | "
                    f"{g['interpolated'] / row['capacity']:.2f} | {tail} |"
                )
    return lines, out


def plot_frontier(data: dict[str, Any], png: Path) -> None:
    """Attainment against offered rate, a panel per workload and SLO pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(data)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, row in data[key].items():
            rates, atts = zip(*row["points"], strict=True)
            ax.plot(rates, atts, marker="o", label=f"{label} (goodput "
                    f"{row['goodput']['interpolated']:.1f})")  # fmt: skip
        ax.axhline(ATTAINMENT, color="grey", ls="--", lw=0.8)
        ax.set_title(key)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    log(f"wrote {png}")


def report(args: argparse.Namespace) -> None:
    runs, phases = load_runs([Path(d) for d in args.dirs])
    lines = []
    off = phases.get("offline", {}).get("request_throughput")
    one = runs.get("one-sharegpt-inf")
    if off and one:
        r = one[0]["request_throughput"]
        lines.append(
            f"one colocated worker through the gateway: {r:.2f} req/s vs offline {off:.2f} "
            f"= {r / off:.3f}x ({phases['offline'].get('gpu', '')})"
        )
    two = runs.get("two-sharegpt-inf")
    if one and two:
        a, b = one[0]["request_throughput"], two[0]["request_throughput"]
        lines.append(f"two colocated / one: {b:.2f} / {a:.2f} = {b / a:.3f}x")
    pd_rates, two_rates = runs.get("pd-sharegpt-rates", []), runs.get("two-sharegpt-rates", [])
    for p in pd_rates:
        for t in two_rates:
            if p["offered_rate"] == t["offered_rate"]:
                lines.append(
                    f"ShareGPT at {p['offered_rate']} req/s: p99 TTFT 1P1D {p['p99_ttft_ms']:.0f} ms "
                    f"/ 2 colocated {t['p99_ttft_ms']:.0f} ms = "
                    f"{p['p99_ttft_ms'] / t['p99_ttft_ms']:.2f}x"
                )
    header = "| run | offered | req/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | "
    header += " | ".join(f"goodput {k} ({v['ttft']:g}/{v['tpot']:g})" for k, v in SLOS.items())
    table = [header + " |", "|" + "---|" * (5 + len(SLOS))]
    summary: dict[str, Any] = {"phases": phases, "runs": {}}
    for label, results in sorted(runs.items()):
        summary["runs"][label] = []
        for res in results:
            gp = {k: goodput(res, v) for k, v in SLOS.items()}
            slim = {k: v for k, v in res.items() if k != "requests"} | {"goodput": gp}
            summary["runs"][label].append(slim)
            table.append(
                f"| {label} | {bench.format_rate(res['offered_rate'])} | "
                f"{res['request_throughput']:.2f} | {res['median_ttft_ms']:.0f} / "
                f"{res['p90_ttft_ms']:.0f} / {res['p99_ttft_ms']:.0f} | "
                f"{res['median_tpot_ms']:.1f} / {res['p90_tpot_ms']:.1f} | "
                + " | ".join(f"{gp[k]:.2f}" for k in SLOS)
                + " |"
            )
    frontier_lines, frontiers = goodput_tables(runs)
    summary["goodput"] = frontiers
    print("\n".join(lines + [""] + table + frontier_lines))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot and frontiers:
        png = Path(args.plot)
        plot_frontier(frontiers, png.with_name(f"{png.stem}_goodput{png.suffix}"))
    if args.plot:
        for workload in ("sharegpt", "long"):
            data = {"runs": {}}
            for topo in topologies(runs, workload):
                results = runs.get(f"{topo}-{workload}-rates", []) + runs.get(
                    f"{topo}-{workload}-inf", []
                )
                data["runs"][topology_label(topo)] = {"results": results}
            if data["runs"]:
                png = Path(args.plot)
                bench.plot_report(data, png.with_name(f"{png.stem}_{workload}{png.suffix}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    c = sub.add_parser("offline-child")
    for r in (r, c):  # noqa: B020 (the child takes the run's arguments)
        add_run_args(r)
    c.add_argument("--child-out", required=True)
    p = sub.add_parser("report")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--steady-from", type=float, default=0.0, help="as run's")
    args = ap.parse_args()
    global STEADY_FROM
    STEADY_FROM = args.steady_from if args.cmd != "offline-child" else 0.0
    if not 0.0 <= STEADY_FROM < 1.0:
        raise SystemExit(f"--steady-from must be in [0, 1), got {STEADY_FROM}")
    if args.cmd in ("run", "offline-child") and args.engine is None:
        args.engine = ["load_format=dummy", "max_model_len=8192"]
    if args.cmd == "run":
        run(args)
    elif args.cmd == "offline-child":
        Path(args.child_out).write_text(json.dumps(offline(args)))
    else:
        report(args)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", required=True, help="HF folder (config + tokenizer)")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument(
        "--predictor",
        default=None,
        help="tandem serve --predictor (default: serve's; 'none' where the learned one's "
        "artifact was left out of a GPU machine's carry)",
    )
    r.add_argument("--phases", default="offline,one,two,pd")
    r.add_argument(
        "--workloads",
        default="sharegpt,long",
        help="the rate sweeps to run (comma-separated): sharegpt, long",
    )
    r.add_argument(
        "--gpus",
        default=None,
        help="CUDA devices for the topology instead of its own (0 / 0,1): e.g. 2,3 to measure "
        "two topologies side by side on a 4-GPU machine",
    )
    r.add_argument("--out", required=True)
    r.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="EngineConfig fields (default: load_format=dummy max_model_len=8192)",
    )
    r.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT at inf")
    r.add_argument(
        "--requests-file",
        type=Path,
        default=None,
        help="the ShareGPT requests from a benchmarks/workloads.py file (e.g. vLLM's sample, "
        "benchmarks/data/vllm_sharegpt_llama3_1000.json) instead of random ids at the lengths "
        "of benchmarks/data/sharegpt_llama3_lengths.json",
    )
    r.add_argument("--rate-prompts", type=int, default=400, help="ShareGPT at each finite rate")
    r.add_argument("--warmup", type=int, default=0, help="ShareGPT requests first, untimed")
    r.add_argument(
        "--extend",
        type=int,
        default=4,
        help="more rates, a step apart, while the last still meets an SLO pair (at most)",
    )
    r.add_argument(
        "--rate-seconds",
        type=float,
        default=30.0,
        help="each finite rate sends rate x this many requests (at least the --*rate-prompts)",
    )
    r.add_argument("--long-prompts", type=int, default=200)
    r.add_argument("--long-rate-prompts", type=int, default=100)
    r.add_argument("--long-input", type=int, nargs=2, default=[2048, 7936])
    r.add_argument("--long-output", type=int, nargs=2, default=[64, 256])
    r.add_argument("--max-output", type=int, default=None)
    r.add_argument("--fracs", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    r.add_argument(
        "--steady-from",
        type=float,
        default=0.0,
        help="SLO attainment over the requests sent after this share of a rate run's window "
        "(0.3: its first 30 %% met an emptier server); the report takes it too",
    )
    r.add_argument("--ref-rate", type=float, default=None, help="ShareGPT rates are fracs of it")
    r.add_argument("--long-ref-rate", type=float, default=None)
    r.add_argument("--max-concurrent", type=int, default=2048)
    r.add_argument("--start-timeout", type=float, default=400.0)
    r.add_argument("--bench-timeout", type=float, default=400.0)
    r.add_argument("--inf-only", action="store_true", help="only ShareGPT at inf per phase")
    r.add_argument("--profile", action="store_true", help="CPU per process; py-spy stacks")
    r.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="serve.py's HTTP client (httpx: the one the runs before 2026-11-28 used)",
    )
    r.add_argument("--profile-delay", type=float, default=8.0, help="py-spy starts then (s)")
    r.add_argument(
        "--text-prompts",
        action="store_true",
        help="the served phases send --requests-file's prompts as text (serve.py --text-prompts)",
    )
    r.add_argument(
        "--chat",
        action="store_true",
        help="the served phases send --requests-file's prompts as text, each the one user "
        "message of a chat (/v1/chat/completions: the model's template adds its tokens)",
    )


if __name__ == "__main__":
    main()
