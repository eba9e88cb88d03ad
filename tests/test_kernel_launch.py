"""kernels/launch.py on CPU, with a stand-in for a Triton kernel (the real path runs on a GPU:
tests/gpu/test_kernel_launch_gpu.py): which calls go through the JIT and which straight to the
compiled kernel, with what arguments, and what the key tells apart."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import launch as launch_mod


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name, self.default = p.name, p.default


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("fast", (gx, gy, gz), stream, args))


class _Kernel:
    """Stands in for a ``JITFunction``: ``kernel[grid](*args, **kwargs)`` records a JIT call."""

    def __init__(self, fn):
        params = list(inspect.signature(fn).parameters.values())
        self.params = [_Param(p) for p in params]
        self.arg_names = [p.name for p in params]
        self.log: list = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled

        return jit


def _kernel(x_ptr, y_ptr, n, scale, BLOCK=16, FLAG=False):  # the parameters only
    raise AssertionError("never run")


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(launch_mod, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    launch_mod.clear()
    yield
    launch_mod.clear()


def test_a_second_call_alike_goes_straight_to_the_compiled_kernel(fake_cuda):
    k = _Kernel(_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    launch_mod.launch(k, (4,), x, y, 64, 0.5, BLOCK=32, num_warps=4)
    launch_mod.launch(k, (8, 2), y, x, 48, 0.25, BLOCK=32, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "fast"]
    _, grid, stream, args = k.log[1]
    assert grid == (8, 2, 1) and stream == 1234
    # the new call's arguments, then the keywords and defaults in the kernel's order
    assert args[:4] == (y, x, 48, 0.25) and args[4:] == (32, False)


@pytest.mark.parametrize(
    "change",
    [
        "misaligned tensor",
        "other dtype",
        "int equal to 1",
        "int not a multiple of 16",
        "int past 32 bits",
        "other constexpr",
        "other launch option",
        "bool flipped",
    ],
)
def test_what_triton_would_specialise_on_goes_through_the_jit_again(fake_cuda, change):
    k = _Kernel(_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    base = dict(args=[x, y, 64, 0.5], kwargs={"BLOCK": 32, "num_warps": 4})
    launch_mod.launch(k, (1,), *base["args"], **base["kwargs"])
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "misaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "other dtype":
        args[1] = torch.zeros(64, dtype=torch.float16)
    elif change == "int equal to 1":
        args[2] = 1
    elif change == "int not a multiple of 16":
        args[2] = 63
    elif change == "int past 32 bits":
        args[2] = 2**31 + 16
    elif change == "other constexpr":
        kwargs["BLOCK"] = 64
    elif change == "other launch option":
        kwargs["num_warps"] = 8
    elif change == "bool flipped":
        kwargs["FLAG"] = True
    launch_mod.launch(k, (1,), *args, **kwargs)
    assert [e[0] for e in k.log] == ["jit", "jit"]
    launch_mod.launch(k, (1,), *args, **kwargs)  # and that key is kept in turn
    assert [e[0] for e in k.log] == ["jit", "jit", "fast"]


def test_a_float_argument_is_not_part_of_the_key(fake_cuda):
    k = _Kernel(_kernel)
    x = torch.zeros(64)
    launch_mod.launch(k, (1,), x, x, 64, 0.5)
    launch_mod.launch(k, (1,), x, x, 64, 3.0)
    assert [e[0] for e in k.log] == ["jit", "fast"]


def test_an_argument_the_key_does_not_cover_takes_the_jit_every_time(fake_cuda):
    k = _Kernel(_kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch_mod.launch(k, (1,), x, x, 64, [0.5])  # a list: not a kind the key knows
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_under_the_interpreter_every_call_is_the_ordinary_launch(fake_cuda, monkeypatch):
    monkeypatch.setattr(launch_mod, "_INTERPRET", True)
    k = _Kernel(_kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch_mod.launch(k, (1,), x, x, 64, 0.5)
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_a_launch_hook_or_the_switch_off_takes_the_ordinary_path(fake_cuda, monkeypatch):
    from triton import knobs

    k = _Kernel(_kernel)
    x = torch.zeros(64)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            launch_mod.launch(k, (1,), x, x, 64, 0.5)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert [e[0] for e in k.log] == ["jit", "jit"]
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    launch_mod.launch(k, (1,), x, x, 64, 0.5)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit"]
    monkeypatch.setattr(launch_mod, "ENABLED", True)
    launch_mod.launch(k, (1,), x, x, 64, 0.5)
    launch_mod.launch(k, (1,), x, x, 64, 0.5)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit", "jit", "fast"]
