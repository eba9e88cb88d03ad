"""The native CPU kernels as one torch extension: paged decode attention
(``paged_decode_attention.cpp``), causal prefill attention (``prefill_attention.cpp``) and the
decoder's fused elementwise layers (``fused_ops.cpp``), bound in ``bindings.cpp``; all use the
vector ``exp`` of ``vec_exp.h`` (a header change rebuilds them too: torch's loader runs ninja,
which follows the includes).

It is built with ``torch.utils.cpp_extension.load`` the first time it is needed (about a minute
on 2 cores, cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). When
no compiler or ninja is available, or ``TANDEM_DISABLE_CPU_KERNELS`` is set, ``load_kernel()``
returns None and callers use plain torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / name
    for name in (
        "paged_decode_attention.cpp",
        "prefill_attention.cpp",
        "fused_ops.cpp",
        "bindings.cpp",
    )
]
_NAME = "tandem_cpu_kernels"
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the rotary rounds
# each product and sum as torch does (bit-identical to engine/ops.py's TorchOps)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def load_kernel():
    """The compiled module, or None when it cannot be built here (logged once)."""
    if os.environ.get("TANDEM_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = Path(_get_build_directory(_NAME, verbose=False))
        built = (build_dir / f"{_NAME}.so").exists()
        if not built:
            print(
                "tandem: compiling the native CPU kernels (once, about a minute) ...",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        with _build_lock(build_dir):
            module = load(
                name=_NAME,
                sources=[str(s) for s in SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: fall back, say why
        print(f"tandem: native CPU kernels unavailable ({exc}); using torch", file=sys.stderr)
        return None
    if not built:
        print(f"tandem: kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One loader of the kernel at a time, under an ``flock`` the kernel releases when its
    holder dies. torch's own lock (a ``lock`` file in the build folder, taken even to load a
    finished build) outlives a process killed while building, and every later process waited
    on it forever; holding this lock, a ``lock`` file there can only be such a leftover."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tandem.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
