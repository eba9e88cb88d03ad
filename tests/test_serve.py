"""`tandem serve` end to end: the official openai client against a real server process.

One server for the module: SmolLM2 fp32 on CPU, 2 prefill + 1 decode workers (TCP KV
transport), a Redis this test starts (so it can kill and restart it), an API key, and a small
`--max-concurrent` so a burst overflows it. A second process, `tandem gateway`, attaches to the
same workers and shares the prefix index. The tests that stop Redis run last (file order).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_process import CliProcess, free_port
from openai_checks import check_n_samples, check_tool_calls

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-1"
# small, so that a burst of 3x it overflows it (429s), and large enough that the schema suite's
# 52 requests decode 8 at a time (at 3, that test took twice as long on 2 cores)
MAX_CONCURRENT = 8
MODEL = "smollm2"
WORDS = [
    "river",
    "stone",
    "mill",
    "bread",
    "orange",
    "violet",
    "copper",
    "garden",
    "lantern",
    "harbor",
    "meadow",
    "signal",
]


Proc = CliProcess


SHUTDOWN_S = 3.0


@pytest.fixture(scope="module")
def redis():
    from router.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def env():
    return {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def server(smollm2_dir, redis, env):
    port = free_port()
    proc = Proc(
        [
            "serve",
            "--model",
            str(smollm2_dir),
            "--served-model-name",
            MODEL,
            "--device",
            "cpu",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--redis-url",
            redis.url,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--max-concurrent",
            str(MAX_CONCURRENT),
            "--shutdown-timeout",
            str(SHUTDOWN_S),
            "--engine",
            "kv_cache_memory_gb=0.5",
        ],
        env,
    )
    try:
        ray_line = proc.wait_for(r"^ray: (\S+) \(cluster (\w+)\)", 300)
        proc.wait_for(r"^serving http://", 300)
        yield {"url": f"http://127.0.0.1:{port}", "ray": ray_line[1], "proc": proc}
    finally:
        proc.stop()
        assert proc.proc.returncode == 0, "\n".join(proc.lines[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


def long_prefix(seed: int, words: int = 1300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


# ---------------------------------------------------------------------------------- the API


def test_completion_streamed_equals_unstreamed(client) -> None:
    prompt = "The capital of France is"
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0
    )
    assert raw.headers["x-tandem-prefill"] in ("prefill-0", "prefill-1")
    assert raw.headers["x-tandem-decode"] == "decode-0"
    whole = raw.parse()
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_greedy_text_equals_transformers_also_on_a_prefix_hit(client, smollm2_dir) -> None:
    """Through the gateway, router and a prefill -> decode pair: transformers' greedy tokens
    (fp32), for a short prompt and for a long one sent twice (the second a prefix hit)."""
    import torch
    import transformers
    from hf_oracle import hf_greedy_ids

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    long = tok(long_prefix(9, 400) + " The last word is")["input_ids"]
    for ids, cached in ((tok("The capital of France is")["input_ids"], 0), (long, 0), (long, 1)):
        expect = tok.decode(hf_greedy_ids(hf.eval(), ids, 10), skip_special_tokens=True)
        out = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == expect
        assert (out.usage.prompt_tokens_details.cached_tokens > 0) == bool(cached)


def test_chat_streamed_equals_unstreamed_with_logprobs(client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].message.content
    assert "Paris" in content
    lp = whole.choices[0].logprobs.content
    assert len(lp) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    assert all(t.logprob >= t.top_logprobs[1].logprob for t in lp)  # greedy: the top token
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_stop_n_and_completion_logprobs(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[","]
    )
    assert out.choices[0].finish_reason == "stop" and "," not in out.choices[0].text
    two = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        seed=7,
        n=2,
        logprobs=1,
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in two.choices)


def test_n_samples_streamed_and_not(client) -> None:
    check_n_samples(client, MODEL)  # disaggregated: the n samples are n requests


def test_structured_outputs_through_the_openai_client(client) -> None:
    """Disaggregated (the prefill worker masks the first token, the decode worker rebuilds the
    grammar from it): ``parse`` with a pydantic model, json_schema streamed, json_object,
    guided_choice, and a schema that does not compile is a 400 naming it."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: float = Field(ge=0, le=50)

    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, max_tokens=80, temperature=1.0
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    assert parsed.choices[0].finish_reason == "stop"
    schema = {"name": "color", "schema": {"enum": ["red", "green", "blue"]}, "strict": True}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        response_format={"type": "json_schema", "json_schema": schema},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) in ("red", "green", "blue")
    obj = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(
        model=MODEL,
        prompt="Is Paris in France?",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, extra_body={"guided_regex": "a(b"}
        )
    assert bad.value.body["param"] == "guided_regex" and "regex" in bad.value.message


def test_the_schema_suite_at_temperature_1_through_the_openai_client(server) -> None:
    """Every schema of the suite (benchmarks/structured_suite.py: nested objects, arrays with
    bounds, enums, numbers with ranges, string patterns), one request each at temperature 1
    through the openai client, disaggregated (the prefill worker masks the first token, the
    decode worker the rest): 100 % of the answers parse and validate."""
    jsonschema = pytest.importorskip("jsonschema")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.structured_suite import schemas

    suite = schemas()
    assert len(suite) >= 50

    async def main():
        gate = asyncio.Semaphore(MAX_CONCURRENT)  # the server's bound: beyond it, 429s
        c = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)

        async def one(i, schema):
            async with gate:
                r = await c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"A JSON value for schema {i}."}],
                    max_tokens=160,
                    temperature=1.0,
                    seed=i,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
                    },
                )
            return r.choices[0]

        async with c:
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(suite)))

    bad = []
    for schema, choice in zip(suite, asyncio.run(main()), strict=True):
        try:
            assert choice.finish_reason == "stop", choice.finish_reason
            jsonschema.validate(json.loads(choice.message.content), schema)
        except Exception as exc:  # noqa: BLE001 - collected, reported together
            bad.append((choice.message.content, str(exc)[:120]))
    assert not bad, f"{len(bad)}/{len(suite)} invalid: {bad[:3]}"


def test_tool_calls_through_the_openai_client(client) -> None:
    """Disaggregated: a named tool, ``required`` streamed, parallel calls on and off, a tool
    result answered (tests/openai_checks.py)."""
    check_tool_calls(client, MODEL)


def test_errors_are_openai_json(server, client) -> None:
    url = server["url"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="maximum context length is"):
        client.completions.create(model=MODEL, prompt="hi " * 9000, max_tokens=10)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health").status_code == 200  # no key needed


@pytest.mark.parametrize(
    ("param", "extra"),
    [
        ("seed", {"seed": 2**70}),
        ("top_k", {"extra_body": {"top_k": 2**70}}),
        ("top_k", {"extra_body": {"top_k": 10**6}}),  # above the vocabulary
    ],
)
def test_an_out_of_range_knob_is_a_400_and_harms_no_other_request(server, client, param, extra):
    """Such values once overflowed the sampler inside a step and failed every request of it."""

    async def running():
        c = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
        return await c.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=16)

    async def scenario():
        other = asyncio.ensure_future(running())
        await asyncio.sleep(0.2)
        with pytest.raises(openai.BadRequestError) as bad:
            await asyncio.to_thread(
                client.completions.create, model=MODEL, prompt="hi", max_tokens=4, **extra
            )
        return bad.value, await other

    bad, other = asyncio.run(scenario())
    assert bad.body["param"] == param and param in bad.body["message"]
    assert "Traceback" not in bad.body["message"]
    assert other.choices[0].finish_reason == "length"


def test_burst_over_the_bound_gets_429_and_the_rest_complete(server) -> None:
    async def one(c: openai.AsyncOpenAI):
        try:
            out = await c.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=24)
            return out.choices[0].finish_reason
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["retry-after"]) >= 1
            return 429

    async def burst():
        c = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(c) for _ in range(3 * MAX_CONCURRENT)))

    results = asyncio.run(burst())
    assert results.count(429) >= MAX_CONCURRENT, results
    assert all(r in ("length", "stop", 429) for r in results), results


def test_client_disconnect_frees_blocks_on_both_workers(server) -> None:
    url = server["url"]
    body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 2000, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        pieces = 0
        for line in r.iter_lines():
            pieces += line.startswith("data: ")
            if pieces >= 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = metric(url, "tandem:num_requests_running")
        used = metric(url, "tandem:kv_cache_usage_perc")
        if running == 0 and used == 0:
            break
        time.sleep(0.2)
    assert running == 0 and used == 0, f"running={running} kv usage={used}"
    # earlier requests moved KV from the prefill workers to the decode worker, and it was timed
    sent = metric(url, "tandem:kv_transfer_bytes_total", direction="sent")
    assert sent > 0 and metric(url, "tandem:kv_transfer_bytes_total", direction="received") > 0
    assert metric(url, "tandem:kv_transfer_seconds_total") > 0


# ------------------------------------------------------------------- routing and the index


def _chat(client_, prefix: str, question: str):
    raw = client_.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )
    out = raw.parse()
    return raw.headers["x-tandem-prefill"], out.usage


def wait_for_hit(client_, prefix: str, worker: str, timeout: float = 20.0):
    """Ask until a request lands on ``worker`` with a prefix hit (the index is asynchronous:
    blocks are published within a few tens of ms of the step that computed them)."""
    deadline = time.monotonic() + timeout
    while True:
        got, usage = _chat(client_, prefix, f"Question {random.random()}?")
        if got == worker and usage.prompt_tokens_details.cached_tokens >= 1000:
            return usage
        assert time.monotonic() < deadline, f"no hit on {worker}: went to {got}, {usage}"
        time.sleep(0.2)


def test_shared_prefix_goes_to_the_worker_that_holds_it(client) -> None:
    prefix = long_prefix(1)
    first, usage = _chat(client, prefix, "What is the first word?")
    assert usage.prompt_tokens > 1000
    wait_for_hit(client, prefix, first)
    for i in range(4):  # the other worker is idle, but the hit is worth more
        got, usage = _chat(client, prefix, f"Question {i}: how many words?")
        assert got == first and usage.prompt_tokens_details.cached_tokens >= 1000


def test_a_second_gateway_finds_prefixes_cached_through_the_first(
    server, client, redis, env
) -> None:
    port = free_port()
    gw = Proc(
        [
            "gateway",
            "--ray-address",
            server["ray"],
            "--redis-url",
            redis.url,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--model",
            MODEL,
        ],
        env,
    )
    try:
        gw.wait_for(r"^serving http://", 120)
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        prefix = long_prefix(2)
        first, _ = _chat(client, prefix, "Through gateway one.")
        wait_for_hit(other, prefix, first)
        # A gateway that dies mid-stream: the workers abort its requests (its output streams'
        # reader is gone) and free their blocks; nothing decodes on for nobody.
        body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 2000}
        headers = {"Authorization": f"Bearer {KEY}"}
        url2 = f"http://127.0.0.1:{port}"
        with httpx.stream(
            "POST", url2 + "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as r:
            pieces = 0
            for line in r.iter_lines():
                pieces += line.startswith("data: ")
                if pieces >= 3:
                    gw.proc.kill()
                    break
        gw.proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = metric(server["url"], "tandem:num_requests_running")
            used = metric(server["url"], "tandem:kv_cache_usage_perc")
            if running == 0 and used == 0:
                break
            time.sleep(0.2)
        assert running == 0 and used == 0, f"running={running} kv usage={used}"
    finally:
        gw.stop()


def test_redis_down_routes_by_load_then_the_index_rebuilds(server, client, redis) -> None:
    url = server["url"]
    prefix = long_prefix(3)
    first, _ = _chat(client, prefix, "Before the outage.")
    wait_for_hit(client, prefix, first)
    misses = metric(url, "tandem:prefix_index_unavailable_total")
    redis.stop()
    try:
        for i in range(3):
            got, usage = _chat(client, prefix, f"During the outage {i}.")
            assert usage.completion_tokens > 0
        assert metric(url, "tandem:prefix_index_unavailable_total") >= misses + 3
    finally:
        redis.restart()  # empty: the workers notice and re-publish what they hold
    wait_for_hit(client, prefix, first, timeout=30)


# ----------------------------------------------------------- shutdown (last: it stops the server)


def test_sigterm_drains_refuses_new_requests_and_ends_the_rest_in_band(server) -> None:
    """SIGTERM: new requests get 503 + Retry-After at once; a stream still running when
    --shutdown-timeout passes ends with an in-band error and [DONE] (nothing is cut off
    without a word); then the server exits 0 (the fixture checks the exit status)."""
    url, proc = server["url"], server["proc"]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120)
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    proc.wait_for(r"SIGTERM: draining", 10)
    r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=headers)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "shutting_down"
    reader.join(60)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert SHUTDOWN_S - 0.5 < time.monotonic() - t0 < SHUTDOWN_S + 10
    assert proc.proc.wait(120) == 0
