"""Live migration between two decode workers in one process (in-process KV transport, no Ray),
on a random tiny Llama: the protocol's contract, fast enough for every edit.

A request decoding on A moves to B mid-stream; read as the router reads it (A's stream until its
``moved_to`` delta, then B's; deltas positioned), its tokens equal an unmigrated run's, greedy
and seeded. Every failure outcome is a value, the request keeps decoding (or ends as it would),
and both workers' block accounting is exact afterwards.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from hf_oracle import save_tiny

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.messages import Delta, PrefillDone, Reserved
from prefill_worker.worker import PrefillWorker

transformers = pytest.importorskip("transformers")

ENGINE = {"max_num_batched_tokens": 32, "num_kv_blocks": 96, "block_size": 4, "max_num_seqs": 4}
MIGRATION = {"last_stage_blocks": 2, "headroom_blocks": 1, "chunk_tokens": 8, "timeout_s": 5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-migrate")


# Decode workers with async scheduling too (on by default on CUDA): a migration pauses a request
# while a step may be running, and its tokens must still come out exactly.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def workers(tiny, request):
    cfg = {"model_dir": tiny, **ENGINE, "async_scheduling": request.param}
    p = PrefillWorker(cfg, "p")
    a = DecodeWorker(cfg, "a", transport="inproc", migration=MIGRATION)
    b = DecodeWorker(cfg, "b", transport="inproc", migration=MIGRATION)
    for w in (p, a, b):
        w.start()
    yield p, a, b
    for w in (p, a, b):
        w.shutdown()


def handle(worker):
    """What a Ray actor handle offers (``method.remote(...)`` -> awaitable), in process."""

    class _Handle:
        def __getattr__(self, name):
            method = getattr(worker, name)
            return SimpleNamespace(remote=lambda *a, **k: method(*a, **k))

    return _Handle()


class Client:
    """Reads one request the way the router does: positioned deltas from the worker it runs
    on, switching streams on ``moved_to``."""

    def __init__(self, workers: dict, rid: str) -> None:
        self.workers, self.rid = workers, rid
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.moves: list[str] = []

    def apply(self, d: Delta) -> None:
        assert d.request_id == self.rid and d.error is None, d
        if d.moved_to:
            self.moves.append(d.moved_to)
            return
        if d.start < 0:  # an unpositioned end (an abort): no tokens
            assert not d.token_ids
            self.finish = d.finish_reason or self.finish
            return
        assert d.start <= len(self.tokens), f"gap: {d.start} after {len(self.tokens)} tokens"
        self.tokens += d.token_ids[len(self.tokens) - d.start :]
        self.finish = d.finish_reason or self.finish

    async def run(self, first: str) -> None:
        name = first
        while self.finish is None:
            moved = len(self.moves)
            stream = self.workers[name].outputs(self.rid)
            try:
                async for batch in stream:
                    for d in batch.deltas:
                        self.apply(d)
                    if self.finish is not None or len(self.moves) > moved:
                        break
            finally:
                await stream.aclose()
            if len(self.moves) > moved:
                name = self.moves[-1]


async def start(p, d, rid, prompt, params):
    res = await d.reserve(rid, prompt, params, rid)
    assert isinstance(res, Reserved)
    done = await p.prefill(rid, prompt, params, res.endpoint)
    assert isinstance(done, PrefillDone)


def prompt_of(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(320) for _ in range(n)]


async def wait_tokens(client: Client, n: int) -> None:
    while len(client.tokens) < n and client.finish is None:
        await asyncio.sleep(0.002)


async def there_and_back(p, named: dict, rid: str, prompt, params, at=(6, 20)):
    """``rid`` prefilled by ``p`` onto ``named["a"]``, moved to the other worker once it has
    ``at[0]`` tokens and back at ``at[1]``, read as the router reads it: its ``Client`` and
    each move's result."""
    await start(p, named["a"], rid, prompt, params)
    client = Client(named, rid)
    reader = asyncio.ensure_future(client.run("a"))
    results, where = [], "a"
    for n in at:
        await wait_tokens(client, n)
        dest = "b" if where == "a" else "a"
        results.append(await named[where].migrate_out(rid, handle(named[dest]), dest))
        where = dest if results[-1].ok else where
    await reader
    return client, results


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=48, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_migrated_request_gives_the_same_tokens(tiny, workers, params) -> None:
    p, a, b = workers
    prompt = prompt_of(30)
    expected = LLM(tiny, **ENGINE).generate([prompt], params)[0].outputs[0].token_ids
    named = {"a": a, "b": b}
    client, results = asyncio.run(there_and_back(p, named, f"m-{params.seed}", prompt, params))
    assert [r.outcome for r in results] == ["migrated", "migrated"], results
    assert client.moves == ["b", "a"]
    assert client.tokens == expected
    assert client.finish == "length"
    assert all(r.stages >= 2 and r.tokens > 30 and r.bytes > 0 for r in results), results
    for w in (p, a, b):
        assert asyncio.run(w.check_idle()) is None


def test_failures_are_values_and_the_request_goes_on(tiny, workers) -> None:
    p, a, b = workers
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = prompt_of(20, seed=9)
    expected = LLM(tiny, **ENGINE).generate([prompt], params)[0].outputs[0].token_ids

    class Dead:
        def __getattr__(self, name):
            async def fail(*a, **k):
                raise ConnectionError("actor died")

            return SimpleNamespace(remote=fail)

    async def main():
        rid = "f1"
        await start(p, a, rid, prompt, params)
        client = Client({"a": a, "b": b}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 4)
        out = {}
        out["unknown"] = await a.migrate_out("nope", handle(b), "b")
        out["dead"] = await a.migrate_out(rid, Dead(), "b")
        # B full: fill B's pool first (a reservation that holds almost every block)
        hog = await b.reserve("hog", [1] * 376, SamplingParams(max_tokens=1), "hog")
        assert isinstance(hog, Reserved)
        out["full"] = await a.migrate_out(rid, handle(b), "b")
        await b.abort("hog")
        await reader
        return client, out

    client, out = asyncio.run(main())
    assert out["unknown"].outcome == "not_migratable"
    assert out["dead"].outcome == "dest_failed" and "actor died" in out["dead"].reason
    assert out["full"].outcome == "dest_full"
    assert client.tokens == expected and client.moves == []
    for w in (p, a, b):
        assert asyncio.run(w.check_idle()) is None


def test_destination_dies_in_the_last_stage_and_the_source_resumes(tiny, workers) -> None:
    """B reserves and receives, then never answers migrate_wait: A cancels, puts the request
    back, and it finishes on A with the right tokens; B frees its reservation."""
    p, a, b = workers
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = prompt_of(16, seed=4)
    expected = LLM(tiny, **ENGINE).generate([prompt], params)[0].outputs[0].token_ids

    class Hangs:
        """B until the last stage; then it stops answering (its reservation stays)."""

        def __getattr__(self, name):
            if name in ("migrate_wait", "migrate_cancel"):

                async def hang(*a, **k):
                    await asyncio.sleep(60)

                return SimpleNamespace(remote=hang)
            return getattr(handle(b), name)

    async def main():
        rid = "f2"
        await start(p, a, rid, prompt, params)
        client = Client({"a": a, "b": b}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 3)
        res = await a.migrate_out(rid, Hangs(), "b")
        await reader
        return client, res

    role = a.migration_role
    old = role.config
    role.config = type(old)(**{**old.__dict__, "timeout_s": 0.5})
    try:
        client, res = asyncio.run(main())
    finally:
        role.config = old
    assert res.outcome == "dest_failed" and res.pause_s >= 0.5
    assert client.tokens == expected and client.moves == []
    # B admitted it (the KV and done arrived) but A kept it: B runs it for nobody until told
    asyncio.run(b.abort("f2"))
    for w in (p, a, b):
        assert asyncio.run(w.check_idle()) is None


def test_request_that_finishes_during_the_migration(tiny, workers) -> None:
    p, a, b = workers
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    rid = "f3"

    async def main():
        await start(p, a, rid, prompt_of(60, seed=2), params)
        client = Client({"a": a, "b": b}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 1)  # admitted: decoding on A
        # a slow copy: the request's 5 remaining tokens finish before the stages do
        res = await a.migrate_out(rid, handle(b), "b")
        await reader
        return client, res

    role = a.migration_role
    old = role.config
    role.config = type(old)(**{**old.__dict__, "chunk_tokens": 1, "last_stage_blocks": 1})
    try:
        client, res = asyncio.run(main())
    finally:
        role.config = old
    # On a loaded machine the last 5 tokens can also land before the migration reaches A's
    # engine thread: then there is nothing to move, and the same stream ends whole.
    gone = res.outcome == "not_migratable" and res.reason == f"no request {rid!r} here"
    assert res.outcome in ("finished", "migrated") or gone, res
    assert len(client.tokens) == 6 and client.finish == "length"
    for w in (p, a, b):
        assert asyncio.run(w.check_idle()) is None


@pytest.mark.parametrize("when", ["copying", "paused"])
def test_client_abort_during_the_migration_cleans_both_sides(tiny, workers, when) -> None:
    """The request is aborted on A while its KV is being copied (stages) or while it is paused
    in the last stage: the migration ends ``finished``, B frees its reservation, A frees the
    request, and the stream ends with ``abort``."""
    p, a, b = workers
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    class Slow:
        """B, whose answer is held where the abort should land: the abort is sent once B has
        answered (``inside``) and before A sees the answer, so the timing is not a race with
        the request's remaining decode steps."""

        def __init__(self):
            self.inside = asyncio.Event()

        def __getattr__(self, name):
            method = getattr(handle(b), name)
            slow = (when == "paused" and name == "migrate_wait") or (
                when == "copying" and name == "migrate_in"
            )
            if not slow:
                return method

            async def later(*args, **kwargs):
                result = await method.remote(*args, **kwargs)
                self.inside.set()
                await asyncio.sleep(0.3)
                return result

            return SimpleNamespace(remote=later)

    async def main():
        rid = f"ab-{when}"
        await start(p, a, rid, prompt_of(40, seed=6), params)
        client = Client({"a": a, "b": b}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 3)
        slow = Slow()
        mig = asyncio.ensure_future(a.migrate_out(rid, slow, "b"))
        await slow.inside.wait()
        await a.abort(rid)
        res = await mig
        await reader
        return client, res

    client, res = asyncio.run(main())
    assert res.outcome == "finished", res
    assert client.finish == "abort" and client.moves == []
    for w in (p, a, b):
        assert asyncio.run(w.check_idle()) is None


def test_projection_counts_the_router_s_predicted_length(tiny, workers) -> None:
    """A reservation that carries the router's predicted length (its 90th percentile) is
    projected to need blocks for that many tokens, not for its max_tokens (the rebalancer
    reads it); past the prediction, max_tokens again."""
    p, a, _ = workers
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = prompt_of(12, seed=5)

    async def main():
        rid = "predicted"
        res = await a.reserve(rid, prompt, params, rid, predicted_tokens=30)
        assert isinstance(res, Reserved)
        assert isinstance(await p.prefill(rid, prompt, params, res.endpoint), PrefillDone)
        client = Client({"a": a}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 2)
        (c,) = [c for c in await a.migration_candidates() if c["request_id"] == rid]
        await reader
        return c, client

    c, client = asyncio.run(main())
    produced = c["num_tokens"] - len(prompt)
    assert 2 <= produced < 30, c
    assert c["remaining"] == 30 - produced  # not 48 - produced
    assert len(client.tokens) == 48  # a prediction never cuts the answer short
    assert asyncio.run(a.check_idle()) is None


def test_a_destination_with_another_kv_cache_dtype_is_refused(tiny, workers) -> None:
    """B keeps its KV in fp8 (``kv_cache_dtype="fp8"``), A in the model's dtype: A's copy channel
    is refused at the handshake, naming both dtypes, before any byte moves; the migration ends
    ``dest_failed``, the request finishes on A with the right tokens, B frees its reservation."""
    p, a, _ = workers
    cfg = {"model_dir": tiny, **ENGINE, "kv_cache_dtype": "fp8"}
    b8 = DecodeWorker(cfg, "b8", transport="inproc", migration=MIGRATION)
    b8.start()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = prompt_of(18, seed=8)
    expected = LLM(tiny, **ENGINE).generate([prompt], params)[0].outputs[0].token_ids

    async def main():
        rid = "kv-dtype"
        await start(p, a, rid, prompt, params)
        client = Client({"a": a, "b8": b8}, rid)
        reader = asyncio.ensure_future(client.run("a"))
        await wait_tokens(client, 3)
        res = await a.migrate_out(rid, handle(b8), "b8")
        await reader
        return client, res

    try:
        client, res = asyncio.run(main())
        assert res.outcome == "dest_failed", res
        assert "KV cache dtype: sender 'float32', receiver 'float8_e4m3fn'" in res.reason, res
        assert client.tokens == expected and client.moves == []
        for w in (p, a, b8):
            assert asyncio.run(w.check_idle()) is None
    finally:
        b8.shutdown()
