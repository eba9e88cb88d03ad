"""Paged decode attention on CPU: a C++ kernel (``paged_decode_attention.cpp``) and its
plain-torch reference.

The kernel is built with ``torch.utils.cpp_extension.load`` the first time it is needed (about
40-50 s on 2 cores, cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). When no
compiler or ninja is available, ``load_kernel()`` returns None and callers use the torch path.
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

import torch

SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
_NAME = "tandem_paged_decode_cpu"


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
                "tandem: compiling the native CPU decode kernel (once, about 40 s) ...",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        with _build_lock(build_dir):
            module = load(
                name=_NAME,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: fall back, say why
        print(f"tandem: CPU decode kernel unavailable ({exc}); using torch", file=sys.stderr)
        return None
    if not built:
        print(f"tandem: kernel built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
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


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [KVH, S, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel is not available here")
    return kernel.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, block_size, scale
    )


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    """Plain torch, one sequence at a time: the definition the kernel is tested against."""
    b, num_heads, head_dim = q.shape
    kvh = k_cache.shape[0]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(context_lens[i])
        pos = torch.arange(n)
        slots = block_tables[i, pos // block_size] * block_size + pos % block_size
        k = k_cache[:, slots].repeat_interleave(num_heads // kvh, dim=0)  # [H, n, D]
        v = v_cache[:, slots].repeat_interleave(num_heads // kvh, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), k.float()) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v.float()).to(q.dtype)
    return out
