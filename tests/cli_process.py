"""A ``python -m cluster.cli ...`` child process for tests: its output is kept line by line
and scanned for the line a test waits for (``tandem serve``'s ``serving ...``, say)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port(n: int = 1) -> int:
    """A free port on 127.0.0.1 (with the next ``n - 1`` free too) for a server a test starts,
    below the kernel's ephemeral range: a port the kernel hands out (bind to 0) may be taken
    by any outgoing connection or Ray listener before the server binds it (a flake seen in CI:
    "address already in use")."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low - n)
        try:
            for p in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class CliProcess:
    # a launcher that exits before the server serves (``--detach``): keep waiting after its exit
    outlives_launcher = False

    def __init__(self, args: list[str], env: dict[str, str], *, new_session: bool = False):
        """``new_session``: in a process group of its own (``stop(group=True)`` then reaches
        what it started, a redis-server say)."""
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=new_session,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> list[str]:
        """Its lines so far."""
        return list(self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output()[-n:])

    def wait_for(self, pattern: str, timeout: float, lines=None) -> re.Match:
        """The first line (of ``lines()``, default ``output()``) matching ``pattern``; an
        AssertionError with its last lines when it exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            if exited:
                self.reader.join(5)
            for line in (lines or self.output)():
                if m := re.search(pattern, line):
                    return m
            if (exited and not self.outlives_launcher) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"no line matching {pattern!r} (exit {self.proc.poll()}):\n{self.tail()}"
        )

    def stop(self, signals=((signal.SIGTERM, 60.0),), group: bool = False) -> None:
        """Each of ``signals`` in turn, waiting its seconds for the exit, then SIGKILL (of its
        whole process group with ``group``)."""
        for sig, wait_s in (*signals, (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGKILL and group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
