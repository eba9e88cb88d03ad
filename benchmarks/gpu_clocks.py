"""The bf16 matmul rate in a burst and sustained, with the SM clock and power beside it.

Every "at the measured bf16 rate" floor of benchmarks/ divides by ``gpu_ceilings``'s rate: 20
back-to-back 8192^3 matmuls, about 30 ms of work, which a GPU runs at its boost clock. A serving
step runs back to back for minutes, and a GPU at its power limit lowers its clock. This script
measures the same matmul (and the mixed step's largest GEMM, 2304 x 4096 @ 4096 x 28672, with
weights of the engine's dummy scale) both ways: a burst, then ``--seconds`` of windows of
back-to-back calls, each window's rate beside the clock and power NVML reports at its end.

    PYTHONPATH=$PWD python benchmarks/gpu_clocks.py --out F [--seconds 10]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_ceilings import time_cuda  # noqa: E402


def nvml_reader():
    """A function returning (SM clock MHz, power W, temperature C), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no NVML bindings: nvidia-smi, or the rates alone
        return smi_reader

    def read():
        return (
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        )

    return read


def smi_reader():
    """(SM clock MHz, power W, temperature C) from nvidia-smi, or Nones without it."""
    import subprocess

    query = "--query-gpu=clocks.sm,power.draw,temperature.gpu"
    index = str(torch.cuda.current_device())
    try:
        line = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits", "-i", index],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        clock, power, temp = (float(v) for v in line.split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, None, None
    return int(clock), power, int(temp)


def windows(fn, flops: float, seconds: float, window: float, read) -> list[dict]:
    """Back-to-back calls of ``fn`` for ``seconds``: each ``window``'s rate, then NVML's."""
    calls = max(int(window / time_cuda(fn, 3)), 1)
    rows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        clock, power, temp = read()
        sec = start.elapsed_time(end) / 1e3
        rows.append(
            {
                "t_s": time.perf_counter() - t0,
                "tflops": flops * calls / sec / 1e12,
                "sm_clock_mhz": clock,
                "power_w": power,
                "temp_c": temp,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_clocks.json"))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--window", type=float, default=0.5, help="seconds a window")
    args = ap.parse_args(argv)
    read = nvml_reader()
    cases = {}
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    cases["8192^3, randn"] = (lambda: a @ b, 2 * n**3)
    x = torch.randn(2304, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    cases["2304 x 4096 @ 4096 x 28672, weights x 0.02"] = (
        lambda: torch.nn.functional.linear(x, w),
        2 * 2304 * 4096 * 28672,
    )
    result = {"benchmark": "gpu_clocks", "device": torch.cuda.get_device_name(), "cases": {}}
    print(f"{result['device']}")
    print("| GEMM | burst TFLOP/s (20 calls) | sustained, first window | last window | "
          "median | SM MHz (first, last) | W (last) |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name, (fn, flops) in cases.items():
        time.sleep(2)  # let the clock come back up between cases
        burst = flops / time_cuda(fn, 20) / 1e12
        rows = windows(fn, flops, args.seconds, args.window, read)
        med = statistics.median(r["tflops"] for r in rows)
        result["cases"][name] = {
            "burst_tflops": burst,
            "sustained_median_tflops": med,
            "windows": rows,
        }
        first, last = rows[0], rows[-1]
        print(f"| {name} | {burst:.0f} | {first['tflops']:.0f} | {last['tflops']:.0f} | {med:.0f} | "
              f"{first['sm_clock_mhz']}, {last['sm_clock_mhz']} | {last['power_w']} |")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
