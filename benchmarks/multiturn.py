"""Multi-turn conversations through the OpenAI API: real ShareGPT conversations replayed turn
by turn, each turn's prompt the whole conversation so far (the previous prompts and the answers
the server gave, as token ids) plus the next human message, with think time between turns.

What the KV tiers are for: with enough users, the conversations' KV outgrows the device pool,
and each returning user's history is either recomputed or loaded from a tier below.

    python benchmarks/multiturn.py --url http://127.0.0.1:8000 --users 128 --conversations 600 \\
        --think-s 1.0 --out run.json

Each user takes the next conversation from benchmarks/data/sharegpt_multiturn_llama3.json
(benchmarks/gen_multiturn.py: Llama-3 token lengths of real conversations) and replays it:
a human message is random ids (128..30000, in every vocabulary here) of its length, the answer is the server's own (``max_tokens``:
the recorded answer's length, capped by ``--max-output``, ``ignore_eos``), its ids read back
with vLLM's ``return_token_ids``. A conversation stops before a turn that would pass
``--max-context``. ``--first-turns`` sends every conversation's first turn only: no turn
finds an earlier one's KV (the miss cost of the tiers). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks.http_client` when run as a script

DATA = Path(__file__).resolve().parent / "data" / "sharegpt_multiturn_llama3.json"


@dataclass
class Turn:
    user: int
    conversation: int
    turn: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    sent: float  # seconds since the run's start
    ttft: float
    latency: float
    error: str | None = None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def stream_turn(client, url: str, model: str, prompt: list[int], max_tokens: int):
    """(ttft, latency, answer ids, cached tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft, ids, cached = None, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(str(data["error"])[:200])
            for choice in data.get("choices") or ():
                if choice.get("token_ids"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    ids += choice["token_ids"]
            usage = data.get("usage")
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ttft or 0.0, time.perf_counter() - t0, ids, cached


async def user(
    k: int, args, client, model: str, queue: asyncio.Queue, t0: float, out: list[Turn], bar
) -> None:
    think = random.Random(args.seed * 1000 + k)
    if args.think_s and not args.first_turns:
        # users arrive as if back from thinking, not all at the first instant: a burst of every
        # user's first turn at t=0 measures the burst (the whole run's p90), not the tiers
        await asyncio.sleep(think.expovariate(1.0 / args.think_s))
    while True:
        try:
            index, turns = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        # a conversation's messages depend on it alone: two runs over other conversations (the
        # miss run after the multi-turn one) share no prompt by accident
        rng = random.Random(args.seed * 1_000_003 + index + getattr(args, "offset", 0))
        history: list[int] = []
        for i, (human, answer) in enumerate(turns):
            max_tokens = min(answer, args.max_output)
            prompt = history + [rng.randrange(128, 30_000) for _ in range(human)]
            if len(prompt) + max_tokens > args.max_context:
                break
            sent = time.perf_counter() - t0
            try:
                ttft, latency, ids, cached = await stream_turn(
                    client, args.url, model, prompt, max_tokens
                )
            except Exception as exc:  # noqa: BLE001 - recorded, the conversation ends
                why = f"{type(exc).__name__}: {exc}"
                out.append(Turn(k, index, i, len(prompt), 0, 0, sent, 0.0, 0.0, why))
                break
            out.append(Turn(k, index, i, len(prompt), len(ids), cached, sent, ttft, latency))
            bar(len(out))
            history = prompt + ids
            if args.first_turns:
                break
            await asyncio.sleep(think.expovariate(1.0 / args.think_s) if args.think_s else 0)


def summarize(turns: list[Turn], wall: float) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "turns": len(ok),
        "errors": len(turns) - len(ok),
        "wall_s": wall,
        "turns_per_s": len(ok) / wall,
        "output_tok_per_s": sum(t.output_tokens for t in ok) / wall,
        "ttft_p50_s": pct([t.ttft for t in ok], 50),
        "ttft_p90_s": pct([t.ttft for t in ok], 90),
        "ttft_later_p50_s": pct([t.ttft for t in later], 50),
        "ttft_later_p90_s": pct([t.ttft for t in later], 90),
        "cached_share": sum(t.cached_tokens for t in ok) / max(prompt, 1),
        "mean_prompt_tokens": prompt / max(len(ok), 1),
        "latency_p50_s": pct([t.latency for t in ok], 50),
        **steady(ok),
    }


def steady(ok: list[Turn], share: float = 0.8) -> dict[str, Any]:
    """Throughput while every user still has conversations to replay: up to the moment the first
    ``share`` of the turns had ended. A closed loop drains at its end (the last users finish
    alone), which dilutes a throughput taken over the whole wall time."""
    if not ok:
        return {"steady_s": 0.0, "steady_turns_per_s": 0.0, "steady_output_tok_per_s": 0.0}
    ends = sorted(t.sent + t.latency for t in ok)
    until = ends[max(int(len(ends) * share) - 1, 0)]
    done = [t for t in ok if t.sent + t.latency <= until]
    return {
        "steady_s": until,
        "steady_turns_per_s": len(done) / max(until, 1e-9),
        "steady_output_tok_per_s": sum(t.output_tokens for t in done) / max(until, 1e-9),
    }


async def run(args) -> dict[str, Any]:
    import httpx

    doc = json.loads(Path(args.data).read_text())
    first = getattr(args, "offset", 0)
    convs = doc["conversations"][first : first + args.conversations]
    queue: asyncio.Queue = asyncio.Queue()
    for i, c in enumerate(convs):
        queue.put_nowait((i, c["turns"]))
    total = sum(1 if args.first_turns else len(c["turns"]) for c in convs)
    # uvicorn closes a connection idle for 5 s, httpx keeps one 5 s: a user back from thinking
    # then races the close and gets a ReadError. Drop idle connections well before the server.
    limits = httpx.Limits(
        max_connections=args.users + 8, max_keepalive_connections=args.users, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(args.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        if (
            getattr(args, "client", "raw") == "raw"
        ):  # the turns' streams (benchmarks/http_client.py)
            from benchmarks.http_client import RawStreamClient

            client = RawStreamClient(args.timeout_s)
        out: list[Turn] = []
        last = [0.0]

        def bar(done: int) -> None:
            now = time.perf_counter()
            if now - last[0] > 5:
                last[0] = now
                print(f"  {done}/~{total} turns, {now - t0:.0f} s", flush=True)

        t0 = time.perf_counter()
        await asyncio.gather(
            *(user(k, args, client, model, queue, t0, out, bar) for k in range(args.users))
        )
        wall = time.perf_counter() - t0
    summary = summarize(out, wall)
    return {"args": vars(args), "summary": summary, "turns": [asdict(t) for t in out]}


def table(name: str, s: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    return (
        f"{name:<16} turns {s['turns']:>5} err {s['errors']:>3}  {s['turns_per_s']:6.2f} turn/s "
        f"{s['output_tok_per_s']:8.0f} out tok/s  TTFT p50/p90 {ms(s['ttft_p50_s'])}/"
        f"{ms(s['ttft_p90_s'])} ms (turns 2+: {ms(s['ttft_later_p50_s'])}/"
        f"{ms(s['ttft_later_p90_s'])})  cached {s['cached_share']:.0%}  steady "
        f"{s['steady_output_tok_per_s']:.0f} out tok/s"
    )


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time (exponential)")
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=8000)
    ap.add_argument("--first-turns", action="store_true")
    ap.add_argument("--offset", type=int, default=0, help="skip this many conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="what streams the turns: benchmarks/http_client.py (httpx cost ~0.6 ms of CPU an "
        "event on a 2-core host)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="run")
    ap.add_argument("--out", type=Path)
    add_args(ap)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(table(args.name, result["summary"]))
    if args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
