"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

Between two kernels on a stream the GPU normally drains the first (its last blocks finish, its
writes flush) before it starts launching the second: about a microsecond a kernel even inside
a CUDA graph. A batch-1 decode step of the Llama-3-8B shape runs ~350 kernels, so that is
~0.4 ms of a 6 ms step in which the GPU reads nothing (benchmarks/NOTES.md, "Every kernel
against its floor"). With PDL a kernel is launched while the one before it still runs::

    kernel A   [==== blocks ====]
    kernel B             [prefetch | wait ... | reads A's output ===]
                          ^ B's blocks start once every block of A has started
                            (``gdc_launch_dependents``), B's ``gdc_wait`` returns
                            when A has completed and its writes are visible

The rules every kernel launched this way keeps (``PDL`` is its constexpr switch):

- it calls ``gdc_wait()`` before reading anything an earlier kernel writes and before writing
  anything at all (an earlier kernel may still read the memory it would write: the caching
  allocator reuses buffers in stream order); before the wait it may only read memory no kernel
  of its own chain writes: weights, the step's inputs copied from the host before its first
  kernel, and KV cache rows of earlier steps (the decode attention's older tokens; a step's
  kernels chain only inside its graph, and a graph starts once the stream's earlier work is
  done);
- every program reaches the wait (none returns early before it), so the kernel cannot complete
  before the one it waits for: the next kernel's wait then covers both;
- it calls ``gdc_launch_dependents()`` first, which lets the next kernel's blocks start once
  all of this one's have started (never earlier: they cannot take the slots of its later
  waves).

Kernels of torch or cuBLAS in between are launched without PDL and serialise as always.
Captured in a CUDA graph, the launch attribute becomes a programmatic edge of the graph (CUDA
12.3+). ``TANDEM_PDL=0`` turns it off; Triton's interpreter (CPU tests) never uses it (the
wait is inline PTX), and neither do GPUs before compute capability 9.0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["enabled", "force", "gdc_launch_dependents", "gdc_wait", "launch_options", "start"]

_forced: bool | None = None
_by_device: dict[int, bool] = {}


def _supported(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    if os.environ.get("TANDEM_PDL", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (decided once per device)."""
    if _forced is not None:
        return _forced and device.type == "cuda"
    key = device.index if device.index is not None else -1
    on = _by_device.get(key)
    if on is None:
        on = _by_device[key] = _supported(device)
    return on


def force(on: bool | None) -> None:
    """Benchmarks: PDL on or off for every device (``None``: back to the default). Kernels
    already captured in CUDA graphs keep what they were captured with."""
    global _forced
    _forced = on


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a kernel launch adds: its ``PDL`` constexpr and, when on, Triton's
    ``launch_pdl`` (a variant of its own: warm-ups launch with the same options)."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first step under PDL: let the next kernel launch, then wait for the last one.
    Kernels that prefetch weights call the two halves themselves."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
