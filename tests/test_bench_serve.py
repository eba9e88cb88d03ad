"""benchmarks/serve.py: the metrics, the arrival schedule, the workloads, and one run against a
tiny local SSE server (no model; a few seconds on CPU)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import Request  # module level: FastAPI resolves the endpoint's annotation here

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serve  # noqa: E402
from benchmarks.serve import Record  # noqa: E402

# ------------------------------------------------------------------------------------ metrics


def _records() -> list[Record]:
    return [
        Record(10, 4, True, 200, "", 0.0, 1.0, 0.1, 1.0, [0.3, 0.3, 0.3], 4, 0),
        Record(12, 4, True, 200, "", 0.5, 2.5, 0.5, 2.0, [0.5, 0.5, 0.5], 4, 12),
        Record(5, 4, True, 200, "", 1.0, 1.2, 0.2, 0.2, [], 1, 5),
        Record(7, 4, False, 429, "HTTP 429: busy", 1.0, 1.01, 0.0, 0.01),
        Record(7, 4, False, 500, "HTTP 500: boom", 2.0, 2.1, 0.0, 0.1),
    ]


def test_metrics_counts_and_throughput():
    m = serve.compute_metrics(_records())
    assert (m["num_prompts"], m["completed"], m["failed"], m["rejected"]) == (5, 3, 2, 1)
    assert m["duration"] == pytest.approx(2.5)
    assert m["total_input_tokens"] == 10 + 12 + 5  # usage where sent, else the prompt length
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(3 / 2.5)
    assert m["output_throughput"] == pytest.approx(9 / 2.5)
    assert m["total_token_throughput"] == pytest.approx(36 / 2.5)
    assert m["max_concurrent_requests"] == 3
    assert m["errors"] == {"HTTP 429: busy": 1, "HTTP 500: boom": 1}
    assert m["request_goodput"] is None


def test_metrics_latency_stats():
    m = serve.compute_metrics(_records())
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(440)  # linear interpolation between 200 and 500
    assert m["p99_ttft_ms"] == pytest.approx(494)
    # TPOT = (e2el - ttft) / (output - 1): 0.9 / 3 and 1.5 / 3; one-token requests left out
    assert m["mean_tpot_ms"] == pytest.approx(400)
    assert m["p90_tpot_ms"] == pytest.approx(480)
    assert m["std_tpot_ms"] == pytest.approx(100)
    assert m["median_itl_ms"] == pytest.approx(400)
    assert m["p99_e2el_ms"] == pytest.approx(1000 + 0.98 * 1000)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 300}, 2),  # 100 and 200 ms
        ({"ttft": 300, "tpot": 400}, 2),  # tpot 300 ms, and 0 for the one-token request
        ({"tpot": 250}, 1),
        ({"e2el": 1500}, 2),
        ({"ttft": 150, "e2el": 1500}, 1),
        ({"ttft": 1}, 0),
    ],
)
def test_goodput(slos, good):
    m = serve.compute_metrics(_records(), slos)
    assert m["request_goodput"] == pytest.approx(good / 2.5)


def test_metrics_from_dicts_and_empty():
    from dataclasses import asdict

    as_dicts = [asdict(r) for r in _records()]
    assert serve.compute_metrics(as_dicts) == serve.compute_metrics(_records())
    empty = serve.compute_metrics([])
    assert empty["completed"] == 0 and empty["request_throughput"] == 0.0
    assert empty["p99_ttft_ms"] is None
    failed = serve.compute_metrics(_records()[3:], {"ttft": 100})
    assert failed["completed"] == 0 and failed["request_goodput"] == 0.0
    assert failed["median_itl_ms"] is None


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    values = sorted(rng.random() for _ in range(37))
    for q in (0, 1, 50, 90, 99, 100):
        assert serve.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert serve.percentile([3.0], 99) == 3.0


def test_parse_slos():
    assert serve.parse_slos(["ttft:500", "tpot:40"]) == {"ttft": 500.0, "tpot": 40.0}
    assert serve.parse_slos(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:0"]):
        with pytest.raises(SystemExit):
            serve.parse_slos(bad)


# ----------------------------------------------------------------------------------- arrivals


def test_poisson_schedule_is_seeded_and_has_the_right_mean():
    a = serve.arrival_times(20000, 4.0, seed=3)
    assert a == serve.arrival_times(20000, 4.0, seed=3)
    assert a != serve.arrival_times(20000, 4.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.03)


def test_inf_rate_sends_all_at_once():
    assert serve.arrival_times(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError):
        serve.arrival_times(5, 0.0)


# ---------------------------------------------------------------------------------- workloads


def _args(line: str, *extra: str):
    return serve.parse_args(["--base-url", "http://x", *line.split(), *extra])


def test_random_and_long_and_prefix_workloads():
    reqs = serve.build_requests(
        _args("--workload random --num-prompts 50 --input-len 20 --output-len 10 --range-ratio 0.5")
    )
    assert len(reqs) == 50 and all(10 <= r.prompt_len <= 30 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len and 5 <= r.output_len <= 15 for r in reqs)
    assert all(lo <= t < hi for r in reqs for t in r.prompt for lo, hi in [serve.SAFE_ID_RANGE])
    again = serve.build_requests(
        _args("--workload random --num-prompts 50 --input-len 20 --output-len 10 --range-ratio 0.5")
    )
    assert again == reqs
    long = serve.build_requests(_args("--workload long --num-prompts 5 --long-input 100 200"))
    assert all(100 <= r.prompt_len <= 200 and 64 <= r.output_len <= 256 for r in long)
    pre = serve.build_requests(
        _args(
            "--workload prefix --num-prompts 6 --num-prefixes 2 --prefix-len 16 "
            "--input-len 4 --output-len 3"
        )
    )
    assert all(r.prompt_len == 20 and r.output_len == 3 for r in pre)
    assert pre[0].prompt[:16] == pre[2].prompt[:16] != pre[1].prompt[:16]
    assert pre[0].prompt[16:] != pre[2].prompt[16:]


def test_sharegpt_ids_from_the_lengths_file():
    pairs = json.loads(serve.DEFAULT_LENGTHS.read_text())["lengths"]
    reqs = serve.build_requests(
        _args(
            "--workload sharegpt-ids --num-prompts 8 --max-output 64 --lengths-file",
            str(serve.DEFAULT_LENGTHS),
        )
    )
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(p, min(o, 64)) for p, o in pairs[:8]]
    assert all(len(r.prompt) == r.prompt_len for r in reqs)


def test_chat_needs_text_and_request_bodies():
    with pytest.raises(SystemExit):
        serve.build_requests(_args("--workload random --endpoint chat"))
    req = serve.Request("hi", 1, 7)
    chat = serve.Target("http://h:1/", "m", "chat", "k", ignore_eos=True)
    body = serve.request_body(chat, req)
    assert chat.url == "http://h:1/v1/chat/completions"
    assert chat.headers() == {"Authorization": "Bearer k"}
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 7 and body["ignore_eos"] is True
    plain = serve.request_body(serve.Target("http://h:1", None), serve.Request([1, 2], 2, 3))
    assert plain == {
        "prompt": [1, 2],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert serve.chunk_text({"choices": [{"delta": {"content": "a"}}]}, chat=True) == "a"
    assert serve.chunk_text({"choices": [], "usage": {}}, chat=False) == ""


# ------------------------------------------------------------------------ end to end (no model)

CHUNK_DELAY_S = 0.002


def _fake_openai_app(bodies: list[dict]):
    """Streams max_tokens one-character chunks (the first ends in a raw U+2028, which JSON may
    leave unescaped and str.splitlines() takes for a line end); odd max_tokens -> 429;
    max_tokens 4 -> an in-band error after the first chunk."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        bodies.append({**body, "_auth": request.headers.get("authorization")})
        n = body["max_tokens"]
        if n % 2:
            return JSONResponse({"error": {"message": "busy", "code": 429}}, status_code=429)
        return StreamingResponse(_frames(body, n), media_type="text/event-stream")

    return app


async def _frames(body: dict, n: int):
    def frame(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    for i in range(n):
        await asyncio.sleep(CHUNK_DELAY_S)
        if n == 4 and i == 1:
            yield frame({"error": {"message": "worker lost", "type": "server_error"}})
            return
        text = "x\u2028" if i == 0 else "x"
        yield frame({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
    yield frame({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
    yield frame({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    bodies: list[dict] = []
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it Nagle holds the small SSE frames back ~40 ms (delayed ACKs).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_fake_openai_app(bodies), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    yield f"http://127.0.0.1:{port}", bodies
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _run(argv: list[str]) -> dict:
    return asyncio.run(asyncio.wait_for(serve.async_main(argv), timeout=30))


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_end_to_end_sweep(fake_server, tmp_path, capsys, client):
    base, bodies = fake_server
    out = tmp_path / "serve.json"
    argv = (
        f"--base-url {base} --out {out} --label fake --workload random --num-prompts 12 "
        "--input-len 8 --output-len 6 --range-ratio 0.5 --seed 1 --rates inf 40 --ignore-eos "
        f"--warmup 0 --timeout 10 --goodput ttft:5000 --client {client}"
    ).split()
    requests = serve.build_requests(serve.parse_args(argv))
    rejected = sum(r.output_len % 2 for r in requests)
    errored = sum(r.output_len == 4 for r in requests)
    assert 0 < rejected < 12 and errored > 0  # the seeded lengths exercise every outcome
    bodies.clear()
    entry = _run(argv)

    assert len(bodies) == 24 and all(b["model"] == "fake-model" for b in bodies)  # discovered
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["_auth"] is None for b in bodies)
    assert [r["offered_rate"] for r in entry["results"]] == ["inf", 40.0]
    ok = [r for r in requests if r.output_len % 2 == 0 and r.output_len != 4]
    for i, res in enumerate(entry["results"]):
        assert res["completed"] == len(ok)
        assert res["failed"] == rejected + errored and res["rejected"] == rejected
        assert res["total_output_tokens"] == sum(r.output_len for r in ok)
        # the second rate's prompts are a round of their own: two marker tokens each
        assert res["total_input_tokens"] == sum(r.prompt_len + 2 * i for r in ok)
        assert res["request_goodput"] == pytest.approx(res["request_throughput"])
        # measured per chunk (a value, not None); how large depends on when the client's reads
        # ran, which a busy 2-core machine coalesces; the arithmetic is checked by test_metrics_latency_stats
        assert res["median_itl_ms"] is not None and res["median_itl_ms"] > 0
        assert res["client_cpu_s"] > 0 and 0 < res["client_cpu_share"] <= 1.5
    # each rate's run sends prompts no other run sent: the first as built, the second with
    # its round's two tokens after the first one (a server's prefix cache finds no repeat)
    first, second = ({tuple(b["prompt"]) for b in bodies[k : k + 12]} for k in (0, 12))
    assert first == {tuple(r.prompt) for r in requests}
    assert second == {tuple(r.prompt) for r in serve.fresh_round(requests, 1)}
    assert not first & second
    # the Poisson run cannot end before its last seeded send
    assert entry["results"][1]["duration"] >= serve.arrival_times(12, 40.0, seed=1)[-1]

    data = json.loads(out.read_text())
    assert list(data["runs"]) == ["fake"]
    assert data["runs"]["fake"]["config"]["rates"] == ["inf", 40.0]
    assert data["runs"]["fake"]["base_url"] == base
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.split() and line.split()[0] in ("inf", "40")]
    assert len(rows) == 2


def test_end_to_end_append_save_requests_and_plot(fake_server, tmp_path):
    base, bodies = fake_server
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    out.write_text(json.dumps({"benchmark": "serve", "runs": {"other": {"results": []}}}))
    argv = (
        f"--base-url {base} --out {out} --plot {png} --append --save-requests --label sys-b "
        "--model fake-model --api-key sekrit --workload random --num-prompts 4 --input-len 5 "
        "--output-len 6 --burst --max-concurrency 2 --timeout 10"
    ).split()
    entry = _run(argv)
    (res,) = entry["results"]
    assert res["offered_rate"] == "inf" and res["completed"] == 4 and res["failed"] == 0
    assert res["max_concurrent_requests"] <= 2
    recs = res["requests"]
    assert all(r["output_tokens"] == 6 and len(r["itl"]) == 5 for r in recs)
    assert all(r["prompt_tokens"] == 5 and r["ttft"] > 0 for r in recs)
    assert res["mean_tpot_ms"] > 0 and res["p99_e2el_ms"] >= res["p99_ttft_ms"]
    assert bodies[-1]["_auth"] == "Bearer sekrit" and "sekrit" not in out.read_text()
    data = json.loads(out.read_text())
    assert sorted(data["runs"]) == ["other", "sys-b"]
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0


def test_file_workload_sends_the_files_own_requests():
    """``--workload file``: the prompt ids and output lengths of a workloads.py file (vLLM's
    ShareGPT sample here), in order, clipped by ``--max-output``; without the file it says so."""
    from benchmarks.workloads import read_workload

    path = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
    args = serve.parse_args(
        ["--workload", "file", "--workload-file", str(path), "--num-prompts", "7"]
        + ["--max-output", "100"]
    )
    requests = serve.build_requests(args)
    items = read_workload(path)[:7]
    assert [r.prompt for r in requests] == [list(i.prompt_token_ids) for i in items]
    assert [r.prompt_len for r in requests] == [len(i.prompt_token_ids) for i in items]
    assert [r.output_len for r in requests] == [min(i.output_len, 100) for i in items]
    assert any(i.output_len > 100 for i in items)
    with pytest.raises(SystemExit, match="--workload-file"):
        serve.build_requests(serve.parse_args(["--workload", "file"]))


def test_file_workload_as_text_prompts(monkeypatch) -> None:
    """``--text-prompts``: each prompt's ids decoded by ``--tokenizer`` (as vLLM's client sends
    ShareGPT: the server tokenizes), the lengths still the file's; without a tokenizer it says
    so."""
    from benchmarks.workloads import read_workload

    class Decoder:
        def __len__(self) -> int:
            return 200_000

        def decode(self, ids) -> str:
            return " ".join(map(str, ids))

    monkeypatch.setattr(serve, "load_tokenizer", lambda name: Decoder())
    path = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
    file = ["--workload", "file", "--workload-file", str(path), "--num-prompts", "3"]
    requests = serve.build_requests(serve.parse_args([*file, "--text-prompts", "--tokenizer", "t"]))
    items = read_workload(path)[:3]
    assert [r.prompt for r in requests] == [" ".join(map(str, i.prompt_token_ids)) for i in items]
    assert [r.prompt_len for r in requests] == [len(i.prompt_token_ids) for i in items]
    with pytest.raises(SystemExit, match="--text-prompts"):
        serve.build_requests(serve.parse_args([*file, "--text-prompts"]))
    chat = serve.parse_args([*file, "--endpoint", "chat", "--text-prompts", "--tokenizer", "t"])
    assert [r.prompt for r in serve.build_requests(chat)] == [r.prompt for r in requests]
    with pytest.raises(SystemExit, match="--endpoint chat needs text"):
        serve.build_requests(serve.parse_args([*file, "--endpoint", "chat", "--tokenizer", "t"]))


def test_file_workload_goes_round_without_prefix_hits(tmp_path) -> None:
    """Asked for more requests than the file holds, ``--workload file`` repeats its lengths but
    no later round's prompt shares its first block's tokens with an earlier one."""
    from benchmarks.workloads import read_workload

    path = ROOT / "benchmarks" / "data" / "vllm_sharegpt_llama3_1000.json"
    items = read_workload(path)
    n = 2 * len(items) + 5
    args = serve.parse_args(["--workload", "file", "--workload-file", str(path)] + [
        "--num-prompts", str(n)])  # fmt: skip
    requests = serve.build_requests(args)
    assert len(requests) == n
    for k in (0, 3, 4):
        first, again, third = requests[k], requests[k + len(items)], requests[k + 2 * len(items)]
        assert first.prompt == list(items[k].prompt_token_ids)
        assert first.prompt_len == again.prompt_len == third.prompt_len
        assert first.output_len == again.output_len == third.output_len
        heads = {tuple(r.prompt[:16]) for r in (first, again, third)}
        assert len(heads) == 3  # three different first blocks: no prefix-cache hit
        assert sum(a != b for a, b in zip(first.prompt, again.prompt, strict=True)) == 1


def test_fresh_rounds_share_no_prefix_across_rounds_and_keep_it_inside_one() -> None:
    """A workload sent again to one server: round r's prompts share no first block with any
    other round's, prompts that shared a prefix inside a round still do, lengths grow by the
    two marker tokens only, and text prompts get the round's tag."""
    shared = list(range(200, 240))
    reqs = [
        serve.Request([7, *shared, 1, 2, 3], 44, 5),
        serve.Request([7, *shared, 4, 5], 43, 6),
        serve.Request("hello there", 2, 7),
    ]
    assert serve.fresh_round(reqs, 0) is reqs
    rounds = {r: serve.fresh_round(reqs, r) for r in (1, 2, 29_899, 29_900, 123_456)}
    heads = {(r, tuple(q[0].prompt[:16])) for r, q in rounds.items()}
    assert len({h for _, h in heads} | {tuple(reqs[0].prompt[:16])}) == len(rounds) + 1
    for r, got in rounds.items():
        a, b, text = got
        assert a.prompt[0] == 7 and a.prompt[3:] == reqs[0].prompt[1:]  # BOS kept first
        assert a.prompt[:16] == b.prompt[:16]  # the shared prefix is still shared
        assert (a.prompt_len, b.prompt_len) == (46, 45)
        assert (a.output_len, b.output_len, text.output_len) == (5, 6, 7)
        assert text.prompt == f"[{r}] hello there"
        assert all(serve.SAFE_ID_RANGE[0] <= t < serve.SAFE_ID_RANGE[1] for t in a.prompt[1:3])
    span = serve.SAFE_ID_RANGE[1] - serve.SAFE_ID_RANGE[0]
    with pytest.raises(ValueError, match="round"):
        serve.fresh_round(reqs, span**2)


def test_goodput_frontier_is_the_last_rate_before_attainment_drops() -> None:
    """DistServe's goodput: the highest rate at which 90 % of requests meet both SLOs (the last
    passing rate before the first miss, and the crossing interpolated between them)."""
    from benchmarks.gpu_serve import attainment, frontier

    g = frontier([(30.0, 0.5), (10.0, 1.0), (20.0, 0.95), (float("inf"), 0.0)])
    assert g["measured"] == 20.0 and g["first_miss"] == 30.0
    assert g["interpolated"] == pytest.approx(20.0 + 10.0 * 0.05 / 0.45)
    # a later rate passing again does not lift it past the first miss
    assert frontier([(10.0, 0.95), (20.0, 0.5), (30.0, 0.92)])["measured"] == 10.0
    assert frontier([(10.0, 0.8), (20.0, 0.5)])["bound"] == "below"
    top = frontier([(10.0, 1.0), (20.0, 0.91)])
    assert top["bound"] == "above" and top["measured"] == 20.0

    def rec(ttft: float, latency: float, ok: bool = True) -> dict:
        return vars(Record(prompt_len=8, output_len=11, success=ok, ttft=ttft, latency=latency,
                           output_tokens=11))  # fmt: skip

    slos = {"ttft": 500.0, "tpot": 40.0}
    reqs = [
        rec(0.1, 0.1 + 10 * 0.03),
        rec(0.6, 0.9),
        rec(0.1, 0.1 + 10 * 0.05),
        rec(0.1, 0.2, False),
    ]
    assert attainment({"requests": reqs}, slos) == 0.25  # only the first meets both; failed miss
    # --steady-from: the first arrivals (an emptier server) left out of the share
    for i, r in enumerate(reqs):
        r["start"] = float(i)  # sent at 0, 1, 2, 3 s: the first, the only one meeting both
    assert attainment({"requests": reqs}, slos, steady_from=0.3) == 0.0
    assert attainment({"requests": reqs}, slos, steady_from=0.0) == 0.25


def test_steady_capacity_is_the_middle_token_rate_over_a_requests_output() -> None:
    """A burst whose tail drains slowly: its own requests/s understate what the batch sustains;
    the tokens/s in the run's middle half over the mean output do not."""
    from benchmarks.gpu_serve import steady_capacity

    def rec(end: float, tokens: int) -> dict:
        return vars(Record(prompt_len=8, output_len=tokens, success=True, start=0.0, ttft=0.0,
                           end=end, latency=end, output_tokens=tokens))  # fmt: skip

    # 8 requests of 100 tokens decode side by side for 8 s (100 tokens/s of the batch over
    # [0, 8]), then one straggler of 100 tokens runs alone to 24 s: middle half = [6, 18] s
    recs = [rec(8.0, 100) for _ in range(8)] + [rec(24.0, 100)]
    tokens = 8 * 100 * 2 / 8 + 100 * 12 / 24  # the 8 between 6 and 8 s; the straggler's share
    assert steady_capacity({"requests": recs}) == pytest.approx(tokens / 12 / 100)
    assert steady_capacity({"requests": []}) is None


# ------------------------------------------------------------------------ the raw HTTP client


def test_raw_client_decodes_chunks_split_anywhere_and_refuses_bad_heads():
    """Chunked bodies whose size lines and payloads straddle the reads (read whole and as
    lines), a sized body, a body up to EOF; a bad status line or a truncated chunk raises
    HTTPError."""
    from benchmarks.http_client import HTTPError, RawStreamClient

    payloads = [b"data: a\n\n", b"x" * 70000, b"data: \xe2\x80\xa8b\n\n"]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"
    replies = {
        "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n" + chunked,
        "/sized": b"HTTP/1.1 429 Too Many\r\ncontent-length: 5\r\n\r\nbusy!extra",
        "/eof": b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        "/bad": b"HTTX/9 nope\r\n\r\n",
        "/cut": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nshort",
    }

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        reply = replies[path]
        for i in range(0, len(reply), 7):  # tiny writes: every boundary falls somewhere
            writer.write(reply[i : i + 7])
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawStreamClient(10)
        url = f"http://127.0.0.1:{port}"
        try:
            async with client.stream("POST", url + "/chunked", json={"a": 1}) as resp:
                assert resp.status_code == 200 and resp.headers["x-a"] == "1"
                assert await resp.aread() == b"".join(payloads)
            async with client.stream("POST", url + "/chunked") as resp:
                lines = [line async for line in resp.aiter_lines()]
            # (a line and the 3-byte U+2028 straddle the 7-byte writes: put back together)
            assert lines == ["data: a", "", "x" * 70000 + "data: \u2028b", ""]
            async with client.stream("GET", url + "/sized") as resp:
                assert resp.status_code == 429 and await resp.aread() == b"busy!"
            async with client.stream("GET", url + "/eof") as resp:
                assert await resp.aread() == b"until the end"
            with pytest.raises(HTTPError, match="status line"):
                async with client.stream("GET", url + "/bad"):
                    pass
            with pytest.raises(HTTPError, match="inside a chunk"):
                async with client.stream("GET", url + "/cut") as resp:
                    await resp.aread()
            with pytest.raises(ValueError, match="http://"):
                async with client.stream("GET", "https://example.com/"):
                    pass
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), timeout=20))
