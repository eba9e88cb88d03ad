"""`tandem serve --gateways N` (cluster/launch/gateways.py GatewayGroup): child gateway processes over the
one cluster.

Fast tests first: the ports, the admission share and the child's argv as pure functions, then the
group's lifecycle with fake children (a short script that speaks the child's channel: secrets
in, "serving" out): secrets through the channel and nowhere else, a restart after a SIGKILL, the
restart budget, a child that dies before it serves, SIGKILL after the grace period.

Then two real servers, started side by side (SmolLM2 fp32 on CPU, one colocated worker each):
``--gateways 2`` on two ports, and ``--gateways 2 --reuse-port`` on one. The tests that kill
processes run last (file order).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_process import CliProcess, free_port
from openai_checks import check_n_samples, check_tool_calls

from cluster.launch.gateways import (
    GatewayGroup,
    GatewayStartError,
    check_ports_free,
    gateway_ports,
    gateway_slots,
)
from cluster.launch.serve import add_serve_args, gateway_child_argv, pid_alive

ROOT = Path(__file__).resolve().parents[1]
KEY = "gateways-test-key"
MODEL = "smollm2"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


# -- pure functions -----------------------------------------------------------------------------


def test_ports_one_each_or_all_on_one():
    assert gateway_ports(8000, 1, False) == [8000]
    assert gateway_ports(8000, 3, False) == [8000, 8001, 8002]
    assert gateway_ports(8000, 3, True) == [8000, 8000, 8000]
    with pytest.raises(ValueError, match="--gateways must be 1 or more"):
        gateway_ports(8000, 0, False)
    with pytest.raises(ValueError, match="needs ports up to 65536"):
        gateway_ports(65535, 2, False)
    assert gateway_ports(65535, 2, True) == [65535, 65535]


def test_each_router_takes_its_share_of_the_slots():
    assert gateway_slots(0, [256], 1) == 0  # one gateway: as before (the worker's own)
    assert gateway_slots(0, [256, 256], 2) == 128
    assert gateway_slots(0, [256, 64], 3) == 86  # the largest, rounded up
    assert gateway_slots(0, [1], 4) == 1  # never 0
    assert gateway_slots(0, [0], 2) == 128  # not known: the router's fallback of 256
    assert gateway_slots(16, [256], 4) == 16  # explicit: per gateway, as given


def test_a_childs_argv_attaches_and_carries_no_secret(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "env-key")
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:hunter2@127.0.0.1:1/0")
    args = serve_args(
        *("--gateways", "3", "--reuse-port", "--api-key", "argv-key", "--port", "9000"),
        *("--max-concurrent", "7", "--queue-policy", "sjf", "--slots-per-worker", "4"),
        *("--served-model-name", "m", "--colocated", "2", "--engine", "max_num_seqs=8"),
    )
    argv = gateway_child_argv(
        args,
        ray_address="127.0.0.1:6379",
        namespace="tandem",
        cluster_id="abc123",
        model_name="m",
        slots_per_worker=2,
    )
    text = " ".join(argv)
    assert argv[:4] == [sys.executable, "-m", "cluster.cli", "gateway"]
    for pair in (
        "--ray-address 127.0.0.1:6379",
        "--namespace tandem",
        "--cluster-id abc123",
        "--served-model-name m",
        "--slots-per-worker 2",  # the share the parent computed, not the flag's 4
        "--max-concurrent 7",
        "--queue-policy sjf",
        "--reuse-port",
    ):
        assert pair in text, pair
    # serve's own flags are not the gateway's; the port is the group's to add; no secret
    for absent in ("--gateways", "--colocated", "--engine", "--port", "--api-key", "argv-key"):
        assert absent not in argv, absent
    assert "env-key" not in text and "hunter2" not in text
    from cluster.cli import build_parser

    parsed = build_parser().parse_args([*argv[3:], "--port", "9001"])  # `tandem gateway` takes it
    assert (parsed.port, parsed.reuse_port, parsed.cluster_id) == (9001, True, "abc123")


def test_a_port_in_use_is_refused_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_ports_free("127.0.0.1", [port])
    check_ports_free("127.0.0.1", [port])  # closed: free again


def test_detach_passes_the_gateway_flags_on():
    from cluster.launch.serve import _child_argv

    argv = _child_argv(serve_args("--gateways", "2", "--reuse-port", "--detach"))
    assert argv == ["--gateways", "2", "--reuse-port"]


# -- the group, with fake children ----------------------------------------------------------------

FAKE_CHILD = """
import argparse, json, os, signal, sys, time
from cluster.launch.gateways import CHILD_ENV, ChildChannel

mode, out = sys.argv[1], sys.argv[2]
port = sys.argv[sys.argv.index("--port") + 1]
leaked = sorted(k for k, v in os.environ.items() if "s3cr3t" in v)
args = argparse.Namespace()
child = ChildChannel.take(args)
record = {"keys": args.api_keys, "admin": args.admin_keys, "redis": args.index_url,
          "index": child.index, "leaked": leaked, "env_left": CHILD_ENV in os.environ}
with open(os.path.join(out, f"{port}-{os.getpid()}.json"), "w") as f:
    json.dump(record, f)
if mode == "early":
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child.ready()
if mode == "crash":
    time.sleep(0.2)
    sys.exit(4)
time.sleep(120)
"""

SECRETS = {
    "api_keys": ["s3cr3t-k1", "s3cr3t-k2"],
    "admin_keys": ["s3cr3t-admin"],
    "redis_url": "redis://:s3cr3t-pw@127.0.0.1:1/0",
}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A factory of GatewayGroups of fake children (stopped at the end)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    groups = []

    def make(mode: str, n: int = 2, **options) -> GatewayGroup:
        group = GatewayGroup(
            lambda port: [sys.executable, str(script), mode, str(tmp_path), "--port", str(port)],
            [9100 + i for i in range(n)],
            SECRETS,
            **options,
        )
        groups.append(group)
        group.start()
        return group

    yield make
    for group in groups:
        group.stop()


def records(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("91*.json"))]


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_children_get_the_secrets_through_their_channel_only(fake, tmp_path):
    group = fake("serve")
    assert group.wait_ready(60)
    got = records(tmp_path)
    assert [r["index"] for r in got] == [1, 2]
    for r in got:
        assert (r["keys"], r["admin"]) == (SECRETS["api_keys"], SECRETS["admin_keys"])
        assert r["redis"] == SECRETS["redis_url"]
        assert r["leaked"] == [] and not r["env_left"]
    for pid in group.pids():  # nor in the argv or the environment others can read
        assert b"s3cr3t" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"s3cr3t" not in Path(f"/proc/{pid}/environ").read_bytes()
        assert os.getsid(pid) == pid  # its own session: a terminal's Ctrl-C reaches serve alone
    pids = group.pids()
    group.stop()
    assert not any(pid_alive(p) for p in pids)


def test_a_killed_child_is_started_again(fake):
    group = fake("serve", n=1, restart_delay_s=0.1)
    assert group.wait_ready(60)
    (first,) = group.pids()
    os.kill(first, signal.SIGKILL)
    child = group.children[0]
    wait_until(lambda: child.serving and child.pid != first, 60, "a new process serving")
    assert len(child.restarts) == 1 and child.gave_up is None and pid_alive(child.pid)


def test_a_child_that_keeps_exiting_is_given_up(fake):
    group = fake("crash", n=1, restart_limit=2, restart_window_s=60, restart_delay_s=0.05)
    assert group.wait_ready(60)
    child = group.children[0]
    wait_until(lambda: child.gave_up, 60, "giving up")
    assert "exit status 4" in child.gave_up and "after 2 restarts in 60 s" in child.gave_up
    assert child.proc is None


def test_a_child_that_exits_before_it_serves_fails_the_start(fake):
    group = fake("early", n=1)
    with pytest.raises(GatewayStartError, match=r"gateway 1 \(http://127.0.0.1:9100/v1\) "):
        group.wait_ready(60)
    assert "exited (exit status 3) before it served" in group.children[0].gave_up


def test_stop_kills_a_child_that_ignores_sigterm(fake):
    group = fake("stubborn", n=1, grace_s=0.5)
    assert group.wait_ready(60)
    (pid,) = group.pids()
    t0 = time.monotonic()
    group.stop()
    assert not pid_alive(pid) and group.children[0].proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_serves_signals_reach_the_children(fake):
    group = fake("serve", n=2)
    assert group.wait_ready(60)
    pids = group.pids()
    group.signal(1)  # serve's first SIGTERM: each child gets one (and drains)
    for pid in pids:
        wait_until(lambda pid=pid: not pid_alive(pid), 10, f"pid {pid} gone")
    assert all(c.proc.wait(5) == -signal.SIGTERM for c in group.children)
    assert not group.wait_ready(1)  # stopping: no wait


# -- two real servers -----------------------------------------------------------------------------

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")


class Serve(CliProcess):
    """A `tandem serve` child and its output. In the foreground its child gateways write to its
    pipe too; with ``--detach`` ``proc`` is the launcher (it exits once the server serves) and
    the server writes to its log under ``cache`` (``TANDEM_CACHE_DIR``)."""

    def __init__(self, smollm2_dir: Path, port: int, *extra: str, cache: Path | None = None):
        self.port, self.cache = port, cache
        self.outlives_launcher = cache is not None
        self.env = {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
        if cache is not None:
            self.env["TANDEM_CACHE_DIR"] = str(cache)
        self.env["TANDEM_API_KEY"] = KEY  # the children get it through their channel
        argv = [
            *("serve", "--model", str(smollm2_dir), "--served-model-name", MODEL),
            *("--device", "cpu", "--colocated", "1", "--no-operator", "--port", str(port)),
            *("--shutdown-timeout", "2", "--engine", "kv_cache_memory_gb=0.25", *extra),
        ]
        super().__init__(argv, self.env)
        self.pid = 0  # the serving process (the launcher's child with --detach)

    def output(self) -> list[str]:
        """The server's lines so far (its log file when detached)."""
        if self.cache is None:
            return list(self.lines)
        log = self.cache / "run" / f"serve-{self.port}.log"
        return log.read_text().splitlines() if log.exists() else []

    def tail(self, n: int = 40) -> str:
        return "\n".join([*self.lines[-20:], *(self.output()[-30:] if self.cache else [])])

    def child_gateways(self) -> list[int]:
        """Pids of this server's `tandem gateway` children now (from /proc)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.pid and b"gateway" in argv and pid_alive(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    def stop(self) -> int:
        """SIGTERM (foreground) or `tandem stop` (detached); the exit status."""
        if self.cache is not None:
            if not pid_alive(self.pid):
                return 0
            argv = ["stop", "--port", str(self.port), "--timeout", "30", "--kill-after", "10"]
            return subprocess.run(
                [sys.executable, "-m", "cluster.cli", *argv], cwd=ROOT, env=self.env, timeout=90
            ).returncode
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    """Both servers, started side by side (their startup is most of this module's time): one
    gateway per port in the foreground, and all on one port, detached."""
    split = Serve(smollm2_dir, free_port(2), "--gateways", "2")
    port = free_port(1)
    while port in (split.port, split.port + 1):
        port = free_port(1)
    shared = Serve(
        smollm2_dir,
        port,
        *("--gateways", "2", "--reuse-port", "--detach"),
        cache=tmp_path_factory.mktemp("cache"),
    )
    try:
        split.wait_for(r"^serving http://", 300)
        split.pid = split.proc.pid
        shared.wait_for(r"^serving http://", 300, lines=lambda: shared.lines)
        assert shared.proc.wait(10) == 0  # the launcher returns once it serves
        shared.pid = int((shared.cache / "run" / f"serve-{shared.port}.pid").read_text())
        yield {"split": split, "shared": shared}
    finally:
        for s in (split, shared):
            s.stop()


HEADERS = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def complete(port: int, fresh: bool = True) -> str:
    headers = {**HEADERS, "Connection": "close"} if fresh else HEADERS
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json=BODY, headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def finished(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=HEADERS, timeout=30).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("tandem:request_success_total{")
    )


@pytest.mark.slow
def test_each_port_answers_with_the_same_text_and_counts_its_own(servers):
    split = servers["split"]
    a, b = split.port, split.port + 1
    line = split.wait_for(r"^gateways: (.*)", 1)[1]
    assert f"http://127.0.0.1:{a}/v1 (pid {split.proc.pid})" in line
    assert re.search(rf"http://127.0.0.1:{b}/v1 \(pid \d+\)", line)
    split.wait_for(rf"^gateway 1: serving http://127.0.0.1:{b}/v1", 1)  # the child's own line
    texts = {complete(a), complete(a), complete(b)}
    assert len(texts) == 1 and texts.pop().strip()
    assert (finished(a), finished(b)) == (2, 1)  # each process its own /metrics
    # the child has the API key (through its channel): without it, 401
    r = httpx.post(f"http://127.0.0.1:{b}/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 401


@pytest.mark.slow
def test_n_samples_through_both_gateway_processes(servers):
    """A colocated cluster: n = 2 and 3 through the parent gateway and the child's."""
    import openai

    split = servers["split"]
    for port in (split.port, split.port + 1):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        check_n_samples(client, MODEL)


@pytest.mark.slow
def test_tool_calls_through_a_child_gateway(servers):
    """Colocated, through the child gateway process (its tool settings came on its argv): a
    named tool and ``required`` streamed (tests/openai_checks.py)."""
    import openai

    port = servers["split"].port + 1
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120
    )
    check_tool_calls(client, MODEL, everything=False)


def _owners(port: int, client_ports: set[int], pids: list[int]) -> dict[int, int]:
    """client port -> the pid holding the server side of that connection to ``port``."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            local, remote = int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16)
            if local == port and remote in client_ports:
                inodes[f"socket:[{f[9]}]"] = remote
    owners = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link in inodes:
                owners[inodes[link]] = pid
    return owners


@pytest.mark.slow
def test_reuse_port_spreads_fresh_connections_over_the_processes(servers):
    shared = servers["shared"]
    port = shared.port
    line = shared.wait_for(r"^gateways: 2 processes .*pids (\d+), (\d+)", 1)
    pids = [int(p) for p in line.groups()]
    assert pids[0] == shared.pid and shared.child_gateways() == pids[1:]
    with ThreadPoolExecutor(4) as pool:  # each on a connection of its own
        texts = list(pool.map(lambda _: complete(port), range(12)))
    assert len(set(texts)) == 1
    # Who served which connection: hold 16 fresh ones open, each answered once, and look up
    # the process holding the server side of each (/proc), within uvicorn's keep-alive (5 s).
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(16)]
    try:
        for c in conns:
            c.request("GET", "/health")
            answer = c.getresponse()
            answer.read()
            assert answer.status == 200
        clients = {c.sock.getsockname()[1] for c in conns}
        owners = _owners(port, clients, pids)
    finally:
        for c in conns:
            c.close()
    assert set(owners) == clients, "a connection held by no gateway process"
    assert len(set(owners.values())) == 2, owners


@pytest.mark.slow
def test_a_killed_child_gateway_is_restarted_and_its_port_answers(servers):
    split = servers["split"]
    (child,) = split.child_gateways()
    expected = complete(split.port)
    os.kill(child, signal.SIGKILL)
    split.wait_for(
        rf"gateway 1 .*pid {child}\) exited \(killed by SIGKILL\): starting it again", 10
    )
    new = int(split.wait_for(r"gateway 1 \(.*\) serves again \(pid (\d+)\)", 120)[1])
    assert new != child and split.child_gateways() == [new]
    assert complete(split.port + 1) == expected


@pytest.mark.slow
def test_sigterm_or_tandem_stop_stops_every_child_then_the_cluster(servers):
    for s in servers.values():  # the foreground one by SIGTERM, the detached by `tandem stop`
        children = s.child_gateways()
        assert len(children) == 1
        assert s.stop() == 0, "\n".join(s.output()[-30:])
        assert not pid_alive(s.pid) and not [p for p in children if pid_alive(p)]
        s.wait_for(r"gateway 1: SIGTERM: draining", 1)  # it heard serve's signal
        assert "stopped" in s.output()[-3:]
