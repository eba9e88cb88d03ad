"""Run a benchmark script with ``Fp8Linear``'s row limits (or ``fuse_norm_quant``) set: an A/B of
which FP8 kernel takes which batch sizes without editing the engine (engine/quant.py's
class-wide settings).

    PYTHONPATH=$PWD python benchmarks/fp8_rows_ab.py splitk_max_rows=64 \\
        benchmarks/gpu_async.py --quantization fp8 ...
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    from engine.quant import Fp8Linear

    args = sys.argv[1:]
    while args and "=" in args[0] and not args[0].startswith("-"):
        name, value = args.pop(0).split("=", 1)
        if not hasattr(Fp8Linear, name) or not (
            name.endswith("_max_rows") or name in ("fuse_norm_quant", "scaled_mm_row_multiple")
        ):
            raise SystemExit(f"Fp8Linear has no row limit or switch {name!r}")
        setattr(Fp8Linear, name, int(value))
    if not args:
        raise SystemExit(__doc__)
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
