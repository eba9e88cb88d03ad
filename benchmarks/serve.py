"""Serving benchmark client for OpenAI-compatible servers: tandem's gateway, vLLM, or any other.

Like vLLM's ``vllm bench serve``: an open-loop load generator. Requests are sent on a Poisson
schedule (exponential gaps of mean 1/rate, seeded) whether or not earlier ones have finished, or
all at once (rate ``inf`` or ``--burst``); ``--rates`` replays the same request list at several
rates to find where the server saturates. ``--max-concurrency`` caps the requests in flight.

Each request is a streamed ``POST /v1/completions`` (or ``/v1/chat/completions`` with
``--endpoint chat``) with ``stream_options.include_usage``, ``temperature: 0`` and, with
``--ignore-eos``, vLLM's ``ignore_eos`` extra; nothing else is server-specific, so the same command
measures tandem and vLLM alike.

Metrics (per rate; vLLM's names, times in ms unless named otherwise)
--------------------------------------------------------------------
* TTFT: send -> first chunk with non-empty text (``choices[0].text`` / ``delta.content``).
* ITL: the gaps between successive non-empty chunks; a chunk carrying several tokens is one gap.
* E2EL: send -> end of the stream.
* TPOT: per request (e2el - ttft) / (output_tokens - 1), for requests of more than one token.
* output tokens: ``usage.completion_tokens`` of the last chunk (else the number of text chunks);
  input tokens: ``usage.prompt_tokens`` (else the workload's prompt length).
* ``completed``: HTTP 200 streams that ended with ``data: [DONE]`` and no in-band error;
  ``failed``: all others (HTTP errors, in-band ``{"error": ...}`` frames, exceptions);
  ``rejected``: the failed ones answered 429 or 503 (a subset of ``failed``).
* ``duration``: first send -> last response; ``request_throughput`` = completed / duration,
  ``output_throughput`` = output tokens / duration, ``total_token_throughput`` adds input tokens.
* ``mean/median/p90/p99/std_{ttft,tpot,itl,e2el}_ms`` over completed requests (percentiles
  interpolated linearly, as numpy's; std is the population one).
* ``request_goodput``: completed requests meeting every SLO of ``--goodput`` (ttft <= SLO,
  tpot <= SLO, e2el <= SLO; a one-token request's tpot counts as 0), per second of duration.

Workloads (``--workload``): ``sharegpt`` (real ShareGPT first-turn text, answer length as the
output length), ``sharegpt-ids`` (random token ids of ShareGPT lengths; ``--lengths-file`` reads
benchmarks/data/sharegpt_llama3_lengths.json where the dataset is not installed), ``file`` (the
prompt ids and output lengths of a benchmarks/workloads.py file, ``--workload-file``: vLLM's
ShareGPT sample, benchmarks/data/vllm_sharegpt_llama3_1000.json), ``random``,
``long`` (2048..8192-token prompts) and ``prefix`` (``--num-prefixes`` shared system prompts).

Tandem and vLLM side by side (same requests, one JSON file, one plot)::

    tandem serve --model smollm2 --port 8000
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --tokenizer smollm2 --workload sharegpt --num-prompts 200 --max-output 128 \\
        --ignore-eos --rates 0.5 1 2 inf --goodput ttft:500 tpot:40 \\
        --label tandem --out benchmarks/results/serve_cpu.json

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --port 8001 \\
        --served-model-name smollm2
    python benchmarks/serve.py --base-url http://127.0.0.1:8001 --model smollm2 \\
        --tokenizer smollm2 --workload sharegpt --num-prompts 200 --max-output 128 \\
        --ignore-eos --rates 0.5 1 2 inf --goodput ttft:500 tpot:40 \\
        --label vllm --out benchmarks/results/serve_cpu.json --append \\
        --plot benchmarks/results/serve_cpu.png

Without ``--model`` the first id of ``GET /v1/models`` is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks.workloads` when run as a script

DEFAULT_LENGTHS = ROOT / "benchmarks" / "data" / "sharegpt_llama3_lengths.json"
WORKLOADS = ("sharegpt", "sharegpt-ids", "file", "random", "long", "prefix")
SLO_METRICS = ("ttft", "tpot", "e2el")
REJECT_STATUSES = (429, 503)
SAFE_ID_RANGE = (100, 30000)  # token ids every tokenizer of interest knows

# ------------------------------------------------------------------------- requests, records


@dataclass(frozen=True)
class Request:
    prompt: str | list[int]
    prompt_len: int
    output_len: int  # max_tokens
    headers: tuple[tuple[str, str], ...] = ()  # sent with this request only
    # the client reads this many text chunks, then closes the stream (the server aborts the
    # request): an answer of this length without telling the server (scheduling benchmarks)
    stop_after: int | None = None


@dataclass
class Record:
    """One request's outcome. Seconds; ``start``/``end`` count from the run's first send."""

    prompt_len: int
    output_len: int
    success: bool = False
    status: int = 0
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0  # from the usage chunk; 0 when the server sent none
    predicted_tokens: int | None = None  # tandem's x-tandem-predicted-tokens, when it sent one
    retry_after: str | None = None  # the Retry-After of a refused request


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str | None
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0  # dummy weights: 1.0 draws printable text (greedy may repeat one
    # token that prints nothing, and TTFT / TPOT are timed by text chunks)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/v1/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# ---------------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of sorted ``values``, interpolated linearly (numpy's default)."""
    k = (len(values) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """mean/median/p90/p99/std of ``seconds``, in ms, under vLLM's key names."""
    ms = sorted(s * 1000.0 for s in seconds)
    keys = [f"{stat}_{name}_ms" for stat in ("mean", "median", "p90", "p99", "std")]
    if not ms:
        return dict.fromkeys(keys)
    values = [
        statistics.fmean(ms),
        percentile(ms, 50),
        percentile(ms, 90),
        percentile(ms, 99),
        statistics.pstdev(ms),
    ]
    return dict(zip(keys, values, strict=True))


def request_tpot(rec: Record) -> float:
    """Seconds per output token after the first; 0 for a request of at most one token."""
    if rec.output_tokens <= 1:
        return 0.0
    return (rec.latency - rec.ttft) / (rec.output_tokens - 1)


def meets_slos(rec: Record, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": request_tpot(rec), "e2el": rec.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def peak_concurrency(records: Sequence[Record]) -> int:
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def compute_metrics(
    records: Sequence[Record | dict[str, Any]], slos_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """The metrics of one run from its per-request records (see the module docstring)."""
    recs = [r if isinstance(r, Record) else Record(**r) for r in records]
    ok = [r for r in recs if r.success]
    duration = max(r.end for r in recs) - min(r.start for r in recs) if recs else 0.0
    total_in = sum(r.prompt_tokens or r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    errors = Counter(r.error[:200] for r in recs if not r.success)
    metrics: dict[str, Any] = {
        "num_prompts": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "rejected": sum(1 for r in recs if not r.success and r.status in REJECT_STATUSES),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
        "request_goodput": None,
        "max_concurrent_requests": peak_concurrency(recs),
        "errors": dict(errors.most_common(5)),
    }
    if slos_ms:
        metrics["request_goodput"] = sum(meets_slos(r, slos_ms) for r in ok) * per_s
    metrics |= summarize("ttft", [r.ttft for r in ok])
    metrics |= summarize("tpot", [request_tpot(r) for r in ok if r.output_tokens > 1])
    metrics |= summarize("itl", [gap for r in ok for gap in r.itl])
    metrics |= summarize("e2el", [r.latency for r in ok])
    return metrics


# --------------------------------------------------------------------------------- arrivals


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the first send) of ``n`` Poisson arrivals; all 0 for rate ``inf``."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---------------------------------------------------------------------------------- sending


def request_body(target: Target, req: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model} if target.model else {}
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    body |= {
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def sse_lines(resp: Any) -> AsyncIterator[str]:
    """An SSE body's lines, split at ``\n`` (and ``\r\n``) only. httpx's ``aiter_lines`` also
    splits at U+2028, U+0085 and other characters a server may leave raw inside a JSON string."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buf:
        yield buf.decode()


async def read_stream(
    resp: Any, rec: Record, start: float, chat: bool, stop_after: int | None = None
) -> None:
    """Fill ``rec`` from an SSE stream: TTFT, ITLs, usage, or the in-band error. With
    ``stop_after``, a stream that brought that many text chunks counts as complete there."""
    last, chunks, done = start, 0, False
    async for line in sse_lines(resp):
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        data = json.loads(payload)
        now = time.perf_counter()
        if "error" in data:
            err = data["error"]
            rec.error = (
                f"in-band error: {err.get('message', err) if isinstance(err, dict) else err}"
            )
            return
        if chunk_text(data, chat):
            if chunks == 0:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last, chunks = now, chunks + 1
            if stop_after is not None and chunks >= stop_after:
                done = True
                break
        if usage := data.get("usage"):
            rec.output_tokens = usage.get("completion_tokens") or 0
            rec.prompt_tokens = usage.get("prompt_tokens") or 0
    if not done:
        rec.error = "the stream ended without data: [DONE]"
    rec.output_tokens = rec.output_tokens or chunks
    if chunks == 0:  # nothing printable came: the first token is the whole response
        rec.ttft = time.perf_counter() - start


async def send_request(client: Any, target: Target, req: Request, t0: float) -> Record:
    """One streamed request; never raises (failures are kept in the record)."""
    rec = Record(prompt_len=req.prompt_len, output_len=req.output_len)
    start = time.perf_counter()
    try:
        body = request_body(target, req)
        headers = target.headers() | dict(req.headers)
        async with client.stream("POST", target.url, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            predicted = resp.headers.get("x-tandem-predicted-tokens")
            rec.predicted_tokens = int(predicted) if predicted and predicted.isdigit() else None
            rec.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                await read_stream(resp, rec, start, target.endpoint == "chat", req.stop_after)
    except Exception as exc:  # connection errors, timeouts, malformed frames
        rec.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    rec.start, rec.end, rec.latency = start - t0, end - t0, end - start
    rec.success = not rec.error
    return rec


class Progress:
    """A one-line stderr counter, redrawn at most ``per_s`` times a second."""

    def __init__(self, total: int, label: str, per_s: float = 5.0) -> None:
        self.total, self.label, self.interval = total, label, 1.0 / per_s
        self.done = self.failed = 0
        self.t0 = self.last = time.perf_counter()

    def update(self, rec: Record) -> None:
        self.done += 1
        self.failed += not rec.success
        now = time.perf_counter()
        if now - self.last >= self.interval or self.done == self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        sys.stderr.write(
            f"\r {self.label}: {self.done}/{self.total} done, {self.failed} failed, "
            f"{now - self.t0:.1f} s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.done < self.total:
            self._draw(time.perf_counter())
        sys.stderr.write("\n")


async def run_rate(
    client: Any,
    target: Target,
    requests: Sequence[Request],
    rate: float,
    seed: int = 0,
    max_concurrency: int | None = None,
) -> list[Record]:
    """Send ``requests`` open-loop at ``rate`` req/s; wait for all; their records in order."""
    offsets = arrival_times(len(requests), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = Progress(len(requests), f"rate {format_rate(rate)}")
    t0 = time.perf_counter()

    async def one(req: Request) -> Record:
        if sem is None:
            rec = await send_request(client, target, req, t0)
        else:
            async with sem:
                rec = await send_request(client, target, req, t0)
        progress.update(rec)
        return rec

    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    progress.close()
    return list(records)


def make_client(timeout_s: float) -> Any:
    import httpx

    # trust_env=False: no proxy from the environment between the client and the server.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 60.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def stream_client(kind: str, timeout_s: float, url: str, fallback: Any) -> Any:
    """The client the streamed requests go through: benchmarks/http_client.py's (``raw``, for
    ``http://``; httpx's async client spent ~40x its CPU per event, enough to pace a burst)
    or ``fallback``, an httpx client."""
    if kind == "raw" and url.startswith("http://"):
        from benchmarks.http_client import RawStreamClient

        return RawStreamClient(timeout_s)
    return fallback


def client_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def discover_model(client: Any, target: Target) -> str:
    resp = await client.get(f"{target.base_url.rstrip('/')}/v1/models", headers=target.headers())
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def warm_up(client: Any, target: Target, req: Request) -> None:
    """One uncounted request (at most 16 tokens) whose prompt shares no cached prefix with any
    measured one (``WARMUP_ROUND``); stops the benchmark if it fails."""
    (req,) = fresh_round([req], WARMUP_ROUND)
    short = Request(req.prompt, req.prompt_len, min(req.output_len, 16))
    rec = await send_request(client, target, short, time.perf_counter())
    if not rec.success:
        raise SystemExit(f"the warm-up request to {target.url} failed: {rec.error}")


# -------------------------------------------------------------------------------- workloads

WARMUP_ROUND = 999_999  # the warm-up request's round: no measured run uses it


def fresh_round(requests: list[Request], rnd: int) -> list[Request]:
    """The requests of run ``rnd`` of a workload sent more than once to one server, so that no
    prompt finds an earlier run's in a prefix cache (a server keeps finished prompts' blocks;
    a repeated prompt would skip its prefill and flatter every run after the first). Round 0:
    as they are. Round r: two tokens naming r (from ``SAFE_ID_RANGE``) inserted after every
    token-id prompt's first token (often BOS), ``prompt_len`` + 2; ``[r] `` before every text
    prompt. Prompts that share a prefix inside a run still share it."""
    if rnd == 0:
        return requests
    lo, hi = SAFE_ID_RANGE
    mark = [lo + rnd // (hi - lo), lo + rnd % (hi - lo)]
    if rnd >= (hi - lo) ** 2:
        raise ValueError(f"round {rnd} past the {(hi - lo) ** 2} two tokens can name")
    out = []
    for r in requests:
        if isinstance(r.prompt, str):
            out.append(replace(r, prompt=f"[{rnd}] {r.prompt}"))
        else:
            out.append(replace(r, prompt=[*r.prompt[:1], *mark, *r.prompt[1:]],
                               prompt_len=r.prompt_len + 2))  # fmt: skip
    return out


def load_tokenizer(name: str) -> Any:
    """A tokenizer from a local HF folder, a tandem alias (``smollm2``) or a hub id."""
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if not path.is_dir():
        try:
            from engine.model_hub import resolve_model

            path = resolve_model(name)
        except (ImportError, ValueError):
            return AutoTokenizer.from_pretrained(name)
    return AutoTokenizer.from_pretrained(str(path))


def id_range(tokenizer: Any) -> tuple[int, int]:
    """Token ids to draw random prompts from: away from the special ids at either end."""
    if tokenizer is None:
        return SAFE_ID_RANGE
    vocab = len(tokenizer)
    return (1000, vocab - 1000) if vocab > 4000 else (0, vocab)


def random_ids(rng: random.Random, n: int, ids: tuple[int, int]) -> list[int]:
    return [rng.randrange(ids[0], ids[1]) for _ in range(n)]


def uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    lo = max(1, int(length * (1 - ratio)))
    return rng.randint(lo, max(lo, int(length * (1 + ratio))))


def clip_output(length: int, max_output: int | None) -> int:
    return min(length, max_output) if max_output else length


def sharegpt_text(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    from benchmarks.workloads import sharegpt_prompts

    rows = sharegpt_prompts(
        tokenizer, args.num_prompts, args.max_prompt, max_total(args), args.seed
    )
    if len(rows) < args.num_prompts:
        print(f"note: only {len(rows)} ShareGPT prompts pass the filters", file=sys.stderr)
    return [Request(text, p, clip_output(o, args.max_output)) for text, p, o in rows]


def max_total(args: argparse.Namespace) -> int:
    return max(2048, args.max_prompt + (args.max_output or 0))


def sharegpt_length_pairs(args: argparse.Namespace, tokenizer: Any) -> list[tuple[int, int]]:
    from benchmarks import workloads

    if args.lengths_file is None and tokenizer is not None:
        return workloads.sharegpt_lengths(tokenizer, args.num_prompts, args.seed)
    path = args.lengths_file or DEFAULT_LENGTHS
    pairs = [(p, o) for p, o in workloads.read_lengths(path) if p <= args.max_prompt]
    if not pairs:
        raise SystemExit(f"{path}: no (prompt, output) pairs with prompt <= {args.max_prompt}")
    return [pairs[i % len(pairs)] for i in range(args.num_prompts)]  # cycles if short


def sharegpt_ids(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    rng, ids = random.Random(args.seed), id_range(tokenizer)
    return [
        Request(random_ids(rng, p, ids), p, clip_output(o, args.max_output))
        for p, o in sharegpt_length_pairs(args, tokenizer)
    ]


def file_requests(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    """The first ``--num-prompts`` requests of a benchmarks/workloads.py file (``--workload-file``,
    e.g. vLLM's ShareGPT sample): its own prompt token ids and output lengths. Asked for more
    than the file holds, it goes round again; each later round changes one early token of every
    prompt (the second: the first is often BOS), so no prompt is a prefix-cache hit on an
    earlier round's and the lengths stay the file's."""
    from benchmarks.workloads import read_workload

    if args.workload_file is None:
        raise SystemExit("--workload file needs --workload-file PATH")
    items = read_workload(args.workload_file)
    if not items:
        raise SystemExit(f"{args.workload_file} holds no requests")
    lo, hi = id_range(tokenizer)
    out = []
    for n in range(args.num_prompts):
        item = items[n % len(items)]
        ids = list(item.prompt_token_ids)
        rnd = n // len(items)
        if rnd and ids:
            j = min(1, len(ids) - 1)
            ids[j] = lo + (ids[j] - lo + rnd * 7919) % (hi - lo)
        prompt: str | list[int] = ids
        if args.text_prompts:  # as vLLM's client sends ShareGPT: text, tokenized by the server
            prompt = tokenizer.decode(ids)
        out.append(Request(prompt, len(ids), clip_output(item.output_len, args.max_output)))
    return out


def random_requests(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    rng, ids, out = random.Random(args.seed), id_range(tokenizer), []
    for _ in range(args.num_prompts):
        p = uniform_len(rng, args.input_len, args.range_ratio)
        o = uniform_len(rng, args.output_len, args.range_ratio)
        out.append(Request(random_ids(rng, p, ids), p, o))
    return out


def long_requests(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    rng, ids, out = random.Random(args.seed), id_range(tokenizer), []
    for _ in range(args.num_prompts):
        p = rng.randint(*args.long_input)
        out.append(Request(random_ids(rng, p, ids), p, rng.randint(*args.long_output)))
    return out


def prefix_requests(args: argparse.Namespace, tokenizer: Any) -> list[Request]:
    """Request i: shared prefix i % K + its own suffix of ``--input-len`` tokens."""
    rng, ids = random.Random(args.seed), id_range(tokenizer)
    prefixes = [random_ids(rng, args.prefix_len, ids) for _ in range(args.num_prefixes)]
    out = []
    for i in range(args.num_prompts):
        prompt = prefixes[i % len(prefixes)] + random_ids(rng, args.input_len, ids)
        out.append(Request(prompt, len(prompt), args.output_len))
    return out


BUILDERS = {
    "sharegpt": sharegpt_text,
    "sharegpt-ids": sharegpt_ids,
    "file": file_requests,
    "random": random_requests,
    "long": long_requests,
    "prefix": prefix_requests,
}


def build_requests(args: argparse.Namespace) -> list[Request]:
    """The workload's request list (the same for every rate of a sweep)."""
    if args.endpoint == "chat" and args.workload != "sharegpt" and not args.text_prompts:
        raise SystemExit(
            "--endpoint chat needs text: --workload sharegpt, or --workload file --text-prompts"
        )
    name = args.tokenizer
    if name is None and args.workload == "sharegpt":
        name = args.model
    if name is None and args.workload == "sharegpt":
        raise SystemExit("--workload sharegpt needs --tokenizer (a folder or an alias)")
    if args.text_prompts and (args.workload != "file" or name is None):
        raise SystemExit("--text-prompts is for --workload file, with --tokenizer")
    tokenizer = load_tokenizer(name) if name else None
    requests = BUILDERS[args.workload](args, tokenizer)
    if not requests:
        raise SystemExit("the workload produced no requests")
    return requests


# ---------------------------------------------------------------------------- report, table


def format_rate(rate: float | str) -> str:
    return "inf" if rate == "inf" or math.isinf(float(rate)) else f"{float(rate):g}"


def jsonable(value: Any) -> Any:
    """Paths as strings and infinities as "inf", recursively (JSON has no Infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def rate_result(
    rate: float, records: list[Record], slos_ms: dict[str, float], save: bool
) -> dict[str, Any]:
    result: dict[str, Any] = {"offered_rate": jsonable(rate)}
    result |= compute_metrics(records, slos_ms)
    if save:
        result["requests"] = [asdict(r) for r in records]
    return result


def write_report(path: Path, entry: dict[str, Any], append: bool) -> dict[str, Any]:
    """Write ``entry`` under ``runs[label]``; with ``append`` keep the file's other labels."""
    data: dict[str, Any] = {"benchmark": "serve", "runs": {}}
    if append and path.exists():
        data = json.loads(path.read_text())
        data.setdefault("runs", {})
    data["runs"][entry["label"]] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


TABLE_COLUMNS = [
    ("rate", "offered_rate", None),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50", "median_tpot_ms", "{:.1f}"),
    ("TPOT p90", "p90_tpot_ms", "{:.1f}"),
    ("ITL p50", "median_itl_ms", "{:.1f}"),
    ("goodput", "request_goodput", "{:.2f}"),
    ("ok", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("rejected", "rejected", "{}"),
    ("client cpu", "client_cpu_share", "{:.0%}"),
]


def format_table(label: str, results: Sequence[dict[str, Any]]) -> str:
    """One row per rate; latencies in ms, throughputs per second."""
    header = [name for name, _, _ in TABLE_COLUMNS]
    rows = []
    for res in results:
        row = []
        for _, key, fmt in TABLE_COLUMNS:
            value = res.get(key)
            if key == "offered_rate":
                row.append(format_rate(value))
            else:
                row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"== {label} (ms, req/s, tok/s) =="]
    for row in [header, *rows]:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- plot


def rate_positions(data: dict[str, Any]) -> tuple[dict[str, float], float]:
    """x of each offered rate: finite rates as they are, ``inf`` to the right of them."""
    finite = {
        float(res["offered_rate"])
        for run in data["runs"].values()
        for res in run["results"]
        if res["offered_rate"] != "inf"
    }
    inf_x = max(finite) * 1.5 if finite else 1.0
    return {format_rate(r): r for r in finite} | {"inf": inf_x}, inf_x


def plot_report(data: dict[str, Any], png: Path) -> None:
    """TTFT p99, TPOT p90 and achieved req/s against offered rate, one line per label."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    xs, inf_x = rate_positions(data)
    panels = [
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("p90_tpot_ms", "TPOT p90 (ms)"),
        ("request_throughput", "achieved (req/s)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, run in data["runs"].items():
        for ax, (key, _) in zip(axes, panels, strict=True):
            pts = [
                (xs[format_rate(r["offered_rate"])], r[key])
                for r in run["results"]
                if r.get(key) is not None
            ]
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    finite = sorted(x for x in xs.values() if x != inf_x)
    if finite:
        axes[2].plot(finite, finite, "k--", lw=0.8, label="offered")
    for ax, (key, title) in zip(axes, panels, strict=True):
        if key.endswith("_ms"):  # latencies span ms below saturation to seconds past it
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_xticks(sorted(xs.values()), [k for k, _ in sorted(xs.items(), key=lambda t: t[1])])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}", file=sys.stderr)


# -------------------------------------------------------------------------------------- CLI


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 or inf, got {text}")
    return rate


def parse_slos(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:40"]`` -> ``{"ttft": 500.0, "tpot": 40.0}`` (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise SystemExit(f"--goodput {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise SystemExit(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def add_target_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id to send (default: GET /v1/models)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--api-key", default=None, help="sent as a Bearer token")
    ap.add_argument("--ignore-eos", action="store_true", help='send vLLM\'s "ignore_eos": true')
    ap.add_argument("--timeout", type=float, default=3600.0, help="per request (s)")
    ap.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="HTTP client of the streamed requests: benchmarks/http_client.py, or httpx",
    )
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests first (0: none)")


def add_load_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=parse_rate, default=float("inf"), help="req/s or inf")
    ap.add_argument("--rates", type=parse_rate, nargs="+", default=None, help="a sweep")
    ap.add_argument("--burst", action="store_true", help="send everything at once (rate inf)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prompt-round",
        type=int,
        default=0,
        help="the first rate's round of prompts (fresh_round): a later run against the same "
        "server passes a higher one, so its prompts are not prefix hits",
    )
    ap.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs: ttft:500 tpot:40 e2el:5000",
    )


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    ap.add_argument("--tokenizer", default=None, help="HF folder or alias (sharegpt: --model)")
    ap.add_argument("--lengths-file", type=Path, default=None, help="sharegpt-ids lengths JSON")
    ap.add_argument(
        "--workload-file", type=Path, default=None, help="file: a benchmarks/workloads.py file"
    )
    ap.add_argument(
        "--text-prompts",
        action="store_true",
        help="file: send each prompt as its ids decoded to text (--tokenizer), as vLLM's "
        "client sends ShareGPT, so the server tokenizes it",
    )
    ap.add_argument("--max-prompt", type=int, default=1024, help="sharegpt: longer skipped")
    ap.add_argument("--max-output", type=int, default=None, help="sharegpt: clip outputs")
    ap.add_argument("--input-len", type=int, default=1024, help="random; prefix: the suffix")
    ap.add_argument("--output-len", type=int, default=128, help="random, prefix")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="random: +- this fraction")
    ap.add_argument("--long-input", type=int, nargs=2, default=[2048, 8192], metavar=("LO", "HI"))
    ap.add_argument("--long-output", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"))
    ap.add_argument("--num-prefixes", type=int, default=10, help="prefix: shared prompts")
    ap.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens of each")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Open-loop serving benchmark for OpenAI-compatible servers (vLLM's metrics)."
    )
    add_target_args(ap)
    add_load_args(ap)
    add_workload_args(ap)
    ap.add_argument("--label", default=None, help="this system's name (default: the host)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--append", action="store_true", help="keep --out's other labels")
    ap.add_argument("--save-requests", action="store_true", help="per-request records in JSON")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of every label in --out")
    args = ap.parse_args(argv)
    args.rates = [float("inf")] if args.burst else (args.rates or [args.request_rate])
    args.label = args.label or args.base_url.split("//")[-1].rstrip("/")
    return args


async def run_sweep(args: argparse.Namespace, requests: list[Request]) -> dict[str, Any]:
    """Every rate of ``args.rates`` over the same requests, each rate's run a round of its own
    (``fresh_round``: ``--prompt-round`` + the rate's index); the run's JSON entry."""
    slos = parse_slos(args.goodput)
    target = Target(args.base_url, args.model, args.endpoint, args.api_key, args.ignore_eos)
    results = []
    async with make_client(args.timeout) as client:
        if target.model is None:
            target = replace(target, model=await discover_model(client, target))
        streams = stream_client(args.client, args.timeout, target.url, client)
        for _ in range(args.warmup):
            await warm_up(streams, target, requests[0])
        for i, rate in enumerate(args.rates):
            cpu0, wall0 = client_cpu_s(), time.perf_counter()
            fresh = fresh_round(requests, args.prompt_round + i)
            records = await run_rate(streams, target, fresh, rate, args.seed, args.max_concurrency)
            result = rate_result(rate, records, slos, args.save_requests)
            # The client's own CPU over the run: near 100 % of a core, it sets the pace.
            result["client_cpu_s"] = client_cpu_s() - cpu0
            result["client_cpu_share"] = result["client_cpu_s"] / (time.perf_counter() - wall0)
            results.append(result)
    skip = ("out", "plot", "label", "append", "api_key")  # the key is never written out
    config = {k: v for k, v in vars(args).items() if k not in skip}
    return jsonable(
        {
            "label": args.label,
            "base_url": args.base_url,
            "model": target.model,
            "endpoint": args.endpoint,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config | {"goodput_slos_ms": slos, "num_requests": len(requests)},
            "results": results,
        }
    )


async def async_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run the sweep, print the table, write --out / --plot; the run's entry."""
    args = parse_args(argv)
    parse_slos(args.goodput)  # fail on a bad SLO before loading anything
    requests = build_requests(args)
    entry = await run_sweep(args, requests)
    print(format_table(args.label, entry["results"]))
    if args.out is not None:
        data = write_report(args.out, entry, args.append)
        print(f"wrote {args.out}", file=sys.stderr)
        if args.plot is not None:
            plot_report(data, args.plot)
    elif args.plot is not None:
        plot_report({"runs": {args.label: entry}}, args.plot)
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(async_main(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
