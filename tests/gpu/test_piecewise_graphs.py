"""Piecewise CUDA graphs (engine/cuda_graphs.py ``PiecewiseGraphs``) on a GPU; skipped without one.

    python -m pytest -q tests/gpu/test_piecewise_graphs.py

A random tiny Llama in bf16 on a mixed workload (chunked prefill beside decodes, decode batches
above the decode graphs' largest bucket): the engine with piecewise graphs must give the same
greedy token ids as the eager engine. Both run the same kernels on the real rows; the graphs
only add padded rows, which the dense layers keep to themselves. The length probe's hidden states
and the KV streamer's per-layer hook must work under the graphs too.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hf_oracle import GPU_TINY, save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

transformers = pytest.importorskip("transformers")

ENGINE = dict(
    dtype="bfloat16",
    device="cuda",
    num_kv_blocks=512,
    max_num_batched_tokens=96,  # chunks of prompts share steps with decodes
    max_num_seqs=16,
    cuda_graph_max_batch=4,  # decode batches of 5..16 go through the piecewise graphs
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory, "tiny-piecewise", **GPU_TINY)
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 200))] for _ in range(14)]
    params_kw = [dict(max_tokens=4 + 3 * i) for i in range(14)]
    return path, prompts, params_kw


def make_llm(path, **overrides):
    from engine import LLM

    return LLM(str(path), **{**ENGINE, **overrides})


def generate(llm, prompts, params_kw):
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, **kw) for kw in params_kw]
    outs = llm.generate(prompts, params)
    llm.engine.block_manager.check_invariant(expect_idle=True)
    return [o.outputs[0].token_ids for o in outs]


def count_piecewise_steps(llm) -> dict:
    """Wrap the runner's piecewise forward; returns {bucket tokens or step kind: steps}."""
    pw = llm.engine.runner.piecewise
    seen: dict = {}
    inner = pw.forward

    def forward(input_ids, positions, meta, *args, **kwargs):
        bucket = next(s for s in pw.sizes if s >= len(input_ids))
        seen[bucket] = seen.get(bucket, 0) + 1
        kind = "decode" if meta.num_decodes == len(input_ids) else "prefill"
        seen[kind] = seen.get(kind, 0) + 1
        return inner(input_ids, positions, meta, *args, **kwargs)

    pw.forward = forward
    return seen


def test_piecewise_greedy_equals_eager_bf16(tiny):
    path, prompts, params_kw = tiny
    eager = generate(make_llm(path, enforce_eager=True), prompts, params_kw)
    llm = make_llm(path)
    runner = llm.engine.runner
    assert runner.piecewise is not None and runner.piecewise.max_tokens == 96
    assert runner.piecewise.capture_s > 0 and runner.piecewise.memory_bytes >= 0
    seen = count_piecewise_steps(llm)
    graphed = generate(llm, prompts, params_kw)
    assert graphed == eager
    assert seen["decode"] and seen["prefill"] and len(seen) >= 4, seen  # 2+ buckets


def test_piecewise_off_runs_eagerly(tiny):
    path, prompts, params_kw = tiny
    llm = make_llm(path, cuda_graph_max_tokens=0)
    assert llm.engine.runner.piecewise is None and llm.engine.runner.graphs is not None
    generate(llm, prompts[:3], params_kw[:3])


def test_prompt_hidden_under_piecewise_equals_eager(tiny):
    """The length probe's input: each layer's output at the prompt's last token."""
    path, prompts, params_kw = tiny
    from engine import SamplingParams

    layers = (0, 2, 3, -1)
    hidden, seen = [], None
    for eager in (True, False):
        llm = make_llm(path, enforce_eager=eager, prompt_hidden_layers=layers)
        if not eager:
            seen = count_piecewise_steps(llm)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        outs = llm.generate(prompts, params)
        hidden.append([o.prompt_hidden for o in outs])
    assert seen
    for a, b in zip(*hidden, strict=True):
        assert sorted(a) == sorted(b) == sorted(layers)
        for layer in layers:
            assert (a[layer] == b[layer]).all(), layer


class _Recorder:
    """A StepObserver like the prefill worker's KV streamer: at hook(i) it copies layer i's KV at
    the step's new slots (queued on the stream, as the streamer's gather is)."""

    def __init__(self, kv_caches, block_size):
        self.kv_caches, self.block_size = kv_caches, block_size
        self.calls: list[list[int]] = []
        self.mismatches = 0

    def begin_step(self, out):
        from engine.attention import host_to_device, slot_array

        slots = np.concatenate(
            [
                slot_array(c.block_table, c.start, c.start + c.num_tokens, self.block_size)
                for c in out.scheduled
            ]
        )
        index = host_to_device(slots, self.kv_caches[0].device)
        calls: list[int] = []
        self.calls.append(calls)
        self.sent: list[torch.Tensor] = []

        def hook(layer: int) -> None:
            calls.append(layer)
            self.sent.append(self.kv_caches[layer].index_select(2, index))

        self._index = index
        return hook

    def end_step(self, out, sampled) -> None:
        for layer, sent in enumerate(self.sent):
            if not torch.equal(sent, self.kv_caches[layer].index_select(2, self._index)):
                self.mismatches += 1


def test_layer_hook_under_piecewise(tiny):
    """Every layer's hook runs once per step, in order, after that layer's KV is written."""
    path, prompts, params_kw = tiny
    eager = generate(make_llm(path, enforce_eager=True), prompts[:6], params_kw[:6])
    llm = make_llm(path)
    seen = count_piecewise_steps(llm)
    runner = llm.engine.runner
    recorder = _Recorder(runner.kv_caches, runner.cfg.block_size)
    llm.engine.step_observer = recorder
    assert generate(llm, prompts[:6], params_kw[:6]) == eager
    assert seen and recorder.calls
    layers = list(range(runner.model_cfg.num_layers))
    assert all(c == layers for c in recorder.calls)
    assert recorder.mismatches == 0
