"""Every KV head of given blocks on rank 0 of a tensor-parallel engine (CPU, gloo):
``read_kv_blocks`` gathers each rank's heads into the layout a one-device pool has, and
``write_kv_blocks`` scatters full-head KV back to the ranks' pools. Checked against a TP 1 engine
on the same prompt (KV heads split at TP 2, replicated at TP 4), by exact round trips, and a bad
call is refused on rank 0 before the other ranks hear of it (the group stays in step).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_tensor_parallel import _prompts, _save

from engine import LLM, SamplingParams
from engine.step_inputs import GatheredLayerHook

BS = 8
PROMPT_LEN = 27  # three full blocks and three tokens in a fourth


def _prefill(llm, prompt, max_tokens=8):
    """Start ``prompt`` and step until its prefill is done: (request id, its block table)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rid = engine.add_request(None, prompt, params)
    while engine.single_request(rid).num_computed_tokens < len(prompt):
        engine.step()
    engine.drain()
    table = list(engine.block_manager.block_table(rid))
    assert len(table) >= -(-len(prompt) // BS)
    return rid, table


def _finish(llm, rid):
    """Step ``rid`` to its end: its output tokens."""
    last = None
    while llm.engine.has_unfinished_requests():
        last = next((o for o in llm.engine.step() if o.request_id == rid), last)
    return last.outputs[0].token_ids


def _prompt_kv(llm, prompt, *layer_ranges):
    """The KV of ``prompt``'s blocks, every layer then each of ``layer_ranges``, read while its
    request runs (after its prefill); and its block table."""
    rid, table = _prefill(llm, prompt)
    try:
        reads = [llm.engine.runner.read_kv_blocks(table, r) for r in (None, *layer_ranges)]
        return table, *reads
    finally:
        llm.engine.abort_request(rid)
        llm.engine.drain()


def _check_same_kv(one, split, prompt_len):
    """Layer 0's K and V are the embedding's projections: exact under any split. Later layers
    read the row-parallel all-reduce's sums: fp32 rounding apart."""
    slots = prompt_len  # the slots past the prompt hold nothing written yet on either
    assert one.shape == split.shape
    torch.testing.assert_close(split[0, ..., :slots, :], one[0, ..., :slots, :], rtol=0, atol=0)
    torch.testing.assert_close(split[..., :slots, :], one[..., :slots, :], rtol=1e-5, atol=1e-5)
    assert one[..., :slots, :].abs().amax() > 0.1  # real KV, not an empty pool


@pytest.fixture(scope="module")
def llama8_path(tmp_path_factory):
    _, path = _save(
        tmp_path_factory, "llama8-kv", num_attention_heads=8, num_key_value_heads=8, hidden_size=128
    )
    return path


@pytest.fixture(scope="module")
def one(llama8_path):
    with LLM(llama8_path, block_size=BS, num_kv_blocks=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp2(llama8_path):
    with LLM(llama8_path, tensor_parallel_size=2, block_size=BS, num_kv_blocks=16) as llm:
        yield llm


def test_tp2_reads_the_same_kv_as_one_device(one, tp2):
    (prompt,) = _prompts([PROMPT_LEN], seed=11)
    _, kv1 = _prompt_kv(one, prompt)
    table, kv2, kv2_layer1 = _prompt_kv(tp2, prompt, range(1, 2))
    assert kv2.shape == (2, 2, 8, len(table) * BS, 16)  # layers, K/V, all 8 heads, slots, dim
    assert tp2.engine.runner.kv_caches[0].shape[1] == 4  # while each rank holds 4
    _check_same_kv(kv1, kv2, PROMPT_LEN)
    torch.testing.assert_close(kv2_layer1, kv2[1:], rtol=0, atol=0)
    # rank 0's own heads are its pool's, unchanged by the trip
    slots = [b * BS + i for b in table for i in range(BS)]
    local = tp2.engine.runner.kv_caches[1][:, :, slots]
    torch.testing.assert_close(kv2[1, :, :4], local, rtol=0, atol=0)


class _LayerCollector:
    """A step observer whose hook gathers every KV head of each step's new positions, per
    layer, as the prefill streamer's does."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []

    def begin_step(self, out):
        from engine.attention import slot_array

        slots = [
            slot_array(c.block_table, c.start, c.start + c.num_tokens, BS) for c in out.scheduled
        ]
        on_layer = lambda i, kv: self.calls.append((i, kv.clone()))  # noqa: E731
        return GatheredLayerHook(np.concatenate(slots), on_layer)

    def end_step(self, out, sampled) -> None:
        pass


def test_tp2_gathers_every_head_after_each_layer_as_one_device(one, tp2):
    """The prefill streamer's hook at TP 2: after each layer, in order, rank 0 gets all 8
    heads of the step's new positions, as one device's pool holds them."""
    (prompt,) = _prompts([PROMPT_LEN], seed=12)
    got = {}
    for name, llm in (("one", one), ("tp2", tp2)):
        collector = _LayerCollector()
        llm.engine.step_observer = collector
        try:
            rid, _ = _prefill(llm, prompt)
        finally:
            llm.engine.step_observer = None
            llm.engine.abort_request(rid)
            llm.engine.drain()
        steps = len(collector.calls) // 2
        assert [i for i, _ in collector.calls] == [0, 1] * steps  # each step: layer 0, then 1
        got[name] = [
            torch.cat([kv for i, kv in collector.calls if i == layer], dim=2) for layer in (0, 1)
        ]
    for layer in (0, 1):
        assert got["tp2"][layer].shape == (2, 8, PROMPT_LEN, 16)
        tol = 0 if layer == 0 else 1e-5  # (layer 0's KV is the embedding's projections: exact)
        torch.testing.assert_close(got["tp2"][layer], got["one"][layer], rtol=tol, atol=tol)
    assert got["one"][1].abs().amax() > 0.1


def _forget_cached(llm):
    """Written blocks must not be found as some prompt's cached prefix later."""
    assert llm.engine.block_manager.reset_prefix_cache()


@pytest.mark.parametrize("tp", [1, 2])
def test_write_then_read_round_trip(request, tp):
    """At TP 1 the same calls read and write the pool itself: one path for callers."""
    llm = request.getfixturevalue("one" if tp == 1 else "tp2")
    runner = llm.engine.runner
    _forget_cached(llm)
    blocks = [9, 2, 14]  # out of order: block i's KV goes to blocks[i]
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn((2, 2, 8, len(blocks) * BS, 16), generator=gen)
    runner.write_kv_blocks(blocks, kv)
    torch.testing.assert_close(runner.read_kv_blocks(blocks), kv, rtol=0, atol=0)
    # rank 0 holds heads 0 .. 8 / tp - 1 of it (at TP 2 heads 4..7 came back from rank 1)
    slots = [b * BS + i for b in blocks for i in range(BS)]
    assert runner.kv_caches[0].shape[1] == 8 // tp
    for layer in range(2):
        torch.testing.assert_close(
            runner.kv_caches[layer][:, :, slots], kv[layer, :, : 8 // tp], rtol=0, atol=0
        )
    # one block, one layer: its place in the blocks' KV, on the ranks that hold each head
    got = runner.read_kv_blocks([14], range(1, 2))
    torch.testing.assert_close(got, kv[1:, :, :, 2 * BS :], rtol=0, atol=0)
    # no blocks: nothing to move, nothing sent
    assert runner.read_kv_blocks([]).shape == (2, 2, 8, 0, 16)
    runner.write_kv_blocks([], kv[:, :, :, :0])
    # a write of one layer of one block leaves the rest as it was
    patch = torch.randn((1, 2, 8, BS, 16), generator=gen)
    runner.write_kv_blocks([2], patch, range(1, 2))
    expected = kv.clone()
    expected[1:, :, :, BS : 2 * BS] = patch
    torch.testing.assert_close(runner.read_kv_blocks(blocks), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda r: r.read_kv_blocks([0, 16]), ["[16] out of range", "0..15"]),
        (lambda r: r.read_kv_blocks([-1]), ["[-1] out of range"]),
        (lambda r: r.read_kv_blocks([1.5]), ["must be integers"]),
        (lambda r: r.read_kv_blocks([0], range(0, 3)), ["range(0, 2)", "range(0, 3)"]),
        (lambda r: r.read_kv_blocks([0], range(1, 1)), ["non-empty"]),
        (lambda r: r.write_kv_blocks([0], torch.zeros(2, 2, 4, BS, 16)), ["[2, 2, 8, 8, 16]"]),
        (
            lambda r: r.write_kv_blocks([0], torch.zeros(2, 2, 8, BS, 16, dtype=torch.bfloat16)),
            ["torch.float32", "got torch.bfloat16"],
        ),
        (lambda r: r.write_kv_blocks([3, 3], torch.zeros(2, 2, 8, 2 * BS, 16)), ["twice"]),
    ],
)
def test_bad_call_refused_before_anything_is_sent(tp2, monkeypatch, call, words):
    runner = tp2.engine.runner
    _forget_cached(tp2)
    sent = []
    real = runner.tp.broadcast_cpu
    monkeypatch.setattr(runner.tp, "broadcast_cpu", lambda x: sent.append(x) or real(x))
    with pytest.raises(ValueError) as err:
        call(runner)
    assert all(w in str(err.value) for w in words), err.value
    assert sent == []  # the other rank heard nothing: the group is still in step
    runner.write_kv_blocks([5], torch.ones(2, 2, 8, BS, 16))
    assert len(sent) == 2  # header, block ids
    assert bool((runner.read_kv_blocks([5]) == 1).all())


def test_kv_call_while_another_thread_sends_is_refused(tp2):
    """Rank 0 talks to the other ranks from one thread at a time (the engine thread): a KV call
    while another thread holds the group is refused before it sends anything."""
    runner = tp2.engine.runner
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with runner._group_turn():
            held.set()
            release.wait(30)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert held.wait(30)
        with pytest.raises(RuntimeError, match="must all come from the engine thread"):
            runner.read_kv_blocks([0])
    finally:
        release.set()
        other.join()
    assert runner.read_kv_blocks([0]).shape == (2, 2, 8, BS, 16)  # still in step


def test_tp2_steps_after_kv_calls_match_one_device(one, tp2):
    """KV calls between steps leave the ranks in step: generation goes on token-exact."""
    prompts = _prompts([5, 19], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    tp2.engine.runner.read_kv_blocks([0, 1])
    assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params)] == expected


def test_tp4_replicated_heads_read_once_written_to_each(tmp_path_factory):
    """2 KV heads at TP 4: ranks 0, 1 hold head 0 and ranks 2, 3 head 1. A read takes each
    head from one rank; a write reaches every rank holding it: a running request's KV zeroed
    and written back decodes the same tokens as on one device (a rank left with zeros would
    attend to them)."""
    _, path = _save(
        tmp_path_factory,
        "llama-kv2-kv",
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=128,
    )
    (prompt,) = _prompts([PROMPT_LEN], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(path, block_size=BS, num_kv_blocks=16) as one:
        _, kv1 = _prompt_kv(one, prompt)
        (expected,) = [o.outputs[0].token_ids for o in one.generate([prompt], params)]
    with LLM(path, tensor_parallel_size=4, block_size=BS, num_kv_blocks=16) as tp4:
        runner = tp4.engine.runner
        rid, table = _prefill(tp4, prompt)
        kv4 = runner.read_kv_blocks(table)
        assert kv4.shape == kv1.shape == (2, 2, 2, len(table) * BS, 16)
        _check_same_kv(kv1, kv4, PROMPT_LEN)
        runner.write_kv_blocks(table, torch.zeros_like(kv4))
        assert bool((runner.read_kv_blocks(table) == 0).all())
        runner.write_kv_blocks(table, kv4)
        assert _finish(tp4, rid) == expected


def test_tp2_fp8_pool_round_trip(llama8_path):
    """An fp8 KV pool moves as bytes (gloo has no fp8, torch lacks some fp8 kernels on CPU):
    written and read back bit for bit, and what the pool holds after a prompt's prefill comes
    back as rank 0's own heads hold it."""
    with LLM(
        llama8_path, tensor_parallel_size=2, block_size=BS, num_kv_blocks=16, kv_cache_dtype="fp8"
    ) as llm:
        runner = llm.engine.runner
        (prompt,) = _prompts([PROMPT_LEN], seed=13)
        table, kv = _prompt_kv(llm, prompt)
        assert kv.dtype == torch.float8_e4m3fn and kv.shape == (2, 2, 8, len(table) * BS, 16)
        slots = [b * BS + i for b in table for i in range(BS)]
        local = runner.kv_caches[0][:, :, slots].view(torch.uint8)
        assert torch.equal(kv[0, :, :4].view(torch.uint8), local)
        assert kv[..., :PROMPT_LEN, :].view(torch.uint8).any()
        _forget_cached(llm)
        gen = torch.Generator().manual_seed(3)
        data = torch.randn((2, 2, 8, 2 * BS, 16), generator=gen).to(torch.float8_e4m3fn)
        runner.write_kv_blocks([4, 11], data)
        assert torch.equal(runner.read_kv_blocks([4, 11]).view(torch.uint8), data.view(torch.uint8))
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            runner.write_kv_blocks([4, 11], data.float())
