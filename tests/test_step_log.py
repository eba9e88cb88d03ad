"""TANDEM_STEP_LOG (engine/tracing.py StepLog): one CSV line per engine step, read back by
benchmarks/step_log.py. The tiny model's steps are known from the scheduler's budget, so the
file's counts are checked against what the engine must have run."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hf_oracle import save_tiny

from engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_log import load, summarize  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory, "tiny-steplog")


def test_step_log_counts_every_step_and_token(tiny, tmp_path, monkeypatch):
    log = tmp_path / "steps-{pid}.csv"
    monkeypatch.setenv("TANDEM_STEP_LOG", str(log))
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # a 16-token budget: the 40-token prompt takes 3 chunks beside the others' decodes
    with LLM(tiny, block_size=4, max_num_batched_tokens=16, async_scheduling=False) as llm:
        llm.generate(prompts, params)
    (written,) = list(tmp_path.glob("steps-*.csv"))
    rows = load(written)
    s = summarize(rows)
    # every prompt token once, then 5 decodes per request (the 6th token ends it at sampling)
    assert s["prefill_tokens"] == 5 + 40 + 9
    assert s["decodes"] == 3 * 5
    assert s["tokens"] == 5 + 40 + 9 + 3 * 5
    assert s["preempted"] == 0
    assert max(r["tokens"] for r in rows) <= 16
    assert s["steps"] == len(rows) >= (5 + 40 + 9) // 16 + 5
    assert s["inside_s"] > 0 and s["span_s"] >= s["inside_s"] * 0.999
    kinds = s["kinds"]
    assert sum(k["steps"] for k in kinds.values()) == s["steps"]
    # decode-only steps ran 1-3 requests; the first steps carried prompt tokens
    assert {k.split("+")[0] for k in kinds} <= {"prefill", "1-1", "2-8"}, kinds
    assert "prefill" in {k.split("+")[0] for k in kinds} and "2-8" in kinds, kinds


def test_no_step_log_without_the_variable(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_STEP_LOG", raising=False)
    monkeypatch.chdir(tmp_path)
    with LLM(tiny, block_size=4) as llm:
        assert llm.engine._step_log is None
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    assert list(tmp_path.iterdir()) == []
