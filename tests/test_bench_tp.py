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

from benchmarks.gpu_serve import topology  # noqa: E402
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
    ],
)
def test_tensor_parallel_topologies(name, flags, gpus):
    assert topology(name) == (flags, gpus)


def test_unknown_topology_is_refused():
    with pytest.raises(SystemExit, match="unknown topology 'pd-p2'"):
        topology("pd-p2")
