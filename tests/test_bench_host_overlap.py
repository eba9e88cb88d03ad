"""benchmarks/gpu_host_overlap.py's reading of a GPU trace, without a GPU: the idle share and
the gaps in the middle steps, and each kernel's time per step."""

from __future__ import annotations

import pytest

from benchmarks.gpu_host_overlap import GAP_S, gpu_summary


def steps(n: int, wait_us: float) -> list[tuple[float, float, str]]:
    """``n`` steps of 100 us each: gemm 0-60, a 2 us launch gap, attn 62-80, then the next
    step's first kernel ``wait_us`` after a copy that ends at 100."""
    trace, t = [], 0.0
    for _ in range(n):
        trace += [(t, t + 60, "gemm"), (t + 62, t + 80, "attn"), (t + 80, t + 100, "copy")]
        t += 100 + wait_us
    return trace


def test_short_launch_gaps_are_not_waits_and_long_ones_are_named():
    wait = 2 * GAP_S * 1e6  # a wait twice the threshold, between steps
    got = gpu_summary(steps(10, wait), reps=10, top=5)
    assert got["gaps_per_step"] == pytest.approx(1.0, abs=0.2)  # one wait a step, not the 2 us
    assert got["gap_s_per_step"] == pytest.approx(wait / 1e6, rel=0.2)
    assert {g["before"] for g in got["largest_gaps"]} == {"copy"}
    assert {g["after"] for g in got["largest_gaps"]} == {"gemm"}
    assert got["gaps_by_next_kernel"][0]["next"] == "gemm"
    period = 100 + wait
    assert got["idle_share"] == pytest.approx((wait + 2) / period, rel=0.15)
    kernels = {k["name"]: k["s_per_step"] for k in got["kernels"]}
    assert kernels == pytest.approx({"gemm": 60e-6, "attn": 18e-6, "copy": 20e-6})


def test_a_gpu_that_never_waits_has_no_gaps():
    got = gpu_summary(steps(10, 0.0), reps=10, top=5)
    assert got["gaps_per_step"] == 0 and got["largest_gaps"] == []
    assert got["idle_share"] == pytest.approx(0.02, rel=0.2)  # the 2 us launch gaps only
    assert gpu_summary([], reps=10, top=5) == {}
