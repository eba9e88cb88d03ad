"""benchmarks/gpu_fp8_weights.py's CPU-testable parts: its flags, the big model's size (it must
not serve from one H100 in bf16, and must in fp8), and the weights floor's byte count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_fp8_weights import (  # noqa: E402
    big_config,
    median_run,
    spread,
    weights_read_per_step,
)
from engine.config import ModelConfig  # noqa: E402
from engine.models import model_class  # noqa: E402
from engine.quant import quantize_model  # noqa: E402


def test_help_runs_without_a_gpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_fp8_weights.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--big" in out and "--ppl-model" in out and "--num-requests" in out
    assert "--repeats" in out


def test_repeated_throughput_reports_the_median_run_and_the_spread():
    runs = [{"output_tok_s": v, "seconds": i} for i, v in enumerate([13217.0, 11834.0, 12990.0])]
    assert median_run(runs) is runs[2]  # a real run, not an average
    assert median_run(runs[:2]) is runs[1]  # even count: the lower middle
    assert median_run(runs[:1]) is runs[0]
    r = {"throughput": median_run(runs), "throughput_runs": runs}
    assert spread(r) == "12990 (11834-13217)"
    assert spread({"throughput": runs[0]}) == "13217"
    assert spread({}) == "-"


def _params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of the four projections, all parameters) of a config, by arithmetic."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    proj = cfg.num_layers * (proj + 3 * h * cfg.intermediate_size)
    return proj, proj + 2 * cfg.vocab_size * h


def test_the_big_model_serves_from_an_h100_in_fp8_only():
    cfg = ModelConfig.from_dict(big_config(40))
    proj, total = _params(cfg)
    budget = 0.9 * 79.2 * 2**30  # an H100's memory at utilization 0.9
    assert 2 * total > 0.93 * budget  # bf16: the weights alone leave under 7 % for KV
    fp8 = proj + 2 * (total - proj)
    assert fp8 < 0.6 * budget


def test_floor_counts_every_weight_a_decode_step_reads():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    model = model_class(cfg)(cfg, 32).to(torch.bfloat16)
    total, read = weights_read_per_step(model)
    assert total - read == 256 * 64 * 2  # the embedding: a step reads one row of it
    quantize_model(model, torch.device("cpu"))
    _, read8 = weights_read_per_step(model)
    proj, _ = _params(cfg)
    scales = 4 * cfg.num_layers * (128 + 64 + 256 + 64)  # a float32 per output channel
    assert read - read8 == proj - scales  # 1 byte a weight, not 2
