"""Structured outputs on every path a request takes between workers, in one process (in-process
KV transport, no Ray; async scheduling on), on a random tiny Llama with SmolLM2's tokenizer:

(a) 1P1D: the first token, sampled on the prefill worker, is masked by the grammar (it is one
    the grammar allows, and not the token the unconstrained model picks), and the decode worker
    continues the grammar (rebuilt from that token): the answer equals the colocated one;
(b) migrated mid-answer from decode worker A to B and back: the same tokens, valid;
(c) resumed from its snapshot on another pair (what the router does when its decode worker
    is killed: prompt + the tokens produced so far, carried as output): the same tokens, valid.

Greedy: each path must give the colocated answer token for token."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
from hf_oracle import save_tiny
from test_migration_inprocess import Client, handle, wait_tokens

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.grammar import allocate_bitmask, allowed_tokens
from engine.messages import PrefillDone, Reserved
from engine.sampling_params import StructuredSpec
from prefill_worker.worker import PrefillWorker

transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

VOCAB = 49152
ENGINE = {"max_num_batched_tokens": 32, "num_kv_blocks": 96, "block_size": 4, "max_num_seqs": 4}
MIGRATION = {"last_stage_blocks": 2, "headroom_blocks": 1, "chunk_tokens": 8, "timeout_s": 5}
WORDS = ["alpha", "beta", "gamma"]
# 16 items (~50 tokens): the migration test moves the answer at its 5th and 14th token, and the
# second move must find it still running (with 8 items it could finish first).
SCHEMA = {"type": "array", "items": {"enum": WORDS}, "minItems": 16, "maxItems": 16}
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=160, structured=StructuredSpec.json_schema(SCHEMA)
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    path = Path(save_tiny(tmp_path_factory, "tiny-structured", vocab_size=VOCAB))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def workers(tiny):
    cfg = {"model_dir": tiny, **ENGINE, "async_scheduling": True}
    p = PrefillWorker(cfg, "p")
    a = DecodeWorker(cfg, "a", transport="inproc", migration=MIGRATION)
    b = DecodeWorker(cfg, "b", transport="inproc", migration=MIGRATION)
    for w in (p, a, b):
        w.start()
    yield p, a, b
    for w in (p, a, b):
        w.shutdown()


@pytest.fixture(scope="module")
def colocated(tiny):
    return LLM(tiny, **ENGINE)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(3)
    return [rng.randrange(200, VOCAB) for _ in range(21)]


@pytest.fixture(scope="module")
def expected(colocated, prompt):
    out = colocated.generate([prompt], PARAMS)[0].outputs[0]
    assert out.finish_reason == "stop"
    check(out.text)
    assert len(out.token_ids) >= 30, out.token_ids  # room after the second move (at 14)
    return out.token_ids


def check(text: str) -> None:
    value = json.loads(text)
    assert len(value) == 16 and set(value) <= set(WORDS), text


def text_of(llm, tokens: list[int]) -> str:
    return llm.tokenizer.decode(tokens, skip_special_tokens=True)


async def start(p, d, rid, prompt, **kwargs) -> PrefillDone:
    res = await d.reserve(rid, prompt, PARAMS, rid, **kwargs)
    assert isinstance(res, Reserved)
    done = await p.prefill(rid, prompt, PARAMS, res.endpoint, **kwargs)
    assert isinstance(done, PrefillDone)
    return done


def idle(*workers) -> None:
    for w in workers:
        assert asyncio.run(w.check_idle()) is None


def test_1p1d_masks_the_first_token_on_the_prefill_worker(workers, colocated, prompt, expected):
    p, a, b = workers
    free = SamplingParams(temperature=0.0, max_tokens=1)
    unmasked = colocated.generate([prompt], free)[0].outputs[0].token_ids[0]
    bitmask = allocate_bitmask(1, VOCAB)
    colocated.engine.structured_outputs().matcher(PARAMS.structured).fill_bitmask(bitmask, 0)
    allowed = set(allowed_tokens(bitmask[0], VOCAB).tolist())
    assert unmasked not in allowed  # so an unmasked first draw would break the answer

    async def main():
        done = await start(p, a, "a1", prompt)
        client = Client({"a": a}, "a1")
        await client.run("a")
        return done, client

    done, client = asyncio.run(main())
    assert done.token.token_id in allowed and done.token.token_id == expected[0]
    assert client.tokens == expected and client.finish == "stop"
    check(text_of(colocated, client.tokens))
    idle(p, a)


def test_migrated_mid_answer_stays_valid_and_exact(workers, colocated, prompt, expected):
    p, a, b = workers
    named = {"a": a, "b": b}

    async def main():
        await start(p, a, "m1", prompt)
        client = Client(named, "m1")
        reader = asyncio.ensure_future(client.run("a"))
        results = []
        for at, (source, dest) in ((5, ("a", "b")), (14, ("b", "a"))):
            await wait_tokens(client, at)
            results.append(await named[source].migrate_out("m1", handle(named[dest]), dest))
        await reader
        return client, results

    client, results = asyncio.run(main())
    assert [r.outcome for r in results] == ["migrated", "migrated"], results
    assert client.moves == ["b", "a"]
    assert client.tokens == expected and client.finish == "stop"
    check(text_of(colocated, client.tokens))
    idle(p, a, b)


@pytest.mark.parametrize("cut", [1, 9])
def test_resumed_from_its_snapshot_stays_valid_and_exact(workers, colocated, prompt, expected, cut):
    p, a, b = workers
    head = expected[:cut]

    async def main():
        await start(p, b, f"r{cut}", prompt, output_token_ids=head)
        client = Client({"b": b}, f"r{cut}")
        client.tokens = list(head)  # (the router's snapshot: deltas start after it)
        await client.run("b")
        return client

    client = asyncio.run(main())
    assert client.tokens == expected and client.finish == "stop"
    check(text_of(colocated, client.tokens))
    idle(p, b)


def test_a_decode_worker_admits_when_its_compile_lands_and_never_stalls(
    workers, colocated, prompt, monkeypatch
):
    """The decode worker's compile (started at the reservation) outlasts the prefill: the
    request waits with its KV in, the engine thread is not blocked (a free request on the same
    worker runs to its end meanwhile), and it is admitted, exact, once the compile lands."""
    import threading

    from engine.grammar import Grammars
    from engine.request import RequestStatus

    p, a, b = workers
    spec = StructuredSpec.regex("[a-c]{12}")
    params = SamplingParams(temperature=0.0, max_tokens=20, structured=spec)
    expected = colocated.generate([prompt], params)[0].outputs[0].token_ids
    release, compile_once = threading.Event(), Grammars.compile

    def slow(self, s):
        if self is a.engine.structured_outputs() and s == spec:
            release.wait(60)
        return compile_once(self, s)

    monkeypatch.setattr(Grammars, "compile", slow)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        res = await a.reserve("slow", prompt, params, "slow")
        assert isinstance(res, Reserved)
        assert isinstance(await p.prefill("slow", prompt, params, res.endpoint), PrefillDone)
        res = await a.reserve("free", prompt[:7], free, "free")
        assert isinstance(await p.prefill("free", prompt[:7], free, res.endpoint), PrefillDone)
        other = Client({"a": a}, "free")
        await other.run("a")  # runs to its end while the compile is held
        held = a.engine._seq_owner["slow"][1].request
        assert held.status == RequestStatus.WAITING_FOR_REMOTE_KV and not release.is_set()
        release.set()
        client = Client({"a": a}, "slow")
        await client.run("a")
        return other, client

    other, client = asyncio.run(main())
    assert len(other.tokens) == 6 and other.finish == "length"
    assert client.tokens == expected and client.finish == "stop"
    idle(p, a)
