"""benchmarks/gpu_tp.py's and gpu_serve.py's tensor-parallel parts that run without GPUs: the
floor arithmetic (rank 0's weights over the HBM rate plus the step's all-reduces) and the
``pd-p<P>d<D>`` / ``two-tp<T>`` topologies' flags and GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_serve import goodput_tables, topology, topology_label  # noqa: E402
from benchmarks.gpu_tp import with_floors  # noqa: E402


def test_floor_is_rank_weights_plus_all_reduces():
    runs = {
        "1": {"tp": 1, "hidden_size": 4096, "num_layers": 32, "rank_weight_bytes_read_per_step": 15e9, "itl_s": 6e-3},
        "2": {"tp": 2, "hidden_size": 4096, "num_layers": 32, "rank_weight_bytes_read_per_step": 7.5e9, "itl_s": 4e-3},
    }  # fmt: skip
    with_floors(runs, hbm=3e12, latencies={2: 10e-6}, nvlink=450e9)
    one, two = runs["1"], runs["2"]
    assert one["floor_s"] == pytest.approx(5e-3) and one["allreduce_s"] == 0
    assert two["weights_floor_s"] == pytest.approx(2.5e-3)
    assert two["allreduce_s"] == pytest.approx(65 * 10e-6)  # 2 a layer and the embedding's
    # at NVLink's rate: each GPU sends 2 (T - 1) / T of the [1, 4096] bf16 tensor per all-reduce
    assert two["allreduce_rate_s"] == pytest.approx(65 * 8192 / 450e9)
    assert two["itl_over_floor"] == pytest.approx(4e-3 / (2.5e-3 + 65e-5))


@pytest.mark.parametrize(
    "name, flags, gpus",
    [
        ("pd", ["--prefill", "1", "--decode", "1"], "0,1"),
        (
            "pd-p2d1",
            ["--prefill", "1", "--decode", "1"]
            + ["--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"],
            "0,1,2",
        ),
        ("two-tp4", ["--colocated", "2", "--tensor-parallel-size", "4"], "0,1,2,3,4,5,6,7"),
        ("one-tp2", ["--colocated", "1", "--tensor-parallel-size", "2"], "0,1"),
        ("2p1d", ["--prefill", "2", "--decode", "1"], "0,1,2"),
        ("3col", ["--colocated", "3"], "0,1,2"),
    ],
)
def test_tensor_parallel_topologies(name, flags, gpus):
    assert topology(name) == (flags, gpus)


def test_unknown_topology_is_refused():
    with pytest.raises(SystemExit, match="unknown topology 'pd-p2'"):
        topology("pd-p2")


@pytest.mark.parametrize(
    "name, label",
    [("pd", "1P1D"), ("two", "2 colocated"), ("pd-p2d1", "1P(TP 2) + 1D(TP 1)"),
     ("two-tp4", "2 colocated at TP 4"), ("2p1d", "2P1D"), ("3col", "3 colocated")],
)  # fmt: skip
def test_topology_labels(name, label):
    assert topology_label(name) == label


def _rate_run(rate: float, ttft: float, tail_ms: float | None) -> dict:
    """A finished run at ``rate``: 10 requests, all with first token after ``ttft`` s."""
    recs = [
        dict(prompt_len=8, output_len=4, success=True, status=200, start=i / rate,
             end=i / rate + ttft + 0.03, ttft=ttft, latency=ttft + 0.03, itl=[0.01] * 3,
             output_tokens=4)
        for i in range(10)
    ]  # fmt: skip
    run = {"offered_rate": rate, "request_throughput": rate, "requests": recs}
    run["mean_ttft_ms"] = 1e3 * ttft
    if tail_ms is not None:
        run["kv_tail_ms_mean"] = tail_ms
    return run


def test_goodput_tables_take_every_topology_with_its_gpus_and_kv_tail():
    """TP topologies get their own rows (found from the run labels), goodput per GPU over the
    topology's own GPU count, and P/D rows the stream's exposed tail against TTFT."""
    runs = {
        # 1P(TP 2) + 1D(TP 2): 4 GPUs; meets the chat SLO (500 ms) at 2 and 4 req/s, not at 8
        "pd-p2d2-sharegpt-rates": [_rate_run(2, 0.2, 20.0), _rate_run(4, 0.4, 40.0),
                                   _rate_run(8, 0.9, 50.0)],
        "pd-p2d2-sharegpt-inf": [_rate_run(10, 1.0, 50.0)],
        "two-tp2-sharegpt-rates": [_rate_run(2, 0.2, None), _rate_run(4, 0.9, None)],
        "two-tp2-sharegpt-inf": [_rate_run(6, 1.0, None)],
    }  # fmt: skip
    lines, out = goodput_tables(runs)
    rows = out["sharegpt/chat"]
    assert list(rows) == ["2 colocated at TP 2", "1P(TP 2) + 1D(TP 2)"]
    pd = rows["1P(TP 2) + 1D(TP 2)"]
    assert pd["gpus"] == 4 and pd["goodput"]["measured"] == 4
    assert pd["kv_tail_ms"] == [20.0, 40.0, 50.0, 50.0]
    assert pd["kv_tail_share"] == pytest.approx([0.1, 0.1, 50 / 900, 0.05])
    assert "kv_tail_ms" not in rows["2 colocated at TP 2"]
    row = next(x for x in lines if x.startswith("| 1P(TP 2)"))
    assert "| 4 |" in row and "20.0-50.0 (5.0%-10.0%)" in row
    assert f"| {pd['goodput']['interpolated'] / 4:.2f} |" in row
