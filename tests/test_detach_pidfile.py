"""``tandem stop`` and ``serve --detach`` trust a pid file only while its process is a tandem server:
a pid file outlives a crash or a reboot, and its pid may since name another process."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest

from cluster.launch import serve

SLEEPER = "import time; time.sleep(60)"


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    return tmp_path / "run"


def stop_args(port: int) -> argparse.Namespace:
    return argparse.Namespace(port=port, timeout=10.0, kill_after=5.0)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(*argv: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", SLEEPER, *argv]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_pid_file_naming_another_process_is_not_signalled(run_dir, spawn, capsys):
    other = spawn("not", "ours")  # alive, but no tandem server
    _, pid_path = serve._run_files(8123)
    pid_path.write_text(str(other.pid))
    assert serve.detached_pid(pid_path) is None
    assert serve.run_stop(stop_args(8123)) == 1
    assert other.poll() is None  # untouched
    assert not pid_path.exists()
    assert "no tandem server now" in capsys.readouterr().err


def test_a_pid_file_of_a_dead_process_is_removed(run_dir, spawn, capsys):
    gone = spawn("cluster.cli", "serve")
    gone.kill()
    gone.wait()
    _, pid_path = serve._run_files(8124)
    pid_path.write_text(str(gone.pid))
    assert serve.run_stop(stop_args(8124)) == 1
    assert not pid_path.exists()
    assert "no detached server on port 8124" in capsys.readouterr().err


def test_a_live_server_is_found_and_stopped(run_dir, spawn, capsys):
    server = spawn("cluster.cli", "serve", "--port", "8125")  # a serve child's command line
    _, pid_path = serve._run_files(8125)
    pid_path.write_text(str(server.pid))
    assert serve.detached_pid(pid_path) == server.pid
    assert serve.run_stop(stop_args(8125)) == 0
    assert server.wait(timeout=10) == -signal.SIGTERM  # the first, polite signal was enough
    assert not pid_path.exists()
    assert f"(pid {server.pid})" in capsys.readouterr().out
