"""The NCCL KV transport without cupy: ``ClusterConfig`` refuses it at start-up, naming the
``gpu`` extras (pyproject.toml), and ``tandem serve`` says so in one line instead of a worker's
ImportError deep in Ray. Runs on CPU: cupy's absence is simulated."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import free_port

from cluster.launch.local import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
REAL_FIND_SPEC = importlib.util.find_spec

# Loaded at start-up by every Python given this folder on PYTHONPATH (the launcher and the
# `--detach` child alike): cupy looks absent whatever this machine has.
NO_CUPY_SITECUSTOMIZE = """\
import importlib.util as _util

_find_spec = _util.find_spec


def _no_cupy(name, package=None):
    return None if name == "cupy" or name.startswith("cupy.") else _find_spec(name, package)


_util.find_spec = _no_cupy
"""


@pytest.fixture
def cupy(monkeypatch):
    """Set ``cupy.present`` to say whether ``find_spec("cupy")`` finds it."""

    class State:
        present = False

    def find_spec(name, package=None):
        if name == "cupy":
            return importlib.machinery.ModuleSpec("cupy", None) if State.present else None
        return REAL_FIND_SPEC(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return State


def test_disaggregated_cuda_without_cupy_names_the_extra(cupy):
    with pytest.raises(ValueError, match=r"needs cupy") as err:
        ClusterConfig(device="cuda", num_prefill=1, num_decode=1)
    message = str(err.value)
    assert '".[gpu]"' in message and '".[gpu-cu12]"' in message
    assert "--colocated" in message and "--transport tcp" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"needs cupy"):  # asked for by name, on its own
        ClusterConfig(device="cuda", num_prefill=1, num_decode=1, transport="nccl")


def test_what_needs_no_cupy(cupy):
    # colocated workers move no KV between workers; TCP needs no cupy; a joined cluster's
    # workers run on its nodes, with their own Python (deploy/scripts/setup-node.sh adds cupy)
    assert ClusterConfig(device="cuda", num_prefill=0, num_decode=0, num_colocated=1)
    assert ClusterConfig(device="cuda", transport="tcp").transport == "tcp"
    assert ClusterConfig(device="cuda", ray_address="auto").transport == "nccl"
    assert ClusterConfig(device="cpu").transport == "tcp"
    cupy.present = True
    assert ClusterConfig(device="cuda").transport == "nccl"


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detach"])
def test_tandem_serve_says_it_in_one_line(tmp_path, detach):
    """``tandem serve`` on CUDA with prefill and decode workers and no cupy: exit 2 and one
    ``tandem: error:`` line, no traceback (with --detach, from the background server's log)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_CUPY_SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "TANDEM_CACHE_DIR": str(tmp_path / "cache"),
    }
    for name in ("TANDEM_API_KEY", "TANDEM_ADMIN_KEY", "TANDEM_REDIS_URL"):
        env.pop(name, None)
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--device", "cuda"]
    cmd += ["--prefill", "1", "--decode", "1", "--port", str(port), "--no-operator"]
    if detach:
        cmd.append("--detach")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == (1 if detach else 2), out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("tandem: error:")]
    assert len(errors) == 1 and "needs cupy" in errors[0] and '".[gpu]"' in errors[0], out
    assert "started redis-server" not in out and "starting " not in out, out  # nothing started
    if detach:
        assert "the server exited (2)" in out, out
        assert not (tmp_path / "cache" / "run" / f"serve-{port}.pid").exists()
