"""benchmarks/gpu_kv_fp8.py's CPU-testable parts: its flags, the ShareGPT samples, and the
teacher-forced scoring of answers, which must equal transformers' log-softmax over the whole
sequence (fp32, the model's own KV) before it says anything about fp8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_oracle import save_tiny

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_kv_fp8  # noqa: E402
from benchmarks.gpu_kv_fp8 import Sample, answer_logprobs  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_help_runs_without_a_gpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_kv_fp8.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--ppl-model" in out and "--ppl-data" in out and "--out" in out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-bench-fp8")


def test_answer_scores_equal_transformers_log_softmax(tiny):
    """Prefill then one decode step per answer token, in batches of mixed lengths, against one
    transformers forward over prompt + answer."""
    from engine import LLM

    samples = [
        Sample([3, 17, 40, 2, 9], [11, 12, 13, 14, 15, 16, 17, 18]),
        Sample(list(range(20, 53)), [5, 6, 7]),
        Sample([100] * 18, list(range(200, 221))),
    ]
    llm = LLM(tiny, num_kv_blocks=24, enforce_eager=True, block_size=4)  # 4 + 9 + 10 used
    got = answer_logprobs(llm.engine.runner, samples)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for s, scores in zip(samples, got, strict=True):
        ids = torch.tensor([s.prompt + s.answer])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        rows = range(len(s.prompt) - 1, len(s.prompt) + len(s.answer) - 1)
        want = [float(logp[r, ids[0, r + 1]]) for r in rows]
        assert scores == pytest.approx(want, abs=2e-4)
    with pytest.raises(ValueError, match="6 samples need 46 blocks"):
        answer_logprobs(llm.engine.runner, samples * 2)


class ChatTokenizer:
    """Enough of a tokenizer for ``sharegpt_samples``: a template that wraps the question, and
    one token per character."""

    chat_template = "yes"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        return [1] + [ord(c) for c in messages[0]["content"]] + [2]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_sharegpt_samples_from_a_file(tmp_path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello there"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "x" * 50},
                {"from": "gpt", "value": "y" * 20},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "no question first"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "short"}]},
        {"conversations": [{"from": "human", "value": "why"}, {"from": "gpt", "value": "z" * 30}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations)[:-40])  # cut off, as the packaged file is
    samples = gpu_kv_fp8.sharegpt_samples(ChatTokenizer(), str(path), 5, 20, 10)
    assert [(len(s.prompt), len(s.answer)) for s in samples] == [(4, 10)]  # the others: filtered
    assert samples[0].prompt == [1, ord("h"), ord("i"), 2]


def test_summary_ratios():
    def run(blocks, step, kernel, ppl):
        speed = {
            "num_kv_blocks": blocks,
            "decode_step_graph_s": step,
            "decode_step_eager_s": 2 * step,
            "kernel": [{"batch": 256, "context": 512, "s": kernel, "kv_bytes": 1}],
        }
        return {"speed": speed, "ppl": {"ppl": ppl, "tokens": 10}}

    ratios = gpu_kv_fp8.summary(
        {"auto": run(100, 0.02, 1e-4, 5.0), "fp8": run(200, 0.019, 6e-5, 5.02)}
    )
    assert ratios["blocks_ratio"] == 2.0
    assert ratios["decode_step_graph_s_ratio"] == pytest.approx(0.95)
    assert ratios["kernel_ratios"][0]["ratio"] == pytest.approx(0.6)
    assert ratios["ppl_ratio"] == pytest.approx(1.004)
