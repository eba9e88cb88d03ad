"""The chaos table: faults in turn under a steady streaming load, through a real gateway.

What runs (all real: Ray actors, a redis-server child, uvicorn on 127.0.0.1, httpx over sockets)::

    1. jobs        short text prompts, chat prompts and long token-id prompts (or ShareGPT ones),
                   greedy, ``ignore_eos``, a fixed ``max_tokens`` each; the expected text of
                   each is transformers' greedy tokens in fp32 (``--expect hf``), rendered by
                   the router's own detokenizer, or an uninterrupted run (``--expect baseline``)
    2. cluster     redis-server (router/redis_server.py), LocalCluster (prefill + decode
                   workers publishing to that index), and the gateway (router.gateway over
                   router.service.ClusterBackend) on a free port, in a thread of this process
    3. scenarios   for each: ``--concurrency`` lanes send streamed requests back to back (at
                   least ``--requests``, and for as long as the fault is still running); the
                   fault waits for its moment (streams mid-decode, long prompts mid-prefill),
                   strikes, and may send extra requests of its own (a burst, cut clients)
    4. afterwards  stopped workers are continued, killed ones replaced (the controller starts
                   new ones), and every live worker must come back idle with exact block
                   accounting (``check_idle``); blocks still in use then are leaked

Each request ends as exactly one of:

* ``exact``: ``data: [DONE]``, finish_reason ``length``, ``max_tokens`` tokens, the expected text;
* ``wrong``: it completed with another text or length (a bug: must be 0);
* ``rejected``: 429 or 503 with Retry-After and an OpenAI error body (before any token);
* ``error``: any other OpenAI error JSON, as an HTTP error or in-band in the stream;
* ``cancelled``: the client went away on purpose (the disconnect scenarios);
* ``lost``: none of those: no byte for ``--stall-deadline`` s, no end within ``--deadline`` s,
  a stream that ends without [DONE] or error, an error that is not OpenAI JSON (must be 0).

The longest stall is the largest gap between two consecutive frames of one stream; for the
streams that ran on a killed or stopped worker, the gap across the fault is listed too (the
stall a resumed stream saw).

    python benchmarks/chaos.py                               # CPU, SmolLM2, every scenario
    python benchmarks/chaos.py --scenarios kill-decode,hang-decode --requests 32
    python benchmarks/chaos.py --device cuda --model DIR --num-prefill 1 --num-decode 2 \\
        --workload sharegpt-ids --scenarios kill-decode --requests 200 --concurrency 32 \\
        --max-tokens 256 --expect none

Writes ``--json`` (default benchmarks/results/chaos.json) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks.serve` when run as a script

from benchmarks import serve as bench  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "chaos.json"
OUTCOMES = ("exact", "wrong", "rejected", "error", "cancelled", "lost")
TOPICS = [
    "rivers",
    "mountains",
    "bread",
    "copper",
    "lanterns",
    "harbors",
    "gardens",
    "owls",
    "glaciers",
    "violins",
    "bridges",
    "comets",
]
WORDS = ["river", "stone", "mill", "bread", "orange", "violet", "copper", "garden", "lantern"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- config


@dataclass
class ChaosConfig:
    """Every knob of one chaos run (the CLI's flags; the CI test builds a small one)."""

    device: str = "cpu"
    model: str = "smollm2"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    num_prefill: int = 2
    num_decode: int = 2
    scenarios: list[str] = field(default_factory=lambda: list(DEFAULT_SCENARIOS))
    requests: int = 16  # load requests per scenario (at least; more while a fault runs)
    concurrency: int = 4  # load lanes
    max_tokens: int = 24
    max_concurrent: int = 12  # the gateway's bound (the overload scenario sends 2x)
    max_body_bytes: int = 8 << 20  # the gateway's body limit
    workload: str = "short"  # short | sharegpt | sharegpt-ids
    lengths_file: str | None = None  # sharegpt-ids
    long_tokens: int = 512  # long prompts (token ids)
    long_max_tokens: int = 12
    long_burst: int = 6
    kill_prefill_longs: int = 3  # long prompts in prefill when a prefill worker is killed
    disconnects: int = 3  # cut clients per disconnect scenario
    expect: str = "auto"  # hf | baseline | none | auto (hf on cpu, none on cuda)
    stall_timeout_s: float = 10.0  # a worker silent (or one engine step) this long: hung
    transfer_timeout_s: float = 60.0
    max_resumes: int = 2
    kv_blocks: int | None = 512  # per worker, of 16 tokens (None: the engine's own sizing)
    engine: dict[str, Any] = field(default_factory=dict)  # more EngineConfig fields
    decode_gpus: float = 1.0  # CUDA: GPUs per decode worker (0.5: two share one)
    prefill_gpus: float = 1.0  # CUDA: GPUs per prefill worker
    replace: bool = True  # start a new worker for each one killed
    stall_deadline_s: float = 60.0  # no byte this long: lost
    deadline_s: float = 300.0  # no end this long: lost
    idle_timeout_s: float = 30.0  # workers must be idle this long after a scenario
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("the chaos run is disaggregated: num_prefill and num_decode >= 1")
        if self.expect not in ("hf", "baseline", "none", "auto"):
            raise ValueError(f"expect must be hf, baseline, none or auto, got {self.expect!r}")

    @property
    def oracle(self) -> str:
        """Where expected texts come from: hf, baseline or none (auto: hf on cpu)."""
        if self.expect == "auto":
            return "hf" if self.device == "cpu" else "none"
        return self.expect


# ------------------------------------------------------------------------------------ jobs


@dataclass
class Job:
    """One request body's content and the text it must produce."""

    name: str
    endpoint: str  # completions | chat
    prompt: Any  # completions: str or token ids; chat: messages
    prompt_ids: list[int]
    max_tokens: int
    expected: str | None = None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "temperature": 0, "ignore_eos": True}
        if self.endpoint == "chat":
            body |= {"messages": self.prompt, "max_completion_tokens": self.max_tokens}
        else:
            body |= {"prompt": self.prompt, "max_tokens": self.max_tokens}
        return body | {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Jobs:
    load: list[Job]  # the lanes cycle through these
    long: dict[str, list[Job]]  # distinct long prompts (no prefix hits) for each use

    def checked(self) -> list[Job]:
        """The jobs whose text is checked (a client cut before its first token has none)."""
        cut = ("disconnect-prefill", "disconnect-transfer")
        return [*self.load, *(j for use, js in self.long.items() if use not in cut for j in js)]


KILL_PREFILL_ROUNDS = 3  # batches of long prompts sent until one is seen in a prefill worker

LONG_USES = {
    "calibrate": lambda cfg: 1,
    "kill-prefill": lambda cfg: cfg.kill_prefill_longs * KILL_PREFILL_ROUNDS,
    "long-burst": lambda cfg: cfg.long_burst,
    "disconnect-prefill": lambda cfg: cfg.disconnects,
    "disconnect-transfer": lambda cfg: cfg.disconnects,
}


def short_jobs(tok: Any, cfg: ChaosConfig) -> list[Job]:
    """Text completions and chat requests about a few topics (a model without a tokenizer:
    random token ids)."""
    from engine.tokenizer import apply_chat_template, encode_prompt

    jobs = []
    for i, topic in enumerate(TOPICS[: max(6, cfg.concurrency)]):
        if tok is None:
            ids = random_ids(random.Random(cfg.seed + i), 24)
            jobs.append(Job(f"ids-{topic}", "completions", ids, ids, cfg.max_tokens))
        elif i % 3 == 2:
            messages = [{"role": "user", "content": f"Write two sentences about {topic}."}]
            ids = apply_chat_template(tok, messages, add_generation_prompt=True)
            jobs.append(Job(f"chat-{topic}", "chat", messages, ids, cfg.max_tokens))
        else:
            text = (
                f"Here is a short note about {topic}, written for a curious reader who enjoys "
                "plain facts and old stories:"
            )
            ids = encode_prompt(tok, text)
            jobs.append(Job(f"text-{topic}", "completions", text, ids, cfg.max_tokens))
    return jobs


def long_jobs(tok: Any, cfg: ChaosConfig) -> dict[str, list[Job]]:
    """Distinct prompts of ``long_tokens`` token ids (their first words differ) for the
    calibration and each scenario that sends some."""
    from engine.tokenizer import encode_prompt

    rng = random.Random(cfg.seed + 1)
    out: dict[str, list[Job]] = {}
    for use, count in LONG_USES.items():
        if use != "calibrate" and use not in cfg.scenarios:
            continue
        for i in range(count(cfg)):
            if tok is None:
                ids = random_ids(rng, cfg.long_tokens)
            else:
                words = [rng.choice(WORDS) for _ in range(cfg.long_tokens)]
                text = f"Document {use} {i} {rng.random():.6f}: " + " ".join(words)
                ids = encode_prompt(tok, text)[: cfg.long_tokens]
            job = Job(f"long-{use}-{i}", "completions", ids, ids, cfg.long_max_tokens)
            out.setdefault(use, []).append(job)
    return out


def random_ids(rng: random.Random, n: int) -> list[int]:
    return bench.random_ids(rng, n, bench.SAFE_ID_RANGE)


def sharegpt_jobs(tok: Any, cfg: ChaosConfig) -> list[Job]:
    """ShareGPT first turns (text) or random ids of ShareGPT lengths, answers clipped to
    ``max_tokens``; prompts of at most 1024 tokens, as benchmarks/serve.py takes them."""
    n = max(64, cfg.concurrency * 4)
    args = argparse.Namespace(
        num_prompts=n,
        max_prompt=1024,
        max_output=cfg.max_tokens,
        seed=cfg.seed,
        lengths_file=Path(cfg.lengths_file) if cfg.lengths_file else None,
    )
    if cfg.workload == "sharegpt":
        reqs = bench.sharegpt_text(args, tok)
    else:
        args.lengths_file = args.lengths_file or bench.DEFAULT_LENGTHS
        reqs = bench.sharegpt_ids(args, tok)
    jobs = []
    for i, r in enumerate(reqs):
        ids = r.prompt if isinstance(r.prompt, list) else tok(r.prompt)["input_ids"]
        jobs.append(Job(f"sharegpt-{i}", "completions", r.prompt, list(ids), r.output_len))
    return jobs


def render(tok: Any, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text the router streams for these tokens (its own incremental detokenizer)."""
    from engine.detokenizer import SequenceText
    from engine.sampling_params import SamplingParams

    seq = SequenceText(tok, prompt_ids, SamplingParams(temperature=0.0, ignore_eos=True))
    text = ""
    for t in token_ids:
        seq.add(t)
        text += seq.next_text(False)
    return text + seq.next_text(True)


def hf_expected(model_dir: str, tok: Any, jobs: Sequence[Job]) -> None:
    """Fill each job's expected text from transformers' greedy tokens (fp32, CPU), one
    unpadded prompt at a time (the same oracle as tests/hf_oracle.py)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second thread costs 4x on a busy 2-core machine, gains ~1.5x idle
    try:
        _generate_expected(model, tok, jobs)
    finally:
        torch.set_num_threads(threads)


def _generate_expected(model: Any, tok: Any, jobs: Sequence[Job]) -> None:
    import torch

    for i, job in enumerate(jobs):
        x = torch.tensor([job.prompt_ids])
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=job.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        job.expected = render(tok, job.prompt_ids, out[0, len(job.prompt_ids) :].tolist())
        if sys.stderr.isatty():
            sys.stderr.write(f"\r transformers oracle: {i + 1}/{len(jobs)}")
    if sys.stderr.isatty():
        sys.stderr.write("\n")


# ------------------------------------------------------------------------------- the cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayThread:
    """The OpenAI gateway over the cluster's workers, served by uvicorn on 127.0.0.1 in a
    thread with its own event loop (its own membership view, tokenizer and router)."""

    def __init__(
        self,
        cluster: Any,
        index_url: str | None,
        cfg: Any,
        model_name: str,
        **backend: Any,
    ) -> None:
        """``cfg``: max_resumes, stall_timeout_s, max_concurrent, max_body_bytes (a
        ChaosConfig); ``index_url`` None: no prefix index; ``backend``: more ClusterBackend
        arguments (a placement policy)."""
        self.cluster = cluster
        self.backend_kwargs = backend
        self.index_url = index_url
        self.cfg = cfg
        self.model_name = model_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend: Any = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-gateway", daemon=True)

    def start(self, timeout_s: float = 120.0) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self._server is not None and self._server.started):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start within {timeout_s} s")
            time.sleep(0.05)
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc

    async def _main(self) -> None:
        import uvicorn

        from engine.prefix_index import PrefixIndex
        from engine.tokenizer import load_tokenizer
        from router.gateway import create_app
        from router.membership import MembershipView
        from router.service import ClusterBackend

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # not the main thread: no signal handlers
                yield

        controller = self.cluster.controller
        members = MembershipView(await controller.members.remote(), controller)
        index = None
        if self.index_url is not None:
            index = PrefixIndex(self.index_url, self.cluster.index_namespace)
        self.backend = ClusterBackend(
            members,
            tokenizer=load_tokenizer(self.cluster.model_dir),  # not shared with the driver
            index=index,
            model_name=self.model_name,
            max_resumes=self.cfg.max_resumes,
            stall_timeout_s=self.cfg.stall_timeout_s,
            **self.backend_kwargs,
        )
        app = create_app(
            self.backend,
            max_concurrent=self.cfg.max_concurrent,
            max_body_bytes=self.cfg.max_body_bytes,
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = Server(config)
        self._loop = asyncio.get_running_loop()
        try:
            await self._server.serve()
        finally:
            await self.backend.aclose()
            if index is not None:
                index.close()

    def stop(self) -> None:
        if self._loop is not None and self._server is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)
            self._thread.join(30)

    def decode_names(self) -> set[str]:
        return {w.name for w in self.backend.members.decode}

    def prefill_names(self) -> set[str]:
        return {w.name for w in self.backend.members.prefill}

    def routed_names(self) -> set[str]:
        """The workers this gateway places requests on now (ACTIVE and not suspected by it)."""
        m = self.backend.members
        return {w.name for w in (*m.prefill, *m.decode, *m.colocated)}


@dataclass
class WorkerIdle:
    """One live worker after a scenario: blocks still in use once idle, and what was wrong."""

    name: str
    leaked_blocks: int
    problem: str | None


class Harness:
    """Redis, the workers and the gateway of one chaos run, and the faults applied to them."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.redis: Any = None
        self.cluster: Any = None
        self.gateway: GatewayThread | None = None
        self.stopped: set[int] = set()  # pids under SIGSTOP
        self.killed: list[str] = []

    def start(self) -> Harness:
        from cluster.launch.local import LocalCluster
        from router.redis_server import RedisServer

        cfg = self.cfg
        self.redis = RedisServer().start()
        # blocks of 16 on every device: kv_blocks counts them, and the scenarios' prompts are
        # sized so that they fill some (prefix lookups, the index's outage)
        engine = {"max_num_batched_tokens": 256, "max_num_seqs": 64, "block_size": 16, **cfg.engine}
        engine["dtype"] = cfg.dtype or ("float32" if cfg.device == "cpu" else "bfloat16")
        if cfg.kv_blocks:
            engine["num_kv_blocks"] = cfg.kv_blocks
        self.cluster = LocalCluster(
            model=cfg.model,
            num_prefill=cfg.num_prefill,
            num_decode=cfg.num_decode,
            device=cfg.device,
            engine=engine,
            transfer_timeout_s=cfg.transfer_timeout_s,
            stall_timeout_s=cfg.stall_timeout_s,
            index_url=self.redis.url,
            gpus={
                role: share
                for role, share in (("prefill", cfg.prefill_gpus), ("decode", cfg.decode_gpus))
                if share != 1.0
            },
        )
        self.gateway = GatewayThread(self.cluster, self.redis.url, cfg, "chaos").start()
        return self

    def close(self) -> None:
        for pid in list(self.stopped):
            self.cont(pid)
        if self.gateway is not None:
            self.gateway.stop()
        if self.cluster is not None:
            self.cluster.shutdown()
        if self.redis is not None:
            self.redis.stop()

    # -- faults ----------------------------------------------------------------------------

    def pid(self, name: str) -> int:
        self.cluster.refresh()
        return next(w.pid for w in self.cluster.workers if w.name == name)

    def kill(self, name: str) -> None:
        os.kill(self.pid(name), signal.SIGKILL)
        self.killed.append(name)

    def stop(self, name: str) -> int:
        pid = self.pid(name)
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        return pid

    def cont(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def replace_killed(self, timeout_s: float = 300.0) -> list[str]:
        """Start one new worker of the role of each killed one (the controller's ``start``
        adds workers); returns once the gateway routes to them."""
        import ray

        roles = [n.split("-")[0] for n in self.killed]
        self.killed = []
        if not roles:
            return []
        before = {w.name for w in self.cluster.workers}
        ray.get(
            self.cluster.controller.start.remote(roles.count("prefill"), roles.count("decode"), 0),
            timeout=timeout_s,
        )
        self.cluster.refresh()
        new = sorted({w.name for w in self.cluster.workers} - before)
        deadline = time.monotonic() + 60
        while not set(new) <= self.gateway.decode_names() | self.gateway.prefill_names():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway does not route to the new workers {new}")
            time.sleep(0.1)
        return new

    def wait_dead(self, name: str, timeout_s: float = 30.0) -> None:
        """Until the controller has marked ``name`` dead (so idle checks skip it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.cluster.refresh()
            if name not in {w.name for w in self.cluster.workers}:
                return
            time.sleep(0.2)

    def wait_routed(self, timeout_s: float = 60.0) -> bool:
        """Until the gateway routes to every live worker again (a worker hung and then resumed
        is suspected until it answers; a scenario that starts before then finds one worker
        fewer than it assumes). False past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.cluster.refresh()
            live = {w.name for w in self.cluster.workers}
            if live <= self.gateway.routed_names():
                return True
            if time.monotonic() > deadline:
                log(
                    f"not routed to again after {timeout_s:g} s: {sorted(live - self.gateway.routed_names())}"
                )
                return False
            time.sleep(0.1)

    # -- idle checks -------------------------------------------------------------------------

    def settle(self) -> list[WorkerIdle]:
        """Wait (up to idle_timeout_s) for every live worker to be idle with exact block
        accounting; then each one's blocks still in use and its problem, if any."""
        import ray

        deadline = time.monotonic() + self.cfg.idle_timeout_s
        while True:
            self.cluster.refresh()
            workers = list(self.cluster.workers)
            try:
                problems = ray.get([w.handle.check_idle.remote() for w in workers], timeout=30)
                stats = ray.get([w.handle.stats.remote() for w in workers], timeout=30)
            except Exception as exc:  # noqa: BLE001 - a worker died meanwhile: look again
                if time.monotonic() > deadline:
                    raise
                log(f"idle check: {exc!r}"[:200])
                time.sleep(0.5)
                continue
            if all(p is None for p in problems) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = []
        for w, p, s in zip(workers, problems, stats, strict=True):
            mismatch = (
                s["total_blocks"] - s["free_blocks"] - s["cached_blocks"] - s["in_use_blocks"]
            )
            out.append(WorkerIdle(w.name, s["in_use_blocks"] + abs(mismatch), p))
        return out

    def step_ages(self, role: str) -> dict[str, float]:
        """How long each live ``role`` worker's engine step has been running (0: between
        steps), from ``health``, which the event loop answers while a step runs."""
        import ray

        from engine.messages import control

        workers = [w for w in self.cluster.workers if w.role == role and w.name not in self.killed]
        got = ray.get([control(w.handle.health).remote() for w in workers], timeout=10)
        return {w.name: h["step_age_s"] for w, h in zip(workers, got, strict=True)}


# ------------------------------------------------------------------------------ the client


@dataclass
class Flight:
    """One request as its client saw it (times in s from the scenario's start)."""

    id: int
    job: Job
    role: str  # load | burst | long | cut
    sent: float = 0.0
    headers_at: float | None = None
    ended: float | None = None
    status: int = 0
    prefill: str = ""
    decode: str = ""
    frames: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    cut_after_frames: int | None = None
    cut_requested: bool = False
    outcome: str = ""
    detail: str = ""
    retry_after_s: float = 0.0  # a rejection's Retry-After

    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.frames, self.frames[1:], strict=False)), default=0.0)

    def gap_across(self, t: float) -> float | None:
        """The stall a fault at ``t`` caused this stream: its longest gap between frames that
        ends after ``t`` (from ``t`` itself when it had no frame before). Not just the gap
        across ``t``: frames the dead worker produced before ``t`` may still arrive after it,
        and the resume's gap comes once they are read. None when no frame came after ``t``."""
        before = [x for x in self.frames if x <= t]
        after = [x for x in self.frames if x > t]
        if not after:
            return None
        points = [before[-1] if before else t, *after]
        return max(b - a for a, b in zip(points, points[1:], strict=False))

    def ttft(self) -> float | None:
        return self.frames[0] - self.sent if self.frames else None


def openai_error(obj: Any) -> bool:
    """``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and "code" in err
    )


def classify_http_error(f: Flight, status: int, headers: Any, raw: bytes) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    f.error = body.get("error") if isinstance(body, dict) else None
    text = raw[:200].decode("utf-8", "replace")
    if not openai_error(body):
        f.outcome, f.detail = "lost", f"HTTP {status} without an OpenAI error body: {text}"
    elif status in (429, 503):
        retry = headers.get("retry-after", "")
        ok = retry.isdigit() and int(retry) >= 1
        f.outcome = "rejected" if ok else "lost"
        f.retry_after_s = float(retry) if ok else 1.0
        f.detail = f"HTTP {status}" + ("" if ok else f" with Retry-After {retry!r}")
    else:
        f.outcome, f.detail = "error", f"HTTP {status}: {f.error['message'][:400]}"


async def read_frames(resp: Any, f: Flight, t0: float) -> None:
    """SSE frames into ``f``: frame times, text, finish reason, usage, an in-band error."""
    chat = f.job.endpoint == "chat"
    async for line in bench.sse_lines(resp):
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            f.done = True
            return
        data = json.loads(payload)
        if "error" in data:
            f.error = data
            continue
        choices = data.get("choices") or []
        if choices and not (chat and "role" in (choices[0].get("delta") or {})):
            f.frames.append(time.monotonic() - t0)
            f.text += bench.chunk_text(data, chat)
            f.finish_reason = choices[0].get("finish_reason") or f.finish_reason
        if data.get("usage"):
            f.completion_tokens = data["usage"].get("completion_tokens")
        if f.cut_after_frames is not None and len(f.frames) >= f.cut_after_frames:
            f.cut_requested = True
            return


def judge_stream(f: Flight) -> None:
    """The outcome of a 200 stream that was read to its end (or cut)."""
    if f.cut_requested and not f.done:
        f.outcome, f.detail = "cancelled", f"cut after {len(f.frames)} frames"
    elif f.error is not None:
        ok = openai_error(f.error)
        f.outcome = "error" if ok else "lost"
        msg = f.error.get("error", {}).get("message", "") if ok else str(f.error)[:160]
        f.detail = f"in-band: {msg[:400]}"
        f.error = f.error.get("error") if ok else f.error
    elif not f.done:
        f.outcome, f.detail = "lost", f"the stream ended after {len(f.frames)} frames, no [DONE]"
    elif (
        f.finish_reason != "length"
        or f.completion_tokens != f.job.max_tokens
        or (f.job.expected is not None and f.text != f.job.expected)
    ):
        f.outcome = "wrong"
        f.detail = (
            f"finish {f.finish_reason}, {f.completion_tokens} tokens, text "
            f"{f.text[:60]!r} vs expected {(f.job.expected or '')[:60]!r}"
        )
    else:
        f.outcome = "exact"


async def stream_one(client: Any, url: str, model: str, f: Flight, t0: float) -> None:
    """Send ``f``'s request and read its response into ``f``; never raises except when the
    task is cancelled without ``f.cut_requested`` (a deadline, or the caller going away)."""
    import httpx

    path = "/v1/chat/completions" if f.job.endpoint == "chat" else "/v1/completions"
    f.sent = time.monotonic() - t0
    try:
        async with client.stream("POST", url + path, json=f.job.body(model)) as resp:
            f.status, f.headers_at = resp.status_code, time.monotonic() - t0
            f.prefill = resp.headers.get("x-tandem-prefill", "")
            f.decode = resp.headers.get("x-tandem-decode", "")
            if resp.status_code != 200:
                classify_http_error(f, resp.status_code, resp.headers, await resp.aread())
            else:
                await read_frames(resp, f, t0)
                judge_stream(f)
    except asyncio.CancelledError:
        if not f.cut_requested:
            raise
        where = "before the first token" if f.headers_at is None else f"after {len(f.frames)}"
        f.outcome, f.detail = "cancelled", f"cut {where}"
    except httpx.TimeoutException as exc:
        f.outcome, f.detail = "lost", f"no byte for the stall deadline ({type(exc).__name__})"
    except (httpx.HTTPError, ValueError) as exc:
        f.outcome, f.detail = "lost", f"{type(exc).__name__}: {exc}"[:200]
    finally:
        f.ended = time.monotonic() - t0


# ------------------------------------------------------------------------------- a scenario


class Run:
    """One scenario in progress: its requests, the lanes of steady load, the fault's notes."""

    def __init__(self, name: str, h: Harness, client: Any, jobs: Jobs, long_ttft: float) -> None:
        self.name, self.h, self.client, self.jobs = name, h, client, jobs
        self.cfg = h.cfg
        self.long_ttft = long_ttft
        self.flights: list[Flight] = []
        self.extras: list[asyncio.Task] = []
        self.notes: dict[str, Any] = {}
        self.fault_at: float | None = None
        self.fault_wall: float | None = None  # time.time() of the fault (the router's clock)
        self.affected: list[Flight] = []  # streams on the worker the fault hit
        self.hit: Callable[[Flight], bool] = lambda f: True  # which of them it really hit
        self.fault_done = False
        self.t0 = time.monotonic()
        self._next_load = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(
        self,
        job: Job,
        role: str,
        cut_after_s: float | None = None,
        cut_after_frames: int | None = None,
    ) -> Flight:
        """Run one request to its end; ``cut_after_s`` / ``cut_after_frames``: the client goes
        away then (unless it ended first)."""
        f = Flight(len(self.flights), job, role, cut_after_frames=cut_after_frames)
        self.flights.append(f)
        url = self.h.gateway.url
        task = asyncio.ensure_future(stream_one(self.client, url, "chaos", f, self.t0))
        try:
            if cut_after_s is not None:
                await asyncio.wait({task}, timeout=cut_after_s)
                if not task.done():
                    f.cut_requested = True
                    task.cancel()
            await asyncio.wait_for(asyncio.shield(task), self.cfg.deadline_s)
        except asyncio.TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            f.outcome, f.detail = "lost", f"no end within {self.cfg.deadline_s:.0f} s"
        except asyncio.CancelledError:
            if not f.cut_requested:
                raise
        return f

    def extra(self, job: Job, role: str, **cut: Any) -> asyncio.Task:
        """A request beside the load, awaited before the scenario ends."""
        task = asyncio.ensure_future(self.send(job, role, **cut))
        self.extras.append(task)
        return task

    async def lanes(self) -> None:
        """``concurrency`` clients, each sending its next request when the last one ended (after
        the Retry-After of a rejection, as a well-behaved client does)."""

        async def lane() -> None:
            while self._next_load < self.cfg.requests or not self.fault_done:
                job = self.jobs.load[self._next_load % len(self.jobs.load)]
                self._next_load += 1
                f = await self.send(job, "load")
                if f.outcome == "rejected":
                    await asyncio.sleep(f.retry_after_s)

        await asyncio.gather(*(lane() for _ in range(self.cfg.concurrency)))

    def in_flight(self) -> list[Flight]:
        return [f for f in self.flights if f.ended is None]

    def decoding_on(self) -> dict[str, list[Flight]]:
        """Streams in flight with at least 2 frames, by decode worker."""
        by: dict[str, list[Flight]] = {}
        for f in self.in_flight():
            if len(f.frames) >= 2 and f.decode:
                by.setdefault(f.decode, []).append(f)
        return by

    async def until(self, predicate: Callable[[], Any], timeout_s: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            await asyncio.sleep(0.01)
        return None

    def strike(self, victim: str, affected: list[Flight], **notes: Any) -> None:
        self.fault_at = self.now()
        self.fault_wall = time.time()
        self.affected = affected
        self.notes |= {"victim": victim, "fault_at_s": round(self.fault_at, 3), **notes}


Scenario = Callable[[Run], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn

    return register


async def busiest_decode(run: Run, min_streams: int) -> tuple[str, list[Flight]] | None:
    """The decode worker with the most streams mid-decode, once it has ``min_streams``."""

    def pick():
        by = run.decoding_on()
        if not by:
            return None
        name = max(by, key=lambda n: len(by[n]))
        return (name, by[name]) if len(by[name]) >= min_streams else None

    return await run.until(pick)


@scenario("baseline")
async def baseline(run: Run) -> None:
    """No fault: the load alone."""


@scenario("kill-decode")
async def kill_decode(run: Run) -> None:
    """SIGKILL the decode worker that holds the most streams mid-decode."""
    got = await busiest_decode(run, min(2, run.cfg.concurrency))
    if got is None:
        run.notes["skipped"] = "no streams mid-decode"
        return
    victim, affected = got
    run.h.kill(victim)
    run.strike(victim, list(affected), tokens_before={f.id: len(f.frames) for f in affected})
    await asyncio.to_thread(run.h.wait_dead, victim)


@scenario("hang-decode")
async def hang_decode(run: Run) -> None:
    """SIGSTOP the decode worker that holds the most streams mid-decode; SIGCONT it once its
    streams went on elsewhere (or after 4 stall timeouts + 10 s)."""
    got = await busiest_decode(run, min(2, run.cfg.concurrency))
    if got is None:
        run.notes["skipped"] = "no streams mid-decode"
        return
    victim, affected = got
    pid = run.h.stop(victim)
    run.strike(victim, list(affected))
    limit = 4 * run.cfg.stall_timeout_s + 10
    await run.until(lambda: all(f.ended is not None for f in affected), limit)
    run.h.cont(pid)
    run.notes["stopped_for_s"] = round(run.now() - run.fault_at, 2)


@scenario("kill-prefill")
async def kill_prefill(run: Run) -> None:
    """Send distinct long prompts; once they are mid-prefill, SIGKILL the prefill worker that
    computes one (its engine step has run for a while: a long prompt's, not a short one's). A
    batch can finish between two looks at the workers (a short prompt on a fast machine), so
    up to ``KILL_PREFILL_ROUNDS`` batches are sent."""
    long_step_s = max(0.02, 0.1 * run.long_ttft)

    def busiest():
        # ``health`` answers off the engine thread, so a step in progress shows as its age;
        # ``stats`` would wait for that step to end, when the prompt may already be gone
        ages = run.h.step_ages("prefill")
        name = max(ages, key=ages.get, default=None)
        if name is None or ages[name] <= long_step_s:
            return None
        return name, round(ages[name], 3)

    jobs = run.jobs.long["kill-prefill"]
    size = run.cfg.kill_prefill_longs
    got = None
    for start in range(0, len(jobs), size):
        longs = [run.extra(j, "long") for j in jobs[start : start + size]]
        await asyncio.sleep(0.1 * run.long_ttft)
        while got is None and not all(t.done() for t in longs):
            got = await asyncio.to_thread(busiest)
            await asyncio.sleep(0.01)
        if got is not None:
            run.notes["rounds"] = start // size + 1
            break
    if got is None:
        run.notes["skipped"] = "the long prompts finished before a kill"
        return
    victim, busy = got
    run.h.kill(victim)
    waiting = [f for f in run.in_flight() if f.headers_at is None]
    run.strike(victim, waiting, step_age_s=busy)
    run.hit = lambda f: f.prefill == victim  # placed there first (the header says so)
    await asyncio.to_thread(run.h.wait_dead, victim)


@scenario("redis-restart")
async def redis_restart(run: Run) -> None:
    """Stop Redis mid-load, keep serving (routing by load alone) for at least 2 s and one new
    request per lane, then start it again, empty."""
    await busiest_decode(run, 1)
    backend = run.h.gateway.backend
    unavailable = backend.router_stats().index_unavailable
    await asyncio.to_thread(run.h.redis.stop)
    run.strike("redis", [])
    sent = len(run.flights)
    await asyncio.sleep(2.0)
    await run.until(lambda: len(run.flights) >= sent + run.cfg.concurrency, 60)
    await asyncio.to_thread(run.h.redis.start)
    run.notes["down_s"] = round(run.now() - run.fault_at, 2)
    run.notes["lookups_without_index"] = backend.router_stats().index_unavailable - unavailable


def _cut_before_first_token(fraction: float, label: str) -> Scenario:
    async def cut(run: Run) -> None:
        await busiest_decode(run, 1)
        after = fraction * run.long_ttft
        jobs = run.jobs.long[run.name]
        tasks = [run.extra(j, "cut", cut_after_s=after) for j in jobs]
        run.strike("clients", [], cut_after_s=round(after, 3), phase=label)
        await asyncio.gather(*tasks)

    cut.__doc__ = f"Clients of long prompts go away at {fraction:.0%} of a long prefill ({label})."
    return cut


scenario("disconnect-prefill")(_cut_before_first_token(0.15, "first chunk computing"))
scenario("disconnect-transfer")(_cut_before_first_token(0.8, "KV mostly on the decode worker"))


@scenario("disconnect-decode")
async def disconnect_decode(run: Run) -> None:
    """Clients go away after 3 streamed frames."""
    await busiest_decode(run, 1)
    run.strike("clients", [], cut_after_frames=3)
    tasks = []
    for i in range(run.cfg.disconnects):
        job = run.jobs.load[i % len(run.jobs.load)]
        longer = Job(f"{job.name}-x4", job.endpoint, job.prompt, job.prompt_ids, 4 * job.max_tokens)
        tasks.append(run.extra(longer, "cut", cut_after_frames=3))
    await asyncio.gather(*tasks)


@scenario("overload")
async def overload(run: Run) -> None:
    """2x the gateway's concurrency bound at once, on top of the load."""
    await busiest_decode(run, 1)
    n = 2 * run.cfg.max_concurrent
    run.strike("gateway", [], burst=n)
    tasks = [run.extra(run.jobs.load[i % len(run.jobs.load)], "burst") for i in range(n)]
    await asyncio.gather(*tasks)


@scenario("long-burst")
async def long_burst(run: Run) -> None:
    """Long distinct prompts in a burst, on top of the load."""
    await busiest_decode(run, 1)
    jobs = run.jobs.long["long-burst"]
    run.strike("prefill", [], burst=len(jobs), prompt_tokens=len(jobs[0].prompt_ids))
    await asyncio.gather(*(run.extra(j, "long") for j in jobs))


DEFAULT_SCENARIOS = (
    "baseline",
    "kill-decode",
    "kill-prefill",
    "hang-decode",
    "redis-restart",
    "disconnect-prefill",
    "disconnect-transfer",
    "disconnect-decode",
    "overload",
    "long-burst",
)


# ------------------------------------------------------------------------------------ report


@dataclass
class Row:
    scenario: str
    counts: dict[str, int]
    accepted: int
    leaked: dict[str, int]
    problems: dict[str, str]
    longest_stall_s: float
    resumed_stalls_s: list[float | None]
    notes: dict[str, Any]
    wall_s: float
    requests: list[dict[str, Any]]

    @property
    def sent(self) -> int:
        return sum(self.counts.values())


async def run_scenario(name: str, h: Harness, client: Any, jobs: Jobs, long_ttft: float) -> Row:
    run = Run(name, h, client, jobs, long_ttft)
    resumes0 = dict(h.gateway.backend.dispatcher.resumes)
    log0 = len(h.gateway.backend.dispatcher.resume_log)
    progress = asyncio.ensure_future(_progress(run)) if h.cfg.progress else None
    load = asyncio.ensure_future(run.lanes())
    try:
        await SCENARIOS[name](run)
    finally:
        run.fault_done = True
        await load
        await asyncio.gather(*run.extras)
        if progress is not None:
            progress.cancel()
    for pid in list(h.stopped):
        h.cont(pid)
    if h.killed and h.cfg.replace:
        run.notes["replaced_by"] = await asyncio.to_thread(h.replace_killed)
    idle = await asyncio.to_thread(h.settle)
    await asyncio.to_thread(h.wait_routed)  # the next scenario starts with every worker routed
    resumes = {k: v - resumes0.get(k, 0) for k, v in h.gateway.backend.dispatcher.resumes.items()}
    run.notes["resumes"] = {k: v for k, v in resumes.items() if v}
    timelines = list(h.gateway.backend.dispatcher.resume_log)[log0:]
    if timelines and run.fault_wall is not None:
        run.notes["resume_breakdown"] = resume_breakdown(timelines, run.fault_wall)
    return make_row(run, idle)


RESUME_SPANS = (
    # (name, from, to): milliseconds between two instants of a resume's timeline
    ("detect", "fault", "failed"),  # the fault -> the router gives up on the attempt
    ("place", "failed", "placed"),  # -> new workers chosen
    ("reserve", "placed", "reserved"),  # -> the decode worker reserved (the prefill runs beside)
    ("prefill", "placed", "prefilled"),  # -> the prefill worker's answer is back
    ("kv_tail_admit", "prefilled", "first"),  # -> the first token of the new attempt arrives
    ("first_step", "first", "second"),  # -> its next token (one decode step)
    ("stall", "fault", "first"),  # the fault -> the first token after it
)


def resume_breakdown(timelines: list[dict[str, Any]], fault_wall: float) -> dict[str, Any]:
    """Each resume's spans (ms), and the prefill worker's own split of ``prefill``: the call to
    its engine thread, queued there, computing prompt + output (the rest of ``prefill`` is the
    two Ray hops). Median over the resumes alongside."""
    rows = []
    for t in timelines:
        marks = {**t, "fault": fault_wall}
        row: dict[str, Any] = {"tokens": t.get("tokens"), "reason": t.get("reason")}
        for name, a, b in RESUME_SPANS:
            if marks.get(a) is not None and marks.get(b) is not None:
                row[name] = round((marks[b] - marks[a]) * 1e3, 1)
        phases = t.get("prefill_phases")
        if phases:
            names = ("prefill_call", "prefill_queued", "prefill_compute")
            for name, v in zip(names, phases, strict=True):
                row[name] = round(v * 1e3, 1)
        rows.append(row)
    median = {}
    for k in dict.fromkeys(k for r in rows for k in r if k not in ("tokens", "reason")):
        vals = sorted(r[k] for r in rows if k in r)
        median[k] = vals[len(vals) // 2]
    return {"resumes": rows, "median_ms": median}


def make_row(run: Run, idle: list[WorkerIdle]) -> Row:
    counts = dict.fromkeys(OUTCOMES, 0)
    for f in run.flights:
        counts[f.outcome or "lost"] += 1
    hit = [f for f in run.affected if run.hit(f)]
    stalls = [f.gap_across(run.fault_at) for f in hit] if run.fault_at is not None else []
    if hit:
        run.notes["streams_hit"] = [f.id for f in hit]
    return Row(
        scenario=run.name,
        counts=counts,
        accepted=sum(1 for f in run.flights if f.status == 200),
        leaked={w.name: w.leaked_blocks for w in idle},
        problems={w.name: w.problem for w in idle if w.problem},
        longest_stall_s=max((f.max_gap() for f in run.flights), default=0.0),
        resumed_stalls_s=stalls,
        notes=run.notes,
        wall_s=run.now(),
        requests=[flight_record(f) for f in run.flights],
    )


def flight_record(f: Flight) -> dict[str, Any]:
    return {
        "id": f.id,
        "job": f.job.name,
        "role": f.role,
        "outcome": f.outcome,
        "detail": f.detail,
        "status": f.status,
        "prefill": f.prefill,
        "decode": f.decode,
        "sent_s": round(f.sent, 3),
        "ttft_s": None if f.ttft() is None else round(f.ttft(), 3),
        "max_gap_s": round(f.max_gap(), 3),
        "frames": len(f.frames),
    }


async def _progress(run: Run) -> None:
    last = ""
    while True:
        await asyncio.sleep(1.0)
        done = sum(1 for f in run.flights if f.ended is not None)
        fault = "fault pending" if run.fault_at is None else f"fault at {run.fault_at:.1f} s"
        line = (
            f" {run.name}: {done}/{len(run.flights)} done, {len(run.in_flight())} in flight, "
            f"{fault}, {run.now():.0f} s"
        )
        if line != last:
            sys.stderr.write("\r" + line.ljust(90) if sys.stderr.isatty() else line + "\n")
            sys.stderr.flush()
            last = line


def _fmt_stalls(stalls: list[float | None]) -> str:
    """``n: max`` of the stalls of the streams a fault hit (``-``: none were hit)."""
    seen = [s for s in stalls if s is not None]
    if not stalls:
        return "-"
    if len(stalls) <= 4:
        return ", ".join("-" if s is None else f"{s:.2f}" for s in stalls)
    return f"{len(stalls)} streams, max {max(seen):.2f}" if seen else f"{len(stalls)} streams"


def format_table(rows: Sequence[Row]) -> str:
    head = [
        "scenario",
        "sent",
        "accepted",
        "exact",
        "wrong",
        "clear err",
        "(429/503)",
        "cancelled",
        "lost",
        "leaked",
        "stall s",
        "stall of streams hit s",
    ]
    body = []
    for r in rows:
        c = r.counts
        body.append(
            [
                r.scenario,
                str(r.sent),
                str(r.accepted),
                str(c["exact"]),
                str(c["wrong"]),
                str(c["rejected"] + c["error"]),
                str(c["rejected"]),
                str(c["cancelled"]),
                str(c["lost"]),
                str(sum(r.leaked.values())),
                f"{r.longest_stall_s:.2f}",
                _fmt_stalls(r.resumed_stalls_s),
            ]
        )
    total = [
        "total",
        *(str(sum(int(b[i]) for b in body)) for i in range(1, 10)),
        f"{max((r.longest_stall_s for r in rows), default=0.0):.2f}",
        "",
    ]
    widths = [max(len(x[i]) for x in [head, *body, total]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    lines = [line(head), sep, *(line(b) for b in body), line(total)]
    for r in rows:  # the resumes' breakdown (median ms over the scenario's resumes)
        b = r.notes.get("resume_breakdown")
        if b:
            spans = ", ".join(f"{k} {v}" for k, v in b["median_ms"].items())
            lines.append(f"{r.scenario}: {len(b['resumes'])} resumes, median ms: {spans}")
    return "\n".join(lines)


def report(cfg: ChaosConfig, rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    return bench.jsonable(
        {
            "benchmark": "chaos",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": vars(cfg) | {"oracle": cfg.oracle},
            **meta,
            "totals": {
                "sent": sum(r.sent for r in rows),
                "lost": sum(r.counts["lost"] for r in rows),
                "wrong": sum(r.counts["wrong"] for r in rows),
                "leaked_blocks": sum(sum(r.leaked.values()) for r in rows),
            },
            "scenarios": [
                {k: v for k, v in vars(r).items() if k != "requests"}
                | {"sent": r.sent, "requests": r.requests}
                for r in rows
            ],
        }
    )


# -------------------------------------------------------------------------------- the driver


def build_jobs(cfg: ChaosConfig, tok: Any) -> Jobs:
    load = short_jobs(tok, cfg) if cfg.workload == "short" else sharegpt_jobs(tok, cfg)
    return Jobs(load, long_jobs(tok, cfg))


async def calibrate(h: Harness, client: Any, jobs: Jobs) -> float:
    """One long prompt alone: its time to first token (the disconnect scenarios cut at
    fractions of it). Also warms every worker up."""
    run = Run("calibrate", h, client, jobs, 0.0)
    f = await run.send(jobs.long["calibrate"][0], "long")
    if f.outcome != "exact" or f.ttft() is None:
        raise RuntimeError(f"the calibration request failed: {f.outcome} {f.detail}")
    return f.ttft()


async def baseline_expected(h: Harness, client: Any, jobs: Jobs) -> None:
    """``--expect baseline``: each job's text from one uninterrupted run through the gateway."""
    run = Run("expected", h, client, jobs, 0.0)
    sem = asyncio.Semaphore(h.cfg.concurrency)

    async def one(job: Job) -> None:
        async with sem:
            f = await run.send(job, "load")
        if f.outcome != "exact":
            raise RuntimeError(f"the baseline run of {job.name} failed: {f.outcome} {f.detail}")
        job.expected = f.text

    await asyncio.gather(*(one(j) for j in jobs.checked()))


async def drive(h: Harness, jobs: Jobs) -> tuple[list[Row], dict[str, Any]]:
    import httpx

    cfg = h.cfg
    timeout = httpx.Timeout(cfg.stall_deadline_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        if cfg.oracle == "baseline":
            log("expected outputs: one uninterrupted run through the gateway")
            await baseline_expected(h, client, jobs)
        long_ttft = await calibrate(h, client, jobs)
        log(f"a {cfg.long_tokens}-token prompt alone: TTFT {long_ttft:.2f} s")
        rows = []
        for name in cfg.scenarios:
            log(f"{name}: {SCENARIOS[name].__doc__ or ''}".strip())
            row = await run_scenario(name, h, client, jobs, long_ttft)
            log(
                f"{name}: {row.counts}, leaked {sum(row.leaked.values())}, "
                f"stall {row.longest_stall_s:.2f} s, {row.notes}"
            )
            rows.append(row)
    return rows, {"long_prompt_ttft_s": long_ttft}


def run_chaos(cfg: ChaosConfig) -> tuple[list[Row], dict[str, Any]]:
    """Start everything, run the scenarios in turn, stop everything; the rows and metadata."""
    from engine.model_hub import resolve_model
    from engine.tokenizer import load_tokenizer

    model_dir = str(resolve_model(cfg.model))
    tok = load_tokenizer(model_dir)
    if tok is None and cfg.oracle == "hf":
        raise SystemExit(f"{model_dir} has no tokenizer: use --expect baseline or none")
    jobs = build_jobs(cfg, tok)
    t0 = time.monotonic()
    if cfg.oracle == "hf":
        log(f"expected outputs: transformers fp32 greedy on {len(jobs.checked())} jobs")
        hf_expected(model_dir, tok, jobs.checked())
    oracle_s = time.monotonic() - t0
    log(f"starting {cfg.num_prefill} prefill + {cfg.num_decode} decode workers on {cfg.device}")
    h = Harness(cfg)
    try:
        h.start()
        log(
            f"gateway on {h.gateway.url}, cluster ready in {time.monotonic() - t0 - oracle_s:.0f} s"
        )
        rows, meta = asyncio.run(drive(h, jobs))
    finally:
        h.close()
    meta |= {"oracle_s": round(oracle_s, 1), "wall_s": round(time.monotonic() - t0, 1)}
    return rows, meta


# ----------------------------------------------------------------------------------------- CLI


# (flag, ChaosConfig field, type, help); each default is the field's
FLAGS = [
    ("--device", "device", str, "cpu or cuda"),
    ("--model", "model", str, "alias or HF folder"),
    ("--dtype", "dtype", str, "default: float32 on cpu, bfloat16 on cuda"),
    ("--num-prefill", "num_prefill", int, "prefill workers"),
    ("--num-decode", "num_decode", int, "decode workers"),
    ("--requests", "requests", int, "load requests per scenario (at least)"),
    ("--concurrency", "concurrency", int, "load lanes (streams at once)"),
    ("--max-tokens", "max_tokens", int, "per load request (ignore_eos)"),
    ("--max-concurrent", "max_concurrent", int, "the gateway's bound"),
    ("--workload", "workload", str, "short | sharegpt | sharegpt-ids"),
    ("--lengths-file", "lengths_file", str, "sharegpt-ids: (prompt, output) lengths JSON"),
    ("--long-tokens", "long_tokens", int, "tokens of each long prompt"),
    ("--long-burst", "long_burst", int, "long prompts in the burst"),
    ("--disconnects", "disconnects", int, "cut clients per disconnect scenario"),
    ("--expect", "expect", str, "hf | baseline | none | auto (hf on cpu, none on cuda)"),
    ("--stall-timeout", "stall_timeout_s", float, "s: a silent worker or step is hung"),
    ("--transfer-timeout", "transfer_timeout_s", float, "s: a KV transfer fails"),
    ("--kv-blocks", "kv_blocks", int, "per worker (0: the engine's sizing)"),
    ("--stall-deadline", "stall_deadline_s", float, "s without a byte: lost"),
    ("--deadline", "deadline_s", float, "s without the end: lost"),
    ("--seed", "seed", int, "prompts"),
    ("--decode-gpus", "decode_gpus", float, "CUDA: GPUs per decode worker (0.5: two share one)"),
    ("--prefill-gpus", "prefill_gpus", float, "CUDA: GPUs per prefill worker"),
]


def parse_args(argv: Sequence[str] | None = None) -> tuple[ChaosConfig, Path]:
    defaults = ChaosConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for flag, name, kind, text in FLAGS:
        ap.add_argument(flag, dest=name, type=kind, default=getattr(defaults, name), help=text)
    ap.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated, run in this order (default: all): {', '.join(SCENARIOS)}",
    )
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-replace", action="store_true", help="do not replace killed workers")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    opts = vars(ap.parse_args(argv))
    path = opts.pop("json")
    opts["scenarios"] = [s for s in opts["scenarios"].split(",") if s]
    opts["engine"] = dict(engine_option(pair) for pair in opts["engine"])
    opts["replace"] = not opts.pop("no_replace")
    opts["progress"] = not opts.pop("quiet")
    opts["kv_blocks"] = opts["kv_blocks"] or None
    return ChaosConfig(**opts), path


def engine_option(pair: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, the value as JSON, else as text)."""
    key, sep, value = pair.partition("=")
    if not sep:
        raise SystemExit(f"--engine wants KEY=VALUE, got {pair!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: Sequence[str] | None = None) -> int:
    cfg, path = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows, meta = run_chaos(cfg)
    data = report(cfg, rows, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(format_table(rows))
    print(
        f"\n{data['totals']['sent']} requests, lost {data['totals']['lost']}, wrong "
        f"{data['totals']['wrong']}, leaked blocks {data['totals']['leaked_blocks']}; "
        f"wrote {path}"
    )
    bad = data["totals"]["lost"] + data["totals"]["wrong"] + data["totals"]["leaked_blocks"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
