"""More gateway processes over one cluster: ``tandem serve --gateways N``.

The serve process's gateway is gateway 0; ``GatewayGroup`` runs gateways 1 .. N-1, each a
``tandem gateway`` process attached to the same cluster, so tokenizing, detokenizing and SSE are
not one process's GIL. They listen on ``--port`` .. ``--port``+N-1 (``gateway_ports``), or all
on ``--port`` with SO_REUSEPORT (``reuse_port_socket``: Linux spreads new connections across
them). Each router admits on its own: by default each takes 1/N of every decode worker's slots
(``gateway_slots``). A child gets its secrets over a socket pair (``ChildChannel``), never its
argv or environment; a child that exits is started again (at most ``RESTART_LIMIT`` times in
``RESTART_WINDOW_S``); serve's signals reach the children first, and the cluster stops once
they are gone. (The child's command line is cluster/launch/serve.py's ``gateway_child_argv``.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tandem.serve")


def gateway_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` with SO_REUSEPORT: every gateway process that
    opens one shares the port, and Linux spreads new connections across them by a hash of each
    connection's addresses (only processes of the same user may join: the kernel checks)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--reuse-port needs SO_REUSEPORT, which this system does not have")
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_ports_free(host: str, ports: Sequence[int]) -> None:
    """Raise ValueError naming the first of ``ports`` where something already listens (checked
    before the cluster starts; a reuse-port socket would otherwise join another server's)."""
    for port in ports:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                probe.bind(address)
            except OSError as exc:
                raise ValueError(
                    f"cannot listen on {host}:{port}: {exc.strerror} (another server there? "
                    "pick another --port)"
                ) from None


RESTART_LIMIT = 5  # restarts of one child gateway within RESTART_WINDOW_S; one more: given up
RESTART_WINDOW_S = 60.0
RESTART_DELAY_S = 1.0  # between a child's exit and its restart
CHILD_GRACE_S = 10.0  # beyond --shutdown-timeout, before a child that still runs gets SIGKILL
CHILD_ENV = "TANDEM_GATEWAY_CHILD"  # "<index>:<fd>:<serve's pid>": a child gateway's channel


def gateway_ports(port: int, gateways: int, reuse_port: bool) -> list[int]:
    """Each gateway's port, the serve process's first: ``port`` .. ``port + gateways - 1``, or
    ``port`` for all with SO_REUSEPORT."""
    if gateways < 1:
        raise ValueError(f"--gateways must be 1 or more, got {gateways}")
    ports = [port] * gateways if reuse_port else list(range(port, port + gateways))
    if ports[-1] > 65535:
        raise ValueError(
            f"--gateways {gateways} from --port {port} needs ports up to {ports[-1]} (> 65535): "
            "pick a lower --port, or --reuse-port"
        )
    return ports


def gateway_slots(slots_per_worker: int, max_num_seqs: Sequence[int], gateways: int) -> int:
    """The ``--slots-per-worker`` each of ``gateways`` routers runs with.

    Every router admits on its own over the one decode pool, so N routers that each fill a
    worker's ``max_num_seqs`` would send it N times what it runs at once (its engine queue
    takes the rest, out of the router's queue order). By default (0) each takes 1/N of the
    largest ``max_num_seqs`` of the pool, rounded up; an explicit value is per gateway as given
    (``--slots-per-worker`` = ``max_num_seqs`` lets each fill the worker: overcommit by choice).
    """
    if gateways <= 1 or slots_per_worker:
        return slots_per_worker
    full = max(max_num_seqs, default=0) or 256  # the router's own fallback (ClusterBackend)
    return -(-full // gateways)


class ChildChannel:
    """A child gateway's end of the socket pair its ``tandem serve`` made for it: the parent
    writes the secrets (JSON) and shuts its side for writing; the child reads them before Ray
    starts, and later writes ``serving`` once its port answers. Nothing secret is in the child's
    argv or environment; ``CHILD_ENV`` only names the descriptor."""

    def __init__(self, index: int, sock: socket.socket, parent: int) -> None:
        self.index, self.sock, self.parent = index, sock, parent
        self.label = f"gateway {index}: "

    @classmethod
    def take(cls, args: argparse.Namespace) -> ChildChannel | None:
        """None when this process is no child gateway; else read the secrets into ``args`` (as
        ``_api_keys`` / ``_admin_keys`` / ``_redis_url`` keep them) and the variable leaves the
        environment."""
        spec = os.environ.pop(CHILD_ENV, None)
        if not spec:
            return None
        index, fd, parent = (int(x) for x in spec.split(":"))
        sock = socket.socket(fileno=fd)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
        secrets = json.loads(data)
        args.api_keys, args.admin_keys = secrets["api_keys"], secrets["admin_keys"]
        if secrets.get("redis_url"):
            args.index_url = secrets["redis_url"]
        return cls(index, sock, parent)

    def ready(self) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: parent_gone says so
            self.sock.sendall(f"serving {os.getpid()}\n".encode())

    async def parent_gone(self, every_s: float = 1.0) -> None:
        """Return once the ``tandem serve`` that started this process is gone (killed, say:
        it could not stop its children)."""
        while os.getppid() == self.parent:
            await asyncio.sleep(every_s)
        print(f"{self.label}tandem serve (pid {self.parent}) is gone", file=sys.stderr, flush=True)


class GatewayStartError(RuntimeError):
    """A child gateway did not come up: it exited before it served, or took too long."""


@dataclass(eq=False)
class _Child:
    index: int
    port: int
    url: str
    proc: subprocess.Popen | None = None
    pid: int = 0
    served: bool = False  # it has served once: an exit from now on is restarted
    serving: bool = False  # this process of it serves now
    restarts: list[float] = field(default_factory=list)  # times, within the window
    restart_at: float | None = None  # when proc is None: start it again then
    gave_up: str | None = None  # why it is not (re)started any more
    reader: threading.Thread | None = None


class GatewayGroup:
    """The child gateways of ``tandem serve --gateways N``: gateways 1 .. N-1 (serve's own is
    gateway 0), each a ``tandem gateway`` process attached to the cluster::

        start        each child in its own session (a Ctrl-C on the terminal reaches serve
                     alone, which then stops them in order), its secrets through its
                     ChildChannel; it writes to serve's own stdout / stderr, each line it
                     prints itself marked "gateway i: "
        wait_ready   until every child wrote "serving" on its channel (its port answers);
                     GatewayStartError when one exited before that (or after ``timeout_s``)
        (watcher)    a child that exits after it served is logged and started again after
                     RESTART_DELAY_S, at most ``restart_limit`` times in ``restart_window_s``;
                     one more exit and it is given up (logged: the others keep serving)
        signal       serve's SIGTERM / SIGINT passed on: the 1st and 2nd as SIGTERM (drain,
                     then stop now), the 3rd as SIGKILL
        stop         SIGTERM to the children not yet signalled, SIGKILL to those still running
                     ``grace_s`` later; then serve stops the cluster

    ``command(port)`` is a child's argv (``gateway_child_argv`` and its ``--port``)."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        ports: Sequence[int],
        secrets: dict[str, Any],
        *,
        host: str = "127.0.0.1",
        grace_s: float = 40.0,
        restart_limit: int = RESTART_LIMIT,
        restart_window_s: float = RESTART_WINDOW_S,
        restart_delay_s: float = RESTART_DELAY_S,
    ) -> None:
        self.command = command
        self.children = [
            _Child(i, port, gateway_url(host, port)) for i, port in enumerate(ports, start=1)
        ]
        self._secrets = json.dumps(secrets).encode()  # api_keys, admin_keys, redis_url
        self.grace_s = grace_s
        self.restart_limit, self.restart_window_s = restart_limit, restart_window_s
        self.restart_delay_s = restart_delay_s
        self._lock = threading.Lock()  # spawning vs signalling
        self._stopping = threading.Event()
        self._signals = 0
        self._watcher: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            for child in self.children:
                self._spawn(child)
        self._watcher = threading.Thread(target=self._watch, name="gateway-watcher", daemon=True)
        self._watcher.start()

    def wait_ready(self, timeout_s: float = 600.0) -> bool:
        """True once every child serves; False when serve is stopping first. Raises
        GatewayStartError for a child that exited before it served, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._stopping.is_set():
            for child in self.children:
                if child.gave_up is not None and not child.served:
                    raise GatewayStartError(f"gateway {child.index} ({child.url}) {child.gave_up}")
            if all(child.served for child in self.children):
                return True
            if time.monotonic() > deadline:
                late = [c.url for c in self.children if not c.served]
                raise GatewayStartError(f"not serving after {timeout_s:.0f} s: {', '.join(late)}")
            time.sleep(0.1)
        return False

    def signal(self, count: int) -> None:
        """Serve's ``count``-th SIGTERM / SIGINT, passed on to every running child."""
        with self._lock:
            self._stopping.set()
            self._signals = count
            sig = signal.SIGKILL if count >= 3 else signal.SIGTERM
            for child in self.children:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(sig)

    def stop(self) -> None:
        """Stop every child (SIGTERM unless serve's signal went to them already, SIGKILL after
        ``grace_s``) and wait for them."""
        if self._signals == 0:
            self.signal(1)
        self._stopping.set()
        deadline = time.monotonic() + self.grace_s
        for child in self.children:
            proc = child.proc
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "gateway %d (pid %d) still runs %.0f s after SIGTERM: killing it",
                    child.index,
                    proc.pid,
                    self.grace_s,
                )
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(5)

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None]

    def banner(self, own_url: str, reuse_port: bool) -> str:
        """The banner's line of every gateway (serve's own, at ``own_url``, first)."""
        if reuse_port:
            pids = ", ".join(str(p) for p in (os.getpid(), *self.pids()))
            return (
                f"gateways: {len(self.children) + 1} processes on {own_url} (SO_REUSEPORT, pids "
                f"{pids}; a /metrics scrape reaches one of them)"
            )
        shown = [f"{own_url} (pid {os.getpid()})"]
        shown += [f"{c.url} (pid {c.pid})" for c in self.children]
        return "gateways: " + ", ".join(shown)

    # -- children -----------------------------------------------------------------------------------

    def _spawn(self, child: _Child) -> None:
        """Start ``child``'s process (under the lock)."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, CHILD_ENV: f"{child.index}:{theirs.fileno()}:{os.getpid()}"}
        try:
            proc = subprocess.Popen(
                self.command(child.port),
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        child.proc, child.pid, child.serving, child.restart_at = proc, proc.pid, False, None
        with contextlib.suppress(OSError):  # it died at once: the watcher sees it
            ours.sendall(self._secrets)
            ours.shutdown(socket.SHUT_WR)
        child.reader = threading.Thread(
            target=self._read, args=(child, proc, ours), name=f"gateway-{child.index}", daemon=True
        )
        child.reader.start()

    def _read(self, child: _Child, proc: subprocess.Popen, sock: socket.socket) -> None:
        """``child``'s channel: "serving" once its port answers; EOF when it exits."""
        with sock, sock.makefile("r") as lines:
            for line in lines:
                if line.startswith("serving") and proc is child.proc:
                    if child.served:
                        print(
                            f"gateway {child.index} ({child.url}) serves again (pid {proc.pid})",
                            file=sys.stderr,
                            flush=True,
                        )
                    child.served = child.serving = True

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                if self._stopping.is_set():
                    return
                for child in self.children:
                    self._check(child, time.monotonic())

    def _check(self, child: _Child, now: float) -> None:
        """Restart ``child`` when its time came; note its exit (under the lock)."""
        if child.gave_up is not None:
            return
        if child.proc is None:
            if child.restart_at is not None and now >= child.restart_at:
                self._spawn(child)
            return
        code = child.proc.poll()
        if code is None:
            return
        if child.reader is not None:
            child.reader.join(1.0)  # a "serving" just before the exit is read first
        why = _exit_status(code)
        if not child.served:
            child.gave_up = f"exited ({why}) before it served"
            logger.warning("gateway %d (%s) %s", child.index, child.url, child.gave_up)
            return
        child.restarts = [t for t in child.restarts if now - t < self.restart_window_s]
        if len(child.restarts) >= self.restart_limit:
            child.gave_up = (
                f"exited ({why}) after {len(child.restarts)} restarts in "
                f"{self.restart_window_s:.0f} s"
            )
            logger.warning(
                "gateway %d (%s) %s: giving up on it; the other gateways keep serving",
                child.index,
                child.url,
                child.gave_up,
            )
            child.proc = None
            return
        child.restarts.append(now)
        child.proc, child.serving, child.restart_at = None, False, now + self.restart_delay_s
        logger.warning(
            "gateway %d (%s, pid %d) exited (%s): starting it again (restart %d of at most %d "
            "in %.0f s)",
            child.index,
            child.url,
            child.pid,
            why,
            len(child.restarts),
            self.restart_limit,
            self.restart_window_s,
        )


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"
