"""Launching a Triton kernel without its dispatcher when it was launched alike before.

``fn[grid](*args, **kwargs)`` goes through Triton's JIT dispatch on every call: it specialises
each argument, builds a cache key, finds the compiled kernel and checks the globals it used.
On the GPU hosts that is 40-70 us a launch (benchmarks/NOTES.md), and a mixed prefill + decode
step launches its attention eagerly, three kernels a layer: ~100 launches, several ms of host
time in every such step. ``launch`` keeps the compiled kernel of each specialisation under a key
of its own and hands later calls with the same key straight to the compiled kernel's launcher
(what ``CompiledKernel.__getitem__`` does).

The key is at least as fine as Triton's specialisation, so a kernel is never reused where
Triton would have compiled another:

* a tensor: its dtype and whether its address is a multiple of 16 bytes;
* an int: whether it is 1, whether it is a multiple of 16, and whether it needs 64 bits (Triton
  also specialises no further for ``do_not_specialize`` arguments; the key does, which only
  costs a cache entry);
* a bool, a string, ``None``: the value; a float: its type only (passed as fp32);
* a TMA ``TensorDescriptor``: its base's dtype and alignment, block shape and padding;
* every keyword argument (constexprs and launch options) by value, and the device.

``TANDEM_FAST_LAUNCH=0`` (or ``ENABLED = False``) turns it off. Anything else (or Triton's
interpreter, or a launch hook set, as profilers do) takes the
ordinary path. The direct launch passes no hooks and no launch metadata (the ordinary one builds
the metadata and calls both empty hook chains on every launch). The first call of a key goes through Triton, which compiles or finds the kernel.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# TANDEM_FAST_LAUNCH=0: every launch through Triton's dispatch (A/B runs, bisecting)
ENABLED = os.environ.get("TANDEM_FAST_LAUNCH", "1").strip().lower() not in (
    "0",
    "false",
    "off",
    "no",
)
_I32 = 2**31

# (kernel, device, argument key, keyword arguments) -> (compiled kernel, the trailing
# arguments the keywords and defaults give, in the kernel's parameter order)
_COMPILED: dict[tuple, tuple] = {}


def _arg_key(a):
    kind = type(a)
    if kind is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if kind is bool or a is None or kind is str:
        return (kind, a)
    if kind is int:
        return (kind, a == 1, a % 16 == 0, -_I32 <= a < _I32)
    if kind is float:
        return kind
    if kind is TensorDescriptor:
        return (kind, a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.block_shape), a.padding)
    raise TypeError  # not a kind the key covers: the ordinary path


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps each as a chain, empty unless a profiler
    adds to it; its ordinary launch calls both chains and builds their metadata every time)."""
    runtime = knobs.runtime
    return any(
        h is not None and getattr(h, "calls", True)
        for h in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


def launch(fn, grid: tuple, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``: positional arguments for the kernel's leading
    parameters, keywords for the rest (constexprs) and for launch options (``num_warps``,
    ``launch_pdl``, ...)."""
    if _INTERPRET or not ENABLED or _hooked():
        return fn[grid](*args, **kwargs)
    try:
        key = (fn, torch.cuda.current_device(), tuple(map(_arg_key, args)), *kwargs.items())
        hit = _COMPILED.get(key)
    except TypeError:  # an argument the key does not cover, or an unhashable keyword
        return fn[grid](*args, **kwargs)
    if hit is None:
        compiled = fn[grid](*args, **kwargs)
        if getattr(compiled, "run", None) is not None:
            names = fn.arg_names[len(args) :]
            defaults = {p.name: p.default for p in fn.params}
            tail = tuple(kwargs[n] if n in kwargs else defaults[n] for n in names)
            _COMPILED[key] = (compiled, tail)
        return compiled
    compiled, tail = hit
    stream = torch._C._cuda_getCurrentRawStream(key[1])
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None,
                 None, None, *args, *tail)  # fmt: skip
    return compiled


def clear() -> None:
    """Forget every kept kernel (tests)."""
    _COMPILED.clear()


__all__ = ["clear", "launch"]
