"""benchmarks/gpu_kv_tiers.py's plan: the multi-turn run's working set against the pool,
estimated before a GPU is taken (issue 25's aim wants at least 4x)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_kv_tiers import plan, serve  # noqa: E402


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(
        out=str(tmp_path), users=320, conversations=640, offset=0, pool_blocks=4096,
        max_output=256, max_context=7500, min_working_set=0.0, plan_only=True,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_plan_estimates_the_measured_run(tmp_path):
    """The 320-user run measured a 3.3x peak: the mid estimate is below it (a lower
    estimate), the high one (every user at its conversation's end) above."""
    p = plan(_args(tmp_path))
    assert p["conversations"] == 640 and p["pool_tokens"] == 4096 * 16
    assert 2.3 < p["mid_over_pool"] < 3.3 < p["high_over_pool"]
    assert p["high_tokens"] == pytest.approx(2 * p["mid_tokens"])
    # answers cut shorter and a bigger pool: a smaller share
    small = plan(_args(tmp_path, max_output=32, pool_blocks=8192))
    assert small["mid_over_pool"] < p["mid_over_pool"] / 2
    other = plan(_args(tmp_path, offset=1000))
    assert other["mean_final_context"] != p["mean_final_context"]


def test_serve_refuses_a_run_sized_under_the_working_set_asked(tmp_path):
    args = _args(tmp_path, plan_only=False, min_working_set=4.0, model="unused", variants="off")
    with pytest.raises(SystemExit, match="under --min-working-set 4"):
        serve(args)  # before any server starts
    assert (tmp_path / "plan.json").exists()
