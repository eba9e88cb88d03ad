"""benchmarks/gpu_structured.py's smoke mode: the whole run (compiles, the free and the
constrained batch, table, JSON, plot) on a tiny random model with SmolLM2's tokenizer, on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_oracle import save_tiny

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("llguidance")
pytest.importorskip("matplotlib")


def test_smoke_on_cpu(tmp_path_factory, smollm2_dir, tmp_path):
    model = Path(save_tiny(tmp_path_factory, "tiny-structured", vocab_size=49152))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / name, model / name)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_structured.py"), "--device", "cpu"]
        + ["--model", str(model), "--batch", "3", "--steps", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        # this PATH, not a bare one: another ninja than the suite's rebuilds the CPU kernels (a
        # minute on 2 cores), since ninja versions do not share their build logs
        env={"PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"], "HOME": str(Path.home())},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "gpu_structured.json").read_text())
    assert len(result["compiles"]) >= 50 and all(c["allowed"] >= 1 for c in result["compiles"])
    assert result["constrained"]["grammar_errors"] == 0
    assert result["constrained"]["mask_s_per_step"] > 0 and result["free"]["mask_s_per_step"] == 0
    assert result["constrained"]["running_at_end"] == 3  # no answer ended inside the window
    assert "constrained / free ITL" in run.stdout and (out / "gpu_structured.png").is_file()
