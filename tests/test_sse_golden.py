"""The bytes a client receives, pinned: the gateway over the real router (``ClusterBackend``,
its dispatcher and ``Assembler``, ``_Fanout`` for ``n`` > 1) and stand-in colocated workers
(no Ray) that stream scripted engine deltas, one delta per request at a time.

The responses of a few representative requests (streamed and not, ``n`` = 2, logprobs in the
completions and chat shapes, a stop string that holds text back, a stop token, include_usage,
a request resumed on another worker after its first one failed mid-stream) are compared with
tests/golden/sse_router.json, with only the response id and ``created`` normalized. Streamed
frames of ``n`` > 1 are compared per choice (stably grouped by choice index): the order in
which two children's steps interleave is timing, each choice's own frames are not.

``TANDEM_WRITE_GOLDEN=1`` rewrites the file (only when the output is meant to change).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.messages import Delta, Membership, StreamBatch, WorkerInfo
from engine.tokenizer import encode_prompt, load_tokenizer
from router.gateway import create_app
from router.membership import MembershipView

pytest.importorskip("ray.exceptions")  # the router's stats poll imports it

GOLDEN = Path(__file__).parent / "golden" / "sse_router.json"
SENTENCE = " The tides rise. The moon pulls the sea; it falls again, and again and again."


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args, **kwargs))
        return fut


class _Stream:
    """One client's output stream of one worker: an async iterator of batches."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[StreamBatch] = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()


class _Job:
    def __init__(self, worker: _Worker, irid: str, params, client: str, carried: list[int]):
        self.worker, self.irid, self.params, self.client = worker, irid, params, client
        base = irid.split("~")[0]
        self.child = int(base.rsplit(".", 1)[1]) if "." in base else 0
        self.pos = len(carried)
        self.started = self.pos


class _Worker:
    def __init__(self, cluster: FakeCluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.streams: dict[str, _Stream] = {}
        self.generate_many = _Method(self._generate_many)
        self.abort = _Method(self._abort)
        self.health = _Method(lambda: {"step_age_s": 0.0})
        self.stats = _Method(lambda: {"name": name, "free_blocks": 100, "running": 0})

    def _outputs(self, client: str) -> _Stream:
        return self.streams.setdefault(client, _Stream())

    def _generate_many(self, items, client):
        for irid, _ids, params, kwargs in items:
            carried = list(kwargs.get("output_token_ids") or ())
            self.cluster.jobs.append(_Job(self, irid, params, client, carried))
        return [None] * len(items)

    def _abort(self, irid):
        self.cluster.jobs = [j for j in self.cluster.jobs if j.irid != irid]

    def send(self, client: str, delta: Delta) -> None:
        self._outputs(client).queue.put_nowait(StreamBatch(self.name, [delta]))


class FakeCluster:
    """Drives every job: one delta for a request whenever its previous one was taken by the
    dispatcher, so each step of a request holds exactly one engine delta."""

    def __init__(self, tokenizer) -> None:
        self.cycle = encode_prompt(tokenizer, SENTENCE)
        self.alternatives = encode_prompt(tokenizer, " cat mouse horse")
        self.jobs: list[_Job] = []
        self.workers = [_Worker(self, f"colocated-{i}") for i in range(2)]
        self.fail_after: int | None = None  # the next job fails after this many tokens
        self.dispatcher = None

    def membership(self) -> MembershipView:
        infos = [WorkerInfo(w.name, "colocated", w, endpoint=w.name) for w in self.workers]
        return MembershipView(Membership(1, infos, block_size=4, max_model_len=256))

    async def drive(self) -> None:
        while True:
            await asyncio.sleep(0.002)
            for job in list(self.jobs):
                inflight = self.dispatcher._inflight.get(job.irid)
                if inflight is None or inflight.deltas:
                    continue
                self._step(job)

    def _step(self, job: _Job) -> None:
        p = job.params
        if self.fail_after is not None and job.pos - job.started == self.fail_after:
            self.fail_after = None
            self.jobs.remove(job)
            job.worker.send(job.client, Delta(job.irid, error="transfer failed", retryable=True))
            return
        token = self.cycle[(job.child * 3 + job.pos) % len(self.cycle)]
        logprobs = None
        if p.logprobs is not None:
            entry = {token: -0.25}
            for j, alt in enumerate(self.alternatives):
                if len(entry) >= max(p.logprobs, 1):
                    break
                entry.setdefault(alt, -1.0 - j)
            logprobs = [entry]
        finish = stop = None
        if token in (p.stop_token_ids or ()):
            finish, stop = "stop", token
        elif job.pos + 1 >= p.max_tokens:
            finish = "length"
        cached = 2 if job.pos == job.started else 0
        delta = Delta(
            job.irid,
            [token],
            logprobs,
            finish_reason=finish,
            stop_reason=stop,
            num_cached_tokens=cached,
            start=job.pos,
        )
        job.pos += 1
        if finish is not None:
            self.jobs.remove(job)
        job.worker.send(job.client, delta)


CASES: list[tuple[str, str, dict[str, Any], int | None]] = [
    # (name, path, body, fail_after)
    (
        "completion-stream-usage",
        "/v1/completions",
        {"max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        None,
    ),
    ("completion-logprobs", "/v1/completions", {"max_tokens": 6, "logprobs": 2}, None),
    (
        "completion-stream-logprobs-stop",
        "/v1/completions",
        {"max_tokens": 16, "stream": True, "logprobs": 2, "stop": ["e moo"]},
        None,
    ),
    (
        "completion-stream-stop-included",
        "/v1/completions",
        {"max_tokens": 16, "stream": True, "stop": ["ls the"], "include_stop_str_in_output": True},
        None,
    ),
    ("completion-stop-string", "/v1/completions", {"max_tokens": 16, "stop": ["e moo"]}, None),
    (
        "completion-stream-stop-token",
        "/v1/completions",
        {"max_tokens": 16, "stream": True, "stop_token_ids": [], "logprobs": 1},
        None,
    ),
    (
        "completion-stream-n2-logprobs",
        "/v1/completions",
        {
            "max_tokens": 6,
            "stream": True,
            "n": 2,
            "logprobs": 1,
            "stop": [" moon"],
            "stream_options": {"include_usage": True},
        },
        None,
    ),
    ("completion-n2", "/v1/completions", {"max_tokens": 5, "n": 2, "logprobs": 1}, None),
    (
        "completion-stream-resumed",
        "/v1/completions",
        {"max_tokens": 8, "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}},
        3,
    ),
    ("completion-resumed", "/v1/completions", {"max_tokens": 8}, 2),
    (
        "chat-stream-n2-logprobs-usage",
        "/v1/chat/completions",
        {
            "max_tokens": 6,
            "stream": True,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
        },
        None,
    ),
    (
        "chat-n2-stop",
        "/v1/chat/completions",
        {"max_tokens": 12, "n": 2, "stop": ["."], "logprobs": True, "top_logprobs": 1},
        None,
    ),
    (
        "chat-stream-stop",
        "/v1/chat/completions",
        {"max_tokens": 12, "stream": True, "stop": ["a"]},
        None,
    ),
]


_ID = re.compile(r'"id":"(cmpl|chatcmpl)-[0-9a-f]+"')
_CREATED = re.compile(r'"created":[0-9]+')


def _normalized(text: str, streamed: bool, n: int) -> Any:
    """The body (or each frame's raw JSON text) with the id and ``created`` fixed."""

    def fixed(raw: str) -> str:
        return _CREATED.sub('"created":0', _ID.sub(r'"id":"\1-ID"', raw))

    if not streamed:
        return fixed(text)
    assert text.endswith("\n\n"), text[-40:]
    frames = []
    for f in text[:-2].split("\n\n"):
        assert f.startswith("data: "), f
        frames.append(fixed(f[6:]))
    if n > 1:  # each choice's frames in order; the usage frame and [DONE] stay last

        def choice(raw: str) -> int:
            body = json.loads(raw) if raw != "[DONE]" else {"choices": []}
            return body["choices"][0]["index"] if body["choices"] else n

        frames.sort(key=choice)
    return frames


async def _run_cases(tokenizer) -> dict[str, Any]:
    from router.service import ClusterBackend

    cluster = FakeCluster(tokenizer)
    stop_token = cluster.cycle[6]
    backend = ClusterBackend(cluster.membership(), tokenizer=tokenizer, model_name="smollm2")
    cluster.dispatcher = backend.dispatcher
    backend.dispatcher.open_stream = lambda worker, client: worker.handle._outputs(client)
    driver = asyncio.ensure_future(cluster.drive())
    app = create_app(backend)
    results = {}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for name, path, body, fail_after in CASES:
                body = dict(body)
                if "stop_token_ids" in body:
                    body["stop_token_ids"] = [stop_token]
                if path.endswith("chat/completions"):
                    body["messages"] = [{"role": "user", "content": "Tell me about the tides"}]
                else:
                    body["prompt"] = "Tell me about the tides"
                cluster.fail_after = fail_after
                r = await asyncio.wait_for(client.post(path, json=body), 30)
                assert r.status_code == 200, (name, r.text)
                results[name] = _normalized(r.text, body.get("stream", False), body.get("n", 1))
    finally:
        driver.cancel()
        await backend.aclose()
    results["resumes"] = dict(backend.dispatcher.resumes)
    return results


def test_the_sse_bytes_of_representative_requests_are_pinned(smollm2_dir) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    results = asyncio.run(_run_cases(tokenizer))
    if os.environ.get("TANDEM_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(results) == sorted(golden)
    for name in golden:
        assert results[name] == golden[name], name
    assert results["resumes"] == {"transfer_failed": 2}  # both resumed requests did resume
