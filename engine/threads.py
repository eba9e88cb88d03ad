"""Torch's CPU threads, per OS thread: one OpenMP team per process.

libgomp keeps a thread team per OS thread that runs a parallel region (torch runs one per
large CPU op). Once a process holds more OpenMP threads than it has cores, libgomp stops
spinning its idle workers between regions and puts them to sleep instead, so every op after
that pays a futex wake: a 135M model's decode step on 2 cores took 1.5x as long
(benchmarks/NOTES.md, "The CPU served gap, found"). The engine thread owns the process's
team; a helper thread that touches tensors (a KV channel's receiver, a migration's gather)
calls ``torch_single_threaded()`` first, so its ops run on it alone and add no team.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

logger = logging.getLogger(__name__)


@functools.cache
def _omp_set_num_threads():
    """libgomp's ``omp_set_num_threads`` as torch loaded it, or None (another runtime)."""
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")):
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    try:  # linked from the system's copy
        return ctypes.CDLL(None).omp_set_num_threads
    except AttributeError:
        logger.debug("no libgomp found: helper threads keep torch's thread count")
        return None


def torch_single_threaded() -> None:
    """From here on, the calling thread's torch CPU ops run on this thread alone (OpenMP's
    per-thread setting; the other threads keep theirs). For helper threads, never the engine
    thread. Does nothing where torch does not run on libgomp."""
    import torch

    fn = _omp_set_num_threads()
    if fn is None:
        return
    torch.get_num_threads()  # torch sets each thread's count on its first use: let it, first
    fn(1)
